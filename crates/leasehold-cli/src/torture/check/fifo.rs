//! First come, first served: the order of grants of a fair lock.

use std::collections::{HashMap, HashSet};

use super::report::Report;
use super::timeline::{Fault, Hold};
use crate::torture::history::Role;

/// First come, first served, judged from the history alone. `a`'s acquire logged that the
/// store had queued it (an answer with its queue position) before `b`'s acquire was
/// invoked, so `b`'s request reached the store after `a` was in its queue; if both were
/// granted, `a` must have been granted first, and tokens give the store's grant order
/// (they rise with each grant). Not judged: two readers (let in together, in any order);
/// `a` in trouble while it waited (any fault of the store or the link, or one aimed at
/// it: it may have lost its place, as a waiter that stops renewing its place must); `b`
/// given a token it had before (it re-entered its own hold, left by a lost release).
pub(super) fn fifo(holds: &[Hold], faults: &[Fault], report: &mut Report) {
    let mut seen: HashMap<&str, HashSet<u64>> = HashMap::new();
    let mut fresh = vec![true; holds.len()];
    for (i, h) in holds.iter().enumerate() {
        fresh[i] = seen.entry(&h.owner).or_default().insert(h.token);
    }
    for a in holds {
        let Some(queued) = a.queued else { continue };
        let troubled = (faults.iter()).any(|f| {
            (f.target.is_none() || f.target.as_ref() == Some(&a.owner)) && f.overlaps(queued, a.got)
        });
        if troubled {
            continue;
        }
        for (b, _) in (holds.iter().zip(&fresh)).filter(|(_, &fresh)| fresh) {
            if b.owner == a.owner
                || b.invoked <= queued
                || (a.role == Role::Shared && b.role == Role::Shared)
            {
                continue;
            }
            report.fifo_checked += 1;
            if b.token < a.token {
                report.fifo_violations += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::setup::{Primitive, Setup};
    use super::super::testing::{setup, H};
    use crate::torture::history::{Event, Role};

    fn fair(primitive: Primitive) -> Setup {
        Setup {
            fair: true,
            ..setup(primitive)
        }
    }

    /// a queued at 10; b invoked at 20; both granted later, with these tokens.
    fn queue(a: (Role, u64), b: (Role, u64)) -> H {
        H::default()
            .acquired(0, "h", 1, 100)
            .at(5, Event::Invoke { owner: "a".into() })
            .queued(10, "a")
            .released(50, "h", 1, 100)
            .acquired_as(20, 60, "b", b.1, 200, b.0)
            .released(65, "b", b.1, 200)
            .acquired_as(5, 70, "a", a.1, 200, a.0)
            .released(80, "a", a.1, 200)
    }

    #[test]
    fn fifo_a_later_arrival_granted_first_fails() {
        let r = queue((Role::Exclusive, 3), (Role::Exclusive, 2)).check_as(&fair(Primitive::Mutex));
        assert_eq!((r.fifo_checked, r.fifo_violations), (1, 1));
        assert!(r.violations.iter().any(|v| v.contains("later arrival")));
        // Non-fair: not judged.
        let r =
            queue((Role::Exclusive, 3), (Role::Exclusive, 2)).check_as(&setup(Primitive::Mutex));
        assert_eq!(r.fifo_checked, 0);
        // The queued one first: passes (the arrival order of responses does not matter).
        let r = queue((Role::Exclusive, 2), (Role::Exclusive, 3)).check_as(&fair(Primitive::Mutex));
        assert_eq!((r.fifo_checked, r.fifo_violations), (1, 0));
        let r =
            queue((Role::Permit, 3), (Role::Permit, 2)).check_as(&fair(Primitive::Semaphore(2)));
        assert_eq!(r.fifo_violations, 1);
    }

    #[test]
    fn fifo_does_not_judge_readers_together_a_waiter_in_trouble_or_one_not_seen_queued() {
        let readers =
            queue((Role::Shared, 3), (Role::Shared, 2)).check_as(&fair(Primitive::RwLock));
        assert_eq!(readers.fifo_checked, 0);
        let writer_first =
            queue((Role::Exclusive, 3), (Role::Shared, 2)).check_as(&fair(Primitive::RwLock));
        assert_eq!(writer_first.fifo_violations, 1);
        let troubled = queue((Role::Exclusive, 3), (Role::Exclusive, 2))
            .fault(30, 40, "restart-store", None)
            .check_as(&fair(Primitive::Mutex));
        assert_eq!((troubled.fifo_checked, troubled.violations.len()), (0, 0));
        // b invoked before a's queue place was known: no order between them.
        let r = H::default()
            .acquired(0, "h", 1, 100)
            .at(5, Event::Invoke { owner: "a".into() })
            .at(6, Event::Invoke { owner: "b".into() })
            .queued(10, "a")
            .released(50, "h", 1, 100)
            .acquired_as(6, 60, "b", 2, 200, Role::Exclusive)
            .released(65, "b", 2, 200)
            .acquired_as(5, 70, "a", 3, 200, Role::Exclusive)
            .released(80, "a", 3, 200)
            .check_as(&fair(Primitive::Mutex));
        assert_eq!((r.fifo_checked, r.fifo_violations), (0, 0));
    }
}
