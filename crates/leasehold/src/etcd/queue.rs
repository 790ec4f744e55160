//! The queue model, pure: the key layout, the values of queue and hold keys, where a key
//! stands in its queue (who holds), and the reads and writes of that layout as etcd ops.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::rpc::{
    self, prefix_end, Compare, DeleteRangeRequest, KeyValue, Op, PutRequest, RangeRequest,
    TxnRequest,
};
use crate::store::{AcquireRequest, HolderInfo, LeaseId, LockKind};
use crate::{FencingToken, LockName, Locked};

pub(super) const ROOT: &[u8] = b"leasehold\0";
/// Owner markers: outside every range under [`ROOT`].
pub(super) const MARKERS: &[u8] = b"leasehold\x01";
/// Re-entry holds: outside every range under [`ROOT`] and [`MARKERS`].
pub(super) const HOLDS: &[u8] = b"leasehold\x02";

/// The value of a queue key.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Entry {
    pub(super) owner: String,
    pub(super) host: String,
    pub(super) pid: u32,
    pub(super) kind: LockKind,
    /// Client wall clock, ms since the epoch.
    pub(super) since: u64,
    /// The acquisition whose hold the key itself carries, on its lease (one; older
    /// versions listed re-entries here too). Re-entries have hold keys of their own
    /// ([`hold_key`]).
    pub(super) holds: Vec<LeaseId>,
    /// The holder's published value ([`AcquireRequest::value`], [`Store::proclaim`]).
    /// Absent for plain locks, whose keys stay as they were.
    ///
    /// [`AcquireRequest::value`]: crate::store::AcquireRequest::value
    /// [`Store::proclaim`]: crate::store::Store::proclaim
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) value: Option<String>,
}

/// The value of a re-entry's hold key.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct HoldEntry {
    pub(super) hold: LeaseId,
}

impl HoldEntry {
    pub(super) fn value(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("plain strings serialize")
    }
}

impl Entry {
    /// The entry of `req`'s own key, held (or waiting) since now.
    pub(super) fn of(req: &AcquireRequest) -> Entry {
        Entry {
            owner: req.owner.to_string(),
            host: req.requester.host.clone(),
            pid: req.requester.pid,
            kind: req.kind,
            since: now_ms(),
            holds: vec![req.lease.clone()],
            value: req.value.as_deref().map(str::to_string),
        }
    }

    pub(super) fn value(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("plain strings and numbers serialize")
    }
}

/// A queue key read back.
#[derive(Clone, Debug)]
pub(super) struct Member {
    pub(super) kv: KeyValue,
    pub(super) entry: Entry,
}

/// Where one key stands in its queue.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Standing {
    /// `None`: it holds the lock.
    pub(super) waiting: Option<Waiting>,
    /// Waiters ahead + 1.
    pub(super) position: usize,
}

/// A key of one queue as this client keeps it, in one word: what follows the queue's
/// prefix is the hex id the key was named by (its lease's, or a waiting key's own),
/// kept as that id where it reads back exactly. A key costs no allocation, and a list
/// of the keys ahead of a waiter eight bytes a key (thousands of waiters keep their own
/// key and the keys ahead of them, in their record and in their line). Any other key
/// (not named by this library: rare) gets a negative id from a table of the process,
/// where it stays; so two keys of one queue are equal exactly when their ids are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct KeyId(i64);

/// The keys not named by an id, each once, in the order they were met: `KeyId(-1 - i)`
/// is `OTHER_KEYS.keys[i]`.
static OTHER_KEYS: std::sync::LazyLock<Mutex<OtherKeys>> =
    std::sync::LazyLock::new(Default::default);

#[derive(Default)]
struct OtherKeys {
    ids: std::collections::HashMap<Box<[u8]>, i64>,
    keys: Vec<Box<[u8]>>,
}

impl KeyId {
    /// No key (an acquisition outside the queue): ids start at 1.
    pub(super) const NONE: KeyId = KeyId(0);

    /// The key this id names in `name`'s queue.
    pub(super) fn key_in(&self, name: &LockName) -> Vec<u8> {
        match usize::try_from(-1 - self.0) {
            Ok(other) => OTHER_KEYS.locked().keys[other].to_vec(),
            Err(_) => queue_key(name, self.0),
        }
    }

    /// The id of a queue's `key`: lock names have no control characters, so its suffix is
    /// what follows its last NUL.
    pub(super) fn of(key: &[u8]) -> KeyId {
        let suffix = key.rsplit(|&b| b == 0).next().unwrap_or(key);
        // As `queue_key` writes an id: lowercase hex, no leading zero.
        let canonical = (1..=16).contains(&suffix.len())
            && (suffix[0] != b'0' || suffix.len() == 1)
            && suffix
                .iter()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        let id = canonical
            .then(|| std::str::from_utf8(suffix).ok())
            .flatten()
            .and_then(|hex| i64::from_str_radix(hex, 16).ok());
        if let Some(id) = id {
            return KeyId(id);
        }
        let mut others = OTHER_KEYS.locked();
        if let Some(&id) = others.ids.get(key) {
            return KeyId(id);
        }
        let id = -1 - others.keys.len() as i64;
        others.keys.push(key.into());
        others.ids.insert(key.into(), id);
        KeyId(id)
    }
}

/// What a waiting key waits for: the deletion of keys ahead of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Waiting {
    /// The keys ahead whose deletion can let it in (see [`EtcdStore::deletion_lets_in`]):
    /// shared by the acquisition's record and its place in line.
    pub(super) ahead: Arc<[KeyId]>,
    /// How many of them may remain when it holds.
    pub(super) room: u32,
    /// Behind a waiting key of its own owner: when `ahead` is down to `room`, it does not
    /// hold, it looks again (its owner may hold by then: see [`EtcdStore::behind_owner`]).
    pub(super) second: bool,
}

/// `n` as a count kept in 32 bits (a queue's keys, a place in it), saturating.
pub(super) fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A writer waits for every key ahead of it. `key(i)`: the `i`th key of the queue, in
/// create order.
pub(super) fn writer_waiting<'a>(at: usize, key: impl Fn(usize) -> &'a [u8]) -> Option<Waiting> {
    (at > 0).then(|| Waiting {
        ahead: (0..at).map(|i| KeyId::of(key(i))).collect(),
        room: 0,
        second: false,
    })
}

/// The standing of `queue[at]`, by the rules of its kind. `queue` is in create order.
/// This is the lock rules ([`rules::decide`]) for a fair queue, read by position (a
/// test checks that they agree): linear in the queue, where folding `decide` over it
/// would be quadratic.
pub(super) fn standing(queue: &[Member], at: usize) -> Standing {
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
        members.map(|m| KeyId::of(&m.kv.key)).collect::<Arc<[_]>>()
    };
    let waiting = match queue[at].entry.kind {
        LockKind::Exclusive => writer_waiting(at, |i| &queue[i].kv.key),
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
            room: permits - 1,
            second: false,
        }),
    };
    Standing { waiting, position }
}

/// `root`, the name and a NUL, in a buffer with room for `more` bytes after: every key
/// of a lock is made in one allocation (an acquire and its release make several).
fn under(root: &[u8], name: &LockName, more: usize) -> Vec<u8> {
    let mut key = Vec::with_capacity(under_len(root, name) + more);
    key.extend_from_slice(root);
    key.extend_from_slice(name.as_str().as_bytes());
    key.push(0);
    key
}

/// How long [`under`]'s prefix is.
fn under_len(root: &[u8], name: &LockName) -> usize {
    root.len() + name.as_str().len() + 1
}

/// Appends `id` in lowercase hex, as `{:x}` writes it (etcd's lease ids as etcdctl
/// shows them).
fn push_hex(key: &mut Vec<u8>, id: i64) {
    use std::io::Write;
    let _ = write!(key, "{id:x}");
}

/// Room for an id in hex.
const HEX: usize = 16;

pub(super) fn queue_prefix(name: &LockName) -> Vec<u8> {
    under(ROOT, name, 0)
}

pub(super) fn queue_key(name: &LockName, lease: i64) -> Vec<u8> {
    let mut key = under(ROOT, name, HEX);
    push_hex(&mut key, lease);
    key
}

/// Where the markers of `owner`'s keys in `name`'s queue are (see the module docs).
pub(super) fn owner_markers(name: &LockName, owner: &str) -> Vec<u8> {
    let mut key = under(MARKERS, name, owner.len() + 1 + HEX);
    key.extend_from_slice(owner.as_bytes());
    key.push(0);
    key
}

/// The marker of `owner`'s key `key` in `name`'s queue: one per key (owner ids have no
/// control characters, so one owner's markers are never another's).
pub(super) fn marker_key(name: &LockName, owner: &str, key: &[u8]) -> Vec<u8> {
    let mut marker = owner_markers(name, owner);
    marker.extend_from_slice(key.get(under_len(ROOT, name)..).unwrap_or_default());
    marker
}

/// Where the re-entry holds of every queue key of `name` are.
pub(super) fn holds_of(name: &LockName) -> Vec<u8> {
    under(HOLDS, name, 0)
}

/// Where the re-entry holds of `name`'s queue key created at `create` are: under its
/// create revision, never reused, so a hold key left by a force-release never counts
/// for a later key of the same name.
pub(super) fn holds_prefix(name: &LockName, create: i64) -> Vec<u8> {
    let mut key = under(HOLDS, name, 2 * HEX + 1);
    push_hex(&mut key, create);
    key.push(0);
    key
}

/// A re-entry's hold key, on the hold's own `lease`: etcd deletes it when the lease
/// ends, which ends the hold.
pub(super) fn hold_key(name: &LockName, create: i64, lease: i64) -> Vec<u8> {
    let mut key = holds_prefix(name, create);
    push_hex(&mut key, lease);
    key
}

/// The create revision a hold key of `name` is filed under.
pub(super) fn hold_create(name: &LockName, key: &[u8]) -> Option<i64> {
    let rest = key.get(holds_of(name).len()..)?;
    let create = rest.split(|&b| b == 0).next()?;
    i64::from_str_radix(std::str::from_utf8(create).ok()?, 16).ok()
}

/// The lock name whose keys `request` touches, when they are all one name's (queue keys,
/// markers, holds; ranges within them): Txns of different names may share a request
/// ([`rpc::Scope`]). `None` for anything else, sent alone.
pub(super) fn txn_scope(request: &TxnRequest) -> Option<&[u8]> {
    let mut scope = None;
    scope_of(request, &mut scope)?;
    scope
}

/// Narrows `scope` to each key and range that `request` compares, reads or writes,
/// nested Txns' too; `None` when they are not all one name's.
fn scope_of<'a>(request: &'a TxnRequest, scope: &mut Option<&'a [u8]>) -> Option<()> {
    fn within<'a>(scope: &mut Option<&'a [u8]>, key: &'a [u8], range_end: &[u8]) -> Option<()> {
        let name = name_of(key, range_end)?;
        (*scope.get_or_insert(name) == name).then_some(())
    }
    for compare in &request.compare {
        within(scope, &compare.key, &compare.range_end)?;
    }
    for op in request.success.iter().chain(&request.failure) {
        match op.request.as_ref()? {
            Op::Range(r) => within(scope, &r.key, &r.range_end)?,
            Op::Put(p) => within(scope, &p.key, &[])?,
            Op::Delete(d) => within(scope, &d.key, &d.range_end)?,
            Op::Txn(t) => scope_of(t, scope)?,
        }
    }
    Some(())
}

/// The name in the layout's `key` (under [`ROOT`], [`MARKERS`] or [`HOLDS`]), if the
/// range from it to `range_end` (empty: the key alone) stays within that name's keys.
fn name_of<'a>(key: &'a [u8], range_end: &[u8]) -> Option<&'a [u8]> {
    let root = [ROOT, MARKERS, HOLDS]
        .into_iter()
        .find(|r| key.starts_with(r))?;
    let rest = &key[root.len()..];
    let name = &rest[..rest.iter().position(|&b| b == 0)?];
    let under = root.len() + name.len();
    // A range ends within the name's keys: at its `\0` or just after them (`\x01`).
    let ends_within = range_end.is_empty()
        || (range_end.get(..under) == key.get(..under)
            && range_end.get(under).is_none_or(|&b| b <= 1));
    ends_within.then_some(name)
}

/// Puts `key` on etcd lease `lease`.
pub(super) fn put_on(lease: i64, key: &[u8], value: &[u8]) -> Op {
    Op::Put(PutRequest {
        key: key.to_vec(),
        value: value.to_vec(),
        lease,
        ignore_value: false,
        ignore_lease: false,
    })
}

/// Writes `entry` into the existing `key`, keeping the key's lease.
pub(super) fn rewrite(key: &[u8], entry: &Entry) -> Op {
    Op::Put(PutRequest {
        key: key.to_vec(),
        value: entry.value(),
        lease: 0,
        ignore_value: false,
        ignore_lease: true,
    })
}

/// Takes `key` out of the queue with its owner's marker.
pub(super) fn remove(key: &[u8], marker: &[u8]) -> Vec<Op> {
    vec![delete(key), delete(marker)]
}

pub(super) fn range_queue(prefix: &[u8]) -> Op {
    Op::Range(queue_keys(prefix, false))
}

/// The keys of the queue in create order, with their values unless `keys_only`.
pub(super) fn queue_keys(prefix: &[u8], keys_only: bool) -> RangeRequest {
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
pub(super) fn writer_view(prefix: &[u8]) -> [Op; 2] {
    [
        Op::Range(queue_keys(prefix, true)),
        Op::Range(RangeRequest {
            limit: 1,
            ..queue_keys(prefix, false)
        }),
    ]
}

pub(super) fn range_key(key: &[u8]) -> Op {
    Op::Range(RangeRequest {
        key: key.to_vec(),
        ..Default::default()
    })
}

pub(super) fn delete(key: &[u8]) -> Op {
    Op::Delete(DeleteRangeRequest {
        key: key.to_vec(),
        range_end: Vec::new(),
    })
}

pub(super) fn delete_prefix(prefix: &[u8]) -> Op {
    Op::Delete(DeleteRangeRequest {
        key: prefix.to_vec(),
        range_end: prefix_end(prefix),
    })
}

pub(super) fn range_prefix(prefix: &[u8], keys_only: bool) -> Op {
    Op::Range(RangeRequest {
        key: prefix.to_vec(),
        range_end: prefix_end(prefix),
        keys_only,
        ..Default::default()
    })
}

pub(super) fn txn(compare: Vec<Compare>, success: Vec<Op>, failure: Vec<Op>) -> TxnRequest {
    TxnRequest {
        compare,
        success: success.into_iter().map(Into::into).collect(),
        failure: failure.into_iter().map(Into::into).collect(),
    }
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

pub(super) fn holder_info(member: &Member, lease_left: Duration) -> HolderInfo {
    HolderInfo {
        owner: member.entry.owner.clone(),
        host: member.entry.host.clone(),
        pid: member.entry.pid,
        token: FencingToken(member.kv.create_revision as u64),
        kind: member.entry.kind,
        since: UNIX_EPOCH + Duration::from_millis(member.entry.since),
        lease_left,
        holds: member.entry.holds.len() as u32,
        value: member.entry.value.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules;

    #[test]
    fn a_locks_keys_are_laid_out_as_every_client_reads_them() {
        let name: LockName = "jobs/nightly".try_into().expect("a valid name");
        let key = queue_key(&name, 0x1a2b);
        assert_eq!(key, b"leasehold\x00jobs/nightly\x001a2b");
        assert_eq!(queue_prefix(&name), b"leasehold\x00jobs/nightly\x00");
        assert_eq!(KeyId::of(&key).key_in(&name), key);
        assert_eq!(
            owner_markers(&name, "me"),
            b"leasehold\x01jobs/nightly\x00me\x00"
        );
        assert_eq!(
            marker_key(&name, "me", &key),
            b"leasehold\x01jobs/nightly\x00me\x001a2b"
        );
        assert_eq!(holds_of(&name), b"leasehold\x02jobs/nightly\x00");
        assert_eq!(
            holds_prefix(&name, 0xff),
            b"leasehold\x02jobs/nightly\x00ff\x00"
        );
        let hold = hold_key(&name, 0xff, 0x7fff_ffff_ffff_ffff);
        assert_eq!(hold, b"leasehold\x02jobs/nightly\x00ff\x007fffffffffffffff");
        assert_eq!(hold_create(&name, &hold), Some(0xff));
    }

    /// A Txn over one name's queue keys, markers and holds is of that name; one that
    /// touches two names, or ranges past a name's keys, has no scope (it goes alone).
    #[test]
    fn a_txn_is_scoped_to_the_one_name_whose_keys_it_touches() {
        let name: LockName = "a".try_into().expect("a valid name");
        let longer: LockName = "ab".try_into().expect("a valid name");
        let (prefix, key) = (queue_prefix(&name), queue_key(&name, 7));
        let join = rpc::TxnRequest {
            compare: vec![Compare::empty(&prefix, &prefix_end(&prefix))],
            success: vec![
                put_on(7, &key, b"{}").into(),
                put_on(7, &marker_key(&name, "me", &key), b"").into(),
            ],
            failure: vec![
                range_queue(&prefix).into(),
                range_key(&hold_key(&name, 3, 7)).into(),
            ],
        };
        assert_eq!(txn_scope(&join), Some(&b"a"[..]));
        let nested = rpc::TxnRequest {
            success: vec![Op::Txn(Box::new(join.clone())).into()],
            ..Default::default()
        };
        assert_eq!(txn_scope(&nested), Some(&b"a"[..]));
        let two_names = rpc::TxnRequest {
            success: vec![delete(&queue_key(&longer, 7)).into()],
            ..join.clone()
        };
        assert_eq!(txn_scope(&two_names), None);
        let every_lock = rpc::TxnRequest {
            compare: vec![Compare::empty(ROOT, &prefix_end(ROOT))],
            ..Default::default()
        };
        assert_eq!(txn_scope(&every_lock), None);
        let past_the_name = rpc::TxnRequest {
            compare: vec![Compare::empty(&prefix, &queue_prefix(&longer))],
            ..Default::default()
        };
        assert_eq!(txn_scope(&past_the_name), None);
        assert_eq!(txn_scope(&rpc::TxnRequest::default()), None);
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
                    value: None,
                },
            })
            .collect()
    }

    /// Waiting for the keys `ahead` (by index), `room` of which may remain.
    fn waits_for(ahead: &[u8], room: u32) -> Option<Waiting> {
        Some(Waiting {
            ahead: ahead.iter().map(|&i| KeyId::of(&[b'k', i])).collect(),
            room,
            second: false,
        })
    }

    use LockKind::{Exclusive as W, Shared as R};

    #[test]
    fn a_key_is_kept_as_its_lease_id_where_that_reads_back_exactly() {
        let name = LockName::new("n").unwrap();
        for id in [0, 0x1f, i64::MAX] {
            let key = queue_key(&name, id);
            assert_eq!(KeyId::of(&key), KeyId(id));
            assert_eq!(KeyId(id).key_in(&name), key);
        }
        // Not as `queue_key` writes an id: kept whole, so never equal to an id's key.
        let odd = [
            "01f",
            "1F",
            "+1f",
            "-1",
            "",
            "8000000000000000",
            "1ffffffffffffffff",
        ];
        for odd in odd.into_iter().chain(["owner-id"]) {
            let key = [queue_prefix(&name), odd.as_bytes().to_vec()].concat();
            let id = KeyId::of(&key);
            assert!(id.0 < 0, "{odd:?}");
            assert_eq!(KeyId::of(&key), id, "{odd:?}: the same id again");
            assert_eq!(id.key_in(&name), key, "{odd:?}");
        }
    }

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
}
