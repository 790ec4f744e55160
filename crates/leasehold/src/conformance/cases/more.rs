//! Several permits at once, the free permits, and a write lock downgraded to a read lock.

use std::sync::Arc;
use std::time::Duration;

use super::{busy, granted, queued, LONG_TTL};
use crate::conformance::{unique, within};
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
    let mutex = a.mutex(unique("many-mutex")).unwrap();
    assert!(matches!(
        mutex.free_permits().await,
        Err(Error::InvalidOption { .. })
    ));
}

/// A write hold downgraded to a read hold: readers come in, a writer does not, the read
/// hold's token is newer, and a downgrade of a write hold that had ended is refused.
pub async fn downgrade_keeps_writers_out(store: Arc<dyn Store>) {
    let name = unique("downgrade");
    let (mine, other) = (
        Leasehold::from_store(store.clone()),
        Leasehold::from_store(store.clone()),
    );
    let write = granted(
        &mine.write(name.as_str()).unwrap().with_ttl(LONG_TTL),
        "a free lock",
    )
    .await;
    let written = write.token();
    let read_lock = mine.read(name.as_str()).unwrap().with_ttl(LONG_TTL);
    let read = read_lock.downgrade(write).await.unwrap();
    assert_eq!(read.kind(), LockKind::Shared);
    assert!(read.token() > written);
    let reader = granted(
        &other.read(name.as_str()).unwrap(),
        "a reader beside a downgraded hold",
    )
    .await;
    busy(
        &other.write(name.as_str()).unwrap(),
        "a writer beside a downgraded hold",
    )
    .await;
    let _ = reader.release().await.unwrap();
    let _ = read.release().await.unwrap();

    let gone = granted(
        &mine.write(name.as_str()).unwrap().with_ttl(LONG_TTL),
        "a free lock",
    )
    .await;
    assert!(mine.force_release(name.as_str()).await.unwrap());
    let refused = read_lock.downgrade(gone).await.unwrap_err();
    assert!(matches!(refused, Error::Lost { .. }), "{refused}");
    let state = mine.describe(name.as_str()).await.unwrap();
    assert!(
        state.holders.is_empty(),
        "a refused downgrade left a hold: {state:?}"
    );
}
