//! Several permits at once, the free permits, and a write hold downgraded to a read hold.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::{busy, queued, LONG_TTL};
use crate::conformance::{unique, within, PATIENCE};
use crate::store::{LockKind, Store};
use crate::{Error, Leasehold};

/// `lock_many` takes `n` permits with tokens of their own; `free_permits` counts what is
/// left; two acquirers of several permits that together need more than there are do not
/// each hold part and wait for ever; bad counts are refused.
pub async fn semaphore_many_permits(store: Arc<dyn Store>) {
    let name = unique("many");
    let (a, b) = (
        Leasehold::from_store(store.clone()),
        Leasehold::from_store(store.clone()),
    );
    let sem = |c: &Leasehold| c.semaphore(name.as_str(), 4).unwrap().with_ttl(LONG_TTL);
    assert_eq!(sem(&a).free_permits().await.unwrap(), 4);
    let three = sem(&a).lock_many(3).await.unwrap();
    assert_eq!(three.len(), 3);
    let mut tokens: Vec<_> = three.iter().map(|g| g.token()).collect();
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "each permit has its own token");
    assert_eq!(sem(&b).free_permits().await.unwrap(), 1);
    // b needs 3 while a holds 3 of 4: it takes the free one and waits for two more.
    let waiting = tokio::spawn({
        let sem = sem(&b);
        async move { sem.lock_many(3).await.unwrap() }
    });
    queued("b waiting for more permits", &b, &name, 1).await;
    assert!(
        sem(&a)
            .try_lock_many_for(2, Duration::from_millis(50))
            .await
            .unwrap()
            .is_none(),
        "a second acquirer of several permits got in while the first waited"
    );
    for guard in three {
        let _ = guard.release().await.unwrap();
    }
    let theirs = within("b to get three permits", waiting).await.unwrap();
    assert_eq!(theirs.len(), 3);
    assert_eq!(sem(&a).free_permits().await.unwrap(), 1);
    for guard in theirs {
        let _ = guard.release().await.unwrap();
    }
    for bad in [0, 5] {
        let refused = sem(&a).lock_many(bad).await.unwrap_err();
        assert!(
            matches!(refused, Error::InvalidOption { .. }),
            "{bad}: {refused}"
        );
    }
    // A name as long as names go still has a turn of its own.
    let long = format!("{name}{}", "x".repeat(crate::MAX_NAME_LEN - name.len()));
    let sem_long = a.semaphore(long.as_str(), 2).unwrap().with_ttl(LONG_TTL);
    let mut both = sem_long.lock_many(2).await.unwrap();
    // Giving up part-way gives back what it took before it says so.
    let none = sem_long
        .try_lock_many_for(1, Duration::from_millis(50))
        .await
        .unwrap();
    assert!(none.is_none());
    let _ = both.remove(0).release().await.unwrap();
    let given_up = sem_long
        .try_lock_many_for(2, Duration::from_millis(50))
        .await
        .unwrap();
    assert!(given_up.is_none(), "two permits while one was held");
    assert_eq!(
        sem_long.free_permits().await.unwrap(),
        1,
        "a permit kept after giving up"
    );
    let _ = both.remove(0).release().await.unwrap();
    // A wait too long to count is no limit (not a panic).
    let fresh = a
        .semaphore(unique("many-max"), 2)
        .unwrap()
        .with_ttl(LONG_TTL);
    let again = fresh.try_lock_many_for(2, Duration::MAX).await.unwrap();
    assert_eq!(again.map(|g| g.len()), Some(2));
    let mutex = a.mutex(unique("many-mutex")).unwrap();
    assert!(matches!(
        mutex.free_permits().await,
        Err(Error::InvalidOption { .. })
    ));
}

/// A downgraded write hold keeps its token and lease and lets the readers queued before
/// any writer in (woken by the store: every lease here outlives the case), while writers,
/// and readers behind a waiting writer, wait until it is released; in fair and non-fair
/// mode, with the waiting writer in another client or in the holder's. Downgrading a read hold, a permit, or one of several holds of an owner is
/// refused and leaves the guard as it was; a hold that was taken away is lost.
pub async fn downgrade_lets_readers_in(store: Arc<dyn Store>) {
    let client = || Leasehold::from_store(store.clone());
    // The writer waiting behind the downgraded hold is of another client, or of the
    // holder's (waiting in its process first, where the store cannot see it).
    for (fair, same_client) in [(false, false), (true, false), (false, true), (true, true)] {
        let name = unique(if fair { "downgrade-fair" } else { "downgrade" });
        let (a, b, c, d) = (client(), client(), client(), client());
        let lock = |c: &Leasehold, write: bool| {
            let lock = match write {
                true => c.write(name.as_str()),
                false => c.read(name.as_str()),
            };
            lock.unwrap().with_ttl(LONG_TTL).with_fair(fair)
        };
        let mut writer = lock(&a, true).lock().await.unwrap();
        let token = writer.token();
        let reader = tokio::spawn({
            let lock = lock(&b, false);
            async move { lock.lock().await.unwrap() }
        });
        queued("a reader waiting for the writer", &a, &name, 1).await;
        let next_writer = tokio::spawn({
            let lock = lock(if same_client { &a } else { &c }, true);
            async move { lock.lock().await.unwrap() }
        });
        queued("a writer waiting behind the reader", &a, &name, 2).await;
        writer.downgrade().await.unwrap();
        assert_eq!(writer.kind(), LockKind::Shared);
        assert_eq!(writer.token(), token, "a downgrade keeps the token");
        writer.check().unwrap();
        let read = within(
            &format!("the reader let in by the downgrade (fair {fair}, same client {same_client})"),
            reader,
        )
        .await
        .unwrap();
        let holders = a.describe(name.as_str()).await.unwrap().holders;
        assert_eq!(holders.len(), 2, "fair {fair}: {holders:?}");
        assert!(holders.iter().all(|h| h.kind == LockKind::Shared));
        assert!(holders.iter().any(|h| h.token == token));
        // A writer still waits, and so does a reader that would pass it.
        busy(
            &lock(&d, true),
            "a writer got in beside the downgraded hold",
        )
        .await;
        busy(&lock(&d, false), "a reader passed a waiting writer").await;
        busy(
            &lock(&b, false),
            "a reader of the writer's client passed it",
        )
        .await;
        assert!(!next_writer.is_finished(), "a writer got in beside readers");
        let again = writer.downgrade().await.unwrap_err();
        assert!(matches!(again, Error::InvalidOption { .. }), "{again}");
        let _ = writer.release().await.unwrap();
        let _ = read.release().await.unwrap();
        let last = within("the writer after the readers", next_writer)
            .await
            .unwrap();
        assert!(last.token() > token);
        let _ = last.release().await.unwrap();
    }

    let name = unique("downgrade-refused");
    let locks = client();
    let owned = || {
        let lock = locks.write(name.as_str()).unwrap().with_ttl(LONG_TTL);
        lock.with_owner("one-owner")
    };
    let mut first = owned().lock().await.unwrap();
    let second = owned().lock().await.unwrap();
    let refused = first.downgrade().await.unwrap_err();
    assert!(matches!(refused, Error::Conflict { .. }), "{refused}");
    assert_eq!(first.kind(), LockKind::Exclusive);
    first
        .check()
        .expect("a refused downgrade leaves the guard held");
    let _ = second.release().await.unwrap();
    first.downgrade().await.unwrap();
    let _ = first.release().await.unwrap();

    // The name is free again: a semaphore may use it.
    let semaphore = locks.semaphore(name.as_str(), 2).unwrap();
    let mut permit = semaphore.with_ttl(LONG_TTL).lock().await.unwrap();
    let refused = permit.downgrade().await.unwrap_err();
    assert!(matches!(refused, Error::InvalidOption { .. }), "{refused}");
    permit.check().unwrap();

    let gone = unique("downgrade-gone");
    let mut writer = (locks.write(gone.as_str()).unwrap())
        .with_ttl(LONG_TTL)
        .lock()
        .await
        .unwrap();
    assert!(locks.force_release(gone.as_str()).await.unwrap());
    let lost = writer.downgrade().await.unwrap_err();
    assert!(matches!(lost, Error::Lost { .. }), "{lost}");
}

/// A task waiting at its process's gate may be given a place in the store's queue by
/// another: by its holder's downgrade (so that readers who come later wait behind it), or
/// by a release that hands over to it while someone of another process is first. If it
/// gives up before it runs again, that place leaves the store's queue with it, rather
/// than hold up the waiters behind it until its waiter lease ends.
pub async fn gate_waiter_given_a_place_can_give_up(store: Arc<dyn Store>) {
    let client = || Leasehold::from_store(store.clone());
    for (by_downgrade, fair) in [(true, false), (true, true), (false, true)] {
        if fair && !store.capabilities().queues_by_wait {
            // Its fair waiters each ask the store: none waits at a gate.
            continue;
        }
        let name = unique("given-a-place");
        let (a, b) = (client(), client());
        let lock = |c: &Leasehold| {
            (c.write(name.as_str()).unwrap())
                .with_ttl(LONG_TTL)
                .with_fair(fair)
        };
        let mut holder = lock(&a).lock().await.unwrap();
        let other = match by_downgrade {
            true => None,
            false => {
                let other = lock(&b);
                let other = tokio::spawn(async move { other.lock().await.unwrap() });
                queued("a writer of another process", &a, &name, 1).await;
                Some(other)
            }
        };
        // A task of the holder's process waits: polled once, then never again.
        let next = lock(&a);
        let mut waiting = Box::pin(next.lock());
        std::future::poll_fn(|cx| {
            assert!(waiting.as_mut().poll(cx).is_pending());
            std::task::Poll::Ready(())
        })
        .await;
        let waiters = usize::from(other.is_some()) + 1;
        queued("a writer waiting in its process", &a, &name, waiters).await;
        let other = match other {
            None => {
                holder.downgrade().await.unwrap();
                None
            }
            Some(other) => {
                let _ = holder.release().await.unwrap();
                Some(
                    within("the writer of another process", other)
                        .await
                        .unwrap(),
                )
            }
        };
        drop(waiting);
        // Whatever it left in the store is taken out by tasks that `shutdown` waits for.
        assert!(a.shutdown(PATIENCE).await, "the undo did not finish");
        let left = b.describe(name.as_str()).await.unwrap().waiters;
        assert!(
            left.is_empty(),
            "a task that gave up still waits (downgrade {by_downgrade}, fair {fair}): {left:?}"
        );
        if let Some(other) = other {
            let _ = other.release().await.unwrap();
        }
    }
}
