//! One member's HTTP/2 connection, its calls handed straight to hyper.
//!
//! tonic's `Channel` runs a buffer task, on the runtime that made the channel, between
//! its callers and the connection: once that runtime ended (a store built on one runtime
//! and used from the blocking client's), every call failed. A link keeps hyper's request
//! sender, which any task can use, and its connection's task runs on the runtime of the
//! call that connected; when the connection has ended, for that reason or any other, the
//! next call connects again (one task for all the calls waiting).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

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

/// How the connection is kept alive: a PING every 10 s, idle or not, answered within the
/// call timeout or the connection is dropped (a paused member).
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// A member's address and, once made, its connection.
pub(super) struct Link {
    host: String,
    authority: Authority,
    tls: Option<tokio_rustls::TlsConnector>,
    connect_timeout: Duration,
    keep_alive_timeout: Duration,
    sender: Mutex<Option<SendRequest<Body>>>,
    /// Held while connecting, so that the calls that found no connection make one.
    connecting: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("authority", &self.authority)
            .field("tls", &self.tls.is_some())
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
        Ok(Link {
            host: authority
                .host()
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            authority,
            tls,
            connect_timeout,
            keep_alive_timeout,
            sender: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
        })
    }

    /// The connection's sender, connecting first if there is none open.
    pub async fn sender(&self) -> Result<Sender, Status> {
        if let Some(sender) = self.open() {
            return Ok(sender);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(sender) = self.open() {
            return Ok(sender);
        }
        let send = tokio::time::timeout(self.connect_timeout, self.connect())
            .await
            .unwrap_or_else(|_| {
                let limit = self.connect_timeout;
                Err(Status::unavailable(format!(
                    "cannot connect within {limit:?}"
                )))
            })?;
        *self.sender.locked() = Some(send.clone());
        Ok(self.with(send))
    }

    fn open(&self) -> Option<Sender> {
        let sender = self.sender.locked();
        let send = sender.as_ref().filter(|s| !s.is_closed())?.clone();
        Some(self.with(send))
    }

    fn with(&self, send: SendRequest<Body>) -> Sender {
        let scheme = if self.tls.is_some() {
            Scheme::HTTPS
        } else {
            Scheme::HTTP
        };
        Sender {
            send,
            scheme,
            authority: self.authority.clone(),
        }
    }

    async fn connect(&self) -> Result<SendRequest<Body>, Status> {
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
