//! What elections need from the Redis store, against real servers (one, and a cluster):
//! a hold's value, kept and shown; `proclaim`; `watch`, woken by the scripts of another
//! client, and failing once the server is gone.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::time::Duration;

use leasehold::conformance::{eventually, within, PROMPT};
use leasehold::store::{AcquireRequest, Attempt, Grant, LeaseId, Renewal, Requester};
use leasehold::{LockKind, LockName, RedisStore, Released, Result, Store};
use leasehold_testkit::{RedisCluster, RedisServer};
use tokio::task::JoinHandle;

/// How long a watch must stay pending when nothing changed.
const QUIET: Duration = Duration::from_millis(300);

async fn store(url: &str) -> RedisStore {
    RedisStore::connect(url).await.unwrap()
}

fn name(text: &str) -> LockName {
    text.try_into().unwrap()
}

/// An exclusive request for `name` by `owner`, with `value`, queued if it must wait.
fn request(name: &str, owner: &str, fair: bool, value: Option<&str>) -> AcquireRequest {
    AcquireRequest {
        name: self::name(name),
        lease: LeaseId::random(),
        owner: owner.into(),
        kind: LockKind::Exclusive,
        ttl: Duration::from_secs(30),
        fair,
        enqueue: true,
        waited_since: None,
        requester: Arc::new(Requester {
            host: "test-host".into(),
            pid: 7,
        }),
        value: value.map(Arc::from),
    }
}

async fn granted(store: &RedisStore, req: &AcquireRequest) -> Grant {
    match store.acquire(req).await.unwrap() {
        Attempt::Granted(grant) => grant,
        Attempt::Busy(busy) => panic!("{} was not granted: {busy:?}", req.owner),
    }
}

/// Each holder's owner and value, as `describe` shows them.
async fn values(store: &RedisStore, lock: &str) -> Vec<(String, Option<String>)> {
    let state = store.describe(&name(lock)).await.unwrap();
    state
        .holders
        .into_iter()
        .map(|h| (h.owner, h.value))
        .collect()
}

fn shown(owner: &str, value: Option<&str>) -> Vec<(String, Option<String>)> {
    vec![(owner.to_string(), value.map(String::from))]
}

/// A value is shown with the hold granted directly, with the holder in a `Busy`, after
/// a re-entry (the holder's, not the re-entry's), and with a hold handed to a queued
/// fair waiter (the waiter's).
async fn a_value_goes_with_its_hold(url: &str) {
    let (leader, candidate) = (store(url).await, store(url).await);
    let first = request("elect", "leader", true, Some("10.0.0.1:80"));
    granted(&leader, &first).await;
    assert_eq!(
        values(&leader, "elect").await,
        shown("leader", Some("10.0.0.1:80"))
    );

    let next = request("elect", "candidate", true, Some("10.0.0.2:80"));
    let Attempt::Busy(busy) = candidate.acquire(&next).await.unwrap() else {
        panic!("granted past the leader");
    };
    assert_eq!(busy.position, Some(1));
    let holder = busy.holder.expect("the leader in the way");
    assert_eq!(holder.value.as_deref(), Some("10.0.0.1:80"));

    let again = request("elect", "leader", true, Some("10.0.0.9:80"));
    assert_eq!(granted(&leader, &again).await.holds, 2);
    assert_eq!(
        values(&leader, "elect").await,
        shown("leader", Some("10.0.0.1:80"))
    );

    assert_eq!(
        leader.release(&again.lease()).await.unwrap(),
        Released::Released
    );
    assert_eq!(
        leader.release(&first.lease()).await.unwrap(),
        Released::Released
    );
    // The release hands the lock to the fair head of the queue in the same step.
    let state = leader.describe(&name("elect")).await.unwrap();
    assert_eq!(
        values(&leader, "elect").await,
        shown("candidate", Some("10.0.0.2:80"))
    );
    assert!(state.last_token > holder.token);

    // A plain lock has no value, and an empty value is a value.
    let plain = request("plain", "p", false, None);
    granted(&leader, &plain).await;
    assert_eq!(values(&leader, "plain").await, shown("p", None));
    let empty = request("empty", "e", false, Some(""));
    granted(&leader, &empty).await;
    assert_eq!(values(&leader, "empty").await, shown("e", Some("")));
}

/// `proclaim` replaces the holder's value (its token and lease stay), on a hold with a
/// value or without one; a hold released, or never held, is `Lost`.
async fn proclaim_replaces_the_holder_s_value(url: &str) {
    let (leader, other) = (store(url).await, store(url).await);
    let first = request("proclaimed", "leader", false, Some("old"));
    let grant = granted(&leader, &first).await;
    let lease = first.lease();
    assert_eq!(
        leader.proclaim(&lease, "new").await.unwrap(),
        Renewal::Renewed
    );
    let state = other.describe(&lease.name).await.unwrap();
    assert_eq!(state.holders[0].value.as_deref(), Some("new"));
    assert_eq!(state.holders[0].token, grant.token);
    assert!(state.holders[0].lease_left > Duration::from_secs(20));

    let never = request("proclaimed", "stranger", false, None);
    assert_eq!(
        other.proclaim(&never.lease(), "mine").await.unwrap(),
        Renewal::Lost
    );
    assert_eq!(
        values(&other, "proclaimed").await,
        shown("leader", Some("new"))
    );

    let _ = leader.release(&lease).await.unwrap();
    assert_eq!(
        leader.proclaim(&lease, "late").await.unwrap(),
        Renewal::Lost
    );
    assert!(values(&other, "proclaimed").await.is_empty());

    // A hold taken without a value (on the hold key alone) can proclaim one.
    let plain = request("plain-proclaimed", "p", false, None);
    granted(&leader, &plain).await;
    assert_eq!(
        leader.proclaim(&plain.lease(), "now").await.unwrap(),
        Renewal::Renewed
    );
    assert_eq!(
        values(&other, "plain-proclaimed").await,
        shown("p", Some("now"))
    );
}

/// Awaits a watch that a change should have woken: within [`PROMPT`], well before its
/// refresh (every 5 s) would have seen the change without being told.
async fn woken(what: &str, watch: JoinHandle<Result<()>>) {
    match tokio::time::timeout(PROMPT, watch).await {
        Ok(outcome) => outcome.unwrap().unwrap(),
        Err(_) => panic!("the watch was not woken by {what} within {PROMPT:?}"),
    }
}

/// A watch of `lock` from `store`, from a fresh look; checked not to resolve while nothing
/// changes.
async fn watching(store: &RedisStore, lock: &str) -> JoinHandle<Result<()>> {
    let seen = store.describe(&name(lock)).await.unwrap();
    let (store, lock) = (store.clone(), name(lock));
    let mut watch = tokio::spawn(async move { store.watch(&lock, &seen).await });
    let early = tokio::time::timeout(QUIET, &mut watch).await;
    assert!(early.is_err(), "resolved with nothing changed: {early:?}");
    watch
}

/// Each change of the holders made by another client wakes a watch: a grant, a proclaim,
/// a release, a force-release. A renewal does not.
async fn watch_is_woken_by_each_change_of_the_holders(url: &str) {
    let (watcher, actor) = (store(url).await, store(url).await);
    let lock = "watched";

    let watch = watching(&watcher, lock).await;
    let req = request(lock, "actor", false, Some("a"));
    granted(&actor, &req).await;
    woken("the grant", watch).await;

    let watch = watching(&watcher, lock).await;
    assert_eq!(
        actor
            .renew(&req.lease(), Duration::from_secs(30))
            .await
            .unwrap(),
        Renewal::Renewed
    );
    let mut watch = watch;
    let renewed = tokio::time::timeout(QUIET, &mut watch).await;
    assert!(renewed.is_err(), "a renewal woke the watch: {renewed:?}");
    assert_eq!(
        actor.proclaim(&req.lease(), "b").await.unwrap(),
        Renewal::Renewed
    );
    woken("the proclamation", watch).await;

    let watch = watching(&watcher, lock).await;
    let _ = actor.release(&req.lease()).await.unwrap();
    woken("the release", watch).await;

    let req = request(lock, "actor", false, None);
    granted(&actor, &req).await;
    let watch = watching(&watcher, lock).await;
    assert!(actor.force_release(&name(lock)).await.unwrap());
    woken("the force-release", watch).await;

    // A release by the watcher's own client: its message comes back in the reply.
    let req = request(lock, "watcher", false, None);
    granted(&watcher, &req).await;
    let watch = watching(&watcher, lock).await;
    let _ = watcher.release(&req.lease()).await.unwrap();
    woken("its own client's release", watch).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_goes_with_its_hold_on_one_server() {
    let server = RedisServer::start();
    a_value_goes_with_its_hold(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proclaim_replaces_the_holder_s_value_on_one_server() {
    let server = RedisServer::start();
    proclaim_replaces_the_holder_s_value(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_is_woken_by_each_change_of_the_holders_on_one_server() {
    let server = RedisServer::start();
    watch_is_woken_by_each_change_of_the_holders(&server.url()).await;
}

/// The same three on a Redis Cluster (one cluster: each case has its own names and
/// clients).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_proclaim_and_watch_work_on_a_cluster() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap();
    let url = cluster.url();
    a_value_goes_with_its_hold(&url).await;
    proclaim_replaces_the_holder_s_value(&url).await;
    watch_is_woken_by_each_change_of_the_holders(&url).await;
}

/// While watched, a lock lives in its record (so every call reaches the scripts that
/// tell the watcher); once the watch ends and the lock is free, nothing is left but the
/// token counter, and a plain hold is on the hold key alone again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_leaves_nothing_behind() {
    let server = RedisServer::start();
    let (watcher, actor) = (store(&server.url()).await, store(&server.url()).await);
    let keys = || {
        let mut keys: Vec<String> = (server.cli(&["--scan", "--pattern", "lh:{left}*"]).lines())
            .map(String::from)
            .collect();
        keys.sort();
        keys
    };
    let watch = watching(&watcher, "left").await;
    assert_eq!(keys(), ["lh:{left}", "lh:{left}:hold"]);
    let req = request("left", "actor", false, None);
    granted(&actor, &req).await;
    woken("the grant", watch).await;
    let _ = actor.release(&req.lease()).await.unwrap();
    eventually("the watcher's entry to go", || async {
        keys() == ["lh:{left}:token"]
    })
    .await;
    granted(&actor, &request("left", "actor", false, None)).await;
    assert_eq!(keys(), ["lh:{left}:hold", "lh:{left}:token"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_fails_rather_than_hangs_once_the_server_is_killed() {
    let mut server = RedisServer::start();
    let watcher = store(&server.url()).await;
    let watch = watching(&watcher, "killed").await;
    tokio::task::block_in_place(|| server.kill());
    let outcome = within("the watch to end", watch).await.unwrap();
    let error = outcome.expect_err("a watch of a server that is gone succeeded");
    assert!(error.is_retryable(), "{error}");
}

/// A change made while the watcher's subscription is cut is not missed: once its client
/// subscribes again, the watch looks again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_sees_a_change_made_while_its_subscription_was_cut() {
    let server = RedisServer::start();
    let (watcher, actor) = (store(&server.url()).await, store(&server.url()).await);
    let watch = watching(&watcher, "cut").await;
    let killed = server.cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    assert_eq!(killed.trim(), "2", "both clients' subscriptions cut");
    granted(&actor, &request("cut", "actor", false, Some("a"))).await;
    woken("a grant made while it was unsubscribed", watch).await;
}
