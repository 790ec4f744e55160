//! What only the local store promises, beyond the conformance suite.

use std::sync::Arc;

use leasehold::{Error, Leasehold, LocalStore, Rate, Store};
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

/// The store never follows a symbolic link in its directories, which others may write to
/// (a store shared with a group): a link where a lock's or a limiter's file goes, or in
/// place of its locks directory, is refused as a configuration error, and what it points
/// at is left as it was (not made, written or given the store's mode).
#[tokio::test]
async fn links_in_the_store_are_refused_and_what_they_point_at_is_left_alone() {
    use std::os::unix::fs::{symlink, PermissionsExt};
    let dir = TempDir::new("local-links");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "data\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
    let missing = dir.path().join("missing");
    let store = dir.path().join("store");
    let first = Leasehold::new(LocalStore::open(&store).unwrap());
    let limiter = first.rate_limiter("r", Rate::per_second(10), 1).unwrap();
    assert!(limiter.try_acquire(1).await.unwrap().allowed);
    std::fs::remove_file(store.join("limits/r.lock")).unwrap();
    symlink(&victim, store.join("limits/r.lock")).unwrap();
    symlink(&victim, store.join("locks/v.lock")).unwrap();
    symlink(&missing, store.join("locks/w.lock")).unwrap();

    let locks = Leasehold::new(LocalStore::open(&store).unwrap());
    for name in ["v", "w"] {
        let refused = locks.mutex(name).unwrap().try_lock().await;
        assert!(matches!(refused, Err(Error::Config { .. })), "{refused:?}");
    }
    let limiter = locks.rate_limiter("r", Rate::per_second(10), 1).unwrap();
    let refused = limiter.try_acquire(1).await;
    assert!(matches!(refused, Err(Error::Config { .. })), "{refused:?}");
    // Other names still work, and list skips the links.
    let g = locks.mutex("k").unwrap().try_lock().await.unwrap().unwrap();
    let listed: Vec<String> = (locks.store().list("").await.unwrap().into_iter())
        .map(|s| s.name.to_string())
        .collect();
    assert_eq!(listed, ["k"]);
    let _ = g.release().await.unwrap();

    // The locks directory itself a link: the store does not open.
    std::fs::rename(store.join("locks"), dir.path().join("locks-moved")).unwrap();
    std::fs::create_dir(dir.path().join("elsewhere")).unwrap();
    symlink(dir.path().join("elsewhere"), store.join("locks")).unwrap();
    let refused = LocalStore::open(&store);
    assert!(refused.is_err(), "{refused:?}");
    let refused = locks.mutex("new").unwrap().try_lock().await;
    assert!(matches!(refused, Err(Error::Config { .. })), "{refused:?}");
    assert_eq!(
        std::fs::read_dir(dir.path().join("elsewhere"))
            .unwrap()
            .count(),
        0
    );

    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "data\n");
    let mode = std::fs::metadata(&victim).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o644);
    assert!(!missing.exists());
}
