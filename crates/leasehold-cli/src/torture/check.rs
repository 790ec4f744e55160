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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

use serde::{Serialize, Serializer};

use super::history::{Entry, Event, Op, Role};

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
}

impl Primitive {
    /// Whether a hold of kind `b` may be valid beside the holds of `others` (other owners).
    fn admits(self, others: &[Role], b: Role) -> bool {
        match self {
            Primitive::Semaphore(n) => others.len() < n as usize,
            Primitive::Mutex => others.is_empty(),
            Primitive::RwLock => {
                others.is_empty()
                    || (b == Role::Shared && others.iter().all(|&a| a == Role::Shared))
            }
        }
    }

    /// How many `a`-holders conflict with `b` joining `others`: pairs for the locks,
    /// one per grant beyond the limit for a semaphore.
    fn conflicts(self, others: &[Role], b: Role) -> usize {
        match self {
            Primitive::Semaphore(_) => usize::from(!self.admits(others, b)),
            Primitive::Mutex => others.len(),
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
        }
    }
}

impl FromStr for Primitive {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mutex" => Ok(Primitive::Mutex),
            "rwlock" => Ok(Primitive::RwLock),
            _ => {
                let n = s.strip_prefix("semaphore:").ok_or_else(|| {
                    format!("{s:?}: give mutex, semaphore:N (N permits) or rwlock")
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
    /// The workers themselves lock the store for their updates (library workers on the
    /// local store): a pause of any of them may stall the store.
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

/// Faults that explain a lost lease: a long pause or kill of that worker, or any fault
/// of the store or the link (no target).
const EXCUSING_HOLDER_FAULTS: &[&str] = &["pause", "stall-run", "kill"];

/// The CLI's exit status for a lock lost while the command ran.
const RUN_LOST: i32 = crate::exit::LOST as i32;

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
    fn of(mut ns: Vec<u64>) -> Self {
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
    /// Faults started, by kind.
    pub faults: BTreeMap<String, usize>,
    /// From killing a holder to the next acquisition by someone else.
    pub takeover: Spread,
    /// From acquire invoked to a guard returned.
    pub acquire: Spread,
    /// The invariants this history broke (empty: it passed).
    pub violations: Vec<String>,
}

#[derive(Debug)]
struct Hold {
    owner: String,
    role: Role,
    token: u64,
    invoked: u64,
    queued: Option<u64>,
    got: u64,
    deadline: u64,
    lost: Option<u64>,
    release: Option<u64>,
    killed: Option<u64>,
    /// A `run` command paused by the nemesis while inside.
    paused: bool,
    /// Its release answered an error: the hold may be left in the store until the
    /// library's retry of the release gets through.
    release_failed: bool,
}

impl Hold {
    /// A killed process cannot act, and the store may free its lock on seeing it dead.
    fn valid_end(&self) -> u64 {
        [self.release, self.killed]
            .into_iter()
            .flatten()
            .fold(self.deadline, u64::min)
    }

    fn belief_end(&self, history_end: u64) -> u64 {
        [self.lost, self.release, self.killed]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(history_end)
    }
}

#[derive(Debug)]
struct Fault {
    kind: String,
    target: Option<String>,
    start: u64,
    end: u64,
}

impl Fault {
    fn overlaps(&self, from: u64, to: u64) -> bool {
        self.start <= to && self.end >= from
    }
}

/// What the resource saw, replayed from its accesses.
#[derive(Debug, Default)]
struct Replay {
    highest: u64,
    highest_exclusive: u64,
    counter: u64,
    writes: usize,
    first_read: HashMap<String, usize>,
    inside: HashSet<String>,
}

impl Replay {
    #[allow(clippy::too_many_arguments)]
    fn access(
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

    fn gone(&mut self, owner: &str) {
        self.inside.remove(owner);
        self.first_read.remove(owner);
    }
}

/// Checks a history (entries in time order) of one lock.
pub fn check(history: &[Entry], setup: &Setup) -> Report {
    let mut report = Report::default();
    let history_end = history.last().map_or(0, |e| e.t);
    let mut holds: Vec<Hold> = Vec::new();
    let mut current: HashMap<&str, usize> = HashMap::new();
    let mut invoked: HashMap<&str, u64> = HashMap::new();
    let mut queued: HashMap<&str, u64> = HashMap::new();
    let mut acquire_ns = Vec::new();
    let mut faults: Vec<Fault> = Vec::new();
    let mut replay = Replay::default();
    let mut exits: HashMap<&str, (u64, Option<i32>)> = HashMap::new();

    for entry in history {
        let t = entry.t;
        match &entry.event {
            Event::Spawned { .. } => {}
            Event::Invoke { owner } => {
                invoked.insert(owner, t);
                queued.remove(owner.as_str());
            }
            Event::Queued { owner } => {
                queued.entry(owner).or_insert(t);
            }
            Event::Acquired {
                owner,
                token,
                deadline,
                role,
            } => {
                report.acquisitions += 1;
                let invoked = invoked.get(owner.as_str()).copied().unwrap_or(t);
                acquire_ns.push(t - invoked);
                if *deadline < t {
                    report.granted_late += 1;
                }
                current.insert(owner, holds.len());
                holds.push(Hold {
                    owner: owner.clone(),
                    role: *role,
                    token: *token,
                    invoked,
                    queued: queued.remove(owner.as_str()),
                    got: t,
                    deadline: *deadline,
                    lost: None,
                    release: None,
                    killed: None,
                    paused: false,
                    release_failed: false,
                });
            }
            Event::AcquireFailed { unknown, .. } => match unknown {
                true => report.acquire_unknown += 1,
                false => report.acquire_failed += 1,
            },
            Event::Reentered {
                owner,
                token,
                outer,
            } => {
                report.reentries += 1;
                // Once the outer hold is gone (lost, or past its safe deadline), the
                // inner acquisition is a new hold and rightly gets a new token.
                let outer_held = (current.get(owner.as_str()))
                    .is_some_and(|&i| holds[i].lost.is_none() && t <= holds[i].deadline);
                if token != outer && outer_held {
                    report.reentry_token_changed += 1;
                }
            }
            Event::Renewed {
                owner, deadline, ..
            } => {
                if let Some(&i) = current.get(owner.as_str()) {
                    holds[i].deadline = holds[i].deadline.max(*deadline);
                }
            }
            Event::Lost { owner, .. } => {
                if let Some(&i) = current.get(owner.as_str()) {
                    holds[i].lost.get_or_insert(t);
                }
            }
            Event::Check { ok, deadline, .. } => {
                if *ok && t > *deadline {
                    report.believed_past_deadline += 1;
                }
            }
            Event::Release {
                owner, deadline, ..
            } => {
                if let Some(&i) = current.get(owner.as_str()) {
                    holds[i].release = Some(t);
                    holds[i].deadline = holds[i].deadline.max(*deadline);
                }
            }
            Event::Released { owner, outcome, .. } => {
                if let Some(i) = current.remove(owner.as_str()) {
                    holds[i].release_failed = outcome.starts_with("error");
                }
            }
            Event::Access {
                owner,
                token,
                op,
                value,
                base,
                accepted,
                role,
            } => {
                if setup.via_run {
                    command_access(&mut holds, &mut current, &invoked, owner, *token, *role, t);
                    if *op == Op::Enter {
                        report.acquisitions += 1;
                        acquire_ns.push(t - invoked.get(owner.as_str()).copied().unwrap_or(t));
                    }
                }
                if !accepted {
                    report.stale_rejected += 1;
                    continue;
                }
                replay.access(&mut report, setup, owner, *token, *op, *value, *base);
            }
            Event::Killed { owner } => {
                if let Some(&i) = current.get(owner.as_str()) {
                    holds[i].killed = Some(t);
                }
                replay.gone(owner);
            }
            Event::RunExited {
                owner,
                code,
                signal,
            } => {
                let status = match (code, signal) {
                    (Some(code), _) => code.to_string(),
                    (None, Some(signal)) => format!("signal {signal}"),
                    (None, None) => "unknown".to_string(),
                };
                *report.run_exits.entry(status).or_default() += 1;
                exits.insert(owner, (t, *code));
                replay.gone(owner);
            }
            Event::FaultStart { kind, target } => {
                *report.faults.entry(kind.clone()).or_default() += 1;
                faults.push(Fault {
                    kind: kind.clone(),
                    target: target.clone(),
                    start: t,
                    end: history_end,
                });
            }
            Event::FaultEnd { kind, target } => {
                if let Some(f) = (faults.iter_mut().rev())
                    .find(|f| &f.kind == kind && &f.target == target && f.end == history_end)
                {
                    f.end = t;
                }
            }
        }
    }

    report.acquire = Spread::of(acquire_ns);
    if setup.workers_lock_the_store {
        // Every worker takes the store's file lock for its updates: one paused in that
        // moment stalls the store for all of them (calls fail after the file lock's
        // patience), which is a fault of the store's.
        let stalls: Vec<Fault> = (faults.iter())
            .filter(|f| f.kind == "pause" && f.target.is_some())
            .map(|f| Fault {
                kind: "store stalled by a paused worker".into(),
                target: None,
                start: f.start,
                end: f.end,
            })
            .collect();
        faults.extend(stalls);
    }
    if setup.via_run {
        for h in &mut holds {
            let end = h.release.unwrap_or(h.got);
            h.paused = (faults.iter()).any(|f| {
                f.kind == "pause" && f.target.as_ref() == Some(&h.owner) && f.overlaps(h.got, end)
            });
        }
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
    report.takeover = takeovers(&holds, &faults);
    report.violations = violations(&report, setup);
    report
}

/// A `run` command's access: the first opens its hold (token, role), each one moves its
/// end (kept in `release`).
fn command_access<'a>(
    holds: &mut Vec<Hold>,
    current: &mut HashMap<&'a str, usize>,
    invoked: &HashMap<&str, u64>,
    owner: &'a str,
    token: u64,
    role: Role,
    t: u64,
) {
    match current.get(owner) {
        Some(&i) if holds[i].token == token => holds[i].release = Some(t),
        _ => {
            current.insert(owner, holds.len());
            holds.push(Hold {
                owner: owner.to_string(),
                role,
                token,
                invoked: invoked.get(owner).copied().unwrap_or(t),
                queued: None,
                got: t,
                deadline: u64::MAX,
                lost: None,
                release: Some(t),
                killed: None,
                paused: false,
                release_failed: false,
            });
        }
    }
}

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
fn overlaps(holds: &[Hold], history_end: u64, primitive: Primitive, report: &mut Report) {
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
fn overlaps_of_commands(holds: &[Hold], primitive: Primitive, report: &mut Report) {
    let spans = |all: bool| -> Vec<(&str, Role, u64, u64)> {
        (holds.iter())
            .filter(|h| all || !h.paused)
            .map(|h| (h.owner.as_str(), h.role, h.got, h.valid_end() + 1))
            .collect()
    };
    (report.service_overlap, report.max_valid_holders) = conflicts(&mut spans(false), primitive);
    report.belief_overlap = conflicts(&mut spans(true), primitive).0;
}

/// Tokens: unique across owners, and rising: a valid hold `y` must have a token above
/// every valid hold `x` that the store must have granted before it — one that began
/// before `y` did when either excludes the other (their valid leases cannot overlap), or
/// one that began before `y` was even asked for (any kind). An owner may see a token it
/// had before again when its release of it answered an error (store trouble: it is sent
/// again in the background): its next acquisition re-entered the hold that was left, as
/// re-entry must, while readers or permit holders of other owners may have been granted
/// higher tokens. Such a shared or permit hold is not judged for order (tokens stay
/// unique across owners; an exclusive one still is).
fn tokens(holds: &[Hold], report: &mut Report) {
    // Token -> the owner that got it, and whether its last release by that owner failed.
    let mut owners: HashMap<u64, (&str, bool)> = HashMap::new();
    let mut again = HashSet::new();
    for (i, h) in holds.iter().enumerate() {
        match owners.entry(h.token) {
            std::collections::hash_map::Entry::Occupied(mut first) if first.get().0 == h.owner => {
                // (Not an exclusive hold: no other owner can have been granted the lock
                // while the left-over hold stood, so its token must still be the top.)
                if first.get().1 && h.role != Role::Exclusive {
                    again.insert(i);
                }
                first.get_mut().1 = h.release_failed;
            }
            std::collections::hash_map::Entry::Occupied(_) => report.duplicate_tokens += 1,
            std::collections::hash_map::Entry::Vacant(first) => {
                first.insert((&h.owner, h.release_failed));
            }
        }
    }
    let mut valid: Vec<&Hold> = (holds.iter().enumerate())
        .filter(|(i, h)| h.got < h.valid_end() && !again.contains(i))
        .map(|(_, h)| h)
        .collect();
    valid.sort_by_key(|h| h.got);
    for (j, y) in valid.iter().enumerate() {
        let before = |x: &&&Hold| {
            x.got < y.got
                && (x.role == Role::Exclusive || y.role == Role::Exclusive || x.got < y.invoked)
        };
        let backwards = (valid[..j].iter())
            .filter(before)
            .any(|x| x.token > y.token || (x.token == y.token && x.owner != y.owner));
        if backwards {
            report.tokens_backwards += 1;
        }
    }
}

/// First come, first served, judged from the history alone. `a`'s acquire logged that the
/// store had queued it (an answer with its queue position) before `b`'s acquire was
/// invoked, so `b`'s request reached the store after `a` was in its queue; if both were
/// granted, `a` must have been granted first, and tokens give the store's grant order
/// (they rise with each grant). Not judged: two readers (let in together, in any order);
/// `a` in trouble while it waited (any fault of the store or the link, or one aimed at
/// it: it may have lost its place, as a waiter that stops renewing its place must); `b`
/// given a token it had before (it re-entered its own hold, left by a lost release).
fn fifo(holds: &[Hold], faults: &[Fault], report: &mut Report) {
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

/// Every lease that expired while held must fire `lost`; `lost` without a fault is false.
fn losses(holds: &[Hold], faults: &[Fault], history_end: u64, report: &mut Report) {
    let mut delays = Vec::new();
    for h in holds {
        let killed_before_deadline = h.killed.is_some_and(|k| k <= h.deadline);
        let held_until = h.release.unwrap_or(history_end);
        if h.deadline < held_until && !killed_before_deadline {
            report.expired_while_held += 1;
            if let Some(lost) = h.lost {
                report.losses_reported += 1;
                // A stopped process can only notice once it runs again.
                let noticeable = (faults.iter())
                    .filter(|f| f.start <= h.deadline && f.end > h.deadline)
                    .filter(|f| f.target.is_none() || f.target.as_ref() == Some(&h.owner))
                    .map(|f| f.end)
                    .fold(h.deadline, u64::max);
                delays.push(lost.saturating_sub(noticeable));
            }
        }
        if let Some(lost) = h.lost {
            if !excused(faults, &h.owner, h.invoked, lost) {
                report.false_losses += 1;
            }
        }
    }
    report.loss_report = Spread::of(delays);
}

/// Whether a fault explains a loss of `owner`'s between `from` (its acquire) and `to`.
fn excused(faults: &[Fault], owner: &str, from: u64, to: u64) -> bool {
    faults.iter().any(|f| {
        let relevant = match &f.target {
            None => true,
            Some(t) => t == owner && EXCUSING_HOLDER_FAULTS.contains(&f.kind.as_str()),
        };
        relevant && f.overlaps(from, to)
    })
}

/// `run` workers: a command paused past its lease (a `pause`, 1.5-2 TTL), or one whose
/// `run` alone was (a `stall-run`: its watchdog stops the command), must end with `run`
/// exiting 76, unless the coordinator killed that `run`; exit 76 needs a fault.
fn run_losses(
    holds: &[Hold],
    faults: &[Fault],
    invoked: &HashMap<&str, u64>,
    exits: &HashMap<&str, (u64, Option<i32>)>,
    report: &mut Report,
) {
    let mut delays = Vec::new();
    for f in (faults.iter()).filter(|f| f.kind == "pause" || f.kind == "stall-run") {
        let Some(owner) = f.target.as_deref() else {
            continue;
        };
        if !holds.iter().any(|h| h.owner == owner) {
            continue;
        }
        let Some(&(t, code)) = exits.get(owner) else {
            continue;
        };
        report.expired_while_held += 1;
        if code == Some(RUN_LOST) {
            report.losses_reported += 1;
            delays.push(t.saturating_sub(f.end));
        }
    }
    for (&owner, &(t, code)) in exits {
        let from = invoked.get(owner).copied().unwrap_or(0);
        if code == Some(RUN_LOST) && !excused(faults, owner, from, t) {
            report.false_losses += 1;
        }
    }
    report.loss_report = Spread::of(delays);
}

/// From each kill of a holder to the next guard returned to another owner.
fn takeovers(holds: &[Hold], faults: &[Fault]) -> Spread {
    let mut ns = Vec::new();
    for f in faults.iter().filter(|f| f.kind == "kill") {
        let victim_held = (holds.iter()).any(|h| Some(&h.owner) == f.target.as_ref());
        if !victim_held {
            continue;
        }
        if let Some(next) = (holds.iter())
            .filter(|h| h.got > f.start && Some(&h.owner) != f.target.as_ref())
            .map(|h| h.got)
            .min()
        {
            ns.push(next - f.start);
        }
    }
    Spread::of(ns)
}

fn violations(r: &Report, setup: &Setup) -> Vec<String> {
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
    if setup.fence == Fence::All {
        must_be_zero(r.stale_accepted, "stale access accepted");
        must_be_zero(r.lost_updates, "lost update");
        must_be_zero(r.torn_reads, "a write inside a reader's reads");
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
    use super::*;

    const MS: u64 = 1_000_000;

    /// A tiny history language: each call appends an event at `t` ms.
    #[derive(Default)]
    struct H(Vec<Entry>);

    impl H {
        fn at(mut self, t: u64, event: Event) -> Self {
            self.0.push(Entry { t: t * MS, event });
            self
        }
        fn acquired(self, t: u64, owner: &str, token: u64, deadline: u64) -> Self {
            self.acquired_as(t, t, owner, token, deadline, Role::Exclusive)
        }
        /// Acquire invoked at `invoked`, returned at `t`.
        fn acquired_as(
            self,
            invoked: u64,
            t: u64,
            owner: &str,
            token: u64,
            deadline: u64,
            role: Role,
        ) -> Self {
            let o = owner.to_string();
            self.at(invoked, Event::Invoke { owner: o.clone() }).at(
                t,
                Event::Acquired {
                    owner: o,
                    token,
                    deadline: deadline * MS,
                    role,
                },
            )
        }
        fn queued(self, t: u64, owner: &str) -> Self {
            let owner = owner.into();
            self.at(t, Event::Queued { owner })
        }
        fn released(self, t: u64, owner: &str, token: u64, deadline: u64) -> Self {
            let o = owner.to_string();
            self.at(
                t,
                Event::Release {
                    owner: o.clone(),
                    token,
                    deadline: deadline * MS,
                },
            )
            .at(
                t,
                Event::Released {
                    owner: o,
                    token,
                    outcome: "released".into(),
                },
            )
        }
        /// A release that answered an error (the store was away).
        fn release_failed(self, t: u64, owner: &str, token: u64) -> Self {
            let o = owner.to_string();
            self.at(
                t,
                Event::Release {
                    owner: o.clone(),
                    token,
                    deadline: 1000 * MS,
                },
            )
            .at(
                t,
                Event::Released {
                    owner: o,
                    token,
                    outcome: "error: store unavailable".into(),
                },
            )
        }
        fn access(self, t: u64, owner: &str, token: u64, op: Op, value: u64, ok: bool) -> Self {
            let base = (op == Op::Write).then(|| value - 1);
            let role = match op {
                Op::Read | Op::Write => Role::Exclusive,
                Op::ReadShared | Op::Reread => Role::Shared,
                Op::Enter | Op::Exit => Role::Permit,
            };
            self.at(
                t,
                Event::Access {
                    owner: owner.into(),
                    token,
                    op,
                    value,
                    base,
                    accepted: ok,
                    role,
                },
            )
        }
        fn lost(self, t: u64, owner: &str, token: u64) -> Self {
            let owner = owner.into();
            self.at(t, Event::Lost { owner, token })
        }
        fn fault(self, start: u64, end: u64, kind: &str, target: Option<&str>) -> Self {
            let (kind, target) = (kind.to_string(), target.map(String::from));
            self.at(
                start,
                Event::FaultStart {
                    kind: kind.clone(),
                    target: target.clone(),
                },
            )
            .at(end, Event::FaultEnd { kind, target })
        }
        fn check(self, fence: Fence) -> Report {
            self.check_as(&Setup::new(fence, Primitive::Mutex))
        }
        fn check_as(mut self, setup: &Setup) -> Report {
            // Stable: events logged at the same instant keep their order.
            self.0.sort_by_key(|e| e.t);
            check(&self.0, setup)
        }
    }

    /// Two clean cycles: a then b, each reading and incrementing.
    fn clean() -> H {
        H::default()
            .acquired(0, "a", 1, 100)
            .access(1, "a", 1, Op::Read, 0, true)
            .access(2, "a", 1, Op::Write, 1, true)
            .released(3, "a", 1, 100)
            .acquired(4, "b", 2, 104)
            .access(5, "b", 2, Op::Read, 1, true)
            .access(6, "b", 2, Op::Write, 2, true)
            .released(7, "b", 2, 104)
    }

    #[test]
    fn a_clean_history_passes() {
        let r = clean().check(Fence::All);
        assert_eq!(r.violations, Vec::<String>::new());
        assert_eq!(
            (r.acquisitions, r.service_overlap, r.lost_updates),
            (2, 0, 0)
        );
    }

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

    #[test]
    fn a_token_that_goes_backwards_fails() {
        let r = H::default()
            .acquired(0, "a", 5, 100)
            .released(10, "a", 5, 100)
            .acquired(20, "b", 4, 120)
            .released(30, "b", 4, 120)
            .check(Fence::All);
        assert_eq!(r.tokens_backwards, 1);
        assert!(r.violations.iter().any(|v| v.contains("did not increase")));
    }

    #[test]
    fn an_owner_may_see_its_top_token_again_but_not_an_older_one() {
        // a's release did not reach the store: its next acquisition re-entered token 5.
        let again = || {
            H::default()
                .acquired(0, "a", 5, 100)
                .released(10, "a", 5, 100)
                .acquired(20, "a", 5, 120)
                .released(30, "a", 5, 120)
        };
        let r = again().check(Fence::All);
        assert_eq!((r.tokens_backwards, r.violations.len()), (0, 0));
        let r = again()
            .acquired(40, "b", 6, 140)
            .released(50, "b", 6, 140)
            .acquired(60, "a", 5, 160)
            .released(70, "a", 5, 160)
            .check(Fence::All);
        assert_eq!(r.tokens_backwards, 1);
    }

    #[test]
    fn a_token_given_twice_fails() {
        let r = H::default()
            .acquired(0, "a", 3, 100)
            .released(10, "a", 3, 100)
            .acquired(20, "b", 3, 120)
            .released(30, "b", 3, 120)
            .check(Fence::All);
        assert_eq!(r.duplicate_tokens, 1);
    }

    /// Reader `a` sees its token 5 again after reader `b` got 6: a release of `a`'s that
    /// met store trouble left a hold, which `a`'s next acquire re-entered, as it must.
    /// After a release that said `released`, or for a token no one had before, it fails.
    #[test]
    fn an_owner_seeing_its_own_token_again_is_a_re_entry_not_a_token_going_back() {
        let setup = Setup::new(Fence::All, Primitive::RwLock);
        let history = |failed: bool| {
            let h = H::default()
                .acquired_as(0, 10, "a", 5, 1000, Role::Shared)
                .acquired_as(15, 20, "b", 6, 1000, Role::Shared);
            let h = match failed {
                true => h.release_failed(25, "a", 5),
                false => h.released(25, "a", 5, 1000),
            };
            h.acquired_as(30, 31, "a", 5, 1000, Role::Shared)
                .released(40, "a", 5, 1000)
                .released(41, "b", 6, 1000)
        };
        let r = history(true).check_as(&setup);
        assert_eq!(r.tokens_backwards, 0, "{:?}", r.violations);
        assert_eq!(history(false).check_as(&setup).tokens_backwards, 1);
        let r = H::default()
            .acquired_as(0, 10, "a", 5, 1000, Role::Shared)
            .released(25, "a", 5, 1000)
            .acquired_as(30, 31, "c", 4, 1000, Role::Shared)
            .released(40, "c", 4, 1000)
            .check_as(&setup);
        assert_eq!(r.tokens_backwards, 1);
    }

    #[test]
    fn a_late_grant_does_not_count_in_the_token_order() {
        // b's grant (token 1) arrived at 150, after its deadline 90: not a valid hold.
        let r = H::default()
            .acquired(100, "a", 2, 200)
            .fault(0, 160, "delay", None)
            .acquired(150, "b", 1, 90)
            .lost(150, "b", 1)
            .released(151, "b", 1, 90)
            .released(160, "a", 2, 200)
            .check(Fence::All);
        assert_eq!(r.violations, Vec::<String>::new());
        assert_eq!((r.granted_late, r.tokens_backwards), (1, 0));
    }

    #[test]
    fn an_expired_lease_without_a_lost_signal_fails() {
        let r = H::default()
            .acquired(0, "a", 1, 100)
            .fault(10, 200, "pause", Some("a"))
            .released(201, "a", 1, 100)
            .check(Fence::All);
        assert_eq!((r.expired_while_held, r.losses_reported), (1, 0));
        assert!(r.violations.iter().any(|v| v.contains("no lost signal")));
    }

    #[test]
    fn a_killed_holder_is_not_asked_to_report_and_its_takeover_is_timed() {
        let r = H::default()
            .acquired(0, "a", 1, 100)
            .fault(10, 10, "kill", Some("a"))
            .at(10, Event::Killed { owner: "a".into() })
            .acquired(104, "b", 2, 204)
            .released(110, "b", 2, 204)
            .check(Fence::All);
        assert_eq!(r.violations, Vec::<String>::new());
        assert_eq!(r.expired_while_held, 0);
        assert_eq!((r.takeover.n, r.takeover.p50_ms), (1, 94.0));
    }

    #[test]
    fn a_loss_under_a_short_pause_or_no_fault_is_false() {
        let short = H::default()
            .acquired(0, "a", 1, 100)
            .fault(10, 40, "short-pause", Some("a"))
            .lost(41, "a", 1)
            .released(42, "a", 1, 100)
            .check(Fence::All);
        assert_eq!(short.false_losses, 1);
        assert!(short
            .violations
            .iter()
            .any(|v| v.starts_with("lost with no fault")));
        let store = H::default()
            .acquired(0, "a", 1, 100)
            .fault(10, 40, "restart-store", None)
            .lost(41, "a", 1)
            .released(42, "a", 1, 100)
            .check(Fence::All);
        assert_eq!(store.false_losses, 0);
    }

    #[test]
    fn check_saying_held_after_the_deadline_fails_and_reentry_keeps_the_token() {
        let r = H::default()
            .acquired(0, "a", 1, 100)
            .at(
                5,
                Event::Reentered {
                    owner: "a".into(),
                    token: 2,
                    outer: 1,
                },
            )
            .at(
                101,
                Event::Check {
                    owner: "a".into(),
                    token: 1,
                    ok: true,
                    deadline: 100 * MS,
                },
            )
            .released(102, "a", 1, 100)
            .lost(102, "a", 1)
            .check(Fence::All);
        assert_eq!((r.believed_past_deadline, r.reentry_token_changed), (1, 1));
    }

    fn setup(primitive: Primitive) -> Setup {
        Setup::new(Fence::All, primitive)
    }

    /// a's outer hold was lost before it re-entered: the inner acquisition is a hold of
    /// its own, whose new token is no change. While the outer holds, it is.
    #[test]
    fn a_re_entry_after_the_outer_hold_was_lost_may_get_a_new_token() {
        let reentered = |t| {
            let changed = Event::Reentered {
                owner: "a".into(),
                token: 2,
                outer: 1,
            };
            H::default()
                .acquired(0, "a", 1, 100)
                .fault(10, 150, "pause", Some("a"))
                .lost(99, "a", 1)
                .at(t, changed)
                .released(160, "a", 1, 100)
                .check(Fence::All)
        };
        assert_eq!(reentered(151).reentry_token_changed, 0);
        assert_eq!(reentered(50).reentry_token_changed, 1);
    }

    /// On the local store a worker paused while it held the store's file lock stalls
    /// everyone's renewals: b's loss during a's pause is the store's fault there, and
    /// false elsewhere.
    #[test]
    fn a_loss_during_another_workers_pause_is_excused_where_workers_lock_the_store() {
        let h = || {
            H::default()
                .acquired(0, "b", 1, 100)
                .fault(10, 150, "pause", Some("a"))
                .lost(99, "b", 1)
                .released(100, "b", 1, 100)
        };
        let local = Setup {
            workers_lock_the_store: true,
            ..setup(Primitive::Mutex)
        };
        assert_eq!(h().check_as(&local).false_losses, 0);
        assert_eq!(h().check_as(&setup(Primitive::Mutex)).false_losses, 1);
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
    fn a_permit_asked_for_after_another_was_granted_needs_a_higher_token() {
        let r = H::default()
            .acquired_as(0, 10, "a", 5, 100, Role::Permit)
            .acquired_as(20, 30, "b", 4, 100, Role::Permit)
            .released(40, "a", 5, 100)
            .released(40, "b", 4, 100)
            .check_as(&setup(Primitive::Semaphore(2)));
        assert_eq!(r.tokens_backwards, 1);
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

    fn via_run(primitive: Primitive) -> Setup {
        Setup {
            via_run: true,
            ..setup(primitive)
        }
    }

    fn run_exit(h: H, t: u64, owner: &str, code: i32) -> H {
        h.at(
            t,
            Event::RunExited {
                owner: owner.into(),
                code: Some(code),
                signal: None,
            },
        )
    }

    /// Two `run` commands: a enters at 10, b at 50; a's last access is at `a_last`.
    fn commands(a_last: u64, pause_a: bool) -> H {
        let mut h = H::default()
            .at(0, Event::Invoke { owner: "a".into() })
            .access(10, "a", 1, Op::Enter, 1, true)
            .access(11, "a", 1, Op::Read, 0, true)
            .at(20, Event::Invoke { owner: "b".into() })
            .access(50, "b", 2, Op::Enter, 1, true)
            .access(51, "b", 2, Op::Read, 0, true)
            .access(52, "b", 2, Op::Write, 1, true)
            .access(53, "b", 2, Op::Exit, 0, true)
            .access(a_last, "a", 1, Op::Write, 1, !pause_a)
            .access(a_last + 1, "a", 1, Op::Exit, 0, true);
        if pause_a {
            h = h.fault(12, 150, "pause", Some("a"));
        }
        run_exit(run_exit(h, a_last + 2, "a", 76), 54, "b", 0)
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

    #[test]
    fn a_paused_run_that_did_not_exit_lost_fails() {
        let h = commands(160, true);
        let mut entries = h.0;
        entries.retain(|e| !matches!(&e.event, Event::RunExited { owner, .. } if owner == "a"));
        let r = run_exit(H(entries), 162, "a", 0).check_as(&via_run(Primitive::Mutex));
        assert_eq!((r.expired_while_held, r.losses_reported), (1, 0));
        assert!(r.violations.iter().any(|v| v.contains("no lost signal")));
    }
}
