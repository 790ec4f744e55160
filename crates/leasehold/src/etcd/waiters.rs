//! The waiter leases: the waiting keys of one client share one etcd lease per length
//! (the waiter lease of their TTL, at most 5 s), kept alive by one task. Thousands of
//! waiters then cost etcd one keepalive every few seconds, not one each: a process
//! starved of CPU, whose thousands of keepalives ran late, lost its waiters' places.
//!
//! A waiting key is named by a random id, not after its lease, and leaves the shared
//! lease for one of its own (of the full TTL) when it is let in
//! ([`on_full_lease`](EtcdStore::on_full_lease)): a holder's lock ends with its own
//! guard's renewals, whatever else the process does. A shared lease is never spared or
//! revoked while a key of this client may be on it; the task revokes it once no
//! acquisition has used it for its whole TTL.
//!
//! An undo of a waiter's put whose answer never came deletes the key by name, and
//! retires the lease: new waiters take a new one, and the old one is revoked once its
//! waiters are gone, so a put that etcd applies late cannot leave a key behind for longer.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::leases::{lease_seconds, EtcdLease};
use super::{rpc, try_per_member, EtcdStore, Inner};
use crate::options::waiter_lease;
use crate::{Locked, Result};

/// The waiter leases of a client.
#[derive(Default)]
pub(super) struct WaiterLeases {
    /// By etcd lease id: the bound of each live one, and when a waiter last took it.
    live: HashMap<i64, (EtcdLease, Instant)>,
    /// By length in seconds: the one new waiting keys go on.
    current: HashMap<i64, i64>,
}

impl WaiterLeases {
    /// The ids of all of them, taken out (the store is dropped).
    pub(super) fn drain(&mut self) -> Vec<i64> {
        self.current.clear();
        self.live.drain().map(|(id, _)| id).collect()
    }

    /// Forgets `id`: no waiter takes it any more, and nothing keeps it from a revoke.
    fn forget(&mut self, id: i64) {
        self.current.retain(|_, current| *current != id);
        self.live.remove(&id);
    }
}

impl EtcdStore {
    /// The shared lease a waiting key of lock lease `ttl` goes on: the current one of its
    /// length, or a new one (granted once for all the waiters that ask meanwhile).
    pub(super) async fn waiter_lease_for(&self, ttl: Duration) -> Result<EtcdLease> {
        let seconds = lease_seconds(waiter_lease(ttl));
        if let Some(lease) = self.take_waiter_lease(seconds) {
            return Ok(lease);
        }
        let _granting = self.inner.granting.lock().await;
        if let Some(lease) = self.take_waiter_lease(seconds) {
            return Ok(lease);
        }
        let granted = self.grant(waiter_lease(ttl)).await?;
        let lease = EtcdLease {
            ours: false,
            shared: true,
            ..granted
        };
        {
            let mut leases = self.inner.waiter_leases.locked();
            leases.live.insert(lease.id, (lease, Instant::now()));
            leases.current.insert(seconds, lease.id);
        }
        tokio::spawn(keep_waiters_alive(Arc::downgrade(&self.inner), lease));
        Ok(lease)
    }

    /// The current shared lease of `seconds`, if it has at least half its TTL left.
    fn take_waiter_lease(&self, seconds: i64) -> Option<EtcdLease> {
        let mut leases = self.inner.waiter_leases.locked();
        let id = *leases.current.get(&seconds)?;
        let (lease, taken) = leases.live.get_mut(&id)?;
        if lease.left(Instant::now()) * 2 < lease.ttl() {
            return None;
        }
        *taken = Instant::now();
        Some(*lease)
    }

    /// `lease` with its latest bound: a shared lease's is the keeper's; `None` once it has
    /// ended. Any other lease as it is.
    pub(super) fn current(&self, lease: EtcdLease) -> Option<EtcdLease> {
        if !lease.shared {
            return Some(lease);
        }
        let leases = self.inner.waiter_leases.locked();
        leases.live.get(&lease.id).map(|(lease, _)| *lease)
    }

    /// Whether `id` is a live shared lease (never to be revoked while keys may be on it).
    pub(super) fn is_waiter_lease(&self, id: i64) -> bool {
        self.inner.waiter_leases.locked().live.contains_key(&id)
    }

    /// New waiting keys go on another lease; `id` is revoked once nothing uses it.
    pub(super) fn retire_waiter_lease(&self, id: i64) {
        let mut leases = self.inner.waiter_leases.locked();
        leases.current.retain(|_, current| *current != id);
    }

    /// `id` has ended in etcd (a put found it gone): forgotten, so that waiters take
    /// another.
    pub(super) fn waiter_lease_ended(&self, id: i64) {
        self.inner.waiter_leases.locked().forget(id);
    }

    /// Whether an acquisition of this client has a key (or a put) on lease `id`.
    fn uses(&self, id: i64) -> bool {
        let acquisitions = self.inner.acquisitions.locked();
        (acquisitions.values()).any(|a| a.lease.is_some_and(|l| l.id == id))
    }

    /// Takes `id` out if no acquisition uses it and no waiter took it within its TTL:
    /// whether it did (then it is for the caller to revoke).
    fn unused_taken_out(&self, id: i64) -> bool {
        let looked = Instant::now();
        if self.uses(id) {
            return false;
        }
        let mut leases = self.inner.waiter_leases.locked();
        let Some((lease, taken)) = leases.live.get(&id) else {
            return true;
        };
        // A waiter may have taken it just before the look, and not yet recorded its put.
        if *taken + lease.ttl() > looked {
            return false;
        }
        leases.forget(id);
        true
    }

    /// Revokes every shared lease that nothing uses (`shutdown`).
    pub(super) fn shed_waiter_leases(&self) {
        let ids: Vec<i64> = self
            .inner
            .waiter_leases
            .locked()
            .live
            .keys()
            .copied()
            .collect();
        for id in ids {
            if !self.uses(id) {
                self.waiter_lease_ended(id);
                self.revoke_later(id);
            }
        }
    }

    fn set_waiter_lease(&self, lease: EtcdLease) {
        let mut leases = self.inner.waiter_leases.locked();
        if let Some((known, _)) = leases.live.get_mut(&lease.id) {
            *known = lease;
        }
    }
}

/// Keeps shared lease `lease` alive at a third of its TTL while the store lives and an
/// acquisition uses it; then revokes it. A keepalive that fails is tried again soon,
/// while the lease is still alive; one that finds the lease ended forgets it (its keys
/// are gone, and their waiters learn it from their queue's watch).
async fn keep_waiters_alive(store: Weak<Inner>, mut lease: EtcdLease) {
    let mut pause = lease.ttl() / 3;
    loop {
        tokio::time::sleep(pause).await;
        let Some(inner) = store.upgrade() else {
            return;
        };
        let store = EtcdStore { inner };
        if !store.is_waiter_lease(lease.id) {
            return;
        }
        if store.unused_taken_out(lease.id) {
            store.revoke_later(lease.id);
            return;
        }
        let per_member = try_per_member(lease.ttl());
        match rpc::trying_each_for(per_member, store.keep_alive(lease)).await {
            Ok(Some(renewed)) => {
                lease = renewed;
                store.set_waiter_lease(lease);
                pause = lease.ttl() / 3;
            }
            Ok(None) => {
                tracing::warn!(lease = lease.id, "etcd: the waiters' lease had ended");
                store.waiter_lease_ended(lease.id);
                return;
            }
            Err(error) => {
                tracing::debug!(%error, "etcd: keeping the waiters' lease alive failed");
                pause = (lease.left(Instant::now()) / 4).max(Duration::from_millis(100));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::acquire::tests::{put_key, request, started};
    use super::super::acquisitions::{Acquisition, State};
    use super::super::leases::tests::leases;
    use super::super::queue::{range_key, KeyId};
    use super::*;
    use crate::store::{Released, Store};
    use crate::LockName;

    /// An unanswered put on the waiters' shared lease is undone by deleting its key (and
    /// marker) by name, not by revoking the lease under the other waiters. The lease is
    /// retired: the next waiter takes another, and the old one is revoked once nothing
    /// uses it, so that a put etcd applied late cannot stay. Against a real etcd; the
    /// unanswered put is the state the store records for one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unanswered_waiting_put_is_undone_by_name_and_retires_the_shared_lease() {
        let (server, store) = started().await;
        let name = LockName::new("undone").unwrap();
        let req = request(&name, "o");
        let shared = store.waiter_lease_for(req.ttl).await.unwrap();
        assert!(shared.shared && !shared.ours);
        let (key, marker, _) = put_key(&store, &req, shared).await;
        store.record(
            &req.lease,
            Acquisition {
                key: KeyId::of(&key),
                owner: Acquisition::owner_of(&req.lease, &req.owner),
                lease: Some(shared),
                state: State::Unknown,
                hold: None,
            },
        );
        assert_eq!(
            store.release(&req.lease()).await.unwrap(),
            Released::Released
        );
        for gone in [&key, &marker] {
            let left = store.range(range_key(gone)).await.unwrap().kvs;
            assert!(
                left.is_empty(),
                "{:?} is still there",
                String::from_utf8_lossy(gone)
            );
        }
        assert!(
            store.is_waiter_lease(shared.id),
            "not revoked under other waiters"
        );
        let next = store.waiter_lease_for(req.ttl).await.unwrap();
        assert_ne!(next.id, shared.id, "new waiters go on another lease");

        let id = format!("{:x}", shared.id);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if !tokio::task::block_in_place(|| leases(&server)).contains(&id) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the retired lease is still there"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
