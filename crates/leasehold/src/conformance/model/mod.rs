//! Randomized model-based conformance: random operation sequences from several clients
//! and owners on a few names, run against a store through the public API, each outcome
//! checked against a model built on [the lock rules](crate#the-lock-rules): the library's
//! own decision table, not a second copy of it.
//!
//! # What a run does
//! - **Actors.** Three clients (each its own [`Leasehold`](crate::Leasehold) on the store, as
//!   separate processes would be) and four owner ids (so re-entry happens, also across
//!   clients). Most requests for a mutex give no owner id (the commonest use; most of them
//!   from client 0, so that its tasks queue together): each is then its own owner, and a
//!   non-fair one (a fair one too where the store queues by arrival,
//!   [`Capabilities::queues_by_wait`](crate::store::Capabilities)) waits in its client's gate
//!   behind the task of that client that asks the store or holds the lock. Three names: a
//!   mutex, a read-write lock and a semaphore of 2 or 3 permits; now and then a request asks
//!   for another primitive or another number of permits, which must be refused while the name
//!   is in use (and is granted, and makes the name that primitive, while it is not).
//! - **Operations**, generated up front from the seed as data, independent of outcomes
//!   (an operation that refers to something that does not exist then — a guard to
//!   release, a waiter to cancel — is skipped): `try_lock`; a bounded wait
//!   ([`BOUNDED`]: the driver is sequential, so its outcome is a try's, and a timed-out
//!   wait must leave no place in the queue); an unbounded `lock()` in a task of its own
//!   (a waiter); cancelling a waiter (the task aborted, its future dropped: it must leave
//!   the queue within [`PROMPT`], before its waiter lease could end it); releasing a held
//!   guard; a request with a short TTL whose guard is leaked (not renewed), after which
//!   the store must drop that hold; force-release (the holders' guards must report the
//!   loss); a release followed at once by a try, which races the waiters the release
//!   lets in (the only moment where fairness shows: once the waiters due are served, a
//!   fair and a non-fair request get the same answer). Requests are fair or not, by
//!   request (the rules decide per request).
//! - **Expected outcomes** come from the rules' decision table (`rules::decide`) on the
//!   model's holders and queue. A non-fair request may pass waiters but need not: where the rules for a non-fair and
//!   a fair request differ, either answer is accepted and the model learns the state
//!   from what happened.
//! - **Settling.** After each step the driver waits (on conditions, with deadlines) until
//!   every waiter that the rules grant is granted; when several waiters (and a racing try)
//!   finished, it looks for an order in which each was allowed when it was served (fair
//!   waiters only in their turn). Then it compares the model with
//!   [`Leasehold::describe`](crate::Leasehold::describe): holders (owner, kind, hold count,
//!   token) and waiters (owner and kind, in queue order; an ownerless waiter's owner id is
//!   not known to the model, see `Driver::compare`), from client 0 and from each client with
//!   tasks at its gate.
//! - **Gates.** The model keeps each gate's queue: only the task with the turn is in the
//!   store; a release of a hold with the turn hands it to the gate's next task (which,
//!   when the rules let it in even as a fair request, must be the next holder within
//!   [`PROMPT`]); a task at the gate is never served before it gets the turn (FIFO in
//!   the client); a non-fair task joins the store's queue when it gets the turn, and a
//!   fair one keeps its arrival place (FIFO across clients).
//! - **Invariants** at every step: who holds matches the model; tokens strictly increase
//!   across holders of a name and are unchanged on re-entry; no two incompatible holders
//!   in `describe`; a waiter is granted only when the rules grant it; every waiter the
//!   rules grant is granted; a force-release is seen as lost by the guards, whose release
//!   then says not held. At the end every guard is released and every waiter must be
//!   served, and the names are left empty.
//!
//! # Seeds, budget and replay
//! The seed is `LEASEHOLD_MODEL_SEED` (decimal or `0x` hex) if set, else random; it is
//! printed at the start (`cargo test -- --nocapture` shows it; a failure repeats it).
//! `LEASEHOLD_MODEL_STEPS` sets the number of operations ([`DEFAULT_STEPS`] by default:
//! under 15 s on etcd and Redis Cluster on two loaded cores; most of it is leases left
//! to expire). The operations are a pure function of the seed, and a
//! shorter run is a prefix of a longer one. A longer run, e.g. on etcd:
//!
//! ```text
//! LEASEHOLD_MODEL_STEPS=5000 cargo test -p leasehold --all-features \
//!     --test conformance_etcd model_based -- --nocapture
//! ```
//!
//! On a failure the driver shrinks the sequence (delta debugging: it drops chunks of
//! operations while the rest still fails, on fresh names, for at most
//! `LEASEHOLD_MODEL_SHRINK_SECS`, default 120) and panics with the seed, the failing
//! step, the shrunk sequence and the trace of its last run.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::store::Store;
use plan::{parse_seed, Plan};

/// Fails the check with a message unless `$cond` holds.
macro_rules! ensure {
    ($cond:expr, $($arg:tt)*) => {
        if !$cond {
            return Err(format!($($arg)*));
        }
    };
}

// After `ensure!`, which they use.
mod driver;
mod expected;
mod plan;
mod settle;
mod shrink;

/// Operations per run unless `LEASEHOLD_MODEL_STEPS` says otherwise.
pub const DEFAULT_STEPS: usize = 300;

/// The bound of a bounded wait.
pub const BOUNDED: Duration = Duration::from_millis(100);

/// How soon the store must show a change that needs no waiting on a lease: a new waiter
/// queued, a cancelled one gone. Shorter than any waiter lease can still run after a
/// cancel (half of [`MAX_WAITER_LEASE`](crate::store::MAX_WAITER_LEASE) at least), so a waiter
/// that leaves only when its lease ends is caught.
pub const PROMPT: Duration = Duration::from_secs(2);

const CLIENTS: usize = 3;
const OWNERS: [&str; 4] = ["ann", "bob", "cid", "dee"];

/// A check's outcome: what went wrong, if anything.
type Check<T = ()> = std::result::Result<T, String>;

/// How often each kind of outcome was seen in a run.
type Counts = std::collections::BTreeMap<String, usize>;

/// Runs the fixed plans (`plan::regressions`) on `store`, each on fresh names, checked as a
/// random plan is: cases that once showed a store, or this suite, wrong.
pub async fn model_regressions(store: Arc<dyn Store>) {
    for (case, plan) in plan::regressions() {
        if let Err(failure) = driver::run(&store, &plan, &plan.ops).await {
            panic!(
                "model_regressions: \"{case}\" failed on {}: {failure}\ntrace:\n{}",
                store.describe_store(),
                failure.trace.join("\n")
            );
        }
    }
}

/// Runs the model-based conformance case on `store` (see the [module docs](self)),
/// with fair and non-fair requests.
pub async fn model_based(store: Arc<dyn Store>) {
    let seed = match std::env::var("LEASEHOLD_MODEL_SEED") {
        Ok(text) => parse_seed(&text).expect("LEASEHOLD_MODEL_SEED: a decimal or 0x-hex u64"),
        Err(_) => rand::random(),
    };
    let steps = match std::env::var("LEASEHOLD_MODEL_STEPS") {
        Ok(text) => text.parse().expect("LEASEHOLD_MODEL_STEPS: a number"),
        Err(_) => DEFAULT_STEPS,
    };
    let shrink_for = match std::env::var("LEASEHOLD_MODEL_SHRINK_SECS") {
        Ok(text) => Duration::from_secs(text.parse().expect("LEASEHOLD_MODEL_SHRINK_SECS")),
        Err(_) => Duration::from_secs(120),
    };
    let shown = store.describe_store();
    let case = "model_based";
    eprintln!("{case} on {shown}: LEASEHOLD_MODEL_SEED={seed} LEASEHOLD_MODEL_STEPS={steps}");
    let plan = Plan::generate(seed, steps);
    let started = Instant::now();
    match driver::run(&store, &plan, &plan.ops).await {
        Ok(counts) => {
            let counts: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
            eprintln!(
                "{case} on {shown}: seed {seed}, {steps} steps passed in {:.1?} ({})",
                started.elapsed(),
                counts.join(", ")
            );
        }
        Err(failure) => {
            let report = shrink::report(&store, &plan, failure, shrink_for).await;
            panic!(
                "{case} failed on {shown}\n\
                 replay: LEASEHOLD_MODEL_SEED={seed} LEASEHOLD_MODEL_STEPS={steps}\n{report}"
            );
        }
    }
}
