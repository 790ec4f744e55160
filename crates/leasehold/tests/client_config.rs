//! `Leasehold::builder` against real servers: each setting (default TTL, key prefix,
//! request and connect timeouts, TLS client certificates, waiting for the store, an
//! existing connection) and the refusals that are configuration, not trouble.
#![cfg(all(feature = "redis", feature = "etcd"))]

use std::time::Duration;

use leasehold::conformance::within;
use leasehold::{Error, EtcdStore, Leasehold, RedisStore, StoreUrl};
use leasehold_testkit::{free_port, make_tls_certs, EtcdServer, RedisServer, TempDir};
use tokio::time::Instant;

/// Past the timeout under test, what a loaded machine may add; kept below the defaults
/// (Redis 5 s, etcd 3 s per call, 3 s to connect) so that a test passing shows its setting.
const MARGIN: Duration = Duration::from_millis(2000);

fn names(states: &[leasehold::LockState]) -> Vec<&str> {
    states.iter().map(|s| s.name.as_str()).collect()
}

/// `check` against a fresh redis-server, then a fresh etcd.
async fn on_redis_and_etcd<F: std::future::Future<Output = ()>>(check: impl Fn(String) -> F) {
    let redis = RedisServer::start();
    check(redis.url()).await;
    let etcd = EtcdServer::start();
    check(etcd.url()).await;
}

async fn ttl_is_each_locks_lease(url: &str) {
    let ttl = Duration::from_secs(40);
    let locks = Leasehold::builder(url).ttl(ttl).build().await.unwrap();
    let guard = locks.mutex("ttl").unwrap().lock().await.unwrap();
    let state = locks.describe("ttl").await.unwrap();
    let left = state.holders[0].lease_left;
    // Well above DEFAULT_TTL (15 s): the builder's TTL was used.
    assert!(
        left > ttl - Duration::from_secs(5) && left <= ttl,
        "{left:?}"
    );
    // A lock's own TTL still wins.
    let short = locks.mutex("own").unwrap().with_ttl(Duration::from_secs(2));
    let own = short.lock().await.unwrap();
    let left = locks.describe("own").await.unwrap().holders[0].lease_left;
    assert!(left <= Duration::from_secs(2), "{left:?}");
    let _ = own.release().await.unwrap();
    let _ = guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builder_ttl_is_the_default_lease_on_redis_and_etcd() {
    on_redis_and_etcd(|url| async move { ttl_is_each_locks_lease(&url).await }).await;
}

async fn prefixes_keep_applications_apart(url: &str) {
    let with = |prefix: &str| Leasehold::builder(url).key_prefix(prefix).build();
    let (a, b, a_again) = (
        with("app-a/").await.unwrap(),
        with("app-b/").await.unwrap(),
        with("app-a/").await.unwrap(),
    );
    let held_a = a
        .mutex("job")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .expect("a takes job");
    let held_b = (b.mutex("job").unwrap().try_lock().await.unwrap())
        .expect("b's job is another lock than a's");
    assert!(
        a_again
            .mutex("job")
            .unwrap()
            .try_lock()
            .await
            .unwrap()
            .is_none(),
        "the same prefix is the same lock"
    );
    assert_eq!(held_a.name().as_str(), "app-a/job");
    for (client, token) in [(&a, held_a.token()), (&b, held_b.token())] {
        let listed = client.list("").await.unwrap();
        assert_eq!(names(&listed), ["job"]);
        let state = client.describe("job").await.unwrap();
        assert_eq!(
            (state.name.as_str(), state.holders[0].token),
            ("job", token)
        );
    }
    // A client without a prefix sees the store's names.
    let plain = Leasehold::connect(url).await.unwrap();
    assert_eq!(
        names(&plain.list("app-").await.unwrap()),
        ["app-a/job", "app-b/job"]
    );
    assert!(b.force_release("job").await.unwrap());
    assert_eq!(
        names(&a.list("").await.unwrap()),
        ["job"],
        "b freed only its own job"
    );
    let _ = held_a.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_prefixes_keep_applications_apart_on_redis_and_etcd() {
    on_redis_and_etcd(|url| async move { prefixes_keep_applications_apart(&url).await }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_prefixes_separate_rate_limiters_on_redis() {
    let redis = RedisServer::start();
    let with = |prefix: &str| Leasehold::builder(&redis.url()).key_prefix(prefix).build();
    let rate = leasehold::Rate::per_minute(1);
    for (prefix, allowed) in [("app-a/", true), ("app-b/", true), ("app-a/", false)] {
        let limiter = with(prefix)
            .await
            .unwrap()
            .rate_limiter("api", rate, 1)
            .unwrap();
        assert_eq!(
            limiter.try_acquire(1).await.unwrap().allowed,
            allowed,
            "{prefix}"
        );
    }
}

/// A call to a paused server fails as unavailable once the request timeout passes.
async fn request_timeout_is_honoured(
    url: &str,
    timeout: Duration,
    pause: impl Fn(),
    resume: impl Fn(),
) {
    let locks = Leasehold::builder(url)
        .request_timeout(timeout)
        .build()
        .await
        .unwrap();
    locks.describe("k").await.unwrap();
    let guard = locks.mutex("held").unwrap().lock().await.unwrap();
    pause();
    unavailable_after(timeout, locks.describe("k")).await;
    // A script's call too, once: a timed-out call is not sent again (on Redis it was,
    // which doubled the timeout).
    unavailable_after(timeout, guard.release()).await;
    resume();
}

/// `call` fails as unavailable once `timeout` has passed, within [`MARGIN`].
async fn unavailable_after<T: std::fmt::Debug>(
    timeout: Duration,
    call: impl std::future::Future<Output = leasehold::Result<T>>,
) {
    let start = Instant::now();
    let answer = call.await;
    let took = start.elapsed();
    assert!(
        matches!(answer, Err(Error::Unavailable { .. })),
        "{answer:?}"
    );
    assert!(took >= timeout && took < timeout + MARGIN, "{took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_ends_calls_to_a_paused_redis_and_etcd() {
    let redis = RedisServer::start();
    // Longer than MARGIN: a call that waited twice would show.
    let timeout = Duration::from_millis(2500);
    request_timeout_is_honoured(&redis.url(), timeout, || redis.pause(), || redis.resume()).await;
    let etcd = EtcdServer::start();
    let timeout = Duration::from_millis(300);
    request_timeout_is_honoured(&etcd.url(), timeout, || etcd.pause(), || etcd.resume()).await;
}

/// A paused server accepts the connection (the kernel does) and never answers its
/// handshake: connecting ends at the connect timeout.
async fn connect_timeout_is_honoured(builder: leasehold::LeaseholdBuilder, timeout: Duration) {
    unavailable_after(timeout, builder.connect_timeout(timeout).build()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_timeout_ends_connecting_to_a_paused_redis_and_etcd() {
    let certs = TempDir::new("connect-timeout");
    make_tls_certs(certs.path());
    let ca = std::fs::read(certs.path().join("ca.pem")).unwrap();
    let redis = RedisServer::start();
    redis.pause();
    let builder = Leasehold::builder(&redis.url()).request_timeout(Duration::from_secs(60));
    // Long enough that a connect tried again with the whole timeout each time (the
    // connection manager's retries) would take longer than MARGIN allows.
    connect_timeout_is_honoured(builder, Duration::from_millis(1500)).await;
    redis.resume();
    // Over TLS, the handshake is part of connecting.
    let etcd = EtcdServer::start_tls(
        &certs.path().join("server.pem"),
        &certs.path().join("server.key"),
    );
    etcd.pause();
    let builder = Leasehold::builder(&etcd.url()).tls_ca(ca);
    connect_timeout_is_honoured(builder, Duration::from_millis(500)).await;
    etcd.resume();
}

/// A client that waits for the store at `url`, which is down (connecting without waiting
/// fails), connects once `start` has brought it up, and takes a lock.
async fn waits_until_up<S: Send + 'static>(url: &str, start: impl FnOnce() -> S + Send + 'static) {
    let refused = Leasehold::builder(url).build().await;
    assert!(
        matches!(refused, Err(Error::Unavailable { .. })),
        "{refused:?}"
    );
    let waiting = tokio::spawn(
        Leasehold::builder(url)
            .wait_for_store(Duration::from_secs(60))
            .build(),
    );
    let server = tokio::task::spawn_blocking(start).await.unwrap();
    let locks = within("the client to connect", waiting)
        .await
        .unwrap()
        .unwrap();
    let guard = locks.mutex("k").unwrap().lock().await.unwrap();
    let _ = guard.release().await.unwrap();
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_store_connects_once_redis_and_etcd_come_up() {
    let port = free_port();
    waits_until_up(&format!("redis://127.0.0.1:{port}/0"), move || {
        RedisServer::start_at(port)
    })
    .await;
    let port = free_port();
    waits_until_up(&format!("etcd://127.0.0.1:{port}"), move || {
        EtcdServer::start_at(port)
    })
    .await;
}

/// The patience bounds the tries after the first: the first runs in full, so a zero
/// patience still connects to a store that is up; so does one without end
/// (`Duration::MAX`, which overflowed an `Instant` and panicked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_or_endless_wait_for_store_still_connects_to_a_store_that_is_up() {
    let redis = RedisServer::start();
    let etcd = EtcdServer::start();
    for url in [redis.url(), etcd.url()] {
        for patience in [Duration::ZERO, Duration::MAX] {
            let locks = Leasehold::builder(&url)
                .wait_for_store(patience)
                .build()
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}"));
            let guard = locks.mutex("k").unwrap().lock().await.unwrap();
            let _ = guard.release().await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_store_gives_up_after_its_patience_and_at_once_on_a_wrong_password() {
    let patience = Duration::from_secs(1);
    let url = format!("redis://127.0.0.1:{}/0", free_port());
    let start = Instant::now();
    let answer = Leasehold::builder(&url)
        .wait_for_store(patience)
        .build()
        .await;
    let took = start.elapsed();
    assert!(
        matches!(answer, Err(Error::Unavailable { .. })),
        "{answer:?}"
    );
    assert!(took < patience + MARGIN, "{took:?}");

    let server = RedisServer::start_with(&["--save", "", "--requirepass", "right-secret"]);
    let url = format!("redis://:wrong-secret@127.0.0.1:{}/0", server.port());
    let start = Instant::now();
    let answer = Leasehold::builder(&url)
        .wait_for_store(Duration::from_secs(60))
        .build()
        .await;
    assert!(matches!(answer, Err(Error::Config { .. })), "{answer:?}");
    assert!(
        start.elapsed() < MARGIN,
        "a configuration error was retried: {:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_and_unknown_database_are_config_errors() {
    let redis = RedisServer::start_with(&["--save", "", "--requirepass", "right-secret"]);
    for url in [
        format!("redis://:wrong-secret@127.0.0.1:{}/0", redis.port()),
        format!("redis://:right-secret@127.0.0.1:{}/99", redis.port()),
        // No password with a database: the SELECT is what the server refuses.
        format!("redis://127.0.0.1:{}/5", redis.port()),
        format!(
            "redis://:right-secret@127.0.0.1:{}/4294967296",
            redis.port()
        ),
    ] {
        let answer = Leasehold::connect(&url).await;
        assert!(
            matches!(answer, Err(Error::Config { .. })),
            "{url}: {answer:?}"
        );
    }
    let etcd = EtcdServer::start();
    etcd.etcdctl(&["user", "add", "root:right-secret"]);
    let enabled = etcd.etcdctl(&["auth", "enable"]);
    assert!(enabled.contains("Enabled"), "auth enable said {enabled:?}");
    let url = format!("{}?user=root&password=wrong-secret", etcd.url());
    let answer = Leasehold::connect(&url).await;
    assert!(matches!(answer, Err(Error::Config { .. })), "{answer:?}");
}

struct Certs {
    _dir: TempDir,
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
    path: std::path::PathBuf,
}

fn certs(label: &str) -> Certs {
    let dir = TempDir::new(label);
    make_tls_certs(dir.path());
    let read = |file: &str| std::fs::read(dir.path().join(file)).unwrap();
    Certs {
        ca: read("ca.pem"),
        cert: read("client.pem"),
        key: read("client.key"),
        path: dir.path().to_path_buf(),
        _dir: dir,
    }
}

/// With the client certificate the server takes locks; without it, it refuses.
async fn client_certificate_is_presented(url: &str, certs: &Certs) {
    let locks = Leasehold::builder(url)
        .tls_ca(certs.ca.clone())
        .tls_client_cert(certs.cert.clone(), certs.key.clone())
        .build()
        .await
        .unwrap();
    let guard = locks.mutex("k").unwrap().lock().await.unwrap();
    let _ = guard.release().await.unwrap();
    let without = Leasehold::builder(url)
        .tls_ca(certs.ca.clone())
        .build()
        .await;
    assert!(without.is_err(), "a client without a certificate got in");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_client_certificates_reach_redis_and_etcd_that_ask_for_them() {
    let certs = certs("client-certs");
    let redis = RedisServer::start_tls(&certs.path);
    client_certificate_is_presented(&redis.tls_url().unwrap(), &certs).await;
    let etcd = EtcdServer::start_tls_client_auth(&certs.path);
    client_certificate_is_presented(&etcd.url(), &certs).await;
}

/// `#insecure` accepts a server certificate no trusted CA signed (the test CA is not
/// given): it was refused for a feature missing from the build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insecure_redis_url_takes_a_certificate_of_an_unknown_ca() {
    let certs = certs("insecure");
    let redis = RedisServer::start_tls(&certs.path);
    let url = redis.tls_url().unwrap();
    let client = |url: String| {
        Leasehold::builder(&url)
            .tls_client_cert(certs.cert.clone(), certs.key.clone())
            .build()
    };
    let strict = client(url.clone()).await;
    assert!(
        strict.is_err(),
        "the test CA is trusted without being given"
    );
    let locks = client(format!("{url}#insecure")).await.unwrap();
    let guard = locks.mutex("k").unwrap().lock().await.unwrap();
    let _ = guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_from_an_existing_connection_or_channel_take_locks() {
    let redis = RedisServer::start();
    let client = redis::Client::open(redis.url()).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    let store = RedisStore::from_connection(conn, client).await.unwrap();
    let locks = Leasehold::new(store);
    let guard = locks.mutex("k").unwrap().lock().await.unwrap();
    assert_eq!(locks.describe("k").await.unwrap().holders.len(), 1);
    let _ = guard.release().await.unwrap();

    let etcd = EtcdServer::start();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", etcd.endpoint()))
        .unwrap()
        .connect_lazy();
    let store = EtcdStore::from_channels(etcd.url(), vec![channel], None)
        .await
        .unwrap();
    let locks = Leasehold::new(store);
    let guard = locks.mutex("k").unwrap().lock().await.unwrap();
    assert_eq!(locks.describe("k").await.unwrap().holders.len(), 1);
    let _ = guard.release().await.unwrap();
}

#[tokio::test]
async fn builder_refuses_settings_out_of_range() {
    let url = "redis://127.0.0.1:1/0";
    let option = |answer: leasehold::Result<Leasehold>| match answer {
        Err(Error::InvalidOption { option, .. }) => option,
        other => panic!("{other:?}"),
    };
    let zero = Duration::ZERO;
    let hour = Duration::from_secs(3600);
    assert_eq!(
        option(Leasehold::builder(url).request_timeout(zero).build().await),
        "request_timeout"
    );
    assert_eq!(
        option(Leasehold::builder(url).connect_timeout(hour).build().await),
        "connect_timeout"
    );
    assert_eq!(
        option(
            Leasehold::builder(url)
                .ttl(Duration::from_millis(1))
                .build()
                .await
        ),
        "ttl"
    );
    assert_eq!(
        option(Leasehold::builder(url).key_prefix("a\nb").build().await),
        "key_prefix"
    );
    let long = "p".repeat(leasehold::MAX_KEY_PREFIX_LEN + 1);
    assert_eq!(
        option(Leasehold::builder(url).key_prefix(long).build().await),
        "key_prefix"
    );
    let plain = Leasehold::builder(url).tls_ca(b"x".to_vec()).build().await;
    assert!(
        matches!(plain, Err(Error::InvalidStore { .. })),
        "{plain:?}"
    );
    // A CA that is not PEM certificates is refused before connecting, not taken for a
    // store that is down.
    let tls = "rediss://127.0.0.1:1/0";
    for ca in [
        &b"garbage"[..],
        b"-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n",
    ] {
        let answer = Leasehold::builder(tls).tls_ca(ca.to_vec()).build().await;
        assert_eq!(option(answer), "tls_ca");
    }
    // The URL's own options still come from the URL, read in one place.
    assert!(StoreUrl::parse("redis://127.0.0.1:1/0?timeout=1s").is_err());
}

/// A server certificate no trusted CA signed, and a client certificate missing where the
/// server asks for one: refusals that asking again cannot fix, so configuration errors
/// (exit 78 in the CLI) that say what to check, not a store that is away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_refusals_are_configuration_errors() {
    let certs = certs("tls-refusals");
    let redis = RedisServer::start_tls(&certs.path);
    let etcd = EtcdServer::start_tls_client_auth(&certs.path);
    let refusal = |answer: leasehold::Result<Leasehold>| match answer {
        Err(e @ Error::Config { .. }) => {
            assert!(!e.is_retryable());
            e.to_string()
        }
        other => panic!("not a configuration error: {other:?}"),
    };
    for url in [redis.tls_url().unwrap(), etcd.url()] {
        let untrusted = Leasehold::builder(&url)
            .tls_client_cert(certs.cert.clone(), certs.key.clone())
            .build();
        let shown = refusal(untrusted.await);
        assert!(shown.contains("certificate is not trusted"), "{shown}");
    }
    // etcd (TLS 1.3) checks the client's certificate after the handshake, so its refusal
    // may reach the client as a closed stream: only Redis's is certain to say why.
    let no_client_cert = Leasehold::builder(&redis.tls_url().unwrap())
        .tls_ca(certs.ca.clone())
        .build();
    let shown = refusal(no_client_cert.await);
    assert!(shown.contains("refused our client certificate"), "{shown}");
}

/// The README's way to a blocking client with the builder's settings: a store built on a
/// runtime that then ends. Its connection went with that runtime: etcd's calls then
/// failed for good ("transport error"); they now connect again on the client's own.
#[test]
fn a_blocking_client_outlives_the_runtime_that_built_its_store() {
    let redis = RedisServer::start();
    let etcd = EtcdServer::start();
    for url in [redis.url(), etcd.url()] {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let built = runtime.block_on(Leasehold::builder(&url).build()).unwrap();
        let store = built.store().clone();
        drop(built);
        drop(runtime);
        let locks = leasehold::blocking::Leasehold::from_store(store).unwrap();
        let guard = locks.mutex("k").unwrap().try_lock();
        let guard = guard.unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(guard.expect("a free lock").release().is_ok(), "{url}");
    }
}

/// A URL whose TLS is not the server's: the error suggests the other scheme (it said only
/// "connection reset" or "timed out"); a server that is not there gets no such hint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_mix_up_suggests_the_other_scheme() {
    let certs = certs("tls-mix-up");
    let key = certs.path.join("server.key");
    let tls_etcd = EtcdServer::start_tls(&certs.path.join("server.pem"), &key);
    let plain_etcd = EtcdServer::start();
    let tls_redis = RedisServer::start_tls(&certs.path);
    let plain_redis = RedisServer::start();
    let cases = [
        (tls_etcd.url().replace("etcds:", "etcd:"), "use etcds://"),
        (plain_etcd.url().replace("etcd:", "etcds:"), "use etcd://"),
        (
            tls_redis.tls_url().unwrap().replace("rediss:", "redis:"),
            "use rediss://",
        ),
        (
            plain_redis.url().replace("redis:", "rediss:"),
            "use redis://",
        ),
    ];
    for (url, hint) in cases {
        let mut builder = Leasehold::builder(&url).connect_timeout(Duration::from_secs(2));
        if url.starts_with("rediss:") || url.starts_with("etcds:") {
            builder = builder.tls_ca(certs.ca.clone());
        }
        match builder.build().await {
            Err(e @ Error::Unavailable { .. }) => assert!(e.to_string().contains(hint), "{e}"),
            other => panic!("{url}: {other:?}"),
        }
    }
    let nobody = format!("etcd://127.0.0.1:{}", free_port());
    let refused = Leasehold::builder(&nobody).build().await.err().unwrap();
    assert!(!refused.to_string().contains("TLS"), "{refused}");
}
