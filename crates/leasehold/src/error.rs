//! The one public error type.

/// A boxed error from a store's client library or the OS.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong. Contention is not an error: `try_lock` returns `None`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The name (of a lock, an election or a rate limiter) broke a rule (see
    /// [`LockName`](crate::LockName)).
    #[error("invalid name \"{name}\": the name {rule}")]
    InvalidName {
        /// The rejected name, escaped for display (cut after 64 characters).
        name: String,
        /// The rule it broke.
        rule: String,
    },

    /// An option (TTL, wait, permits, owner, ...) is out of range.
    #[error("invalid {option}: {reason}")]
    InvalidOption {
        /// Which option.
        option: &'static str,
        /// What was wrong and what is allowed.
        reason: String,
    },

    /// A store URL or store location that cannot be used.
    #[error("invalid store {store:?}: {reason}")]
    InvalidStore {
        /// The URL or path as given.
        store: String,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// The request is valid but cannot be served with the lock in its current shape,
    /// e.g. upgrading a held read lock to a write lock (which would deadlock).
    #[error("lock \"{name}\": {reason}")]
    Conflict {
        /// The lock.
        name: String,
        /// Why.
        reason: String,
    },

    /// The store could not be reached or did not answer. Retrying may help.
    #[error("store {store} is unavailable: {source}")]
    Unavailable {
        /// Which store (URL or path).
        store: String,
        /// The underlying error.
        #[source]
        source: BoxError,
    },

    /// The store refused us for a reason retrying cannot fix: wrong credentials, missing
    /// permissions (a local store's files too), an unknown database, a TLS certificate not
    /// trusted (the server's by us, or ours by the server). Not retryable: fix the
    /// configuration.
    #[error("store {store} refused access: {reason}")]
    Config {
        /// Which store (URL or path, without secrets).
        store: String,
        /// What it said, and what to check.
        reason: String,
    },

    /// The store's data for a lock cannot be read back.
    #[error("store {store} holds unreadable state for lock \"{name}\": {reason}")]
    Corrupt {
        /// Which store.
        store: String,
        /// The lock.
        name: String,
        /// What is wrong and what to do.
        reason: String,
    },

    /// The guard can no longer prove it holds the lock: its safe deadline has passed,
    /// or the store said the lease is gone (expired, force-released).
    #[error("lock \"{name}\" is lost: {reason}; stop work protected by it (its fencing token {token} is stale)")]
    Lost {
        /// The lock.
        name: String,
        /// The token the guard had.
        token: u64,
        /// Deadline passed or the store's word.
        reason: String,
    },

    /// A wait ended without the lock because the store dropped our place in its queue
    /// (the waiter's own lease expired while this process was paused or cut off). A
    /// wait joins the queue again, at its end, when this happens: a bounded one returns
    /// this if its time runs out on the way; `lock()` never does.
    #[error("lock \"{name}\": stopped waiting: {reason}")]
    WaitEnded {
        /// The lock.
        name: String,
        /// Why the place was lost.
        reason: String,
    },

    /// The store does not offer what was asked (e.g. rate limiters on etcd, which has no
    /// server clock every client can trust). Not retryable: use another store.
    #[error("store {store} does not offer {what}")]
    Unsupported {
        /// Which store.
        store: String,
        /// What it does not offer.
        what: String,
    },

    /// A bug or an unexpected state.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// True when the same call may succeed later (the store was unreachable or slow, or
    /// it dropped a waiter's place: a wait then joins the queue again by itself, and
    /// returns this only once its time is up).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unavailable { .. } | Error::WaitEnded { .. })
    }

    pub(crate) fn option(option: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidOption {
            option,
            reason: reason.into(),
        }
    }
}

/// Longest rejected input shown whole in an error, in characters.
const SHOWN: usize = 64;

/// A rejected input as an error shows it: escaped, and cut after [`SHOWN`] characters
/// (an input too long may be very long: the message says how long instead).
pub(crate) fn shown(input: &str) -> String {
    let escaped = input.escape_debug().to_string();
    match escaped.char_indices().nth(SHOWN) {
        Some((cut, _)) => format!("{}… ({} bytes)", &escaped[..cut], input.len()),
        None => escaped,
    }
}

#[cfg(test)]
mod tests {
    use super::shown;

    #[test]
    fn a_long_input_is_shown_cut_with_its_length() {
        assert_eq!(shown("a\nb"), "a\\nb");
        assert_eq!(shown(&"x".repeat(64)), "x".repeat(64));
        assert_eq!(
            shown(&"é".repeat(10_000)),
            format!("{}… (20000 bytes)", "é".repeat(64))
        );
    }
}
