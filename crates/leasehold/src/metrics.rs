//! Every metric the library records, through the `metrics` facade: the core calls these
//! small functions, so names and labels live here only (the crate docs list them). With
//! no recorder installed each call is a no-op of the facade's, and allocates nothing.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use ::metrics::{Key, Label, Level, Metadata};
use tokio::time::Instant;

use crate::store::{LockKind, Released, Store};
use crate::{Error, LockGuard, LockName, Locked, Result};

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
/// opted in (a label per lock name can be too many series). Each metric's key (name and
/// labels) is built once, so recording one allocates nothing, recorder or not.
#[derive(Clone, Debug)]
pub(crate) struct Meter {
    keys: Arc<Keys>,
    /// The keys of this meter's labels plus each lock kind, built on first use: lock
    /// handles without a `lock` label share them (see [`of`](Self::of)).
    kinds: Arc<Mutex<HashMap<&'static str, Arc<Keys>>>>,
}

/// Outcome (or reason, or call) label values, in the order of the keys built for them.
const ACQUIRED: [&str; 4] = ["acquired", "timed_out", "refused", "error"];
const LOST: [&str; 3] = ["renewal_failed", "gone", "force_released"];
const RENEWED: [&str; 2] = ["ok", "failed"];
const RELEASED: [&str; 4] = ["ok", "not_held", "resent", "error"];
const CALLS: [&str; 4] = ["acquire", "renew", "release", "force_release"];

/// A store call, timed (its `call` label: [`CALLS`], in this order).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Call {
    Acquire = 0,
    Renew = 1,
    Release = 2,
    ForceRelease = 3,
}

/// Every metric's key for one set of labels.
#[derive(Debug)]
struct Keys {
    labels: Vec<Label>,
    acquisitions: [Key; 4],
    losses: [Key; 3],
    renewals: [Key; 2],
    releases: [Key; 4],
    force_releases: Key,
    wait: Key,
    hold: Key,
    renewal: Key,
    store_calls: [Key; 4],
    held: Key,
    waiting: Key,
}

impl Keys {
    fn new(labels: Vec<Label>) -> Self {
        let plain = |name: &'static str| Key::from_parts(name, labels.clone());
        let by = |name: &'static str, label: &'static str, value: &'static str| {
            let mut all = labels.clone();
            all.push(Label::new(label, value));
            Key::from_parts(name, all)
        };
        Keys {
            acquisitions: ACQUIRED.map(|v| by(ACQUISITIONS, "outcome", v)),
            losses: LOST.map(|v| by(LOSSES, "reason", v)),
            renewals: RENEWED.map(|v| by(RENEWALS, "outcome", v)),
            releases: RELEASED.map(|v| by(RELEASES, "outcome", v)),
            force_releases: plain(FORCE_RELEASES),
            wait: plain(WAIT_SECONDS),
            hold: plain(HOLD_SECONDS),
            renewal: plain(RENEWAL_SECONDS),
            store_calls: CALLS.map(|v| by(STORE_CALL_SECONDS, "call", v)),
            held: plain(HELD),
            waiting: plain(WAITING),
            labels,
        }
    }
}

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

fn count(key: &Key) {
    ::metrics::with_recorder(|r| r.register_counter(key, &METADATA).increment(1));
}

fn record(key: &Key, since: Instant) {
    record_until(key, since, Instant::now());
}

fn record_until(key: &Key, since: Instant, now: Instant) {
    let elapsed = now.saturating_duration_since(since);
    ::metrics::with_recorder(|r| r.register_histogram(key, &METADATA).record(elapsed));
}

fn gauge(key: &Key, by: f64) {
    ::metrics::with_recorder(|r| r.register_gauge(key, &METADATA).increment(by));
}

impl Meter {
    /// The labels of everything done on `store`.
    pub fn new(store: &dyn Store) -> Self {
        Meter {
            keys: Arc::new(Keys::new(vec![Label::new("store", store_kind(store))])),
            kinds: Arc::default(),
        }
    }

    /// These labels plus a lock's `kind`, if any, and its `name`, if given.
    pub fn of(&self, kind: Option<LockKind>, name: Option<&LockName>) -> Self {
        let mut labels = self.keys.labels.clone();
        if let Some(kind) = kind {
            labels.push(Label::new("kind", kind.word()));
        }
        let keys = match (name, kind) {
            (Some(name), _) => {
                labels.push(Label::new("lock", name.to_string()));
                Arc::new(Keys::new(labels))
            }
            (None, None) => Arc::new(Keys::new(labels)),
            (None, Some(kind)) => (self.kinds.locked().entry(kind.word()))
                .or_insert_with(|| Arc::new(Keys::new(labels)))
                .clone(),
        };
        Meter {
            keys,
            kinds: self.kinds.clone(),
        }
    }

    /// How an acquire that started at `started` ended; `waited` says whether it could wait.
    pub fn acquired(&self, acquired: &Result<Option<LockGuard>>, waited: bool, started: Instant) {
        let outcome = match acquired {
            Ok(Some(guard)) => {
                record_until(&self.keys.wait, started, guard.acquired_at());
                0
            }
            Ok(None) if waited => 1,
            Ok(None) | Err(Error::Conflict { .. }) => 2,
            Err(_) => 3,
        };
        count(&self.keys.acquisitions[outcome]);
    }

    pub fn lost(&self, reason: Loss) {
        let at = match reason {
            Loss::RenewalFailed => 0,
            Loss::Gone => 1,
            Loss::ForceReleased => 2,
        };
        count(&self.keys.losses[at]);
    }

    /// A renewal (sent at `sent`) and whether the store confirmed it.
    pub fn renewed(&self, ok: bool, sent: Instant) {
        record(&self.keys.renewal, sent);
        count(&self.keys.renewals[usize::from(!ok)]);
    }

    /// A guard's release; one that met store trouble is sent again in the background.
    pub fn released(&self, released: &Result<Released>) {
        let outcome = match released {
            Ok(Released::Released) => 0,
            Ok(Released::NotHeld) => 1,
            Err(e) if e.is_retryable() => 2,
            Err(_) => 3,
        };
        count(&self.keys.releases[outcome]);
    }

    pub fn force_released(&self) {
        count(&self.keys.force_releases);
    }

    /// `call` to the store, sent at `sent` (the caller's clock read), timed as `what`.
    pub async fn store_call<T>(
        &self,
        what: Call,
        sent: Instant,
        call: impl Future<Output = T>,
    ) -> T {
        let answer = call.await;
        record(&self.keys.store_calls[what as usize], sent);
        answer
    }

    /// As [`store_call`](Self::store_call), with the clock read at its answer (for the
    /// caller to use rather than read the clock again).
    pub async fn store_call_answered<T>(
        &self,
        what: Call,
        sent: Instant,
        call: impl Future<Output = Result<T>>,
    ) -> Result<(T, Instant)> {
        let answer = call.await;
        let now = Instant::now();
        record_until(&self.keys.store_calls[what as usize], sent, now);
        answer.map(|answer| (answer, now))
    }

    /// Counts a guard held since `since` until dropped, then records how long it was held.
    pub fn holding(&self, since: Instant) -> Holding {
        gauge(&self.keys.held, 1.0);
        Holding {
            meter: self.clone(),
            since,
        }
    }

    /// Counts a waiting task until dropped.
    pub fn waiting(&self) -> Waiting {
        gauge(&self.keys.waiting, 1.0);
        Waiting(self.clone())
    }

    /// `fut`, counted as a waiting task from its first poll that does not finish. Not an
    /// `async fn`, which would keep `fut` twice.
    pub fn waiting_while<'a, F: Future + Unpin + 'a>(
        &'a self,
        mut fut: F,
    ) -> impl Future<Output = F::Output> + 'a {
        let mut waiting = None;
        std::future::poll_fn(move |cx| match Pin::new(&mut fut).poll(cx) {
            Poll::Pending => {
                waiting.get_or_insert_with(|| self.waiting());
                Poll::Pending
            }
            ready => ready,
        })
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
        record(&self.meter.keys.hold, self.since);
        gauge(&self.meter.keys.held, -1.0);
    }
}

/// A waiting task, for the `waiting` gauge.
#[derive(Debug)]
pub(crate) struct Waiting(Meter);

impl Drop for Waiting {
    fn drop(&mut self) {
        gauge(&self.0.keys.waiting, -1.0);
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
