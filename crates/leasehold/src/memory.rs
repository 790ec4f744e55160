//! In-process store: locks shared by the tasks of one process.
//!
//! Always built. Useful on its own (one process, many tasks) and as the store for doc
//! examples and tests. State lives in a mutex; waiters are woken by [`tokio::sync::Notify`].
//! Nothing survives the process, so tokens restart at 1 in a new process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::record::{Look, Now, Record, Wake};
use crate::store::{
    gcra, AcquireRequest, Attempt, Capabilities, Grant, Lease, LockState, RateRequest, Released,
    Renewal, Store, Watermark,
};
use crate::{Error, LockName, Locked, RateDecision, Result};

/// The in-process store. Cheap to clone; clones share locks.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold::Result<()> {
/// use leasehold::{Leasehold, MemoryStore};
/// let locks = Leasehold::new(MemoryStore::new());
/// let guard = locks.mutex("nightly")?.lock().await?;
/// assert!(locks.mutex("nightly")?.try_lock().await?.is_none());
/// let _ = guard.release().await?; // Released::NotHeld would say the lease had ended first
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    epoch: Instant,
    locks: Mutex<HashMap<LockName, Entry>>,
    /// Rate limiters.
    limits: Mutex<Limits>,
}

impl Default for Inner {
    fn default() -> Self {
        Inner {
            epoch: Instant::now(),
            locks: Mutex::default(),
            limits: Mutex::default(),
        }
    }
}

/// Rate limiters' theoretical arrival times, µs since `epoch`.
#[derive(Debug, Default)]
struct Limits {
    tat: HashMap<LockName, u64>,
    /// Idle limiters (back to full burst) are dropped, as Redis expires their key, when
    /// the map reaches this size; then it is set to twice what is left (at least 1024).
    sweep_at: usize,
}

#[derive(Debug, Default)]
struct Entry {
    record: Record,
    changed: Arc<Wake>,
}

fn alive(_host: &str, _pid: u32) -> bool {
    true
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn now(&self) -> Now {
        Now {
            mono: self.inner.epoch.elapsed().as_nanos() as u64,
            wall_ms: Now::wall_ms(),
            first_token: 1,
        }
    }

    fn locks(&self) -> Result<std::sync::MutexGuard<'_, HashMap<LockName, Entry>>> {
        (self.inner.locks.lock()).map_err(|_| Error::Internal("memory store mutex poisoned".into()))
    }

    /// Runs `f` on the entry of `name` (pruned first), waking waiters if it changed.
    fn with_entry<T>(&self, name: &LockName, f: impl FnOnce(&mut Entry, Now) -> T) -> Result<T> {
        let now = self.now();
        let mut locks = self.locks()?;
        let entry = locks.entry(name.clone()).or_insert_with(|| Entry {
            record: Record::new(name.as_str(), ""),
            changed: Arc::default(),
        });
        let before = (entry.record.version, entry.record.last_token);
        entry.record.prune(now, &alive);
        let out = f(entry, now);
        if entry.record.version != before.0 {
            entry.changed.changed();
        } else if entry.record.last_token != before.1 {
            entry.changed.holders_changed();
        }
        Ok(out)
    }

    fn with<T>(&self, name: &LockName, f: impl FnOnce(&mut Record, Now) -> T) -> Result<T> {
        self.with_entry(name, |e, now| f(&mut e.record, now))
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        self.with(&req.name, |r, now| r.acquire(req, now))?
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        self.with(&lease.name, |r, now| r.renew(lease, ttl, now))
    }

    async fn release(&self, lease: &Lease) -> Result<Released> {
        self.with(&lease.name, |r, _| r.release(lease))
    }

    async fn transfer(&self, from: &Lease, to: &AcquireRequest) -> Result<(Released, Attempt)> {
        self.with(&to.name, |r, now| {
            Ok((r.release(from), r.acquire(to, now)?))
        })?
    }

    async fn changed(&self, req: &AcquireRequest, mut since: Watermark) -> Result<Option<Grant>> {
        let wake = self.with_entry(&req.name, |e, _| e.changed.clone())?;
        loop {
            let notified = wake.notified(req);
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.with(&req.name, |r, _| r.look(req, since))? {
                Look::TryNow => return Ok(None),
                Look::Wait(seen) => since = seen,
            }
            notified.await;
        }
    }

    async fn ended(&self, lease: &Lease) -> Result<()> {
        let wake = self.with_entry(&lease.name, |e, _| e.changed.clone())?;
        loop {
            let notified = wake.notified_any();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.with(&lease.name, |r, _| r.holds(lease))? {
                return Ok(());
            }
            notified.await;
        }
    }

    async fn proclaim(&self, lease: &Lease, value: &str) -> Result<Renewal> {
        self.with_entry(&lease.name, |e, _| {
            let renewal = e.record.proclaim(lease, value);
            e.changed.holders_changed();
            renewal
        })
    }

    async fn downgrade(&self, lease: &Lease) -> Result<Renewal> {
        self.with(&lease.name, |r, _| r.downgrade(lease))?
    }

    async fn watch(&self, name: &LockName, seen: &LockState) -> Result<()> {
        let wake = self.with_entry(name, |e, _| e.changed.clone())?;
        loop {
            let notified = wake.notified_holders();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.describe(name).await?.same_holders(seen) {
                return Ok(());
            }
            notified.await;
        }
    }

    async fn describe(&self, name: &LockName) -> Result<LockState> {
        self.with(name, |r, now| r.state(now))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockState>> {
        let names: Vec<LockName> = {
            let locks = self.locks()?;
            locks
                .keys()
                .filter(|n| n.as_str().starts_with(prefix))
                .cloned()
                .collect()
        };
        let mut out = Vec::new();
        for name in names {
            let state = self.with(&name, |r, now| (!r.is_idle()).then(|| r.state(now)))?;
            out.extend(state);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn force_release(&self, name: &LockName) -> Result<bool> {
        self.with(name, |r, _| r.force_release())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            cross_process: false,
            reclaims_dead_processes: false,
            fair_by_default: false,
            queues_by_wait: false,
            failed_calls_change_nothing: true,
            keeps_waiters_alive: false,
        }
    }

    fn describe_store(&self) -> String {
        "memory:".into()
    }

    fn caveat(&self) -> Option<String> {
        None
    }

    async fn rate(&self, req: &RateRequest) -> Result<RateDecision> {
        let mut limits = self.inner.limits.locked();
        let now = self.inner.epoch.elapsed().as_micros() as u64;
        let kept = limits.tat.get(&req.name).copied();
        let (decision, tat) = gcra(kept, now, req.limit, req.units, req.max_wait_us);
        if let Some(tat) = tat {
            if limits.tat.len() >= limits.sweep_at {
                limits.tat.retain(|_, tat| *tat > now);
                limits.sweep_at = (limits.tat.len() * 2).max(1024);
            }
            limits.tat.insert(req.name.clone(), tat);
        }
        Ok(decision)
    }
}
