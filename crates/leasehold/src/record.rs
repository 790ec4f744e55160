//! One lock's state and its transitions, shared by the stores that keep state themselves
//! (`memory` in a mutex, `local` in a file). Pure: the caller supplies the clock and the
//! process-liveness check and persists the record.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

use crate::options::waiter_lease;
use crate::store::{
    AcquireRequest, Attempt, Busy, Grant, HolderInfo, Lease, LockKind, LockState, Released,
    Renewal, WaiterInfo, Watermark,
};
use crate::{rules, FencingToken, Result};

/// Says whether the process `pid` on `host` may still be running.
pub(crate) type Alive<'a> = &'a dyn Fn(&str, u32) -> bool;

/// The clock and host facts a transition needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Now {
    /// Monotonic nanoseconds on the store's clock (leases expire on it).
    pub mono: u64,
    /// Wall clock, for display only.
    pub wall_ms: u64,
    /// The token of a name that never had one: 1 in a store whose records live as long
    /// as it does (memory); the wall clock in microseconds in one whose records can be
    /// lost apart from it (a lock file deleted), so tokens do not go back then.
    pub first_token: u64,
}

impl Now {
    pub fn wall_ms() -> u64 {
        Self::wall_us() / 1000
    }

    pub fn wall_us() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros() as u64
    }
}

/// What an attempt would get (indices into holders and waiters).
enum Admit {
    /// Already granted to this request (a retry).
    Again(usize),
    /// The same owner holds it: one more hold.
    Reenter(usize),
    Grant,
    /// Blocked by a holder and/or a waiter ahead; `me` is the request's queue place.
    Wait {
        holder: Option<usize>,
        waiter: Option<usize>,
        me: Option<usize>,
    },
}

/// What [`Record::look`] says.
pub(crate) enum Look {
    TryNow,
    Wait(Watermark),
}

/// Wakes the waiters of one process when a lock changes: all of those who each need to
/// look, and one of those of whom any one can use the change (see [`Watermark`]), so a
/// release does not wake a herd that would find the lock taken again.
#[derive(Debug, Default)]
pub(crate) struct Wake {
    all: Notify,
    one: Notify,
    /// [`Store::watch`](crate::store::Store::watch)ers: any change of the holders.
    holders: Notify,
}

impl Wake {
    pub fn changed(&self) {
        self.all.notify_waiters();
        self.one.notify_one();
        self.holders.notify_waiters();
    }

    /// A holder came or published a value: only watchers can care.
    pub fn holders_changed(&self) {
        self.holders.notify_waiters();
    }

    pub fn notified_holders(&self) -> Notified<'_> {
        self.holders.notified()
    }

    /// Any one non-fair exclusive waiter can use a change (only one can win it); fair
    /// waiters, readers and permit waiters (several permits may have come free, in
    /// one notification) each need to look.
    /// Any change at all.
    pub fn notified_any(&self) -> Notified<'_> {
        self.all.notified()
    }

    pub fn notified(&self, req: &AcquireRequest) -> Notified<'_> {
        if !req.fair && req.kind == LockKind::Exclusive {
            self.one.notified()
        } else {
            self.all.notified()
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Record {
    pub name: String,
    /// The last fencing token issued; never decreases.
    pub last_token: u64,
    /// Bumped whenever something went away that a waiter may have waited for (a hold, a
    /// waiter ahead). Grants, renewals and waiter refreshes cannot help a waiter, so
    /// they do not bump it.
    pub version: u64,
    /// Next waiter sequence number (queue order).
    pub next_seq: u64,
    /// The epoch `mono` times belong to (the local store's boot id); a record from another
    /// epoch has no live leases.
    #[serde(default)]
    pub epoch: String,
    pub holders: Vec<Holder>,
    pub waiters: Vec<Waiter>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Holder {
    pub owner: String,
    pub kind: LockKind,
    pub token: u64,
    pub since_ms: u64,
    /// One per acquisition by this owner (re-entry adds one).
    pub holds: Vec<Hold>,
    /// What the holder published ([`AcquireRequest::value`], [`Record::proclaim`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

impl Holder {
    /// The answer to an attempt that this holder's grant (or re-entry) answers.
    fn granted(&self) -> Attempt {
        Attempt::Granted(Grant {
            token: FencingToken(self.token),
            holds: self.holds.len() as u32,
            lease: None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Hold {
    pub lease: String,
    pub host: String,
    pub pid: u32,
    pub expires: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Waiter {
    pub lease: String,
    pub owner: String,
    pub kind: LockKind,
    pub seq: u64,
    pub host: String,
    pub pid: u32,
    pub since_ms: u64,
    pub expires: u64,
}

fn deadline(now: Now, ttl: Duration) -> u64 {
    now.mono
        .saturating_add(ttl.as_nanos().min(u64::MAX as u128) as u64)
}

impl Record {
    pub fn new(name: &str, epoch: &str) -> Self {
        Record {
            name: name.to_string(),
            epoch: epoch.to_string(),
            ..Record::default()
        }
    }

    /// Starts a new epoch (the host rebooted): no lease from before survives, the token
    /// counter does.
    pub fn enter_epoch(&mut self, epoch: &str) {
        if self.epoch != epoch {
            self.epoch = epoch.to_string();
            self.holders.clear();
            self.waiters.clear();
            self.version += 1;
        }
    }

    /// Drops expired leases and waiters, and those whose process `alive` says is gone.
    /// Returns whether anything was dropped.
    pub fn prune(&mut self, now: Now, alive: Alive<'_>) -> bool {
        let before = (self.holders.len(), self.waiters.len(), self.hold_count());
        for h in &mut self.holders {
            h.holds
                .retain(|hold| hold.expires > now.mono && alive(&hold.host, hold.pid));
        }
        self.holders.retain(|h| !h.holds.is_empty());
        self.waiters
            .retain(|w| w.expires > now.mono && alive(&w.host, w.pid));
        let changed = before != (self.holders.len(), self.waiters.len(), self.hold_count());
        if changed {
            self.version += 1;
        }
        changed
    }

    fn hold_count(&self) -> usize {
        self.holders.iter().map(|h| h.holds.len()).sum()
    }

    pub fn is_idle(&self) -> bool {
        self.holders.is_empty() && self.waiters.is_empty()
    }

    /// What an attempt of `req` would get, without changing anything: the lock rules
    /// ([`rules::decide`]) on this record.
    fn admit(&self, req: &AcquireRequest) -> Result<Admit> {
        let lease = req.lease.as_str();
        let mine = |h: &Holder| h.holds.iter().any(|x| x.lease == lease);
        if let Some(i) = self.holders.iter().position(mine) {
            return Ok(Admit::Again(i));
        }
        let holders: Vec<rules::Holder> = self
            .holders
            .iter()
            .map(|h| rules::Holder {
                owner: &h.owner,
                kind: h.kind,
            })
            .collect();
        let waiters: Vec<rules::Waiter> = self
            .waiters
            .iter()
            .map(|w| rules::Waiter {
                owner: &w.owner,
                kind: w.kind,
            })
            .collect();
        let me = self.waiters.iter().position(|w| w.lease == lease);
        let ask = rules::Ask {
            owner: &req.owner,
            kind: req.kind,
            fair: req.fair,
        };
        Ok(match rules::decide(&holders, &waiters, me, &ask) {
            rules::Decision::Reenter(i) => Admit::Reenter(i),
            rules::Decision::Grant => Admit::Grant,
            rules::Decision::Wait { holder, waiter } => Admit::Wait { holder, waiter, me },
            rules::Decision::Refuse(refusal) => return Err(refusal.conflict(&self.name)),
        })
    }

    /// One attempt. The caller has pruned with the same `now`.
    pub fn acquire(&mut self, req: &AcquireRequest, now: Now) -> Result<Attempt> {
        let hold = Hold {
            lease: req.lease.as_str().to_string(),
            host: req.requester.host.clone(),
            pid: req.requester.pid,
            expires: deadline(now, req.ttl),
        };
        let (holder, waiter, me) = match self.admit(req)? {
            // A retry of a request that was already granted: the same answer again.
            Admit::Again(i) => {
                let h = &mut self.holders[i];
                for x in h.holds.iter_mut().filter(|x| x.lease == hold.lease) {
                    x.expires = x.expires.max(hold.expires);
                }
                return Ok(h.granted());
            }
            // Re-entry by the same owner: one more hold, the same token.
            Admit::Reenter(i) => {
                self.holders[i].holds.push(hold);
                self.waiters.retain(|w| w.lease != req.lease.as_str());
                return Ok(self.holders[i].granted());
            }
            Admit::Grant => return Ok(self.grant(req, hold, now)),
            Admit::Wait { holder, waiter, me } => (holder, waiter, me),
        };
        let retry_at = match (holder, waiter) {
            (Some(h), _) => self.holders[h].holds.iter().map(|x| x.expires).max(),
            (None, Some(w)) => Some(self.waiters[w].expires),
            (None, None) => None,
        };
        let holder = holder.map(|h| self.holder_info(&self.holders[h], now));
        let position = req.enqueue.then(|| self.queue(req, hold, me, now));
        Ok(Attempt::Busy(Busy {
            holder,
            position,
            retry_in: retry_at.map(|t| Duration::from_nanos(t.saturating_sub(now.mono))),
            watermark: Watermark(self.version),
        }))
    }

    /// Makes `req` a new holder, with the next token.
    fn grant(&mut self, req: &AcquireRequest, hold: Hold, now: Now) -> Attempt {
        self.last_token = match self.last_token {
            0 => now.first_token.max(1),
            last => last + 1,
        };
        self.holders.push(Holder {
            owner: req.owner.to_string(),
            kind: req.kind,
            token: self.last_token,
            since_ms: now.wall_ms,
            holds: vec![hold],
            value: req.value.as_deref().map(str::to_string),
        });
        self.waiters.retain(|w| w.lease != req.lease.as_str());
        self.holders[self.holders.len() - 1].granted()
    }

    /// Keeps `req`'s place in the queue (`me`, if it has one) or gives it one at the end;
    /// its position (1 = next).
    fn queue(&mut self, req: &AcquireRequest, hold: Hold, me: Option<usize>, now: Now) -> usize {
        let lease = waiter_lease(req.ttl);
        match me {
            Some(i) => {
                // Refresh the waiter lease only once a quarter of it is gone, so
                // re-attempts do not rewrite the record each time.
                if self.waiters[i].expires < deadline(now, lease.mul_f64(0.75)) {
                    self.waiters[i].expires = deadline(now, lease);
                }
                i + 1
            }
            None => {
                self.waiters.push(Waiter {
                    lease: req.lease.as_str().to_string(),
                    owner: req.owner.to_string(),
                    kind: req.kind,
                    seq: self.next_seq,
                    host: hold.host,
                    pid: hold.pid,
                    since_ms: now.wall_ms,
                    expires: deadline(now, lease),
                });
                self.next_seq += 1;
                self.waiters.len()
            }
        }
    }

    pub fn renew(&mut self, lease: &Lease, ttl: Duration, now: Now) -> Renewal {
        let hold = self
            .holders
            .iter_mut()
            .flat_map(|h| h.holds.iter_mut())
            .find(|x| x.lease == lease.id.as_str());
        match hold {
            Some(hold) => {
                hold.expires = deadline(now, ttl);
                Renewal::Renewed
            }
            None => Renewal::Lost,
        }
    }

    pub fn release(&mut self, lease: &Lease) -> Released {
        let mut released = Released::NotHeld;
        for h in &mut self.holders {
            let before = h.holds.len();
            h.holds.retain(|x| x.lease != lease.id.as_str());
            if h.holds.len() != before {
                released = Released::Released;
            }
        }
        self.holders.retain(|h| !h.holds.is_empty());
        let waiters = self.waiters.len();
        self.waiters.retain(|w| w.lease != lease.id.as_str());
        if released == Released::Released || waiters != self.waiters.len() {
            self.version += 1;
        }
        released
    }

    /// Replaces the value of the holder that has `lease` among its holds.
    pub fn proclaim(&mut self, lease: &Lease, value: &str) -> Renewal {
        match self.holder_mut(lease) {
            Some(holder) => {
                holder.value = Some(value.to_string());
                Renewal::Renewed
            }
            None => Renewal::Lost,
        }
    }

    /// Turns the holder that has `lease` among its holds shared, by the lock rules
    /// ([`rules::downgrade`]); waiters look again.
    pub fn downgrade(&mut self, lease: &Lease) -> Result<Renewal> {
        let Some(holder) = self.holder_mut(lease) else {
            return Ok(Renewal::Lost);
        };
        let holds = holder.holds.len() as u32;
        let change = rules::downgrade(holder.kind, holds, &holder.owner)
            .map_err(|refusal| refusal.conflict(lease.name.as_str()))?;
        if change {
            holder.kind = LockKind::Shared;
            self.version += 1;
        }
        Ok(Renewal::Renewed)
    }

    fn holder_mut(&mut self, lease: &Lease) -> Option<&mut Holder> {
        let mine = |h: &&mut Holder| h.holds.iter().any(|x| x.lease == lease.id.as_str());
        self.holders.iter_mut().find(mine)
    }

    /// Whether `lease` is one of the holds.
    pub fn holds(&self, lease: &Lease) -> bool {
        self.holders
            .iter()
            .any(|h| h.holds.iter().any(|x| x.lease == lease.id.as_str()))
    }

    pub fn force_release(&mut self) -> bool {
        let held = !self.holders.is_empty();
        self.holders.clear();
        self.version += 1;
        held
    }

    fn holder_info(&self, h: &Holder, now: Now) -> HolderInfo {
        let first = &h.holds[0];
        let expires = h.holds.iter().map(|x| x.expires).max().unwrap_or(0);
        HolderInfo {
            owner: h.owner.clone(),
            host: first.host.clone(),
            pid: first.pid,
            token: FencingToken(h.token),
            kind: h.kind,
            since: UNIX_EPOCH + Duration::from_millis(h.since_ms),
            lease_left: Duration::from_nanos(expires.saturating_sub(now.mono)),
            holds: h.holds.len() as u32,
            value: h.value.clone(),
        }
    }

    pub fn state(&self, now: Now) -> LockState {
        LockState {
            name: self.name.clone(),
            last_token: FencingToken(self.last_token),
            holders: self
                .holders
                .iter()
                .map(|h| self.holder_info(h, now))
                .collect(),
            waiters: self
                .waiters
                .iter()
                .map(|w| WaiterInfo {
                    owner: w.owner.clone(),
                    host: w.host.clone(),
                    pid: w.pid,
                    kind: w.kind,
                    since: UNIX_EPOCH + Duration::from_millis(w.since_ms),
                })
                .collect(),
        }
    }

    /// Whether trying `req` again may succeed: the lock changed since `since`, and a
    /// dry run of `req` on the current state is granted (or fails, which the caller
    /// should hear about). Otherwise the version to wait beyond.
    pub fn look(&self, req: &AcquireRequest, since: Watermark) -> Look {
        if self.version == since.0 {
            return Look::Wait(since);
        }
        match self.admit(req) {
            Ok(Admit::Wait { .. }) => Look::Wait(Watermark(self.version)),
            _ => Look::TryNow,
        }
    }

    /// Processes that stand in the way of waiters: every holder's, and the queue head's.
    /// A store that can watch processes wakes waiters when one of them exits.
    pub fn blocking_pids(&self) -> impl Iterator<Item = (&str, u32)> {
        let holds = self
            .holders
            .iter()
            .flat_map(|h| h.holds.iter().map(|x| (x.host.as_str(), x.pid)));
        holds.chain(self.waiters.first().map(|w| (w.host.as_str(), w.pid)))
    }
}
