//! Waiting and watches: a waiter outside the queue watches what keeps it out; a queued
//! waiter waits in its process's line (line.rs); a holder watches its key for `lost`.

use tokio::time::Instant;

use super::acquisitions::{Acquisition, Ours, State};
use super::line::{Joined, Place, Turn};
use super::queue::*;
use super::rpc::{self, prefix_end, Op, RangeRequest, WatchCreateRequest, WatchResponse};
use super::EtcdStore;
use crate::store::{AcquireRequest, Attempt, Grant};
use crate::{Error, LockName, Locked, Result};

/// Why a watch stopped.
pub(super) enum WatchEnd {
    /// Its start revision was compacted away: look again.
    Compacted,
    Broken(Error),
}
use WatchEnd::{Broken, Compacted};

/// What a waiter watches for deletion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Blocker {
    Key(Vec<u8>),
    /// Any key of the lock.
    Queue(Vec<u8>),
}

impl EtcdStore {
    /// Resolves at the first deletion in `blocker` after revision `seen`. `Ok(false)` when
    /// etcd can no longer tell (the revision was compacted): look again.
    ///
    /// A single key is watched from now rather than from `seen + 1`: etcd serves a watch
    /// that starts in the past from a loop that runs every 100 ms, which would delay a
    /// hand-over by up to that. A read after the watch exists covers the gap: the key
    /// gone, or replaced by a newer one, is a deletion since `seen`.
    ///
    /// Every held lock waits here (for `lost`): the watch's start and the read are boxed,
    /// so that what it keeps while it waits is the watch alone.
    pub(super) async fn deleted(&self, blocker: &Blocker, seen: i64) -> Result<bool> {
        let (key, range_end, start) = match blocker {
            Blocker::Key(key) => (key.clone(), Vec::new(), 0),
            Blocker::Queue(prefix) => (prefix.clone(), prefix_end(prefix), seen + 1),
        };
        let (mut events, now) = match Box::pin(self.watch_deletes(&key, range_end, start)).await? {
            Some(created) => created,
            None => return Ok(false),
        };
        if start == 0 && now > seen {
            let current = Box::pin(self.range(range_key(&key))).await?;
            let same = current
                .kvs
                .first()
                .is_some_and(|kv| kv.create_revision <= seen);
            if !same {
                return Ok(true);
            }
        }
        match self.next_event(&mut events).await {
            Ok(()) => Ok(true),
            Err(Compacted) => Ok(false),
            Err(Broken(error)) => Err(error),
        }
    }

    /// A watch for deletions in `[key, range_end)` from `start` (0: from now), and the
    /// revision it starts after; `None` if `start` was compacted away.
    pub(super) async fn watch_deletes(
        &self,
        key: &[u8],
        range_end: Vec<u8>,
        start: i64,
    ) -> Result<Option<(rpc::Watch, i64)>> {
        self.watch_from(key, range_end, start, vec![rpc::NO_PUT])
            .await
    }

    /// [`watch_deletes`](Self::watch_deletes), with etcd's event `filters` (none: puts
    /// and deletions).
    pub(super) async fn watch_from(
        &self,
        key: &[u8],
        range_end: Vec<u8>,
        start: i64,
        filters: Vec<i32>,
    ) -> Result<Option<(rpc::Watch, i64)>> {
        let mut watch = self
            .inner
            .client
            .watch(WatchCreateRequest {
                key: key.to_vec(),
                range_end,
                start_revision: start,
                filters,
            })
            .await
            .map_err(|s| self.unavailable(s))?;
        let Some(created) = watch.message().await else {
            return Err(self.watch_ended());
        };
        match self.deletions(created) {
            Ok(answer) => Ok(Some((watch, answer.header.map_or(0, |h| h.revision)))),
            Err(Compacted) => Ok(None),
            Err(Broken(error)) => Err(error),
        }
    }

    /// Resolves at the first event `watch` reports (a deletion, for
    /// [`watch_deletes`](Self::watch_deletes)).
    pub(super) async fn next_event(
        &self,
        watch: &mut rpc::Watch,
    ) -> std::result::Result<(), WatchEnd> {
        loop {
            let Some(answer) = watch.message().await else {
                return Err(Broken(self.watch_ended()));
            };
            if !self.deletions(answer)?.events.is_empty() {
                return Ok(());
            }
        }
    }

    /// A watch answer, unless it says the watch is over.
    pub(super) fn deletions(
        &self,
        answer: WatchResponse,
    ) -> std::result::Result<WatchResponse, WatchEnd> {
        if !answer.canceled {
            return Ok(answer);
        }
        if answer.compact_revision > 0 {
            return Err(Compacted);
        }
        Err(Broken(self.unavailable(tonic::Status::unavailable(
            format!("watch cancelled: {}", answer.cancel_reason),
        ))))
    }

    pub(super) fn watch_ended(&self) -> Error {
        self.unavailable(tonic::Status::unavailable("watch stream ended"))
    }

    /// Our queued key's place in its process's line, or (`Err`) what the wait came to
    /// without one: a grant if nothing keeps our key out now, `None` to look again.
    pub(super) async fn join_line(
        &self,
        req: &AcquireRequest,
        mut seen: i64,
    ) -> Result<std::result::Result<Place, Option<Grant>>> {
        let prefix = queue_prefix(&req.name);
        // The keys ahead as read again when the line started after our read.
        let mut reread: Option<Waiting> = None;
        loop {
            let (line, fresh) = match self.inner.lines.get(&prefix) {
                Some(line) => (line, false),
                None => {
                    let end = prefix_end(&prefix);
                    let Some((watch, since)) = self.watch_deletes(&prefix, end, 0).await? else {
                        return Ok(Err(None));
                    };
                    (self.inner.lines.start(&prefix, watch, since), true)
                }
            };
            let (joined, second) = {
                let acquisitions = self.inner.acquisitions.locked();
                let Some(Acquisition {
                    key,
                    state: State::Queued { waiting, .. },
                    ..
                }) = acquisitions.get(&req.lease).map(|a| &**a)
                else {
                    return Ok(Err(None));
                };
                let ahead = reread.as_ref().unwrap_or(waiting);
                let joined = line.join(key, &ahead.ahead, ahead.room, seen);
                (joined, waiting.second)
            };
            match joined {
                Joined::Waiting(place) => return Ok(Ok(place)),
                Joined::Over(turn) => return Ok(Err(self.after_turn(req, turn))),
                Joined::Ended if fresh => return Err(self.watch_ended()),
                Joined::Ended => continue,
                // Behind our owner's key: look again (see `behind_owner`).
                Joined::Gap(_) if second => return Ok(Err(None)),
                Joined::Gap(since) => {
                    // The line started after our read: read again, as of its start.
                    let (queue, revision) = self.look(&req.name, &prefix, since).await?;
                    let Some((ours, _)) = self.queued_key(req) else {
                        return Ok(Err(None));
                    };
                    let Some(at) = queue.iter().position(|m| m.kv.key == ours.key) else {
                        return Ok(Err(None));
                    };
                    match standing(&queue, at).waiting {
                        Some(now) => reread = Some(now),
                        None => return Ok(Err(self.handed_over(req, &ours))),
                    }
                    seen = revision;
                }
            }
        }
    }

    /// Our turn in line has come: the lock is ours if our key is let in (`Free`) and not
    /// behind our owner's; else look again.
    pub(super) fn after_turn(&self, req: &AcquireRequest, turn: Turn) -> Option<Grant> {
        match turn {
            // Our key is gone: the next attempt says why.
            Turn::Gone => None,
            Turn::Free => match self.queued_key(req)? {
                (_, true) => None,
                (ours, false) => self.handed_over(req, &ours),
            },
        }
    }

    /// Our key while it waits in the queue, and whether it waits behind its owner's.
    fn queued_key(&self, req: &AcquireRequest) -> Option<(Ours, bool)> {
        let acquisitions = self.inner.acquisitions.locked();
        let (ours, waiting) = acquisitions.get(&req.lease)?.queued(&req.name)?;
        Some((ours, waiting.second))
    }

    /// The queue as of revision `at_least` or later. The member's own state (no quorum
    /// read) serves when it is that recent: keys ahead of ours never come back once gone,
    /// so a recent enough state tells which are left.
    pub(super) async fn look(
        &self,
        name: &LockName,
        prefix: &[u8],
        at_least: i64,
    ) -> Result<(Vec<Member>, i64)> {
        let local = RangeRequest {
            serializable: true,
            ..queue_keys(prefix, false)
        };
        let mut answer = self.range(Op::Range(local)).await?;
        let mut revision = answer.header.as_ref().map_or(0, |h| h.revision);
        if revision < at_least {
            answer = self.range(Op::Range(queue_keys(prefix, false))).await?;
            revision = answer.header.as_ref().map_or(0, |h| h.revision);
        }
        Ok((self.members(name, &answer.kvs)?, revision))
    }

    /// Nothing keeps our key out any more, and nothing can queue ahead of it: the lock is
    /// ours, if our own lease is surely still alive.
    pub(super) fn handed_over(&self, req: &AcquireRequest, ours: &Ours) -> Option<Grant> {
        let lease = self.current(ours.lease)?;
        if lease.left(Instant::now()) * 2 < lease.ttl().min(req.ttl) {
            return None;
        }
        let ours = &Ours {
            key: ours.key.clone(),
            lease,
            ..*ours
        };
        match self.granted(req, ours, ours.create) {
            Attempt::Granted(grant) => Some(grant),
            Attempt::Busy(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::acquire::tests::{request, started};
    use crate::store::{Lease, Store, Watermark};
    use crate::LockName;

    /// What thousands of waiters (and held locks) each keep while they wait is the state
    /// of these futures: the calls to etcd inside them are boxed, so that they stay small
    /// (before, 12 KB for an attempt waiting for its admission, 4 KB for a wait in line).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_futures_that_wait_stay_small() {
        let (_server, store) = started().await;
        let name = LockName::new("small-futures").unwrap();
        let req = request(&name, "o");
        let lease = Lease {
            name: name.clone(),
            id: req.lease.clone(),
        };
        let sizes = [
            ("acquire", std::mem::size_of_val(&*store.acquire(&req))),
            (
                "changed",
                std::mem::size_of_val(&*store.changed(&req, Watermark(0))),
            ),
            ("ended", std::mem::size_of_val(&*store.ended(&lease))),
            (
                "keep_alive",
                std::mem::size_of_val(&store.keep_alive(super::super::leases::borrowed(1))),
            ),
        ];
        for (call, size) in sizes {
            assert!(size <= 1024, "{call}: {size} bytes");
        }
        // A queued waiter carries its wait in line alone (a place in its line).
        let changed = sizes[1].1;
        assert!(changed <= 112, "changed: {changed} bytes");
    }
}
