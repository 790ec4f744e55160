//! Leases: expiry, renewal, the lost signal, releases that must reach the store, and
//! force-release.

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;

use super::{busy, granted, queued};
use crate::conformance::{eventually, unique, within, Partition, PATIENCE, SHORT_TTL};
use crate::store::{Released, Renewal, Store};
use crate::{Error, Leasehold};

/// A holder that stops renewing (its process died) loses the lock at its lease's end
/// and the next holder gets a higher token.
pub async fn expiry_after_holder_dies(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let lock = locks.mutex(unique("expiry")).unwrap().with_ttl(SHORT_TTL);
    let dead = lock.try_lock().await.unwrap().unwrap();
    let dead_token = dead.token();
    let _abandoned = dead.leak();
    busy(&lock, "the lease must outlive the holder").await;
    let next = within("the abandoned lease to expire", lock.lock())
        .await
        .unwrap();
    assert!(next.token() > dead_token);
    let _ = next.release().await.unwrap();
}

/// Renewal keeps a lock held across several TTLs.
pub async fn renewal_keeps_lock(store: Arc<dyn Store>) {
    // Each renewal has two thirds of the TTL to land before the safe deadline: with 1s
    // that holds while two loaded cores run every test binary (with 300ms, an etcd
    // renewal once missed it there).
    let ttl = Duration::from_secs(1);
    let locks = Leasehold::from_store(store);
    let lock = locks.mutex(unique("renewal")).unwrap().with_ttl(ttl);
    let guard = lock.try_lock().await.unwrap().unwrap();
    let until = Instant::now() + ttl * 4;
    // Time passing is the point of this case: sample until four TTLs are over.
    while Instant::now() < until {
        assert!(
            guard.check().is_ok(),
            "lost while renewals work: {:?}",
            guard.check()
        );
        busy(&lock, "someone else got a renewed lock").await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(guard.release().await.unwrap(), Released::Released);
}

/// With renewals failing, `lost()` fires — and `check()` fails — before another holder
/// can acquire the lock; releasing the lost lease reports it was not held.
pub async fn lost_fires_before_takeover(store: Arc<dyn Store>) {
    let partitioned = Partition::new(store.clone());
    let name = unique("lost");
    let cut_off = Leasehold::from_store(partitioned.clone());
    let other = Leasehold::from_store(store);
    let guard = cut_off
        .mutex(name.as_str())
        .unwrap()
        .with_ttl(SHORT_TTL)
        .lock()
        .await
        .unwrap();
    partitioned.cut_renewals();
    let next = within(
        "the next holder",
        other.mutex(name.as_str()).unwrap().lock(),
    )
    .await
    .unwrap();
    assert!(
        guard.is_lost(),
        "another holder got the lock before the loss was known"
    );
    assert!(matches!(guard.check(), Err(Error::Lost { .. })));
    assert!(
        guard.lost().now_or_never().is_some(),
        "lost() had not fired"
    );
    assert!(guard.valid_until() <= Instant::now());
    assert!(next.token() > guard.token());
    assert_eq!(guard.release().await.unwrap(), Released::NotHeld);
    let _ = next.release().await.unwrap();
}

/// A release the store did not get (the link was down) is sent again once the store can
/// be reached: the lock frees long before its lease could end, and the owner's next
/// acquisition is a new one (a newer token), not a re-entry into the hold left behind.
pub async fn missed_release_is_sent_again(store: Arc<dyn Store>) {
    let partition = Partition::new(store.clone());
    let name = unique("missed-release");
    let owner = format!("owner-{name}");
    let lock = (Leasehold::from_store(partition.clone()).mutex(name.as_str()))
        .unwrap()
        .with_owner(owner.as_str())
        // Far longer than PATIENCE: only the release can free the lock in time.
        .with_ttl(PATIENCE * 10);
    let guard = lock.try_lock().await.unwrap().unwrap();
    let token = guard.token();
    partition.cut_releases();
    let failed = guard.release().await.unwrap_err();
    assert!(failed.is_retryable(), "{failed}");
    partition.heal();
    let other = Leasehold::from_store(store);
    let next = within(
        "another owner to get the lock",
        other.mutex(name.as_str()).unwrap().lock(),
    )
    .await
    .unwrap();
    let taken = next.token();
    assert!(taken > token);
    let _ = next.release().await.unwrap();
    let again = lock.try_lock().await.unwrap().unwrap();
    assert!(again.token() > taken, "re-entered a hold left behind");
    assert_eq!(again.holds(), 1);

    // A cancelled wait whose undo the store did not get leaves the queue once the store
    // is back, not when its place's lease (up to the TTL) ends.
    let waiter = tokio::spawn({
        let lock = lock.clone().with_owner("waiter").with_fair(true);
        async move { lock.lock().await }
    });
    queued("the waiter to queue", &other, &name, 1).await;
    partition.cut_releases();
    let refused = partition.refused_releases();
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    eventually("the cancelled wait's undo to be refused", || async {
        partition.refused_releases() > refused
    })
    .await;
    partition.heal();
    let _ = again.release().await.unwrap();
    let last = within(
        "the lock past the cancelled waiter's place",
        other.mutex(name.as_str()).unwrap().with_fair(true).lock(),
    )
    .await
    .unwrap();
    let _ = last.release().await.unwrap();
}

/// A guard renews again once its store is back from `restart` (a restart well within the
/// guard's `ttl`), and nobody else takes the lock meanwhile. For store tests that can
/// restart their server; not in [`conformance_suite!`](crate::conformance_suite).
pub async fn renews_again_after_a_restart(
    locks: &Leasehold,
    ttl: Duration,
    restart: impl FnOnce(),
) {
    let name = unique("restart");
    let lock = locks.mutex(name.as_str()).unwrap();
    let guard = lock.clone().with_ttl(ttl).lock().await.unwrap();
    tokio::task::block_in_place(restart);
    let restarted = Instant::now();
    // Only a renewal sent after the restart can move the deadline this far.
    eventually("a renewal after the restart", || async {
        guard.valid_until() > restarted + ttl / 2
    })
    .await;
    assert!(guard.check().is_ok());
    assert!(lock.try_lock().await.unwrap().is_none(), "taken meanwhile");
    let _ = guard.release().await.unwrap();
}

/// Releasing twice is harmless, and a release never touches another holder's lease.
pub async fn release_is_idempotent(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store.clone());
    let lock = locks.mutex(unique("release")).unwrap();
    let lease = lock.try_lock().await.unwrap().unwrap().leak();
    assert_eq!(store.release(&lease).await.unwrap(), Released::Released);
    assert_eq!(store.release(&lease).await.unwrap(), Released::NotHeld);
    let next = lock.try_lock().await.unwrap().unwrap();
    assert_eq!(store.release(&lease).await.unwrap(), Released::NotHeld);
    busy(&lock, "an old lease released the new holder").await;
    assert_eq!(store.renew(&lease, SHORT_TTL).await.unwrap(), Renewal::Lost);
    let _ = next.release().await.unwrap();
}

/// Force-release frees the lock; the holder's guard reports the loss at once (not at
/// its next renewal); its release says it was not held.
pub async fn force_release_is_seen_as_lost(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("force");
    let lock = locks
        .mutex(name.as_str())
        .unwrap()
        .with_ttl(Duration::from_secs(3600))
        .with_owner("victim");
    let guard = lock.try_lock().await.unwrap().unwrap();
    let state = locks.describe(name.as_str()).await.unwrap();
    let holder = &state.holders[0];
    assert_eq!(holder.owner, "victim");
    assert_eq!(holder.pid, std::process::id());
    assert_eq!(holder.token, guard.token());
    assert!(holder.lease_left > Duration::ZERO && holder.lease_left <= Duration::from_secs(3600));
    let listed = locks.list("conformance/force/").await.unwrap();
    assert!(
        listed.iter().any(|s| s.name == name),
        "list misses a held lock"
    );
    // A task of its own watches through a signal, and work runs while the lock is held.
    let signal = guard.lost_signal();
    let watcher = tokio::spawn({
        let signal = signal.clone();
        async move { signal.lost().await }
    });
    let work = guard.run_while_held(std::future::pending::<()>());
    // With a one-hour lease no renewal comes within the test: the store must say it.
    let (released, (), stopped) = within("the guard to see the loss", async {
        tokio::join!(locks.force_release(name.as_str()), guard.lost(), work)
    })
    .await;
    assert!(released.unwrap());
    assert!(matches!(stopped, Err(Error::Lost { .. })), "{stopped:?}");
    within("the signal in another task", watcher).await.unwrap();
    assert!(signal.is_lost());
    assert!(
        !locks.force_release(name.as_str()).await.unwrap(),
        "nothing left to release"
    );
    assert!(guard.check().is_err());
    within("lost() to resolve again once lost", guard.lost()).await;
    // Work given to a lost guard is never started (asked a few times: work ready at its
    // first poll must not win a coin toss against the loss).
    for _ in 0..8 {
        let started = std::sync::atomic::AtomicBool::new(false);
        let late = guard
            .run_while_held(async { started.store(true, std::sync::atomic::Ordering::SeqCst) })
            .await;
        assert!(matches!(late, Err(Error::Lost { .. })), "{late:?}");
        assert!(!started.into_inner(), "work ran on a lost guard");
    }
    let next = granted(
        &locks.mutex(name.as_str()).unwrap(),
        "free after force-release",
    )
    .await;
    assert!(next.token() > guard.token());
    assert_eq!(guard.release().await.unwrap(), Released::NotHeld);
    let _ = next.release().await.unwrap();
}

/// A holder of its process's turn (tasks of an ownerless mutex queue in their process
/// first) that is force-released passes the turn on as soon as it knows: the task waiting
/// behind it gets the lock while the lost guard is still alive.
pub async fn force_released_holder_lets_its_process_in(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("force-turn");
    let lock = || {
        let lock = locks.mutex(name.as_str()).unwrap();
        lock.with_ttl(Duration::from_secs(3600))
    };
    let guard = granted(&lock(), "a free lock").await;
    let waiter = tokio::spawn({
        let lock = lock();
        async move { lock.lock().await.unwrap() }
    });
    queued("a task waiting behind the holder", &locks, &name, 1).await;
    assert!(locks.force_release(name.as_str()).await.unwrap());
    // With a one-hour lease no renewal comes within the test: the store must say it.
    within("the guard to see the loss", guard.lost()).await;
    let next = within("the waiting task, while the lost guard lives", waiter)
        .await
        .unwrap();
    assert!(next.token() > guard.token());
    drop(guard);
    let _ = next.release().await.unwrap();
}
