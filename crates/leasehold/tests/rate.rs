//! Rate limiters against the real stores: the window bound under contention from
//! several clients, waits served in turn, bad input; on Redis, expiry of idle limiters
//! and a server restart; on etcd, a clear refusal.

use std::sync::Arc;
use std::time::Duration;

use leasehold::conformance::rate::{
    acquire_waits_for_its_turn, bad_limiter_input_is_refused, bound_holds_under_contention,
    burst_from_idle_is_exact,
};
use leasehold::conformance::{opener, unique};
use leasehold::{Leasehold, MemoryStore, Rate, Store};

const RUN: Duration = Duration::from_secs(3);

/// Clients of one memory store (every client of a run shares it).
fn memory() -> leasehold::conformance::Open {
    let store = MemoryStore::new();
    opener(move || {
        let store = store.clone();
        async move { Ok(store) }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_keeps_the_window_bound_under_contention() {
    bound_holds_under_contention(memory(), 3, 4, RUN).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_serves_waits_in_turn() {
    acquire_waits_for_its_turn(memory()).await;
}

#[tokio::test]
async fn memory_lets_exactly_the_burst_through_from_idle() {
    burst_from_idle_is_exact(memory()).await;
}

#[tokio::test]
async fn bad_input_is_refused() {
    bad_limiter_input_is_refused(Arc::new(MemoryStore::new())).await;
}

#[cfg(feature = "local")]
mod local {
    use super::*;
    use leasehold::LocalStore;
    use leasehold_testkit::TempDir;

    fn open(dir: &TempDir) -> leasehold::conformance::Open {
        let dir = dir.path().to_path_buf();
        // A store opened anew per client: its own open files, as another process has.
        opener(move || {
            let dir = dir.clone();
            async move { LocalStore::open(&dir) }
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn local_keeps_the_window_bound_under_contention() {
        let dir = TempDir::new("rate-local");
        bound_holds_under_contention(open(&dir), 3, 3, RUN).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn local_serves_waits_in_turn() {
        let dir = TempDir::new("rate-local-turns");
        acquire_waits_for_its_turn(open(&dir)).await;
    }

    #[tokio::test]
    async fn local_lets_exactly_the_burst_through_from_idle() {
        let dir = TempDir::new("rate-local-burst");
        burst_from_idle_is_exact(open(&dir)).await;
    }

    #[tokio::test]
    async fn a_limiter_and_a_lock_of_one_name_are_apart() {
        let dir = TempDir::new("rate-local-apart");
        let limits = Leasehold::new(LocalStore::open(dir.path()).unwrap());
        let guard = limits.mutex("shared").unwrap().lock().await.unwrap();
        let limiter = limits
            .rate_limiter("shared", Rate::per_second(1), 1)
            .unwrap();
        assert!(limiter.try_acquire(1).await.unwrap().allowed);
        assert!(!limiter.try_acquire(1).await.unwrap().allowed);
        assert_eq!(limits.describe("shared").await.unwrap().holders.len(), 1);
        let _ = guard.release().await.unwrap();
    }
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use leasehold::conformance::{eventually, within};
    use leasehold::{Error, RedisStore};
    use leasehold_testkit::{RedisCluster, RedisServer};

    fn open(url: String) -> leasehold::conformance::Open {
        opener(move || {
            let url = url.clone();
            async move { RedisStore::connect(&url).await }
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_keeps_the_window_bound_under_contention() {
        let server = RedisServer::start();
        bound_holds_under_contention(open(server.url()), 3, 4, RUN).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_serves_waits_in_turn() {
        let server = RedisServer::start();
        acquire_waits_for_its_turn(open(server.url())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_keeps_the_window_bound_under_contention() {
        let cluster = tokio::task::spawn_blocking(RedisCluster::start)
            .await
            .unwrap();
        bound_holds_under_contention(open(cluster.url()), 3, 4, RUN).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_serves_waits_in_turn() {
        let cluster = tokio::task::spawn_blocking(RedisCluster::start)
            .await
            .unwrap();
        acquire_waits_for_its_turn(open(cluster.url())).await;
    }

    #[tokio::test]
    async fn redis_lets_exactly_the_burst_through_from_idle() {
        let server = RedisServer::start();
        burst_from_idle_is_exact(open(server.url())).await;
    }

    #[tokio::test]
    async fn redis_cluster_lets_exactly_the_burst_through_from_idle() {
        let cluster = tokio::task::spawn_blocking(RedisCluster::start)
            .await
            .unwrap();
        burst_from_idle_is_exact(open(cluster.url())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_limiter_key_expires_when_back_to_full_burst() {
        let server = RedisServer::start();
        let limits = Leasehold::new(RedisStore::connect(&server.url()).await.unwrap());
        let name = unique("rate-expiry");
        let key = format!("lh:rate:{{{name}}}");
        let limiter = limits
            .rate_limiter(name.as_str(), Rate::per_second(10), 5)
            .unwrap();
        let d = limiter.try_acquire(3).await.unwrap();
        assert!(d.allowed && d.remaining == 2);
        assert_eq!(d.reset_after, Duration::from_millis(300));
        let pttl: i64 = server.cli(&["PTTL", &key]).trim().parse().unwrap();
        assert!((1..=300).contains(&pttl), "PTTL {pttl}");
        eventually("the idle limiter's key expires", || async {
            server.cli(&["EXISTS", &key]).trim() == "0"
        })
        .await;
        // Gone means full again.
        assert_eq!(limiter.try_acquire(1).await.unwrap().remaining, 4);
        // A refusal writes nothing: the key keeps its expiry.
        assert!(limiter.try_acquire(4).await.unwrap().allowed);
        let before: i64 = server.cli(&["PTTL", &key]).trim().parse().unwrap();
        assert!(!limiter.try_acquire(1).await.unwrap().allowed);
        let after: i64 = server.cli(&["PTTL", &key]).trim().parse().unwrap();
        assert!(
            after <= before,
            "a refusal extended the key: {before} -> {after}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_limiter_and_a_lock_of_one_name_do_not_collide() {
        let server = RedisServer::start();
        let limits = Leasehold::new(RedisStore::connect(&server.url()).await.unwrap());
        let guard = limits.mutex("shared").unwrap().lock().await.unwrap();
        let limiter = limits
            .rate_limiter("shared", Rate::per_second(1), 1)
            .unwrap();
        assert!(limiter.try_acquire(1).await.unwrap().allowed);
        assert!(!limiter.try_acquire(1).await.unwrap().allowed);
        assert_eq!(limits.list("").await.unwrap().len(), 1);
        let _ = guard.release().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_restart_gives_an_error_or_a_fresh_limiter_never_a_panic() {
        let mut server = RedisServer::start();
        let limits = Leasehold::new(RedisStore::connect(&server.url()).await.unwrap());
        let limiter = limits
            .rate_limiter(unique("rate-restart").as_str(), Rate::per_minute(1), 2)
            .unwrap();
        assert!(limiter.try_acquire(2).await.unwrap().allowed);
        server.kill();
        match limiter.try_acquire(1).await {
            Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
            other => panic!("expected unavailable while the server is down, got {other:?}"),
        }
        server.restart();
        // The server kept nothing: the limiter starts again at full burst.
        within("a decision after the restart", async {
            loop {
                match limiter.try_acquire(2).await {
                    Ok(d) => break assert!(d.allowed),
                    Err(e) => assert!(e.is_retryable(), "{e}"),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
    }

    /// Tasks asking at once share round trips: fewer script calls than decisions. Each
    /// decision still stands alone: the burst of each of four limiters is let through
    /// exactly, and a key that is not a limiter's spoils only its own decisions.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn decisions_asked_at_once_share_round_trips_and_stand_alone() {
        let server = RedisServer::start();
        server.cli(&["SET", "lh:rate:{bad}", "hello"]);
        let limits = Leasehold::new(RedisStore::connect(&server.url()).await.unwrap());
        server.cli(&["CONFIG", "RESETSTAT"]);
        let (burst, tasks, rounds) = (50, 16, 25);
        let names = ["a", "b", "c", "d"];
        let mut handles = Vec::new();
        for task in 0..tasks {
            let name = if task == 0 { "bad" } else { names[task % 4] };
            let limiter = limits
                .rate_limiter(name, Rate::new(1, Duration::from_secs(3600)), burst)
                .unwrap();
            handles.push(tokio::spawn(async move {
                let mut allowed = 0;
                for _ in 0..rounds {
                    match limiter.try_acquire(1).await {
                        Ok(d) => allowed += d.allowed as u64,
                        Err(e) => {
                            assert!(
                                matches!(e, Error::Corrupt { .. }) && name == "bad",
                                "{name}: {e}"
                            );
                        }
                    }
                }
                (name, allowed)
            }));
        }
        let mut by_name = std::collections::HashMap::new();
        for h in handles {
            let (name, allowed) = within("every task", h).await.unwrap();
            *by_name.entry(name).or_insert(0) += allowed;
        }
        for name in names {
            assert_eq!(by_name[name], burst, "{name}: not exactly its burst");
        }
        let stats = server.cli(&["INFO", "commandstats"]);
        let calls: u64 = (stats.lines())
            .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no EVALSHA in {stats}"));
        let decisions = (tasks * rounds) as u64;
        assert!(
            calls < decisions,
            "{calls} script calls for {decisions} decisions"
        );
    }

    /// A paused server: every decision fails as unavailable within the request timeout
    /// of the call it rode in (sent once more after a timeout), including those asked
    /// while an earlier call was waiting for the server, which fail with it rather than
    /// wait for a call of their own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn decisions_asked_of_a_paused_server_fail_within_the_request_timeout() {
        let server = RedisServer::start();
        let timeout = Duration::from_secs(1);
        let limits = Leasehold::builder(&server.url())
            .request_timeout(timeout)
            .build()
            .await
            .unwrap();
        let limiter =
            (limits.rate_limiter(unique("rate-paused").as_str(), Rate::per_second(10), 5)).unwrap();
        assert!(limiter.try_acquire(1).await.unwrap().allowed);
        server.pause();
        let mut handles = Vec::new();
        for _ in 0..6 {
            let limiter = limiter.clone();
            handles.push(tokio::spawn(async move {
                let asked = std::time::Instant::now();
                let answer = limiter.try_acquire(1).await;
                (answer, asked.elapsed())
            }));
            // Later askers come while the first call waits for the server.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for h in handles {
            let (answer, took) = within("a decision of a paused server", h).await.unwrap();
            assert!(
                matches!(answer, Err(Error::Unavailable { .. })),
                "{answer:?}"
            );
            // A call and its resend: 2 s; one more call of their own would be 4 s.
            assert!(took < 2 * timeout + Duration::from_secs(1), "{took:?}");
        }
        server.resume();
    }

    #[tokio::test]
    async fn a_key_that_is_not_a_limiter_is_reported_as_unreadable() {
        let server = RedisServer::start();
        let limits = Leasehold::new(RedisStore::connect(&server.url()).await.unwrap());
        server.cli(&["SET", "lh:rate:{odd}", "hello"]);
        server.cli(&["HSET", "lh:rate:{odder}", "a", "b"]);
        // Numbers Lua reads that are not a time in µs.
        server.cli(&["SET", "lh:rate:{nan}", "nan"]);
        server.cli(&["SET", "lh:rate:{huge}", "1e300"]);
        server.cli(&["SET", "lh:rate:{half}", "0.5"]);
        for name in ["odd", "odder", "nan", "huge", "half"] {
            let limiter = limits.rate_limiter(name, Rate::per_second(1), 1).unwrap();
            let err = limiter.try_acquire(1).await.unwrap_err();
            assert!(matches!(err, Error::Corrupt { .. }), "{err}");
            assert!(err.to_string().contains("delete it"), "{err}");
        }
    }
}

#[cfg(feature = "etcd")]
#[tokio::test]
async fn etcd_refuses_rate_limiters_as_unsupported() {
    let server = tokio::task::spawn_blocking(leasehold_testkit::EtcdServer::start)
        .await
        .unwrap();
    let store = leasehold::EtcdStore::connect(&server.url()).await.unwrap();
    let limits = Leasehold::from_store(Arc::new(store) as Arc<dyn Store>);
    let limiter = limits.rate_limiter("api", Rate::per_second(1), 1).unwrap();
    let err = limiter.try_acquire(1).await.unwrap_err();
    assert!(matches!(err, leasehold::Error::Unsupported { .. }), "{err}");
    assert!(!err.is_retryable());
    assert!(
        err.to_string().contains("does not offer rate limiters"),
        "{err}"
    );
}

/// A limiter's name is given as a lock's is: `&str`, `String`, `&String`, a `LockName`
/// or a reference to one.
#[tokio::test]
async fn a_limiter_takes_every_form_of_name_a_lock_takes() {
    let limits = Leasehold::new(MemoryStore::new());
    let rate = Rate::per_second(10);
    let owned = String::from("by-string");
    let name = leasehold::LockName::new("by-name").unwrap();
    limits.rate_limiter("by-str", rate, 1).unwrap();
    limits.rate_limiter(owned.clone(), rate, 1).unwrap();
    limits.rate_limiter(&owned, rate, 1).unwrap();
    limits.rate_limiter(&name, rate, 1).unwrap();
    let limiter = limits.rate_limiter(name, rate, 1).unwrap();
    assert_eq!(limiter.name().as_str(), "by-name");
}
