//! Acquisition: the state this client keeps of each acquisition, and the attempt that
//! puts a key into the queue (or re-reads it) and settles where it stands.

use std::time::Duration;

use tokio::time::Instant;

use super::queue::*;
use super::rpc::{self, prefix_end, Compare, KeyValue, Op, RangeRequest, TxnResponse};
use super::wait::Blocker;
use super::{EtcdLease, EtcdStore, MIN_TRY_PER_MEMBER};
use crate::options::waiter_lease;
use crate::store::{AcquireRequest, Attempt, Busy, Grant, LeaseId, LockKind, Watermark};
use crate::{rules, Error, FencingToken, Locked, Result};

/// How many busy queues a client remembers; past that it forgets them all.
pub(super) const BUSY_QUEUES: usize = 4096;

#[derive(Clone, Debug)]
pub(super) struct Acquisition {
    pub(super) key: Vec<u8>,
    /// The owner's marker.
    pub(super) marker: Vec<u8>,
    pub(super) lease: Option<EtcdLease>,
    pub(super) state: State,
    /// A re-entry's hold key (see [`hold_key`]), on `lease`, as it was granted; `None`
    /// for the hold that the queue key itself carries.
    pub(super) hold: Option<Vec<u8>>,
}

#[derive(Clone, Debug)]
pub(super) enum State {
    /// An attempt was sent and its outcome is unknown: undo by revoking the lease.
    Unknown,
    /// Not in the queue (a try, or a non-fair waiter): wait for `blocker` to go.
    Outside { blocker: Blocker },
    /// Our key waits in the queue.
    Queued {
        create: i64,
        waiting: Waiting,
        /// When the last attempt started: a hand-over lease counts from there.
        attempted: Instant,
    },
    /// Granted: our key (or our owner's, re-entered) at `create`, last written at
    /// `modified`.
    Held { create: i64, modified: i64 },
}

/// A waiting acquisition's own key.
pub(super) struct Ours {
    pub(super) key: Vec<u8>,
    pub(super) lease: EtcdLease,
    pub(super) create: i64,
    /// When the last attempt started: a hand-over lease counts from there.
    pub(super) attempted: Instant,
}

pub(super) fn conflict(req: &AcquireRequest, refusal: rules::Refusal) -> Error {
    Error::Conflict {
        name: req.name.to_string(),
        reason: refusal.message(),
    }
}

pub(super) fn grant(
    req: &AcquireRequest,
    lease: EtcdLease,
    create: i64,
    holds: u32,
    started: Instant,
) -> Grant {
    let left = lease.left(started);
    Grant {
        token: FencingToken(create as u64),
        holds,
        lease: (left < req.ttl).then_some(left),
    }
}

impl EtcdStore {
    pub(super) fn acquisition(&self, id: &LeaseId) -> Option<Acquisition> {
        self.inner.acquisitions.locked().get(id).cloned()
    }

    pub(super) fn record(&self, id: &LeaseId, acquisition: Acquisition) {
        self.inner
            .acquisitions
            .locked()
            .insert(id.clone(), acquisition);
    }

    pub(super) fn forget(&self, id: &LeaseId) -> Option<Acquisition> {
        self.inner.acquisitions.locked().remove(id)
    }

    pub(super) fn update(&self, id: &LeaseId, change: impl FnOnce(&mut Acquisition)) {
        if let Some(a) = self.inner.acquisitions.locked().get_mut(id) {
            change(a);
        }
    }

    pub(super) fn set_lease(&self, id: &LeaseId, lease: EtcdLease, modified: Option<i64>) {
        if let Some(a) = self.inner.acquisitions.locked().get_mut(id) {
            a.lease = Some(lease);
            if let (Some(revision), State::Held { modified, .. }) = (modified, &mut a.state) {
                *modified = revision;
            }
        }
    }

    /// Notes whether the queue at `prefix` was found busy; returns `busy`.
    pub(super) fn seen_busy(&self, prefix: &[u8], busy: bool) -> bool {
        let mut queues = self.inner.busy_queues.locked();
        if !busy {
            queues.remove(prefix);
        } else if !queues.contains(prefix) {
            if queues.len() >= BUSY_QUEUES {
                queues.clear();
            }
            queues.insert(prefix.to_vec());
        }
        busy
    }

    pub(super) async fn attempt(&self, req: &AcquireRequest) -> Result<Attempt> {
        let started = Instant::now();
        let prefix = queue_prefix(&req.name);
        let mut known = self.acquisition(&req.lease);
        if let Some(Acquisition {
            lease: Some(lease),
            state: State::Unknown,
            hold: Some(_),
            ..
        }) = known
        {
            // A re-entry whose answer was lost: its hold key, if it was put, goes with its
            // lease. (Reused for a queue key, the lease would keep it.)
            self.revoke(lease.id).await?;
            self.forget(&req.lease);
            known = None;
        }
        if let Some(Acquisition {
            key,
            lease: Some(lease),
            state: State::Queued {
                create, waiting, ..
            },
            ..
        }) = known
        {
            let second = waiting.second;
            return self
                .recheck(req, &prefix, &key, lease, create, second, started)
                .await;
        }
        let writer = req.kind == LockKind::Exclusive;
        // A mutex try takes the lock only if nobody holds or waits; everything that waits
        // joins the queue, non-fair requests too (the rules let them pass waiters, not
        // make them: a waiter outside the queue would not be shown, and readers could
        // pass it).
        let only_if_free = writer && !req.enqueue;
        // A key that joins a busy queue waits there on a waiter's short lease, so that a
        // waiter that dies holds up the queue for a few seconds, not for the lock's TTL;
        // it moves to a lease of the full TTL when it is let in (`on_full_lease`).
        let joins = !only_if_free && self.inner.busy_queues.locked().contains(&prefix);
        let fresh = known.as_ref().is_none_or(|a| a.lease.is_none());
        let lease = match known.and_then(|a| a.lease) {
            Some(lease) => lease,
            None if joins && req.enqueue => self.lease_for(waiter_lease(req.ttl)).await?,
            None => self.lease_for(req.ttl).await?,
        };
        let key = queue_key(&req.name, lease.id);
        let marker = marker_key(&req.name, &req.owner, &key);
        self.record(
            &req.lease,
            Acquisition {
                key: key.clone(),
                marker: marker.clone(),
                lease: Some(lease),
                state: State::Unknown,
                hold: None,
            },
        );
        let entry = Entry {
            owner: req.owner.clone(),
            host: req.requester.host.clone(),
            pid: req.requester.pid,
            kind: req.kind,
            since: now_ms(),
            holds: vec![req.lease.clone()],
        };
        let puts = vec![
            put_on(lease.id, &key, &entry.value()),
            put_on(lease.id, &marker, &key),
        ];
        let everyone = Compare::empty(&prefix, &prefix_end(&prefix));
        let owners = owner_markers(&req.name, &req.owner);
        let request = if only_if_free {
            txn(
                vec![everyone],
                puts[..1].to_vec(),
                vec![range_queue(&prefix)],
            )
        } else {
            let mut join = puts.clone();
            if writer {
                join.extend(writer_view(&prefix));
            } else {
                join.push(range_queue(&prefix));
            }
            // Our owner's marker there: read the queue to find the owner's key.
            let join = txn(
                vec![Compare::empty(&owners, &prefix_end(&owners))],
                join,
                vec![
                    range_queue(&prefix),
                    Op::Range(RangeRequest {
                        key: owners.clone(),
                        range_end: prefix_end(&owners),
                        ..Default::default()
                    }),
                ],
            );
            // Into an empty queue the key alone (nothing to read back, no marker needed);
            // else join it: in the same Txn where the queue was busy last time, else in a
            // second one. etcd takes about 35 µs longer over a Txn that carries the nested
            // join, which an uncontended lock would pay on every acquire.
            let join = match self.inner.busy_queues.locked().contains(&prefix) {
                true => vec![Op::Txn(Box::new(join))],
                false => Vec::new(),
            };
            txn(vec![everyone], puts[..1].to_vec(), join)
        };
        let answer = match self.call_txn(request).await {
            Err(Error::Unavailable { source, .. })
                if source.to_string().contains("requested lease not found") =>
            {
                // A spare lease that etcd ended (revoked by hand, or a restore): drop it.
                self.forget(&req.lease);
                return Box::pin(self.attempt(req)).await;
            }
            other => other?,
        };
        let revision = answer.revision();
        if !only_if_free && self.seen_busy(&prefix, !answer.succeeded) && answer.nested().is_none()
        {
            // Busy, and the Txn did not carry the join: join now, on a waiter's lease if
            // this one is new (nothing was put on it).
            if fresh && req.enqueue {
                self.forget(&req.lease);
                self.spare(lease);
            }
            return Box::pin(self.attempt(req)).await;
        }
        // The join's answer when the queue was not empty.
        let joined = answer.nested().unwrap_or(&answer);
        let put_done = joined.succeeded;
        if writer && put_done && answer.nested().is_some() {
            return self
                .writer_standing(req, &key, lease, joined, revision, started)
                .await;
        }
        let queue = match joined.range() {
            Some(kvs) => self.members(&req.name, kvs)?,
            // Put into an empty queue: ours alone.
            None => vec![Member {
                kv: KeyValue {
                    key: key.clone(),
                    create_revision: revision,
                    mod_revision: revision,
                    value: Vec::new(),
                    lease: lease.id,
                },
                entry,
            }],
        };
        // Our key: put now, or by an earlier attempt of this request whose answer was lost
        // (then this put found the marker and did nothing). Its lease is spared only once
        // the key is gone: a spare lease must have no key.
        let ours = queue
            .iter()
            .find(|m| m.kv.key == key)
            .map(|m| m.kv.create_revision);
        let refused = queue
            .iter()
            .find_map(|m| rules::same_primitive(m.entry.kind, req.kind).err());
        if let Some(refusal) = refused {
            if let Some(create) = ours {
                self.withdraw(&req.lease, &key, &marker, create, lease)
                    .await?;
            } else {
                self.forget(&req.lease);
                self.spare(lease);
            }
            return Err(conflict(req, refusal));
        }
        // Our owner's first key: ours, or an earlier one (we re-enter it if it holds, and
        // else wait behind it in a place of our own).
        let Some(at) = queue.iter().position(|m| m.entry.owner == req.owner) else {
            if !put_done && !only_if_free {
                // Markers without their keys (a key deleted alone, by hand or by an older
                // version): clear them and join again.
                let stale = joined.ranges().nth(1).map_or(&[][..], |r| &r.kvs[..]);
                for stale in stale {
                    self.call_txn(txn(
                        vec![Compare::modified_at(&stale.key, stale.mod_revision)],
                        vec![delete(&stale.key)],
                        vec![],
                    ))
                    .await?;
                }
                return Box::pin(self.attempt(req)).await;
            }
            // Not queued (the lock was busy for a mutex try).
            self.spare(lease);
            return Ok(self.outside(req, &queue, &prefix, revision));
        };
        if queue[at].kv.key != key {
            let Some(create) = ours else {
                let here = standing(&queue, at);
                if here.waiting.is_some() && req.enqueue {
                    // Our owner waits: we wait too, in a place of our own, as the rules
                    // queue every waiting request. Put our key and look again.
                    self.call_txn(txn(vec![], puts, vec![])).await?;
                    return Box::pin(self.attempt(req)).await;
                }
                self.spare(lease);
                return self
                    .behind_owner(req, &queue, at, None, lease, revision, started)
                    .await;
            };
            let mine = queue.iter().position(|m| m.kv.key == key);
            let Some(mine) = mine.filter(|&mine| mine > at) else {
                return Err(self.wait_ended(req));
            };
            let _ = create; // put by an earlier attempt, or just now
            return self
                .behind_owner(req, &queue, at, Some(mine), lease, revision, started)
                .await;
        }
        let here = standing(&queue, at);
        let (create, modified) = (queue[at].kv.create_revision, queue[at].kv.mod_revision);
        let Some(waiting) = here.waiting else {
            return Ok(self.granted(req, &key, lease, create, modified, 1, started));
        };
        if !req.enqueue {
            self.withdraw(&req.lease, &key, &marker, create, lease)
                .await?;
            return Ok(self.busy(queue.first(), None, revision));
        }
        let busy = self.busy(queue.first(), Some(here.position), revision);
        self.queued(req, key, lease, create, waiting, started);
        Ok(busy)
    }

    /// Our owner has a key ahead of ours (`queue[first]`; ours is `queue[mine]`, if we put
    /// one): re-enter it if it holds; else a try is busy, and a waiting request waits
    /// in its own place, until any key ahead of it goes (then it looks again: its owner
    /// may hold by then, and it re-enters at once, as the rules say).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn behind_owner(
        &self,
        req: &AcquireRequest,
        queue: &[Member],
        first: usize,
        mine: Option<usize>,
        lease: EtcdLease,
        revision: i64,
        started: Instant,
    ) -> Result<Attempt> {
        let prefix = queue_prefix(&req.name);
        let holds = standing(queue, first).waiting.is_none();
        if holds || !req.enqueue || mine.is_none() {
            if let Some(m) = mine.map(|i| &queue[i]) {
                let marker = marker_key(&req.name, &req.owner, &m.kv.key);
                self.withdraw(&req.lease, &m.kv.key, &marker, m.kv.create_revision, lease)
                    .await?;
            }
            if holds {
                if let Err(refusal) = rules::reentry(queue[first].entry.kind, req.kind, &req.owner)
                {
                    self.forget(&req.lease);
                    return Err(conflict(req, refusal));
                }
                return self.reenter(req, &queue[first], started).await;
            }
            return Ok(self.outside(req, queue, &prefix, revision));
        }
        let mine = mine.expect("checked above");
        let ahead: Vec<Vec<u8>> = queue[..mine].iter().map(|m| m.kv.key.clone()).collect();
        let waiting = Waiting {
            room: ahead.len() - 1,
            ahead,
            second: true,
        };
        let position = standing(queue, mine).position;
        let busy = self.busy(queue.first(), Some(position), revision);
        let create = queue[mine].kv.create_revision;
        self.queued(
            req,
            queue[mine].kv.key.clone(),
            lease,
            create,
            waiting,
            started,
        );
        Ok(busy)
    }

    /// A writer's place from [`writer_view`]'s answer (after its put, or a recheck).
    pub(super) async fn writer_standing(
        &self,
        req: &AcquireRequest,
        key: &[u8],
        lease: EtcdLease,
        answer: &TxnResponse,
        revision: i64,
        started: Instant,
    ) -> Result<Attempt> {
        let mut ranges = answer.ranges();
        let keys = ranges.next().map_or(&[][..], |r| &r.kvs[..]);
        let first = match ranges.next().and_then(|r| r.kvs.first()) {
            Some(kv) => Some(self.member(&req.name, kv)?),
            None => None,
        };
        let Some(at) = keys.iter().position(|kv| kv.key == key) else {
            return Err(self.wait_ended(req));
        };
        let (create, modified) = (keys[at].create_revision, keys[at].mod_revision);
        let marker = marker_key(&req.name, &req.owner, key);
        if let Some(first) = first
            .as_ref()
            .filter(|f| f.entry.owner == req.owner && f.kv.key != key)
        {
            // Our owner holds through a key put into an empty queue: re-enter it.
            self.withdraw(&req.lease, key, &marker, create, lease)
                .await?;
            if let Err(refusal) = rules::reentry(first.entry.kind, req.kind, &req.owner) {
                return Err(conflict(req, refusal));
            }
            return self.reenter(req, first, started).await;
        }
        let refused = first
            .as_ref()
            .and_then(|f| rules::same_primitive(f.entry.kind, req.kind).err());
        if let Some(refusal) = refused {
            self.withdraw(&req.lease, key, &marker, create, lease)
                .await?;
            return Err(conflict(req, refusal));
        }
        let Some(waiting) = writer_waiting(at, |i| keys[i].key.clone()) else {
            return Ok(self.granted(req, key, lease, create, modified, 1, started));
        };
        if !req.enqueue {
            self.withdraw(&req.lease, key, &marker, create, lease)
                .await?;
            return Ok(self.busy(first.as_ref(), None, revision));
        }
        let busy = self.busy(first.as_ref(), Some(at), revision);
        self.queued(req, key.to_vec(), lease, create, waiting, started);
        Ok(busy)
    }

    /// A waiting acquisition tries again: is its key still there, and where?
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn recheck(
        &self,
        req: &AcquireRequest,
        prefix: &[u8],
        key: &[u8],
        lease: EtcdLease,
        create: i64,
        second: bool,
        started: Instant,
    ) -> Result<Attempt> {
        let due = lease.left(started) * 3 < lease.ttl() * 2;
        // A writer's own key, first of its owner's, reads the keys and the first value; a
        // key behind its owner's reads the whole queue (whose keys are whose).
        let writer = req.kind == LockKind::Exclusive && !second;
        let view = if writer {
            writer_view(prefix).into()
        } else {
            vec![range_queue(prefix)]
        };
        // A waiting key is on a short lease (a waiter lease): like a renewal, each member
        // gets a sixth of it while another is left, so a paused member cannot keep the
        // keepalive from another one in time. (The check only reads.)
        let per_member = (lease.ttl() / 6).max(MIN_TRY_PER_MEMBER);
        let check = rpc::trying_each_for(
            per_member,
            self.call_txn(txn(vec![Compare::created_at(key, create)], view, vec![])),
        );
        let (answer, renewed) = if due {
            let keep_alive = rpc::trying_each_for(per_member, self.keep_alive(lease));
            let (answer, renewed) = tokio::join!(check, keep_alive);
            (answer?, renewed.ok())
        } else {
            (check.await?, Some(Some(lease)))
        };
        let lease = match renewed {
            Some(Some(lease)) => lease,
            // A failed keepalive: keep the old bound.
            None => lease,
            Some(None) => return Err(self.wait_ended(req)),
        };
        if !answer.succeeded {
            return Err(self.wait_ended(req));
        }
        if writer {
            let revision = answer.revision();
            return self
                .writer_standing(req, key, lease, &answer, revision, started)
                .await;
        }
        let queue = self.members(&req.name, answer.range().unwrap_or_default())?;
        let Some(at) = queue.iter().position(|m| m.kv.key == key) else {
            return Err(self.wait_ended(req));
        };
        if let Some(first) = queue[..at].iter().position(|m| m.entry.owner == req.owner) {
            let revision = answer.revision();
            return self
                .behind_owner(req, &queue, first, Some(at), lease, revision, started)
                .await;
        }
        let here = standing(&queue, at);
        let Some(waiting) = here.waiting else {
            let modified = queue[at].kv.mod_revision;
            return Ok(self.granted(req, key, lease, create, modified, 1, started));
        };
        let busy = self.busy(queue.first(), Some(here.position), answer.revision());
        self.queued(req, key.to_vec(), lease, create, waiting, started);
        Ok(busy)
    }

    pub(super) fn wait_ended(&self, req: &AcquireRequest) -> Error {
        self.forget(&req.lease);
        Error::WaitEnded {
            name: req.name.to_string(),
            reason: "our place in etcd's queue is gone: its lease expired while this process could not renew it (paused, or cut off from etcd)".into(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn granted(
        &self,
        req: &AcquireRequest,
        key: &[u8],
        lease: EtcdLease,
        create: i64,
        modified: i64,
        holds: u32,
        started: Instant,
    ) -> Attempt {
        self.record(
            &req.lease,
            Acquisition {
                key: key.to_vec(),
                marker: marker_key(&req.name, &req.owner, key),
                lease: Some(lease),
                state: State::Held { create, modified },
                hold: None,
            },
        );
        Attempt::Granted(grant(req, lease, create, holds, started))
    }

    /// Records our key as waiting in the queue.
    pub(super) fn queued(
        &self,
        req: &AcquireRequest,
        key: Vec<u8>,
        lease: EtcdLease,
        create: i64,
        waiting: Waiting,
        started: Instant,
    ) {
        self.record(
            &req.lease,
            Acquisition {
                marker: marker_key(&req.name, &req.owner, &key),
                key,
                lease: Some(lease),
                state: State::Queued {
                    create,
                    waiting,
                    attempted: started,
                },
                hold: None,
            },
        );
    }

    /// Busy for an acquisition that is not in the queue: wait for the holder to go (or,
    /// with several keys, for any key to go).
    pub(super) fn outside(
        &self,
        req: &AcquireRequest,
        queue: &[Member],
        prefix: &[u8],
        revision: i64,
    ) -> Attempt {
        let blocker = match queue {
            [only] => Blocker::Key(only.kv.key.clone()),
            _ => Blocker::Queue(prefix.to_vec()),
        };
        self.record(
            &req.lease,
            Acquisition {
                key: Vec::new(),
                marker: Vec::new(),
                lease: None,
                state: State::Outside { blocker },
                hold: None,
            },
        );
        self.busy(queue.first(), None, revision)
    }

    /// `first`: the queue's first key.
    pub(super) fn busy(
        &self,
        first: Option<&Member>,
        position: Option<usize>,
        revision: i64,
    ) -> Attempt {
        Attempt::Busy(Busy {
            holder: first.map(|m| holder_info(m, Duration::ZERO)),
            position,
            // Deletions are watched, lease expiries included: no timer needed.
            retry_in: None,
            watermark: Watermark(revision as u64),
        })
    }

    /// Takes back a key we put but will not wait with (a try that found the lock busy).
    pub(super) async fn withdraw(
        &self,
        id: &LeaseId,
        key: &[u8],
        marker: &[u8],
        create: i64,
        lease: EtcdLease,
    ) -> Result<()> {
        self.forget(id);
        let answer = self
            .call_txn(txn(
                vec![Compare::created_at(key, create)],
                remove(key, marker),
                vec![],
            ))
            .await?;
        if answer.succeeded {
            self.spare(lease);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::LockName;

    fn request(name: &LockName, owner: &str) -> AcquireRequest {
        AcquireRequest {
            name: name.clone(),
            lease: LeaseId::random(),
            owner: owner.to_string(),
            kind: LockKind::Exclusive,
            ttl: Duration::from_secs(30),
            fair: true,
            enqueue: true,
            waited: Duration::ZERO,
            requester: Arc::new(crate::store::Requester::this_process()),
        }
    }

    /// An acquire whose answer was lost had queued its key; retried, it finds its owner's
    /// older key first. Its lease must not be spared while its key is queued (run by
    /// `leasehold torture` on etcd with store restarts, one spare lease backed two
    /// acquisitions and a holder's key was revoked under it). Against a real etcd; the
    /// lost answer is the state the store records for one: the key put, the answer not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retried_attempt_takes_back_its_key_before_it_spares_the_lease() {
        let server = tokio::task::spawn_blocking(leasehold_testkit::EtcdServer::start)
            .await
            .unwrap();
        let store = EtcdStore::connect(&server.url()).await.unwrap();
        let name = LockName::new("lost-answer").unwrap();
        let older = request(&name, "o");
        assert!(matches!(
            store.attempt(&older).await.unwrap(),
            Attempt::Granted(_)
        ));
        // The retried request's first attempt: its key and its owner's marker put, then
        // the answer lost.
        let retried = request(&name, "o");
        let lease = store.lease_for(retried.ttl).await.unwrap();
        let key = queue_key(&name, lease.id);
        let marker = marker_key(&name, "o", &key);
        let entry = Entry {
            owner: "o".into(),
            host: "h".into(),
            pid: 1,
            kind: LockKind::Exclusive,
            since: now_ms(),
            holds: vec![retried.lease.clone()],
        };
        store
            .call_txn(txn(
                vec![],
                vec![
                    put_on(lease.id, &key, &entry.value()),
                    put_on(lease.id, &marker, &key),
                ],
                vec![],
            ))
            .await
            .unwrap();
        store.record(
            &retried.lease,
            Acquisition {
                key: key.clone(),
                marker,
                lease: Some(lease),
                state: State::Unknown,
                hold: None,
            },
        );
        // The retry re-enters the older key, which holds.
        match store.attempt(&retried).await.unwrap() {
            Attempt::Granted(grant) => assert_eq!(grant.holds, 2),
            Attempt::Busy(_) => panic!("the owner holds: it re-enters"),
        }
        let spared = store.inner.spare.lock().unwrap().clone();
        let (queue, _) = store.queue(&name).await.unwrap();
        for lease in spared.values().flatten() {
            let named = queue_key(&name, lease.id);
            assert!(
                queue.iter().all(|m| m.kv.key != named),
                "lease {:x} is spare while its key is queued",
                lease.id
            );
        }
        assert_eq!(queue.len(), 1, "only the older key is left");
    }
}
