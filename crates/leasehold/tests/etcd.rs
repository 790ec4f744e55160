//! What only the etcd store promises, against a real etcd: a waiter's key on a short
//! lease until it holds (then on the full TTL, shown held since its grant); a waiter whose own lease ends
//! stops with a clear error, renewal across a member restart, `lost` when etcd stays
//! away, non-fair waiting, extending past the lease etcd granted, re-entry by an owner
//! that queued first, a waiter moving off a paused member, a short lease renewed through
//! another member while its own is paused, a re-entry's hold ending with its own lease;
//! for elections, a hold's value, `proclaim` and `watch`.
#![cfg(feature = "etcd")]

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use leasehold::conformance::{eventually, join_all, renews_again_after_a_restart, within};
use leasehold::store::{
    AcquireRequest, Attempt, Grant, LeaseId, LockKind, Released, Renewal, Requester, Store,
};
use leasehold::{Error, EtcdStore, Leasehold, LockName};
use leasehold_testkit::{EtcdCluster, EtcdServer};
use tokio::task::JoinHandle;
use tokio::time::Instant;

async fn start() -> (EtcdServer, Leasehold) {
    let server = tokio::task::spawn_blocking(EtcdServer::start)
        .await
        .unwrap();
    let locks = Leasehold::new(EtcdStore::connect(&server.url()).await.unwrap());
    (server, locks)
}

/// The etcd lease ids of the lock's queue keys, in queue order (etcdctl's JSON).
fn queue_leases(server: &EtcdServer) -> Vec<i64> {
    // Queue keys are under `leasehold\0`; owner markers under `leasehold\x01`.
    let out = server.etcdctl(&[
        "get",
        "leasehold",
        "leasehold\u{1}",
        "--sort-by=CREATE",
        "--order=ASCEND",
        "-w",
        "json",
    ]);
    let json: serde_json::Value = serde_json::from_str(&out).expect("etcdctl prints JSON");
    json["kvs"]
        .as_array()
        .map(|kvs| kvs.iter().map(|kv| kv["lease"].as_i64().unwrap()).collect())
        .unwrap_or_default()
}

/// The TTL etcd granted lease `id`, in seconds.
fn granted_ttl(server: &EtcdServer, id: i64) -> i64 {
    let out = server.etcdctl(&["lease", "timetolive", &format!("{id:x}"), "-w", "json"]);
    let json: serde_json::Value = serde_json::from_str(&out).expect("etcdctl prints JSON");
    json["granted-ttl"].as_i64().expect("a granted TTL")
}

/// A waiter's key is on a waiter's short lease, so a waiter that dies holds up the
/// queue for at most that long; the key is on a lease of the lock's full TTL once it
/// holds, and its guard counts on the full TTL from the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_waits_on_a_short_lease_and_holds_on_the_full_ttl() {
    let (server, locks) = start().await;
    let ttl = Duration::from_secs(30);
    let lock = locks.mutex("k").unwrap().with_ttl(ttl).with_owner("holder");
    let holder = lock.try_lock().await.unwrap().unwrap();
    let other = Leasehold::new(EtcdStore::connect(&server.url()).await.unwrap());
    let waiter = tokio::spawn({
        let lock = other.mutex("k").unwrap().with_ttl(ttl).with_owner("waiter");
        async move { lock.lock().await }
    });
    eventually("the waiter to queue", || async {
        locks.describe("k").await.unwrap().waiters.len() == 1
    })
    .await;
    let leases = queue_leases(&server);
    assert_eq!(granted_ttl(&server, leases[0]), 30, "the holder's lease");
    let short = leasehold::store::MAX_WAITER_LEASE.as_secs() as i64;
    assert_eq!(granted_ttl(&server, leases[1]), short, "the waiter's lease");
    let joined = locks.describe("k").await.unwrap().waiters[0].since;
    // The grant comes on a later millisecond than the join, so that the two differ.
    eventually("the wall clock to pass the join", || async {
        std::time::SystemTime::now() > joined + Duration::from_millis(2)
    })
    .await;
    let released = std::time::SystemTime::now();
    let _ = holder.release().await.unwrap();
    let guard = within("the hand-over", waiter).await.unwrap().unwrap();
    // `status` shows it held since the grant, not since it joined the queue.
    let since = locks.describe("k").await.unwrap().holders[0].since;
    assert!(
        since + Duration::from_millis(1) >= released && since > joined,
        "held since {since:?}; joined {joined:?}, released {released:?}"
    );
    let left = guard.valid_until() - Instant::now();
    assert!(
        left > ttl / 2,
        "the guard counts on {left:?} of a {ttl:?} lease"
    );
    let leases = queue_leases(&server);
    assert_eq!(leases.len(), 1);
    assert_eq!(
        granted_ttl(&server, leases[0]),
        30,
        "the new holder's lease"
    );
    let _ = guard.release().await.unwrap();
    assert!(queue_leases(&server).is_empty());
}

/// The ids of the leases etcd has (`etcdctl lease list`: a count, then one hex id a line).
fn leases(server: &EtcdServer) -> Vec<i64> {
    let list = server.etcdctl(&["lease", "list"]);
    (list.lines().skip(1))
        .map(|id| i64::from_str_radix(id.trim(), 16).expect("a hex lease id"))
        .collect()
}

/// The waiting keys of one client share one etcd lease, however many they are, and it
/// stays alive past its TTL with no recheck from its waiters. A waiter let in holds on a
/// lease of its own, of its TTL, even when that is as short as the waiter lease (the
/// shared one lives on without its guard). Once nobody waits, the shared lease is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_one_client_share_one_lease_and_hold_on_their_own() {
    let (server, locks) = start().await;
    let ttl = Duration::from_secs(3);
    let names = ["a", "b", "c"];
    let mut holders = Vec::new();
    for name in names {
        let lock = locks.mutex(name).unwrap().with_ttl(ttl);
        holders.push(lock.try_lock().await.unwrap().expect("free"));
    }
    let (go, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut waiters = Vec::new();
    for i in 0..9 {
        let lock = locks.mutex(names[i % 3]).unwrap().with_ttl(ttl);
        let mut go = go.subscribe();
        waiters.push(tokio::spawn(async move {
            let guard = lock.lock().await.expect("served");
            let _ = go.recv().await;
            guard.release().await.unwrap()
        }));
    }
    for name in names {
        eventually("three waiters on each name", || async {
            locks.describe(name).await.unwrap().waiters.len() == 3
        })
        .await;
    }
    let queued = tokio::task::block_in_place(|| queue_leases(&server));
    assert_eq!(queued.len(), 12, "{queued:?}");
    let mut shared: Vec<i64> = queued.clone();
    shared.sort_unstable();
    shared.dedup();
    // Three holders' leases and one for all nine waiters.
    assert_eq!(shared.len(), 4, "{queued:?}");
    let shared_id = *shared
        .iter()
        .find(|id| queued.iter().filter(|q| q == id).count() == 9)
        .expect("one lease carries the nine waiting keys");
    // The interval under test: past the shared lease's TTL, nobody's rechecks needed.
    tokio::time::sleep(ttl + Duration::from_secs(1)).await;
    for name in names {
        assert_eq!(locks.describe(name).await.unwrap().waiters.len(), 3);
    }
    for holder in holders {
        let _ = holder.release().await.unwrap();
    }
    eventually("the first waiter of each name to hold", || async {
        let queued = tokio::task::block_in_place(|| queue_leases(&server));
        queued.len() == 9 && queued.iter().filter(|&&q| q == shared_id).count() == 6
    })
    .await;
    for id in tokio::task::block_in_place(|| queue_leases(&server)) {
        if id != shared_id {
            let granted = tokio::task::block_in_place(|| granted_ttl(&server, id));
            assert_eq!(granted, 3, "a holder's own lease, of its TTL");
        }
    }
    let _ = go.send(());
    drop(go);
    for waiter in waiters {
        assert_eq!(
            within("a waiter", waiter).await.unwrap(),
            Released::Released
        );
    }
    assert!(tokio::task::block_in_place(|| queue_leases(&server)).is_empty());
    eventually("the shared lease to be revoked", || async {
        !tokio::task::block_in_place(|| leases(&server)).contains(&shared_id)
    })
    .await;
}

/// A waiter whose place etcd dropped (its lease ended: what a pause of the process, or
/// of etcd, longer than the waiter lease does) joins the queue again, at its end, and is
/// served: `lock()` waits as long as it takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_place_is_dropped_joins_the_queue_again() {
    let (server, locks) = start().await;
    let lock = locks.mutex("k").unwrap().with_ttl(Duration::from_secs(2));
    let holder = lock.try_lock().await.unwrap().unwrap();
    let waiter = tokio::spawn({
        let lock = lock.clone();
        async move { lock.lock().await }
    });
    eventually("the waiter to queue", || async {
        locks.describe("k").await.unwrap().waiters.len() == 1
    })
    .await;
    // The waiter's key has its token already, but the last token issued is the holder's.
    assert_eq!(
        locks.describe("k").await.unwrap().last_token,
        holder.token()
    );
    let leases = tokio::task::block_in_place(|| queue_leases(&server));
    assert_eq!(leases.len(), 2);
    let dropped = leases[1];
    let id = format!("{dropped:x}");
    let revoked = tokio::task::block_in_place(|| server.etcdctl(&["lease", "revoke", &id]));
    assert!(revoked.contains("revoked"), "{revoked}");
    eventually("the waiter to queue again, on another lease", || async {
        let leases = tokio::task::block_in_place(|| queue_leases(&server));
        leases.len() == 2 && leases[1] != dropped
    })
    .await;
    assert!(holder.check().is_ok());
    let first = holder.token();
    let _ = holder.release().await.unwrap();
    let guard = within("the waiter to be served", waiter)
        .await
        .unwrap()
        .expect("lock() waits as long as it takes");
    assert!(guard.token() > first);
    let _ = guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_renews_again_after_a_member_restart_within_its_deadline() {
    let (mut server, locks) = start().await;
    renews_again_after_a_restart(&locks, Duration::from_secs(4), || server.restart()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_fires_when_etcd_stays_away() {
    let (mut server, locks) = start().await;
    let guard = locks
        .mutex("k")
        .unwrap()
        .with_ttl(Duration::from_secs(1))
        .lock()
        .await
        .unwrap();
    tokio::task::block_in_place(|| server.kill());
    within("lost() after etcd went away", guard.lost()).await;
    assert!(matches!(guard.check(), Err(Error::Lost { .. })));
}

/// Non-fair waiters (who watch the holder's key rather than queue) still exclude each
/// other, and tokens keep increasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_fair_waiters_exclude_each_other() {
    let (_server, locks) = start().await;
    let lock = locks.mutex("k").unwrap().with_fair(false);
    join_all("the non-fair tasks", taking_turns(&lock, 6, 10)).await;
}

/// `tasks` tasks taking `lock` in turn, `cycles` times each: never two holders, and each
/// holder's token above every earlier holder's.
fn taking_turns(lock: &leasehold::Lock, tasks: usize, cycles: usize) -> Vec<JoinHandle<()>> {
    let (inside, last) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicU64::new(0)));
    (0..tasks)
        .map(|_| {
            let (lock, inside, last) = (lock.clone(), inside.clone(), last.clone());
            tokio::spawn(async move {
                for _ in 0..cycles {
                    let guard = lock.lock().await.unwrap();
                    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    let token = guard.token().get();
                    let earlier = last.swap(token, Ordering::SeqCst);
                    assert!(token > earlier, "token {token} after {earlier}");
                    tokio::task::yield_now().await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    let _ = guard.release().await.unwrap();
                }
            })
        })
        .collect()
}

/// A non-fair writer that waits is in the queue (not outside it, watching): `describe`
/// shows it, and a reader that comes later does not pass it (a reader never passes a
/// waiting writer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_fair_writer_waits_in_the_queue_and_readers_do_not_pass_it() {
    let (_server, locks) = start().await;
    let reader = locks.read("rw").unwrap().with_owner("r1");
    let held = reader.try_lock().await.unwrap().unwrap();
    let writer = locks.write("rw").unwrap().with_owner("w").with_fair(false);
    let waiting = tokio::spawn(async move { writer.lock().await });
    eventually("the non-fair writer to be shown waiting", || async {
        locks.describe("rw").await.unwrap().waiters.len() == 1
    })
    .await;
    let later = locks.read("rw").unwrap().with_owner("r2").with_fair(false);
    assert!(
        later.try_lock().await.unwrap().is_none(),
        "a reader passed a waiting writer"
    );
    let _ = held.release().await.unwrap();
    let guard = within("the writer to hold", waiting)
        .await
        .unwrap()
        .unwrap();
    let _ = guard.release().await.unwrap();
}

/// Two waiting requests of one owner each have a place in the queue (`describe` shows
/// both), and once the first holds, the second re-enters at once, whatever waits
/// between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_waiting_twice_has_two_places_and_the_second_re_enters() {
    let (server, locks) = start().await;
    let holder = locks.mutex("k").unwrap().with_owner("h");
    let held = holder.try_lock().await.unwrap().unwrap();
    let other = Leasehold::new(EtcdStore::connect(&server.url()).await.unwrap());
    let mine = locks.mutex("k").unwrap().with_owner("me");
    let first = tokio::spawn({
        let mine = mine.clone();
        async move { mine.lock().await }
    });
    eventually("the first wait", || async {
        locks.describe("k").await.unwrap().waiters.len() == 1
    })
    .await;
    let between = other.mutex("k").unwrap().with_owner("x");
    let between = tokio::spawn(async move { between.lock().await });
    eventually("the wait between", || async {
        locks.describe("k").await.unwrap().waiters.len() == 2
    })
    .await;
    // The second wait, through another client.
    let again = other.mutex("k").unwrap().with_owner("me");
    let second = tokio::spawn(async move { again.lock().await });
    eventually("the second wait of the owner shown", || async {
        let waiters = locks.describe("k").await.unwrap().waiters;
        waiters.iter().map(|w| w.owner.as_str()).collect::<Vec<_>>() == ["me", "x", "me"]
    })
    .await;
    let _ = held.release().await.unwrap();
    let outer = within("the owner to hold", first).await.unwrap().unwrap();
    let inner = within("the second to re-enter", second)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(inner.token(), outer.token());
    assert_eq!(inner.holds(), 2);
    let state = locks.describe("k").await.unwrap();
    assert_eq!(state.holders[0].holds, 2);
    assert_eq!(state.waiters.len(), 1, "x still waits");
    let _ = inner.release().await.unwrap();
    let _ = outer.release().await.unwrap();
    let x = within("x to hold", between).await.unwrap().unwrap();
    let _ = x.release().await.unwrap();
}

/// `extend` past the lease etcd granted moves the key to a longer lease: the token stays,
/// and the lock outlives the old lease without renewals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_beyond_the_granted_lease_keeps_the_token() {
    let (_server, locks) = start().await;
    let guard = locks
        .mutex("k")
        .unwrap()
        .with_ttl(Duration::from_secs(1))
        .lock()
        .await
        .unwrap();
    let token = guard.token();
    guard.extend(Duration::from_secs(30)).await.unwrap();
    assert!(guard.valid_until() > Instant::now() + Duration::from_secs(20));
    let state = locks.describe("k").await.unwrap();
    assert_eq!(state.holders[0].token, token);
    assert!(state.holders[0].lease_left > Duration::from_secs(20));
    let _ = guard.release().await.unwrap();
}

/// An owner that joined behind another holder (its key carries an owner marker) re-enters
/// once it holds, and its last release leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_queued_behind_another_re_enters() {
    let (server, locks) = start().await;
    let other = locks.mutex("k").unwrap().try_lock().await.unwrap().unwrap();
    let mine = locks.mutex("k").unwrap().with_owner("me");
    let queued = tokio::spawn({
        let mine = mine.clone();
        async move { mine.lock().await }
    });
    eventually("the owner to queue", || async {
        locks.describe("k").await.unwrap().waiters.len() == 1
    })
    .await;
    let _ = other.release().await.unwrap();
    let outer = within("the owner to hold", queued).await.unwrap().unwrap();
    let inner = within("the re-entry", mine.lock()).await.unwrap();
    assert_eq!(inner.token(), outer.token());
    assert_eq!(inner.holds(), 2);
    let _ = inner.release().await.unwrap();
    let _ = outer.release().await.unwrap();
    let state = locks.describe("k").await.unwrap();
    assert!(state.holders.is_empty() && state.waiters.is_empty());
    let left = tokio::task::block_in_place(|| {
        server.etcdctl(&["get", "--prefix", "leasehold", "--keys-only"])
    });
    assert!(left.trim().is_empty(), "keys left: {left:?}");
}

/// A waiter whose calls and watches go to a member that stops answering (paused) moves
/// to another member and is let in when the holder leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_moves_off_a_paused_member() {
    let cluster = tokio::task::spawn_blocking(EtcdCluster::start)
        .await
        .unwrap();
    let url = cluster.url();
    let (first, rest) = url.split_once(',').unwrap();
    // The waiter's client calls member 0 first; the holder's never does.
    let waiters = Leasehold::new(EtcdStore::connect(&url).await.unwrap());
    let holders = Leasehold::new(EtcdStore::connect(&format!("etcd://{rest}")).await.unwrap());
    assert!(first.ends_with(&cluster.members[0].port().to_string()));
    let holder = holders
        .mutex("k")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    let waiter = tokio::spawn({
        let lock = waiters.mutex("k").unwrap();
        async move { lock.lock().await }
    });
    eventually("the waiter to queue", || async {
        holders.describe("k").await.unwrap().waiters.len() == 1
    })
    .await;
    cluster.members[0].pause();
    let _ = holder.release().await.unwrap();
    let guard = within("the waiter to hold", waiter).await.unwrap().unwrap();
    assert!(guard.check().is_ok());
    let _ = guard.release().await.unwrap();
    cluster.members[0].resume();
}

/// A holder whose member stops answering (paused) renews a short lease through another
/// member before it runs out: each member gets a sixth of the TTL, not the 3 s a call
/// otherwise waits, which is longer than the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lease_is_renewed_through_another_member_while_its_member_is_paused() {
    let cluster = tokio::task::spawn_blocking(EtcdCluster::start)
        .await
        .unwrap();
    // The client calls a follower first: pausing the leader would add an election.
    let leader = tokio::task::block_in_place(|| cluster.wait_for_leader());
    let first = (leader + 1) % cluster.members.len();
    let endpoints: Vec<String> = (0..cluster.members.len())
        .map(|i| cluster.members[(first + i) % cluster.members.len()].endpoint())
        .collect();
    let url = format!("etcd://{}", endpoints.join(","));
    let locks = Leasehold::new(EtcdStore::connect(&url).await.unwrap());
    let ttl = Duration::from_secs(2);
    let guard = (locks.mutex("k").unwrap().with_ttl(ttl))
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    let paused_at = Instant::now();
    cluster.members[first].pause();
    // Held past the end of every lease granted before the pause: renewed since.
    eventually("a renewal through another member", || async {
        guard.valid_until() > paused_at + ttl || guard.check().is_err()
    })
    .await;
    assert!(guard.check().is_ok(), "{:?}", guard.check());
    cluster.members[first].resume();
    let _ = guard.release().await.unwrap();
}

/// A holder cut off from etcd while its lock was force-released through another member
/// learns it as soon as its own member is back (its watch is made again, and a read finds
/// the key gone), not at its next renewal (about 20 s after the acquire here; the test
/// allows 15), by when another client could long have been granted the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_learns_at_once_of_a_release_made_while_it_was_cut_off() {
    let mut cluster = tokio::task::spawn_blocking(EtcdCluster::start)
        .await
        .unwrap();
    // The holder reaches one follower only (killing it needs no election).
    let leader = tokio::task::block_in_place(|| cluster.wait_for_leader());
    let cut = (leader + 1) % cluster.members.len();
    let only = |i: usize| format!("etcd://{}", cluster.members[i].endpoint());
    let holders = Leasehold::new(EtcdStore::connect(&only(cut)).await.unwrap());
    let others = Leasehold::new(EtcdStore::connect(&only(leader)).await.unwrap());
    let lock = holders.mutex("k").unwrap();
    let guard = (lock.with_ttl(Duration::from_secs(60)))
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    let before_renewal = Instant::now() + Duration::from_secs(15);
    let lost = guard.lost_signal();
    let watcher = tokio::spawn(async move { lost.lost().await });
    tokio::task::block_in_place(|| cluster.members[cut].kill());
    assert!(others.force_release("k").await.unwrap());
    tokio::task::block_in_place(|| cluster.members[cut].restart());
    let learned = tokio::time::timeout_at(before_renewal, watcher).await;
    assert!(learned.is_ok(), "the holder learned only at its renewal");
    assert!(guard.check().is_err());
}

/// How long after a leaked hold's TTL etcd may still show it: its lease is whole seconds
/// (at least the server's minimum), and expired leases are revoked by a periodic check.
const ETCD_LEASE_SLACK: Duration = Duration::from_millis(2500);

/// A re-entry whose guard is leaked holds the lock only until its own TTL ends: once its
/// owner has released its first hold, the lock is free again then, not a TTL of the
/// first hold later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaked_re_entry_ends_at_its_own_ttl_after_its_owner_releases() {
    let (_server, locks) = start().await;
    let name = "leaked-re-entry-released";
    let lock = locks.mutex(name).unwrap().with_owner("me");
    let first = lock
        .clone()
        .with_ttl(Duration::from_secs(30))
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    let short = Duration::from_secs(1);
    let inner = lock.with_ttl(short).try_lock().await.unwrap().unwrap();
    assert_eq!((inner.holds(), inner.token()), (2, first.token()));
    let leaked_at = Instant::now();
    let _lease = inner.leak();
    let _ = first.release().await.unwrap();
    let state = locks.describe(name).await.unwrap();
    assert_eq!(state.holders.len(), 1, "the leaked re-entry still holds");
    assert_eq!(state.holders[0].holds, 1);
    let deadline = leaked_at + short + ETCD_LEASE_SLACK;
    let other = locks.mutex(name).unwrap().with_owner("other");
    loop {
        if let Some(guard) = other.try_lock().await.unwrap() {
            let _ = guard.release().await.unwrap();
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lock is still held {:?} after a re-entry of TTL {short:?} was leaked",
            leaked_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A leaked re-entry expires at its own TTL while its owner's first hold goes on: the
/// hold count drops from 2 to 1 and the lock stays held, with the same token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaked_re_entry_expires_while_its_owner_holds_on() {
    let (_server, locks) = start().await;
    let name = "leaked-re-entry-held";
    let lock = locks.mutex(name).unwrap().with_owner("me");
    let first = lock
        .clone()
        .with_ttl(Duration::from_secs(30))
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    let short = Duration::from_secs(1);
    let inner = lock.with_ttl(short).try_lock().await.unwrap().unwrap();
    let leaked_at = Instant::now();
    let _lease = inner.leak();
    let state = locks.describe(name).await.unwrap();
    assert_eq!(state.holders[0].holds, 2);
    let deadline = leaked_at + short + ETCD_LEASE_SLACK;
    loop {
        let state = locks.describe(name).await.unwrap();
        assert_eq!(state.holders.len(), 1, "the owner holds on");
        assert_eq!(state.holders[0].token, first.token());
        if state.holders[0].holds == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the leaked re-entry still holds {:?} after it was leaked",
            leaked_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    first.check().unwrap();
    let busy = locks.mutex(name).unwrap().with_owner("other");
    assert!(busy.try_lock().await.unwrap().is_none(), "still held");
    let _ = first.release().await.unwrap();
    let free = busy
        .try_lock()
        .await
        .unwrap()
        .expect("free after the last release");
    let _ = free.release().await.unwrap();
}

/// Releasing the hold whose lease carries the queue key keeps the lock for the owner's
/// other hold, which renews it past the first hold's TTL; its release then frees the
/// lock and leaves no key behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_entry_keeps_the_lock_after_its_first_hold_is_released() {
    let (server, locks) = start().await;
    let name = "re-entry-outlives-first";
    let ttl = Duration::from_secs(2);
    let lock = locks.mutex(name).unwrap().with_owner("me").with_ttl(ttl);
    let first = lock.try_lock().await.unwrap().unwrap();
    let other_client = Leasehold::new(EtcdStore::connect(&server.url()).await.unwrap());
    let inner = other_client
        .mutex(name)
        .unwrap()
        .with_owner("me")
        .with_ttl(ttl)
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    let released_at = Instant::now();
    let _ = first.release().await.unwrap();
    // Renewed on its own lease past the end of the first hold's.
    let past = released_at + ttl + ETCD_LEASE_SLACK;
    eventually(
        "the re-entry to renew past the first hold's lease",
        || async { inner.valid_until() > past + ttl / 2 },
    )
    .await;
    tokio::time::sleep_until(past).await;
    inner.check().unwrap();
    let state = locks.describe(name).await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(
        (state.holders[0].holds, state.holders[0].token),
        (1, inner.token())
    );
    let busy = locks.mutex(name).unwrap().with_owner("other");
    assert!(busy.try_lock().await.unwrap().is_none(), "still held");
    let _ = inner.release().await.unwrap();
    let free = busy
        .try_lock()
        .await
        .unwrap()
        .expect("free after the last release");
    let _ = free.release().await.unwrap();
    let left = tokio::task::block_in_place(|| {
        server.etcdctl(&["get", "--prefix", "leasehold", "--keys-only"])
    });
    assert!(left.trim().is_empty(), "keys left: {left:?}");
}

/// A re-entry released, the owner re-enters again: two holds, the same token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_entry_after_a_released_re_entry_counts_both_holds() {
    let (_server, locks) = start().await;
    let name = "re-entry-again";
    let lock = locks.semaphore(name, 3).unwrap().with_owner("me");
    let first = lock.try_lock().await.unwrap().unwrap();
    let second = lock
        .try_lock_for(Duration::from_millis(100))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(second.holds(), 2);
    let _ = second.release().await.unwrap();
    let third = lock.try_lock().await.unwrap().unwrap();
    assert_eq!((third.holds(), third.token()), (2, first.token()));
    assert_eq!(locks.describe(name).await.unwrap().holders[0].holds, 2);
    let _ = third.release().await.unwrap();
    let _ = first.release().await.unwrap();
}

/// The first hold released while a re-entry holds on, the owner re-enters again: the
/// released hold's lease, whose name the queue key keeps, is not reused for a new key of
/// the same name (which would be taken for the owner's key, a first hold).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_entry_after_the_first_hold_is_released_counts_both_holds() {
    let (_server, locks) = start().await;
    let name = "re-entry-after-first";
    let lock = locks.semaphore(name, 3).unwrap().with_owner("me");
    let first = lock.try_lock().await.unwrap().unwrap();
    let second = lock
        .try_lock_for(Duration::from_millis(100))
        .await
        .unwrap()
        .unwrap();
    let _ = first.release().await.unwrap();
    let third = lock
        .try_lock_for(Duration::from_millis(100))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((third.holds(), third.token()), (2, second.token()));
    assert_eq!(locks.describe(name).await.unwrap().holders[0].holds, 2);
    let _ = third.release().await.unwrap();
    let _ = second.release().await.unwrap();
    assert!(locks.describe(name).await.unwrap().holders.is_empty());
}

/// A fair mutex request of `owner` for `name` that publishes `value`, as an election's
/// candidate makes (through the store: the library's elections are not there yet).
fn candidate(name: &str, owner: &str, value: Option<&str>) -> AcquireRequest {
    AcquireRequest {
        name: LockName::new(name).unwrap(),
        lease: LeaseId::random(),
        owner: owner.into(),
        kind: LockKind::Exclusive,
        ttl: Duration::from_secs(30),
        fair: true,
        enqueue: true,
        waited_since: None,
        requester: Arc::new(Requester::this_process()),
        value: value.map(Arc::from),
    }
}

/// `req` granted, at once or when its turn in the queue comes, as the lock loop waits:
/// for a change, and again by `retry_in` (which keeps a waiter's lease alive).
async fn granted(store: &dyn Store, req: &AcquireRequest) -> Grant {
    within("the grant", async {
        loop {
            let busy = match store.acquire(req).await.unwrap() {
                Attempt::Granted(grant) => return grant,
                Attempt::Busy(busy) => busy,
            };
            let again = busy.retry_in.unwrap_or(Duration::from_secs(1));
            let changed = store.changed(req, busy.watermark);
            if let Ok(Some(grant)) = tokio::time::timeout(again, changed)
                .await
                .map(Result::unwrap)
            {
                return grant;
            }
        }
    })
    .await
}

/// `req` waiting in the queue through `store` (the only waiter), its grant to come.
async fn queued(store: &Arc<dyn Store>, req: &AcquireRequest) -> JoinHandle<Grant> {
    let waiting = tokio::spawn({
        let (store, req) = (store.clone(), req.clone());
        async move { granted(&*store, &req).await }
    });
    eventually("the waiter to queue", || async {
        let state = store.describe(&req.name).await.unwrap();
        state.waiters.len() == 1
    })
    .await;
    waiting
}

/// The value `describe` shows for the first holder of `name`.
async fn shown_value(store: &dyn Store, name: &str) -> Option<String> {
    let state = store.describe(&LockName::new(name).unwrap()).await.unwrap();
    state.holders.first().and_then(|h| h.value.clone())
}

/// A plain lock's key is written as before: no value field. A hold's value is shown by
/// `describe`, `list` and a busy try's holder; a re-entry keeps the value its owner's
/// hold published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_shows_its_value_and_a_re_entry_keeps_it() {
    let (server, locks) = start().await;
    let store = &**locks.store();
    let plain = candidate("plain", "me", None);
    granted(store, &plain).await;
    let entry = server.etcdctl(&["get", "leasehold", "leasehold\u{1}", "--print-value-only"]);
    assert!(entry.contains("\"owner\":\"me\""), "{entry}");
    assert!(!entry.contains("value"), "a plain lock's entry: {entry}");
    assert_eq!(shown_value(store, "plain").await, None);

    let first = candidate("v", "me", Some("10.0.0.1:80"));
    let grant = granted(store, &first).await;
    assert_eq!(
        shown_value(store, "v").await.as_deref(),
        Some("10.0.0.1:80")
    );
    let again = granted(store, &candidate("v", "me", Some("elsewhere"))).await;
    assert_eq!((again.token, again.holds), (grant.token, 2));
    let state = locks.describe("v").await.unwrap();
    assert_eq!(state.holders[0].holds, 2);
    assert_eq!(
        state.holders[0].value.as_deref(),
        Some("10.0.0.1:80"),
        "a re-entry keeps the holder's value"
    );

    let other = EtcdStore::connect(&server.url()).await.unwrap();
    let try_once = AcquireRequest {
        enqueue: false,
        ..candidate("v", "you", Some("mine"))
    };
    match other.acquire(&try_once).await.unwrap() {
        Attempt::Busy(busy) => assert_eq!(
            busy.holder.and_then(|h| h.value).as_deref(),
            Some("10.0.0.1:80")
        ),
        Attempt::Granted(_) => panic!("the lock is held"),
    }
    let listed = other.list("v").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].holders[0].value.as_deref(), Some("10.0.0.1:80"));
}

/// A waiter's value is put with its key, and shown once the queue hands it the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_waiter_holds_with_its_value() {
    let (server, locks) = start().await;
    let store = locks.store().clone();
    let first = candidate("q", "a", Some("a:1"));
    granted(&*store, &first).await;
    let other: Arc<dyn Store> = Arc::new(EtcdStore::connect(&server.url()).await.unwrap());
    let second = candidate("q", "b", Some("b:2"));
    let waiting = queued(&other, &second).await;
    assert_eq!(shown_value(&*store, "q").await.as_deref(), Some("a:1"));
    assert_eq!(
        store.release(&first.lease()).await.unwrap(),
        Released::Released
    );
    let grant = within("the hand-over", waiting).await.unwrap();
    let state = locks.describe("q").await.unwrap();
    assert_eq!(state.holders[0].token, grant.token);
    assert_eq!(state.holders[0].value.as_deref(), Some("b:2"));
}

/// `proclaim` replaces the holder's value and leaves its token, through the key's own
/// hold, a re-entry, or another client that knows only the lease; a lease that waits,
/// was released or never held is `Lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proclaim_replaces_the_holders_value_and_keeps_its_token() {
    let (server, locks) = start().await;
    let store = locks.store().clone();
    let first = candidate("p", "me", Some("old"));
    let grant = granted(&*store, &first).await;
    let renewed = |value: &str| (Renewal::Renewed, Some(value.to_string()));
    assert_eq!(proclaimed(&store, &first, "new").await, renewed("new"));
    let reentry = candidate("p", "me", None);
    granted(&*store, &reentry).await;
    let by_reentry = proclaimed(&store, &reentry, "by the re-entry").await;
    assert_eq!(by_reentry, renewed("by the re-entry"));
    let other: Arc<dyn Store> = Arc::new(EtcdStore::connect(&server.url()).await.unwrap());
    let from_afar = proclaimed(&other, &first, "from afar").await;
    assert_eq!(from_afar, renewed("from afar"));

    // A waiter does not hold: neither its own client nor another may proclaim with it.
    let waiter = candidate("p", "w", Some("w"));
    let waiting = queued(&other, &waiter).await;
    let lost = (Renewal::Lost, Some("from afar".to_string()));
    assert_eq!(proclaimed(&other, &waiter, "x").await, lost);
    assert_eq!(proclaimed(&store, &waiter, "x").await, lost);
    let never = candidate("p", "me", None);
    assert_eq!(proclaimed(&store, &never, "x").await, lost);
    let state = locks.describe("p").await.unwrap();
    assert_eq!(state.holders[0].token, grant.token);

    // Releases find the key they hold, rewritten or not.
    for hold in [&reentry, &first] {
        let released = store.release(&hold.lease()).await.unwrap();
        assert_eq!(released, Released::Released);
    }
    let after = proclaimed(&store, &first, "x").await;
    assert_eq!(after.0, Renewal::Lost, "proclaimed after its release");
    within("the waiter to hold", waiting).await.unwrap();
    assert_eq!(shown_value(&*store, "p").await.as_deref(), Some("w"));
}

/// `value` proclaimed through `req`'s lease on `store`: the answer, and the value then
/// shown.
async fn proclaimed(
    store: &Arc<dyn Store>,
    req: &AcquireRequest,
    value: &str,
) -> (Renewal, Option<String>) {
    let renewal = store.proclaim(&req.lease(), value).await.unwrap();
    (renewal, shown_value(&**store, req.name.as_str()).await)
}

/// A watch of `name` from what `store` describes now, running.
async fn watching(store: &Arc<dyn Store>, name: &LockName) -> JoinHandle<leasehold::Result<()>> {
    let seen = store.describe(name).await.unwrap();
    let (store, name) = (store.clone(), name.clone());
    tokio::spawn(async move { store.watch(&name, &seen).await })
}

/// The watch has not resolved: nothing it waits for has happened yet.
async fn still_watching(watch: &mut JoinHandle<leasehold::Result<()>>, before: &str) {
    let early = tokio::time::timeout(Duration::from_millis(300), watch).await;
    assert!(early.is_err(), "the watch resolved before {before}");
}

/// `watch` wakes at a grant, a proclamation, a release (a hand-over) and a force-release
/// made through another client, and not at a waiter joining.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_wakes_when_another_client_changes_the_holders() {
    let (server, locks) = start().await;
    let watcher = locks.store().clone();
    let other: Arc<dyn Store> = Arc::new(EtcdStore::connect(&server.url()).await.unwrap());
    let name = LockName::new("w").unwrap();
    let woken = |watch: JoinHandle<leasehold::Result<()>>| async move {
        within("the watch to wake", watch).await.unwrap().unwrap()
    };

    let mut watch = watching(&watcher, &name).await;
    still_watching(&mut watch, "the grant").await;
    let first = candidate("w", "a", Some("a"));
    granted(&*other, &first).await;
    woken(watch).await;

    let mut watch = watching(&watcher, &name).await;
    still_watching(&mut watch, "the waiter joined").await;
    let second = candidate("w", "b", Some("b"));
    let waiting = queued(&other, &second).await;
    still_watching(&mut watch, "the proclamation (a waiter joined)").await;
    let proclaimed = other.proclaim(&first.lease(), "a:2").await.unwrap();
    assert_eq!(proclaimed, Renewal::Renewed);
    woken(watch).await;

    let mut watch = watching(&watcher, &name).await;
    still_watching(&mut watch, "the release").await;
    let released = other.release(&first.lease()).await.unwrap();
    assert_eq!(released, Released::Released);
    woken(watch).await;
    within("the hand-over", waiting).await.unwrap();

    let mut watch = watching(&watcher, &name).await;
    still_watching(&mut watch, "the force-release").await;
    assert!(other.force_release(&name).await.unwrap());
    woken(watch).await;
}

/// A watch whose etcd went away fails with the store's error rather than wait on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_fails_once_etcd_is_gone() {
    let (mut server, locks) = start().await;
    let name = LockName::new("gone").unwrap();
    let mut watch = watching(locks.store(), &name).await;
    still_watching(&mut watch, "etcd went away").await;
    tokio::task::block_in_place(|| server.kill());
    match within("the watch to fail", watch).await.unwrap() {
        Err(Error::Unavailable { .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// The Txn requests etcd has answered, from its own counters (`/metrics`).
fn txn_requests(server: &EtcdServer) -> u64 {
    use std::io::{Read, Write};
    let mut http = std::net::TcpStream::connect(server.endpoint()).expect("etcd's client port");
    http.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut metrics = String::new();
    http.read_to_string(&mut metrics).unwrap();
    (metrics.lines())
        .filter(|l| {
            l.starts_with("grpc_server_handled_total{") && l.contains("grpc_method=\"Txn\"")
        })
        .map(|l| {
            l.rsplit(' ')
                .next()
                .unwrap()
                .parse::<u64>()
                .expect("a count")
        })
        .sum()
}

/// The Txns of one client for different locks share requests: twenty-four tasks, each
/// taking and releasing a lock of its own (a Txn each), send fewer Txn requests than
/// Txns. And sharing changes nothing a lock promises: sixteen locks, three tasks each
/// (fair and non-fair), one holder at a time per lock, each with a higher token than
/// every earlier holder of that lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn txns_of_different_locks_share_requests_and_each_lock_keeps_its_promises() {
    let (server, locks) = start().await;
    let before = txn_requests(&server);
    let cycles: usize = 10;
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let lock = locks.mutex(format!("own-{i}")).unwrap();
            tokio::spawn(async move {
                for _ in 0..cycles {
                    let guard = lock
                        .try_lock()
                        .await
                        .unwrap()
                        .expect("nobody else takes it");
                    let _ = guard.release().await.unwrap();
                }
            })
        })
        .collect();
    join_all("the tasks with a lock each", tasks).await;
    let (txns, requests) = (24 * cycles as u64 * 2, txn_requests(&server) - before);
    assert!(requests < txns, "{txns} Txns took {requests} requests");

    let mut tasks = Vec::new();
    for i in 0..16 {
        let lock = locks.mutex(format!("shared-{i}")).unwrap();
        tasks.extend(taking_turns(&lock.with_fair(i % 2 == 0), 3, cycles));
    }
    join_all("the tasks sharing locks", tasks).await;
}

/// `lock_many` returns no guard that is lost already: a permit taken first and lost
/// while etcd stalled (its renewals failed past the TTL) as the second was waited for is
/// taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_many_returns_no_permit_lost_while_it_waited_for_the_others() {
    let (server, locks) = start().await;
    let ttl = Duration::from_secs(2);
    let other = Leasehold::new(EtcdStore::connect(&server.url()).await.unwrap());
    let sem = |locks: &Leasehold| locks.semaphore("permits", 2).unwrap().with_ttl(ttl);
    let held = sem(&other)
        .try_lock()
        .await
        .unwrap()
        .expect("a free permit");
    let many = sem(&locks);
    let waiting = tokio::spawn(async move { many.lock_many(2).await });
    eventually("the first permit taken", || async {
        locks.describe("permits").await.unwrap().holders.len() == 2
    })
    .await;
    server.pause();
    eventually("the permits' renewals failing past the TTL", || async {
        held.check().is_err()
    })
    .await;
    server.resume();
    let guards = within("lock_many", waiting).await.unwrap().unwrap();
    assert_eq!(guards.len(), 2);
    for guard in &guards {
        assert!(guard.check().is_ok(), "{:?}", guard.check());
    }
    drop(held);
}

/// An address that answers HTTP/2 but not gRPC (a proxy, another server: here every
/// request gets 404) is passed over like a member that is down: the calls go to the
/// next member, whichever place it has in the URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_is_not_etcd_is_passed_over_for_the_next() {
    let server = tokio::task::spawn_blocking(EtcdServer::start)
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let not_etcd = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((_, mut respond))) = conn.accept().await {
                    let response = http::Response::builder().status(404).body(()).unwrap();
                    let _ = respond.send_response(response, true);
                }
            });
        }
    });
    let real = server.url().trim_start_matches("etcd://").to_string();
    for members in [format!("{not_etcd},{real}"), format!("{real},{not_etcd}")] {
        let store = EtcdStore::connect(&format!("etcd://{members}")).await;
        let locks = Leasehold::new(store.unwrap_or_else(|e| panic!("{members}: {e}")));
        let guard = locks.mutex("k").unwrap().try_lock().await.unwrap();
        let _ = guard.expect("free").release().await.unwrap();
    }
}
