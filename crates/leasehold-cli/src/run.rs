//! `run` (a command under a lock) and `hold` (a lock until signalled).

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::process::{ExitCode, ExitStatus};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use clap::Args;
use leasehold::{humanize, Leasehold, LockGuard};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::time::{sleep_until, Instant};

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
        args.conflict_exit_code,
        format!("lock \"{}\" {held_by}; {gave_up}", args.name),
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
    let wait = match (lock.no_wait, lock.wait) {
        (true, _) => Some(Duration::ZERO),
        (false, wait) => wait,
    };
    let opening = crate::open_shared_store(store, command);
    Ok(Leasehold::from_store(
        crate::within_wait(wait, opening).await?,
    ))
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

/// How long the release after the command may take before `run` exits without its
/// answer (it goes on in the background for the shutdown's patience; else the lease
/// ends it): a store that went away must not hold a finished job for long.
const RELEASE_PATIENCE: Duration = Duration::from_secs(1);

/// Kills the command's process group if `leasehold` dies without standing it down
/// (SIGKILL, the OOM killer), or stalls past the lease (SIGSTOP, a frozen VM):
/// `PR_SET_PDEATHSIG` reaches the command's first process only, not what it started, and
/// nothing at all while we are stopped. A forked process waits on a pipe whose write end
/// only we hold, so it ends when we do, and until the safe deadline we keep in a page we
/// share, renewal after renewal. The end of the pipe without the page saying we stood it
/// down means we are gone; a deadline passed without a later one means we are stuck.
/// Neither new deadlines nor standing down wake it.
///
/// It leads the process group the command then joins, so it knows the group before the
/// command runs anything, and the command can be started without code of ours between
/// fork and exec (posix_spawn, which does not copy our address space). Being in the group,
/// it keeps every signal blocked: what is sent to the command's group is not for it.
struct Watchdog {
    /// Also the command's process group.
    pid: libc::pid_t,
    /// Closed with us; the command does not inherit it (close-on-exec).
    pipe: std::fs::File,
    shared: &'static Shared,
}

/// What the watchdog reads of us: in a page mapped shared before the fork, for the life
/// of the process.
#[repr(C)]
struct Shared {
    /// The safe deadline, on CLOCK_MONOTONIC in nanoseconds.
    deadline: AtomicU64,
    stood_down: AtomicBool,
}

/// CLOCK_MONOTONIC in nanoseconds: the clock the watchdog and we share.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; async-signal-safe (the watchdog calls it).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `valid_until` on CLOCK_MONOTONIC, in nanoseconds.
fn monotonic_at(valid_until: Instant) -> u64 {
    let left = valid_until.saturating_duration_since(Instant::now());
    monotonic_ns().saturating_add(left.as_nanos().min(u64::MAX as u128) as u64)
}

impl Watchdog {
    /// Starts it, watching over the lease until `valid_until` (later deadlines come by
    /// [`deadline`](Self::deadline)).
    fn start(valid_until: Instant) -> std::io::Result<Watchdog> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        // SAFETY: a new anonymous mapping, zeroed: a valid `Shared`, as its fields are
        // atomics whose zero is a value.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                std::mem::size_of::<Shared>(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if page == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: mapped above, never unmapped, aligned (a page).
        let shared: &'static Shared = unsafe { &*page.cast::<Shared>() };
        shared
            .deadline
            .store(monotonic_at(valid_until), Ordering::Release);
        let mut fds = [0; 2];
        // SAFETY: plain syscall filling a local array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just made and are owned here alone.
        let (read_end, write_end) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // Blocked across the fork, and in the child for good: none runs our handlers (the
        // runtime's) there, and none sent to the command's group reaches the watchdog.
        // SAFETY: plain calls on signal sets of this thread, kept on the stack.
        let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
        let mut before: libc::sigset_t = unsafe { std::mem::zeroed() };
        unsafe {
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut before);
        }
        // SAFETY: between fork and _exit the child makes only async-signal-safe calls.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe {
                // A group of its own, for the command to join (we make it too, whichever
                // of us runs first). Every signal stays blocked (SIGKILL and SIGSTOP
                // cannot be; no matter).
                libc::setpgid(0, 0);
                libc::close(write_end.as_raw_fd());
                // Our own group, by its id: never the group we were forked in, should
                // setpgid have failed.
                let group = -libc::getpid();
                loop {
                    if shared.stood_down.load(Ordering::Acquire) {
                        break;
                    }
                    let deadline = shared.deadline.load(Ordering::Acquire);
                    let now = monotonic_ns();
                    if now >= deadline {
                        // Stuck past the lease: the command must not run on unlocked.
                        libc::kill(group, libc::SIGKILL);
                        break;
                    }
                    let wait_ms = ((deadline - now) / 1_000_000 + 1).min(i32::MAX as u64) as i32;
                    let mut poll = libc::pollfd {
                        fd: read_end.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // Nothing is ever written: the pipe is readable at its end only.
                    let mut byte = 0u8;
                    if libc::poll(&mut poll, 1, wait_ms) > 0
                        && libc::read(read_end.as_raw_fd(), (&raw mut byte).cast(), 1) == 0
                    {
                        if !shared.stood_down.load(Ordering::Acquire) {
                            // We are gone without standing it down.
                            libc::kill(group, libc::SIGKILL);
                        }
                        break;
                    }
                }
                libc::_exit(0)
            }
        }
        // SAFETY: restores this thread's own mask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut()) };
        if pid == -1 {
            return Err(std::io::Error::last_os_error());
        }
        // Its group exists before the command joins it, whichever of us runs first.
        // SAFETY: plain syscalls on our own child.
        if unsafe { libc::setpgid(pid, pid) } != 0 {
            let e = std::io::Error::last_os_error();
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            return Err(e);
        }
        Ok(Watchdog {
            pid,
            pipe: write_end.into(),
            shared,
        })
    }

    /// The lease is provably ours until `valid_until` (a renewal confirmed it).
    fn deadline(&self, valid_until: Instant) {
        (self.shared.deadline).store(monotonic_at(valid_until), Ordering::Release);
    }

    /// We are still here: the watchdog leaves the command's group alone. It exits when
    /// the pipe returned is dropped (or at its deadline): keep it until the work left is
    /// done, as waking the watchdog costs a CPU.
    fn stand_down(self) -> std::fs::File {
        self.shared.stood_down.store(true, Ordering::Release);
        // Reaped if it has exited already (killed with the group); else, once we are
        // gone, by init. Never waited for: a stopped watchdog must not hold us.
        // SAFETY: plain syscall on our own child.
        unsafe { libc::waitpid(self.pid, std::ptr::null_mut(), libc::WNOHANG) };
        self.pipe
    }
}

/// Starts the command: in the watchdog's process group (`group`), else in a group of its
/// own. Only what posix_spawn cannot do needs code of ours between fork and exec, and
/// only then is the command forked: handing it the terminal, or, without a watchdog,
/// having the kernel kill it if we die.
fn spawn(
    args: &RunArgs,
    store: Option<&str>,
    guard: &LockGuard,
    foreground: bool,
    group: Option<libc::pid_t>,
) -> Result<tokio::process::Child, Failure> {
    let mut cmd = tokio::process::Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env("LEASEHOLD_NAME", &args.lock.name)
        .env("LEASEHOLD_TOKEN", guard.token().to_string())
        .env("LEASEHOLD_OWNER", guard.owner())
        .env(
            crate::HELD_VAR,
            crate::held_with(&args.lock.name, guard.owner()),
        );
    if let Some(store) = store {
        cmd.env("LEASEHOLD_STORE", store);
    }
    cmd.process_group(group.unwrap_or(0));
    if foreground || group.is_none() {
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                // Die with us: a killed `leasehold` must not leave its command running
                // unlocked.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if foreground {
                    libc::tcsetpgrp(0, libc::getpgrp());
                    libc::signal(libc::SIGTTOU, libc::SIG_DFL);
                }
                Ok(())
            });
        }
    }
    cmd.spawn().map_err(|e| {
        let what = args.command[0].to_string_lossy();
        match e.kind() {
            std::io::ErrorKind::NotFound if on_disk(&args.command[0]) => Failure::new(
                exit::CANNOT_EXECUTE,
                format!("cannot run {what}: its interpreter (the #! line) or loader was not found"),
            ),
            std::io::ErrorKind::NotFound => {
                Failure::new(exit::NOT_FOUND, format!("command not found: {what}"))
            }
            _ => Failure::new(exit::CANNOT_EXECUTE, format!("cannot run {what}: {e}")),
        }
    })
}

/// Whether `command` names a file, as a path or found on `PATH`: when exec says "not
/// found" for a file that is there, what is missing is its interpreter.
fn on_disk(command: &OsString) -> bool {
    let path = std::path::Path::new(command);
    if command.as_encoded_bytes().contains(&b'/') {
        return path.is_file();
    }
    std::env::var_os("PATH")
        .is_some_and(|dirs| std::env::split_paths(&dirs).any(|dir| dir.join(path).is_file()))
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
    if kill_in.is_zero() {
        "SIGTERM, then SIGKILL at once: the safe deadline has passed, so there is no grace"
            .to_string()
    } else if at_deadline {
        format!(
            "SIGTERM, then SIGKILL in {} at the safe deadline, before --grace {} is over",
            humanize(kill_in),
            humanize(grace)
        )
    } else {
        format!("SIGTERM, then SIGKILL after --grace {}", humanize(grace))
    }
}

fn exit_code(status: ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(code as u8),
        (None, Some(sig)) => ExitCode::from(128u8.wrapping_add(sig as u8)),
        _ => ExitCode::from(exit::INTERNAL),
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
    let locks = connect(store, subcommand, lock).await?;
    let outcome = command(locks.clone()).await;
    if !locks.shutdown(SHUTDOWN_PATIENCE).await {
        tracing::warn!(
            "exiting before every release reached the store; those locks end with their leases"
        );
    }
    outcome
}

/// `leasehold run NAME -- COMMAND...`.
pub async fn run(store: Option<&str>, args: RunArgs) -> Result<ExitCode, Failure> {
    let lock = args.lock.clone();
    with_locks(store, "run", &lock, |locks| run_with(locks, store, args)).await
}

async fn run_with(
    locks: Leasehold,
    store: Option<&str>,
    args: RunArgs,
) -> Result<ExitCode, Failure> {
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
            eprintln!("leasehold: warning: cannot start the watchdog ({e}); if leasehold is killed, what the command started may outlive the lock");
        })
        .ok();
    let group = watchdog.as_ref().map(|w| w.pid);
    let mut child = match spawn(&args, store, &guard, foreground, group) {
        Ok(child) => child,
        Err(failure) => {
            drop(watchdog.map(Watchdog::stand_down));
            let _ = guard.release().await;
            return Err(failure);
        }
    };
    let pgid = group.or(child.id().map(|id| id as i32)).unwrap_or(0);
    let mut deadlines = guard.deadlines();
    let mut renewing = true;
    // Stop the command a little before the safe deadline if renewals keep failing, so it
    // is gone before anyone else can hold the lock. Only failing renewals count: a lock
    // handed over on a short lease is renewed to the full TTL at once.
    let warning = args.grace.min(args.lock.ttl / 3);
    let ended = loop {
        let [int, term, hup] = &mut signals;
        tokio::select! {
            status = child.wait() => match status {
                Ok(status) => break Ended::Exited(status),
                Err(e) => return Err(Failure::new(exit::INTERNAL, format!("cannot wait for the command: {e}"))),
            },
            _ = int.recv() => kill_group(pgid, libc::SIGINT),
            _ = term.recv() => kill_group(pgid, libc::SIGTERM),
            _ = hup.recv() => kill_group(pgid, libc::SIGHUP),
            valid_until = deadlines.next(), if renewing => match (valid_until, &mut watchdog) {
                (Some(valid_until), Some(watchdog)) => watchdog.deadline(valid_until),
                (Some(_), None) => {}
                (None, _) => renewing = false,
            },
            // Lost (the store said so, or the safe deadline passed), or about to be.
            _ = async { tokio::select! { _ = guard.lost() => {}, _ = guard.at_risk(warning) => {} } } => {
                let now = Instant::now();
                let valid_until = guard.valid_until();
                let why = match guard.check() {
                    Err(lost) => lost.to_string(),
                    Ok(_) => format!(
                        "lock \"{}\" is about to be lost: it could not be renewed and ends in {}",
                        args.lock.name,
                        humanize(valid_until.saturating_duration_since(now))
                    ),
                };
                // Past the safe deadline someone else may hold the lock: no grace then.
                let after_grace = now + args.grace;
                let kill_at = after_grace.min(valid_until.max(now));
                break Ended::Lost { kill_at, at_deadline: kill_at < after_grace, why };
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
        Ended::Lost {
            kill_at,
            at_deadline,
            why,
        } => {
            eprintln!(
                "leasehold: {why}; stopping the command ({})",
                stop_plan(
                    kill_at.saturating_duration_since(Instant::now()),
                    at_deadline,
                    args.grace
                )
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
    // The command is reaped (and its group killed if the lock was lost): from here on a
    // killed leasehold must not touch the group, whose id may even be reused. The
    // watchdog, idle, exits when the release is done.
    let _watchdog_pipe = watchdog.map(Watchdog::stand_down);
    if foreground {
        take_terminal_back();
    }
    // If the store is away, do not wait on it: the lease ends the lock anyway.
    let released = match tokio::time::timeout(RELEASE_PATIENCE, guard.release()).await {
        Ok(released) => released.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {}", humanize(RELEASE_PATIENCE))),
    };
    if let Err(e) = released {
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
            let _ = guard.release().await;
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
    }
}
