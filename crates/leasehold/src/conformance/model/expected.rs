//! What the rules expect of one name: its holders and queue in the model, what a request
//! may get there ([`Name::allowed`]), how an outcome changes it ([`Name::apply`]), and
//! in which order ended waiters may have been served ([`serve_order`]).

use super::plan::Req;
use super::Check;
use crate::rules::{self, Decision};
use crate::store::LockKind;

/// A holder in the model: one per owner, its re-entries counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Holder {
    pub(super) owner: String,
    pub(super) kind: LockKind,
    pub(super) token: u64,
    pub(super) holds: u32,
    /// The client whose gate's turn this hold has (an ownerless request that came
    /// through the gate): its release hands the lock to that gate's next task.
    pub(super) turn: Option<usize>,
}

/// A waiter in the model's queue: the store's order, which is arrival order but for a
/// non-fair task of a gate, which joins the store's queue at its end when it gets the
/// turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Waiter {
    pub(super) id: usize,
    /// Its owner id; an ownerless request's is unknown until granted (`~w` and its id).
    pub(super) owner: String,
    pub(super) kind: LockKind,
    pub(super) fair: bool,
    /// The client whose gate it goes through (see [`gated`]).
    pub(super) gate: Option<usize>,
    /// Still at the gate, behind the task that has its turn: not in the store. A fair
    /// one keeps its arrival place all the same (the store queues it by how long it
    /// waited in its process when it comes); a non-fair one has no place in the rules'
    /// queue until it gets the turn.
    pub(super) at_gate: bool,
    /// An ownerless waiter's owner as the store shows it (its acquisition's id), learned
    /// when the store first agreed with the model with it in its place; from then on that
    /// place must show this id. Ownerless waiters are otherwise alike: a cancelled one
    /// still in the store would pass for the task that took its turn.
    pub(super) seen_as: Option<String>,
}

impl Waiter {
    /// Whether the rules count it in the queue.
    fn queued(&self) -> bool {
        !self.at_gate || self.fair
    }

    /// Whether it asked without an owner id (its owner is [`unnamed`] until granted).
    pub(super) fn ownerless(&self) -> bool {
        self.owner.starts_with('~')
    }
}

/// Whether `req` waits in its client's gate (gate.rs) before the store: an exclusive
/// request without an owner, fair ones only where the store queues by arrival.
pub(super) fn gated(req: &Req, queues_by_wait: bool) -> bool {
    req.owner.is_none() && req.asked.kind() == LockKind::Exclusive && (!req.fair || queues_by_wait)
}

/// The gate `req` waits at: a client's fair and non-fair requests have gates of their
/// own. [`client_of`] gives its client back.
pub(super) fn gate_of(req: &Req) -> usize {
    req.client * 2 + usize::from(req.fair)
}

pub(super) fn client_of(gate: usize) -> usize {
    gate / 2
}

/// The model's name for an ownerless waiter until it is granted and its guard tells.
pub(super) fn unnamed(id: usize) -> String {
    format!("~w{id}")
}

/// One name in the model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Name {
    pub(super) holders: Vec<Holder>,
    pub(super) waiters: Vec<Waiter>,
    /// The highest token seen granted on this name.
    pub(super) last_token: u64,
}

/// What a request got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    Granted { token: u64, holds: u32 },
    Busy,
    Refused,
}

impl Name {
    pub(super) fn decide(
        &self,
        me: Option<usize>,
        owner: &str,
        kind: LockKind,
        fair: bool,
    ) -> Decision {
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
    pub(super) fn gate_busy(&self, gate: usize) -> bool {
        self.holders.iter().any(|h| h.turn == Some(gate))
            || self.waiters.iter().any(|w| w.gate == Some(gate))
    }

    /// `client`'s gate passes its turn on (the task with it ended, or its hold did):
    /// the next task at the gate asks the store, or is handed the lock. A fair one keeps
    /// its arrival place; a non-fair one joins the store's queue at its end. The task,
    /// if any.
    pub(super) fn pass_turn(&mut self, client: usize) -> Option<usize> {
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
    pub(super) fn allowed(
        &self,
        me: Option<usize>,
        owner: &str,
        kind: LockKind,
        fair: bool,
    ) -> Vec<Decision> {
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
    pub(super) fn apply(
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
    pub(super) fn must_serve(&self, i: usize) -> bool {
        let w = &self.waiters[i];
        !w.at_gate
            && !matches!(
                self.decide(Some(i), &w.owner, w.kind, true),
                Decision::Wait { .. }
            )
    }

    /// Drops one hold of `owner`; the task its gate's turn went to when that was the
    /// last (see [`pass_turn`](Self::pass_turn)).
    pub(super) fn drop_hold(&mut self, owner: &str) -> Option<usize> {
        let i = self.holders.iter().position(|h| h.owner == owner)?;
        self.holders[i].holds -= 1;
        if self.holders[i].holds > 0 {
            return None;
        }
        let turn = self.holders.remove(i).turn?;
        self.pass_turn(turn)
    }

    pub(super) fn text(&self) -> String {
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
pub(super) const DIRECT: usize = usize::MAX;

/// A request made at once after a release, as the rules see it: checked with the waiters
/// that release lets in, in an order the rules allow.
#[derive(Debug)]
pub(super) struct Racer {
    /// Its owner id (an ownerless request's from its guard if granted, else `~`).
    pub(super) owner: String,
    pub(super) kind: LockKind,
    pub(super) fair: bool,
    /// The client whose gate it passed.
    pub(super) turn: Option<usize>,
}

/// An order in which the rules allowed each ended waiter `(id, outcome)` when it was
/// served, and the model after it; `None` if there is none.
pub(super) fn serve_order(
    name: &Name,
    ended: &[(usize, Outcome)],
    direct: Option<&Racer>,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(list: &[(usize, &str, LockKind, bool)]) -> Vec<Waiter> {
        list.iter()
            .map(|&(id, owner, kind, fair)| Waiter {
                id,
                owner: owner.into(),
                kind,
                fair,
                gate: None,
                at_gate: false,
                seen_as: None,
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
