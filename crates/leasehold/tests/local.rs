//! What only the local store promises, beyond the conformance suite.

use std::sync::Arc;

use leasehold::{Leasehold, LocalStore, Store};
use leasehold_testkit::TempDir;

#[tokio::test]
async fn tokens_continue_after_the_store_is_reopened() {
    let dir = TempDir::new("local-reopen");
    let first = Leasehold::new(LocalStore::open(dir.path()).unwrap());
    let g = first.mutex("k").unwrap().try_lock().await.unwrap().unwrap();
    let token = g.token();
    let _ = g.release().await.unwrap();
    drop(first);

    let reopened = Leasehold::new(LocalStore::open(dir.path()).unwrap());
    let g = reopened
        .mutex("k")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    assert!(
        g.token() > token,
        "token {} after {token} from before the reopen",
        g.token()
    );
    let _ = g.release().await.unwrap();
}

#[tokio::test]
async fn two_stores_on_one_directory_exclude_each_other() {
    let dir = TempDir::new("local-two");
    let a = Leasehold::new(LocalStore::open(dir.path()).unwrap());
    let b = Leasehold::new(LocalStore::open(dir.path()).unwrap());
    let held = a.mutex("k").unwrap().try_lock().await.unwrap().unwrap();
    assert!(b.mutex("k").unwrap().try_lock().await.unwrap().is_none());
    let waiting = tokio::spawn(async move { b.mutex("k").unwrap().lock().await.unwrap() });
    let _ = held.release().await.unwrap();
    let next = leasehold::conformance::within("the other store's waiter", waiting)
        .await
        .unwrap();
    let _ = next.release().await.unwrap();
}

#[tokio::test]
async fn names_of_any_characters_and_length_get_their_own_files() {
    let dir = TempDir::new("local-names");
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path()).unwrap());
    let locks = Leasehold::from_store(store);
    let long = "ü/".repeat(85); // 255 bytes
    let names = [
        "a/b",
        "a%2Fb",
        ".hidden",
        "spaces and: colons",
        long.as_str(),
    ];
    let mut guards = Vec::new();
    for name in names {
        guards.push(
            locks
                .mutex(name)
                .unwrap()
                .try_lock()
                .await
                .unwrap()
                .expect(name),
        );
    }
    let listed: Vec<String> = locks
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    for name in names {
        assert!(
            listed.iter().any(|l| l == name),
            "{name:?} missing from {listed:?}"
        );
    }
    for g in guards {
        let _ = g.release().await.unwrap();
    }
}

/// A lock file that is lost (deleted, or moved aside when unreadable) does not make tokens
/// go back: a name's first token comes from the clock.
#[tokio::test]
async fn tokens_rise_after_the_lock_file_is_lost() {
    let dir = TempDir::new("local-lost-file");
    let locks = Leasehold::new(LocalStore::open(dir.path()).unwrap());
    let lock = locks.mutex("k").unwrap();
    let g = lock.try_lock().await.unwrap().unwrap();
    let before = g.token();
    let _ = g.release().await.unwrap();
    drop(locks);
    std::fs::remove_file(dir.path().join("locks/k.lock")).unwrap();
    let locks = Leasehold::new(LocalStore::open(dir.path()).unwrap());
    let g = locks.mutex("k").unwrap().try_lock().await.unwrap().unwrap();
    assert!(g.token() > before, "{} after {before}", g.token());
    let _ = g.release().await.unwrap();
}

/// A stranger holds the lock file's `flock`: a bounded wait fails after one store call's
/// patience, and since a failed call on the local store changed nothing, it leaves no
/// undo behind to wait for (which met the same stuck file lock, a second each, in the
/// wait and again at shutdown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_a_stuck_file_lock_ends_leaves_nothing_to_undo() {
    use std::os::fd::AsRawFd;
    let dir = TempDir::new("local-stuck");
    let locks = Leasehold::new(LocalStore::open(dir.path()).unwrap());
    let lock = locks.mutex("k").unwrap();
    let _ = lock
        .try_lock()
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    let stranger = std::fs::File::open(dir.path().join("locks/k.lock")).unwrap();
    // SAFETY: a valid fd; the lock goes with the file.
    assert_eq!(
        unsafe { libc::flock(stranger.as_raw_fd(), libc::LOCK_EX) },
        0
    );
    let failed = lock
        .try_lock_for(std::time::Duration::from_millis(500))
        .await;
    assert!(
        matches!(failed, Err(leasehold::Error::Unavailable { .. })),
        "{failed:?}"
    );
    assert!(
        locks.shutdown(std::time::Duration::ZERO).await,
        "an undo was left to send"
    );
}
