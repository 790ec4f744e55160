//! Leader election: one leader among candidates, seen by everyone, with its term as a
//! fencing token.
//!
//! An election is a fair exclusive lock whose holder publishes a value (its address, say)
//! with its hold. Everything a lock guarantees carries over: a lease renewed in the
//! background, a [`lost`](Leadership::lost) signal that fires before the next leader can
//! start, and a token ([`term`](Leadership::term)) that strictly increases from one
//! leader to the next. Candidates queue in arrival order, so a leader that resigns hands
//! over to the one that has waited longest.
//!
//! An election and a [`mutex`](crate::Leasehold::mutex) of the same name are the same
//! lock: `leasehold status NAME` shows the leader, and `leasehold release --force NAME`
//! deposes it.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::Stream;
use serde::Serialize;

use crate::store::{HolderInfo, LockKind, LockState, Renewal, Store};
use crate::{Error, FencingToken, Lock, LockGuard, LockName, LostSignal, Released, Result};

/// One election: make it with [`Leasehold::election`](crate::Leasehold::election).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold::Result<()> {
/// use leasehold::{Leasehold, MemoryStore};
///
/// let client = Leasehold::new(MemoryStore::new());
/// let election = client.election("db-primary")?;
/// let leadership = election.campaign("10.0.0.7:5432").await?;   // waits until we lead
/// println!("leading in term {}", leadership.term());
///
/// // Anyone can ask who leads, and follow the changes.
/// let leader = election.leader().await?.expect("we lead");
/// assert_eq!(leader.value.as_deref(), Some("10.0.0.7:5432"));
/// assert_eq!(leader.term, leadership.term());
///
/// leadership.proclaim("10.0.0.8:5432").await?;                   // same term, new value
/// let _ = leadership.resign().await?;                            // the next candidate leads
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Election {
    lock: Lock,
    store: Arc<dyn Store>,
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Election")
            .field("name", self.lock.name())
            .finish()
    }
}

/// The leader as everyone sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Leader {
    /// Its term: the fencing token of its leadership, higher than every earlier leader's.
    pub term: FencingToken,
    /// What it proclaimed (`None` while a plain mutex holder has the name).
    pub value: Option<String>,
    /// Its owner id.
    pub owner: String,
    /// Where it runs.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// When it became leader (the store's wall clock). On etcd, which records no moment
    /// of hand-over, the leader's own clock when it was let in (its key moved onto a
    /// lease of its own); an [`observe`](Election::observe)r may first see the moment it
    /// joined the queue of candidates, just before that move.
    #[serde(serialize_with = "crate::store::unix_ms::serialize")]
    pub since: SystemTime,
    /// Lease left, as the store saw it.
    #[serde(serialize_with = "crate::store::millis::serialize")]
    pub lease_left: Duration,
}

impl Leader {
    /// The leader in a lock's state: its exclusive holder.
    pub fn of(state: &LockState) -> Option<Leader> {
        let holder = state
            .holders
            .iter()
            .find(|h| h.kind == LockKind::Exclusive)?;
        Some(Leader::from(holder))
    }
}

impl From<&HolderInfo> for Leader {
    fn from(h: &HolderInfo) -> Self {
        Leader {
            term: h.token,
            value: h.value.clone(),
            owner: h.owner.clone(),
            host: h.host.clone(),
            pid: h.pid,
            since: h.since,
            lease_left: h.lease_left,
        }
    }
}

impl Election {
    pub(crate) fn new(lock: Lock, store: Arc<dyn Store>) -> Self {
        Election {
            lock: lock.with_fair(true),
            store,
        }
    }

    /// The leadership lease (default: the client's, 15 s unless set): a dead leader is
    /// replaced within it.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.lock = self.lock.with_ttl(ttl);
        self
    }

    /// The candidate's owner id, shown as the leader's. Default: a fresh id per campaign.
    /// Two campaigns under one owner id re-enter: both lead, in the same term, so give
    /// each candidate its own.
    pub fn with_owner(mut self, owner: impl Into<String>) -> Self {
        self.lock = self.lock.with_owner(owner);
        self
    }

    /// The election's name (the lock's, behind the client's key prefix).
    pub fn name(&self) -> &LockName {
        self.lock.name()
    }

    /// The lock a campaign for `value` takes: its guard is this candidate's leadership
    /// (its token the term). For code that drives locks generically, as the CLI's
    /// `elect` runs a command under it as `run` does under a lock; otherwise
    /// [`campaign`](Self::campaign) says more.
    pub fn candidate(&self, value: impl Into<String>) -> Lock {
        let value: String = value.into();
        self.lock.clone().with_value(Some(value.into()))
    }

    /// A campaign for `value` that `take`s the candidate's lock (waiting as it says).
    async fn run<F, Fut>(&self, value: String, take: F) -> Result<Option<Leadership>>
    where
        F: FnOnce(Lock) -> Fut,
        Fut: std::future::Future<Output = Result<Option<LockGuard>>>,
    {
        let Some(guard) = take(self.candidate(value.clone())).await? else {
            return Ok(None);
        };
        // A re-entry (this owner id leads already) keeps the leader's value: say that one.
        let value = match guard.holds() > 1 {
            true => (self.leader().await?.and_then(|l| l.value)).unwrap_or(value),
            false => value,
        };
        Ok(Some(Leadership {
            guard,
            value: Mutex::new(value),
            store: self.store.clone(),
        }))
    }

    /// Waits until this candidate leads, publishing `value` as the leader's. Candidates
    /// are served in arrival order and woken by the store, not polling.
    ///
    /// # Cancel safety
    /// Cancel-safe, as [`Lock::lock`]: a dropped campaign leaves the queue.
    pub async fn campaign(&self, value: impl Into<String>) -> Result<Leadership> {
        let led = self.run(
            value.into(),
            |lock| async move { lock.lock().await.map(Some) },
        );
        let led = led.await?;
        led.ok_or_else(|| {
            Error::Internal("a campaign without a limit ended without leading".into())
        })
    }

    /// Leads now if nobody does (and no candidate waits ahead), else `None`.
    pub async fn try_campaign(&self, value: impl Into<String>) -> Result<Option<Leadership>> {
        (self.run(value.into(), |lock| async move { lock.try_lock().await })).await
    }

    /// As [`campaign`](Self::campaign), waiting `wait` at most.
    pub async fn campaign_for(
        &self,
        value: impl Into<String>,
        wait: Duration,
    ) -> Result<Option<Leadership>> {
        (self.run(
            value.into(),
            |lock| async move { lock.try_lock_for(wait).await },
        ))
        .await
    }

    /// As [`campaign`](Self::campaign), waiting until `deadline` at most.
    pub async fn campaign_until(
        &self,
        value: impl Into<String>,
        deadline: std::time::Instant,
    ) -> Result<Option<Leadership>> {
        (self.run(value.into(), |lock| async move {
            lock.try_lock_until(deadline).await
        }))
        .await
    }

    /// The current leader, or `None`.
    pub async fn leader(&self) -> Result<Option<Leader>> {
        Ok(Leader::of(&self.store.describe(self.name()).await?))
    }

    /// Follows the leader: see [`Observer`].
    pub fn observe(&self) -> Observer {
        Observer {
            store: self.store.clone(),
            name: self.name().clone(),
            shown: None,
            highest: None,
        }
    }
}

/// This candidate's leadership: renewed in the background while it lives; dropping it
/// resigns (in the background, as dropping a [`LockGuard`] releases).
#[derive(Debug)]
pub struct Leadership {
    guard: LockGuard,
    value: Mutex<String>,
    store: Arc<dyn Store>,
}

impl Leadership {
    /// The term: a fencing token higher than every earlier leader's. Send it with every
    /// write the leader makes, so that a resource can refuse a deposed leader's.
    pub fn term(&self) -> FencingToken {
        self.guard.token()
    }

    /// The value this leader published last.
    pub fn value(&self) -> String {
        self.value.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Publishes a new value, in the same term, if this candidate still leads; observers
    /// see it. [`Error::Lost`] once the leadership is gone.
    ///
    /// Proclamations of one leadership are best made one at a time: two at once reach the
    /// store in either order, and [`value`](Self::value) says the last to return.
    pub async fn proclaim(&self, value: impl Into<String>) -> Result<()> {
        let value = value.into();
        crate::options::check_value(&value)?;
        self.guard.check()?;
        match self.store.proclaim(self.guard.lease(), &value).await? {
            Renewal::Renewed => {
                if let Ok(mut v) = self.value.lock() {
                    *v = value;
                }
                Ok(())
            }
            Renewal::Lost => {
                // Lost for every use of the guard, not only this call's answer.
                self.guard
                    .gone("the store no longer has this leadership (found by a proclamation)");
                self.guard.check().map(|_| ())
            }
        }
    }

    /// The term, if this candidate provably leads at this instant; else [`Error::Lost`].
    pub fn check(&self) -> Result<FencingToken> {
        self.guard.check()
    }

    /// Whether the leadership can no longer be proven.
    pub fn is_lost(&self) -> bool {
        self.guard.is_lost()
    }

    /// Resolves once the leadership can no longer be proven: before the next leader can
    /// start. See [`LockGuard::lost`].
    pub async fn lost(&self) {
        self.guard.lost().await
    }

    /// The lost signal, to watch from another task.
    pub fn lost_signal(&self) -> LostSignal {
        self.guard.lost_signal()
    }

    /// The lock guard underneath (its lease, deadlines, renewal state).
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// Stops renewing without resigning: the leadership ends with its lease, as a dead
    /// leader's does. See [`LockGuard::leak`].
    pub fn leak(self) -> crate::store::Lease {
        self.guard.leak()
    }

    /// Steps down now; the next candidate leads. [`Released::NotHeld`] says the
    /// leadership had already ended.
    pub async fn resign(self) -> Result<Released> {
        self.guard.release().await
    }
}

/// Follows an election's leader: [`next`](Self::next) returns the leader now, then each
/// change (a new leader, a new value, no leader), woken by the store. Never shows an
/// older term after a newer one. Leaders that come and go between two looks may be
/// missed; one that leads for a renewal interval is seen.
#[derive(Debug)]
pub struct Observer {
    store: Arc<dyn Store>,
    name: LockName,
    /// What `next` returned last, the state it came from and when that was read.
    shown: Option<Shown>,
    /// The highest term shown so far.
    highest: Option<FencingToken>,
}

#[derive(Debug)]
struct Shown {
    leader: Option<Leader>,
    state: LockState,
    read_at: tokio::time::Instant,
}

impl Observer {
    /// The leader now on the first call; after that, waits for a change and returns it.
    /// An error (the store unreachable) can be retried by calling again.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only reads.
    pub async fn next(&mut self) -> Result<Option<Leader>> {
        loop {
            if let Some(shown) = &self.shown {
                self.wait(shown).await?;
            }
            let read_at = tokio::time::Instant::now();
            let state = self.store.describe(&self.name).await?;
            let leader = Leader::of(&state);
            let changed = match &self.shown {
                None => true,
                Some(shown) => key(shown.leader.as_ref()) != key(leader.as_ref()),
            };
            let went_back = match (self.highest, &leader) {
                (Some(highest), Some(now)) if now.term < highest => Some((highest, now.term)),
                _ => None,
            };
            self.shown = Some(Shown {
                leader: leader.clone(),
                state,
                read_at,
            });
            if let Some((highest, now)) = went_back {
                // The baseline moves on, so the next call waits for the next change.
                return Err(Error::Corrupt {
                    store: self.store.describe_store(),
                    name: self.name.to_string(),
                    reason: format!(
                        "the leader's term went back from {highest} to {now}: the store lost its state"
                    ),
                });
            }
            if let Some(l) = &leader {
                self.highest = Some(self.highest.map_or(l.term, |h| h.max(l.term)));
            }
            if changed {
                return Ok(leader);
            }
        }
    }

    /// Until the store says the holders changed, or the first lease seen could have run
    /// out (a lease ending wakes no store), counted from when it was read.
    async fn wait(&self, shown: &Shown) -> Result<()> {
        let seen = &shown.state;
        let lease_end = seen.holders.iter().map(|h| h.lease_left).min();
        let expiry = async {
            match lease_end {
                Some(left) => {
                    let at = shown.read_at + left + Duration::from_millis(1);
                    tokio::time::sleep_until(at).await
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = self.store.watch(&self.name, seen) => changed,
            () = expiry => Ok(()),
        }
    }

    /// The changes as a [`Stream`]. It ends after an error that calling again cannot
    /// mend (not [`Error::is_retryable`]), which it yields first.
    pub fn into_stream(self) -> impl Stream<Item = Result<Option<Leader>>> {
        futures_util::stream::unfold(Some(self), |observer| async move {
            let mut observer = observer?;
            let next = observer.next().await;
            let go_on = match &next {
                Err(e) if !e.is_retryable() => None,
                _ => Some(observer),
            };
            Some((next, go_on))
        })
    }
}

/// What makes two looks at the leader a change: its term and its value.
fn key(leader: Option<&Leader>) -> Option<(FencingToken, Option<&str>)> {
    leader.map(|l| (l.term, l.value.as_deref()))
}
