//! Safe-deadline arithmetic and the renewal task a guard owns.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Mutex};
use tokio::time::{sleep_until, timeout_at, Instant};

use crate::store::{Lease, Renewal, Store};
use crate::Result;

/// Clock drift allowed between the client and the store, as a fraction of the TTL.
pub const DRIFT: f64 = 0.01;
/// Fixed margin subtracted from every safe deadline.
pub const MARGIN: Duration = Duration::from_millis(2);

/// The last moment a lease granted or renewed by a request sent at `sent` is provably
/// ours: the store counts the TTL from when it handled the request, which is no earlier
/// than `sent`, so its expiry is later than this by at least the drift and the margin.
pub fn safe_deadline(sent: Instant, ttl: Duration) -> Instant {
    sent + ttl.mul_f64(1.0 - DRIFT).saturating_sub(MARGIN)
}

#[derive(Clone, Debug)]
pub(crate) struct Status {
    pub valid_until: Instant,
    pub renewed_at: Instant,
    pub ttl: Duration,
    pub lost: Option<String>,
}

impl Status {
    pub fn is_lost(&self, now: Instant) -> bool {
        self.lost.is_some() || now >= self.valid_until
    }
}

/// State shared by a guard and its renewal task.
#[derive(Debug)]
pub(crate) struct Lifeline {
    pub store: Arc<dyn Store>,
    pub lease: Lease,
    pub status: watch::Sender<Status>,
    /// One renewal in flight at a time, so an older answer cannot overwrite a newer one.
    renewing: Mutex<()>,
}

impl Lifeline {
    pub fn new(store: Arc<dyn Store>, lease: Lease, sent: Instant, ttl: Duration) -> Arc<Self> {
        let (status, _) = watch::channel(Status {
            valid_until: safe_deadline(sent, ttl),
            renewed_at: sent,
            ttl,
            lost: None,
        });
        Arc::new(Lifeline {
            store,
            lease,
            status,
            renewing: Mutex::new(()),
        })
    }

    pub fn mark_lost(&self, reason: &str) {
        self.status.send_if_modified(|s| {
            if s.lost.is_some() {
                return false;
            }
            tracing::warn!(lock = %self.lease.name, reason, "lock lost");
            s.lost = Some(reason.to_string());
            true
        });
    }

    /// Renews for `ttl`. The answer counts only if it arrives before the current safe
    /// deadline; the new deadline is counted from this request's send time.
    pub async fn renew(&self, ttl: Duration) -> Result<Renewal> {
        let _one_at_a_time = self.renewing.lock().await;
        let current = self.status.borrow().clone();
        let sent = Instant::now();
        if current.is_lost(sent) {
            self.mark_lost("the safe deadline passed before the lease was renewed");
            return Ok(Renewal::Lost);
        }
        match timeout_at(current.valid_until, self.store.renew(&self.lease, ttl)).await {
            Err(_) => {
                self.mark_lost("no renewal was confirmed before the safe deadline");
                Ok(Renewal::Lost)
            }
            Ok(Ok(Renewal::Renewed)) => {
                self.status.send_modify(|s| {
                    if s.lost.is_none() {
                        s.valid_until = safe_deadline(sent, ttl);
                        s.renewed_at = sent;
                        s.ttl = ttl;
                    }
                });
                tracing::debug!(lock = %self.lease.name, ttl = ?ttl, "renewed");
                Ok(Renewal::Renewed)
            }
            Ok(Ok(Renewal::Lost)) => {
                self.mark_lost(
                    "the store no longer has the lease (it expired or was force-released)",
                );
                Ok(Renewal::Lost)
            }
            Ok(Err(e)) => Err(e),
        }
    }

    /// The renewal task: renews at about a third of the TTL, retries failed renewals with
    /// jittered backoff, and declares the loss at the safe deadline at the latest.
    pub async fn keep_alive(self: Arc<Self>) {
        let mut failing = false;
        loop {
            let status = self.status.borrow().clone();
            if status.lost.is_some() {
                return;
            }
            let next = if failing {
                Instant::now() + jitter(status.ttl.div_f64(10.0).min(Duration::from_millis(500)))
            } else {
                status.renewed_at + status.ttl / 3
            };
            tokio::select! {
                _ = sleep_until(next) => {}
                _ = sleep_until(status.valid_until) => {
                    self.mark_lost("the safe deadline passed without a confirmed renewal");
                    return;
                }
            }
            match self.renew(status.ttl).await {
                Ok(Renewal::Renewed) => failing = false,
                Ok(Renewal::Lost) => return,
                Err(error) => {
                    tracing::warn!(lock = %self.lease.name, %error, "renewal failed; retrying until the safe deadline");
                    failing = true;
                }
            }
        }
    }
}

/// `d` scaled by a random factor in [0.5, 1.5).
pub(crate) fn jitter(d: Duration) -> Duration {
    d.mul_f64(0.5 + rand::random::<f64>())
}
