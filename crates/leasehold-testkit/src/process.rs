//! Processes: whether one runs or is stopped, signals, and the store servers' own
//! processes, which die with the test process.

use crate::wait::wait_for;

/// Whether process `pid` still runs: `kill(pid, 0)` succeeds and it is not a zombie (an
/// exited process nobody reaped yet, as orphans stay where PID 1 does not reap them).
pub fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => proc_state(&stat).is_none_or(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Whether every thread of process `pid` is stopped (SIGSTOP), so it answers nothing.
pub fn pid_stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue; // a thread that just exited
        };
        if !matches!(proc_state(&stat), Some("T" | "t" | "Z" | "X") | None) {
            return false;
        }
        any = true;
    }
    any
}

/// The state letter of a `/proc/.../stat` line: it follows the parenthesised command
/// name, which may hold spaces.
fn proc_state(stat: &str) -> Option<&str> {
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
}

/// SIGSTOP to `pid`, and waits until all its threads stopped: `kill` returns before a
/// thread busy on another core stops, and that thread could still answer a request.
pub fn stop_process(pid: i32) {
    send_signal(pid, libc::SIGSTOP);
    wait_for(&format!("process {pid} to stop"), || pid_stopped(pid));
}

/// Sends `signal` to process `pid`; panics if it cannot, or if `pid` is not a process
/// (0, the pid of a stopped server, would signal the test's own process group).
pub fn send_signal(pid: i32, signal: i32) {
    assert!(pid > 0, "no process to send signal {signal} to (pid {pid})");
    // SAFETY: plain syscall.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {signal}): {}",
        std::io::Error::last_os_error()
    );
}

/// A store server's process: started so that it dies with the test process
/// (`PR_SET_PDEATHSIG`), then paused, resumed and killed by pid.
#[derive(Debug, Default)]
pub(crate) struct ServerProcess(Option<std::process::Child>);

type SpawnCall = (
    std::process::Command,
    std::sync::mpsc::Sender<std::io::Result<std::process::Child>>,
);

/// Spawns `cmd` from one thread that lives as long as the test process.
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the
/// process: a server started from a tokio blocking-pool thread (`spawn_blocking`, which
/// tests use to start etcd and Redis Cluster) was killed when that thread retired after
/// 10 s idle, in the middle of a longer test.
fn spawn_from_lasting_thread(cmd: std::process::Command) -> std::io::Result<std::process::Child> {
    use std::sync::mpsc;
    use std::sync::{Mutex, OnceLock};
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnCall>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnCall>();
        std::thread::Builder::new()
            .name("testkit-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("start the testkit's spawner thread");
        Mutex::new(tx)
    });
    let (reply, answer) = mpsc::channel();
    let sent = spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((cmd, reply));
    sent.expect("the spawner thread lives as long as the process");
    answer.recv().expect("the spawner thread answers")
}

impl ServerProcess {
    /// Starts `cmd`; `package` is the Debian package to name when the binary is missing.
    pub(crate) fn spawn(&mut self, mut cmd: std::process::Command, package: &str) {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let program = cmd.get_program().to_string_lossy().into_owned();
        self.0 = Some(match spawn_from_lasting_thread(cmd) {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "{program} is not installed: run ./scripts/test (it installs it) or apt-get install {package}"
            ),
            Err(e) => panic!("cannot start {program}: {e}"),
        });
    }

    /// Not running: never started, killed, or exited (e.g. its port was taken).
    pub(crate) fn exited(&mut self) -> bool {
        !matches!(self.0.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    pub(crate) fn pid(&self) -> i32 {
        self.0.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// SIGKILL, and reap it.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The public `pid`, `pause`, `resume` and `kill` of a server whose process is its field
/// `process: ServerProcess`; `$pause` says what a paused one does.
macro_rules! server_process_controls {
    ($pause:literal) => {
        /// Its pid (0 when stopped).
        pub fn pid(&self) -> i32 {
            self.process.pid()
        }

        #[doc = concat!("SIGSTOP: ", $pause, " (stopped on return).")]
        pub fn pause(&self) {
            $crate::stop_process(self.pid());
        }

        /// SIGCONT after [`pause`](Self::pause).
        pub fn resume(&self) {
            $crate::send_signal(self.pid(), libc::SIGCONT);
        }

        /// SIGKILL, and reap it.
        pub fn kill(&mut self) {
            self.process.kill();
        }
    };
}
pub(crate) use server_process_controls;

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::wait::wait_for;
    use crate::RedisServer;
    /// A server started from a thread that then ends keeps running (the death signal is
    /// tied to the thread that forked it, so that must be one that lasts).
    #[test]
    fn a_server_outlives_the_thread_that_started_it() {
        let (server, tid) = std::thread::spawn(|| {
            // SAFETY: plain syscall.
            (RedisServer::start(), unsafe { libc::gettid() })
        })
        .join()
        .unwrap();
        // The kernel sends the death signal while the thread exits, before its task
        // leaves /proc: once it has left, a server tied to it has been told to die.
        wait_for("the starting thread to be gone", || {
            !Path::new(&format!("/proc/self/task/{tid}")).exists()
        });
        assert!(
            server.ping(),
            "redis-server died with the thread that started it"
        );
    }
}
