use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;

fn parse(text: &str) -> StoreUrl {
    parse::parse(text, Some(Path::new("/home/me"))).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn refused(text: &str) -> String {
    match parse::parse(text, Some(Path::new("/home/me"))) {
        Ok(url) => panic!("{text} was taken: {url:?}"),
        Err(Error::InvalidStore { reason, .. }) => reason,
        Err(other) => panic!("{text}: not InvalidStore: {other:?}"),
    }
}

fn endpoints(url: &StoreUrl) -> Vec<String> {
    url.endpoints().iter().map(|e| e.to_string()).collect()
}

/// The URL reads back from `expose` as itself, and from `Display` too when it holds no
/// password.
fn round_trips(url: &StoreUrl) {
    assert_eq!(&parse(&url.expose()), url, "{}", url.expose());
    if url.credentials().and_then(|c| c.password()).is_none() {
        assert_eq!(&parse(&url.to_string()), url, "{url}");
    }
}

#[test]
fn memory_takes_no_address() {
    let url = parse("memory:");
    assert_eq!(
        (url.scheme(), url.to_string()),
        (Scheme::Memory, "memory:".into())
    );
    assert!(refused("memory:x").contains("no address"));
}

#[test]
fn local_forms_name_the_default_an_absolute_or_a_relative_directory() {
    for (text, dir) in [
        ("local:", None),
        ("local://", None),
        ("local:/srv/locks", Some("/srv/locks")),
        ("local:///srv/locks", Some("/srv/locks")),
        ("local:locks", Some("locks")),
        ("local:~", Some("/home/me")),
        ("local:~/locks", Some("/home/me/locks")),
        ("local:/srv/my%20locks", Some("/srv/my locks")),
        ("local:/srv/100%25", Some("/srv/100%")),
        ("local:%7Elocks", Some("~locks")),
        ("local:/srv/caf%C3%A9", Some("/srv/café")),
    ] {
        let url = parse(text);
        assert_eq!(url.scheme().backend(), "local");
        assert_eq!(url.dir(), dir.map(Path::new), "{text}");
        round_trips(&url);
    }
}

#[test]
fn local_directories_that_are_not_utf8_or_start_oddly_read_back() {
    use std::os::unix::ffi::OsStringExt;
    let odd = PathBuf::from(std::ffi::OsString::from_vec(b"/srv/\xff%x".to_vec()));
    for dir in [odd, "~x".into(), "//srv".into(), "a b?c#d".into()] {
        let url = StoreUrl::local(&dir);
        assert_eq!(parse(&url.to_string()).dir(), Some(dir.as_path()), "{url}");
    }
}

#[test]
fn local_forms_that_cannot_be_read_are_refused() {
    let err = refused("local://srv/locks");
    for said in [
        "host",
        "local:/srv/locks",
        "local:///srv/locks",
        "local:srv/locks",
    ] {
        assert!(err.contains(said), "no {said:?} in: {err}");
    }
    assert!(refused("local:~bob/locks").contains("~USER"));
    assert!(refused("local:/srv/50%").contains("%25"));
    assert!(refused("local:/srv/%zz").contains("%25"));
    let no_home = parse::parse("local:~/locks", None).unwrap_err().to_string();
    assert!(no_home.contains("HOME is not set"), "{no_home}");
}

#[test]
fn a_redis_url_gives_its_server_credentials_database_and_options() {
    let url = parse("redis://app:s%40cret@cache.internal:6380/2?replicas=2&replica_timeout=250ms&durable=1&protocol=resp3");
    assert_eq!(url.scheme(), Scheme::Redis);
    assert_eq!(endpoints(&url), ["cache.internal:6380"]);
    let credentials = url.credentials().unwrap();
    assert_eq!(credentials.user(), Some("app"));
    assert_eq!(credentials.password().unwrap().expose(), "s@cret");
    assert_eq!(url.redis.db, Some(2));
    assert_eq!(url.redis.replicas, Some(2));
    assert_eq!(url.redis.replica_timeout, Some(Duration::from_millis(250)));
    assert!(url.redis.durable);
    assert_eq!(url.redis.protocol, Some(3));
    assert_eq!(
        url.to_string(),
        "redis://app:***@cache.internal:6380/2?replicas=2&replica_timeout=250ms&durable=1&protocol=resp3"
    );
    round_trips(&url);
}

#[test]
fn redis_forms_with_defaults_tls_ipv6_and_clusters_are_read() {
    let url = parse("redis://h");
    assert_eq!((url.endpoints()[0].port(), url.redis.db), (None, None));
    assert_eq!(url.credentials(), None);
    #[cfg(feature = "redis")]
    {
        let timeout = redis::DEFAULT_REPLICA_TIMEOUT;
        assert_eq!(
            parse("redis://h:1?replicas=1").replicas(),
            Some((1, timeout))
        );
        assert_eq!(parse("redis://h:1?replica_timeout=1.5s").replicas(), None);
    }
    let url = parse("redis://h:1?replica_timeout=1.5s");
    assert_eq!(url.redis.replica_timeout, Some(Duration::from_millis(1500)));
    round_trips(&url);
    let password_only = parse("redis://:pw@h:1/");
    assert_eq!(password_only.credentials().unwrap().user(), None);
    assert_eq!(password_only.to_string(), "redis://:***@h:1");
    let tls = parse("rediss://h:1/0#insecure");
    assert!(tls.scheme().tls() && tls.redis.insecure);
    assert_eq!(endpoints(&parse("redis://[::1]:7000")), ["[::1]:7000"]);
    for scheme in ["redis+cluster", "rediss+cluster"] {
        let url = parse(&format!("{scheme}://:pw@a:1,b:2,[::1]:3/"));
        assert!(url.scheme().cluster());
        assert_eq!(endpoints(&url), ["a:1", "b:2", "[::1]:3"]);
        round_trips(&url);
    }
    // A password may hold what ends a host, unescaped: the last @ ends it.
    let url = parse("redis://u:a/b?c#d@e@h:1/3");
    assert_eq!(
        url.credentials().unwrap().password().unwrap().expose(),
        "a/b?c#d@e"
    );
    assert_eq!(
        (endpoints(&url), url.redis.db),
        (vec!["h:1".to_string()], Some(3))
    );
    round_trips(&url);
}

#[test]
fn redis_urls_that_cannot_be_used_are_refused_saying_why() {
    for (text, said) in [
        ("redis:/h:1", "a redis URL is redis://"),
        ("redis://", "no host"),
        ("redis://h:port", "endpoint \"h:port\" is not HOST[:PORT]"),
        ("redis://h:70000", "endpoint \"h:70000\""),
        ("redis://::1:6379", "is not HOST[:PORT]"),
        ("redis://0.0.0.0:6379", "wildcard"),
        ("redis://h1:1,h2:2", "redis+cluster://h1:p1,h2:p2"),
        ("redis://h:1/zero", "the database /zero is not a number"),
        ("redis+cluster://", "no host"),
        ("redis+cluster://a:1,,b:2", "an endpoint is empty"),
        ("redis+cluster://a:1/0", "takes no database"),
        (
            "redis+cluster://a:1?replicas=1",
            "?replicas is for a single server",
        ),
        ("redis://h:1#insecure", "#insecure is for TLS"),
        ("rediss://h:1#secure", "only #insecure"),
        ("redis://h:1?replica=1", "unknown URL parameter \"replica\""),
        ("redis://h:1?replicas=0", "replicas=0: give how many"),
        ("redis://h:1?replica_timeout=soon", "replica_timeout=soon"),
        (
            "redis://h:1?durable=maybe",
            "durable=maybe: give 1 (or true, yes) or 0 (or false, no)",
        ),
        (
            "redis://h:1?protocol=resp4",
            "protocol=resp4: give resp2 or resp3",
        ),
        (
            "redis://h:1?durable=1&durable=0",
            "\"durable\" is given twice",
        ),
        ("redis://us%zzer@h:1", "the user name holds a %"),
        ("redis://u:%FF@h:1", "the password is not UTF-8"),
    ] {
        let reason = refused(text);
        assert!(reason.contains(said), "{text}: no {said:?} in {reason:?}");
    }
}

#[test]
fn an_etcd_url_gives_its_members_and_credentials() {
    let url = parse("etcds://a:2379,[::1]:2380/?user=root&password=p%26w");
    assert!(url.scheme().tls());
    assert_eq!(url.scheme().backend(), "etcd");
    assert_eq!(endpoints(&url), ["a:2379", "[::1]:2380"]);
    let credentials = url.credentials().unwrap();
    assert_eq!(credentials.user(), Some("root"));
    assert_eq!(credentials.password().unwrap().expose(), "p&w");
    assert_eq!(
        url.to_string(),
        "etcds://a:2379,[::1]:2380?user=root&password=***"
    );
    round_trips(&url);
    let url = parse("etcd://a:1,,b:2");
    assert_eq!(
        (endpoints(&url), url.credentials()),
        (vec!["a:1".into(), "b:2".into()], None)
    );
    round_trips(&url);
}

#[test]
fn etcd_urls_that_cannot_be_used_are_refused_saying_why() {
    for (text, said) in [
        ("etcd:h:2379", "an etcd URL is etcd://"),
        ("etcd://", "no endpoint"),
        (
            "etcd://h",
            "endpoint \"h\" is not HOST:PORT (etcd's client port is usually 2379)",
        ),
        ("etcd://h:x", "endpoint \"h:x\""),
        (
            "etcd://u:p@h:2379",
            "as ?user=NAME&password=SECRET, not before the hosts",
        ),
        ("etcd://h:1?user=root", "give both user= and password="),
        ("etcd://h:1?user=&password=", "give both"),
        ("etcd://h:1?user=u&password=p&pw=1", "after password="),
        (
            "etcd://h:1?token=1",
            "unknown URL parameter \"token\": an etcd URL takes user=NAME",
        ),
        ("etcd://h:1#x", "endpoint \"h:1#x\""),
    ] {
        let reason = refused(text);
        assert!(reason.contains(said), "{text}: no {said:?} in {reason:?}");
    }
}

#[test]
fn unknown_schemes_and_text_without_one_are_refused_listing_the_forms() {
    for text in ["ftp://x", "postgres://h/db", "/srv/locks"] {
        let reason = refused(text);
        assert!(
            reason.contains("etcd://h1:2379") && reason.contains("local:DIR"),
            "{reason}"
        );
    }
    assert!(refused("REDIS://h:1").contains("unknown store scheme \"REDIS\""));
}

#[test]
fn each_scheme_names_its_backend() {
    let backend = |text: &str| parse(text).scheme().backend();
    assert_eq!(backend("memory:"), "memory");
    assert_eq!(backend("local:/tmp/x"), "local");
    for text in [
        "redis://h:1",
        "rediss://h:1",
        "redis+cluster://h:1",
        "rediss+cluster://h:1",
    ] {
        assert_eq!(backend(text), "redis", "{text}");
    }
    assert_eq!(backend("etcd://h:1"), "etcd");
    assert_eq!(backend("etcds://h:1"), "etcd");
}

#[test]
fn endpoints_can_be_replaced_keeping_the_rest() {
    let url = parse("redis://u:pw@h:1/2?replicas=1");
    let moved = url.with_endpoints(vec![Endpoint::new("127.0.0.1", 9)]);
    assert_eq!(moved.expose(), "redis://u:pw@127.0.0.1:9/2?replicas=1");
    let url = parse("etcd://a:1,b:2?user=u&password=p");
    let moved = url.with_endpoints(vec![Endpoint::new("x", 3), Endpoint::new("y", 4)]);
    assert_eq!(moved.expose(), "etcd://x:3,y:4?user=u&password=p");
}

/// URL forms with the password `pwA/pwB?pwC#pwD&pwE` (written in the URL as `PW`): each
/// piece of it must stay out of every message.
const WITH_A_PASSWORD: &[&str] = &[
    // Usable.
    "redis://u:PW@h:1/0",
    "redis://:PW@h:1",
    "rediss://u:PW@h:1/0#insecure",
    "redis+cluster://u:PW@a:1,b:2",
    "rediss+cluster://u:PW@a:1,b:2",
    "etcd://a:1,b:2?user=u&password=PW",
    "etcds://a:1?user=u&password=PW",
    // Not usable.
    "redis://u:PW@h:notaport/0",
    "redis://u:PW@h:1/?bogus=1",
    "redis://u:PW@h:1/?pwX=1",
    "redis://u:PW@h:1/?replicas=0",
    "redis://u:PW@h:1/db",
    "redis://u:PW@h1:1,h2:2",
    "redis://u:PW@0.0.0.0:1",
    "redis://u:PW%zz@h:1",
    "redis:/u:PW@h:1",
    "redix://u:PW@h:1",
    "u:PW@h:1",
    "redis+cluster://u:PW@a:1,,b:2",
    "redis+cluster://u:PW@a:1,b:port",
    "redis+cluster://u:PW@a:1/0",
    "redis+cluster://u:PW@a:1?replicas=1",
    "rediss://u:PW@h:1#nope",
    "etcd://h:notaport?user=u&password=PW",
    "etcd://h:1?user=u&password=PW&bogus=1",
    "etcd://h:1?user=u&passwd=PW",
    "etcd://h:1?password=PW",
    "etcd://u:PW@h:2379",
    "etcds://h?user=u&password=PW",
    "etcd://?user=u&password=PW",
];
const PASSWORD: &str = "pwA/pwB?pwC#pwD&pwE";
const PIECES: [&str; 5] = ["pwA", "pwB", "pwC", "pwD", "pwE"];

/// A form with the password in it: unescaped in the userinfo of a Redis URL (the
/// careless way, which must be safe too) and escaped where it must be (an etcd query).
fn with_password(form: &str) -> Vec<String> {
    let mut escaped = String::new();
    parse::encode(&mut escaped, PASSWORD);
    let mut texts = vec![form.replace("PW", &escaped)];
    if !form.contains("password=") {
        texts.push(form.replace("PW", PASSWORD));
    }
    texts
}

fn assert_hidden(text: &str, shown: &str) {
    for piece in PIECES {
        assert!(!shown.contains(piece), "{text}: {piece} shown in {shown:?}");
    }
}

#[test]
fn no_message_display_or_debug_shows_a_password() {
    let mut usable = 0;
    for form in WITH_A_PASSWORD {
        for text in with_password(form) {
            match StoreUrl::parse(&text) {
                Ok(url) => {
                    usable += 1;
                    assert_hidden(&text, &url.to_string());
                    assert_hidden(&text, &format!("{url:?}"));
                    assert_hidden(&text, &format!("{:?}", url.credentials()));
                    assert!(url.to_string().contains("***"), "{url}");
                    let password = url.credentials().unwrap().password().unwrap();
                    assert_eq!(password.expose(), PASSWORD, "{text}");
                    assert!(url.expose().contains("pwA"), "{}", url.expose());
                }
                Err(e) => {
                    assert!(matches!(e, Error::InvalidStore { .. }), "{text}: {e:?}");
                    assert_hidden(&text, &e.to_string());
                    assert_hidden(&text, &format!("{e:?}"));
                }
            }
        }
    }
    // The first seven forms are usable, the Redis ones both ways.
    assert_eq!(usable, 12);
}

/// Opening the store of a URL that parses (nothing listens on port 1), and of ones that
/// do not, by `open_store` and the store's own `connect`: no error shows the password.
#[cfg(all(feature = "redis", feature = "etcd"))]
#[tokio::test]
async fn no_store_connect_error_shows_a_password() {
    for form in WITH_A_PASSWORD {
        for text in with_password(form) {
            let text = (text.replace("h:1", "127.0.0.1:1"))
                .replace("a:1", "127.0.0.1:1")
                .replace("b:2", "127.0.0.1:2");
            let mut errors = vec![open_store(&text).await.map(drop).unwrap_err()];
            // The stores' own entry reads the URL as open_store does.
            if StoreUrl::parse(&text).is_err() {
                let own = match text.get(..4) {
                    Some("etcd") => crate::EtcdStore::connect(&text).await.err(),
                    Some("redi") => crate::RedisStore::connect(&text).await.err(),
                    _ => None,
                };
                errors.extend(own);
            }
            for e in &errors {
                assert_hidden(&text, &e.to_string());
                assert_hidden(&text, &format!("{e:?}"));
            }
        }
    }
}

#[cfg(feature = "local")]
#[tokio::test]
async fn local_with_three_slashes_is_an_absolute_directory() {
    let dir = tempfile::tempdir().unwrap();
    let abs = dir.path().join("store");
    let store = open_store(&format!("local://{}", abs.display()))
        .await
        .unwrap();
    assert!(store.describe_store().contains(&abs.display().to_string()));
    assert!(abs.is_dir(), "the store was not made at {}", abs.display());
}

#[cfg(feature = "local")]
#[tokio::test]
async fn local_directory_escapes_are_decoded_before_the_store_opens() {
    let dir = tempfile::tempdir().unwrap();
    let spaced = dir.path().join("my locks");
    let url = format!("local:{}/my%20locks", dir.path().display());
    let store = open_store(&url).await.unwrap();
    assert!(
        spaced.join("locks").is_dir(),
        "no store at {}",
        spaced.display()
    );
    assert_eq!(
        store.describe_store(),
        format!("local:{}", spaced.display())
    );
}
