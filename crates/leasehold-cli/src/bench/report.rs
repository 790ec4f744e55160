//! The lockbench.v1 figures of a lock run: the JSON line (field order as in the
//! contract's schema table) and the table `--json` replaces.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use super::locks::{Outcome, Plan, Sample, Tally, Workload};

const SCHEMA: &str = "lockbench.v1";

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

/// Nearest-rank percentile `q` (0..=100) of sorted values.
pub(super) fn percentile(sorted: &[u64], q: f64) -> Option<u64> {
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

pub(super) fn pct_us(sorted: &[u64], q: f64) -> Option<f64> {
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
pub(super) struct Report {
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
    pub(super) overlaps: Option<u64>,
    pub(super) stuck_workers: usize,
    notes: String,
}

/// The figures of a run.
pub(super) fn report(plan: &Plan, backend: &str, outcome: &Outcome) -> Report {
    let tallies = &outcome.tallies;
    let counts: Vec<u64> = tallies.iter().map(|t| t.samples.len() as u64).collect();
    let acquired: u64 = counts.iter().sum();
    let acq = sorted(tallies, |s| s.acquire_ns);
    let rel = sorted(tallies, |s| s.release_ns);
    let cyc = sorted(tallies, |s| s.cycle_ns);
    // W1: the wall time of the cycles; W2/W3: the fixed window.
    let elapsed = match plan.workload {
        Workload::W1 => outcome.elapsed.as_secs_f64(),
        _ => plan.window.as_secs_f64(),
    };
    let handoffs = (plan.workload == Workload::W2).then(|| handoffs(tallies));
    let h = handoffs.as_ref();
    let error_sample = tallies
        .iter()
        .find_map(|t| t.first_error.as_ref())
        .map(|e| e.chars().take(300).collect());
    Report {
        schema: SCHEMA,
        peer: format!("leasehold-{backend}"),
        implementation: format!("leasehold {}", env!("CARGO_PKG_VERSION")),
        lang: "rust",
        backend: backend.to_string(),
        workload: plan.workload.label(),
        workers: plan.workers,
        keys: plan.distinct_keys(),
        params: params(plan, backend),
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
        notes: notes(backend, plan.fair),
    }
}

/// One figure of every sample of every worker, sorted.
fn sorted(tallies: &[Tally], f: fn(&Sample) -> u64) -> Vec<u64> {
    let mut v: Vec<u64> = tallies
        .iter()
        .flat_map(|t| t.samples.iter().map(f))
        .collect();
    v.sort_unstable();
    v
}

/// The hand-offs of ONE key (W2), from every worker's samples.
fn handoffs(tallies: &[Tally]) -> Handoffs {
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
}

/// The `params` the line echoes.
fn params(plan: &Plan, backend: &str) -> Params {
    Params {
        ops: plan.ops_param,
        duration_s: plan.duration_param,
        wait_s: plan.wait_s,
        ttl_s: plan.ttl_s,
        concurrency: "tokio tasks",
        retry: retry_text(backend),
        fair: plan.fair,
    }
}

fn notes(backend: &str, fair: bool) -> String {
    let mode = if fair {
        "fair (FIFO)"
    } else {
        "non-fair (barging allowed)"
    };
    format!(
        "leasehold CLI, {backend} store, {mode}; tokio tasks on 2 worker threads, one handle each"
    )
}

fn show(x: Option<f64>) -> String {
    x.map_or_else(|| "–".into(), |x| format!("{x:.1}"))
}

/// The human-readable form of a report.
pub(super) fn table(r: &Report, store: &str, cpu: Duration) -> String {
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
    latency_rows(&mut out, r);
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

/// The table's latency rows: acquire, release, cycle and (W2) hand-offs.
fn latency_rows(out: &mut String, r: &Report) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
