//! Leases: each acquisition's etcd lease, the pool of spare leases a process reuses,
//! keepalives, renewing a hold (a re-entry's in reentry.rs), and moving a key onto a
//! longer lease.

use std::time::Duration;

use tokio::time::Instant;

use super::acquisitions::{Acquisition, State};
use super::queue::{marker_key, move_to, put_on, range_key, txn, Entry};
use super::rpc::{
    self, Compare, KeyValue, LeaseGrantRequest, LeaseGrantResponse, LeaseTimeToLiveResponse,
};
use super::{try_per_member, EtcdStore, Pass};
use crate::store::{AcquireRequest, Grant, Lease, Renewal};
use crate::{Locked, Result};

/// Spare leases kept per TTL: enough for the acquisitions a process makes at once on
/// many locks; a burst of releases (thousands of waiters served) would otherwise leave
/// a lease per waiter in etcd until its TTL.
const MAX_SPARE: usize = 64;

/// An etcd lease and how long it is surely alive.
#[derive(Clone, Copy, Debug)]
pub(super) struct EtcdLease {
    pub(super) id: i64,
    /// Seconds etcd granted.
    pub(super) ttl: i64,
    /// Seconds asked for: the spare list it goes back to.
    pub(super) asked: i64,
    /// Request time of the last grant or keepalive plus the TTL: etcd cannot end the
    /// lease earlier.
    pub(super) alive_until: Instant,
    /// Granted by this client for one acquisition (not borrowed from a re-entered key),
    /// so it may be reused once that acquisition's key is gone.
    pub(super) ours: bool,
}

impl EtcdLease {
    pub(super) fn left(&self, now: Instant) -> Duration {
        self.alive_until.saturating_duration_since(now)
    }

    pub(super) fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl.max(0) as u64)
    }
}

/// Whole seconds of etcd lease covering `ttl`.
pub(super) fn lease_seconds(ttl: Duration) -> i64 {
    (ttl.as_millis().div_ceil(1000) as i64).max(1)
}

/// A lease another acquisition made, known only by id until a keepalive bounds it.
pub(super) fn borrowed(id: i64) -> EtcdLease {
    EtcdLease {
        id,
        ttl: 0,
        asked: 0,
        alive_until: Instant::now(),
        ours: false,
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
            }) => (key, etcd_lease, create, hold),
            Some(_) => return Ok(Pass::Done(Renewal::Lost)),
            None => match self.find(&lease.name, &lease.id).await? {
                Some((m, hold)) => {
                    let on = hold.as_ref().map_or(m.kv.lease, |h| h.lease);
                    let hold = hold.map(|h| h.key);
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
            return Ok(Pass::Done(Renewal::Lost));
        };
        self.set_lease(&lease.id, renewed, None);
        if renewed.ttl() < ttl {
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
        let sent = Instant::now();
        let answer: LeaseGrantResponse = self
            .inner
            .client
            .unary(
                "/etcdserverpb.Lease/LeaseGrant",
                LeaseGrantRequest { ttl: seconds },
            )
            .await
            .map_err(|s| self.unavailable(s))?;
        if !answer.error.is_empty() {
            return Err(self.unavailable(tonic::Status::unavailable(answer.error)));
        }
        Ok(EtcdLease {
            id: answer.id,
            ttl: answer.ttl,
            asked: seconds,
            alive_until: sent + Duration::from_secs(answer.ttl.max(0) as u64),
            ours: true,
        })
    }

    /// Keeps `lease` for the next acquisition, if fewer than [`MAX_SPARE`] of its TTL are
    /// kept; else revokes it.
    pub(super) fn spare(&self, lease: EtcdLease) {
        if lease.ours && lease.alive_until > Instant::now() {
            {
                let mut spare = self.inner.spare.locked();
                let list = spare.entry(lease.asked).or_default();
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

    pub(super) fn revoke_later(&self, id: i64) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let store = self.clone();
            runtime.spawn(async move {
                let _ = store.revoke(id).await;
            });
        }
    }

    pub(super) async fn revoke(&self, id: i64) -> Result<()> {
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
            ttl: answer.ttl,
            alive_until: sent + Duration::from_secs(answer.ttl as u64),
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
    pub(super) async fn on_full_lease(&self, req: &AcquireRequest, grant: Grant) -> Grant {
        let Some(Acquisition {
            key,
            marker,
            lease: Some(short),
            state: State::Held { create, .. },
            hold: None,
        }) = self.acquisition(&req.lease)
        else {
            return grant;
        };
        if !short.ours || short.asked >= lease_seconds(req.ttl) {
            return grant;
        }
        let Ok(full) = self.lease_for(req.ttl).await else {
            return grant;
        };
        // The marker too: it must go with the key (a key put into an empty queue has
        // none; one more does no harm, a release deletes it with the key).
        let moved = self
            .call_txn(txn(
                vec![Compare::created_at(&key, create)],
                vec![move_to(full.id, &key), put_on(full.id, &marker, &key)],
                vec![],
            ))
            .await;
        let revision = match moved {
            Ok(answer) if answer.succeeded => answer.revision(),
            Ok(_) => {
                // Our key is gone (the guard's first renewal says so): nothing moved.
                self.spare(full);
                return grant;
            }
            // The key may have moved unseen: the guard's renewal follows it to its lease,
            // and the new lease, not reused, ends with the key.
            Err(_) => return grant,
        };
        self.set_lease(&req.lease, full, Some(revision));
        // Not for reuse: the key keeps the short lease's name.
        self.revoke_later(short.id);
        let longer = full
            .alive_until
            .saturating_duration_since(short.alive_until);
        Grant {
            lease: grant
                .lease
                .map(|left| left + longer)
                .filter(|&l| l < req.ttl),
            ..grant
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_seconds_round_up() {
        assert_eq!(lease_seconds(Duration::from_millis(100)), 1);
        assert_eq!(lease_seconds(Duration::from_millis(1001)), 2);
        assert_eq!(lease_seconds(Duration::from_secs(15)), 15);
    }
}
