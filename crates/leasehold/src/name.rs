//! Validated lock names.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

/// The longest lock name accepted, in bytes.
pub const MAX_NAME_LEN: usize = 256;

/// A validated lock name: non-empty, at most [`MAX_NAME_LEN`] bytes of UTF-8, no control
/// characters. Any other character is allowed (`/`, `:`, spaces, non-ASCII), so names
/// like `billing/nightly` or `tenant:42:migrate` can namespace locks.
///
/// ```
/// use leasehold::LockName;
/// assert!(LockName::new("billing/nightly").is_ok());
/// let err = LockName::new("").unwrap_err();
/// assert!(err.to_string().contains("empty"));
/// ```
///
/// Cloning one is cheap (the text is shared), as every acquisition carries its name.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockName(Arc<str>);

impl LockName {
    /// Validates `name`; the error names the rule that failed.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let rule = if name.is_empty() {
            Some("must not be empty".to_string())
        } else if name.len() > MAX_NAME_LEN {
            Some(format!(
                "is {} bytes long; at most {MAX_NAME_LEN} bytes are allowed",
                name.len()
            ))
        } else {
            name.char_indices()
                .find(|(_, c)| c.is_control())
                .map(|(at, c)| {
                    format!("contains the control character {c:?} at byte {at}; control characters are not allowed")
                })
        };
        match rule {
            Some(rule) => Err(Error::InvalidName {
                name: crate::error::shown(&name),
                rule,
            }),
            None => Ok(LockName(name.into())),
        }
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// What a lock name can be given as: `&str`, `String`, `&String`, `Cow<str>`, or a
/// [`LockName`] (owned or borrowed, kept as it is: it was validated when it was made).
/// [`Leasehold::mutex`](crate::Leasehold::mutex) and the other methods that take a name
/// take any of these.
///
/// ```
/// # fn main() -> leasehold::Result<()> {
/// use leasehold::{Leasehold, LockName, MemoryStore};
/// let locks = Leasehold::new(MemoryStore::new());
/// let name = format!("tenant:{}:migrate", 42);
/// locks.mutex(&name)?;
/// locks.mutex(name.clone())?;
/// let checked = LockName::new(name)?;
/// locks.write(&checked)?;
/// locks.read(checked)?;
/// # Ok(()) }
/// ```
pub trait IntoLockName {
    /// The validated name; [`Error::InvalidName`] if it breaks a rule of [`LockName`].
    fn into_lock_name(self) -> Result<LockName>;
}

impl IntoLockName for LockName {
    fn into_lock_name(self) -> Result<LockName> {
        Ok(self)
    }
}

impl IntoLockName for &LockName {
    fn into_lock_name(self) -> Result<LockName> {
        Ok(self.clone())
    }
}

impl IntoLockName for &str {
    fn into_lock_name(self) -> Result<LockName> {
        LockName::new(self)
    }
}

impl IntoLockName for String {
    fn into_lock_name(self) -> Result<LockName> {
        LockName::new(self)
    }
}

impl IntoLockName for &String {
    fn into_lock_name(self) -> Result<LockName> {
        LockName::new(self.as_str())
    }
}

impl IntoLockName for std::borrow::Cow<'_, str> {
    fn into_lock_name(self) -> Result<LockName> {
        LockName::new(self)
    }
}

impl TryFrom<&str> for LockName {
    type Error = Error;
    fn try_from(name: &str) -> Result<Self> {
        LockName::new(name)
    }
}

impl TryFrom<String> for LockName {
    type Error = Error;
    fn try_from(name: String) -> Result<Self> {
        LockName::new(name)
    }
}

impl TryFrom<&LockName> for LockName {
    type Error = Error;
    fn try_from(name: &LockName) -> Result<Self> {
        Ok(name.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_each_rule_with_its_reason() {
        let msg = |n: &str| LockName::new(n).unwrap_err().to_string();
        assert!(msg("").contains("must not be empty"));
        assert!(msg(&"x".repeat(257)).contains("257 bytes"));
        assert!(msg("a\nb").contains("control character"));
        assert!(msg("a\u{7f}").contains("control character"));
        assert!(LockName::new("x".repeat(256)).is_ok());
        assert!(LockName::new("tenant:42/ü migrate").is_ok());
    }
}
