//! Every metric moves for a real acquire, wait, renewal, loss (a force-release) and
//! release, on the local store and a real redis-server. Each test records into a
//! recorder of its own (thread-local, on a current-thread runtime), so tests running
//! at once in this process cannot see each other's numbers.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use leasehold::conformance::{eventually, within};
use leasehold::{Leasehold, Released, Store};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// Totals since the recorder started (its snapshots hand over what changed since the
/// last one), by `name{label=value,...}` with labels sorted.
struct Seen {
    snapshotter: Snapshotter,
    /// Counters and gauges: their sum; histograms: how many values.
    totals: HashMap<String, f64>,
}

impl Seen {
    fn new(recorder: &DebuggingRecorder) -> Self {
        Seen {
            snapshotter: recorder.snapshotter(),
            totals: HashMap::new(),
        }
    }

    fn get(&mut self, key: &str) -> f64 {
        for (ck, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let mut labels: Vec<String> = ck
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            let key = format!("{}{{{}}}", ck.key().name(), labels.join(","));
            let moved = match value {
                DebugValue::Counter(n) => n as f64,
                DebugValue::Gauge(v) => v.into_inner(),
                DebugValue::Histogram(values) => values.len() as f64,
            };
            *self.totals.entry(key).or_default() += moved;
        }
        self.totals.get(key).copied().unwrap_or(0.0)
    }
}

/// Runs `test` on a current-thread runtime whose every task records into `recorder`.
fn recorded<F: Future<Output = ()>>(recorder: &DebuggingRecorder, test: F) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(recorder, || runtime.block_on(test));
}

/// The whole life of a lock on `store` (labelled `store`), seen in the metrics.
async fn every_metric_moves(seen: &mut Seen, locks: Leasehold, other: Leasehold, store: &str) {
    let locks = locks.with_lock_name_metrics(true);
    let name = "metrics-life";
    let labels = format!("kind=exclusive,lock={name},store={store}");
    let key = |metric: &str, extra: &str| match extra {
        "" => format!("{metric}{{{labels}}}"),
        extra => {
            let mut all: Vec<&str> = labels.split(',').chain([extra]).collect();
            all.sort();
            format!("{metric}{{{}}}", all.join(","))
        }
    };
    let lock = locks.mutex(name).unwrap().with_ttl(Duration::from_secs(3));

    // Acquire.
    let guard = lock.try_lock().await.unwrap().expect("free");
    assert_eq!(
        seen.get(&key("leasehold_acquisitions_total", "outcome=acquired")),
        1.0
    );
    assert_eq!(seen.get(&key("leasehold_wait_seconds", "")), 1.0);
    assert!(seen.get(&key("leasehold_store_call_seconds", "call=acquire")) >= 1.0);
    assert_eq!(seen.get(&key("leasehold_held", "")), 1.0);

    // Refused at once, and a bounded wait that runs out.
    assert!(lock.try_lock().await.unwrap().is_none());
    assert_eq!(
        seen.get(&key("leasehold_acquisitions_total", "outcome=refused")),
        1.0
    );
    let waited = lock.try_lock_for(Duration::from_millis(200)).await.unwrap();
    assert!(waited.is_none());
    assert_eq!(
        seen.get(&key("leasehold_acquisitions_total", "outcome=timed_out")),
        1.0
    );
    assert_eq!(seen.get(&key("leasehold_waiting", "")), 0.0);

    // A waiter that stays, counted while it waits (with an owner id of its own, so it
    // waits in the store rather than behind the holder in this process).
    let waiter = {
        let lock = (lock.clone().with_owner("waiter")).with_ttl(Duration::from_secs(60));
        tokio::spawn(async move { lock.lock().await })
    };
    let waiting = key("leasehold_waiting", "");
    eventually("the waiting gauge counts the waiter", || {
        let now = seen.get(&waiting);
        async move { now == 1.0 }
    })
    .await;

    // Renewal, at a third of the TTL.
    let renewed = key("leasehold_renewals_total", "outcome=ok");
    eventually("a renewal", || {
        let now = seen.get(&renewed);
        async move { now >= 1.0 }
    })
    .await;
    assert!(seen.get(&key("leasehold_renewal_seconds", "")) >= 1.0);
    assert!(seen.get(&key("leasehold_store_call_seconds", "call=renew")) >= 1.0);

    // Released; the waiter gets the lock.
    assert_eq!(guard.release().await.unwrap(), Released::Released);
    assert_eq!(
        seen.get(&key("leasehold_releases_total", "outcome=ok")),
        1.0
    );
    let next = within("the waiter's lock", waiter).await.unwrap().unwrap();
    assert_eq!(
        seen.get(&key("leasehold_acquisitions_total", "outcome=acquired")),
        2.0
    );
    assert_eq!(seen.get(&waiting), 0.0);
    assert_eq!(seen.get(&key("leasehold_wait_seconds", "")), 2.0);

    // Loss: force-released by another client, seen through the store's watch (the
    // waiter's first renewal is 20 s away, so it cannot see the loss first).
    let signal = next.lost_signal();
    assert!(other.force_release(name).await.unwrap());
    within("the loss", signal.lost()).await;
    assert_eq!(
        seen.get(&key("leasehold_losses_total", "reason=force_released")),
        1.0
    );
    // Nothing is held from the loss on, though the guard lives.
    assert_eq!(seen.get(&key("leasehold_held", "")), 0.0);
    assert_eq!(seen.get(&key("leasehold_hold_seconds", "")), 2.0);
    assert_eq!(next.release().await.unwrap(), Released::NotHeld);
    assert_eq!(
        seen.get(&key("leasehold_releases_total", "outcome=not_held")),
        1.0
    );
    assert_eq!(seen.get(&key("leasehold_hold_seconds", "")), 2.0);
    assert_eq!(seen.get(&key("leasehold_held", "")), 0.0);
    assert!(seen.get(&key("leasehold_store_call_seconds", "call=release")) >= 2.0);

    // The force-release, from the other client (no lock-name label there).
    assert_eq!(
        seen.get(&format!("leasehold_force_releases_total{{store={store}}}")),
        1.0
    );
    assert_eq!(
        seen.get(&format!(
            "leasehold_store_call_seconds{{call=force_release,store={store}}}"
        )),
        1.0
    );
}

#[test]
fn every_metric_moves_on_the_local_store() {
    let recorder = DebuggingRecorder::new();
    let mut seen = Seen::new(&recorder);
    let dir = leasehold_testkit::TempDir::new("metrics-local");
    recorded(&recorder, async {
        let open = || Leasehold::new(leasehold::LocalStore::open(dir.path()).unwrap());
        every_metric_moves(&mut seen, open(), open(), "local").await;
    });
}

#[cfg(feature = "redis")]
#[test]
fn every_metric_moves_on_redis() {
    let recorder = DebuggingRecorder::new();
    let mut seen = Seen::new(&recorder);
    let server = leasehold_testkit::RedisServer::start();
    recorded(&recorder, async {
        let open = || async {
            let store = leasehold::RedisStore::connect(&server.url()).await.unwrap();
            assert!(store.describe_store().starts_with("redis:"));
            Leasehold::new(store)
        };
        every_metric_moves(&mut seen, open().await, open().await, "redis").await;
    });
}
