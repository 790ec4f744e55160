//! A Redis URL as the redis crate's connection settings, so that the crate never reads
//! the URL's text again.

use std::time::Duration;

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, ProtocolVersion, RedisResult};

use super::StoreUrl;

/// Where a Redis URL leaves out the port.
const REDIS_PORT: u16 = 6379;

/// What a grant waits for its replicas by default with `?replicas=N`.
pub(super) const DEFAULT_REPLICA_TIMEOUT: Duration = Duration::from_millis(100);

impl StoreUrl {
    /// `?replicas=N`, and how long a grant waits for them (`replica_timeout`).
    pub(crate) fn replicas(&self) -> Option<(u32, Duration)> {
        let timeout = self
            .redis
            .replica_timeout
            .unwrap_or(DEFAULT_REPLICA_TIMEOUT);
        self.redis.replicas.map(|n| (n, timeout))
    }

    /// `?durable=1`.
    pub(crate) fn durable(&self) -> bool {
        self.redis.durable
    }

    /// The settings for each endpoint: one server, or a cluster's seed nodes.
    pub(crate) fn redis_nodes(&self) -> RedisResult<Vec<ConnectionInfo>> {
        (self.endpoints.iter())
            .map(|e| {
                // The client wants an IPv6 address without its brackets.
                let host = e.host.trim_start_matches('[').trim_end_matches(']');
                self.redis_node(host, e.port.unwrap_or(REDIS_PORT))
            })
            .collect()
    }

    fn redis_node(&self, host: &str, port: u16) -> RedisResult<ConnectionInfo> {
        let host = host.to_string();
        let addr = match self.scheme.tls() {
            true => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: self.redis.insecure,
                tls_params: None,
            },
            false => ConnectionAddr::Tcp(host, port),
        };
        let mut settings = redis::RedisConnectionInfo::default().set_db(self.redis.db.unwrap_or(0));
        if self.redis.protocol == Some(3) {
            settings = settings.set_protocol(ProtocolVersion::RESP3);
        }
        if let Some(user) = self.credentials().and_then(|c| c.user()) {
            settings = settings.set_username(user);
        }
        if let Some(password) = self.credentials().and_then(|c| c.password()) {
            settings = settings.set_password(password.expose());
        }
        Ok(addr.into_connection_info()?.set_redis_settings(settings))
    }

    /// `redis://[user:password@]` (`rediss://` for TLS), password included, to which a
    /// cluster node's `host:port` is added to reach that node.
    pub(crate) fn redis_node_prefix(&self) -> String {
        let mut prefix = match self.scheme.tls() {
            true => "rediss://".to_string(),
            false => "redis://".to_string(),
        };
        self.write_userinfo(&mut prefix, true);
        prefix
    }
}
