//! Store URLs: `local:DIR`, `local:` (the default directory), `memory:`.

use std::sync::Arc;

use crate::{Error, MemoryStore, Result, Store};

/// The URL forms this build understands, for messages and `--help`.
pub const URL_FORMS: &str = "local:DIR, local: (default directory), memory: (this process only), redis://[user:password@]host:port[/db], rediss://... (TLS), redis+cluster://h1:p1,h2:p2, etcd://h1:2379[,h2:2379...][?user=U&password=P], etcds://... (TLS)";

/// Opens the store `url` names.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let err = leasehold::open_store("ftp://x").await.unwrap_err();
/// assert!(err.to_string().contains("unknown store scheme"));
/// # }
/// ```
pub async fn open_store(url: &str) -> Result<Arc<dyn Store>> {
    let invalid = |reason: String| Error::InvalidStore {
        store: url.to_string(),
        reason,
    };
    let Some((scheme, rest)) = url.split_once(':') else {
        return Err(invalid(format!(
            "a store URL starts with a scheme; use one of: {URL_FORMS}"
        )));
    };
    match scheme {
        "memory" if rest.is_empty() => Ok(Arc::new(MemoryStore::new())),
        "memory" => Err(invalid("memory: takes no address".into())),
        #[cfg(feature = "local")]
        "local" => {
            let dir = rest.strip_prefix("//").unwrap_or(rest);
            let store = if dir.is_empty() {
                crate::LocalStore::open_default()?
            } else {
                crate::LocalStore::open(dir)?
            };
            Ok(Arc::new(store))
        }
        #[cfg(not(feature = "local"))]
        "local" => Err(invalid(format!(
            "the local store is not part of this build; available: {URL_FORMS}"
        ))),
        #[cfg(feature = "redis")]
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => {
            Ok(Arc::new(crate::RedisStore::connect(url).await?))
        }
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => Err(invalid(format!(
            "the redis store is not part of this build; available: {URL_FORMS}"
        ))),
        #[cfg(feature = "etcd")]
        "etcd" | "etcds" => Ok(Arc::new(crate::EtcdStore::connect(url).await?)),
        #[cfg(not(feature = "etcd"))]
        "etcd" | "etcds" => Err(invalid(format!(
            "the {scheme} store is not part of this build; available: {URL_FORMS}"
        ))),
        _ => Err(invalid(format!(
            "unknown store scheme {scheme:?}; use one of: {URL_FORMS}"
        ))),
    }
}
