//! The plan of a run: the names' shapes and the operations, a pure function of the seed.

use std::fmt;

use super::{CLIENTS, OWNERS};
use crate::store::LockKind;

/// The share (percent) of requests for a mutex that give no owner id.
const OWNERLESS: u64 = 70;

pub(super) fn parse_seed(text: &str) -> Option<u64> {
    let text = text.trim();
    match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// SplitMix64: a tiny generator whose sequence for a seed never changes with a
/// dependency's version, so a printed seed replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// How a name is normally used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    Mutex,
    RwLock,
    Semaphore(u32),
}

/// What a request asks for, by the constructor it uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Asked {
    Mutex,
    Read,
    Write,
    Permits(u32),
}

impl Asked {
    pub(super) fn kind(self) -> LockKind {
        match self {
            Asked::Mutex | Asked::Write => LockKind::Exclusive,
            Asked::Read => LockKind::Shared,
            Asked::Permits(permits) => LockKind::Permit { permits },
        }
    }
}

impl fmt::Display for Asked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Asked::Mutex => f.write_str("mutex"),
            Asked::Read => f.write_str("read"),
            Asked::Write => f.write_str("write"),
            Asked::Permits(n) => write!(f, "sem({n})"),
        }
    }
}

/// One request: which client, owner (`None`: none given, as most users ask for a mutex),
/// name, what and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Req {
    pub(super) client: usize,
    pub(super) owner: Option<usize>,
    pub(super) name: usize,
    pub(super) asked: Asked,
    pub(super) fair: bool,
}

impl fmt::Display for Req {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "c{} {} {} n{} {}",
            self.client,
            self.owner.map_or("ownerless", |o| OWNERS[o]),
            self.asked,
            self.name,
            if self.fair { "fair" } else { "unfair" }
        )
    }
}

/// One operation of a sequence. `pick`s choose among what exists when the operation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    /// `try_lock`, or `try_lock_for(BOUNDED)` when `bounded`.
    Try { req: Req, bounded: bool },
    /// `lock()` in a task of its own.
    Wait { req: Req },
    /// Abort a waiting task.
    Cancel { pick: u32 },
    /// Release a held guard.
    Release { pick: u32 },
    /// `try_lock` with a short TTL; a guard is leaked and must end with its lease.
    Expire { req: Req },
    /// Force-release a name.
    Force { name: usize },
    /// Release a held guard and make `req` (a try) at once, racing the waiters the
    /// release lets in.
    Handoff { pick: u32, req: Req },
    /// Downgrade a held guard to a read hold.
    Downgrade { pick: u32 },
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Try {
                req,
                bounded: false,
            } => write!(f, "try      {req}"),
            Op::Try { req, bounded: true } => write!(f, "try_for  {req}"),
            Op::Wait { req } => write!(f, "wait     {req}"),
            Op::Cancel { pick } => write!(f, "cancel   waiter pick {pick}"),
            Op::Release { pick } => write!(f, "release  guard pick {pick}"),
            Op::Expire { req } => write!(f, "expire   {req}"),
            Op::Force { name } => write!(f, "force    n{name}"),
            Op::Handoff { pick, req } => write!(f, "handoff  guard pick {pick}, then try {req}"),
            Op::Downgrade { pick } => write!(f, "downgrade guard pick {pick}"),
        }
    }
}

/// The names' shapes and the operations, from a seed.
pub(super) struct Plan {
    pub(super) shapes: Vec<Shape>,
    pub(super) ops: Vec<Op>,
}

/// Fixed plans, each named by what it once caught.
pub(super) fn regressions() -> Vec<(&'static str, Plan)> {
    let req = |client, owner, asked, fair| Req {
        client,
        owner,
        name: 0,
        asked,
        fair,
    };
    let (ann, bob) = (Some(0), Some(1));
    vec![(
        // The task with its client's gate's turn, waiting in the store, is cancelled, and
        // another client's waiter comes as the next task at that gate takes the turn.
        // Ownerless waiters look alike: the suite took the cancelled one, still in the
        // store for a moment, for the task that took its turn, and then blamed the store
        // for the order the two arrived in.
        "a cancelled turn, and another client's waiter",
        Plan {
            shapes: vec![Shape::Mutex],
            ops: vec![
                Op::Try {
                    req: req(1, bob, Asked::Mutex, false),
                    bounded: false,
                },
                Op::Wait {
                    req: req(0, None, Asked::Mutex, false),
                },
                Op::Wait {
                    req: req(0, None, Asked::Mutex, false),
                },
                Op::Cancel { pick: 0 },
                Op::Wait {
                    req: req(2, ann, Asked::Mutex, true),
                },
                Op::Release { pick: 0 },
            ],
        },
    )]
}

impl Plan {
    pub(super) fn generate(seed: u64, steps: usize) -> Plan {
        let mut rng = Rng(seed);
        let shapes = vec![
            Shape::Mutex,
            Shape::RwLock,
            Shape::Semaphore(2 + rng.below(2) as u32),
        ];
        let ops: Vec<Op> = (0..steps).map(|_| Self::op(&mut rng, &shapes)).collect();
        Plan { shapes, ops }
    }

    fn op(rng: &mut Rng, shapes: &[Shape]) -> Op {
        let req = |rng: &mut Rng| {
            let name = rng.below(shapes.len() as u64) as usize;
            let wrong = rng.chance(6);
            let asked = match (shapes[name], wrong) {
                (Shape::Mutex, false) => Asked::Mutex,
                (Shape::RwLock, false) if rng.chance(50) => Asked::Read,
                (Shape::RwLock, false) => Asked::Write,
                (Shape::Semaphore(n), false) => Asked::Permits(n),
                (Shape::Mutex | Shape::RwLock, true) => Asked::Permits(2 + rng.below(2) as u32),
                (Shape::Semaphore(n), true) => match rng.below(3) {
                    0 => Asked::Mutex,
                    1 => Asked::Read,
                    _ => Asked::Permits(n + 1),
                },
            };
            let client = rng.below(CLIENTS as u64) as usize;
            let owner = rng.below(OWNERS.len() as u64) as usize;
            // A share of mutex requests give no owner: the commonest use. Most of them
            // come from one client, so that its tasks queue at its gate.
            let (client, owner) = match asked == Asked::Mutex && rng.chance(OWNERLESS) {
                true if rng.chance(75) => (0, None),
                true => (client, None),
                false => (client, Some(owner)),
            };
            Req {
                client,
                owner,
                name,
                asked,
                fair: rng.chance(50),
            }
        };
        match rng.below(100) {
            0..=24 => Op::Try {
                req: req(rng),
                bounded: false,
            },
            25..=34 => Op::Try {
                req: req(rng),
                bounded: true,
            },
            35..=52 => Op::Wait { req: req(rng) },
            53..=60 => Op::Cancel {
                pick: rng.next() as u32,
            },
            61..=63 => Op::Expire { req: req(rng) },
            64..=66 => Op::Force {
                name: rng.below(shapes.len() as u64) as usize,
            },
            67..=74 => Op::Handoff {
                pick: rng.next() as u32,
                req: req(rng),
            },
            75..=79 => Op::Downgrade {
                pick: rng.next() as u32,
            },
            _ => Op::Release {
                pick: rng.next() as u32,
            },
        }
    }

    pub(super) fn shapes_text(&self) -> String {
        let shapes: Vec<String> = (self.shapes.iter().enumerate())
            .map(|(i, s)| format!("n{i} {s:?}"))
            .collect();
        shapes.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_operations_and_a_longer_run_extends_a_shorter() {
        let (short, long) = (Plan::generate(7, 50), Plan::generate(7, 200));
        assert_eq!(short.shapes, long.shapes);
        assert_eq!(short.ops[..], long.ops[..50]);
        assert_ne!(Plan::generate(8, 50).ops, short.ops);
        assert_eq!(parse_seed("0x10"), Some(16));
        assert_eq!(parse_seed(" 42 "), Some(42));
    }

    #[test]
    fn every_kind_of_operation_is_generated() {
        let plan = Plan::generate(1, 2000);
        let count = |f: fn(&Op) -> bool| plan.ops.iter().filter(|op| f(op)).count();
        fn ownerless(op: &Op) -> bool {
            match op {
                Op::Try { req, .. } | Op::Wait { req } | Op::Expire { req } => req.owner.is_none(),
                _ => false,
            }
        }
        assert!(
            count(|op| ownerless(op) && matches!(op, Op::Wait { req } if req.client == 0)) > 20
        );
        assert!(count(|op| ownerless(op) && matches!(op, Op::Wait { req } if req.client != 0)) > 5);
        assert!(count(|op| ownerless(op) && matches!(op, Op::Try { .. })) > 20);
        assert!(count(|op| matches!(op, Op::Try { bounded: false, .. })) > 100);
        assert!(count(|op| matches!(op, Op::Try { bounded: true, .. })) > 50);
        assert!(count(|op| matches!(op, Op::Wait { .. })) > 100);
        assert!(count(|op| matches!(op, Op::Cancel { .. })) > 50);
        assert!(count(|op| matches!(op, Op::Release { .. })) > 100);
        assert!(count(|op| matches!(op, Op::Expire { .. })) > 10);
        assert!(count(|op| matches!(op, Op::Force { .. })) > 10);
        assert!(count(|op| matches!(op, Op::Downgrade { .. })) > 50);
        let wrong = |op: &Op| match op {
            Op::Try { req, .. } | Op::Wait { req } | Op::Expire { req } => {
                matches!(
                    (req.name, req.asked),
                    (0 | 1, Asked::Permits(_)) | (2, Asked::Mutex | Asked::Read)
                )
            }
            _ => false,
        };
        assert!(plan.ops.iter().filter(|op| wrong(op)).count() > 20);
    }
}
