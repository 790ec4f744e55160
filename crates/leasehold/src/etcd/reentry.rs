//! Re-entry holds: each re-entry holds through a hold key on an etcd lease of its own
//! (see the module docs); finding, renewing and releasing holds, and handing the queue
//! key on to a live re-entry.

use std::time::Duration;

use tokio::time::Instant;

use super::acquire::{Retry, Step};
use super::acquisitions::{conflict, grant, Acquisition, State};
use super::leases::borrowed;
use super::leases::{Relook, Renewing};
use super::queue::*;
use super::rpc::{self, prefix_end, Compare, KeyValue, TxnResponse};
use super::{try_per_member, EtcdLease, EtcdStore, Pass};
use crate::store::{AcquireRequest, Attempt, Lease, LeaseId, Released, Renewal};
use crate::{rules, LockName, Result};

/// A queue key and the re-entry holds filed under it, read together.
pub(super) struct Holding {
    pub(super) member: Member,
    /// Hold keys, each with the acquisition it is for.
    pub(super) holds: Vec<(KeyValue, LeaseId)>,
    /// The revision read at.
    pub(super) revision: i64,
}

/// How an acquisition holds through a queue key.
pub(super) enum Role {
    /// The key's own hold: the key is on its lease.
    Carrier,
    /// A re-entry: this hold key, on its own lease.
    Reentry(KeyValue),
}

impl Holding {
    pub(super) fn role(&self, id: &LeaseId) -> Option<Role> {
        if self.member.entry.holds.contains(id) {
            return Some(Role::Carrier);
        }
        (self.holds.iter())
            .find(|(_, hold)| hold == id)
            .map(|(kv, _)| Role::Reentry(kv.clone()))
    }

    pub(super) fn count(&self) -> u32 {
        (self.member.entry.holds.len() + self.holds.len()) as u32
    }
}

impl EtcdStore {
    /// The queue key holding acquisition `id` of `name`, the hold key if it is a
    /// re-entry, and whether the key holds the lock (else it waits), found by reading
    /// them (for acquisitions this client does not know: made by another client, or
    /// unanswered).
    pub(super) async fn find(
        &self,
        name: &LockName,
        id: &LeaseId,
    ) -> Result<Option<(Member, Option<KeyValue>, bool)>> {
        let (queue, _) = self.queue(name).await?;
        if let Some(at) = queue.iter().position(|m| m.entry.holds.contains(id)) {
            let holds = standing(&queue, at).waiting.is_none();
            return Ok(Some((queue[at].clone(), None, holds)));
        }
        let holds = self.range(range_prefix(&holds_of(name), false)).await?;
        for kv in holds.kvs {
            let ours = serde_json::from_slice::<HoldEntry>(&kv.value).is_ok_and(|h| &h.hold == id);
            let create = hold_create(name, &kv.key);
            let member = queue.iter().find(|m| Some(m.kv.create_revision) == create);
            // Only a key that holds has re-entries.
            if let (true, Some(member)) = (ours, member) {
                return Ok(Some((member.clone(), Some(kv), true)));
            }
        }
        Ok(None)
    }

    /// `key`, if it is still the one created at `create`, with its re-entry holds.
    pub(super) async fn holding(
        &self,
        name: &LockName,
        key: &[u8],
        create: i64,
    ) -> Result<Option<Holding>> {
        let answer = self
            .call_txn(txn(
                vec![Compare::created_at(key, create)],
                vec![
                    range_key(key),
                    range_prefix(&holds_prefix(name, create), false),
                ],
                vec![],
            ))
            .await?;
        match answer.succeeded {
            true => self.holding_from(name, &answer),
            false => Ok(None),
        }
    }

    /// A [`Holding`] from the ranges of a queue key and its hold keys, in that order.
    pub(super) fn holding_from(
        &self,
        name: &LockName,
        answer: &TxnResponse,
    ) -> Result<Option<Holding>> {
        let mut ranges = answer.ranges();
        let Some(kv) = ranges.next().and_then(|r| r.kvs.first()) else {
            return Ok(None);
        };
        let holds = ranges.next().map_or(&[][..], |r| &r.kvs[..]);
        Ok(Some(Holding {
            member: self.member(name, kv)?,
            holds: (holds.iter())
                .filter_map(|kv| {
                    let entry = serde_json::from_slice::<HoldEntry>(&kv.value).ok()?;
                    Some((kv.clone(), entry.hold))
                })
                .collect(),
            revision: answer.revision(),
        }))
    }

    /// Re-enters our owner's key, which holds the lock, if the rules let us: a hold key
    /// of our own, on a lease of our own, so that our hold ends with that lease (see the
    /// module docs). Our renewals keep the queue key's lease alive too: the key must
    /// outlive our hold.
    pub(super) async fn reenter(
        &self,
        req: &AcquireRequest,
        member: &Member,
        started: Instant,
    ) -> Result<Step> {
        if let Err(refusal) = rules::reentry(member.entry.kind, req.kind, &req.owner) {
            self.forget(&req.lease);
            return Err(conflict(req, refusal));
        }
        let (key, create) = (&member.kv.key, member.kv.create_revision);
        let lease = self.lease_for(req.ttl).await?;
        let hold = hold_key(&req.name, create, lease.id);
        let owner = Acquisition::owner_of(&req.lease, &req.owner);
        let acquisition = |state| Acquisition {
            key: KeyId::of(key),
            owner: owner.clone(),
            lease: Some(lease),
            state,
            hold: Some(hold.clone().into()),
        };
        // Unanswered, the hold key is undone by revoking its lease.
        self.record(&req.lease, acquisition(State::Unknown));
        let value = HoldEntry {
            hold: req.lease.clone(),
        }
        .value();
        let (answer, carrier) = tokio::join!(
            self.call_txn(txn(
                vec![Compare::created_at(key, create)],
                vec![
                    put_on(lease.id, &hold, &value),
                    range_key(key),
                    range_prefix(&holds_prefix(&req.name, create), false),
                ],
                vec![],
            )),
            self.keep_alive(borrowed(member.kv.lease))
        );
        let answer = answer?;
        let now = match answer.succeeded {
            true => self.holding_from(&req.name, &answer)?,
            false => None,
        };
        let Some(now) = now else {
            // The key is gone: nothing was put.
            self.forget(&req.lease);
            self.spare(lease);
            return Ok(Pass::Again(Retry::KeyGone));
        };
        let carrier = match carrier {
            Ok(Some(carrier)) if carrier.id == now.member.kv.lease => Some(carrier),
            _ => self.keep_alive(borrowed(now.member.kv.lease)).await?,
        };
        let Some(carrier) = carrier else {
            // The key's lease just ended: our hold key goes with our lease, and we wait
            // for etcd to delete the key.
            self.forget(&req.lease);
            self.revoke_later(lease.id);
            let prefix = queue_prefix(&req.name);
            let revision = answer.revision();
            let outside = self.outside(req, std::slice::from_ref(member), &prefix, revision);
            return Ok(Pass::Done(outside));
        };
        let modified = now.member.kv.mod_revision;
        self.record(&req.lease, acquisition(State::Held { create, modified }));
        // The grant lasts as long as both leases.
        let bound = match carrier.left(started) < lease.left(started) {
            true => carrier,
            false => lease,
        };
        let granted = grant(req, bound, create, now.count(), started);
        Ok(Pass::Done(Attempt::Granted(granted)))
    }

    /// Takes acquisition `lease`'s hold out of `key` (created at `create`), whatever it
    /// is now. A re-entry deletes its hold key. The key's own hold moves the key onto the
    /// lease of a live re-entry, whose hold it becomes (the key keeps its create
    /// revision, the token), or deletes it with the last hold. `own`: our etcd lease, kept
    /// for reuse once it has no key.
    pub(super) async fn release_hold(
        &self,
        lease: &Lease,
        key: &[u8],
        create: i64,
        own: Option<EtcdLease>,
    ) -> Result<Released> {
        let name = &lease.name;
        let holds = holds_prefix(name, create);
        loop {
            let Some(now) = self.holding(name, key, create).await? else {
                return Ok(Released::NotHeld);
            };
            let m = &now.member;
            let marker = marker_key(name, &m.entry.owner, key);
            let unchanged = Compare::modified_at(key, m.kv.mod_revision);
            let (compare, change, freed) = match now.role(&lease.id) {
                None => return Ok(Released::NotHeld),
                Some(Role::Reentry(hold)) => (
                    vec![Compare::modified_at(&hold.key, hold.mod_revision)],
                    vec![delete(&hold.key)],
                    hold.lease,
                ),
                Some(Role::Carrier) if m.entry.holds.len() > 1 => {
                    // Re-entries of an older version, in the key's value.
                    let mut entry = m.entry.clone();
                    entry.holds.retain(|h| h != &lease.id);
                    (vec![unchanged], vec![rewrite(key, &entry)], 0)
                }
                Some(Role::Carrier) => match self.heir(&now).await? {
                    Some((hold, id)) => {
                        let mut entry = m.entry.clone();
                        entry.holds = vec![id];
                        (
                            vec![
                                unchanged,
                                Compare::modified_at(&hold.key, hold.mod_revision),
                            ],
                            vec![
                                put_on(hold.lease, key, &entry.value()),
                                put_on(hold.lease, &marker, key),
                                delete(&hold.key),
                            ],
                            m.kv.lease,
                        )
                    }
                    // Hold keys whose leases have ended, if any, go with the key (unless
                    // a re-entry came since).
                    None => {
                        let mut change = remove(key, &marker);
                        change.push(delete_prefix(&holds));
                        let none_new =
                            Compare::created_before(&holds, &prefix_end(&holds), now.revision + 1);
                        (vec![unchanged, none_new], change, m.kv.lease)
                    }
                },
            };
            if self.call_txn(txn(compare, change, vec![])).await?.succeeded {
                match own.filter(|l| l.id == freed) {
                    // Keyless, but the queue key moved off it keeps its name: reused, it
                    // would name that key again.
                    Some(own) if queue_key(name, own.id) == key => self.revoke_later(own.id),
                    Some(own) => self.spare(own),
                    // Found by id, its record gone: the lease the hold was on carries
                    // nothing now (a lease with a key is never spare), and nobody else
                    // would end it before its TTL.
                    None if own.is_none() && freed != 0 => self.revoke_later(freed),
                    None => {}
                }
                let kept = (freed != m.kv.lease).then_some(m.kv.lease);
                self.moved_off(&lease.id, kept);
                return Ok(Released::Released);
            }
        }
    }

    /// The re-entry that takes the queue key over when the key's own hold is released:
    /// the one whose lease has the most time left (the others' renewals keep the key's
    /// lease alive, whichever it is). `None` if every hold key's lease has ended.
    pub(super) async fn heir(&self, now: &Holding) -> Result<Option<(KeyValue, LeaseId)>> {
        let mut best: Option<(i64, &KeyValue, &LeaseId)> = None;
        for (kv, id) in &now.holds {
            let left = self.time_to_live(kv.lease).await?;
            if left >= 0 && best.is_none_or(|(most, ..)| left > most) {
                best = Some((left, kv, id));
            }
        }
        Ok(best.map(|(_, kv, id)| (kv.clone(), id.clone())))
    }

    /// Renews a re-entry's hold: its own lease, which its hold key is on, and the queue
    /// key's lease, which must outlive it. If the key's lease is shorter than the TTL
    /// asked, or our own is (an extend), the key moves onto a lease of ours
    /// ([`carry`](Self::carry)).
    pub(super) async fn renew_reentry(
        &self,
        lease: &Lease,
        ttl: Duration,
        key: &[u8],
        known: EtcdLease,
        create: i64,
    ) -> Result<Renewing> {
        let lost = || {
            self.forget(&lease.id);
            Ok(Pass::Done(Renewal::Lost))
        };
        let Some(now) = self.holding(&lease.name, key, create).await? else {
            return lost();
        };
        let carrier = now.member.kv.lease;
        let hold = match now.role(&lease.id) {
            None => return lost(),
            Some(Role::Carrier) => {
                // Our hold is the key's own now: the hold that carried it was released.
                self.update(&lease.id, |a| {
                    a.hold = None;
                    if known.id != carrier {
                        a.lease = Some(borrowed(carrier));
                    }
                });
                return Ok(Pass::Again(Relook::NowCarrier));
            }
            Some(Role::Reentry(hold)) => hold,
        };
        let own = match known.id == hold.lease {
            true => known,
            false => borrowed(hold.lease),
        };
        let per_member = try_per_member(ttl.min(own.ttl()));
        let (alive, key_alive) = tokio::join!(
            rpc::trying_each_for(per_member, self.keep_alive(own)),
            rpc::trying_each_for(per_member, self.keep_alive(borrowed(carrier)))
        );
        let (Some(alive), Some(key_alive)) = (alive?, key_alive?) else {
            return lost();
        };
        self.update(&lease.id, |a| {
            a.lease = Some(alive);
            a.hold = Some(hold.key.clone().into());
        });
        if key_alive.ttl() >= ttl && alive.ttl() >= ttl {
            return Ok(Pass::Done(Renewal::Renewed));
        }
        self.carry(lease, ttl, &now, &hold, alive).await
    }

    /// Moves the queue key onto a lease of this re-entry's (its own, or a new one of `ttl`
    /// if its own is shorter), whose hold the key then carries; the hold the key carried
    /// gets a hold key on its own lease, and still ends with it. The key keeps its create
    /// revision (the token).
    pub(super) async fn carry(
        &self,
        lease: &Lease,
        ttl: Duration,
        now: &Holding,
        hold: &KeyValue,
        own: EtcdLease,
    ) -> Result<Renewing> {
        let target = match own.ttl() >= ttl {
            true => own,
            false => self.grant(ttl).await?,
        };
        let m = &now.member;
        let mut entry = m.entry.clone();
        let carried = std::mem::replace(&mut entry.holds, vec![lease.id.clone()]);
        let mut moves = vec![
            put_on(target.id, &m.kv.key, &entry.value()),
            put_on(
                target.id,
                &marker_key(&lease.name, &entry.owner, &m.kv.key),
                &m.kv.key,
            ),
            delete(&hold.key),
        ];
        if let Some(first) = carried.first() {
            let value = HoldEntry {
                hold: first.clone(),
            }
            .value();
            let create = m.kv.create_revision;
            let key = hold_key(&lease.name, create, m.kv.lease);
            moves.push(put_on(m.kv.lease, &key, &value));
        }
        let answer = self
            .call_txn(txn(
                vec![
                    Compare::modified_at(&m.kv.key, m.kv.mod_revision),
                    Compare::modified_at(&hold.key, hold.mod_revision),
                ],
                moves,
                vec![],
            ))
            .await?;
        if !answer.succeeded {
            // Changed meanwhile: look again.
            if target.id != own.id {
                self.revoke_later(target.id);
            }
            return Ok(Pass::Again(Relook::Changed));
        }
        if target.id != own.id {
            // Keyless now, but named in no key: not worth keeping.
            self.revoke_later(own.id);
        }
        self.update(&lease.id, |a| {
            a.lease = Some(target);
            a.hold = None;
            if let State::Held { modified, .. } = &mut a.state {
                *modified = answer.revision();
            }
        });
        Ok(Pass::Done(Renewal::Renewed))
    }
}
