//! `leasehold bench`: measures a store with the lockbench.v1 workloads.
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

use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use leasehold::{Leasehold, Lock, Released, Store};
use serde::Serialize;
use tokio::sync::watch;

use crate::exit::{Failure, INTERNAL, USAGE};

// Flags of `leasehold bench` (the lockbench.v1 driver contract plus `--store`, `--fair`).
//
// Durations are read as `run`'s are: `500ms`, `15s`, `1m30s`, or a bare number of
// seconds (fractions allowed, e.g. `2.5`, as lockbench.v1 drivers pass them).
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Locks (lockbench.v1): W1: one worker, N acquire+release cycles on one key; W2: K
    /// workers contend for ONE key for a fixed time; W3: K workers, a key each (no
    /// contention). Rate limiter (ratebench.v1): R1: K workers ask for 1 unit of ONE key
    /// as fast as they can; R2: a key each, a limit that allows ~all; R3: K workers wait
    /// for 1 unit (budget --wait); R4: a trickle plus pulses of hammering on ONE key
    #[arg(long, value_name = "W1|W2|W3|R1|R2|R3|R4")]
    pub workload: String,

    /// Workers (tokio tasks, one lock handle each) [default: 8; W1 always uses 1]
    #[arg(long, value_name = "K")]
    pub workers: Option<usize>,

    /// W1: acquire+release cycles
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub ops: u64,

    /// W1: time cap (a bare number is seconds)
    #[arg(long, value_name = "DUR", default_value = "8s", value_parser = crate::parse_duration, allow_hyphen_values = true)]
    pub max_seconds: Duration,

    /// W2/W3: length of the measured window (a bare number is seconds) [default: W2 10s,
    /// W3 5s]
    #[arg(long, value_name = "DUR", value_parser = crate::parse_duration, allow_hyphen_values = true)]
    pub duration: Option<Duration>,

    /// Wait budget of each acquire (a bare number is seconds); an acquire that runs out
    /// counts as a timeout [default: 5s; R3: 1s]
    #[arg(long, value_name = "DUR", value_parser = crate::parse_duration, allow_hyphen_values = true)]
    pub wait: Option<Duration>,

    /// R1-R4: the limiter's rate, units per second [default: 1000; R2: 1000000; R4: 100]
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub rate: Option<String>,

    /// R1-R4: the limiter's burst [default: 100; R2: 1000000; R4: 10]
    #[arg(long, value_name = "B")]
    pub burst: Option<u64>,

    /// Lease TTL (100ms to 24h; a bare number is seconds)
    #[arg(long, value_name = "DUR", default_value = "30s", value_parser = crate::parse_duration, allow_hyphen_values = true)]
    pub ttl: Duration,

    /// Prefix of the lock names: W1/W2 use P:W:K:one, W3 uses P:W:K:kI (I = worker index)
    #[arg(long, value_name = "P", default_value = "lockbench")]
    pub key_prefix: String,

    /// Benchmark the Redis store at URL (only when no --store is given)
    #[arg(long, value_name = "URL")]
    pub redis_url: Option<String>,

    /// Benchmark the etcd store at HOST:PORT (only when no --store is given)
    #[arg(long, value_name = "HOST:PORT")]
    pub etcd: Option<String>,

    /// First come, first served: waiters are granted the lock in arrival order
    /// [default: on for etcd, off for the other stores]
    #[arg(long, overrides_with = "no_fair")]
    pub fair: bool,

    /// Not first come, first served: a release may go to any waiter
    #[arg(long, overrides_with = "fair")]
    pub no_fair: bool,

    /// Print exactly one lockbench.v1 JSON line on stdout instead of the table
    #[arg(long)]
    pub json: bool,
}

const SCHEMA: &str = "lockbench.v1";
/// Most workers accepted (each is a task and, while waiting, an entry in the lock's queue).
const MAX_WORKERS: usize = 10_000;
/// Longest window, wait budget or time cap accepted.
const MAX_SECONDS: f64 = 86_400.0;
/// How long workers may stay blocked after the window and one wait budget.
const STUCK_GRACE: Duration = Duration::from_secs(10);
/// Pause after an acquire that failed with an error, before trying again.
const ERROR_PAUSE: Duration = Duration::from_millis(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
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
                "unknown workload {s:?}; use --workload W1 (one worker, N cycles), W2 (K workers, one key) or W3 (K workers, a key each), or a rate limiter's R1, R2, R3 or R4"
            ))),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Workload::W1 => "W1",
            Workload::W2 => "W2",
            Workload::W3 => "W3",
        }
    }
}

/// A validated run.
#[derive(Debug, Clone)]
struct Plan {
    workload: Workload,
    workers: usize,
    /// Cycles per worker: `--ops` for W1, unbounded otherwise.
    ops: u64,
    /// W1: the time cap; W2/W3: the window.
    window: Duration,
    wait: Duration,
    ttl: Duration,
    fair: bool,
    /// The lock name of each worker.
    keys: Vec<String>,
    /// Echoed in `params`.
    ops_param: Option<u64>,
    duration_param: Option<f64>,
    wait_s: f64,
    ttl_s: f64,
}

fn usage(message: impl Into<String>) -> Failure {
    Failure::new(USAGE, message)
}

/// A duration flag's seconds, at most [`MAX_SECONDS`].
pub(crate) fn seconds(flag: &str, duration: Duration) -> Result<f64, Failure> {
    let secs = duration.as_secs_f64();
    if secs > MAX_SECONDS {
        return Err(usage(format!(
            "--{flag} {}: at most 24h",
            leasehold::humanize(duration)
        )));
    }
    Ok(secs)
}

pub(crate) fn positive_seconds(flag: &str, duration: Duration) -> Result<f64, Failure> {
    let secs = seconds(flag, duration)?;
    if secs == 0.0 {
        return Err(usage(format!("--{flag} must be more than 0s")));
    }
    Ok(secs)
}

/// `--workers`: 8 unless given, 1 to [`MAX_WORKERS`].
pub(crate) fn workers(args: &BenchArgs) -> Result<usize, Failure> {
    match args.workers {
        Some(0) => Err(usage("--workers must be at least 1")),
        Some(k) if k > MAX_WORKERS => Err(usage(format!(
            "--workers {k}: at most {MAX_WORKERS} workers"
        ))),
        Some(k) => Ok(k),
        None => Ok(8),
    }
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
        let ttl = args.ttl;
        let ttl_s = ttl.as_secs_f64();
        if ttl < leasehold::MIN_TTL || ttl > leasehold::MAX_TTL {
            return Err(usage(format!(
                "--ttl {}: a lease must last from {} to {}",
                leasehold::humanize(ttl),
                leasehold::humanize(leasehold::MIN_TTL),
                leasehold::humanize(leasehold::MAX_TTL)
            )));
        }
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

    fn distinct_keys(&self) -> usize {
        if self.workload == Workload::W3 {
            self.workers
        } else {
            1
        }
    }
}

/// The store URL: `--store` (or LEASEHOLD_STORE) first, then `--redis-url` / `--etcd`,
/// else the default local store.
fn store_url(store: Option<&str>, args: &BenchArgs) -> Result<String, Failure> {
    if let Some(url) = store {
        return Ok(url.to_string());
    }
    match (&args.redis_url, &args.etcd) {
        (Some(_), Some(_)) => Err(usage(
            "--redis-url and --etcd each pick a store; give one of them, or --store URL",
        )),
        (Some(url), None) if url.contains("://") => Ok(url.clone()),
        (Some(addr), None) => Ok(format!("redis://{addr}")),
        (None, Some(addr)) if addr.contains("://") => Ok(addr.clone()),
        (None, Some(addr)) => Ok(format!("etcd://{addr}")),
        (None, None) => Ok("local:".into()),
    }
}

/// The backend name of a store URL: `local`, `memory`, `redis`, `etcd`, ...
fn backend_of(url: &str) -> String {
    let scheme = url.split_once(':').map_or(url, |(scheme, _)| scheme);
    match scheme {
        "redis" | "rediss" | "redis+cluster" => "redis".into(),
        "etcd" | "etcds" => "etcd".into(),
        other => other.to_ascii_lowercase(),
    }
}

/// How waiters learn that the lock may be free, per backend.
fn retry_text(backend: &str) -> &'static str {
    match backend {
        "local" => "woken by the store (inotify, pidfd), no polling",
        "memory" => "woken by the store (tokio Notify), no polling",
        "redis" => {
            "woken by pub/sub (one subscription per client); fair: handed over in the release"
        }
        "etcd" => "watch on the key ahead (fair; handed over by its deletion) or on the holder (non-fair), no polling",
        _ => "woken by the store, no polling",
    }
}

/// One acquisition that returned inside the window.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// When the acquire call returned, ns since the run's base instant.
    acquired_at: u64,
    /// When the release call started, ns since the base instant.
    release_at: u64,
    acquire_ns: u64,
    release_ns: u64,
    cycle_ns: u64,
}

/// What one worker saw. Shared with the coordinator so a stuck worker's finished cycles
/// still count.
#[derive(Debug, Default)]
struct Tally {
    samples: Vec<Sample>,
    timeouts: u64,
    errors: u64,
    first_error: Option<String>,
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

fn nanos(d: Duration) -> u64 {
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

/// Nearest-rank percentile `q` (0..=100) of sorted values.
fn percentile(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len();
    let rank = ((q / 100.0 * n as f64).ceil() as usize).clamp(1, n);
    Some(sorted[rank - 1])
}

/// Nanoseconds → microseconds with one decimal.
fn micros(ns: u64) -> f64 {
    round_to(ns as f64 / 1000.0, 1)
}

fn round_to(x: f64, decimals: i32) -> f64 {
    let f = 10f64.powi(decimals);
    (x * f).round() / f
}

fn pct_us(sorted: &[u64], q: f64) -> Option<f64> {
    percentile(sorted, q).map(micros)
}

/// Jain's fairness index (Σx)² / (n·Σx²); None when nobody acquired anything.
fn jain(counts: &[u64]) -> Option<f64> {
    let sum: f64 = counts.iter().map(|&c| c as f64).sum();
    let squares: f64 = counts.iter().map(|&c| (c as f64) * (c as f64)).sum();
    (squares > 0.0).then(|| round_to(sum * sum / (counts.len() as f64 * squares), 4))
}

/// Hand-off figures of ONE key.
#[derive(Debug, Default, PartialEq)]
struct Handoffs {
    /// Next holder's acquire returned − previous holder's release started, ns, sorted.
    gaps: Vec<u64>,
    /// The same, only where the next holder is a different worker.
    xgaps: Vec<u64>,
    /// Consecutive acquisitions by the same worker.
    same: u64,
    /// Next acquire returned before the previous release started: two holders at once.
    overlaps: u64,
}

impl Handoffs {
    /// From (acquired_at, release_at, worker) of every acquisition of one key.
    fn new(mut events: Vec<(u64, u64, usize)>) -> Self {
        events.sort_unstable();
        let mut h = Handoffs::default();
        for pair in events.windows(2) {
            let (prev, next) = (pair[0], pair[1]);
            let Some(gap) = next.0.checked_sub(prev.1) else {
                h.overlaps += 1;
                continue;
            };
            h.gaps.push(gap);
            if prev.2 == next.2 {
                h.same += 1;
            } else {
                h.xgaps.push(gap);
            }
        }
        h.gaps.sort_unstable();
        h.xgaps.sort_unstable();
        h
    }

    fn same_worker_pct(&self) -> Option<f64> {
        (!self.gaps.is_empty())
            .then(|| round_to(100.0 * self.same as f64 / self.gaps.len() as f64, 1))
    }
}

#[derive(Debug, Serialize)]
struct Params {
    ops: Option<u64>,
    duration_s: Option<f64>,
    wait_s: f64,
    ttl_s: f64,
    concurrency: &'static str,
    retry: &'static str,
    fair: bool,
}

/// The lockbench.v1 line (field order as in the README's schema table).
#[derive(Debug, Serialize)]
struct Report {
    schema: &'static str,
    peer: String,
    #[serde(rename = "impl")]
    implementation: String,
    lang: &'static str,
    backend: String,
    workload: &'static str,
    workers: usize,
    keys: usize,
    params: Params,
    elapsed_s: f64,
    acquired: u64,
    timeouts: u64,
    errors: u64,
    error_sample: Option<String>,
    ops_per_s: Option<f64>,
    acq_p50_us: Option<f64>,
    acq_p99_us: Option<f64>,
    acq_max_us: Option<f64>,
    rel_p50_us: Option<f64>,
    rel_p99_us: Option<f64>,
    cycle_p50_us: Option<f64>,
    cycle_p99_us: Option<f64>,
    per_worker_min: u64,
    per_worker_max: u64,
    jain: Option<f64>,
    handoff_p50_us: Option<f64>,
    handoff_p99_us: Option<f64>,
    handoff_n: Option<usize>,
    xhandoff_p50_us: Option<f64>,
    xhandoff_p99_us: Option<f64>,
    same_worker_pct: Option<f64>,
    overlaps: Option<u64>,
    stuck_workers: usize,
    notes: String,
}

/// What the run produced, before it is turned into figures.
struct Outcome {
    tallies: Vec<Tally>,
    elapsed: Duration,
    stuck: usize,
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

fn report(plan: &Plan, backend: &str, outcome: &Outcome) -> Report {
    let tallies = &outcome.tallies;
    let counts: Vec<u64> = tallies.iter().map(|t| t.samples.len() as u64).collect();
    let acquired: u64 = counts.iter().sum();
    let sorted = |f: fn(&Sample) -> u64| {
        let mut v: Vec<u64> = tallies
            .iter()
            .flat_map(|t| t.samples.iter().map(f))
            .collect();
        v.sort_unstable();
        v
    };
    let acq = sorted(|s| s.acquire_ns);
    let rel = sorted(|s| s.release_ns);
    let cyc = sorted(|s| s.cycle_ns);
    // W1: the wall time of the cycles; W2/W3: the fixed window.
    let elapsed = match plan.workload {
        Workload::W1 => outcome.elapsed.as_secs_f64(),
        _ => plan.window.as_secs_f64(),
    };
    let handoffs = (plan.workload == Workload::W2).then(|| {
        Handoffs::new(
            tallies
                .iter()
                .enumerate()
                .flat_map(|(w, t)| {
                    t.samples
                        .iter()
                        .map(move |s| (s.acquired_at, s.release_at, w))
                })
                .collect(),
        )
    });
    let h = handoffs.as_ref();
    let error_sample = tallies
        .iter()
        .find_map(|t| t.first_error.as_ref())
        .map(|e| e.chars().take(300).collect());
    let mode = if plan.fair {
        "fair (FIFO)"
    } else {
        "non-fair (barging allowed)"
    };
    Report {
        schema: SCHEMA,
        peer: format!("leasehold-{backend}"),
        implementation: format!("leasehold {}", env!("CARGO_PKG_VERSION")),
        lang: "rust",
        backend: backend.to_string(),
        workload: plan.workload.label(),
        workers: plan.workers,
        keys: plan.distinct_keys(),
        params: Params {
            ops: plan.ops_param,
            duration_s: plan.duration_param,
            wait_s: plan.wait_s,
            ttl_s: plan.ttl_s,
            concurrency: "tokio tasks",
            retry: retry_text(backend),
            fair: plan.fair,
        },
        elapsed_s: round_to(elapsed, 3),
        acquired,
        timeouts: tallies.iter().map(|t| t.timeouts).sum(),
        errors: tallies.iter().map(|t| t.errors).sum(),
        error_sample,
        ops_per_s: (elapsed > 0.0).then(|| round_to(acquired as f64 / elapsed, 1)),
        acq_p50_us: pct_us(&acq, 50.0),
        acq_p99_us: pct_us(&acq, 99.0),
        acq_max_us: pct_us(&acq, 100.0),
        rel_p50_us: pct_us(&rel, 50.0),
        rel_p99_us: pct_us(&rel, 99.0),
        cycle_p50_us: pct_us(&cyc, 50.0),
        cycle_p99_us: pct_us(&cyc, 99.0),
        per_worker_min: counts.iter().copied().min().unwrap_or(0),
        per_worker_max: counts.iter().copied().max().unwrap_or(0),
        jain: jain(&counts),
        handoff_p50_us: h.and_then(|h| pct_us(&h.gaps, 50.0)),
        handoff_p99_us: h.and_then(|h| pct_us(&h.gaps, 99.0)),
        handoff_n: h.map(|h| h.gaps.len()),
        xhandoff_p50_us: h.and_then(|h| pct_us(&h.xgaps, 50.0)),
        xhandoff_p99_us: h.and_then(|h| pct_us(&h.xgaps, 99.0)),
        same_worker_pct: h.and_then(Handoffs::same_worker_pct),
        overlaps: h.map(|h| h.overlaps),
        stuck_workers: outcome.stuck,
        notes: format!(
            "leasehold CLI, {backend} store, {mode}; tokio tasks on 2 worker threads, one handle each"
        ),
    }
}

fn show(x: Option<f64>) -> String {
    x.map_or_else(|| "–".into(), |x| format!("{x:.1}"))
}

/// The human-readable form of a report.
fn table(r: &Report, store: &str, cpu: Duration) -> String {
    let mut out = String::new();
    let mode = if r.params.fair { "fair" } else { "non-fair" };
    let key_word = if r.keys == 1 { "key" } else { "keys" };
    let worker_word = if r.workers == 1 { "worker" } else { "workers" };
    let _ = writeln!(
        out,
        "workload       {} ({} {worker_word}, {} {key_word}, {mode})",
        r.workload, r.workers, r.keys
    );
    let _ = writeln!(out, "store          {store}");
    let _ = writeln!(out, "elapsed        {:.3} s", r.elapsed_s);
    let _ = writeln!(out, "acquired       {}", r.acquired);
    let _ = writeln!(out, "ops/s          {}", show(r.ops_per_s));
    let _ = writeln!(
        out,
        "               {:>10} {:>10} {:>10}",
        "p50", "p99", "max"
    );
    let _ = writeln!(
        out,
        "acquire µs     {:>10} {:>10} {:>10}",
        show(r.acq_p50_us),
        show(r.acq_p99_us),
        show(r.acq_max_us)
    );
    let _ = writeln!(
        out,
        "release µs     {:>10} {:>10}",
        show(r.rel_p50_us),
        show(r.rel_p99_us)
    );
    let _ = writeln!(
        out,
        "cycle µs       {:>10} {:>10}",
        show(r.cycle_p50_us),
        show(r.cycle_p99_us)
    );
    if r.handoff_n.is_some() {
        let _ = writeln!(
            out,
            "handoff µs     {:>10} {:>10}   n {}",
            show(r.handoff_p50_us),
            show(r.handoff_p99_us),
            r.handoff_n.unwrap_or(0)
        );
        let _ = writeln!(
            out,
            "xhandoff µs    {:>10} {:>10}   (to another worker)",
            show(r.xhandoff_p50_us),
            show(r.xhandoff_p99_us)
        );
        let _ = writeln!(out, "same-worker    {} %", show(r.same_worker_pct));
    }
    let _ = writeln!(
        out,
        "per worker     min {}  max {}  Jain {}",
        r.per_worker_min,
        r.per_worker_max,
        r.jain.map_or_else(|| "–".into(), |j| format!("{j:.4}"))
    );
    if let Some(overlaps) = r.overlaps {
        let _ = writeln!(out, "overlaps       {overlaps}");
    }
    let _ = writeln!(out, "timeouts       {}", r.timeouts);
    let _ = writeln!(out, "errors         {}", r.errors);
    let _ = writeln!(out, "stuck workers  {}", r.stuck_workers);
    let per_acq = if r.acquired > 0 {
        format!(
            " ({:.1} µs per acquisition)",
            cpu.as_secs_f64() * 1e6 / r.acquired as f64
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "cpu            {:.2} s user+sys{per_acq}",
        cpu.as_secs_f64()
    );
    if let Some(e) = &r.error_sample {
        let _ = writeln!(out, "first error    {e}");
    }
    out
}

/// Runs the benchmark.
pub async fn bench(store: Option<&str>, args: BenchArgs) -> Result<ExitCode, Failure> {
    if crate::ratebench::is_rate_workload(&args.workload) {
        let url = store_url(store, &args)?;
        return crate::ratebench::bench(&url, &backend_of(&url), &args).await;
    }
    let mut plan = Plan::new(&args)?;
    let url = store_url(store, &args)?;
    let backend = backend_of(&url);
    let store: Arc<dyn Store> = crate::open_store(Some(&url)).await?;
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
    let report = report(&plan, &backend, &outcome);

    if args.json {
        let line = serde_json::to_string(&report)
            .map_err(|e| Failure::new(INTERNAL, format!("cannot encode the result: {e}")))?;
        println!("{line}");
    } else {
        print!("{}", table(&report, &store_name, cpu));
    }
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

    fn args(workload: &str) -> BenchArgs {
        BenchArgs {
            workload: workload.into(),
            workers: None,
            ops: 10_000,
            max_seconds: Duration::from_secs(8),
            duration: None,
            wait: None,
            rate: None,
            burst: None,
            ttl: Duration::from_secs(30),
            key_prefix: "lockbench".into(),
            redis_url: None,
            etcd: None,
            fair: false,
            no_fair: false,
            json: false,
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&v, 100.0), Some(100));
        assert_eq!(percentile(&[7], 50.0), Some(7));
        assert_eq!(percentile(&[1, 2, 3], 50.0), Some(2));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(micros(12_345), 12.3);
    }

    #[test]
    fn jain_index() {
        assert_eq!(jain(&[5, 5, 5, 5]), Some(1.0));
        assert_eq!(jain(&[10, 0, 0, 0]), Some(0.25));
        assert_eq!(jain(&[0, 0]), None);
    }

    #[test]
    fn handoffs_gaps_same_worker_and_overlaps() {
        // (acquired_at, release_at, worker)
        let h = Handoffs::new(vec![(30, 31, 1), (10, 11, 0), (20, 21, 0)]);
        assert_eq!(h.gaps, vec![9, 9]);
        assert_eq!(h.xgaps, vec![9]);
        assert_eq!(h.same, 1);
        assert_eq!(h.overlaps, 0);
        assert_eq!(h.same_worker_pct(), Some(50.0));
        // Worker 1 acquired at 15, before worker 0's release started at 18.
        let h = Handoffs::new(vec![(10, 18, 0), (15, 16, 1), (30, 31, 0)]);
        assert_eq!(h.overlaps, 1);
        assert_eq!(h.gaps, vec![14]);
    }

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
        a.ttl = Duration::ZERO;
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

    #[test]
    fn store_selection() {
        let mut a = args("W1");
        assert_eq!(store_url(None, &a).unwrap(), "local:");
        a.redis_url = Some("redis://127.0.0.1:6390/0".into());
        a.etcd = Some("127.0.0.1:2391".into());
        assert_eq!(store_url(Some("memory:"), &a).unwrap(), "memory:");
        assert_eq!(store_url(None, &a).unwrap_err().code, USAGE);
        a.redis_url = None;
        assert_eq!(store_url(None, &a).unwrap(), "etcd://127.0.0.1:2391");
        assert_eq!(backend_of("etcd://127.0.0.1:2391"), "etcd");
        assert_eq!(backend_of("rediss://h:1"), "redis");
        assert_eq!(backend_of("local:/tmp/x"), "local");
        assert_eq!(backend_of("memory:"), "memory");
    }
}
