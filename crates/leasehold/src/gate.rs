//! Tasks of one process that want the same lock queue here first (exclusive locks
//! without an owner id, so no re-entry; fair ones only on stores that queue by
//! [`AcquireRequest::waited_since`]): only one of them can hold it, so only one asks the store
//! at a time, and a release hands the lock to the next task in the same store step
//! ([`Store::transfer`]): one round trip per hand-over instead of two, one wake-up
//! through the store for all of them. A fair task handed over this way takes its place
//! in the store's queue by when it arrived here, so other processes' waiters keep the
//! order they arrived in; so does one whose turn came without the lock (the task before
//! it gave up), which asks the store itself with how long it waited here. Fair and
//! non-fair tasks queue at gates of their own: a fair task behind a non-fair one's turn
//! would wait for a store request that joined the store's queue late, and another
//! process's later waiter could pass it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::oneshot;
use tokio::time::{timeout_at, Instant};

use crate::lock::Pending;
use crate::store::{AcquireRequest, Attempt, Grant, Lease, Released, Store, WaiterInfo};
use crate::Locked;
use crate::{LockName, Result};

/// The gates of one [`Leasehold`](crate::Leasehold), by lock name and fairness.
#[derive(Debug, Default)]
pub(crate) struct Gates(Mutex<HashMap<(LockName, bool), Arc<Gate>>>);

impl Gates {
    pub fn gate(&self, name: &LockName, fair: bool) -> Arc<Gate> {
        let mut gates = self.0.locked();
        if gates.len() > 1024 {
            gates.retain(|_, gate| Arc::strong_count(gate) > 1);
        }
        gates.entry((name.clone(), fair)).or_default().clone()
    }

    /// The tasks waiting at the gates of `name`, in arrival order (for `describe`).
    pub fn waiting(&self, name: &LockName) -> Vec<WaiterInfo> {
        let gates: Vec<Arc<Gate>> = {
            let gates = self.0.locked();
            [false, true]
                .iter()
                .filter_map(|&fair| gates.get(&(name.clone(), fair)).cloned())
                .collect()
        };
        let now = (SystemTime::now(), Instant::now());
        let mut waiting: Vec<(Instant, WaiterInfo)> = Vec::new();
        for gate in gates {
            let state = gate.0.locked();
            let open = state.queue.iter().filter(|waiting| !waiting.tx.is_closed());
            waiting.extend(open.map(|waiting| {
                let info = WaiterInfo {
                    owner: waiting.req.owner.to_string(),
                    host: waiting.req.requester.host.clone(),
                    pid: waiting.req.requester.pid,
                    kind: waiting.req.kind,
                    since: now.0.checked_sub(now.1 - waiting.since).unwrap_or(now.0),
                };
                (waiting.since, info)
            }));
        }
        waiting.sort_by_key(|(since, _)| *since);
        waiting.into_iter().map(|(_, info)| info).collect()
    }
}

#[derive(Debug, Default)]
pub(crate) struct Gate(Mutex<State>);

#[derive(Debug, Default)]
struct State {
    /// A task has the turn (it asks the store, or holds the lock).
    busy: bool,
    /// Tasks waiting for the turn.
    queue: VecDeque<Waiting>,
}

impl State {
    /// Takes the turn if nobody has it; whether it did.
    fn take_turn(&mut self) -> bool {
        !std::mem::replace(&mut self.busy, true)
    }
}

#[derive(Debug)]
struct Waiting {
    /// The request the task would send.
    req: AcquireRequest,
    /// When it arrived.
    since: Instant,
    tx: oneshot::Sender<Pass>,
}

/// What a queued task is given.
#[derive(Debug)]
enum Pass {
    /// Your turn: ask the store yourself.
    Turn,
    /// Your turn, and your request waits in the store's queue (put there for you): ask
    /// the store yourself, which finds its place kept; give up first, and it is undone.
    Queued,
    /// The lock, handed over by a store step sent at that instant.
    Granted(Grant, Instant),
}

/// How far a wait at the gate may go.
pub(crate) enum Until {
    Now,
    Deadline(Instant),
    Forever,
}

/// A task's wait for its pass. Dropped before the pass was taken (a deadline, a dropped
/// future), it closes the channel, so no pass can come after, and deals with one that
/// came before: the turn is passed on, a lock handed over or a place in the store's queue
/// is released by `undo`.
struct Expecting<'a> {
    rx: oneshot::Receiver<Pass>,
    gate: Arc<Gate>,
    undo: Option<Pending<'a>>,
}

impl Drop for Expecting<'_> {
    fn drop(&mut self) {
        let Some(mut undo) = self.undo.take() else {
            return;
        };
        self.rx.close();
        let pass = self.rx.try_recv().ok();
        if !matches!(pass, Some(Pass::Granted(..) | Pass::Queued)) {
            undo.disarm();
        }
        // Dropping `undo` armed releases what the store has for us; the turn goes on.
        drop(undo);
        if pass.is_some() {
            drop(Turn(Some(self.gate.clone())));
        }
    }
}

/// The turn at a gate; passed on when dropped, or by [`Turn::release`].
#[derive(Debug)]
pub(crate) struct Turn(Option<Arc<Gate>>);

impl Gate {
    /// Waits for the turn; `None` if `until` comes first. With the turn comes the lock
    /// itself when the previous task handed it over. `undo` (armed with `req`'s lease)
    /// takes back a lock handed over after this task stopped waiting.
    ///
    /// Cancel-safe: a pass that arrives as the wait ends (its deadline, or the future
    /// dropped) is not lost: the turn goes on to the next task, and a lock handed over
    /// is released by `undo`.
    pub async fn enter(
        self: &Arc<Self>,
        req: &AcquireRequest,
        until: Until,
        mut undo: Pending<'_>,
    ) -> Option<(Turn, Option<(Grant, Instant)>)> {
        let rx = {
            let mut state = self.0.locked();
            if state.take_turn() {
                undo.disarm();
                return Some((Turn(Some(self.clone())), None));
            }
            if matches!(until, Until::Now) {
                undo.disarm();
                return None;
            }
            let (tx, rx) = oneshot::channel();
            state.queue.push_back(Waiting {
                req: req.clone(),
                since: Instant::now(),
                tx,
            });
            rx
        };
        let mut expecting = Expecting {
            rx,
            gate: self.clone(),
            undo: Some(undo),
        };
        let pass = match until {
            // Boxed: a timer is large, and most waits here have no deadline.
            Until::Deadline(deadline) => Box::pin(timeout_at(deadline, &mut expecting.rx))
                .await
                .ok()?,
            _ => (&mut expecting.rx).await,
        };
        if let Some(mut undo) = expecting.undo.take() {
            undo.disarm();
        }
        // The sender is only dropped after a send; a closed channel means no pass.
        let turn = Turn(Some(self.clone()));
        match pass.ok()? {
            Pass::Turn | Pass::Queued => Some((turn, None)),
            Pass::Granted(grant, sent) => Some((turn, Some((grant, sent)))),
        }
    }

    /// The turn, if nobody has it.
    pub fn free_turn(self: &Arc<Self>) -> Option<Turn> {
        let taken = self.0.locked().take_turn();
        taken.then(|| Turn(Some(self.clone())))
    }

    /// The next task still waiting, or `None` after marking the gate free.
    fn next(&self) -> Option<Waiting> {
        let mut state = self.0.locked();
        while let Some(waiting) = state.queue.pop_front() {
            if !waiting.tx.is_closed() {
                return Some(waiting);
            }
        }
        state.busy = false;
        None
    }

    /// Gives the turn to the next waiting task, or frees the gate.
    fn pass_turn(&self) {
        while let Some(waiting) = self.next() {
            if waiting.tx.send(Pass::Turn).is_ok() {
                return;
            }
        }
    }
}

impl Turn {
    /// Releases `lease`: handed straight to the next waiting task of this process when
    /// there is one, else released in the store and the turn passed on.
    pub async fn release(mut self, store: &dyn Store, lease: &Lease) -> Result<Released> {
        let Some(gate) = self.0.take() else {
            return store.release(lease).await;
        };
        let waiting = gate
            .0
            .locked()
            .queue
            .iter()
            .any(|waiting| !waiting.tx.is_closed());
        if !waiting {
            let released = store.release(lease).await;
            // Someone may have queued meanwhile: they ask the store themselves.
            gate.pass_turn();
            return released;
        }
        let Some(next) = gate.next() else {
            return store.release(lease).await;
        };
        // Boxed: the hand-over's state (the request, the store's answer) is not carried
        // by every release, most of which have nobody to hand over to.
        Box::pin(hand_over(&gate, next, store, lease)).await
    }
}

impl Turn {
    /// Puts the next waiting task in the store's queue with the request it would send
    /// (with how long it waited here, as a hand-over does), then gives it the turn to
    /// ask the store itself, which finds its place kept: how a hold that stops excluding
    /// (a downgrade) lets the store see the writers waiting here before it lets anyone
    /// else in. However this ends (dropped half-way too), the task gets the turn.
    pub async fn queue_next(mut self, store: &dyn Store) {
        let Some(gate) = self.0.take() else { return };
        let Some(Waiting { mut req, since, tx }) = gate.next() else {
            return;
        };
        req.waited_since = Some(since.into_std());
        let given = TurnGiven {
            tx: Some(tx),
            gate: gate.clone(),
        };
        let _ = store.acquire(&req).await;
        if !given.give() {
            // The task gave up meanwhile: take its place out of the store's queue.
            let _ = store.release(&req.lease()).await;
        }
    }
}

/// The turn of the task that `tx` reaches, whose request may be in the store's queue:
/// given when dropped (or, if that task has given up, passed on).
struct TurnGiven {
    tx: Option<oneshot::Sender<Pass>>,
    gate: Arc<Gate>,
}

impl TurnGiven {
    /// Gives the turn; false if the task has given up (the turn went on), leaving its
    /// request to the caller to undo.
    fn give(mut self) -> bool {
        self.send()
    }

    fn send(&mut self) -> bool {
        let given = self
            .tx
            .take()
            .is_some_and(|tx| tx.send(Pass::Queued).is_ok());
        if !given {
            self.gate.pass_turn();
        }
        given
    }
}

impl Drop for TurnGiven {
    fn drop(&mut self) {
        // Dropped half-way: the task undoes its request if it gives up too.
        if self.tx.is_some() {
            self.send();
        }
    }
}

/// Releases `lease` and makes `next`'s request in one store step ([`Store::transfer`]),
/// and passes it what came of it: the lock, or the turn to ask the store itself.
async fn hand_over(
    gate: &Gate,
    next: Waiting,
    store: &dyn Store,
    lease: &Lease,
) -> Result<Released> {
    let Waiting { mut req, since, tx } = next;
    let sent = Instant::now();
    req.waited_since = Some(since.into_std());
    let outcome = store.transfer(lease, &req).await;
    let pass = match &outcome {
        Ok((_, Attempt::Granted(grant))) => Pass::Granted(grant.clone(), sent),
        // In the store's queue: a task that gives up before asking undoes it.
        Ok((_, Attempt::Busy(_))) => Pass::Queued,
        Err(_) => {
            // Outcome unknown: undo the new acquisition by its id before the task,
            // which asks the store itself, reuses that id.
            let _ = store.release(&req.lease()).await;
            Pass::Turn
        }
    };
    if tx.send(pass).is_err() {
        // The task gave up meanwhile: take back what the store gave it (the lock, or
        // a place in its queue, which would hold up a fair queue until its waiter
        // lease ended), and pass the turn on.
        if outcome.is_ok() {
            let _ = store.release(&req.lease()).await;
        }
        gate.pass_turn();
    }
    outcome.map(|(released, _)| released)
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(gate) = self.0.take() {
            gate.pass_turn();
        }
    }
}
