//! Leases: each acquisition's etcd lease, the pool of spare leases a process reuses,
//! keepalives, renewing a hold (a re-entry's in reentry.rs), and moving a key onto a
//! longer lease.

use std::time::Duration;

use tokio::time::Instant;

use super::acquisitions::{Acquisition, State};
use super::queue::{marker_key, put_on, range_key, txn, Entry};
use super::rpc::{
    self, Compare, KeyValue, LeaseGrantRequest, LeaseGrantResponse, LeaseTimeToLiveResponse,
};
use super::{try_per_member, EtcdStore, Pass};
use crate::store::{AcquireRequest, Grant, Lease, LeaseId, Renewal};
use crate::{Locked, Result};

/// Spare leases kept per TTL: enough for the acquisitions a process makes at once on
/// many locks; a burst of releases (thousands of waiters served) would otherwise leave
/// a lease per waiter in etcd until its TTL.
const MAX_SPARE: usize = 64;

/// Tries of a revoke in the background.
const REVOKE_TRIES: usize = 3;

/// An etcd lease and how long it is surely alive.
#[derive(Clone, Copy, Debug)]
pub(super) struct EtcdLease {
    pub(super) id: i64,
    /// Seconds etcd granted. (32 bits, as `asked`: every waiter's record keeps a lease.)
    pub(super) ttl: u32,
    /// Seconds asked for: the spare list it goes back to.
    pub(super) asked: u32,
    /// Request time of the last grant or keepalive plus the TTL: etcd cannot end the
    /// lease earlier.
    pub(super) alive_until: Instant,
    /// Granted by this client for one acquisition (not borrowed from a re-entered key),
    /// so it may be reused once that acquisition's key is gone.
    pub(super) ours: bool,
    /// The waiter lease this client's waiting keys share (see `waiters.rs`): kept alive
    /// by a task of its own, never spared, never revoked while in use.
    pub(super) shared: bool,
}

impl EtcdLease {
    pub(super) fn left(&self, now: Instant) -> Duration {
        self.alive_until.saturating_duration_since(now)
    }

    pub(super) fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl.into())
    }
}

/// Whole seconds of etcd lease covering `ttl`.
pub(super) fn lease_seconds(ttl: Duration) -> i64 {
    (ttl.as_millis().div_ceil(1000) as i64).max(1)
}

/// etcd's seconds (an `i64`) as kept, within 0..=u32::MAX (far above the longest TTL).
fn seconds_u32(seconds: i64) -> u32 {
    seconds.clamp(0, u32::MAX.into()) as u32
}

/// A random id, positive (etcd's lease ids, and the ids that name waiting keys).
pub(super) fn random_id() -> i64 {
    (rand::random::<i64>() & i64::MAX).max(1)
}

/// A lease another acquisition made, known only by id until a keepalive bounds it.
pub(super) fn borrowed(id: i64) -> EtcdLease {
    EtcdLease {
        id,
        ttl: 0,
        asked: 0,
        alive_until: Instant::now(),
        ours: false,
        shared: false,
    }
}

/// Why a renewal looks again from the top.
#[derive(Clone, Copy, Debug)]
pub(super) enum Relook {
    /// We moved the key onto a longer lease, unanswered: follow it to that lease.
    KeyMoved,
    /// Our re-entry's hold is the key's own now: renew it as that.
    NowCarrier,
    /// The key (or our hold key) changed while we moved it: look again.
    Changed,
}

/// What one pass of a renewal comes to.
pub(super) type Renewing = Pass<Renewal, Relook>;

impl EtcdStore {
    /// Renews acquisition `lease`'s hold for `ttl`: passes until one settles.
    pub(super) async fn renewal(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        loop {
            match self.renew_pass(lease, ttl).await? {
                Pass::Done(renewal) => return Ok(renewal),
                Pass::Again(why) => {
                    tracing::trace!(name = %lease.name, ?why, "etcd: renewing again");
                }
            }
        }
    }

    /// One pass of a renewal: the key's own hold here, a re-entry's in
    /// [`renew_reentry`](Self::renew_reentry).
    async fn renew_pass(&self, lease: &Lease, ttl: Duration) -> Result<Renewing> {
        let (key, etcd_lease, create, hold) = match self.acquisition(&lease.id) {
            Some(Acquisition {
                key,
                lease: Some(etcd_lease),
                state: State::Held { create, .. },
                hold,
                ..
            }) => (key.key_in(&lease.name), etcd_lease, create, hold),
            Some(_) => return Ok(Pass::Done(Renewal::Lost)),
            None => match self.find(&lease.name, &lease.id).await? {
                Some((m, hold, _)) => {
                    let on = hold.as_ref().map_or(m.kv.lease, |h| h.lease);
                    let hold = hold.map(|h| h.key.into());
                    (m.kv.key, borrowed(on), m.kv.create_revision, hold)
                }
                None => return Ok(Pass::Done(Renewal::Lost)),
            },
        };
        if hold.is_some() {
            return self
                .renew_reentry(lease, ttl, &key, etcd_lease, create)
                .await;
        }
        // The key is checked too: a force-release deletes it but leaves the lease.
        // A renewal starts with two thirds of the lease left: room for a try on a member
        // that does not answer, a retry after the guard's back-off, and a healthy member.
        // (Only these two calls, which may be repeated anywhere; not the writes below.)
        let per_member = try_per_member(ttl.min(etcd_lease.ttl()));
        let (alive, current) = tokio::join!(
            rpc::trying_each_for(per_member, self.keep_alive(etcd_lease)),
            rpc::trying_each_for(per_member, self.range(range_key(&key)))
        );
        let (alive, current) = (alive?, current?);
        let Some(kv) = (current.kvs.into_iter().next()).filter(|kv| kv.create_revision == create)
        else {
            self.forget(&lease.id);
            self.moved_off(&lease.id, None);
            return Ok(Pass::Done(Renewal::Lost));
        };
        let carried =
            serde_json::from_slice::<Entry>(&kv.value).is_ok_and(|e| e.holds.contains(&lease.id));
        if !carried {
            // Another hold of our owner took the key onto its lease: ours is a hold key
            // now (or gone).
            return self
                .renew_reentry(lease, ttl, &key, etcd_lease, create)
                .await;
        }
        if kv.lease != etcd_lease.id {
            // We moved the key to a longer lease, unanswered: follow it.
            self.set_lease(&lease.id, borrowed(kv.lease), None);
            return Ok(Pass::Again(Relook::KeyMoved));
        }
        let Some(renewed) = alive else {
            self.forget(&lease.id);
            self.moved_off(&lease.id, None);
            return Ok(Pass::Done(Renewal::Lost));
        };
        self.set_lease(&lease.id, renewed, None);
        // Still on the waiters' shared lease (its move at the grant failed): a lease of
        // its own, so that the hold ends with this guard's renewals.
        if renewed.ttl() < ttl || renewed.shared || self.is_waiter_lease(renewed.id) {
            return self.move_to_longer_lease(lease, &kv, renewed, ttl).await;
        }
        Ok(Pass::Done(Renewal::Renewed))
    }

    /// A lease for a new acquisition: a spare one with at least half its TTL left, or a
    /// new grant.
    pub(super) async fn lease_for(&self, ttl: Duration) -> Result<EtcdLease> {
        let seconds = lease_seconds(ttl);
        let now = Instant::now();
        let mut stale = Vec::new();
        let spare = {
            let mut spare = self.inner.spare.locked();
            let list = spare.entry(seconds).or_default();
            let mut found = None;
            while let Some(lease) = list.pop() {
                if lease.left(now) * 2 >= lease.ttl() {
                    found = Some(lease);
                    break;
                }
                stale.push(lease.id);
            }
            found
        };
        for id in stale {
            self.revoke_later(id);
        }
        match spare {
            Some(lease) => Ok(lease),
            None => self.grant(ttl).await,
        }
    }

    /// A new etcd lease covering `ttl`. The grant finishes even if its caller is
    /// cancelled (a wait that ended meanwhile), and a
    /// lease nobody took is kept spare or revoked, not left in etcd until its TTL.
    pub(super) async fn grant(&self, ttl: Duration) -> Result<EtcdLease> {
        let store = self.clone();
        let (answer, granted) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            if let Err(Ok(lease)) = answer.send(store.grant_now(ttl).await) {
                store.spare(lease);
            }
        });
        granted
            .await
            .unwrap_or_else(|_| Err(self.unavailable(tonic::Status::cancelled("lease grant"))))
    }

    async fn grant_now(&self, ttl: Duration) -> Result<EtcdLease> {
        let seconds = lease_seconds(ttl);
        // Our own id, so that a grant etcd applied but whose answer was lost can be
        // revoked rather than left until its TTL.
        let id = random_id();
        let sent = Instant::now();
        let answer: LeaseGrantResponse = self
            .inner
            .client
            .unary(
                "/etcdserverpb.Lease/LeaseGrant",
                LeaseGrantRequest { ttl: seconds, id },
            )
            .await
            .map_err(|s| {
                // Another's lease has that id: not ours to revoke.
                if !s.message().contains("lease already exists") {
                    self.revoke_later(id);
                }
                self.unavailable(s)
            })?;
        if !answer.error.is_empty() {
            return Err(self.unavailable(tonic::Status::unavailable(answer.error)));
        }
        Ok(EtcdLease {
            id: answer.id,
            ttl: seconds_u32(answer.ttl),
            asked: seconds_u32(seconds),
            alive_until: sent + Duration::from_secs(seconds_u32(answer.ttl).into()),
            ours: true,
            shared: false,
        })
    }

    /// Keeps `lease` for the next acquisition, if fewer than [`MAX_SPARE`] of its TTL are
    /// kept; else revokes it.
    pub(super) fn spare(&self, lease: EtcdLease) {
        if lease.ours && lease.alive_until > Instant::now() {
            {
                let mut spare = self.inner.spare.locked();
                let list = spare.entry(lease.asked.into()).or_default();
                // Twice in the list, one lease would back two acquisitions.
                if list.iter().any(|l| l.id == lease.id) {
                    return;
                }
                if list.len() < MAX_SPARE {
                    list.push(lease);
                    return;
                }
            }
            self.revoke_later(lease.id);
        }
    }

    /// Acquisition `id` is over: revokes the full lease set aside for it, if any, unless
    /// its key stays on it (`kept`: the lease the key stays on, for others' holds).
    pub(super) fn moved_off(&self, id: &LeaseId, kept: Option<i64>) {
        let set_aside = self.inner.moving.locked().remove(id);
        if let Some(lease) = set_aside.filter(|l| Some(l.id) != kept) {
            self.revoke_later(lease.id);
        }
    }

    pub(super) fn revoke_later(&self, id: i64) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let store = self.clone();
            let revokes = &self.inner.revokes;
            revokes.spawn_on(
                async move {
                    // A revoke that failed (etcd busy, a failover) leaves the lease until its
                    // TTL: try again a few times.
                    let mut pause = Duration::from_millis(100);
                    for _ in 0..REVOKE_TRIES - 1 {
                        if store.revoke(id).await.is_ok() {
                            return;
                        }
                        tokio::time::sleep(crate::keepalive::jitter(pause)).await;
                        pause *= 2;
                    }
                    let _ = store.revoke(id).await;
                },
                &runtime,
            );
        }
    }

    /// Revokes every spare lease, and waits for these and the other revokes on their way.
    pub(super) async fn shed_leases(&self) {
        let spare = super::spare_ids(&mut self.inner.spare.locked());
        for id in spare {
            self.revoke_later(id);
        }
        let revokes = &self.inner.revokes;
        revokes.close();
        revokes.wait().await;
        revokes.reopen();
    }

    pub(super) async fn revoke(&self, id: i64) -> Result<()> {
        // Other waiters' keys are on it: its keeper revokes it once none are.
        if self.is_waiter_lease(id) {
            return Ok(());
        }
        let result: std::result::Result<rpc::Empty, _> = self
            .inner
            .client
            .unary("/etcdserverpb.Lease/LeaseRevoke", rpc::LeaseId { id })
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(status) if status.message().contains("not found") => Ok(()),
            Err(status) => Err(self.unavailable(status)),
        }
    }

    /// One LeaseKeepAlive: the lease's new bound, or `None` if etcd no longer has it.
    pub(super) async fn keep_alive(&self, lease: EtcdLease) -> Result<Option<EtcdLease>> {
        let sent = Instant::now();
        let answer =
            (self.inner.client.keep_alive(lease.id).await).map_err(|s| self.unavailable(s))?;
        Ok((answer.ttl > 0).then(|| EtcdLease {
            ttl: seconds_u32(answer.ttl),
            alive_until: sent + Duration::from_secs(seconds_u32(answer.ttl).into()),
            ..lease
        }))
    }

    /// Seconds left of etcd lease `id`, -1 if it has ended.
    pub(super) async fn time_to_live(&self, id: i64) -> Result<i64> {
        let answer: LeaseTimeToLiveResponse = self
            .inner
            .client
            .unary("/etcdserverpb.Lease/LeaseTimeToLive", rpc::LeaseId { id })
            .await
            .map_err(|s| self.unavailable(s))?;
        Ok(answer.ttl)
    }

    /// A key let in while on a waiter's short lease moves to a lease of the lock's TTL
    /// before its grant is returned: a holder's lease is the full TTL (a holder may be
    /// paused for that long), and its guard counts its safe deadline from it. Should the
    /// move fail, the grant stands on the short lease, which the guard's first renewal
    /// lengthens ([`move_to_longer_lease`](Self::move_to_longer_lease)).
    ///
    /// The lock loop drops this future when its wake-up comes first, and asks again: the
    /// full lease is kept aside until the move is seen through, so that the next move
    /// reuses it (rather than leave it in etcd, with or without our key, until its TTL).
    pub(super) async fn on_full_lease(&self, req: &AcquireRequest, grant: Grant) -> Grant {
        // No later than the request the caller counts the grant from was sent.
        let called = Instant::now();
        let Some(Acquisition {
            key,
            lease: Some(short),
            state: State::Held { create, .. },
            hold: None,
            ..
        }) = self.acquisition(&req.lease)
        else {
            return grant;
        };
        // A key on the waiters' shared lease always moves: that lease lives on without
        // our guard's renewals.
        if !short.shared && (!short.ours || i64::from(short.asked) >= lease_seconds(req.ttl)) {
            return grant;
        }
        let key = key.key_in(&req.name);
        let marker = marker_key(&req.name, &req.owner, &key);
        let pending = self.inner.moving.locked().get(&req.lease).copied();
        let full = match pending {
            Some(full) => full,
            None => {
                let Ok(full) = self.lease_for(req.ttl).await else {
                    return grant;
                };
                // No await until it is set aside.
                self.inner.moving.locked().insert(req.lease.clone(), full);
                full
            }
        };
        // The marker too: it must go with the key (a key put into an empty queue has
        // none; one more does no harm, a release deletes it with the key). The entry is
        // written anew, held since now: `since` said when the key joined the queue.
        let entry = Entry::of(req).value();
        let moved = self
            .call_txn(txn(
                vec![Compare::created_at(&key, create)],
                vec![
                    put_on(full.id, &key, &entry),
                    put_on(full.id, &marker, &key),
                ],
                vec![],
            ))
            .await;
        let revision = match moved {
            Ok(answer) if answer.succeeded => answer.revision(),
            Ok(_) => {
                // Our key is gone (the guard's first renewal says so): nothing moved now.
                self.inner.moving.locked().remove(&req.lease);
                match pending {
                    // An earlier move may have put the marker on it.
                    Some(_) => self.revoke_later(full.id),
                    None => self.spare(full),
                }
                return lasting_until(grant, called, called, req.ttl);
            }
            // The key may have moved unseen: the guard's renewal follows it to its lease,
            // which stays set aside for the release to revoke. Until then it lives as
            // long as the shorter-lived of the two leases it may be on.
            Err(_) => {
                let until = short.alive_until.min(full.alive_until);
                return lasting_until(grant, until, called, req.ttl);
            }
        };
        self.inner.moving.locked().remove(&req.lease);
        self.set_lease(&req.lease, full, Some(revision));
        // Not for reuse: the key keeps the short lease's name. (The shared one is not
        // ours to revoke.)
        if !short.shared {
            self.revoke_later(short.id);
        }
        lasting_until(grant, full.alive_until, called, req.ttl)
    }

    /// `extend` asked for a longer TTL than the key's etcd lease has: put the key on a
    /// new lease of that length (the key, and so the token, stays).
    pub(super) async fn move_to_longer_lease(
        &self,
        lease: &Lease,
        kv: &KeyValue,
        old: EtcdLease,
        ttl: Duration,
    ) -> Result<Renewing> {
        let new = self.grant(ttl).await?;
        let mut moves = vec![put_on(new.id, &kv.key, &kv.value)];
        if let Ok(entry) = serde_json::from_slice::<Entry>(&kv.value) {
            moves.push(put_on(
                new.id,
                &marker_key(&lease.name, &entry.owner, &kv.key),
                &kv.key,
            ));
        }
        let answer = self
            .call_txn(txn(
                vec![Compare::modified_at(&kv.key, kv.mod_revision)],
                moves,
                vec![],
            ))
            .await?;
        if !answer.succeeded {
            // Changed meanwhile: look again.
            self.spare(new);
            return Ok(Pass::Again(Relook::Changed));
        }
        self.set_lease(&lease.id, new, Some(answer.revision()));
        if old.ours {
            // Not for reuse: the key keeps the old lease's name, and a key named after a
            // spare lease must not exist.
            self.revoke_later(old.id);
        }
        Ok(Pass::Done(Renewal::Renewed))
    }
}

/// `grant` with its lease as what is left, from `called`, of a key's lease that lasts
/// until `until`: the caller counts it from its request's send, which is no later than
/// `called`. (The full TTL when that is left, as for a lease granted since; none when the
/// key is gone: a renewal then decides.)
///
/// From the key's lease itself, not from the lease it waited on: the waiters' shared
/// lease often outlives a short TTL's full lease, and counting from it would let a
/// paused holder believe in its grant after etcd had ended it.
fn lasting_until(grant: Grant, until: Instant, called: Instant, ttl: Duration) -> Grant {
    Grant {
        lease: super::acquisitions::lease_left(until.saturating_duration_since(called), ttl),
        ..grant
    }
}

#[cfg(test)]
pub(super) mod tests {
    use futures_util::FutureExt;

    use super::super::acquire::tests::{put_key, request, started};
    use super::super::queue::KeyId;
    use super::*;
    use crate::store::{Released, Store};
    use crate::{FencingToken, LockName};

    /// The leases etcd has: `etcdctl lease list` prints a count, then one id a line.
    pub(in crate::etcd) fn leases(server: &leasehold_testkit::EtcdServer) -> Vec<String> {
        let list = server.etcdctl(&["lease", "list"]);
        list.lines().skip(1).map(str::to_owned).collect()
    }

    /// Waits (10 s at most) until etcd has no lease: a dropped store revokes its spare
    /// leases in the background.
    async fn no_lease_left(server: &leasehold_testkit::EtcdServer) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !leases(server).is_empty() {
            assert!(
                Instant::now() < deadline,
                "leases left: {:?}",
                leases(server)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `req`'s key put on `lease` and recorded held there, as the store records a
    /// hand-over before the move onto the full lease: the key and its create revision.
    async fn handed_over_on(
        store: &EtcdStore,
        req: &AcquireRequest,
        lease: EtcdLease,
    ) -> (Vec<u8>, i64) {
        let (key, _, create) = put_key(store, req, lease).await;
        store.record(
            &req.lease,
            Acquisition {
                key: KeyId::of(&key),
                owner: Acquisition::owner_of(&req.lease, &req.owner),
                lease: Some(lease),
                state: State::Held {
                    create,
                    modified: create,
                },
                hold: None,
            },
        );
        (key, create)
    }

    /// A hand-over's move onto the full lease, cancelled once sent (the lock loop drops
    /// it when its wake-up comes first) and then asked again, goes onto the same lease;
    /// once released and the store dropped, etcd has no lease left. (Before, the first
    /// full lease stayed, keyless, until its TTL.) Against a real etcd; the hand-over is
    /// the state the store records for one: our key held on a waiter's short lease.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_move_onto_the_full_lease_leaves_no_lease_behind() {
        let (server, store) = started().await;
        let name = LockName::new("cancelled-move").unwrap();
        let req = request(&name, "o");
        let short = store.lease_for(Duration::from_secs(5)).await.unwrap();
        let (key, create) = handed_over_on(&store, &req, short).await;
        // A spare full lease, so that the move is sent within the first poll.
        let full = store.lease_for(req.ttl).await.unwrap();
        store.spare(full);
        let grant = Grant {
            token: FencingToken(create as u64),
            holds: 1,
            lease: Some(Duration::from_secs(5)),
        };
        let cancelled = store.on_full_lease(&req, grant.clone()).now_or_never();
        assert!(cancelled.is_none(), "the move waits for etcd");
        store.on_full_lease(&req, grant).await;
        let on = store.range(range_key(&key)).await.unwrap().kvs[0].lease;
        assert_eq!(
            on, full.id,
            "the key is on the lease the cancelled move took"
        );
        let lease = Lease {
            name,
            id: req.lease.clone(),
        };
        assert!(matches!(
            store.release(&lease).await.unwrap(),
            Released::Released
        ));
        drop(store);
        no_lease_left(&server).await;
    }

    /// A key handed over on a lease that outlives its full lease (the waiters' shared
    /// lease beside a short TTL) moves onto a full lease with less left: its grant must
    /// not promise more than that full lease holds. (Before, it counted from the lease it
    /// waited on, and a holder paused at once believed in it after etcd had ended it.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handed_over_grant_lasts_no_longer_than_the_lease_its_key_moved_to() {
        let (_server, store) = started().await;
        let name = LockName::new("grant-bound").unwrap();
        let req = request(&name, "o");
        let waited_on = store.lease_for(Duration::from_secs(60)).await.unwrap();
        // As the waiters' shared lease is: the key always moves off it.
        let shared = EtcdLease {
            shared: true,
            ..waited_on
        };
        let (key, create) = handed_over_on(&store, &req, shared).await;
        // A spare full lease known to end sooner than the one the key waited on.
        let full = store.lease_for(req.ttl).await.unwrap();
        let ends = Instant::now() + req.ttl.mul_f64(0.6);
        store.spare(EtcdLease {
            alive_until: ends,
            ..full
        });
        let grant = Grant {
            token: FencingToken(create as u64),
            holds: 1,
            lease: None,
        };
        // The lock loop counts the grant from its request, sent before this call.
        let sent = Instant::now();
        let moved = store.on_full_lease(&req, grant).await;
        let on = store.range(range_key(&key)).await.unwrap().kvs[0].lease;
        assert_eq!(on, full.id, "the key moved onto the spare lease");
        let promised = moved.lease.expect("less than the full TTL is left");
        assert!(
            sent + promised <= ends,
            "promised {promised:?} from the request, the lease ends {:?} after it",
            ends - sent
        );
    }

    /// A release dropped once sent (a bounded undo that gave up on it) and sent again
    /// ends with no lease left in etcd, whatever etcd did with the first. (Before, the
    /// first forgot the acquisition, and the second, finding the key by id or finding
    /// nothing, left its lease keyless in etcd until its TTL.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_release_sent_again_after_a_dropped_one_leaves_no_lease_behind() {
        let (server, store) = started().await;
        let name = LockName::new("release-again").unwrap();
        let req = request(&name, "o");
        let granted = store.acquire(&req).await.unwrap();
        assert!(matches!(granted, crate::store::Attempt::Granted(_)));
        let lease = req.lease();
        let dropped = store.release(&lease).now_or_never();
        assert!(dropped.is_none(), "the release waits for etcd");
        // Released, or NotHeld if etcd applied the first.
        let _ = store.release(&lease).await.unwrap();
        let (queue, _) = store.queue(&name).await.unwrap();
        assert!(queue.is_empty(), "the key is gone");
        drop(store);
        no_lease_left(&server).await;
    }

    /// A released lock's lease is kept for reuse, alive and keyless; once `shutdown`
    /// returns, etcd has none of them (before, they stayed until the store was dropped,
    /// or until their TTL when the process ended first), and the locks stay usable.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_leaves_no_spare_lease() {
        let (server, store) = started().await;
        let locks = crate::Leasehold::new(store);
        for i in 0..3 {
            let lock = locks.mutex(format!("shed-{i}").as_str()).unwrap();
            let guard = lock.try_lock().await.unwrap().expect("free");
            assert_eq!(guard.release().await.unwrap(), Released::Released);
        }
        assert!(
            !leases(&server).is_empty(),
            "released leases are kept for reuse"
        );
        assert!(locks.shutdown(Duration::from_secs(10)).await);
        assert_eq!(leases(&server), Vec::<String>::new());

        let lock = locks.mutex("shed-again").unwrap();
        let guard = lock
            .try_lock()
            .await
            .unwrap()
            .expect("usable after shutdown");
        assert_eq!(guard.release().await.unwrap(), Released::Released);
    }

    #[test]
    fn lease_seconds_round_up() {
        assert_eq!(lease_seconds(Duration::from_millis(100)), 1);
        assert_eq!(lease_seconds(Duration::from_millis(1001)), 2);
        assert_eq!(lease_seconds(Duration::from_secs(15)), 15);
    }
}
