//! The history checker: a pure function from the merged history to a report.
//!
//! A hold's *valid lease* runs from the moment its acquire returned to the earliest of the
//! safe deadline the library promised (the last one it logged), the moment its release
//! was invoked and the moment its process was killed. Both ends are conservative: the
//! store's lease began earlier and ends later, so valid leases that break the primitive's
//! rule at one instant (two mutex holders; a writer beside anyone; more than N permits)
//! prove that the store broke it. A hold's *belief* runs from the acquire's return until
//! the worker learned of the loss, released, or was killed: what the application thought.
//!
//! With `leasehold run` workers (`--workers-as run`) the history has no deadlines (the CLI
//! keeps them to itself); there a *command* is inside from its first access to the
//! resource to its last, and two incompatible commands inside at once are an overlap
//! unless one of them was paused (with its `run`) while inside: a frozen `run` cannot
//! stop its command, and fencing is what must refuse the command's stale access then.

mod election;
mod fifo;
mod losses;
mod overlap;
mod replay;
mod report;
mod setup;
#[cfg(test)]
mod testing;
mod timeline;
mod tokens;

use super::history::Entry;

use self::election::election;
use self::fifo::fifo;
use self::losses::{losses, run_losses, takeovers};
use self::overlap::{overlaps, overlaps_of_commands};
use self::report::violations;
pub use self::report::{Report, Spread};
pub use self::setup::{Fence, Primitive, Setup};
use self::timeline::Timeline;
use self::tokens::tokens;

/// Checks a history (entries in time order) of one lock.
pub fn check(history: &[Entry], setup: &Setup) -> Report {
    let Timeline {
        mut report,
        holds,
        faults,
        invoked,
        exits,
        history_end,
    } = Timeline::read(history, setup);
    if setup.via_run {
        overlaps_of_commands(&holds, setup.primitive, &mut report);
        run_losses(&holds, &faults, &invoked, &exits, &mut report);
    } else {
        overlaps(&holds, history_end, setup.primitive, &mut report);
        losses(&holds, &faults, history_end, &mut report);
        if setup.fair {
            fifo(&holds, &faults, &mut report);
        }
    }
    tokens(&holds, &mut report);
    if setup.primitive == Primitive::Election {
        election(history, &mut report);
    }
    report.takeover = takeovers(&holds, &faults);
    report.violations = violations(&report, setup);
    report
}

#[cfg(test)]
mod tests {
    use super::testing::clean;
    use super::Fence;

    #[test]
    fn a_clean_history_passes() {
        let r = clean().check(Fence::All);
        assert_eq!(r.violations, Vec::<String>::new());
        assert_eq!(
            (r.acquisitions, r.service_overlap, r.lost_updates),
            (2, 0, 0)
        );
    }
}
