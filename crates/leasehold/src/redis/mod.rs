//! Redis store: every lock under one hash tag, every check-and-change one Lua script.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold::Result<()> {
//! use leasehold::Leasehold;
//! let locks = Leasehold::connect("redis://127.0.0.1:6379/0").await?;
//! let guard = locks.mutex("nightly")?.lock().await?;
//! let _ = guard.release().await?; // Released::NotHeld would say the lease had ended first
//! # Ok(()) }
//! ```
//!
//! # How it works
//! - A lock `NAME` has three keys under one hash tag, `lh:{NAME}` (`%`, `{`, `}`
//!   escaped, so the tag is the whole name), and every script is given all three, so
//!   scripts run unchanged on Redis Cluster:
//!   - `lh:{NAME}:hold`: an exclusive hold with nobody waiting, as Redis's own key with
//!     `PX` expiry; while the record below holds anything, a marker without expiry.
//!   - `lh:{NAME}:token`: the fencing token counter (never deleted).
//!   - `lh:{NAME}`: the record, only while the lock has waiters, re-entered holds,
//!     readers or permits: a string with its holds and queue (format in `record.lua`).
//!
//!   The commonest calls (acquiring a free lock, releasing, renewing or handing over a
//!   hold with nobody waiting) are `SET NX PX` with `INCR`, `GET` with `DEL`, and so
//!   on, in `hot.lua`, without reading the record or the server's time. Everything
//!   else reads the record, decides and writes it back (taking a hold from the hold key
//!   in first); fast paths read and write only the part of the record they change (see
//!   `record.lua` and `*_fast.lua`). Scripts are `*.lua` beside this file, loaded once,
//!   run by EVALSHA; each is one atomic step.
//! - Leases expire on the server's clock (`TIME`, or Redis's own key expiry), never a
//!   client's.
//! - Fencing tokens come from the counter key (the record carries the last token while
//!   it exists); neither is ever lower than a token given.
//! - Waiting: each client subscribes once, on one connection, to a channel of its own.
//!   When a hold or a waiter goes away, the script publishes to the channels of the
//!   waiters that may now get in (the queue head, readers behind a reading head, permit
//!   waiters for the free permits), naming their acquisitions; the client wakes exactly
//!   those. A lost message costs at most the holder's remaining lease: waiters also
//!   retry when it ends.
//! - Tasks of one process waiting for one mutex wait in the process behind the one of
//!   them in the queue; a release hands the lock to the next in the same script. A fair
//!   task handed over takes its place in the queue by when it arrived in its process
//!   (entries record arrival on the server's clock), so FIFO holds across processes.
//!
//! - A rate limiter `NAME` is one key, `lh:rate:{NAME}`: its theoretical arrival time
//!   in microseconds of the server's clock. Each decision is one EVALSHA of
//!   `rate.lua` (`TIME`, `GET`, and `SET … PX` when it lets units through), which
//!   expires the key when the limiter would be back to full burst: an idle limiter
//!   leaves nothing behind. A server that restarts without persistence (or fails over
//!   to a replica that missed the write) forgets it: the limiter starts again at full
//!   burst. A call in flight when the connection drops is sent once more.
//!
//! # Guarantees and limits
//! - One Redis server is one point of truth. With replicas, a failover to a replica that
//!   had not received the latest writes can hand a held lock to a second holder and
//!   repeat fencing tokens; keep the fencing check at the resource.
//! - A name's token counter that is missing (a new name, or one Redis forgot in a
//!   restart without persistence) starts from the server's clock (`TIME`, in
//!   microseconds), so tokens rise across such a restart as long as the server's clock
//!   does not step back. A counter that is there but behind (a failover to a replica that
//!   missed writes) can still repeat tokens: see the replica option.
//! - A hold key has an expiry, so a server evicting keys (`maxmemory-policy` other than
//!   `noeviction`) could evict a held lock. Keep lock keys on a server that does not
//!   evict.
//! - Every client of one lock must use this key layout: a client of a release before it
//!   (a lock as one key) does not see holds in the hold key.
//! - A client that cannot reach Redis stops being able to renew: its guards fire `lost`
//!   at their safe deadline. When Redis answers again within that deadline, renewal
//!   resumes.

// Where things are, following one acquire (`Lock::lock` -> `Store::acquire`, store.rs ->
// `RedisStore::attempt`, acquire.rs, which makes a `request::Acquire` -> `run`,
// scripts.rs: one EVALSHA of the acquire script -> `reply::AcquireReply` -> `Attempt`):
// - request.rs: each script's request, one list of named fields: it packs the arguments,
//   and lua.rs writes from it the Lua that names them (`req_ttl`).
// - reply.rs: each reply's shape, its fields by name; the typed replies Rust reads. The
//   scripts give replies by name (`reply.granted{...}`), written out by lua.rs.
// - lua.rs: the Lua written from those lists; scripts.rs: the scripts made from it and
//   the `.lua` files (hot.lua first: see its header), and how they are run.
// - acquire.rs: the attempt; store.rs: the `Store` impl, a script run for each call.
// - waker.rs: the client's subscription, and the waiters it wakes.
// - state.rs: describe's JSON; keys.rs: key names; errors.rs: what an error means;
//   durability.rs: what a restart or failover of the server can lose (the caveat).

mod acquire;
mod durability;
mod errors;
mod keys;
mod lua;
mod reply;
mod request;
mod scripts;
mod state;
mod store;
mod waker;

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio_util::task::AbortOnDropHandle;

use crate::{Error, Result};
use durability::{caveat, cluster_caveat};
use errors::failed;
use waker::Waiters;

/// The Redis store. Cheap to clone; clones share one connection and one subscription.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    shown: String,
    conn: Conn,
    /// `?replicas=N[&replica_timeout=DUR]`: replicas that must acknowledge a grant.
    replicas: Option<(u32, Duration)>,
    /// What a restart or failover of the server can lose (see [`caveat`]).
    caveat: Option<String>,
    channel: String,
    waiters: Arc<Waiters>,
    _subscriber: AbortOnDropHandle<()>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.inner.shown)
            .finish()
    }
}

/// One multiplexed connection (reconnecting), to a server or to a cluster.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    /// With the scheme and credentials to reach each node directly (for `list`).
    Cluster(redis::cluster_async::ClusterConnection, String),
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

/// leasehold's own options in a Redis URL's query.
#[derive(Debug, Default, PartialEq)]
struct UrlOptions {
    /// `replicas=N[&replica_timeout=DUR]`.
    replicas: Option<(u32, Duration)>,
    /// `durable=1`: refuse a server whose restart can lose locks.
    durable: bool,
}

/// Takes leasehold's own options (`replicas`, `replica_timeout`, `durable`) out of the
/// URL's query, and refuses parameters nobody reads (a misspelt `replicas` must not pass
/// unnoticed).
fn url_options(url: &str) -> std::result::Result<(String, UrlOptions), String> {
    // A fragment (`#insecure`, read by the redis crate) follows the query: set it aside.
    let (url, fragment) = match url.split_once('#') {
        Some((url, fragment)) => (url, format!("#{fragment}")),
        None => (url, String::new()),
    };
    let Some((base, query)) = url.split_once('?') else {
        return Ok((format!("{url}{fragment}"), UrlOptions::default()));
    };
    let (mut want, mut timeout, mut rest) = (None, Duration::from_millis(100), Vec::new());
    let mut durable = false;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("replicas", n)) => {
                want = Some(n.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| {
                    format!("replicas={n}: give how many replicas must confirm a grant, at least 1")
                })?)
            }
            Some(("replica_timeout", t)) => {
                timeout = parse_millis(t).ok_or_else(|| {
                    format!("replica_timeout={t}: give a duration like 100ms or 1s")
                })?
            }
            Some(("durable", flag)) => {
                durable = match flag {
                    "1" | "true" | "yes" => true,
                    "0" | "false" | "no" => false,
                    _ => return Err(format!("durable={flag}: give 1 or 0")),
                }
            }
            // The one the redis crate reads from a server URL: passed on.
            Some(("protocol", _)) => rest.push(pair),
            _ => {
                let key = pair.split_once('=').map_or(pair, |(key, _)| key);
                return Err(format!(
                    "unknown URL parameter {key:?}: a Redis URL takes replicas=N, replica_timeout=DUR, durable=1 and protocol=resp2|resp3"
                ));
            }
        }
    }
    let url = if rest.is_empty() {
        format!("{base}{fragment}")
    } else {
        format!("{base}?{}{fragment}", rest.join("&"))
    };
    let replicas = want.map(|w| (w, timeout));
    Ok((url, UrlOptions { replicas, durable }))
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
        .map(Duration::from_secs_f64)
}

/// The node URLs of a `redis+cluster://` or `rediss+cluster://` URL, and their common
/// start (scheme and credentials) for reaching other nodes; `None` for other URLs.
fn cluster_nodes(url: &str) -> Option<std::result::Result<(String, Vec<String>), String>> {
    let (scheme, rest) = url.split_once("://")?;
    let plain = scheme.strip_suffix("+cluster")?;
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), rest),
    };
    let hosts = hosts.trim_end_matches('/');
    if hosts.is_empty() || hosts.contains('/') {
        return Some(Err(format!(
            "a cluster URL lists seed nodes, e.g. {plain}+cluster://h1:6379,h2:6379 (no database: a cluster has only db 0)"
        )));
    }
    let prefix = format!("{plain}://{auth}");
    let nodes = hosts.split(',').map(|h| format!("{prefix}{h}")).collect();
    Some(Ok((prefix, nodes)))
}

impl RedisStore {
    /// Connects to `redis://[user:pass@]host:port[/db]`, `rediss://...` (TLS), or a
    /// Redis Cluster given as `redis+cluster://[user:pass@]h1:p1,h2:p2` (`rediss+cluster`
    /// for TLS), and subscribes to this client's wake-up channel.
    ///
    /// `?replicas=N` (with `&replica_timeout=DUR`, default 100ms) makes every grant wait
    /// until N replicas have it (`WAIT`); a grant they do not confirm in time is released
    /// and the attempt fails as unavailable. Single servers only.
    pub async fn connect(url: &str) -> Result<Self> {
        let shown = redact(url);
        let invalid = |reason: String| Error::InvalidStore {
            store: shown.clone(),
            reason,
        };
        let (url, options) = url_options(url).map_err(invalid)?;
        let replicas = options.replicas;
        let url = url.as_str();
        if replicas.is_some() && cluster_nodes(url).is_some() {
            return Err(invalid(
                "?replicas is for a single server; a cluster's WAIT is per node".into(),
            ));
        }
        let unavailable = |e: redis::RedisError| failed(&shown, e);
        let (conn, subscribe_to, caveat_found) = match cluster_nodes(url) {
            Some(nodes) => {
                let (prefix, nodes) = nodes.map_err(invalid)?;
                let client = redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(Duration::from_secs(3))
                    .response_timeout(Duration::from_secs(5))
                    .build()
                    .map_err(|e| invalid(e.to_string()))?;
                let mut conn = client.get_async_connection().await.map_err(unavailable)?;
                let caveat = cluster_caveat(&mut conn, &prefix).await;
                // PUBLISH reaches every node of a cluster: any one node will do.
                let first =
                    redis::Client::open(nodes[0].as_str()).map_err(|e| invalid(e.to_string()))?;
                (Conn::Cluster(conn, prefix), first, caveat)
            }
            None => {
                let client = redis::Client::open(url).map_err(|e| {
                    invalid(format!("{e}; expected redis://[user:password@]host:port[/db], rediss://..., or redis+cluster://h1:p1,h2:p2"))
                })?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(3)))
                    .set_response_timeout(Some(Duration::from_secs(5)))
                    .set_number_of_retries(2);
                let mut conn = client
                    .get_connection_manager_with_config(config)
                    .await
                    .map_err(unavailable)?;
                let caveat = caveat(&mut conn, Some(replicas.is_some())).await;
                (Conn::Single(conn), client, caveat)
            }
        };
        match (&caveat_found, options.durable) {
            (Some(caveat), true) => {
                return Err(invalid(format!(
                    "?durable=1 asks for a server that loses no lock on a restart, and {caveat}; run it with appendonly yes and appendfsync always"
                )))
            }
            (Some(caveat), false) => tracing::warn!(store = %shown, "{caveat}"),
            (None, _) => {}
        }
        let channel = format!("lh:client:{:032x}", rand::random::<u128>());
        let (waiters, subscriber) = waker::subscribed(subscribe_to, &channel, &shown).await?;
        Ok(RedisStore {
            inner: Arc::new(Inner {
                shown,
                conn,
                replicas,
                caveat: caveat_found,
                channel,
                waiters,
                _subscriber: subscriber,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_options_are_taken_out_and_unknown_ones_refused() {
        let ms = Duration::from_millis;
        let replicas = |replicas| UrlOptions {
            replicas,
            durable: false,
        };
        assert_eq!(
            url_options("rediss://h:1/0?replicas=2&protocol=resp3#insecure"),
            Ok((
                "rediss://h:1/0?protocol=resp3#insecure".into(),
                replicas(Some((2, ms(100))))
            ))
        );
        assert_eq!(
            url_options("redis://h:1?replica_timeout=2s&replicas=1"),
            Ok(("redis://h:1".into(), replicas(Some((1, ms(2000))))))
        );
        assert_eq!(
            url_options("rediss://h:1/#insecure"),
            Ok(("rediss://h:1/#insecure".into(), replicas(None)))
        );
        let durable = UrlOptions {
            replicas: None,
            durable: true,
        };
        assert_eq!(
            url_options("redis://h:1?durable=1"),
            Ok(("redis://h:1".into(), durable))
        );
        assert!(url_options("redis://h:1?durable=maybe").is_err());
        let misspelt = url_options("redis://h:1?replica=1").unwrap_err();
        assert!(misspelt.contains("\"replica\""), "{misspelt}");
    }
}
