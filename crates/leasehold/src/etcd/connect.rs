//! Connecting (the URL, the members), the calls every room makes (Txn, Range), how
//! their failures become errors, and reading a queue's keys into [`Member`]s.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::line::Lines;
use super::queue::Member;
use super::queue::{queue_prefix, range_key, range_queue, txn_scope};
use super::rpc::{self, Client, KeyValue, Op, RangeResponse, TlsRefused, TxnRequest, TxnResponse};
use super::{EtcdStore, Inner};
use crate::builder::ClientSettings;
use crate::url::Credentials;
use crate::{Error, LockName, Result, StoreUrl};

impl EtcdStore {
    /// Connects to the etcd cluster `url` names (see the module docs). Fails at once,
    /// with [`Error::Unavailable`], when no endpoint answers.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(&StoreUrl::parse(url)?, &ClientSettings::default()).await
    }

    /// [`connect`](Self::connect) to a parsed URL, reached as `settings` say.
    pub(crate) async fn connect_with(url: &StoreUrl, settings: &ClientSettings) -> Result<Self> {
        if url.scheme().backend() != "etcd" {
            return Err(url.invalid(
                "not an etcd URL: etcd://HOST:PORT[,HOST:PORT...][?user=NAME&password=SECRET] (etcds:// for TLS)",
            ));
        }
        let addresses: Vec<String> = url.endpoints().iter().map(|e| e.to_string()).collect();
        let client = Client::new(
            &addresses,
            url.scheme().tls(),
            url.credentials().cloned(),
            settings,
        )
        .map_err(|reason| url.invalid(reason))?;
        let checked = Self::checked(url.to_string(), client, settings.connect_timeout).await;
        checked.map_err(|e| url.with_scheme_hint(e))
    }

    /// A store over channels the application made (its own TLS, timeouts, proxies), one
    /// for each member, `shown` naming them in messages; `credentials` for a cluster with
    /// auth enabled (from a URL: [`StoreUrl::credentials`]).
    pub async fn from_channels(
        shown: impl Into<String>,
        channels: Vec<tonic::transport::Channel>,
        credentials: Option<Credentials>,
    ) -> Result<Self> {
        let shown = shown.into();
        if channels.is_empty() {
            return Err(Error::InvalidStore {
                store: shown,
                reason: "no channel to an etcd member".into(),
            });
        }
        Self::checked(shown, Client::from_channels(channels, credentials), None).await
    }

    /// The store on `client`, once it has answered, within `connect_timeout` if given.
    async fn checked(
        shown: String,
        client: Client,
        connect_timeout: Option<Duration>,
    ) -> Result<Self> {
        let store = EtcdStore {
            inner: Arc::new(Inner {
                shown,
                client: Arc::new(client),
                acquisitions: Mutex::default(),
                spare: Mutex::default(),
                moving: Mutex::default(),
                waiter_leases: Mutex::default(),
                granting: tokio::sync::Mutex::default(),
                lines: Lines::default(),
                busy_queues: Mutex::default(),
                shown_holders: Mutex::default(),
                puts: tokio::sync::Semaphore::new(super::PUTS_AT_ONCE),
                attempts: Arc::new(tokio::sync::Semaphore::new(super::ATTEMPTS_AT_ONCE)),
                revokes: tokio_util::task::TaskTracker::new(),
                caveat: std::sync::OnceLock::new(),
            }),
        };
        // Fail now, with a clear error, rather than at the first lock; and ask the
        // member's version beside it, for the store's caveat (no answer: none known).
        let status = store
            .inner
            .client
            .unary::<_, rpc::StatusResponse>("/etcdserverpb.Maintenance/Status", rpc::Empty {});
        let check = async {
            let (checked, status) = tokio::join!(store.range(range_key(b"leasehold")), status);
            if let Some(caveat) = status.ok().and_then(|s| version_caveat(&s.version)) {
                let _ = store.inner.caveat.set(caveat);
            }
            checked
        };
        // A link's connect timeout covers TCP, TLS and HTTP/2's preface; a member that
        // accepts and then never answers is bounded here, by this first call.
        match connect_timeout {
            None => check.await?,
            Some(limit) => {
                tokio::time::timeout(limit, check)
                    .await
                    .map_err(|_| Error::Unavailable {
                        store: store.inner.shown.clone(),
                        source: format!("no connection within the connect timeout ({limit:?})")
                            .into(),
                    })??
            }
        };
        Ok(store)
    }

    pub(super) fn unavailable(&self, status: tonic::Status) -> Error {
        let message = status.message().to_string();
        let source = std::error::Error::source(&status);
        if let Some(TlsRefused(check)) = source.and_then(|s| s.downcast_ref()) {
            return Error::Config {
                store: self.inner.shown.clone(),
                reason: format!("{message}; {check}"),
            };
        }
        // Refused after the client authenticated again once, a wrong password, or auth
        // options for a server without auth: a configuration to fix, not to retry.
        let refused = match status.code() {
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => true,
            tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition => {
                message.contains("authentication")
            }
            _ => false,
        };
        if refused {
            return Error::Config {
                store: self.inner.shown.clone(),
                reason: format!("authentication failed: {message} (check user= and password=)"),
            };
        }
        let reason = match message.is_empty() {
            true => format!("{}", status.code()),
            false => message,
        };
        Error::Unavailable {
            store: self.inner.shown.clone(),
            source: reason.into(),
        }
    }

    pub(super) async fn call_txn(&self, request: TxnRequest) -> Result<TxnResponse> {
        (self.inner.client.txn(request, txn_scope).await).map_err(|s| self.unavailable(s))
    }

    pub(super) async fn range(&self, op: Op) -> Result<RangeResponse> {
        let Op::Range(request) = op else {
            unreachable!("range takes a range")
        };
        self.inner
            .client
            .unary("/etcdserverpb.KV/Range", request)
            .await
            .map_err(|s| self.unavailable(s))
    }

    pub(super) fn corrupt(&self, name: &LockName, reason: String) -> Error {
        Error::Corrupt {
            store: self.inner.shown.clone(),
            name: name.to_string(),
            reason,
        }
    }

    pub(super) fn members(&self, name: &LockName, kvs: &[KeyValue]) -> Result<Vec<Member>> {
        kvs.iter().map(|kv| self.member(name, kv)).collect()
    }

    pub(super) fn member(&self, name: &LockName, kv: &KeyValue) -> Result<Member> {
        let entry = serde_json::from_slice(&kv.value).map_err(|e| {
            self.corrupt(
                name,
                format!(
                    "key {:?} is not a leasehold queue entry ({e}); delete it with etcdctl",
                    String::from_utf8_lossy(&kv.key)
                ),
            )
        })?;
        Ok(Member {
            kv: kv.clone(),
            entry,
        })
    }

    pub(super) async fn queue(&self, name: &LockName) -> Result<(Vec<Member>, i64)> {
        let answer = self.range(range_queue(&queue_prefix(name))).await?;
        let revision = answer.header.as_ref().map_or(0, |h| h.revision);
        Ok((self.members(name, &answer.kvs)?, revision))
    }
}

/// What an etcd member of `version` can do to held locks, if it is one that etcd issue
/// 15247 affects (fixed in 3.4.31 and 3.5.13): a leader that stalls and resumes can
/// revoke leases its followers kept alive meanwhile.
fn version_caveat(version: &str) -> Option<String> {
    let mut parts = version
        .split(['.', '-', '+'])
        .map(|p| p.parse::<u64>().ok());
    let (major, minor, patch) = (parts.next()??, parts.next()??, parts.next()??);
    let affected = match (major, minor) {
        (3, 4) => patch < 31,
        (3, 5) => patch < 13,
        (3, m) => m < 4,
        (m, _) => m < 3,
    };
    affected.then(|| {
        format!(
            "etcd {version} can revoke leases that clients kept alive when a stalled leader resumes (etcd issue 15247; fixed in 3.4.31 and 3.5.13): a held lock can then pass to a waiter before its holder learns it is lost; fencing tokens still rise"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::version_caveat;

    #[test]
    fn versions_before_the_lease_revoke_fix_get_a_caveat() {
        for affected in ["3.4.23", "3.4.30", "3.5.0", "3.5.12", "3.3.27", "2.3.8"] {
            let caveat = version_caveat(affected).unwrap_or_default();
            assert!(
                caveat.contains(affected) && caveat.contains("15247"),
                "{affected}"
            );
        }
        for fixed in ["3.4.31", "3.5.13", "3.5.21", "3.6.0", "3.6.0-rc.1", "4.0.0"] {
            assert_eq!(version_caveat(fixed), None, "{fixed}");
        }
        // A version it cannot read says nothing.
        assert_eq!(version_caveat(""), None);
        assert_eq!(version_caveat("main"), None);
    }
}
