//! The resource replayed from its accesses: what fencing let through (stale tokens, lost
//! updates, torn reads) and how many permit holders were inside at once.

use std::collections::{HashMap, HashSet};

use super::report::Report;
use super::setup::{Primitive, Setup};
use crate::torture::history::Op;

/// What the resource saw, replayed from its accesses.
#[derive(Debug, Default)]
pub(super) struct Replay {
    highest: u64,
    highest_exclusive: u64,
    counter: u64,
    writes: usize,
    first_read: HashMap<String, usize>,
    inside: HashSet<String>,
}

impl Replay {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn access(
        &mut self,
        r: &mut Report,
        setup: &Setup,
        owner: &str,
        token: u64,
        op: Op,
        value: u64,
        base: Option<u64>,
    ) {
        match op {
            Op::Read | Op::Write => {
                if token < self.highest {
                    r.stale_accepted += 1;
                }
                self.highest = self.highest.max(token);
                self.highest_exclusive = self.highest_exclusive.max(token);
                if op == Op::Write {
                    if base != Some(self.counter) {
                        r.lost_updates += 1;
                    }
                    self.counter = value;
                    self.writes += 1;
                }
            }
            Op::ReadShared | Op::Reread => {
                if token < self.highest_exclusive {
                    r.stale_accepted += 1;
                }
                self.highest = self.highest.max(token);
                match op {
                    Op::ReadShared => {
                        self.first_read.insert(owner.to_string(), self.writes);
                    }
                    _ => {
                        if (self.first_read.remove(owner)).is_some_and(|w| w != self.writes) {
                            r.torn_reads += 1;
                        }
                    }
                }
            }
            Op::Enter => {
                self.inside.insert(owner.to_string());
                if let Primitive::Semaphore(n) = setup.primitive {
                    if self.inside.len() > n as usize {
                        r.resource_over_capacity += 1;
                    }
                }
            }
            Op::Exit => self.gone(owner),
        }
    }

    pub(super) fn gone(&mut self, owner: &str) {
        self.inside.remove(owner);
        self.first_read.remove(owner);
    }
}

#[cfg(test)]
mod tests {
    use super::super::setup::{Fence, Primitive, Setup};
    use super::super::testing::{clean, setup, H};
    use crate::torture::history::{Op, Role};

    #[test]
    fn a_stale_access_accepted_fails_when_fenced() {
        let r = clean()
            .access(8, "a", 1, Op::Write, 3, true)
            .check(Fence::All);
        assert_eq!(r.stale_accepted, 1);
        assert!(r
            .violations
            .iter()
            .any(|v| v.starts_with("stale access accepted")));
    }

    #[test]
    fn a_lost_update_fails_when_fenced_and_is_the_control_s_expected_damage() {
        // Both read 0, both write 1: one increment is lost.
        let h = || {
            H::default()
                .acquired(0, "a", 1, 100)
                .access(1, "a", 1, Op::Read, 0, true)
                .fault(2, 150, "pause", Some("a"))
                .acquired(110, "b", 2, 210)
                .access(111, "b", 2, Op::Read, 0, true)
                .access(112, "b", 2, Op::Write, 1, true)
                .released(113, "b", 2, 210)
                .lost(151, "a", 1)
                .access(152, "a", 1, Op::Write, 1, true)
                .released(153, "a", 1, 100)
        };
        let fenced = h().check(Fence::All);
        assert_eq!((fenced.lost_updates, fenced.stale_accepted), (1, 1));
        assert!(fenced
            .violations
            .iter()
            .any(|v| v.starts_with("lost update")));
        let control = h().check(Fence::None);
        assert_eq!(control.lost_updates, 1);
        assert_eq!(control.violations, Vec::<String>::new());
    }

    #[test]
    fn a_write_between_a_reader_s_reads_is_a_torn_read_and_readers_fence_on_writers() {
        // r1 (token 2) reads; its lease ends in a pause; w (token 3) writes; r1 reads again.
        let h = |accepted: bool| {
            H::default()
                .acquired_as(0, 0, "r1", 2, 100, Role::Shared)
                .acquired_as(0, 1, "r2", 1, 100, Role::Shared)
                .access(2, "r1", 2, Op::ReadShared, 0, true)
                .access(3, "r2", 1, Op::ReadShared, 0, true)
                .access(4, "r2", 1, Op::Reread, 0, true)
                .released(5, "r2", 1, 100)
                .fault(6, 300, "pause", Some("r1"))
                .acquired_as(110, 120, "w", 3, 220, Role::Exclusive)
                .access(121, "w", 3, Op::Read, 0, true)
                .access(122, "w", 3, Op::Write, 1, true)
                .released(123, "w", 3, 220)
                .lost(301, "r1", 2)
                .access(302, "r1", 2, Op::Reread, 1, accepted)
                .released(303, "r1", 2, 100)
        };
        // r2's token (1) below r1's (2) is no stale read: readers interleave.
        let fenced = h(false).check_as(&setup(Primitive::RwLock));
        assert_eq!(fenced.violations, Vec::<String>::new());
        assert_eq!((fenced.stale_accepted, fenced.torn_reads), (0, 0));
        let broken = h(true).check_as(&setup(Primitive::RwLock));
        assert_eq!((broken.stale_accepted, broken.torn_reads), (1, 1));
        assert!(broken
            .violations
            .iter()
            .any(|v| v.contains("reader's reads")));
        let control = h(true).check_as(&Setup::new(Fence::None, Primitive::RwLock));
        assert_eq!(control.violations, Vec::<String>::new());
    }

    #[test]
    fn the_permit_gauge_counts_over_capacity_and_is_the_semaphore_control_s_damage() {
        let h = || {
            H::default()
                .acquired_as(0, 0, "a", 1, 100, Role::Permit)
                .access(1, "a", 1, Op::Enter, 1, true)
                .fault(2, 200, "pause", Some("a"))
                .acquired_as(0, 110, "b", 2, 300, Role::Permit)
                .access(111, "b", 2, Op::Enter, 2, true)
                .lost(201, "a", 1)
                .access(202, "a", 1, Op::Exit, 1, true)
                .released(203, "a", 1, 100)
                .access(204, "b", 2, Op::Exit, 0, true)
                .released(205, "b", 2, 300)
        };
        let one = Setup::new(Fence::None, Primitive::Semaphore(1));
        let r = h().check_as(&one);
        assert_eq!((r.resource_over_capacity, r.service_overlap), (1, 0));
        assert_eq!(r.violations, Vec::<String>::new());
        // With two permits nothing was over: the control shows no damage.
        let r = h().check_as(&Setup::new(Fence::None, Primitive::Semaphore(2)));
        assert_eq!(r.resource_over_capacity, 0);
        assert!(r.violations[0].starts_with("the unfenced control showed no damage"));
    }
}
