//! What only the Redis store promises, against a real redis-server: renewal across a
//! server restart, `lost` when the server stays away, wake-ups through one subscription.
#![cfg(feature = "redis")]

use std::time::Duration;

use leasehold::conformance::{eventually, renews_again_after_a_restart, within};
use leasehold::{Leasehold, RedisStore};
use leasehold_testkit::RedisServer;
use tokio::time::Instant;

async fn locks(server: &RedisServer) -> Leasehold {
    Leasehold::new(RedisStore::connect(&server.url()).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_renews_again_after_a_server_restart_within_its_deadline() {
    let mut server = RedisServer::start_persistent();
    let locks = locks(&server).await;
    renews_again_after_a_restart(&locks, Duration::from_secs(3), || server.restart()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_fires_lost_when_the_server_stays_away_past_its_deadline() {
    let server = RedisServer::start();
    let holder = locks(&server).await;
    let guard = holder
        .mutex("k")
        .unwrap()
        .with_ttl(Duration::from_millis(600))
        .lock()
        .await
        .unwrap();
    server.pause();
    within("lost while the server is paused", guard.lost()).await;
    assert!(guard.check().is_err());
    server.resume();
    let other = locks(&server).await;
    let next = within("the next holder", other.mutex("k").unwrap().lock())
        .await
        .unwrap();
    assert!(next.token() > guard.token());
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_waiters_of_one_client_share_its_single_subscription() {
    let server = RedisServer::start();
    let locks = locks(&server).await;
    let lock = locks.mutex("k").unwrap().with_fair(true);
    let holder = lock.try_lock().await.unwrap().unwrap();
    let mut waiters = Vec::new();
    for _ in 0..16 {
        let lock = lock.clone();
        waiters.push(tokio::spawn(async move {
            lock.lock().await.unwrap().release().await.unwrap()
        }));
    }
    eventually("16 queued waiters", || async {
        locks.describe("k").await.unwrap().waiters.len() == 16
    })
    .await;
    let clients = server.cli(&["CLIENT", "LIST"]);
    let subscribers = clients.lines().filter(|l| l.contains("sub=1")).count();
    assert_eq!(
        subscribers, 1,
        "one subscription connection per client:\n{clients}"
    );
    holder.release().await.unwrap();
    leasehold::conformance::join_all("every waiter", waiters).await;
}

/// A grant that reaches the client after its safe deadline (the server was stopped with
/// the request in its socket, longer than the TTL) is confirmed by a renewal before it is
/// returned, instead of being handed out already lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_arrives_after_its_deadline_is_confirmed_before_it_is_returned() {
    let server = RedisServer::start();
    let locks = locks(&server).await;
    let ttl = Duration::from_millis(300);
    let lock = locks.mutex("late").unwrap().with_ttl(ttl);
    // Scripts loaded and connections up, so the next attempt is one request.
    lock.try_lock()
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    server.pause();
    let attempt = tokio::spawn(async move { lock.try_lock().await });
    eventually(
        "the request to wait in the stopped server's socket",
        || async { leasehold_testkit::unread_bytes(server.port()) > 0 },
    )
    .await;
    // The fault itself: the server stays stopped for twice the TTL.
    tokio::time::sleep(ttl * 2).await;
    server.resume();
    let guard = within("the late grant", attempt)
        .await
        .unwrap()
        .unwrap()
        .expect("nobody else wanted the lock");
    assert!(guard.check().is_ok(), "returned already lost");
    assert!(guard.valid_until() > Instant::now());
    guard.release().await.unwrap();
}
