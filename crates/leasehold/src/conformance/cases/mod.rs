//! The conformance cases, a room per concern; [`super`] re-exports them.

pub(super) mod blocking;
pub(super) mod election;
pub(super) mod exclusion;
pub(super) mod leases;
pub(super) mod more;
pub(super) mod primitives;
pub(super) mod processes;
pub(super) mod queue;

use std::time::Duration;

use super::eventually;
use crate::{Leasehold, Lock, LockGuard};

/// A TTL long enough that a place or hold left behind would cost the others seconds.
pub(super) const LONG_TTL: Duration = Duration::from_secs(30);

/// A fair mutex with [`LONG_TTL`], acquired under `owner` (named in `describe`).
pub(super) fn fair_lock(locks: &Leasehold, name: &str, owner: &str) -> Lock {
    let lock = locks.mutex(name).unwrap().with_ttl(LONG_TTL);
    lock.with_fair(true).with_owner(owner)
}

pub(super) async fn waiting_owners(locks: &Leasehold, name: &str) -> Vec<String> {
    let state = locks.describe(name).await.unwrap();
    state.waiters.into_iter().map(|w| w.owner).collect()
}

/// Waits until `locks` shows `waiters` waiters on `name`, failing with `what` after
/// [`PATIENCE`](super::PATIENCE).
pub(super) async fn queued(what: &str, locks: &Leasehold, name: &str, waiters: usize) {
    eventually(what, || async {
        locks.describe(name).await.unwrap().waiters.len() == waiters
    })
    .await
}

/// A `try_lock` of `lock` that must be granted; `what` says why it should be.
pub(super) async fn granted(lock: &Lock, what: &str) -> LockGuard {
    lock.try_lock().await.unwrap().expect(what)
}

/// A `try_lock` of `lock` that must find it taken; `what` says what a grant would be.
pub(super) async fn busy(lock: &Lock, what: &str) {
    assert!(lock.try_lock().await.unwrap().is_none(), "{what}");
}
