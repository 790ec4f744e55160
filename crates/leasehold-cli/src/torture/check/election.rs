//! A leader election's own rules, beside the mutex's (no two valid leaderships at once,
//! terms rising from leader to leader): each observer's terms never go back, and each
//! leader an observer reported was a real leadership: a term some candidate was granted,
//! shown with the value that candidate campaigned with.

use std::collections::{HashMap, HashSet};

use super::report::Report;
use crate::torture::history::{Entry, Event};

/// Judges the observers' reports against the campaigns and grants in `history`.
pub(super) fn election(history: &[Entry], report: &mut Report) {
    // Owner -> the value of its campaign now; every value any candidate campaigned with.
    let mut campaign: HashMap<&str, &str> = HashMap::new();
    let mut campaigned: HashSet<&str> = HashSet::new();
    // Term -> the values its owner campaigned with when granted it: more than one when a
    // later campaign re-entered a hold that a failed release had left in the store (the
    // store keeps the first value then).
    let mut terms: HashMap<u64, HashSet<&str>> = HashMap::new();
    // Observer -> the highest term it reported.
    let mut highest: HashMap<&str, u64> = HashMap::new();
    let mut reported = Vec::new();
    for entry in history {
        match &entry.event {
            Event::Campaign { owner, value } => {
                campaign.insert(owner, value);
                campaigned.insert(value);
            }
            Event::Acquired { owner, token, .. } | Event::Reentered { owner, token, .. } => {
                if let Some(&value) = campaign.get(owner.as_str()) {
                    terms.entry(*token).or_default().insert(value);
                }
            }
            Event::Observed {
                observer,
                term: Some(term),
                value,
                ..
            } => {
                report.observed_leaders += 1;
                let top = highest.entry(observer).or_default();
                if term < top {
                    report.observer_regressions += 1;
                }
                *top = (*top).max(*term);
                reported.push((*term, value.as_deref()));
            }
            Event::ObserveFailed { regressed, .. } => {
                report.observer_errors += 1;
                report.observer_regressions += usize::from(*regressed);
            }
            _ => {}
        }
    }
    for (term, value) in reported {
        match (terms.get(&term), value) {
            (Some(values), Some(value)) if values.contains(value) => {}
            // A grant whose answer the candidate never got (lost in a link or store
            // fault): the term is unclaimed, but the value must be a campaign's.
            (None, Some(value)) if campaigned.contains(value) => report.observed_unclaimed += 1,
            _ => report.observed_wrong_value += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::setup::{Fence, Primitive, Setup};
    use super::super::testing::{setup, H};
    use super::super::Report;
    use crate::torture::history::Op;

    fn check(h: H) -> Report {
        h.check_as(&Setup {
            fair: true,
            ..setup(Primitive::Election)
        })
    }

    /// `owner` campaigns with "OWNER/0" at `t`, leads in `term` (the counter's
    /// `term`-th increment) and resigns; the observer `o` sees it.
    fn lead(h: H, t: u64, owner: &str, term: u64) -> H {
        let value = format!("{owner}/0");
        h.campaign(t, owner, &value)
            .acquired(t, owner, term, t + 100)
            .observed(t + 1, "o", term, Some(&value))
            .access(t + 2, owner, term, Op::Read, term - 1, true)
            .access(t + 3, owner, term, Op::Write, term, true)
            .released(t + 4, owner, term, t + 100)
    }

    /// a leads in term 1, then b in term 2.
    fn two_terms() -> H {
        lead(lead(H::default(), 0, "a", 1), 5, "b", 2)
    }

    #[test]
    fn a_clean_election_passes() {
        let r = check(two_terms());
        assert_eq!(r.violations, Vec::<String>::new());
        assert_eq!((r.acquisitions, r.observed_leaders), (2, 2));
        assert_eq!((r.observer_regressions, r.observed_wrong_value), (0, 0));
    }

    #[test]
    fn an_observer_whose_term_goes_back_fails() {
        let r = check(two_terms().observed(10, "o", 1, Some("a/0")));
        assert_eq!(r.observer_regressions, 1);
        assert!(r.violations.iter().any(|v| v.contains("term went back")));
        // Another observer seeing term 1 first is no regression.
        let r = check(two_terms().observed(10, "o2", 1, Some("a/0")));
        assert_eq!(r.violations, Vec::<String>::new());
        // The library's observer refusing an older term is one.
        let r = check(two_terms().observe_failed(10, "o", true));
        assert_eq!((r.observer_regressions, r.observer_errors), (1, 1));
        assert!(r.violations.iter().any(|v| v.contains("term went back")));
        let r = check(two_terms().observe_failed(10, "o", false));
        assert_eq!((r.observer_regressions, r.observer_errors), (0, 1));
        assert_eq!(r.violations, Vec::<String>::new());
    }

    #[test]
    fn a_leader_shown_with_a_value_its_candidate_did_not_campaign_with_fails() {
        for (term, value) in [
            (2, Some("a/0")),  // a's value in b's term
            (2, None),         // the store lost the value
            (3, Some("z/9")),  // nobody campaigned with it
            (1, Some("a/01")), // not a's value
        ] {
            let r = check(two_terms().observed(10, "o2", term, value));
            assert_eq!(r.observed_wrong_value, 1, "{term} {value:?}");
            assert!(
                r.violations.iter().any(|v| v.contains("no leadership had")),
                "{term} {value:?}: {:?}",
                r.violations
            );
        }
    }

    /// c's acquire failed with the outcome unknown (a reset link): the store granted
    /// term 3, which c never learned of, and the observer saw it with c's value.
    #[test]
    fn a_term_granted_to_a_candidate_that_never_learned_of_it_is_reported_not_failed() {
        let r = check(
            two_terms()
                .campaign(10, "c", "c/0")
                .acquire_failed(12, "c")
                .observed(11, "o", 3, Some("c/0")),
        );
        assert_eq!((r.observed_unclaimed, r.observed_wrong_value), (1, 0));
        assert_eq!(r.violations, Vec::<String>::new());
    }

    /// a's release of term 5 failed (the store was away) and its next campaign re-entered
    /// the hold it left: the store shows the first campaign's value in that term.
    #[test]
    fn a_re_entered_left_hold_may_show_its_first_campaign_s_value() {
        let h = |shown: &str| {
            H::default()
                .campaign(0, "a", "a/0")
                .acquired(0, "a", 5, 100)
                .release_failed(10, "a", 5)
                .campaign(20, "a", "a/1")
                .acquired(20, "a", 5, 120)
                .observed(21, "o", 5, Some(shown))
                .released(30, "a", 5, 120)
        };
        for shown in ["a/0", "a/1"] {
            assert_eq!(check(h(shown)).violations, Vec::<String>::new(), "{shown}");
        }
    }

    #[test]
    fn two_leaders_at_once_and_a_term_that_goes_back_fail() {
        let r = check(
            H::default()
                .campaign(0, "a", "a/0")
                .acquired(0, "a", 2, 100)
                .campaign(10, "b", "b/0")
                .acquired(50, "b", 1, 150)
                .observed(51, "o", 2, Some("a/0"))
                .released(60, "b", 1, 150)
                .released(70, "a", 2, 100),
        );
        assert_eq!((r.service_overlap, r.tokens_backwards), (1, 1));
        assert!(r
            .violations
            .iter()
            .any(|v| v.starts_with("service overlap")));
        assert!(r.violations.iter().any(|v| v.contains("did not increase")));
    }

    #[test]
    fn an_election_whose_observer_reported_no_leader_fails() {
        let h = || {
            H::default()
                .campaign(0, "a", "a/0")
                .acquired(0, "a", 1, 100)
                .released(4, "a", 1, 100)
        };
        let r = check(h().observed_none(5, "o"));
        assert_eq!(r.violations, vec!["the observers reported no leader"]);
        // A mutex has no observer.
        assert_eq!(h().check(Fence::All).violations, Vec::<String>::new());
    }
}
