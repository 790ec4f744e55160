//! A lock's state as describe.lua writes it (JSON, one letter a field: see its header),
//! and as [`LockState`] shows it.

use std::time::Duration;

use serde::Deserialize;

use super::reply::{kind, since, StateReply};
use crate::store::{HolderInfo, LockKind, LockState, WaiterInfo};
use crate::{FencingToken, LockName};

/// The lock. cjson writes an empty list as `{}`, so lists are read leniently.
#[derive(Deserialize)]
pub(super) struct State {
    #[serde(rename = "t", deserialize_with = "token_text")]
    last_token: u64,
    #[serde(rename = "h", default, deserialize_with = "lenient_list")]
    holders: Vec<Holder>,
    #[serde(rename = "w", default, deserialize_with = "lenient_list")]
    waiters: Vec<Waiter>,
}

/// Who holds or waits, and for what kind of lock.
#[derive(Deserialize)]
struct Owner {
    #[serde(rename = "o")]
    owner: String,
    #[serde(rename = "k")]
    kind: String,
    #[serde(rename = "p")]
    permits: f64,
}

impl Owner {
    /// A kind as the record keeps it: a word that is none of ours reads as exclusive.
    fn kind(&self) -> LockKind {
        kind(&self.kind, self.permits as i64).unwrap_or(LockKind::Exclusive)
    }
}

/// An owner's holds, which share its kind, token and time acquired.
#[derive(Deserialize)]
struct Holder {
    #[serde(flatten)]
    who: Owner,
    #[serde(rename = "t", deserialize_with = "token_text")]
    token: u64,
    /// ms since the epoch.
    #[serde(rename = "a")]
    acquired: f64,
    #[serde(rename = "d", deserialize_with = "lenient_list")]
    holds: Vec<Hold>,
    /// What the holder published, if anything (an election's).
    #[serde(rename = "v", default)]
    value: Option<String>,
}

#[derive(Deserialize)]
struct Hold {
    #[serde(rename = "n")]
    host: String,
    #[serde(rename = "i")]
    pid: f64,
    /// ms since the epoch, on the server's clock.
    #[serde(rename = "e")]
    expires: f64,
}

#[derive(Deserialize)]
struct Waiter {
    #[serde(flatten)]
    who: Owner,
    #[serde(rename = "n")]
    host: String,
    #[serde(rename = "i")]
    pid: f64,
    /// ms since the epoch.
    #[serde(rename = "a")]
    arrived: f64,
}

/// A token, which describe.lua writes as text: cjson writes numbers with 14 digits, and
/// tokens seeded from the clock have 16.
fn token_text<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    String::deserialize(d)?
        .trim()
        .parse()
        .map_err(serde::de::Error::custom)
}

fn lenient_list<'de, D, T>(d: D) -> std::result::Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::Array(items) => items
            .into_iter()
            .map(|v| T::deserialize(v).map_err(serde::de::Error::custom))
            .collect(),
        _ => Ok(Vec::new()),
    }
}

impl State {
    /// The lock's state from describe.lua's reply; `Err` if its JSON is not a state.
    pub(super) fn read(reply: &StateReply) -> serde_json::Result<Self> {
        serde_json::from_str(&reply.json)
    }

    /// As [`LockState`] shows it, leases counted from `now` (the server's time, ms).
    pub(super) fn shown(&self, name: &LockName, now: i64) -> LockState {
        LockState {
            name: name.to_string(),
            last_token: FencingToken(self.last_token),
            holders: self
                .holders
                .iter()
                .filter_map(|h| {
                    let first = h.holds.first()?;
                    let expires = h.holds.iter().map(|d| d.expires as i64).max();
                    Some(HolderInfo {
                        owner: h.who.owner.clone(),
                        host: first.host.clone(),
                        pid: first.pid as u32,
                        token: FencingToken(h.token),
                        kind: h.who.kind(),
                        since: since(h.acquired as i64),
                        lease_left: Duration::from_millis(
                            (expires.unwrap_or(0) - now).max(0) as u64
                        ),
                        holds: h.holds.len() as u32,
                        value: h.value.clone(),
                    })
                })
                .collect(),
            waiters: self
                .waiters
                .iter()
                .map(|w| WaiterInfo {
                    owner: w.who.owner.clone(),
                    host: w.host.clone(),
                    pid: w.pid as u32,
                    kind: w.who.kind(),
                    since: since(w.arrived as i64),
                })
                .collect(),
        }
    }
}
