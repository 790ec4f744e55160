//! The workers: a process per slot running the hidden `torture-worker` (library), or a
//! slot that starts one `leasehold run` per acquisition (run); and their ending.

use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio::time::{sleep, Instant};

use super::check::Primitive;
use super::history::{Event, Role};
use super::nemesis::signal;
use super::{command, worker, Run};
use crate::exit::{self, Failure};

/// One worker slot: its current process (library workers).
#[derive(Debug)]
pub(super) struct Worker {
    owner: String,
    incarnation: u32,
    child: Child,
}

/// A seed for one process of the run, from the run's.
fn child_seed(seed: u64, slot: u32, incarnation: u32) -> u64 {
    let mix = (u64::from(slot) << 32 | u64::from(incarnation)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    seed ^ mix.rotate_left(17)
}

/// Kills the process `cmd` starts when the coordinator dies.
fn dies_with_coordinator(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

impl Run {
    /// Starts the workers: a process each (library), or a slot each that starts
    /// `leasehold run`s (run), whose tasks it returns.
    pub(super) async fn start_workers(self: &Arc<Self>) -> Result<Vec<JoinHandle<()>>, Failure> {
        let mut slots = Vec::new();
        for id in 0..self.args.workers {
            match self.via_run() {
                true => slots.push(tokio::spawn(self.clone().slot(id))),
                false => {
                    let worker = self.spawn_worker(id, 0)?;
                    self.workers.lock().await.push(worker);
                }
            }
        }
        Ok(slots)
    }

    /// Starts worker `id`'s process number `incarnation`.
    fn spawn_worker(&self, id: u32, incarnation: u32) -> Result<Worker, Failure> {
        let owner = format!("w{id}.{incarnation}");
        let exe = std::env::current_exe()
            .map_err(|e| Failure::new(exit::INTERNAL, format!("own executable: {e}")))?;
        let stderr = std::fs::File::create(self.dir.join(format!("{owner}.stderr")))
            .map_err(|e| Failure::new(exit::INTERNAL, format!("{}: {e}", self.dir.display())))?;
        let wait = self
            .ttl(4.0 * f64::from(self.args.workers))
            .max(Duration::from_secs(5));
        let mut cmd = Command::new(exe);
        cmd.arg("--store")
            .arg(&self.url)
            .arg("torture-worker")
            .args(["--lock", &self.lock, "--owner", &owner])
            .args(["--resource", &self.resource_addr])
            .arg("--ttl")
            .arg(humantime::format_duration(self.args.ttl).to_string())
            .arg("--wait")
            .arg(humantime::format_duration(wait).to_string())
            .arg("--history")
            .arg(self.dir.join(format!("{owner}.jsonl")))
            .arg("--primitive")
            .arg(self.args.primitive.to_string())
            .arg("--seed")
            .arg(child_seed(self.seed, id, incarnation).to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true);
        if self.fair {
            cmd.arg("--fair");
        }
        dies_with_coordinator(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| Failure::new(exit::INTERNAL, format!("cannot start a worker: {e}")))?;
        let pid = child.id().unwrap_or(0) as i32;
        self.log.record(Event::Spawned {
            owner: owner.clone(),
            pid,
        });
        Ok(Worker {
            owner,
            incarnation,
            child,
        })
    }

    /// The process of worker `owner`: its `leasehold run` (run workers) or itself.
    pub(super) async fn pid_of(&self, owner: &str) -> Option<i32> {
        if self.via_run() {
            let runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
            return runs.get(owner).copied();
        }
        let workers = self.workers.lock().await;
        let worker = workers.iter().find(|w| w.owner == owner)?;
        Some(worker.child.id()? as i32)
    }

    /// Kills library worker `owner` and starts the next process in its slot.
    pub(super) async fn replace_worker(&self, owner: &str) {
        let mut workers = self.workers.lock().await;
        let found = workers
            .iter_mut()
            .enumerate()
            .find(|(_, w)| w.owner == owner);
        let Some((id, w)) = found else {
            return;
        };
        // Logged first: it cannot act after the signal.
        self.log.record(Event::Killed {
            owner: owner.to_string(),
        });
        let _ = w.child.kill().await;
        self.resource.forget(owner);
        if let Ok(new) = self.spawn_worker(id as u32, w.incarnation + 1) {
            *w = new;
        }
    }

    /// One `run` worker slot: starts `leasehold run` processes one after another (each
    /// one acquisition) until the run ends, logging each one's start and exit status.
    async fn slot(self: Arc<Self>, id: u32) {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("r{id}.stderr")));
        for incarnation in 0.. {
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            let owner = format!("r{id}.{incarnation}");
            let role = self.random(|r| worker::pick_role(self.args.primitive, r));
            let seed = child_seed(self.seed, id, incarnation);
            let stderr = match stderr.as_ref().map(|f| f.try_clone()) {
                Ok(Ok(f)) => Stdio::from(f),
                _ => Stdio::null(),
            };
            let mut child = match self.spawn_run(&owner, role, seed, stderr) {
                Ok(child) => child,
                Err(e) => {
                    eprintln!("leasehold torture: cannot start leasehold run: {e}");
                    return;
                }
            };
            let pid = child.id().unwrap_or(0) as i32;
            (self.runs.lock().unwrap_or_else(|e| e.into_inner())).insert(owner.clone(), pid);
            self.log.record(Event::Spawned {
                owner: owner.clone(),
                pid,
            });
            self.log.record(Event::Invoke {
                owner: owner.clone(),
            });
            let status = child.wait().await;
            (self.runs.lock().unwrap_or_else(|e| e.into_inner())).remove(&owner);
            self.resource.forget(&owner);
            let (code, signal) = match status {
                Ok(status) => {
                    use std::os::unix::process::ExitStatusExt;
                    (status.code(), status.signal())
                }
                Err(_) => (None, None),
            };
            self.log.record(Event::RunExited {
                owner,
                code,
                signal,
            });
            // A run that could not even start (the store away): not in a busy loop.
            if code.is_some_and(|c| c != 0 && c != i32::from(command::REFUSED)) {
                sleep(self.ttl(0.1)).await;
            }
        }
    }

    /// `leasehold --store URL run NAME --ttl TTL [kind] -- leasehold torture-command ...`.
    fn spawn_run(
        &self,
        owner: &str,
        role: Role,
        seed: u64,
        stderr: Stdio,
    ) -> std::io::Result<Child> {
        let exe = std::env::current_exe()?;
        let ttl = humantime::format_duration(self.args.ttl).to_string();
        let mut cmd = Command::new(&exe);
        cmd.arg("--store")
            .arg(&self.url)
            .args(["run", &self.lock, "--ttl", &ttl])
            .arg(if self.fair { "--fair" } else { "--no-fair" });
        match (self.args.primitive, role) {
            (Primitive::Semaphore(n), _) => {
                cmd.arg("--permits").arg(n.to_string());
            }
            (_, Role::Shared) => {
                cmd.arg("--shared");
            }
            _ => {}
        }
        cmd.arg("--")
            .arg(&exe)
            .arg("torture-command")
            .args(["--resource", &self.resource_addr, "--owner", owner])
            .args(["--role", role.word(), "--ttl", &ttl])
            .arg("--seed")
            .arg(seed.to_string())
            .env_remove("LEASEHOLD_OWNER")
            .env_remove("LEASEHOLD_HELD")
            .env_remove("LEASEHOLD_NAME")
            .env_remove("LEASEHOLD_STORE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true);
        dies_with_coordinator(&mut cmd);
        cmd.spawn()
    }

    /// Asks the workers to end after their cycle; kills those still running after a grace.
    pub(super) async fn finish(&self, slots: Vec<tokio::task::JoinHandle<()>>) {
        self.resource.stop();
        self.stopping.store(true, Ordering::SeqCst);
        let grace = Instant::now() + self.ttl(3.0) + Duration::from_secs(2);
        // `run` workers: each command that enters now goes out at once, so the runs that
        // wait get their turn and end; those left after the grace are stopped.
        for slot in slots {
            let abort = slot.abort_handle();
            if tokio::time::timeout_at(grace, slot).await.is_err() {
                let left: Vec<(String, i32)> = (self.runs.lock())
                    .unwrap_or_else(|e| e.into_inner())
                    .drain()
                    .collect();
                for (owner, pid) in left {
                    self.log.record(Event::Killed { owner });
                    signal(pid, libc::SIGKILL);
                }
                abort.abort();
            }
        }
        let mut workers = self.workers.lock().await;
        for w in workers.iter_mut() {
            if tokio::time::timeout_at(grace, w.child.wait())
                .await
                .is_err()
            {
                self.log.record(Event::Killed {
                    owner: w.owner.clone(),
                });
                let _ = w.child.kill().await;
            }
        }
    }
}
