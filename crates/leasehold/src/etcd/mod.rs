//! etcd store: a lock is a queue of keys ordered by create revision, each on an etcd lease.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold::Result<()> {
//! use leasehold::Leasehold;
//! let locks = Leasehold::connect("etcd://127.0.0.1:2379,127.0.0.1:22379").await?;
//! let guard = locks.mutex("nightly")?.lock().await?; // fair (FIFO) by default on etcd
//! println!("fencing token {}", guard.token());
//! let _ = guard.release().await?; // Released::NotHeld would say the lease had ended first
//! # Ok(()) }
//! ```
//!
//! URLs: `etcd://HOST:PORT[,HOST:PORT...][?user=NAME&password=SECRET]`, and `etcds://` for
//! TLS (rustls; the CA must be trusted by the system store or `SSL_CERT_FILE`). Calls go to
//! one member and fail over to the next when it is down, paused or has no leader: a call
//! tries each member for 1 s, then each for 2 s, up to 3 s a try and 3 s per member in
//! all (a renewal: each once, for a sixth of the lease, at least 250 ms, so that a short
//! lease is renewed through another member in time). A connection answers a PING every 2 s, within 3 s,
//! or is dropped: watches on a paused member move to another within 5 s. A client has at most 64 calls in
//! flight besides those that keep leases alive, and puts at most 32 keys at once; a member
//! that has too many requests is asked again after a backoff: thousands of waiters in one
//! process queue there, not in etcd.
//!
//! # How it works
//! - Every acquisition of lock `NAME` is the key `leasehold\0NAME\0L`, `L` its etcd lease
//!   (hex), holding the holder's owner, description and acquisition ids (JSON). Keys of one
//!   lock sort by create revision into one queue; who holds follows from the order: a
//!   writer or mutex holds when it is first, a reader when no writer is ahead of it, a
//!   permit holder when it is among the first N.
//! - Key names come from leases, which the process reuses, so a lock's queue keeps to a
//!   few names (a waiting key's name is new, see below): etcd keeps every deleted key in its index until the next compaction, and
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
//! - The fencing token is the key's create revision: strictly increasing per lock, never
//!   lower than an earlier acquisition's of any lock (acquisitions of different locks
//!   that shared a request have the same), never reused for the lock, unchanged on
//!   re-entry (re-entry leaves the key as it is, and a key moved onto another lease
//!   keeps its create revision).
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
//!   client share one gRPC stream, and so do all its keepalives.
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
//!   delete (up to 64 spare leases per TTL; the rest, and all of them when the store is
//!   dropped, are revoked). etcd leases count whole seconds (at least the server's minimum, 1–2 s by
//!   default): a lock with a shorter TTL is held by the store slightly longer than the
//!   guard believes, never shorter.
//! - Release deletes only our own key, and only if it is still the acquisition we made
//!   (compared on create/mod revision), so a retried release never deletes a newer lock.
//!   An acquire whose answer never came (timeout, cancellation) is undone by revoking its
//!   lease: whatever etcd did with the request, the key goes with it.
//! - A waiter's key is on a short lease, the waiter lease
//!   ([`waiter_lease`](crate::store::waiter_lease): the TTL, at most 5 s), that all the
//!   waiting keys of a client share (one per length), kept alive by one task at a third
//!   of its TTL: a process that dies leaves the queues when that lease ends, and ten
//!   thousand waiters cost etcd one keepalive every few seconds, not one each. A waiting
//!   key is named by a random id (not after the shared lease). While the process's watch
//!   of the queue has seen every deletion there since the waiter's last read, a recheck
//!   costs no call: the watch says where the key stands, and a waiter only looks again
//!   when a change is signalled (or every 30 s, should one be missed). When it is let
//!   in, the key moves to a lease of its own (one Txn; granted for the TTL, or a spare
//!   one with what is left of it), before the grant is returned, so that the hold ends
//!   with its guard's renewals. A waiter that finds
//!   its own key gone (the lease expired while the process was paused or cut off) stops
//!   with [`Error::WaitEnded`](crate::Error::WaitEnded). See `waiters.rs`.
//! - **Values** (elections): a hold's value is in its queue key's entry, put with the
//!   key, so a queued waiter's shows once it holds; a re-entry leaves the key, and the
//!   value, as they are. A plain lock's entry has no value field: its acquire and release
//!   are unchanged. `proclaim` reads the key and rewrites its entry in one Txn that
//!   compares the key's mod revision (and a re-entry's hold key) and keeps the key's
//!   lease (`ignore_lease`), so the token stays. `watch` is an etcd watch of the queue's
//!   keys, puts and deletions, started before it reads the holders; it wakes at every
//!   join too, and reads again.
//! - **Downgrade**: the same compared rewrite, of the entry's kind (and only while the
//!   key has no re-entry hold keys: a compare that none was created since the read).
//!   It deletes nothing, so a waiting reader also watches the queue for puts that
//!   rewrite a key into a reader's entry, and reads the queue again when one comes.
//! - `lost`: a guard watches its key, so a force-release or a lease expiry is seen at once.
//!   Renewal checks both the lease and the key. A force-release deletes the key and its
//!   hold keys: every hold ends.
//! - **Txns of different locks share requests.** A Txn that finds a request of the
//!   client's Txns in flight (and none of its lock's) waits while the tasks ready now
//!   run (two requests in flight: until one ends, at most a few times as long as a
//!   request takes), and the waiting Txns go together as the ops of one Txn:
//!   etcd applies them as one raft entry, with one reply (`rpc/batch.rs`). Every inner Txn's
//!   compares are taken against the keys as they were, and Txns of one lock (the name in
//!   their keys) never share a request, so each compares, reads and writes what it would
//!   alone; they share a revision, so tokens of different locks may be equal (a lock's
//!   own still rise). A request etcd refuses as a whole changed nothing, and its Txns
//!   are sent again one by one.
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
//!   A waiter's key is written anew, held since then, when it moves onto the full lease
//!   at its grant; with a TTL no longer than the waiter lease (5 s) there is no move,
//!   and its `since` stays when it joined the queue.
//! - `describe().last_token` is the newest token among current holders, and 0 while
//!   nobody holds the lock (etcd keeps no per-name counter; tokens come from the cluster
//!   revision). A waiter's key has its token already, but it is not issued before it holds.

// Where things are (following one acquire: store.rs -> acquire.rs -> queue.rs for where
// the key stands -> acquisitions.rs to record it -> wait.rs while it waits):
// - connect.rs: the URL and the members, the calls every room makes, their errors.
//   rpc/: the client (messages, failover, links, Txns sharing requests in batch.rs).
// - queue.rs: the queue model, pure: key layout, key values, who holds (`standing`).
// - leases.rs: etcd leases, the pool of spare ones, keepalives, renewing a hold, moving a
//   key onto a longer lease. waiters.rs: the lease waiting keys share, and its keeper.
// - acquisitions.rs: what the client keeps of each acquisition, and recording outcomes.
// - acquire.rs: the attempt: passes that put or re-read our key and settle where it stands.
// - reentry.rs: re-entry holds, each on a lease of its own (taking, renewing, releasing).
// - wait.rs: waiting and watches; line.rs: a process's waiters on one watch.
// - election.rs: a holder's entry rewritten (proclaim, downgrade), and the watches that
//   hear of it.
// - store.rs: the `Store` impl, routing each call to the rooms above.
// - rpc/: the etcd v3 messages, the client that fails over, watches on one stream.

mod acquire;
mod acquisitions;
mod connect;
mod election;
mod leases;
mod line;
mod queue;
mod reentry;
mod rpc;
mod store;
mod wait;
mod waiters;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::store::ByLease;
use acquisitions::Acquisition;
use leases::EtcdLease;
use line::Lines;
use rpc::Client;

/// The least time a renewal's call gives one member before trying the next: a healthy
/// member under load can take this long, and a failed-over call restarts the watches.
const MIN_TRY_PER_MEMBER: Duration = Duration::from_millis(250);

/// How long a call that keeps a lease of `ttl` alive gives one member while another is
/// left to try (see [`rpc::trying_each_for`]): a sixth of it, so a paused member cannot
/// keep the call from a healthy one in time.
fn try_per_member(ttl: Duration) -> Duration {
    (ttl / 6).max(MIN_TRY_PER_MEMBER)
}

/// One pass of a call that may have to start again: its answer, or why it starts again
/// (instead of calling itself).
enum Pass<T, Why> {
    Done(T),
    Again(Why),
}

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
    /// Shared with the revokes of the spare leases when the store is dropped.
    client: Arc<Client>,
    /// This client's acquisitions, by id: what etcd holds for each. Boxed: a map keeps
    /// room for up to twice its entries, and thousands of waiters each have one.
    acquisitions: Mutex<ByLease<Box<Acquisition>>>,
    /// Released leases, alive and without keys, by TTL in seconds: the next acquisition
    /// takes one instead of granting a new lease.
    spare: Mutex<HashMap<i64, Vec<EtcdLease>>>,
    /// By acquisition: the full lease a hand-over's move was sent with and not seen
    /// through (its caller was cancelled, or etcd did not answer). The next move of that
    /// key goes onto the same lease, so a move etcd applied unseen lands there too; the
    /// release revokes it (see [`EtcdStore::on_full_lease`]).
    moving: Mutex<ByLease<EtcdLease>>,
    /// The leases waiting keys share, and the lock a new one is granted under.
    waiter_leases: Mutex<waiters::WaiterLeases>,
    granting: tokio::sync::Mutex<()>,
    lines: Lines,
    /// Queues (by prefix) this client last found busy: an attempt there joins at once
    /// (see [`EtcdStore::attempt`]).
    busy_queues: Mutex<HashSet<Vec<u8>>>,
    /// By queue prefix: the holder its waiting keys were last shown, one copy for all of
    /// them (see [`EtcdStore::queued`]).
    shown_holders: Mutex<HashMap<Vec<u8>, std::sync::Weak<crate::store::HolderInfo>>>,
    /// What the member asked at connect may do to held locks ([`Store::caveat`]).
    caveat: std::sync::OnceLock<String>,
    /// Admissions of attempts that put a key ([`PUTS_AT_ONCE`]).
    puts: tokio::sync::Semaphore,
    /// Admissions of attempts that may put a key, before their state is built
    /// ([`ATTEMPTS_AT_ONCE`], see [`Store::admit`](crate::store::Store::admit)).
    attempts: Arc<tokio::sync::Semaphore>,
    /// Revokes on their way in the background (see [`EtcdStore::revoke_later`]), which
    /// [`shed`](crate::store::Store::shed) waits for.
    revokes: tokio_util::task::TaskTracker,
}

/// Attempts that put a key at once: more queue in the process, not in etcd.
const PUTS_AT_ONCE: usize = 32;

/// Attempts under way that may put a key: enough to keep the puts busy.
const ATTEMPTS_AT_ONCE: usize = 2 * PUTS_AT_ONCE;

/// The ids of the spare leases, taken out of `spare`.
fn spare_ids(spare: &mut HashMap<i64, Vec<EtcdLease>>) -> Vec<i64> {
    spare.drain().flat_map(|(_, l)| l).map(|l| l.id).collect()
}

impl Drop for Inner {
    /// The spare leases have no keys and nobody to reuse them now, and the waiters'
    /// leases no waiters: revoke them rather than leave them in etcd until their TTL (in
    /// the background, if a runtime runs).
    fn drop(&mut self) {
        let mut spare = (self.spare.get_mut()).map_or_else(|_| Vec::new(), spare_ids);
        if let Ok(waiters) = self.waiter_leases.get_mut() {
            spare.extend(waiters.drain());
        }
        if spare.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let client = self.client.clone();
            runtime.spawn(async move {
                for id in spare {
                    let _: std::result::Result<rpc::Empty, _> = client
                        .unary("/etcdserverpb.Lease/LeaseRevoke", rpc::LeaseId { id })
                        .await;
                }
            });
        }
    }
}
