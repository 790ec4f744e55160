//! What the checker found, and which of it breaks an invariant.

use std::collections::BTreeMap;

use serde::Serialize;

use super::setup::{Fence, Primitive, Setup};

/// Nearest-rank percentiles of durations, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Spread {
    /// How many.
    pub n: usize,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

impl Spread {
    pub(super) fn of(mut ns: Vec<u64>) -> Self {
        if ns.is_empty() {
            return Spread::default();
        }
        ns.sort_unstable();
        let rank = |p: f64| ns[((p * ns.len() as f64).ceil() as usize).clamp(1, ns.len()) - 1];
        let ms = |v: u64| v as f64 / 1e6;
        Spread {
            n: ns.len(),
            p50_ms: ms(rank(0.50)),
            p99_ms: ms(rank(0.99)),
            max_ms: ms(ns[ns.len() - 1]),
        }
    }
}

/// What the checker found. Counts of pairs for overlaps.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    /// Acquisitions that returned a guard (with `run` workers: commands that entered).
    pub acquisitions: usize,
    /// Acquires that returned without the lock: busy or out of time.
    pub acquire_failed: usize,
    /// Acquires that failed with an error (the store may have granted).
    pub acquire_unknown: usize,
    /// Valid leases that broke the primitive's rule: pairs of owners (a mutex; a writer
    /// and anyone), or grants beyond N valid permits (a semaphore). With `run` workers:
    /// the same for commands inside at once, neither paused. Must be 0.
    pub service_overlap: usize,
    /// The same for beliefs (with `run` workers: for all commands; reported only).
    pub belief_overlap: usize,
    /// Most valid leases at one instant.
    pub max_valid_holders: usize,
    /// Accesses the resource accepted with a token below one it had accepted before (for
    /// a reader: below a writer's).
    pub stale_accepted: usize,
    /// Accesses the resource refused.
    pub stale_rejected: usize,
    /// Accepted writes that did not build on the value before them.
    pub lost_updates: usize,
    /// Readers whose two accepted reads had an accepted write between them.
    pub torn_reads: usize,
    /// Permit holders that entered the resource beside N others still inside (a
    /// semaphore's resource cannot be fenced by token: reported).
    pub resource_over_capacity: usize,
    /// Holders (different owners) that got the same token.
    pub duplicate_tokens: usize,
    /// Holds whose token was not above that of an earlier hold they must follow (one that
    /// began before they did, if either excludes the other; else one that began before
    /// they asked).
    pub tokens_backwards: usize,
    /// Re-entries that returned a token other than the outer hold's.
    pub reentry_token_changed: usize,
    /// Re-entries checked.
    pub reentries: usize,
    /// Pairs checked for first-come-first-served order (fair runs).
    pub fifo_checked: usize,
    /// Of those, pairs where the later arrival got the lock first.
    pub fifo_violations: usize,
    /// Guards returned already past their safe deadline (a grant that arrived late).
    pub granted_late: usize,
    /// `check` said "held" after the guard's own deadline.
    pub believed_past_deadline: usize,
    /// Holds whose safe deadline passed while the worker still held them (with `run`
    /// workers: commands paused past their lease).
    pub expired_while_held: usize,
    /// Of those, how many fired `lost` (`run` exited 76).
    pub losses_reported: usize,
    /// From the deadline (or the end of the fault that covered it) to `lost`.
    pub loss_report: Spread,
    /// `lost` (`run` exit 76) with no fault to explain it (a short pause does not).
    pub false_losses: usize,
    /// `run` workers' exit statuses (`signal N` when killed).
    pub run_exits: BTreeMap<String, usize>,
    /// Leaders the observers reported (`--primitive election`).
    pub observed_leaders: usize,
    /// Observers' looks that failed (each tried again).
    pub observer_errors: usize,
    /// Leaders an observer reported with a term below one it had reported before, and
    /// looks where the observer refused such a term. Must be 0.
    pub observer_regressions: usize,
    /// Reported leaders that no leadership was: a term shown with a value its candidate
    /// did not campaign with, or none. Must be 0.
    pub observed_wrong_value: usize,
    /// Reported leaders whose term no candidate learned it was granted (the answer was
    /// lost), shown with a value some candidate campaigned with.
    pub observed_unclaimed: usize,
    /// Faults started, by kind.
    pub faults: BTreeMap<String, usize>,
    /// From killing a holder to the next acquisition by someone else.
    pub takeover: Spread,
    /// From acquire invoked to a guard returned.
    pub acquire: Spread,
    /// The invariants this history broke (empty: it passed).
    pub violations: Vec<String>,
}

/// The invariants `r` breaks, as `setup` judges them.
pub(super) fn violations(r: &Report, setup: &Setup) -> Vec<String> {
    let mut v = Vec::new();
    let mut must_be_zero = |count: usize, what: &str| {
        if count > 0 {
            v.push(format!("{what}: {count}"));
        }
    };
    let forgotten = setup.store_forgets && r.faults.get("restart-store").is_some_and(|&n| n > 0);
    must_be_zero(
        if forgotten { 0 } else { r.service_overlap },
        match (setup.via_run, setup.primitive) {
            (false, Primitive::Semaphore(_)) => "service overlap (more than N valid permits)",
            (false, _) => "service overlap (incompatible valid leases at once)",
            (true, _) => "service overlap (incompatible commands inside at once, none paused)",
        },
    );
    must_be_zero(r.duplicate_tokens, "a token given to two owners");
    must_be_zero(r.tokens_backwards, "a token that did not increase");
    must_be_zero(r.reentry_token_changed, "re-entry changed the token");
    must_be_zero(
        r.believed_past_deadline,
        "check said held past its deadline",
    );
    must_be_zero(
        r.expired_while_held - r.losses_reported,
        "an expired lease with no lost signal",
    );
    must_be_zero(r.false_losses, "lost with no fault to explain it");
    must_be_zero(r.fifo_violations, "a later arrival granted first (fair)");
    if setup.primitive == Primitive::Election {
        must_be_zero(r.observer_regressions, "an observer's term went back");
        must_be_zero(
            r.observed_wrong_value,
            "an observed (term, value) that no leadership had",
        );
    }
    if setup.fence == Fence::All {
        must_be_zero(r.stale_accepted, "stale access accepted");
        must_be_zero(r.lost_updates, "lost update");
        must_be_zero(r.torn_reads, "a write inside a reader's reads");
    }
    if setup.primitive == Primitive::Election && r.acquisitions > 0 && r.observed_leaders == 0 {
        v.push("the observers reported no leader".to_string());
    }
    let damage = r.lost_updates + r.torn_reads + r.resource_over_capacity;
    let paused = r.faults.get("pause").is_some_and(|&n| n > 0);
    if setup.fence == Fence::None && (paused || forgotten) && damage == 0 {
        v.push("the unfenced control showed no damage: the faults did not land".to_string());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::super::setup::{Fence, Primitive, Setup};
    use super::super::testing::{clean, H};
    use crate::torture::history::Op;

    /// A restart of a store that forgets (Redis without persistence) lets b in while a
    /// still holds a valid lease: an overlap that only fencing can make harmless. There
    /// it is reported, not a violation, and a's stale write must be refused; elsewhere it
    /// is a violation.
    #[test]
    fn a_store_that_forgets_may_overlap_and_fencing_must_refuse_the_old_holder() {
        let h = |accepted: bool| {
            H::default()
                .acquired(0, "a", 5, 1000)
                .access(1, "a", 5, Op::Read, 0, true)
                .fault(10, 20, "restart-store", None)
                .acquired(30, "b", 9, 1030)
                .access(31, "b", 9, Op::Read, 0, true)
                .access(32, "b", 9, Op::Write, 1, true)
                .access(40, "a", 5, Op::Write, 1, accepted)
                .lost(41, "a", 5)
                .released(42, "a", 5, 1000)
                .released(50, "b", 9, 1030)
        };
        let forgets = Setup {
            store_forgets: true,
            ..Setup::new(Fence::All, Primitive::Mutex)
        };
        let r = h(false).check_as(&forgets);
        assert_eq!(r.service_overlap, 1);
        assert_eq!(r.violations, Vec::<String>::new());
        let r = h(true).check_as(&forgets);
        assert!(r
            .violations
            .iter()
            .any(|v| v.starts_with("stale access accepted")));
        let r = h(false).check(Fence::All);
        assert!(r
            .violations
            .iter()
            .any(|v| v.starts_with("service overlap")));
        // The unfenced control must show the damage.
        let control = Setup {
            fence: Fence::None,
            ..forgets
        };
        assert_eq!(h(true).check_as(&control).lost_updates, 1);
        assert_eq!(h(true).check_as(&control).violations, Vec::<String>::new());
    }

    #[test]
    fn a_control_without_damage_fails() {
        let r = clean().fault(10, 20, "pause", Some("a")).check(Fence::None);
        assert_eq!(
            r.violations,
            vec!["the unfenced control showed no damage: the faults did not land"]
        );
    }
}
