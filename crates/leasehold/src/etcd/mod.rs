//! etcd store: a lock is a queue of keys ordered by create revision, each on an etcd lease.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold::Result<()> {
//! use leasehold::Leasehold;
//! let locks = Leasehold::connect("etcd://127.0.0.1:2379,127.0.0.1:22379").await?;
//! let guard = locks.mutex("nightly")?.lock().await?; // fair (FIFO) by default on etcd
//! println!("fencing token {}", guard.token());
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! URLs: `etcd://HOST:PORT[,HOST:PORT...][?user=NAME&password=SECRET]`, and `etcds://` for
//! TLS (rustls; the CA must be trusted by the system store or `SSL_CERT_FILE`). Calls go to
//! one member and fail over to the next when it is down, paused (no answer within 3 s, or
//! a sixth of the lease, at least 250 ms, for a renewal, so that a short lease is renewed
//! through another member in time) or has no leader.
//!
//! # How it works
//! - Every acquisition of lock `NAME` is the key `leasehold\0NAME\0L`, `L` its etcd lease
//!   (hex), holding the holder's owner, description and acquisition ids (JSON). Keys of one
//!   lock sort by create revision into one queue; who holds follows from the order: a
//!   writer or mutex holds when it is first, a reader when no writer is ahead of it, a
//!   permit holder when it is among the first N.
//! - Key names come from leases, which the process reuses, so a lock's queue keeps to a
//!   few names: etcd keeps every deleted key in its index until the next compaction, and
//!   each read of a queue (or compare over it) walks them all. A key per owner id, new for
//!   each acquisition, made a busy lock slower by the minute.
//! - An acquisition that joins a non-empty queue also puts the marker
//!   `leasehold\x01NAME\0OWNER\0L` on its lease, and only if the owner has no marker: an
//!   owner already holding is found in the same round trip, and re-enters. An owner
//!   already waiting gets a key of its own behind its first one (each waiting request
//!   has its place, as the rules say); that key wakes at any deletion ahead of it and
//!   looks again, so it re-enters at once when its owner's first key holds. A key put
//!   into an empty queue needs no marker: it is first and stays first, and every join reads
//!   the first key. Markers live outside the queue's range: reads of the queue never walk
//!   them, and the uncontended acquire and release touch one key each.
//! - The join rides in the acquire's Txn (a nested Txn in its else branch) only where the
//!   client found the queue busy last time; elsewhere the Txn is a bare put-if-empty and a
//!   busy queue is joined by a second Txn. etcd spends about 35 µs more on a Txn that
//!   carries the nested join, which an uncontended lock would pay on every acquire.
//! - The fencing token is the key's create revision: strictly increasing cluster-wide,
//!   never reused, unchanged on re-entry (re-entry leaves the key as it is, and a key
//!   moved onto another lease keeps its create revision).
//! - **Re-entry.** The queue key carries one hold, on its lease (its id is in the value).
//!   Each re-entry puts a hold key `leasehold\x02NAME\0CREATE\0L` on a lease `L` of
//!   its own (of its TTL, spare or granted), filed under the queue key's create revision
//!   so that no later key of the name counts it; etcd deletes it when that lease ends,
//!   which ends the hold. The owner's hold count (`describe`) is the key's hold plus the
//!   live hold keys. A re-entry's renewal checks its hold key and the queue key, and
//!   keeps the queue key's lease alive too (the key must outlive every live hold); if
//!   that lease is shorter than the TTL asked, the key moves onto the re-entry's lease
//!   and the hold it carried gets a hold key on its own lease. Releasing the key's own
//!   hold while re-entries live moves the key (same Txn) onto the live re-entry whose
//!   lease has the most time left; the last hold deletes the key. An uncontended
//!   acquire and release stay one Txn each (the release also compares that no hold key
//!   is there); a re-entry costs a Txn, and its release two.
//! - **Fair mode** (the default on etcd): a waiter puts its key at the end of the queue.
//!   The waiters of a process share one watch of their queue's deletions, and each is let
//!   in when enough of the keys that could keep it out have gone (every key ahead for a
//!   writer, the writers ahead for a reader, all but `permits - 1` keys ahead for a
//!   semaphore): a release reaches each waiting process as one event, wakes only the task
//!   it lets in, and is the hand-over itself (no further round trip). All watches of a
//!   client share one gRPC stream.
//! - **Non-fair mode** (`with_fair(false)`): the rules let a non-fair request pass
//!   waiters, they do not make it; on etcd every waiting request queues, so a non-fair
//!   waiter is served like a fair one (and `describe` shows it, and readers do not pass
//!   it). A mutex try puts its key only if the queue is empty (a compare over the whole
//!   key range), and stays out of the queue.
//! - **Leases.** Each acquisition's key is on an etcd lease of its own, renewed by the
//!   guard's renewals (LeaseKeepAlive at about a third of the TTL): a guard that stops
//!   renewing loses its lock at the end of its TTL, whatever else the process holds. A
//!   released lease is kept alive and reused by the process's next acquisition, so an
//!   uncontended acquire and release cost one Txn each, like a bare put-if-absent and
//!   delete. etcd leases count whole seconds (at least the server's minimum, 1–2 s by
//!   default): a lock with a shorter TTL is held by the store slightly longer than the
//!   guard believes, never shorter.
//! - Release deletes only our own key, and only if it is still the acquisition we made
//!   (compared on create/mod revision), so a retried release never deletes a newer lock.
//!   An acquire whose answer never came (timeout, cancellation) is undone by revoking its
//!   lease: whatever etcd did with the request, the key goes with it.
//! - A waiter's key is on a short lease of its own, the waiter lease
//!   ([`waiter_lease`]: the TTL, at most 5 s), kept alive by the
//!   waiter's rechecks: a waiter that dies leaves the queue when that lease ends. When it
//!   is let in, the key moves to a lease of the full TTL (one Txn) before the grant is
//!   returned; the short lease is revoked (the key keeps its name, so it is not reused). A waiter that finds its own key gone (its lease expired while the process
//!   was paused or cut off) stops with [`Error::WaitEnded`].
//! - `lost`: a guard watches its key, so a force-release or a lease expiry is seen at once.
//!   Renewal checks both the lease and the key. A force-release deletes the key and its
//!   hold keys: every hold ends.
//!
//! # Guarantees and limits
//! - Each hold of an owner ends with its own lease, re-entries too: a leaked re-entry (a
//!   guard leaked, or a nested process killed) ends at the end of its own TTL, and its
//!   owner's other holds go on. One exception: the hold that the queue key itself
//!   carries, leaked while re-entries of its owner go on, lasts as long as they do (their
//!   renewals keep the key's lease alive) and then at most its TTL.
//! - etcd is linearizable: with a majority of members up, a lock has at most one holder
//!   and tokens never repeat, across leader changes and member restarts.
//! - Holder times (`since`) are the clients' wall clocks; etcd keeps no time of its own.
//! - `describe().last_token` is the newest token among current holders, and 0 while
//!   nobody holds the lock (etcd keeps no per-name counter; tokens come from the cluster
//!   revision). A waiter's key has its token already, but it is not issued before it holds.

mod line;
mod rpc;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::options::waiter_lease;
use crate::store::{
    busy_states, AcquireRequest, Attempt, Busy, Capabilities, Grant, HolderInfo, Lease, LeaseId,
    LockKind, LockState, Released, Renewal, Store, WaiterInfo, Watermark,
};
use crate::Locked;
use crate::{rules, Error, FencingToken, LockName, Result};
use line::{Joined, Lines, Turn};
use rpc::{
    prefix_end, Client, Compare, DeleteRangeRequest, KeyValue, LeaseGrantRequest,
    LeaseGrantResponse, LeaseKeepAliveResponse, LeaseTimeToLiveResponse, Op, PutRequest,
    RangeRequest, RangeResponse, TxnRequest, TxnResponse, WatchCreateRequest, WatchResponse,
};

const ROOT: &[u8] = b"leasehold\0";
/// Owner markers: outside every range under [`ROOT`].
const MARKERS: &[u8] = b"leasehold\x01";
/// Re-entry holds: outside every range under [`ROOT`] and [`MARKERS`].
const HOLDS: &[u8] = b"leasehold\x02";

/// The least time a renewal's call gives one member before trying the next: a healthy
/// member under load can take this long, and a failed-over call restarts the watches.
const MIN_TRY_PER_MEMBER: Duration = Duration::from_millis(250);

/// The etcd store. Cheap to clone; clones share the connections.
#[derive(Clone)]
pub struct EtcdStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("url", &self.inner.shown)
            .finish()
    }
}

struct Inner {
    shown: String,
    client: Client,
    /// This client's acquisitions, by id: what etcd holds for each.
    acquisitions: Mutex<HashMap<LeaseId, Acquisition>>,
    /// Released leases, alive and without keys, by TTL in seconds: the next acquisition
    /// takes one instead of granting a new lease.
    spare: Mutex<HashMap<i64, Vec<EtcdLease>>>,
    lines: Lines,
    /// Queues (by prefix) this client last found busy: an attempt there joins at once
    /// (see [`EtcdStore::attempt`]).
    busy_queues: Mutex<HashSet<Vec<u8>>>,
}

/// How many busy queues a client remembers; past that it forgets them all.
const BUSY_QUEUES: usize = 4096;

/// An etcd lease and how long it is surely alive.
#[derive(Clone, Copy, Debug)]
struct EtcdLease {
    id: i64,
    /// Seconds etcd granted.
    ttl: i64,
    /// Seconds asked for: the spare list it goes back to.
    asked: i64,
    /// Request time of the last grant or keepalive plus the TTL: etcd cannot end the
    /// lease earlier.
    alive_until: Instant,
    /// Granted by this client for one acquisition (not borrowed from a re-entered key),
    /// so it may be reused once that acquisition's key is gone.
    ours: bool,
}

impl EtcdLease {
    fn left(&self, now: Instant) -> Duration {
        self.alive_until.saturating_duration_since(now)
    }

    fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl.max(0) as u64)
    }
}

#[derive(Clone, Debug)]
struct Acquisition {
    key: Vec<u8>,
    /// The owner's marker.
    marker: Vec<u8>,
    lease: Option<EtcdLease>,
    state: State,
    /// A re-entry's hold key (see [`hold_key`]), on `lease`, as it was granted; `None`
    /// for the hold that the queue key itself carries.
    hold: Option<Vec<u8>>,
}

#[derive(Clone, Debug)]
enum State {
    /// An attempt was sent and its outcome is unknown: undo by revoking the lease.
    Unknown,
    /// Not in the queue (a try, or a non-fair waiter): wait for `blocker` to go.
    Outside { blocker: Blocker },
    /// Our key waits in the queue.
    Queued {
        create: i64,
        waiting: Waiting,
        /// When the last attempt started: a hand-over lease counts from there.
        attempted: Instant,
    },
    /// Granted: our key (or our owner's, re-entered) at `create`, last written at
    /// `modified`.
    Held { create: i64, modified: i64 },
}

/// A waiting acquisition's own key.
struct Ours {
    key: Vec<u8>,
    lease: EtcdLease,
    create: i64,
    /// When the last attempt started: a hand-over lease counts from there.
    attempted: Instant,
}

/// Why a watch stopped.
enum WatchEnd {
    /// Its start revision was compacted away: look again.
    Compacted,
    Broken(Error),
}
use WatchEnd::{Broken, Compacted};

/// What a waiter watches for deletion.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Blocker {
    Key(Vec<u8>),
    /// Any key of the lock.
    Queue(Vec<u8>),
}

/// The value of a queue key.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Entry {
    owner: String,
    host: String,
    pid: u32,
    kind: LockKind,
    /// Client wall clock, ms since the epoch.
    since: u64,
    /// The acquisition whose hold the key itself carries, on its lease (one; older
    /// versions listed re-entries here too). Re-entries have hold keys of their own
    /// ([`hold_key`]).
    holds: Vec<LeaseId>,
}

/// The value of a re-entry's hold key.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct HoldEntry {
    hold: LeaseId,
}

impl HoldEntry {
    fn value(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("plain strings serialize")
    }
}

impl Entry {
    fn value(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("plain strings and numbers serialize")
    }
}

/// Puts `key` on etcd lease `lease`.
fn put_on(lease: i64, key: &[u8], value: &[u8]) -> Op {
    Op::Put(PutRequest {
        key: key.to_vec(),
        value: value.to_vec(),
        lease,
        ignore_value: false,
        ignore_lease: false,
    })
}

/// Puts the existing `key`, value unchanged, on `lease`.
fn move_to(lease: i64, key: &[u8]) -> Op {
    Op::Put(PutRequest {
        key: key.to_vec(),
        value: Vec::new(),
        lease,
        ignore_value: true,
        ignore_lease: false,
    })
}

/// Writes `entry` into the existing `key`, keeping the key's lease.
fn rewrite(key: &[u8], entry: &Entry) -> Op {
    Op::Put(PutRequest {
        key: key.to_vec(),
        value: entry.value(),
        lease: 0,
        ignore_value: false,
        ignore_lease: true,
    })
}

/// A queue key read back.
#[derive(Clone, Debug)]
struct Member {
    kv: KeyValue,
    entry: Entry,
}

/// A queue key and the re-entry holds filed under it, read together.
struct Holding {
    member: Member,
    /// Hold keys, each with the acquisition it is for.
    holds: Vec<(KeyValue, LeaseId)>,
    /// The revision read at.
    revision: i64,
}

/// How an acquisition holds through a queue key.
enum Role {
    /// The key's own hold: the key is on its lease.
    Carrier,
    /// A re-entry: this hold key, on its own lease.
    Reentry(KeyValue),
}

impl Holding {
    fn role(&self, id: &LeaseId) -> Option<Role> {
        if self.member.entry.holds.contains(id) {
            return Some(Role::Carrier);
        }
        (self.holds.iter())
            .find(|(_, hold)| hold == id)
            .map(|(kv, _)| Role::Reentry(kv.clone()))
    }

    fn count(&self) -> u32 {
        (self.member.entry.holds.len() + self.holds.len()) as u32
    }
}

/// Where one key stands in its queue.
#[derive(Debug, PartialEq, Eq)]
struct Standing {
    /// `None`: it holds the lock.
    waiting: Option<Waiting>,
    /// Waiters ahead + 1.
    position: usize,
}

/// What a waiting key waits for: the deletion of keys ahead of it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Waiting {
    /// The keys ahead whose deletion can let it in (see [`EtcdStore::wait_in_line`]).
    ahead: Vec<Vec<u8>>,
    /// How many of them may remain when it holds.
    room: usize,
    /// Behind a waiting key of its own owner: when `ahead` is down to `room`, it does not
    /// hold, it looks again (its owner may hold by then: see [`EtcdStore::behind_owner`]).
    second: bool,
}

/// A writer waits for every key ahead of it. `key(i)`: the `i`th key of the queue, in
/// create order.
fn writer_waiting(at: usize, key: impl Fn(usize) -> Vec<u8>) -> Option<Waiting> {
    (at > 0).then(|| Waiting {
        ahead: (0..at).map(key).collect(),
        room: 0,
        second: false,
    })
}

/// The standing of `queue[at]`, by the rules of its kind. `queue` is in create order.
/// This is the lock rules ([`rules::decide`]) for a fair queue, read by position (a
/// test checks that they agree): linear in the queue, where folding `decide` over it
/// would be quadratic.
fn standing(queue: &[Member], at: usize) -> Standing {
    let granted = |i: usize| match queue[i].entry.kind {
        LockKind::Exclusive => i == 0,
        LockKind::Shared => !queue[..i]
            .iter()
            .any(|m| m.entry.kind == LockKind::Exclusive),
        LockKind::Permit { permits } => i < permits as usize,
    };
    let position = (0..at).filter(|&i| !granted(i)).count() + 1;
    if granted(at) {
        return Standing {
            waiting: None,
            position,
        };
    }
    let keys = |members: &mut dyn Iterator<Item = &Member>| {
        members.map(|m| m.kv.key.clone()).collect::<Vec<_>>()
    };
    let waiting = match queue[at].entry.kind {
        LockKind::Exclusive => writer_waiting(at, |i| queue[i].kv.key.clone()),
        // A reader waits for the writers ahead of it.
        LockKind::Shared => Some(Waiting {
            ahead: keys(
                &mut queue[..at]
                    .iter()
                    .filter(|m| m.entry.kind == LockKind::Exclusive),
            ),
            room: 0,
            second: false,
        }),
        // A permit holder is among the first `permits`.
        LockKind::Permit { permits } => Some(Waiting {
            ahead: keys(&mut queue[..at].iter()),
            room: permits as usize - 1,
            second: false,
        }),
    };
    Standing { waiting, position }
}

fn queue_prefix(name: &LockName) -> Vec<u8> {
    [ROOT, name.as_str().as_bytes(), b"\0"].concat()
}

fn queue_key(name: &LockName, lease: i64) -> Vec<u8> {
    [queue_prefix(name), format!("{lease:x}").into_bytes()].concat()
}

/// Where the markers of `owner`'s keys in `name`'s queue are (see the module docs).
fn owner_markers(name: &LockName, owner: &str) -> Vec<u8> {
    [
        MARKERS,
        name.as_str().as_bytes(),
        b"\0",
        owner.as_bytes(),
        b"\0",
    ]
    .concat()
}

/// The marker of `owner`'s key `key` in `name`'s queue: one per key (owner ids have no
/// control characters, so one owner's markers are never another's).
fn marker_key(name: &LockName, owner: &str, key: &[u8]) -> Vec<u8> {
    let lease = key.get(queue_prefix(name).len()..).unwrap_or_default();
    [owner_markers(name, owner), lease.to_vec()].concat()
}

/// Where the re-entry holds of every queue key of `name` are.
fn holds_of(name: &LockName) -> Vec<u8> {
    [HOLDS, name.as_str().as_bytes(), b"\0"].concat()
}

/// Where the re-entry holds of `name`'s queue key created at `create` are: under its
/// create revision, never reused, so a hold key left by a force-release never counts
/// for a later key of the same name.
fn holds_prefix(name: &LockName, create: i64) -> Vec<u8> {
    [holds_of(name), format!("{create:x}\0").into_bytes()].concat()
}

/// A re-entry's hold key, on the hold's own `lease`: etcd deletes it when the lease
/// ends, which ends the hold.
fn hold_key(name: &LockName, create: i64, lease: i64) -> Vec<u8> {
    [
        holds_prefix(name, create),
        format!("{lease:x}").into_bytes(),
    ]
    .concat()
}

/// The create revision a hold key of `name` is filed under.
fn hold_create(name: &LockName, key: &[u8]) -> Option<i64> {
    let rest = key.get(holds_of(name).len()..)?;
    let create = rest.split(|&b| b == 0).next()?;
    i64::from_str_radix(std::str::from_utf8(create).ok()?, 16).ok()
}

/// Takes `key` out of the queue with its owner's marker.
fn remove(key: &[u8], marker: &[u8]) -> Vec<Op> {
    vec![delete(key), delete(marker)]
}

fn range_queue(prefix: &[u8]) -> Op {
    Op::Range(queue_keys(prefix, false))
}

/// The keys of the queue in create order, with their values unless `keys_only`.
fn queue_keys(prefix: &[u8], keys_only: bool) -> RangeRequest {
    RangeRequest {
        key: prefix.to_vec(),
        range_end: prefix_end(prefix),
        sort_order: rpc::ASCEND,
        sort_target: rpc::BY_CREATE,
        keys_only,
        ..Default::default()
    }
}

/// What a writer reads of its queue: the keys in order (its place), and the first key
/// with its value (who holds, and whether the kinds mix: they all match the first).
fn writer_view(prefix: &[u8]) -> [Op; 2] {
    [
        Op::Range(queue_keys(prefix, true)),
        Op::Range(RangeRequest {
            limit: 1,
            ..queue_keys(prefix, false)
        }),
    ]
}

fn range_key(key: &[u8]) -> Op {
    Op::Range(RangeRequest {
        key: key.to_vec(),
        ..Default::default()
    })
}

fn delete(key: &[u8]) -> Op {
    Op::Delete(DeleteRangeRequest {
        key: key.to_vec(),
        range_end: Vec::new(),
    })
}

fn delete_prefix(prefix: &[u8]) -> Op {
    Op::Delete(DeleteRangeRequest {
        key: prefix.to_vec(),
        range_end: prefix_end(prefix),
    })
}

fn range_prefix(prefix: &[u8], keys_only: bool) -> Op {
    Op::Range(RangeRequest {
        key: prefix.to_vec(),
        range_end: prefix_end(prefix),
        keys_only,
        ..Default::default()
    })
}

fn txn(compare: Vec<Compare>, success: Vec<Op>, failure: Vec<Op>) -> TxnRequest {
    TxnRequest {
        compare,
        success: success.into_iter().map(Into::into).collect(),
        failure: failure.into_iter().map(Into::into).collect(),
    }
}

/// Whole seconds of etcd lease covering `ttl`.
fn lease_seconds(ttl: Duration) -> i64 {
    (ttl.as_millis().div_ceil(1000) as i64).max(1)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

impl EtcdStore {
    /// Connects to the etcd cluster `url` names (see the module docs). Fails at once,
    /// with [`Error::Unavailable`], when no endpoint answers.
    pub async fn connect(url: &str) -> Result<Self> {
        let invalid = |reason: String| Error::InvalidStore {
            store: url.to_string(),
            reason,
        };
        let (tls, rest) = if let Some(rest) = url.strip_prefix("etcds://") {
            (true, rest)
        } else if let Some(rest) = url.strip_prefix("etcd://") {
            (false, rest)
        } else {
            return Err(invalid(
                "an etcd URL is etcd://HOST:PORT[,HOST:PORT...][?user=NAME&password=SECRET] (etcds:// for TLS)".into(),
            ));
        };
        let (hosts, query) = rest.split_once('?').unwrap_or((rest, ""));
        let hosts = hosts.trim_end_matches('/');
        let addresses: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(str::to_string)
            .collect();
        if addresses.is_empty() {
            return Err(invalid("no endpoint: give HOST:PORT[,HOST:PORT...]".into()));
        }
        for address in &addresses {
            let ok = address
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !ok {
                return Err(invalid(format!(
                    "endpoint {address:?} is not HOST:PORT (etcd's client port is usually 2379)"
                )));
            }
        }
        let (mut user, mut password) = (None, None);
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("user", v)) => user = Some(v.to_string()),
                Some(("password", v)) => password = Some(v.to_string()),
                _ => {
                    return Err(invalid(format!(
                        "unknown parameter {pair:?}; etcd URLs take user= and password="
                    )))
                }
            }
        }
        let credentials = match (user, password) {
            (Some(u), Some(p)) => Some((u, p)),
            (None, None) => None,
            _ => return Err(invalid("give both user= and password=".into())),
        };
        let shown = format!("{}://{hosts}", if tls { "etcds" } else { "etcd" });
        let client = Client::new(&addresses, tls, credentials).map_err(invalid)?;
        let store = EtcdStore {
            inner: Arc::new(Inner {
                shown,
                client,
                acquisitions: Mutex::default(),
                spare: Mutex::default(),
                lines: Lines::default(),
                busy_queues: Mutex::default(),
            }),
        };
        // Fail now, with a clear error, rather than at the first lock.
        store.range(range_key(b"leasehold")).await?;
        Ok(store)
    }

    fn unavailable(&self, status: tonic::Status) -> Error {
        let message = status.message().to_string();
        // Refused after the client authenticated again once, a wrong password, or auth
        // options for a server without auth: a configuration to fix, not to retry.
        let refused = match status.code() {
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => true,
            tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition => {
                message.contains("authentication")
            }
            _ => false,
        };
        if refused {
            return Error::Config {
                store: self.inner.shown.clone(),
                reason: format!("authentication failed: {message} (check user= and password=)"),
            };
        }
        let reason = match message.is_empty() {
            true => format!("{}", status.code()),
            false => message,
        };
        Error::Unavailable {
            store: self.inner.shown.clone(),
            source: reason.into(),
        }
    }

    async fn call_txn(&self, request: TxnRequest) -> Result<TxnResponse> {
        self.inner
            .client
            .unary("/etcdserverpb.KV/Txn", request)
            .await
            .map_err(|s| self.unavailable(s))
    }

    async fn range(&self, op: Op) -> Result<RangeResponse> {
        let Op::Range(request) = op else {
            unreachable!("range takes a range")
        };
        self.inner
            .client
            .unary("/etcdserverpb.KV/Range", request)
            .await
            .map_err(|s| self.unavailable(s))
    }

    fn corrupt(&self, name: &LockName, reason: String) -> Error {
        Error::Corrupt {
            store: self.inner.shown.clone(),
            name: name.to_string(),
            reason,
        }
    }

    fn members(&self, name: &LockName, kvs: &[KeyValue]) -> Result<Vec<Member>> {
        kvs.iter().map(|kv| self.member(name, kv)).collect()
    }

    fn member(&self, name: &LockName, kv: &KeyValue) -> Result<Member> {
        let entry = serde_json::from_slice(&kv.value).map_err(|e| {
            self.corrupt(
                name,
                format!(
                    "key {:?} is not a leasehold queue entry ({e}); delete it with etcdctl",
                    String::from_utf8_lossy(&kv.key)
                ),
            )
        })?;
        Ok(Member {
            kv: kv.clone(),
            entry,
        })
    }

    async fn queue(&self, name: &LockName) -> Result<(Vec<Member>, i64)> {
        let answer = self.range(range_queue(&queue_prefix(name))).await?;
        let revision = answer.header.as_ref().map_or(0, |h| h.revision);
        Ok((self.members(name, &answer.kvs)?, revision))
    }

    // --- leases -------------------------------------------------------------------

    /// A lease for a new acquisition: a spare one with at least half its TTL left, or a
    /// new grant.
    async fn lease_for(&self, ttl: Duration) -> Result<EtcdLease> {
        let seconds = lease_seconds(ttl);
        let now = Instant::now();
        let mut stale = Vec::new();
        let spare = {
            let mut spare = self.inner.spare.locked();
            let list = spare.entry(seconds).or_default();
            let mut found = None;
            while let Some(lease) = list.pop() {
                if lease.left(now) * 2 >= lease.ttl() {
                    found = Some(lease);
                    break;
                }
                stale.push(lease.id);
            }
            found
        };
        for id in stale {
            self.revoke_later(id);
        }
        match spare {
            Some(lease) => Ok(lease),
            None => self.grant(ttl).await,
        }
    }

    /// A new etcd lease covering `ttl`.
    async fn grant(&self, ttl: Duration) -> Result<EtcdLease> {
        let seconds = lease_seconds(ttl);
        let sent = Instant::now();
        let answer: LeaseGrantResponse = self
            .inner
            .client
            .unary(
                "/etcdserverpb.Lease/LeaseGrant",
                LeaseGrantRequest { ttl: seconds },
            )
            .await
            .map_err(|s| self.unavailable(s))?;
        if !answer.error.is_empty() {
            return Err(self.unavailable(tonic::Status::unavailable(answer.error)));
        }
        Ok(EtcdLease {
            id: answer.id,
            ttl: answer.ttl,
            asked: seconds,
            alive_until: sent + Duration::from_secs(answer.ttl.max(0) as u64),
            ours: true,
        })
    }

    /// Keeps `lease` for the next acquisition.
    fn spare(&self, lease: EtcdLease) {
        if lease.ours && lease.alive_until > Instant::now() {
            let mut spare = self.inner.spare.locked();
            let list = spare.entry(lease.asked).or_default();
            // Twice in the list, one lease would back two acquisitions.
            if !list.iter().any(|l| l.id == lease.id) {
                list.push(lease);
            }
        }
    }

    /// Notes whether the queue at `prefix` was found busy; returns `busy`.
    fn seen_busy(&self, prefix: &[u8], busy: bool) -> bool {
        let mut queues = self.inner.busy_queues.locked();
        if !busy {
            queues.remove(prefix);
        } else if !queues.contains(prefix) {
            if queues.len() >= BUSY_QUEUES {
                queues.clear();
            }
            queues.insert(prefix.to_vec());
        }
        busy
    }

    fn revoke_later(&self, id: i64) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let store = self.clone();
            runtime.spawn(async move {
                let _ = store.revoke(id).await;
            });
        }
    }

    async fn revoke(&self, id: i64) -> Result<()> {
        let result: std::result::Result<rpc::Empty, _> = self
            .inner
            .client
            .unary("/etcdserverpb.Lease/LeaseRevoke", rpc::LeaseId { id })
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(status) if status.message().contains("not found") => Ok(()),
            Err(status) => Err(self.unavailable(status)),
        }
    }

    /// One LeaseKeepAlive: the lease's new bound, or `None` if etcd no longer has it.
    async fn keep_alive(&self, lease: EtcdLease) -> Result<Option<EtcdLease>> {
        let sent = Instant::now();
        let mut answers = self
            .inner
            .client
            .stream::<_, LeaseKeepAliveResponse>(
                "/etcdserverpb.Lease/LeaseKeepAlive",
                rpc::LeaseId { id: lease.id },
            )
            .await
            .map_err(|s| self.unavailable(s))?;
        let answer = tokio::time::timeout(rpc::CALL_TIMEOUT, answers.message())
            .await
            .map_err(|_| self.unavailable(tonic::Status::deadline_exceeded("keepalive")))?
            .map_err(|s| self.unavailable(s))?
            .ok_or_else(|| {
                self.unavailable(tonic::Status::unavailable("keepalive stream ended"))
            })?;
        Ok((answer.ttl > 0).then(|| EtcdLease {
            ttl: answer.ttl,
            alive_until: sent + Duration::from_secs(answer.ttl as u64),
            ..lease
        }))
    }

    // --- acquisitions -----------------------------------------------------------------

    fn acquisition(&self, id: &LeaseId) -> Option<Acquisition> {
        self.inner.acquisitions.locked().get(id).cloned()
    }

    fn record(&self, id: &LeaseId, acquisition: Acquisition) {
        self.inner
            .acquisitions
            .locked()
            .insert(id.clone(), acquisition);
    }

    fn forget(&self, id: &LeaseId) -> Option<Acquisition> {
        self.inner.acquisitions.locked().remove(id)
    }

    /// The queue key holding acquisition `id` of `name`, and the hold key if it is a
    /// re-entry, found by reading them (for acquisitions this client does not know: made
    /// by another client, or unanswered).
    async fn find(
        &self,
        name: &LockName,
        id: &LeaseId,
    ) -> Result<Option<(Member, Option<KeyValue>)>> {
        let (queue, _) = self.queue(name).await?;
        if let Some(member) = queue.iter().find(|m| m.entry.holds.contains(id)) {
            return Ok(Some((member.clone(), None)));
        }
        let holds = self.range(range_prefix(&holds_of(name), false)).await?;
        for kv in holds.kvs {
            let ours = serde_json::from_slice::<HoldEntry>(&kv.value).is_ok_and(|h| &h.hold == id);
            let create = hold_create(name, &kv.key);
            let member = queue.iter().find(|m| Some(m.kv.create_revision) == create);
            if let (true, Some(member)) = (ours, member) {
                return Ok(Some((member.clone(), Some(kv))));
            }
        }
        Ok(None)
    }

    /// `key`, if it is still the one created at `create`, with its re-entry holds.
    async fn holding(&self, name: &LockName, key: &[u8], create: i64) -> Result<Option<Holding>> {
        let answer = self
            .call_txn(txn(
                vec![Compare::created_at(key, create)],
                vec![
                    range_key(key),
                    range_prefix(&holds_prefix(name, create), false),
                ],
                vec![],
            ))
            .await?;
        match answer.succeeded {
            true => self.holding_from(name, &answer),
            false => Ok(None),
        }
    }

    /// A [`Holding`] from the ranges of a queue key and its hold keys, in that order.
    fn holding_from(&self, name: &LockName, answer: &TxnResponse) -> Result<Option<Holding>> {
        let mut ranges = answer.ranges();
        let Some(kv) = ranges.next().and_then(|r| r.kvs.first()) else {
            return Ok(None);
        };
        let holds = ranges.next().map_or(&[][..], |r| &r.kvs[..]);
        Ok(Some(Holding {
            member: self.member(name, kv)?,
            holds: (holds.iter())
                .filter_map(|kv| {
                    let entry = serde_json::from_slice::<HoldEntry>(&kv.value).ok()?;
                    Some((kv.clone(), entry.hold))
                })
                .collect(),
            revision: answer.revision(),
        }))
    }

    /// Seconds left of etcd lease `id`, -1 if it has ended.
    async fn time_to_live(&self, id: i64) -> Result<i64> {
        let answer: LeaseTimeToLiveResponse = self
            .inner
            .client
            .unary("/etcdserverpb.Lease/LeaseTimeToLive", rpc::LeaseId { id })
            .await
            .map_err(|s| self.unavailable(s))?;
        Ok(answer.ttl)
    }

    async fn attempt(&self, req: &AcquireRequest) -> Result<Attempt> {
        let started = Instant::now();
        let prefix = queue_prefix(&req.name);
        let mut known = self.acquisition(&req.lease);
        if let Some(Acquisition {
            lease: Some(lease),
            state: State::Unknown,
            hold: Some(_),
            ..
        }) = known
        {
            // A re-entry whose answer was lost: its hold key, if it was put, goes with its
            // lease. (Reused for a queue key, the lease would keep it.)
            self.revoke(lease.id).await?;
            self.forget(&req.lease);
            known = None;
        }
        if let Some(Acquisition {
            key,
            lease: Some(lease),
            state: State::Queued {
                create, waiting, ..
            },
            ..
        }) = known
        {
            let second = waiting.second;
            return self
                .recheck(req, &prefix, &key, lease, create, second, started)
                .await;
        }
        let writer = req.kind == LockKind::Exclusive;
        // A mutex try takes the lock only if nobody holds or waits; everything that waits
        // joins the queue, non-fair requests too (the rules let them pass waiters, not
        // make them: a waiter outside the queue would not be shown, and readers could
        // pass it).
        let only_if_free = writer && !req.enqueue;
        // A key that joins a busy queue waits there on a waiter's short lease, so that a
        // waiter that dies holds up the queue for a few seconds, not for the lock's TTL;
        // it moves to a lease of the full TTL when it is let in (`on_full_lease`).
        let joins = !only_if_free && self.inner.busy_queues.locked().contains(&prefix);
        let fresh = known.as_ref().is_none_or(|a| a.lease.is_none());
        let lease = match known.and_then(|a| a.lease) {
            Some(lease) => lease,
            None if joins && req.enqueue => self.lease_for(waiter_lease(req.ttl)).await?,
            None => self.lease_for(req.ttl).await?,
        };
        let key = queue_key(&req.name, lease.id);
        let marker = marker_key(&req.name, &req.owner, &key);
        self.record(
            &req.lease,
            Acquisition {
                key: key.clone(),
                marker: marker.clone(),
                lease: Some(lease),
                state: State::Unknown,
                hold: None,
            },
        );
        let entry = Entry {
            owner: req.owner.clone(),
            host: req.requester.host.clone(),
            pid: req.requester.pid,
            kind: req.kind,
            since: now_ms(),
            holds: vec![req.lease.clone()],
        };
        let puts = vec![
            put_on(lease.id, &key, &entry.value()),
            put_on(lease.id, &marker, &key),
        ];
        let everyone = Compare::empty(&prefix, &prefix_end(&prefix));
        let owners = owner_markers(&req.name, &req.owner);
        let request = if only_if_free {
            txn(
                vec![everyone],
                puts[..1].to_vec(),
                vec![range_queue(&prefix)],
            )
        } else {
            let mut join = puts.clone();
            if writer {
                join.extend(writer_view(&prefix));
            } else {
                join.push(range_queue(&prefix));
            }
            // Our owner's marker there: read the queue to find the owner's key.
            let join = txn(
                vec![Compare::empty(&owners, &prefix_end(&owners))],
                join,
                vec![
                    range_queue(&prefix),
                    Op::Range(RangeRequest {
                        key: owners.clone(),
                        range_end: prefix_end(&owners),
                        ..Default::default()
                    }),
                ],
            );
            // Into an empty queue the key alone (nothing to read back, no marker needed);
            // else join it: in the same Txn where the queue was busy last time, else in a
            // second one. etcd takes about 35 µs longer over a Txn that carries the nested
            // join, which an uncontended lock would pay on every acquire.
            let join = match self.inner.busy_queues.locked().contains(&prefix) {
                true => vec![Op::Txn(Box::new(join))],
                false => Vec::new(),
            };
            txn(vec![everyone], puts[..1].to_vec(), join)
        };
        let answer = match self.call_txn(request).await {
            Err(Error::Unavailable { source, .. })
                if source.to_string().contains("requested lease not found") =>
            {
                // A spare lease that etcd ended (revoked by hand, or a restore): drop it.
                self.forget(&req.lease);
                return Box::pin(self.attempt(req)).await;
            }
            other => other?,
        };
        let revision = answer.revision();
        if !only_if_free && self.seen_busy(&prefix, !answer.succeeded) && answer.nested().is_none()
        {
            // Busy, and the Txn did not carry the join: join now, on a waiter's lease if
            // this one is new (nothing was put on it).
            if fresh && req.enqueue {
                self.forget(&req.lease);
                self.spare(lease);
            }
            return Box::pin(self.attempt(req)).await;
        }
        // The join's answer when the queue was not empty.
        let joined = answer.nested().unwrap_or(&answer);
        let put_done = joined.succeeded;
        if writer && put_done && answer.nested().is_some() {
            return self
                .writer_standing(req, &key, lease, joined, revision, started)
                .await;
        }
        let queue = match joined.range() {
            Some(kvs) => self.members(&req.name, kvs)?,
            // Put into an empty queue: ours alone.
            None => vec![Member {
                kv: KeyValue {
                    key: key.clone(),
                    create_revision: revision,
                    mod_revision: revision,
                    value: Vec::new(),
                    lease: lease.id,
                },
                entry,
            }],
        };
        // Our key: put now, or by an earlier attempt of this request whose answer was lost
        // (then this put found the marker and did nothing). Its lease is spared only once
        // the key is gone: a spare lease must have no key.
        let ours = queue
            .iter()
            .find(|m| m.kv.key == key)
            .map(|m| m.kv.create_revision);
        let refused = queue
            .iter()
            .find_map(|m| rules::same_primitive(m.entry.kind, req.kind).err());
        if let Some(refusal) = refused {
            if let Some(create) = ours {
                self.withdraw(&req.lease, &key, &marker, create, lease)
                    .await?;
            } else {
                self.forget(&req.lease);
                self.spare(lease);
            }
            return Err(conflict(req, refusal));
        }
        // Our owner's first key: ours, or an earlier one (we re-enter it if it holds, and
        // else wait behind it in a place of our own).
        let Some(at) = queue.iter().position(|m| m.entry.owner == req.owner) else {
            if !put_done && !only_if_free {
                // Markers without their keys (a key deleted alone, by hand or by an older
                // version): clear them and join again.
                let stale = joined.ranges().nth(1).map_or(&[][..], |r| &r.kvs[..]);
                for stale in stale {
                    self.call_txn(txn(
                        vec![Compare::modified_at(&stale.key, stale.mod_revision)],
                        vec![delete(&stale.key)],
                        vec![],
                    ))
                    .await?;
                }
                return Box::pin(self.attempt(req)).await;
            }
            // Not queued (the lock was busy for a mutex try).
            self.spare(lease);
            return Ok(self.outside(req, &queue, &prefix, revision));
        };
        if queue[at].kv.key != key {
            let Some(create) = ours else {
                let here = standing(&queue, at);
                if here.waiting.is_some() && req.enqueue {
                    // Our owner waits: we wait too, in a place of our own, as the rules
                    // queue every waiting request. Put our key and look again.
                    self.call_txn(txn(vec![], puts, vec![])).await?;
                    return Box::pin(self.attempt(req)).await;
                }
                self.spare(lease);
                return self
                    .behind_owner(req, &queue, at, None, lease, revision, started)
                    .await;
            };
            let mine = queue.iter().position(|m| m.kv.key == key);
            let Some(mine) = mine.filter(|&mine| mine > at) else {
                return Err(self.wait_ended(req));
            };
            let _ = create; // put by an earlier attempt, or just now
            return self
                .behind_owner(req, &queue, at, Some(mine), lease, revision, started)
                .await;
        }
        let here = standing(&queue, at);
        let (create, modified) = (queue[at].kv.create_revision, queue[at].kv.mod_revision);
        let Some(waiting) = here.waiting else {
            return Ok(self.granted(req, &key, lease, create, modified, 1, started));
        };
        if !req.enqueue {
            self.withdraw(&req.lease, &key, &marker, create, lease)
                .await?;
            return Ok(self.busy(queue.first(), None, revision));
        }
        let busy = self.busy(queue.first(), Some(here.position), revision);
        self.queued(req, key, lease, create, waiting, started);
        Ok(busy)
    }

    /// Our owner has a key ahead of ours (`queue[first]`; ours is `queue[mine]`, if we put
    /// one): re-enter it if it holds; else a try is busy, and a waiting request waits
    /// in its own place, until any key ahead of it goes (then it looks again: its owner
    /// may hold by then, and it re-enters at once, as the rules say).
    #[allow(clippy::too_many_arguments)]
    async fn behind_owner(
        &self,
        req: &AcquireRequest,
        queue: &[Member],
        first: usize,
        mine: Option<usize>,
        lease: EtcdLease,
        revision: i64,
        started: Instant,
    ) -> Result<Attempt> {
        let prefix = queue_prefix(&req.name);
        let holds = standing(queue, first).waiting.is_none();
        if holds || !req.enqueue || mine.is_none() {
            if let Some(m) = mine.map(|i| &queue[i]) {
                let marker = marker_key(&req.name, &req.owner, &m.kv.key);
                self.withdraw(&req.lease, &m.kv.key, &marker, m.kv.create_revision, lease)
                    .await?;
            }
            if holds {
                if let Err(refusal) = rules::reentry(queue[first].entry.kind, req.kind, &req.owner)
                {
                    self.forget(&req.lease);
                    return Err(conflict(req, refusal));
                }
                return self.reenter(req, &queue[first], started).await;
            }
            return Ok(self.outside(req, queue, &prefix, revision));
        }
        let mine = mine.expect("checked above");
        let ahead: Vec<Vec<u8>> = queue[..mine].iter().map(|m| m.kv.key.clone()).collect();
        let waiting = Waiting {
            room: ahead.len() - 1,
            ahead,
            second: true,
        };
        let position = standing(queue, mine).position;
        let busy = self.busy(queue.first(), Some(position), revision);
        let create = queue[mine].kv.create_revision;
        self.queued(
            req,
            queue[mine].kv.key.clone(),
            lease,
            create,
            waiting,
            started,
        );
        Ok(busy)
    }

    /// A writer's place from [`writer_view`]'s answer (after its put, or a recheck).
    async fn writer_standing(
        &self,
        req: &AcquireRequest,
        key: &[u8],
        lease: EtcdLease,
        answer: &TxnResponse,
        revision: i64,
        started: Instant,
    ) -> Result<Attempt> {
        let mut ranges = answer.ranges();
        let keys = ranges.next().map_or(&[][..], |r| &r.kvs[..]);
        let first = match ranges.next().and_then(|r| r.kvs.first()) {
            Some(kv) => Some(self.member(&req.name, kv)?),
            None => None,
        };
        let Some(at) = keys.iter().position(|kv| kv.key == key) else {
            return Err(self.wait_ended(req));
        };
        let (create, modified) = (keys[at].create_revision, keys[at].mod_revision);
        let marker = marker_key(&req.name, &req.owner, key);
        if let Some(first) = first
            .as_ref()
            .filter(|f| f.entry.owner == req.owner && f.kv.key != key)
        {
            // Our owner holds through a key put into an empty queue: re-enter it.
            self.withdraw(&req.lease, key, &marker, create, lease)
                .await?;
            if let Err(refusal) = rules::reentry(first.entry.kind, req.kind, &req.owner) {
                return Err(conflict(req, refusal));
            }
            return self.reenter(req, first, started).await;
        }
        let refused = first
            .as_ref()
            .and_then(|f| rules::same_primitive(f.entry.kind, req.kind).err());
        if let Some(refusal) = refused {
            self.withdraw(&req.lease, key, &marker, create, lease)
                .await?;
            return Err(conflict(req, refusal));
        }
        let Some(waiting) = writer_waiting(at, |i| keys[i].key.clone()) else {
            return Ok(self.granted(req, key, lease, create, modified, 1, started));
        };
        if !req.enqueue {
            self.withdraw(&req.lease, key, &marker, create, lease)
                .await?;
            return Ok(self.busy(first.as_ref(), None, revision));
        }
        let busy = self.busy(first.as_ref(), Some(at), revision);
        self.queued(req, key.to_vec(), lease, create, waiting, started);
        Ok(busy)
    }

    /// A waiting acquisition tries again: is its key still there, and where?
    #[allow(clippy::too_many_arguments)]
    async fn recheck(
        &self,
        req: &AcquireRequest,
        prefix: &[u8],
        key: &[u8],
        lease: EtcdLease,
        create: i64,
        second: bool,
        started: Instant,
    ) -> Result<Attempt> {
        let due = lease.left(started) * 3 < lease.ttl() * 2;
        // A writer's own key, first of its owner's, reads the keys and the first value; a
        // key behind its owner's reads the whole queue (whose keys are whose).
        let writer = req.kind == LockKind::Exclusive && !second;
        let view = if writer {
            writer_view(prefix).into()
        } else {
            vec![range_queue(prefix)]
        };
        // A waiting key is on a short lease (a waiter lease): like a renewal, each member
        // gets a sixth of it while another is left, so a paused member cannot keep the
        // keepalive from another one in time. (The check only reads.)
        let per_member = (lease.ttl() / 6).max(MIN_TRY_PER_MEMBER);
        let check = rpc::trying_each_for(
            per_member,
            self.call_txn(txn(vec![Compare::created_at(key, create)], view, vec![])),
        );
        let (answer, renewed) = if due {
            let keep_alive = rpc::trying_each_for(per_member, self.keep_alive(lease));
            let (answer, renewed) = tokio::join!(check, keep_alive);
            (answer?, renewed.ok())
        } else {
            (check.await?, Some(Some(lease)))
        };
        let lease = match renewed {
            Some(Some(lease)) => lease,
            // A failed keepalive: keep the old bound.
            None => lease,
            Some(None) => return Err(self.wait_ended(req)),
        };
        if !answer.succeeded {
            return Err(self.wait_ended(req));
        }
        if writer {
            let revision = answer.revision();
            return self
                .writer_standing(req, key, lease, &answer, revision, started)
                .await;
        }
        let queue = self.members(&req.name, answer.range().unwrap_or_default())?;
        let Some(at) = queue.iter().position(|m| m.kv.key == key) else {
            return Err(self.wait_ended(req));
        };
        if let Some(first) = queue[..at].iter().position(|m| m.entry.owner == req.owner) {
            let revision = answer.revision();
            return self
                .behind_owner(req, &queue, first, Some(at), lease, revision, started)
                .await;
        }
        let here = standing(&queue, at);
        let Some(waiting) = here.waiting else {
            let modified = queue[at].kv.mod_revision;
            return Ok(self.granted(req, key, lease, create, modified, 1, started));
        };
        let busy = self.busy(queue.first(), Some(here.position), answer.revision());
        self.queued(req, key.to_vec(), lease, create, waiting, started);
        Ok(busy)
    }

    fn wait_ended(&self, req: &AcquireRequest) -> Error {
        self.forget(&req.lease);
        Error::WaitEnded {
            name: req.name.to_string(),
            reason: "our place in etcd's queue is gone: its lease expired while this process could not renew it (paused, or cut off from etcd)".into(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn granted(
        &self,
        req: &AcquireRequest,
        key: &[u8],
        lease: EtcdLease,
        create: i64,
        modified: i64,
        holds: u32,
        started: Instant,
    ) -> Attempt {
        self.record(
            &req.lease,
            Acquisition {
                key: key.to_vec(),
                marker: marker_key(&req.name, &req.owner, key),
                lease: Some(lease),
                state: State::Held { create, modified },
                hold: None,
            },
        );
        Attempt::Granted(grant(req, lease, create, holds, started))
    }

    /// Records our key as waiting in the queue.
    fn queued(
        &self,
        req: &AcquireRequest,
        key: Vec<u8>,
        lease: EtcdLease,
        create: i64,
        waiting: Waiting,
        started: Instant,
    ) {
        self.record(
            &req.lease,
            Acquisition {
                marker: marker_key(&req.name, &req.owner, &key),
                key,
                lease: Some(lease),
                state: State::Queued {
                    create,
                    waiting,
                    attempted: started,
                },
                hold: None,
            },
        );
    }

    /// Busy for an acquisition that is not in the queue: wait for the holder to go (or,
    /// with several keys, for any key to go).
    fn outside(
        &self,
        req: &AcquireRequest,
        queue: &[Member],
        prefix: &[u8],
        revision: i64,
    ) -> Attempt {
        let blocker = match queue {
            [only] => Blocker::Key(only.kv.key.clone()),
            _ => Blocker::Queue(prefix.to_vec()),
        };
        self.record(
            &req.lease,
            Acquisition {
                key: Vec::new(),
                marker: Vec::new(),
                lease: None,
                state: State::Outside { blocker },
                hold: None,
            },
        );
        self.busy(queue.first(), None, revision)
    }

    /// `first`: the queue's first key.
    fn busy(&self, first: Option<&Member>, position: Option<usize>, revision: i64) -> Attempt {
        Attempt::Busy(Busy {
            holder: first.map(|m| holder_info(m, Duration::ZERO)),
            position,
            // Deletions are watched, lease expiries included: no timer needed.
            retry_in: None,
            watermark: Watermark(revision as u64),
        })
    }

    /// Takes back a key we put but will not wait with (a try that found the lock busy).
    async fn withdraw(
        &self,
        id: &LeaseId,
        key: &[u8],
        marker: &[u8],
        create: i64,
        lease: EtcdLease,
    ) -> Result<()> {
        self.forget(id);
        let answer = self
            .call_txn(txn(
                vec![Compare::created_at(key, create)],
                remove(key, marker),
                vec![],
            ))
            .await?;
        if answer.succeeded {
            self.spare(lease);
        }
        Ok(())
    }

    /// Re-enters our owner's key, which holds the lock: a hold key of our own, on a lease
    /// of our own, so that our hold ends with that lease (see the module docs). Our
    /// renewals keep the queue key's lease alive too: the key must outlive our hold.
    async fn reenter(
        &self,
        req: &AcquireRequest,
        member: &Member,
        started: Instant,
    ) -> Result<Attempt> {
        let (key, create) = (&member.kv.key, member.kv.create_revision);
        let lease = self.lease_for(req.ttl).await?;
        let hold = hold_key(&req.name, create, lease.id);
        let marker = marker_key(&req.name, &req.owner, key);
        let acquisition = |state| Acquisition {
            key: key.clone(),
            marker: marker.clone(),
            lease: Some(lease),
            state,
            hold: Some(hold.clone()),
        };
        // Unanswered, the hold key is undone by revoking its lease.
        self.record(&req.lease, acquisition(State::Unknown));
        let value = HoldEntry {
            hold: req.lease.clone(),
        }
        .value();
        let (answer, carrier) = tokio::join!(
            self.call_txn(txn(
                vec![Compare::created_at(key, create)],
                vec![
                    put_on(lease.id, &hold, &value),
                    range_key(key),
                    range_prefix(&holds_prefix(&req.name, create), false),
                ],
                vec![],
            )),
            self.keep_alive(borrowed(member.kv.lease))
        );
        let answer = answer?;
        let now = match answer.succeeded {
            true => self.holding_from(&req.name, &answer)?,
            false => None,
        };
        let Some(now) = now else {
            // The key is gone: nothing was put.
            self.forget(&req.lease);
            self.spare(lease);
            return Box::pin(self.attempt(req)).await;
        };
        let carrier = match carrier {
            Ok(Some(carrier)) if carrier.id == now.member.kv.lease => Some(carrier),
            _ => self.keep_alive(borrowed(now.member.kv.lease)).await?,
        };
        let Some(carrier) = carrier else {
            // The key's lease just ended: our hold key goes with our lease, and we wait
            // for etcd to delete the key.
            self.forget(&req.lease);
            self.revoke_later(lease.id);
            let prefix = queue_prefix(&req.name);
            let revision = answer.revision();
            return Ok(self.outside(req, std::slice::from_ref(member), &prefix, revision));
        };
        let modified = now.member.kv.mod_revision;
        self.record(&req.lease, acquisition(State::Held { create, modified }));
        // The grant lasts as long as both leases.
        let bound = match carrier.left(started) < lease.left(started) {
            true => carrier,
            false => lease,
        };
        Ok(Attempt::Granted(grant(
            req,
            bound,
            create,
            now.count(),
            started,
        )))
    }

    // --- watching ----------------------------------------------------------------------

    /// Resolves at the first deletion in `blocker` after revision `seen`. `Ok(false)` when
    /// etcd can no longer tell (the revision was compacted): look again.
    ///
    /// A single key is watched from now rather than from `seen + 1`: etcd serves a watch
    /// that starts in the past from a loop that runs every 100 ms, which would delay a
    /// hand-over by up to that. A read after the watch exists covers the gap: the key
    /// gone, or replaced by a newer one, is a deletion since `seen`.
    async fn deleted(&self, blocker: &Blocker, seen: i64) -> Result<bool> {
        let (key, range_end, start) = match blocker {
            Blocker::Key(key) => (key.clone(), Vec::new(), 0),
            Blocker::Queue(prefix) => (prefix.clone(), prefix_end(prefix), seen + 1),
        };
        let (mut events, now) = match self.watch_deletes(&key, range_end, start).await? {
            Some(created) => created,
            None => return Ok(false),
        };
        if start == 0 && now > seen {
            let current = self.range(range_key(&key)).await?;
            let same = current
                .kvs
                .first()
                .is_some_and(|kv| kv.create_revision <= seen);
            if !same {
                return Ok(true);
            }
        }
        match self.next_deletion(&mut events).await {
            Ok(()) => Ok(true),
            Err(Compacted) => Ok(false),
            Err(Broken(error)) => Err(error),
        }
    }

    /// A watch for deletions in `[key, range_end)` from `start` (0: from now), and the
    /// revision it starts after; `None` if `start` was compacted away.
    async fn watch_deletes(
        &self,
        key: &[u8],
        range_end: Vec<u8>,
        start: i64,
    ) -> Result<Option<(rpc::Watch, i64)>> {
        let mut watch = self
            .inner
            .client
            .watch(WatchCreateRequest {
                key: key.to_vec(),
                range_end,
                start_revision: start,
                filters: vec![rpc::NO_PUT],
            })
            .await
            .map_err(|s| self.unavailable(s))?;
        let Some(created) = watch.message().await else {
            return Err(self.watch_ended());
        };
        match self.deletions(created) {
            Ok(answer) => Ok(Some((watch, answer.header.map_or(0, |h| h.revision)))),
            Err(Compacted) => Ok(None),
            Err(Broken(error)) => Err(error),
        }
    }

    /// Resolves at the first deletion `watch` reports.
    async fn next_deletion(&self, watch: &mut rpc::Watch) -> std::result::Result<(), WatchEnd> {
        loop {
            let Some(answer) = watch.message().await else {
                return Err(Broken(self.watch_ended()));
            };
            if !self.deletions(answer)?.events.is_empty() {
                return Ok(());
            }
        }
    }

    /// A watch answer, unless it says the watch is over.
    fn deletions(&self, answer: WatchResponse) -> std::result::Result<WatchResponse, WatchEnd> {
        if !answer.canceled {
            return Ok(answer);
        }
        if answer.compact_revision > 0 {
            return Err(Compacted);
        }
        Err(Broken(self.unavailable(tonic::Status::unavailable(
            format!("watch cancelled: {}", answer.cancel_reason),
        ))))
    }

    fn watch_ended(&self) -> Error {
        self.unavailable(tonic::Status::unavailable("watch stream ended"))
    }

    /// A queued acquisition waits in line here rather than in the lock loop. The process
    /// watches the queue for deletions once for all its waiters (see line.rs), and a
    /// waiter holds when enough of the keys that could keep it out have gone: the release
    /// that lets it in reaches it as one event, with no read or watch of its own on the
    /// hand-over's path.
    async fn wait_in_line(
        &self,
        req: &AcquireRequest,
        ours: &Ours,
        mut waiting: Waiting,
        mut seen: i64,
    ) -> Result<Option<Grant>> {
        let prefix = queue_prefix(&req.name);
        loop {
            let (line, fresh) = match self.inner.lines.get(&prefix) {
                Some(line) => (line, false),
                None => {
                    let end = prefix_end(&prefix);
                    let Some((watch, since)) = self.watch_deletes(&prefix, end, 0).await? else {
                        return Ok(None);
                    };
                    (self.inner.lines.start(&prefix, watch, since), true)
                }
            };
            let turn = match line.join(&ours.key, &waiting.ahead, waiting.room, seen) {
                Joined::Over(turn) => turn,
                Joined::Waiting(mut place) => match place.turn().await {
                    Some(turn) => turn,
                    None => return Err(self.watch_ended()),
                },
                Joined::Ended if fresh => return Err(self.watch_ended()),
                Joined::Ended => continue,
                // Behind our owner's key: look again (see `behind_owner`).
                Joined::Gap(_) if waiting.second => return Ok(None),
                Joined::Gap(since) => {
                    // The line started after our read: read again, as of its start.
                    let (queue, revision) = self.look(&req.name, &prefix, since).await?;
                    let Some(at) = queue.iter().position(|m| m.kv.key == ours.key) else {
                        return Ok(None);
                    };
                    match standing(&queue, at).waiting {
                        Some(now) => waiting = now,
                        None => return Ok(self.handed_over(req, ours)),
                    }
                    seen = revision;
                    continue;
                }
            };
            return Ok(match turn {
                Turn::Free if waiting.second => None,
                Turn::Free => self.handed_over(req, ours),
                // Our key is gone: the next attempt says why.
                Turn::Gone => None,
            });
        }
    }

    /// The queue as of revision `at_least` or later. The member's own state (no quorum
    /// read) serves when it is that recent: keys ahead of ours never come back once gone,
    /// so a recent enough state tells which are left.
    async fn look(
        &self,
        name: &LockName,
        prefix: &[u8],
        at_least: i64,
    ) -> Result<(Vec<Member>, i64)> {
        let local = RangeRequest {
            serializable: true,
            ..queue_keys(prefix, false)
        };
        let mut answer = self.range(Op::Range(local)).await?;
        let mut revision = answer.header.as_ref().map_or(0, |h| h.revision);
        if revision < at_least {
            answer = self.range(Op::Range(queue_keys(prefix, false))).await?;
            revision = answer.header.as_ref().map_or(0, |h| h.revision);
        }
        Ok((self.members(name, &answer.kvs)?, revision))
    }

    /// Nothing keeps our key out any more, and nothing can queue ahead of it: the lock is
    /// ours, if our own lease is surely still alive.
    fn handed_over(&self, req: &AcquireRequest, ours: &Ours) -> Option<Grant> {
        let lease = ours.lease;
        if lease.left(Instant::now()) * 2 < lease.ttl().min(req.ttl) {
            return None;
        }
        let (key, create) = (&ours.key, ours.create);
        match self.granted(req, key, lease, create, create, 1, ours.attempted) {
            Attempt::Granted(grant) => Some(grant),
            Attempt::Busy(_) => None,
        }
    }
}

fn conflict(req: &AcquireRequest, refusal: rules::Refusal) -> Error {
    Error::Conflict {
        name: req.name.to_string(),
        reason: refusal.message(),
    }
}

fn grant(
    req: &AcquireRequest,
    lease: EtcdLease,
    create: i64,
    holds: u32,
    started: Instant,
) -> Grant {
    let left = lease.left(started);
    Grant {
        token: FencingToken(create as u64),
        holds,
        lease: (left < req.ttl).then_some(left),
    }
}

/// A lease another acquisition made, known only by id until a keepalive bounds it.
fn borrowed(id: i64) -> EtcdLease {
    EtcdLease {
        id,
        ttl: 0,
        asked: 0,
        alive_until: Instant::now(),
        ours: false,
    }
}

fn holder_info(member: &Member, lease_left: Duration) -> HolderInfo {
    HolderInfo {
        owner: member.entry.owner.clone(),
        host: member.entry.host.clone(),
        pid: member.entry.pid,
        token: FencingToken(member.kv.create_revision as u64),
        kind: member.entry.kind,
        since: UNIX_EPOCH + Duration::from_millis(member.entry.since),
        lease_left,
        holds: member.entry.holds.len() as u32,
    }
}

#[async_trait]
impl Store for EtcdStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        match self.attempt(req).await? {
            Attempt::Granted(grant) => Ok(Attempt::Granted(self.on_full_lease(req, grant).await)),
            busy => Ok(busy),
        }
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        let (key, etcd_lease, create, hold) = match self.acquisition(&lease.id) {
            Some(Acquisition {
                key,
                lease: Some(etcd_lease),
                state: State::Held { create, .. },
                hold,
                ..
            }) => (key, etcd_lease, create, hold),
            Some(_) => return Ok(Renewal::Lost),
            None => match self.find(&lease.name, &lease.id).await? {
                Some((m, hold)) => {
                    let on = hold.as_ref().map_or(m.kv.lease, |h| h.lease);
                    let hold = hold.map(|h| h.key);
                    (m.kv.key, borrowed(on), m.kv.create_revision, hold)
                }
                None => return Ok(Renewal::Lost),
            },
        };
        if hold.is_some() {
            return self
                .renew_reentry(lease, ttl, &key, etcd_lease, create)
                .await;
        }
        // The key is checked too: a force-release deletes it but leaves the lease.
        // A renewal starts with two thirds of the lease left: room for a try on a member
        // that does not answer, a retry after the guard's back-off, and a healthy member.
        // (Only these two calls, which may be repeated anywhere; not the writes below.)
        let per_member = (ttl.min(etcd_lease.ttl()) / 6).max(MIN_TRY_PER_MEMBER);
        let (alive, current) = tokio::join!(
            rpc::trying_each_for(per_member, self.keep_alive(etcd_lease)),
            rpc::trying_each_for(per_member, self.range(range_key(&key)))
        );
        let (alive, current) = (alive?, current?);
        let Some(kv) = (current.kvs.into_iter().next()).filter(|kv| kv.create_revision == create)
        else {
            self.forget(&lease.id);
            return Ok(Renewal::Lost);
        };
        let carried =
            serde_json::from_slice::<Entry>(&kv.value).is_ok_and(|e| e.holds.contains(&lease.id));
        if !carried {
            // Another hold of our owner took the key onto its lease: ours is a hold key
            // now (or gone).
            return self
                .renew_reentry(lease, ttl, &key, etcd_lease, create)
                .await;
        }
        if kv.lease != etcd_lease.id {
            // We moved the key to a longer lease, unanswered: follow it.
            self.set_lease(&lease.id, borrowed(kv.lease), None);
            return Box::pin(self.renew(lease, ttl)).await;
        }
        let Some(renewed) = alive else {
            self.forget(&lease.id);
            return Ok(Renewal::Lost);
        };
        self.set_lease(&lease.id, renewed, None);
        if renewed.ttl() < ttl {
            return self.move_to_longer_lease(lease, &kv, renewed, ttl).await;
        }
        Ok(Renewal::Renewed)
    }

    async fn release(&self, lease: &Lease) -> Result<Released> {
        let known = self.forget(&lease.id);
        let (key, create, own) = match known {
            Some(Acquisition {
                lease: Some(etcd_lease),
                state: State::Unknown,
                ..
            }) => {
                // Whatever etcd did with the unanswered attempt, its key goes with the lease.
                self.revoke(etcd_lease.id).await?;
                return Ok(Released::Released);
            }
            // The key's own hold, or a waiting key: with no re-entries, delete it.
            Some(Acquisition {
                key,
                marker,
                lease: Some(etcd_lease),
                state,
                hold: None,
            }) if matches!(state, State::Held { .. } | State::Queued { .. }) => {
                let (create, modified) = match state {
                    State::Held { create, modified } => (create, modified),
                    State::Queued { create, .. } => (create, create),
                    _ => unreachable!("matched above"),
                };
                if self
                    .delete_alone(&lease.name, &key, &marker, etcd_lease, create, modified)
                    .await?
                {
                    return Ok(Released::Released);
                }
                (key, create, Some(etcd_lease))
            }
            Some(Acquisition {
                key,
                lease,
                state: State::Held { create, .. },
                ..
            }) => (key, create, lease),
            Some(_) => return Ok(Released::NotHeld),
            None => match self.find(&lease.name, &lease.id).await? {
                Some((member, _)) => (member.kv.key, member.kv.create_revision, None),
                None => return Ok(Released::NotHeld),
            },
        };
        self.release_hold(lease, &key, create, own).await
    }

    async fn transfer(&self, from: &Lease, to: &AcquireRequest) -> Result<(Released, Attempt)> {
        let released = self.release(from).await?;
        Ok((released, self.acquire(to).await?))
    }

    async fn changed(&self, req: &AcquireRequest, since: Watermark) -> Result<Option<Grant>> {
        let seen = since.0 as i64;
        match self.acquisition(&req.lease) {
            Some(Acquisition {
                state: State::Outside { blocker, .. },
                ..
            }) => {
                self.deleted(&blocker, seen).await?;
                Ok(None)
            }
            Some(Acquisition {
                key,
                lease: Some(lease),
                state:
                    State::Queued {
                        create,
                        waiting,
                        attempted,
                    },
                ..
            }) => {
                let ours = Ours {
                    key,
                    lease,
                    create,
                    attempted,
                };
                match self.wait_in_line(req, &ours, waiting, seen).await? {
                    Some(grant) => Ok(Some(self.on_full_lease(req, grant).await)),
                    None => Ok(None),
                }
            }
            _ => std::future::pending().await,
        }
    }

    async fn ended(&self, lease: &Lease) -> Result<()> {
        let Some(Acquisition {
            key,
            state: State::Held { modified, .. },
            ..
        }) = self.acquisition(&lease.id)
        else {
            return std::future::pending().await;
        };
        let mut seen = modified;
        let mut trouble = Duration::from_millis(50);
        loop {
            match self.deleted(&Blocker::Key(key.clone()), seen).await {
                Ok(true) => return Ok(()),
                Ok(false) => {
                    // Compacted past `seen`: is our key still there?
                    let now = self.range(range_key(&key)).await?;
                    match now.kvs.first() {
                        Some(kv) if kv.create_revision <= modified => {
                            seen = now.header.map_or(seen, |h| h.revision)
                        }
                        _ => return Ok(()),
                    }
                }
                // A member went away: watch again through another.
                Err(error) if error.is_retryable() => {
                    tracing::debug!(%error, "watch on a held key broke; watching again");
                    tokio::time::sleep(trouble).await;
                    trouble = (trouble * 2).min(Duration::from_secs(1));
                }
                Err(error) => return Err(error),
            }
        }
    }

    async fn describe(&self, name: &LockName) -> Result<LockState> {
        let (queue, _) = self.queue(name).await?;
        let hold_keys = match queue.is_empty() {
            true => Vec::new(),
            false => self.range(range_prefix(&holds_of(name), true)).await?.kvs,
        };
        let mut state = LockState {
            name: name.to_string(),
            last_token: FencingToken(0),
            holders: Vec::new(),
            waiters: Vec::new(),
        };
        for at in 0..queue.len() {
            let member = &queue[at];
            if standing(&queue, at).waiting.is_none() {
                let left = self.time_to_live(member.kv.lease).await?;
                let mut holder = holder_info(member, Duration::from_secs(left.max(0) as u64));
                // Live re-entries: etcd deletes a hold key when its lease ends.
                let create = Some(member.kv.create_revision);
                holder.holds += (hold_keys.iter())
                    .filter(|kv| hold_create(name, &kv.key) == create)
                    .count() as u32;
                state.holders.push(holder);
            } else {
                state.waiters.push(WaiterInfo {
                    owner: member.entry.owner.clone(),
                    host: member.entry.host.clone(),
                    pid: member.entry.pid,
                    kind: member.entry.kind,
                    since: UNIX_EPOCH + Duration::from_millis(member.entry.since),
                });
            }
        }
        // A waiter's key already has the revision that will be its token, but it is not
        // issued until the waiter holds.
        if let Some(newest) = state.holders.iter().map(|h| h.token).max() {
            state.last_token = newest;
        }
        Ok(state)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockState>> {
        let start = [ROOT, prefix.as_bytes()].concat();
        let answer = self
            .range(Op::Range(RangeRequest {
                range_end: prefix_end(&start),
                key: start,
                keys_only: true,
                ..Default::default()
            }))
            .await?;
        // Keys sort by name first (names hold no NUL), so each name's keys are adjacent.
        let mut names: Vec<String> = answer
            .kvs
            .iter()
            .filter_map(|kv| {
                let rest = kv.key.get(ROOT.len()..)?;
                let name = rest.split(|&b| b == 0).next()?;
                std::str::from_utf8(name).ok().map(str::to_string)
            })
            .collect();
        names.dedup();
        let names = names
            .into_iter()
            .filter_map(|n| LockName::new(n).ok())
            .collect();
        busy_states(self, names).await
    }

    async fn force_release(&self, name: &LockName) -> Result<bool> {
        let (queue, _) = self.queue(name).await?;
        let mut any = false;
        for at in 0..queue.len() {
            if standing(&queue, at).waiting.is_some() {
                continue;
            }
            let (key, create) = (&queue[at].kv.key, queue[at].kv.create_revision);
            let marker = marker_key(name, &queue[at].entry.owner, key);
            // Every hold: the key's own, and its re-entries' hold keys.
            let mut ends = remove(key, &marker);
            ends.push(delete_prefix(&holds_prefix(name, create)));
            let answer = self
                .call_txn(txn(vec![Compare::created_at(key, create)], ends, vec![]))
                .await?;
            any |= answer.succeeded;
        }
        Ok(any)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            cross_process: true,
            reclaims_dead_processes: false,
            fair_by_default: true,
            queues_by_wait: false,
            failed_calls_change_nothing: false,
        }
    }

    fn describe_store(&self) -> String {
        self.inner.shown.clone()
    }

    fn caveat(&self) -> Option<String> {
        None
    }
}

impl EtcdStore {
    /// Deletes our key if it is unchanged since `modified` and has no re-entry holds,
    /// and keeps its lease for the next acquisition, refreshed on the way if it has aged.
    /// Whether it did.
    async fn delete_alone(
        &self,
        name: &LockName,
        key: &[u8],
        marker: &[u8],
        lease: EtcdLease,
        create: i64,
        modified: i64,
    ) -> Result<bool> {
        let holds = holds_prefix(name, create);
        let delete_if_unchanged = self.call_txn(txn(
            vec![
                Compare::modified_at(key, modified),
                Compare::empty(&holds, &prefix_end(&holds)),
            ],
            remove(key, marker),
            vec![],
        ));
        let aged = lease.ours && lease.left(Instant::now()) * 3 < lease.ttl() * 2;
        let (answer, lease) = if aged {
            let (answer, refreshed) = tokio::join!(delete_if_unchanged, self.keep_alive(lease));
            (answer?, refreshed.ok().flatten())
        } else {
            (delete_if_unchanged.await?, Some(lease))
        };
        if !answer.succeeded {
            return Ok(false);
        }
        if let Some(lease) = lease {
            self.spare(lease);
        }
        Ok(true)
    }

    /// Takes acquisition `lease`'s hold out of `key` (created at `create`), whatever it
    /// is now. A re-entry deletes its hold key. The key's own hold moves the key onto the
    /// lease of a live re-entry, whose hold it becomes (the key keeps its create
    /// revision, the token), or deletes it with the last hold. `own`: our etcd lease, kept
    /// for reuse once it has no key.
    async fn release_hold(
        &self,
        lease: &Lease,
        key: &[u8],
        create: i64,
        own: Option<EtcdLease>,
    ) -> Result<Released> {
        let name = &lease.name;
        let holds = holds_prefix(name, create);
        loop {
            let Some(now) = self.holding(name, key, create).await? else {
                return Ok(Released::NotHeld);
            };
            let m = &now.member;
            let marker = marker_key(name, &m.entry.owner, key);
            let unchanged = Compare::modified_at(key, m.kv.mod_revision);
            let (compare, change, freed) = match now.role(&lease.id) {
                None => return Ok(Released::NotHeld),
                Some(Role::Reentry(hold)) => (
                    vec![Compare::modified_at(&hold.key, hold.mod_revision)],
                    vec![delete(&hold.key)],
                    hold.lease,
                ),
                Some(Role::Carrier) if m.entry.holds.len() > 1 => {
                    // Re-entries of an older version, in the key's value.
                    let mut entry = m.entry.clone();
                    entry.holds.retain(|h| h != &lease.id);
                    (vec![unchanged], vec![rewrite(key, &entry)], 0)
                }
                Some(Role::Carrier) => match self.heir(&now).await? {
                    Some((hold, id)) => {
                        let mut entry = m.entry.clone();
                        entry.holds = vec![id];
                        (
                            vec![
                                unchanged,
                                Compare::modified_at(&hold.key, hold.mod_revision),
                            ],
                            vec![
                                put_on(hold.lease, key, &entry.value()),
                                put_on(hold.lease, &marker, key),
                                delete(&hold.key),
                            ],
                            m.kv.lease,
                        )
                    }
                    // Hold keys whose leases have ended, if any, go with the key (unless
                    // a re-entry came since).
                    None => {
                        let mut change = remove(key, &marker);
                        change.push(delete_prefix(&holds));
                        let none_new =
                            Compare::created_before(&holds, &prefix_end(&holds), now.revision + 1);
                        (vec![unchanged, none_new], change, m.kv.lease)
                    }
                },
            };
            if self.call_txn(txn(compare, change, vec![])).await?.succeeded {
                match own.filter(|l| l.id == freed) {
                    // Keyless, but the queue key moved off it keeps its name: reused, it
                    // would name that key again.
                    Some(own) if queue_key(name, own.id) == key => self.revoke_later(own.id),
                    Some(own) => self.spare(own),
                    None => {}
                }
                return Ok(Released::Released);
            }
        }
    }

    /// The re-entry that takes the queue key over when the key's own hold is released:
    /// the one whose lease has the most time left (the others' renewals keep the key's
    /// lease alive, whichever it is). `None` if every hold key's lease has ended.
    async fn heir(&self, now: &Holding) -> Result<Option<(KeyValue, LeaseId)>> {
        let mut best: Option<(i64, &KeyValue, &LeaseId)> = None;
        for (kv, id) in &now.holds {
            let left = self.time_to_live(kv.lease).await?;
            if left >= 0 && best.is_none_or(|(most, ..)| left > most) {
                best = Some((left, kv, id));
            }
        }
        Ok(best.map(|(_, kv, id)| (kv.clone(), id.clone())))
    }

    /// Renews a re-entry's hold: its own lease, which its hold key is on, and the queue
    /// key's lease, which must outlive it. If the key's lease is shorter than the TTL
    /// asked, or our own is (an extend), the key moves onto a lease of ours
    /// ([`carry`](Self::carry)).
    async fn renew_reentry(
        &self,
        lease: &Lease,
        ttl: Duration,
        key: &[u8],
        known: EtcdLease,
        create: i64,
    ) -> Result<Renewal> {
        let lost = || {
            self.forget(&lease.id);
            Ok(Renewal::Lost)
        };
        let Some(now) = self.holding(&lease.name, key, create).await? else {
            return lost();
        };
        let carrier = now.member.kv.lease;
        let hold = match now.role(&lease.id) {
            None => return lost(),
            Some(Role::Carrier) => {
                // Our hold is the key's own now: the hold that carried it was released.
                self.update(&lease.id, |a| {
                    a.hold = None;
                    if known.id != carrier {
                        a.lease = Some(borrowed(carrier));
                    }
                });
                return Box::pin(self.renew(lease, ttl)).await;
            }
            Some(Role::Reentry(hold)) => hold,
        };
        let own = match known.id == hold.lease {
            true => known,
            false => borrowed(hold.lease),
        };
        let per_member = (ttl.min(own.ttl()) / 6).max(MIN_TRY_PER_MEMBER);
        let (alive, key_alive) = tokio::join!(
            rpc::trying_each_for(per_member, self.keep_alive(own)),
            rpc::trying_each_for(per_member, self.keep_alive(borrowed(carrier)))
        );
        let (Some(alive), Some(key_alive)) = (alive?, key_alive?) else {
            return lost();
        };
        self.update(&lease.id, |a| {
            a.lease = Some(alive);
            a.hold = Some(hold.key.clone());
        });
        if key_alive.ttl() >= ttl && alive.ttl() >= ttl {
            return Ok(Renewal::Renewed);
        }
        self.carry(lease, ttl, &now, &hold, alive).await
    }

    /// Moves the queue key onto a lease of this re-entry's (its own, or a new one of `ttl`
    /// if its own is shorter), whose hold the key then carries; the hold the key carried
    /// gets a hold key on its own lease, and still ends with it. The key keeps its create
    /// revision (the token).
    async fn carry(
        &self,
        lease: &Lease,
        ttl: Duration,
        now: &Holding,
        hold: &KeyValue,
        own: EtcdLease,
    ) -> Result<Renewal> {
        let target = match own.ttl() >= ttl {
            true => own,
            false => self.grant(ttl).await?,
        };
        let m = &now.member;
        let mut entry = m.entry.clone();
        let carried = std::mem::replace(&mut entry.holds, vec![lease.id.clone()]);
        let mut moves = vec![
            put_on(target.id, &m.kv.key, &entry.value()),
            put_on(
                target.id,
                &marker_key(&lease.name, &entry.owner, &m.kv.key),
                &m.kv.key,
            ),
            delete(&hold.key),
        ];
        if let Some(first) = carried.first() {
            let value = HoldEntry {
                hold: first.clone(),
            }
            .value();
            let create = m.kv.create_revision;
            let key = hold_key(&lease.name, create, m.kv.lease);
            moves.push(put_on(m.kv.lease, &key, &value));
        }
        let answer = self
            .call_txn(txn(
                vec![
                    Compare::modified_at(&m.kv.key, m.kv.mod_revision),
                    Compare::modified_at(&hold.key, hold.mod_revision),
                ],
                moves,
                vec![],
            ))
            .await?;
        if !answer.succeeded {
            // Changed meanwhile: look again.
            if target.id != own.id {
                self.revoke_later(target.id);
            }
            return Box::pin(self.renew(lease, ttl)).await;
        }
        if target.id != own.id {
            // Keyless now, but named in no key: not worth keeping.
            self.revoke_later(own.id);
        }
        self.update(&lease.id, |a| {
            a.lease = Some(target);
            a.hold = None;
            if let State::Held { modified, .. } = &mut a.state {
                *modified = answer.revision();
            }
        });
        Ok(Renewal::Renewed)
    }

    fn update(&self, id: &LeaseId, change: impl FnOnce(&mut Acquisition)) {
        if let Some(a) = self.inner.acquisitions.locked().get_mut(id) {
            change(a);
        }
    }

    fn set_lease(&self, id: &LeaseId, lease: EtcdLease, modified: Option<i64>) {
        if let Some(a) = self.inner.acquisitions.locked().get_mut(id) {
            a.lease = Some(lease);
            if let (Some(revision), State::Held { modified, .. }) = (modified, &mut a.state) {
                *modified = revision;
            }
        }
    }

    /// A key let in while on a waiter's short lease moves to a lease of the lock's TTL
    /// before its grant is returned: a holder's lease is the full TTL (a holder may be
    /// paused for that long), and its guard counts its safe deadline from it. Should the
    /// move fail, the grant stands on the short lease, which the guard's first renewal
    /// lengthens ([`move_to_longer_lease`](Self::move_to_longer_lease)).
    async fn on_full_lease(&self, req: &AcquireRequest, grant: Grant) -> Grant {
        let Some(Acquisition {
            key,
            marker,
            lease: Some(short),
            state: State::Held { create, .. },
            hold: None,
        }) = self.acquisition(&req.lease)
        else {
            return grant;
        };
        if !short.ours || short.asked >= lease_seconds(req.ttl) {
            return grant;
        }
        let Ok(full) = self.lease_for(req.ttl).await else {
            return grant;
        };
        // The marker too: it must go with the key (a key put into an empty queue has
        // none; one more does no harm, a release deletes it with the key).
        let moved = self
            .call_txn(txn(
                vec![Compare::created_at(&key, create)],
                vec![move_to(full.id, &key), put_on(full.id, &marker, &key)],
                vec![],
            ))
            .await;
        let revision = match moved {
            Ok(answer) if answer.succeeded => answer.revision(),
            Ok(_) => {
                // Our key is gone (the guard's first renewal says so): nothing moved.
                self.spare(full);
                return grant;
            }
            // The key may have moved unseen: the guard's renewal follows it to its lease,
            // and the new lease, not reused, ends with the key.
            Err(_) => return grant,
        };
        self.set_lease(&req.lease, full, Some(revision));
        // Not for reuse: the key keeps the short lease's name.
        self.revoke_later(short.id);
        let longer = full
            .alive_until
            .saturating_duration_since(short.alive_until);
        Grant {
            lease: grant
                .lease
                .map(|left| left + longer)
                .filter(|&l| l < req.ttl),
            ..grant
        }
    }

    /// `extend` asked for a longer TTL than the key's etcd lease has: put the key on a
    /// new lease of that length (the key, and so the token, stays).
    async fn move_to_longer_lease(
        &self,
        lease: &Lease,
        kv: &KeyValue,
        old: EtcdLease,
        ttl: Duration,
    ) -> Result<Renewal> {
        let new = self.grant(ttl).await?;
        let mut moves = vec![put_on(new.id, &kv.key, &kv.value)];
        if let Ok(entry) = serde_json::from_slice::<Entry>(&kv.value) {
            moves.push(put_on(
                new.id,
                &marker_key(&lease.name, &entry.owner, &kv.key),
                &kv.key,
            ));
        }
        let answer = self
            .call_txn(txn(
                vec![Compare::modified_at(&kv.key, kv.mod_revision)],
                moves,
                vec![],
            ))
            .await?;
        if !answer.succeeded {
            // Changed meanwhile: look again.
            self.spare(new);
            return Box::pin(self.renew(lease, ttl)).await;
        }
        self.set_lease(&lease.id, new, Some(answer.revision()));
        if old.ours {
            // Not for reuse: the key keeps the old lease's name, and a key named after a
            // spare lease must not exist.
            self.revoke_later(old.id);
        }
        Ok(Renewal::Renewed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(name: &LockName, owner: &str) -> AcquireRequest {
        AcquireRequest {
            name: name.clone(),
            lease: LeaseId::random(),
            owner: owner.to_string(),
            kind: LockKind::Exclusive,
            ttl: Duration::from_secs(30),
            fair: true,
            enqueue: true,
            waited: Duration::ZERO,
            requester: Arc::new(crate::store::Requester::this_process()),
        }
    }

    /// An acquire whose answer was lost had queued its key; retried, it finds its owner's
    /// older key first. Its lease must not be spared while its key is queued (run by
    /// `leasehold torture` on etcd with store restarts, one spare lease backed two
    /// acquisitions and a holder's key was revoked under it). Against a real etcd; the
    /// lost answer is the state the store records for one: the key put, the answer not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retried_attempt_takes_back_its_key_before_it_spares_the_lease() {
        let server = tokio::task::spawn_blocking(leasehold_testkit::EtcdServer::start)
            .await
            .unwrap();
        let store = EtcdStore::connect(&server.url()).await.unwrap();
        let name = LockName::new("lost-answer").unwrap();
        let older = request(&name, "o");
        assert!(matches!(
            store.attempt(&older).await.unwrap(),
            Attempt::Granted(_)
        ));
        // The retried request's first attempt: its key and its owner's marker put, then
        // the answer lost.
        let retried = request(&name, "o");
        let lease = store.lease_for(retried.ttl).await.unwrap();
        let key = queue_key(&name, lease.id);
        let marker = marker_key(&name, "o", &key);
        let entry = Entry {
            owner: "o".into(),
            host: "h".into(),
            pid: 1,
            kind: LockKind::Exclusive,
            since: now_ms(),
            holds: vec![retried.lease.clone()],
        };
        store
            .call_txn(txn(
                vec![],
                vec![
                    put_on(lease.id, &key, &entry.value()),
                    put_on(lease.id, &marker, &key),
                ],
                vec![],
            ))
            .await
            .unwrap();
        store.record(
            &retried.lease,
            Acquisition {
                key: key.clone(),
                marker,
                lease: Some(lease),
                state: State::Unknown,
                hold: None,
            },
        );
        // The retry re-enters the older key, which holds.
        match store.attempt(&retried).await.unwrap() {
            Attempt::Granted(grant) => assert_eq!(grant.holds, 2),
            Attempt::Busy(_) => panic!("the owner holds: it re-enters"),
        }
        let spared = store.inner.spare.lock().unwrap().clone();
        let (queue, _) = store.queue(&name).await.unwrap();
        for lease in spared.values().flatten() {
            let named = queue_key(&name, lease.id);
            assert!(
                queue.iter().all(|m| m.kv.key != named),
                "lease {:x} is spare while its key is queued",
                lease.id
            );
        }
        assert_eq!(queue.len(), 1, "only the older key is left");
    }

    fn queue(kinds: &[LockKind]) -> Vec<Member> {
        kinds
            .iter()
            .enumerate()
            .map(|(i, &kind)| Member {
                kv: KeyValue {
                    key: vec![b'k', i as u8],
                    create_revision: 10 + i as i64,
                    ..Default::default()
                },
                entry: Entry {
                    owner: format!("o{i}"),
                    host: "h".into(),
                    pid: 1,
                    kind,
                    since: 0,
                    holds: vec![format!("l{i}").as_str().into()],
                },
            })
            .collect()
    }

    /// Waiting for the keys `ahead` (by index), `room` of which may remain.
    fn waits_for(ahead: &[u8], room: usize) -> Option<Waiting> {
        Some(Waiting {
            ahead: ahead.iter().map(|&i| vec![b'k', i]).collect(),
            room,
            second: false,
        })
    }

    use LockKind::{Exclusive as W, Shared as R};

    #[test]
    fn a_writer_waits_for_every_key_ahead() {
        let q = queue(&[W, R, W]);
        assert_eq!(standing(&q, 0).waiting, None);
        let third = standing(&q, 2);
        assert_eq!(third.waiting, waits_for(&[0, 1], 0));
        assert_eq!(third.position, 2);
    }

    #[test]
    fn a_reader_waits_only_for_the_writers_ahead() {
        let q = queue(&[R, R, W, R, W, R]);
        assert_eq!(standing(&q, 1).waiting, None, "readers share");
        assert_eq!(standing(&q, 3).waiting, waits_for(&[2], 0));
        assert_eq!(standing(&q, 5).waiting, waits_for(&[2, 4], 0));
    }

    #[test]
    fn the_first_permits_hold_and_the_rest_wait_for_a_key_ahead_to_go() {
        let sem = LockKind::Permit { permits: 2 };
        let q = queue(&[sem, sem, sem]);
        assert_eq!(standing(&q, 1).waiting, None);
        let third = standing(&q, 2);
        assert_eq!(third.waiting, waits_for(&[0, 1], 1));
        assert_eq!(third.position, 1);
    }

    /// `standing` is the lock rules (rules.rs) for a fair queue, read by position: each
    /// key, in create order, is granted exactly when the rules grant a fair request of
    /// its kind against the keys before it (granted ones as holders, the rest as
    /// waiters). Every queue of up to 7 keys of one primitive is checked.
    #[test]
    fn standing_is_the_lock_rules_for_a_fair_queue() {
        let sem = LockKind::Permit { permits: 3 };
        for kinds in [[W, R], [sem, sem]] {
            for len in 1..=7 {
                for bits in 0..1u32 << len {
                    let kinds: Vec<_> = (0..len).map(|i| kinds[(bits >> i & 1) as usize]).collect();
                    let q = queue(&kinds);
                    let (mut holders, mut waiters) = (Vec::new(), Vec::new());
                    for (at, m) in q.iter().enumerate() {
                        let ask = rules::Ask {
                            owner: &m.entry.owner,
                            kind: m.entry.kind,
                            fair: true,
                        };
                        let granted =
                            rules::decide(&holders, &waiters, None, &ask) == rules::Decision::Grant;
                        assert_eq!(
                            standing(&q, at).waiting.is_none(),
                            granted,
                            "{kinds:?} at {at}"
                        );
                        let (owner, kind) = (ask.owner, ask.kind);
                        match granted {
                            true => holders.push(rules::Holder { owner, kind }),
                            false => waiters.push(rules::Waiter { owner, kind }),
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn lease_seconds_round_up() {
        assert_eq!(lease_seconds(Duration::from_millis(100)), 1);
        assert_eq!(lease_seconds(Duration::from_millis(1001)), 2);
        assert_eq!(lease_seconds(Duration::from_secs(15)), 15);
    }

    #[test]
    fn prefix_end_is_the_next_key_range() {
        assert_eq!(rpc::prefix_end(b"ab"), b"ac");
        assert_eq!(rpc::prefix_end(b"a\xff"), b"b");
    }
}
