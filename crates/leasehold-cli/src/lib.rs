//! The `leasehold` command: run a command under a lock, inspect locks, benchmark stores.
//!
//! `main.rs` only calls [`main`]; everything else is here so tests can drive it.

pub mod bench;
pub mod exit;
mod inspect;
mod limit;
mod progress;
mod ratebench;
mod run;
pub mod torture;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use leasehold::{Leasehold, Lock, Store};

use crate::exit::Failure;

const STORE_HELP: &str =
    "Store URL: local:DIR, local: (the default directory: $LEASEHOLD_HOME, else \
$XDG_STATE_HOME/leasehold, else ~/.local/state/leasehold); \
redis://[user:password@]host:port[/db][?replicas=N[&replica_timeout=DUR]] (wait for N replicas \
to confirm each grant), rediss://... (TLS), redis+cluster://h1:p1,h2:p2; \
etcd://h1:2379[,h2:2379...][?user=NAME&password=SECRET], etcds://... (TLS); \
memory: (this process only: for bench; run, hold, status, list and release refuse it). \
local://DIR is refused (it reads as a host): write local:/DIR or local:///DIR. \
Without --store, the LEASEHOLD_STORE environment variable (empty: the default).";

/// Distributed locks from the shell: run a command while holding a lock, with a lease,
/// a fencing token and a stop when the lock is lost.
#[derive(Debug, Parser)]
#[command(name = "leasehold", version, after_help = exit::TABLE)]
pub struct Cli {
    /// Lock store URL [env: LEASEHOLD_STORE] [default: local:, the default directory]
    // LEASEHOLD_STORE is read in `dispatch`, not by clap: clap counts a value from the
    // environment as given on the command line and shows `--store <URL>` in its usage
    // line when another argument is missing, as if it were required.
    #[arg(long, global = true, value_name = "URL", long_help = STORE_HELP)]
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
    #[command(after_help = RUN_AFTER_HELP)]
    Run(run::RunArgs),
    /// Acquire NAME, print its fencing token, hold it until SIGINT, SIGTERM or SIGHUP
    Hold(run::HoldArgs),
    /// Show who holds NAME and who waits
    Status(inspect::StatusArgs),
    /// List held or awaited locks
    List(inspect::ListArgs),
    /// Free a lock whoever holds it (needs --force); its holder sees the loss
    Release(inspect::ReleaseArgs),
    /// Run COMMAND when rate limiter NAME lets it through (GCRA), or print one decision
    #[command(after_help = limit::LIMIT_AFTER_HELP)]
    Limit(limit::LimitArgs),
    /// Measure a store: locks (W1-W3, lockbench.v1 with --json) or the rate limiter
    /// (R1-R4, ratebench.v1 with --json)
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

const RUN_AFTER_HELP: &str = "\
The command gets LEASEHOLD_NAME, LEASEHOLD_TOKEN (the fencing token, decimal),
LEASEHOLD_OWNER, LEASEHOLD_HELD (every lock the enclosing runs hold, NAME<tab>OWNER per
line) and, with --store, LEASEHOLD_STORE. A nested `leasehold run` of a NAME held
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

Exit status:
  N      the command's own exit status, when it ran to the end
  128+N  the command died of signal N (not one sent because the lock was lost)
  64     bad usage or bad input        69  store unreachable      70  internal error
  75     not acquired in time / busy (or --conflict-exit-code N)
  76     lock lost while running
  126    command not executable        127 command not found";

// The lock flags `run`, `hold` share (a plain comment: see `Command`).
#[derive(Debug, Clone, Args)]
pub struct LockArgs {
    /// Lock name (1 to 256 bytes, no control characters)
    pub name: String,

    /// Lease length; renewed at about a third of it while held (100ms to 24h)
    #[arg(long, value_name = "DUR", default_value = "15s", value_parser = parse_duration, allow_hyphen_values = true)]
    pub ttl: Duration,

    /// Give up after waiting this long (exit 75, or --conflict-exit-code) [default: wait
    /// without limit]
    #[arg(short = 'w', long, value_name = "DUR", value_parser = parse_duration, allow_hyphen_values = true, conflicts_with = "no_wait")]
    pub wait: Option<Duration>,

    /// Do not wait: give up at once if the lock is busy (exit 75, or --conflict-exit-code)
    #[arg(short = 'n', long)]
    pub no_wait: bool,

    /// Exit status when the lock is busy with --no-wait or --wait runs out, as flock's -E
    /// (0 to 255; e.g. 0 for a cron job that skips quietly when another host runs it)
    #[arg(short = 'E', long, value_name = "N", default_value_t = exit::NOT_ACQUIRED)]
    pub conflict_exit_code: u8,

    /// First come, first served: do not pass earlier waiters [default: on for etcd, off
    /// for the other stores]
    #[arg(long, overrides_with = "no_fair")]
    pub fair: bool,

    /// Not first come, first served: a release may go to any waiter (the fastest
    /// hand-off; on etcd, whose queue is its shape, waiters are still served in order)
    #[arg(long, overrides_with = "fair")]
    pub no_fair: bool,

    /// Make it a semaphore with N permits (everyone must use the same N)
    #[arg(
        long,
        value_name = "N",
        conflicts_with = "shared",
        allow_hyphen_values = true,
        value_parser = parse_permits
    )]
    pub permits: Option<u32>,

    /// Take a shared (read) lock; plain holders are writers
    #[arg(short = 's', long)]
    pub shared: bool,

    /// Owner id: holders with the same id re-enter instead of waiting [default: the
    /// owner of this NAME held by an enclosing `leasehold run` (LEASEHOLD_HELD), else
    /// LEASEHOLD_OWNER when not inside a run, else random]
    #[arg(long, value_name = "ID")]
    pub owner: Option<String>,
}

/// The locks that enclosing `leasehold run`s hold for the command, one `NAME\tOWNER`
/// line each (names and owner ids have no control characters): a nested run of one of
/// those names re-enters it, and only of those names.
pub const HELD_VAR: &str = "LEASEHOLD_HELD";

/// The owner a run of `name` uses without `--owner`: the enclosing run's owner of that
/// name, if any; else `LEASEHOLD_OWNER` as the user set it (not inside a run, which sets
/// it for its own name only); else none (a fresh owner).
fn inherited_owner(name: &str) -> Option<String> {
    let held = std::env::var(HELD_VAR).unwrap_or_default();
    let enclosing = held.lines().find_map(|line| {
        let (held_name, owner) = line.split_once('\t')?;
        (held_name == name).then(|| owner.to_string())
    });
    let outside_a_run = std::env::var_os("LEASEHOLD_NAME").is_none();
    enclosing.or_else(|| {
        std::env::var("LEASEHOLD_OWNER")
            .ok()
            .filter(|owner| outside_a_run && !owner.is_empty())
    })
}

/// `LEASEHOLD_HELD` for a command run under `name` held by `owner`.
pub fn held_with(name: &str, owner: &str) -> String {
    let mut held = std::env::var(HELD_VAR).unwrap_or_default();
    if !held.is_empty() {
        held.push('\n');
    }
    held.push_str(&format!("{name}\t{owner}"));
    held
}

impl LockArgs {
    /// The lock handle these flags describe.
    pub fn lock(&self, locks: &Leasehold) -> Result<Lock, Failure> {
        let lock = match (self.permits, self.shared) {
            (Some(permits), _) => locks.semaphore(self.name.as_str(), permits)?,
            (None, true) => locks.read(self.name.as_str())?,
            (None, false) => locks.write(self.name.as_str())?,
        };
        let owner = (self.owner.clone())
            .or_else(|| inherited_owner(&self.name))
            .unwrap_or_else(random_owner);
        let lock = match (self.fair, self.no_fair) {
            (true, _) => lock.with_fair(true),
            (_, true) => lock.with_fair(false),
            _ => lock,
        };
        Ok(lock.with_ttl(self.ttl).with_owner(owner))
    }
}

/// The longest duration a flag takes: far beyond any sensible TTL, wait or grace, and
/// short enough that no deadline counted from now can overflow.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// A duration flag: `500ms`, `1m30s`, `2h` (humantime), or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    const EXAMPLES: &str = "give e.g. 30s, 500ms, 1m30s or 2h";
    // Flags take values that start with '-' so that `--ttl -5s` gets this message rather
    // than clap's advice to write `-- -5s`; a flag or `--` in the value's place too.
    if let Some(rest) = text.trim_start().strip_prefix('-') {
        if rest.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
            return Err(format!("a duration cannot be negative; {EXAMPLES}"));
        }
        return Err(format!(
            "the duration is missing ({text:?} is not one); {EXAMPLES}"
        ));
    }
    let duration = match text.trim().parse::<f64>() {
        Ok(secs) => Duration::try_from_secs_f64(secs).map_err(|e| format!("{e}; {EXAMPLES}"))?,
        Err(_) => humantime::parse_duration(text).map_err(|e| format!("{e}; {EXAMPLES}"))?,
    };
    if duration > MAX_DURATION {
        return Err(format!("at most {}d", MAX_DURATION.as_secs() / 86_400));
    }
    Ok(duration)
}

/// `--permits N`: a whole number from 1 to the library's limit, said as such for any
/// other input (clap's own message for a u32 names the type's range).
fn parse_permits(text: &str) -> Result<u32, String> {
    let max = leasehold::MAX_PERMITS;
    text.trim()
        .parse::<u32>()
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| format!("a semaphore has 1 to {max} permits"))
}

/// `pid-random`: unique, and readable in `status`.
fn random_owner() -> String {
    format!("{}-{:08x}", std::process::id(), rand::random::<u32>())
}

/// Opens the store `--store` names (default: the local store's default directory).
pub async fn open_store(url: Option<&str>) -> Result<Arc<dyn Store>, Failure> {
    Ok(leasehold::open_store(url.unwrap_or("local:")).await?)
}

/// Opens the store for `command` (`run`, `hold`, `status`, `list`, `release`), whose
/// locks are meant for other processes: `memory:` is refused (exit 64), as each
/// `leasehold` process would have a store of its own and nothing would be excluded.
pub async fn open_shared_store(
    url: Option<&str>,
    command: &str,
) -> Result<Arc<dyn Store>, Failure> {
    if url.is_some_and(|url| url.trim().split(':').next() == Some("memory")) {
        return Err(Failure::new(
            exit::USAGE,
            format!(
                "store memory: (from --store or LEASEHOLD_STORE) lives in one process only, so \
`leasehold {command}` would share its locks with no other process and exclude nothing; use \
local: (the processes of this host), redis://... or etcd://... (memory: is for bench)"
            ),
        ));
    }
    open_store(url).await
}

/// What a bounded wait allows the store beyond the wait itself: a connect and a few round
/// trips on a loaded machine.
const STORE_SLACK: Duration = Duration::from_secs(2);

/// Runs `work`, which talks to the store; with a bounded `wait` (`Some(ZERO)` for
/// `--no-wait`), for at most the wait and `STORE_SLACK`, so a store that does not answer
/// (paused, a black-holed link) cannot stretch it by the client's connect and response
/// timeouts (9.5 s for a paused Redis): exit 69 then.
pub async fn within_wait<T, E: Into<Failure>>(
    wait: Option<Duration>,
    work: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, Failure> {
    let Some(wait) = wait else {
        return work.await.map_err(Into::into);
    };
    match tokio::time::timeout(wait.saturating_add(STORE_SLACK), work).await {
        Ok(done) => done.map_err(Into::into),
        Err(_) => {
            let allowed = match wait.is_zero() {
                true => format!("{} to connect", leasehold::humanize(STORE_SLACK)),
                false => format!(
                    "the --wait of {} and {} to connect",
                    leasehold::humanize(wait),
                    leasehold::humanize(STORE_SLACK)
                ),
            };
            Err(Failure::new(
                exit::UNAVAILABLE,
                format!("the store did not answer within {allowed}"),
            ))
        }
    }
}

fn init_tracing(verbose: u8) {
    use tracing_subscriber::util::SubscriberInitExt;
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let from_env = tracing_subscriber::EnvFilter::try_from_default_env();
    let default = match (verbose, from_env) {
        (_, Ok(filter)) => filter,
        (0, Err(_)) => {
            let _ = WarningsOnly::new(ansi).try_init();
            return;
        }
        // The library logs routine events at debug and trace, leaving info to us.
        (1, Err(_)) => tracing_subscriber::EnvFilter::new("leasehold=debug,leasehold_cli=info"),
        (_, Err(_)) => tracing_subscriber::EnvFilter::new("leasehold=trace,leasehold_cli=trace"),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(default)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
}

/// The log of a process without `-v` or `RUST_LOG`: warnings and errors, as the
/// formatting subscriber prints them, which is made when the first of them comes. Most
/// runs log nothing, and then pay for no span registry and no filter.
struct WarningsOnly {
    ansi: bool,
    inner: std::sync::OnceLock<Box<dyn tracing::Subscriber + Send + Sync>>,
}

impl WarningsOnly {
    fn new(ansi: bool) -> Self {
        WarningsOnly {
            ansi,
            inner: std::sync::OnceLock::new(),
        }
    }

    fn inner(&self) -> &(dyn tracing::Subscriber + Send + Sync) {
        &**self.inner.get_or_init(|| {
            Box::new(
                tracing_subscriber::fmt()
                    .with_max_level(tracing::Level::WARN)
                    .with_writer(std::io::stderr)
                    .with_ansi(self.ansi)
                    .finish(),
            )
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

/// `leasehold run NAME COMMAND` (without `--`) fails as an unexpected argument, naming
/// the command's first word: add a tip that says how to write it.
fn hint_the_double_dash(error: &mut clap::Error) {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let in_run = matches!(error.get(ContextKind::Usage),
        Some(ContextValue::StyledStr(usage)) if usage.to_string().contains("leasehold run "));
    let word = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(word)) if !word.starts_with('-') => word.clone(),
        _ => return,
    };
    if error.kind() == ErrorKind::UnknownArgument && in_run {
        let tip = format!(
            "the command goes after `--`: leasehold run [OPTIONS] NAME -- {word} [ARGS...]"
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
            let code = if e.use_stderr() { exit::USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    // Generated from the definitions above: no store, no runtime.
    match &cli.command {
        Command::Completions(args) => return completions(args).unwrap_or_else(Failure::report),
        Command::Man(args) => return man(args).unwrap_or_else(Failure::report),
        _ => {}
    }
    init_tracing(cli.verbose);
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
            return Failure::new(exit::INTERNAL, format!("cannot start the runtime: {e}")).report()
        }
    };
    let outcome = runtime.block_on(dispatch(cli));
    // Do not wait for stray background tasks (a best-effort release) past a short grace.
    runtime.shutdown_timeout(Duration::from_millis(200));
    match outcome {
        Ok(code) => code,
        Err(failure) => failure.report(),
    }
}

async fn dispatch(cli: Cli) -> Result<ExitCode, Failure> {
    // An empty LEASEHOLD_STORE means the default, as if it were not set.
    let from_env = std::env::var("LEASEHOLD_STORE").ok();
    let store = (cli.store.as_deref())
        .or(from_env.as_deref())
        .filter(|url| !url.trim().is_empty());
    match cli.command {
        Command::Run(args) => run::run(store, args).await,
        Command::Hold(args) => run::hold(store, args).await,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_humantime_or_seconds_and_bounded() {
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("60"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("365d"), Ok(MAX_DURATION));
        for bad in [
            "-5s",
            "-1",
            "--",
            "--no-wait",
            "nan",
            "inf",
            "soon",
            "",
            "366d",
            "18000000000000000000s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} was taken");
        }
    }
}
