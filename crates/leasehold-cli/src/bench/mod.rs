//! `leasehold bench`: measures a store, each workload in the contract its peers use so a
//! run is one more row of theirs: the locks' W1-W3 in `lockbench.v1` (`locks.rs`, figures
//! in `report.rs`), the rate limiter's R1-R4 in `ratebench.v1` (`rate.rs`), S1, many
//! waiters in one process (`scale.rs`), and E1, an election's hand-overs (`elect.rs`).

mod elect;
mod locks;
mod rate;
mod report;
pub mod scale;

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use leasehold::StoreUrl;

use crate::exit::{Failure, USAGE};

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
    /// for 1 unit (budget --wait); R4: a trickle plus pulses of hammering on ONE key.
    /// Many waiters: S1: --names locks, each held while --waiters tasks per name wait.
    /// Elections: E1: --workers candidates, a client each; the time from a leader's
    /// resignation (--rounds) and death (--deaths) until the next leads and is observed
    #[arg(long, value_name = "W1|W2|W3|R1|R2|R3|R4|S1|E1")]
    pub workload: String,

    /// Workers (tokio tasks, one lock handle each) [default: 8; W1 always uses 1; E1:
    /// candidates, 4]
    #[arg(long, value_name = "K")]
    pub workers: Option<usize>,

    /// W1: acquire+release cycles
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub ops: u64,

    /// W1: time cap (a bare number is seconds)
    #[arg(long, value_name = "DUR", default_value = "8s", value_parser = crate::args::parse_duration, allow_hyphen_values = true)]
    pub max_seconds: Duration,

    /// W2/W3: length of the measured window (a bare number is seconds) [default: W2 10s,
    /// W3 5s]
    #[arg(long, value_name = "DUR", value_parser = crate::args::parse_duration, allow_hyphen_values = true)]
    pub duration: Option<Duration>,

    /// Wait budget of each acquire (a bare number is seconds); an acquire that runs out
    /// counts as a timeout [default: 5s; R3: 1s]
    #[arg(long, value_name = "DUR", value_parser = crate::args::parse_duration, allow_hyphen_values = true)]
    pub wait: Option<Duration>,

    /// R1-R4: the limiter's rate, units per second [default: 1000; R2: 1000000; R4: 100]
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub rate: Option<String>,

    /// R1-R4: the limiter's burst [default: 100; R2: 1000000; R4: 10]
    #[arg(long, value_name = "B")]
    pub burst: Option<u64>,

    /// S1: lock names, each held by one task while its waiters queue
    #[arg(long, value_name = "N", default_value_t = 1_000)]
    pub names: usize,

    /// S1: waiting tasks per name
    #[arg(long, value_name = "W", default_value_t = 10)]
    pub waiters: usize,

    /// E1: hand-overs by the leader's resignation
    #[arg(long, value_name = "N", default_value_t = 200)]
    pub rounds: usize,

    /// E1: hand-overs by the leader's death (it stops renewing; its lease runs out)
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub deaths: usize,

    /// Lease TTL (100ms to 24h; a bare number is seconds) [default: 30s; E1: 1s]
    #[arg(long, value_name = "DUR", value_parser = crate::args::parse_duration, allow_hyphen_values = true)]
    pub ttl: Option<Duration>,

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

/// Most workers accepted (each is a task and, while waiting, an entry in the lock's queue).
const MAX_WORKERS: usize = 10_000;
/// Longest window, wait budget or time cap accepted.
const MAX_SECONDS: f64 = 86_400.0;
/// How long workers may stay blocked after the window and one wait budget.
const STUCK_GRACE: Duration = Duration::from_secs(10);
/// Pause after a call that failed with an error, before trying again.
const ERROR_PAUSE: Duration = Duration::from_millis(10);
/// `--ttl` unless given (E1 has its own).
const DEFAULT_TTL: Duration = Duration::from_secs(30);

fn usage(message: impl Into<String>) -> Failure {
    Failure::new(USAGE, message)
}

/// A duration flag's seconds, at most [`MAX_SECONDS`].
fn seconds(flag: &str, duration: Duration) -> Result<f64, Failure> {
    let secs = duration.as_secs_f64();
    if secs > MAX_SECONDS {
        return Err(usage(format!(
            "--{flag} {}: at most 24h",
            leasehold::humanize(duration)
        )));
    }
    Ok(secs)
}

fn positive_seconds(flag: &str, duration: Duration) -> Result<f64, Failure> {
    let secs = seconds(flag, duration)?;
    if secs == 0.0 {
        return Err(usage(format!("--{flag} must be more than 0s")));
    }
    Ok(secs)
}

/// `--ttl`, or `default`, within the leases a store accepts.
fn ttl(args: &BenchArgs, default: Duration) -> Result<Duration, Failure> {
    let ttl = args.ttl.unwrap_or(default);
    if ttl < leasehold::MIN_TTL || ttl > leasehold::MAX_TTL {
        return Err(usage(format!(
            "--ttl {}: a lease must last from {} to {}",
            leasehold::humanize(ttl),
            leasehold::humanize(leasehold::MIN_TTL),
            leasehold::humanize(leasehold::MAX_TTL)
        )));
    }
    Ok(ttl)
}

/// `--workers`: 8 unless given, 1 to [`MAX_WORKERS`].
fn workers(args: &BenchArgs) -> Result<usize, Failure> {
    match args.workers {
        Some(0) => Err(usage("--workers must be at least 1")),
        Some(k) if k > MAX_WORKERS => Err(usage(format!(
            "--workers {k}: at most {MAX_WORKERS} workers"
        ))),
        Some(k) => Ok(k),
        None => Ok(8),
    }
}

/// The store URL: `--store` (or LEASEHOLD_STORE) first, then `--redis-url` / `--etcd`
/// (a URL, or an address for `redis://` or `etcd://`), else the default local store.
fn store_url(store: Option<&str>, args: &BenchArgs) -> Result<StoreUrl, Failure> {
    let url = match (store, &args.redis_url, &args.etcd) {
        (Some(url), _, _) => url.to_string(),
        (None, Some(_), Some(_)) => {
            return Err(usage(
                "--redis-url and --etcd each pick a store; give one of them, or --store URL",
            ))
        }
        (None, Some(url), None) if url.contains("://") => url.clone(),
        (None, Some(addr), None) => format!("redis://{addr}"),
        (None, None, Some(addr)) if addr.contains("://") => addr.clone(),
        (None, None, Some(addr)) => format!("etcd://{addr}"),
        (None, None, None) => "local:".into(),
    };
    crate::args::store_url(Some(&url))
}

/// Prints `report` as one JSON line if `json`, else as its `table`.
fn show_report(
    json: bool,
    report: &impl serde::Serialize,
    table: impl FnOnce() -> String,
) -> Result<(), Failure> {
    if json {
        let line = serde_json::to_string(report).map_err(|e| {
            Failure::new(
                crate::exit::INTERNAL,
                format!("cannot encode the result: {e}"),
            )
        })?;
        println!("{line}");
    } else {
        print!("{}", table());
    }
    Ok(())
}

/// Runs the benchmark `--workload` names.
pub async fn bench(store: Option<&str>, args: BenchArgs) -> Result<ExitCode, Failure> {
    match args.workload.as_str() {
        w if rate::is_rate_workload(w) => rate::bench(&store_url(store, &args)?, &args).await,
        w if scale::is_scale_workload(w) => scale::bench(&store_url(store, &args)?, &args).await,
        w if elect::is_elect_workload(w) => elect::bench(&store_url(store, &args)?, &args).await,
        _ => locks::bench(store, &args).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags of `bench --workload WORKLOAD`, all else at their defaults.
    pub(super) fn args(workload: &str) -> BenchArgs {
        BenchArgs {
            workload: workload.into(),
            workers: None,
            ops: 10_000,
            max_seconds: Duration::from_secs(8),
            duration: None,
            wait: None,
            rate: None,
            burst: None,
            names: 1_000,
            waiters: 10,
            rounds: 200,
            deaths: 20,
            ttl: None,
            key_prefix: "lockbench".into(),
            redis_url: None,
            etcd: None,
            fair: false,
            no_fair: false,
            json: false,
        }
    }

    #[test]
    fn store_selection() {
        let mut a = args("W1");
        let url = |store: Option<&str>, a: &BenchArgs| store_url(store, a).map(|u| u.expose());
        assert_eq!(url(None, &a).unwrap(), "local:");
        a.redis_url = Some("redis://127.0.0.1:6390/0".into());
        a.etcd = Some("127.0.0.1:2391".into());
        assert_eq!(url(Some("memory:"), &a).unwrap(), "memory:");
        assert_eq!(url(None, &a).unwrap_err().code, USAGE);
        a.redis_url = None;
        assert_eq!(url(None, &a).unwrap(), "etcd://127.0.0.1:2391");
        a.etcd = None;
        a.redis_url = Some("127.0.0.1:6390".into());
        assert_eq!(url(None, &a).unwrap(), "redis://127.0.0.1:6390");
        let backend = |text: &str| store_url(Some(text), &a).unwrap().scheme().backend();
        assert_eq!(backend("rediss+cluster://h:1,h:2"), "redis");
        assert_eq!(backend("local:/tmp/x"), "local");
    }
}
