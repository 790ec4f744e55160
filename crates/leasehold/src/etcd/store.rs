//! The [`Store`] impl: each call of the trait, routed to the rooms that do the work.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, UNIX_EPOCH};

use async_trait::async_trait;
use tokio::time::Instant;

use super::acquisitions::{owners_marker, Acquisition, State};
use super::queue::*;
use super::rpc::{prefix_end, Compare, Op, RangeRequest};
use super::wait::Blocker;
use super::{EtcdLease, EtcdStore};
use crate::store::{
    busy_states, AcquireRequest, Admission, Admitted, Attempt, Capabilities, Grant, Lease,
    LockKind, LockState, Released, Renewal, Store, WaiterInfo, Watermark,
};
use crate::{FencingToken, LockName, Result};

#[async_trait]
impl Store for EtcdStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        match self.attempt(req).await? {
            // Boxed, as the calls of an attempt are (see `pass`).
            Attempt::Granted(grant) => Ok(Attempt::Granted(
                Box::pin(self.on_full_lease(req, grant)).await,
            )),
            busy => Ok(busy),
        }
    }

    /// An attempt that may put a key waits for its turn here, before its state is
    /// built; a waiting key's recheck goes at once (its lease must not run out).
    fn admit(&self, req: &AcquireRequest) -> Admission {
        if self.waits_in_queue(&req.lease) {
            return Admission::Now(Admitted::default());
        }
        let attempts = &self.inner.attempts;
        match attempts.clone().try_acquire_owned() {
            Ok(permit) => Admission::Now(Admitted::with(permit)),
            Err(_) => {
                let attempts = attempts.clone();
                Admission::Wait(Box::pin(async move {
                    // The semaphore is never closed.
                    attempts
                        .acquire_owned()
                        .await
                        .map(Admitted::with)
                        .unwrap_or_default()
                }))
            }
        }
    }

    async fn shed(&self) {
        self.shed_waiter_leases();
        self.shed_leases().await;
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        self.renewal(lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<Released> {
        // The record goes once etcd has answered: a release whose call failed (or was
        // dropped) is retried the same way, and its etcd lease spared or revoked, rather
        // than left keyless in etcd until its TTL by a retry that no longer knows it.
        let known = self.acquisition(&lease.id);
        let (key, create, own) = match known {
            Some(Acquisition {
                key,
                owner,
                lease: Some(etcd_lease),
                state: State::Unknown,
                ..
            }) => {
                // Whatever etcd did with the unanswered attempt, its key goes with the lease
                // (or with the full lease a cancelled hand-over moved it to). On the
                // waiters' shared lease, the key goes by name, and the lease is retired:
                // a put applied late goes when it ends.
                if etcd_lease.shared {
                    let key = key.key_in(&lease.name);
                    let marker = owners_marker(&lease.name, &lease.id, owner.as_deref(), &key);
                    self.call_txn(txn(vec![], remove(&key, &marker), vec![]))
                        .await?;
                    self.retire_waiter_lease(etcd_lease.id);
                    self.remove_if_put_late(key, marker);
                } else {
                    self.revoke(etcd_lease.id).await?;
                }
                self.forget(&lease.id);
                self.moved_off(&lease.id, None);
                return Ok(Released::Released);
            }
            // The key's own hold, or a waiting key: with no re-entries, delete it.
            Some(Acquisition {
                key,
                owner,
                lease: Some(etcd_lease),
                state,
                hold: None,
            }) if matches!(state, State::Held { .. } | State::Queued { .. }) => {
                let key = key.key_in(&lease.name);
                let marker = owners_marker(&lease.name, &lease.id, owner.as_deref(), &key);
                let (create, modified) = match state {
                    State::Held { create, modified } => (create, modified),
                    State::Queued { create, .. } => (create, create),
                    _ => unreachable!("matched above"),
                };
                if self
                    .delete_alone(&lease.name, &key, &marker, etcd_lease, create, modified)
                    .await?
                {
                    self.forget(&lease.id);
                    self.moved_off(&lease.id, None);
                    return Ok(Released::Released);
                }
                (key, create, Some(etcd_lease))
            }
            Some(Acquisition {
                key,
                lease: own,
                state: State::Held { create, .. },
                ..
            }) => (key.key_in(&lease.name), create, own),
            Some(_) => {
                self.forget(&lease.id);
                return Ok(Released::NotHeld);
            }
            None => match self.find(&lease.name, &lease.id).await? {
                Some((member, ..)) => (member.kv.key, member.kv.create_revision, None),
                None => return Ok(Released::NotHeld),
            },
        };
        let released = self.release_hold(lease, &key, create, own).await?;
        self.forget(&lease.id);
        if released == Released::NotHeld {
            // Our key or hold was gone already (an earlier release applied unseen, a
            // force-release): the leases it was on carry nothing of ours now.
            if let Some(own) = own.filter(|l| l.ours) {
                self.revoke_later(own.id);
            }
            self.moved_off(&lease.id, None);
        }
        Ok(released)
    }

    async fn transfer(&self, from: &Lease, to: &AcquireRequest) -> Result<(Released, Attempt)> {
        let released = self.release(from).await?;
        Ok((released, self.acquire(to).await?))
    }

    // Written out as `async_trait` would make it, so that the box holds the wait itself
    // (`changed_since`), not a frame around it: every waiter (thousands of them) carries
    // this box while it waits.
    fn changed<'life0, 'life1, 'async_trait>(
        &'life0 self,
        req: &'life1 AcquireRequest,
        since: Watermark,
    ) -> Pin<Box<dyn Future<Output = Result<Option<Grant>>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.changed_since(req, since.0 as i64))
    }

    async fn ended(&self, lease: &Lease) -> Result<()> {
        let Some(Acquisition {
            key,
            state: State::Held { modified, .. },
            ..
        }) = self.acquisition(&lease.id)
        else {
            return std::future::pending().await;
        };
        let key = key.key_in(&lease.name);
        let mut seen = modified;
        let mut trouble = Duration::from_millis(50);
        loop {
            match self.deleted(&Blocker::Key(key.clone()), seen).await {
                Ok(true) => return Ok(()),
                Ok(false) => {
                    // Compacted past `seen`: is our key still there?
                    // Boxed, as `deleted`'s calls are: every held lock waits here.
                    let now = Box::pin(self.range(range_key(&key))).await?;
                    match now.kvs.first() {
                        Some(kv) if kv.create_revision <= modified => {
                            seen = now.header.map_or(seen, |h| h.revision)
                        }
                        _ => return Ok(()),
                    }
                }
                // A member went away: watch again through another.
                Err(error) if error.is_retryable() => {
                    tracing::debug!(%error, "watch on a held key broke; watching again");
                    tokio::time::sleep(trouble).await;
                    trouble = (trouble * 2).min(Duration::from_secs(1));
                }
                Err(error) => return Err(error),
            }
        }
    }

    async fn proclaim(&self, lease: &Lease, value: &str) -> Result<Renewal> {
        self.proclaim_value(lease, value).await
    }

    async fn downgrade(&self, lease: &Lease) -> Result<Renewal> {
        self.downgrade_hold(lease).await
    }

    async fn watch(&self, name: &LockName, seen: &LockState) -> Result<()> {
        self.holders_changed(name, seen).await
    }

    async fn describe(&self, name: &LockName) -> Result<LockState> {
        let (queue, _) = self.queue(name).await?;
        let hold_keys = match queue.is_empty() {
            true => Vec::new(),
            false => self.range(range_prefix(&holds_of(name), true)).await?.kvs,
        };
        let mut state = LockState {
            name: name.to_string(),
            last_token: FencingToken(0),
            holders: Vec::new(),
            waiters: Vec::new(),
        };
        for at in 0..queue.len() {
            let member = &queue[at];
            if standing(&queue, at).waiting.is_none() {
                let left = self.time_to_live(member.kv.lease).await?;
                let mut holder = holder_info(member, Duration::from_secs(left.max(0) as u64));
                // Live re-entries: etcd deletes a hold key when its lease ends.
                let create = Some(member.kv.create_revision);
                holder.holds += (hold_keys.iter())
                    .filter(|kv| hold_create(name, &kv.key) == create)
                    .count() as u32;
                state.holders.push(holder);
            } else {
                state.waiters.push(WaiterInfo {
                    owner: member.entry.owner.clone(),
                    host: member.entry.host.clone(),
                    pid: member.entry.pid,
                    kind: member.entry.kind,
                    since: UNIX_EPOCH + Duration::from_millis(member.entry.since),
                });
            }
        }
        // A waiter's key already has the revision that will be its token, but it is not
        // issued until the waiter holds.
        if let Some(newest) = state.holders.iter().map(|h| h.token).max() {
            state.last_token = newest;
        }
        Ok(state)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockState>> {
        let start = [ROOT, prefix.as_bytes()].concat();
        let answer = self
            .range(Op::Range(RangeRequest {
                range_end: prefix_end(&start),
                key: start,
                keys_only: true,
                ..Default::default()
            }))
            .await?;
        // Keys sort by name first (names hold no NUL), so each name's keys are adjacent.
        let mut names: Vec<String> = answer
            .kvs
            .iter()
            .filter_map(|kv| {
                let rest = kv.key.get(ROOT.len()..)?;
                let name = rest.split(|&b| b == 0).next()?;
                std::str::from_utf8(name).ok().map(str::to_string)
            })
            .collect();
        names.dedup();
        let names = names
            .into_iter()
            .filter_map(|n| LockName::new(n).ok())
            .collect();
        busy_states(self, names).await
    }

    async fn force_release(&self, name: &LockName) -> Result<bool> {
        let (queue, _) = self.queue(name).await?;
        let mut any = false;
        for at in 0..queue.len() {
            if standing(&queue, at).waiting.is_some() {
                continue;
            }
            let (key, create) = (&queue[at].kv.key, queue[at].kv.create_revision);
            let marker = marker_key(name, &queue[at].entry.owner, key);
            // Every hold: the key's own, and its re-entries' hold keys.
            let mut ends = remove(key, &marker);
            ends.push(delete_prefix(&holds_prefix(name, create)));
            let answer = self
                .call_txn(txn(vec![Compare::created_at(key, create)], ends, vec![]))
                .await?;
            any |= answer.succeeded;
        }
        Ok(any)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            cross_process: true,
            reclaims_dead_processes: false,
            fair_by_default: true,
            queues_by_wait: false,
            failed_calls_change_nothing: false,
            keeps_waiters_alive: true,
        }
    }

    fn describe_store(&self) -> String {
        self.inner.shown.clone()
    }

    fn caveat(&self) -> Option<String> {
        self.inner.caveat.get().cloned()
    }
}

impl EtcdStore {
    /// Deletes a waiting key, and its marker, again after a put that may still be on its
    /// way could have been applied: its request was given up on, and etcd may apply it
    /// after the delete. Left there, on the waiters' shared lease that the client's other
    /// waiters keep alive, the key would reach the head of the queue held by nobody, and
    /// keep those waiters out for as long as they wait. (Its name is its own: no other
    /// acquisition's key or marker has it.)
    fn remove_if_put_late(&self, key: Vec<u8>, marker: Vec<u8>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Not kept alive by this: a store dropped meanwhile revokes its waiters' leases.
        let inner = std::sync::Arc::downgrade(&self.inner);
        runtime.spawn(async move {
            for after in LATE_PUT {
                tokio::time::sleep(after).await;
                let Some(inner) = inner.upgrade() else { return };
                let store = EtcdStore { inner };
                let _ = (store.call_txn(txn(vec![], remove(&key, &marker), vec![]))).await;
            }
        });
    }
}

/// When a waiting key whose put went unanswered is deleted again: a put that etcd took
/// is applied within a call's time, unless an election holds it up.
const LATE_PUT: [Duration; 3] = [
    Duration::from_millis(250),
    Duration::from_millis(750),
    Duration::from_secs(4),
];

impl EtcdStore {
    /// [`Store::changed`]: a wait for a deletion that lets `req` in, then a hand-over's
    /// move onto the full lease.
    #[allow(clippy::manual_async_fn)] // an `async fn` keeps its arguments twice
    fn changed_since<'a>(
        &'a self,
        req: &'a AcquireRequest,
        seen: i64,
    ) -> impl Future<Output = Result<Option<Grant>>> + Send + 'a {
        async move {
            let grant = match req.kind {
                // A reader is also let in by a writer's downgrade, which deletes nothing.
                // Raced only while it waits: a grant, once come, is seen through.
                // Boxed, as the wait outside the queue is: a queued writer (thousands of
                // them) carries its wait in line alone.
                LockKind::Shared => {
                    Box::pin(async {
                        tokio::select! {
                            grant = self.deletion_lets_in(req, seen) => grant,
                            downgraded = Box::pin(self.downgraded(req, seen)) => {
                                downgraded?;
                                self.look_again(&req.lease);
                                Ok(None)
                            }
                        }
                    })
                    .await?
                }
                _ => self.deletion_lets_in(req, seen).await?,
            };
            match grant {
                // The hand-over's calls are boxed, so that each waiter carries only what
                // it needs while it waits (see `deletion_lets_in`).
                Some(grant) => Ok(Some(Box::pin(self.on_full_lease(req, grant)).await)),
                None => Ok(None),
            }
        }
    }

    /// Resolves once a deletion may let `req` in: for a waiter outside the queue, of
    /// what keeps it out; for a queued one, in its line, with the grant of a hand-over,
    /// whose key is still to move to a full lease.
    ///
    /// A queued acquisition waits in line here rather than in the lock loop. The process
    /// watches the queue for deletions once for all its waiters (see line.rs), and a
    /// waiter holds when enough of the keys that could keep it out have gone: the release
    /// that lets it in reaches it as one event, with no read or watch of its own on the
    /// hand-over's path. While it waits, a waiter keeps its place in line alone (a few
    /// words): joining, which may start the line's watch or read the queue, is boxed, and
    /// its key is read from its record once its turn comes.
    #[allow(clippy::manual_async_fn)] // an `async fn` keeps its arguments twice
    fn deletion_lets_in<'a>(
        &'a self,
        req: &'a AcquireRequest,
        seen: i64,
    ) -> impl std::future::Future<Output = Result<Option<Grant>>> + Send + 'a {
        // Not an `async fn`, which would keep its arguments twice, and what it read of
        // the acquisition is gone before it waits: a queued waiter (thousands of them)
        // carries its wait in line alone.
        async move {
            let queued = self.acquisition_state(&req.lease, |state| match state {
                State::Queued { .. } => Some(true),
                State::Outside { .. } => Some(false),
                _ => None,
            });
            match queued {
                Some(true) => {
                    let mut place = match Box::pin(self.join_line(req, seen)).await? {
                        Ok(place) => place,
                        Err(over) => return Ok(over),
                    };
                    return match place.turn().await {
                        Some(turn) => Ok(self.after_turn(req, turn)),
                        None => Err(self.watch_ended()),
                    };
                }
                Some(false) => {}
                None => return std::future::pending().await,
            }
            let blocker = self.acquisition_state(&req.lease, |state| match state {
                State::Outside { blocker } => Some(blocker.clone()),
                _ => None,
            });
            // Its state changed meanwhile: look again.
            let Some(blocker) = blocker else {
                return Ok(None);
            };
            Box::pin(async move { self.deleted(&blocker, seen).await }).await?;
            Ok(None)
        }
    }

    /// Deletes our key if it is unchanged since `modified` and has no re-entry holds,
    /// and keeps its lease for the next acquisition, refreshed on the way if it has aged.
    /// Whether it did.
    pub(super) async fn delete_alone(
        &self,
        name: &LockName,
        key: &[u8],
        marker: &[u8],
        lease: EtcdLease,
        create: i64,
        modified: i64,
    ) -> Result<bool> {
        let holds = holds_prefix(name, create);
        let delete_if_unchanged = self.call_txn(txn(
            vec![
                Compare::modified_at(key, modified),
                Compare::empty(&holds, &prefix_end(&holds)),
            ],
            remove(key, marker),
            vec![],
        ));
        let aged = lease.ours && lease.left(Instant::now()) * 3 < lease.ttl() * 2;
        let used = lease;
        let (answer, lease) = if aged {
            let (answer, refreshed) = tokio::join!(delete_if_unchanged, self.keep_alive(lease));
            (answer?, refreshed)
        } else {
            (delete_if_unchanged.await?, Ok(Some(lease)))
        };
        if !answer.succeeded {
            return Ok(false);
        }
        match lease {
            Ok(Some(lease)) => self.spare(lease),
            Ok(None) => {}
            // Alive for all we know, but not for reuse with an unknown bound: revoke it
            // rather than leave it in etcd until its TTL.
            Err(_) if used.ours => self.revoke_later(used.id),
            Err(_) => {}
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::acquire::tests::{request, started};
    use crate::store::{Admission, Attempt, Store};
    use crate::{Leasehold, LockName};

    /// Admissions before the attempt's state is built: a request waits while
    /// `ATTEMPTS_AT_ONCE` attempts that may put are under way, a bounded wait ends on time
    /// (the attempt was never sent), and a waiting key's recheck is not held back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn attempts_that_may_put_wait_for_their_admission() {
        let (_server, store) = started().await;
        let store = Arc::new(store);
        let name = LockName::new("admitted").unwrap();
        let holder = request(&name, "holder");
        let waiter = request(&name, "waiter");
        assert!(matches!(
            store.acquire(&holder).await.unwrap(),
            Attempt::Granted(_)
        ));
        assert!(matches!(
            store.acquire(&waiter).await.unwrap(),
            Attempt::Busy(_)
        ));

        let fresh = request(&name, "fresh");
        let mut taken = Vec::new();
        for _ in 0..super::super::ATTEMPTS_AT_ONCE {
            match store.admit(&fresh) {
                Admission::Now(admitted) => taken.push(admitted),
                Admission::Wait(_) => panic!("admissions were free"),
            }
        }
        assert!(matches!(store.admit(&fresh), Admission::Wait(_)));
        assert!(
            matches!(store.admit(&waiter), Admission::Now(_)),
            "a waiting key's recheck keeps its waiter lease alive: it goes at once"
        );

        let locks = Leasehold::from_store(store.clone());
        let lock = locks.mutex("admitted-other").unwrap();
        let error = lock
            .try_lock_for(Duration::from_millis(50))
            .await
            .expect_err("never admitted");
        assert!(error.to_string().contains("an attempt"), "{error}");

        drop(taken);
        let guard = lock.try_lock().await.unwrap().expect("admitted, and free");
        let released = guard.release().await.unwrap();
        assert_eq!(released, crate::store::Released::Released);
    }
}
