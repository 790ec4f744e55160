//! `leasehold bench --workload W1|W2|W3`: measures a store's locks with the lockbench.v1
//! workloads.
//!
//! The workloads, figures and JSON line follow the peer benchmark's driver contract
//! (`shared/bench/peers/README.md`), so a `leasehold bench --json` run is one more row of
//! the same table as the other lock libraries:
//!
//! - **W1**: one worker acquires and releases one key `--ops` times (capped at
//!   `--max-seconds`).
//! - **W2**: `--workers` workers loop on ONE key for `--duration` seconds: acquire (wait
//!   budget `--wait`), hold ~0, release.
//! - **W3**: as W2, but each worker has its own key (no contention).
//!
//! Every worker is a tokio task with its own [`Lock`] handle. All timestamps come from one
//! process-wide monotonic clock ([`Instant`]). Only acquisitions that *returned* inside the
//! window count. The command always ends by itself: workers still blocked `--wait` + 10 s
//! after the window are counted as stuck and abandoned.

use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::{Leasehold, Lock, Released, Store};
use tokio::sync::watch;

use super::report::{report, table};
use super::{positive_seconds, seconds, store_url, ttl, usage, workers, BenchArgs};
use super::{DEFAULT_TTL, ERROR_PAUSE, STUCK_GRACE};
use crate::exit::{Failure, INTERNAL};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Workload {
    W1,
    W2,
    W3,
}

impl Workload {
    fn parse(s: &str) -> Result<Self, Failure> {
        match s.trim().to_ascii_uppercase().as_str() {
            "W1" => Ok(Workload::W1),
            "W2" => Ok(Workload::W2),
            "W3" => Ok(Workload::W3),
            _ => Err(usage(format!(
                "unknown workload {s:?}; use --workload W1 (one worker, N cycles), W2 (K workers, one key) or W3 (K workers, a key each), a rate limiter's R1, R2, R3 or R4, S1 (many waiters) or E1 (an election's hand-overs)"
            ))),
        }
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Workload::W1 => "W1",
            Workload::W2 => "W2",
            Workload::W3 => "W3",
        }
    }
}

/// A validated run.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) workload: Workload,
    pub(super) workers: usize,
    /// Cycles per worker: `--ops` for W1, unbounded otherwise.
    pub(super) ops: u64,
    /// W1: the time cap; W2/W3: the window.
    pub(super) window: Duration,
    pub(super) wait: Duration,
    pub(super) ttl: Duration,
    pub(super) fair: bool,
    /// The lock name of each worker.
    pub(super) keys: Vec<String>,
    /// Echoed in `params`.
    pub(super) ops_param: Option<u64>,
    pub(super) duration_param: Option<f64>,
    pub(super) wait_s: f64,
    pub(super) ttl_s: f64,
}

impl Plan {
    fn new(args: &BenchArgs) -> Result<Plan, Failure> {
        let workload = Workload::parse(&args.workload)?;
        let workers = workers(args)?;
        let workers = if workload == Workload::W1 { 1 } else { workers };
        if args.ops == 0 {
            return Err(usage("--ops must be at least 1"));
        }
        let max_seconds = positive_seconds("max-seconds", args.max_seconds)?;
        let duration = match args.duration {
            Some(window) => positive_seconds("duration", window)?,
            None if workload == Workload::W3 => 5.0,
            None => 10.0,
        };
        let wait_s = seconds("wait", args.wait.unwrap_or(Duration::from_secs(5)))?;
        let ttl = ttl(args, DEFAULT_TTL)?;
        let ttl_s = ttl.as_secs_f64();
        if args.key_prefix.is_empty() {
            return Err(usage("--key-prefix must not be empty"));
        }
        let base = format!("{}:{}:{}", args.key_prefix, workload.label(), workers);
        let keys = (0..workers)
            .map(|i| match workload {
                Workload::W3 => format!("{base}:k{i}"),
                _ => format!("{base}:one"),
            })
            .collect();
        let w1 = workload == Workload::W1;
        Ok(Plan {
            workload,
            workers,
            ops: if w1 { args.ops } else { u64::MAX },
            window: Duration::from_secs_f64(if w1 { max_seconds } else { duration }),
            wait: Duration::from_secs_f64(wait_s),
            ttl,
            fair: args.fair,
            keys,
            ops_param: w1.then_some(args.ops),
            duration_param: (!w1).then_some(duration),
            wait_s,
            ttl_s,
        })
    }

    pub(super) fn distinct_keys(&self) -> usize {
        if self.workload == Workload::W3 {
            self.workers
        } else {
            1
        }
    }
}

/// One acquisition that returned inside the window.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sample {
    /// When the acquire call returned, ns since the run's base instant.
    pub(super) acquired_at: u64,
    /// When the release call started, ns since the base instant.
    pub(super) release_at: u64,
    pub(super) acquire_ns: u64,
    pub(super) release_ns: u64,
    pub(super) cycle_ns: u64,
}

/// What one worker saw. Shared with the coordinator so a stuck worker's finished cycles
/// still count.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) samples: Vec<Sample>,
    pub(super) timeouts: u64,
    pub(super) errors: u64,
    pub(super) first_error: Option<String>,
}

impl Tally {
    fn error(&mut self, what: String) {
        self.errors += 1;
        self.first_error.get_or_insert(what);
    }
}

fn tally(t: &Mutex<Tally>) -> std::sync::MutexGuard<'_, Tally> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// One worker: acquire, release at once, record; until the window closes or `ops` cycles.
async fn worker(
    lock: Lock,
    ops: u64,
    wait: Duration,
    base: Instant,
    mut start: watch::Receiver<Option<Instant>>,
    out: Arc<Mutex<Tally>>,
) {
    let deadline = match start.wait_for(Option::is_some).await {
        Ok(deadline) => (*deadline).unwrap_or(base),
        Err(_) => return,
    };
    let mut done = 0u64;
    loop {
        let t0 = Instant::now();
        if t0 >= deadline || done >= ops {
            break;
        }
        let guard = match lock.try_lock_for(wait).await {
            Ok(Some(guard)) => guard,
            Ok(None) => {
                tally(&out).timeouts += 1;
                continue;
            }
            Err(e) => {
                tally(&out).error(format!("acquire: {e}"));
                tokio::time::sleep(ERROR_PAUSE).await;
                continue;
            }
        };
        let t1 = Instant::now();
        // Hold ~0: the release starts right after the acquire returned.
        let r0 = Instant::now();
        let released = guard.release().await;
        let t2 = Instant::now();
        match released {
            Ok(Released::Released) => {}
            Ok(Released::NotHeld) => {
                tally(&out).error("release: the lease had already ended (not held any more)".into())
            }
            Err(e) => tally(&out).error(format!("release: {e}")),
        }
        if t1 > deadline {
            break;
        }
        done += 1;
        tally(&out).samples.push(Sample {
            acquired_at: nanos(t1 - base),
            release_at: nanos(r0 - base),
            acquire_ns: nanos(t1 - t0),
            release_ns: nanos(t2 - r0),
            cycle_ns: nanos(t2 - t0),
        });
    }
}

/// What the run produced, before it is turned into figures.
pub(super) struct Outcome {
    pub(super) tallies: Vec<Tally>,
    pub(super) elapsed: Duration,
    pub(super) stuck: usize,
}

/// User + system CPU time of this process.
fn cpu_time() -> Duration {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid out-pointer for getrusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Runs the workers and collects what they saw.
async fn run(plan: &Plan, handles: Vec<Lock>) -> Outcome {
    let base = Instant::now();
    let (start_tx, start_rx) = watch::channel(None);
    let mut tasks = Vec::with_capacity(handles.len());
    for lock in handles {
        let out = Arc::new(Mutex::new(Tally::default()));
        let task = tokio::spawn(worker(
            lock,
            plan.ops,
            plan.wait,
            base,
            start_rx.clone(),
            out.clone(),
        ));
        tasks.push((task, out));
    }
    // Let the tasks reach their start line, then open the window for all at once.
    tokio::task::yield_now().await;
    let start = Instant::now();
    let deadline = start + plan.window;
    let _ = start_tx.send(Some(deadline));
    let give_up = deadline + plan.wait + STUCK_GRACE;
    let mut stuck = 0;
    let mut tallies = Vec::with_capacity(tasks.len());
    for (mut task, out) in tasks {
        match tokio::time::timeout_at(give_up.into(), &mut task).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tally(&out).error(format!("worker failed: {e}")),
            Err(_) => {
                stuck += 1;
                task.abort();
            }
        }
        tallies.push(std::mem::take(&mut *tally(&out)));
    }
    Outcome {
        tallies,
        elapsed: start.elapsed(),
        stuck,
    }
}

/// Runs a lock workload and prints its lockbench.v1 line (or the table).
pub(super) async fn bench(store: Option<&str>, args: &BenchArgs) -> Result<ExitCode, Failure> {
    let mut plan = Plan::new(args)?;
    let url = store_url(store, args)?;
    let backend = url.scheme().backend();
    let store: Arc<dyn Store> = url.open().await?;
    plan.fair = args.fair || (!args.no_fair && store.capabilities().fair_by_default);
    let store_name = store.describe_store();
    let locks = Leasehold::from_store(store);
    let handles = plan
        .keys
        .iter()
        .map(|key| {
            Ok(locks
                .mutex(key.as_str())?
                .with_ttl(plan.ttl)
                .with_fair(plan.fair))
        })
        .collect::<Result<Vec<Lock>, Failure>>()?;
    // Setup, like a peer's connect: one cycle per key opens what the store needs (files,
    // watchers) and fails fast, with the store's own error, if it cannot be used.
    for lock in handles.iter().take(plan.distinct_keys()) {
        if let Some(guard) = lock.try_lock().await? {
            let _ = guard.release().await?;
        }
    }

    let cpu_before = cpu_time();
    let outcome = run(&plan, handles).await;
    let cpu = cpu_time().saturating_sub(cpu_before);
    let report = report(&plan, backend, &outcome);
    // What the run leaves behind (an etcd store's spare leases) goes now, not with its
    // TTL; outside the measured window.
    let _ = locks.shutdown(Duration::from_secs(5)).await;

    super::show_report(args.json, &report, || table(&report, &store_name, cpu))?;
    if report.stuck_workers > 0 {
        eprintln!(
            "leasehold: {} worker(s) were still blocked {} s after the window and its wait budget; abandoned",
            report.stuck_workers,
            STUCK_GRACE.as_secs()
        );
    }
    match report.overlaps {
        Some(n) if n > 0 => Err(Failure::new(
            INTERNAL,
            format!("mutual exclusion violated: {n} acquisition(s) returned before the previous holder's release started"),
        )),
        _ => Ok(ExitCode::SUCCESS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::tests::args;
    use crate::exit::USAGE;

    #[test]
    fn plans_keys_and_defaults() {
        let p = Plan::new(&args("W1")).unwrap();
        assert_eq!(
            (p.workers, p.ops, p.window),
            (1, 10_000, Duration::from_secs(8))
        );
        assert_eq!(p.keys, vec!["lockbench:W1:1:one"]);
        let mut a = args("w2");
        a.workers = Some(3);
        let p = Plan::new(&a).unwrap();
        assert_eq!(p.window, Duration::from_secs(10));
        assert!(p.keys.iter().all(|k| k == "lockbench:W2:3:one"));
        let mut a = args("W3");
        a.workers = Some(2);
        a.duration = Some(Duration::from_millis(2500));
        let p = Plan::new(&a).unwrap();
        assert_eq!(p.window, Duration::from_millis(2500));
        assert_eq!(p.keys, vec!["lockbench:W3:2:k0", "lockbench:W3:2:k1"]);
        assert_eq!(
            Plan::new(&args("W3")).unwrap().window,
            Duration::from_secs(5)
        );
    }

    #[test]
    fn rejects_bad_values_with_usage() {
        let code = |a: BenchArgs| Plan::new(&a).unwrap_err().code;
        assert_eq!(code(args("W4")), USAGE);
        let mut a = args("W2");
        a.workers = Some(0);
        assert_eq!(code(a), USAGE);
        let mut a = args("W2");
        a.ttl = Some(Duration::ZERO);
        assert_eq!(code(a), USAGE);
        let mut a = args("W2");
        a.duration = Some(Duration::ZERO);
        assert_eq!(code(a), USAGE);
        let mut a = args("W2");
        a.wait = Some(Duration::from_secs(86_401));
        assert_eq!(code(a), USAGE);
        let mut a = args("W1");
        a.ops = 0;
        assert_eq!(code(a), USAGE);
    }
}
