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
//! operation sequences and checks every outcome against the lock rules (see [`model`]).

pub mod model;
pub mod rate;

pub use model::model_based;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::FutureExt;
use tokio::time::Instant;

use crate::store::{
    AcquireRequest, Attempt, Capabilities, Grant, Lease, LockState, Released, Renewal, Store,
    Watermark,
};
use crate::{Error, Leasehold, LockName, Result};

/// How long a condition may take before a case fails: long enough for 2 loaded cores.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// A short TTL for cases that need leases to end.
pub const SHORT_TTL: Duration = Duration::from_millis(400);

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

/// Passes everything through to a real store, but can make renewals or releases fail, as
/// a network partition between this client and the store would.
#[derive(Debug)]
pub struct Partition {
    inner: Arc<dyn Store>,
    renewals: AtomicBool,
    releases: AtomicBool,
    refused_releases: AtomicUsize,
}

impl Partition {
    /// Wraps `inner`, everything flowing.
    pub fn new(inner: Arc<dyn Store>) -> Arc<Self> {
        Arc::new(Partition {
            inner,
            renewals: AtomicBool::new(false),
            releases: AtomicBool::new(false),
            refused_releases: AtomicUsize::new(0),
        })
    }

    /// From now on renewals fail as if the store were unreachable.
    pub fn cut_renewals(&self) {
        self.renewals.store(true, Ordering::SeqCst);
    }

    /// From now on releases fail as if the store were unreachable.
    pub fn cut_releases(&self) {
        self.releases.store(true, Ordering::SeqCst);
    }

    /// How many releases (and transfers) failed so far.
    pub fn refused_releases(&self) -> usize {
        self.refused_releases.load(Ordering::SeqCst)
    }

    /// Everything flows again.
    pub fn heal(&self) {
        self.renewals.store(false, Ordering::SeqCst);
        self.releases.store(false, Ordering::SeqCst);
    }

    fn pass_release(&self) -> Result<()> {
        let passed = self.pass(&self.releases);
        if passed.is_err() {
            self.refused_releases.fetch_add(1, Ordering::SeqCst);
        }
        passed
    }

    fn pass(&self, cut: &AtomicBool) -> Result<()> {
        match cut.load(Ordering::SeqCst) {
            true => Err(Error::Unavailable {
                store: self.describe_store(),
                source: "partitioned by the test".into(),
            }),
            false => Ok(()),
        }
    }
}

#[async_trait]
impl Store for Partition {
    async fn acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        self.inner.acquire(req).await
    }
    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        self.pass(&self.renewals)?;
        self.inner.renew(lease, ttl).await
    }
    async fn release(&self, lease: &Lease) -> Result<Released> {
        self.pass_release()?;
        self.inner.release(lease).await
    }
    async fn transfer(&self, from: &Lease, to: &AcquireRequest) -> Result<(Released, Attempt)> {
        self.pass_release()?;
        self.inner.transfer(from, to).await
    }
    async fn changed(&self, req: &AcquireRequest, since: Watermark) -> Result<Option<Grant>> {
        self.inner.changed(req, since).await
    }
    async fn ended(&self, lease: &Lease) -> Result<()> {
        self.inner.ended(lease).await
    }
    async fn describe(&self, name: &LockName) -> Result<LockState> {
        self.inner.describe(name).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<LockState>> {
        self.inner.list(prefix).await
    }
    async fn force_release(&self, name: &LockName) -> Result<bool> {
        self.inner.force_release(name).await
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn describe_store(&self) -> String {
        format!("partitioned({})", self.inner.describe_store())
    }

    fn caveat(&self) -> Option<String> {
        self.inner.caveat()
    }
}

/// Tasks incrementing a counter with a read, a yield and a write under the lock: any
/// overlap of holders loses an update or is seen directly. Half the tasks share one
/// [`Leasehold`] (they queue in-process first), the others each have their own (they
/// meet only in the store), as tasks of several processes would.
pub async fn mutual_exclusion(store: Arc<dyn Store>) {
    let shared = Leasehold::from_store(store.clone());
    let name = unique("mutex");
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let last_token = Arc::new(AtomicU64::new(0));
    let (tasks, rounds) = (8, 40);
    let mut handles = Vec::new();
    for task in 0..tasks {
        let locks = if task % 2 == 0 {
            shared.clone()
        } else {
            Leasehold::from_store(store.clone())
        };
        let lock = locks.mutex(name.as_str()).unwrap();
        let (counter, inside, last_token) = (counter.clone(), inside.clone(), last_token.clone());
        handles.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let guard = lock.lock().await.unwrap();
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                let token = guard.check().unwrap().get();
                let before = last_token.swap(token, Ordering::SeqCst);
                assert!(token > before, "token {token} after {before}");
                let seen = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(seen + 1, Ordering::SeqCst);
                inside.fetch_sub(1, Ordering::SeqCst);
                let _ = guard.release().await.unwrap();
            }
        }));
    }
    join_all("all tasks to finish", handles).await;
    assert_eq!(
        counter.load(Ordering::SeqCst),
        tasks * rounds,
        "lost updates"
    );
}

/// A dropped guard releases in the background, so a waiter gets the lock long before
/// the lease would end.
pub async fn drop_releases(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let lock = locks
        .mutex(unique("drop").as_str())
        .unwrap()
        .with_ttl(Duration::from_secs(3600));
    let held = lock.try_lock().await.unwrap().unwrap();
    let waiter = tokio::spawn({
        let lock = lock.clone();
        async move { lock.lock().await.unwrap() }
    });
    drop(held);
    let next = within("the waiter after a dropped guard", waiter)
        .await
        .unwrap();
    let _ = next.release().await.unwrap();
}

/// `try_lock` never waits; bounded waits give up and leave no trace in the queue.
pub async fn try_and_bounded_waits(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("try");
    let lock = locks.mutex(name.as_str()).unwrap();
    let held = lock
        .try_lock()
        .await
        .unwrap()
        .expect("a free lock is granted");
    assert!(
        lock.try_lock().await.unwrap().is_none(),
        "try_lock on a held lock"
    );
    let started = Instant::now();
    assert!(lock
        .try_lock_for(Duration::from_millis(150))
        .await
        .unwrap()
        .is_none());
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "gave up before its deadline"
    );
    let deadline = std::time::Instant::now() + Duration::from_millis(50);
    assert!(lock.try_lock_until(deadline).await.unwrap().is_none());
    let state = locks.describe(name.as_str()).await.unwrap();
    assert!(
        state.waiters.is_empty(),
        "a waiter that gave up is still queued: {state:?}"
    );
    let _ = held.release().await.unwrap();
    let again = within(
        "a bounded wait on a free lock",
        lock.try_lock_for(Duration::from_secs(5)),
    )
    .await
    .unwrap();
    let _ = again
        .expect("free lock within a bounded wait")
        .release()
        .await
        .unwrap();
}

/// A holder that stops renewing (its process died) loses the lock at its lease's end
/// and the next holder gets a higher token.
pub async fn expiry_after_holder_dies(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let lock = locks
        .mutex(unique("expiry").as_str())
        .unwrap()
        .with_ttl(SHORT_TTL);
    let dead = lock.try_lock().await.unwrap().unwrap();
    let dead_token = dead.token();
    let _abandoned = dead.leak();
    assert!(
        lock.try_lock().await.unwrap().is_none(),
        "the lease must outlive the holder"
    );
    let next = within("the abandoned lease to expire", lock.lock())
        .await
        .unwrap();
    assert!(next.token() > dead_token);
    let _ = next.release().await.unwrap();
}

/// Renewal keeps a lock held across several TTLs.
pub async fn renewal_keeps_lock(store: Arc<dyn Store>) {
    // Each renewal has two thirds of the TTL to land before the safe deadline: with 1s
    // that holds while two loaded cores run every test binary (with 300ms, an etcd
    // renewal once missed it there).
    let ttl = Duration::from_secs(1);
    let locks = Leasehold::from_store(store);
    let lock = locks
        .mutex(unique("renewal").as_str())
        .unwrap()
        .with_ttl(ttl);
    let guard = lock.try_lock().await.unwrap().unwrap();
    let until = Instant::now() + ttl * 4;
    // Time passing is the point of this case: sample until four TTLs are over.
    while Instant::now() < until {
        assert!(
            guard.check().is_ok(),
            "lost while renewals work: {:?}",
            guard.check()
        );
        assert!(
            lock.try_lock().await.unwrap().is_none(),
            "someone else got a renewed lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(guard.release().await.unwrap(), Released::Released);
}

/// With renewals failing, `lost()` fires — and `check()` fails — before another holder
/// can acquire the lock; releasing the lost lease reports it was not held.
pub async fn lost_fires_before_takeover(store: Arc<dyn Store>) {
    let partitioned = Partition::new(store.clone());
    let name = unique("lost");
    let cut_off = Leasehold::from_store(partitioned.clone());
    let other = Leasehold::from_store(store);
    let guard = cut_off
        .mutex(name.as_str())
        .unwrap()
        .with_ttl(SHORT_TTL)
        .lock()
        .await
        .unwrap();
    partitioned.cut_renewals();
    let next = within(
        "the next holder",
        other.mutex(name.as_str()).unwrap().lock(),
    )
    .await
    .unwrap();
    assert!(
        guard.is_lost(),
        "another holder got the lock before the loss was known"
    );
    assert!(matches!(guard.check(), Err(Error::Lost { .. })));
    assert!(
        guard.lost().now_or_never().is_some(),
        "lost() had not fired"
    );
    assert!(guard.valid_until() <= Instant::now());
    assert!(next.token() > guard.token());
    assert_eq!(guard.release().await.unwrap(), Released::NotHeld);
    let _ = next.release().await.unwrap();
}

/// A release the store did not get (the link was down) is sent again once the store can
/// be reached: the lock frees long before its lease could end, and the owner's next
/// acquisition is a new one (a newer token), not a re-entry into the hold left behind.
pub async fn missed_release_is_sent_again(store: Arc<dyn Store>) {
    let partition = Partition::new(store.clone());
    let name = unique("missed-release");
    let owner = format!("owner-{name}");
    let lock = (Leasehold::from_store(partition.clone()).mutex(name.as_str()))
        .unwrap()
        .with_owner(owner.as_str())
        // Far longer than PATIENCE: only the release can free the lock in time.
        .with_ttl(PATIENCE * 10);
    let guard = lock.try_lock().await.unwrap().unwrap();
    let token = guard.token();
    partition.cut_releases();
    let failed = guard.release().await.unwrap_err();
    assert!(failed.is_retryable(), "{failed}");
    partition.heal();
    let other = Leasehold::from_store(store);
    let next = within(
        "another owner to get the lock",
        other.mutex(name.as_str()).unwrap().lock(),
    )
    .await
    .unwrap();
    let taken = next.token();
    assert!(taken > token);
    let _ = next.release().await.unwrap();
    let again = lock.try_lock().await.unwrap().unwrap();
    assert!(again.token() > taken, "re-entered a hold left behind");
    assert_eq!(again.holds(), 1);

    // A cancelled wait whose undo the store did not get leaves the queue once the store
    // is back, not when its place's lease (up to the TTL) ends.
    let waiter = tokio::spawn({
        let lock = lock.clone().with_owner("waiter").with_fair(true);
        async move { lock.lock().await }
    });
    eventually("the waiter to queue", || async {
        other.describe(name.as_str()).await.unwrap().waiters.len() == 1
    })
    .await;
    partition.cut_releases();
    let refused = partition.refused_releases();
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    eventually("the cancelled wait's undo to be refused", || async {
        partition.refused_releases() > refused
    })
    .await;
    partition.heal();
    let _ = again.release().await.unwrap();
    let last = within(
        "the lock past the cancelled waiter's place",
        other.mutex(name.as_str()).unwrap().with_fair(true).lock(),
    )
    .await
    .unwrap();
    let _ = last.release().await.unwrap();
}

/// A guard renews again once its store is back from `restart` (a restart well within the
/// guard's `ttl`), and nobody else takes the lock meanwhile. For store tests that can
/// restart their server; not in [`conformance_suite!`](crate::conformance_suite).
pub async fn renews_again_after_a_restart(
    locks: &Leasehold,
    ttl: Duration,
    restart: impl FnOnce(),
) {
    let name = unique("restart");
    let lock = locks.mutex(name.as_str()).unwrap();
    let guard = lock.clone().with_ttl(ttl).lock().await.unwrap();
    tokio::task::block_in_place(restart);
    let restarted = Instant::now();
    // Only a renewal sent after the restart can move the deadline this far.
    eventually("a renewal after the restart", || async {
        guard.valid_until() > restarted + ttl / 2
    })
    .await;
    assert!(guard.check().is_ok());
    assert!(lock.try_lock().await.unwrap().is_none(), "taken meanwhile");
    let _ = guard.release().await.unwrap();
}

/// Tokens strictly increase across holders; re-entry keeps the token and counts holds;
/// the lock frees when the last hold is released.
pub async fn tokens_and_reentry(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("tokens");
    let mut last = 0;
    for _ in 0..5 {
        let g = locks
            .mutex(name.as_str())
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .unwrap();
        assert!(g.token().get() > last, "token did not increase");
        last = g.token().get();
        let _ = g.release().await.unwrap();
    }
    let mine = locks.mutex(name.as_str()).unwrap().with_owner("worker-7");
    let first = mine.try_lock().await.unwrap().unwrap();
    let second = mine.try_lock().await.unwrap().expect("the owner re-enters");
    assert_eq!(first.token(), second.token(), "re-entry changed the token");
    assert!(first.token().get() > last);
    assert_eq!((first.holds(), second.holds()), (1, 2));
    let state = locks.describe(name.as_str()).await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].holds, 2);
    let stranger = locks.mutex(name.as_str()).unwrap();
    let held_token = second.token();
    assert_eq!(second.release().await.unwrap(), Released::Released);
    assert!(
        stranger.try_lock().await.unwrap().is_none(),
        "freed with a hold left"
    );
    assert_eq!(first.release().await.unwrap(), Released::Released);
    let g = stranger
        .try_lock()
        .await
        .unwrap()
        .expect("free after the last hold");
    assert!(g.token() > held_token);
    let _ = g.release().await.unwrap();
}

/// Fair mode serves waiters in arrival order.
pub async fn fifo_when_fair(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("fifo");
    let lock = locks.mutex(name.as_str()).unwrap().with_fair(true);
    let holder = lock.try_lock().await.unwrap().unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut handles = Vec::new();
    for i in 0..5 {
        let (lock, order) = (lock.clone(), order.clone());
        handles.push(tokio::spawn(async move {
            let g = lock.lock().await.unwrap();
            order.lock().unwrap().push(i);
            let _ = g.release().await.unwrap();
        }));
        eventually("the waiter to queue", || async {
            locks.describe(name.as_str()).await.unwrap().waiters.len() == i + 1
        })
        .await;
    }
    let _ = holder.release().await.unwrap();
    join_all("every waiter", handles).await;
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
}

/// A lock handed to a queued waiter (by stores that hand over inside the release, on the
/// waiter's short lease) is renewed to its full TTL at once, not a third of the way into
/// the short lease: code that stops work when the lease left runs low must not see a
/// hand-over as a lock about to be lost.
pub async fn hand_over_renews_to_the_full_ttl(store: Arc<dyn Store>) {
    // Two clients, as two processes: tasks of one client hand over in the client.
    let (locks, other) = (
        Leasehold::from_store(store.clone()),
        Leasehold::from_store(store),
    );
    let name = unique("handover");
    let ttl = Duration::from_secs(60);
    let fair = |locks: &Leasehold| {
        let lock = locks.mutex(name.as_str()).unwrap();
        lock.with_fair(true).with_ttl(ttl)
    };
    let holder = fair(&other).try_lock().await.unwrap().unwrap();
    let waiting = tokio::spawn({
        let lock = fair(&locks);
        async move { lock.lock().await.unwrap() }
    });
    eventually("the waiter to queue", || async {
        locks.describe(name.as_str()).await.unwrap().waiters.len() == 1
    })
    .await;
    let _ = holder.release().await.unwrap();
    let guard = within("the hand-over", waiting).await.unwrap();
    let granted = Instant::now();
    // More than a waiter lease (at most 5 s) ahead: renewed to the TTL asked for.
    eventually("a renewal to the full TTL", || async {
        guard.valid_until() > Instant::now() + ttl / 2
    })
    .await;
    // When that renewal was sent (its safe deadline counts from then): at once, not a
    // third of the way into the short lease (about 1.7 s in).
    let sent = guard.valid_until() - (crate::keepalive::safe_deadline(granted, ttl) - granted);
    assert!(
        sent < granted + Duration::from_secs(1),
        "the first renewal was sent {:?} after the hand-over",
        sent.saturating_duration_since(granted)
    );
    assert!(!guard.renewal_failing());
    let _ = guard.release().await.unwrap();
}

/// A task of one process that stops waiting just as the task before it hands it the lock
/// (its future dropped, or its deadline passing, after the hand-over was sent) does not
/// take the lock or its process's turn with it: the next task gets the lock.
pub async fn hand_over_to_a_dropped_waiter_is_not_lost(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("dropped-hand-over");
    // Non-fair: tasks of one process wait in the process on every store.
    let lock = locks.mutex(name.as_str()).unwrap().with_fair(false);
    let holder = lock.try_lock().await.unwrap().unwrap();
    let mut waiter = Box::pin(lock.lock());
    assert!((&mut waiter).now_or_never().is_none(), "the lock is held");
    eventually("the waiter to queue", || async {
        locks.describe(name.as_str()).await.unwrap().waiters.len() == 1
    })
    .await;
    // Handed to the waiter, which is never polled again.
    let _ = holder.release().await.unwrap();
    drop(waiter);
    let next = within("the next task to get the lock", lock.lock()).await;
    let _ = next.unwrap().release().await.unwrap();
}

/// A semaphore admits at most its permits, each holder with its own token.
pub async fn semaphore_limit(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("semaphore");
    let sem = locks.semaphore(name.as_str(), 3).unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(sem.try_lock().await.unwrap().expect("a free permit"));
    }
    let mut tokens: Vec<_> = held.iter().map(|g| g.token()).collect();
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "permits share a token");
    assert!(
        sem.try_lock().await.unwrap().is_none(),
        "a fourth permit was granted"
    );
    assert!(matches!(
        locks.semaphore(name.as_str(), 5).unwrap().try_lock().await,
        Err(Error::Conflict { .. })
    ));
    let _ = held.pop().unwrap().release().await.unwrap();
    held.push(
        sem.try_lock()
            .await
            .unwrap()
            .expect("a released permit is free"),
    );
    for g in held {
        let _ = g.release().await.unwrap();
    }

    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for _ in 0..8 {
        let (sem, inside, most) = (sem.clone(), inside.clone(), most.clone());
        handles.push(tokio::spawn(async move {
            for _ in 0..15 {
                let g = sem.lock().await.unwrap();
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                let _ = g.release().await.unwrap();
            }
        }));
    }
    join_all("the semaphore tasks", handles).await;
    assert!(
        most.load(Ordering::SeqCst) <= 3,
        "more holders than permits"
    );
}

/// Readers share; a writer excludes everyone; a waiting writer is not passed by new
/// readers.
pub async fn read_write_rules(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("rw");
    let r1 = locks
        .read(name.as_str())
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("reader 1");
    let r2 = locks
        .read(name.as_str())
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("readers share");
    let writer = locks.write(name.as_str()).unwrap();
    assert!(
        writer.try_lock().await.unwrap().is_none(),
        "a writer beside readers"
    );
    let waiting = tokio::spawn(async move { writer.lock().await.unwrap() });
    eventually("the writer to queue", || async {
        locks.describe(name.as_str()).await.unwrap().waiters.len() == 1
    })
    .await;
    assert!(
        locks
            .read(name.as_str())
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none(),
        "a new reader passed a waiting writer"
    );
    let _ = r1.release().await.unwrap();
    let _ = r2.release().await.unwrap();
    let w = within("the writer", waiting).await.unwrap();
    assert!(
        locks
            .read(name.as_str())
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none(),
        "a reader beside a writer"
    );
    assert!(
        locks
            .write(name.as_str())
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none(),
        "two writers"
    );
    let _ = w.release().await.unwrap();
    let r = locks.read(name.as_str()).unwrap().try_lock().await.unwrap();
    let _ = r
        .expect("readers after the writer")
        .release()
        .await
        .unwrap();
}

/// The lock rules (see the crate docs) give the same answer on every store: a reader may
/// not re-enter as a writer (alone or beside other readers); a writer re-enters as a
/// reader with its token; a name is one primitive, and a semaphore one size, whether the
/// holder is another owner or the same one; a reader, fair or not, does not pass a
/// waiting writer.
pub async fn lock_rules(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("rules");
    let name = name.as_str();
    let conflict = |outcome: Result<Option<crate::LockGuard>>, what: &str| match outcome {
        Err(Error::Conflict { .. }) => {}
        Err(e) => panic!("{what}: {e}"),
        Ok(g) => panic!("{what}: granted={}, not refused", g.is_some()),
    };
    let read = |owner: &str| locks.read(name).unwrap().with_owner(owner);
    let write = |owner: &str| locks.write(name).unwrap().with_owner(owner);

    // Shared, then exclusive, by one owner: refused, alone and beside another reader.
    let x_reads = read("x").try_lock().await.unwrap().expect("a free lock");
    conflict(write("x").try_lock().await, "an upgrade of a lone reader");
    let y_reads = read("y").try_lock().await.unwrap().expect("readers share");
    conflict(write("x").try_lock().await, "an upgrade beside a reader");
    conflict(
        write("x").try_lock_for(Duration::from_millis(200)).await,
        "a waiting upgrade",
    );
    let state = locks.describe(name).await.unwrap();
    assert_eq!(state.holders.len(), 2, "{state:?}");
    assert!(
        state.waiters.is_empty(),
        "a refused request stays queued: {state:?}"
    );
    // Not a semaphore either, whoever asks.
    conflict(
        locks.semaphore(name, 2).unwrap().try_lock().await,
        "a semaphore on a rwlock",
    );
    let as_semaphore = locks.semaphore(name, 2).unwrap().with_owner("x");
    conflict(as_semaphore.try_lock().await, "the reader's own semaphore");
    let _ = x_reads.release().await.unwrap();
    let _ = y_reads.release().await.unwrap();

    // Exclusive, then shared, by one owner: one more hold, the same token.
    let x_writes = write("x").try_lock().await.unwrap().expect("a free lock");
    let again = read("x")
        .try_lock()
        .await
        .unwrap()
        .expect("a writer re-enters to read");
    assert_eq!((again.token(), again.holds()), (x_writes.token(), 2));
    assert!(
        read("y").try_lock().await.unwrap().is_none(),
        "a reader beside a writer"
    );
    let _ = again.release().await.unwrap();
    let _ = x_writes.release().await.unwrap();

    // A semaphore: not a mutex, and not another size.
    let permit = locks.semaphore(name, 2).unwrap().try_lock().await.unwrap();
    let permit = permit.expect("a free semaphore");
    conflict(
        locks.mutex(name).unwrap().try_lock().await,
        "a mutex on a semaphore",
    );
    conflict(
        locks.semaphore(name, 3).unwrap().try_lock().await,
        "a semaphore of another size",
    );
    let _ = permit.release().await.unwrap();

    // Readers, fair or not, do not pass a waiting writer.
    let reader = read("r").try_lock().await.unwrap().expect("a free lock");
    let waiting = tokio::spawn({
        let writer = write("w").with_fair(true);
        async move { writer.lock().await.unwrap() }
    });
    eventually("the writer to queue", || async {
        locks.describe(name).await.unwrap().waiters.len() == 1
    })
    .await;
    for fair in [false, true] {
        let passed = read("s").with_fair(fair).try_lock().await.unwrap();
        assert!(
            passed.is_none(),
            "a reader (fair: {fair}) passed a waiting writer"
        );
    }
    let _ = reader.release().await.unwrap();
    let _ = within("the writer", waiting)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// Releasing twice is harmless, and a release never touches another holder's lease.
pub async fn release_is_idempotent(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store.clone());
    let lock = locks.mutex(unique("release").as_str()).unwrap();
    let lease = lock.try_lock().await.unwrap().unwrap().leak();
    assert_eq!(store.release(&lease).await.unwrap(), Released::Released);
    assert_eq!(store.release(&lease).await.unwrap(), Released::NotHeld);
    let next = lock.try_lock().await.unwrap().unwrap();
    assert_eq!(store.release(&lease).await.unwrap(), Released::NotHeld);
    assert!(
        lock.try_lock().await.unwrap().is_none(),
        "an old lease released the new holder"
    );
    assert_eq!(store.renew(&lease, SHORT_TTL).await.unwrap(), Renewal::Lost);
    let _ = next.release().await.unwrap();
}

/// Force-release frees the lock; the holder's guard reports the loss at once (not at
/// its next renewal); its release says it was not held.
pub async fn force_release_is_seen_as_lost(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("force");
    let lock = locks
        .mutex(name.as_str())
        .unwrap()
        .with_ttl(Duration::from_secs(3600))
        .with_owner("victim");
    let guard = lock.try_lock().await.unwrap().unwrap();
    let state = locks.describe(name.as_str()).await.unwrap();
    let holder = &state.holders[0];
    assert_eq!(holder.owner, "victim");
    assert_eq!(holder.pid, std::process::id());
    assert_eq!(holder.token, guard.token());
    assert!(holder.lease_left > Duration::ZERO && holder.lease_left <= Duration::from_secs(3600));
    let listed = locks.list("conformance/force/").await.unwrap();
    assert!(
        listed.iter().any(|s| s.name == name),
        "list misses a held lock"
    );
    // A task of its own watches through a signal, and work runs while the lock is held.
    let signal = guard.lost_signal();
    let watcher = tokio::spawn({
        let signal = signal.clone();
        async move { signal.lost().await }
    });
    let work = guard.run_while_held(std::future::pending::<()>());
    // With a one-hour lease no renewal comes within the test: the store must say it.
    let (released, (), stopped) = within("the guard to see the loss", async {
        tokio::join!(locks.force_release(name.as_str()), guard.lost(), work)
    })
    .await;
    assert!(released.unwrap());
    assert!(matches!(stopped, Err(Error::Lost { .. })), "{stopped:?}");
    within("the signal in another task", watcher).await.unwrap();
    assert!(signal.is_lost());
    assert!(
        !locks.force_release(name.as_str()).await.unwrap(),
        "nothing left to release"
    );
    assert!(guard.check().is_err());
    within("lost() to resolve again once lost", guard.lost()).await;
    let next = locks
        .mutex(name.as_str())
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("free after force-release");
    assert!(next.token() > guard.token());
    assert_eq!(guard.release().await.unwrap(), Released::NotHeld);
    let _ = next.release().await.unwrap();
}

/// A cancelled wait leaves the queue, so it does not block anyone.
pub async fn cancelled_wait_leaves_no_trace(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("cancel");
    let lock = locks.mutex(name.as_str()).unwrap().with_fair(true);
    let holder = lock.try_lock().await.unwrap().unwrap();
    let waiter = tokio::spawn({
        let lock = lock.clone();
        async move { lock.lock().await }
    });
    eventually("the waiter to queue", || async {
        locks.describe(name.as_str()).await.unwrap().waiters.len() == 1
    })
    .await;
    waiter.abort();
    eventually("the cancelled waiter to leave the queue", || async {
        locks
            .describe(name.as_str())
            .await
            .unwrap()
            .waiters
            .is_empty()
    })
    .await;
    let _ = holder.release().await.unwrap();
    let g = lock
        .try_lock()
        .await
        .unwrap()
        .expect("fair lock free after a cancelled waiter");
    let _ = g.release().await.unwrap();
}

/// How long the next waiter may take once nothing keeps it out: far less than the
/// waiter lease a place left behind would cost it.
pub const PROMPT: Duration = Duration::from_secs(2);

/// A TTL long enough that a place or hold left behind would cost the others seconds.
const LONG_TTL: Duration = Duration::from_secs(30);

/// A fair mutex with [`LONG_TTL`], acquired under `owner` (named in `describe`).
fn fair_lock(locks: &Leasehold, name: &str, owner: &str) -> crate::Lock {
    let lock = locks.mutex(name).unwrap().with_ttl(LONG_TTL);
    lock.with_fair(true).with_owner(owner)
}

async fn waiting_owners(locks: &Leasehold, name: &str) -> Vec<String> {
    let state = locks.describe(name).await.unwrap();
    state.waiters.into_iter().map(|w| w.owner).collect()
}

/// A bounded wait that runs out has left the queue when it returns: the next waiter is
/// served at the release, not a waiter lease later.
pub async fn timed_out_wait_leaves_the_queue(store: Arc<dyn Store>) {
    let name = unique("timed-out");
    let (holding, first, second) = (
        Leasehold::from_store(store.clone()),
        Leasehold::from_store(store.clone()),
        Leasehold::from_store(store),
    );
    let holder = fair_lock(&holding, &name, "holder")
        .try_lock()
        .await
        .unwrap();
    let holder = holder.expect("a free lock is granted");
    let w1 = tokio::spawn({
        let lock = fair_lock(&first, &name, "w1");
        async move { lock.try_lock_for(Duration::from_secs(2)).await }
    });
    eventually("w1 to queue", || async {
        waiting_owners(&holding, &name).await.contains(&"w1".into())
    })
    .await;
    let w2 = tokio::spawn({
        let lock = fair_lock(&second, &name, "w2");
        async move { lock.lock().await }
    });
    eventually("w2 to queue", || async {
        waiting_owners(&holding, &name).await.contains(&"w2".into())
    })
    .await;
    let gave_up = within("w1 to give up", w1).await.unwrap().unwrap();
    assert!(gave_up.is_none(), "w1 got a held lock");
    let left = waiting_owners(&holding, &name).await;
    assert!(!left.contains(&"w1".into()), "w1 still queued: {left:?}");
    let _ = holder.release().await.unwrap();
    let next = tokio::time::timeout(PROMPT, w2).await;
    let next = next.expect("w2 is served promptly at the release");
    let _ = next.unwrap().unwrap().release().await.unwrap();
}

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

/// Bad input is rejected before anything reaches the store, with the rule in the message.
pub async fn bad_input_rejected(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let msg = |e: Error| e.to_string();
    assert!(msg(locks.mutex("").unwrap_err()).contains("empty"));
    assert!(msg(locks.mutex("x".repeat(300)).unwrap_err()).contains("300 bytes"));
    assert!(msg(locks.mutex("a\tb").unwrap_err()).contains("control character"));
    assert!(msg(locks.semaphore("ok", 0).unwrap_err()).contains("permits"));
    let name = unique("bad");
    let lock = locks.mutex(name.as_str()).unwrap();
    let e = lock
        .clone()
        .with_ttl(Duration::ZERO)
        .try_lock()
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidOption { option: "ttl", .. }),
        "{e}"
    );
    let e = lock
        .clone()
        .with_ttl(Duration::from_secs(100 * 365 * 86400))
        .lock()
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidOption { option: "ttl", .. }),
        "{e}"
    );
    let e = lock.clone().with_owner("").try_lock().await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidOption {
                option: "owner",
                ..
            }
        ),
        "{e}"
    );
    let state = locks.describe(name.as_str()).await.unwrap();
    assert!(state.holders.is_empty() && state.waiters.is_empty() && state.last_token.get() == 0);
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
            force_release_is_seen_as_lost, cancelled_wait_leaves_no_trace,
            timed_out_wait_leaves_the_queue, bad_input_rejected, model_based);
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
