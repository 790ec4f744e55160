//! The primitive's rule over time: holds (or `run` commands) that were valid at once but
//! may not be.

use super::report::Report;
use super::setup::Primitive;
use super::timeline::Hold;
use crate::torture::history::Role;

/// Spans that break the primitive's rule, counted at each span's start (see
/// [`Primitive::conflicts`]); and the most spans at one instant.
fn conflicts(spans: &mut [(&str, Role, u64, u64)], primitive: Primitive) -> (usize, usize) {
    spans.sort_by_key(|s| s.2);
    let (mut count, mut most) = (0, 0);
    for (j, &(owner, role, start, _)) in spans.iter().enumerate() {
        let others: Vec<Role> = (spans[..j].iter())
            .filter(|a| a.3 > start && a.0 != owner)
            .map(|a| a.1)
            .collect();
        count += primitive.conflicts(&others, role);
        most = most.max(others.len() + 1);
    }
    (count, most)
}

/// Valid leases, and beliefs, that break the primitive's rule.
pub(super) fn overlaps(
    holds: &[Hold],
    history_end: u64,
    primitive: Primitive,
    report: &mut Report,
) {
    let spans = |end: &dyn Fn(&Hold) -> u64| -> Vec<(&str, Role, u64, u64)> {
        (holds.iter())
            .filter(|h| h.got < end(h))
            .map(|h| (h.owner.as_str(), h.role, h.got, end(h)))
            .collect()
    };
    (report.service_overlap, report.max_valid_holders) =
        conflicts(&mut spans(&Hold::valid_end), primitive);
    report.belief_overlap = conflicts(&mut spans(&|h| h.belief_end(history_end)), primitive).0;
}

/// Commands inside at once that break the primitive's rule: those never paused while
/// inside (must be 0), and all of them (belief). A command's span ends just after its
/// last access.
pub(super) fn overlaps_of_commands(holds: &[Hold], primitive: Primitive, report: &mut Report) {
    let spans = |all: bool| -> Vec<(&str, Role, u64, u64)> {
        (holds.iter())
            .filter(|h| all || !h.paused)
            .map(|h| (h.owner.as_str(), h.role, h.got, h.valid_end() + 1))
            .collect()
    };
    (report.service_overlap, report.max_valid_holders) = conflicts(&mut spans(false), primitive);
    report.belief_overlap = conflicts(&mut spans(true), primitive).0;
}

#[cfg(test)]
mod tests {
    use super::super::setup::{Fence, Primitive};
    use super::super::testing::{commands, setup, via_run, H};
    use crate::torture::history::{Op, Role};

    #[test]
    fn overlapping_valid_leases_fail() {
        // b got the lock at 50 while a's lease was valid until 100 and not released.
        let r = H::default()
            .acquired(0, "a", 1, 100)
            .acquired(50, "b", 2, 150)
            .released(60, "b", 2, 150)
            .released(70, "a", 1, 100)
            .check(Fence::All);
        assert_eq!(r.service_overlap, 1);
        assert!(r.violations[0].starts_with("service overlap"), "{r:?}");
    }

    #[test]
    fn a_lease_that_ended_before_the_next_grant_is_no_overlap_but_a_belief_overlap() {
        // a paused from 10 to 200: its deadline (100) passed, b got it at 120; a learns at
        // 201 and its stale write is rejected.
        let r = H::default()
            .acquired(0, "a", 1, 100)
            .access(5, "a", 1, Op::Read, 0, true)
            .fault(10, 200, "pause", Some("a"))
            .acquired(120, "b", 2, 220)
            .access(121, "b", 2, Op::Read, 0, true)
            .access(122, "b", 2, Op::Write, 1, true)
            .released(123, "b", 2, 220)
            .lost(201, "a", 1)
            .access(202, "a", 1, Op::Write, 1, false)
            .released(203, "a", 1, 100)
            .check(Fence::All);
        assert_eq!(r.violations, Vec::<String>::new());
        assert_eq!((r.service_overlap, r.belief_overlap), (0, 1));
        assert_eq!((r.expired_while_held, r.losses_reported), (1, 1));
        assert_eq!(
            r.loss_report.p50_ms, 1.0,
            "from the resume at 200 to lost at 201"
        );
        assert_eq!((r.stale_rejected, r.lost_updates), (1, 0));
    }

    /// Three permit holders invoked together at 0, granted out of order, overlapping from
    /// 20 to 50.
    fn three_permits() -> H {
        H::default()
            .acquired_as(0, 20, "a", 2, 100, Role::Permit)
            .acquired_as(0, 10, "b", 3, 100, Role::Permit)
            .acquired_as(0, 15, "c", 1, 100, Role::Permit)
            .released(50, "a", 2, 100)
            .released(50, "b", 3, 100)
            .released(50, "c", 1, 100)
    }

    #[test]
    fn n_plus_one_valid_permits_fail_and_n_pass() {
        let r = three_permits().check_as(&setup(Primitive::Semaphore(2)));
        assert_eq!((r.service_overlap, r.max_valid_holders), (1, 3));
        assert!(
            r.violations[0].contains("more than N valid permits"),
            "{r:?}"
        );
        let r = three_permits().check_as(&setup(Primitive::Semaphore(3)));
        assert_eq!(r.violations, Vec::<String>::new());
        // Concurrent grants may return in any token order: not backwards.
        assert_eq!(r.tokens_backwards, 0);
    }

    #[test]
    fn a_writer_beside_a_reader_or_a_writer_fails_and_readers_together_pass() {
        let pair = |a: Role, b: Role| {
            H::default()
                .acquired_as(0, 0, "a", 1, 100, a)
                .acquired_as(10, 10, "b", 2, 100, b)
                .released(50, "a", 1, 100)
                .released(50, "b", 2, 100)
                .check_as(&setup(Primitive::RwLock))
        };
        let readers = pair(Role::Shared, Role::Shared);
        assert_eq!(readers.violations, Vec::<String>::new());
        assert_eq!(readers.max_valid_holders, 2);
        for (a, b) in [
            (Role::Shared, Role::Exclusive),
            (Role::Exclusive, Role::Shared),
            (Role::Exclusive, Role::Exclusive),
        ] {
            let r = pair(a, b);
            assert_eq!(r.service_overlap, 1, "{a:?} then {b:?}");
            assert!(r.violations[0].starts_with("service overlap"), "{r:?}");
        }
        // Three readers and a writer among them: three pairs.
        let r = H::default()
            .acquired_as(0, 0, "a", 1, 100, Role::Shared)
            .acquired_as(0, 1, "b", 2, 100, Role::Shared)
            .acquired_as(0, 2, "c", 3, 100, Role::Shared)
            .acquired_as(0, 3, "w", 4, 100, Role::Exclusive)
            .check_as(&setup(Primitive::RwLock));
        assert_eq!(r.service_overlap, 3);
    }

    #[test]
    fn run_commands_inside_at_once_fail_unless_one_was_paused_and_then_lost() {
        // a acted after b entered, unpaused: run let its command outlive the lock.
        let r = commands(160, false).check_as(&via_run(Primitive::Mutex));
        assert_eq!((r.service_overlap, r.belief_overlap), (1, 1));
        assert!(r.violations[0].contains("commands inside at once"), "{r:?}");
        assert_eq!(r.false_losses, 1, "exit 76 with no fault");
        // Paused past its lease: a belief overlap, fenced, and reported lost (exit 76).
        let r = commands(160, true).check_as(&via_run(Primitive::Mutex));
        assert_eq!(r.violations, Vec::<String>::new());
        assert_eq!((r.service_overlap, r.belief_overlap), (0, 1));
        assert_eq!((r.expired_while_held, r.losses_reported), (1, 1));
        assert_eq!((r.acquisitions, r.stale_rejected), (2, 1));
        assert_eq!(r.run_exits.get("76"), Some(&1));
        // Done before b entered: no overlap.
        let r = commands(30, false).check_as(&via_run(Primitive::Mutex));
        assert_eq!(r.service_overlap, 0);
    }

    /// a's `leasehold run` alone was stalled: its command is not paused, so whatever it
    /// does after b entered is an overlap (the watchdog should have stopped it); done
    /// before, it is not. Either way the stalled run must exit 76, which is no false loss.
    #[test]
    fn a_command_of_a_stalled_run_must_be_stopped_before_the_next_holder_enters() {
        let stalled = |a_last: u64| {
            commands(a_last, false)
                .fault(12, 150, "stall-run", Some("a"))
                .check_as(&via_run(Primitive::Mutex))
        };
        let r = stalled(160);
        assert_eq!(r.service_overlap, 1);
        assert!(r.violations[0].contains("commands inside at once"), "{r:?}");
        let r = stalled(30);
        assert_eq!((r.service_overlap, r.false_losses), (0, 0));
        assert_eq!((r.expired_while_held, r.losses_reported), (1, 1));
    }
}
