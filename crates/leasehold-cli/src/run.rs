//! `run` (a command under a lock) and `hold` (a lock until signalled).

use std::ffi::OsString;
use std::io::Write;
use std::process::{ExitCode, ExitStatus};
use std::time::{Duration, SystemTime};

use clap::Args;
use leasehold::{humanize, Leasehold, LockGuard};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::time::{sleep_until, Instant};

use crate::child::{
    exit_code, forward, kill_group, next_stop, spawn, stop_with_the_command, take_terminal_back,
    terminal_foreground, Watchdog,
};
use crate::exit::{self, Failure};
use crate::progress::Progress;
use crate::LockArgs;

// Flags of `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub lock: LockArgs,

    /// Time the command gets between SIGTERM and SIGKILL once the lock is lost
    #[arg(long, value_name = "DUR", default_value = "5s", value_parser = crate::parse_duration, allow_hyphen_values = true)]
    pub grace: Duration,

    /// leasehold's own errors and log lines as JSON objects on stderr (the command's
    /// output is its own)
    #[arg(long)]
    pub json: bool,

    /// The command to run, after `--`
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

// Flags of `hold`.
#[derive(Debug, Args)]
pub struct HoldArgs {
    #[command(flatten)]
    pub lock: LockArgs,

    /// JSON lines on stdout: one when held, one when the hold ends; errors as JSON on
    /// stderr
    #[arg(long)]
    pub json: bool,
}

/// Acquires the lock the flags describe, showing progress on a terminal; exit 75 with
/// who holds it if it cannot be had in time.
async fn acquire(locks: &Leasehold, args: &LockArgs) -> Result<LockGuard, Failure> {
    let progress = Progress::for_stderr(args.noun(), &args.name);
    let lock = args.lock(locks)?.on_wait({
        let progress = progress.clone();
        move |busy| progress.update(busy)
    });
    let acquiring = async {
        if args.no_wait {
            lock.try_lock().await
        } else if let Some(wait) = args.wait {
            lock.try_lock_for(wait).await
        } else {
            lock.lock().await.map(Some)
        }
    };
    tokio::pin!(acquiring);
    // Redraws once a second ("held for" counts on); the store's answers draw it first.
    let second = Duration::from_secs(1);
    let mut tick = tokio::time::interval_at(Instant::now() + second, second);
    let outcome = loop {
        tokio::select! {
            outcome = &mut acquiring => break outcome,
            _ = tick.tick(), if progress.is_on() => progress.redraw(),
        }
    };
    progress.clear();
    if let Some(guard) = outcome? {
        return Ok(guard);
    }
    let state = locks.describe(args.name.as_str()).await.ok();
    let holder = state.as_ref().and_then(|s| s.holders.first());
    let what = args.noun();
    let held = match args.value {
        Some(_) => "is led by",
        None => "is held by",
    };
    let held_by = match holder {
        Some(h) => format!(
            "{held} {} ({}, pid {}) for {}",
            h.owner,
            h.host,
            h.pid,
            humanize(
                SystemTime::now()
                    .duration_since(h.since)
                    .unwrap_or_default()
            )
        ),
        None => "is busy".to_string(),
    };
    // A semaphore's or a read lock's other holders: how many, not only the first.
    let holders = state.as_ref().map_or(0, |s| s.holders.len());
    let held_by = match holders {
        0 | 1 => held_by,
        n => format!(
            "{held_by} and {} other{}",
            n - 1,
            if n == 2 { "" } else { "s" }
        ),
    };
    let gave_up = match args.wait {
        Some(wait) if !args.no_wait => format!("gave up after --wait {}", humanize(wait)),
        _ => "not waiting (--no-wait)".to_string(),
    };
    Err(Failure::new(
        args.conflict_exit_code,
        format!("{what} \"{}\" {held_by}; {gave_up}", args.name),
    )
    .named(exit::NOT_ACQUIRED))
}

/// Opens the store; with a bounded wait (`--wait`, `--no-wait`), within that wait and a
/// little (see [`crate::within_wait`]).
async fn connect(
    store: Option<&str>,
    command: &str,
    lock: &LockArgs,
) -> Result<Leasehold, Failure> {
    let url = crate::store_url(store)?;
    let bound = bounded_wait(lock);
    let opening = crate::open_shared_store(store, command, bound);
    Ok(Leasehold::from_store(
        crate::within_wait(&url, bound, opening).await?,
    ))
}

/// The wait `--wait` or `--no-wait` (zero) bounds, if any.
fn bounded_wait(lock: &LockArgs) -> Option<Duration> {
    match (lock.no_wait, lock.wait) {
        (true, _) => Some(Duration::ZERO),
        (false, wait) => wait,
    }
}

fn signals() -> Result<[Signal; 3], Failure> {
    let make = |kind| {
        signal(kind)
            .map_err(|e| Failure::new(exit::INTERNAL, format!("cannot handle signals: {e}")))
    };
    Ok([
        make(SignalKind::interrupt())?,
        make(SignalKind::terminate())?,
        make(SignalKind::hangup())?,
    ])
}

/// Acquires, unless SIGINT, SIGTERM or SIGHUP arrive first: then stops waiting and exits
/// 128+N as if killed by the signal (the abandoned acquire leaves the queue in the
/// background, which [`with_locks`] waits for).
async fn acquire_or_signal(
    locks: &Leasehold,
    args: &LockArgs,
    signals: &mut [Signal; 3],
) -> Result<LockGuard, Failure> {
    let [int, term, hup] = signals;
    let signal = tokio::select! {
        guard = acquire(locks, args) => return guard,
        _ = int.recv() => libc::SIGINT,
        _ = term.recv() => libc::SIGTERM,
        _ = hup.recv() => libc::SIGHUP,
    };
    Progress::for_stderr(args.noun(), &args.name).clear();
    Err(Failure::new(
        128 + signal as u8,
        format!(
            "stopped waiting for {} \"{}\" on signal {signal}",
            args.noun(),
            args.name
        ),
    ))
}

/// How long the release after the command may take before `run` exits without its
/// answer (it goes on in the background for the shutdown's patience; else the lease
/// ends it): a store that went away must not hold a finished job for long.
const RELEASE_PATIENCE: Duration = Duration::from_secs(2);

/// What the command finds in its environment: the lock it runs under, its token and
/// owner, the locks held around it (for nested runs to re-enter), and the store.
fn command_env(
    args: &RunArgs,
    store: Option<&str>,
    guard: &LockGuard,
) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("LEASEHOLD_NAME", args.lock.name.clone()),
        ("LEASEHOLD_TOKEN", guard.token().to_string()),
        ("LEASEHOLD_OWNER", guard.owner().to_string()),
        (
            crate::HELD_VAR,
            crate::held_with(&args.lock.name, guard.owner()),
        ),
    ];
    if let Some(store) = store {
        env.push(("LEASEHOLD_STORE", store_for_command(store)));
    }
    if let Some(value) = &args.lock.value {
        env.push(("LEASEHOLD_TERM", guard.token().to_string()));
        env.push(("LEASEHOLD_VALUE", value.clone()));
    }
    env
}

/// The store as the command is told it: a local directory absolute (`~` expanded), so
/// that a nested run from another working directory, or with another HOME, opens the
/// same store (and does not take a lock of the same name in another one, believing it
/// re-entered this one). Other URLs as given: their text may hold a password that the
/// parsed form masks.
fn store_for_command(store: &str) -> String {
    match leasehold::StoreUrl::parse(store) {
        Ok(url) if url.dir().is_some() => url
            .absolute()
            .map_or_else(|_| store.to_string(), |url| url.to_string()),
        _ => store.to_string(),
    }
}

enum Ended {
    Exited(ExitStatus),
    /// The lock is lost, or about to be with renewals failing: stop the command,
    /// SIGKILL at `kill_at` (before `--grace` is over if `at_deadline`: the safe
    /// deadline comes first).
    Lost {
        kill_at: Instant,
        at_deadline: bool,
        why: String,
    },
}

/// What stopping the command will do, as the lost message says it: SIGTERM, then SIGKILL
/// `kill_in` from now (after `--grace`, or earlier at the safe deadline).
fn stop_plan(kill_in: Duration, at_deadline: bool, grace: Duration) -> String {
    if kill_in.is_zero() && !at_deadline {
        "SIGTERM, then SIGKILL at once (--grace 0)".to_string()
    } else if kill_in.is_zero() {
        "SIGTERM, then SIGKILL at once: the safe deadline has passed, so there is no grace"
            .to_string()
    } else if at_deadline && grace.saturating_sub(kill_in) >= Duration::from_millis(50) {
        // (Closer, the two read the same: "in 5.0s ..., before --grace 5s is over".)
        format!(
            "SIGTERM, then SIGKILL in {} at the safe deadline, before --grace {} is over",
            humanize(kill_in),
            humanize(grace)
        )
    } else {
        format!("SIGTERM, then SIGKILL after --grace {}", humanize(grace))
    }
}

/// How long `run` and `hold` wait before exiting for what the library does in the
/// background: a place in a queue given up on a signal is taken out, a release that met
/// store trouble is sent again. Left undone, the place would hold up a fair queue until
/// its waiter lease ends.
const SHUTDOWN_PATIENCE: Duration = Duration::from_secs(2);

/// Runs `command` with the store's locks, then lets their background work finish.
async fn with_locks<F: std::future::Future<Output = Result<ExitCode, Failure>>>(
    store: Option<&str>,
    subcommand: &str,
    lock: &LockArgs,
    command: impl FnOnce(Leasehold) -> F,
) -> Result<ExitCode, Failure> {
    // A bounded wait ends the run within the wait and the connect's slack, background
    // work included, when it fails: a store that went away must not stretch it.
    let bound = bounded_wait(lock).map(|wait| Instant::now() + wait + crate::args::STORE_SLACK);
    let locks = connect(store, subcommand, lock).await?;
    let outcome = command(locks.clone()).await;
    let patience = match (&outcome, bound) {
        (Err(_), Some(bound)) => bound
            .saturating_duration_since(Instant::now())
            .min(SHUTDOWN_PATIENCE),
        _ => SHUTDOWN_PATIENCE,
    };
    if !locks.shutdown(patience).await {
        tracing::warn!(
            "exiting before every release reached the store; those locks end with their leases"
        );
    }
    outcome
}

/// `leasehold run NAME -- COMMAND...`.
pub async fn run(store: Option<&str>, args: RunArgs) -> Result<ExitCode, Failure> {
    run_as("run", store, args).await
}

/// `run`, as the subcommand `command` (named in messages about the store).
pub async fn run_as(
    command: &str,
    store: Option<&str>,
    args: RunArgs,
) -> Result<ExitCode, Failure> {
    let lock = args.lock.clone();
    with_locks(store, command, &lock, |locks| run_with(locks, store, args)).await
}

async fn run_with(
    locks: Leasehold,
    store: Option<&str>,
    args: RunArgs,
) -> Result<ExitCode, Failure> {
    crate::child::must_exist(&args.command)?;
    let mut signals = signals()?;
    let guard = acquire_or_signal(&locks, &args.lock, &mut signals).await?;
    tracing::info!(lock = %args.lock.name, token = guard.token().get(), "running the command");
    let foreground = terminal_foreground();
    if foreground {
        // SAFETY: plain call; lets us take the terminal back after the command.
        unsafe { libc::signal(libc::SIGTTOU, libc::SIG_IGN) };
    }
    let mut watchdog = Watchdog::start(guard.valid_until())
        .inspect_err(|e| {
            exit::warning(args.json, &format!("cannot start the watchdog ({e}); if leasehold is killed, what the command started may outlive the lock"));
        })
        .ok();
    let group = watchdog.as_ref().map(|w| w.pid);
    let env = command_env(&args, store, &guard);
    let mut child = match spawn(&args.command, &env, foreground, group) {
        Ok(child) => child,
        Err(failure) => {
            drop(watchdog.map(Watchdog::stand_down));
            let _ = guard.release().await;
            return Err(failure);
        }
    };
    let pgid = group.or(child.id().map(|id| id as i32)).unwrap_or(0);
    let ended = supervise(
        &args,
        &guard,
        &mut child,
        (pgid, foreground),
        &mut signals,
        &mut watchdog,
    )
    .await?;
    let losing = matches!(ended, Ended::Lost { .. });
    let code = stop(ended, &args, &guard, &mut child, pgid).await;
    // The command is reaped (and its group killed if the lock was lost): from here on a
    // killed leasehold must not touch the group, whose id may even be reused. The
    // watchdog, idle, exits when the release is done.
    let _watchdog_pipe = watchdog.map(Watchdog::stand_down);
    if foreground {
        take_terminal_back();
    }
    if losing {
        release_losing(&locks, guard).await;
    } else {
        release_after(guard, &args.lock.name, args.json).await;
    }
    Ok(code)
}

/// While the command runs: passes our signals on to its group, the new safe deadlines
/// on to the watchdog, and ends when the command does or the lock is lost (or about to
/// be).
async fn supervise(
    args: &RunArgs,
    guard: &LockGuard,
    child: &mut tokio::process::Child,
    (pgid, foreground): (i32, bool),
    signals: &mut [Signal; 3],
    watchdog: &mut Option<Watchdog>,
) -> Result<Ended, Failure> {
    let mut deadlines = guard.deadlines();
    let mut renewing = true;
    // Stops and continuations of the command (job control).
    let mut changed = signal(SignalKind::child())
        .map_err(|e| Failure::new(exit::INTERNAL, format!("cannot handle signals: {e}")))?;
    let pid = child.id().unwrap_or(0);
    // A stop before the stream above was made sent its SIGCHLD to nobody.
    follow_stops(pid, pgid, foreground);
    // Stop the command a little before the safe deadline if renewals keep failing, so it
    // is gone before anyone else can hold the lock. Only failing renewals count: a lock
    // handed over on a short lease is renewed to the full TTL at once.
    let warning = args.grace.min(args.lock.ttl / 3);
    loop {
        let [int, term, hup] = &mut *signals;
        tokio::select! {
            status = child.wait() => return match status {
                Ok(status) => Ok(Ended::Exited(status)),
                Err(e) => Err(Failure::new(exit::INTERNAL, format!("cannot wait for the command: {e}"))),
            },
            _ = int.recv() => forward(pgid, libc::SIGINT),
            _ = term.recv() => forward(pgid, libc::SIGTERM),
            _ = hup.recv() => forward(pgid, libc::SIGHUP),
            _ = changed.recv() => follow_stops(pid, pgid, foreground),
            valid_until = deadlines.next(), if renewing => match (valid_until, &mut *watchdog) {
                (Some(valid_until), Some(watchdog)) => watchdog.deadline(valid_until),
                (Some(_), None) => {}
                (None, _) => renewing = false,
            },
            // Lost (the store said so, or the safe deadline passed), or about to be.
            _ = async { tokio::select! { _ = guard.lost() => {}, _ = guard.at_risk(warning) => {} } } => {
                return Ok(lost_now(args, guard));
            }
        }
    }
}

/// Job control: the command stopped from the terminal (Ctrl-Z), in the foreground, and
/// we stop with it; other stops and continuations are the command's own business.
fn follow_stops(pid: u32, pgid: i32, foreground: bool) {
    let from_terminal = |s| matches!(s, libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU);
    while let Some(signal) = next_stop(pid) {
        if foreground && from_terminal(signal) {
            stop_with_the_command(pgid, signal);
        }
    }
}

/// The lock is lost or about to be: why, and when the command is killed.
fn lost_now(args: &RunArgs, guard: &LockGuard) -> Ended {
    let now = Instant::now();
    let valid_until = guard.valid_until();
    let noun = args.lock.noun();
    let why = match guard.check() {
        // The library's message names a lock; an election's is said as one.
        Err(lost) => lost
            .to_string()
            .replacen("lock \"", &format!("{noun} \""), 1),
        Ok(_) => format!(
            "{noun} \"{}\" is about to be lost: it could not be renewed and ends in {}",
            args.lock.name,
            humanize(valid_until.saturating_duration_since(now))
        ),
    };
    // Past the safe deadline someone else may hold the lock: no grace then.
    let after_grace = now + args.grace;
    let kill_at = after_grace.min(valid_until.max(now));
    Ended::Lost {
        kill_at,
        at_deadline: kill_at < after_grace,
        why,
    }
}

/// How it ended, as `run`'s exit code: the command's own when it finished under the
/// lock; else the command (and its group) stopped, and 76.
async fn stop(
    ended: Ended,
    args: &RunArgs,
    guard: &LockGuard,
    child: &mut tokio::process::Child,
    pgid: i32,
) -> ExitCode {
    match ended {
        // Work that finished after the deadline was not protected by the lock.
        Ended::Exited(status) => match guard.check() {
            Ok(_) => exit_code(status),
            Err(lost) => {
                kill_group(pgid, libc::SIGKILL);
                let why = format!("{lost}; the command ended after that");
                Failure::new(exit::LOST, why).report(args.json)
            }
        },
        Ended::Lost {
            kill_at,
            at_deadline,
            why,
        } => {
            let plan = stop_plan(
                kill_at.saturating_duration_since(Instant::now()),
                at_deadline,
                args.grace,
            );
            // Said now, while the command is being stopped; the exit code comes after.
            let code = Failure::new(exit::LOST, format!("{why}; stopping the command ({plan})"))
                .report(args.json);
            kill_group(pgid, libc::SIGTERM);
            tokio::select! {
                _ = child.wait() => {}
                _ = sleep_until(kill_at) => {
                    kill_group(pgid, libc::SIGKILL);
                    let _ = child.wait().await;
                }
            }
            // Whatever is left in its group must not outlive the lock either.
            kill_group(pgid, libc::SIGKILL);
            code
        }
    }
}

/// Releases after the command; if the store is away, does not wait on it: the lease
/// ends the lock anyway.
async fn release_after(guard: LockGuard, name: &str, json: bool) {
    let released = match tokio::time::timeout(RELEASE_PATIENCE, guard.release()).await {
        Ok(released) => released.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {}", humanize(RELEASE_PATIENCE))),
    };
    if let Err(e) = released {
        let why = format!("could not release lock \"{name}\" ({e}); it ends with its lease");
        exit::warning(json, &why);
    }
}

/// Releases a lock that is lost or about to be, once, until its safe deadline at most,
/// and not again in the background: past the deadline the lease is over anyway, and a
/// store that went away (the usual reason) must not hold up the exit.
async fn release_losing(locks: &Leasehold, guard: LockGuard) {
    let left = guard
        .valid_until()
        .saturating_duration_since(Instant::now());
    let lease = guard.leak();
    if !left.is_zero() {
        let _ =
            tokio::time::timeout(left.min(RELEASE_PATIENCE), locks.store().release(&lease)).await;
    }
}

/// `leasehold hold NAME`: prints the token, holds until SIGINT, SIGTERM or SIGHUP,
/// releases.
pub async fn hold(store: Option<&str>, args: HoldArgs) -> Result<ExitCode, Failure> {
    let lock = args.lock.clone();
    with_locks(store, "hold", &lock, |locks| hold_with(locks, args)).await
}

async fn hold_with(locks: Leasehold, args: HoldArgs) -> Result<ExitCode, Failure> {
    let mut signals = signals()?;
    let guard = acquire_or_signal(&locks, &args.lock, &mut signals).await?;
    let [int, term, hup] = &mut signals;
    if args.json {
        crate::json::held(&args.lock.name, &guard)?;
    } else {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", guard.token());
        let _ = out.flush();
    }
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
        _ = hup.recv() => {}
        _ = guard.lost() => {
            let why = guard.check().err().map(|e| e.to_string()).unwrap_or_default();
            let ended = crate::json::lost(args.json, &args.lock.name, guard.token(), why);
            // As `run` does: a store that went away (the usual reason) must not hold up
            // the exit.
            release_losing(&locks, guard).await;
            return ended;
        }
    }
    let token = guard.token();
    // The lease may have ended between the signal and the release (a force-release
    // that the watch had not yet reported): what was done under it was not protected.
    if guard.release().await? == leasehold::Released::NotHeld {
        let why = format!(
            "lock \"{}\" was no longer held when it was released (its lease had ended)",
            args.lock.name
        );
        return crate::json::lost(args.json, &args.lock.name, token, why);
    }
    match args.json {
        true => crate::json::released(&args.lock.name, token),
        false => Ok(ExitCode::SUCCESS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stop_plan_says_when_sigkill_really_comes() {
        let grace = Duration::from_secs(5);
        let plan = stop_plan(Duration::from_millis(664), true, grace);
        assert!(
            plan.contains("SIGKILL in 664ms at the safe deadline"),
            "{plan}"
        );
        assert!(!plan.contains("after"), "{plan}");
        let plan = stop_plan(grace, false, grace);
        assert!(plan.contains("SIGKILL after --grace 5s"), "{plan}");
        let plan = stop_plan(Duration::ZERO, true, grace);
        assert!(plan.contains("SIGKILL at once"), "{plan}");
        assert!(plan.contains("safe deadline has passed"), "{plan}");
        // No grace asked for: at once, and not for a deadline that has not passed.
        let plan = stop_plan(Duration::ZERO, false, Duration::ZERO);
        assert!(plan.contains("SIGKILL at once (--grace 0)"), "{plan}");
        // A deadline a few ms before the grace's end reads as the grace, not as "5s
        // before --grace 5s is over".
        let plan = stop_plan(grace - Duration::from_millis(3), true, grace);
        assert!(plan.contains("SIGKILL after --grace 5s"), "{plan}");
    }
}
