//! The lock rules: for a lock's holders and waiters and a request, grant, wait (and for
//! whom), re-enter, or refuse (and why). Pure: no I/O, no clock, no store.
//!
//! The memory and local stores ([`record`](crate::record)) and the etcd store decide
//! with [`decide`]; the Redis scripts implement the same table (`acquire.lua`) and answer
//! a refusal with its [`Refusal::code`], from which Rust writes the message. The crate docs
//! ("The lock rules") state the table for users; the conformance suite checks every store
//! against it.
//!
//! The table, for a request of `owner` asking for `kind`:
//!
//! 1. **One primitive per name.** A name in use (held or awaited) as a mutex or read-write
//!    lock refuses a semaphore request, and the other way round
//!    ([`Refusal::OtherPrimitive`]); a semaphore refuses a request with another number of
//!    permits ([`Refusal::PermitCount`]). Waiting could never end well: the two sides
//!    would never agree on who may hold.
//! 2. **Re-entry.** If `owner` holds the lock, the request adds a hold with the same
//!    token, whatever waits: the same kind, or shared asked by an exclusive holder (a
//!    writer may read). Exclusive asked by a shared holder is refused
//!    ([`Refusal::Upgrade`]): two readers upgrading would each wait for the other forever.
//! 3. **Holders.** Readers share with readers; permit holders with permit holders, up to
//!    the permits (one per owner); an exclusive holder with nobody.
//! 4. **Waiters ahead.** A fair request waits behind every waiter queued before it, except
//!    that a reader does not wait behind readers (they are let in together). A non-fair
//!    request passes waiters, except that a reader never passes a waiting writer (no
//!    writer starvation).
//! 5. **Downgrade.** A writer may turn its hold into a read hold in place (same token),
//!    whatever waits: it holds the lock, so nobody is passed. Only as its owner's one
//!    hold ([`Refusal::Downgrade`]): the owner's other holds would turn shared with it,
//!    under guards that count on holding alone.

use crate::store::LockKind;

/// A holder as the rules see it: one per owner (its re-entries are one holder).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder<'a> {
    pub owner: &'a str,
    pub kind: LockKind,
}

/// A waiter in the queue, in arrival order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Waiter<'a> {
    pub owner: &'a str,
    pub kind: LockKind,
}

/// A request as the rules see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ask<'a> {
    pub owner: &'a str,
    pub kind: LockKind,
    pub fair: bool,
}

/// What a request gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The owner of `holders[i]` holds it: one more hold, the same token.
    Reenter(usize),
    /// A new holder, with a new token.
    Grant,
    /// Not now: `holder` (an index into holders) is in the way, and/or `waiter` (an index
    /// into waiters) is queued ahead and may not be passed.
    Wait {
        holder: Option<usize>,
        waiter: Option<usize>,
    },
    /// Never as asked.
    Refuse(Refusal),
}

/// Why a request cannot be served as asked, whatever happens to the lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The owner holds the lock shared and asked for it exclusive.
    Upgrade {
        /// The owner id.
        owner: String,
    },
    /// The owner holds the lock more than once and asked to downgrade one hold: its
    /// holds are one holder, so the others would turn shared with it.
    Downgrade {
        /// The owner id.
        owner: String,
        /// Its holds.
        holds: u32,
    },
    /// The name is in use as another primitive (a mutex or read-write lock against a
    /// semaphore).
    OtherPrimitive {
        /// How it is in use.
        used: LockKind,
        /// What was asked.
        asked: LockKind,
    },
    /// The name is in use as a semaphore with another number of permits.
    PermitCount {
        /// Its permits.
        used: u32,
        /// The permits asked for.
        asked: u32,
    },
}

impl Refusal {
    /// A short stable code, as the Redis acquire script answers with it.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::Upgrade { .. } => "upgrade",
            Refusal::Downgrade { .. } => "downgrade",
            Refusal::OtherPrimitive { .. } => "primitive",
            Refusal::PermitCount { .. } => "permits",
        }
    }

    /// What was wrong and what to do, for [`Error::Conflict`](crate::Error::Conflict).
    pub fn message(&self) -> String {
        match self {
            Refusal::Upgrade { owner } => format!(
                "owner {owner:?} holds it shared and asked for it exclusive; upgrading a shared hold would deadlock, release it first"
            ),
            Refusal::Downgrade { owner, holds } => format!(
                "owner {owner:?} holds it {holds} times; a downgrade turns all of an owner's holds shared, so release the others first"
            ),
            Refusal::OtherPrimitive { used, asked } => format!(
                "it is in use as {}, and {} was asked for; a name is one kind of lock at a time, use another name",
                primitive(*used),
                primitive(*asked)
            ),
            Refusal::PermitCount { used, asked } => format!(
                "it is in use as a semaphore with {used} permits; asked with {asked}; use the same count everywhere"
            ),
        }
    }

    /// The refusal as the error a caller gets for `name`.
    pub(crate) fn conflict(&self, name: &str) -> crate::Error {
        crate::Error::Conflict {
            name: name.to_string(),
            reason: self.message(),
        }
    }

    /// The refusal `code` names, with the kinds or owner it concerns (a store's script
    /// answers with the code only; the request and the kind it met fill in the rest).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn from_code(code: &str, ask: &Ask<'_>, used: LockKind) -> Option<Refusal> {
        Some(match (code, used, ask.kind) {
            ("upgrade", _, _) => Refusal::Upgrade {
                owner: ask.owner.to_string(),
            },
            ("primitive", used, asked) => Refusal::OtherPrimitive { used, asked },
            ("permits", LockKind::Permit { permits: used }, LockKind::Permit { permits }) => {
                Refusal::PermitCount {
                    used,
                    asked: permits,
                }
            }
            _ => return None,
        })
    }
}

fn primitive(kind: LockKind) -> String {
    match kind {
        LockKind::Permit { permits: 1 } => "a semaphore of 1 permit".into(),
        LockKind::Permit { permits } => format!("a semaphore of {permits} permits"),
        LockKind::Exclusive | LockKind::Shared => "a mutex or read-write lock".into(),
    }
}

/// Whether `asked` may be used on a name in use as `used` (rule 1).
pub(crate) fn same_primitive(used: LockKind, asked: LockKind) -> Result<(), Refusal> {
    match (used, asked) {
        (LockKind::Permit { permits: used }, LockKind::Permit { permits: asked })
            if used != asked =>
        {
            Err(Refusal::PermitCount { used, asked })
        }
        (LockKind::Permit { .. }, LockKind::Permit { .. }) => Ok(()),
        (LockKind::Permit { .. }, _) | (_, LockKind::Permit { .. }) => {
            Err(Refusal::OtherPrimitive { used, asked })
        }
        _ => Ok(()),
    }
}

/// Whether an owner holding `held` may take `asked` as one more hold (rule 2); the hold
/// keeps the holder's kind.
pub(crate) fn reentry(held: LockKind, asked: LockKind, owner: &str) -> Result<(), Refusal> {
    match (held, asked) {
        (LockKind::Shared, LockKind::Exclusive) => Err(Refusal::Upgrade {
            owner: owner.to_string(),
        }),
        _ => same_primitive(held, asked),
    }
}

/// Whether the holder of `held`, with `holds` holds, may turn them shared (rule 5): `Ok(true)`
/// to change, `Ok(false)` when they are shared already (a downgrade sent again after its
/// answer was lost).
pub(crate) fn downgrade(held: LockKind, holds: u32, owner: &str) -> Result<bool, Refusal> {
    match held {
        LockKind::Shared => Ok(false),
        LockKind::Exclusive if holds > 1 => Err(Refusal::Downgrade {
            owner: owner.to_string(),
            holds,
        }),
        LockKind::Exclusive => Ok(true),
        LockKind::Permit { .. } => Err(Refusal::OtherPrimitive {
            used: held,
            asked: LockKind::Shared,
        }),
    }
}

/// Whether a holder of `held` admits a new holder of `asked` beside it (rule 3, but for
/// the permit count).
pub(crate) fn shares(held: LockKind, asked: LockKind) -> bool {
    matches!(
        (held, asked),
        (LockKind::Shared, LockKind::Shared) | (LockKind::Permit { .. }, LockKind::Permit { .. })
    )
}

/// Whether `ask` may not pass `waiter`, queued ahead of it (rule 4).
pub(crate) fn waits_behind(ask: &Ask<'_>, waiter: LockKind) -> bool {
    let readers = waiter == LockKind::Shared && ask.kind == LockKind::Shared;
    match ask.fair {
        true => !readers,
        false => ask.kind == LockKind::Shared && waiter == LockKind::Exclusive,
    }
}

/// The decision for `ask` on a lock with `holders` (one per owner) and `waiters` in queue
/// order, of which the request itself is `waiters[me]` if queued (`ahead` are those
/// before it: all of them when not queued).
pub(crate) fn decide(
    holders: &[Holder<'_>],
    waiters: &[Waiter<'_>],
    me: Option<usize>,
    ask: &Ask<'_>,
) -> Decision {
    let others = waiters
        .iter()
        .enumerate()
        .filter(|&(i, _)| Some(i) != me)
        .map(|(_, w)| w.kind);
    for used in holders.iter().map(|h| h.kind).chain(others) {
        if let Err(refusal) = same_primitive(used, ask.kind) {
            return Decision::Refuse(refusal);
        }
    }
    if let Some(i) = holders.iter().position(|h| h.owner == ask.owner) {
        return match reentry(holders[i].kind, ask.kind, ask.owner) {
            Ok(()) => Decision::Reenter(i),
            Err(refusal) => Decision::Refuse(refusal),
        };
    }
    let holder = match ask.kind {
        LockKind::Permit { permits } if holders.len() >= permits as usize => Some(0),
        _ => holders.iter().position(|h| !shares(h.kind, ask.kind)),
    };
    let ahead = &waiters[..me.unwrap_or(waiters.len())];
    let waiter = ahead.iter().position(|w| waits_behind(ask, w.kind));
    match (holder, waiter) {
        (None, None) => Decision::Grant,
        (holder, waiter) => Decision::Wait { holder, waiter },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LockKind::{Exclusive as X, Shared as S};

    const P2: LockKind = LockKind::Permit { permits: 2 };
    const P3: LockKind = LockKind::Permit { permits: 3 };

    fn held(list: &[(&'static str, LockKind)]) -> Vec<Holder<'static>> {
        list.iter()
            .map(|&(owner, kind)| Holder { owner, kind })
            .collect()
    }

    fn queued(list: &[(&'static str, LockKind)]) -> Vec<Waiter<'static>> {
        list.iter()
            .map(|&(owner, kind)| Waiter { owner, kind })
            .collect()
    }

    fn ask(owner: &'static str, kind: LockKind, fair: bool) -> Ask<'static> {
        Ask { owner, kind, fair }
    }

    fn wait(holder: Option<usize>, waiter: Option<usize>) -> Decision {
        Decision::Wait { holder, waiter }
    }

    #[test]
    fn a_free_lock_is_granted_to_any_kind() {
        for kind in [X, S, P2] {
            for fair in [false, true] {
                assert_eq!(
                    decide(&[], &[], None, &ask("a", kind, fair)),
                    Decision::Grant
                );
            }
        }
    }

    #[test]
    fn holders_share_by_kind() {
        let cases = [
            (X, X, wait(Some(0), None)),
            (X, S, wait(Some(0), None)),
            (S, X, wait(Some(0), None)),
            (S, S, Decision::Grant),
            (P2, P2, Decision::Grant),
        ];
        for (held_kind, kind, want) in cases {
            let got = decide(
                &held(&[("a", held_kind)]),
                &[],
                None,
                &ask("b", kind, false),
            );
            assert_eq!(got, want, "{held_kind:?} held, {kind:?} asked");
        }
    }

    #[test]
    fn a_semaphore_admits_one_holder_per_permit() {
        let two = held(&[("a", P2), ("b", P2)]);
        assert_eq!(
            decide(&two, &[], None, &ask("c", P2, false)),
            wait(Some(0), None)
        );
        assert_eq!(
            decide(&two[..1], &[], None, &ask("c", P2, false)),
            Decision::Grant
        );
    }

    #[test]
    fn the_same_owner_reenters_as_the_same_kind_or_a_writer_as_a_reader() {
        for (held_kind, kind) in [(X, X), (S, S), (P2, P2), (X, S)] {
            let holders = held(&[("z", S), ("a", held_kind)]);
            let holders = if held_kind == S {
                holders
            } else {
                holders[1..].to_vec()
            };
            let i = holders.iter().position(|h| h.owner == "a").unwrap();
            // Whatever waits ahead: the owner already holds it.
            let waiting = if held_kind == P2 { P2 } else { X };
            let waiters = queued(&[("w", waiting)]);
            let got = decide(&holders, &waiters, None, &ask("a", kind, true));
            assert_eq!(
                got,
                Decision::Reenter(i),
                "{held_kind:?} held, {kind:?} asked"
            );
        }
    }

    #[test]
    fn a_reader_asking_to_write_is_refused_even_alone() {
        for holders in [held(&[("a", S)]), held(&[("b", S), ("a", S)])] {
            let got = decide(&holders, &[], None, &ask("a", X, false));
            assert_eq!(
                got,
                Decision::Refuse(Refusal::Upgrade { owner: "a".into() })
            );
        }
    }

    #[test]
    fn a_name_is_one_primitive_held_or_awaited() {
        let refused = |used, asked| Decision::Refuse(Refusal::OtherPrimitive { used, asked });
        assert_eq!(
            decide(&held(&[("a", X)]), &[], None, &ask("b", P2, false)),
            refused(X, P2)
        );
        assert_eq!(
            decide(&held(&[("a", P2)]), &[], None, &ask("b", S, false)),
            refused(P2, S)
        );
        // The same owner too: a semaphore is not a re-entry of a mutex.
        assert_eq!(
            decide(&held(&[("a", X)]), &[], None, &ask("a", P2, false)),
            refused(X, P2)
        );
        // Only a waiter uses it.
        assert_eq!(
            decide(&[], &queued(&[("a", P2)]), None, &ask("b", X, true)),
            refused(P2, X)
        );
        // Our own queue entry does not count.
        assert_eq!(
            decide(&[], &queued(&[("b", X)]), Some(0), &ask("b", X, true)),
            Decision::Grant
        );
    }

    #[test]
    fn semaphores_of_other_sizes_are_refused() {
        let got = decide(&held(&[("a", P2)]), &[], None, &ask("b", P3, false));
        assert_eq!(
            got,
            Decision::Refuse(Refusal::PermitCount { used: 2, asked: 3 })
        );
        let got = decide(&[], &queued(&[("a", P3)]), None, &ask("b", P2, true));
        assert_eq!(
            got,
            Decision::Refuse(Refusal::PermitCount { used: 3, asked: 2 })
        );
    }

    #[test]
    fn a_fair_request_waits_behind_the_queue_but_readers_join_readers() {
        let waiters = queued(&[("w", X), ("r", S)]);
        assert_eq!(
            decide(&[], &waiters, None, &ask("a", X, true)),
            wait(None, Some(0))
        );
        assert_eq!(
            decide(&[], &waiters, None, &ask("a", S, true)),
            wait(None, Some(0))
        );
        // Queued second, behind the writer.
        let waiters = queued(&[("w", X), ("a", X)]);
        assert_eq!(
            decide(&[], &waiters, Some(1), &ask("a", X, true)),
            wait(None, Some(0))
        );
        assert_eq!(
            decide(&[], &waiters, Some(0), &ask("w", X, true)),
            Decision::Grant
        );
        // Readers behind readers are let in together.
        let readers = held(&[("r1", S)]);
        let waiters = queued(&[("r2", S)]);
        assert_eq!(
            decide(&readers, &waiters, None, &ask("r3", S, true)),
            Decision::Grant
        );
        let permits = queued(&[("p", P2)]);
        assert_eq!(
            decide(&[], &permits, None, &ask("a", P2, true)),
            wait(None, Some(0))
        );
    }

    #[test]
    fn a_non_fair_request_passes_waiters_but_a_reader_not_a_writer() {
        let waiters = queued(&[("r", S), ("w", X)]);
        assert_eq!(
            decide(&[], &waiters, None, &ask("a", X, false)),
            Decision::Grant
        );
        assert_eq!(
            decide(&[], &waiters, None, &ask("a", S, false)),
            wait(None, Some(1))
        );
        let readers = held(&[("r1", S)]);
        assert_eq!(
            decide(&readers, &waiters, None, &ask("a", S, false)),
            wait(None, Some(1))
        );
        let permits = queued(&[("p", P2)]);
        assert_eq!(
            decide(&[], &permits, None, &ask("a", P2, false)),
            Decision::Grant
        );
    }

    #[test]
    fn a_writer_alone_downgrades_and_a_reader_already_has() {
        assert_eq!(downgrade(X, 1, "a"), Ok(true));
        assert_eq!(downgrade(S, 1, "a"), Ok(false));
        assert_eq!(downgrade(S, 3, "a"), Ok(false));
        let refused = downgrade(X, 2, "a").unwrap_err();
        let want = Refusal::Downgrade {
            owner: "a".into(),
            holds: 2,
        };
        assert_eq!(refused, want);
        assert!(refused.message().contains("release the others first"));
        assert_eq!(
            downgrade(P2, 1, "a"),
            Err(Refusal::OtherPrimitive { used: P2, asked: S })
        );
    }

    #[test]
    fn refusals_have_stable_codes_and_messages_that_say_what_to_do() {
        let ask = ask("a", P3, false);
        for refusal in [
            Refusal::Upgrade { owner: "a".into() },
            Refusal::OtherPrimitive { used: X, asked: P3 },
            Refusal::PermitCount { used: 2, asked: 3 },
        ] {
            let used = match refusal {
                Refusal::PermitCount { .. } => P2,
                _ => X,
            };
            let back = Refusal::from_code(refusal.code(), &ask, used).unwrap();
            match refusal {
                // The owner comes from the request.
                Refusal::Upgrade { .. } => assert_eq!(back, Refusal::Upgrade { owner: "a".into() }),
                _ => assert_eq!(back, refusal),
            }
            let message = refusal.message();
            assert!(
                ["release it first", "use another name", "use the same count"]
                    .iter()
                    .any(|fix| message.contains(fix)),
                "{message}"
            );
        }
        assert_eq!(Refusal::from_code("nonsense", &ask, X), None);
    }
}
