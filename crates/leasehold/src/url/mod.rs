//! Store URLs, read once: [`StoreUrl`] is what every store, the CLI and its tools take
//! from a URL, and its `Display` and `Debug` never show a password.
//!
//! ```
//! use leasehold::StoreUrl;
//! let url: StoreUrl = "redis://app:s3cr%40t@10.0.0.5:6379/2?replicas=1".parse().unwrap();
//! assert_eq!(url.scheme().backend(), "redis");
//! assert_eq!(url.to_string(), "redis://app:***@10.0.0.5:6379/2?replicas=1");
//! assert_eq!(url.credentials().unwrap().password().unwrap().expose(), "s3cr@t");
//! let bad = "redis://app:s3cret@10.0.0.5:637900".parse::<StoreUrl>().unwrap_err();
//! assert!(!bad.to_string().contains("s3cret"));
//! ```

mod forms;
mod parse;
#[cfg(feature = "redis")]
mod redis;
#[cfg(test)]
mod tests;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::builder::ClientSettings;
use crate::{Error, MemoryStore, Result, Store};

pub use forms::{UrlForm, URL_FORMS};

/// The scheme of a store URL: which store, and how it is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scheme {
    /// `memory:`: this process only.
    Memory,
    /// `local:`: the processes of one host.
    Local,
    /// `redis://`: one Redis server.
    Redis,
    /// `rediss://`: one Redis server, over TLS.
    Rediss,
    /// `redis+cluster://`: a Redis Cluster.
    RedisCluster,
    /// `rediss+cluster://`: a Redis Cluster, over TLS.
    RedissCluster,
    /// `etcd://`: an etcd cluster.
    Etcd,
    /// `etcds://`: an etcd cluster, over TLS.
    Etcds,
}

impl Scheme {
    const ALL: [Scheme; 8] = [
        Scheme::Memory,
        Scheme::Local,
        Scheme::Redis,
        Scheme::Rediss,
        Scheme::RedisCluster,
        Scheme::RedissCluster,
        Scheme::Etcd,
        Scheme::Etcds,
    ];

    /// The scheme as written, without its `:`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Memory => "memory",
            Scheme::Local => "local",
            Scheme::Redis => "redis",
            Scheme::Rediss => "rediss",
            Scheme::RedisCluster => "redis+cluster",
            Scheme::RedissCluster => "rediss+cluster",
            Scheme::Etcd => "etcd",
            Scheme::Etcds => "etcds",
        }
    }

    fn from_name(name: &str) -> Option<Scheme> {
        Scheme::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// The store it opens: `memory`, `local`, `redis` or `etcd`.
    pub fn backend(self) -> &'static str {
        match self {
            Scheme::Memory => "memory",
            Scheme::Local => "local",
            Scheme::Redis | Scheme::Rediss | Scheme::RedisCluster | Scheme::RedissCluster => {
                "redis"
            }
            Scheme::Etcd | Scheme::Etcds => "etcd",
        }
    }

    /// Whether it reaches its servers over TLS.
    pub fn tls(self) -> bool {
        matches!(self, Scheme::Rediss | Scheme::RedissCluster | Scheme::Etcds)
    }

    /// Whether it names a Redis Cluster.
    pub fn cluster(self) -> bool {
        matches!(self, Scheme::RedisCluster | Scheme::RedissCluster)
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One server of a URL: `host[:port]`, an IPv6 host in brackets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    host: String,
    port: Option<u16>,
}

impl Endpoint {
    /// `host:port`; an IPv6 address goes in brackets (`[::1]`).
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Endpoint {
            host: host.into(),
            port: Some(port),
        }
    }

    /// The host as written (an IPv6 address in brackets).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port, if the URL gave one (a Redis URL may leave it out: 6379).
    pub fn port(&self) -> Option<u16> {
        self.port
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.port {
            Some(port) => write!(f, "{}:{port}", self.host),
            None => f.write_str(&self.host),
        }
    }
}

/// A password: `Debug` shows `***`, and there is no `Display`, so it reaches a message
/// only through [`expose`](Self::expose).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The password itself, for the store's client; never for a message.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// The user and password of a URL, percent-decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    user: Option<String>,
    password: Option<Secret>,
}

impl Credentials {
    /// `None` when neither is given (an empty one counts as not given).
    fn new(user: String, password: Option<String>) -> Option<Self> {
        let user = (!user.is_empty()).then_some(user);
        let password = password.filter(|p| !p.is_empty()).map(Secret);
        (user.is_some() || password.is_some()).then_some(Credentials { user, password })
    }

    /// The user name.
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// The password.
    pub fn password(&self) -> Option<&Secret> {
        self.password.as_ref()
    }
}

/// What a Redis URL asks beyond where to connect.
#[derive(Debug, Clone, Default, PartialEq)]
struct RedisOptions {
    /// `/N`.
    db: Option<i64>,
    /// `replicas=N`: replicas that must acknowledge a grant.
    replicas: Option<u32>,
    /// `replica_timeout=DUR`.
    replica_timeout: Option<Duration>,
    /// `durable=1`: refuse a server whose restart can lose locks.
    durable: bool,
    /// `protocol=resp2|resp3` (2 or 3).
    protocol: Option<u8>,
    /// `#insecure` (TLS that accepts any server certificate).
    insecure: bool,
}

/// A store URL, parsed and checked: the one reading of `memory:`, `local:DIR`,
/// `redis://...`, `rediss://...`, `redis+cluster://...`, `rediss+cluster://...`,
/// `etcd://...` and `etcds://...` (see [`URL_FORMS`]).
///
/// User names, passwords, option values and `local:` directories are percent-decoded
/// (`%40` is `@`, `%20` a space); `local:~/DIR` is in the home directory. Options a
/// store does not know are refused, naming the option. `Display` and `Debug` show a
/// password as `***`; [`expose`](Self::expose) gives the URL with it, to hand on.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreUrl {
    scheme: Scheme,
    /// `local:`: the directory; `None` for the default one.
    dir: Option<PathBuf>,
    endpoints: Vec<Endpoint>,
    credentials: Option<Credentials>,
    redis: RedisOptions,
}

impl StoreUrl {
    /// Reads `text`. An error is [`Error::InvalidStore`], which shows the URL with
    /// anything that may be a password as `***`.
    pub fn parse(text: &str) -> Result<Self> {
        let home = std::env::var_os("HOME").filter(|h| !h.is_empty());
        parse::parse(text, home.as_deref().map(Path::new))
    }

    fn new(scheme: Scheme) -> Self {
        StoreUrl {
            scheme,
            dir: None,
            endpoints: Vec::new(),
            credentials: None,
            redis: RedisOptions::default(),
        }
    }

    /// `memory:`.
    pub fn memory() -> Self {
        Self::new(Scheme::Memory)
    }

    /// `local:DIR`.
    pub fn local(dir: impl Into<PathBuf>) -> Self {
        StoreUrl {
            dir: Some(dir.into()),
            ..Self::new(Scheme::Local)
        }
    }

    /// Its scheme.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// `local:`: the directory, `None` for the default one.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The same store from any working directory: a `local:` directory relative to the
    /// working directory made absolute (`~` was expanded when it was parsed). For a URL
    /// handed to another process, which may start elsewhere.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let url = leasehold::StoreUrl::parse("local:locks")?.absolute()?;
    /// let here = std::env::current_dir()?;
    /// assert_eq!(url.dir(), Some(here.join("locks").as_path()));
    /// # Ok(()) }
    /// ```
    pub fn absolute(mut self) -> std::io::Result<Self> {
        if let Some(dir) = self.dir.as_mut().filter(|dir| dir.is_relative()) {
            *dir = std::path::absolute(&*dir)?;
        }
        Ok(self)
    }

    /// The servers of a Redis or etcd URL, in order; empty for the others.
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// The user and password, if given.
    pub fn credentials(&self) -> Option<&Credentials> {
        self.credentials.as_ref()
    }

    /// The same URL with other servers (e.g. proxies in front of them), one for each.
    pub fn with_endpoints(&self, endpoints: Vec<Endpoint>) -> Self {
        StoreUrl {
            endpoints,
            ..self.clone()
        }
    }

    /// The URL with its password, to hand to another process; never for a message.
    pub fn expose(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, true);
        out
    }

    /// An error about this store's URL (shown without its password).
    pub(crate) fn invalid(&self, reason: impl Into<String>) -> Error {
        Error::InvalidStore {
            store: self.to_string(),
            reason: reason.into(),
        }
    }

    /// A connect that failed as a TLS mix-up may fail (a server that speaks the other
    /// protocol drops the connection; a plain server never answers a TLS handshake),
    /// with the other scheme suggested, as a possibility.
    #[cfg(any(feature = "redis", feature = "etcd"))]
    pub(crate) fn with_scheme_hint(&self, error: Error) -> Error {
        let Error::Unavailable { store, source } = error else {
            return error;
        };
        let text = source.to_string();
        let said = text.to_ascii_lowercase();
        let tls = self.scheme.tls();
        let other = match self.scheme {
            Scheme::Redis => "rediss://",
            Scheme::Rediss => "redis://",
            Scheme::RedisCluster => "rediss+cluster://",
            Scheme::RedissCluster => "redis+cluster://",
            Scheme::Etcd => "etcds://",
            Scheme::Etcds => "etcd://",
            Scheme::Memory | Scheme::Local => "",
        };
        // Over TLS, a handshake that failed or went unanswered (after it, the server
        // spoke TLS); plain, a connection the server dropped (reset, closed, a broken
        // pipe: each client says it its own way), not one refused, timed out (paused)
        // or answered with an error of the server's own.
        let dropped = ["reset", "closed", "broken pipe", "not ready", "eof"];
        let mixup = match tls {
            true => said.contains("handshake") || said.contains("within"),
            false => dropped.iter().any(|d| said.contains(d)),
        };
        if !mixup || other.is_empty() {
            return Error::Unavailable { store, source };
        }
        let hint = match tls {
            true => format!("if the server does not speak TLS, use {other}"),
            false => format!("if the server speaks TLS, use {other}"),
        };
        Error::Unavailable {
            store,
            source: format!("{text} ({hint})").into(),
        }
    }

    /// Opens the store it names.
    pub async fn open(&self) -> Result<Arc<dyn Store>> {
        self.open_with(&ClientSettings::default()).await
    }

    /// Opens the store it names, reached as `settings` say (Redis and etcd).
    pub(crate) async fn open_with(&self, settings: &ClientSettings) -> Result<Arc<dyn Store>> {
        // Memory and local stores have no connection to configure.
        #[cfg(not(any(feature = "redis", feature = "etcd")))]
        let _ = settings;
        let not_built = || {
            self.invalid(format!(
                "the {} store is not part of this build; available: {}",
                self.scheme.backend(),
                forms::line()
            ))
        };
        match self.scheme {
            Scheme::Memory => Ok(Arc::new(MemoryStore::new())),
            #[cfg(feature = "local")]
            Scheme::Local => Ok(Arc::new(match &self.dir {
                None => crate::LocalStore::open_default()?,
                Some(dir) => crate::LocalStore::open(dir)?,
            })),
            #[cfg(feature = "redis")]
            Scheme::Redis | Scheme::Rediss | Scheme::RedisCluster | Scheme::RedissCluster => Ok(
                Arc::new(crate::RedisStore::connect_with(self, settings).await?),
            ),
            #[cfg(feature = "etcd")]
            Scheme::Etcd | Scheme::Etcds => Ok(Arc::new(
                crate::EtcdStore::connect_with(self, settings).await?,
            )),
            // Reached only in a build without some store.
            #[allow(unreachable_patterns)]
            _ => Err(not_built()),
        }
    }

    /// The URL, the password as `***` unless `secrets`.
    fn write(&self, out: &mut String, secrets: bool) {
        out.push_str(self.scheme.as_str());
        out.push(':');
        match self.scheme {
            Scheme::Memory => {}
            Scheme::Local => {
                if let Some(dir) = &self.dir {
                    parse::encode_dir(out, dir);
                }
            }
            _ => {
                out.push_str("//");
                let etcd = self.scheme.backend() == "etcd";
                if !etcd {
                    self.write_userinfo(out, secrets);
                }
                let endpoints: Vec<String> = self.endpoints.iter().map(|e| e.to_string()).collect();
                out.push_str(&endpoints.join(","));
                if let Some(db) = self.redis.db {
                    out.push_str(&format!("/{db}"));
                }
                let query = match etcd {
                    true => self.etcd_query(secrets),
                    false => self.redis_query(),
                };
                if !query.is_empty() {
                    out.push('?');
                    out.push_str(&query.join("&"));
                }
                if self.redis.insecure {
                    out.push_str("#insecure");
                }
            }
        }
    }

    /// `[user][:password]@`, encoded.
    fn write_userinfo(&self, out: &mut String, secrets: bool) {
        let Some(credentials) = &self.credentials else {
            return;
        };
        if let Some(user) = &credentials.user {
            parse::encode(out, user);
        }
        if let Some(password) = &credentials.password {
            out.push(':');
            match secrets {
                true => parse::encode(out, password.expose()),
                false => out.push_str("***"),
            }
        }
        out.push('@');
    }

    fn etcd_query(&self, secrets: bool) -> Vec<String> {
        let Some(credentials) = &self.credentials else {
            return Vec::new();
        };
        let mut query = Vec::new();
        if let Some(user) = &credentials.user {
            let mut pair = "user=".to_string();
            parse::encode(&mut pair, user);
            query.push(pair);
        }
        if let Some(password) = &credentials.password {
            let mut pair = "password=".to_string();
            match secrets {
                true => parse::encode(&mut pair, password.expose()),
                false => pair.push_str("***"),
            }
            query.push(pair);
        }
        query
    }

    fn redis_query(&self) -> Vec<String> {
        let o = &self.redis;
        let mut query = Vec::new();
        if let Some(n) = o.replicas {
            query.push(format!("replicas={n}"));
        }
        if let Some(timeout) = o.replica_timeout {
            query.push(format!("replica_timeout={}", parse::duration_text(timeout)));
        }
        if o.durable {
            query.push("durable=1".into());
        }
        if let Some(protocol) = o.protocol {
            query.push(format!("protocol=resp{protocol}"));
        }
        query
    }
}

/// The URL with its password as `***`.
impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::new();
        self.write(&mut out, false);
        f.write_str(&out)
    }
}

impl std::str::FromStr for StoreUrl {
    type Err = Error;
    fn from_str(text: &str) -> Result<Self> {
        Self::parse(text)
    }
}

/// Opens the store `url` names ([`StoreUrl::parse`], then [`StoreUrl::open`]).
///
/// The local store's directory follows `local:`: `local:/srv/locks` (absolute),
/// `local:locks` (relative to the working directory), `local:~/locks` (in the home
/// directory), or the file-URL form `local:///srv/locks` (absolute). `local://srv/locks`
/// is refused: in URL syntax `srv` there is a host, and reading it as the relative path
/// `srv/locks` would put the locks somewhere other than the user meant.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let err = leasehold::open_store("ftp://x").await.unwrap_err();
/// assert!(err.to_string().contains("unknown store scheme"));
/// # }
/// ```
pub async fn open_store(url: &str) -> Result<Arc<dyn Store>> {
    StoreUrl::parse(url)?.open().await
}
