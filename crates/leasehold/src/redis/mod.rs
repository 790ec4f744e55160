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

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};
use serde::Deserialize;
use tokio::sync::Notify;
use tokio_util::task::AbortOnDropHandle;

use crate::options::waiter_lease;
use crate::store::{
    busy_states, AcquireRequest, Attempt, Busy, Capabilities, Grant, HolderInfo, Lease, LeaseId,
    LockKind, LockState, RateRequest, Released, Renewal, Store, WaiterInfo, Watermark,
};
use crate::{rules, Error, FencingToken, LockName, Result, StoreUrl};
use crate::{Locked, RateDecision};

struct Scripts {
    acquire: Script,
    transfer: Script,
    renew: Script,
    release: Script,
    force: Script,
    held: Script,
    describe: Script,
    rate: Script,
}

fn scripts() -> &'static Scripts {
    static SCRIPTS: OnceLock<Scripts> = OnceLock::new();
    // hot.lua serves the commonest calls (HOT) from the hold key; read.lua reads the
    // record (an acquire only its first KB at first, a release its first 3 KB, with the
    // head of the queue); record.lua parses it; a fast path may answer the common case;
    // common.lua defines the general code that the script's own file then runs.
    macro_rules! script {
        ($prefix:literal; $($fast:literal,)* => $($file:literal),+) => {
            Script::new(concat!(
                $prefix, "\n",
                include_str!("hot.lua"), "\n",
                include_str!("read.lua"), "\n",
                include_str!("record.lua"), "\n",
                $(include_str!($fast), "\n",)*
                include_str!("common.lua"),
                $("\n", include_str!($file)),+
            ))
        };
    }
    SCRIPTS.get_or_init(|| Scripts {
        acquire: script!("local PREFIX, HOT = 1024, 'acquire'"; "acquire_fast.lua", => "acquire.lua"),
        transfer: script!("local PREFIX, HOT = 1024, 'transfer'"; "acquire_fast.lua", => "transfer.lua", "acquire.lua"),
        renew: script!("local PREFIX, HOT = nil, 'renew'"; => "renew.lua"),
        release: script!("local PREFIX, HOT = 3072, 'release'"; "release_fast.lua", => "release.lua"),
        force: script!("local PREFIX, HOT"; => "force.lua"),
        held: script!("local PREFIX, HOT = nil, 'held'"; => "held.lua"),
        describe: script!("local PREFIX, HOT"; => "describe.lua"),
        // Alone: a limiter's decision needs none of the locks' code.
        rate: Script::new(include_str!("rate.lua")),
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

/// This client's waiting acquisitions, by lease id, woken by messages naming them.
#[derive(Debug, Default)]
struct Waiters(Mutex<HashMap<LeaseId, Arc<Slot>>>);

/// One waiting acquisition: woken, and told its token if the lock was handed to it.
#[derive(Debug, Default)]
struct Slot {
    wake: Notify,
    /// Token and lease (ms) of a lock handed over by a script.
    granted: Mutex<Option<(u64, u64)>>,
    /// Told when the hold was taken away (force-release).
    gone: Notify,
    /// Told after every (re)subscription: messages may have been missed, and a server
    /// that came back may have forgotten the hold.
    look_again: Notify,
    /// An attempt was sent: the acquisition may be queued.
    sent: std::sync::atomic::AtomicBool,
}

impl Waiters {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<LeaseId, Arc<Slot>>> {
        self.0.locked()
    }
    fn register(&self, lease: &LeaseId) -> Arc<Slot> {
        self.map().entry(lease.clone()).or_default().clone()
    }
    fn forget(&self, lease: &str) {
        self.map().remove(lease);
    }
    /// One item of a message: `LEASE` (look again), `LEASE=TOKEN:MS` (handed over
    /// with a lease of MS) or `LEASE!` (the hold was taken away). `notify_one` keeps the wake-up for a waiter that is between
    /// two looks.
    fn deliver(&self, item: &str) {
        if let Some(lease) = item.strip_suffix('!') {
            if let Some(slot) = self.map().get(lease) {
                slot.gone.notify_one();
            }
            return;
        }
        let (lease, token) = match item.split_once('=') {
            Some((lease, grant)) => {
                let parsed = grant
                    .split_once(':')
                    .and_then(|(t, ms)| Some((t.parse().ok()?, ms.parse().ok()?)));
                (lease, parsed)
            }
            None => (item, None),
        };
        if let Some(slot) = self.map().get(lease) {
            if token.is_some() {
                *slot.granted.locked() = token;
            }
            slot.wake.notify_one();
        }
    }
    fn wake_all(&self) {
        self.map().values().for_each(|s| {
            s.wake.notify_one();
            s.look_again.notify_waiters();
        });
    }
}

/// A Redis error as ours: refusals that retrying cannot fix (credentials, ACL
/// permissions, an unknown database) are [`Error::Config`]; the rest are
/// [`Error::Unavailable`].
fn failed(store: &str, e: redis::RedisError) -> Error {
    use redis::{ErrorKind, ServerErrorKind};
    let text = e.to_string();
    let config = match e.kind() {
        ErrorKind::AuthenticationFailed => Some("check the URL's user and password"),
        ErrorKind::Server(ServerErrorKind::NoPerm) => {
            Some("the user lacks a permission leasehold needs (EVALSHA, PUBLISH, SUBSCRIBE)")
        }
        _ if matches!(e.code(), Some("WRONGPASS" | "NOAUTH")) => {
            Some("check the URL's user and password")
        }
        _ if text.contains("DB index is out of range") || text.contains("invalid DB index") => {
            Some("the database in the URL (/N) does not exist on this server")
        }
        _ => None,
    };
    match config {
        Some(what) => Error::Config {
            store: store.to_string(),
            reason: format!("{text}; {what}"),
        },
        None => Error::Unavailable {
            store: store.to_string(),
            source: Box::new(e),
        },
    }
}

/// What a restart or failover of the server behind `conn` can lose, from its settings:
/// `None` when nothing (the append-only file written before every answer, no replicas
/// or `?replicas`), or when it does not say (`CONFIG` renamed away, as on some hosted
/// Redis). `replicas`: `Some(asked)` on a single server, where `?replicas` can make
/// grants wait for replicas; `None` on a cluster's node, where it cannot.
async fn caveat<C>(conn: &mut C, replicas: Option<bool>) -> Option<String>
where
    C: redis::aio::ConnectionLike + Clone + Send,
{
    let info = |section: &'static str| {
        let mut conn = conn.clone();
        async move {
            redis::cmd("INFO")
                .arg(section)
                .query_async::<String>(&mut conn)
                .await
                .ok()
        }
    };
    let field = |text: &str, name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    };
    let persistence = info("persistence").await?;
    let fsync: Option<(String, String)> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("appendfsync")
        .query_async(&mut conn.clone())
        .await
        .ok();
    let mut risks = Vec::new();
    match (field(&persistence, "aof_enabled").as_deref(), fsync) {
        (Some("0"), _) => risks.push(
            "a restart forgets every held lock (appendonly no), so a waiter can be granted a lock whose holder has not yet learned that it is gone",
        ),
        (Some(_), Some((_, fsync))) if fsync != "always" => risks.push(
            "a crash can lose the last second of lock changes (appendfsync is not always): a lock granted then can be granted again, with a token given before",
        ),
        _ => {}
    }
    let replication = info("replication").await.unwrap_or_default();
    let replicated = field(&replication, "role").as_deref() == Some("slave")
        || field(&replication, "connected_slaves").is_some_and(|n| n != "0");
    match replicas {
        Some(false) if replicated => risks.push("a failover to a replica that missed writes can grant a held lock again (use ?replicas=N)"),
        None if replicated => risks.push("a failover to a replica that missed writes can grant a held lock again"),
        _ => {}
    }
    (!risks.is_empty()).then(|| risks.join("; "))
}

/// What a restart or failover of a cluster's masters can lose, each asked as a server of
/// its own (a lock lives on the master of its slot): every distinct risk once, with the
/// masters it applies to unless it is all of them. A master that cannot be asked is left
/// out, as a server that does not say is.
async fn cluster_caveat(
    conn: &mut redis::cluster_async::ClusterConnection,
    prefix: &str,
) -> Option<String> {
    let masters = cluster_masters(conn).await.ok()?;
    let asked = masters.iter().map(|addr| async move {
        let client = redis::Client::open(format!("{prefix}{addr}"))?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(3)))
            .set_response_timeout(Some(Duration::from_secs(5)));
        let mut conn = (client.get_multiplexed_async_connection_with_config(&config)).await?;
        redis::RedisResult::Ok((addr, caveat(&mut conn, None).await))
    });
    let mut risks: Vec<(String, Vec<&String>)> = Vec::new();
    for answer in futures_util::future::join_all(asked).await {
        let Ok((addr, Some(caveat))) = answer else {
            continue;
        };
        match risks.iter_mut().find(|(c, _)| *c == caveat) {
            Some((_, addrs)) => addrs.push(addr),
            None => risks.push((caveat, vec![addr])),
        }
    }
    let named = risks.into_iter().map(|(caveat, addrs)| {
        let addrs: Vec<&str> = addrs.iter().map(|a| a.as_str()).collect();
        match addrs.len() == masters.len() {
            true => caveat,
            false => format!("on master {}: {caveat}", addrs.join(", ")),
        }
    });
    let named: Vec<String> = named.collect();
    (!named.is_empty()).then(|| named.join("; "))
}

/// The `host:port` of each master of a cluster that is not failed.
async fn cluster_masters(
    conn: &mut redis::cluster_async::ClusterConnection,
) -> redis::RedisResult<Vec<String>> {
    let nodes: String = redis::cmd("CLUSTER").arg("NODES").query_async(conn).await?;
    let masters = (nodes.lines())
        .filter(|l| l.contains("master") && !l.contains("fail"))
        .filter_map(|l| l.split_whitespace().nth(1)?.split('@').next())
        .map(String::from);
    Ok(masters.collect())
}

/// `lh:{NAME}` with `%`, `{` and `}` escaped, so the whole name is the hash tag: the
/// lock's record. Its hold key and token counter add `:hold` and `:token` (see hot.lua).
fn key(name: &LockName) -> String {
    let mut key = String::new();
    push_key(&mut key, name);
    key
}

/// Appends [`key`]`(name)` to `out`.
fn push_key(out: &mut String, name: &LockName) {
    out.push_str("lh:{");
    out.push_str(&key_escape(name.as_str()));
    out.push('}');
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
        Self::connect_url(&StoreUrl::parse(url)?).await
    }

    /// [`connect`](Self::connect) to a parsed URL.
    pub(crate) async fn connect_url(url: &StoreUrl) -> Result<Self> {
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
        let (conn, subscribe_to, caveat_found) = match url.scheme().cluster() {
            true => {
                let prefix = url.redis_node_prefix();
                let client = redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(Duration::from_secs(3))
                    .response_timeout(Duration::from_secs(5))
                    .build()
                    .map_err(|e| invalid(e.to_string()))?;
                let mut conn = client.get_async_connection().await.map_err(unavailable)?;
                let caveat = cluster_caveat(&mut conn, &prefix).await;
                // PUBLISH reaches every node of a cluster: any one node will do.
                let first =
                    redis::Client::open(nodes[0].clone()).map_err(|e| invalid(e.to_string()))?;
                (Conn::Cluster(conn, prefix), first, caveat)
            }
            false => {
                let client =
                    redis::Client::open(nodes[0].clone()).map_err(|e| invalid(e.to_string()))?;
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
        match (&caveat_found, url.durable()) {
            (Some(caveat), true) => {
                return Err(invalid(format!(
                    "?durable=1 asks for a server that loses no lock on a restart, and {caveat}; run it with appendonly yes and appendfsync always"
                )))
            }
            (Some(caveat), false) => tracing::warn!(store = %shown, "{caveat}"),
            (None, _) => {}
        }
        let channel = format!("lh:client:{:032x}", rand::random::<u128>());
        let waiters = Arc::new(Waiters::default());
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let subscriber = tokio::spawn(subscribe(
            subscribe_to,
            channel.clone(),
            waiters.clone(),
            ready_tx,
        ));
        match tokio::time::timeout(Duration::from_secs(5), ready_rx).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => return Err(unavailable(e)),
            _ => {
                return Err(Error::Unavailable {
                    store: shown,
                    source: "no answer to SUBSCRIBE within 5s".into(),
                })
            }
        }
        Ok(RedisStore {
            inner: Arc::new(Inner {
                shown,
                conn,
                replicas,
                caveat: caveat_found,
                channel,
                waiters,
                _subscriber: AbortOnDropHandle::new(subscriber),
            }),
        })
    }

    /// An acquire attempt, after releasing `from` in the same script when given.
    async fn attempt(
        &self,
        req: &AcquireRequest,
        from: Option<&Lease>,
    ) -> Result<(Released, Attempt)> {
        let lease = req.lease.as_str();
        // Registered before the attempt, so a wake-up sent right after it is not missed.
        let first = req.enqueue
            && !(self.inner.waiters.register(&req.lease).sent).swap(true, Ordering::SeqCst);
        let permits = match req.kind {
            LockKind::Permit { permits } => permits,
            _ => 0,
        };
        // Packed in three arguments (see hot.lua): the value of a hot hold, the TTL, the rest.
        let hold = [
            Arg::Text(lease),
            Arg::Text(&req.owner),
            Arg::Num(wall_ms()),
            Arg::Text(&req.requester.host),
            Arg::Num(req.requester.pid.into()),
            Arg::Text(&self.inner.channel),
        ];
        let rest = [
            Arg::Text(req.kind.word()),
            Arg::Num(permits.into()),
            Arg::Num(req.fair.into()),
            Arg::Num(req.enqueue.into()),
            Arg::Num(waiter_lease(req.ttl).as_millis() as u64),
            Arg::Fresh(first),
        ];
        let ttl = Arg::Num(req.ttl.as_millis() as u64);
        let (script, args) = match from {
            Some(from) => (
                &scripts().transfer,
                &[
                    Arg::Joined(&hold),
                    ttl,
                    Arg::Joined(&rest),
                    Arg::Text(from.id.as_str()),
                    Arg::Num(req.waited.as_millis() as u64),
                ][..],
            ),
            // A request that waited in its process (its gate's turn came without a
            // hand-over) says how long, as a transfer's does, in the same place; the
            // empty text where a transfer names its released hold keeps it off the
            // tail-only fast path.
            None if !req.waited.is_zero() => (
                &scripts().acquire,
                &[
                    Arg::Joined(&hold),
                    ttl,
                    Arg::Joined(&rest),
                    Arg::Text(""),
                    Arg::Num(req.waited.as_millis() as u64),
                ][..],
            ),
            None => (
                &scripts().acquire,
                &[Arg::Joined(&hold), ttl, Arg::Joined(&rest)][..],
            ),
        };
        let reply: Value = match self.run(script, &req.name, args).await {
            Err(Error::Conflict { name, reason }) => {
                return Err(Error::Conflict {
                    name,
                    reason: refusal(&reason, req),
                })
            }
            reply => reply?,
        };
        // A grant by hot.lua is its token alone: one hold, and a transfer's hold was held.
        let (granted, released, reply) = match reply {
            Value::Int(token) => {
                let released = from.map_or(Released::NotHeld, |_| Released::Released);
                (Some((token, 1)), released, Vec::new())
            }
            Value::Array(reply) => {
                let released = match reply.last().map(int) {
                    Some(1) => Released::Released,
                    _ => Released::NotHeld,
                };
                let granted = (reply.first().map(int) == Some(1) && reply.len() >= 4)
                    .then(|| (int(&reply[1]), int(&reply[2])));
                (granted, released, reply)
            }
            other => {
                return Err(Error::Internal(format!(
                    "unexpected reply from the acquire script: {other:?}"
                )))
            }
        };
        if let Some((token, holds)) = granted {
            self.inner.waiters.forget(lease);
            // Not on enough replicas (a failover could lose it): the error makes the
            // caller undo the acquisition by its id.
            self.replicated(&req.name).await?;
            let grant = Grant {
                token: FencingToken(token as u64),
                holds: holds as u32,
                lease: None,
            };
            return Ok((released, Attempt::Granted(grant)));
        }
        if reply.len() < 14 {
            return Err(Error::Internal(format!(
                "unexpected reply from the acquire script: {reply:?}"
            )));
        }
        let holder = (!text(&reply[4]).is_empty()).then(|| HolderInfo {
            owner: text(&reply[4]),
            host: text(&reply[5]),
            pid: int(&reply[6]) as u32,
            token: FencingToken(int(&reply[7]) as u64),
            since: since(int(&reply[8])),
            lease_left: Duration::from_millis(int(&reply[9]).max(0) as u64),
            holds: int(&reply[10]) as u32,
            kind: kind(&text(&reply[11]), int(&reply[12])),
        });
        let position = int(&reply[1]);
        let retry_in = int(&reply[2]);
        let busy = Busy {
            holder,
            position: (position > 0).then_some(position as usize),
            retry_in: (retry_in >= 0).then(|| Duration::from_millis(retry_in as u64)),
            watermark: Watermark(int(&reply[3]) as u64),
        };
        Ok((released, Attempt::Busy(busy)))
    }

    fn error(&self, e: redis::RedisError, name: &LockName) -> Error {
        // A script that failed on what it read (a key of ours that something else wrote,
        // of another type or format): unreadable state, not a store that is away.
        let text = e.to_string();
        if text.contains("user_script:") || text.contains("WRONGTYPE") {
            return Error::Corrupt {
                store: self.inner.shown.clone(),
                name: name.to_string(),
                reason: format!(
                    "{} (or its :hold or :token key) does not hold leasehold's data ({text}); delete those keys to start the lock afresh (tokens then start again from the server's clock)",
                    key(name)
                ),
            };
        }
        if let Some(reason) = e.detail().filter(|_| e.code() == Some("LHCONFLICT")) {
            return Error::Conflict {
                name: name.to_string(),
                reason: reason.to_string(),
            };
        }
        if let Some(reason) = e
            .to_string()
            .split_once("LHCONFLICT ")
            .map(|(_, r)| r.to_string())
        {
            return Error::Conflict {
                name: name.to_string(),
                reason,
            };
        }
        failed(&self.inner.shown, e)
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        name: &LockName,
        args: &[Arg<'_>],
    ) -> Result<T> {
        // EVALSHA built here rather than through redis::ScriptInvocation, which copies
        // every argument twice: this is the hot path of every lock call.
        let command = |resent: bool| {
            let mut cmd = redis::Cmd::with_capacity(args.len() + 6, 512);
            // The record's key, then its hold key and token counter (see hot.lua), then
            // the packed arguments, each made in one buffer sized for them.
            let mut text = String::with_capacity(name.as_str().len() + 256);
            push_key(&mut text, name);
            let record = text.len();
            cmd.arg("EVALSHA").arg(script.get_hash()).arg(3).arg(&text);
            text.push_str(":hold");
            cmd.arg(&text);
            text.truncate(record);
            text.push_str(":token");
            cmd.arg(&text);
            for arg in args {
                match arg {
                    Arg::Num(n) => cmd.arg(*n),
                    Arg::Text(s) if !s.contains(SEPARATORS) => cmd.arg(*s),
                    arg => {
                        text.clear();
                        arg.write(&mut text, resent);
                        cmd.arg(&text)
                    }
                };
            }
            cmd
        };
        // Every script is safe to repeat for its lease id. (A release whose first send
        // took effect then answers "not held": the cautious answer, as the two cannot be
        // told apart.)
        (self.send(script, command).await).map_err(|e| self.error(e, name))
    }

    /// Runs the EVALSHA `command(resent)` builds; a call that met a dropped connection
    /// (a server restart) is sent once more, on the reconnected one, built with `resent`.
    async fn send<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        mut command: impl FnMut(bool) -> redis::Cmd,
    ) -> redis::RedisResult<T> {
        let mut cmd = command(false);
        let mut sent = 0;
        loop {
            sent += 1;
            if sent > 1 {
                cmd = command(true);
            }
            let result = match self.inner.conn.clone() {
                Conn::Single(mut c) => eval(&cmd, script, &mut c).await,
                Conn::Cluster(mut c, _) => eval(&cmd, script, &mut c).await,
            };
            match result {
                Err(e)
                    if sent == 1
                        && (e.is_io_error()
                            || e.is_connection_dropped()
                            || e.is_connection_refusal()) =>
                {
                    tracing::debug!(error = %e, "redis connection dropped; sending again");
                }
                result => return result,
            }
        }
    }

    /// With `?replicas=N`: waits until N replicas have our writes so far (`WAIT`).
    async fn replicated(&self, name: &LockName) -> Result<()> {
        let (Some((want, timeout)), Conn::Single(mut conn)) =
            (self.inner.replicas, self.inner.conn.clone())
        else {
            return Ok(());
        };
        let acked: u32 = redis::cmd("WAIT")
            .arg(want)
            .arg(timeout.as_millis() as u64)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.error(e, name))?;
        if acked >= want {
            return Ok(());
        }
        Err(Error::Unavailable {
            store: self.inner.shown.clone(),
            source: format!(
                "lock \"{name}\" was granted but only {acked} of {want} replicas confirmed it within {}; it was released",
                crate::humanize(timeout)
            )
            .into(),
        })
    }

    /// Every key of ours that matches `pattern`, from each master when clustered.
    async fn scan(&self, pattern: &str) -> Result<Vec<String>> {
        let unavailable = |e: redis::RedisError| failed(&self.inner.shown, e);
        let mut conns = Vec::new();
        match self.inner.conn.clone() {
            Conn::Single(c) => conns.push(c),
            Conn::Cluster(mut c, prefix) => {
                for addr in cluster_masters(&mut c).await.map_err(unavailable)? {
                    let client =
                        redis::Client::open(format!("{prefix}{addr}")).map_err(unavailable)?;
                    conns.push(client.get_connection_manager().await.map_err(unavailable)?);
                }
            }
        }
        let mut keys = Vec::new();
        for mut conn in conns {
            let mut iter = redis::AsyncCommands::scan_match::<_, String>(&mut conn, pattern)
                .await
                .map_err(unavailable)?;
            while let Some(k) = iter.next_item().await {
                keys.push(k.map_err(unavailable)?);
            }
        }
        Ok(keys)
    }
}

/// The subscription task: one connection, one channel, reconnecting as needed. After
/// every (re)subscription all waiters look again, since messages may have been missed.
async fn subscribe(
    client: redis::Client,
    channel: String,
    waiters: Arc<Waiters>,
    ready: tokio::sync::oneshot::Sender<redis::RedisResult<()>>,
) {
    let mut ready = Some(ready);
    loop {
        let subscribed = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        }
        .await;
        match subscribed {
            Ok(mut pubsub) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Ok(()));
                }
                waiters.wake_all();
                let mut messages = pubsub.on_message();
                while let Some(msg) = messages.next().await {
                    if let Ok(leases) = msg.get_payload::<String>() {
                        leases.split(',').for_each(|item| waiters.deliver(item));
                    }
                }
                tracing::debug!("redis subscription ended; reconnecting");
            }
            Err(e) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Err(e));
                    return;
                }
                tracing::debug!(error = %e, "redis subscription failed; retrying");
            }
        }
        waiters.wake_all();
        tokio::time::sleep(crate::keepalive::jitter(Duration::from_millis(200))).await;
    }
}

/// One script argument.
enum Arg<'a> {
    Text(&'a str),
    Num(u64),
    /// 1 if nothing was sent for this acquisition before (so it is not queued), else 0;
    /// always 0 when the call is sent again (the first send may have arrived).
    Fresh(bool),
    /// Several in one argument, separated by \x1f.
    Joined(&'a [Arg<'a>]),
}

/// The message for a refusal by acquire.lua ("CODE KIND PERMITS", see its header): the
/// lock rules' own words (rules.rs), or the script's text if it is not one of them.
fn refusal(answer: &str, req: &AcquireRequest) -> String {
    let mut words = answer.split(' ');
    let (code, kind, permits) = (words.next(), words.next(), words.next());
    let permits = permits.and_then(|p| p.parse().ok()).unwrap_or(0);
    let used = match kind {
        Some("exclusive") => LockKind::Exclusive,
        Some("shared") => LockKind::Shared,
        _ => LockKind::Permit { permits },
    };
    let ask = rules::Ask {
        owner: &req.owner,
        kind: req.kind,
        fair: req.fair,
    };
    match code.and_then(|code| rules::Refusal::from_code(code, &ask, used)) {
        Some(refusal) => refusal.message(),
        None => answer.to_string(),
    }
}

/// The separators of the record's fields (see record.lua): replaced by `?` in any text
/// sent, so no text can forge a field.
const SEPARATORS: [char; 3] = ['\x1d', '\x1e', '\x1f'];

impl Arg<'_> {
    /// Appends the argument as the script reads it; `resent` when the call is sent again.
    fn write(&self, out: &mut String, resent: bool) {
        match self {
            Arg::Text(s) if !s.contains(SEPARATORS) => out.push_str(s),
            Arg::Text(s) => {
                out.extend(
                    s.chars()
                        .map(|c| if SEPARATORS.contains(&c) { '?' } else { c }),
                )
            }
            Arg::Num(n) => {
                use std::fmt::Write;
                let _ = write!(out, "{n}");
            }
            Arg::Fresh(fresh) => out.push(if *fresh && !resent { '1' } else { '0' }),
            Arg::Joined(args) => {
                for (i, arg) in args.iter().enumerate() {
                    if i > 0 {
                        out.push('\x1f');
                    }
                    arg.write(out, resent);
                }
            }
        }
    }
}

/// Runs `cmd` (an EVALSHA of `script`), loading the script first if the server lacks it.
async fn eval<T: redis::FromRedisValue>(
    cmd: &redis::Cmd,
    script: &Script,
    conn: &mut impl redis::aio::ConnectionLike,
) -> redis::RedisResult<T> {
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(conn).await?;
            cmd.query_async(conn).await
        }
        result => result,
    }
}

fn int(v: &Value) -> i64 {
    match v {
        Value::Int(i) => *i,
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        Value::SimpleString(s) => s.parse().unwrap_or(0),
        _ => 0,
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => String::new(),
    }
}

fn kind(word: &str, permits: i64) -> LockKind {
    match word {
        "shared" => LockKind::Shared,
        "permit" => LockKind::Permit {
            permits: permits.max(1) as u32,
        },
        _ => LockKind::Exclusive,
    }
}

fn since(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// The lock as describe.lua gives it (JSON). cjson writes an empty list
/// as `{}`, so lists are read leniently.
#[derive(Deserialize)]
struct State {
    #[serde(deserialize_with = "token_text")]
    t: u64,
    #[serde(default, deserialize_with = "lenient_list")]
    h: Vec<StateHolder>,
    #[serde(default, deserialize_with = "lenient_list")]
    w: Vec<StateWaiter>,
}

#[derive(Deserialize)]
struct StateHolder {
    o: String,
    k: String,
    p: f64,
    #[serde(deserialize_with = "token_text")]
    t: u64,
    a: f64,
    #[serde(deserialize_with = "lenient_list")]
    d: Vec<StateHold>,
}

#[derive(Deserialize)]
struct StateHold {
    n: String,
    i: f64,
    e: f64,
}

#[derive(Deserialize)]
struct StateWaiter {
    o: String,
    k: String,
    p: f64,
    n: String,
    i: f64,
    a: f64,
}

/// A token, which describe.lua writes as text: cjson writes numbers with 14 digits, and
/// tokens seeded from the clock have 16.
fn token_text<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    String::deserialize(d)?
        .trim()
        .parse()
        .map_err(serde::de::Error::custom)
}

fn lenient_list<'de, D, T>(d: D) -> std::result::Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::Array(items) => items
            .into_iter()
            .map(|v| T::deserialize(v).map_err(serde::de::Error::custom))
            .collect(),
        _ => Ok(Vec::new()),
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        Ok(self.attempt(req, None).await?.1)
    }

    async fn transfer(&self, from: &Lease, to: &AcquireRequest) -> Result<(Released, Attempt)> {
        self.attempt(to, Some(from)).await
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        let ttl_ms = ttl.as_millis() as u64;
        let renewed: i64 = self
            .run(
                &scripts().renew,
                &lease.name,
                &[Arg::Text(lease.id.as_str()), Arg::Num(ttl_ms)],
            )
            .await?;
        Ok(if renewed == 1 {
            Renewal::Renewed
        } else {
            Renewal::Lost
        })
    }

    async fn release(&self, lease: &Lease) -> Result<Released> {
        let args = [Arg::Text(lease.id.as_str()), Arg::Text(&self.inner.channel)];
        let reply: Value = self.run(&scripts().release, &lease.name, &args).await?;
        let (released, own) = match &reply {
            Value::Array(items) if items.len() == 2 => (int(&items[0]), text(&items[1])),
            other => (int(other), String::new()),
        };
        self.inner.waiters.forget(lease.id.as_str());
        // A hand-over to a waiter of this client: no need to wait for a message.
        own.split(',')
            .filter(|item| !item.is_empty())
            .for_each(|item| self.inner.waiters.deliver(item));
        Ok(if released == 1 {
            Released::Released
        } else {
            Released::NotHeld
        })
    }

    async fn changed(&self, req: &AcquireRequest, _since: Watermark) -> Result<Option<Grant>> {
        // A message naming this acquisition (kept if it came before we got here).
        let slot = self.inner.waiters.register(&req.lease);
        slot.wake.notified().await;
        let token = slot.granted.locked().take();
        if self.inner.replicas.is_some() {
            // The grant was written by another client, whose writes our WAIT does not
            // cover: come and take it (rewriting it), then wait for the replicas.
            return Ok(None);
        }
        Ok(token.map(|(token, lease_ms)| {
            self.inner.waiters.forget(req.lease.as_str());
            Grant {
                token: FencingToken(token),
                holds: 1,
                lease: Some(Duration::from_millis(lease_ms)),
            }
        }))
    }

    async fn ended(&self, lease: &Lease) -> Result<()> {
        let slot = self.inner.waiters.register(&lease.id);
        loop {
            let (gone, look_again) = (slot.gone.notified(), slot.look_again.notified());
            tokio::pin!(gone, look_again);
            gone.as_mut().enable();
            look_again.as_mut().enable();
            let held = self
                .run::<i64>(
                    &scripts().held,
                    &lease.name,
                    &[Arg::Text(lease.id.as_str())],
                )
                .await;
            match held {
                Ok(1) => {}
                Ok(_) => return Ok(()),
                // The server is away: ask again when the subscription is back.
                Err(error) => tracing::debug!(%error, "cannot tell whether a hold ended yet"),
            }
            // After a reconnection, ask again at once: a server that restarted without
            // its data has no hold, and the holder must learn it now, not at its next
            // renewal (meanwhile another client may be granted the lock).
            tokio::select! {
                _ = gone => return Ok(()),
                _ = look_again => {}
            }
        }
    }

    async fn describe(&self, name: &LockName) -> Result<LockState> {
        let (now, json): (i64, String) = self.run(&scripts().describe, name, &[]).await?;
        let state: State = serde_json::from_str(&json).map_err(|e| Error::Corrupt {
            store: self.inner.shown.clone(),
            name: name.to_string(),
            reason: format!("key {} does not hold a leasehold record ({e})", key(name)),
        })?;
        Ok(LockState {
            name: name.to_string(),
            last_token: FencingToken(state.t),
            holders: state
                .h
                .iter()
                .filter_map(|h| {
                    let first = h.d.first()?;
                    let expires = h.d.iter().map(|d| d.e as i64).max().unwrap_or(0);
                    Some(HolderInfo {
                        owner: h.o.clone(),
                        host: first.n.clone(),
                        pid: first.i as u32,
                        token: FencingToken(h.t),
                        kind: kind(&h.k, h.p as i64),
                        since: since(h.a as i64),
                        lease_left: Duration::from_millis((expires - now).max(0) as u64),
                        holds: h.d.len() as u32,
                    })
                })
                .collect(),
            waiters: state
                .w
                .iter()
                .map(|w| WaiterInfo {
                    owner: w.o.clone(),
                    host: w.n.clone(),
                    pid: w.i as u32,
                    kind: kind(&w.k, w.p as i64),
                    since: since(w.a as i64),
                })
                .collect(),
        })
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockState>> {
        let mut pattern = String::from("lh:{");
        for c in key_escape(prefix).chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                pattern.push('\\');
            }
            pattern.push(c);
        }
        pattern.push('*');
        let keys = self.scan(&pattern).await?;
        // A lock in use has its record or its hold key (`}` ends the tag: names escape it).
        let names: std::collections::BTreeSet<_> = keys
            .iter()
            .filter_map(|k| {
                let tagged = k.strip_prefix("lh:{")?;
                let name = (tagged.strip_suffix('}')).or_else(|| tagged.strip_suffix("}:hold"))?;
                LockName::new(key_unescape(name)).ok()
            })
            .collect();
        busy_states(self, names.into_iter().collect()).await
    }

    async fn force_release(&self, name: &LockName) -> Result<bool> {
        let held: i64 = self.run(&scripts().force, name, &[]).await?;
        Ok(held == 1)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            cross_process: true,
            reclaims_dead_processes: false,
            fair_by_default: false,
            queues_by_wait: true,
            failed_calls_change_nothing: false,
        }
    }

    fn describe_store(&self) -> String {
        self.inner.shown.clone()
    }

    fn caveat(&self) -> Option<String> {
        self.inner.caveat.clone()
    }

    /// `rate.lua`: one EVALSHA, one round trip, on the server's clock.
    async fn rate(&self, req: &RateRequest) -> Result<RateDecision> {
        let mut key = String::with_capacity(req.name.as_str().len() + 12);
        push_rate_key(&mut key, &req.name);
        let script = &scripts().rate;
        let command = |_resent| {
            let mut cmd = redis::Cmd::with_capacity(8, 128);
            cmd.arg("EVALSHA")
                .arg(script.get_hash())
                .arg(1)
                .arg(&key)
                .arg(req.limit.interval_us())
                .arg(req.limit.burst())
                .arg(req.units)
                .arg(req.max_wait_us);
            cmd
        };
        // A call sent again after a dropped connection whose first send took effect too
        // counts its units twice: the limiter lets fewer through, never more.
        let reply: Vec<i64> = match self.send(script, command).await {
            Ok(reply) => reply,
            Err(e) => {
                let text = e.to_string();
                if text.contains("LHCORRUPT") || text.contains("WRONGTYPE") {
                    return Err(Error::Corrupt {
                        store: self.inner.shown.clone(),
                        name: req.name.to_string(),
                        reason: format!(
                            "{key} does not hold a rate limiter's time ({text}); delete it to start the limiter afresh (at full burst)"
                        ),
                    });
                }
                return Err(failed(&self.inner.shown, e));
            }
        };
        let [allowed, wait, remaining, reset] = reply[..] else {
            return Err(Error::Internal(format!("rate.lua answered {reply:?}")));
        };
        let us = |v: i64| Duration::from_micros(v.max(0) as u64);
        Ok(RateDecision {
            allowed: allowed == 1,
            wait: us(wait),
            remaining: remaining.max(0) as u64,
            reset_after: us(reset),
        })
    }
}

/// `lh:rate:{NAME}` (escaped as [`key`]): a rate limiter's key. Lock keys start with
/// `lh:{`, so a limiter and a lock of the same name never share a key, while both hash
/// to the same cluster slot.
fn push_rate_key(out: &mut String, name: &LockName) {
    out.push_str("lh:rate:{");
    out.push_str(&key_escape(name.as_str()));
    out.push('}');
}

fn key_escape(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.contains(['%', '{', '}']) {
        return s.into();
    }
    s.replace('%', "%25")
        .replace('{', "%7B")
        .replace('}', "%7D")
        .into()
}

fn key_unescape(s: &str) -> String {
    s.replace("%7B", "{")
        .replace("%7D", "}")
        .replace("%25", "%")
}
