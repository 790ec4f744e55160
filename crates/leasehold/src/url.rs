//! Store URLs: `local:DIR`, `local:///ABS` (file-URL form), `local:` (the default
//! directory), `memory:`.

use std::sync::Arc;

use crate::{Error, MemoryStore, Result, Store};

/// The URL forms this build understands, for messages and `--help`.
pub const URL_FORMS: &str = "local:DIR (local:/abs/dir, local:///abs/dir or local:rel/dir), local: (default directory), memory: (this process only), redis://[user:password@]host:port[/db], rediss://... (TLS), redis+cluster://h1:p1,h2:p2, etcd://h1:2379[,h2:2379...][?user=U&password=P], etcds://... (TLS)";

/// Opens the store `url` names.
///
/// The local store's directory follows `local:`: `local:/srv/locks` (absolute),
/// `local:locks` (relative to the working directory), or the file-URL form
/// `local:///srv/locks` (absolute). `local://srv/locks` is refused: in URL syntax `srv`
/// there is a host, and reading it as the relative path `srv/locks` would put the locks
/// somewhere other than the user meant.
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
            let dir = match rest.strip_prefix("//") {
                // `local://` (no directory) is the default directory, as `local:` is.
                Some(path) if path.is_empty() || path.starts_with('/') => path,
                Some(path) => {
                    return Err(invalid(format!(
                        "local:// is followed by a host in URL syntax, not a directory; \
for the directory /{path} write local:/{path} or local:///{path}, for {path} relative to \
the working directory write local:{path}"
                    )))
                }
                None => rest,
            };
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

#[cfg(all(test, feature = "local"))]
mod tests {
    use super::*;

    #[tokio::test]
    async fn local_with_two_slashes_and_a_relative_path_is_refused_with_both_spellings() {
        let err = open_store("local://srv/locks")
            .await
            .unwrap_err()
            .to_string();
        for said in [
            "host",
            "local:/srv/locks",
            "local:///srv/locks",
            "local:srv/locks",
        ] {
            assert!(err.contains(said), "no {said:?} in: {err}");
        }
    }

    #[tokio::test]
    async fn local_with_three_slashes_is_an_absolute_directory() {
        let dir = tempfile::tempdir().unwrap();
        let abs = dir.path().join("store");
        let store = open_store(&format!("local://{}", abs.display()))
            .await
            .unwrap();
        assert!(store.describe_store().contains(&abs.display().to_string()));
        assert!(abs.is_dir(), "the store was not made at {}", abs.display());
    }
}
