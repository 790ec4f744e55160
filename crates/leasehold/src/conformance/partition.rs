//! A store wrapper that cuts renewals or releases off, as a network partition would.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::store::{
    AcquireRequest, Attempt, Capabilities, Grant, Lease, LockState, Released, Renewal, Store,
    Watermark,
};
use crate::{Error, LockName, Result};

/// Passes everything through to a real store, but can make renewals or releases fail, as
/// a network partition between this client and the store would.
#[derive(Debug)]
pub struct Partition {
    inner: Arc<dyn Store>,
    renewals: AtomicBool,
    releases: AtomicBool,
    refused_releases: AtomicUsize,
}

impl Partition {
    /// Wraps `inner`, everything flowing.
    pub fn new(inner: Arc<dyn Store>) -> Arc<Self> {
        Arc::new(Partition {
            inner,
            renewals: AtomicBool::new(false),
            releases: AtomicBool::new(false),
            refused_releases: AtomicUsize::new(0),
        })
    }

    /// From now on renewals fail as if the store were unreachable.
    pub fn cut_renewals(&self) {
        self.renewals.store(true, Ordering::SeqCst);
    }

    /// From now on releases fail as if the store were unreachable.
    pub fn cut_releases(&self) {
        self.releases.store(true, Ordering::SeqCst);
    }

    /// How many releases (and transfers) failed so far.
    pub fn refused_releases(&self) -> usize {
        self.refused_releases.load(Ordering::SeqCst)
    }

    /// Everything flows again.
    pub fn heal(&self) {
        self.renewals.store(false, Ordering::SeqCst);
        self.releases.store(false, Ordering::SeqCst);
    }

    fn pass_release(&self) -> Result<()> {
        let passed = self.pass(&self.releases);
        if passed.is_err() {
            self.refused_releases.fetch_add(1, Ordering::SeqCst);
        }
        passed
    }

    fn pass(&self, cut: &AtomicBool) -> Result<()> {
        match cut.load(Ordering::SeqCst) {
            true => Err(Error::Unavailable {
                store: self.describe_store(),
                source: "partitioned by the test".into(),
            }),
            false => Ok(()),
        }
    }
}

#[async_trait]
impl Store for Partition {
    async fn acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        self.inner.acquire(req).await
    }
    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        self.pass(&self.renewals)?;
        self.inner.renew(lease, ttl).await
    }
    async fn release(&self, lease: &Lease) -> Result<Released> {
        self.pass_release()?;
        self.inner.release(lease).await
    }
    async fn transfer(&self, from: &Lease, to: &AcquireRequest) -> Result<(Released, Attempt)> {
        self.pass_release()?;
        self.inner.transfer(from, to).await
    }
    async fn changed(&self, req: &AcquireRequest, since: Watermark) -> Result<Option<Grant>> {
        self.inner.changed(req, since).await
    }
    async fn ended(&self, lease: &Lease) -> Result<()> {
        self.inner.ended(lease).await
    }
    async fn proclaim(&self, lease: &Lease, value: &str) -> Result<Renewal> {
        self.pass(&self.renewals)?;
        self.inner.proclaim(lease, value).await
    }
    async fn downgrade(&self, lease: &Lease) -> Result<Renewal> {
        self.pass(&self.renewals)?;
        self.inner.downgrade(lease).await
    }
    async fn watch(&self, name: &LockName, seen: &LockState) -> Result<()> {
        self.inner.watch(name, seen).await
    }
    async fn describe(&self, name: &LockName) -> Result<LockState> {
        self.inner.describe(name).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<LockState>> {
        self.inner.list(prefix).await
    }
    async fn force_release(&self, name: &LockName) -> Result<bool> {
        self.inner.force_release(name).await
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn describe_store(&self) -> String {
        format!("partitioned({})", self.inner.describe_store())
    }

    fn caveat(&self) -> Option<String> {
        self.inner.caveat()
    }
}
