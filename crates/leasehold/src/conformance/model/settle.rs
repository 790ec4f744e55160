//! Settling after each step: collecting the requests that ended, checking that the rules
//! allowed them in some order, and comparing the model with what the store shows.

use std::time::Duration;

use tokio::time::Instant;

use super::driver::{granted, Direct, Driver, Ended, Task};
use super::expected::{client_of, serve_order, unnamed, Outcome, Waiter, DIRECT};
use super::plan::Req;
use super::{Check, CLIENTS, OWNERS, PROMPT};
use crate::conformance::PATIENCE;
use crate::store::{LockKind, LockState};
use crate::Error;

impl Driver {
    /// Waits until every waiter the rules serve is served (checking each against the
    /// rules) and the store shows the model's state, which must come within `within`
    /// once no waiter is due.
    pub(super) async fn settle(&mut self, within: Duration) -> Check {
        let started = Instant::now();
        let mut quiet: Option<Instant> = None;
        loop {
            if self.collect().await? {
                quiet = None;
                continue;
            }
            if !self.parked.is_empty() {
                // Outcomes kept back until the waiters on their way back come (or `park`
                // gives up): the store is ahead of the model meanwhile.
                tokio::time::sleep(Duration::from_millis(5)).await;
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
                Ok(seen) => {
                    self.seen(seen);
                    return Ok(());
                }
                Err(diff) => ensure!(
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
        let Some((mut ended, direct)) = self.ended().await? else {
            return Ok(false);
        };
        for n in 0..self.model.len() {
            let direct = direct.as_ref().filter(|d| d.name == n);
            if self.granted_before(n, direct, &ended).await? {
                // A request granted before one that came back (a lower token) is on its
                // way back (its task has not finished): judge them together once it
                // comes, whether the one that came back was a waiter or the racing
                // request.
                let (kept, rest): (Vec<Ended>, Vec<Ended>) =
                    ended.into_iter().partition(|e| e.1 == n);
                let first = self.parked_since.is_none();
                self.parked.extend(kept);
                self.parked_since.get_or_insert_with(Instant::now);
                if first {
                    self.count(match direct {
                        Some(_) => "racing request judged once an earlier grant came back",
                        None => "waiter judged once an earlier grant came back",
                    });
                }
                ended = rest;
            }
        }
        let mut applied = false;
        for n in 0..self.model.len() {
            applied |= self.judge(n, &mut ended, direct.as_ref())?;
        }
        if self.parked.is_empty() {
            self.parked_since = None;
        } else {
            self.direct = direct;
        }
        Ok(applied)
    }

    /// Whether the store shows a holder of name `n` that was granted before the latest
    /// grant among `ended` there (a lower token) and that neither the model nor the
    /// requests that ended know, while waiters of that name are still running: one of
    /// them, granted first, is on its way back. (For a while, counted from the racing
    /// request's answer or the first parking: then the grants are judged as they are.)
    async fn granted_before(
        &self,
        n: usize,
        direct: Option<&Direct>,
        ended: &[Ended],
    ) -> Check<bool> {
        let Some(latest) = (ended.iter())
            .filter(|e| e.1 == n)
            .filter_map(|e| match e.3 {
                Outcome::Granted { token, .. } => Some(token),
                _ => None,
            })
            .max()
        else {
            return Ok(false);
        };
        let running = self.tasks.iter().any(|t| t.name == n);
        let since = direct.map(|d| d.since).or(self.parked_since);
        if !running || since.is_some_and(|s| s.elapsed() >= PATIENCE) {
            return Ok(false);
        }
        let name = &self.names[n];
        let state = (self.clients[0].describe(name.as_str()).await)
            .map_err(|e| format!("describe n{n} failed: {e}"))?;
        let known = |t: u64| {
            self.model[n].holders.iter().any(|h| h.token == t)
                || ended.iter().any(|e| {
                    e.1 == n && matches!(e.3, Outcome::Granted { token, .. } if token == t)
                })
        };
        Ok((state.holders.iter())
            .map(|h| h.token.get())
            .any(|t| t < latest && !known(t)))
    }

    /// The requests that ended since the last look: the waiters that finished, the
    /// racing request and those parked before; `None` if there are none.
    async fn ended(&mut self) -> Check<Option<(Vec<Ended>, Option<Direct>)>> {
        let (done, waiting): (Vec<Task>, Vec<Task>) = std::mem::take(&mut self.tasks)
            .into_iter()
            .partition(|t| t.handle.is_finished());
        self.tasks = waiting;
        let direct = self.direct.take();
        let mut ended: Vec<Ended> = std::mem::take(&mut self.parked);
        if done.is_empty() && direct.is_none() && ended.is_empty() {
            return Ok(None);
        }
        let parked_direct = ended.iter().any(|e| e.0 == DIRECT);
        for mut task in done {
            let got = (&mut task.handle).await;
            let (outcome, guard) = match got {
                Ok(Ok(guard)) => granted(guard),
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
        Ok(Some((ended, direct)))
    }

    /// Checks the requests of name `n` among `ended` against the rules and applies them
    /// in an order the rules allow, taking them out of `ended`. Whether it applied any.
    fn judge(&mut self, n: usize, ended: &mut Vec<Ended>, direct: Option<&Direct>) -> Check<bool> {
        let mine: Vec<(usize, Outcome)> = (ended.iter())
            .filter(|e| e.1 == n)
            .map(|e| (e.0, e.3))
            .collect();
        if mine.is_empty() {
            return Ok(false);
        }
        let direct = direct.filter(|d| d.name == n);
        let Some((order, after)) = serve_order(&self.model[n], &mine, direct.map(|d| &d.ask))
        else {
            return self.park(n, ended, &mine, direct).map(|()| false);
        };
        self.model[n] = after;
        self.check_handed(n, &mine)?;
        for id in order {
            let at = ended
                .iter()
                .position(|e| e.0 == id)
                .expect("an ended waiter");
            self.served(ended.remove(at))?;
        }
        Ok(true)
    }

    /// The requests of name `n` ended in no order the rules allow: a failure, unless the
    /// racing request may have come back before a waiter it lost to.
    fn park(
        &mut self,
        n: usize,
        ended: &mut Vec<Ended>,
        mine: &[(usize, Outcome)],
        direct: Option<&Direct>,
    ) -> Check {
        // A waiter can be granted in the store before the racing request was
        // answered, or before another waiter that came back first, while its task is
        // still on its way back (a call after the grant): keep this name's outcomes
        // back until the waiters still running there have finished, for a while.
        let running = self.tasks.iter().any(|t| t.name == n);
        let since = *self.parked_since.get_or_insert_with(Instant::now);
        let since = direct.map_or(since, |d| d.since);
        if running && since.elapsed() < PATIENCE {
            let (kept, rest): (Vec<Ended>, Vec<Ended>) =
                std::mem::take(ended).into_iter().partition(|e| e.1 == n);
            self.parked.extend(kept);
            self.count(match direct {
                Some(_) => "racing request judged once a grant came back",
                None => "waiter judged once another came back",
            });
            *ended = rest;
            return Ok(());
        }
        let got: Vec<String> = (mine.iter())
            .map(|(id, o)| match *id {
                DIRECT => format!("the request after the release: {o:?}"),
                id => format!("w{id}: {o:?}"),
            })
            .collect();
        Err(format!(
            "on n{n}, requests ended as the rules do not allow, in any order: {}\n  model n{n} before: {}",
            got.join(", "),
            self.model[n].text()
        ))
    }

    /// A gate task handed the lock by a release is the next holder of the name.
    fn check_handed(&mut self, n: usize, mine: &[(usize, Outcome)]) -> Check {
        let Some(h) = self.handed.iter().position(|h| h.name == n) else {
            return Ok(());
        };
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
        Ok(())
    }

    /// Takes on a request the rules allowed to end as it did: an ownerless holder gets
    /// its guard's owner id, and the guard, if any, is held.
    fn served(&mut self, (id, name, req, outcome, guard): Ended) -> Check {
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
        Ok(())
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
    async fn compare(&self) -> Check<Result<Vec<Seen>, String>> {
        let mut seen_now = Vec::new();
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
                let queue: Vec<&Waiter> = (model.waiters.iter())
                    .filter(|w| !w.at_gate)
                    .chain(gate)
                    .collect();
                let fits = |(seen, want): (&(String, LockKind), &&Waiter)| {
                    seen.1 == want.kind
                        && match (want.ownerless(), &want.seen_as) {
                            (false, _) => seen.0 == want.owner,
                            (true, Some(id)) => &seen.0 == id,
                            (true, None) => {
                                !OWNERS.contains(&seen.0.as_str())
                                    && !self.seen_ids.contains(&seen.0)
                            }
                        }
                };
                if seen != want
                    || queued.len() != queue.len()
                    || !queued.iter().zip(&queue).all(fits)
                {
                    let shown: Vec<(Option<&str>, LockKind)> = (queue.iter())
                        .map(|w| match w.ownerless() {
                            true => (w.seen_as.as_deref(), w.kind),
                            false => (Some(w.owner.as_str()), w.kind),
                        })
                        .collect();
                    return Ok(Err(format!(
                        "n{n} from c{client}: the store has holders {seen:?} and waiters {queued:?}; the model {want:?} and {shown:?} (None: an ownerless waiter not seen yet)"
                    )));
                }
                seen_now.extend(
                    (queued.iter().zip(&queue))
                        .filter(|(_, w)| w.ownerless() && w.seen_as.is_none())
                        .map(|(seen, w)| Seen {
                            name: n,
                            waiter: w.id,
                            id: seen.0.clone(),
                        }),
                );
            }
        }
        Ok(Ok(seen_now))
    }

    /// Notes the ids that ownerless waiters were seen as, the store and the model agreeing.
    fn seen(&mut self, seen: Vec<Seen>) {
        for Seen { name, waiter, id } in seen {
            let model = &mut self.model[name];
            if let Some(w) = model.waiters.iter_mut().find(|w| w.id == waiter) {
                w.seen_as.get_or_insert_with(|| id.clone());
            }
            self.seen_ids.insert(id);
        }
    }
}

/// An ownerless waiter as the store showed it: its acquisition's id.
struct Seen {
    name: usize,
    waiter: usize,
    id: String,
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
