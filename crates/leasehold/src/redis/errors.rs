//! What a Redis error means to the caller.

use super::keys::key;
use super::reply::CONFLICT_CODE;
use super::RedisStore;
use crate::{Error, LockName};

/// A Redis error as ours: refusals that retrying cannot fix (credentials, ACL
/// permissions, an unknown database, a server that does not speak Redis, a cluster URL
/// at a server that is not a cluster node, a TLS certificate refused either way) are
/// [`Error::Config`]; the rest are
/// [`Error::Unavailable`].
pub(super) fn failed(store: &str, e: redis::RedisError) -> Error {
    use redis::{ErrorKind, ServerErrorKind};
    let text = e.to_string();
    let config = crate::tls::refusal(&e).or(match e.kind() {
        ErrorKind::AuthenticationFailed => Some("check the URL's user and password"),
        // What answered is not a Redis server (or wants TLS): asking again cannot help.
        ErrorKind::Parse => Some(
            "the server at this address does not answer as Redis does: check the URL's host and port (another service? a TLS port, which needs rediss://?)",
        ),
        ErrorKind::Server(ServerErrorKind::NoPerm) => {
            Some("the user lacks a permission leasehold needs (EVALSHA, PUBLISH, SUBSCRIBE)")
        }
        _ if matches!(e.code(), Some("WRONGPASS" | "NOAUTH")) => {
            Some("check the URL's user and password")
        }
        _ if text.contains("cluster support disabled") => Some(
            "the server is not a Redis Cluster node: use redis://... (or rediss://...) for a single server",
        ),
        // SELECT refused: redis-rs keeps the server's words but not its code (NOAUTH).
        _ if text.contains("refused to switch database") && text.contains("uthentication") => {
            Some("check the URL's user and password")
        }
        _ if text.contains("DB index is out of range")
            || text.contains("invalid DB index")
            || text.contains("refused to switch database") =>
        {
            Some("the database in the URL (/N) does not exist on this server")
        }
        _ => None,
    });
    match config {
        Some(what) => Error::Config {
            store: store.to_string(),
            reason: format!("{text}; {what}"),
        },
        None => Error::Unavailable {
            store: store.to_string(),
            source: Box::new(e),
        },
    }
}

impl RedisStore {
    /// The error of a lock script on `name`: the lock rules' refusal (the words of
    /// [`CONFLICT`](super::reply::CONFLICT) as [`Error::Conflict`]'s reason), unreadable state, or [`failed`].
    pub(super) fn error(&self, e: redis::RedisError, name: &LockName) -> Error {
        // A script that failed on what it read (a key of ours that something else wrote,
        // of another type or format): unreadable state, not a store that is away.
        let text = e.to_string();
        if text.contains("user_script:") || text.contains("WRONGTYPE") {
            return Error::Corrupt {
                store: self.inner.shown.clone(),
                name: name.to_string(),
                reason: format!(
                    "{} (or its :hold or :token key) does not hold leasehold's data ({text}); delete those keys to start the lock afresh (tokens then start again from the server's clock)",
                    key(name)
                ),
            };
        }
        if let Some(reason) = e.detail().filter(|_| e.code() == Some(CONFLICT_CODE)) {
            return Error::Conflict {
                name: name.to_string(),
                reason: reason.to_string(),
            };
        }
        if let Some((_, reason)) = text.split_once(&format!("{CONFLICT_CODE} ")) {
            return Error::Conflict {
                name: name.to_string(),
                reason: reason.to_string(),
            };
        }
        failed(&self.inner.shown, e)
    }
}
