//! Elections: one leader at a time, terms that increase, observers that see each leader
//! and its value and never go back, hand-over on resignation, death and pause.

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;

use super::{queued, LONG_TTL};
use crate::conformance::{join_all, unique, within, Partition, SHORT_TTL};
use crate::store::Store;
use crate::{Election, Error, Leader, Leasehold, Observer, Released};

fn election(store: &Arc<dyn Store>, name: &str, ttl: Duration) -> Election {
    let client = Leasehold::from_store(store.clone());
    client.election(name).unwrap().with_ttl(ttl)
}

/// The next change an observer reports, which must be a leader.
async fn next_leader(observer: &mut Observer, what: &str) -> Leader {
    loop {
        match within(what, observer.next()).await.unwrap() {
            Some(leader) => return leader,
            None => continue,
        }
    }
}

/// Candidates of several clients campaign at once: one leads at a time, each leads in
/// turn, and each term is above the one before.
pub async fn election_one_leader_at_a_time(store: Arc<dyn Store>) {
    let name = unique("election-one");
    let leading = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut handles = Vec::new();
    for candidate in 0..4 {
        let election = election(&store, &name, LONG_TTL);
        let leading = leading.clone();
        handles.push(tokio::spawn(async move {
            let mut terms = Vec::new();
            for round in 0..3 {
                let leadership = election
                    .campaign(format!("candidate-{candidate}-{round}"))
                    .await
                    .unwrap();
                let before = leading.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                assert_eq!(before, 0, "two leaders at once");
                terms.push(leadership.check().unwrap());
                tokio::task::yield_now().await;
                leading.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                assert_eq!(leadership.resign().await.unwrap(), Released::Released);
            }
            terms
        }));
    }
    let mut terms: Vec<_> = join_all("every candidate to lead three times", handles)
        .await
        .into_iter()
        .flatten()
        .collect();
    let all = terms.len();
    terms.sort();
    terms.dedup();
    assert_eq!(terms.len(), all, "a term was given to two leaderships");
}

/// `leader()` shows the leader's term and value; a proclamation changes the value in the
/// same term; a resignation hands over to the waiting candidate with a higher term, and
/// observers see each of these in order, woken by the store.
pub async fn election_observe_proclaim_resign(store: Arc<dyn Store>) {
    let name = unique("election-observe");
    // Leases far longer than PATIENCE: only the store's word can wake the observer in time.
    let ttl = Duration::from_secs(3600);
    let (first, second) = (election(&store, &name, ttl), election(&store, &name, ttl));
    let mut observer = election(&store, &name, ttl).observe();
    assert_eq!(
        within("the first look", observer.next()).await.unwrap(),
        None,
        "a leader before any campaign"
    );
    assert_eq!(first.leader().await.unwrap(), None);

    let leading = first.campaign("a:1").await.unwrap();
    let seen = next_leader(&mut observer, "the observer to see the first leader").await;
    assert_eq!(
        (seen.term, seen.value.as_deref()),
        (leading.term(), Some("a:1"))
    );
    let asked = second.leader().await.unwrap().expect("a leader");
    assert_eq!(
        (asked.term, asked.value.as_deref()),
        (leading.term(), Some("a:1"))
    );
    assert_eq!(asked.pid, std::process::id());

    // A value longer than every store can keep is refused, in a campaign and a
    // proclamation alike, as bad input (not as a store that is away).
    let huge = "v".repeat(crate::MAX_VALUE_LEN + 1);
    let refused = second.try_campaign(huge.as_str()).await.map(|_| ());
    assert!(
        matches!(refused, Err(Error::InvalidOption { .. })),
        "{refused:?}"
    );
    let refused = leading.proclaim(huge).await;
    assert!(
        matches!(refused, Err(Error::InvalidOption { .. })),
        "{refused:?}"
    );

    let waiting = tokio::spawn(async move { second.campaign("b:2").await.unwrap() });
    leading.proclaim("a:2").await.unwrap();
    assert_eq!(leading.value(), "a:2");
    let seen = next_leader(&mut observer, "the observer to see the proclamation").await;
    assert_eq!(
        (seen.term, seen.value.as_deref()),
        (leading.term(), Some("a:2"))
    );

    let old_term = leading.term();
    assert_eq!(leading.resign().await.unwrap(), Released::Released);
    let next = within("the waiting candidate to lead", waiting)
        .await
        .unwrap();
    assert!(
        next.term() > old_term,
        "term {} after {old_term}",
        next.term()
    );
    let seen = next_leader(&mut observer, "the observer to see the next leader").await;
    assert_eq!(
        (seen.term, seen.value.as_deref()),
        (next.term(), Some("b:2"))
    );
    let _ = next.resign().await.unwrap();
    assert_eq!(
        within("the observer to see nobody lead", observer.next())
            .await
            .unwrap(),
        None
    );
}

/// A leader that died (its leadership leaked, never renewed) is replaced within its
/// TTL; the observer sees the new leader, never the old term again; the dead leader's
/// proclamation is refused.
pub async fn election_dead_leader_is_replaced(store: Arc<dyn Store>) {
    let name = unique("election-dead");
    let dead = election(&store, &name, SHORT_TTL)
        .campaign("dead")
        .await
        .unwrap();
    let dead_term = dead.term();
    let dead_lease = dead.leak();
    let mut observer = election(&store, &name, SHORT_TTL).observe();
    let next = election(&store, &name, LONG_TTL);
    let next = within(
        "a candidate to replace the dead leader",
        next.campaign("next"),
    )
    .await
    .unwrap();
    assert!(next.term() > dead_term);
    let mut last = None;
    loop {
        let seen = next_leader(&mut observer, "the observer to see the new leader").await;
        if let Some(last) = last {
            assert!(seen.term >= last, "term {} after {last}", seen.term);
        }
        last = Some(seen.term);
        if seen.term == next.term() {
            assert_eq!(seen.value.as_deref(), Some("next"));
            break;
        }
    }
    let refused = store.proclaim(&dead_lease, "dead again").await.unwrap();
    assert_eq!(refused, crate::store::Renewal::Lost);
    let still = next.guard().check().unwrap();
    assert_eq!(still, next.term());
    let _ = next.resign().await.unwrap();
}

/// A leader cut off from the store (a pause, a partition) learns it has lost before the
/// next leader starts, and can no longer proclaim.
pub async fn election_paused_leader_knows_first(store: Arc<dyn Store>) {
    let name = unique("election-paused");
    let partition = Partition::new(store.clone());
    let cut_off = Leasehold::from_store(partition.clone());
    let leading = (cut_off.election(name.as_str()).unwrap().with_ttl(SHORT_TTL))
        .campaign("cut off")
        .await
        .unwrap();
    partition.cut_renewals();
    let next = election(&store, &name, LONG_TTL);
    let next = within("the next leader", next.campaign("next"))
        .await
        .unwrap();
    assert!(
        leading.is_lost() && leading.lost().now_or_never().is_some(),
        "the next leader started before the old one knew it had lost"
    );
    assert!(matches!(leading.check(), Err(Error::Lost { .. })));
    assert!(matches!(
        leading.proclaim("still here?").await,
        Err(Error::Lost { .. })
    ));
    assert!(next.term() > leading.term());
    let _ = next.resign().await.unwrap();
}

/// Bounded campaigns: `try_campaign` does not wait, `campaign_for` gives up in time and
/// leaves no candidate behind, and a dropped campaign leaves the queue.
pub async fn election_bounded_campaigns(store: Arc<dyn Store>) {
    let name = unique("election-bounded");
    let leading = election(&store, &name, LONG_TTL)
        .campaign("leader")
        .await
        .unwrap();
    let other = election(&store, &name, LONG_TTL);
    assert!(other.try_campaign("x").await.unwrap().is_none());
    let waited = other
        .campaign_for("y", Duration::from_millis(50))
        .await
        .unwrap();
    assert!(waited.is_none());
    let dropped = other.campaign("z").now_or_never();
    assert!(
        dropped.is_none(),
        "a campaign led while another leader held"
    );
    let client = Leasehold::from_store(store.clone());
    queued(
        "the abandoned candidates to leave the queue",
        &client,
        &name,
        0,
    )
    .await;
    let _ = leading.resign().await.unwrap();
    let after = within("a new candidate to lead", other.campaign("w"))
        .await
        .unwrap();
    assert_eq!(after.value(), "w");
    let _ = after.resign().await.unwrap();
    // Two campaigns under one owner id re-enter: one term, and the second says the
    // value the leader shows, not the one it asked for.
    let owned = election(&store, &name, LONG_TTL).with_owner(format!("owner-{name}"));
    let first = owned.campaign("first").await.unwrap();
    let second = within("a re-entering campaign", owned.campaign("second"))
        .await
        .unwrap();
    assert_eq!(second.term(), first.term());
    assert_eq!(second.value(), "first");
    let shown = owned.leader().await.unwrap().expect("a leader");
    assert_eq!(shown.value.as_deref(), Some("first"));
    let _ = second.resign().await.unwrap();
    let _ = first.resign().await.unwrap();
}
