//! What this client keeps of each acquisition (what etcd holds for it), and how an
//! attempt records where it ended: held, queued, outside the queue.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::queue::*;
use super::wait::Blocker;
use super::{EtcdLease, EtcdStore};
use crate::store::{AcquireRequest, Attempt, Busy, Grant, HolderInfo, LeaseId, Watermark};
use crate::{rules, Error, FencingToken, LockName, Locked};

/// How many busy queues a client remembers; past that it forgets them all.
pub(super) const BUSY_QUEUES: usize = 4096;

#[derive(Clone, Debug)]
pub(super) struct Acquisition {
    /// Our queue key (a re-entry's: its owner's key), [`KeyId::NONE`] outside the queue.
    pub(super) key: KeyId,
    /// The owner, unless it is the acquisition's id (an anonymous acquisition's owner):
    /// its marker is made from it when needed, not kept (thousands of waiters would each
    /// keep one).
    pub(super) owner: Option<Box<str>>,
    pub(super) lease: Option<EtcdLease>,
    pub(super) state: State,
    /// A re-entry's hold key (see [`hold_key`]), on `lease`, as it was granted; `None`
    /// for the hold that the queue key itself carries.
    pub(super) hold: Option<Box<[u8]>>,
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
        /// The revision `waiting` was read at, and what that read said (for a recheck
        /// that the line answers: see [`EtcdStore::recheck_in_line`]): the holder shown
        /// (one copy for the queue's waiting keys) and our position.
        seen: i64,
        holder: Option<Arc<HolderInfo>>,
        position: Option<u32>,
    },
    /// Granted: our key (or our owner's, re-entered) at `create`, last written at
    /// `modified`.
    Held { create: i64, modified: i64 },
}

impl State {
    /// What the last read of a waiting key said, if it waits.
    pub(super) fn busy(&self) -> Option<Busy> {
        match self {
            State::Queued {
                seen,
                holder,
                position,
                ..
            } => Some(Busy {
                holder: holder.as_deref().cloned(),
                position: position.map(|p| p as usize),
                retry_in: None,
                watermark: Watermark(*seen as u64),
            }),
            _ => None,
        }
    }
}

impl Acquisition {
    /// What a record of acquisition `id` keeps of `owner`.
    pub(super) fn owner_of(id: &LeaseId, owner: &str) -> Option<Box<str>> {
        (owner != id.as_str()).then(|| owner.into())
    }

    /// Our key, if it waits in the queue, and its place there.
    pub(super) fn queued(&self, name: &LockName) -> Option<(Ours, &Waiting)> {
        match self {
            Acquisition {
                key,
                lease: Some(lease),
                state:
                    State::Queued {
                        create,
                        waiting,
                        attempted,
                        ..
                    },
                ..
            } => Some((
                Ours {
                    key: key.key_in(name),
                    lease: *lease,
                    create: *create,
                    attempted: *attempted,
                },
                waiting,
            )),
            _ => None,
        }
    }
}

/// Our key in the queue: a waiting acquisition's, or one a pass has just placed.
pub(super) struct Ours {
    pub(super) key: Vec<u8>,
    pub(super) lease: EtcdLease,
    pub(super) create: i64,
    /// When the last attempt started: a hand-over lease counts from there.
    pub(super) attempted: Instant,
}

/// The marker of `key`, acquisition `id`'s of lock `name`, whose record keeps `owner`
/// (see [`Acquisition::owner_of`]).
pub(super) fn owners_marker(
    name: &LockName,
    id: &LeaseId,
    owner: Option<&str>,
    key: &[u8],
) -> Vec<u8> {
    marker_key(name, owner.unwrap_or(id.as_str()), key)
}

pub(super) fn conflict(req: &AcquireRequest, refusal: rules::Refusal) -> Error {
    refusal.conflict(req.name.as_str())
}

pub(super) fn grant(
    req: &AcquireRequest,
    lease: EtcdLease,
    create: i64,
    holds: u32,
    started: Instant,
) -> Grant {
    Grant {
        token: FencingToken(create as u64),
        holds,
        lease: lease_left(lease.left(started), req.ttl),
    }
}

/// A grant's lease, from what is `left` of its key's etcd lease: `None` (the full TTL,
/// counted from the request) when at least that much is left.
pub(super) fn lease_left(left: Duration, ttl: Duration) -> Option<Duration> {
    (left < ttl).then_some(left)
}

impl EtcdStore {
    /// What this client keeps of acquisition `id`, with its lease's latest bound.
    pub(super) fn acquisition(&self, id: &LeaseId) -> Option<Acquisition> {
        let mut known = (self.inner.acquisitions.locked().get(id)).map(|a| (**a).clone())?;
        known.lease = known.lease.map(|l| self.current(l).unwrap_or(l));
        Some(known)
    }

    /// Whether acquisition `id` has a key waiting in its queue.
    pub(super) fn waits_in_queue(&self, id: &LeaseId) -> bool {
        let acquisitions = self.inner.acquisitions.locked();
        (acquisitions.get(id))
            .is_some_and(|a| a.lease.is_some() && matches!(a.state, State::Queued { .. }))
    }

    /// What `read` makes of acquisition `id`'s state, if there is one (none copied).
    pub(super) fn acquisition_state<T>(
        &self,
        id: &LeaseId,
        read: impl FnOnce(&State) -> Option<T>,
    ) -> Option<T> {
        read(&self.inner.acquisitions.locked().get(id)?.state)
    }

    /// The next recheck of the queued acquisition `id` reads the queue: its line, which
    /// follows deletions only, cannot tell where it stands now (a holder ahead was
    /// downgraded).
    pub(super) fn look_again(&self, id: &LeaseId) {
        if let Some(State::Queued { seen, .. }) =
            (self.inner.acquisitions.locked().get_mut(id)).map(|a| &mut a.state)
        {
            *seen = 0;
        }
    }

    pub(super) fn record(&self, id: &LeaseId, acquisition: Acquisition) {
        self.inner
            .acquisitions
            .locked()
            .insert(id.clone(), Box::new(acquisition));
    }

    pub(super) fn forget(&self, id: &LeaseId) -> Option<Acquisition> {
        self.inner.acquisitions.locked().remove(id).map(|a| *a)
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

    pub(super) fn wait_ended(&self, req: &AcquireRequest) -> Error {
        self.forget(&req.lease);
        Error::WaitEnded {
            name: req.name.to_string(),
            reason: "our place in etcd's queue is gone: its lease expired while this process could not renew it (paused, or cut off from etcd)".into(),
        }
    }

    /// Records our key as holding, unchanged since `modified`.
    pub(super) fn granted(&self, req: &AcquireRequest, ours: &Ours, modified: i64) -> Attempt {
        let create = ours.create;
        self.record(
            &req.lease,
            Acquisition {
                key: KeyId::of(&ours.key),
                owner: Acquisition::owner_of(&req.lease, &req.owner),
                lease: Some(ours.lease),
                state: State::Held { create, modified },
                hold: None,
            },
        );
        Attempt::Granted(grant(req, ours.lease, create, 1, ours.attempted))
    }

    /// Records our key as waiting in the queue.
    pub(super) fn queued(&self, req: &AcquireRequest, ours: Ours, waiting: Waiting, busy: &Busy) {
        self.record(
            &req.lease,
            Acquisition {
                owner: Acquisition::owner_of(&req.lease, &req.owner),
                key: KeyId::of(&ours.key),
                lease: Some(ours.lease),
                state: State::Queued {
                    create: ours.create,
                    waiting,
                    attempted: ours.attempted,
                    seen: busy.watermark.0 as i64,
                    holder: busy.holder.clone().map(|h| self.shown_holder(&req.name, h)),
                    position: busy.position.map(count),
                },
                hold: None,
            },
        );
    }

    /// `holder`, as the waiting keys of `name`'s queue were shown it: one copy for all of
    /// them while it is the same (thousands of waiters would each keep their own).
    fn shown_holder(&self, name: &crate::LockName, holder: HolderInfo) -> Arc<HolderInfo> {
        let prefix = queue_prefix(name);
        let mut shown = self.inner.shown_holders.locked();
        if let Some(known) = shown.get(&prefix).and_then(std::sync::Weak::upgrade) {
            if *known == holder {
                return known;
            }
        }
        let holder = Arc::new(holder);
        // Bounded as the busy queues are: past that, sharing starts over.
        if shown.len() >= BUSY_QUEUES {
            shown.clear();
        }
        shown.insert(prefix, Arc::downgrade(&holder));
        holder
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
                key: KeyId::NONE,
                owner: None,
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
}

#[cfg(test)]
mod tests {
    use super::super::acquire::tests::{request, started};
    use super::*;
    use crate::store::Store;
    use crate::LockName;

    /// The holder a queue's waiting keys were shown is kept once for all of them, and
    /// each recheck still shows it whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiting_keys_share_the_holder_they_were_shown() {
        let (_server, store) = started().await;
        let name = LockName::new("shown-holder").unwrap();
        let holder = request(&name, "holder");
        assert!(matches!(
            store.acquire(&holder).await.unwrap(),
            Attempt::Granted(_)
        ));
        let mut shown = Vec::new();
        for owner in ["w1", "w2"] {
            let waiter = request(&name, owner);
            let Attempt::Busy(busy) = store.acquire(&waiter).await.unwrap() else {
                panic!("{owner}: the lock is held");
            };
            assert_eq!(busy.holder.as_ref().unwrap().owner, "holder");
            let acquisitions = store.inner.acquisitions.locked();
            let State::Queued { holder, .. } = &acquisitions[&waiter.lease].state else {
                panic!("{owner} waits in the queue");
            };
            shown.push((waiter, holder.clone().unwrap()));
        }
        assert!(Arc::ptr_eq(&shown[0].1, &shown[1].1));
        // A recheck shows the same holder as the first answer did.
        let Attempt::Busy(busy) = store.acquire(&shown[1].0).await.unwrap() else {
            panic!("the lock is still held");
        };
        assert_eq!(busy.holder.as_ref(), Some(&*shown[1].1));
    }
}
