//! `leasehold bench --workload R1|R2|R3|R4`: the rate limiter in the rate harness's
//! `ratebench.v1` contract (`shared/bench/rate/README.md`), so a run is one more row of
//! the same table as the other limiters.
//!
//! - **R1**: ONE key; K workers ask `try_acquire(1)` as fast as they can.
//! - **R2**: K workers, a key each, a limit high enough to allow ~all: raw throughput.
//! - **R3**: ONE key; K workers each `acquire_for(1, --wait)` (one store call that
//!   reserves their turn, then a sleep until it), then ask again.
//! - **R4**: ONE key; worker 0 trickles (a call, then 50 ms of sleep), the others hammer
//!   in pulses of 0.5 s every 1.5 s.
//!
//! The loop rules are the contract's: one limiter handle per worker (sharing one client),
//! t0 just before the call and t1 just after on one monotonic clock, only calls that
//! returned by the deadline count, and every allowed call's (t0, t1) is kept for the
//! most allowed in any 1-second window (a call counts in a window only when its whole
//! span lies inside it: a lower bound of what the store let through there).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use leasehold::{Leasehold, Rate, RateLimiter, StoreUrl};

use super::report::percentile;
use super::{positive_seconds, seconds, usage, workers, BenchArgs};
use super::{ERROR_PAUSE, STUCK_GRACE};
use crate::exit::{Failure, INTERNAL};

const SCHEMA: &str = "ratebench.v1";
const PULSE_PERIOD: Duration = Duration::from_millis(1500);
const PULSE_LEN: Duration = Duration::from_millis(500);
const TRICKLE: Duration = Duration::from_millis(50);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Workload {
    R1,
    R2,
    R3,
    R4,
}

/// Whether `--workload` names one of the rate workloads.
pub(super) fn is_rate_workload(text: &str) -> bool {
    parse(text).is_some()
}

fn parse(text: &str) -> Option<Workload> {
    match text.trim().to_ascii_uppercase().as_str() {
        "R1" => Some(Workload::R1),
        "R2" => Some(Workload::R2),
        "R3" => Some(Workload::R3),
        "R4" => Some(Workload::R4),
        _ => None,
    }
}

impl Workload {
    fn label(self) -> &'static str {
        match self {
            Workload::R1 => "R1",
            Workload::R2 => "R2",
            Workload::R3 => "R3",
            Workload::R4 => "R4",
        }
    }
}

/// `--rate N` units per second, as the contract gives it (`1000`, `1000.0`, `0.5`).
fn rate_of(text: &str) -> Result<Rate, Failure> {
    let r: f64 = text
        .trim()
        .parse()
        .ok()
        .filter(|r: &f64| r.is_finite() && *r > 0.0)
        .ok_or_else(|| {
            usage(format!(
                "--rate {text:?}: units per second, a number above 0"
            ))
        })?;
    if r.fract() == 0.0 && r <= 1e9 {
        Ok(Rate::per_second(r as u64))
    } else {
        // Fractions of a unit per second: per 1000 s.
        Ok(Rate::new(
            (r * 1000.0).round() as u64,
            Duration::from_secs(1000),
        ))
    }
}

#[derive(Default)]
struct Stats {
    lat: Vec<u64>,
    allowed: Vec<(u64, u64)>,
    decisions: u64,
    timeouts: u64,
    errors: u64,
    error_sample: Option<String>,
}

/// Most allowed calls whose whole span `[t0, t1]` lies in one window of `width` ns (the
/// harness's `max_in_window`): spans by start, latest first, each added to a Fenwick
/// tree over the ends; the window starting at a span's t0 counts those ended before
/// t0 + width.
fn max_in_window(spans: &mut [(u64, u64)], width: u64) -> usize {
    spans.sort_unstable();
    let mut ends: Vec<u64> = spans.iter().map(|s| s.1).collect();
    ends.sort_unstable();
    let n = ends.len();
    let mut tree = vec![0usize; n + 1];
    let mut best = 0;
    for &(t0, t1) in spans.iter().rev() {
        let mut i = ends.partition_point(|&x| x < t1) + 1;
        while i <= n {
            tree[i] += 1;
            i += i & i.wrapping_neg();
        }
        let (mut q, mut count) = (ends.partition_point(|&x| x < t0 + width), 0);
        while q > 0 {
            count += tree[q];
            q -= q & q.wrapping_neg();
        }
        best = best.max(count);
    }
    best
}

/// Nearest-rank percentile of sorted nanoseconds, in µs rounded as the harness rounds them.
fn percentile_us(sorted: &[u64], q: f64) -> Option<f64> {
    percentile(sorted, q).map(|ns| (ns as f64 / 100.0).round() / 10.0)
}

async fn worker(
    limiter: RateLimiter,
    workload: Workload,
    id: usize,
    start: Instant,
    window: Duration,
    wait: Duration,
) -> Stats {
    let deadline = start + window;
    let mut st = Stats::default();
    loop {
        let t0 = Instant::now();
        if t0 >= deadline {
            break;
        }
        if workload == Workload::R4 && id > 0 {
            let phase =
                Duration::from_nanos(((t0 - start).as_nanos() % PULSE_PERIOD.as_nanos()) as u64);
            if phase >= PULSE_LEN {
                tokio::time::sleep(PULSE_PERIOD - phase).await;
                continue;
            }
        }
        let decision = match workload {
            Workload::R3 => limiter.acquire_for(1, wait).await,
            _ => limiter.try_acquire(1).await,
        };
        let decision = match decision {
            Ok(d) => d,
            Err(e) => {
                st.errors += 1;
                st.error_sample.get_or_insert_with(|| e.to_string());
                tokio::time::sleep(ERROR_PAUSE).await;
                continue;
            }
        };
        let t1 = Instant::now();
        if t1 > deadline {
            break;
        }
        st.decisions += 1;
        st.lat.push((t1 - t0).as_nanos() as u64);
        if decision.allowed {
            st.allowed.push((
                (t0 - start).as_nanos() as u64,
                (t1 - start).as_nanos() as u64,
            ));
        } else if workload == Workload::R3 {
            st.timeouts += 1;
        }
        if workload == Workload::R4 && id == 0 {
            tokio::time::sleep(TRICKLE).await;
        }
        // A store that answers without awaiting anything (memory) must not keep the
        // thread from the other workers.
        tokio::task::consume_budget().await;
    }
    st
}

/// Runs a rate workload and prints its `ratebench.v1` line (or a short table).
pub(super) async fn bench(url: &StoreUrl, args: &BenchArgs) -> Result<ExitCode, Failure> {
    let backend = url.scheme().backend();
    let params = Params::of(args)?;
    let limiters = open_limiters(url, args, &params).await?;
    let (stats, stuck) = run_workers(limiters, &params).await;
    let summary = Summary::of(&stats, params.workload);
    let report = report(&params, backend, &stats, &summary, stuck);
    if args.json {
        println!("{report}");
    } else {
        print_table(url, &params, &summary, &report);
    }
    if stuck > 0 {
        return Err(Failure::new(
            INTERNAL,
            format!("{stuck} worker(s) were still in a call {} s after the window and its wait budget; abandoned", STUCK_GRACE.as_secs()),
        ));
    }
    Ok(ExitCode::SUCCESS)
}

/// What a run measures: its workload, and its flags with the workload's defaults.
struct Params {
    workload: Workload,
    workers: usize,
    /// The window, in seconds.
    duration: f64,
    /// `--wait` (R3's wait budget), in seconds.
    wait_s: f64,
    rate: Rate,
    burst: u64,
}

impl Params {
    fn of(args: &BenchArgs) -> Result<Self, Failure> {
        let workload = parse(&args.workload).ok_or_else(|| usage("unknown rate workload"))?;
        let workers = workers(args)?;
        let duration =
            positive_seconds("duration", args.duration.unwrap_or(Duration::from_secs(10)))?;
        let wait_s = seconds("wait", args.wait.unwrap_or(Duration::from_secs(1)))?;
        let (rate_text, burst) = match workload {
            Workload::R2 => (
                args.rate.as_deref().unwrap_or("1000000"),
                args.burst.unwrap_or(1_000_000),
            ),
            Workload::R4 => (
                args.rate.as_deref().unwrap_or("100"),
                args.burst.unwrap_or(10),
            ),
            _ => (
                args.rate.as_deref().unwrap_or("1000"),
                args.burst.unwrap_or(100),
            ),
        };
        Ok(Params {
            workload,
            workers,
            duration,
            wait_s,
            rate: rate_of(rate_text)?,
            burst,
        })
    }
}

/// A limiter per worker (R2: on a key each; else all on one key), on a store that
/// answered a first call.
async fn open_limiters(
    url: &StoreUrl,
    args: &BenchArgs,
    params: &Params,
) -> Result<Vec<RateLimiter>, Failure> {
    let Params {
        workload,
        workers,
        rate,
        burst,
        ..
    } = *params;
    let base = format!("{}:{}:{}", args.key_prefix, workload.label(), workers);
    let store = url.open().await?;
    let limits = Leasehold::from_store(store);
    let limiters = (0..workers)
        .map(|i| {
            let key = match workload {
                Workload::R2 => format!("{base}:k{i}"),
                _ => format!("{base}:one"),
            };
            Ok(limits.rate_limiter(key.as_str(), rate, burst)?)
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    // Setup, like a peer's connect: fail fast, with the store's own error, if it cannot
    // be used (on its own key, so the measured ones start idle).
    limits
        .rate_limiter(format!("{}:setup", args.key_prefix).as_str(), rate, burst)?
        .try_acquire(1)
        .await?;
    Ok(limiters)
}

/// Runs a worker per limiter through the window and collects their stats, and how many
/// were still in a call [`STUCK_GRACE`] after the window and the wait budget (abandoned,
/// with empty stats).
async fn run_workers(limiters: Vec<RateLimiter>, params: &Params) -> (Vec<Stats>, usize) {
    let workload = params.workload;
    let window = Duration::from_secs_f64(params.duration);
    let wait = Duration::from_secs_f64(params.wait_s);
    let start = Instant::now();
    let handles: Vec<_> = limiters
        .into_iter()
        .enumerate()
        .map(|(id, limiter)| tokio::spawn(worker(limiter, workload, id, start, window, wait)))
        .collect();
    let join_by = start + window + wait + STUCK_GRACE;
    let mut stats = Vec::new();
    let mut stuck = 0;
    for h in handles {
        let left = join_by.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, h).await {
            Ok(Ok(st)) => stats.push(st),
            _ => {
                stuck += 1;
                stats.push(Stats::default());
            }
        }
    }
    (stats, stuck)
}

/// The workers' calls together.
struct Summary {
    /// Latencies (ns), sorted.
    lat: Vec<u64>,
    decisions: u64,
    allowed: usize,
    per_worker: Vec<usize>,
    /// Most allowed in one second (not for R2, whose keys are many).
    max_1s: Option<usize>,
}

impl Summary {
    fn of(stats: &[Stats], workload: Workload) -> Self {
        let mut lat: Vec<u64> = stats.iter().flat_map(|s| s.lat.iter().copied()).collect();
        lat.sort_unstable();
        let mut spans: Vec<(u64, u64)> = stats
            .iter()
            .flat_map(|s| s.allowed.iter().copied())
            .collect();
        Summary {
            lat,
            decisions: stats.iter().map(|s| s.decisions).sum(),
            allowed: spans.len(),
            per_worker: stats.iter().map(|s| s.allowed.len()).collect(),
            max_1s: (workload != Workload::R2).then(|| max_in_window(&mut spans, 1_000_000_000)),
        }
    }
}

/// The `ratebench.v1` line.
fn report(
    params: &Params,
    backend: &str,
    stats: &[Stats],
    summary: &Summary,
    stuck: usize,
) -> serde_json::Value {
    let Params {
        workload,
        workers,
        duration,
        wait_s,
        rate,
        burst,
    } = *params;
    let rate_per_s: f64 = rate.count as f64 / rate.period.as_secs_f64();
    let Summary {
        lat,
        decisions,
        allowed,
        per_worker,
        max_1s,
    } = summary;
    let notes = match workload {
        Workload::R3 => "GCRA, one script on the store's clock; a wait is one call that reserves the turn, then a sleep until it (no retries)",
        _ => "GCRA, one script on the store's clock (Redis: TIME, GET, SET PX when allowed)",
    };
    serde_json::json!({
        "schema": SCHEMA,
        "peer": format!("leasehold-{backend}"),
        "impl": format!("leasehold {} (RateLimiter)", env!("CARGO_PKG_VERSION")),
        "lang": "rust",
        "backend": backend,
        "algorithm": "gcra",
        "workload": workload.label(),
        "workers": workers,
        "keys": if workload == Workload::R2 { workers } else { 1 },
        "params": {
            "rate": rate_per_s,
            "burst": burst,
            "duration_s": duration,
            "wait_s": (workload == Workload::R3).then_some(wait_s),
            "concurrency": "tokio tasks (2 threads), one client",
        },
        "elapsed_s": duration,
        "decisions": decisions,
        "allowed": allowed,
        "timeouts": stats.iter().map(|s| s.timeouts).sum::<u64>(),
        "errors": stats.iter().map(|s| s.errors).sum::<u64>(),
        "error_sample": stats.iter().find_map(|s| s.error_sample.clone()),
        "decisions_per_s": *decisions as f64 / duration,
        "allowed_per_s": *allowed as f64 / duration,
        "lat_p50_us": percentile_us(lat, 50.0),
        "lat_p99_us": percentile_us(lat, 99.0),
        "lat_max_us": percentile_us(lat, 100.0),
        "max_allowed_1s": max_1s,
        "allowed_per_worker_min": per_worker.iter().min().copied().unwrap_or(0),
        "allowed_per_worker_max": per_worker.iter().max().copied().unwrap_or(0),
        "stuck_workers": stuck,
        "notes": notes,
    })
}

/// The short table `--json` replaces.
fn print_table(url: &StoreUrl, params: &Params, summary: &Summary, report: &serde_json::Value) {
    let Params {
        workload,
        workers,
        duration,
        rate,
        burst,
        ..
    } = *params;
    let (decisions, allowed) = (summary.decisions, summary.allowed);
    let show = |k: &str| report[k].to_string();
    println!(
        "workload         {} ({workers} workers, {} key(s)), {rate} burst {burst}",
        workload.label(),
        show("keys")
    );
    println!("store            {url}");
    println!("decisions/s      {:.0}", decisions as f64 / duration);
    println!(
        "allowed          {allowed} ({:.0}/s)",
        allowed as f64 / duration
    );
    println!("max in 1 s       {}", show("max_allowed_1s"));
    println!(
        "latency p50/p99  {} / {} µs",
        show("lat_p50_us"),
        show("lat_p99_us")
    );
    println!("timeouts/errors  {} / {}", show("timeouts"), show("errors"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_in_window_counts_only_whole_spans() {
        let s = 1_000_000_000;
        let mut spans = vec![(0, 10), (s / 2, s / 2 + 10), (s - 5, s + 5), (s + 1, s + 2)];
        // [0, 1 s) holds the first two whole; [s/2, 1.5 s) holds the last three.
        assert_eq!(max_in_window(&mut spans, s), 3);
    }

    #[test]
    fn rates_are_units_per_second() {
        assert_eq!(rate_of("1000").unwrap(), Rate::per_second(1000));
        assert_eq!(rate_of("1000.0").unwrap(), Rate::per_second(1000));
        assert_eq!(
            rate_of("0.5").unwrap(),
            Rate::new(500, Duration::from_secs(1000))
        );
        assert!(rate_of("0").is_err() && rate_of("x").is_err() && rate_of("inf").is_err());
    }
}
