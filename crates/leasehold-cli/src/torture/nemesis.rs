//! The nemesis: the faults, applied in turn to the holder, the store or the link.

use std::time::Duration;

use rand::Rng;
use tokio::time::{sleep, Instant};

use super::history::Event;
use super::plan::FaultKind;
use super::resource::Phase;
use super::spawn::Spawned;
use super::Run;

/// Signals a worker; one that has just exited is no error (the testkit's `send_signal`
/// panics on that, as a test should).
pub(super) fn signal(pid: i32, signal: i32) {
    if pid > 0 {
        // SAFETY: kill has no memory effects; a gone process gives ESRCH.
        unsafe { libc::kill(pid, signal) };
    }
}

impl Run {
    /// Applies the faults in turn until `until`, with a quiet time between them.
    pub(super) async fn nemesis(&self, until: Instant) {
        let mut next = 0;
        loop {
            sleep(self.ttl(self.random(|r| r.gen_range(1.0..2.0)))).await;
            if Instant::now() >= until || self.args.faults.is_empty() {
                if self.args.faults.is_empty() {
                    tokio::time::sleep_until(until).await;
                }
                return;
            }
            let fault = self.args.faults[next % self.args.faults.len()];
            // A fault that found nothing to hit (no holder, no leader) is tried again next.
            if self.apply(fault).await {
                next += 1;
            }
        }
    }

    /// Applies `fault`; false if it found nothing to hit.
    async fn apply(&self, fault: FaultKind) -> bool {
        let kind = fault.name();
        match fault {
            FaultKind::Pause | FaultKind::ShortPause | FaultKind::StallRun => {
                self.pause(fault, &kind).await
            }
            FaultKind::Kill => self.kill(&kind).await,
            FaultKind::KillMember | FaultKind::KillLeader => {
                self.kill_member(fault == FaultKind::KillLeader, &kind)
                    .await
            }
            FaultKind::PauseStore | FaultKind::RestartStore => {
                self.store_fault(fault, &kind).await;
                true
            }
            FaultKind::Delay | FaultKind::Drop | FaultKind::Reset => {
                self.link_fault(fault, &kind).await;
                true
            }
        }
    }

    /// Pauses the holder (pause, short-pause, stall-run); false if there is none.
    async fn pause(&self, fault: FaultKind, kind: &str) -> bool {
        let factor = match fault {
            FaultKind::ShortPause => 0.3,
            _ => self.random(|r| r.gen_range(1.5..2.0)),
        };
        let Some((owner, pid)) = self.holder().await else {
            return false;
        };
        // A `run` worker's command is in a process group of its own: both stop,
        // as on a paused machine; or `leasehold` alone stalls.
        let command =
            (self.resource.pid_inside(&owner)).filter(|&p| p > 0 && fault != FaultKind::StallRun);
        signal(pid, libc::SIGSTOP);
        if let Some(command) = command {
            signal(-command, libc::SIGSTOP);
        }
        self.fault_start(kind, Some(&owner));
        sleep(self.ttl(factor)).await;
        signal(pid, libc::SIGCONT);
        if let Some(command) = command {
            signal(-command, libc::SIGCONT);
        }
        self.fault_end(kind, Some(&owner));
        true
    }

    /// Kills the holder; a library worker is started again in its slot (a `run` worker's
    /// slot starts the next run by itself). False if there is no holder.
    async fn kill(&self, kind: &str) -> bool {
        let Some((owner, pid)) = self.holder().await else {
            return false;
        };
        self.fault_start(kind, Some(&owner));
        if self.via_run() {
            // Logged first: it cannot act after the signal. Its command dies with it
            // (the run's watchdog).
            self.log.record(Event::Killed {
                owner: owner.clone(),
            });
            signal(pid, libc::SIGKILL);
        } else {
            self.replace_worker(&owner).await;
        }
        self.fault_end(kind, Some(&owner));
        true
    }

    /// Kills an etcd member (the leader, or one that does not lead) and restarts it after
    /// 2 TTL; false if none could be killed.
    async fn kill_member(&self, leader: bool, kind: &str) -> bool {
        let killed = (self.with_store(move |s| s.kill_member(leader))).await;
        let Some(i) = killed.flatten() else {
            return false;
        };
        self.fault_start(kind, None);
        sleep(self.ttl(2.0)).await;
        self.with_store(move |s| s.restart_member(i)).await;
        self.fault_end(kind, None);
        true
    }

    /// Pauses or restarts the spawned store.
    async fn store_fault(&self, fault: FaultKind, kind: &str) {
        match fault {
            FaultKind::PauseStore => {
                self.with_store(|s| s.pause(true)).await;
                self.fault_start(kind, None);
                sleep(self.ttl(1.5)).await;
                self.with_store(|s| s.pause(false)).await;
                self.fault_end(kind, None);
            }
            _ => {
                self.fault_start(kind, None);
                self.with_store(Spawned::restart).await;
                self.fault_end(kind, None);
            }
        }
    }

    /// Delays, drops or resets the store traffic at the link proxies.
    async fn link_fault(&self, fault: FaultKind, kind: &str) {
        match fault {
            FaultKind::Delay => {
                let delay = self.ttl(1.5);
                self.links.iter().for_each(|l| l.set_delay(delay));
                self.fault_start(kind, None);
                sleep(self.ttl(1.0)).await;
                self.links.iter().for_each(|l| l.set_delay(Duration::ZERO));
                // The last delayed reply is delivered a delay later.
                sleep(delay).await;
                self.fault_end(kind, None);
            }
            FaultKind::Drop => {
                self.links.iter().for_each(|l| l.set_dropping(true));
                self.fault_start(kind, None);
                sleep(self.ttl(1.5)).await;
                self.links.iter().for_each(|l| {
                    l.set_dropping(false);
                    l.reset();
                });
                self.fault_end(kind, None);
            }
            _ => {
                self.fault_start(kind, None);
                self.links.iter().for_each(|l| l.reset());
                self.fault_end(kind, None);
            }
        }
    }

    fn fault_start(&self, kind: &str, target: Option<&str>) {
        self.log.record(Event::FaultStart {
            kind: kind.to_string(),
            target: target.map(String::from),
        });
    }

    fn fault_end(&self, kind: &str, target: Option<&str>) {
        self.log.record(Event::FaultEnd {
            kind: kind.to_string(),
            target: target.map(String::from),
        });
    }

    /// Runs `f` on the spawned store (see [`Keeper`](super::spawn::Keeper)); `None` without
    /// one, or if it failed.
    async fn with_store<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Spawned) -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.keeper.as_ref()?.send(move |s: &mut Spawned| {
            let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(s)));
            let _ = tx.send(done.ok());
        })?;
        rx.await.ok().flatten()
    }

    /// The worker that holds the lock and has read the counter (so a fault lands between
    /// its read and its write), waiting up to 2 TTL for one; else any holder.
    async fn holder(&self) -> Option<(String, i32)> {
        let deadline = Instant::now() + self.ttl(2.0);
        let owner = loop {
            let changed = self.resource.changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(owner) = self.resource.in_phase(Phase::Thinking).pop() {
                break owner;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                break self.resource.in_phase(Phase::Held).pop()?;
            }
        };
        let pid = self.pid_of(&owner).await?;
        Some((owner, pid))
    }
}
