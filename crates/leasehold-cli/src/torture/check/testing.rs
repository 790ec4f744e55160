//! A tiny language for the checker's unit tests' histories.

use super::setup::{Fence, Primitive, Setup};
use super::{check, Report};
use crate::torture::history::{Entry, Event, Op, Role};

pub(super) const MS: u64 = 1_000_000;

/// A tiny history language: each call appends an event at `t` ms.
#[derive(Default, Clone)]
pub(super) struct H(pub(super) Vec<Entry>);

impl H {
    pub(super) fn at(mut self, t: u64, event: Event) -> Self {
        self.0.push(Entry { t: t * MS, event });
        self
    }
    pub(super) fn acquired(self, t: u64, owner: &str, token: u64, deadline: u64) -> Self {
        self.acquired_as(t, t, owner, token, deadline, Role::Exclusive)
    }
    /// Acquire invoked at `invoked`, returned at `t`.
    pub(super) fn acquired_as(
        self,
        invoked: u64,
        t: u64,
        owner: &str,
        token: u64,
        deadline: u64,
        role: Role,
    ) -> Self {
        let o = owner.to_string();
        self.at(invoked, Event::Invoke { owner: o.clone() }).at(
            t,
            Event::Acquired {
                owner: o,
                token,
                deadline: deadline * MS,
                role,
            },
        )
    }
    pub(super) fn queued(self, t: u64, owner: &str) -> Self {
        let owner = owner.into();
        self.at(t, Event::Queued { owner })
    }
    pub(super) fn released(self, t: u64, owner: &str, token: u64, deadline: u64) -> Self {
        let o = owner.to_string();
        self.at(
            t,
            Event::Release {
                owner: o.clone(),
                token,
                deadline: deadline * MS,
            },
        )
        .at(
            t,
            Event::Released {
                owner: o,
                token,
                outcome: "released".into(),
            },
        )
    }
    /// A release that answered an error (the store was away).
    pub(super) fn release_failed(self, t: u64, owner: &str, token: u64) -> Self {
        let o = owner.to_string();
        self.at(
            t,
            Event::Release {
                owner: o.clone(),
                token,
                deadline: 1000 * MS,
            },
        )
        .at(
            t,
            Event::Released {
                owner: o,
                token,
                outcome: "error: store unavailable".into(),
            },
        )
    }
    pub(super) fn access(
        self,
        t: u64,
        owner: &str,
        token: u64,
        op: Op,
        value: u64,
        ok: bool,
    ) -> Self {
        let base = (op == Op::Write).then(|| value - 1);
        let role = match op {
            Op::Read | Op::Write => Role::Exclusive,
            Op::ReadShared | Op::Reread => Role::Shared,
            Op::Enter | Op::Exit => Role::Permit,
        };
        self.at(
            t,
            Event::Access {
                owner: owner.into(),
                token,
                op,
                value,
                base,
                accepted: ok,
                role,
            },
        )
    }
    pub(super) fn lost(self, t: u64, owner: &str, token: u64) -> Self {
        let owner = owner.into();
        self.at(t, Event::Lost { owner, token })
    }
    pub(super) fn fault(self, start: u64, end: u64, kind: &str, target: Option<&str>) -> Self {
        let (kind, target) = (kind.to_string(), target.map(String::from));
        self.at(
            start,
            Event::FaultStart {
                kind: kind.clone(),
                target: target.clone(),
            },
        )
        .at(end, Event::FaultEnd { kind, target })
    }
    /// A candidate's campaign for `value` (its acquire is logged apart).
    pub(super) fn campaign(self, t: u64, owner: &str, value: &str) -> Self {
        let (owner, value) = (owner.into(), value.into());
        self.at(t, Event::Campaign { owner, value })
    }
    /// An acquire that failed with its outcome unknown.
    pub(super) fn acquire_failed(self, t: u64, owner: &str) -> Self {
        let event = Event::AcquireFailed {
            owner: owner.into(),
            unknown: true,
            error: "connection reset".into(),
        };
        self.at(t, event)
    }
    /// `observer` reported the leader of `term`, shown with `value`.
    pub(super) fn observed(self, t: u64, observer: &str, term: u64, value: Option<&str>) -> Self {
        let event = Event::Observed {
            observer: observer.into(),
            term: Some(term),
            value: value.map(String::from),
            leader: None,
        };
        self.at(t, event)
    }
    /// `observer` reported no leader.
    pub(super) fn observed_none(self, t: u64, observer: &str) -> Self {
        let event = Event::Observed {
            observer: observer.into(),
            term: None,
            value: None,
            leader: None,
        };
        self.at(t, event)
    }
    /// `observer`'s look failed; `regressed`: it refused an older term.
    pub(super) fn observe_failed(self, t: u64, observer: &str, regressed: bool) -> Self {
        let event = Event::ObserveFailed {
            observer: observer.into(),
            error: "store unavailable".into(),
            regressed,
        };
        self.at(t, event)
    }
    pub(super) fn check(self, fence: Fence) -> Report {
        self.check_as(&Setup::new(fence, Primitive::Mutex))
    }
    pub(super) fn check_as(mut self, setup: &Setup) -> Report {
        // Stable: events logged at the same instant keep their order.
        self.0.sort_by_key(|e| e.t);
        check(&self.0, setup)
    }
}

/// Two clean cycles: a then b, each reading and incrementing.
pub(super) fn clean() -> H {
    H::default()
        .acquired(0, "a", 1, 100)
        .access(1, "a", 1, Op::Read, 0, true)
        .access(2, "a", 1, Op::Write, 1, true)
        .released(3, "a", 1, 100)
        .acquired(4, "b", 2, 104)
        .access(5, "b", 2, Op::Read, 1, true)
        .access(6, "b", 2, Op::Write, 2, true)
        .released(7, "b", 2, 104)
}

pub(super) fn setup(primitive: Primitive) -> Setup {
    Setup::new(Fence::All, primitive)
}

pub(super) fn via_run(primitive: Primitive) -> Setup {
    Setup {
        via_run: true,
        ..setup(primitive)
    }
}

pub(super) fn run_exit(h: H, t: u64, owner: &str, code: i32) -> H {
    h.at(
        t,
        Event::RunExited {
            owner: owner.into(),
            code: Some(code),
            signal: None,
        },
    )
}

/// Two `run` commands: a enters at 10, b at 50; a's last access is at `a_last`.
pub(super) fn commands(a_last: u64, pause_a: bool) -> H {
    let mut h = H::default()
        .at(0, Event::Invoke { owner: "a".into() })
        .access(10, "a", 1, Op::Enter, 1, true)
        .access(11, "a", 1, Op::Read, 0, true)
        .at(20, Event::Invoke { owner: "b".into() })
        .access(50, "b", 2, Op::Enter, 1, true)
        .access(51, "b", 2, Op::Read, 0, true)
        .access(52, "b", 2, Op::Write, 1, true)
        .access(53, "b", 2, Op::Exit, 0, true)
        .access(a_last, "a", 1, Op::Write, 1, !pause_a)
        .access(a_last + 1, "a", 1, Op::Exit, 0, true);
    if pause_a {
        h = h.fault(12, 150, "pause", Some("a"));
    }
    run_exit(run_exit(h, a_last + 2, "a", 76), 54, "b", 0)
}
