//! The command's process: started in a process group of its own (led by the watchdog),
//! handed the terminal, signalled as a group, and killed by the watchdog if `leasehold`
//! dies or stalls past the lease.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::process::{ExitCode, ExitStatus};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::time::Instant;

use crate::exit::{self, Failure};

pub(crate) fn kill_group(pgid: i32, signal: i32) {
    // SAFETY: plain syscall; a negative pid addresses the process group.
    unsafe { libc::kill(-pgid, signal) };
}

/// Whether we own the terminal's foreground: then the command gets it while it runs, so
/// interactive commands work although they run in their own process group.
pub(crate) fn terminal_foreground() -> bool {
    // SAFETY: plain queries on fd 0.
    std::io::stdin().is_terminal() && unsafe { libc::tcgetpgrp(0) == libc::getpgrp() }
}

/// Passes `signal` (one that asks the command to end) to the command's group, then
/// SIGCONT: a command stopped meanwhile (Ctrl-Z, or a SIGTSTP sent to it) would keep the
/// signal pending while we wait for it to end. Sent every time, as whether it is
/// stopped can change between a look and the signal; a running command ignores it.
pub(crate) fn forward(pgid: i32, signal: i32) {
    kill_group(pgid, signal);
    kill_group(pgid, libc::SIGCONT);
}

/// The signal that stopped process `pid`, for each stop not yet asked for. Its end is
/// left to the runtime's reaper (no `WEXITED`).
pub(crate) fn next_stop(pid: u32) -> Option<i32> {
    // SAFETY: a zeroed siginfo_t is valid, and waitid only writes it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let options = libc::WSTOPPED | libc::WNOHANG;
    // SAFETY: plain syscall on our own child, with a valid out-pointer.
    let rc = unsafe { libc::waitid(libc::P_PID, pid, &mut info, options) };
    // SAFETY: read after waitid filled it (si_pid 0: nothing to report).
    if rc != 0 || unsafe { info.si_pid() } == 0 {
        return None;
    }
    // SAFETY: as above; a stop's si_status is its signal.
    Some(unsafe { info.si_status() })
}

/// The command was stopped from the terminal (Ctrl-Z, or reading it from the
/// background): we stop too, with the terminal taken back, so the shell sees its job
/// stopped and shows its prompt; continued (`fg`, `bg`), we continue the command, handing
/// it the terminal if the shell gave it to us. Meanwhile nothing renews the lease: the
/// watchdog kills the command at the safe deadline, and `run` then exits 76.
pub(crate) fn stop_with_the_command(pgid: i32, signal: i32) {
    take_terminal_back();
    // The command's signal, so the shell says what it would of the command: stopped by
    // SIGTSTP (exit status 148). Its default action stops this whole process (we handle
    // none of these), until a SIGCONT.
    // SAFETY: plain call.
    unsafe { libc::raise(signal) };
    if terminal_foreground() {
        // SAFETY: as in `take_terminal_back`.
        unsafe { libc::tcsetpgrp(0, pgid) };
    }
    kill_group(pgid, libc::SIGCONT);
}

pub(crate) fn take_terminal_back() {
    // SAFETY: SIGTTOU stays ignored (set before spawning), so tcsetpgrp from what is now
    // a background group does not stop us.
    unsafe { libc::tcsetpgrp(0, libc::getpgrp()) };
}

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
pub(crate) struct Watchdog {
    /// Also the command's process group.
    pub(crate) pid: libc::pid_t,
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

/// The watchdog's life, in the forked child: kills the command's group (its own) when
/// we are gone without standing it down, or stuck past the safe deadline.
///
/// # Safety
/// Only in the child between fork and exit: it makes async-signal-safe calls only.
unsafe fn watch(shared: &Shared, read_fd: std::os::fd::RawFd, write_fd: std::os::fd::RawFd) -> ! {
    unsafe {
        // A group of its own, for the command to join (we make it too, whichever
        // of us runs first). Every signal stays blocked (SIGKILL and SIGSTOP
        // cannot be; no matter).
        libc::setpgid(0, 0);
        libc::close(write_fd);
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
                fd: read_fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // Nothing is ever written: the pipe is readable at its end only.
            let mut byte = 0u8;
            if libc::poll(&mut poll, 1, wait_ms) > 0
                && libc::read(read_fd, (&raw mut byte).cast(), 1) == 0
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

/// CLOCK_MONOTONIC in nanoseconds: the clock the watchdog and we share.
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; async-signal-safe (the watchdog calls it).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `valid_until` on CLOCK_MONOTONIC, in nanoseconds.
pub(crate) fn monotonic_at(valid_until: Instant) -> u64 {
    let left = valid_until.saturating_duration_since(Instant::now());
    monotonic_ns().saturating_add(left.as_nanos().min(u64::MAX as u128) as u64)
}

impl Watchdog {
    /// Starts it, watching over the lease until `valid_until` (later deadlines come by
    /// [`deadline`](Self::deadline)).
    pub(crate) fn start(valid_until: Instant) -> std::io::Result<Watchdog> {
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
            // SAFETY: in the forked child; `watch` makes only async-signal-safe calls.
            unsafe { watch(shared, read_end.as_raw_fd(), write_end.as_raw_fd()) }
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
    pub(crate) fn deadline(&self, valid_until: Instant) {
        (self.shared.deadline).store(monotonic_at(valid_until), Ordering::Release);
    }

    /// We are still here: the watchdog leaves the command's group alone. It exits when
    /// the pipe returned is dropped (or at its deadline): keep it until the work left is
    /// done, as waking the watchdog costs a CPU.
    pub(crate) fn stand_down(self) -> std::fs::File {
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
pub(crate) fn spawn(
    command: &[OsString],
    env: &[(&str, String)],
    foreground: bool,
    group: Option<libc::pid_t>,
) -> Result<tokio::process::Child, Failure> {
    let mut cmd = tokio::process::Command::new(&command[0]);
    cmd.args(&command[1..])
        .envs(env.iter().map(|(k, v)| (k, v)));
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
    cmd.spawn().map_err(|e| spawn_failure(&command[0], e))
}

/// Why `program` could not be started, with the exit code a shell would give (127 not
/// found, 126 cannot execute).
pub(crate) fn spawn_failure(program: &OsString, e: std::io::Error) -> Failure {
    let what = program.to_string_lossy();
    match e.kind() {
        std::io::ErrorKind::NotFound if on_disk(program) => Failure::new(
            exit::CANNOT_EXECUTE,
            format!("cannot run {what}: its interpreter (the #! line) or loader was not found"),
        ),
        std::io::ErrorKind::NotFound => {
            Failure::new(exit::NOT_FOUND, format!("command not found: {what}"))
        }
        _ => Failure::new(exit::CANNOT_EXECUTE, format!("cannot run {what}: {e}")),
    }
}

/// Refuses a command that exec would refuse, before a lock, a limiter's units or a
/// fencing token are taken for it (a mistyped name must not hold others up or spend the
/// budget): 127 if nothing by that name is there, 126 if it names a directory or a file
/// that may not be executed (a shell's codes).
pub(crate) fn must_exist(command: &[OsString]) -> Result<(), Failure> {
    let Some(program) = command.first() else {
        return Ok(());
    };
    let what = program.to_string_lossy();
    if program.is_empty() {
        return Err(Failure::new(
            exit::NOT_FOUND,
            "command not found: \"\" (an empty name)",
        ));
    }
    // As execvp: the first that may be executed runs; else the first found says why not.
    let mut found = None;
    for candidate in candidates(program).into_iter().filter(|c| c.exists()) {
        if candidate.is_file() && executable(&candidate) {
            return Ok(());
        }
        found.get_or_insert(candidate);
    }
    match found {
        None => Err(Failure::new(
            exit::NOT_FOUND,
            format!("command not found: {what}"),
        )),
        Some(dir) if dir.is_dir() => Err(Failure::new(
            exit::CANNOT_EXECUTE,
            format!("cannot run {what}: {} is a directory", dir.display()),
        )),
        Some(file) => Err(Failure::new(
            exit::CANNOT_EXECUTE,
            format!(
                "cannot run {what}: {} may not be executed (permission denied)",
                file.display()
            ),
        )),
    }
}

/// Whether this process may execute `path` (`access(2)` with `X_OK`).
fn executable(path: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated string for the call's duration.
    unsafe { libc::access(c.as_ptr(), libc::X_OK) == 0 }
}

/// Whether `command` names a file, as a path or found on `PATH`: when exec says "not
/// found" for a file that is there, what is missing is its interpreter.
pub(crate) fn on_disk(command: &OsString) -> bool {
    candidates(command).iter().any(|c| c.is_file())
}

/// Where exec looks for `command`: the path itself if it has a `/`, else each `PATH`
/// directory in turn.
fn candidates(command: &OsString) -> Vec<std::path::PathBuf> {
    let path = std::path::Path::new(command);
    if command.as_encoded_bytes().contains(&b'/') {
        return vec![path.to_path_buf()];
    }
    std::env::var_os("PATH")
        .map(|dirs| std::env::split_paths(&dirs).map(|d| d.join(path)).collect())
        .unwrap_or_default()
}

pub(crate) fn exit_code(status: ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(code as u8),
        (None, Some(sig)) => ExitCode::from(128u8.wrapping_add(sig as u8)),
        _ => ExitCode::from(exit::INTERNAL),
    }
}
