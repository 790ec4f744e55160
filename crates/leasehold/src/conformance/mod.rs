//! The behaviour every store must show, as plain async functions over a store.
//!
//! Store tests call [`conformance_suite!`](crate::conformance_suite), which makes one
//! test per case:
//!
//! ```text
//! // tests/conformance.rs of a store crate:
//! leasehold::conformance_suite!(async { (std::sync::Arc::new(MyStore::connect().await), ()) });
//! ```
//!
//! Each case uses lock names of its own, so cases can share one store and run in
//! parallel. Waits are on conditions with generous deadlines, never on fixed sleeps.
//!
//! Besides the cases written out here, [`model_based`] drives a store with random
//! operation sequences and checks every outcome against the lock rules (see [`model`]);
//! [`model_regressions`] runs, the same way, fixed sequences that once found a fault.

pub mod model;
pub mod rate;

mod cases;
mod partition;

pub use cases::blocking::{
    blocking_drop_releases, blocking_exclusion_across_threads, blocking_inside_an_async_runtime,
    blocking_rwlock_readers_and_writer, blocking_semaphore_limit, blocking_tokens_increase,
    blocking_try_and_bounded_wait,
};
pub use cases::election::{
    election_bounded_campaigns, election_dead_leader_is_replaced, election_observe_proclaim_resign,
    election_one_leader_at_a_time, election_paused_leader_knows_first,
};
pub use cases::exclusion::{
    bad_input_rejected, drop_releases, mutual_exclusion, tokens_and_reentry, try_and_bounded_waits,
};
pub use cases::leases::{
    expiry_after_holder_dies, force_release_is_seen_as_lost,
    force_released_holder_lets_its_process_in, lost_fires_before_takeover,
    missed_release_is_sent_again, release_is_idempotent, renewal_keeps_lock,
    renews_again_after_a_restart,
};
pub use cases::more::{
    downgrade_lets_readers_in, gate_waiter_given_a_place_can_give_up, semaphore_many_permits,
};
pub use cases::primitives::{lock_rules, read_write_rules, semaphore_limit};
pub use cases::processes::{
    abandoned_wait_leaves_by_shutdown, dead_waiter_costs_at_most_its_waiter_lease, opener, Open,
};
pub use cases::queue::{
    cancelled_wait_leaves_no_trace, fifo_when_fair, hand_over_renews_to_the_full_ttl,
    hand_over_to_a_dropped_waiter_is_not_lost, timed_out_wait_leaves_the_queue,
};
pub use model::{model_based, model_regressions};
pub use partition::Partition;

use std::future::Future;
use std::time::Duration;

/// How long a condition may take before a case fails: long enough for 2 loaded cores.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// A short TTL for cases that need leases to end.
pub const SHORT_TTL: Duration = Duration::from_millis(400);

/// How long the next waiter may take once nothing keeps it out: far less than the
/// waiter lease a place left behind would cost it.
pub const PROMPT: Duration = Duration::from_secs(2);

/// Awaits `fut`, failing the case with `what` if it takes longer than [`PATIENCE`].
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(PATIENCE, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {PATIENCE:?} waiting for {what}"),
    }
}

/// Polls `cond` until it holds, failing with `what` after [`PATIENCE`]. For observing
/// state that has no notification (e.g. a waiter appearing in `describe`).
pub async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    within(what, async {
        while !cond().await {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
}

/// Awaits every task, failing with `what` if they take longer than [`PATIENCE`] or panic.
pub async fn join_all<T>(what: &str, handles: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    within(what, async {
        let mut out = Vec::new();
        for h in handles {
            out.push(h.await.expect("task panicked"));
        }
        out
    })
    .await
}

/// A unique lock name for one case.
pub fn unique(case: &str) -> String {
    format!("conformance/{case}/{:08x}", rand::random::<u32>())
}

/// Makes one `#[tokio::test]` per conformance case for the store that `$make` builds: an
/// async expression giving `(Arc<dyn Store>, guard)`, where the guard (a temporary
/// directory, a server process) lives until the case ends.
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr) => {
        $crate::conformance_suite!(@cases $make;
            mutual_exclusion, drop_releases, try_and_bounded_waits, expiry_after_holder_dies,
            renewal_keeps_lock, lost_fires_before_takeover, missed_release_is_sent_again,
            tokens_and_reentry,
            fifo_when_fair, hand_over_renews_to_the_full_ttl, hand_over_to_a_dropped_waiter_is_not_lost,
            semaphore_limit, read_write_rules, lock_rules, release_is_idempotent,
            force_release_is_seen_as_lost, force_released_holder_lets_its_process_in,
            cancelled_wait_leaves_no_trace,
            timed_out_wait_leaves_the_queue, bad_input_rejected, model_based, model_regressions,
            election_one_leader_at_a_time, election_observe_proclaim_resign,
            election_dead_leader_is_replaced, election_paused_leader_knows_first,
            election_bounded_campaigns, semaphore_many_permits, downgrade_lets_readers_in,
            gate_waiter_given_a_place_can_give_up);
    };
    (@cases $make:expr; $($case:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let (store, _guard) = $make.await;
                let store: ::std::sync::Arc<dyn $crate::Store> = store;
                $crate::conformance::$case(store).await;
            }
        )*
    };
}

/// Makes one `#[tokio::test]` per conformance case that runs a waiter in a process of its
/// own (see [`abandoned_wait_leaves_by_shutdown`]): `$start` is an async expression giving
/// `(Open, guard)`, where the guard (a temporary directory, a server process) lives until
/// the case ends.
#[macro_export]
macro_rules! conformance_processes {
    ($start:expr) => {
        $crate::conformance_processes!(@cases $start;
            abandoned_wait_leaves_by_shutdown, dead_waiter_costs_at_most_its_waiter_lease);
    };
    (@cases $start:expr; $($case:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let (open, _guard) = $start.await;
                $crate::conformance::$case(open).await;
            }
        )*
    };
}
