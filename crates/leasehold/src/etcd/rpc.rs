//! The slice of etcd's v3 gRPC API the store uses, and a client that fails over between
//! endpoints.
//!
//! The messages are written out here with `prost` derives, field numbers as in etcd's
//! `rpc.proto` and `kv.proto` (fields we never read are left out; protobuf skips them), so
//! building needs no `protoc` and no build script.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status, Streaming};

use crate::Locked;
use tonic_prost::ProstCodec;

/// How long one call to one member may take before the next member is tried: a paused
/// member must not stall the client for longer than this.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);

tokio::task_local! {
    /// Set by [`trying_each_for`]: how long a call may wait for one member while another
    /// is left to try.
    static TRY_TIMEOUT: Duration;
}

/// Runs `calls` with each member tried for at most `limit` (and [`CALL_TIMEOUT`]) while
/// another member is left to try; the last one tried keeps [`CALL_TIMEOUT`]. For calls
/// that must be answered within a lease's TTL: a renewal of a 2 s lease cannot wait 3 s
/// on a paused member before trying a healthy one.
pub async fn trying_each_for<F: std::future::Future>(limit: Duration, calls: F) -> F::Output {
    TRY_TIMEOUT.scope(limit.min(CALL_TIMEOUT), calls).await
}

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

/// A request stream that sends `first` and then stays open: etcd ends a stream's
/// watches and keepalives when the client closes it.
fn open_stream<T: Send + 'static>(first: T) -> impl Stream<Item = T> + Send + 'static {
    futures_util::stream::once(async move { first }).chain(futures_util::stream::pending())
}

/// An etcd client over several endpoints: calls go to the member that last answered and
/// move on to the next when it cannot be reached, is paused or has no leader.
#[derive(Debug)]
pub struct Client {
    members: Vec<Member>,
    current: AtomicUsize,
    credentials: Option<(String, String)>,
    watches: Watches,
}

#[derive(Debug)]
struct Member {
    address: String,
    channel: Channel,
    /// The auth token this member issued (simple tokens are per member).
    token: Mutex<Option<MetadataValue<tonic::metadata::Ascii>>>,
}

/// Errors that another member may not have: try the next.
fn try_next_member(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
    ) || status.message().contains("no leader")
        || status.message().contains("leader changed")
}

impl Client {
    /// Channels to `addresses` (`host:port`), connected lazily; TLS when `tls`.
    pub fn new(
        addresses: &[String],
        tls: bool,
        credentials: Option<(String, String)>,
    ) -> Result<Self, String> {
        let mut members = Vec::new();
        for address in addresses {
            let scheme = if tls { "https" } else { "http" };
            let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
                .map_err(|e| format!("bad endpoint {address:?}: {e}"))?
                .connect_timeout(CALL_TIMEOUT)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_timeout(CALL_TIMEOUT)
                .keep_alive_while_idle(true);
            if tls {
                endpoint = endpoint
                    .tls_config(ClientTlsConfig::new().with_native_roots())
                    .map_err(|e| format!("TLS setup for {address}: {e}"))?;
            }
            members.push(Member {
                address: address.clone(),
                channel: endpoint.connect_lazy(),
                token: Mutex::new(None),
            });
        }
        Ok(Client {
            members,
            current: AtomicUsize::new(0),
            credentials,
            watches: Watches::default(),
        })
    }

    /// One unary call, failing over between members.
    pub async fn unary<Q, R>(&self, path: &'static str, request: Q) -> Result<R, Status>
    where
        Q: prost::Message + Clone + Send + Sync + 'static,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        self.failover(|member| {
            let request = request.clone();
            async move {
                let mut grpc = self.grpc(member).await?;
                let request = self.authorized(member, Request::new(request));
                grpc.unary(
                    request,
                    PathAndQuery::from_static(path),
                    ProstCodec::default(),
                )
                .await
                .map(|r| r.into_inner())
            }
        })
        .await
    }

    /// A bidirectional stream that sends `first` and yields the answers, on the first
    /// member that accepts it. The stream stays open until dropped.
    pub async fn stream<Q, R>(&self, path: &'static str, first: Q) -> Result<Streaming<R>, Status>
    where
        Q: prost::Message + Clone + Send + Sync + 'static,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        self.failover(|member| {
            let first = first.clone();
            async move {
                let mut grpc = self.grpc(member).await?;
                let request = self.authorized(member, Request::new(open_stream(first)));
                grpc.streaming(
                    request,
                    PathAndQuery::from_static(path),
                    ProstCodec::default(),
                )
                .await
                .map(|r| r.into_inner())
            }
        })
        .await
    }

    /// A bidirectional stream that sends `first`, then what is sent on the returned sender;
    /// it stays open until the sender is dropped.
    async fn open<Q, R>(
        &self,
        path: &'static str,
        first: Q,
    ) -> Result<(mpsc::UnboundedSender<Q>, Streaming<R>), Status>
    where
        Q: prost::Message + Clone + Send + Sync + 'static,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        self.failover(|member| {
            let first = first.clone();
            async move {
                let (sender, receiver) = mpsc::unbounded_channel();
                let rest = futures_util::stream::unfold(receiver, |mut receiver| async move {
                    receiver.recv().await.map(|request| (request, receiver))
                });
                let requests = futures_util::stream::once(async move { first }).chain(rest);
                let mut grpc = self.grpc(member).await?;
                let request = self.authorized(member, Request::new(requests));
                let answers = grpc
                    .streaming(
                        request,
                        PathAndQuery::from_static(path),
                        ProstCodec::default(),
                    )
                    .await?
                    .into_inner();
                Ok((sender, answers))
            }
        })
        .await
    }

    /// A watch, multiplexed with this client's other watches on one Watch stream: a new
    /// watch costs one message, not a new HTTP/2 stream and etcd watch stream. The first
    /// message of the watch is etcd's answer to the create.
    pub async fn watch(&self, create: WatchCreateRequest) -> Result<Watch, Status> {
        let (sender, mut events) = mpsc::unbounded_channel();
        let request = WatchRequest {
            request: Some(WatchOp::Create(create)),
        };
        let stream = {
            let mut open = self.watches.0.lock().await;
            match open.as_ref().filter(|s| s.add(&request, &sender)) {
                Some(stream) => stream.clone(),
                None => {
                    if let Some(old) = open.take() {
                        old.end();
                    }
                    let (requests, answers) =
                        self.open("/etcdserverpb.Watch/Watch", request).await?;
                    let stream = Arc::new(WatchStream {
                        member: self.current.load(Ordering::Relaxed),
                        requests,
                        routes: Mutex::new(Routes {
                            pending: VecDeque::from([sender]),
                            ..Routes::default()
                        }),
                        reader: Mutex::new(None),
                    });
                    let reader = tokio::spawn(route(stream.clone(), answers));
                    *stream.reader.locked() = Some(reader.abort_handle());
                    *open = Some(stream.clone());
                    stream
                }
            }
        };
        // A member that stopped answering (paused) must not hold every later watch:
        // end this stream so the next watch opens one, on another member if need be.
        let created = match tokio::time::timeout(CALL_TIMEOUT, events.recv()).await {
            Ok(Some(created)) => created,
            Ok(None) => return Err(Status::unavailable("watch stream ended")),
            Err(_) => {
                stream.end();
                return Err(Status::deadline_exceeded(format!(
                    "no answer to a watch within {CALL_TIMEOUT:?}"
                )));
            }
        };
        Ok(Watch {
            id: (!created.canceled).then_some(created.watch_id),
            stream,
            first: Some(created),
            events,
        })
    }

    /// Runs `call` on the current member, then on the others in turn while the error is
    /// one another member may not have. Each try is bounded by [`CALL_TIMEOUT`], or less
    /// inside [`trying_each_for`].
    async fn failover<'a, T, F, Fut>(&'a self, call: F) -> Result<T, Status>
    where
        F: Fn(&'a Member) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let start = self.current.load(Ordering::Relaxed);
        let tighter = TRY_TIMEOUT.try_with(|limit| *limit).ok();
        let mut last = None;
        for i in 0..self.members.len() {
            let index = (start + i) % self.members.len();
            let member = &self.members[index];
            let limit = match tighter {
                Some(limit) if i + 1 < self.members.len() => limit,
                _ => CALL_TIMEOUT,
            };
            let bounded = || async {
                tokio::time::timeout(limit, call(member))
                    .await
                    .unwrap_or_else(|_| {
                        Err(Status::deadline_exceeded(format!(
                            "{} did not answer within {limit:?}",
                            member.address
                        )))
                    })
            };
            match bounded().await {
                Ok(value) => {
                    self.current.store(index, Ordering::Relaxed);
                    if index != start {
                        self.watches.left(start);
                    }
                    return Ok(value);
                }
                Err(status) if try_next_member(&status) => {
                    tracing::debug!(member = %member.address, %status, "etcd member failed; trying the next");
                    last = Some(Status::new(
                        status.code(),
                        format!("{}: {}", member.address, with_causes(&status)),
                    ));
                }
                Err(status)
                    if status.code() == Code::Unauthenticated && self.credentials.is_some() =>
                {
                    // An expired or foreign token: authenticate again, once, on this member.
                    *member.token.locked() = None;
                    return bounded().await;
                }
                Err(status) => return Err(status),
            }
        }
        Err(last.unwrap_or_else(|| Status::unavailable("no etcd endpoint")))
    }

    async fn grpc(&self, member: &Member) -> Result<tonic::client::Grpc<Channel>, Status> {
        if let Some((name, password)) = &self.credentials {
            if member.token.locked().is_none() {
                let mut grpc = tonic::client::Grpc::new(member.channel.clone());
                grpc.ready().await.map_err(transport_status)?;
                let answer: AuthenticateResponse = grpc
                    .unary(
                        Request::new(AuthenticateRequest {
                            name: name.clone(),
                            password: password.clone(),
                        }),
                        PathAndQuery::from_static("/etcdserverpb.Auth/Authenticate"),
                        ProstCodec::default(),
                    )
                    .await?
                    .into_inner();
                let token = answer
                    .token
                    .parse()
                    .map_err(|_| Status::unauthenticated("etcd sent an unusable auth token"))?;
                *member.token.locked() = Some(token);
            }
        }
        let mut grpc = tonic::client::Grpc::new(member.channel.clone());
        grpc.ready().await.map_err(transport_status)?;
        Ok(grpc)
    }

    fn authorized<T>(&self, member: &Member, mut request: Request<T>) -> Request<T> {
        if let Some(token) = member.token.locked().clone() {
            request.metadata_mut().insert("token", token);
        }
        request
    }
}

/// A status's message followed by its causes ("tcp connect error: Connection refused").
fn with_causes(status: &Status) -> String {
    let mut text = status.message().to_string();
    let mut cause = std::error::Error::source(status);
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text.push_str(": ");
            text.push_str(&c_text);
        }
        cause = c.source();
    }
    text
}

fn transport_status(error: tonic::transport::Error) -> Status {
    Status::unavailable(format!("cannot connect: {error}"))
}

/// The client's watch stream, opened by the first watch and again after it broke.
#[derive(Debug, Default)]
struct Watches(tokio::sync::Mutex<Option<Arc<WatchStream>>>);

impl Watches {
    /// Calls moved away from `member`: a watch stream there may be silent (a paused
    /// member), so end it and let its watches start again where calls now go.
    fn left(&self, member: usize) {
        if let Ok(open) = self.0.try_lock() {
            if let Some(stream) = open.as_ref().filter(|s| s.member == member) {
                stream.end();
            }
        }
    }
}

impl Drop for Watches {
    fn drop(&mut self) {
        if let Some(stream) = self.0.get_mut().take() {
            stream.end();
        }
    }
}

#[derive(Debug)]
struct WatchStream {
    /// The member it is open to.
    member: usize,
    requests: mpsc::UnboundedSender<WatchRequest>,
    routes: Mutex<Routes>,
    /// The task reading etcd's answers.
    reader: Mutex<Option<tokio::task::AbortHandle>>,
}

/// Where each watch's answers go.
#[derive(Debug, Default)]
struct Routes {
    /// Creates sent and not yet answered, in the order sent: etcd answers them in order.
    pending: VecDeque<mpsc::UnboundedSender<WatchResponse>>,
    by_id: HashMap<i64, mpsc::UnboundedSender<WatchResponse>>,
    ended: bool,
}

impl WatchStream {
    /// Sends a create on this stream; `false` if the stream has ended.
    fn add(&self, create: &WatchRequest, sender: &mpsc::UnboundedSender<WatchResponse>) -> bool {
        let mut routes = self.routes.locked();
        // Under the lock, so creates are sent in the order of `pending`.
        if routes.ended || self.requests.send(create.clone()).is_err() {
            return false;
        }
        routes.pending.push_back(sender.clone());
        true
    }

    fn deliver(&self, answer: WatchResponse) {
        let mut routes = self.routes.locked();
        let id = answer.watch_id;
        if answer.created {
            let Some(sender) = routes.pending.pop_front() else {
                return;
            };
            let canceled = answer.canceled;
            if sender.send(answer).is_ok() && !canceled {
                routes.by_id.insert(id, sender);
            } else if !canceled {
                // Its waiter left before the answer came.
                self.cancel(id);
            }
            return;
        }
        let Some(sender) = routes.by_id.get(&id) else {
            return;
        };
        let canceled = answer.canceled;
        if sender.send(answer).is_err() || canceled {
            routes.by_id.remove(&id);
            if !canceled {
                self.cancel(id);
            }
        }
    }

    fn cancel(&self, id: i64) {
        let _ = self.requests.send(WatchRequest {
            request: Some(WatchOp::Cancel(WatchCancelRequest { watch_id: id })),
        });
    }

    /// Ends every watch on this stream (their receivers see the end) and the stream.
    fn end(&self) {
        let mut routes = self.routes.locked();
        routes.ended = true;
        routes.pending.clear();
        routes.by_id.clear();
        if let Some(reader) = self.reader.locked().take() {
            reader.abort();
        }
    }
}

async fn route(stream: Arc<WatchStream>, mut answers: Streaming<WatchResponse>) {
    while let Ok(Some(answer)) = answers.message().await {
        stream.deliver(answer);
    }
    stream.end();
}

/// One watch on the client's watch stream; cancelled in etcd when dropped.
#[derive(Debug)]
pub struct Watch {
    stream: Arc<WatchStream>,
    /// etcd's id for it; `None` if etcd refused it.
    id: Option<i64>,
    first: Option<WatchResponse>,
    events: mpsc::UnboundedReceiver<WatchResponse>,
}

impl Watch {
    /// The next answer for this watch (the first is the create's); `None` when the stream
    /// has ended.
    pub async fn message(&mut self) -> Option<WatchResponse> {
        match self.first.take() {
            Some(first) => Some(first),
            None => self.events.recv().await,
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        let mut routes = self.stream.routes.locked();
        if routes.by_id.remove(&id).is_some() {
            self.stream.cancel(id);
        }
    }
}
