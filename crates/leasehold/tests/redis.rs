//! What only the Redis store promises, against a real redis-server: renewal across a
//! server restart, `lost` when the server stays away, wake-ups through one subscription.
#![cfg(feature = "redis")]

use std::time::Duration;

use leasehold::conformance::{eventually, renews_again_after_a_restart, within};
use leasehold::store::{AcquireRequest, Attempt, LeaseId, Requester};
use leasehold::{FencingToken, Leasehold, LockKind, LockState, RedisStore, Released, Store};
use leasehold_testkit::{DelayProxy, RedisCluster, RedisServer};
use tokio::time::Instant;

async fn locks(server: &RedisServer) -> Leasehold {
    Leasehold::new(RedisStore::connect(&server.url()).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_renews_again_after_a_server_restart_within_its_deadline() {
    let mut server = RedisServer::start_persistent();
    let locks = locks(&server).await;
    renews_again_after_a_restart(&locks, Duration::from_secs(3), || server.restart()).await;
}

/// A lock's token counter expires (48 hours after it was started or put back), so a
/// name used once leaves no key for ever, and a force-release of a name never used makes
/// none; tokens still rise once the counter is gone, for a lock handed to another task
/// of the process (a transfer) and for one taken anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_counters_expire_and_tokens_rise_after_they_are_gone() {
    let server = RedisServer::start();
    let locks = locks(&server).await;
    let lock = locks.mutex("k").unwrap();
    let first = lock.try_lock().await.unwrap().expect("free");
    let ttl: i64 = server
        .cli(&["PTTL", "lh:{k}:token"])
        .trim()
        .parse()
        .unwrap();
    assert!(ttl > 0, "the counter has no expiry: {ttl}");
    let waiter = {
        let lock = lock.clone();
        tokio::spawn(async move { lock.lock().await.unwrap() })
    };
    eventually("the task waiting in the process", || async {
        locks.describe("k").await.unwrap().waiters.len() == 1
    })
    .await;
    server.cli(&["DEL", "lh:{k}:token"]);
    let first_token = first.token();
    let _ = first.release().await.unwrap();
    let handed = within("the hand-over", waiter).await.unwrap();
    assert!(
        handed.token() > first_token,
        "{:?} after {first_token:?}",
        handed.token()
    );
    let handed_token = handed.token();
    let _ = handed.release().await.unwrap();
    server.cli(&["DEL", "lh:{k}:token"]);
    let anew = lock.try_lock().await.unwrap().expect("free");
    assert!(anew.token() > handed_token);
    let _ = anew.release().await.unwrap();

    assert!(!locks.force_release("never-used").await.unwrap());
    assert_eq!(server.cli(&["KEYS", "lh:{never-used}*"]).trim(), "");
}

/// A lone caller's calls go on a connection of their own (the lane: see the store's
/// docs), which authenticates and selects the URL's database like the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_callers_calls_take_a_connection_of_their_own_on_the_urls_database() {
    let server = RedisServer::start_with(&["--save", "", "--requirepass", "lane-secret"]);
    let url = format!("redis://:lane-secret@127.0.0.1:{}/3", server.port());
    let locks = Leasehold::new(RedisStore::connect(&url).await.unwrap());
    let lock = locks.mutex("lane").unwrap();
    let cli = |args: &[&str]| {
        let auth = ["-a", "lane-secret", "--no-auth-warning"];
        server.cli(&[&auth[..], args].concat())
    };
    let last = std::sync::atomic::AtomicU64::new(0);
    eventually("a call on the lane", || async {
        let guard = lock.try_lock().await.unwrap().expect("free");
        let token = guard.token().get();
        assert!(
            token > last.swap(token, std::sync::atomic::Ordering::Relaxed),
            "tokens rise"
        );
        let _ = guard.release().await.unwrap();
        let clients = cli(&["CLIENT", "LIST"]);
        clients.lines().any(|l| {
            l.contains("name=leasehold-lane") && l.contains("db=3") && l.contains("cmd=evalsha")
        })
    })
    .await;
    assert_eq!(cli(&["-n", "3", "EXISTS", "lh:{lane}:token"]).trim(), "1");
    assert_eq!(cli(&["-n", "0", "EXISTS", "lh:{lane}:token"]).trim(), "0");
    // Calls at once take up to four lines of the lane, and share the multiplexed
    // connection beyond that: a busy lane makes no connection per call.
    let connections = || {
        let stats = cli(&["INFO", "stats"]);
        let field = stats
            .lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"));
        field.unwrap_or_default().trim().parse::<u64>().unwrap()
    };
    let before = connections();
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let lock = locks.mutex(format!("busy-{i}")).unwrap();
            tokio::spawn(async move {
                for _ in 0..50 {
                    let guard = lock.try_lock().await.unwrap().expect("free");
                    let _ = guard.release().await.unwrap();
                }
            })
        })
        .collect();
    leasehold::conformance::join_all("the busy tasks", tasks).await;
    let made = connections() - before;
    assert!(made <= 4, "{made} connections made for 800 calls");
}

/// A password changed while connections were dropped, then put back: redis-rs's
/// connection manager kept the reconnect the server refused and answered it to every
/// later call, for good. Tasks at once, so calls go on the multiplexed connection too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_serves_again_once_a_changed_password_is_put_back() {
    let server = RedisServer::start_with(&["--save", "", "--requirepass", "first"]);
    let url = format!("redis://:first@127.0.0.1:{}/2", server.port());
    let locks = Leasehold::new(RedisStore::connect(&url).await.unwrap());
    let cli = |password: &str, args: &[&str]| {
        let auth = ["-a", password, "--no-auth-warning"];
        server.cli(&[&auth[..], args].concat())
    };
    // Names of their own each round: a hold whose release failed stays until its TTL.
    let round = std::sync::atomic::AtomicU32::new(0);
    let cycles = || async {
        let r = round.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let lock = locks.mutex(format!("pw-{r}-{i}")).unwrap();
                tokio::spawn(async move {
                    for _ in 0..20 {
                        let guard = lock.try_lock().await?.expect("free");
                        let _ = guard.release().await?;
                    }
                    Ok::<_, leasehold::Error>(())
                })
            })
            .collect();
        let done = leasehold::conformance::join_all("the tasks", tasks).await;
        done.into_iter().collect::<Result<Vec<()>, _>>()
    };
    cycles().await.unwrap();
    cli("first", &["CONFIG", "SET", "requirepass", "second"]);
    cli("second", &["CLIENT", "KILL", "TYPE", "normal"]);
    eventually("the reconnect refused as a wrong password", || async {
        matches!(cycles().await, Err(leasehold::Error::Config { reason, .. }) if reason.contains("password"))
    })
    .await;
    cli("second", &["CONFIG", "SET", "requirepass", "first"]);
    eventually("every call served again", || async {
        cycles().await.is_ok()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_fires_lost_when_the_server_stays_away_past_its_deadline() {
    let server = RedisServer::start();
    let holder = locks(&server).await;
    let guard = holder
        .mutex("k")
        .unwrap()
        .with_ttl(Duration::from_millis(600))
        .lock()
        .await
        .unwrap();
    server.pause();
    within("lost while the server is paused", guard.lost()).await;
    assert!(guard.check().is_err());
    server.resume();
    let other = locks(&server).await;
    let next = within("the next holder", other.mutex("k").unwrap().lock())
        .await
        .unwrap();
    assert!(next.token() > guard.token());
    let _ = next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_waiters_of_one_client_share_its_single_subscription() {
    let server = RedisServer::start();
    let locks = locks(&server).await;
    let lock = locks.mutex("k").unwrap().with_fair(true);
    let holder = lock.try_lock().await.unwrap().unwrap();
    let mut waiters = Vec::new();
    for i in 0..16 {
        // Each its own owner, so each is queued in the store rather than in the process.
        let lock = lock.clone().with_owner(format!("waiter-{i}"));
        waiters.push(tokio::spawn(async move {
            lock.lock().await.unwrap().release().await.unwrap()
        }));
    }
    eventually("16 waiters queued in the store", || async {
        locks
            .store()
            .describe(&"k".try_into().unwrap())
            .await
            .unwrap()
            .waiters
            .len()
            == 16
    })
    .await;
    let clients = server.cli(&["CLIENT", "LIST"]);
    let subscribers = clients.lines().filter(|l| l.contains("sub=1")).count();
    assert_eq!(
        subscribers, 1,
        "one subscription connection per client:\n{clients}"
    );
    let _ = holder.release().await.unwrap();
    leasehold::conformance::join_all("every waiter", waiters).await;
}

/// A grant that reaches the client after its safe deadline (the server was stopped with
/// the request in its socket, longer than the TTL) is confirmed by a renewal before it is
/// returned, instead of being handed out already lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_arrives_after_its_deadline_is_confirmed_before_it_is_returned() {
    let server = RedisServer::start();
    let locks = locks(&server).await;
    let ttl = Duration::from_millis(300);
    let lock = locks.mutex("late").unwrap().with_ttl(ttl);
    // Scripts loaded and connections up, so the next attempt is one request.
    let _ = lock
        .try_lock()
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    server.pause();
    let attempt = tokio::spawn(async move { lock.try_lock().await });
    eventually(
        "the request to wait in the stopped server's socket",
        || async { leasehold_testkit::unread_bytes(server.port()) > 0 },
    )
    .await;
    // The fault itself: the server stays stopped for twice the TTL.
    tokio::time::sleep(ttl * 2).await;
    server.resume();
    let guard = within("the late grant", attempt)
        .await
        .unwrap()
        .unwrap()
        .expect("nobody else wanted the lock");
    assert!(guard.check().is_ok(), "returned already lost");
    assert!(guard.valid_until() > Instant::now());
    let _ = guard.release().await.unwrap();
}

/// The labels of waiters in the order they got the lock.
type Order = std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>;

/// Starts a waiter on `lock(client)` for each of `arrivals` (a label and its client) in
/// turn, each once `here` sees the one before waiting; each notes its label in `order`
/// when it gets the lock, then releases it.
async fn arrive_in_turn<const N: usize>(
    here: &Leasehold,
    arrivals: [(&'static str, &Leasehold); N],
    lock: impl Fn(&Leasehold) -> leasehold::Lock,
    order: &Order,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut waiters = Vec::new();
    for (i, (who, client)) in arrivals.into_iter().enumerate() {
        let (lock, order) = (lock(client), order.clone());
        waiters.push(tokio::spawn(async move {
            let guard = lock.lock().await.unwrap();
            order.lock().unwrap().push(who);
            let _ = guard.release().await.unwrap();
        }));
        eventually("the waiter to arrive", || async {
            here.describe("k").await.unwrap().waiters.len() == i + 1
        })
        .await;
        // Arrival is measured in milliseconds, on the server's clock for the store's
        // queue and on this process's for its own: keep the arrivals apart by more than
        // that precision and the time a request takes to reach the server.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    waiters
}

/// Tasks of one process wait for a fair lock in the process, behind the one of them that
/// the store queues; one handed the lock over still keeps the place its arrival gives it
/// among other processes' waiters: the order is the order of arrival.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_waiters_of_one_process_keep_their_arrival_order_among_others() {
    let server = RedisServer::start();
    let (here, elsewhere) = (locks(&server).await, locks(&server).await);
    let lock = |locks: &Leasehold| locks.mutex("k").unwrap().with_fair(true);
    let holder = lock(&here).try_lock().await.unwrap().unwrap();
    let order = Order::default();
    let arrivals = [
        ("here-1", &here),
        ("elsewhere", &elsewhere),
        ("here-2", &here),
    ];
    let waiters = arrive_in_turn(&here, arrivals, lock, &order).await;
    let queued = here
        .store()
        .describe(&"k".try_into().unwrap())
        .await
        .unwrap();
    assert_eq!(
        queued.waiters.len(),
        1,
        "only one of this process's tasks is in the store's queue"
    );
    let _ = holder.release().await.unwrap();
    leasehold::conformance::join_all("every waiter", waiters).await;
    assert_eq!(*order.lock().unwrap(), ["here-1", "elsewhere", "here-2"]);
}

/// A hand-over's request says how long its task waited in the process as it is sent. When
/// the server had to load the script first (after a restart or a `SCRIPT FLUSH`), the
/// request sent again says so anew: the time the first send spent in a stopped server is
/// not taken for time after its arrival, which would put it behind a later waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_sent_again_after_a_script_load_keeps_its_arrival_place() {
    let server = RedisServer::start();
    let (here, elsewhere) = (locks(&server).await, locks(&server).await);
    let lock = |locks: &Leasehold| locks.mutex("k").unwrap().with_fair(true);
    let holder = lock(&here).try_lock().await.unwrap().unwrap();
    let order = Order::default();
    let arrivals = [("here", &here), ("elsewhere", &elsewhere)];
    let waiters = arrive_in_turn(&here, arrivals, lock, &order).await;
    server.cli(&["SCRIPT", "FLUSH"]);
    server.pause();
    let release = tokio::spawn(async move { holder.release().await });
    eventually(
        "the hand-over to wait in the stopped server's socket",
        || async { leasehold_testkit::unread_bytes(server.port()) > 0 },
    )
    .await;
    // The fault itself: the server stays stopped for longer than the waiters' arrivals
    // are apart.
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.resume();
    let _ = within("the release", release).await.unwrap().unwrap();
    leasehold::conformance::join_all("every waiter", waiters).await;
    assert_eq!(*order.lock().unwrap(), ["here", "elsewhere"]);
}

/// A fair task at its process's gate that gets the turn because the task ahead of it gave
/// up (not because a release handed it the lock) still takes its place in Redis's queue
/// by when it arrived, ahead of another process's waiter that came after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_task_that_gets_its_gate_s_turn_from_a_cancelled_one_keeps_its_arrival_place() {
    let server = RedisServer::start();
    let (here, elsewhere) = (locks(&server).await, locks(&server).await);
    let lock = |locks: &Leasehold| locks.mutex("k").unwrap().with_fair(true);
    let holder = lock(&elsewhere)
        .with_owner("holder")
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    let order = Order::default();
    let arrivals = [
        ("here-1", &here),
        ("here-2", &here),
        ("elsewhere", &elsewhere),
    ];
    let mut waiters = arrive_in_turn(&here, arrivals, lock, &order).await;
    // here-1, in Redis's queue with its gate's turn, gives up: here-2 gets the turn.
    let first = waiters.remove(0);
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    eventually("here-2 to be in Redis's queue", || async {
        let queued = here.store().describe(&"k".try_into().unwrap()).await;
        queued.unwrap().waiters.len() == 2
    })
    .await;
    let _ = holder.release().await.unwrap();
    leasehold::conformance::join_all("every waiter", waiters).await;
    assert_eq!(*order.lock().unwrap(), ["here-2", "elsewhere"]);
}

/// The lock's keys, sorted.
fn keys_of(server: &RedisServer, name: &str) -> Vec<String> {
    let mut keys: Vec<String> = server
        .cli(&["--scan", "--pattern", &format!("lh:{{{name}}}*")])
        .lines()
        .map(String::from)
        .collect();
    keys.sort();
    keys
}

fn pttl(server: &RedisServer, key: &str) -> i64 {
    server.cli(&["PTTL", key]).trim().parse().unwrap()
}

/// The key layout through a lock's life (see the store's docs): a hold with nobody
/// waiting is the hold key alone, on Redis's own expiry; a waiter brings in the record,
/// which takes the token counter's place, and turns the hold key into a marker; both
/// expire long after anything in them could live (so the record of clients that all
/// died goes by itself), the marker last; once free, only the token counter stays.
/// Tokens keep rising through every form, and force-release reaches a hold in either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_moves_between_its_hold_key_and_its_record_and_tokens_keep_rising() {
    let server = RedisServer::start();
    let (here, elsewhere) = (locks(&server).await, locks(&server).await);
    let ttl = Duration::from_secs(30);
    let lock = here.mutex("k").unwrap().with_ttl(ttl);
    let (hold, token) = ("lh:{k}:hold", "lh:{k}:token");

    let first = lock.try_lock().await.unwrap().expect("a free lock");
    assert_eq!(keys_of(&server, "k"), [hold, token]);
    let left = pttl(&server, hold);
    assert!(left > 0 && left <= ttl.as_millis() as i64, "PTTL {left}");
    let state = here.describe("k").await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].token, first.token());
    assert_eq!(state.last_token, first.token());
    // Looking leaves it a hot hold.
    assert!(pttl(&server, hold) > 0);

    let other = elsewhere.mutex("k").unwrap().with_ttl(ttl);
    let waiter = tokio::spawn(async move { other.lock().await });
    eventually("the waiter to be queued", || async {
        here.describe("k").await.unwrap().waiters.len() == 1
    })
    .await;
    assert_eq!(keys_of(&server, "k"), ["lh:{k}", hold]);
    let (record_left, marker_left) = (pttl(&server, "lh:{k}"), pttl(&server, hold));
    let day = 24 * 3600 * 1000;
    assert!(
        record_left > day && record_left <= 2 * day,
        "record PTTL {record_left}"
    );
    assert!(marker_left > record_left, "marker PTTL {marker_left}");
    let state = here.describe("k").await.unwrap();
    assert_eq!(state.holders[0].token, first.token());
    assert!(state.holders[0].lease_left > Duration::ZERO);

    let first_token = first.token();
    let _ = first.release().await.unwrap();
    let second = within("the waiter's grant", waiter).await.unwrap().unwrap();
    let second_token = second.token();
    assert!(second_token > first_token);
    let _ = second.release().await.unwrap();
    assert_eq!(keys_of(&server, "k"), [token]);
    assert_eq!(here.describe("k").await.unwrap().last_token, second_token);

    let third = lock.try_lock().await.unwrap().expect("free again");
    assert!(third.token() > second_token);
    assert_eq!(keys_of(&server, "k"), [hold, token]);
    assert!(here.force_release("k").await.unwrap());
    within("lost after force-release", third.lost()).await;
    assert_eq!(keys_of(&server, "k"), [token]);
    let fourth = elsewhere.mutex("k").unwrap().try_lock().await.unwrap();
    let fourth = fourth.expect("forced free");
    assert!(fourth.token() > third.token());
    let _ = fourth.release().await.unwrap();
}

/// A record that ends while the lock is busy (by its expiry, after every client died;
/// or lost by Redis) takes its tokens with it: the next token is seeded from the
/// server's clock, above every token issued before, not counted on from the counter as
/// it was when the record began. The marker it leaves behind is cleared by the next
/// call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_lock_whose_record_ends_goes_on_with_higher_tokens() {
    let server = RedisServer::start();
    let ttl = Duration::from_secs(30);
    let mut last = FencingToken(0);
    for round in 0..3 {
        let (first, second, next) = (
            locks(&server).await,
            locks(&server).await,
            locks(&server).await,
        );
        let held = first.mutex("gone").unwrap().with_ttl(ttl);
        let held = held.try_lock().await.unwrap().expect("free");
        assert!(held.token() > last, "round {round}");
        let other = second.mutex("gone").unwrap().with_ttl(ttl);
        let waiting = tokio::spawn(async move { other.lock().await });
        eventually("the waiter to be queued", || async {
            first.describe("gone").await.unwrap().waiters.len() == 1
        })
        .await;
        // Handed over in the record: a token the counter has not seen.
        let _ = held.release().await.unwrap();
        let handed = within("the hand-over", waiting).await.unwrap().unwrap();
        assert!(keys_of(&server, "gone").contains(&"lh:{gone}".to_string()));
        // Its holder dies holding; then the record ends.
        last = handed.token();
        let _ = handed.leak();
        server.cli(&["DEL", "lh:{gone}"]);
        let lock = next.mutex("gone").unwrap().with_ttl(ttl);
        let after = lock
            .try_lock()
            .await
            .unwrap()
            .expect("nothing left in the lock");
        assert!(after.token() > last, "{:?} after {last:?}", after.token());
        last = after.token();
        let _ = after.release().await.unwrap();
        assert_eq!(keys_of(&server, "gone"), ["lh:{gone}:token"]);
    }
}

/// A lock written by the one-key layout (the record alone, no token counter) goes on
/// from its last token, and its holds still keep others out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_key_record_keeps_its_tokens_and_its_holds() {
    let server = RedisServer::start();
    let locks = locks(&server).await;
    let header = |token: u64, expires: u64| {
        format!(
            "{token:>20}\x1f{:>8}\x1f{:>13}\x1f{expires:>13}\x1f{:>8}\x1d",
            0, 0, 0
        )
    };
    server.cli(&["SET", "lh:{free}", &format!("{}\x1d", header(41, 0))]);
    let guard = locks.mutex("free").unwrap().try_lock().await.unwrap();
    assert_eq!(guard.expect("free").token().get(), 42);

    let now: u64 = server
        .cli(&["TIME"])
        .lines()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let expires = (now + 60) * 1000;
    let hold = format!(
        "\x1eold-lease\x1fold-owner\x1fexclusive\x1f0\x1f7\x1f0\x1fold-host\x1f1\x1f{expires}\x1f"
    );
    server.cli(&[
        "SET",
        "lh:{held}",
        &format!("{}{hold}\x1d", header(7, expires)),
    ]);
    let busy = locks.mutex("held").unwrap().try_lock().await.unwrap();
    assert!(busy.is_none(), "taken past a hold in the record");
    let state = locks.describe("held").await.unwrap();
    assert_eq!(state.holders[0].owner, "old-owner");
    assert!(locks.force_release("held").await.unwrap());
    let guard = locks.mutex("held").unwrap().try_lock().await.unwrap();
    assert_eq!(guard.expect("forced free").token().get(), 8);
}

/// A requester's text cannot forge a field: the record's separators are replaced by `?`
/// wherever the store keeps them (a hold on the hold key, a hold or a waiter in the
/// record), and every other field still reads back as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separators_in_a_requester_s_text_are_replaced_in_every_form() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let request = |owner: &str, pid: u32| AcquireRequest {
        name: "k".try_into().unwrap(),
        lease: LeaseId::random(),
        owner: owner.into(),
        kind: LockKind::Exclusive,
        ttl: Duration::from_secs(30),
        fair: false,
        enqueue: true,
        waited_since: None,
        requester: std::sync::Arc::new(Requester {
            host: "a\x1fb\x1ec\x1dd".into(),
            pid,
        }),
        value: None,
    };
    let (first, second) = (request("first", 7), request("second", 8));
    let Attempt::Granted(grant) = store.acquire(&first).await.unwrap() else {
        panic!("a free lock was not granted");
    };
    let holder = |state: &LockState| {
        let h = &state.holders[0];
        (h.owner.clone(), h.host.clone(), h.pid, h.token)
    };
    let on_hold_key = store.describe(&first.name).await.unwrap();
    assert_eq!(
        holder(&on_hold_key),
        ("first".into(), "a?b?c?d".into(), 7, grant.token)
    );

    // A waiter brings in the record, which takes the hold from the hold key.
    assert!(matches!(
        store.acquire(&second).await.unwrap(),
        Attempt::Busy(_)
    ));
    let in_record = store.describe(&first.name).await.unwrap();
    assert_eq!(holder(&in_record), holder(&on_hold_key));
    let waiter = &in_record.waiters[0];
    assert_eq!(
        (waiter.owner.as_str(), waiter.host.as_str(), waiter.pid),
        ("second", "a?b?c?d", 8)
    );

    assert_eq!(
        store.release(&first.lease()).await.unwrap(),
        Released::Released
    );
    let Attempt::Granted(next) = store.acquire(&second).await.unwrap() else {
        panic!("the waiter was not granted the released lock");
    };
    assert!(next.token > grant.token);
    let state = store.describe(&first.name).await.unwrap();
    assert_eq!(
        holder(&state),
        ("second".into(), "a?b?c?d".into(), 8, next.token)
    );
}

/// The last token of a mutex (the hot path) and of a semaphore (the record's path), after
/// three acquisitions each.
async fn tokens_so_far(locks: &Leasehold) -> [u64; 2] {
    let mut last = [0; 2];
    for _ in 0..3 {
        let mutex = locks
            .mutex("forgotten")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .unwrap();
        let sem = locks.semaphore("forgotten-sem", 2).unwrap();
        let permit = sem.try_lock().await.unwrap().unwrap();
        assert!(mutex.token().get() > last[0] && permit.token().get() > last[1]);
        last = [mutex.token().get(), permit.token().get()];
        let _ = mutex.release().await.unwrap();
        let _ = permit.release().await.unwrap();
    }
    last
}

/// Redis that forgets its data (a restart without persistence, a failover) does not give
/// out tokens again: a counter that is missing starts from the server's clock, above every
/// token issued before.
async fn tokens_rise_across_a_wipe(url: &str, wipe: impl FnOnce()) {
    let locks = Leasehold::new(RedisStore::connect(url).await.unwrap());
    let before = tokens_so_far(&locks).await;
    wipe();
    let _ = within("the store to answer again", async {
        // The client reconnects after a restart.
        loop {
            match locks.mutex("forgotten").unwrap().try_lock().await {
                Ok(guard) => break guard.unwrap().release().await.unwrap(),
                Err(error) => assert!(error.is_retryable(), "{error}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let after = tokens_so_far(&locks).await;
    assert!(
        after[0] > before[0] && after[1] > before[1],
        "tokens went back: {before:?} before the wipe, {after:?} after"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_rise_after_a_restart_that_lost_every_key() {
    let mut server = RedisServer::start();
    let url = server.url();
    tokens_rise_across_a_wipe(&url, || server.restart()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_rise_after_a_cluster_lost_every_key() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap();
    tokens_rise_across_a_wipe(&cluster.url(), || {
        for node in &cluster.nodes {
            node.cli(&["FLUSHALL"]);
        }
    })
    .await;
}

/// A cluster master marked failed holds locks nobody can read: `list` says the store is
/// unavailable rather than list the others' (it said nothing was held, with the lock
/// on the master that was down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_a_master_down_cannot_be_listed() {
    let mut cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap();
    let locks = Leasehold::new(RedisStore::connect(&cluster.url()).await.unwrap());
    let guard = locks.mutex("listed").unwrap().lock().await.unwrap();
    assert_eq!(locks.list("").await.unwrap().len(), 1);
    // The master with the lock's keys goes down.
    let holding = (cluster.nodes.iter())
        .position(|n| n.cli(&["DBSIZE"]).trim() != "0")
        .expect("a master with the lock's keys");
    let mut down = cluster.nodes.remove(holding);
    down.kill();
    let survivor = &cluster.nodes[0];
    eventually("the others to mark the master failed", || async {
        survivor.cli(&["CLUSTER", "NODES"]).contains("master,fail ")
    })
    .await;
    let listed = locks.list("").await;
    assert!(
        matches!(listed, Err(leasehold::Error::Unavailable { .. })),
        "{listed:?}"
    );
    drop(guard.leak());
}

/// Through a link that holds every reply back 1.5 s, no grant of a 1 s lease can arrive
/// in time, and a bounded wait of 6 s ends soon after 6 s, saying the store is too slow
/// (or did not answer) rather than that the lock is busy. (It took 16-22 s, and said busy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_wait_on_a_slow_link_ends_on_time_and_says_why() {
    let server = RedisServer::start();
    let proxy = DelayProxy::start(server.port(), Duration::from_millis(1500));
    let url = format!("redis://127.0.0.1:{}/0", proxy.port());
    // Connecting takes a few round trips, 1.5 s each: longer than the default bound.
    let connect = Leasehold::builder(&url).connect_timeout(Duration::from_secs(60));
    let locks = connect.build().await.unwrap();
    let lock = locks
        .mutex("slow")
        .unwrap()
        .with_ttl(Duration::from_secs(1));
    let wait = Duration::from_secs(6);
    let started = Instant::now();
    let outcome = lock.try_lock_for(wait).await;
    let took = started.elapsed();
    let error = outcome.expect_err("no grant of a 1 s lease arrives in time");
    // Whichever ended it, a grant that came too late or an attempt still unanswered at
    // the bound, the store's slowness is named, not a busy lock.
    let said = error.to_string();
    assert!(
        said.contains("too slow") || said.contains("no answer"),
        "{error}"
    );
    // The bound: the wait, one late answer (1 s) and an undo's patience (1 s), with room
    // for a loaded machine.
    assert!(took < wait + Duration::from_secs(4), "took {took:?}");
}

/// A Redis that restarts without its data has forgotten every hold: a holder watching
/// `lost()` learns it as soon as its client is subscribed again, not at its next renewal
/// (20 s away here), by when another client could long have been granted the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_learns_at_once_that_a_restarted_redis_forgot_its_lock() {
    let mut server = RedisServer::start();
    let locks = locks(&server).await;
    let lock = locks.mutex("forgotten").unwrap();
    let guard = lock
        .with_ttl(Duration::from_secs(60))
        .try_lock()
        .await
        .unwrap();
    let guard = std::sync::Arc::new(guard.unwrap());
    // Scripts run so far: the watcher's first look is one more.
    let before = scripts_run(&server);
    let watcher = tokio::spawn({
        let guard = guard.clone();
        async move { guard.lost().await }
    });
    eventually("the holder to watch its lease", || async {
        scripts_run(&server) > before
    })
    .await;
    let restart = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    });
    let learned = tokio::time::timeout(Duration::from_secs(15), watcher).await;
    assert!(learned.is_ok(), "the holder did not learn of the lost lock");
    assert!(guard.check().is_err());
    drop(restart.await.unwrap());
}

/// How many scripts the server has run (`EVALSHA` calls).
fn scripts_run(server: &RedisServer) -> u64 {
    let stats = server.cli(&["INFO", "commandstats"]);
    stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// How many commands the server has processed (`INFO stats`), the INFO asking included.
fn commands_processed(server: &RedisServer) -> u64 {
    let stats = server.cli(&["INFO", "stats"]);
    stats
        .lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("INFO stats has total_commands_processed")
}

/// `lost()` polled anew in a loop (as in `select!` beside a channel) watches the store
/// once per guard, not once per poll: after the first poll has set up the guard's one
/// watch, a million more polls send nothing to the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_lost_a_million_times_sends_nothing_to_the_store() {
    use futures_util::FutureExt;
    let server = RedisServer::start();
    let locks = locks(&server).await;
    let lock = locks.mutex("polled").unwrap();
    // A lease long enough that no renewal falls inside the polling, on a loaded machine.
    let guard = lock
        .with_ttl(Duration::from_secs(600))
        .try_lock()
        .await
        .unwrap()
        .unwrap();
    let before = scripts_run(&server);
    assert!(guard.lost().now_or_never().is_none(), "lost while held");
    eventually("the guard's one watch of its lease", || async {
        scripts_run(&server) > before
    })
    .await;
    let (scripts, commands) = (scripts_run(&server), commands_processed(&server));
    for _ in 0..1_000_000 {
        assert!(guard.lost().now_or_never().is_none(), "lost while held");
    }
    // Less one: the INFO that reads the count.
    let sent = commands_processed(&server) - commands - 1;
    assert_eq!(
        scripts_run(&server),
        scripts,
        "scripts run while lost() was polled"
    );
    assert_eq!(
        sent, 0,
        "commands sent while lost() was polled a million times"
    );
    let _ = guard.release().await.unwrap();
}

/// A non-fair waiter whose process died stays at the head of the queue until its waiter
/// lease ends. A live non-fair waiter behind it may pass it, and is woken at the release
/// (the release wakes the non-fair waiter whose place was renewed last too, not only the
/// head), rather than finding the lock free at its next look, seconds later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_non_fair_waiter_behind_a_dead_one_is_woken_at_the_release() {
    let server = RedisServer::start();
    let (a, b, c) = (
        locks(&server).await,
        locks(&server).await,
        locks(&server).await,
    );
    let name = "dead-head";
    let ttl = Duration::from_secs(60);
    let lock = |locks: &Leasehold| locks.mutex(name).unwrap().with_ttl(ttl);
    let holder = lock(&a).try_lock().await.unwrap().unwrap();
    let waiters = || async { a.describe(name).await.unwrap().waiters.len() };
    // w1 queues; then its process dies: its wait is never looked at again.
    let w1 = lock(&b);
    let mut dead = Box::pin(async move { w1.lock().await });
    tokio::select! {
        got = &mut dead => panic!("w1 got the lock: {got:?}"),
        _ = eventually("w1 to queue", || async { waiters().await == 1 }) => {}
    }
    std::mem::forget(dead);
    let w2 = tokio::spawn({
        let lock = lock(&c);
        async move { lock.lock().await }
    });
    eventually("w2 to queue behind w1", || async { waiters().await == 2 }).await;
    assert_eq!(holder.release().await.unwrap(), Released::Released);
    // Its own next look would come half a waiter lease (2.5 s) after it queued, which
    // was just before the release; woken, it is served in a round trip.
    let next = tokio::time::timeout(Duration::from_millis(1500), w2).await;
    let next = next.expect("w2 is woken at the release");
    let _ = next.unwrap().unwrap().release().await.unwrap();
}
