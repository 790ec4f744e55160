//! Reading a URL's text, and writing parts of it back. A message about a URL quotes only
//! what cannot hold a password: the echo of the URL goes through [`redact`], and a
//! reason quotes hosts, the database and option values only where they cannot be a
//! piece of a password written without its escapes.

use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{forms, Credentials, Endpoint, RedisOptions, Scheme, StoreUrl};
use crate::{Error, Result};

/// Options whose values a message may show: none of them is a secret.
const SHOWN_OPTIONS: [&str; 5] = ["replicas", "replica_timeout", "durable", "protocol", "user"];

/// `text` as a [`StoreUrl`], `home` standing for `~` in a `local:` directory.
pub(super) fn parse(text: &str, home: Option<&Path>) -> Result<StoreUrl> {
    let invalid = |reason: String| Error::InvalidStore {
        store: redact(text),
        reason,
    };
    let Some((name, rest)) = text.split_once(':') else {
        return Err(invalid(format!(
            "a store URL starts with a scheme; use one of: {}",
            forms::line()
        )));
    };
    let Some(scheme) = Scheme::from_name(name) else {
        return Err(invalid(format!(
            "unknown store scheme {name:?}; use one of: {}",
            forms::line()
        )));
    };
    let url = match scheme {
        Scheme::Memory if rest.is_empty() => Ok(StoreUrl::new(scheme)),
        Scheme::Memory => Err("memory: takes no address".to_string()),
        Scheme::Local => local(rest, home),
        Scheme::Etcd | Scheme::Etcds => etcd(scheme, rest),
        Scheme::Redis | Scheme::Rediss | Scheme::RedisCluster | Scheme::RedissCluster => {
            redis(scheme, rest)
        }
    };
    url.map_err(invalid)
}

/// `local:DIR`, `local:///DIR`, `local:~/DIR`, or `local:` (the default directory).
fn local(rest: &str, home: Option<&Path>) -> Result<StoreUrl, String> {
    let path = match rest.strip_prefix("//") {
        // `local://` (no directory) is the default directory, as `local:` is.
        Some(path) if path.is_empty() || path.starts_with('/') => path,
        Some(path) => {
            return Err(format!(
                "local:// is followed by a host in URL syntax, not a directory; \
for the directory /{path} write local:/{path} or local:///{path}, for {path} relative to \
the working directory write local:{path}"
            ))
        }
        None => rest,
    };
    let decoded = |path: &str| {
        decode(path)
            .map(|bytes| PathBuf::from(OsString::from_vec(bytes)))
            .map_err(|()| escape_error("the directory"))
    };
    // `~` is read before decoding: `%7E` is a `~` of the name.
    let dir = match path.strip_prefix('~') {
        _ if path.is_empty() => None,
        Some(under) if under.is_empty() || under.starts_with('/') => {
            let Some(home) = home else {
                return Err(format!(
                    "local:{path} is in the home directory, and HOME is not set; write the directory in full"
                ));
            };
            Some(home.join(decoded(under.trim_start_matches('/'))?))
        }
        Some(_) => {
            return Err(format!(
                "local:{path}: another user's home (~USER) is not looked up; write the directory in full, or %7E for a name starting with ~"
            ))
        }
        None => Some(decoded(path)?),
    };
    Ok(StoreUrl {
        dir,
        ..StoreUrl::new(Scheme::Local)
    })
}

/// `redis://[user:password@]host[:port][/db][?options][#insecure]`, `rediss://`, and the
/// cluster forms with several hosts and no database.
fn redis(scheme: Scheme, rest: &str) -> Result<StoreUrl, String> {
    let plain = if scheme.tls() { "rediss" } else { "redis" };
    let form = match scheme.cluster() {
        true => format!(
            "{plain}+cluster://[user:password@]h1:6379,h2:6379 (seed nodes; no database: a cluster has only db 0)"
        ),
        false => format!("{plain}://[user:password@]host:port[/db]"),
    };
    let Some(rest) = rest.strip_prefix("//") else {
        return Err(format!("a {scheme} URL is {form}"));
    };
    // The last @ ends the user and password, which may hold any character unescaped;
    // nothing after it can hold an @, so what follows may be quoted.
    let (userinfo, rest) = match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let (rest, fragment) = split(rest, '#');
    let (rest, query) = split(rest, '?');
    let (hosts, path) = split(rest, '/');
    let path = path.unwrap_or("").trim_matches('/');
    let mut url = StoreUrl::new(scheme);
    url.credentials = match userinfo {
        Some(userinfo) => userinfo_credentials(userinfo)?,
        None => None,
    };
    if hosts.is_empty() {
        return Err(format!("no host: a {scheme} URL is {form}"));
    }
    if scheme.cluster() && !path.is_empty() {
        return Err(format!("a {scheme} URL takes no database: {form}"));
    }
    url.endpoints = redis_hosts(scheme, hosts, &form)?;
    if !path.is_empty() {
        url.redis.db = Some(path.parse().map_err(|_| {
            format!("the database /{path} is not a number; a {scheme} URL is {form}")
        })?);
    }
    url.redis.insecure = redis_insecure(scheme, fragment)?;
    redis_options(scheme, query.unwrap_or(""), &mut url.redis)?;
    Ok(url)
}

/// A Redis URL's hosts: one server, or a cluster's seed nodes.
fn redis_hosts(scheme: Scheme, hosts: &str, form: &str) -> Result<Vec<Endpoint>, String> {
    let plain = if scheme.tls() { "rediss" } else { "redis" };
    let mut endpoints = Vec::new();
    for host in hosts.split(',') {
        let endpoint = endpoint(host, false, true, form)?;
        let bare = endpoint.host.trim_start_matches('[').trim_end_matches(']');
        if bare == "0.0.0.0" || bare == "::" {
            return Err(format!(
                "{endpoint} is a wildcard address, not a server: give the server's address"
            ));
        }
        endpoints.push(endpoint);
    }
    if endpoints.len() > 1 && !scheme.cluster() {
        return Err(format!(
            "a {scheme} URL names one server; for a Redis Cluster write {plain}+cluster://h1:p1,h2:p2"
        ));
    }
    Ok(endpoints)
}

/// `#insecure`: TLS that accepts any server certificate, the only fragment a Redis URL
/// takes.
fn redis_insecure(scheme: Scheme, fragment: Option<&str>) -> Result<bool, String> {
    let plain = if scheme.tls() { "rediss" } else { "redis" };
    Ok(match fragment {
        None => false,
        Some("insecure") if scheme.tls() => true,
        Some("insecure") => return Err(format!("#insecure is for TLS ({plain}s://...)")),
        Some(_) => {
            return Err(
                "only #insecure (TLS accepting any server certificate) may end a Redis URL".into(),
            )
        }
    })
}

/// leasehold's options in a Redis URL's query (and the redis crate's `protocol`).
fn redis_options(scheme: Scheme, query: &str, o: &mut RedisOptions) -> Result<(), String> {
    let known =
        "a Redis URL takes replicas=N, replica_timeout=DUR, durable=1 and protocol=resp2|resp3";
    options(query, known, |key, value| {
        match key {
            "replicas" if scheme.cluster() => {
                return Err("?replicas is for a single server; a cluster's WAIT is per node".into())
            }
            "replicas" => {
                o.replicas = Some(value.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    format!(
                        "replicas={value}: give how many replicas must confirm a grant, at least 1"
                    )
                })?)
            }
            "replica_timeout" => {
                o.replica_timeout = Some(parse_millis(value).ok_or_else(|| {
                    format!("replica_timeout={value}: give a duration like 100ms or 1s")
                })?)
            }
            "durable" => {
                o.durable = match value {
                    "1" | "true" | "yes" => true,
                    "0" | "false" | "no" => false,
                    _ => {
                        return Err(format!(
                            "durable={value}: give 1 (or true, yes) or 0 (or false, no)"
                        ))
                    }
                }
            }
            "protocol" => {
                o.protocol = Some(match value {
                    "2" | "resp2" => 2,
                    "3" | "resp3" => 3,
                    _ => return Err(format!("protocol={value}: give resp2 or resp3")),
                })
            }
            _ => return Ok(false),
        }
        Ok(true)
    })
}

/// `[user][:password]` before a Redis URL's hosts, decoded.
fn userinfo_credentials(userinfo: &str) -> Result<Option<Credentials>, String> {
    let (user, password) = match userinfo.split_once(':') {
        Some((user, password)) => (user, Some(password)),
        None => (userinfo, None),
    };
    let user = decode_text(user, "the user name")?;
    let password = password
        .map(|p| decode_text(p, "the password"))
        .transpose()?;
    Ok(Credentials::new(user, password))
}

/// `etcd://HOST:PORT[,HOST:PORT...][?user=NAME&password=SECRET]`, `etcds://`.
fn etcd(scheme: Scheme, rest: &str) -> Result<StoreUrl, String> {
    let form = "etcd://HOST:PORT[,HOST:PORT...][?user=NAME&password=SECRET] (etcds:// for TLS)";
    let Some(rest) = rest.strip_prefix("//") else {
        return Err(format!("an etcd URL is {form}"));
    };
    let (hosts, query) = split(rest, '?');
    // An @ here starts the hosts after a user and password, of which nothing is quoted.
    if hosts.contains('@') {
        return Err(
            "an etcd URL takes its user and password as ?user=NAME&password=SECRET, not before the hosts".into(),
        );
    }
    // An @ after the hosts may end a password holding the ? that ended them: then a host
    // may be a piece of the password, and is not quoted.
    let quote = !query.unwrap_or("").contains('@');
    let hint = "etcd's client port is usually 2379";
    let mut url = StoreUrl::new(scheme);
    for host in hosts.trim_end_matches('/').split(',') {
        if !host.is_empty() {
            url.endpoints.push(endpoint(host, true, quote, hint)?);
        }
    }
    if url.endpoints.is_empty() {
        return Err("no endpoint: give HOST:PORT[,HOST:PORT...]".into());
    }
    let (mut user, mut password) = (None, None);
    let known = "an etcd URL takes user=NAME and password=SECRET";
    options(query.unwrap_or(""), known, |key, value| {
        match key {
            "user" => user = Some(decode_text(value, "the user name")?),
            "password" => password = Some(decode_text(value, "the password")?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    url.credentials = match (user, password) {
        (Some(user), Some(password)) if !user.is_empty() && !password.is_empty() => {
            Credentials::new(user, Some(password))
        }
        (None, None) => None,
        _ => return Err("give both user= and password=, neither empty".into()),
    };
    Ok(url)
}

/// `host[:port]` (`port_needed`: `host:port`); an IPv6 host in brackets. Quoted in the
/// error when `quote`; `hint` says what a server's address looks like.
fn endpoint(text: &str, port_needed: bool, quote: bool, hint: &str) -> Result<Endpoint, String> {
    let bad = || {
        let what = match port_needed {
            true => "HOST:PORT",
            false => "HOST[:PORT]",
        };
        match (quote, text.is_empty()) {
            (_, true) => format!("an endpoint is empty (two commas?); {hint}"),
            (true, false) => format!("endpoint {text:?} is not {what} ({hint})"),
            (false, false) => format!("an endpoint is not {what} ({hint})"),
        }
    };
    let (host, port) = match text.strip_prefix('[') {
        Some(v6) => {
            let close = v6.find(']').ok_or_else(bad)?;
            let after = &v6[close + 1..];
            let port = match after {
                "" => None,
                _ => Some(after.strip_prefix(':').ok_or_else(bad)?),
            };
            (&text[..close + 2], port)
        }
        None => match text.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        },
    };
    let unfit = |c: char| c.is_whitespace() || c.is_control() || "/?#@[]\\".contains(c);
    let bare = host.strip_prefix('[').map_or(host, |h| &h[..h.len() - 1]);
    if bare.is_empty() || (host == bare && bare.contains(':')) || bare.contains(unfit) {
        return Err(bad());
    }
    let port = match port {
        Some(port) => Some(port.parse::<u16>().map_err(|_| bad())?),
        None if port_needed => return Err(bad()),
        None => None,
    };
    Ok(Endpoint {
        host: host.to_string(),
        port,
    })
}

/// Hands each `key=value` of `query` to `take`, which says whether it knows the key. A
/// key it does not know, or one given twice, is refused, named only when it cannot be a
/// piece of a password (one that held an unescaped `&`).
fn options<'a>(
    query: &'a str,
    known: &str,
    mut take: impl FnMut(&str, &'a str) -> Result<bool, String>,
) -> Result<(), String> {
    let mut seen: Vec<&str> = Vec::new();
    let mut after_password = false;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let nameable = !after_password
            && key.len() <= 40
            && key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
        if !take(key, value)? {
            return Err(match nameable {
                true => format!("unknown URL parameter {key:?}: {known}"),
                false => format!(
                    "a URL parameter is not an option (after password=, write a & in a password as %26): {known}"
                ),
            });
        }
        if seen.contains(&key) {
            return Err(format!("URL parameter {key:?} is given twice"));
        }
        seen.push(key);
        after_password = key == "password";
    }
    Ok(())
}

/// `(before, Some(after))` at the first `at`, or `(text, None)`.
fn split(text: &str, at: char) -> (&str, Option<&str>) {
    match text.split_once(at) {
        Some((before, after)) => (before, Some(after)),
        None => (text, None),
    }
}

/// `250ms` or `2s`.
fn parse_millis(text: &str) -> Option<Duration> {
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.parse().ok().map(Duration::from_millis);
    }
    text.strip_suffix('s')?
        .parse::<f64>()
        .ok()
        .filter(|s| *s >= 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
}

/// A duration as [`parse_millis`] reads it back.
pub(super) fn duration_text(duration: Duration) -> String {
    match duration.subsec_nanos() % 1_000_000 {
        0 => format!("{}ms", duration.as_millis()),
        _ => format!("{}s", duration.as_secs_f64()),
    }
}

/// `%XX` escapes decoded; `Err` for a `%` that starts none.
fn decode(text: &str) -> std::result::Result<Vec<u8>, ()> {
    let mut out = Vec::with_capacity(text.len());
    let mut bytes = text.bytes();
    while let Some(b) = bytes.next() {
        if b != b'%' {
            out.push(b);
            continue;
        }
        let hex = |b: Option<u8>| (b? as char).to_digit(16);
        match (hex(bytes.next()), hex(bytes.next())) {
            (Some(hi), Some(lo)) => out.push((hi * 16 + lo) as u8),
            _ => return Err(()),
        }
    }
    Ok(out)
}

/// [`decode`] to text; `what` (never its value) names it in the error.
fn decode_text(text: &str, what: &str) -> Result<String, String> {
    let bytes = decode(text).map_err(|()| escape_error(what))?;
    String::from_utf8(bytes)
        .map_err(|_| format!("{what} is not UTF-8 once its %XX escapes are decoded"))
}

fn escape_error(what: &str) -> String {
    format!("{what} holds a % that starts no escape such as %20; write %25 for a % itself")
}

/// `text` with every byte but `A-Z a-z 0-9 - . _ ~` escaped: a user, password or option
/// value as [`decode`] reads it back.
pub(super) fn encode(out: &mut String, text: &str) {
    for b in text.bytes() {
        match b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            true => out.push(b as char),
            false => out.push_str(&format!("%{b:02X}")),
        }
    }
}

/// A `local:` directory as [`local`] reads it back: `%`, a leading `~` and bytes that
/// are not UTF-8 escaped; a leading `//` kept from reading as a host.
pub(super) fn encode_dir(out: &mut String, dir: &Path) {
    let bytes = dir.as_os_str().as_bytes();
    if bytes.starts_with(b"//") {
        out.push_str("//");
    }
    let escape = |out: &mut String, b: u8| out.push_str(&format!("%{b:02X}"));
    match std::str::from_utf8(bytes) {
        Ok(text) => {
            for (i, c) in text.char_indices() {
                match c == '%' || (i == 0 && c == '~') {
                    true => escape(out, c as u8),
                    false => out.push(c),
                }
            }
        }
        Err(_) => {
            for (i, &b) in bytes.iter().enumerate() {
                match b == b'%' || (i == 0 && b == b'~') || !b.is_ascii() {
                    true => escape(out, b),
                    false => out.push(b as char),
                }
            }
        }
    }
}

/// `text` for a message about it when it cannot be parsed: what may be a password (all
/// before the last @, the value of an option not known to be harmless and all after it)
/// is `***`. A `local:` URL holds no secrets and is shown whole.
pub(super) fn redact(text: &str) -> String {
    if text.starts_with("local:") {
        return text.to_string();
    }
    let start = match text.find("://") {
        Some(i) => i + 3,
        None => text.find(':').map_or(0, |i| i + 1),
    };
    let (head, rest) = text.split_at(start);
    let mut out = head.to_string();
    let rest = match rest.rfind('@') {
        Some(at) => {
            out.push_str("***@");
            &rest[at + 1..]
        }
        None => rest,
    };
    let (before, query) = split(rest, '?');
    out.push_str(before);
    let Some(query) = query else {
        return out;
    };
    out.push('?');
    for (i, pair) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        match pair.split_once('=') {
            // What follows may be more of the value (an unescaped &): left out.
            Some((key, _)) if !SHOWN_OPTIONS.contains(&key) => {
                out.push_str(key);
                out.push_str("=***");
                break;
            }
            _ => out.push_str(pair),
        }
    }
    out
}
