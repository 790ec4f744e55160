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
//!     `PX` expiry; while the record below holds anything, a marker that outlives the
//!     record by a second.
//!   - `lh:{NAME}:token`: the fencing token counter, while there is no record.
//!   - `lh:{NAME}`: the record, only while the lock has waiters, re-entered holds,
//!     readers or permits: a string with its holds and queue (format in `record.lua`).
//!     It carries the last token, and expires 48 hours (twice the longest lease) after
//!     its last whole write, so the record of clients that all died goes by itself.
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
//! - Fencing tokens come from the counter key (the record takes the last token while
//!   it exists, and puts it back when it empties); neither is ever lower than a token
//!   given. A record that ends with the lock busy (by its expiry, or lost) leaves no
//!   counter behind, and a counter expires 48 hours after it was started or put back,
//!   so the next token starts from the server's clock (below).
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
//! - Elections: a hold's value (an election leader's) is kept in the record, with the
//!   hold and with the fair waiter it will be handed to; a request with a value never
//!   takes the hot path, and one without adds nothing to it. `proclaim` rewrites the
//!   holder's value in one script (and `downgrade` its kind, handing over to or waking
//!   the readers it admits, as a release does). A `watch` notes itself in the record's header (an
//!   id, its client's channel, an expiry it refreshes every 5 s) and looks in the same
//!   script; while a watcher is noted the record exists, so every call on the lock runs
//!   a record script, which publishes the watcher's id when the holders (owner, token,
//!   value) changed. A watch whose look fails (the server gone) returns the error; a
//!   message lost costs at most the refresh.
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
//!   (a lock as one key) does not see holds in the hold key. Nor can a client of a
//!   release before elections read a lock with a value or a watcher in its record.
//! - A value keeps its text, except the record's separators (`\x1d`-`\x1f`), which
//!   read back as `?`, as in owners and host names.
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
//   the `.lua` files (hot.lua first: see its header), and how they are run: on the
//   lane (lane.rs, connections for one call at a time each) when one is idle, else on the
//   multiplexed connection.
// - acquire.rs: the attempt; store.rs: the `Store` impl, a script run for each call.
// - waker.rs: the client's subscription, and the waiters it wakes.
// - state.rs: describe's JSON; keys.rs: key names; errors.rs: what an error means;
//   durability.rs: what a restart or failover of the server can lose (the caveat).

mod acquire;
mod durability;
mod errors;
mod keys;
mod lane;
mod lua;
mod rate;
mod reply;
mod request;
mod scripts;
mod shared;
mod state;
mod store;
mod waker;

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio_util::task::AbortOnDropHandle;

use crate::builder::ClientSettings;
use crate::{Error, Result, StoreUrl};
use durability::{caveat, cluster_caveat};
use errors::failed;
use shared::SharedConn;
use waker::Waiters;

/// How long connecting may take, unless the builder says otherwise.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one command may take, unless the builder says otherwise.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The builder's TLS settings as the redis crate's; `None` for its defaults (system roots,
/// no client certificate).
fn tls_certificates(settings: &ClientSettings) -> Option<redis::TlsCertificates> {
    (settings.tls_ca.is_some() || settings.tls_identity.is_some()).then(|| redis::TlsCertificates {
        client_tls: (settings.tls_identity.clone()).map(|(client_cert, client_key)| {
            redis::ClientTlsConfig {
                client_cert,
                client_key,
            }
        }),
        root_cert: settings.tls_ca.clone(),
    })
}

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
    /// A single server's connections for calls, one call at a time each (lane.rs).
    lane: Option<Arc<lane::Lane>>,
    channel: String,
    waiters: Arc<Waiters>,
    /// Rate-limiter decisions waiting for a round trip.
    rates: rate::RateCalls,
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
    Single(SharedConn),
    /// With the scheme and credentials to reach each node directly (for `list`).
    Cluster(redis::cluster_async::ClusterConnection, String),
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
        Self::connect_with(&StoreUrl::parse(url)?, &ClientSettings::default()).await
    }

    /// [`connect`](Self::connect) to a parsed URL, reached as `settings` say.
    pub(crate) async fn connect_with(url: &StoreUrl, settings: &ClientSettings) -> Result<Self> {
        let shown = url.to_string();
        let invalid = |reason: String| url.invalid(reason);
        if url.scheme().backend() != "redis" {
            return Err(invalid(
                "not a Redis URL: redis://[user:password@]host:port[/db], rediss://..., or redis+cluster://h1:p1,h2:p2".into(),
            ));
        }
        let replicas = url.replicas();
        let nodes = url.redis_nodes().map_err(|e| invalid(e.to_string()))?;
        let unavailable = |e: redis::RedisError| failed(&shown, e);
        let connect_timeout = settings.connect_timeout.unwrap_or(CONNECT_TIMEOUT);
        let request_timeout = settings.request_timeout.unwrap_or(REQUEST_TIMEOUT);
        let certificates = tls_certificates(settings);
        let client_of = |node: redis::ConnectionInfo| match &certificates {
            Some(certs) => redis::Client::build_with_tls(node, certs.clone()),
            None => redis::Client::open(node),
        };
        // The client's own retries (a connection manager's) each have the whole connect
        // timeout: the connect as a whole must not take longer.
        let connecting = async {
            let (conn, subscribe_to, caveat_found, lane) = match url.scheme().cluster() {
                true => {
                    let prefix = url.redis_node_prefix();
                    let mut builder = redis::cluster::ClusterClient::builder(nodes.clone())
                        .connection_timeout(connect_timeout)
                        .response_timeout(request_timeout);
                    if let Some(certs) = &certificates {
                        builder = builder.certs(certs.clone());
                    }
                    let client = builder.build().map_err(|e| invalid(e.to_string()))?;
                    let mut conn = client.get_async_connection().await.map_err(unavailable)?;
                    let caveat = cluster_caveat(&mut conn, &prefix).await;
                    // PUBLISH reaches every node of a cluster: any one node will do.
                    let first = client_of(nodes[0].clone()).map_err(|e| invalid(e.to_string()))?;
                    (Conn::Cluster(conn, prefix), first, caveat, None)
                }
                false => {
                    let client = client_of(nodes[0].clone()).map_err(|e| invalid(e.to_string()))?;
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(connect_timeout))
                        .set_response_timeout(Some(request_timeout))
                        .set_number_of_retries(2);
                    let mut conn = client
                        .get_connection_manager_with_config(config.clone())
                        .await
                        .map_err(unavailable)?;
                    let caveat = caveat(&mut conn, Some(replicas.is_some())).await;
                    let lane = match replicas {
                        None => lane::Lane::to(client.get_connection_info(), request_timeout),
                        Some(_) => None,
                    };
                    let db = client.get_connection_info().redis_settings().db();
                    let shared = SharedConn::new(conn, Some((client.clone(), config)), db);
                    (Conn::Single(shared), client, caveat, lane)
                }
            };
            match (&caveat_found, url.durable()) {
                (Some(caveat), true) => {
                    return Err(invalid(format!(
                        "?durable=1 asks for a server that loses no lock on a restart, and {caveat}; run it with appendonly yes and appendfsync always"
                    )))
                }
                (Some(caveat), false) => tracing::warn!(store = %shown, "{caveat}"),
                (None, _) => {}
            }
            let found = (caveat_found, lane);
            Self::subscribed(shown.clone(), conn, subscribe_to, replicas, found).await
        };
        let not_in_time = || Error::Unavailable {
            store: shown.clone(),
            source: format!("not connected within {connect_timeout:?}").into(),
        };
        (tokio::time::timeout(connect_timeout, connecting).await)
            .unwrap_or_else(|_| Err(not_in_time()))
            .map_err(|e| url.with_scheme_hint(e))
    }

    /// A store on a connection the application made (its own TLS, timeouts, retries),
    /// with `client` (to the same server) for this store's wake-up subscription.
    /// Replica acknowledgements (`?replicas=N`) and `?durable=1` are URL options: use
    /// [`connect`](Self::connect) for them.
    pub async fn from_connection(
        mut conn: ConnectionManager,
        client: redis::Client,
    ) -> Result<Self> {
        let shown = format!("redis://{}", client.get_connection_info().addr());
        let caveat_found = caveat(&mut conn, Some(false)).await;
        if let Some(caveat) = &caveat_found {
            tracing::warn!(store = %shown, "{caveat}");
        }
        // The application's connection carries every call: no lane of ours beside it.
        let found = (caveat_found, None);
        let db = redis::aio::ConnectionLike::get_db(&conn);
        let shared = SharedConn::new(conn, None, db);
        Self::subscribed(shown, Conn::Single(shared), client, None, found).await
    }

    /// The store on `conn`, once `subscribe_to` has subscribed to its wake-up channel.
    async fn subscribed(
        shown: String,
        conn: Conn,
        subscribe_to: redis::Client,
        replicas: Option<(u32, Duration)>,
        (caveat_found, lane): (Option<String>, Option<Arc<lane::Lane>>),
    ) -> Result<Self> {
        let channel = format!("lh:client:{:032x}", rand::random::<u128>());
        let (waiters, subscriber) = waker::subscribed(subscribe_to, &channel, &shown).await?;
        Ok(RedisStore {
            inner: Arc::new(Inner {
                shown,
                conn,
                replicas,
                caveat: caveat_found,
                lane,
                channel,
                waiters,
                rates: Default::default(),
                _subscriber: subscriber,
            }),
        })
    }
}
