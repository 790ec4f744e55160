//! Distributed locks with leases, fencing tokens and a lost signal.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold::Result<()> {
//! use std::time::Duration;
//! use leasehold::{Leasehold, MemoryStore, Released};
//!
//! let locks = Leasehold::new(MemoryStore::new());
//! let guard = locks
//!     .mutex("nightly-report")?
//!     .with_ttl(Duration::from_secs(10))
//!     .try_lock_for(Duration::from_secs(30))
//!     .await?
//!     .expect("nobody else holds it");
//!
//! tokio::select! {
//!     _ = async { /* the work */ } => {}
//!     _ = guard.lost() => { /* stop: someone else may hold it now */ }
//! }
//! let token = guard.check()?; // fails once the lock can no longer be proven held
//! assert_eq!(token.get(), 1);
//! // NotHeld: the lease ended before the release, so the last work was not protected.
//! assert_eq!(guard.release().await?, Released::Released);
//! # Ok(()) }
//! ```
//!
//! # What you get
//! - [`Lock::try_lock`], [`Lock::lock`], [`Lock::try_lock_for`], [`Lock::try_lock_until`],
//!   all cancel-safe: an acquire whose answer never arrived is undone by its id.
//! - A lease on every lock, renewed in the background at about a third of its TTL while
//!   the [`LockGuard`] lives; renew and release check ownership.
//! - A [`FencingToken`] per acquisition, strictly increasing per lock name.
//! - A safe deadline, on the monotonic clock: the send time of the last confirmed
//!   acquire or renewal, plus the TTL less 1% drift and a 2 ms margin.
//!   [`LockGuard::lost`] resolves at that deadline if no renewal was confirmed, or at
//!   once when the store says the lease is gone — before the store can give the lock to
//!   anyone else.
//! - Re-entry by owner id ([`Lock::with_owner`]), fair and non-fair modes, semaphores
//!   ([`Leasehold::semaphore`]), read-write locks ([`Leasehold::read`],
//!   [`Leasehold::write`]; a mutex is the write side of its name's read-write lock, so
//!   `mutex(n)` and `write(n)` are the same lock), [`Leasehold::describe`],
//!   [`Leasehold::list`], [`Leasehold::force_release`].
//! - Rate limiters on the same stores ([`Leasehold::rate_limiter`], GCRA): at most
//!   `burst + rate·t` units in any window of length `t`; waits sleep until their turn.
//! - Leader election ([`Leasehold::election`]): candidates [`campaign`](Election::campaign)
//!   in arrival order, the leader publishes a value and holds a [`Leadership`] with a
//!   term (its fencing token) and the lost signal; anyone reads the
//!   [`leader`](Election::leader) or [`observe`](Election::observe)s each change. Use a
//!   plain lock when the others need not know who holds it.
//!
//! # The lock rules
//! Every store gives the same answer to the same request (one decision table in the
//! library; the conformance suite checks each store against it). For a request of an
//! owner asking for a kind of hold:
//!
//! | the name is held or awaited as… | request | answer |
//! |---|---|---|
//! | a mutex or read-write lock | a semaphore | refused ([`Error::Conflict`]): a name is one kind of lock at a time |
//! | a semaphore of N permits | a mutex, read or write lock | refused |
//! | a semaphore of N permits | a semaphore of M ≠ N | refused: use the same count everywhere |
//! | held by the same owner, as a writer | write or read | re-entered: one more hold, the same token |
//! | held by the same owner, as a reader | read | re-entered |
//! | held by the same owner, as a reader | write | refused: two readers upgrading would wait for each other forever; release the read hold first |
//! | held by the same owner, a permit | a permit (same N) | re-entered: still one permit |
//! | held by others | — | readers share with readers; permit holders with permit holders, one permit per owner up to N; a writer or mutex holder with nobody |
//!
//! Waiters: a fair request ([`Lock::with_fair`]) waits behind everyone queued before it,
//! except that readers behind readers are let in together; a non-fair request may pass
//! queued waiters, except that a reader never passes a waiting writer (writers do not
//! starve). A re-entry is granted whatever waits. A refused request leaves nothing in
//! the store.
//!
//! A writer may turn its hold into a read hold in place ([`LockGuard::downgrade`]): same
//! token, nobody passed, readers admitted as by a release. Only as its owner's one hold:
//! an owner's holds are one holder, and its other holds' guards count on holding alone.
//!
//! # Choosing a store
//! - [`MemoryStore`]: the tasks of one process.
//! - [`LocalStore`] (feature `local`, on by default): the processes of one host; nothing
//!   to install. The `leasehold` CLI's default.
//! - `RedisStore` (feature `redis`): a Redis server or Redis Cluster.
//! - `EtcdStore` (feature `etcd`): an etcd cluster; fair queues by create revision.
//! - Any [`Store`] you implement: the [`store`] module has what a store sees and
//!   answers; run the `conformance` suite (feature `conformance`) against it.
//!
//! [`open_store`] and [`Leasehold::connect`] take a store URL (`local:DIR`,
//! `redis://...`, `etcd://...`; every form in [`url::URL_FORMS`]), read by [`StoreUrl`],
//! whose `Display` shows a password as `***`.
//! [`Leasehold::builder`] configures what a URL does not say: the default TTL, a key
//! prefix for applications sharing a store, timeouts, TLS client certificates and
//! waiting for the store to come up (see [`LeaseholdBuilder`]).
//!
//! # Release
//! [`LockGuard::release`] is the way to end a hold. Dropping a guard stops renewal and
//! makes a best-effort release on the current tokio runtime; the only promise is that
//! the lease expires within its TTL.
//!
//! A dropped acquire (a cancelled [`Lock::lock`] future) leaves the queue the same way,
//! in the background. Before the process exits, call [`Leasehold::shutdown`]: it waits
//! (for a bound you choose) for those releases and undos, which would otherwise end with
//! the runtime. A process that dies without that chance holds up a fair queue for at
//! most its waiter lease ([`store::waiter_lease`], at most 5 s), and a lock for its TTL.
//!
//! # Metrics
//! Through the [`metrics`](https://docs.rs/metrics) facade: install any recorder (a
//! Prometheus exporter, StatsD, ...) to collect them; with none installed each costs
//! building its few labels and a no-op call. Every metric has the labels `store` (the
//! store's scheme: `memory`, `local`, `redis`, `etcd`...) and `kind` (`exclusive`,
//! `shared`, `permit`; not on force releases), plus `lock` (the lock name) when
//! [`Leasehold::with_lock_name_metrics`] turns it on: off by default, as every name
//! then makes series of its own.
//!
//! | name | type | extra label | what |
//! |---|---|---|---|
//! | `leasehold_acquisitions_total` | counter | `outcome`: `acquired`, `timed_out` (a wait ran out), `refused` (busy for `try_lock`, or refused by the lock rules), `error` | acquires that ended |
//! | `leasehold_losses_total` | counter | `reason`: `renewal_failed` (no renewal confirmed by the safe deadline), `gone` (a renewal found the lease gone), `force_released` (the store's watch saw the hold taken away) | guards that learned their lock was lost |
//! | `leasehold_renewals_total` | counter | `outcome`: `ok`, `failed` | renewals sent (background and [`LockGuard::extend`]) |
//! | `leasehold_releases_total` | counter | `outcome`: `ok`, `not_held` (the lease had ended), `resent` (store trouble: sent again in the background), `error` | guard releases, explicit or on drop |
//! | `leasehold_force_releases_total` | counter | | [`Leasehold::force_release`] calls that reached the store |
//! | `leasehold_wait_seconds` | histogram | | from the call to the grant, for acquires that got the lock |
//! | `leasehold_hold_seconds` | histogram | | from the grant to the guard's end (release, drop, leak) |
//! | `leasehold_renewal_seconds` | histogram | | one renewal, sent to answered |
//! | `leasehold_store_call_seconds` | histogram | `call`: `acquire`, `renew`, `release`, `force_release` | one store call, as the core saw it |
//! | `leasehold_held` | gauge | | guards alive |
//! | `leasehold_waiting` | gauge | | acquires waiting: told busy by the store, or queued behind another task of this process |
//!
//! # Blocking API
//! [`blocking`] has the same locks for synchronous code, on a runtime of its own.
//!
//! # Features
//! - `local` (default): the local store (Linux).
//! - `redis`: the Redis store, one server or a Cluster (TLS with rustls).
//! - `etcd`: the etcd store (gRPC with tonic, TLS with rustls; no `protoc` needed).
//! - `conformance`: the behaviour suite every store passes, for authors of a store of
//!   their own.
//!
//! # Who each name is for
//! The crate root holds what a user of locks needs. [`store`] holds what an author of a
//! store needs (the [`Store`] trait's requests and answers, the lease arithmetic). Names
//! hidden from these docs serve the `leasehold` command and are not part of the API.

#![warn(missing_docs)]

pub mod blocking;
mod builder;
mod election;
mod error;
mod fence;
mod gate;
mod guard;
mod keepalive;
mod lock;
mod memory;
mod metrics;
mod name;
mod options;
mod rate;
mod record;
mod rules;
pub mod store;
mod sys;
#[cfg(any(feature = "redis", feature = "etcd"))]
mod tls;
pub mod url;

#[cfg(feature = "local")]
pub mod local;

#[cfg(feature = "redis")]
pub mod redis;

#[cfg(feature = "etcd")]
pub mod etcd;

#[cfg(feature = "conformance")]
pub mod conformance;

pub use builder::{LeaseholdBuilder, MAX_CLIENT_TIMEOUT, MAX_KEY_PREFIX_LEN};
pub use election::{Election, Leader, Leadership, Observer};
pub use error::{BoxError, Error, Result};
#[cfg(feature = "etcd")]
pub use etcd::EtcdStore;
pub use fence::{FenceGate, FencingToken, FileFence};
pub use guard::{Deadlines, LockGuard, LostSignal};
#[cfg(feature = "local")]
pub use local::LocalStore;
pub use lock::{Leasehold, Lock};
pub use memory::MemoryStore;
pub use name::{IntoLockName, LockName, MAX_NAME_LEN};
pub use options::{DEFAULT_TTL, MAX_OWNER_LEN, MAX_PERMITS, MAX_TTL, MAX_VALUE_LEN, MIN_TTL};
pub use rate::{Rate, RateDecision, RateLimiter, MAX_RATE_TOLERANCE};
#[cfg(feature = "redis")]
pub use redis::RedisStore;
pub use store::{Busy, HolderInfo, LockKind, LockState, Released, Store, WaiterInfo};
pub use url::{open_store, StoreUrl};

// For the `leasehold` command: not part of the API.
#[doc(hidden)]
pub use options::humanize;

/// [`Mutex::lock`](std::sync::Mutex::lock) that goes on after a panic in another task:
/// every critical section here is a few assignments that leave the data whole, and a lock
/// library must not turn one panic into a panic in every task using the same lock.
pub(crate) trait Locked<T> {
    fn locked(&self) -> std::sync::MutexGuard<'_, T>;
}

impl<T> Locked<T> for std::sync::Mutex<T> {
    fn locked(&self) -> std::sync::MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|e| e.into_inner())
    }
}
