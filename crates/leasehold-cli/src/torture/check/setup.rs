//! What a history is of: the resource's fencing, the lock, and how the workers ran.

use std::fmt;
use std::str::FromStr;

use serde::{Serialize, Serializer};

use crate::torture::history::Role;

/// How the resource fences (see `--fence`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Fence {
    /// Reject any access whose token is below the highest accepted (reads advance it).
    All,
    /// Check writes only.
    Writes,
    /// No fencing: the unfenced control.
    None,
}

/// Which lock the run tortures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Primitive {
    /// One holder at a time.
    Mutex,
    /// At most N permit holders at a time.
    Semaphore(u32),
    /// Readers together, a writer alone.
    RwLock,
    /// A leader election: the fair mutex of its name, whose holder carries a value.
    Election,
}

impl Primitive {
    /// Whether a hold of kind `b` may be valid beside the holds of `others` (other owners).
    fn admits(self, others: &[Role], b: Role) -> bool {
        match self {
            Primitive::Semaphore(n) => others.len() < n as usize,
            Primitive::Mutex | Primitive::Election => others.is_empty(),
            Primitive::RwLock => {
                others.is_empty()
                    || (b == Role::Shared && others.iter().all(|&a| a == Role::Shared))
            }
        }
    }

    /// How many `a`-holders conflict with `b` joining `others`: pairs for the locks,
    /// one per grant beyond the limit for a semaphore.
    pub(super) fn conflicts(self, others: &[Role], b: Role) -> usize {
        match self {
            Primitive::Semaphore(_) => usize::from(!self.admits(others, b)),
            Primitive::Mutex | Primitive::Election => others.len(),
            Primitive::RwLock => (others.iter())
                .filter(|&&a| a == Role::Exclusive || b == Role::Exclusive)
                .count(),
        }
    }
}

impl fmt::Display for Primitive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Primitive::Mutex => f.write_str("mutex"),
            Primitive::Semaphore(n) => write!(f, "semaphore:{n}"),
            Primitive::RwLock => f.write_str("rwlock"),
            Primitive::Election => f.write_str("election"),
        }
    }
}

impl FromStr for Primitive {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mutex" => Ok(Primitive::Mutex),
            "rwlock" => Ok(Primitive::RwLock),
            "election" => Ok(Primitive::Election),
            _ => {
                let n = s.strip_prefix("semaphore:").ok_or_else(|| {
                    format!("{s:?}: give mutex, semaphore:N (N permits), rwlock or election")
                })?;
                match n.parse::<u32>() {
                    Ok(n) if (1..=1000).contains(&n) => Ok(Primitive::Semaphore(n)),
                    _ => Err(format!("semaphore:{n}: N must be from 1 to 1000")),
                }
            }
        }
    }
}

impl Serialize for Primitive {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// What the history is of, and how it must be judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setup {
    /// How the resource fenced.
    pub fence: Fence,
    /// The lock.
    pub primitive: Primitive,
    /// First come, first served: judge the order of grants.
    pub fair: bool,
    /// Workers are `leasehold run` processes (no deadlines in the history).
    pub via_run: bool,
    /// The workers themselves lock the store for their updates (library workers and
    /// `leasehold run` workers on the local store): a pause of any of them may stall
    /// the store.
    pub workers_lock_the_store: bool,
    /// A restart of the store forgets every lock (Redis without persistence): the
    /// holder it leaves behind overlaps the next one until it learns of the loss, and
    /// fencing is what must refuse it.
    pub store_forgets: bool,
}

impl Setup {
    /// A library-worker run of `primitive`.
    pub fn new(fence: Fence, primitive: Primitive) -> Self {
        Setup {
            fence,
            primitive,
            fair: false,
            via_run: false,
            workers_lock_the_store: false,
            store_forgets: false,
        }
    }
}
