//! Randomized model-based conformance: random operation sequences from several clients
//! and owners on a few names, run against a store through the public API, each outcome
//! checked against a model built on [the lock rules](crate#the-lock-rules): the library's
//! own decision table, not a second copy of it.
//!
//! # What a run does
//! - **Actors.** Three clients (each its own [`Leasehold`] on the store, as separate
//!   processes would be) and four owner ids (so re-entry happens, also across clients).
//!   Most requests for a mutex give no owner id (the commonest use; most of them from
//!   client 0, so that its tasks queue together): each is then its own owner, and a
//!   non-fair one (a fair one too where the store queues by arrival,
//!   [`Capabilities::queues_by_wait`](crate::store::Capabilities)) waits in its client's gate
//!   behind the task of that client that asks the store or holds the lock. Three names: a mutex, a read-write lock and a semaphore of 2 or 3
//!   permits; now and then a request asks for another primitive or another number of
//!   permits, which must be refused while the name is in use (and is granted, and makes
//!   the name that primitive, while it is not).
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
//! - **Settling.** After each step the driver waits (on conditions, with deadlines)
//!   until every waiter that the rules grant is granted; when several waiters (and a
//!   racing try) finished, it looks for an order in which each was allowed when it was
//!   served (fair waiters only in their turn). Then it compares the model with [`Leasehold::describe`]:
//!   holders (owner, kind, hold count, token) and waiters (owner and kind, in queue
//!   order; an ownerless waiter's owner id is not known to the model, see
//!   `Driver::compare`), from client 0 and from each client with tasks at its gate.
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

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{unique, PATIENCE, SHORT_TTL};
use crate::rules::{self, Decision};
use crate::store::{LockKind, LockState, Released, Store};
use crate::{Error, Leasehold, Lock, LockGuard};

/// Operations per run unless `LEASEHOLD_MODEL_STEPS` says otherwise.
pub const DEFAULT_STEPS: usize = 300;

/// The bound of a bounded wait.
pub const BOUNDED: Duration = Duration::from_millis(100);

/// How soon the store must show a change that needs no waiting on a lease: a new waiter
/// queued, a cancelled one gone. Shorter than any waiter lease can still run after a
/// cancel (half of [`MAX_WAITER_LEASE`](crate::store::MAX_WAITER_LEASE) at least), so a waiter
/// that leaves only when its lease ends is caught.
pub const PROMPT: Duration = Duration::from_secs(2);

/// The lease of every request but the leaked ones: long enough that renewals under load
/// never lapse.
const TTL: Duration = Duration::from_secs(20);

const CLIENTS: usize = 3;
const OWNERS: [&str; 4] = ["ann", "bob", "cid", "dee"];

/// The share (percent) of requests for a mutex that give no owner id.
const OWNERLESS: u64 = 70;

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
    let failure = match run(&store, &plan, &plan.ops).await {
        Ok(counts) => {
            let counts: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
            eprintln!(
                "{case} on {shown}: seed {seed}, {steps} steps passed in {:.1?} ({})",
                started.elapsed(),
                counts.join(", ")
            );
            return;
        }
        Err(failure) => failure,
    };
    let first = failure.to_string();
    let at = failure.step.map_or(String::from("the final drain"), |i| {
        format!("step {i}: {}", plan.ops[i])
    });
    let (ops, last, runs) = shrink(&store, &plan, failure, shrink_for).await;
    let listing: String = ops
        .iter()
        .enumerate()
        .map(|(i, op)| format!("  {i:3}  {op}\n"))
        .collect();
    panic!(
        "{case} failed on {shown}\n\
         replay: LEASEHOLD_MODEL_SEED={seed} LEASEHOLD_MODEL_STEPS={steps}\n\
         shapes: {}\n\
         failed at {at}\n{first}\n\n\
         shrunk to {} operations in {runs} runs:\n{listing}\
         which fail with:\n{}\n\ntrace of that run:\n{}",
        plan.shapes_text(),
        ops.len(),
        last.message,
        last.trace.join("\n")
    );
}

fn parse_seed(text: &str) -> Option<u64> {
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
enum Shape {
    Mutex,
    RwLock,
    Semaphore(u32),
}

/// What a request asks for, by the constructor it uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asked {
    Mutex,
    Read,
    Write,
    Permits(u32),
}

impl Asked {
    fn kind(self) -> LockKind {
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
struct Req {
    client: usize,
    owner: Option<usize>,
    name: usize,
    asked: Asked,
    fair: bool,
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
enum Op {
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
        }
    }
}

/// The names' shapes and the operations, from a seed.
struct Plan {
    shapes: Vec<Shape>,
    ops: Vec<Op>,
}

impl Plan {
    fn generate(seed: u64, steps: usize) -> Plan {
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
            _ => Op::Release {
                pick: rng.next() as u32,
            },
        }
    }

    fn shapes_text(&self) -> String {
        let shapes: Vec<String> = (self.shapes.iter().enumerate())
            .map(|(i, s)| format!("n{i} {s:?}"))
            .collect();
        shapes.join(", ")
    }
}

/// Why a run failed: at which step (`None`: the final drain), what, and the trace.
#[derive(Debug)]
struct Failure {
    step: Option<usize>,
    message: String,
    trace: Vec<String>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

type Check<T = ()> = std::result::Result<T, String>;

type Counts = std::collections::BTreeMap<String, usize>;

macro_rules! ensure {
    ($cond:expr, $($arg:tt)*) => {
        if !$cond {
            return Err(format!($($arg)*));
        }
    };
}

/// A holder in the model: one per owner, its re-entries counted.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Holder {
    owner: String,
    kind: LockKind,
    token: u64,
    holds: u32,
    /// The client whose gate's turn this hold has (an ownerless request that came
    /// through the gate): its release hands the lock to that gate's next task.
    turn: Option<usize>,
}

/// A waiter in the model's queue: the store's order, which is arrival order but for a
/// non-fair task of a gate, which joins the store's queue at its end when it gets the
/// turn.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Waiter {
    id: usize,
    /// Its owner id; an ownerless request's is unknown until granted (`~w` and its id).
    owner: String,
    kind: LockKind,
    fair: bool,
    /// The client whose gate it goes through (see [`gated`]).
    gate: Option<usize>,
    /// Still at the gate, behind the task that has its turn: not in the store. A fair
    /// one keeps its arrival place all the same (the store queues it by how long it
    /// waited in its process when it comes); a non-fair one has no place in the rules'
    /// queue until it gets the turn.
    at_gate: bool,
}

impl Waiter {
    /// Whether the rules count it in the queue.
    fn queued(&self) -> bool {
        !self.at_gate || self.fair
    }
}

/// Whether `req` waits in its client's gate (gate.rs) before the store: an exclusive
/// request without an owner, fair ones only where the store queues by arrival.
fn gated(req: &Req, queues_by_wait: bool) -> bool {
    req.owner.is_none() && req.asked.kind() == LockKind::Exclusive && (!req.fair || queues_by_wait)
}

/// The gate `req` waits at: a client's fair and non-fair requests have gates of their
/// own. [`client_of`] gives its client back.
fn gate_of(req: &Req) -> usize {
    req.client * 2 + usize::from(req.fair)
}

fn client_of(gate: usize) -> usize {
    gate / 2
}

/// The model's name for an ownerless waiter until it is granted and its guard tells.
fn unnamed(id: usize) -> String {
    format!("~w{id}")
}

/// One name in the model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Name {
    holders: Vec<Holder>,
    waiters: Vec<Waiter>,
    /// The highest token seen granted on this name.
    last_token: u64,
}

/// What a request got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Granted { token: u64, holds: u32 },
    Busy,
    Refused,
}

impl Name {
    fn decide(&self, me: Option<usize>, owner: &str, kind: LockKind, fair: bool) -> Decision {
        let holders: Vec<rules::Holder> = (self.holders.iter())
            .map(|h| rules::Holder {
                owner: &h.owner,
                kind: h.kind,
            })
            .collect();
        let waiters: Vec<rules::Waiter> = (self.waiters.iter())
            .filter(|w| w.queued())
            .map(|w| rules::Waiter {
                owner: &w.owner,
                kind: w.kind,
            })
            .collect();
        let me = me.map(|i| self.waiters[..i].iter().filter(|w| w.queued()).count());
        rules::decide(&holders, &waiters, me, &rules::Ask { owner, kind, fair })
    }

    /// Whether `client`'s gate is busy: one of its tasks holds the lock or is in the
    /// store's queue, and others wait behind it.
    fn gate_busy(&self, gate: usize) -> bool {
        self.holders.iter().any(|h| h.turn == Some(gate))
            || self.waiters.iter().any(|w| w.gate == Some(gate))
    }

    /// `client`'s gate passes its turn on (the task with it ended, or its hold did):
    /// the next task at the gate asks the store, or is handed the lock. A fair one keeps
    /// its arrival place; a non-fair one joins the store's queue at its end. The task,
    /// if any.
    fn pass_turn(&mut self, client: usize) -> Option<usize> {
        let i = (self.waiters.iter()).position(|w| w.gate == Some(client) && w.at_gate)?;
        let id = self.waiters[i].id;
        self.waiters[i].at_gate = false;
        if !self.waiters[i].fair {
            let w = self.waiters.remove(i);
            self.waiters.push(w);
        }
        Some(id)
    }

    /// What the rules allow: a non-fair request may pass waiters, so it may also get
    /// what a fair one would.
    fn allowed(&self, me: Option<usize>, owner: &str, kind: LockKind, fair: bool) -> Vec<Decision> {
        let mut allowed = vec![self.decide(me, owner, kind, fair)];
        if !fair {
            let strict = self.decide(me, owner, kind, true);
            if !allowed.contains(&strict) {
                allowed.push(strict);
            }
        }
        allowed
    }

    /// Whether `outcome` is what `decision` gives here.
    fn fits(&self, decision: &Decision, outcome: Outcome) -> bool {
        match (decision, outcome) {
            (Decision::Reenter(i), Outcome::Granted { token, holds }) => {
                let h = &self.holders[*i];
                token == h.token && holds == h.holds + 1
            }
            (Decision::Grant, Outcome::Granted { token, holds }) => {
                token > self.last_token && holds == 1
            }
            (Decision::Wait { .. }, Outcome::Busy) => true,
            (Decision::Refuse(_), Outcome::Refused) => true,
            _ => false,
        }
    }

    /// The first of `allowed` that `outcome` fits, applied to the model. `turn`: the
    /// client whose gate's turn the request has (a direct request that passed its gate).
    fn apply(
        &mut self,
        allowed: &[Decision],
        outcome: Outcome,
        me: Option<usize>,
        owner: &str,
        kind: LockKind,
        turn: Option<usize>,
    ) -> Check {
        let Some(decision) = allowed.iter().find(|d| self.fits(d, outcome)) else {
            return Err(format!(
                "{owner} asking {kind:?} got {outcome:?}; the rules allow {allowed:?}"
            ));
        };
        let turn = me.map_or(turn, |i| self.waiters[i].gate);
        match (decision, outcome) {
            (Decision::Reenter(i), _) => self.holders[*i].holds += 1,
            (Decision::Grant, Outcome::Granted { token, .. }) => {
                self.holders.push(Holder {
                    owner: owner.to_string(),
                    kind,
                    token,
                    holds: 1,
                    turn,
                });
                self.last_token = token;
            }
            _ => {}
        }
        if let (Some(i), Outcome::Granted { .. } | Outcome::Refused) = (me, outcome) {
            self.waiters.remove(i);
            if let (Some(client), Outcome::Refused) = (turn, outcome) {
                self.pass_turn(client);
            }
        }
        Ok(())
    }

    /// Whether the rules serve waiter `i` now whatever the fairness of anyone: it must be
    /// granted (or refused), or someone else served in its stead.
    fn must_serve(&self, i: usize) -> bool {
        let w = &self.waiters[i];
        !w.at_gate
            && !matches!(
                self.decide(Some(i), &w.owner, w.kind, true),
                Decision::Wait { .. }
            )
    }

    /// Drops one hold of `owner`; the task its gate's turn went to when that was the
    /// last (see [`pass_turn`](Self::pass_turn)).
    fn drop_hold(&mut self, owner: &str) -> Option<usize> {
        let i = self.holders.iter().position(|h| h.owner == owner)?;
        self.holders[i].holds -= 1;
        if self.holders[i].holds > 0 {
            return None;
        }
        let turn = self.holders.remove(i).turn?;
        self.pass_turn(turn)
    }

    fn text(&self) -> String {
        let holders: Vec<String> = (self.holders.iter())
            .map(|h| {
                let turn = h
                    .turn
                    .map_or(String::new(), |g| format!(" with c{}'s turn", client_of(g)));
                format!("{} {:?} x{} #{}{turn}", h.owner, h.kind, h.holds, h.token)
            })
            .collect();
        let waiters: Vec<String> = (self.waiters.iter())
            .map(|w| {
                let fair = if w.fair { "fair" } else { "unfair" };
                let gate = match (w.gate, w.at_gate) {
                    (Some(g), true) => format!(" at c{}'s gate", client_of(g)),
                    (Some(g), false) => format!(" with c{}'s turn", client_of(g)),
                    (None, _) => String::new(),
                };
                format!("w{} {} {:?} {fair}{gate}", w.id, w.owner, w.kind)
            })
            .collect();
        format!(
            "holders [{}], waiters [{}], last token {}",
            holders.join(", "),
            waiters.join(", "),
            self.last_token
        )
    }
}

/// The id of a direct request among ended waiters in [`serve_order`].
const DIRECT: usize = usize::MAX;

/// A request made at once after a release, before the waiters it lets in are served:
/// checked with them, in an order the rules allow.
#[derive(Debug)]
struct Direct {
    name: usize,
    /// Its owner id (an ownerless request's from its guard if granted, else `~`).
    owner: String,
    kind: LockKind,
    fair: bool,
    /// The client whose gate it passed.
    turn: Option<usize>,
    outcome: Outcome,
    guard: Option<LockGuard>,
    /// When it was answered.
    since: Instant,
}

/// A request that ended: its id ([`DIRECT`] for the racing one), name, request, outcome
/// and guard.
type Ended = (usize, usize, Option<Req>, Outcome, Option<LockGuard>);

/// A guard the driver holds.
#[derive(Debug)]
struct Held {
    id: usize,
    name: usize,
    owner: String,
    /// The client whose gate's turn it has.
    turn: Option<usize>,
    guard: LockGuard,
}

/// A task of a gate that a release handed the lock to.
#[derive(Debug)]
struct Handed {
    name: usize,
    id: usize,
    since: Instant,
}

/// A waiting `lock()` task; aborted when dropped.
#[derive(Debug)]
struct Task {
    id: usize,
    name: usize,
    req: Req,
    handle: JoinHandle<crate::Result<LockGuard>>,
}

impl Drop for Task {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

/// One run of a sequence on fresh names.
struct Driver {
    clients: Vec<Leasehold>,
    names: Vec<String>,
    shapes: Vec<Shape>,
    model: Vec<Name>,
    held: Vec<Held>,
    tasks: Vec<Task>,
    next_id: usize,
    trace: Vec<String>,
    /// A request racing the waiters a release let in, to check with them.
    direct: Option<Direct>,
    /// Ended requests of a name kept back, with the racing request, until the waiters
    /// still running there have finished (see [`collect`](Self::collect)).
    parked: Vec<Ended>,
    /// Whether the store queues a fair request by how long it waited in its process
    /// ([`Capabilities::queues_by_wait`](crate::store::Capabilities)): fair ownerless requests
    /// then wait in their client's gate too.
    queues_by_wait: bool,
    /// Gate tasks that a release handed the lock to in its own store step, by name: each
    /// must be the next holder of its name, within [`PROMPT`] of the release.
    handed: Vec<Handed>,
    /// The owner ids of ownerless guards so far: each must be new.
    anonymous: std::collections::HashSet<String>,
    /// How often each kind of outcome was seen, to show what a run exercised.
    counts: std::collections::BTreeMap<String, usize>,
}

/// Runs `ops` on fresh names; a panic in the driver is a failure too.
async fn run(store: &Arc<dyn Store>, plan: &Plan, ops: &[Op]) -> Result<Counts, Failure> {
    let shapes = &plan.shapes;
    let base = unique("model");
    let driver = Driver {
        clients: (0..CLIENTS)
            .map(|_| Leasehold::from_store(store.clone()))
            .collect(),
        names: (0..shapes.len()).map(|i| format!("{base}/n{i}")).collect(),
        shapes: shapes.to_vec(),
        model: vec![Name::default(); shapes.len()],
        held: Vec::new(),
        tasks: Vec::new(),
        next_id: 0,
        trace: Vec::new(),
        counts: Default::default(),
        direct: None,
        parked: Vec::new(),
        queues_by_wait: store.capabilities().queues_by_wait,
        handed: Vec::new(),
        anonymous: Default::default(),
    };
    let ops = ops.to_vec();
    match tokio::spawn(driver.run(ops)).await {
        Ok(outcome) => outcome,
        Err(e) => {
            let message = match e.try_into_panic() {
                Ok(panic) => panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic".into()),
                Err(e) => e.to_string(),
            };
            Err(Failure {
                step: None,
                message: format!("the driver panicked: {message}"),
                trace: Vec::new(),
            })
        }
    }
}

impl Driver {
    async fn run(mut self, ops: Vec<Op>) -> Result<Counts, Failure> {
        for (i, op) in ops.iter().enumerate() {
            let line = format!("{i:3}  {op}");
            self.trace.push(line);
            if let Err(message) = self.step(*op).await {
                return Err(self.failure(Some(i), message));
            }
        }
        self.trace.push("     drain".into());
        if let Err(message) = self.drain().await {
            return Err(self.failure(None, message));
        }
        Ok(std::mem::take(&mut self.counts))
    }

    fn count(&mut self, what: impl fmt::Display) {
        *self.counts.entry(what.to_string()).or_default() += 1;
    }

    fn failure(&mut self, step: Option<usize>, message: String) -> Failure {
        let state: Vec<String> = (self.model.iter().enumerate())
            .map(|(i, n)| format!("  model n{i} ({:?}): {}", self.shapes[i], n.text()))
            .collect();
        Failure {
            step,
            message: format!("{message}\n{}", state.join("\n")),
            trace: std::mem::take(&mut self.trace),
        }
    }

    fn note(&mut self, what: impl fmt::Display) {
        if let Some(last) = self.trace.last_mut() {
            last.push_str(&format!("  -> {what}"));
        }
    }

    fn lock(&self, req: &Req, ttl: Duration) -> Lock {
        let locks = &self.clients[req.client];
        let name = self.names[req.name].as_str();
        let lock = match req.asked {
            Asked::Mutex => locks.mutex(name),
            Asked::Read => locks.read(name),
            Asked::Write => locks.write(name),
            Asked::Permits(n) => locks.semaphore(name, n),
        };
        let lock = lock.expect("model names and permits are valid");
        let lock = match req.owner {
            Some(owner) => lock.with_owner(OWNERS[owner]),
            None => lock,
        };
        lock.with_fair(req.fair).with_ttl(ttl)
    }

    fn gated(&self, req: &Req) -> bool {
        gated(req, self.queues_by_wait)
    }

    /// Drops one hold of `owner` on `name` from the model. When that hands the turn of
    /// a gate to a task that the rules let in now even as a fair request, the release
    /// handed it the lock in its own store step: it must be the next holder, promptly.
    fn released(&mut self, name: usize, owner: &str) {
        let model = &mut self.model[name];
        let Some(id) = model.drop_hold(owner) else {
            return;
        };
        let i = (model.waiters.iter().position(|w| w.id == id)).expect("the task with the turn");
        let w = &model.waiters[i];
        if model.decide(Some(i), &w.owner, w.kind, true) == Decision::Grant {
            self.note(format!("hands over to w{id}"));
            self.handed.push(Handed {
                name,
                id,
                since: Instant::now(),
            });
        }
    }

    async fn step(&mut self, op: Op) -> Check {
        match op {
            Op::Try { req, bounded } => {
                let lock = self.lock(&req, TTL);
                let got = match bounded {
                    false => lock.try_lock().await,
                    true => lock.try_lock_for(BOUNDED).await,
                };
                if let Some(guard) = self.request(&req, got)? {
                    self.hold_ownerless(&req, guard.owner())?;
                    self.hold(req.name, guard);
                }
                self.settle(PROMPT).await
            }
            Op::Expire { req } => {
                let got = self.lock(&req, SHORT_TTL).try_lock().await;
                if let Some(guard) = self.request(&req, got)? {
                    let owner = guard.owner().to_string();
                    self.hold_ownerless(&req, &owner)?;
                    // Leaking passes on its gate's turn, if it had one: the next task
                    // asks the store, and waits for the lease to end.
                    let _lease = guard.leak();
                    self.model[req.name].drop_hold(&owner);
                    self.note("leaked; waiting for the lease to end");
                    self.count("expired");
                    return self.settle(PATIENCE).await;
                }
                self.settle(PROMPT).await
            }
            Op::Wait { req } => {
                let id = self.next_id;
                self.next_id += 1;
                let lock = self.lock(&req, TTL);
                let handle = tokio::spawn(async move { lock.lock().await });
                self.tasks.push(Task {
                    id,
                    name: req.name,
                    req,
                    handle,
                });
                let gate = self.gated(&req).then_some(gate_of(&req));
                let at_gate = gate.is_some_and(|c| self.model[req.name].gate_busy(c));
                self.model[req.name].waiters.push(Waiter {
                    id,
                    owner: req
                        .owner
                        .map_or_else(|| unnamed(id), |o| OWNERS[o].to_string()),
                    kind: req.asked.kind(),
                    fair: req.fair,
                    gate,
                    at_gate,
                });
                match at_gate {
                    true => {
                        self.note(format!("w{id}, at c{}'s gate", req.client));
                        self.count("queued at a gate");
                    }
                    false => self.note(format!("w{id}")),
                }
                self.settle(PROMPT).await
            }
            Op::Cancel { pick } => {
                if self.tasks.is_empty() {
                    self.note("skipped: nobody waits");
                    self.count("skipped");
                    return Ok(());
                }
                let task = self.tasks.remove(pick as usize % self.tasks.len());
                self.note(format!("w{}", task.id));
                self.count("cancelled");
                task.handle.abort();
                let (id, name) = (task.id, task.name);
                let mut task = task;
                match (&mut task.handle).await {
                    Err(e) if e.is_cancelled() => {}
                    Err(e) => return Err(format!("waiter w{id} failed: {e}")),
                    Ok(got) => {
                        return Err(format!(
                            "waiter w{id}, which the model says waits, had ended: {:?}",
                            got.map(|g| g.token())
                        ))
                    }
                }
                let model = &mut self.model[name];
                let i = (model.waiters.iter().position(|w| w.id == id)).expect("a waiter");
                let w = model.waiters.remove(i);
                // The task with its gate's turn passes it on as it goes; one at the gate
                // just leaves it.
                if let (Some(client), false) = (w.gate, w.at_gate) {
                    model.pass_turn(client);
                }
                self.settle(PROMPT)
                    .await
                    .map_err(|e| format!("after cancelling waiter w{id}: {e}"))
            }
            Op::Release { pick } | Op::Handoff { pick, .. } => {
                if self.held.is_empty() {
                    self.note("skipped: nothing held");
                    self.count("skipped");
                    return Ok(());
                }
                let held = self.held.remove(pick as usize % self.held.len());
                self.note(format!("g{} {} n{}", held.id, held.owner, held.name));
                ensure!(
                    !held.guard.is_lost(),
                    "guard g{} is lost though nothing ended it",
                    held.id
                );
                let released = held.guard.release().await;
                ensure!(
                    matches!(released, Ok(Released::Released)),
                    "releasing g{} gave {released:?}",
                    held.id
                );
                self.released(held.name, &held.owner);
                if let Op::Handoff { req, .. } = op {
                    let got = self.lock(&req, TTL).try_lock().await;
                    let (outcome, guard) = outcome_of(got)?;
                    self.note(format!("then {outcome:?}"));
                    let owner = match (req.owner, &guard) {
                        (Some(owner), _) => OWNERS[owner].to_string(),
                        (None, Some(guard)) => guard.owner().to_string(),
                        (None, None) => "~".into(),
                    };
                    if guard.is_some() {
                        self.hold_ownerless(&req, &owner)?;
                    }
                    self.direct = Some(Direct {
                        name: req.name,
                        owner,
                        kind: req.asked.kind(),
                        fair: req.fair,
                        turn: self.gated(&req).then_some(gate_of(&req)),
                        outcome,
                        guard,
                        since: Instant::now(),
                    });
                }
                self.settle(PROMPT).await
            }
            Op::Force { name } => {
                // A force-release frees the lock in the store before the guard with its
                // gate's turn hands the turn on, so store waiters may be let in ahead of
                // the fair tasks at that gate, whose arrival place the model keeps: a race
                // the model does not pin down, so it leaves that case out.
                let model = &self.model[name];
                let turns: Vec<usize> = model.holders.iter().filter_map(|h| h.turn).collect();
                if (model.waiters.iter())
                    .any(|w| w.fair && w.at_gate && w.gate.is_some_and(|c| turns.contains(&c)))
                {
                    self.note("skipped: fair tasks wait at the holder's gate");
                    self.count("skipped");
                    return Ok(());
                }
                let was_held = !self.model[name].holders.is_empty();
                let forced = self.clients[0]
                    .force_release(self.names[name].as_str())
                    .await;
                self.note(format!("{forced:?}"));
                self.count("forced");
                ensure!(
                    matches!(forced, Ok(held) if held == was_held),
                    "force_release gave {forced:?}; the model says held: {was_held}"
                );
                self.model[name].holders.clear();
                let (lost, kept): (Vec<Held>, Vec<Held>) = std::mem::take(&mut self.held)
                    .into_iter()
                    .partition(|h| h.name == name);
                self.held = kept;
                for held in lost {
                    let seen = tokio::time::timeout(PATIENCE, held.guard.lost()).await;
                    ensure!(
                        seen.is_ok(),
                        "guard g{} did not see the force-release within {PATIENCE:?}",
                        held.id
                    );
                    ensure!(
                        held.guard.check().is_err(),
                        "g{} checks ok after its loss",
                        held.id
                    );
                    let released = held.guard.release().await;
                    ensure!(
                        matches!(released, Ok(Released::NotHeld)),
                        "releasing force-released g{} gave {released:?}",
                        held.id
                    );
                    // Its release passed its gate's turn on (no hand-over is promised:
                    // the store may have let a waiter in at the force-release).
                    if let Some(client) = held.turn {
                        self.model[name].pass_turn(client);
                    }
                }
                self.settle(PROMPT).await
            }
        }
    }

    /// Checks the outcome of a direct request (a try or bounded wait) against the model
    /// and applies it; the guard, if granted.
    fn request(
        &mut self,
        req: &Req,
        got: crate::Result<Option<LockGuard>>,
    ) -> Check<Option<LockGuard>> {
        let (outcome, guard) = outcome_of(got)?;
        self.note(format!("{outcome:?}"));
        // An ownerless request's owner is its guard's (checked new in `hold`); one not
        // granted has none the rules could match.
        let owner = match (req.owner, &guard) {
            (Some(owner), _) => OWNERS[owner],
            (None, Some(guard)) => guard.owner(),
            (None, None) => "~",
        }
        .to_string();
        let kind = req.asked.kind();
        let turn = self.gated(req).then_some(gate_of(req));
        let name = &mut self.model[req.name];
        // A task of its client's gate has the turn: the request waits behind it at the
        // gate and never reaches the store.
        ensure!(
            !turn.is_some_and(|c| name.gate_busy(c)) || outcome == Outcome::Busy,
            "a request passed its client's gate, whose turn another task has: {outcome:?}"
        );
        let allowed = name.allowed(None, &owner, kind, req.fair);
        let reentry = matches!(allowed[..], [Decision::Reenter(_), ..]);
        name.apply(&allowed, outcome, None, &owner, kind, turn)?;
        self.count(match outcome {
            Outcome::Granted { .. } if reentry => "re-entered",
            Outcome::Granted { .. } if req.owner.is_none() => "granted ownerless",
            Outcome::Granted { .. } => "granted",
            Outcome::Busy => "busy",
            Outcome::Refused => "refused",
        });
        Ok(guard)
    }

    /// Checks that an ownerless request's owner id is new: none of the model's owners,
    /// and unique to the acquisition (so it never re-enters another).
    fn hold_ownerless(&mut self, req: &Req, owner: &str) -> Check {
        if req.owner.is_some() {
            return Ok(());
        }
        ensure!(
            !OWNERS.contains(&owner) && self.anonymous.insert(owner.to_string()),
            "an ownerless guard has the owner id {owner:?}, which is not new"
        );
        Ok(())
    }

    fn hold(&mut self, name: usize, guard: LockGuard) {
        let id = self.next_id;
        self.next_id += 1;
        let owner = guard.owner().to_string();
        let turn = (self.model[name].holders.iter())
            .find(|h| h.owner == owner)
            .and_then(|h| h.turn);
        self.held.push(Held {
            id,
            name,
            owner,
            turn,
            guard,
        });
    }

    /// Waits until every waiter the rules serve is served (checking each against the
    /// rules) and the store shows the model's state, which must come within `within`
    /// once no waiter is due.
    async fn settle(&mut self, within: Duration) -> Check {
        let started = Instant::now();
        let mut quiet: Option<Instant> = None;
        loop {
            if self.collect().await? {
                quiet = None;
                continue;
            }
            let due = (self.model.iter().enumerate()).find_map(|(n, name)| {
                (0..name.waiters.len())
                    .find(|&i| name.must_serve(i))
                    .map(|i| (n, name.waiters[i].id))
            });
            if let Some(late) = (self.handed.iter()).find(|h| h.since.elapsed() >= PROMPT) {
                return Err(format!(
                    "w{} on n{}, handed the lock by the release before, is not its holder after {PROMPT:?}",
                    late.id, late.name
                ));
            }
            if let Some((n, id)) = due {
                ensure!(
                    started.elapsed() < PATIENCE,
                    "waiter w{id} on n{n} is due by the rules but still waits after {PATIENCE:?}"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            let since = *quiet.get_or_insert_with(Instant::now);
            match self.compare().await? {
                None => return Ok(()),
                Some(diff) => ensure!(
                    since.elapsed() < within,
                    "the store disagrees with the model after {within:?}: {diff}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Takes the waiters that ended and checks there is an order in which the rules
    /// allowed each; applies it. Whether any ended.
    async fn collect(&mut self) -> Check<bool> {
        let (done, waiting): (Vec<Task>, Vec<Task>) = std::mem::take(&mut self.tasks)
            .into_iter()
            .partition(|t| t.handle.is_finished());
        self.tasks = waiting;
        let direct = self.direct.take();
        let mut ended: Vec<Ended> = std::mem::take(&mut self.parked);
        if done.is_empty() && direct.is_none() && ended.is_empty() {
            return Ok(false);
        }
        let parked_direct = ended.iter().any(|e| e.0 == DIRECT);
        for mut task in done {
            let got = (&mut task.handle).await;
            let (outcome, guard) = match got {
                Ok(Ok(guard)) => (
                    Outcome::Granted {
                        token: guard.token().get(),
                        holds: guard.holds(),
                    },
                    Some(guard),
                ),
                Ok(Err(Error::Conflict { .. })) => (Outcome::Refused, None),
                Ok(Err(e)) => return Err(format!("waiter w{} failed: {e}", task.id)),
                Err(e) => return Err(format!("waiter w{} panicked: {e}", task.id)),
            };
            ended.push((task.id, task.name, Some(task.req), outcome, guard));
        }
        let direct = direct.map(|mut d| {
            if !parked_direct {
                ended.push((DIRECT, d.name, None, d.outcome, d.guard.take()));
            }
            d
        });
        let mut applied = false;
        for n in 0..self.model.len() {
            let mine: Vec<(usize, Outcome)> = (ended.iter())
                .filter(|e| e.1 == n)
                .map(|e| (e.0, e.3))
                .collect();
            if mine.is_empty() {
                continue;
            }
            let direct = direct.as_ref().filter(|d| d.name == n);
            let Some((order, after)) = serve_order(&self.model[n], &mine, direct) else {
                // A waiter the release let in can be granted in the store before the
                // racing request was answered, while its task is still on its way back
                // (a call after the grant): keep this name's outcomes back until the
                // waiters still running there have finished, for a while.
                let running = self.tasks.iter().any(|t| t.name == n);
                if running && direct.is_some_and(|d| d.since.elapsed() < PATIENCE) {
                    let (kept, rest): (Vec<Ended>, Vec<Ended>) =
                        ended.into_iter().partition(|e| e.1 == n);
                    self.parked.extend(kept);
                    self.count("racing request judged once a grant came back");
                    ended = rest;
                    continue;
                }
                let got: Vec<String> = (mine.iter())
                    .map(|(id, o)| match *id {
                        DIRECT => format!("the request after the release: {o:?}"),
                        id => format!("w{id}: {o:?}"),
                    })
                    .collect();
                return Err(format!(
                    "on n{n}, requests ended as the rules do not allow, in any order: {}\n  model n{n} before: {}",
                    got.join(", "),
                    self.model[n].text()
                ));
            };
            self.model[n] = after;
            applied = true;
            // A gate task handed the lock by a release is the next holder of the name.
            if let Some(h) = self.handed.iter().position(|h| h.name == n) {
                let first = (mine.iter())
                    .filter_map(|(id, o)| match o {
                        Outcome::Granted { token, .. } => Some((*token, *id)),
                        _ => None,
                    })
                    .min();
                if let Some((_, id)) = first {
                    let want = self.handed.remove(h).id;
                    ensure!(
                        id == want,
                        "on n{n}, the release handed the lock to w{want}, but {} got it first",
                        if id == DIRECT {
                            "the racing request".to_string()
                        } else {
                            format!("w{id}")
                        }
                    );
                    self.count("handed over in a gate");
                }
            }
            for id in order {
                let at = ended
                    .iter()
                    .position(|e| e.0 == id)
                    .expect("an ended waiter");
                let (id, name, req, outcome, guard) = ended.remove(at);
                // An ownerless waiter's owner is known once granted: its guard's.
                if let (Some(req @ Req { owner: None, .. }), Some(guard)) = (req, &guard) {
                    let owner = guard.owner().to_string();
                    self.hold_ownerless(&req, &owner)?;
                    let model = &mut self.model[name];
                    if let Some(h) = model.holders.iter_mut().find(|h| h.owner == unnamed(id)) {
                        h.owner = owner;
                    }
                }
                match req {
                    Some(req) => {
                        self.trace
                            .push(format!("       w{id} ({req}) ended: {outcome:?}"));
                        self.count(match outcome {
                            Outcome::Refused => "waiter refused",
                            _ => "waiter served",
                        });
                    }
                    None => {
                        self.trace
                            .push(format!("       the racing request: {outcome:?}"));
                        self.count("raced a hand-over");
                    }
                }
                if let Some(guard) = guard {
                    self.hold(name, guard);
                }
            }
        }
        if !self.parked.is_empty() {
            self.direct = direct;
        }
        Ok(applied)
    }

    /// `None` if every name's `describe` shows the model; else what differs. Fails at
    /// once on what no moment may show (incompatible holders) or on a store error.
    ///
    /// `describe` lists the store's waiters, then the tasks waiting at the gate of the
    /// client that asks (only it knows them): client 0 is asked always, another client
    /// when the model has tasks at its gate. Every holder is compared whole: an ownerless
    /// holder's owner id is its guard's. An ownerless waiter's owner id is not compared:
    /// it is made inside `lock()` and no answer gives it to the caller before the lock
    /// is granted; the model checks only that it is none of the named owners.
    async fn compare(&self) -> Check<Option<String>> {
        for (n, name) in self.names.iter().enumerate() {
            let model = &self.model[n];
            for client in 0..CLIENTS {
                let at_gate = |w: &&Waiter| w.at_gate && w.gate.map(client_of) == Some(client);
                if client > 0 && !model.waiters.iter().any(|w| at_gate(&w)) {
                    continue;
                }
                let state = (self.clients[client].describe(name.as_str()).await)
                    .map_err(|e| format!("describe n{n} from c{client} failed: {e}"))?;
                compatible(&state).map_err(|e| format!("n{n}: {e}"))?;
                let mut seen: Vec<(String, LockKind, u32, u64)> = (state.holders.iter())
                    .map(|h| (h.owner.clone(), h.kind, h.holds, h.token.get()))
                    .collect();
                seen.sort_by_key(|h| h.3);
                let mut want: Vec<(String, LockKind, u32, u64)> = (model.holders.iter())
                    .map(|h| (h.owner.clone(), h.kind, h.holds, h.token))
                    .collect();
                want.sort_by_key(|h| h.3);
                let queued: Vec<(String, LockKind)> = (state.waiters.iter())
                    .map(|w| (w.owner.clone(), w.kind))
                    .collect();
                let mut gate: Vec<&Waiter> = model.waiters.iter().filter(at_gate).collect();
                gate.sort_by_key(|w| w.id);
                let queue: Vec<(Option<String>, LockKind)> = (model.waiters.iter())
                    .filter(|w| !w.at_gate)
                    .chain(gate)
                    .map(|w| ((!w.owner.starts_with('~')).then(|| w.owner.clone()), w.kind))
                    .collect();
                let fits = |(seen, want): (&(String, LockKind), &(Option<String>, LockKind))| {
                    seen.1 == want.1
                        && match &want.0 {
                            Some(owner) => &seen.0 == owner,
                            None => !OWNERS.contains(&seen.0.as_str()),
                        }
                };
                if seen != want
                    || queued.len() != queue.len()
                    || !queued.iter().zip(&queue).all(fits)
                {
                    return Ok(Some(format!(
                        "n{n} from c{client}: the store has holders {seen:?} and waiters {queued:?}; the model {want:?} and {queue:?} (None: an ownerless waiter)"
                    )));
                }
            }
        }
        Ok(None)
    }

    /// Releases every guard, oldest first, letting waiters in; all must be served and
    /// the names left empty.
    async fn drain(&mut self) -> Check {
        loop {
            if !self.held.is_empty() {
                let held = self.held.remove(0);
                let released = held.guard.release().await;
                ensure!(
                    matches!(released, Ok(Released::Released)),
                    "releasing g{} at the end gave {released:?}",
                    held.id
                );
                self.released(held.name, &held.owner);
                self.settle(PROMPT).await?;
                continue;
            }
            let waiting: Vec<String> = self.tasks.iter().map(|t| format!("w{}", t.id)).collect();
            ensure!(
                waiting.is_empty(),
                "waiters {waiting:?} never served, with nothing held"
            );
            return Ok(());
        }
    }
}

/// An order in which the rules allowed each ended waiter `(id, outcome)` when it was
/// served, and the model after it; `None` if there is none.
fn serve_order(
    name: &Name,
    ended: &[(usize, Outcome)],
    direct: Option<&Direct>,
) -> Option<(Vec<usize>, Name)> {
    if ended.is_empty() {
        return Some((Vec::new(), name.clone()));
    }
    // Grants in token order first: the likeliest order.
    let mut tries: Vec<usize> = (0..ended.len()).collect();
    tries.sort_by_key(|&j| match ended[j].1 {
        Outcome::Granted { token, .. } => token,
        _ => 0,
    });
    for j in tries {
        let (id, outcome) = ended[j];
        let (me, owner, kind, fair, turn) = match (id, direct) {
            (DIRECT, Some(d)) => (None, d.owner.clone(), d.kind, d.fair, d.turn),
            _ => {
                let me = name.waiters.iter().position(|w| w.id == id)?;
                let w = &name.waiters[me];
                // A task still behind its gate's turn cannot have been served.
                if w.at_gate {
                    continue;
                }
                (Some(me), w.owner.clone(), w.kind, w.fair, None)
            }
        };
        let allowed = name.allowed(me, &owner, kind, fair);
        let mut next = name.clone();
        if (matches!(outcome, Outcome::Busy) && id != DIRECT)
            || next
                .apply(&allowed, outcome, me, &owner, kind, turn)
                .is_err()
        {
            continue;
        }
        let rest: Vec<(usize, Outcome)> = (ended.iter().enumerate())
            .filter(|&(k, _)| k != j)
            .map(|(_, e)| *e)
            .collect();
        if let Some((mut order, after)) = serve_order(&next, &rest, direct) {
            order.insert(0, id);
            return Some((order, after));
        }
    }
    None
}

/// Whether the holders `describe` shows can hold together.
fn compatible(state: &LockState) -> Check {
    let holders = &state.holders;
    let mut owners: Vec<&str> = holders.iter().map(|h| h.owner.as_str()).collect();
    owners.sort_unstable();
    owners.dedup();
    ensure!(
        owners.len() == holders.len(),
        "an owner is listed twice as a holder: {holders:?}"
    );
    let kinds: Vec<LockKind> = holders.iter().map(|h| h.kind).collect();
    let ok = match kinds.first() {
        None => true,
        Some(LockKind::Exclusive) => kinds.len() == 1,
        Some(LockKind::Shared) => kinds.iter().all(|k| *k == LockKind::Shared),
        Some(LockKind::Permit { permits }) => {
            kinds.iter().all(|k| k == &kinds[0]) && kinds.len() <= *permits as usize
        }
    };
    ensure!(ok, "incompatible holders at once: {holders:?}");
    Ok(())
}

/// Delta debugging within `budget`: the shortest failing sequence found, its failure and
/// the number of runs.
async fn shrink(
    store: &Arc<dyn Store>,
    plan: &Plan,
    first: Failure,
    budget: Duration,
) -> (Vec<Op>, Failure, usize) {
    let until = Instant::now() + budget;
    let mut ops: Vec<Op> = match first.step {
        Some(i) => plan.ops[..=i].to_vec(),
        None => plan.ops.clone(),
    };
    let mut last = first;
    let mut runs = 0;
    let mut chunks = 2;
    while ops.len() > 1 && Instant::now() < until {
        let size = ops.len().div_ceil(chunks);
        let mut cut = false;
        let mut start = 0;
        while start < ops.len() && Instant::now() < until {
            let mut fewer = ops.clone();
            fewer.drain(start..(start + size).min(ops.len()));
            runs += 1;
            match run(store, plan, &fewer).await {
                Err(failure) => {
                    // Everything after the failing step is not needed either.
                    if let Some(i) = failure.step {
                        fewer.truncate(i + 1);
                    }
                    ops = fewer;
                    last = failure;
                    cut = true;
                }
                Ok(_) => start += size,
            }
        }
        if cut {
            chunks = chunks.saturating_sub(1).max(2);
        } else if size == 1 {
            break;
        } else {
            chunks = (chunks * 2).min(ops.len());
        }
    }
    (ops, last, runs)
}

/// What a request's answer was, as the model records it, with the guard if granted.
fn outcome_of(
    got: crate::Result<Option<LockGuard>>,
) -> std::result::Result<(Outcome, Option<LockGuard>), String> {
    Ok(match got {
        Ok(Some(guard)) => (
            Outcome::Granted {
                token: guard.token().get(),
                holds: guard.holds(),
            },
            Some(guard),
        ),
        Ok(None) => (Outcome::Busy, None),
        Err(Error::Conflict { .. }) => (Outcome::Refused, None),
        Err(e) => return Err(format!("the request failed: {e}")),
    })
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

    fn queued(list: &[(usize, &str, LockKind, bool)]) -> Vec<Waiter> {
        list.iter()
            .map(|&(id, owner, kind, fair)| Waiter {
                id,
                owner: owner.into(),
                kind,
                fair,
                gate: None,
                at_gate: false,
            })
            .collect()
    }

    #[test]
    fn ended_waiters_are_accepted_only_in_an_order_the_rules_allow() {
        use LockKind::Exclusive as X;
        let free = Name {
            holders: Vec::new(),
            waiters: queued(&[(1, "a", X, true), (2, "b", X, true)]),
            last_token: 5,
        };
        let granted = |token| Outcome::Granted { token, holds: 1 };
        // The head of a fair queue may go first.
        let (order, after) = serve_order(&free, &[(1, granted(6))], None).unwrap();
        assert_eq!(order, vec![1]);
        assert_eq!(after.holders[0].owner, "a");
        // Not the second: it waits behind the first.
        assert!(serve_order(&free, &[(2, granted(6))], None).is_none());
        // Not both: two writers at once.
        assert!(serve_order(&free, &[(1, granted(6)), (2, granted(7))], None).is_none());
        // A non-fair second may pass the first.
        let mut unfair = free.clone();
        unfair.waiters[1].fair = false;
        assert!(serve_order(&unfair, &[(2, granted(6))], None).is_some());
        // A token must be new.
        assert!(serve_order(&free, &[(1, granted(5))], None).is_none());
        // Two owners' re-entries: the same owner's second waiter re-enters.
        let same = Name {
            waiters: queued(&[(1, "a", X, true), (2, "a", X, true)]),
            ..free.clone()
        };
        let (order, _) = serve_order(
            &same,
            &[
                (2, Outcome::Granted { token: 6, holds: 2 }),
                (1, granted(6)),
            ],
            None,
        )
        .unwrap();
        assert_eq!(order, vec![1, 2]);
    }
}
