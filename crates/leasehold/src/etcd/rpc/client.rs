//! A client over several members: each call goes to the member that last answered and
//! moves on to the next when it cannot be reached, is paused or has no leader.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::{BufMut, Bytes};
use futures_util::{Stream, StreamExt};
use tokio::sync::{mpsc, Semaphore, SemaphorePermit};
use tokio::time::Instant;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Code, Request, Status, Streaming};
use tonic_prost::{ProstCodec, ProstDecoder};

use super::batch::Batches;
use super::keepalive::KeepAlives;
use super::link::{Link, Route};
use super::watch::Watches;
use super::{AuthenticateRequest, AuthenticateResponse, CALL_TIMEOUT, TRY_TIMEOUT};
use crate::builder::ClientSettings;
use crate::keepalive::jitter;
use crate::url::Credentials;
use crate::Locked;

/// Calls a client has in flight at once, outside those that keep a lease alive (see
/// [`Client::permit`]): thousands of waiters joining at once would otherwise send
/// thousands of writes together, which etcd refuses ("too many requests") once its
/// applied entries fall 5,000 behind, and which outrun the calls' own timeouts.
const IN_FLIGHT: usize = 64;

/// How long a try on one member may take while another member is left to try.
const FAILOVER_AFTER: Duration = Duration::from_secs(1);

/// How long a call may keep asking a member that says it has too many requests (its
/// backoff doubles up to [`MAX_BACKOFF`]) before the error is returned.
const OVERLOAD_PATIENCE: Duration = Duration::from_secs(30);
const FIRST_BACKOFF: Duration = Duration::from_millis(20);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// etcd is behind on applying what it committed: the same member can take the call
/// after a pause. (Not every ResourceExhausted: a full database stays full.)
fn overloaded(status: &Status) -> bool {
    status.code() == Code::ResourceExhausted && status.message().contains("too many requests")
}

/// An etcd client over several endpoints: calls go to the member that last answered and
/// move on to the next when it cannot be reached, is paused or has no leader.
#[derive(Debug)]
pub struct Client {
    members: Vec<Member>,
    pub(super) current: AtomicUsize,
    credentials: Option<Credentials>,
    /// How long one try of a call may take on one member.
    call_timeout: Duration,
    pub(super) watches: Watches,
    pub(super) keepalives: KeepAlives,
    /// Permits for calls in flight ([`IN_FLIGHT`]).
    calls: Semaphore,
    /// Txns waiting to share a request.
    pub(super) batches: Batches,
}

#[derive(Debug)]
struct Member {
    address: String,
    way: Way,
    /// The auth token this member issued (simple tokens are per member).
    token: Mutex<Option<MetadataValue<tonic::metadata::Ascii>>>,
}

/// How a member is reached.
#[derive(Debug)]
enum Way {
    /// A connection of our own.
    Link(Link),
    /// A channel the application made.
    Channel(Channel),
}

/// Errors that another member may not have: try the next. An answer without a gRPC
/// status is not etcd's (a proxy or another server at that address, answering HTTP 404
/// or the like): the next member may be etcd.
pub(super) fn try_next_member(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
    ) || status.message().contains("no leader")
        || status.message().contains("leader changed")
        || status.message().starts_with("grpc-status header missing")
}

impl Client {
    /// Channels to `addresses` (`host:port`), connected lazily; TLS when `tls`.
    pub fn new(
        addresses: &[String],
        tls: bool,
        credentials: Option<Credentials>,
        settings: &ClientSettings,
    ) -> Result<Self, String> {
        let call_timeout = settings.request_timeout.unwrap_or(CALL_TIMEOUT);
        let connect_timeout = settings.connect_timeout.unwrap_or(CALL_TIMEOUT);
        let mut members = Vec::new();
        for address in addresses {
            let link = Link::new(address, tls, settings, connect_timeout, CALL_TIMEOUT)?;
            members.push(Member {
                address: address.clone(),
                way: Way::Link(link),
                token: Mutex::new(None),
            });
        }
        Ok(Client {
            members,
            current: AtomicUsize::new(0),
            credentials,
            call_timeout,
            watches: Watches::default(),
            keepalives: KeepAlives::default(),
            calls: Semaphore::new(IN_FLIGHT),
            batches: Batches::default(),
        })
    }

    /// A client over channels made elsewhere, one per member, with the default timeout.
    pub fn from_channels(channels: Vec<Channel>, credentials: Option<Credentials>) -> Self {
        let members = (channels.into_iter().enumerate())
            .map(|(i, channel)| Member {
                address: format!("member {i}"),
                way: Way::Channel(channel),
                token: Mutex::new(None),
            })
            .collect();
        Client {
            members,
            current: AtomicUsize::new(0),
            credentials,
            call_timeout: CALL_TIMEOUT,
            watches: Watches::default(),
            keepalives: KeepAlives::default(),
            calls: Semaphore::new(IN_FLIGHT),
            batches: Batches::default(),
        }
    }

    /// One unary call, failing over between members. The request is encoded once: each
    /// try sends the same bytes, where a copy of the message for each would cost a Txn
    /// a dozen allocations.
    pub async fn unary<Q, R>(&self, path: &'static str, request: Q) -> Result<R, Status>
    where
        Q: prost::Message,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        self.unary_encoded(path, Bytes::from(request.encode_to_vec()))
            .await
    }

    /// [`unary`](Self::unary) with the request encoded.
    pub(super) async fn unary_encoded<R>(
        &self,
        path: &'static str,
        request: Bytes,
    ) -> Result<R, Status>
    where
        R: prost::Message + Default + Send + Sync + 'static,
    {
        let _permit = self.permit().await;
        self.failover(|member| {
            let request = request.clone();
            async move {
                let mut grpc = self.grpc(member).await?;
                let request = self.authorized(member, Request::new(request));
                grpc.unary(
                    request,
                    PathAndQuery::from_static(path),
                    Encoded(PhantomData),
                )
                .await
                .map(|r| r.into_inner())
            }
        })
        .await
    }

    /// A bidirectional stream that sends `first`, then what is sent on the returned sender;
    /// it stays open until the sender is dropped.
    pub(super) async fn open<Q, R>(
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
                let answers = self.streaming(member, path, requests).await?;
                Ok((sender, answers))
            }
        })
        .await
    }

    /// How many members it calls.
    pub(super) fn members(&self) -> usize {
        self.members.len()
    }

    /// A permit to call, waited for outside the calls' timeouts; none needed inside
    /// [`trying_each_for`](super::trying_each_for): a call that keeps a lease alive
    /// (a holder's renewal, a waiter's recheck) must not queue behind the joins of
    /// thousands of other waiters, or their leases would end while they queue.
    async fn permit(&self) -> Option<SemaphorePermit<'_>> {
        if TRY_TIMEOUT.try_with(|_| ()).is_ok() {
            return None;
        }
        self.calls.acquire().await.ok()
    }

    /// A bidirectional stream on `member` that sends `requests`.
    async fn streaming<Q, R>(
        &self,
        member: &Member,
        path: &'static str,
        requests: impl Stream<Item = Q> + Send + 'static,
    ) -> Result<Streaming<R>, Status>
    where
        Q: prost::Message + Send + Sync + 'static,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        let mut grpc = self.grpc(member).await?;
        let request = self.authorized(member, Request::new(requests));
        grpc.streaming(
            request,
            PathAndQuery::from_static(path),
            ProstCodec::default(),
        )
        .await
        .map(|r| r.into_inner())
    }

    /// Runs `call` on the current member, then on the others in turn while the error is
    /// one another member may not have, each try bounded as [`try_limit`] says.
    async fn failover<'a, T, F, Fut>(&'a self, call: F) -> Result<T, Status>
    where
        F: Fn(&'a Member) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let start = self.current.load(Ordering::Relaxed);
        let tighter = TRY_TIMEOUT.try_with(|limit| *limit).ok();
        let n = self.members.len();
        if n == 0 {
            return Err(Status::unavailable("no etcd endpoint"));
        }
        let mut planned = Duration::ZERO;
        let mut last = None;
        for k in 0.. {
            let index = (start + k) % n;
            let member = &self.members[index];
            let Some(limit) = try_limit(k, n, tighter, self.call_timeout, planned) else {
                break;
            };
            planned += limit;
            let once = || async {
                tokio::time::timeout(limit, call(member))
                    .await
                    .unwrap_or_else(|_| {
                        // The failover below names the member.
                        Err(Status::deadline_exceeded(format!(
                            "did not answer within {limit:?}"
                        )))
                    })
            };
            // A member too busy to take the call now takes it after a pause (a renewal
            // pauses only within its own limit): the load is usually ours, and ends.
            let bounded = || async {
                let give_up = Instant::now() + tighter.unwrap_or(OVERLOAD_PATIENCE);
                let mut backoff = FIRST_BACKOFF;
                loop {
                    match once().await {
                        Err(status) if overloaded(&status) => {
                            let pause = jitter(backoff);
                            if Instant::now() + pause >= give_up {
                                return Err(status);
                            }
                            tracing::debug!(member = %member.address, "etcd member has too many requests; pausing");
                            tokio::time::sleep(pause).await;
                            backoff = (backoff * 2).min(MAX_BACKOFF);
                        }
                        answer => return answer,
                    }
                }
            };
            match bounded().await {
                Ok(value) => {
                    self.current.store(index, Ordering::Relaxed);
                    if index != start {
                        self.watches.left(start);
                        self.keepalives.left(start);
                    }
                    return Ok(value);
                }
                Err(status) if try_next_member(&status) => {
                    tracing::debug!(member = %member.address, %status, "etcd member failed; trying the next");
                    let mut failed = Status::new(
                        status.code(),
                        format!("{}: {}", member.address, with_causes(&status)),
                    );
                    if let Some(check) = crate::tls::refusal(&status) {
                        failed.set_source(std::sync::Arc::new(TlsRefused(check)));
                    }
                    last = Some(failed);
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

    /// Where calls to `member` go now: its link connects first if it has no connection.
    async fn route(&self, member: &Member) -> Result<Route, Status> {
        match &member.way {
            Way::Link(link) => link.sender().await.map(Route::Link),
            Way::Channel(channel) => Ok(Route::Channel(channel.clone())),
        }
    }

    async fn grpc(&self, member: &Member) -> Result<tonic::client::Grpc<Route>, Status> {
        if let Some(credentials) = &self.credentials {
            if member.token.locked().is_none() {
                let mut grpc = tonic::client::Grpc::new(self.route(member).await?);
                grpc.ready().await.map_err(not_ready)?;
                let answer: AuthenticateResponse = grpc
                    .unary(
                        Request::new(AuthenticateRequest {
                            name: credentials.user().unwrap_or_default().to_string(),
                            password: (credentials.password())
                                .map_or_else(String::new, |p| p.expose().to_string()),
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
        let mut grpc = tonic::client::Grpc::new(self.route(member).await?);
        grpc.ready().await.map_err(not_ready)?;
        Ok(grpc)
    }

    fn authorized<T>(&self, member: &Member, mut request: Request<T>) -> Request<T> {
        if let Some(token) = member.token.locked().clone() {
            request.metadata_mut().insert("token", token);
        }
        request
    }
}

/// The time limit of a call's try `k` (from 0) over `n` members, after tries whose limits
/// add up to `planned`; `None` once the call has had its tries.
///
/// Inside [`trying_each_for`](super::trying_each_for) (`tighter`): each member once, the
/// tighter limit while another is left. Else round after round: a second on each member at
/// first, doubling up to the call timeout, until a call timeout per member is spent. A
/// member that does not answer (paused) is passed before a caller's own short patience (a
/// release at exit, a `--no-wait`) runs out, and a call asked again after an election (no
/// member answers during one) is answered.
fn try_limit(
    k: usize,
    n: usize,
    tighter: Option<Duration>,
    call_timeout: Duration,
    planned: Duration,
) -> Option<Duration> {
    match tighter {
        Some(limit) if k + 1 < n => Some(limit.min(call_timeout)),
        Some(_) => (k + 1 == n).then_some(call_timeout),
        None if n == 1 => (k == 0).then_some(call_timeout),
        None => {
            let budget = call_timeout * n as u32;
            let round = (k / n).min(8) as u32;
            let limit = (FAILOVER_AFTER * (1 << round)).min(call_timeout);
            (planned < budget).then(|| limit.min(budget - planned))
        }
    }
}

/// A codec that sends a request encoded already, and decodes an `R` answer.
struct Encoded<R>(PhantomData<R>);

impl<R: prost::Message + Default + Send + 'static> Codec for Encoded<R> {
    type Encode = Bytes;
    type Decode = R;
    type Encoder = AsEncoded;
    type Decoder = ProstDecoder<R>;

    fn encoder(&mut self) -> AsEncoded {
        AsEncoded
    }

    fn decoder(&mut self) -> ProstDecoder<R> {
        ProstDecoder::default()
    }
}

/// Writes an encoded request as it is.
struct AsEncoded;

impl Encoder for AsEncoded {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, encoded: Bytes, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put(encoded);
        Ok(())
    }
}

/// A TLS handshake refused (a certificate not trusted, either way): what to check.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsRefused(pub &'static str);

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

fn not_ready(error: Box<dyn std::error::Error + Send + Sync>) -> Status {
    Status::unavailable(format!("cannot connect: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limits of every try of one call, in order.
    fn tries(n: usize, tighter: Option<Duration>) -> Vec<Duration> {
        let mut planned = Duration::ZERO;
        let mut limits = Vec::new();
        for k in 0.. {
            let Some(limit) = try_limit(k, n, tighter, CALL_TIMEOUT, planned) else {
                break;
            };
            planned += limit;
            limits.push(limit);
        }
        limits
    }

    #[test]
    fn a_call_passes_a_silent_member_in_a_second_and_keeps_its_whole_patience() {
        let s = Duration::from_secs;
        assert_eq!(tries(1, None), [s(3)]);
        assert_eq!(tries(2, None), [s(1), s(1), s(2), s(2)]);
        assert_eq!(tries(3, None), [s(1), s(1), s(1), s(2), s(2), s(2)]);
        let tight = Duration::from_millis(500);
        assert_eq!(tries(3, Some(tight)), [tight, tight, s(3)]);
        assert_eq!(tries(1, Some(tight)), [s(3)]);
    }
}
