//! `limit`: run a command when a rate limiter lets it through, or print one decision.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use leasehold::url::Scheme;
use leasehold::{humanize, Leasehold, Rate, RateDecision, RateLimiter};

use crate::exit::{self, Failure};

// Flags of `limit`.
#[derive(Debug, Args)]
pub struct LimitArgs {
    /// Limiter name (1 to 256 bytes, no control characters); limiters and locks have
    /// names of their own
    pub name: String,

    /// Long-run rate: COUNT/PERIOD, e.g. 10/s, 100/m, 5/h, 10/500ms (at most 1000000/s).
    /// Every user of NAME must give the same rate and burst
    #[arg(long, value_name = "COUNT/PERIOD", value_parser = parse_rate)]
    pub rate: Rate,

    /// Units that may pass at once from idle [default: the rate's COUNT]
    #[arg(long, value_name = "N", allow_hyphen_values = true, value_parser = parse_units)]
    pub burst: Option<u64>,

    /// Units this run takes (1 to the burst)
    #[arg(long, value_name = "N", default_value = "1", allow_hyphen_values = true, value_parser = parse_units)]
    pub cost: u64,

    /// Wait at most this long for the units; if they would take longer, exit 75 at once
    /// [default: wait as long as it takes; with --check, do not wait]
    #[arg(short = 'w', long, value_name = "DUR", value_parser = crate::args::parse_duration, allow_hyphen_values = true, conflicts_with = "no_wait")]
    pub wait: Option<Duration>,

    /// Do not wait: exit 75 at once unless the units may pass now
    #[arg(short = 'n', long)]
    pub no_wait: bool,

    /// Print one decision instead of running a command: exit 0 if allowed (the units
    /// are taken), 75 if not
    #[arg(long, conflicts_with = "command")]
    pub check: bool,

    /// With --check: one JSON object on stdout
    #[arg(long, requires = "check")]
    pub json: bool,

    /// The command to run once allowed, after `--`
    #[arg(last = true, value_name = "COMMAND", required_unless_present = "check")]
    pub command: Vec<OsString>,
}

pub const LIMIT_AFTER_HELP: &str = "\
A GCRA rate limiter shared by every process using NAME on the store: in any window of
length t at most BURST + RATE*t units pass, with no doubling at window edges. Waiting
reserves the earliest moment the units may pass and sleeps until then (no polling);
waiters are served in the order the store saw them. NAME keeps when its next unit is
due: a run with a rate far slower than meant holds NAME back for as long as that rate
said (start it afresh by deleting lh:rate:{NAME} on Redis, or its file under the local
store's limits/). Not on etcd (exit 64): it has no
server clock every client can trust; nor on memory: (exit 64), which would give each
process a limiter of its own.

The command replaces leasehold once allowed (no lock is held while it runs): its exit
status is leasehold's.

Examples:
  leasehold limit github-api --rate 5000/h -- gh api /user
  leasehold limit mail --rate 10/m --burst 3 --wait 30s -- ./send-mail.sh
  leasehold limit crawl --rate 2/s --no-wait -- curl -sO \"$URL\"   # exit 75 if over
  leasehold limit reports --rate 100/d --cost 5 --check --json

Exit status:
  N      the command's own exit status
  0 / 75 with --check: allowed (the units are taken) / refused
  64     bad usage or bad input (rate, burst, cost, a store without limiters)
  69     the store is unreachable (decide for yourself whether to run anyway)
  75     refused with --no-wait, or the units would take longer than --wait
  126    the command could not be executed  127  the command was not found";

fn parse_rate(text: &str) -> Result<Rate, String> {
    text.parse::<Rate>().map_err(|e| match e {
        leasehold::Error::InvalidOption { reason, .. } => reason,
        e => e.to_string(),
    })
}

fn parse_units(text: &str) -> Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => {
            Err(format!("{text:?} is too many units: at most {}", u64::MAX))
        }
        _ => Err(format!(
            "{text:?} is not a whole number of units, 1 or more"
        )),
    }
}

/// `leasehold limit NAME --rate R [...] -- COMMAND` or `--check`.
pub async fn limit(store: Option<&str>, args: LimitArgs) -> Result<ExitCode, Failure> {
    let burst = args.burst.unwrap_or(args.rate.count.max(1));
    if args.cost > burst {
        return Err(Failure::new(
            exit::USAGE,
            format!(
                "--cost {} is more than the burst ({burst}): those units could never pass at once; raise --burst or lower --cost",
                args.cost
            ),
        ));
    }
    crate::child::must_exist(&args.command)?;
    // A store that does not answer cannot stretch a bounded wait (see within_wait).
    let wait = match (args.no_wait || args.check, args.wait) {
        (_, Some(wait)) => Some(wait),
        (true, None) => Some(Duration::ZERO),
        (false, None) => None,
    };
    // Refused before connecting: whether etcd is up has nothing to do with it.
    let url = crate::args::store_url(store)?;
    let in_vain = "share its limiter with no other process and limit nothing";
    crate::args::refuse_memory(&url, "limit", in_vain, "redis://...")?;
    if matches!(url.scheme(), Scheme::Etcd | Scheme::Etcds) {
        return Err(Failure::new(
            exit::USAGE,
            "etcd does not offer rate limiters: it has no server clock every client can trust; use local:, redis://... or redis+cluster://...",
        ));
    }
    let decision = crate::args::within_wait(&url, wait, async {
        let locks = Leasehold::from_store(crate::args::open_within(&url, wait).await?);
        let limiter = locks.rate_limiter(args.name.as_str(), args.rate, burst)?;
        decide(&limiter, &args).await
    })
    .await?;
    if args.check {
        print_decision(&args, burst, &decision)?;
        return Ok(ExitCode::from(match decision.allowed {
            true => 0,
            false => exit::NOT_ACQUIRED,
        }));
    }
    if !decision.allowed {
        return Err(Failure::new(
            exit::NOT_ACQUIRED,
            refusal(&args, burst, &decision),
        ));
    }
    tracing::info!(limiter = %args.name, waited = ?decision.wait, "running the command");
    let err = std::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .exec();
    Err(crate::child::spawn_failure(&args.command[0], err))
}

/// The decision, waiting if the flags say so; SIGINT, SIGTERM or SIGHUP while waiting
/// exit 128+N (the reserved units stay spent: the limiter errs toward fewer).
async fn decide(limiter: &RateLimiter, args: &LimitArgs) -> Result<RateDecision, Failure> {
    let progress = crate::progress::Progress::for_stderr("rate limiter", &args.name);
    let deciding = async {
        if args.no_wait || (args.check && args.wait.is_none()) {
            return limiter.try_acquire(args.cost).await;
        }
        let turn = limiter
            .reserve(args.cost, args.wait.unwrap_or(Duration::MAX))
            .await?;
        if turn.allowed {
            let what = format!(
                "waiting for rate limiter \"{}\" ({}): {}",
                args.name,
                args.rate,
                units(args.cost)
            );
            wait_for_turn(&progress, &what, turn.wait).await;
        }
        Ok(turn)
    };
    let make = |kind| {
        tokio::signal::unix::signal(kind)
            .map_err(|e| Failure::new(exit::INTERNAL, format!("cannot handle signals: {e}")))
    };
    use tokio::signal::unix::SignalKind;
    let mut int = make(SignalKind::interrupt())?;
    let mut term = make(SignalKind::terminate())?;
    let mut hup = make(SignalKind::hangup())?;
    let signal = tokio::select! {
        decision = deciding => return Ok(decision?),
        _ = int.recv() => libc::SIGINT,
        _ = term.recv() => libc::SIGTERM,
        _ = hup.recv() => libc::SIGHUP,
    };
    progress.clear();
    Err(Failure::new(
        128 + signal as u8,
        format!(
            "stopped waiting for rate limiter \"{}\" on signal {signal}",
            args.name
        ),
    ))
}

/// Sleeps until a reserved turn (`left` from now), showing `what` and the time left on
/// a terminal.
async fn wait_for_turn(progress: &crate::progress::Progress, what: &str, left: Duration) {
    let until = tokio::time::Instant::now() + left;
    loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            break;
        }
        progress.countdown(what, left);
        // The line counts down by whole seconds; without it, one sleep.
        let step = match progress.is_on() {
            true => left.min(Duration::from_secs(1)),
            false => left,
        };
        tokio::time::sleep(step).await;
    }
    progress.clear();
}

fn units(n: u64) -> String {
    match n {
        1 => "1 unit".into(),
        n => format!("{n} units"),
    }
}

fn refusal(args: &LimitArgs, burst: u64, d: &RateDecision) -> String {
    let given = match (args.no_wait || args.check, args.wait) {
        (true, _) => "--no-wait".to_string(),
        (false, Some(wait)) => format!("--wait {}", humanize(wait)),
        (false, None) => "no wait".to_string(),
    };
    format!(
        "rate limiter \"{}\" ({} with a burst of {burst}): {} would be allowed in {}; gave up at once with {given}",
        args.name,
        args.rate,
        units(args.cost),
        humanize(d.wait)
    )
}

/// Milliseconds to the µs, printed as such (147.077, not 147.07700000000003).
fn ms(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

fn print_decision(args: &LimitArgs, burst: u64, d: &RateDecision) -> Result<(), Failure> {
    if args.json {
        let out = serde_json::json!({
            "name": args.name,
            "rate": args.rate.to_string(),
            "burst": burst,
            "cost": args.cost,
            "allowed": d.allowed,
            "wait_ms": ms(d.wait),
            "remaining": d.remaining,
            "reset_after_ms": ms(d.reset_after),
        });
        exit::print(&format!("{out}\n"))
    } else if d.allowed {
        exit::print(&format!(
            "{}: allowed {}; {} of the burst of {burst} left\n",
            args.name,
            units(args.cost),
            d.remaining
        ))
    } else {
        exit::print(&format!(
            "{}: refused; {} would be allowed in {}; {} of the burst of {burst} left\n",
            args.name,
            units(args.cost),
            humanize(d.wait),
            d.remaining
        ))
    }
}
