//! Fencing tokens, and a small gate for resources that check them.
//!
//! A lease can end while its holder still believes it holds the lock (a long GC or VM
//! pause, a stalled network). The holder's writes then race the next holder's. A
//! fencing token closes that hole: every acquisition of a lock name gets a token larger
//! than any before it, the holder sends it with each write, and the resource refuses a
//! token lower than the highest it has accepted.
//!
//! In SQL, keep the highest accepted token next to the data and make the check part of
//! the write itself:
//!
//! ```sql
//! -- once: ALTER TABLE jobs ADD COLUMN fence BIGINT NOT NULL DEFAULT 0;
//! UPDATE jobs SET state = $1, fence = $2
//!  WHERE id = $3 AND fence <= $2;      -- $2 = guard.check()?.get()
//! -- 0 rows updated: a newer holder has written; stop and do not retry.
//! ```
//!
//! In-process resources can use [`FenceGate`].

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// A token that strictly increases per lock name across holders and is never reused,
/// including across restarts of a store that keeps its data. Re-entering a held lock
/// (same owner) gives the same token.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The number itself, e.g. to store next to a row.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Accepts a token only if it is at least the highest accepted so far.
///
/// ```
/// use leasehold::{FenceGate, FencingToken};
/// let gate = FenceGate::new();
/// assert!(gate.admit(FencingToken(7)));
/// assert!(gate.admit(FencingToken(7)));   // the same holder again
/// assert!(!gate.admit(FencingToken(6)));  // a stale holder
/// assert_eq!(gate.highest(), FencingToken(7));
/// ```
#[derive(Debug, Default)]
pub struct FenceGate {
    highest: AtomicU64,
}

impl FenceGate {
    /// A gate that has seen no token.
    pub fn new() -> Self {
        Self::default()
    }

    /// Admits `token` if it is ≥ every token admitted before, and remembers it.
    ///
    /// `#[must_use]`: `false` is the gate refusing a stale holder, and a write made
    /// anyway is the one fencing exists to stop.
    ///
    /// ```compile_fail
    /// #![deny(unused_must_use)]
    /// leasehold::FenceGate::new().admit(leasehold::FencingToken(1));
    /// ```
    #[must_use = "false means a newer holder has been admitted: do not write"]
    pub fn admit(&self, token: FencingToken) -> bool {
        self.highest.fetch_max(token.0, Ordering::AcqRel) <= token.0
    }

    /// The highest token admitted so far (0 before any).
    pub fn highest(&self) -> FencingToken {
        FencingToken(self.highest.load(Ordering::Acquire))
    }
}
