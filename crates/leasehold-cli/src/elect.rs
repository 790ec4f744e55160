//! `elect` (a command run while this candidate leads) and `leader` (who leads, and
//! `--watch` for each change).

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Args;
use leasehold::{humanize, Leader, Leasehold};
use tokio::signal::unix::{signal, SignalKind};

use crate::exit::{self, Failure};
use crate::run::RunArgs;
use crate::LockArgs;

// Flags of `elect`: `run`'s, less those that make another kind of lock.
#[derive(Debug, Args)]
pub struct ElectArgs {
    /// Election name (1 to 256 bytes, no control characters): the lock of that name
    pub name: String,

    /// What the leader publishes for the others to see (`leasehold leader NAME`), e.g.
    /// its address [default: HOST:PID]
    #[arg(long, value_name = "TEXT")]
    pub value: Option<String>,

    /// Leadership lease: a dead leader is replaced within it; renewed at about a third
    /// of it while leading (100ms to 24h)
    #[arg(long, value_name = "DUR", default_value = "15s", value_parser = crate::parse_duration, allow_hyphen_values = true)]
    pub ttl: Duration,

    /// Give up after waiting this long to lead (exit 75, or --conflict-exit-code)
    /// [default: wait without limit]
    #[arg(short = 'w', long, value_name = "DUR", value_parser = crate::parse_duration, allow_hyphen_values = true, conflicts_with = "no_wait")]
    pub wait: Option<Duration>,

    /// Do not wait: give up at once if another candidate leads (exit 75, or
    /// --conflict-exit-code)
    #[arg(short = 'n', long)]
    pub no_wait: bool,

    /// Exit status when another leads with --no-wait or --wait runs out (0 to 255; with 0
    /// nothing is printed, but with --json)
    #[arg(short = 'E', long, value_name = "N", default_value_t = exit::NOT_ACQUIRED,
          allow_hyphen_values = true, value_parser = crate::args::parse_exit_code)]
    pub conflict_exit_code: u8,

    /// Candidate id, shown as the leader's owner [default: random]. Give each candidate
    /// its own: two with one id would both lead
    #[arg(long, value_name = "ID")]
    pub owner: Option<String>,

    /// Time the command gets between SIGTERM and SIGKILL once leadership is lost
    #[arg(long, value_name = "DUR", default_value = "5s", value_parser = crate::parse_duration, allow_hyphen_values = true)]
    pub grace: Duration,

    /// Serve the library's metrics as Prometheus text over HTTP on ADDR while it runs
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,

    /// leasehold's own errors and log lines as JSON objects on stderr (the command's
    /// output is its own)
    #[arg(long)]
    pub json: bool,

    /// The command to run while leading, after `--`
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

impl ElectArgs {
    /// `run`'s flags for a fair mutex of the election's name, campaigning with the value.
    pub fn into_run(self) -> RunArgs {
        let value = (self.value).unwrap_or_else(|| {
            format!(
                "{}:{}",
                leasehold::store::Requester::this_process().host,
                std::process::id()
            )
        });
        RunArgs {
            lock: LockArgs {
                name: self.name,
                ttl: self.ttl,
                wait: self.wait,
                no_wait: self.no_wait,
                conflict_exit_code: self.conflict_exit_code,
                fair: true,
                no_fair: false,
                permits: None,
                shared: false,
                owner: self.owner,
                metrics: self.metrics,
                value: Some(value),
            },
            grace: self.grace,
            json: self.json,
            command: self.command,
        }
    }
}

pub const ELECT_AFTER_HELP: &str = "\
Candidates are served in arrival order. While this one leads, COMMAND runs with
LEASEHOLD_TERM (the term: a fencing token higher than every earlier leader's) and
LEASEHOLD_VALUE, besides what `run` gives it. If leadership is lost (force-released,
or renewals fail until the safe deadline) the command's process group is stopped, as
by `run`, before the next leader can start, and leasehold exits with 76. When the
command exits, this candidate resigns and the next one leads.

Use `elect` when the others must see who leads (`leasehold leader NAME`) or when the
work runs for long; `run` when they only need to not run it at once.

Examples:
  leasehold elect --value 10.0.0.7:8080 scheduler -- ./scheduler
  leasehold elect --no-wait -E 0 cleanup -- ./cleanup   # skip if another leads
  leasehold leader scheduler --watch --json";

// Flags of `leader`.
#[derive(Debug, Args)]
pub struct LeaderArgs {
    /// Election name
    pub name: String,
    /// JSON on stdout: one object, or one line per change with --watch
    #[arg(long)]
    pub json: bool,
    /// Print the leader, then one line per change (a new leader, a new value, none)
    /// until interrupted
    #[arg(long)]
    pub watch: bool,
}

/// `leasehold elect NAME -- COMMAND`.
pub async fn elect(store: Option<&str>, args: ElectArgs) -> Result<ExitCode, Failure> {
    crate::run::run_as("elect", store, args.into_run()).await
}

/// `leasehold leader NAME [--watch] [--json]`.
pub async fn leader(store: Option<&str>, args: LeaderArgs) -> Result<ExitCode, Failure> {
    // A watch follows what comes: a local store made after it starts too.
    let store = match args.watch {
        true => crate::args::open_shared_store(store, "leader", None).await?,
        false => crate::args::open_to_look(store, "leader").await?,
    };
    let locks = Leasehold::from_store(store);
    let election = locks.election(args.name.as_str())?;
    if !args.watch {
        let state = locks.describe(election.name()).await?;
        let leader = Leader::of(&state);
        let mut line = show(&args, leader.as_ref());
        // Held, but not as an election (a read lock, a semaphore): no leader, and no
        // candidate can lead until it is free, as `elect` says.
        if let (None, Some(holder), false) = (&leader, state.holders.first(), args.json) {
            line.push_str(&format!(
                "; the name is held as a {} lock by {} holder(s), which keeps candidates out",
                holder.kind.word(),
                state.holders.len()
            ));
        }
        exit::print(&format!("{line}\n"))?;
        return Ok(ExitCode::SUCCESS);
    }
    let interrupt = |kind| {
        signal(kind)
            .map_err(|e| Failure::new(exit::INTERNAL, format!("cannot handle signals: {e}")))
    };
    let mut int = interrupt(SignalKind::interrupt())?;
    let mut term = interrupt(SignalKind::terminate())?;
    let mut hup = interrupt(SignalKind::hangup())?;
    let mut observer = election.observe();
    loop {
        let leader = tokio::select! {
            leader = observer.next() => leader?,
            _ = int.recv() => return Ok(ExitCode::SUCCESS),
            _ = term.recv() => return Ok(ExitCode::SUCCESS),
            _ = hup.recv() => return Ok(ExitCode::SUCCESS),
        };
        exit::print(&format!("{}\n", show(&args, leader.as_ref())))?;
    }
}

/// One line: JSON (`{"name", "leader": {...} | null}`) or text.
fn show(args: &LeaderArgs, leader: Option<&Leader>) -> String {
    if args.json {
        let line = serde_json::json!({ "name": args.name, "leader": leader });
        return line.to_string();
    }
    match leader {
        None => format!("election \"{}\": no leader", args.name),
        Some(l) => format!(
            "election \"{}\": term {}, value {}, owner {} ({}, pid {}), leading for {}, lease {} left",
            args.name,
            l.term,
            l.value.as_deref().map_or("(none)".to_string(), |v| format!("{v:?}")),
            l.owner,
            l.host,
            l.pid,
            humanize(SystemTime::now().duration_since(l.since).unwrap_or_default()),
            humanize(l.lease_left),
        ),
    }
}
