//! One member's HTTP/2 connection, its calls handed straight to hyper.
//!
//! tonic's `Channel` runs a buffer task, on the runtime that made the channel, between
//! its callers and the connection: once that runtime ended (a store built on one runtime
//! and used from the blocking client's), every call failed. A link keeps hyper's request
//! sender, which any task can use, and its connection's task runs on the runtime of the
//! call that connected; when the connection has ended, for that reason or any other, the
//! next call connects again. A connect runs in a task of its own, which the calls waiting
//! for it share: one that stops waiting (its own timeout) does not end it for the others.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, Shared};
use http_body_util::Either;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tonic::body::Body;
use tonic::codegen::http::uri::{Authority, PathAndQuery, Scheme};
use tonic::codegen::http::{Request, Response, Uri};
use tonic::transport::Channel;
use tonic::Status;

use super::body::looking_ahead;
use crate::builder::ClientSettings;
use crate::Locked;

/// How the connection is kept alive: a PING every 2 s, idle or not, answered within the
/// call timeout or the connection is dropped. A paused member is found within 5 s so,
/// even by a client that only watches (its streams then open on another member).
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(2);

/// A member's address and, once made, its connection.
pub(super) struct Link {
    target: Arc<Target>,
    state: Mutex<State>,
}

/// Where a link connects, and how.
struct Target {
    host: String,
    authority: Authority,
    tls: Option<tokio_rustls::TlsConnector>,
    connect_timeout: Duration,
    keep_alive_timeout: Duration,
}

/// A connect in progress, in a task of its own: a call that stops waiting for it (its
/// own timeout) leaves it to finish for the calls after.
type Connecting = Shared<BoxFuture<'static, Result<SendRequest<Body>, Status>>>;

enum State {
    Idle,
    Connecting(Connecting),
    Open(SendRequest<Body>),
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("authority", &self.target.authority)
            .field("tls", &self.target.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl Link {
    /// A link to `address` (`host:port`), not connected yet; TLS as `settings` say when
    /// `tls`. `keep_alive_timeout` bounds the answer to a PING.
    pub fn new(
        address: &str,
        tls: bool,
        settings: &ClientSettings,
        connect_timeout: Duration,
        keep_alive_timeout: Duration,
    ) -> Result<Self, String> {
        let authority: Authority =
            (address.parse()).map_err(|e| format!("bad endpoint {address:?}: {e}"))?;
        let tls = match tls {
            true => Some(tokio_rustls::TlsConnector::from(Arc::new(tls_config(
                settings,
            )?))),
            false => None,
        };
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let target = Target {
            host: host.to_string(),
            authority,
            tls,
            connect_timeout,
            keep_alive_timeout,
        };
        Ok(Link {
            target: Arc::new(target),
            state: Mutex::new(State::Idle),
        })
    }

    /// The connection's sender, connecting first if there is none open (or joining the
    /// connect under way).
    pub async fn sender(&self) -> Result<Sender, Status> {
        let connecting = {
            let mut state = self.state.locked();
            match &*state {
                State::Open(send) if !send.is_closed() => return Ok(self.with(send.clone())),
                State::Connecting(connecting) => connecting.clone(),
                _ => {
                    let target = self.target.clone();
                    let task = tokio::spawn(async move { target.connect().await });
                    let joined = async move {
                        (task.await).unwrap_or_else(|e| Err(Status::unavailable(e.to_string())))
                    };
                    let connecting = joined.boxed().shared();
                    *state = State::Connecting(connecting.clone());
                    connecting
                }
            }
        };
        let connected = connecting.clone().await;
        let mut state = self.state.locked();
        // The first to learn the outcome of the connect still under way records it.
        if matches!(&*state, State::Connecting(c) if c.ptr_eq(&connecting)) {
            *state = match &connected {
                Ok(send) => State::Open(send.clone()),
                Err(_) => State::Idle,
            };
        }
        connected.map(|send| self.with(send))
    }

    fn with(&self, send: SendRequest<Body>) -> Sender {
        let scheme = match self.target.tls {
            Some(_) => Scheme::HTTPS,
            None => Scheme::HTTP,
        };
        Sender {
            send,
            scheme,
            authority: self.target.authority.clone(),
        }
    }
}

impl Target {
    /// A connection within the connect timeout: TCP, TLS if asked, HTTP/2.
    async fn connect(&self) -> Result<SendRequest<Body>, Status> {
        let limit = self.connect_timeout;
        (tokio::time::timeout(limit, self.connect_now()).await).unwrap_or_else(|_| {
            Err(Status::unavailable(format!(
                "cannot connect within {limit:?}"
            )))
        })
    }

    async fn connect_now(&self) -> Result<SendRequest<Body>, Status> {
        let tcp = TcpStream::connect(self.authority.as_str())
            .await
            .map_err(|e| cannot("tcp connect error", e))?;
        tcp.set_nodelay(true)
            .map_err(|e| cannot("tcp connect error", e))?;
        match &self.tls {
            None => self.handshake(tcp).await,
            Some(connector) => {
                let name = ServerName::try_from(self.host.clone())
                    .map_err(|e| cannot(&format!("TLS server name {:?}", self.host), e))?;
                let tls = connector
                    .connect(name, tcp)
                    .await
                    .map_err(|e| cannot("TLS handshake", e))?;
                self.handshake(tls).await
            }
        }
    }

    async fn handshake<T>(&self, io: T) -> Result<SendRequest<Body>, Status>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let (send, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(KEEP_ALIVE_INTERVAL)
            .keep_alive_timeout(self.keep_alive_timeout)
            .keep_alive_while_idle(true)
            .handshake(TokioIo::new(io))
            .await
            .map_err(|e| cannot("HTTP/2 handshake", e))?;
        let member = self.authority.clone();
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%member, %error, "etcd connection ended");
            }
        });
        Ok(send)
    }
}

/// A connect that failed at `step`, its error kept as the cause (a TLS refusal is found
/// there).
fn cannot(step: &str, error: impl std::error::Error + Send + Sync + 'static) -> Status {
    let mut status = Status::unavailable(format!("cannot connect: {step}: {error}"));
    status.set_source(Arc::new(error));
    status
}

/// A link's connection, ready for calls.
#[derive(Clone)]
pub(super) struct Sender {
    send: SendRequest<Body>,
    scheme: Scheme,
    authority: Authority,
}

/// Where a call goes: a link's connection, or a channel the application made. A tower
/// service for tonic's `Grpc`; either way the request's body ends with its last frame.
#[derive(Clone)]
pub(super) enum Route {
    Link(Sender),
    Channel(Channel),
}

type Answer = Response<Either<hyper::body::Incoming, Body>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Request<Body>> for Route {
    type Response = Answer;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Answer, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        match self {
            Route::Link(sender) => sender.send.poll_ready(cx).map_err(Into::into),
            Route::Channel(channel) => channel.poll_ready(cx).map_err(Into::into),
        }
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let request = request.map(looking_ahead);
        match self {
            Route::Link(sender) => {
                let (mut parts, body) = request.into_parts();
                let path = (parts.uri.path_and_query().cloned())
                    .unwrap_or_else(|| PathAndQuery::from_static("/"));
                let uri = Uri::builder()
                    .scheme(sender.scheme.clone())
                    .authority(sender.authority.clone())
                    .path_and_query(path)
                    .build();
                if let Ok(uri) = uri {
                    parts.uri = uri;
                }
                let answer = sender.send.send_request(Request::from_parts(parts, body));
                Box::pin(async move { Ok(answer.await?.map(Either::Left)) })
            }
            Route::Channel(channel) => {
                let answer = channel.call(request);
                Box::pin(async move { Ok(answer.await?.map(Either::Right)) })
            }
        }
    }
}

/// The builder's CA (else the system's roots) and client certificate, speaking HTTP/2.
fn tls_config(settings: &ClientSettings) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    match &settings.tls_ca {
        Some(ca) => {
            for cert in CertificateDer::pem_slice_iter(ca) {
                let cert = cert.map_err(|e| format!("the CA certificate: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("the CA certificate: {e}"))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let _ = roots.add_parsable_certificates(found.certs);
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots);
    let mut config = match &settings.tls_identity {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(cert)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("the client certificate: {e}"))?;
            let key =
                PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("the client key: {e}"))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("the client certificate: {e}"))?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Calls that give up on a slow connect (a TLS handshake that takes long) leave it
    /// running for the calls after: one connection is made, not one per caller.
    #[tokio::test]
    async fn callers_that_stop_waiting_leave_the_connect_to_the_next() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        // Accepts, and never answers the TLS handshake.
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                held.push(socket);
            }
        });
        let settings = ClientSettings::default();
        let patience = Duration::from_secs(60);
        let link = Link::new(&address, true, &settings, patience, patience).unwrap();
        let connecting = || match &*link.state.locked() {
            State::Connecting(connecting) => connecting.clone(),
            _ => panic!("no connect under way"),
        };
        let mut first = None;
        for _ in 0..3 {
            let gave_up = tokio::time::timeout(Duration::from_millis(50), link.sender()).await;
            assert!(gave_up.is_err(), "a handshake nobody answers succeeded");
            // Still the connect the first caller started.
            let now = connecting();
            assert!(first.get_or_insert_with(|| now.clone()).ptr_eq(&now));
        }
        let seen = std::time::Instant::now();
        while accepted.load(Ordering::SeqCst) == 0 && seen.elapsed() < patience {
            tokio::task::yield_now().await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "connections made");
        server.abort();
    }
}
