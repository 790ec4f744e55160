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
    for i in 0..16 {
        // Each its own owner, so each is queued in the store rather than in the process.
        let lock = lock.clone().with_owner(format!("waiter-{i}"));
        waiters.push(tokio::spawn(async move {
            lock.lock().await.unwrap().release().await.unwrap()
        }));
    }
    eventually("16 waiters queued in the store", || async {
        locks
            .store()
            .describe(&"k".try_into().unwrap())
            .await
            .unwrap()
            .waiters
            .len()
            == 16
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

/// Tasks of one process wait for a fair lock in the process, behind the one of them that
/// the store queues; one handed the lock over still keeps the place its arrival gives it
/// among other processes' waiters: the order is the order of arrival.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_waiters_of_one_process_keep_their_arrival_order_among_others() {
    let server = RedisServer::start();
    let (here, elsewhere) = (locks(&server).await, locks(&server).await);
    let lock = |locks: &Leasehold| locks.mutex("k").unwrap().with_fair(true);
    let holder = lock(&here).try_lock().await.unwrap().unwrap();
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for (i, (who, locks)) in [
        ("here-1", &here),
        ("elsewhere", &elsewhere),
        ("here-2", &here),
    ]
    .into_iter()
    .enumerate()
    {
        let (lock, order) = (lock(locks), order.clone());
        waiters.push(tokio::spawn(async move {
            let guard = lock.lock().await.unwrap();
            order.lock().unwrap().push(who);
            guard.release().await.unwrap();
        }));
        eventually("the waiter to arrive", || async {
            here.describe("k").await.unwrap().waiters.len() == i + 1
        })
        .await;
        // Arrival is measured in milliseconds, on the server's clock for the store's
        // queue and on this process's for its own: keep the arrivals apart by more than
        // that precision and the time a request takes to reach the server.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let queued = here
        .store()
        .describe(&"k".try_into().unwrap())
        .await
        .unwrap();
    assert_eq!(
        queued.waiters.len(),
        1,
        "only one of this process's tasks is in the store's queue"
    );
    holder.release().await.unwrap();
    leasehold::conformance::join_all("every waiter", waiters).await;
    assert_eq!(*order.lock().unwrap(), ["here-1", "elsewhere", "here-2"]);
}
