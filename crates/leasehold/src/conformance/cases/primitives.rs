//! Semaphores, read-write locks, and the lock rules between primitives and owners.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{busy, granted, queued};
use crate::conformance::{join_all, unique, within};
use crate::store::Store;
use crate::{Error, Leasehold, Lock, LockGuard, Result};

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
    busy(&sem, "a fourth permit was granted").await;
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
    let r1 = granted(&locks.read(name.as_str()).unwrap(), "reader 1").await;
    let r2 = granted(&locks.read(name.as_str()).unwrap(), "readers share").await;
    let writer = locks.write(name.as_str()).unwrap();
    busy(&writer, "a writer beside readers").await;
    let waiting = tokio::spawn(async move { writer.lock().await.unwrap() });
    queued("the writer to queue", &locks, &name, 1).await;
    busy(
        &locks.read(name.as_str()).unwrap(),
        "a new reader passed a waiting writer",
    )
    .await;
    let _ = r1.release().await.unwrap();
    let _ = r2.release().await.unwrap();
    let w = within("the writer", waiting).await.unwrap();
    busy(
        &locks.read(name.as_str()).unwrap(),
        "a reader beside a writer",
    )
    .await;
    busy(&locks.write(name.as_str()).unwrap(), "two writers").await;
    let _ = w.release().await.unwrap();
    let r = granted(
        &locks.read(name.as_str()).unwrap(),
        "readers after the writer",
    )
    .await;
    let _ = r.release().await.unwrap();
}

/// The lock rules (see the crate docs) give the same answer on every store: a reader may
/// not re-enter as a writer (alone or beside other readers); a writer re-enters as a
/// reader with its token; a name is one primitive, and a semaphore one size, whether the
/// holder is another owner or the same one; a reader, fair or not, does not pass a
/// waiting writer.
pub async fn lock_rules(store: Arc<dyn Store>) {
    let locks = Leasehold::from_store(store);
    let name = unique("rules");
    let rules = OneName {
        locks: &locks,
        name: &name,
    };
    rules.a_reader_does_not_upgrade().await;
    rules.a_writer_reenters_to_read().await;
    rules.a_semaphore_is_one_primitive_of_one_size().await;
    rules.readers_do_not_pass_a_waiting_writer().await;
}

/// The handles on one name that [`lock_rules`] asks with, each step leaving it free.
struct OneName<'a> {
    locks: &'a Leasehold,
    name: &'a str,
}

impl OneName<'_> {
    fn read(&self, owner: &str) -> Lock {
        self.locks.read(self.name).unwrap().with_owner(owner)
    }

    fn write(&self, owner: &str) -> Lock {
        self.locks.write(self.name).unwrap().with_owner(owner)
    }

    /// Shared, then exclusive, by one owner: refused, alone and beside another reader.
    async fn a_reader_does_not_upgrade(&self) {
        let (locks, name) = (self.locks, self.name);
        let x_reads = granted(&self.read("x"), "a free lock").await;
        conflict(
            self.write("x").try_lock().await,
            "an upgrade of a lone reader",
        );
        let y_reads = granted(&self.read("y"), "readers share").await;
        conflict(
            self.write("x").try_lock().await,
            "an upgrade beside a reader",
        );
        conflict(
            self.write("x")
                .try_lock_for(Duration::from_millis(200))
                .await,
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
    }

    /// Exclusive, then shared, by one owner: one more hold, the same token.
    async fn a_writer_reenters_to_read(&self) {
        let x_writes = granted(&self.write("x"), "a free lock").await;
        let again = granted(&self.read("x"), "a writer re-enters to read").await;
        assert_eq!((again.token(), again.holds()), (x_writes.token(), 2));
        busy(&self.read("y"), "a reader beside a writer").await;
        let _ = again.release().await.unwrap();
        let _ = x_writes.release().await.unwrap();
    }

    /// A semaphore: not a mutex, and not another size.
    async fn a_semaphore_is_one_primitive_of_one_size(&self) {
        let (locks, name) = (self.locks, self.name);
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
    }

    /// Readers, fair or not, do not pass a waiting writer.
    async fn readers_do_not_pass_a_waiting_writer(&self) {
        let reader = granted(&self.read("r"), "a free lock").await;
        let waiting = tokio::spawn({
            let writer = self.write("w").with_fair(true);
            async move { writer.lock().await.unwrap() }
        });
        queued("the writer to queue", self.locks, self.name, 1).await;
        for fair in [false, true] {
            let passed = self.read("s").with_fair(fair).try_lock().await.unwrap();
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
}

/// Fails unless `outcome` is a refusal; `what` says which request it was.
fn conflict(outcome: Result<Option<LockGuard>>, what: &str) {
    match outcome {
        Err(Error::Conflict { .. }) => {}
        Err(e) => panic!("{what}: {e}"),
        Ok(g) => panic!("{what}: granted={}, not refused", g.is_some()),
    }
}
