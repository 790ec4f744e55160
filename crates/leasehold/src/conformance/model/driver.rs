//! The driver: runs a plan's operations against a store through the public API, one
//! function per kind of operation, and keeps the model in step with what it did.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::expected::{gate_of, gated, unnamed, Name, Outcome, Racer, Waiter};
use super::plan::{Asked, Op, Plan, Req, Shape};
use super::shrink::Failure;
use super::{Check, Counts, BOUNDED, CLIENTS, OWNERS, PROMPT};
use crate::conformance::{unique, PATIENCE, SHORT_TTL};
use crate::rules::{self, Decision};
use crate::store::{LockKind, Released, Store};
use crate::{Error, Leasehold, Lock, LockGuard};

/// The lease of every request but the leaked ones: long enough that renewals under load
/// never lapse.
const TTL: Duration = Duration::from_secs(20);

/// A request made at once after a release, before the waiters it lets in are served:
/// checked with them, in an order the rules allow.
#[derive(Debug)]
pub(super) struct Direct {
    pub(super) name: usize,
    pub(super) ask: Racer,
    pub(super) outcome: Outcome,
    pub(super) guard: Option<LockGuard>,
    /// When it was answered.
    pub(super) since: Instant,
}

/// A request that ended: its id ([`DIRECT`](super::expected::DIRECT) for the racing one),
/// name, request, outcome and guard.
pub(super) type Ended = (usize, usize, Option<Req>, Outcome, Option<LockGuard>);

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
pub(super) struct Handed {
    pub(super) name: usize,
    pub(super) id: usize,
    pub(super) since: Instant,
}

/// A waiting `lock()` task; aborted when dropped.
#[derive(Debug)]
pub(super) struct Task {
    pub(super) id: usize,
    pub(super) name: usize,
    pub(super) req: Req,
    pub(super) handle: JoinHandle<crate::Result<LockGuard>>,
}

impl Drop for Task {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

/// One run of a sequence on fresh names.
pub(super) struct Driver {
    pub(super) clients: Vec<Leasehold>,
    pub(super) names: Vec<String>,
    shapes: Vec<Shape>,
    pub(super) model: Vec<Name>,
    held: Vec<Held>,
    pub(super) tasks: Vec<Task>,
    next_id: usize,
    pub(super) trace: Vec<String>,
    /// A request racing the waiters a release let in, to check with them.
    pub(super) direct: Option<Direct>,
    /// Ended requests of a name kept back, with the racing request, until the waiters
    /// still running there have finished (see [`collect`](Self::collect)).
    pub(super) parked: Vec<Ended>,
    /// When the requests in `parked` were first kept back.
    pub(super) parked_since: Option<Instant>,
    /// Whether the store queues a fair request by how long it waited in its process
    /// ([`Capabilities::queues_by_wait`](crate::store::Capabilities)): fair ownerless requests
    /// then wait in their client's gate too.
    queues_by_wait: bool,
    /// Gate tasks that a release handed the lock to in its own store step, by name: each
    /// must be the next holder of its name, within [`PROMPT`] of the release.
    pub(super) handed: Vec<Handed>,
    /// The owner ids of ownerless guards so far: each must be new.
    anonymous: std::collections::HashSet<String>,
    /// Every id an ownerless waiter was seen as ([`Waiter::seen_as`]): a waiter not yet
    /// seen may not be taken for one of them (a cancelled waiter still in the store).
    pub(super) seen_ids: std::collections::HashSet<String>,
    /// How often each kind of outcome was seen, to show what a run exercised.
    counts: Counts,
}

/// Runs `ops` on fresh names; a panic in the driver is a failure too.
pub(super) async fn run(
    store: &Arc<dyn Store>,
    plan: &Plan,
    ops: &[Op],
) -> Result<Counts, Failure> {
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
        parked_since: None,
        queues_by_wait: store.capabilities().queues_by_wait,
        handed: Vec::new(),
        anonymous: Default::default(),
        seen_ids: Default::default(),
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

    pub(super) fn count(&mut self, what: impl fmt::Display) {
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

    /// The gate `req` waits at, if it goes through one.
    fn gate(&self, req: &Req) -> Option<usize> {
        gated(req, self.queues_by_wait).then_some(gate_of(req))
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
            Op::Try { req, bounded } => self.attempt(req, bounded).await,
            Op::Expire { req } => self.expire(req).await,
            Op::Wait { req } => self.wait(req).await,
            Op::Cancel { pick } => self.cancel(pick).await,
            Op::Release { pick } => self.release(pick, None).await,
            Op::Handoff { pick, req } => self.release(pick, Some(req)).await,
            Op::Force { name } => self.force(name).await,
            Op::Downgrade { pick } => self.downgrade(pick).await,
        }
    }

    fn skip(&mut self, why: &str) -> Check {
        self.note(format!("skipped: {why}"));
        self.count("skipped");
        Ok(())
    }

    /// `try_lock`, or `try_lock_for(BOUNDED)` when `bounded`.
    async fn attempt(&mut self, req: Req, bounded: bool) -> Check {
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

    /// `try_lock` with a short TTL; a guard is leaked, and the store must drop its hold.
    async fn expire(&mut self, req: Req) -> Check {
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

    /// `lock()` in a task of its own: a waiter in the model.
    async fn wait(&mut self, req: Req) -> Check {
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
        let gate = self.gate(&req);
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
            seen_as: None,
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

    /// Aborts a waiting task: it must leave the queue promptly.
    async fn cancel(&mut self, pick: u32) -> Check {
        if self.tasks.is_empty() {
            return self.skip("nobody waits");
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

    /// Releases a held guard; then, if `then` is given, makes that try at once (see
    /// [`race`](Self::race)).
    async fn release(&mut self, pick: u32, then: Option<Req>) -> Check {
        if self.held.is_empty() {
            return self.skip("nothing held");
        }
        let held = self.held.remove(pick as usize % self.held.len());
        self.note(format!("g{} {} n{}", held.id, held.owner, held.name));
        ensure!(
            !held.guard.is_lost(),
            "guard g{} is lost though nothing ended it",
            held.id
        );
        released_as(held.guard, Released::Released, format!("g{}", held.id)).await?;
        self.released(held.name, &held.owner);
        if let Some(req) = then {
            self.race(req).await?;
        }
        self.settle(PROMPT).await
    }

    /// Downgrades a held guard: done for a write hold that is its owner's only hold,
    /// refused for one of several (the guard stays a writer's) and for a read hold or a
    /// permit (the guard's own kind); the readers it admits must then be served.
    async fn downgrade(&mut self, pick: u32) -> Check {
        if self.held.is_empty() {
            return self.skip("nothing held");
        }
        let i = pick as usize % self.held.len();
        let (name, owner, id) = (
            self.held[i].name,
            self.held[i].owner.clone(),
            self.held[i].id,
        );
        self.note(format!("g{id} {owner} n{name}"));
        let model = &self.model[name];
        let Some(holder) = model.holders.iter().position(|h| h.owner == owner) else {
            return Err(format!("g{id} is held but the model has no holder {owner}"));
        };
        let (kind, holds) = (model.holders[holder].kind, model.holders[holder].holds);
        let guard = &mut self.held[i].guard;
        let asked = guard.kind();
        let got = guard.downgrade().await;
        let now = guard.kind();
        let want = match asked {
            LockKind::Exclusive => rules::downgrade(kind, holds, &owner),
            _ => Ok(false),
        };
        self.note(format!("{asked:?} guard, {kind:?} x{holds}: {got:?}"));
        match (asked, want, &got) {
            (LockKind::Exclusive, Ok(_), Ok(())) => {
                ensure!(now == LockKind::Shared, "g{id} downgraded but not shared");
                let model = &mut self.model[name];
                model.holders[holder].kind = LockKind::Shared;
                // The next writer at its gate asks the store now.
                if let Some(turn) = model.holders[holder].turn.take() {
                    model.pass_turn(turn);
                }
                self.held[i].turn = None;
                self.count("downgraded");
            }
            (LockKind::Exclusive, Err(_), Err(Error::Conflict { .. })) => {
                ensure!(now == asked, "g{id} refused but changed");
                self.count("downgrade refused");
            }
            (_, _, Err(Error::InvalidOption { .. })) if asked != LockKind::Exclusive => {
                self.count("downgrade refused");
            }
            _ => return Err(format!("downgrading g{id} ({asked:?}) gave {got:?}")),
        }
        self.settle(PROMPT).await
    }

    /// A try made right after a release, racing the waiters the release lets in: kept as
    /// the [`Direct`] request, to be checked with them.
    async fn race(&mut self, req: Req) -> Check {
        let got = self.lock(&req, TTL).try_lock().await;
        let (outcome, guard) = outcome_of(got)?;
        self.note(format!("then {outcome:?}"));
        let owner = owner_of(&req, guard.as_ref());
        if guard.is_some() {
            self.hold_ownerless(&req, &owner)?;
        }
        self.direct = Some(Direct {
            name: req.name,
            ask: Racer {
                owner,
                kind: req.asked.kind(),
                fair: req.fair,
                turn: self.gate(&req),
            },
            outcome,
            guard,
            since: Instant::now(),
        });
        Ok(())
    }

    /// Force-releases a name: its holders' guards must see the loss.
    async fn force(&mut self, name: usize) -> Check {
        // A force-release frees the lock in the store before the guard with its
        // gate's turn hands the turn on, so store waiters may be let in ahead of
        // the fair tasks at that gate, whose arrival place the model keeps: a race
        // the model does not pin down, so it leaves that case out.
        let model = &self.model[name];
        let turns: Vec<usize> = model.holders.iter().filter_map(|h| h.turn).collect();
        if (model.waiters.iter())
            .any(|w| w.fair && w.at_gate && w.gate.is_some_and(|c| turns.contains(&c)))
        {
            return self.skip("fair tasks wait at the holder's gate");
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
            self.lost(held).await?;
        }
        self.settle(PROMPT).await
    }

    /// Checks that a force-released guard saw its loss and that its release says not held.
    async fn lost(&mut self, held: Held) -> Check {
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
        let what = format!("force-released g{}", held.id);
        released_as(held.guard, Released::NotHeld, what).await?;
        // Its release passed its gate's turn on (no hand-over is promised:
        // the store may have let a waiter in at the force-release).
        if let Some(client) = held.turn {
            self.model[held.name].pass_turn(client);
        }
        Ok(())
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
        let owner = owner_of(req, guard.as_ref());
        let kind = req.asked.kind();
        let turn = self.gate(req);
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
    pub(super) fn hold_ownerless(&mut self, req: &Req, owner: &str) -> Check {
        if req.owner.is_some() {
            return Ok(());
        }
        ensure!(
            !OWNERS.contains(&owner) && self.anonymous.insert(owner.to_string()),
            "an ownerless guard has the owner id {owner:?}, which is not new"
        );
        Ok(())
    }

    pub(super) fn hold(&mut self, name: usize, guard: LockGuard) {
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

    /// Releases every guard, oldest first, letting waiters in; all must be served and
    /// the names left empty.
    async fn drain(&mut self) -> Check {
        loop {
            if !self.held.is_empty() {
                let held = self.held.remove(0);
                let what = format!("g{} at the end", held.id);
                released_as(held.guard, Released::Released, what).await?;
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

/// Releases `guard` (`what`, in a failure), whose release must say `want`.
async fn released_as(guard: LockGuard, want: Released, what: String) -> Check {
    let released = guard.release().await;
    ensure!(
        matches!(&released, Ok(r) if *r == want),
        "releasing {what} gave {released:?}"
    );
    Ok(())
}

/// The owner id the model knows a request by. An ownerless request's is its guard's
/// (checked new in [`Driver::hold_ownerless`]); one not granted has none the rules could
/// match.
fn owner_of(req: &Req, guard: Option<&LockGuard>) -> String {
    match (req.owner, guard) {
        (Some(owner), _) => OWNERS[owner].to_string(),
        (None, Some(guard)) => guard.owner().to_string(),
        (None, None) => "~".into(),
    }
}

/// What a granted request got, as the model records it, with its guard.
pub(super) fn granted(guard: LockGuard) -> (Outcome, Option<LockGuard>) {
    let outcome = Outcome::Granted {
        token: guard.token().get(),
        holds: guard.holds(),
    };
    (outcome, Some(guard))
}

/// What a request's answer was, as the model records it, with the guard if granted.
fn outcome_of(got: crate::Result<Option<LockGuard>>) -> Check<(Outcome, Option<LockGuard>)> {
    Ok(match got {
        Ok(Some(guard)) => granted(guard),
        Ok(None) => (Outcome::Busy, None),
        Err(Error::Conflict { .. }) => (Outcome::Refused, None),
        Err(e) => return Err(format!("the request failed: {e}")),
    })
}
