//! Test support for leasehold: temporary directories and deadlines now; real store
//! processes (redis-server, etcd) on free loopback ports as those stores arrive.

use std::path::{Path, PathBuf};

/// A temporary directory removed on drop (unless leaked for a store that outlives it).
#[derive(Debug)]
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    /// A fresh directory whose name starts with `leasehold-{label}-`.
    pub fn new(label: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("leasehold-{label}-"))
            .tempdir()
            .expect("create a temporary directory");
        TempDir(dir)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// Keeps the directory (for a store that lives until the test process ends).
    pub fn leak(self) -> PathBuf {
        self.0.keep()
    }
}

/// How long a test waits for a condition before it fails: generous, so a loaded machine
/// (parallel tests on two cores) does not fail a correct test.
pub const PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// How often [`wait_until`] looks again.
pub const POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// Looks at `check` every [`POLL`] until it gives a value, and returns it; panics naming
/// `what` after `patience`. For conditions, never for a fixed delay.
pub fn wait_until<T>(
    what: &str,
    patience: std::time::Duration,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    let deadline = std::time::Instant::now() + patience;
    loop {
        if let Some(value) = check() {
            return value;
        }
        if std::time::Instant::now() >= deadline {
            panic!("gave up after {patience:?} waiting for {what}");
        }
        std::thread::sleep(POLL);
    }
}

/// [`wait_until`] for a yes/no condition, with [`PATIENCE`].
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    wait_until(what, PATIENCE, || cond().then_some(()))
}

/// Whether process `pid` still runs: `kill(pid, 0)` succeeds and it is not a zombie (an
/// exited process nobody reaped yet, as orphans stay where PID 1 does not reap them).
pub fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name, which may hold spaces.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Sends `signal` to process `pid`; panics if it cannot.
pub fn send_signal(pid: i32, signal: i32) {
    // SAFETY: plain syscall.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {signal}): {}",
        std::io::Error::last_os_error()
    );
}
