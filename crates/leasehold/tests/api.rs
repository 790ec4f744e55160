//! What a user of the library meets first: the names it takes, what a guard prints, what
//! it logs. On the in-process store.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::{Leasehold, LockName, MemoryStore, Released};

#[tokio::test]
async fn every_method_that_takes_a_name_takes_str_string_and_lock_name_owned_or_borrowed() {
    let locks = Leasehold::new(MemoryStore::new());
    let text = String::from("tenant:42:migrate");
    let name = LockName::new(text.as_str()).unwrap();
    for lock in [
        locks.mutex("tenant:42:migrate").unwrap(),
        locks.mutex(&text).unwrap(),
        locks.mutex(text.clone()).unwrap(),
        locks.mutex(&name).unwrap(),
        locks.mutex(name.clone()).unwrap(),
        locks
            .mutex(std::borrow::Cow::Borrowed(text.as_str()))
            .unwrap(),
        locks.write(&text).unwrap(),
        locks.write(name.clone()).unwrap(),
        locks.read(&name).unwrap(),
        locks.read(text.clone()).unwrap(),
    ] {
        assert_eq!(lock.name(), &name);
    }
    assert_eq!(locks.semaphore(&text, 2).unwrap().name(), &name);
    assert_eq!(locks.semaphore(name.clone(), 2).unwrap().name(), &name);
    let held = locks
        .mutex(&name)
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(locks.describe(&text).await.unwrap().holders.len(), 1);
    assert_eq!(locks.describe(name.clone()).await.unwrap().holders.len(), 1);
    assert!(locks.force_release(&name).await.unwrap());
    assert!(!locks.force_release(text).await.unwrap());
    assert_eq!(held.release().await.unwrap(), Released::NotHeld);
    // A name that breaks a rule is refused whatever it comes as.
    assert!(locks.mutex(String::new()).is_err());
    let control = "a\nb".to_string();
    assert!(locks.mutex(&control).is_err());
}

#[tokio::test]
async fn mutex_and_write_of_one_name_are_the_same_lock() {
    let locks = Leasehold::new(MemoryStore::new());
    let mutex = locks.mutex("k").unwrap().try_lock().await.unwrap().unwrap();
    assert!(locks
        .write("k")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .is_none());
    assert!(locks.read("k").unwrap().try_lock().await.unwrap().is_none());
    let _ = mutex.release().await.unwrap();
    let writer = locks.write("k").unwrap().try_lock().await.unwrap().unwrap();
    assert!(locks
        .mutex("k")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .is_none());
    let _ = writer.release().await.unwrap();
}

#[tokio::test]
async fn a_guard_debugs_as_one_short_line_of_what_identifies_the_hold() {
    let locks = Leasehold::new(MemoryStore::new());
    let guard = locks
        .mutex("nightly")
        .unwrap()
        .with_owner("web-3")
        .with_ttl(Duration::from_secs(30))
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    let shown = format!("{guard:?}");
    assert!(shown.len() < 200, "{} bytes: {shown}", shown.len());
    assert!(!shown.contains('\n'), "{shown}");
    for part in [
        "\"nightly\"",
        &format!("token: {}", guard.token()),
        "\"web-3\"",
        "Exclusive",
        "holds: 1",
        "valid_for: 29",
    ] {
        assert!(shown.contains(part), "no {part:?} in {shown}");
    }
    // Its deadlines show the same, not the channel they come through.
    let deadlines = format!("{:?}", guard.deadlines());
    assert!(
        deadlines.starts_with("Deadlines { valid_for: 29") && !deadlines.contains('\n'),
        "{deadlines}"
    );
    locks.force_release("nightly").await.unwrap();
    guard.lost().await;
    let shown = format!("{guard:?}");
    assert!(
        shown.contains("lost: ") && !shown.contains("valid_for"),
        "{shown}"
    );
    assert!(shown.len() < 300, "{} bytes: {shown}", shown.len());
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Logs at `level` and above while `work` runs (on this thread: a current-thread runtime
/// runs every task here).
async fn logged_at<F: std::future::Future<Output = ()>>(level: tracing::Level, work: F) -> String {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .with_writer({
            let captured = captured.clone();
            move || captured.clone()
        })
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    work.await;
    captured.text()
}

/// Acquires (once after a wait), renews, releases, force-releases, loses a lock.
async fn routine_lock_traffic() {
    let locks = Leasehold::new(MemoryStore::new());
    let lock = locks
        .mutex("k")
        .unwrap()
        .with_ttl(Duration::from_millis(300));
    let first = lock.try_lock().await.unwrap().unwrap();
    let waiter = tokio::spawn({
        let lock = lock.clone();
        async move { lock.lock().await.unwrap() }
    });
    // One renewal, confirmed, before the release.
    let renewed = tokio::time::timeout(Duration::from_secs(10), first.deadlines().next()).await;
    assert!(matches!(renewed, Ok(Some(_))), "no renewal: {renewed:?}");
    let _ = first.release().await.unwrap();
    let second = waiter.await.unwrap();
    assert!(locks.force_release("k").await.unwrap());
    second.lost().await;
    let _ = second.release().await.unwrap();
    assert!(locks.shutdown(Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "current_thread")]
async fn routine_lock_traffic_logs_nothing_at_info_and_tells_debug_what_happened() {
    let info = logged_at(tracing::Level::INFO, routine_lock_traffic()).await;
    assert_eq!(info, "", "the library logged at INFO or above");
    let debug = logged_at(tracing::Level::DEBUG, routine_lock_traffic()).await;
    for event in ["acquired", "released", "force-released", "lock lost"] {
        assert!(debug.contains(event), "no {event:?} at DEBUG:\n{debug}");
    }
    assert!(!debug.contains("renewed"), "renewals are TRACE:\n{debug}");
    let trace = logged_at(tracing::Level::TRACE, routine_lock_traffic()).await;
    assert!(trace.contains("renewed"), "no renewal at TRACE:\n{trace}");
}

/// A task that waits for a lock carries its handle and `lock()`'s future for as long as it
/// waits (thousands of them, on busy names), and tokio allocates a task in steps of 128
/// bytes: the acquire's state is boxed, and the handle and the guard are small.
#[tokio::test]
async fn a_waiting_task_carries_little_beside_its_handle() {
    let locks = Leasehold::new(MemoryStore::new());
    let lock = locks.mutex("task-size").unwrap();
    let handle = std::mem::size_of_val(&lock);
    assert!(handle <= 128, "Lock: {handle} bytes");
    let waiting = lock.lock();
    let size = std::mem::size_of_val(&waiting);
    assert!(size <= 32, "lock(): {size} bytes");
    let guard = waiting.await.unwrap();
    let size = std::mem::size_of_val(&guard);
    assert!(size <= 16, "LockGuard: {size} bytes");
    assert_eq!(guard.release().await.unwrap(), Released::Released);
}

/// A task that waits for a lock and then releases it carries the larger of the two
/// futures for as long as it waits (thousands of them, on a busy name): the release's
/// work is boxed, so it adds little beside the guard.
#[tokio::test]
async fn release_carries_little_beside_the_guard() {
    let locks = Leasehold::new(MemoryStore::new());
    let lock = locks.mutex("release-size").unwrap();
    let guard = lock.lock().await.unwrap();
    let guard_size = std::mem::size_of_val(&guard);
    let release = guard.release();
    let size = std::mem::size_of_val(&release);
    assert!(size <= guard_size + 64, "release(): {size} bytes");
    assert_eq!(release.await.unwrap(), Released::Released);
}
