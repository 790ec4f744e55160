//! The etcd v3 messages the store uses, as `prost` derives (field numbers as in etcd's
//! `rpc.proto` and `kv.proto`).

#[derive(Clone, PartialEq, prost::Message)]
pub struct ResponseHeader {
    #[prost(int64, tag = "3")]
    pub revision: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(int64, tag = "2")]
    pub create_revision: i64,
    #[prost(int64, tag = "3")]
    pub mod_revision: i64,
    #[prost(bytes = "vec", tag = "5")]
    pub value: Vec<u8>,
    #[prost(int64, tag = "6")]
    pub lease: i64,
}

/// `RangeRequest.SortOrder.ASCEND` / `SortTarget.CREATE`.
pub const ASCEND: i32 = 1;
pub const BY_CREATE: i32 = 2;

#[derive(Clone, PartialEq, prost::Message)]
pub struct RangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub range_end: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub limit: i64,
    #[prost(int32, tag = "5")]
    pub sort_order: i32,
    #[prost(int32, tag = "6")]
    pub sort_target: i32,
    /// Answered by the member from its own state, without a quorum read.
    #[prost(bool, tag = "7")]
    pub serializable: bool,
    #[prost(bool, tag = "8")]
    pub keys_only: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RangeResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(message, repeated, tag = "2")]
    pub kvs: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub lease: i64,
    /// Keep the key's value (the key must exist).
    #[prost(bool, tag = "5")]
    pub ignore_value: bool,
    #[prost(bool, tag = "6")]
    pub ignore_lease: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DeleteRangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    /// Empty: `key` alone.
    #[prost(bytes = "vec", tag = "2")]
    pub range_end: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RequestOp {
    #[prost(oneof = "Op", tags = "1, 2, 3, 4")]
    pub request: Option<Op>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Op {
    #[prost(message, tag = "1")]
    Range(RangeRequest),
    #[prost(message, tag = "2")]
    Put(PutRequest),
    #[prost(message, tag = "3")]
    Delete(DeleteRangeRequest),
    #[prost(message, boxed, tag = "4")]
    Txn(Box<TxnRequest>),
}

impl From<Op> for RequestOp {
    fn from(op: Op) -> Self {
        RequestOp { request: Some(op) }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ResponseOp {
    #[prost(oneof = "OpResponse", tags = "1, 4")]
    pub response: Option<OpResponse>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum OpResponse {
    #[prost(message, tag = "1")]
    Range(RangeResponse),
    #[prost(message, boxed, tag = "4")]
    Txn(Box<TxnResponse>),
}

/// `Compare.CompareResult.EQUAL`, and the targets we compare.
pub const EQUAL: i32 = 0;
pub const CREATE: i32 = 1;
pub const MOD: i32 = 2;
/// `Compare.CompareResult.LESS`.
pub const LESS: i32 = 2;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Compare {
    #[prost(int32, tag = "1")]
    pub result: i32,
    #[prost(int32, tag = "2")]
    pub target: i32,
    #[prost(bytes = "vec", tag = "3")]
    pub key: Vec<u8>,
    /// `create_revision` or `mod_revision`, by `target`.
    #[prost(oneof = "Revision", tags = "5, 6")]
    pub revision: Option<Revision>,
    /// With a range, every key in it must match; an empty range compares as one absent
    /// key (create revision 0). That is how "nobody holds or waits" is one compare.
    #[prost(bytes = "vec", tag = "64")]
    pub range_end: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Revision {
    #[prost(int64, tag = "5")]
    Create(i64),
    #[prost(int64, tag = "6")]
    Mod(i64),
}

impl Compare {
    /// `key`'s create revision is `revision` (0: the key does not exist).
    pub fn created_at(key: &[u8], revision: i64) -> Self {
        Compare {
            result: EQUAL,
            target: CREATE,
            key: key.to_vec(),
            revision: Some(Revision::Create(revision)),
            range_end: Vec::new(),
        }
    }

    /// `key` was last changed at `revision`.
    pub fn modified_at(key: &[u8], revision: i64) -> Self {
        Compare {
            result: EQUAL,
            target: MOD,
            key: key.to_vec(),
            revision: Some(Revision::Mod(revision)),
            range_end: Vec::new(),
        }
    }

    /// Every key in `[key, range_end)` was created before `revision` (so, also, when
    /// there is none).
    pub fn created_before(key: &[u8], range_end: &[u8], revision: i64) -> Self {
        Compare {
            result: LESS,
            range_end: range_end.to_vec(),
            ..Self::created_at(key, revision)
        }
    }

    /// No key in `[key, range_end)`.
    pub fn empty(key: &[u8], range_end: &[u8]) -> Self {
        Compare {
            range_end: range_end.to_vec(),
            ..Self::created_at(key, 0)
        }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TxnRequest {
    #[prost(message, repeated, tag = "1")]
    pub compare: Vec<Compare>,
    #[prost(message, repeated, tag = "2")]
    pub success: Vec<RequestOp>,
    #[prost(message, repeated, tag = "3")]
    pub failure: Vec<RequestOp>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TxnResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(bool, tag = "2")]
    pub succeeded: bool,
    #[prost(message, repeated, tag = "3")]
    pub responses: Vec<ResponseOp>,
}

impl TxnResponse {
    pub fn revision(&self) -> i64 {
        self.header.as_ref().map_or(0, |h| h.revision)
    }

    /// The key-values of the first range in the branch taken.
    pub fn range(&self) -> Option<&[KeyValue]> {
        self.ranges().next().map(|r| &r.kvs[..])
    }

    /// The ranges of the branch taken, in order.
    pub fn ranges(&self) -> impl Iterator<Item = &RangeResponse> {
        self.responses
            .iter()
            .filter_map(|r| match r.response.as_ref()? {
                OpResponse::Range(range) => Some(range),
                OpResponse::Txn(_) => None,
            })
    }

    /// The answer of the first nested transaction in the branch taken.
    pub fn nested(&self) -> Option<&TxnResponse> {
        self.responses
            .iter()
            .find_map(|r| match r.response.as_ref()? {
                OpResponse::Txn(txn) => Some(&**txn),
                OpResponse::Range(_) => None,
            })
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchRequest {
    #[prost(oneof = "WatchOp", tags = "1, 2")]
    pub request: Option<WatchOp>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum WatchOp {
    #[prost(message, tag = "1")]
    Create(WatchCreateRequest),
    #[prost(message, tag = "2")]
    Cancel(WatchCancelRequest),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchCancelRequest {
    #[prost(int64, tag = "1")]
    pub watch_id: i64,
}

/// `WatchCreateRequest.FilterType.NOPUT`: deletions only.
pub const NO_PUT: i32 = 0;
/// `NODELETE`: puts only.
pub const NO_DELETE: i32 = 1;

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchCreateRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub range_end: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub start_revision: i64,
    #[prost(int32, repeated, tag = "5")]
    pub filters: Vec<i32>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(int64, tag = "2")]
    pub watch_id: i64,
    #[prost(bool, tag = "3")]
    pub created: bool,
    #[prost(bool, tag = "4")]
    pub canceled: bool,
    #[prost(int64, tag = "5")]
    pub compact_revision: i64,
    #[prost(string, tag = "6")]
    pub cancel_reason: String,
    #[prost(message, repeated, tag = "11")]
    pub events: Vec<Event>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(message, optional, tag = "2")]
    pub kv: Option<KeyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseGrantRequest {
    #[prost(int64, tag = "1")]
    pub ttl: i64,
    /// Chosen by the client (0: by etcd).
    #[prost(int64, tag = "2")]
    pub id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseGrantResponse {
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(int64, tag = "3")]
    pub ttl: i64,
    #[prost(string, tag = "4")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseId {
    #[prost(int64, tag = "1")]
    pub id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseKeepAliveResponse {
    #[prost(int64, tag = "2")]
    pub id: i64,
    /// Seconds the lease now runs; 0 or less when it no longer exists.
    #[prost(int64, tag = "3")]
    pub ttl: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseTimeToLiveResponse {
    #[prost(int64, tag = "3")]
    pub ttl: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthenticateRequest {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub password: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AuthenticateResponse {
    #[prost(string, tag = "2")]
    pub token: String,
}

/// A member's status (Maintenance/Status takes an empty request).
#[derive(Clone, PartialEq, prost::Message)]
pub struct StatusResponse {
    /// The member's etcd version, e.g. `3.5.13`.
    #[prost(string, tag = "2")]
    pub version: String,
}

/// The end of the range of keys that start with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_is_the_next_key_range() {
        assert_eq!(prefix_end(b"ab"), b"ac");
        assert_eq!(prefix_end(b"a\xff"), b"b");
    }
}
