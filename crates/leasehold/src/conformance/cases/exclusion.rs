//! A mutex's basic promises: one holder at a time, tries and bounded waits, tokens and
//! re-entry, and bad input refused.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{busy, granted};
use crate::conformance::{join_all, unique, within};
use crate::store::{Released, Store};
use crate::{Error, Leasehold};

/// Tasks incrementing a counter with a read, a yield and a write under the lock: any
/// overlap of holders loses an update or is seen directly. Half the tasks share one
/// [`Leasehold`] (they queue in-process first), the others each have their own (they
/// meet only in the store), as tasks of several processes would.
pub async fn mutual_exclusion(store: Arc<dyn Store>) {
    let shared = Leasehold::from_store(store.clone());
    let name = unique("mutex");
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let last_token = Arc::new(AtomicU64::new(0));
    let (tasks, rounds) = (8, 40);
    let mut handles = Vec::new();
    for task in 0..tasks {
        let locks = if task % 2 == 0 {
            shared.clone()
        } else {
            Leasehold::from_store(store.clone())
        };
        let lock = locks.mutex(name.as_str()).unwrap();
        let (counter, inside, last_token) = (counter.clone(), inside.clone(), last_token.clone());
        handles.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let guard = lock.lock().await.unwrap();
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                let token = guard.check().unwrap().get();
                let before = last_token.swap(token, Ordering::SeqCst);
                assert!(token > before, "token {token} after {before}");
                let seen = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(seen + 1, Ordering::SeqCst);
                inside.fetch_sub(1, Ordering::SeqCst);
                let _ = guard.release().await.unwrap();
            }
        }));
    }
    join_all("all tasks to finish", handles).await;
    assert_eq!(
        counter.load(Ordering::SeqCst),
        tasks * rounds,
        "lost updates"
    );
}

/// A dropped guard releases in the background, so a waiter gets the lock long before
/// the lease would end.
pub async fn drop_releases(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let lock = locks
        .mutex(unique("drop"))
        .unwrap()
        .with_ttl(Duration::from_secs(3600));
    let held = lock.try_lock().await.unwrap().unwrap();
    let waiter = tokio::spawn({
        let lock = lock.clone();
        async move { lock.lock().await.unwrap() }
    });
    drop(held);
    let next = within("the waiter after a dropped guard", waiter)
        .await
        .unwrap();
    let _ = next.release().await.unwrap();
}

/// `try_lock` never waits; bounded waits give up and leave no trace in the queue.
pub async fn try_and_bounded_waits(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("try");
    let lock = locks.mutex(name.as_str()).unwrap();
    let held = granted(&lock, "a free lock is granted").await;
    busy(&lock, "try_lock on a held lock").await;
    let started = Instant::now();
    assert!(lock
        .try_lock_for(Duration::from_millis(150))
        .await
        .unwrap()
        .is_none());
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "gave up before its deadline"
    );
    let deadline = std::time::Instant::now() + Duration::from_millis(50);
    assert!(lock.try_lock_until(deadline).await.unwrap().is_none());
    // A deadline long past asks once, as try_lock does (it failed as "no answer").
    let past = std::time::Instant::now() - Duration::from_secs(60);
    assert!(lock.try_lock_until(past).await.unwrap().is_none());
    let state = locks.describe(name.as_str()).await.unwrap();
    assert!(
        state.waiters.is_empty(),
        "a waiter that gave up is still queued: {state:?}"
    );
    let _ = held.release().await.unwrap();
    let again = within(
        "a bounded wait on a free lock",
        lock.try_lock_for(Duration::from_secs(5)),
    )
    .await
    .unwrap();
    let _ = again
        .expect("free lock within a bounded wait")
        .release()
        .await
        .unwrap();
    let past = std::time::Instant::now() - Duration::from_secs(60);
    let _ = (lock.try_lock_until(past).await.unwrap())
        .expect("a free lock, asked for with a deadline long past")
        .release()
        .await
        .unwrap();
}

/// Tokens strictly increase across holders; re-entry keeps the token and counts holds;
/// the lock frees when the last hold is released.
pub async fn tokens_and_reentry(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("tokens");
    let mut last = 0;
    for _ in 0..5 {
        let g = granted(&locks.mutex(name.as_str()).unwrap(), "a free lock").await;
        assert!(g.token().get() > last, "token did not increase");
        last = g.token().get();
        let _ = g.release().await.unwrap();
    }
    let mine = locks.mutex(name.as_str()).unwrap().with_owner("worker-7");
    let first = mine.try_lock().await.unwrap().unwrap();
    let second = mine.try_lock().await.unwrap().expect("the owner re-enters");
    assert_eq!(first.token(), second.token(), "re-entry changed the token");
    assert!(first.token().get() > last);
    assert_eq!((first.holds(), second.holds()), (1, 2));
    let state = locks.describe(name.as_str()).await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].holds, 2);
    let stranger = locks.mutex(name.as_str()).unwrap();
    let held_token = second.token();
    assert_eq!(second.release().await.unwrap(), Released::Released);
    busy(&stranger, "freed with a hold left").await;
    assert_eq!(first.release().await.unwrap(), Released::Released);
    let g = granted(&stranger, "free after the last hold").await;
    assert!(g.token() > held_token);
    let _ = g.release().await.unwrap();
}

/// Bad input is rejected before anything reaches the store, with the rule in the message.
pub async fn bad_input_rejected(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let msg = |e: Error| e.to_string();
    assert!(msg(locks.mutex("").unwrap_err()).contains("empty"));
    assert!(msg(locks.mutex("x".repeat(300)).unwrap_err()).contains("300 bytes"));
    assert!(msg(locks.mutex("a\tb").unwrap_err()).contains("control character"));
    assert!(msg(locks.semaphore("ok", 0).unwrap_err()).contains("permits"));
    let name = unique("bad");
    let lock = locks.mutex(name.as_str()).unwrap();
    let invalid = |e: Error, what: &str| match e {
        Error::InvalidOption { option, .. } if option == what => {}
        e => panic!("{e}"),
    };
    let zero = lock.clone().with_ttl(Duration::ZERO);
    invalid(zero.try_lock().await.unwrap_err(), "ttl");
    let century = lock
        .clone()
        .with_ttl(Duration::from_secs(100 * 365 * 86400));
    invalid(century.lock().await.unwrap_err(), "ttl");
    let nobody = lock.clone().with_owner("");
    invalid(nobody.try_lock().await.unwrap_err(), "owner");
    let state = locks.describe(name.as_str()).await.unwrap();
    assert!(state.holders.is_empty() && state.waiters.is_empty() && state.last_token.get() == 0);
}
