//! [`LeaseholdBuilder`]: a client configured beyond its URL (default TTL, key prefix,
//! timeouts, TLS client certificates, waiting for the store to come up).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::options::{check_ttl, humanize, DEFAULT_TTL};
use crate::{Error, Leasehold, LockName, Result, StoreUrl};

/// Longest connect or request timeout accepted: past it a dead store looks like a hang.
pub const MAX_CLIENT_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest prefix accepted, in bytes, so that prefixed names stay well under
/// [`MAX_NAME_LEN`](crate::MAX_NAME_LEN).
pub const MAX_KEY_PREFIX_LEN: usize = 64;

/// How a Redis or etcd store is reached, beyond its URL. `None`: the store's default.
#[derive(Clone, Default)]
pub(crate) struct ClientSettings {
    pub connect_timeout: Option<Duration>,
    pub request_timeout: Option<Duration>,
    /// PEM: the CA to trust instead of the system's roots.
    pub tls_ca: Option<Vec<u8>>,
    /// PEM: `(certificate, key)` this client presents.
    pub tls_identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl ClientSettings {
    /// Whether any TLS setting is given (they need a TLS URL).
    fn tls(&self) -> bool {
        self.tls_ca.is_some() || self.tls_identity.is_some()
    }
}

/// A [`Leasehold`] configured step by step; [`build`](Self::build) connects.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use leasehold::Leasehold;
///
/// let locks = Leasehold::builder("rediss://locks.internal:6379/0")
///     .key_prefix("billing/")
///     .ttl(Duration::from_secs(30))
///     .connect_timeout(Duration::from_secs(2))
///     .request_timeout(Duration::from_secs(1))
///     .tls_ca(std::fs::read("ca.pem")?)
///     .tls_client_cert(std::fs::read("client.pem")?, std::fs::read("client.key")?)
///     .wait_for_store(Duration::from_secs(60))
///     .build()
///     .await?;
/// let guard = locks.mutex("nightly")?.lock().await?; // the store's lock "billing/nightly"
/// # drop(guard); Ok(()) }
/// ```
#[derive(Clone)]
#[must_use = "a builder does nothing until .build().await"]
pub struct LeaseholdBuilder {
    url: String,
    ttl: Duration,
    key_prefix: String,
    settings: ClientSettings,
    wait_for_store: Option<Duration>,
}

impl std::fmt::Debug for LeaseholdBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may carry a password, and the key is secret: show neither.
        let url = StoreUrl::parse(&self.url).map_or_else(|_| "(invalid)".into(), |u| u.to_string());
        f.debug_struct("LeaseholdBuilder")
            .field("url", &url)
            .field("ttl", &self.ttl)
            .field("key_prefix", &self.key_prefix)
            .field("connect_timeout", &self.settings.connect_timeout)
            .field("request_timeout", &self.settings.request_timeout)
            .field("tls_ca", &self.settings.tls_ca.is_some())
            .field("tls_client_cert", &self.settings.tls_identity.is_some())
            .field("wait_for_store", &self.wait_for_store)
            .finish()
    }
}

impl LeaseholdBuilder {
    pub(crate) fn new(url: &str) -> Self {
        LeaseholdBuilder {
            url: url.to_string(),
            ttl: DEFAULT_TTL,
            key_prefix: String::new(),
            settings: ClientSettings::default(),
            wait_for_store: None,
        }
    }

    /// The lease of every lock this client makes ([`DEFAULT_TTL`] unless set); a lock's
    /// own [`with_ttl`](crate::Lock::with_ttl) still overrides it.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// A namespace put before every lock and rate limiter name this client uses, so that
    /// applications sharing one store do not meet on a common name. `describe`, `list`
    /// and `force_release` take and show names without it; a [`Lock`](crate::Lock)'s
    /// name and errors show the name in the store, with it. Empty (the default): none.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// How long connecting to a Redis or etcd server may take (default 3 s): for Redis
    /// each connection with its TLS and handshake; for etcd each member's TCP connection,
    /// and the first call (which also opens TLS and HTTP/2) as a whole.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.settings.connect_timeout = Some(timeout);
        self
    }

    /// How long one call to a Redis or etcd server may take before it fails as
    /// unavailable (default: Redis 5 s, etcd 3 s per member).
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.settings.request_timeout = Some(timeout);
        self
    }

    /// A certificate and key (PEM) to present to a Redis (`rediss://`) or etcd
    /// (`etcds://`) server that asks for client certificates.
    pub fn tls_client_cert(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.settings.tls_identity = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// The CA (PEM) that signed the server's certificate, trusted instead of the
    /// system's roots.
    pub fn tls_ca(mut self, ca_pem: impl Into<Vec<u8>>) -> Self {
        self.settings.tls_ca = Some(ca_pem.into());
        self
    }

    /// Keeps trying to connect, with backoff, until the store answers or `patience`
    /// passes (then the last [`Error::Unavailable`]). The first attempt runs in full, as
    /// without this setting (bounded by the connect timeout); `patience` bounds the tries
    /// after it, so a short or zero patience still connects to a store that is up. A
    /// refusal that retrying cannot fix ([`Error::Config`], [`Error::InvalidStore`]) ends
    /// it at once.
    pub fn wait_for_store(mut self, patience: Duration) -> Self {
        self.wait_for_store = Some(patience);
        self
    }

    /// Checks the settings, then connects.
    pub async fn build(self) -> Result<Leasehold> {
        let url = StoreUrl::parse(&self.url)?;
        let ttl = check_ttl(self.ttl)?;
        let prefix = check_prefix(&self.key_prefix)?;
        check_timeout("connect_timeout", self.settings.connect_timeout)?;
        check_timeout("request_timeout", self.settings.request_timeout)?;
        if self.settings.tls() && !url.scheme().tls() {
            return Err(url.invalid(
                "TLS certificates were given for a URL without TLS: use rediss://, rediss+cluster:// or etcds://",
            ));
        }
        if let Some(ca) = &self.settings.tls_ca {
            check_pem_certificates(ca)?;
        }
        let store = match self.wait_for_store {
            None => url.open_with(&self.settings).await?,
            Some(patience) => open_patiently(&url, &self.settings, patience).await?,
        };
        Ok(Leasehold::from_store(store).configured(ttl, prefix))
    }
}

/// Opens `url`, again after each failure that retrying may fix, until `patience` passes.
/// A wait with no end in sight: a century.
const FOREVER: Duration = Duration::from_secs(100 * 366 * 86_400);

async fn open_patiently(
    url: &StoreUrl,
    settings: &ClientSettings,
    patience: Duration,
) -> Result<Arc<dyn crate::Store>> {
    // (Duration::MAX: patience without end, as far as an Instant reaches.)
    let now = Instant::now();
    let deadline = now.checked_add(patience).unwrap_or(now + FOREVER);
    let mut backoff = Duration::from_millis(50);
    let mut last = None;
    loop {
        // A later attempt is cut off at the deadline too (dropping a connect is harmless).
        let attempt = url.open_with(settings);
        let answer = match last {
            None => Ok(attempt.await),
            Some(_) => tokio::time::timeout_at(deadline, attempt).await,
        };
        match answer {
            Err(_) => {
                return Err(last.unwrap_or_else(|| Error::Unavailable {
                    store: url.to_string(),
                    source: format!("no answer within {}", humanize(patience)).into(),
                }))
            }
            Ok(Err(e @ Error::Unavailable { .. })) if Instant::now() + backoff < deadline => {
                tracing::debug!(store = %url, error = %e, "store not up yet; trying again");
                last = Some(e);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Ok(answer) => return answer,
        }
    }
}

/// A CA given to [`LeaseholdBuilder::tls_ca`] is PEM with at least one certificate: a
/// wrong file is a configuration error now, not a TLS failure at every connect that
/// looks like a store that is down (and is retried as one).
fn check_pem_certificates(pem: &[u8]) -> Result<()> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let refuse = |why: &str| {
        Err(Error::option(
            "tls_ca",
            format!("{why}; give the CA's certificates in PEM ({BEGIN} ... {END})"),
        ))
    };
    let Ok(mut text) = std::str::from_utf8(pem) else {
        return refuse("is not text");
    };
    let mut certificates = 0;
    while let Some(start) = text.find(BEGIN) {
        let rest = &text[start + BEGIN.len()..];
        let Some(end) = rest.find(END) else {
            return refuse("has a certificate without its end line");
        };
        let body = &rest[..end];
        let base64 = |c: char| c.is_ascii_alphanumeric() || "+/=".contains(c) || c.is_whitespace();
        if body.trim().is_empty() || !body.chars().all(base64) {
            return refuse("has a certificate that is not base64");
        }
        certificates += 1;
        text = &rest[end + END.len()..];
    }
    match certificates {
        0 => refuse("holds no certificate"),
        _ => Ok(()),
    }
}

fn check_timeout(option: &'static str, timeout: Option<Duration>) -> Result<()> {
    match timeout {
        Some(t) if t.is_zero() || t > MAX_CLIENT_TIMEOUT => Err(Error::option(
            option,
            format!(
                "{} is out of range; it must be above zero and at most {}",
                humanize(t),
                humanize(MAX_CLIENT_TIMEOUT)
            ),
        )),
        _ => Ok(()),
    }
}

fn check_prefix(prefix: &str) -> Result<Option<Arc<str>>> {
    if prefix.is_empty() {
        return Ok(None);
    }
    if prefix.len() > MAX_KEY_PREFIX_LEN {
        return Err(Error::option(
            "key_prefix",
            format!(
                "is {} bytes long; at most {MAX_KEY_PREFIX_LEN} bytes are allowed",
                prefix.len()
            ),
        ));
    }
    // The same rules as a name's (no control characters).
    LockName::new(prefix).map_err(|e| Error::option("key_prefix", e.to_string()))?;
    Ok(Some(prefix.into()))
}
