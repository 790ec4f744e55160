//! Deadlines: waiting for a condition, never for a fixed delay.

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
    check: impl FnMut() -> Option<T>,
) -> T {
    wait_until_explained(what, patience, check, String::new)
}

/// [`wait_until`], whose panic also says what `explain` tells (what the processes
/// involved printed, say): a failure on a loaded machine can then be read afterwards.
pub fn wait_until_explained<T>(
    what: &str,
    patience: std::time::Duration,
    mut check: impl FnMut() -> Option<T>,
    explain: impl FnOnce() -> String,
) -> T {
    let deadline = std::time::Instant::now() + patience;
    loop {
        if let Some(value) = check() {
            return value;
        }
        if std::time::Instant::now() >= deadline {
            panic!(
                "gave up after {patience:?} waiting for {what}\n{}",
                explain()
            );
        }
        std::thread::sleep(POLL);
    }
}

/// [`wait_until`] for a yes/no condition, with [`PATIENCE`].
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    wait_until(what, PATIENCE, || cond().then_some(()))
}
