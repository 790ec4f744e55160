//! Fencing tokens: unique across owners, and rising with each grant the store must have
//! made before another.

use std::collections::{HashMap, HashSet};

use super::report::Report;
use super::timeline::Hold;
use crate::torture::history::Role;

/// Tokens: unique across owners, and rising: a valid hold `y` must have a token above
/// every valid hold `x` that the store must have granted before it — one that began
/// before `y` did when either excludes the other (their valid leases cannot overlap), or
/// one that began before `y` was even asked for (any kind). An owner may see a token it
/// had before again when its release of it answered an error (store trouble: it is sent
/// again in the background): its next acquisition re-entered the hold that was left, as
/// re-entry must, while readers or permit holders of other owners may have been granted
/// higher tokens. Such a shared or permit hold is not judged for order (tokens stay
/// unique across owners; an exclusive one still is).
pub(super) fn tokens(holds: &[Hold], report: &mut Report) {
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

#[cfg(test)]
mod tests {
    use super::super::setup::{Fence, Primitive, Setup};
    use super::super::testing::{setup, H};
    use crate::torture::history::Role;

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
    fn a_permit_asked_for_after_another_was_granted_needs_a_higher_token() {
        let r = H::default()
            .acquired_as(0, 10, "a", 5, 100, Role::Permit)
            .acquired_as(20, 30, "b", 4, 100, Role::Permit)
            .released(40, "a", 5, 100)
            .released(40, "b", 4, 100)
            .check_as(&setup(Primitive::Semaphore(2)));
        assert_eq!(r.tokens_backwards, 1);
    }
}
