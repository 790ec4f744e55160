//! The blocking API ([`crate::blocking`]) keeps the same promises from plain threads:
//! exclusion between clients, tries and bounded waits, semaphore and read-write rules,
//! increasing tokens, release on drop; and it does not panic inside an async runtime.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::blocking::{Leasehold, Lock, LockGuard};
use crate::conformance::{unique, PATIENCE};
use crate::{Released, Store};

/// Longer than [`PATIENCE`]: a lock freed in time was released, not expired.
const BEYOND_PATIENCE: Duration = Duration::from_secs(60);

fn client(store: &Arc<dyn Store>) -> Leasehold {
    Leasehold::from_store(store.clone()).unwrap()
}

/// The lock `lock` names, taken at once; failing the case with `what` if it is busy.
fn taken(what: &str, lock: crate::Result<Lock>) -> LockGuard {
    got(what, lock.unwrap().try_lock().unwrap())
}

/// `guard`, failing the case with `what` if there is none.
fn got(what: &str, guard: Option<LockGuard>) -> LockGuard {
    guard.unwrap_or_else(|| panic!("no lock for {what}"))
}

/// Releases `holders` while `waiter` waits for the lock in a thread of its own: the
/// guard it gets, failing the case with `what` if none.
fn freed_for(what: &str, waiter: Lock, holders: Vec<LockGuard>) -> LockGuard {
    let waiting = thread::spawn(move || waiter.try_lock_for(PATIENCE).unwrap());
    for holder in holders {
        assert_eq!(holder.release().unwrap(), Released::Released);
    }
    got(what, waiting.join().unwrap())
}

/// Threads of two clients (as two processes would be) take turns under one mutex: no
/// two inside at once, every token greater than the last.
pub fn blocking_exclusion_across_threads(store: Arc<dyn Store>) {
    let (a, b) = (client(&store), client(&store));
    let name = unique("blocking-exclusion");
    let inside = Arc::new(AtomicUsize::new(0));
    let last_token = Arc::new(AtomicU64::new(0));
    let turns = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = [&a, &a, &b, &b]
        .into_iter()
        .map(|locks| {
            let lock = locks
                .mutex(name.as_str())
                .unwrap()
                .with_ttl(BEYOND_PATIENCE);
            let (inside, last_token, turns) = (inside.clone(), last_token.clone(), turns.clone());
            thread::spawn(move || {
                for _ in 0..10 {
                    let guard = got("a turn", lock.try_lock_for(PATIENCE).unwrap());
                    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    let token = guard.check().unwrap().get();
                    assert!(last_token.swap(token, Ordering::SeqCst) < token);
                    thread::yield_now();
                    turns.fetch_add(1, Ordering::SeqCst);
                    inside.fetch_sub(1, Ordering::SeqCst);
                    assert_eq!(guard.release().unwrap(), Released::Released);
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    assert_eq!(turns.load(Ordering::SeqCst), 40);
}

/// `try_lock` gives up at once and `try_lock_for` after its wait while someone holds
/// the lock; a bounded wait gets it once it is released.
pub fn blocking_try_and_bounded_wait(store: Arc<dyn Store>) {
    let (a, b) = (client(&store), client(&store));
    let name = unique("blocking-waits");
    let held = taken("the holder", a.mutex(name.as_str()));
    let lock = b.mutex(name.as_str()).unwrap();
    assert!(lock.try_lock().unwrap().is_none());
    let started = Instant::now();
    let wait = Duration::from_millis(200);
    assert!(lock.try_lock_for(wait).unwrap().is_none());
    assert!(started.elapsed() >= wait, "gave up before its wait");
    let _next = freed_for("the bounded wait", lock, vec![held]);
}

/// At most N permit holders; a freed permit goes to a waiter.
pub fn blocking_semaphore_limit(store: Arc<dyn Store>) {
    let locks = client(&store);
    let name = unique("blocking-semaphore");
    let permit = || locks.semaphore(name.as_str(), 2).unwrap();
    let first = got("permit 1", permit().try_lock().unwrap());
    let _second = got("permit 2", permit().try_lock().unwrap());
    assert!(
        permit().try_lock().unwrap().is_none(),
        "a third permit of 2"
    );
    let _third = freed_for("the freed permit", permit(), vec![first]);
}

/// Readers hold together and keep a writer out; the writer gets the lock once they are
/// gone, and keeps readers out until it downgrades to a reader.
pub fn blocking_rwlock_readers_and_writer(store: Arc<dyn Store>) {
    let (a, b) = (client(&store), client(&store));
    let name = unique("blocking-rwlock");
    let r1 = taken("reader 1", a.read(name.as_str()));
    let r2 = taken("reader 2", b.read(name.as_str()));
    let writer = b.write(name.as_str()).unwrap();
    assert!(
        writer.try_lock().unwrap().is_none(),
        "a writer beside readers"
    );
    let mut w = freed_for("the writer", writer, vec![r1, r2]);
    let reader = a.read(name.as_str()).unwrap();
    assert!(
        reader.try_lock().unwrap().is_none(),
        "a reader beside a writer"
    );
    // Downgraded, the writer keeps its token and lets a reader in beside it.
    let token = w.token();
    w.downgrade().unwrap();
    assert_eq!((w.kind(), w.token()), (crate::LockKind::Shared, token));
    let beside = got(
        "a reader beside the downgraded writer",
        reader.try_lock().unwrap(),
    );
    let writer = b.write(name.as_str()).unwrap();
    assert!(
        writer.try_lock().unwrap().is_none(),
        "a writer beside readers"
    );
    assert_eq!(w.release().unwrap(), Released::Released);
    assert_eq!(beside.release().unwrap(), Released::Released);
    assert!(reader.try_lock().unwrap().is_some());
}

/// Each acquisition of a name, by either client, has a greater token than the last.
pub fn blocking_tokens_increase(store: Arc<dyn Store>) {
    let (a, b) = (client(&store), client(&store));
    let name = unique("blocking-tokens");
    let mut last = 0;
    for locks in [&a, &b, &a, &b] {
        let guard = locks.mutex(name.as_str()).unwrap().lock().unwrap();
        let token = guard.token().get();
        assert!(token > last, "token {token} after {last}");
        last = token;
        assert_eq!(guard.release().unwrap(), Released::Released);
    }
}

/// A dropped guard is released (in the background), long before its lease would end.
pub fn blocking_drop_releases(store: Arc<dyn Store>) {
    let (a, b) = (client(&store), client(&store));
    let name = unique("blocking-drop");
    let lock = |locks: &Leasehold| {
        locks
            .mutex(name.as_str())
            .unwrap()
            .with_ttl(BEYOND_PATIENCE)
    };
    let guard = got("the holder", lock(&a).try_lock().unwrap());
    assert!(lock(&b).try_lock().unwrap().is_none());
    drop(guard);
    let next = lock(&b).try_lock_for(PATIENCE).unwrap();
    assert!(next.is_some(), "the dropped guard was not released");
}

/// Called from a task of an async runtime, the blocking API works (blocking that
/// thread) rather than panicking, and so does dropping its guard and client there.
pub fn blocking_inside_an_async_runtime(store: Arc<dyn Store>) {
    let name = unique("blocking-in-async");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let locks = client(&store);
        let lock = locks.mutex(name.as_str()).unwrap();
        let guard = got("the lock", lock.try_lock().unwrap());
        assert!(!guard.is_lost());
        drop(guard);
        assert!(lock.try_lock_for(PATIENCE).unwrap().is_some());
        drop(locks);
    });
}

/// Makes one `#[test]` per blocking case for the store that `$make` builds: an
/// expression giving `(Arc<dyn Store>, guard)`, the guard living until the case ends.
/// Plain tests, not `#[tokio::test]`: the blocking API is for threads outside a runtime.
#[macro_export]
macro_rules! conformance_blocking {
    ($make:expr) => {
        $crate::conformance_blocking!(@cases $make;
            blocking_exclusion_across_threads, blocking_try_and_bounded_wait,
            blocking_semaphore_limit, blocking_rwlock_readers_and_writer,
            blocking_tokens_increase, blocking_drop_releases, blocking_inside_an_async_runtime);
    };
    (@cases $make:expr; $($case:ident),*) => {
        $(
            #[test]
            fn $case() {
                let (store, _guard) = $make;
                let store: ::std::sync::Arc<dyn $crate::Store> = store;
                $crate::conformance::$case(store);
            }
        )*
    };
}
