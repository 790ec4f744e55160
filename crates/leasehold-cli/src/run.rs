//! `run` (a command under a lock) and `hold` (a lock until signalled).

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::process::{ExitCode, ExitStatus};
use std::time::{Duration, SystemTime};

use clap::Args;
use leasehold::{humanize, Leasehold, LockGuard};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::time::{sleep_until, Instant};

use crate::exit::{self, Failure};
use crate::progress::Progress;
use crate::LockArgs;

/// Flags of `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub lock: LockArgs,

    /// Time the command gets between SIGTERM and SIGKILL once the lock is lost
    #[arg(long, value_name = "DUR", default_value = "5s", value_parser = humantime::parse_duration)]
    pub grace: Duration,

    /// The command to run, after `--`
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Flags of `hold`.
#[derive(Debug, Args)]
pub struct HoldArgs {
    #[command(flatten)]
    pub lock: LockArgs,
}

/// Acquires the lock the flags describe, showing progress on a terminal; exit 75 with
/// who holds it if it cannot be had in time.
async fn acquire(locks: &Leasehold, args: &LockArgs) -> Result<LockGuard, Failure> {
    let progress = Progress::for_stderr(&args.name);
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
    let mut tick = tokio::time::interval(Duration::from_secs(1));
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
    let held_by = match holder {
        Some(h) => format!(
            "is held by {} ({}, pid {}) for {}",
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
    let gave_up = match args.wait {
        Some(wait) if !args.no_wait => format!("gave up after --wait {}", humanize(wait)),
        _ => "not waiting (--no-wait)".to_string(),
    };
    Err(Failure::new(
        exit::NOT_ACQUIRED,
        format!("lock \"{}\" {held_by}; {gave_up}", args.name),
    ))
}

async fn connect(store: Option<&str>) -> Result<Leasehold, Failure> {
    Ok(Leasehold::from_store(crate::open_store(store).await?))
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

/// Acquires, unless SIGINT, SIGTERM or SIGHUP arrive first: then stops waiting (the
/// abandoned acquire leaves the queue) and exits 128+N as if killed by the signal.
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
    Progress::for_stderr(&args.name).clear();
    Err(Failure::new(
        128 + signal as u8,
        format!(
            "stopped waiting for lock \"{}\" on signal {signal}",
            args.name
        ),
    ))
}

fn kill_group(pgid: i32, signal: i32) {
    // SAFETY: plain syscall; a negative pid addresses the process group.
    unsafe { libc::kill(-pgid, signal) };
}

/// Whether we own the terminal's foreground: then the command gets it while it runs, so
/// interactive commands work although they run in their own process group.
fn terminal_foreground() -> bool {
    // SAFETY: plain queries on fd 0.
    std::io::stdin().is_terminal() && unsafe { libc::tcgetpgrp(0) == libc::getpgrp() }
}

fn take_terminal_back() {
    // SAFETY: SIGTTOU stays ignored (set before spawning), so tcsetpgrp from what is now
    // a background group does not stop us.
    unsafe { libc::tcsetpgrp(0, libc::getpgrp()) };
}

fn spawn(
    args: &RunArgs,
    store: Option<&str>,
    guard: &LockGuard,
    foreground: bool,
) -> Result<tokio::process::Child, Failure> {
    let mut cmd = tokio::process::Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env("LEASEHOLD_NAME", &args.lock.name)
        .env("LEASEHOLD_TOKEN", guard.token().to_string())
        .env("LEASEHOLD_OWNER", guard.owner());
    if let Some(store) = store {
        cmd.env("LEASEHOLD_STORE", store);
    }
    cmd.process_group(0);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // Die with us: a killed `leasehold` must not leave its command running unlocked.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if foreground {
                libc::setpgid(0, 0);
                libc::tcsetpgrp(0, libc::getpgrp());
                libc::signal(libc::SIGTTOU, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    cmd.spawn().map_err(|e| {
        let what = args.command[0].to_string_lossy();
        match e.kind() {
            std::io::ErrorKind::NotFound => {
                Failure::new(exit::NOT_FOUND, format!("command not found: {what}"))
            }
            _ => Failure::new(exit::CANNOT_EXECUTE, format!("cannot run {what}: {e}")),
        }
    })
}

enum Ended {
    Exited(ExitStatus),
    /// The lock is lost, or about to be with renewals failing: stop the command,
    /// SIGKILL at `kill_at`.
    Lost {
        kill_at: Instant,
        why: String,
    },
}

fn exit_code(status: ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(code as u8),
        (None, Some(sig)) => ExitCode::from(128u8.wrapping_add(sig as u8)),
        _ => ExitCode::from(exit::INTERNAL),
    }
}

/// `leasehold run NAME -- COMMAND...`.
pub async fn run(store: Option<&str>, args: RunArgs) -> Result<ExitCode, Failure> {
    let locks = connect(store).await?;
    let mut signals = signals()?;
    let guard = acquire_or_signal(&locks, &args.lock, &mut signals).await?;
    tracing::info!(lock = %args.lock.name, token = guard.token().get(), "running the command");
    let foreground = terminal_foreground();
    if foreground {
        // SAFETY: plain call; lets us take the terminal back after the command.
        unsafe { libc::signal(libc::SIGTTOU, libc::SIG_IGN) };
    }
    let mut child = match spawn(&args, store, &guard, foreground) {
        Ok(child) => child,
        Err(failure) => {
            let _ = guard.release().await;
            return Err(failure);
        }
    };
    let pgid = child.id().map(|id| id as i32).unwrap_or(0);
    // Stop the command a little before the safe deadline if renewals keep failing, so it
    // is gone before anyone else can hold the lock.
    let warning = args.grace.min(args.lock.ttl / 3);
    let ended = loop {
        let warn_at = guard
            .valid_until()
            .checked_sub(warning)
            .unwrap_or_else(Instant::now);
        let [int, term, hup] = &mut signals;
        tokio::select! {
            status = child.wait() => match status {
                Ok(status) => break Ended::Exited(status),
                Err(e) => return Err(Failure::new(exit::INTERNAL, format!("cannot wait for the command: {e}"))),
            },
            _ = int.recv() => kill_group(pgid, libc::SIGINT),
            _ = term.recv() => kill_group(pgid, libc::SIGTERM),
            _ = hup.recv() => kill_group(pgid, libc::SIGHUP),
            _ = guard.lost() => {
                let why = guard.check().err().map(|e| e.to_string()).unwrap_or_default();
                // Past the safe deadline someone else may hold the lock: no grace then.
                let now = Instant::now();
                let kill_at = (now + args.grace).min(guard.valid_until().max(now));
                break Ended::Lost { kill_at, why };
            }
            _ = sleep_until(warn_at) => {
                let valid_until = guard.valid_until();
                if Instant::now() + warning >= valid_until {
                    let why = format!(
                        "lock \"{}\" could not be renewed and ends in {}",
                        args.lock.name,
                        humanize(valid_until.saturating_duration_since(Instant::now()))
                    );
                    break Ended::Lost { kill_at: valid_until.max(Instant::now()), why };
                }
            }
        }
    };
    let code = match ended {
        // Work that finished after the deadline was not protected by the lock.
        Ended::Exited(status) => match guard.check() {
            Ok(_) => exit_code(status),
            Err(lost) => {
                kill_group(pgid, libc::SIGKILL);
                eprintln!("leasehold: {lost}; the command ended after that");
                ExitCode::from(exit::LOST)
            }
        },
        Ended::Lost { kill_at, why } => {
            eprintln!(
                "leasehold: {why}; stopping the command (SIGTERM, then SIGKILL after {})",
                humanize(args.grace)
            );
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
            ExitCode::from(exit::LOST)
        }
    };
    if foreground {
        take_terminal_back();
    }
    if let Err(e) = guard.release().await {
        eprintln!(
            "leasehold: could not release lock \"{}\" ({e}); it ends with its lease",
            args.lock.name
        );
    }
    Ok(code)
}

/// `leasehold hold NAME`: prints the token, holds until SIGINT, SIGTERM or SIGHUP,
/// releases.
pub async fn hold(store: Option<&str>, args: HoldArgs) -> Result<ExitCode, Failure> {
    let locks = connect(store).await?;
    let mut signals = signals()?;
    let guard = acquire_or_signal(&locks, &args.lock, &mut signals).await?;
    let [int, term, hup] = &mut signals;
    {
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
            eprintln!("leasehold: {why}");
            let _ = guard.release().await;
            return Ok(ExitCode::from(exit::LOST));
        }
    }
    guard.release().await?;
    Ok(ExitCode::SUCCESS)
}
