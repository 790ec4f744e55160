//! The same locks for synchronous code: each call waits on the calling thread for the
//! async core, which runs on a runtime of the client's own (the shape of
//! `reqwest::blocking`).
//!
//! ```
//! # fn main() -> leasehold::Result<()> {
//! use std::time::Duration;
//! use leasehold::blocking::Leasehold;
//! use leasehold::{MemoryStore, Released};
//!
//! let locks = Leasehold::new(MemoryStore::new())?;
//! let nightly = locks.mutex("nightly")?.with_ttl(Duration::from_secs(30));
//! let guard = nightly.lock()?; // renewed in the background while it lives
//! let token = guard.check()?; // send it with every write the lock protects
//! assert!(nightly.try_lock()?.is_none());
//! assert_eq!(guard.release()?, Released::Released);
//!
//! // Semaphores and read-write locks too; dropping a guard releases it.
//! let first = locks.read("catalog")?.lock()?;
//! let second = locks.read("catalog")?.lock()?;
//! assert!(locks.write("catalog")?.try_lock_for(Duration::from_millis(50))?.is_none());
//! drop((first, second));
//! assert!(locks.write("catalog")?.try_lock()?.is_some());
//! # let _ = token; Ok(()) }
//! ```
//!
//! # What it costs
//! A [`Leasehold`] starts a tokio runtime with one worker thread, shared by its clones,
//! its locks and guards; the thread runs renewals, releases of dropped guards and the
//! store's connections. Each call hands its work to that thread and waits for the answer.
//! Prefer the async API ([`crate::Leasehold`]) in async code and where many locks are
//! waited for at once: a blocking wait holds its calling thread for as long as it lasts.
//!
//! # Inside an async runtime
//! Nothing here panics there, but every call blocks the thread it is made on, which then
//! runs no other task until the call returns (on a current-thread runtime, none at all).
//! From async code use the async API, or call from `tokio::task::spawn_blocking`.
//!
//! # Release
//! [`LockGuard::release`] waits for the store's answer. Dropping a guard releases it in
//! the background on the client's runtime. Dropping the last handle on a client (its
//! last clone, lock or guard) waits up to a second for those releases before the runtime
//! stops; without that, a lock stays held until its lease ends.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Runtime;

use crate::{Error, FencingToken, IntoLockName, LockKind, LockName, Released, Result, Store};

/// How long dropping the last handle on a client waits for the releases it left to run.
const SHUTDOWN_PATIENCE: Duration = Duration::from_secs(1);

/// A store plus this process's identity, with a runtime of its own: makes blocking lock
/// handles. Cheap to clone; clones share the runtime.
///
/// ```
/// # #[cfg(feature = "local")]
/// # fn main() -> leasehold::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// use leasehold::blocking::Leasehold;
/// use leasehold::LocalStore;
///
/// // The processes of this host, from plain threads.
/// let locks = Leasehold::new(LocalStore::open(dir.path())?)?;
/// let backup = locks.mutex("backup")?;
/// let guard = backup.lock()?;
/// let other = std::thread::spawn({
///     let backup = backup.clone();
///     move || backup.try_lock().map(|guard| guard.is_none())
/// });
/// assert!(other.join().unwrap()?, "held by the first thread");
/// drop(guard); // released on the client's runtime
/// # Ok(()) }
/// # #[cfg(not(feature = "local"))]
/// # fn main() {}
/// ```
#[derive(Clone, Debug)]
pub struct Leasehold {
    client: Arc<Client>,
    lock_name_metrics: bool,
}

/// The async client and the runtime it runs on; stopped when the last handle goes.
struct Client {
    locks: crate::Leasehold,
    runtime: Option<Runtime>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("locks", &self.locks)
            .finish()
    }
}

impl Client {
    fn runtime(&self) -> &Runtime {
        self.runtime
            .as_ref()
            .expect("the runtime lives until the client is dropped")
    }

    /// Runs `work` on the client's runtime and waits on this thread for its output.
    fn wait<T: Send + 'static>(&self, work: impl Future<Output = T> + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.runtime().spawn(async move {
            let _ = tx.send(work.await);
        });
        // The task sends before it ends; only a panic in `work` drops the sender.
        rx.recv()
            .unwrap_or_else(|_| panic!("a leasehold::blocking call panicked on its runtime"))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let Some(runtime) = self.runtime.take() else {
            return;
        };
        let locks = self.locks.clone();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        runtime.spawn(async move {
            let _ = tx.send(locks.shutdown(SHUTDOWN_PATIENCE).await);
        });
        let _ = rx.recv();
        // Not `drop(runtime)`, which panics when called from async code.
        runtime.shutdown_background();
    }
}

impl Leasehold {
    /// Locks on `store`, with a runtime of their own.
    pub fn new(store: impl Store) -> Result<Self> {
        Self::from_store(Arc::new(store))
    }

    /// Locks on a shared store, with a runtime of their own.
    pub fn from_store(store: Arc<dyn Store>) -> Result<Self> {
        Ok(Self::with(crate::Leasehold::from_store(store), runtime()?))
    }

    /// Opens the store a URL names (see [`open_store`](crate::open_store)).
    pub fn connect(url: &str) -> Result<Self> {
        let runtime = runtime()?;
        let url = url.to_string();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        runtime.spawn(async move {
            let _ = tx.send(crate::Leasehold::connect(&url).await);
        });
        let locks = rx
            .recv()
            .map_err(|_| Error::Internal("opening the store panicked".into()))?;
        let locks = match locks {
            Ok(locks) => locks,
            Err(e) => {
                runtime.shutdown_background();
                return Err(e);
            }
        };
        Ok(Self::with(locks, runtime))
    }

    fn with(locks: crate::Leasehold, runtime: Runtime) -> Self {
        Leasehold {
            client: Arc::new(Client {
                locks,
                runtime: Some(runtime),
            }),
            lock_name_metrics: false,
        }
    }

    /// Labels metrics with the lock name too (see
    /// [`crate::Leasehold::with_lock_name_metrics`]).
    pub fn with_lock_name_metrics(mut self, on: bool) -> Self {
        self.lock_name_metrics = on;
        self
    }

    /// The async client, with this handle's settings.
    fn locks(&self) -> crate::Leasehold {
        (self.client.locks.clone()).with_lock_name_metrics(self.lock_name_metrics)
    }

    fn lock(&self, lock: Result<crate::Lock>) -> Result<Lock> {
        Ok(Lock {
            inner: lock?,
            client: self.client.clone(),
        })
    }

    /// A mutex (see [`crate::Leasehold::mutex`]).
    pub fn mutex<N: IntoLockName>(&self, name: N) -> Result<Lock> {
        self.lock(self.locks().mutex(name))
    }

    /// A semaphore of `permits` (see [`crate::Leasehold::semaphore`]).
    pub fn semaphore<N: IntoLockName>(&self, name: N, permits: u32) -> Result<Lock> {
        self.lock(self.locks().semaphore(name, permits))
    }

    /// The read side of a read-write lock (see [`crate::Leasehold::read`]).
    pub fn read<N: IntoLockName>(&self, name: N) -> Result<Lock> {
        self.lock(self.locks().read(name))
    }

    /// The write side of a read-write lock (see [`crate::Leasehold::write`]).
    pub fn write<N: IntoLockName>(&self, name: N) -> Result<Lock> {
        self.lock(self.locks().write(name))
    }

    /// Frees a lock whoever holds it (see [`crate::Leasehold::force_release`]).
    pub fn force_release<N: IntoLockName>(&self, name: N) -> Result<bool> {
        let name = name.into_lock_name()?;
        let locks = self.locks();
        self.client
            .wait(async move { locks.force_release(name).await })
    }

    /// The async client underneath, e.g. to hand to async code.
    pub fn as_async(&self) -> &crate::Leasehold {
        &self.client.locks
    }
}

/// The runtime of a client: one worker thread, for renewals, releases and connections.
fn runtime() -> Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("leasehold-blocking")
        .enable_all()
        .build()
        .map_err(|e| Error::Internal(format!("cannot start the blocking client's runtime: {e}")))
}

/// A blocking handle on one lock name with its options (see [`crate::Lock`]). Cheap to
/// clone, and to send to other threads.
#[derive(Clone, Debug)]
pub struct Lock {
    inner: crate::Lock,
    client: Arc<Client>,
}

impl Lock {
    /// Lease length (see [`crate::Lock::with_ttl`]).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.inner = self.inner.with_ttl(ttl);
        self
    }

    /// First come, first served (see [`crate::Lock::with_fair`]).
    pub fn with_fair(mut self, fair: bool) -> Self {
        self.inner = self.inner.with_fair(fair);
        self
    }

    /// The re-entry key (see [`crate::Lock::with_owner`]).
    pub fn with_owner(mut self, owner: impl Into<String>) -> Self {
        self.inner = self.inner.with_owner(owner);
        self
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        self.inner.name()
    }

    fn guard(&self, guard: crate::LockGuard) -> LockGuard {
        LockGuard {
            inner: Some(guard),
            client: self.client.clone(),
        }
    }

    /// One attempt; `None` if someone else holds it.
    pub fn try_lock(&self) -> Result<Option<LockGuard>> {
        let lock = self.inner.clone();
        let guard = self.client.wait(async move { lock.try_lock().await })?;
        Ok(guard.map(|g| self.guard(g)))
    }

    /// Waits as long as it takes.
    pub fn lock(&self) -> Result<LockGuard> {
        let lock = self.inner.clone();
        let guard = self.client.wait(async move { lock.lock().await })?;
        Ok(self.guard(guard))
    }

    /// Waits at most `wait`; `None` if it ran out.
    pub fn try_lock_for(&self, wait: Duration) -> Result<Option<LockGuard>> {
        let lock = self.inner.clone();
        let guard = self
            .client
            .wait(async move { lock.try_lock_for(wait).await })?;
        Ok(guard.map(|g| self.guard(g)))
    }

    /// Waits until `deadline` at most; `None` if it passed.
    pub fn try_lock_until(&self, deadline: std::time::Instant) -> Result<Option<LockGuard>> {
        let lock = self.inner.clone();
        let guard = self
            .client
            .wait(async move { lock.try_lock_until(deadline).await })?;
        Ok(guard.map(|g| self.guard(g)))
    }
}

/// A held lock, renewed in the background on the client's runtime while it lives (see
/// [`crate::LockGuard`]). Dropping it releases it in the background.
#[must_use = "the lock is released (best effort) as soon as the guard is dropped"]
pub struct LockGuard {
    inner: Option<crate::LockGuard>,
    client: Arc<Client>,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Some(guard) => guard.fmt(f),
            None => f.write_str("LockGuard { ended }"),
        }
    }
}

impl LockGuard {
    fn held(&self) -> &crate::LockGuard {
        // Only `release` takes it, and it consumes the guard.
        self.inner.as_ref().expect("guard is held until consumed")
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        self.held().name()
    }

    /// The fencing token of this acquisition; prefer [`check`](Self::check).
    pub fn token(&self) -> FencingToken {
        self.held().token()
    }

    /// Exclusive, shared or permit.
    pub fn kind(&self) -> LockKind {
        self.held().kind()
    }

    /// The token, if the lock is provably held now; otherwise [`Error::Lost`].
    pub fn check(&self) -> Result<FencingToken> {
        self.held().check()
    }

    /// Whether the lock can no longer be proven held.
    pub fn is_lost(&self) -> bool {
        self.held().is_lost()
    }

    /// Blocks until the lock can no longer be proven held (see [`crate::LockGuard::lost`]).
    pub fn lost(&self) {
        let signal = {
            let _in = self.client.runtime().enter();
            self.held().lost_signal()
        };
        self.client.wait(async move { signal.lost().await })
    }

    /// Blocks until the lock is lost or `wait` has passed; whether it was lost.
    pub fn lost_within(&self, wait: Duration) -> bool {
        let signal = {
            let _in = self.client.runtime().enter();
            self.held().lost_signal()
        };
        self.client
            .wait(async move { tokio::time::timeout(wait, signal.lost()).await.is_ok() })
    }

    /// Turns this write hold into a read hold in place (see
    /// [`crate::LockGuard::downgrade`]).
    pub fn downgrade(&mut self) -> Result<()> {
        let mut guard = self.inner.take().expect("guard is held until consumed");
        let (guard, done) = self.client.wait(async move {
            let done = guard.downgrade().await;
            (guard, done)
        });
        self.inner = Some(guard);
        done
    }

    /// Releases this hold and waits for the store's answer (see
    /// [`crate::LockGuard::release`]).
    pub fn release(mut self) -> Result<Released> {
        let guard = self.inner.take().expect("guard is held until consumed");
        self.client.wait(async move { guard.release().await })
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Some(guard) = self.inner.take() {
            // The async guard releases on the runtime it finds current: ours.
            let _in = self.client.runtime().enter();
            drop(guard);
        }
    }
}
