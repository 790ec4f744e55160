//! Lost leases: every lease that expired while held must be reported lost, and no lease
//! may be reported lost without a fault to explain it; and how soon a killed holder's
//! lock went to someone else.

use std::collections::HashMap;

use super::report::{Report, Spread};
use super::timeline::{Fault, Hold};

/// Faults that explain a lost lease: a long pause or kill of that worker, or any fault
/// of the store or the link (no target).
const EXCUSING_HOLDER_FAULTS: &[&str] = &["pause", "stall-run", "kill"];

/// The CLI's exit status for a lock lost while the command ran.
const RUN_LOST: i32 = crate::exit::LOST as i32;

/// Every lease that expired while held must fire `lost`; `lost` without a fault is false.
pub(super) fn losses(holds: &[Hold], faults: &[Fault], history_end: u64, report: &mut Report) {
    let mut delays = Vec::new();
    for h in holds {
        let killed_before_deadline = h.killed.is_some_and(|k| k <= h.deadline);
        let held_until = h.release.unwrap_or(history_end);
        if h.deadline < held_until && !killed_before_deadline {
            report.expired_while_held += 1;
            if let Some(lost) = h.lost {
                report.losses_reported += 1;
                // A stopped process can only notice once it runs again.
                let noticeable = (faults.iter())
                    .filter(|f| f.start <= h.deadline && f.end > h.deadline)
                    .filter(|f| f.target.is_none() || f.target.as_ref() == Some(&h.owner))
                    .map(|f| f.end)
                    .fold(h.deadline, u64::max);
                delays.push(lost.saturating_sub(noticeable));
            }
        }
        if let Some(lost) = h.lost {
            if !excused(faults, &h.owner, h.invoked, lost) && !stopped_at_deadline(faults, h) {
                report.false_losses += 1;
            }
        }
    }
    report.loss_report = Spread::of(delays);
}

/// How long after a pause a resumed worker may need to get a renewal through: one round
/// trip to a store on a loaded host.
const RENEWAL_AFTER_RESUME: u64 = 100_000_000;

/// Whether `h`'s owner was stopped by a pause of its own, short ones too, when the lease
/// it last confirmed ran out (or too close before it to renew in time). A short pause
/// alone does not explain a loss, as the lease normally has most of its TTL left; but a
/// hold handed over on a waiter's short lease may have less left than a short pause
/// lasts, before its first renewal to the full TTL.
fn stopped_at_deadline(faults: &[Fault], h: &Hold) -> bool {
    faults.iter().any(|f| {
        matches!(f.kind.as_str(), "pause" | "short-pause")
            && f.target.as_deref() == Some(h.owner.as_str())
            && f.start <= h.deadline
            && f.end + RENEWAL_AFTER_RESUME >= h.deadline
    })
}

/// Whether a fault explains a loss of `owner`'s between `from` (its acquire) and `to`.
fn excused(faults: &[Fault], owner: &str, from: u64, to: u64) -> bool {
    faults.iter().any(|f| {
        let relevant = match &f.target {
            None => true,
            Some(t) => t == owner && EXCUSING_HOLDER_FAULTS.contains(&f.kind.as_str()),
        };
        relevant && f.overlaps(from, to)
    })
}

/// `run` workers: a command paused past its lease (a `pause`, 1.5-2 TTL), or one whose
/// `run` alone was (a `stall-run`: its watchdog stops the command), must end with `run`
/// exiting 76, unless the coordinator killed that `run`; exit 76 needs a fault.
pub(super) fn run_losses(
    holds: &[Hold],
    faults: &[Fault],
    invoked: &HashMap<&str, u64>,
    exits: &HashMap<&str, (u64, Option<i32>)>,
    report: &mut Report,
) {
    let mut delays = Vec::new();
    for f in (faults.iter()).filter(|f| f.kind == "pause" || f.kind == "stall-run") {
        let Some(owner) = f.target.as_deref() else {
            continue;
        };
        if !holds.iter().any(|h| h.owner == owner) {
            continue;
        }
        let Some(&(t, code)) = exits.get(owner) else {
            continue;
        };
        report.expired_while_held += 1;
        if code == Some(RUN_LOST) {
            report.losses_reported += 1;
            delays.push(t.saturating_sub(f.end));
        }
    }
    for (&owner, &(t, code)) in exits {
        let from = invoked.get(owner).copied().unwrap_or(0);
        if code == Some(RUN_LOST) && !excused(faults, owner, from, t) {
            report.false_losses += 1;
        }
    }
    report.loss_report = Spread::of(delays);
}

/// From each kill of a holder to the next guard returned to another owner.
pub(super) fn takeovers(holds: &[Hold], faults: &[Fault]) -> Spread {
    let mut ns = Vec::new();
    for f in faults.iter().filter(|f| f.kind == "kill") {
        let victim_held = (holds.iter()).any(|h| Some(&h.owner) == f.target.as_ref());
        if !victim_held {
            continue;
        }
        if let Some(next) = (holds.iter())
            .filter(|h| h.got > f.start && Some(&h.owner) != f.target.as_ref())
            .map(|h| h.got)
            .min()
        {
            ns.push(next - f.start);
        }
    }
    Spread::of(ns)
}

#[cfg(test)]
mod tests {
    use super::super::setup::{Fence, Primitive, Setup};
    use super::super::testing::{commands, run_exit, setup, via_run, H};
    use super::RUN_LOST;
    use crate::torture::history::{Event, Op};

    #[test]
    fn an_expired_lease_without_a_lost_signal_fails() {
        let r = H::default()
            .acquired(0, "a", 1, 100)
            .fault(10, 200, "pause", Some("a"))
            .released(201, "a", 1, 100)
            .check(Fence::All);
        assert_eq!((r.expired_while_held, r.losses_reported), (1, 0));
        assert!(r.violations.iter().any(|v| v.contains("no lost signal")));
    }

    #[test]
    fn a_killed_holder_is_not_asked_to_report_and_its_takeover_is_timed() {
        let r = H::default()
            .acquired(0, "a", 1, 100)
            .fault(10, 10, "kill", Some("a"))
            .at(10, Event::Killed { owner: "a".into() })
            .acquired(104, "b", 2, 204)
            .released(110, "b", 2, 204)
            .check(Fence::All);
        assert_eq!(r.violations, Vec::<String>::new());
        assert_eq!(r.expired_while_held, 0);
        assert_eq!((r.takeover.n, r.takeover.p50_ms), (1, 94.0));
    }

    #[test]
    fn a_loss_under_a_short_pause_or_no_fault_is_false() {
        // The lease had most of its time left after the pause.
        let short = H::default()
            .acquired(0, "a", 1, 500)
            .fault(10, 40, "short-pause", Some("a"))
            .lost(41, "a", 1)
            .released(42, "a", 1, 500)
            .check(Fence::All);
        assert_eq!(short.false_losses, 1);
        assert!(short
            .violations
            .iter()
            .any(|v| v.starts_with("lost with no fault")));
        let store = H::default()
            .acquired(0, "a", 1, 100)
            .fault(10, 40, "restart-store", None)
            .lost(41, "a", 1)
            .released(42, "a", 1, 100)
            .check(Fence::All);
        assert_eq!(store.false_losses, 0);
    }

    /// A hold handed over on a waiter's short lease (here 100 ms left) may run out during
    /// a short pause, before its first renewal: that loss is explained; one whose
    /// deadline came long after the pause ended is not.
    #[test]
    fn a_loss_whose_deadline_came_during_a_short_pause_is_explained() {
        let paused_over = |deadline| {
            H::default()
                .acquired(0, "a", 1, deadline)
                .fault(10, 160, "short-pause", Some("a"))
                .lost(161, "a", 1)
                .released(162, "a", 1, deadline)
                .check(Fence::All)
        };
        assert_eq!(paused_over(100).false_losses, 0);
        assert_eq!(paused_over(200).false_losses, 0);
        assert_eq!(paused_over(500).false_losses, 1);
        let another_owners_pause = H::default()
            .acquired(0, "a", 1, 100)
            .fault(10, 160, "short-pause", Some("b"))
            .lost(161, "a", 1)
            .released(162, "a", 1, 100)
            .check(Fence::All);
        assert_eq!(another_owners_pause.false_losses, 1);
    }

    /// On the local store a worker paused while it held the store's file lock stalls
    /// everyone's renewals: b's loss during a's pause is the store's fault there, and
    /// false elsewhere. A `run` worker's `leasehold run` renews, so it too takes the file
    /// lock: stopped with its command (pause) or alone (stall-run).
    #[test]
    fn a_loss_during_another_workers_pause_is_excused_where_workers_lock_the_store() {
        let library = H::default()
            .acquired(0, "b", 1, 100)
            .fault(10, 150, "pause", Some("a"))
            .lost(99, "b", 1)
            .released(100, "b", 1, 100);
        let run = |kind| {
            let h = (H::default())
                .at(0, Event::Invoke { owner: "b".into() })
                .access(5, "b", 1, Op::Enter, 1, true)
                .fault(10, 150, kind, Some("a"));
            run_exit(h, 99, "b", RUN_LOST)
        };
        for (h, workers) in [
            (library, setup(Primitive::Mutex)),
            (run("pause"), via_run(Primitive::Mutex)),
            (run("stall-run"), via_run(Primitive::Mutex)),
        ] {
            let local = Setup {
                workers_lock_the_store: true,
                ..workers
            };
            assert_eq!(h.clone().check_as(&local).false_losses, 0, "{workers:?}");
            assert_eq!(h.check_as(&workers).false_losses, 1, "{workers:?}");
        }
    }

    #[test]
    fn a_paused_run_that_did_not_exit_lost_fails() {
        let h = commands(160, true);
        let mut entries = h.0;
        entries.retain(|e| !matches!(&e.event, Event::RunExited { owner, .. } if owner == "a"));
        let r = run_exit(H(entries), 162, "a", 0).check_as(&via_run(Primitive::Mutex));
        assert_eq!((r.expired_while_held, r.losses_reported), (1, 0));
        assert!(r.violations.iter().any(|v| v.contains("no lost signal")));
    }
}
