//! For store authors: the small trait every store implements, the values that cross it,
//! and the lease arithmetic a store must agree with.
//!
//! A store answers single attempts and says when another attempt may be worth making.
//! Waiting, deadlines, renewal, re-entry bookkeeping above the store and guards live once,
//! in [`Lock`](crate::Lock) and [`LockGuard`](crate::LockGuard), so a store cannot get them
//! subtly wrong.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::{FencingToken, LockName, Result};

pub use crate::keepalive::{safe_deadline, DRIFT, MARGIN};
pub use crate::options::{waiter_lease, MAX_WAITER_LEASE};
pub use crate::rate::{gcra, RateLimit};

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LockKind {
    /// A mutex, or the write side of a read-write lock: one holder.
    Exclusive,
    /// The read side of a read-write lock: any number of readers, no writer.
    Shared,
    /// One of `permits` permits of a semaphore.
    Permit {
        /// How many holders the semaphore admits.
        permits: u32,
    },
}

impl LockKind {
    /// A short word for messages: `exclusive`, `shared`, `permit`.
    pub fn word(&self) -> &'static str {
        match self {
            LockKind::Exclusive => "exclusive",
            LockKind::Shared => "shared",
            LockKind::Permit { .. } => "permit",
        }
    }
}

/// A random id for one acquisition, made before the request is sent, so an acquire whose
/// answer never arrived can still be found and released.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LeaseId(Arc<str>);

/// A map by acquisition id, as the stores keep their acquisitions and waiters: the ids
/// are random, so a fast hash (foldhash, seeded per process) does, where the standard
/// one costs each of an acquisition's several lookups a few hundred instructions.
#[cfg(any(feature = "redis", feature = "etcd"))]
pub(crate) type ByLease<V> = std::collections::HashMap<LeaseId, V, foldhash::fast::RandomState>;

impl LeaseId {
    /// 128 random bits as 32 lowercase hex digits.
    pub fn random() -> Self {
        LeaseId(random_hex(&mut [0; 32]).into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id's text, shared (no copy).
    pub fn shared_text(&self) -> Arc<str> {
        self.0.clone()
    }
}

/// A lease id read back from a store's own records.
impl From<&str> for LeaseId {
    fn from(id: &str) -> Self {
        LeaseId(id.into())
    }
}

/// Looks up maps keyed by lease id with the id's text (`Hash` and `Eq` agree with `str`'s).
impl std::borrow::Borrow<str> for LeaseId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// 128 random bits as 32 lowercase hex digits, written in `out`.
fn random_hex(out: &mut [u8; 32]) -> &str {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bits = rand::random::<u128>();
    for (i, digit) in out.iter_mut().enumerate() {
        *digit = HEX[(bits >> (124 - 4 * i)) as usize & 15];
    }
    std::str::from_utf8(out).expect("hex digits are ASCII")
}

impl Debug for LeaseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who is asking: shown by `describe`, and used by stores that can tell when a process
/// on their own host has died.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requester {
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
}

impl Requester {
    /// This process.
    pub fn this_process() -> Self {
        Requester {
            host: crate::sys::hostname(),
            pid: std::process::id(),
        }
    }
}

/// One acquire attempt.
#[derive(Clone, Debug)]
pub struct AcquireRequest {
    /// The lock.
    pub name: LockName,
    /// This acquisition's id (see [`LeaseId`]).
    pub lease: LeaseId,
    /// Re-entry key: the same owner acquiring again holds it again. Shared: an
    /// anonymous acquisition's owner is its lease id's text, and a lock's owner id is
    /// the same for each acquisition.
    pub owner: Arc<str>,
    /// Mutex, read, write or permit.
    pub kind: LockKind,
    /// Lease length.
    pub ttl: Duration,
    /// FIFO: do not pass waiters queued ahead.
    pub fair: bool,
    /// When busy, join (or stay in) the wait queue, with a waiter lease of `ttl`.
    pub enqueue: bool,
    /// Since when this acquisition has waited in this process (behind another of its
    /// tasks), if it has. A store whose [`Capabilities::queues_by_wait`] is set queues a
    /// fair request as if it had arrived then, reckoning how long ago as it sends the
    /// call (again, if it must send it again); others ignore it.
    pub waited_since: Option<std::time::Instant>,
    /// Shown to others (shared by every request of a [`Leasehold`](crate::Leasehold)).
    pub requester: Arc<Requester>,
    /// Shown with the hold to others, until [`Store::proclaim`] replaces it: an election
    /// leader's value (its address, say). `None` for plain locks.
    pub value: Option<Arc<str>>,
}

impl AcquireRequest {
    /// The lease this request creates if granted.
    pub fn lease(&self) -> Lease {
        Lease {
            name: self.name.clone(),
            id: self.lease.clone(),
        }
    }
}

/// A held (or possibly held) lease: enough to renew or release it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The lock.
    pub name: LockName,
    /// The acquisition.
    pub id: LeaseId,
}

/// "State seen" marker for [`Store::changed`], made by the store in [`Busy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Watermark(pub u64);

/// The answer to one attempt.
#[derive(Clone, Debug)]
pub enum Attempt {
    /// The lock is ours.
    Granted(Grant),
    /// Someone else holds it, or waiters are ahead of us.
    Busy(Busy),
}

/// A granted acquisition.
#[derive(Clone, Debug)]
pub struct Grant {
    /// The fencing token (the holder's, unchanged on re-entry).
    pub token: FencingToken,
    /// How many times this owner now holds the lock (1 unless re-entered).
    pub holds: u32,
    /// The lease granted, when shorter than the one asked for (a lock handed to a queued
    /// waiter runs on the waiter's short lease until its first renewal).
    pub lease: Option<Duration>,
}

/// Why an attempt was not granted, and when trying again may help.
#[derive(Clone, Debug)]
pub struct Busy {
    /// A holder that stands in the way, if any.
    pub holder: Option<HolderInfo>,
    /// Our place in the wait queue (1 = next), where the store keeps one.
    pub position: Option<usize>,
    /// Try again by then even if no change was signalled: the earliest moment a holder's
    /// lease or a waiter ahead of us can expire.
    pub retry_in: Option<Duration>,
    /// Pass to [`Store::changed`].
    pub watermark: Watermark,
}

/// The answer to a renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renewal {
    /// The lease runs for the new TTL, counted from when the store handled it.
    Renewed,
    /// The lease is gone (expired, released or force-released).
    Lost,
}

/// The answer to a release. Releasing twice is not an error.
///
/// `#[must_use]`: [`NotHeld`](Released::NotHeld) from [`LockGuard::release`] says the lease
/// had ended before the release, so the work done since its safe deadline was not
/// protected by the lock. Look at it (`if guard.release().await? == Released::NotHeld`),
/// or say that it does not matter with `let _ =`:
///
/// ```
/// #![deny(unused_must_use)]
/// # async fn job(guard: leasehold::LockGuard) -> leasehold::Result<()> {
/// let _ = guard.release().await?;
/// # Ok(()) }
/// ```
///
/// Dropping it unlooked-at is a warning (an error here):
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// # async fn job(guard: leasehold::LockGuard) -> leasehold::Result<()> {
/// guard.release().await?;
/// # Ok(()) }
/// ```
///
/// [`LockGuard::release`]: crate::LockGuard::release
#[must_use = "NotHeld means the lease had ended first: the work since its safe deadline was not protected"]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Released {
    /// This acquisition's hold was removed (the lock is free if it was the last hold).
    Released,
    /// There was nothing to release: the lease had already ended.
    NotHeld,
}

/// One holder, as `describe` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderInfo {
    /// Owner id (re-entry key).
    pub owner: String,
    /// Where it runs.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// Its fencing token.
    pub token: FencingToken,
    /// Exclusive, shared or permit.
    #[serde(flatten)]
    pub kind: LockKind,
    /// When it acquired (the store's wall clock).
    #[serde(with = "unix_ms")]
    pub since: SystemTime,
    /// Lease left, as the store sees it.
    #[serde(with = "millis")]
    pub lease_left: Duration,
    /// Hold count (re-entries + 1).
    pub holds: u32,
    /// The value the holder published ([`AcquireRequest::value`], [`Store::proclaim`]):
    /// an election leader's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// One waiter, as `describe` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaiterInfo {
    /// Owner id.
    pub owner: String,
    /// Where it runs.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// What it waits for.
    #[serde(flatten)]
    pub kind: LockKind,
    /// When it started waiting (the store's wall clock).
    #[serde(with = "unix_ms")]
    pub since: SystemTime,
}

/// A lock's state: holders, waiters, the last token issued.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockState {
    /// The lock's name.
    pub name: String,
    /// The highest fencing token issued so far (0: never held). On etcd, which keeps no
    /// counter per name: the newest among current holders (0: nobody holds it).
    pub last_token: FencingToken,
    /// Current holders, oldest first.
    pub holders: Vec<HolderInfo>,
    /// Waiters in queue order.
    pub waiters: Vec<WaiterInfo>,
}

impl LockState {
    /// Whether `other` shows the same holders (owner, token) with the same values: what a
    /// [`Store::watch`] waits to change. Leases left and hold counts are not compared.
    pub fn same_holders(&self, other: &LockState) -> bool {
        fn key(h: &HolderInfo) -> (FencingToken, Option<&str>, &str) {
            (h.token, h.value.as_deref(), h.owner.as_str())
        }
        self.holders.len() == other.holders.len()
            && self
                .holders
                .iter()
                .map(key)
                .eq(other.holders.iter().map(key))
    }
}

/// What a store can do, for the library, the CLI and the conformance suite. A store of
/// your own starts from [`Capabilities::default`] (nothing promised) and sets what it
/// does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Locks are visible to other processes.
    pub cross_process: bool,
    /// A holder whose process dies is dropped at once rather than at its lease's end.
    pub reclaims_dead_processes: bool,
    /// Locks are fair (FIFO) unless [`Lock::with_fair`](crate::Lock::with_fair) says
    /// otherwise: the store's queue is its natural shape (etcd).
    pub fair_by_default: bool,
    /// [`Store::transfer`] queues a fair request by [`AcquireRequest::waited_since`]: behind
    /// the waiters that arrived before it, ahead of those that arrived after. Tasks of
    /// one process can then wait for a fair lock in the process, behind the one of them
    /// that is in the store's queue, without losing their place.
    pub queues_by_wait: bool,
    /// A call that returns an error changed nothing in the store (it never reached it,
    /// or was refused before any change), so an acquire that failed that way needs no
    /// undo: a bounded wait then ends at once instead of first trying to undo it on a
    /// store that cannot be reached. False where an error can hide a change that was made
    /// (a reply lost on the network).
    pub failed_calls_change_nothing: bool,
    /// The store keeps a waiting request's place alive itself (etcd: one lease that a
    /// client's waiting keys share), so a waiter need not ask again in time to keep it.
    pub keeps_waiters_alive: bool,
}

/// How a store takes the next attempt of a request (see [`Store::admit`]).
pub enum Admission {
    /// Send it now, holding this until it is answered.
    Now(Admitted),
    /// Wait for this first, before the attempt's state is built.
    Wait(std::pin::Pin<Box<dyn std::future::Future<Output = Admitted> + Send>>),
}

impl Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Admission::Now(admitted) => f.debug_tuple("Now").field(admitted).finish(),
            Admission::Wait(_) => f.write_str("Wait"),
        }
    }
}

/// A store's admission of one attempt, held until the attempt is answered.
#[derive(Debug, Default)]
pub struct Admitted {
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Admitted {
    /// Admitted with a permit of the store's own, given back when this is dropped.
    pub fn with(permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        Admitted {
            _permit: Some(permit),
        }
    }
}

/// A lock store. Every method is one attempt: none waits for a holder.
///
/// Stores keep these rules: every check-and-change is one atomic step; a lease's
/// expiry is counted from when the store handled the request (never earlier than the
/// client sent it); fencing tokens strictly increase per name and survive restarts of
/// a store that keeps its data; releasing is idempotent and checks ownership by
/// [`LeaseId`].
#[async_trait]
pub trait Store: Debug + Send + Sync + 'static {
    /// Acquire `req.name`, or say who is in the way.
    async fn acquire(&self, req: &AcquireRequest) -> Result<Attempt>;
    /// Extend our own lease to `ttl` from now, if it still exists.
    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Renewal>;
    /// Drop our hold (and our place in the queue, if waiting).
    async fn release(&self, lease: &Lease) -> Result<Released>;
    /// `release(from)` and then the attempt `to`, as one atomic step: how a process hands
    /// a lock from one of its tasks to the next in one round trip.
    async fn transfer(&self, from: &Lease, to: &AcquireRequest) -> Result<(Released, Attempt)>;
    /// Resolves once `req` may succeed if tried again: the lock changed since `since` in
    /// a way that can let `req` in (a release, a force-release, a queue move, a holder's
    /// process exit). A store that can tell should not resolve for changes that cannot
    /// help `req` (another holder arriving); it may resolve early. Only promptness
    /// depends on it: callers also retry at [`Busy::retry_in`].
    ///
    /// A store that hands the lock to a queued waiter itself says so with `Some(grant)`:
    /// the lease then runs from a moment after the waiter's last request was sent.
    async fn changed(&self, req: &AcquireRequest, since: Watermark) -> Result<Option<Grant>>;
    /// Resolves once the store no longer has `lease` as a hold (force-released, or ended
    /// by its lease), so a guard watching for loss learns it at once rather than at its
    /// next renewal. Must not resolve while the hold exists; may never resolve (the safe
    /// deadline still ends the guard).
    async fn ended(&self, lease: &Lease) -> Result<()>;
    /// Whether an attempt of `req` may be sent now. A store that takes only so many
    /// attempts at once (etcd: the puts of new keys) returns the wait, which the caller
    /// makes before it builds the attempt's state: thousands of requests that arrive at
    /// once then each hold the wait, not an attempt (whose pages the allocator keeps).
    fn admit(&self, _req: &AcquireRequest) -> Admission {
        Admission::Now(Admitted::default())
    }
    /// Gives back what the store keeps only to reuse (etcd: the leases of released
    /// locks, and the revokes of those it let go, still on their way), so that once
    /// [`Leasehold::shutdown`](crate::Leasehold::shutdown) returns, nothing of this client's
    /// is left in the store but its live locks. The store stays usable.
    async fn shed(&self) {}
    /// Holders and waiters of one lock.
    async fn describe(&self, name: &LockName) -> Result<LockState>;
    /// Every lock whose name starts with `prefix` that has holders or waiters.
    async fn list(&self, prefix: &str) -> Result<Vec<LockState>>;
    /// Remove every holder of `name`; their guards see the loss at their next renewal.
    /// Returns whether anyone held it.
    async fn force_release(&self, name: &LockName) -> Result<bool>;
    /// What this store can do.
    fn capabilities(&self) -> Capabilities;
    /// A short description for messages, e.g. `local:/var/lib/leasehold`.
    fn describe_store(&self) -> String;
    /// What a restart or failover of the store can lose that its users should know
    /// (held locks, tokens), as found when it was opened; `None` when nothing is known
    /// to be at risk. Shown by `leasehold status`.
    fn caveat(&self) -> Option<String>;

    /// Replaces the value shown with `lease`'s hold ([`HolderInfo::value`]) if the hold
    /// still exists, as one atomic step, and wakes [`watch`](Self::watch)ers: how an
    /// election leader proclaims. Ownership-checked like [`renew`](Self::renew); the lease
    /// itself is left as it is.
    async fn proclaim(&self, lease: &Lease, value: &str) -> Result<Renewal> {
        let _ = (lease, value);
        Err(crate::Error::Unsupported {
            store: self.describe_store(),
            what: "proclaimed values (elections)".into(),
        })
    }

    /// Turns the hold `lease` into a read hold ([`LockKind::Shared`]) in place, with the
    /// same token and lease, as one atomic step, by the lock rules (crate docs): refused
    /// ([`Error::Conflict`](crate::Error)) unless it is an exclusive hold and its owner's
    /// only one; already shared is done.
    /// Readers it now admits are let in or woken as by a release. `Renewal::Lost` if the
    /// hold is gone.
    async fn downgrade(&self, lease: &Lease) -> Result<Renewal> {
        let _ = lease;
        Err(crate::Error::Unsupported {
            store: self.describe_store(),
            what: "downgrading a write lock".into(),
        })
    }

    /// Resolves once the holders of `name` may differ from `seen` (a [`describe`] of it,
    /// compared with [`LockState::same_holders`]): a grant, a release, a force-release, a
    /// proclamation. Checks first, so a change made after `seen` was read and before this
    /// call is not missed. May resolve early; callers describe again. A lease running
    /// out need not wake it: callers also wake at the end of the leases they saw.
    ///
    /// The default describes again every 100 ms; every store in this crate is woken by
    /// the store itself instead.
    ///
    /// [`describe`]: Self::describe
    async fn watch(&self, name: &LockName, seen: &LockState) -> Result<()> {
        poll_holders(self, name, seen).await
    }

    /// One rate-limiter decision ([`RateRequest`]), as one atomic step on the store's
    /// own clock: the arithmetic of [`gcra`] on the limiter's stored theoretical
    /// arrival time. Optional: a store that has no clock every client can trust (etcd)
    /// keeps this default, which refuses with [`Error::Unsupported`](crate::Error).
    async fn rate(&self, req: &RateRequest) -> Result<crate::RateDecision> {
        Err(crate::Error::Unsupported {
            store: self.describe_store(),
            what: format!(
                "rate limiters (asked for \"{}\"); the local, Redis and memory stores do",
                req.name
            ),
        })
    }
}

/// One decision asked of a rate limiter.
#[derive(Clone, Debug)]
pub struct RateRequest {
    /// The limiter (a namespace apart from the locks: a lock and a limiter may share a
    /// name).
    pub name: LockName,
    /// Its rate and burst.
    pub limit: RateLimit,
    /// Units asked for: 1 to the burst.
    pub units: u64,
    /// Allow (and reserve) the units if they can pass within this many microseconds of
    /// now; 0: only if they can pass now.
    pub max_wait_us: u64,
}

/// Times as Unix milliseconds in JSON (`describe`, the leader).
pub(crate) mod unix_ms {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        let ms = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
        s.serialize_u64(ms)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        Ok(UNIX_EPOCH + Duration::from_millis(u64::deserialize(d)?))
    }
}

/// Durations as milliseconds in JSON.
pub(crate) mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

/// [`Store::watch`] by describing again every 100 ms: for stores that cannot be told.
pub(crate) async fn poll_holders<S: Store + ?Sized>(
    store: &S,
    name: &LockName,
    seen: &LockState,
) -> Result<()> {
    loop {
        if !store.describe(name).await?.same_holders(seen) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `describe` of each name, keeping the locks with holders or waiters, sorted by name:
/// the shared end of a store's `list`.
pub(crate) async fn busy_states<S: Store + ?Sized>(
    store: &S,
    names: Vec<LockName>,
) -> Result<Vec<LockState>> {
    let mut out = Vec::new();
    for name in names {
        let state = store.describe(&name).await?;
        if !state.holders.is_empty() || !state.waiters.is_empty() {
            out.push(state);
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}
