//! The `leasehold` command: run a command under a lock, inspect locks, benchmark stores.
//!
//! `main.rs` only calls [`main`]; everything else is here so tests can drive it.

mod args;
pub mod bench;
mod child;
mod elect;
pub mod exit;
mod fence;
mod inspect;
mod json;
mod limit;
mod metrics;
mod progress;
mod run;
pub mod torture;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

// At the crate root too, where `run` and the library's users name them.
use crate::args::store_help;
pub use crate::args::{
    held_with, open_shared_store, open_store, parse_duration, store_url, within_wait, LockArgs,
    HELD_VAR,
};
use crate::exit::Failure;

/// Distributed locks from the shell: run a command while holding a lock, with a lease,
/// a fencing token and a stop when the lock is lost.
#[derive(Debug, Parser)]
#[command(name = "leasehold", version, after_help = format!("{}\n\n{}", exit::table(), json::errors_help()))]
pub struct Cli {
    /// Lock store URL [env: LEASEHOLD_STORE] [default: local:, the default directory]
    // LEASEHOLD_STORE is read in `dispatch`, not by clap: clap counts a value from the
    // environment as given on the command line and shows `--store <URL>` in its usage
    // line when another argument is missing, as if it were required.
    #[arg(long, global = true, value_name = "URL", long_help = store_help())]
    pub store: Option<String>,

    /// More log output: -v the library's acquires, releases, losses and store trouble
    /// (its debug log), -vv also each renewal and wait attempt (trace); RUST_LOG overrides
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands. Their flags are defined when one is chosen (`defer`), not all of them
/// for every invocation.
// The flag structs have plain comments, not doc comments: clap would read a doc comment
// as the command's description, and with `defer` it would replace the one given here.
#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum Command {
    /// Run COMMAND while holding lock NAME; stop it if the lock is lost
    #[command(after_help = run_after_help())]
    Run(run::RunArgs),
    /// Acquire NAME, print its fencing token, hold it until SIGINT, SIGTERM or SIGHUP
    #[command(after_help = json::HOLD_AFTER_HELP)]
    Hold(run::HoldArgs),
    /// Show who holds NAME and who waits
    Status(inspect::StatusArgs),
    /// List held or awaited locks
    List(inspect::ListArgs),
    /// Free a lock whoever holds it (needs --force); its holder sees the loss
    #[command(after_help = json::RELEASE_AFTER_HELP)]
    Release(inspect::ReleaseArgs),
    /// Campaign to lead election NAME; run COMMAND while leading; stop it if
    /// leadership is lost
    #[command(after_help = elect_after_help())]
    Elect(elect::ElectArgs),
    /// Show the leader of election NAME; --watch prints each change
    Leader(elect::LeaderArgs),
    /// Admit a fencing token against a token file (or refuse a stale one, exit 76);
    /// with COMMAND, run it holding the file
    #[command(after_help = fence::FENCE_AFTER_HELP, override_usage = fence::FENCE_USAGE)]
    Fence(fence::FenceArgs),
    /// Run COMMAND when rate limiter NAME lets it through (GCRA), or print one decision
    #[command(after_help = limit::LIMIT_AFTER_HELP)]
    Limit(limit::LimitArgs),
    /// Measure a store: locks (W1-W3, lockbench.v1 with --json), the rate limiter
    /// (R1-R4, ratebench.v1 with --json), waiters at scale (S1) or elections (E1)
    Bench(bench::BenchArgs),
    /// Check safety under faults: workers, a fenced counter, a nemesis, a history checker
    Torture(torture::TortureArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell)
    #[command(after_help = COMPLETIONS_AFTER_HELP)]
    Completions(CompletionsArgs),
    /// Print the manual page (roff), of leasehold or of one of its commands
    #[command(after_help = MAN_AFTER_HELP)]
    Man(ManArgs),
    /// One torture worker (started by `torture`)
    #[command(hide = true)]
    TortureWorker(torture::worker::WorkerArgs),
    /// The command of a torture `leasehold run` worker (started by `torture`)
    #[command(hide = true)]
    TortureCommand(torture::command::CommandArgs),
}

// Flags of `completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

// Flags of `man`.
#[derive(Debug, Args)]
pub struct ManArgs {
    /// A command's page (leasehold-COMMAND(1)) instead of leasehold(1)
    #[arg(value_name = "COMMAND")]
    pub command: Option<String>,
}

const COMPLETIONS_AFTER_HELP: &str = "\
Install (for your user; open a new shell afterwards):
  bash:        leasehold completions bash > ~/.local/share/bash-completion/completions/leasehold
  zsh:         leasehold completions zsh > ~/.zfunc/_leasehold
               (with fpath=(~/.zfunc $fpath) before compinit in ~/.zshrc)
  fish:        leasehold completions fish > ~/.config/fish/completions/leasehold.fish
  elvish:      leasehold completions elvish > ~/.config/elvish/lib/leasehold.elv
               (with use leasehold in ~/.config/elvish/rc.elv)
  powershell:  leasehold completions powershell >> $PROFILE";

const MAN_AFTER_HELP: &str = "\
Read it now:  leasehold man | man -l -
Install:      leasehold man > ~/.local/share/man/man1/leasehold.1
              leasehold man run > ~/.local/share/man/man1/leasehold-run.1  (and so on)
              (system-wide: /usr/local/share/man/man1, as root)";

/// The clap definition, for completions and the manual.
pub fn command() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

/// `leasehold completions SHELL`: the script on stdout.
fn completions(args: &CompletionsArgs) -> Result<ExitCode, Failure> {
    let mut cmd = command();
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "leasehold", &mut script);
    exit::print(&String::from_utf8_lossy(&script))?;
    Ok(ExitCode::SUCCESS)
}

/// `leasehold man [COMMAND]`: leasehold(1), or leasehold-COMMAND(1), in roff on stdout.
fn man(args: &ManArgs) -> Result<ExitCode, Failure> {
    let mut cmd = command();
    cmd.build();
    let page = match &args.command {
        None => cmd,
        Some(name) => {
            let visible =
                || (cmd.get_subcommands()).filter(|c| !c.is_hide_set() && c.get_name() != "help");
            let Some(sub) = visible().find(|c| c.get_name() == name) else {
                let names: Vec<&str> = visible().map(|c| c.get_name()).collect();
                return Err(Failure::new(
                    exit::USAGE,
                    format!(
                        "no command {name:?}; the manual has pages for: {}",
                        names.join(", ")
                    ),
                ));
            };
            let full = format!("leasehold-{name}");
            sub.clone().name(full.clone()).bin_name(full)
        }
    };
    let mut out = Vec::new();
    clap_mangen::Man::new(page)
        .render(&mut out)
        .and_then(|()| std::io::Write::write_all(&mut std::io::stdout(), &out))
        .map_err(|e| Failure::new(exit::INTERNAL, format!("cannot write the manual: {e}")))?;
    Ok(ExitCode::SUCCESS)
}

/// `run --help`'s closing text, with the exit status table.
fn elect_after_help() -> String {
    format!("{}\n\n{}", elect::ELECT_AFTER_HELP, exit::table())
}

fn run_after_help() -> String {
    format!("{RUN_AFTER_HELP}\n{}", exit::table())
}

const RUN_AFTER_HELP: &str = "\
The command gets LEASEHOLD_NAME, LEASEHOLD_TOKEN (the fencing token, decimal),
LEASEHOLD_OWNER, LEASEHOLD_HELD (every lock the enclosing runs hold, NAME<tab>OWNER per
line) and, with --store, LEASEHOLD_STORE (a local directory made absolute, so a nested
run from another directory opens the same store). A nested `leasehold run` of a NAME held
around it re-enters that lock instead of waiting for itself; a run of any other name
inside it is a holder of its own (parallel jobs under one run exclude each other).

SIGINT, SIGTERM and SIGHUP are passed to the command's process group; the lock is
released after the command exits (what it left running in the background is left
alone). If the lock is lost (force-released, or renewals fail until the safe deadline)
the command's process group gets SIGTERM, then SIGKILL after --grace (or at the safe
deadline, if that comes first; the message says which), and leasehold exits with 76. If leasehold itself is killed (SIGKILL), a watchdog kills the command's
process group.

Examples:
  leasehold run nightly -- ./nightly-report.sh
  leasehold run --wait 30s --ttl 1m migrate -- ./migrate.sh
  leasehold run --no-wait cron-job -- ./job     # exit 75 if someone else runs it
  leasehold run -n -E 0 cron-job -- ./job       # the same, exit 0 (flock -n -E 0)
  leasehold run -w 30s -s schema -- ./report    # a shared lock, waiting 30s at most
  leasehold run --permits 4 encoders -- ffmpeg ...
  leasehold run --shared schema -- ./read-only-task
";

fn init_tracing(verbose: u8, json: bool) {
    use tracing_subscriber::util::SubscriberInitExt;
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let filter = match (
        verbose,
        tracing_subscriber::EnvFilter::try_from_default_env(),
    ) {
        (_, Ok(filter)) => filter,
        (0, Err(_)) => {
            let _ = WarningsOnly::new(ansi, json).try_init();
            return;
        }
        // The library logs routine events at debug and trace, leaving info to us.
        (1, Err(_)) => tracing_subscriber::EnvFilter::new("leasehold=debug,leasehold_cli=info"),
        (_, Err(_)) => tracing_subscriber::EnvFilter::new("leasehold=trace,leasehold_cli=trace"),
    };
    let log = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match json {
        true => log.event_format(json::JsonLog).try_init(),
        false => log.with_ansi(ansi).try_init(),
    };
}

/// The log of a process without `-v` or `RUST_LOG`: warnings and errors, as the
/// formatting subscriber prints them, which is made when the first of them comes. Most
/// runs log nothing, and then pay for no span registry and no filter.
struct WarningsOnly {
    ansi: bool,
    /// `--json`: log lines as JSON objects.
    json: bool,
    inner: std::sync::OnceLock<Box<dyn tracing::Subscriber + Send + Sync>>,
}

impl WarningsOnly {
    fn new(ansi: bool, json: bool) -> Self {
        WarningsOnly {
            ansi,
            json,
            inner: std::sync::OnceLock::new(),
        }
    }

    fn inner(&self) -> &(dyn tracing::Subscriber + Send + Sync) {
        &**self.inner.get_or_init(|| {
            let log = tracing_subscriber::fmt()
                .with_max_level(tracing::Level::WARN)
                .with_writer(std::io::stderr);
            match self.json {
                true => Box::new(log.event_format(json::JsonLog).finish()),
                false => Box::new(log.with_ansi(self.ansi).finish()),
            }
        })
    }
}

impl tracing::Subscriber for WarningsOnly {
    fn register_callsite(&self, meta: &tracing::Metadata<'_>) -> tracing::subscriber::Interest {
        match self.enabled(meta) {
            true => tracing::subscriber::Interest::always(),
            false => tracing::subscriber::Interest::never(),
        }
    }

    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        *meta.level() <= tracing::Level::WARN
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::WARN)
    }

    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        self.inner().new_span(span)
    }

    fn record(&self, span: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        self.inner().record(span, values)
    }

    fn record_follows_from(&self, span: &tracing::span::Id, follows: &tracing::span::Id) {
        self.inner().record_follows_from(span, follows)
    }

    fn event(&self, event: &tracing::Event<'_>) {
        self.inner().event(event)
    }

    fn enter(&self, span: &tracing::span::Id) {
        self.inner().enter(span)
    }

    fn exit(&self, span: &tracing::span::Id) {
        self.inner().exit(span)
    }

    fn clone_span(&self, span: &tracing::span::Id) -> tracing::span::Id {
        self.inner().clone_span(span)
    }

    fn try_close(&self, span: tracing::span::Id) -> bool {
        self.inner().try_close(span)
    }
}

/// `leasehold run NAME COMMAND` (without `--`; `elect`, `limit` and `fence` alike) fails
/// as an unexpected argument, naming the command's first word: add a tip that says how
/// to write it.
fn hint_the_double_dash(error: &mut clap::Error) {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let usage = match error.get(ContextKind::Usage) {
        Some(ContextValue::StyledStr(usage)) => usage.to_string(),
        _ => return,
    };
    let runs = ["run", "elect", "limit", "fence"];
    let Some(sub) = runs
        .iter()
        .find(|c| usage.contains(&format!("leasehold {c} ")))
    else {
        return;
    };
    let word = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(word)) if !word.starts_with('-') => word.clone(),
        _ => return,
    };
    if error.kind() == ErrorKind::UnknownArgument {
        let what = if *sub == "fence" { "FILE" } else { "NAME" };
        let tip = format!(
            "the command goes after `--`: leasehold {sub} [OPTIONS] {what} -- {word} [ARGS...]"
        );
        error.insert(
            ContextKind::Suggested,
            ContextValue::StyledStrs(vec![tip.into()]),
        );
    }
}

/// Parses arguments, runs, returns the exit code. Usage errors exit 64.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(mut e) => {
            hint_the_double_dash(&mut e);
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if json_in_args() {
                let message = e.render().to_string();
                return Failure::new(exit::USAGE, message.trim_end()).report(true);
            }
            let _ = e.print();
            return ExitCode::from(exit::USAGE);
        }
    };
    let json = cli.json();
    // Generated from the definitions above: no store, no runtime.
    match &cli.command {
        Command::Completions(args) => return completions(args).unwrap_or_else(|f| f.report(json)),
        Command::Man(args) => return man(args).unwrap_or_else(|f| f.report(json)),
        _ => {}
    }
    init_tracing(cli.verbose, json);
    // bench drives many workers on two threads, like the peers it is compared with; the
    // other commands wait on one lock and one child, which one thread does with fewer
    // hand-offs between threads.
    let mut builder = match cli.command {
        Command::Bench(_) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(2);
            b
        }
        _ => tokio::runtime::Builder::new_current_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            return Failure::new(exit::INTERNAL, format!("cannot start the runtime: {e}"))
                .report(json)
        }
    };
    let outcome = runtime.block_on(dispatch(cli));
    // Do not wait for stray background tasks (a best-effort release) past a short grace.
    runtime.shutdown_timeout(Duration::from_millis(200));
    match outcome {
        Ok(code) => code,
        Err(failure) => failure.report(json),
    }
}

impl Cli {
    /// Whether the command was given `--json`: then its errors are JSON too.
    fn json(&self) -> bool {
        match &self.command {
            Command::Run(args) => args.json,
            Command::Elect(args) => args.json,
            Command::Hold(args) => args.json,
            Command::Status(args) => args.json,
            Command::Leader(args) => args.json,
            Command::List(args) => args.json,
            Command::Release(args) => args.json,
            Command::Limit(args) => args.json,
            Command::Bench(args) => args.json,
            Command::Torture(args) => args.json,
            _ => false,
        }
    }
}

/// Whether `--json` is among the arguments (before a `--`) of a command line clap
/// refused, whose usage error must then be JSON too.
fn json_in_args() -> bool {
    std::env::args_os()
        .skip(1)
        .take_while(|arg| arg != "--")
        .any(|arg| arg == "--json")
}

async fn dispatch(cli: Cli) -> Result<ExitCode, Failure> {
    // An empty LEASEHOLD_STORE means the default, as if it were not set.
    let from_env = std::env::var("LEASEHOLD_STORE").ok();
    let store = (cli.store.as_deref())
        .or(from_env.as_deref())
        .filter(|url| !url.trim().is_empty());
    match cli.command {
        Command::Run(args) => {
            metrics::serve(args.lock.metrics)?;
            run::run(store, args).await
        }
        Command::Hold(args) => {
            metrics::serve(args.lock.metrics)?;
            run::hold(store, args).await
        }
        Command::Elect(args) => {
            metrics::serve(args.metrics)?;
            elect::elect(store, args).await
        }
        Command::Leader(args) => elect::leader(store, args).await,
        Command::Fence(args) => fence::fence(args),
        Command::Status(args) => inspect::status(store, args).await,
        Command::List(args) => inspect::list(store, args).await,
        Command::Release(args) => inspect::release(store, args).await,
        Command::Limit(args) => limit::limit(store, args).await,
        Command::Bench(args) => bench::bench(store, args).await,
        Command::Torture(args) => torture::torture(store, args).await,
        Command::TortureWorker(args) => torture::worker::worker(store, args).await,
        Command::TortureCommand(args) => torture::command::command(args).await,
        Command::Completions(args) => completions(&args),
        Command::Man(args) => man(&args),
    }
}
