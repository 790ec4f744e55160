//! The verdict: the checker's report on the merged histories, as a line (or JSON) and
//! an exit status.

use std::process::ExitCode;

use super::check::{self, Primitive, Report, Setup};
use super::plan::{Spawn, TortureArgs, WorkersAs};
use super::{history, Run, VIOLATED};
use crate::exit::{self, Failure};

/// Checks the histories the run left, prints the report (and keeps it beside them).
pub(super) fn verdict(run: &Run) -> Result<ExitCode, Failure> {
    let dir = &run.dir;
    let entries = history::read_dir(dir)
        .map_err(|e| Failure::new(exit::INTERNAL, format!("{}: {e}", dir.display())))?;
    let via_run = run.via_run();
    let setup = Setup {
        fence: run.args.fence,
        primitive: run.args.primitive,
        fair: run.fair,
        via_run,
        workers_lock_the_store: run.label == "local",
        store_forgets: run.args.spawn == Some(Spawn::RedisVolatile),
    };
    let report = check::check(&entries, &setup);
    let headline = summary(&run.label, &run.args, run.fair, run.seed, &report);
    let json = serde_json::json!({
            "store": run.label,
            "primitive": run.args.primitive,
            "workers_as": if via_run { "run" } else { "library" },
            "seed": run.seed,
            "fence": run.args.fence,
            "workers": run.args.workers,
            "ttl_ms": run.args.ttl.as_millis() as u64,
            "duration_s": run.args.duration.as_secs_f64(),
            "fair": run.fair,
            "history": dir,
            "summary": headline,
            "report": report,
    });
    // Kept beside the histories; a failure to write it must not hide the verdict.
    let _ = std::fs::write(dir.join("report.json"), format!("{json}\n"));
    if run.args.json {
        println!("{json}");
    } else {
        println!("{headline}");
        for violation in &report.violations {
            println!("  VIOLATED: {violation}");
        }
        println!("  history: {}", dir.display());
    }
    Ok(match report.violations.is_empty() {
        true => ExitCode::SUCCESS,
        false => ExitCode::from(VIOLATED),
    })
}

/// The one-line summary.
fn summary(label: &str, args: &TortureArgs, fair: bool, seed: u64, r: &Report) -> String {
    let faults: Vec<String> = r.faults.iter().map(|(k, n)| format!("{k}×{n}")).collect();
    let fence = format!("{:?}", args.fence).to_lowercase();
    let via = match args.workers_as {
        WorkersAs::Run => " via run",
        WorkersAs::Library => "",
    };
    let observers = match args.primitive {
        Primitive::Election => format!(
            "observers: {} leaders, {} terms back, {} wrong values, {} unclaimed, {} errors; ",
            r.observed_leaders,
            r.observer_regressions,
            r.observed_wrong_value,
            r.observed_unclaimed,
            r.observer_errors,
        ),
        _ => String::new(),
    };
    let fifo = match fair {
        true => format!(
            "fifo {} broken of {} pairs; ",
            r.fifo_violations, r.fifo_checked
        ),
        false => String::new(),
    };
    format!(
        "{label} {}{via}{} fence={fence} W={} TTL={} seed={seed} {}: {} acq; \
service overlap {} (most holders {}); belief overlap {}; \
stale accepted {} / rejected {}; lost updates {}; torn reads {}; over capacity {}; \
losses reported {}/{} (p50 {:.0} ms); false losses {}; {fifo}{observers}\
tokens: {} duplicate, {} backwards, {} re-entries changed; \
takeover {}; acquire p50 {:.1} ms p99 {:.1} ms",
        args.primitive,
        if fair { " fair" } else { "" },
        args.workers,
        leasehold::humanize(args.ttl),
        if faults.is_empty() {
            "no faults".to_string()
        } else {
            faults.join(" ")
        },
        r.acquisitions,
        r.service_overlap,
        r.max_valid_holders,
        r.belief_overlap,
        r.stale_accepted,
        r.stale_rejected,
        r.lost_updates,
        r.torn_reads,
        r.resource_over_capacity,
        r.losses_reported,
        r.expired_while_held,
        r.loss_report.p50_ms,
        r.false_losses,
        r.duplicate_tokens,
        r.tokens_backwards,
        r.reentry_token_changed,
        match r.takeover.n {
            0 => "n/a".to_string(),
            _ => format!("p50 {:.0} ms", r.takeover.p50_ms),
        },
        r.acquire.p50_ms,
        r.acquire.p99_ms,
    )
}
