//! Many waiters of one process on etcd, small enough for CI: 50 names x 20 waiters,
//! fair and non-fair, are all served over at most two connections and leave no lease
//! and no key behind; waiters cancelled while queued leave nothing once their undo has
//! run. (`leasehold bench --workload S1` runs the same at 10,000 waiters, and counts
//! with the same functions.)

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use leasehold::{EtcdStore, Leasehold, LockGuard, StoreUrl};
use leasehold_cli::bench::scale::{connections, left_in_store};
use leasehold_testkit::EtcdServer;
use tokio::time::{timeout, Instant};

const NAMES: usize = 50;
const WAITERS: usize = 20;
const TTL: Duration = Duration::from_secs(30);
/// Long enough for 1,000 waiters on 2 loaded cores.
const PATIENCE: Duration = Duration::from_secs(60);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    (timeout(PATIENCE, fut).await).unwrap_or_else(|_| panic!("{what}: not within {PATIENCE:?}"))
}

/// (leases, keys) in etcd: every lease (the server is this test's own) and every key.
fn left(url: &StoreUrl) -> (usize, usize) {
    match left_in_store(url, "") {
        (Some(leases), Some(keys)) => (leases, keys),
        nothing => panic!("etcdctl could not tell: {nothing:?}"),
    }
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

/// Every waiter has its own key in etcd's queue.
async fn all_queued(queued: &AtomicUsize) {
    within("every waiter queued in etcd", async {
        while queued.load(Ordering::Relaxed) < NAMES * WAITERS {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// Once the undo has run no key is left, and once the client is dropped no lease: it
/// revokes its spare leases as it goes. Within 4 s, before the waiter leases (5 s)
/// could end by themselves.
async fn nothing_left(server: &EtcdServer, url: &StoreUrl, locks: Leasehold) {
    assert!(locks.shutdown(Duration::from_secs(10)).await, "undo ran");
    assert_eq!(left(url).1, 0, "no key left once the undo has run");
    drop(locks);
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        let now = left(url);
        if now == (0, 0) {
            return;
        }
        if Instant::now() >= deadline {
            let leases = server.etcdctl(&["lease", "list"]);
            let ttls: Vec<String> = (leases.lines().skip(1))
                .map(|id| server.etcdctl(&["lease", "timetolive", id]))
                .collect();
            panic!("(leases, keys) left: {now:?}: {ttls:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn start() -> (EtcdServer, StoreUrl, Leasehold) {
    let server = tokio::task::spawn_blocking(EtcdServer::start)
        .await
        .unwrap();
    let url = StoreUrl::parse(&server.url()).unwrap();
    let locks = Leasehold::new(EtcdStore::connect(&server.url()).await.unwrap());
    (server, url, locks)
}

async fn all_served(fair: bool) {
    let (server, url, locks) = start().await;
    let holders = hold_all(&locks, fair).await;
    let queued = Arc::new(AtomicUsize::new(0));
    let waiters = wait_all(&locks, fair, &queued);
    if fair {
        all_queued(&queued).await;
    }
    let open = connections(Some(server.port()));
    assert!(open <= 2, "{open} connections to etcd");
    for guard in holders {
        let _ = guard.release().await.unwrap();
    }
    within("every waiter served", async {
        for waiter in waiters {
            waiter.await.expect("no waiter panicked");
        }
    })
    .await;
    nothing_left(&server, &url, locks).await;
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
    let (server, url, locks) = start().await;
    let holders = hold_all(&locks, true).await;
    let queued = Arc::new(AtomicUsize::new(0));
    let waiters = wait_all(&locks, true, &queued);
    all_queued(&queued).await;
    for waiter in &waiters {
        waiter.abort();
    }
    for waiter in waiters {
        assert!(within("a cancelled waiter", waiter).await.is_err());
    }
    for guard in holders {
        let _ = guard.release().await.unwrap();
    }
    nothing_left(&server, &url, locks).await;
}
