//! `torture --spawn`: the store processes a run starts itself, so the nemesis can pause,
//! kill and restart them. They come from the test kit, which only a build with the
//! `spawn` feature carries; the default `leasehold` has none and says how to get it.

use super::Spawn;
use crate::exit::{self, Failure};

type Job = Box<dyn FnOnce(&mut Spawned) + Send>;

/// The thread that starts, pauses, restarts and finally stops a `--spawn` store. One
/// thread for the whole run: the testkit's processes die with the *thread* that started
/// them (`PR_SET_PDEATHSIG`), and a blocking-pool thread ends when it idles.
#[derive(Debug)]
pub struct Keeper {
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub url: String,
    pub label: &'static str,
}

impl Keeper {
    pub fn start(kind: Spawn) -> Result<Self, Failure> {
        let (jobs, inbox) = std::sync::mpsc::channel::<Job>();
        let (started_tx, started) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let mut spawned = match Spawned::start(kind) {
                Ok(spawned) => spawned,
                Err(failure) => return drop(started_tx.send(Err(failure))),
            };
            let _ = started_tx.send(Ok((spawned.url(), kind.label())));
            // Until the run drops its sender; then the store is stopped with `spawned`.
            for job in inbox {
                job(&mut spawned);
            }
        });
        let (url, label) = started
            .recv()
            .map_err(|_| Failure::new(exit::INTERNAL, "the store thread ended"))??;
        Ok(Keeper {
            jobs: Some(jobs),
            thread: Some(thread),
            url,
            label,
        })
    }

    /// Runs `job` on the store's thread; `None` if that thread is gone.
    pub fn send(&self, job: impl FnOnce(&mut Spawned) + Send + 'static) -> Option<()> {
        self.jobs.as_ref()?.send(Box::new(job)).ok()
    }
}

impl Drop for Keeper {
    /// Stops the store before the run goes on (or the process exits).
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(feature = "spawn")]
pub use with_test_kit::Spawned;

#[cfg(feature = "spawn")]
mod with_test_kit {
    use leasehold_testkit::{EtcdCluster, EtcdServer, RedisServer};

    use super::super::Spawn;
    use crate::exit::{self, Failure};

    /// The store processes of a `--spawn` run.
    #[derive(Debug)]
    pub enum Spawned {
        Redis(RedisServer),
        Etcd(EtcdServer),
        Cluster(EtcdCluster),
    }

    impl Spawned {
        pub fn start(kind: Spawn) -> Result<Self, Failure> {
            let (program, package) = match kind {
                Spawn::Redis | Spawn::RedisVolatile => ("redis-server", "redis-server"),
                Spawn::Etcd | Spawn::EtcdCluster => ("etcd", "etcd-server"),
            };
            if !on_path(program) {
                return Err(Failure::new(
                    exit::UNAVAILABLE,
                    format!("--spawn needs {program}: apt-get install {package}"),
                ));
            }
            // The testkit reports a server that does not come up by panicking.
            std::panic::catch_unwind(|| match kind {
                Spawn::Redis => Spawned::Redis(RedisServer::start_persistent()),
                Spawn::RedisVolatile => Spawned::Redis(RedisServer::start()),
                Spawn::Etcd => Spawned::Etcd(EtcdServer::start()),
                Spawn::EtcdCluster => Spawned::Cluster(EtcdCluster::start()),
            })
            .map_err(|_| Failure::new(exit::UNAVAILABLE, format!("{program} did not start")))
        }

        pub fn url(&self) -> String {
            match self {
                Spawned::Redis(s) => s.url(),
                Spawned::Etcd(s) => s.url(),
                Spawned::Cluster(c) => c.url(),
            }
        }

        /// Stops (SIGSTOP, waiting until stopped, as the testkit's `pause` does) or
        /// resumes every server process.
        pub fn pause(&mut self, stop: bool) {
            let pids = match self {
                Spawned::Redis(s) => vec![s.pid()],
                Spawned::Etcd(s) => vec![s.pid()],
                Spawned::Cluster(c) => c.members.iter().map(EtcdServer::pid).collect(),
            };
            for pid in pids {
                match stop {
                    true => leasehold_testkit::stop_process(pid),
                    false => leasehold_testkit::send_signal(pid, libc::SIGCONT),
                }
            }
        }

        /// Kills the one server and starts it again on its port and data (not a cluster).
        pub fn restart(&mut self) {
            match self {
                Spawned::Redis(r) => r.restart(),
                Spawned::Etcd(e) => e.restart(),
                Spawned::Cluster(_) => {}
            }
        }

        /// Kills the cluster's leader, or a member that does not lead; which one, or
        /// `None` when this is no cluster or no leader was found (each look waits a
        /// second at most).
        pub fn kill_member(&mut self, leader: bool) -> Option<usize> {
            let Spawned::Cluster(c) = self else {
                return None;
            };
            let lead = (0..10).find_map(|_| c.leader())?;
            let i = match leader {
                true => lead,
                false => (lead + 1 + rand::random::<usize>() % 2) % 3,
            };
            c.members[i].kill();
            Some(i)
        }

        pub fn restart_member(&mut self, i: usize) {
            if let Spawned::Cluster(c) = self {
                c.members[i].restart();
            }
        }
    }

    fn on_path(program: &str) -> bool {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path).any(|dir| dir.join(program).is_file())
    }
}

/// Without the test kit there is nothing to spawn: `start` says how to get a build
/// that can, and the rest cannot be reached.
#[cfg(not(feature = "spawn"))]
#[derive(Debug)]
pub enum Spawned {}

#[cfg(not(feature = "spawn"))]
impl Spawned {
    pub fn start(_: Spawn) -> Result<Self, Failure> {
        Err(Failure::new(
            exit::USAGE,
            "this leasehold was built without --spawn (it starts redis-server and etcd with the project's test kit): build it with `cargo install --path crates/leasehold-cli --features spawn`, or point torture at a store with --store",
        ))
    }

    pub fn url(&self) -> String {
        match *self {}
    }

    pub fn pause(&mut self, _: bool) {
        match *self {}
    }

    pub fn restart(&mut self) {
        match *self {}
    }

    pub fn kill_member(&mut self, _: bool) -> Option<usize> {
        match *self {}
    }

    pub fn restart_member(&mut self, _: usize) {
        match *self {}
    }
}
