//! Many waiters of one process on etcd, small enough for CI: 50 names x 20 waiters,
//! fair and non-fair, are all served over at most two connections and leave no lease
//! and no key behind; waiters cancelled while queued leave nothing once their undo has
//! run. (`leasehold bench --workload S1` runs the same at 10,000 waiters.)
#![cfg(feature = "etcd")]

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use leasehold::conformance::{eventually, join_all, within};
use leasehold::{EtcdStore, Leasehold, LockGuard};
use leasehold_testkit::EtcdServer;

const NAMES: usize = 50;
const WAITERS: usize = 20;
const TTL: Duration = Duration::from_secs(30);

async fn start() -> (EtcdServer, Leasehold) {
    let server = tokio::task::spawn_blocking(EtcdServer::start)
        .await
        .unwrap();
    let locks = Leasehold::new(EtcdStore::connect(&server.url()).await.unwrap());
    (server, locks)
}

/// Established TCP connections of this process to `port` (the test binary runs other
/// tests' clients too, each to an etcd of its own).
fn connections_to(port: u16) -> usize {
    let ours: HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().into_owned();
            Some(
                link.strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    let remote = format!(":{port:04X}");
    ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .map(|table| {
            (table.lines().skip(1))
                .filter(|line| {
                    let cols: Vec<&str> = line.split_whitespace().collect();
                    // rem_address, state (01: established), inode.
                    cols.get(2).is_some_and(|r| r.ends_with(&remote))
                        && cols.get(3) == Some(&"01")
                        && cols.get(9).is_some_and(|i| ours.contains(*i))
                })
                .count()
        })
        .sum()
}

/// (leases, keys) in etcd: every lease (the server is this test's own) and every key
/// of the store's layout (queue keys, markers, holds).
fn left(server: &EtcdServer) -> (usize, usize) {
    let leases = server.etcdctl(&["lease", "list"]);
    // "found N leases", then their ids.
    let leases = leases.lines().skip(1).filter(|l| !l.is_empty()).count();
    let keys = server.etcdctl(&["get", "--prefix", "leasehold", "--keys-only"]);
    let keys = keys.lines().filter(|l| !l.is_empty()).count();
    (leases, keys)
}

/// A holder for each name.
async fn hold_all(locks: &Leasehold, fair: bool) -> Vec<LockGuard> {
    let mut holders = Vec::new();
    for i in 0..NAMES {
        let lock = locks.mutex(format!("n{i}")).unwrap().with_ttl(TTL);
        let guard = lock.with_fair(fair).try_lock().await.unwrap();
        holders.push(guard.expect("a fresh name is free"));
    }
    holders
}

/// `WAITERS` tasks per name that wait for it (no limit), take it and release it; each
/// counts in `queued` once etcd has answered it busy.
fn wait_all(
    locks: &Leasehold,
    fair: bool,
    queued: &Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..NAMES * WAITERS)
        .map(|i| {
            let once = std::sync::Once::new();
            let queued = queued.clone();
            let lock = (locks.mutex(format!("n{}", i % NAMES)).unwrap())
                .with_ttl(TTL)
                .with_fair(fair)
                .on_wait(move |_| once.call_once(|| _ = queued.fetch_add(1, Ordering::Relaxed)));
            tokio::spawn(async move {
                let guard = lock
                    .lock()
                    .await
                    .expect("a waiter is served, with no error");
                let _ = guard.release().await.unwrap();
            })
        })
        .collect()
}

/// After the client is dropped, etcd has nothing of it left: its spare leases are
/// revoked as it goes (the waiter leases would end by themselves only after 5 s).
async fn nothing_left(server: &EtcdServer, locks: Leasehold) {
    assert!(locks.shutdown(Duration::from_secs(10)).await, "undo ran");
    assert_eq!(left(server).1, 0, "no key left once the undo has run");
    drop(locks);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
    loop {
        let now = left(server);
        if now == (0, 0) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "(leases, keys) left: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn all_served(fair: bool) {
    let (server, locks) = start().await;
    let holders = hold_all(&locks, fair).await;
    let queued = Arc::new(AtomicUsize::new(0));
    let waiters = wait_all(&locks, fair, &queued);
    if fair {
        // Every fair waiter has its own key in etcd's queue.
        let all = NAMES * WAITERS;
        eventually("every fair waiter queued in etcd", || {
            let queued = queued.load(Ordering::Relaxed);
            async move { queued == all }
        })
        .await;
    }
    let open = connections_to(server.port());
    assert!(open <= 2, "{open} connections to etcd");
    for guard in holders {
        let _ = guard.release().await.unwrap();
    }
    join_all("every waiter served", waiters).await;
    nothing_left(&server, locks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_waiters_of_many_names_are_served_on_one_client_and_leave_nothing() {
    all_served(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_fair_waiters_of_many_names_are_served_on_one_client_and_leave_nothing() {
    all_served(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waiters_leave_nothing_once_their_undo_has_run() {
    let (server, locks) = start().await;
    let holders = hold_all(&locks, true).await;
    let queued = Arc::new(AtomicUsize::new(0));
    let waiters = wait_all(&locks, true, &queued);
    let all = NAMES * WAITERS;
    eventually("every waiter queued in etcd", || {
        let queued = queued.load(Ordering::Relaxed);
        async move { queued == all }
    })
    .await;
    for waiter in &waiters {
        waiter.abort();
    }
    for waiter in waiters {
        assert!(within("a cancelled waiter", waiter).await.is_err());
    }
    for guard in holders {
        let _ = guard.release().await.unwrap();
    }
    nothing_left(&server, locks).await;
}
