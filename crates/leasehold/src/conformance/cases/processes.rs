//! Waiters in processes of their own that stop waiting, gracefully or by dying.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::{fair_lock, waiting_owners, LONG_TTL};
use crate::conformance::{eventually, unique, within, PATIENCE, PROMPT};
use crate::store::Store;
use crate::{Leasehold, Result};

/// Opens a connection of its own to the store under test, as another process would; it
/// is called on the runtime that uses it.
pub type Open =
    Arc<dyn Fn() -> futures_util::future::BoxFuture<'static, Arc<dyn Store>> + Send + Sync>;

/// An [`Open`] from a connect function.
pub fn opener<S, F, Fut>(connect: F) -> Open
where
    S: Store,
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<S>> + Send + 'static,
{
    let connect = Arc::new(connect);
    Arc::new(move || {
        let connect = connect.clone();
        Box::pin(async move {
            let store: Arc<dyn Store> = Arc::new(connect().await.expect("connect"));
            store
        })
    })
}

/// Waiter `w1` of the fair lock `name`, in a process of its own: its own thread, runtime
/// and connection. Once it is told to, it stops waiting and ends: by dropping its wait
/// and calling [`Leasehold::shutdown`] if `graceful`, else as a killed process does,
/// without another step: its runtime ends with the wait in it, so nothing it would send
/// on the way out runs, and what it held (connections, files and their locks) is let go,
/// as the kernel lets a dead process's go.
fn waiter_process(
    open: Open,
    name: String,
    graceful: bool,
) -> (
    tokio::sync::oneshot::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            let locks = Leasehold::from_store(open().await);
            let lock = fair_lock(&locks, &name, "w1");
            let mut wait = tokio::spawn(async move { lock.lock().await });
            tokio::select! {
                got = &mut wait => panic!("w1 got the lock: {got:?}"),
                _ = stopped => {}
            }
            if graceful {
                wait.abort();
                let _ = wait.await;
                assert!(locks.shutdown(PATIENCE).await, "shutdown finished in time");
            }
        });
        // Whatever the runtime still had (the wait, a background undo) ends with it,
        // without being run again.
        runtime.shutdown_background();
    });
    (stop, thread)
}

/// Holder and w2 in this process, w1 in its own (see [`waiter_process`]), queued in
/// that order; w1's process ends; returns when it has, with the holder and w2's wait.
async fn after_waiter_process(
    open: &Open,
    graceful: bool,
) -> (
    Leasehold,
    String,
    crate::LockGuard,
    tokio::task::JoinHandle<Result<crate::LockGuard>>,
) {
    let locks = Leasehold::from_store(open().await);
    let name = unique(if graceful { "shut-down" } else { "killed" });
    let holder = fair_lock(&locks, &name, "holder").try_lock().await.unwrap();
    let holder = holder.expect("a free lock is granted");
    let (stop, w1) = waiter_process(open.clone(), name.clone(), graceful);
    eventually("w1 to queue", || async {
        waiting_owners(&locks, &name).await == ["w1"]
    })
    .await;
    let w2 = tokio::spawn({
        let lock = fair_lock(&locks, &name, "w2");
        async move { lock.lock().await }
    });
    eventually("w2 to queue behind w1", || async {
        waiting_owners(&locks, &name).await == ["w1", "w2"]
    })
    .await;
    let _ = stop.send(());
    within(
        "w1's process to end",
        tokio::task::spawn_blocking(move || w1.join()),
    )
    .await
    .unwrap()
    .expect("w1's process ended cleanly");
    (locks, name, holder, w2)
}

/// A process that stops waiting and calls [`Leasehold::shutdown`] before it exits has
/// left the queue by then: the next waiter is served at the release, not a waiter lease
/// later.
pub async fn abandoned_wait_leaves_by_shutdown(open: Open) {
    let (locks, name, holder, w2) = after_waiter_process(&open, true).await;
    let left = waiting_owners(&locks, &name).await;
    assert_eq!(left, ["w2"], "w1 left its place behind");
    let _ = holder.release().await.unwrap();
    let next = tokio::time::timeout(PROMPT, w2).await;
    let next = next.expect("w2 is served promptly at the release");
    let _ = next.unwrap().unwrap().release().await.unwrap();
}

/// A waiter whose process dies without a word costs the others at most its waiter
/// lease, counted from its death: the holder here lets go 4 s after it, and w2 must be
/// served by the end of the dead waiter's lease, not a waiter lease after the release
/// (as when the lock was handed to the dead waiter on a fresh lease).
pub async fn dead_waiter_costs_at_most_its_waiter_lease(open: Open) {
    let (_locks, _name, holder, w2) = after_waiter_process(&open, false).await;
    let died = tokio::time::Instant::now();
    let lease = crate::store::MAX_WAITER_LEASE;
    // Part of the scenario, not a wait for anything: the holder works on for a while.
    tokio::time::sleep_until(died + lease * 4 / 5).await;
    let _ = holder.release().await.unwrap();
    // The waiter lease, a refresh of w2's wait (half a waiter lease) and a second of
    // etcd's rounding.
    let bound = lease + lease / 2 + Duration::from_secs(1);
    assert!(bound < LONG_TTL);
    let next = tokio::time::timeout_at(died + bound, w2).await;
    let next = next.expect("w2 is served within the dead waiter's lease");
    let _ = next.unwrap().unwrap().release().await.unwrap();
}
