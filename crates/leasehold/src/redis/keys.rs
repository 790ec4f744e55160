//! The keys of a lock (`lh:{NAME}`, `:hold`, `:token`: see hot.lua) and of a rate
//! limiter (`lh:rate:{NAME}`).

use crate::LockName;

/// `lh:{NAME}` with `%`, `{` and `}` escaped, so the whole name is the hash tag: the
/// lock's record. Its hold key and token counter add `:hold` and `:token` (see hot.lua).
pub(super) fn key(name: &LockName) -> String {
    let mut key = String::new();
    push_key(&mut key, name);
    key
}

/// Appends [`key`]`(name)` to `out`.
pub(super) fn push_key(out: &mut String, name: &LockName) {
    out.push_str("lh:{");
    out.push_str(&key_escape(name.as_str()));
    out.push('}');
}

/// `lh:rate:{NAME}` (escaped as [`key`]): a rate limiter's key. Lock keys start with
/// `lh:{`, so a limiter and a lock of the same name never share a key, while both hash
/// to the same cluster slot.
pub(super) fn push_rate_key(out: &mut String, name: &LockName) {
    out.push_str("lh:rate:{");
    out.push_str(&key_escape(name.as_str()));
    out.push('}');
}

pub(super) fn key_escape(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.contains(['%', '{', '}']) {
        return s.into();
    }
    s.replace('%', "%25")
        .replace('{', "%7B")
        .replace('}', "%7D")
        .into()
}

pub(super) fn key_unescape(s: &str) -> String {
    s.replace("%7B", "{")
        .replace("%7D", "}")
        .replace("%25", "%")
}
