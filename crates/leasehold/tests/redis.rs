//! What only the Redis store promises, against a real redis-server: renewal across a
//! server restart, `lost` when the server stays away, wake-ups through one subscription.
#![cfg(feature = "redis")]

use std::time::Duration;

use leasehold::conformance::{eventually, within};
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
    let ttl = Duration::from_secs(3);
    let guard = locks
        .mutex("k")
        .unwrap()
        .with_ttl(ttl)
        .lock()
        .await
        .unwrap();
    server.restart();
    let restarted = Instant::now();
    // Only a renewal sent after the restart can move the deadline this far.
    eventually("a renewal after the restart", || async {
        guard.valid_until() > restarted + ttl / 2
    })
    .await;
    assert!(guard.check().is_ok());
    assert!(locks
        .mutex("k")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .is_none());
    guard.release().await.unwrap();
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
