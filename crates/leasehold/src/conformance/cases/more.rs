//! Several permits at once, and the free permits.

use std::sync::Arc;
use std::time::Duration;

use super::{queued, LONG_TTL};
use crate::conformance::{unique, within};
use crate::store::Store;
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
