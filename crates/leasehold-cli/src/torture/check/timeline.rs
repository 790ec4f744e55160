//! Reading the history: a hold per acquisition (or per `run` command), the faults, and
//! what is counted on the way.

use std::collections::HashMap;

use super::replay::Replay;
use super::report::{Report, Spread};
use super::setup::Setup;
use crate::torture::history::{Entry, Event, Op, Role};

/// One acquisition (or `run` command), from its grant to its end.
#[derive(Debug)]
pub(super) struct Hold {
    pub(super) owner: String,
    pub(super) role: Role,
    pub(super) token: u64,
    pub(super) invoked: u64,
    pub(super) queued: Option<u64>,
    pub(super) got: u64,
    pub(super) deadline: u64,
    pub(super) lost: Option<u64>,
    pub(super) release: Option<u64>,
    pub(super) killed: Option<u64>,
    /// A `run` command paused by the nemesis while inside.
    pub(super) paused: bool,
    /// Its release answered an error: the hold may be left in the store until the
    /// library's retry of the release gets through.
    pub(super) release_failed: bool,
}

impl Hold {
    /// A hold granted at `got`, valid until `deadline` unless it ends earlier.
    fn new(owner: &str, role: Role, token: u64, invoked: u64, got: u64, deadline: u64) -> Self {
        Hold {
            owner: owner.to_string(),
            role,
            token,
            invoked,
            queued: None,
            got,
            deadline,
            lost: None,
            release: None,
            killed: None,
            paused: false,
            release_failed: false,
        }
    }

    /// A killed process cannot act, and the store may free its lock on seeing it dead.
    pub(super) fn valid_end(&self) -> u64 {
        [self.release, self.killed]
            .into_iter()
            .flatten()
            .fold(self.deadline, u64::min)
    }

    pub(super) fn belief_end(&self, history_end: u64) -> u64 {
        [self.lost, self.release, self.killed]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(history_end)
    }
}

/// A fault the nemesis started, and when it ended (the history's end if it did not).
#[derive(Debug)]
pub(super) struct Fault {
    pub(super) kind: String,
    pub(super) target: Option<String>,
    pub(super) start: u64,
    pub(super) end: u64,
}

impl Fault {
    pub(super) fn overlaps(&self, from: u64, to: u64) -> bool {
        self.start <= to && self.end >= from
    }
}

/// The history read: its holds and faults, and the counts taken while reading.
#[derive(Debug)]
pub(super) struct Timeline<'a> {
    /// Filled in while reading; the judging steps add the rest.
    pub(super) report: Report,
    pub(super) holds: Vec<Hold>,
    /// With the store stalls a paused worker caused where workers lock the store.
    pub(super) faults: Vec<Fault>,
    /// Owner → when its last acquire was invoked.
    pub(super) invoked: HashMap<&'a str, u64>,
    /// `run` worker → when it exited, and its exit code.
    pub(super) exits: HashMap<&'a str, (u64, Option<i32>)>,
    /// When the last entry was logged.
    pub(super) history_end: u64,
}

impl<'a> Timeline<'a> {
    /// Reads `history` (entries in time order).
    pub(super) fn read(history: &'a [Entry], setup: &Setup) -> Self {
        let mut reader = Reader {
            setup: *setup,
            history_end: history.last().map_or(0, |e| e.t),
            report: Report::default(),
            holds: Vec::new(),
            current: HashMap::new(),
            invoked: HashMap::new(),
            queued: HashMap::new(),
            acquire_ns: Vec::new(),
            faults: Vec::new(),
            replay: Replay::default(),
            exits: HashMap::new(),
        };
        for entry in history {
            reader.event(entry.t, &entry.event);
        }
        reader.finish()
    }
}

/// A [`Timeline`] being read, entry by entry.
struct Reader<'a> {
    setup: Setup,
    history_end: u64,
    report: Report,
    holds: Vec<Hold>,
    /// Owner → its hold not yet released (an index in `holds`).
    current: HashMap<&'a str, usize>,
    invoked: HashMap<&'a str, u64>,
    /// Owner → when the store first said it queued its acquire.
    queued: HashMap<&'a str, u64>,
    acquire_ns: Vec<u64>,
    faults: Vec<Fault>,
    replay: Replay,
    exits: HashMap<&'a str, (u64, Option<i32>)>,
}

impl<'a> Reader<'a> {
    fn event(&mut self, t: u64, event: &'a Event) {
        match event {
            // The election's own events: see `election.rs`.
            Event::Spawned { .. }
            | Event::Campaign { .. }
            | Event::Observed { .. }
            | Event::ObserveFailed { .. } => {}
            Event::Invoke { owner } => {
                self.invoked.insert(owner, t);
                self.queued.remove(owner.as_str());
            }
            Event::Queued { owner } => {
                self.queued.entry(owner).or_insert(t);
            }
            Event::Acquired {
                owner,
                token,
                deadline,
                role,
            } => self.acquired(t, owner, *token, *deadline, *role),
            Event::AcquireFailed { unknown, .. } => match unknown {
                true => self.report.acquire_unknown += 1,
                false => self.report.acquire_failed += 1,
            },
            Event::Reentered {
                owner,
                token,
                outer,
            } => self.reentered(t, owner, *token, *outer),
            Event::Renewed {
                owner, deadline, ..
            } => self.renewed(owner, *deadline),
            Event::Lost { owner, .. } => self.lost(t, owner),
            Event::Check { ok, deadline, .. } => {
                if *ok && t > *deadline {
                    self.report.believed_past_deadline += 1;
                }
            }
            Event::Release {
                owner, deadline, ..
            } => self.release(t, owner, *deadline),
            Event::Released { owner, outcome, .. } => {
                if let Some(i) = self.current.remove(owner.as_str()) {
                    self.holds[i].release_failed = outcome.starts_with("error");
                }
            }
            Event::Access {
                owner,
                token,
                op,
                value,
                base,
                accepted,
                role,
            } => {
                if self.setup.via_run {
                    self.command_access(t, owner, *token, *role, *op);
                }
                match accepted {
                    true => (self.replay).access(
                        &mut self.report,
                        &self.setup,
                        owner,
                        *token,
                        *op,
                        *value,
                        *base,
                    ),
                    false => self.report.stale_rejected += 1,
                }
            }
            Event::Killed { owner } => self.killed(t, owner),
            Event::RunExited {
                owner,
                code,
                signal,
            } => self.run_exited(t, owner, *code, *signal),
            Event::FaultStart { kind, target } => self.fault_started(t, kind, target),
            Event::FaultEnd { kind, target } => self.fault_ended(t, kind, target),
        }
    }

    /// `owner`'s hold not yet released.
    fn hold(&mut self, owner: &str) -> Option<&mut Hold> {
        let &i = self.current.get(owner)?;
        Some(&mut self.holds[i])
    }

    fn acquired(&mut self, t: u64, owner: &'a str, token: u64, deadline: u64, role: Role) {
        self.report.acquisitions += 1;
        let invoked = self.invoked.get(owner).copied().unwrap_or(t);
        self.acquire_ns.push(t - invoked);
        if deadline < t {
            self.report.granted_late += 1;
        }
        self.current.insert(owner, self.holds.len());
        self.holds.push(Hold {
            queued: self.queued.remove(owner),
            ..Hold::new(owner, role, token, invoked, t, deadline)
        });
    }

    fn renewed(&mut self, owner: &str, deadline: u64) {
        if let Some(h) = self.hold(owner) {
            h.deadline = h.deadline.max(deadline);
        }
    }

    fn lost(&mut self, t: u64, owner: &str) {
        if let Some(h) = self.hold(owner) {
            h.lost.get_or_insert(t);
        }
    }

    fn release(&mut self, t: u64, owner: &str, deadline: u64) {
        if let Some(h) = self.hold(owner) {
            h.release = Some(t);
            h.deadline = h.deadline.max(deadline);
        }
    }

    fn killed(&mut self, t: u64, owner: &str) {
        if let Some(h) = self.hold(owner) {
            h.killed = Some(t);
        }
        self.replay.gone(owner);
    }

    fn reentered(&mut self, t: u64, owner: &str, token: u64, outer: u64) {
        self.report.reentries += 1;
        // Once the outer hold is gone (lost, or past its safe deadline), the inner
        // acquisition is a new hold and rightly gets a new token.
        let outer_held = (self.current.get(owner))
            .is_some_and(|&i| self.holds[i].lost.is_none() && t <= self.holds[i].deadline);
        if token != outer && outer_held {
            self.report.reentry_token_changed += 1;
        }
    }

    /// A `run` command's access: the first opens its hold (token, role), each one moves
    /// its end (kept in `release`); entering counts as acquiring.
    fn command_access(&mut self, t: u64, owner: &'a str, token: u64, role: Role, op: Op) {
        let invoked = self.invoked.get(owner).copied().unwrap_or(t);
        match self.current.get(owner) {
            Some(&i) if self.holds[i].token == token => self.holds[i].release = Some(t),
            _ => {
                self.current.insert(owner, self.holds.len());
                self.holds.push(Hold {
                    release: Some(t),
                    ..Hold::new(owner, role, token, invoked, t, u64::MAX)
                });
            }
        }
        if op == Op::Enter {
            self.report.acquisitions += 1;
            self.acquire_ns.push(t - invoked);
        }
    }

    fn run_exited(&mut self, t: u64, owner: &'a str, code: Option<i32>, signal: Option<i32>) {
        let status = match (code, signal) {
            (Some(code), _) => code.to_string(),
            (None, Some(signal)) => format!("signal {signal}"),
            (None, None) => "unknown".to_string(),
        };
        *self.report.run_exits.entry(status).or_default() += 1;
        self.exits.insert(owner, (t, code));
        self.replay.gone(owner);
    }

    fn fault_started(&mut self, t: u64, kind: &str, target: &Option<String>) {
        *self.report.faults.entry(kind.to_string()).or_default() += 1;
        self.faults.push(Fault {
            kind: kind.to_string(),
            target: target.clone(),
            start: t,
            end: self.history_end,
        });
    }

    /// Ends the latest fault of `kind` on `target` still open (ending with the history).
    fn fault_ended(&mut self, t: u64, kind: &str, target: &Option<String>) {
        let open = self.history_end;
        if let Some(f) = (self.faults.iter_mut().rev())
            .find(|f| f.kind == kind && &f.target == target && f.end == open)
        {
            f.end = t;
        }
    }

    fn finish(mut self) -> Timeline<'a> {
        self.report.acquire = Spread::of(self.acquire_ns);
        if self.setup.workers_lock_the_store {
            let stalls = store_stalls(&self.faults);
            self.faults.extend(stalls);
        }
        if self.setup.via_run {
            mark_paused(&mut self.holds, &self.faults);
        }
        Timeline {
            report: self.report,
            holds: self.holds,
            faults: self.faults,
            invoked: self.invoked,
            exits: self.exits,
            history_end: self.history_end,
        }
    }
}

/// Every worker takes the store's file lock for its updates: one paused in that moment
/// stalls the store for all of them (calls fail after the file lock's patience), which is
/// a fault of the store's. A `run` worker's `leasehold run` takes it to renew, and is
/// stopped by a `pause` and by a `stall-run`.
fn store_stalls(faults: &[Fault]) -> Vec<Fault> {
    (faults.iter())
        .filter(|f| matches!(f.kind.as_str(), "pause" | "stall-run") && f.target.is_some())
        .map(|f| Fault {
            kind: "store stalled by a paused worker".into(),
            target: None,
            start: f.start,
            end: f.end,
        })
        .collect()
}

/// Marks the `run` commands the nemesis paused while inside.
fn mark_paused(holds: &mut [Hold], faults: &[Fault]) {
    for h in holds {
        let end = h.release.unwrap_or(h.got);
        h.paused = (faults.iter()).any(|f| {
            f.kind == "pause" && f.target.as_ref() == Some(&h.owner) && f.overlaps(h.got, end)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{H, MS};
    use crate::torture::check::Fence;
    use crate::torture::history::Event;

    #[test]
    fn check_saying_held_after_the_deadline_fails_and_reentry_keeps_the_token() {
        let r = H::default()
            .acquired(0, "a", 1, 100)
            .at(
                5,
                Event::Reentered {
                    owner: "a".into(),
                    token: 2,
                    outer: 1,
                },
            )
            .at(
                101,
                Event::Check {
                    owner: "a".into(),
                    token: 1,
                    ok: true,
                    deadline: 100 * MS,
                },
            )
            .released(102, "a", 1, 100)
            .lost(102, "a", 1)
            .check(Fence::All);
        assert_eq!((r.believed_past_deadline, r.reentry_token_changed), (1, 1));
    }

    /// a's outer hold was lost before it re-entered: the inner acquisition is a hold of
    /// its own, whose new token is no change. While the outer holds, it is.
    #[test]
    fn a_re_entry_after_the_outer_hold_was_lost_may_get_a_new_token() {
        let reentered = |t| {
            let changed = Event::Reentered {
                owner: "a".into(),
                token: 2,
                outer: 1,
            };
            H::default()
                .acquired(0, "a", 1, 100)
                .fault(10, 150, "pause", Some("a"))
                .lost(99, "a", 1)
                .at(t, changed)
                .released(160, "a", 1, 100)
                .check(Fence::All)
        };
        assert_eq!(reentered(151).reentry_token_changed, 0);
        assert_eq!(reentered(50).reentry_token_changed, 1);
    }
}
