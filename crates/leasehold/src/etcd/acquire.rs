//! The attempt: a pass puts our key into the queue (or a waiting key reads its place
//! again) and settles where it stands; a pass that cannot settle starts again.

use tokio::time::Instant;

use super::acquisitions::{conflict, Acquisition, Ours, State};
use super::queue::*;
use super::rpc::{self, prefix_end, Compare, KeyValue, Op, TxnRequest, TxnResponse};
use super::{try_per_member, EtcdLease, EtcdStore, Pass};
use crate::store::{AcquireRequest, Attempt, Busy, LockKind};
use crate::{rules, Error, Locked, Result};

/// Why a pass of an attempt starts again from the top.
#[derive(Clone, Copy, Debug)]
pub(super) enum Retry {
    /// The spare lease our key was to go on had ended in etcd: the next pass takes
    /// another.
    LeaseEnded,
    /// The queue was busy, and the Txn did not carry the join: join now.
    Join,
    /// Our owner's markers were there without their keys: cleared, join again.
    StaleMarkers,
    /// Our owner waits, and our key now waits behind its key: see where it stands.
    BesideOwner,
    /// The key we were to re-enter was gone: nothing was put.
    KeyGone,
}

/// What a pass starts from: our key waiting in the queue (with its place, the revision
/// it was read at, and what it was told); a re-entry whose answer was lost, on its lease;
/// or a key to put.
enum Known {
    Queued(Ours, Waiting, i64, Box<Busy>),
    LostReentry(EtcdLease),
    Other,
}

/// What one pass of an attempt comes to.
pub(super) type Step = Pass<Attempt, Retry>;

/// What a pass puts: our key (and our owner's marker, if it joins a busy queue), on a
/// lease.
struct Put {
    key: Vec<u8>,
    lease: EtcdLease,
    entry: Entry,
    /// A mutex try: the key goes in only if the queue is empty.
    only_if_free: bool,
    /// The queue was busy last time: the Txn carries the join (on a waiter's lease, if
    /// the request waits).
    joins: bool,
    /// The lease is new to this acquisition (nothing was put on it before).
    fresh: bool,
}

impl Put {
    /// Our key, on our lease.
    fn key_op(&self) -> Op {
        put_on(self.lease.id, &self.key, &self.entry.value())
    }

    /// Our key and our owner's marker, on our lease.
    fn ops(&self, req: &AcquireRequest) -> Vec<Op> {
        let marker = marker_key(&req.name, &req.owner, &self.key);
        vec![self.key_op(), put_on(self.lease.id, &marker, &self.key)]
    }
}

impl EtcdStore {
    /// Attempts to acquire: passes until one settles. A pass that cannot settle starts
    /// again from the top, for one of the reasons [`Retry`] names.
    pub(super) async fn attempt(&self, req: &AcquireRequest) -> Result<Attempt> {
        loop {
            match self.pass(req).await? {
                Pass::Done(attempt) => return Ok(attempt),
                Pass::Again(why) => {
                    tracing::trace!(name = %req.name, ?why, "etcd: attempting again");
                }
            }
        }
    }

    /// One pass: a waiting key looks again where it stands; anything else puts its key.
    ///
    /// Each call that talks to etcd is boxed: thousands of waiters' attempts wait for
    /// their admission at once, and each would otherwise carry the largest of these
    /// calls' states (about 12 KB) while it waits.
    async fn pass(&self, req: &AcquireRequest) -> Result<Step> {
        let started = Instant::now();
        match self.known(req, started) {
            Known::Queued(ours, waiting, seen, busy) => {
                if !waiting.second && self.line_covers(req, &ours.key, seen) {
                    return Box::pin(self.recheck_in_line(req, ours, waiting, *busy)).await;
                }
                return Box::pin(self.recheck(req, ours, waiting.second)).await;
            }
            Known::LostReentry(lease) => {
                // A re-entry whose answer was lost: its hold key, if it was put, goes with
                // its lease. (Reused for a queue key, the lease would keep it.)
                Box::pin(self.revoke(lease.id)).await?;
                self.forget(&req.lease);
            }
            Known::Other => {}
        }
        // One admission for the whole put (lease, Txn, join): admitted call by call,
        // thousands of waiters arriving at once would each get their waiter lease early
        // and put their key seconds later, on a lease about to end. What is known of the
        // attempt is read once admitted: thousands wait here, with nothing but the wait.
        let _admitted = self.inner.puts.acquire().await;
        Box::pin(async {
            let put = self.prepare(req, self.acquisition(&req.lease)).await?;
            self.put(req, &put, started).await
        })
        .await
    }

    /// What this client knows of `req`'s acquisition that a pass starts from.
    fn known(&self, req: &AcquireRequest, started: Instant) -> Known {
        let acquisitions = self.inner.acquisitions.locked();
        let Some(known) = acquisitions.get(&req.lease) else {
            return Known::Other;
        };
        if let (Some(lease), State::Unknown, Some(_)) = (known.lease, &known.state, &known.hold) {
            return Known::LostReentry(lease);
        }
        match (known.queued(&req.name), &known.state) {
            (Some((ours, waiting)), State::Queued { seen, .. }) => {
                let ours = Ours {
                    attempted: started,
                    ..ours
                };
                let busy = known.state.busy().expect("queued");
                Known::Queued(ours, waiting.clone(), *seen, Box::new(busy))
            }
            _ => Known::Other,
        }
    }

    /// Chooses the lease and names the key a pass puts, and records the attempt as
    /// unanswered until it is.
    async fn prepare(&self, req: &AcquireRequest, known: Option<Acquisition>) -> Result<Put> {
        let prefix = queue_prefix(&req.name);
        // A mutex try takes the lock only if nobody holds or waits; everything that waits
        // joins the queue, non-fair requests too (the rules let them pass waiters, not
        // make them: a waiter outside the queue would not be shown, and readers could
        // pass it).
        let only_if_free = req.kind == LockKind::Exclusive && !req.enqueue;
        // A key that joins a busy queue waits there on a waiter's short lease, so that a
        // waiter that dies holds up the queue for a few seconds, not for the lock's TTL;
        // it moves to a lease of the full TTL when it is let in (`on_full_lease`).
        let joins = !only_if_free && self.inner.busy_queues.locked().contains(&prefix);
        let fresh = known.as_ref().is_none_or(|a| a.lease.is_none());
        let (lease, key) = match known.and_then(|a| Some((a.lease?, a.key))) {
            // An earlier put of this request may have gone in: the same key again.
            Some((lease, key)) if lease.shared => (lease, key.key_in(&req.name)),
            Some((lease, _)) => (lease, queue_key(&req.name, lease.id)),
            None if joins && req.enqueue => {
                // Named by an id of its own: the lease is the waiters' shared one.
                let id = super::leases::random_id();
                (
                    self.waiter_lease_for(req.ttl).await?,
                    queue_key(&req.name, id),
                )
            }
            None => {
                let lease = self.lease_for(req.ttl).await?;
                (lease, queue_key(&req.name, lease.id))
            }
        };
        self.record(
            &req.lease,
            Acquisition {
                key: KeyId::of(&key),
                owner: Acquisition::owner_of(&req.lease, &req.owner),
                lease: Some(lease),
                state: State::Unknown,
                hold: None,
            },
        );
        let entry = Entry::of(req);
        Ok(Put {
            key,
            lease,
            entry,
            only_if_free,
            joins,
            fresh,
        })
    }

    /// The Txn that puts our key: into an empty queue, the key alone (nothing to read
    /// back, no marker needed); else, unless only a free lock will do, the key joins the
    /// queue: in the same Txn where the queue was busy last time, else in a second one.
    /// etcd takes about 35 µs longer over a Txn that carries the nested join, which an
    /// uncontended lock would pay on every acquire.
    fn put_txn(&self, req: &AcquireRequest, put: &Put) -> TxnRequest {
        let prefix = queue_prefix(&req.name);
        let everyone = Compare::empty(&prefix, &prefix_end(&prefix));
        if put.only_if_free {
            return txn(
                vec![everyone],
                vec![put.key_op()],
                vec![range_queue(&prefix)],
            );
        }
        // As decided with the lease (a waiting key goes on the waiters' shared one); made
        // only when sent, as an uncontended acquire does not send it.
        let join = match put.joins {
            true => vec![Op::Txn(Box::new(self.join_txn(req, put, &prefix)))],
            false => Vec::new(),
        };
        txn(vec![everyone], vec![put.key_op()], join)
    }

    /// The join: our key and our owner's marker, unless our owner's marker is there (then
    /// read the queue to find the owner's key); with what a waiter needs to know of the
    /// queue.
    fn join_txn(&self, req: &AcquireRequest, put: &Put, prefix: &[u8]) -> TxnRequest {
        let owners = owner_markers(&req.name, &req.owner);
        let mut join = put.ops(req);
        if req.kind == LockKind::Exclusive {
            join.extend(writer_view(prefix));
        } else {
            join.push(range_queue(prefix));
        }
        txn(
            vec![Compare::empty(&owners, &prefix_end(&owners))],
            join,
            vec![range_queue(prefix), range_prefix(&owners, false)],
        )
    }

    /// Sends a pass's put and reads what it found.
    async fn put(&self, req: &AcquireRequest, put: &Put, started: Instant) -> Result<Step> {
        let prefix = queue_prefix(&req.name);
        let answer = match self.call_txn(self.put_txn(req, put)).await {
            Err(Error::Unavailable { source, .. })
                if source.to_string().contains("requested lease not found") =>
            {
                // A spare lease that etcd ended (revoked by hand, or a restore), or the
                // waiters' lease: drop it.
                if put.lease.shared {
                    self.waiter_lease_ended(put.lease.id);
                }
                self.forget(&req.lease);
                return Ok(Pass::Again(Retry::LeaseEnded));
            }
            other => other?,
        };
        let revision = answer.revision();
        if !put.only_if_free
            && self.seen_busy(&prefix, !answer.succeeded)
            && answer.nested().is_none()
        {
            // Busy, and the Txn did not carry the join: join now, on a waiter's lease if
            // this one is new (nothing was put on it).
            if put.fresh && req.enqueue {
                self.forget(&req.lease);
                self.spare(put.lease);
            }
            return Ok(Pass::Again(Retry::Join));
        }
        // The join's answer when the queue was not empty.
        let joined = answer.nested().unwrap_or(&answer);
        if req.kind == LockKind::Exclusive && joined.succeeded && answer.nested().is_some() {
            return self
                .writer_standing(req, &put.key, put.lease, joined, revision, started)
                .await;
        }
        let queue = match joined.range() {
            Some(kvs) => self.members(&req.name, kvs)?,
            // Put into an empty queue: ours alone.
            None => vec![Member {
                kv: KeyValue {
                    key: put.key.clone(),
                    create_revision: revision,
                    mod_revision: revision,
                    value: Vec::new(),
                    lease: put.lease.id,
                },
                entry: put.entry.clone(),
            }],
        };
        self.placed(req, put, &queue, joined, revision, started)
            .await
    }

    /// Where a pass's put leaves us in `queue`: refused, outside, behind our owner's key,
    /// or in a place of our own.
    async fn placed(
        &self,
        req: &AcquireRequest,
        put: &Put,
        queue: &[Member],
        joined: &TxnResponse,
        revision: i64,
        started: Instant,
    ) -> Result<Step> {
        let (key, lease) = (&put.key, put.lease);
        // Our key: put now, or by an earlier attempt of this request whose answer was lost
        // (then this put found the marker and did nothing). Its lease is spared only once
        // the key is gone: a spare lease must have no key.
        let mine = queue.iter().position(|m| m.kv.key == *key);
        let refused =
            (queue.iter()).find_map(|m| rules::same_primitive(m.entry.kind, req.kind).err());
        if let Some(refusal) = refused {
            let create = mine.map(|i| queue[i].kv.create_revision);
            return Err(self.refuse(req, key, create, lease, refusal).await);
        }
        // Our owner's first key: ours, or an earlier one (we re-enter it if it holds, and
        // else wait behind it in a place of our own).
        let Some(at) = queue.iter().position(|m| *m.entry.owner == *req.owner) else {
            if !joined.succeeded && !put.only_if_free {
                // Markers without their keys (a key deleted alone, by hand or by an older
                // version): clear them and join again.
                self.clear_markers(joined).await?;
                return Ok(Pass::Again(Retry::StaleMarkers));
            }
            // Not queued (the lock was busy for a mutex try).
            self.spare(lease);
            let prefix = queue_prefix(&req.name);
            return Ok(Pass::Done(self.outside(req, queue, &prefix, revision)));
        };
        match mine {
            Some(mine) if mine == at => {
                let ours = Ours {
                    key: key.clone(),
                    lease,
                    create: queue[at].kv.create_revision,
                    attempted: started,
                };
                let (modified, here) = (queue[at].kv.mod_revision, standing(queue, at));
                self.settle(req, ours, modified, here, queue.first(), revision)
                    .await
            }
            None if standing(queue, at).waiting.is_some() && req.enqueue => {
                // Our owner waits: we wait too, in a place of our own, as the rules
                // queue every waiting request. Put our key and look again.
                self.call_txn(txn(vec![], put.ops(req), vec![])).await?;
                Ok(Pass::Again(Retry::BesideOwner))
            }
            None => {
                // Nothing of ours is in etcd but the lease: forget the record that names
                // it before sparing it, so that an undo of this attempt (cancelled while it
                // re-enters) cannot revoke it under the acquisition that takes it next.
                self.forget(&req.lease);
                self.spare(lease);
                self.behind_owner(req, queue, at, None, lease, revision, started)
                    .await
            }
            // Put by an earlier attempt, or just now.
            Some(mine) if mine > at => {
                self.behind_owner(req, queue, at, Some(mine), lease, revision, started)
                    .await
            }
            Some(_) => Err(self.wait_ended(req)),
        }
    }

    /// Deletes the owner markers a join found (read in its failure branch) whose keys are
    /// gone.
    async fn clear_markers(&self, joined: &TxnResponse) -> Result<()> {
        let stale = joined.ranges().nth(1).map_or(&[][..], |r| &r.kvs[..]);
        for stale in stale {
            self.call_txn(txn(
                vec![Compare::modified_at(&stale.key, stale.mod_revision)],
                vec![delete(&stale.key)],
                vec![],
            ))
            .await?;
        }
        Ok(())
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
    ) -> Result<Step> {
        let holds = standing(queue, first).waiting.is_none();
        let mine = match mine {
            Some(mine) if !holds && req.enqueue => mine,
            _ => {
                if let Some(m) = mine.map(|i| &queue[i]) {
                    self.withdraw(req, &m.kv.key, m.kv.create_revision, lease)
                        .await?;
                }
                if holds {
                    return self.reenter(req, &queue[first], started).await;
                }
                let prefix = queue_prefix(&req.name);
                return Ok(Pass::Done(self.outside(req, queue, &prefix, revision)));
            }
        };
        let ahead: std::sync::Arc<[KeyId]> =
            queue[..mine].iter().map(|m| KeyId::of(&m.kv.key)).collect();
        let here = Standing {
            waiting: Some(Waiting {
                room: count(ahead.len() - 1),
                ahead,
                second: true,
            }),
            position: standing(queue, mine).position,
        };
        let ours = Ours {
            key: queue[mine].kv.key.clone(),
            lease,
            create: queue[mine].kv.create_revision,
            attempted: started,
        };
        let modified = queue[mine].kv.mod_revision;
        self.settle(req, ours, modified, here, queue.first(), revision)
            .await
    }

    /// A writer's place from [`writer_view`]'s answer (after its put, or a recheck).
    async fn writer_standing(
        &self,
        req: &AcquireRequest,
        key: &[u8],
        lease: EtcdLease,
        answer: &TxnResponse,
        revision: i64,
        started: Instant,
    ) -> Result<Step> {
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
        if let Some(first) = first
            .as_ref()
            .filter(|f| *f.entry.owner == *req.owner && f.kv.key != key)
        {
            // Our owner holds through a key put into an empty queue: re-enter it.
            self.withdraw(req, key, create, lease).await?;
            return self.reenter(req, first, started).await;
        }
        let refused = first
            .as_ref()
            .and_then(|f| rules::same_primitive(f.entry.kind, req.kind).err());
        if let Some(refusal) = refused {
            return Err(self.refuse(req, key, Some(create), lease, refusal).await);
        }
        let here = Standing {
            waiting: writer_waiting(at, |i| &keys[i].key),
            position: at,
        };
        let ours = Ours {
            key: key.to_vec(),
            lease,
            create,
            attempted: started,
        };
        self.settle(req, ours, modified, here, first.as_ref(), revision)
            .await
    }

    /// A waiting acquisition tries again: is its key still there, and where?
    async fn recheck(&self, req: &AcquireRequest, ours: Ours, second: bool) -> Result<Step> {
        let (key, started) = (&ours.key[..], ours.attempted);
        let Some(lease) = self.current(ours.lease) else {
            return Err(self.wait_ended(req));
        };
        let prefix = queue_prefix(&req.name);
        // The waiters' shared lease has a keeper of its own.
        let due = !lease.shared && lease.left(started) * 3 < lease.ttl() * 2;
        // A writer's own key, first of its owner's, reads the keys and the first value; a
        // key behind its owner's reads the whole queue (whose keys are whose).
        let writer = req.kind == LockKind::Exclusive && !second;
        let view = if writer {
            writer_view(&prefix).into()
        } else {
            vec![range_queue(&prefix)]
        };
        // A waiting key is on a short lease (a waiter lease): like a renewal, each member
        // gets a sixth of it while another is left, so a paused member cannot keep the
        // keepalive from another one in time. (The check only reads.)
        let per_member = try_per_member(lease.ttl());
        let check = rpc::trying_each_for(
            per_member,
            self.call_txn(txn(
                vec![Compare::created_at(key, ours.create)],
                view,
                vec![],
            )),
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
        let revision = answer.revision();
        if writer {
            return self
                .writer_standing(req, key, lease, &answer, revision, started)
                .await;
        }
        let queue = self.members(&req.name, answer.range().unwrap_or_default())?;
        let Some(at) = queue.iter().position(|m| m.kv.key == key) else {
            return Err(self.wait_ended(req));
        };
        if let Some(first) = queue[..at]
            .iter()
            .position(|m| *m.entry.owner == *req.owner)
        {
            return self
                .behind_owner(req, &queue, first, Some(at), lease, revision, started)
                .await;
        }
        let (modified, here) = (queue[at].kv.mod_revision, standing(&queue, at));
        let ours = Ours { lease, ..ours };
        self.settle(req, ours, modified, here, queue.first(), revision)
            .await
    }

    /// Records our key as waiting, `busy`: the next recheck keeps our waiter lease alive,
    /// due while half of what is left remains (a lease granted before the put waited for
    /// its admission may have had much of its TTL run out). The waiters' shared lease
    /// needs no recheck: its keeper keeps it alive.
    fn wait_queued(
        &self,
        req: &AcquireRequest,
        ours: Ours,
        waiting: Waiting,
        mut busy: Busy,
    ) -> Attempt {
        if !ours.lease.shared {
            busy.retry_in = Some(ours.lease.left(Instant::now()) / 2);
        }
        self.queued(req, ours, waiting, &busy);
        Attempt::Busy(busy)
    }

    /// Whether the process's line of our queue has watched every deletion there since
    /// revision `seen`, and none of them was our key.
    fn line_covers(&self, req: &AcquireRequest, key: &[u8], seen: i64) -> bool {
        (self.inner.lines.get(&queue_prefix(&req.name))).is_some_and(|l| l.covers(key, seen))
    }

    /// A recheck that the line answers: where our key stands follows from the deletions
    /// it has watched since our last read (see [`deletion_lets_in`](Self::deletion_lets_in)), so
    /// the recheck only keeps our waiter lease alive, one message on the client's
    /// keepalive stream instead of a read of the queue. Thousands of waiters of one
    /// process cost etcd their keepalives, no reads. A keepalive that fails falls back
    /// to a full recheck.
    async fn recheck_in_line(
        &self,
        req: &AcquireRequest,
        ours: Ours,
        waiting: Waiting,
        busy: Busy,
    ) -> Result<Step> {
        let Some(lease) = self.current(ours.lease) else {
            return Err(self.wait_ended(req));
        };
        let renewed = match !lease.shared && lease.left(ours.attempted) * 3 < lease.ttl() * 2 {
            true => {
                let per_member = try_per_member(lease.ttl());
                rpc::trying_each_for(per_member, self.keep_alive(lease)).await
            }
            false => Ok(Some(lease)),
        };
        match renewed {
            Ok(Some(lease)) => {
                let ours = Ours { lease, ..ours };
                Ok(Pass::Done(self.wait_queued(req, ours, waiting, busy)))
            }
            Ok(None) => Err(self.wait_ended(req)),
            // Boxed: a full recheck is about 6 KB, and a keepalive that goes through
            // (thousands of waiters' at a time) needs none of it.
            Err(_) => Box::pin(self.recheck(req, ours, false)).await,
        }
    }

    /// The decision every pass ends in once it knows where our key stands: granted; a
    /// try that would wait takes its key back and is busy; else queued, and busy.
    /// `first`: the queue's first key.
    async fn settle(
        &self,
        req: &AcquireRequest,
        ours: Ours,
        modified: i64,
        here: Standing,
        first: Option<&Member>,
        revision: i64,
    ) -> Result<Step> {
        let Some(waiting) = here.waiting else {
            return Ok(Pass::Done(self.granted(req, &ours, modified)));
        };
        if !req.enqueue {
            self.withdraw(req, &ours.key, ours.create, ours.lease)
                .await?;
            return Ok(Pass::Done(self.busy(first, None, revision)));
        }
        let Attempt::Busy(busy) = self.busy(first, Some(here.position), revision) else {
            unreachable!("busy is busy")
        };
        Ok(Pass::Done(self.wait_queued(req, ours, waiting, busy)))
    }

    /// Refused by the rules: takes back our key if we put one (created at `create`), and
    /// says why (or what went wrong taking it back).
    async fn refuse(
        &self,
        req: &AcquireRequest,
        key: &[u8],
        create: Option<i64>,
        lease: EtcdLease,
        refusal: rules::Refusal,
    ) -> Error {
        match create {
            Some(create) => {
                if let Err(error) = self.withdraw(req, key, create, lease).await {
                    return error;
                }
            }
            None => {
                self.forget(&req.lease);
                self.spare(lease);
            }
        }
        conflict(req, refusal)
    }

    /// Takes back a key we put but will not wait with (a try that found the lock busy).
    pub(super) async fn withdraw(
        &self,
        req: &AcquireRequest,
        key: &[u8],
        create: i64,
        lease: EtcdLease,
    ) -> Result<()> {
        self.forget(&req.lease);
        let marker = marker_key(&req.name, &req.owner, key);
        let answer = self
            .call_txn(txn(
                vec![Compare::created_at(key, create)],
                remove(key, &marker),
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
pub(super) mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::store::LeaseId;
    use crate::LockName;

    pub(in crate::etcd) fn request(name: &LockName, owner: &str) -> AcquireRequest {
        AcquireRequest {
            name: name.clone(),
            lease: LeaseId::random(),
            owner: owner.into(),
            kind: LockKind::Exclusive,
            ttl: Duration::from_secs(30),
            fair: true,
            enqueue: true,
            waited_since: None,
            requester: Arc::new(crate::store::Requester::this_process()),
            value: None,
        }
    }

    /// A store on an etcd server of its own (keep the server for as long as the store).
    pub(in crate::etcd) async fn started() -> (leasehold_testkit::EtcdServer, EtcdStore) {
        let server = tokio::task::spawn_blocking(leasehold_testkit::EtcdServer::start)
            .await
            .unwrap();
        let store = EtcdStore::connect(&server.url()).await.unwrap();
        (server, store)
    }

    /// Puts `req`'s key and its owner's marker on `lease`, as an attempt would: the key,
    /// the marker and the key's create revision.
    pub(in crate::etcd) async fn put_key(
        store: &EtcdStore,
        req: &AcquireRequest,
        lease: EtcdLease,
    ) -> (Vec<u8>, Vec<u8>, i64) {
        let key = queue_key(&req.name, lease.id);
        let marker = marker_key(&req.name, &req.owner, &key);
        let entry = Entry {
            owner: req.owner.to_string(),
            host: "h".into(),
            pid: 1,
            kind: LockKind::Exclusive,
            since: now_ms(),
            holds: vec![req.lease.clone()],
            value: None,
        };
        let answer = store
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
        (key, marker, answer.revision())
    }

    /// A waiter that gives up on a join whose answer never came deletes its key by name,
    /// and etcd may apply the put after that: the key is deleted again. Left on the
    /// waiters' shared lease, which the client's other waiters keep alive, it would reach
    /// the head of the queue held by nobody and keep them out (a first user's trial of
    /// many cancelled waits). The late put is made by hand here.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_key_put_after_its_waiter_gave_up_is_deleted_again() {
        use crate::store::Store;
        let (_server, store) = started().await;
        let name = LockName::new("late-put").unwrap();
        let (gave_up, other) = (request(&name, "gave-up"), request(&name, "other"));
        let lease = store.waiter_lease_for(gave_up.ttl).await.unwrap();
        let unanswered = |req: &AcquireRequest| Acquisition {
            key: KeyId::of(&queue_key(&name, super::super::leases::random_id())),
            owner: Acquisition::owner_of(&req.lease, &req.owner),
            lease: Some(lease),
            state: State::Unknown,
            hold: None,
        };
        let late = unanswered(&gave_up);
        let key = late.key.key_in(&name);
        store.record(&gave_up.lease, late);
        // Another waiter of the client on the same lease keeps it alive.
        store.record(&other.lease, unanswered(&other));
        let _ = store.release(&gave_up.lease()).await.unwrap();
        store
            .call_txn(txn(vec![], vec![put_on(lease.id, &key, b"{}")], vec![]))
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !store.range(range_key(&key)).await.unwrap().kvs.is_empty() {
            assert!(Instant::now() < deadline, "the late key is still there");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// An acquire whose answer was lost had queued its key; retried, it finds its owner's
    /// older key first. Its lease must not be spared while its key is queued (run by
    /// `leasehold torture` on etcd with store restarts, one spare lease backed two
    /// acquisitions and a holder's key was revoked under it). Against a real etcd; the
    /// lost answer is the state the store records for one: the key put, the answer not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retried_attempt_takes_back_its_key_before_it_spares_the_lease() {
        let (_server, store) = started().await;
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
        let (key, _, _) = put_key(&store, &retried, lease).await;
        store.record(
            &retried.lease,
            Acquisition {
                key: KeyId::of(&key),
                owner: Acquisition::owner_of(&retried.lease, &retried.owner),
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

    /// A recheck that a waiter's line answers is a keepalive: thousands of waiters' are
    /// on their way at a time, so it must not carry a full recheck's state (6 KB and
    /// more).
    #[tokio::test]
    async fn a_recheck_in_line_carries_its_keepalive_alone() {
        let (_server, store) = started().await;
        let req = request(&LockName::new("small-recheck").unwrap(), "o");
        let ours = Ours {
            key: Vec::new(),
            lease: super::super::leases::borrowed(1),
            create: 1,
            attempted: Instant::now(),
        };
        let waiting = Waiting {
            ahead: Arc::from([]),
            room: 0,
            second: false,
        };
        let busy = Busy {
            holder: None,
            position: None,
            retry_in: None,
            watermark: crate::store::Watermark(0),
        };
        let recheck = store.recheck_in_line(&req, ours, waiting, busy);
        let size = std::mem::size_of_val(&recheck);
        assert!(size <= 2048, "recheck_in_line: {size} bytes");
    }
}
