//! Waiting: fair order, hand-overs, and waits that end (cancelled, timed out) leaving
//! no place behind.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;

use super::{fair_lock, granted, queued, waiting_owners};
use crate::conformance::{eventually, join_all, unique, within, PROMPT};
use crate::store::Store;
use crate::Leasehold;

/// Fair mode serves waiters in arrival order.
pub async fn fifo_when_fair(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("fifo");
    let lock = locks.mutex(name.as_str()).unwrap().with_fair(true);
    let holder = lock.try_lock().await.unwrap().unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut handles = Vec::new();
    for i in 0..5 {
        let (lock, order) = (lock.clone(), order.clone());
        handles.push(tokio::spawn(async move {
            let g = lock.lock().await.unwrap();
            order.lock().unwrap().push(i);
            let _ = g.release().await.unwrap();
        }));
        queued("the waiter to queue", &locks, &name, i + 1).await;
    }
    let _ = holder.release().await.unwrap();
    join_all("every waiter", handles).await;
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
}

/// A lock handed to a queued waiter (by stores that hand over inside the release, on the
/// waiter's short lease) is renewed to its full TTL at once, not a third of the way into
/// the short lease: code that stops work when the lease left runs low must not see a
/// hand-over as a lock about to be lost.
pub async fn hand_over_renews_to_the_full_ttl(store: Arc<dyn Store>) {
    // Two clients, as two processes: tasks of one client hand over in the client.
    let (locks, other) = (
        Leasehold::from_store(store.clone()),
        Leasehold::from_store(store),
    );
    let name = unique("handover");
    let ttl = Duration::from_secs(60);
    let fair = |locks: &Leasehold| {
        let lock = locks.mutex(name.as_str()).unwrap();
        lock.with_fair(true).with_ttl(ttl)
    };
    let holder = fair(&other).try_lock().await.unwrap().unwrap();
    let waiting = tokio::spawn({
        let lock = fair(&locks);
        async move { lock.lock().await.unwrap() }
    });
    queued("the waiter to queue", &locks, &name, 1).await;
    let _ = holder.release().await.unwrap();
    let guard = within("the hand-over", waiting).await.unwrap();
    let granted = Instant::now();
    // More than a waiter lease (at most 5 s) ahead: renewed to the TTL asked for.
    eventually("a renewal to the full TTL", || async {
        guard.valid_until() > Instant::now() + ttl / 2
    })
    .await;
    // When that renewal was sent (its safe deadline counts from then): at once, not a
    // third of the way into the short lease (about 1.7 s in).
    let sent = guard.valid_until() - (crate::keepalive::safe_deadline(granted, ttl) - granted);
    assert!(
        sent < granted + Duration::from_secs(1),
        "the first renewal was sent {:?} after the hand-over",
        sent.saturating_duration_since(granted)
    );
    assert!(!guard.renewal_failing());
    let _ = guard.release().await.unwrap();
}

/// A task of one process that stops waiting just as the task before it hands it the lock
/// (its future dropped, or its deadline passing, after the hand-over was sent) does not
/// take the lock or its process's turn with it: the next task gets the lock.
pub async fn hand_over_to_a_dropped_waiter_is_not_lost(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("dropped-hand-over");
    // Non-fair: tasks of one process wait in the process on every store.
    let lock = locks.mutex(name.as_str()).unwrap().with_fair(false);
    let holder = lock.try_lock().await.unwrap().unwrap();
    let mut waiter = Box::pin(lock.lock());
    assert!((&mut waiter).now_or_never().is_none(), "the lock is held");
    queued("the waiter to queue", &locks, &name, 1).await;
    // Handed to the waiter, which is never polled again.
    let _ = holder.release().await.unwrap();
    drop(waiter);
    let next = within("the next task to get the lock", lock.lock()).await;
    let _ = next.unwrap().release().await.unwrap();
}

/// A cancelled wait leaves the queue, so it does not block anyone.
pub async fn cancelled_wait_leaves_no_trace(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("cancel");
    let lock = locks.mutex(name.as_str()).unwrap().with_fair(true);
    let holder = lock.try_lock().await.unwrap().unwrap();
    let waiter = tokio::spawn({
        let lock = lock.clone();
        async move { lock.lock().await }
    });
    queued("the waiter to queue", &locks, &name, 1).await;
    waiter.abort();
    eventually("the cancelled waiter to leave the queue", || async {
        locks
            .describe(name.as_str())
            .await
            .unwrap()
            .waiters
            .is_empty()
    })
    .await;
    let _ = holder.release().await.unwrap();
    let g = granted(&lock, "fair lock free after a cancelled waiter").await;
    let _ = g.release().await.unwrap();
}

/// A bounded wait that runs out has left the queue when it returns: the next waiter is
/// served at the release, not a waiter lease later.
pub async fn timed_out_wait_leaves_the_queue(store: Arc<dyn Store>) {
    let name = unique("timed-out");
    let (holding, first, second) = (
        Leasehold::from_store(store.clone()),
        Leasehold::from_store(store.clone()),
        Leasehold::from_store(store),
    );
    let holder = fair_lock(&holding, &name, "holder")
        .try_lock()
        .await
        .unwrap();
    let holder = holder.expect("a free lock is granted");
    let w1 = tokio::spawn({
        let lock = fair_lock(&first, &name, "w1");
        async move { lock.try_lock_for(Duration::from_secs(2)).await }
    });
    eventually("w1 to queue", || async {
        waiting_owners(&holding, &name).await.contains(&"w1".into())
    })
    .await;
    let w2 = tokio::spawn({
        let lock = fair_lock(&second, &name, "w2");
        async move { lock.lock().await }
    });
    eventually("w2 to queue", || async {
        waiting_owners(&holding, &name).await.contains(&"w2".into())
    })
    .await;
    let gave_up = within("w1 to give up", w1).await.unwrap().unwrap();
    assert!(gave_up.is_none(), "w1 got a held lock");
    let left = waiting_owners(&holding, &name).await;
    assert!(!left.contains(&"w1".into()), "w1 still queued: {left:?}");
    let _ = holder.release().await.unwrap();
    let next = tokio::time::timeout(PROMPT, w2).await;
    let next = next.expect("w2 is served promptly at the release");
    let _ = next.unwrap().unwrap().release().await.unwrap();
}
