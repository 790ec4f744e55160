//! Every metric the library records, through the `metrics` facade: the core calls these
//! small functions, so names and labels live here only (the crate docs list them). With
//! no recorder installed each call is a no-op of the facade's.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use ::metrics::{counter, gauge, histogram, Label};
use tokio::time::Instant;

use crate::store::{LockKind, Released, Store};
use crate::{Error, LockGuard, LockName, Result};

pub(crate) const ACQUISITIONS: &str = "leasehold_acquisitions_total";
pub(crate) const LOSSES: &str = "leasehold_losses_total";
pub(crate) const RENEWALS: &str = "leasehold_renewals_total";
pub(crate) const RELEASES: &str = "leasehold_releases_total";
pub(crate) const FORCE_RELEASES: &str = "leasehold_force_releases_total";
pub(crate) const WAIT_SECONDS: &str = "leasehold_wait_seconds";
pub(crate) const HOLD_SECONDS: &str = "leasehold_hold_seconds";
pub(crate) const RENEWAL_SECONDS: &str = "leasehold_renewal_seconds";
pub(crate) const STORE_CALL_SECONDS: &str = "leasehold_store_call_seconds";
pub(crate) const HELD: &str = "leasehold_held";
pub(crate) const WAITING: &str = "leasehold_waiting";

/// The labels of one lock handle's metrics: `store`, `kind`, and `lock` when the user
/// opted in (a label per lock name can be too many series).
#[derive(Clone, Debug)]
pub(crate) struct Meter {
    labels: Arc<[Label]>,
}

impl Meter {
    /// The labels of everything done on `store`.
    pub fn new(store: &dyn Store) -> Self {
        Meter {
            labels: [Label::new("store", store_kind(store))].into(),
        }
    }

    /// These labels plus a lock's `kind`, if any, and its `name`, if given.
    pub fn of(&self, kind: Option<LockKind>, name: Option<&LockName>) -> Self {
        let mut labels = self.labels.to_vec();
        if let Some(kind) = kind {
            labels.push(Label::new("kind", kind.word()));
        }
        if let Some(name) = name {
            labels.push(Label::new("lock", name.to_string()));
        }
        Meter {
            labels: labels.into(),
        }
    }

    fn with(&self, key: &'static str, value: &'static str) -> Vec<Label> {
        let mut labels = self.labels.to_vec();
        labels.push(Label::new(key, value));
        labels
    }

    /// How an acquire that started at `started` ended; `waited` says whether it could wait.
    pub fn acquired(&self, acquired: &Result<Option<LockGuard>>, waited: bool, started: Instant) {
        let outcome = match acquired {
            Ok(Some(_)) => {
                histogram!(WAIT_SECONDS, self.labels.to_vec()).record(started.elapsed());
                "acquired"
            }
            Ok(None) if waited => "timed_out",
            Ok(None) | Err(Error::Conflict { .. }) => "refused",
            Err(_) => "error",
        };
        counter!(ACQUISITIONS, self.with("outcome", outcome)).increment(1);
    }

    pub fn lost(&self, reason: Loss) {
        let reason = match reason {
            Loss::RenewalFailed => "renewal_failed",
            Loss::Gone => "gone",
            Loss::ForceReleased => "force_released",
        };
        counter!(LOSSES, self.with("reason", reason)).increment(1);
    }

    /// A renewal (sent at `sent`) and whether the store confirmed it.
    pub fn renewed(&self, ok: bool, sent: Instant) {
        histogram!(RENEWAL_SECONDS, self.labels.to_vec()).record(sent.elapsed());
        let outcome = if ok { "ok" } else { "failed" };
        counter!(RENEWALS, self.with("outcome", outcome)).increment(1);
    }

    /// A guard's release; one that met store trouble is sent again in the background.
    pub fn released(&self, released: &Result<Released>) {
        let outcome = match released {
            Ok(Released::Released) => "ok",
            Ok(Released::NotHeld) => "not_held",
            Err(e) if e.is_retryable() => "resent",
            Err(_) => "error",
        };
        counter!(RELEASES, self.with("outcome", outcome)).increment(1);
    }

    pub fn force_released(&self) {
        counter!(FORCE_RELEASES, self.labels.to_vec()).increment(1);
    }

    /// `call` to the store, timed as `what`.
    pub async fn store_call<T>(&self, what: &'static str, call: impl Future<Output = T>) -> T {
        let sent = Instant::now();
        let answer = call.await;
        histogram!(STORE_CALL_SECONDS, self.with("call", what)).record(sent.elapsed());
        answer
    }

    /// Counts a held guard until dropped, then records how long it was held.
    pub fn holding(&self) -> Holding {
        gauge!(HELD, self.labels.to_vec()).increment(1.0);
        Holding {
            meter: self.clone(),
            since: Instant::now(),
        }
    }

    /// Counts a waiting task until dropped.
    pub fn waiting(&self) -> Waiting {
        gauge!(WAITING, self.labels.to_vec()).increment(1.0);
        Waiting(self.clone())
    }

    /// `fut`, counted as a waiting task from its first poll that does not finish.
    pub async fn waiting_while<F: Future>(&self, fut: F) -> F::Output {
        let mut fut = pin!(fut);
        let mut waiting = None;
        std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
            Poll::Pending => {
                waiting.get_or_insert_with(|| self.waiting());
                Poll::Pending
            }
            ready => ready,
        })
        .await
    }
}

/// Why a guard learned its lock was lost.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Loss {
    /// No renewal was confirmed before the safe deadline.
    RenewalFailed,
    /// A renewal found the lease gone (expired, or force-released).
    Gone,
    /// The store's watch said the hold was taken away (a force-release).
    ForceReleased,
}

/// A held guard, for the `held` gauge and the hold time.
#[derive(Debug)]
pub(crate) struct Holding {
    meter: Meter,
    since: Instant,
}

impl Drop for Holding {
    fn drop(&mut self) {
        let labels = self.meter.labels.to_vec();
        histogram!(HOLD_SECONDS, labels.clone()).record(self.since.elapsed());
        gauge!(HELD, labels).decrement(1.0);
    }
}

/// A waiting task, for the `waiting` gauge.
#[derive(Debug)]
pub(crate) struct Waiting(Meter);

impl Drop for Waiting {
    fn drop(&mut self) {
        gauge!(WAITING, self.0.labels.to_vec()).decrement(1.0);
    }
}

/// The `store` label: the scheme of the store's description (`memory`, `local`,
/// `redis`, `etcd`...), not its address.
fn store_kind(store: &dyn Store) -> String {
    let shown = store.describe_store();
    let end = shown.find([':', '(']).unwrap_or(shown.len());
    shown[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The crate docs' table and the README's name every metric recorded here.
    #[test]
    fn every_metric_is_in_the_docs_tables() {
        let readme = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
        let readme = std::fs::read_to_string(readme).unwrap();
        let docs = [
            ("the crate docs", include_str!("lib.rs")),
            ("the README", readme.as_str()),
        ];
        let names = [
            ACQUISITIONS,
            LOSSES,
            RENEWALS,
            RELEASES,
            FORCE_RELEASES,
            WAIT_SECONDS,
            HOLD_SECONDS,
            RENEWAL_SECONDS,
            STORE_CALL_SECONDS,
            HELD,
            WAITING,
        ];
        for (where_, text) in docs {
            for name in names {
                assert!(
                    text.contains(&format!("| `{name}` |")),
                    "{name} not in {where_}"
                );
            }
        }
    }
}
