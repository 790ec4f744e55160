//! What the scripts answer. Each reply is a [`Shape`]: a list of named fields in the
//! order they are sent. The scripts give a reply's fields by name
//! (`return reply.granted{token = t, holds = 1, released = 0}`, written out in the
//! shape's order when the script is made: lua.rs) and Rust reads it back here by the
//! same names, into a typed reply ([`AcquireReply`] and the others). A reply that does
//! not fit its shape is an error, not a default.
//!
//! hot.lua answers before any of this is defined, with bare integers: an acquire's
//! token, or 1 for a release, renewal or look that it served.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::Value;

use crate::store::{Busy, HolderInfo, LockKind, Released, Renewal, Watermark};
use crate::{rules, Error, FencingToken, LockName, RateDecision, Result};

/// How a reply is sent.
#[derive(Debug)]
pub(super) enum Form {
    /// A list of the fields.
    List,
    /// A list of the fields after this number, which tells the shapes of one script apart.
    Tagged(i64),
    /// An error reply: this code, then the fields, separated by spaces.
    Error(&'static str),
}

/// A reply: its name in Lua (`reply.NAME{...}`), how it is sent, and its fields.
#[derive(Debug)]
pub(super) struct Shape {
    pub(super) name: &'static str,
    pub(super) form: Form,
    pub(super) fields: &'static [&'static str],
}

/// An acquire granted: the fencing token, the owner's holds now, and 1 if a transfer's
/// hold was released first (else 0).
pub(super) const GRANTED: Shape = Shape {
    name: "granted",
    form: Form::Tagged(1),
    fields: &["token", "holds", "released"],
};

/// An acquire not granted: the place in the queue (0: not queued), when to look again
/// (ms, -1: no time), the watermark, the holder in the way (owner `''` when none: the
/// others are then 0 or `''`; its value nil when it has none), and `released` as in
/// [`GRANTED`].
pub(super) const BUSY: Shape = Shape {
    name: "busy",
    form: Form::Tagged(0),
    fields: &[
        "position",
        "retry_in",
        "watermark",
        "owner",
        "host",
        "pid",
        "token",
        "acquired",
        "lease_left",
        "holds",
        "kind",
        "permits",
        "value",
        "released",
    ],
};

/// The code of a [`CONFLICT`] error.
pub(super) const CONFLICT_CODE: &str = "LHCONFLICT";

/// An acquire that the lock rules refuse: the refusal's code (`Refusal::code` in rules.rs)
/// and the kind and permits of the holder or waiter it met.
pub(super) const CONFLICT: Shape = Shape {
    name: "conflict",
    form: Form::Error(CONFLICT_CODE),
    fields: &["code", "kind", "permits"],
};

/// A release whose messages include some for the caller's own waiters: 1 if a hold was
/// released (else 0), and those messages (a release without them answers the number).
pub(super) const RELEASE: Shape = Shape {
    name: "release",
    form: Form::List,
    fields: &["released", "own"],
};

/// The lock as describe.lua sees it: the server's time (ms) and the state as JSON.
pub(super) const STATE: Shape = Shape {
    name: "state",
    form: Form::List,
    fields: &["now", "state"],
};

/// A rate limiter's decision: allowed (1 or 0), the wait, the units left and when the
/// limiter is back to full burst (µs).
pub(super) const DECISION: Shape = Shape {
    name: "decision",
    form: Form::List,
    fields: &["allowed", "wait_us", "remaining", "reset_after_us"],
};

/// One reply read by the names of its shape's fields.
struct Fields<'a> {
    shape: &'static Shape,
    values: &'a [Value],
    /// The whole reply, for messages.
    reply: &'a Value,
}

impl<'a> Fields<'a> {
    /// The list `reply` as `shape` (after its tag, if it has one).
    fn read(shape: &'static Shape, reply: &'a Value) -> Result<Self> {
        let Value::Array(items) = reply else {
            return Err(malformed(shape, reply, "not a list"));
        };
        let values = match shape.form {
            Form::Tagged(tag) if items.first().and_then(int) == Some(tag) => &items[1..],
            Form::Tagged(_) => return Err(malformed(shape, reply, "another tag")),
            Form::List | Form::Error(_) => &items[..],
        };
        if values.len() != shape.fields.len() {
            return Err(malformed(shape, reply, "another number of fields"));
        }
        Ok(Fields {
            shape,
            values,
            reply,
        })
    }

    fn get(&self, field: &str) -> &'a Value {
        let at = self.shape.fields.iter().position(|f| *f == field);
        &self.values[at.unwrap_or_else(|| panic!("{} has no field {field}", self.shape.name))]
    }

    fn int(&self, field: &str) -> Result<i64> {
        int(self.get(field)).ok_or_else(|| self.not(field, "a whole number"))
    }

    fn text(&self, field: &str) -> Result<String> {
        text(self.get(field)).ok_or_else(|| self.not(field, "text"))
    }

    /// A field that is 1 or 0.
    fn flag(&self, field: &str) -> Result<bool> {
        match self.int(field)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.not(field, "1 or 0")),
        }
    }

    fn not(&self, field: &str, what: &str) -> Error {
        malformed(self.shape, self.reply, &format!("{field} is not {what}"))
    }
}

fn malformed(shape: &Shape, reply: &Value, why: &str) -> Error {
    Error::Internal(format!(
        "malformed {} reply from a Redis script ({why}): {reply:?}",
        shape.name
    ))
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

/// A kind as the scripts write it, with the permits of a semaphore's.
pub(super) fn kind(word: &str, permits: i64) -> Option<LockKind> {
    match word {
        "exclusive" => Some(LockKind::Exclusive),
        "shared" => Some(LockKind::Shared),
        "permit" => Some(LockKind::Permit {
            permits: permits.max(1) as u32,
        }),
        _ => None,
    }
}

/// What downgrade.lua answered: 1 done, 0 the hold gone, or the holder's kind, permits,
/// holds and owner, which the lock rules refuse.
pub(super) fn downgrade(reply: &Value, name: &LockName) -> Result<Renewal> {
    let refused = |fields: &[Value]| {
        let [word, permits, holds, owner] = fields else {
            return None;
        };
        let held = kind(&text(word)?, int(permits)?)?;
        let holds = u32::try_from(int(holds)?).ok()?;
        rules::downgrade(held, holds, &text(owner)?).err()
    };
    let refusal = match reply {
        Value::Int(1) => return Ok(Renewal::Renewed),
        Value::Int(0) => return Ok(Renewal::Lost),
        Value::Array(fields) => refused(fields),
        _ => None,
    };
    Err(match refusal {
        Some(refusal) => refusal.conflict(name.as_str()),
        None => Error::Internal(format!(
            "malformed downgrade reply from a Redis script: {reply:?}"
        )),
    })
}

/// A time in ms since the epoch.
pub(super) fn since(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

fn ms(ms: i64) -> Duration {
    Duration::from_millis(ms.max(0) as u64)
}

fn released(yes: bool) -> Released {
    match yes {
        true => Released::Released,
        false => Released::NotHeld,
    }
}

/// What an acquire or transfer script answered.
#[derive(Debug)]
pub(super) struct AcquireReply {
    pub(super) outcome: Outcome,
    /// A transfer's hold was still held, and is released.
    pub(super) released: Released,
}

/// Whether the acquire was granted.
#[derive(Debug)]
pub(super) enum Outcome {
    Granted { token: FencingToken, holds: u32 },
    Busy(Busy),
}

impl AcquireReply {
    /// Reads [`GRANTED`] or [`BUSY`], or hot.lua's grant (a transfer's when `transfer`),
    /// which is the token alone: one hold, and a transfer's hold was held.
    pub(super) fn decode(reply: &Value, transfer: bool) -> Result<Self> {
        if let Value::Int(token) = reply {
            return Ok(AcquireReply {
                outcome: Outcome::Granted {
                    token: FencingToken(*token as u64),
                    holds: 1,
                },
                released: released(transfer),
            });
        }
        let tag = match reply {
            Value::Array(items) => items.first().and_then(int),
            _ => None,
        };
        let granted = matches!(GRANTED.form, Form::Tagged(t) if tag == Some(t));
        let fields = Fields::read(if granted { &GRANTED } else { &BUSY }, reply)?;
        let outcome = match granted {
            true => Outcome::Granted {
                token: FencingToken(fields.int("token")? as u64),
                holds: fields.int("holds")? as u32,
            },
            false => Outcome::Busy(busy(&fields)?),
        };
        Ok(AcquireReply {
            outcome,
            released: released(fields.flag("released")?),
        })
    }
}

fn busy(fields: &Fields<'_>) -> Result<Busy> {
    let owner = fields.text("owner")?;
    let holder = match owner.is_empty() {
        true => None,
        false => Some(HolderInfo {
            owner,
            host: fields.text("host")?,
            pid: fields.int("pid")? as u32,
            token: FencingToken(fields.int("token")? as u64),
            since: since(fields.int("acquired")?),
            lease_left: ms(fields.int("lease_left")?),
            holds: fields.int("holds")? as u32,
            kind: kind(&fields.text("kind")?, fields.int("permits")?)
                .ok_or_else(|| fields.not("kind", "a kind"))?,
            value: match fields.get("value") {
                Value::Nil => None,
                _ => Some(fields.text("value")?),
            },
        }),
    };
    let (position, retry_in) = (fields.int("position")?, fields.int("retry_in")?);
    Ok(Busy {
        holder,
        position: (position > 0).then_some(position as usize),
        retry_in: (retry_in >= 0).then(|| ms(retry_in)),
        watermark: Watermark(fields.int("watermark")? as u64),
    })
}

/// A refusal by the lock rules, as [`CONFLICT`] carries it (after its code).
#[derive(Debug, PartialEq)]
pub(super) struct Conflict<'a> {
    pub(super) code: &'a str,
    /// The kind of the holder or waiter the request met.
    pub(super) met: LockKind,
}

impl<'a> Conflict<'a> {
    /// Reads the words after the code; `None` if they are not [`CONFLICT`]'s.
    pub(super) fn decode(words: &'a str) -> Option<Self> {
        let words: Vec<&str> = words.split(' ').collect();
        if words.len() != CONFLICT.fields.len() {
            return None;
        }
        let field = |name: &str| Some(words[CONFLICT.fields.iter().position(|f| *f == name)?]);
        let permits: u32 = field("permits")?.parse().ok()?;
        let met = match field("kind")? {
            "exclusive" => LockKind::Exclusive,
            "shared" => LockKind::Shared,
            "permit" => LockKind::Permit { permits },
            _ => return None,
        };
        Some(Conflict {
            code: field("code")?,
            met,
        })
    }
}

/// What the release script answered: a number, or [`RELEASE`].
#[derive(Debug, PartialEq)]
pub(super) struct ReleaseReply {
    pub(super) released: Released,
    /// Messages for this client's own waiters (as the subscription delivers them).
    pub(super) own: String,
}

impl ReleaseReply {
    pub(super) fn decode(reply: &Value) -> Result<Self> {
        let (yes, own) = match reply {
            Value::Array(_) => {
                let fields = Fields::read(&RELEASE, reply)?;
                (fields.flag("released")?, fields.text("own")?)
            }
            Value::Int(0) => (false, String::new()),
            Value::Int(1) => (true, String::new()),
            _ => return Err(malformed(&RELEASE, reply, "not 1, 0 or a list")),
        };
        Ok(ReleaseReply {
            released: released(yes),
            own,
        })
    }
}

/// What describe.lua answered ([`STATE`]).
#[derive(Debug, PartialEq)]
pub(super) struct StateReply {
    /// The server's time, ms since the epoch.
    pub(super) now: i64,
    /// The lock as JSON (see state.rs).
    pub(super) json: String,
}

impl StateReply {
    pub(super) fn decode(reply: &Value) -> Result<Self> {
        let fields = Fields::read(&STATE, reply)?;
        Ok(StateReply {
            now: fields.int("now")?,
            json: fields.text("state")?,
        })
    }
}

/// What rate.lua answered: a decision per request, in the order asked ([`DECISION`]
/// each), `None` for one whose key does not hold a time.
pub(super) fn decisions(reply: &Value) -> Result<Vec<Option<RateDecision>>> {
    let Value::Array(items) = reply else {
        return Err(malformed(&DECISION, reply, "not a list of decisions"));
    };
    items.iter().map(decision).collect()
}

fn decision(reply: &Value) -> Result<Option<RateDecision>> {
    let fields = Fields::read(&DECISION, reply)?;
    if fields.int("allowed")? == -1 {
        return Ok(None);
    }
    let us = |v: i64| Duration::from_micros(v.max(0) as u64);
    Ok(Some(RateDecision {
        allowed: fields.flag("allowed")?,
        wait: us(fields.int("wait_us")?),
        remaining: fields.int("remaining")?.max(0) as u64,
        reset_after: us(fields.int("reset_after_us")?),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    /// A reply of `shape` as a script sends it: its fields in its order.
    fn sent(shape: &Shape, by_name: &[(&str, Value)]) -> Value {
        let tag = match shape.form {
            Form::Tagged(tag) => Some(Value::Int(tag)),
            _ => None,
        };
        let fields = shape.fields.iter().map(|field| {
            let value = by_name.iter().find(|(name, _)| name == field);
            value.unwrap_or_else(|| panic!("no {field}")).1.clone()
        });
        Value::Array(tag.into_iter().chain(fields).collect())
    }

    /// A busy reply's fields, with `changed` set as given.
    fn busy(changed: &[(&str, Value)]) -> Value {
        let mut fields = vec![
            ("position", Value::Int(3)),
            ("retry_in", Value::Int(1500)),
            ("watermark", Value::Int(0)),
            ("owner", bulk("web")),
            ("host", bulk("web-3")),
            ("pid", bulk("812")),
            ("token", bulk("1732559340123456")),
            ("acquired", bulk("1700000000000")),
            ("lease_left", Value::Int(1500)),
            ("holds", Value::Int(2)),
            ("kind", bulk("permit")),
            ("permits", bulk("3")),
            ("value", Value::Nil),
            ("released", Value::Int(1)),
        ];
        for (name, value) in changed {
            fields.iter_mut().find(|(n, _)| n == name).unwrap().1 = value.clone();
        }
        sent(&BUSY, &fields)
    }

    fn granted(token: Value, released: i64) -> Value {
        let fields = [("token", token), ("holds", Value::Int(2))];
        sent(
            &GRANTED,
            &[&fields[..], &[("released", Value::Int(released))]].concat(),
        )
    }

    #[test]
    fn an_acquire_reply_is_read_by_name() {
        let read = |reply: &Value, transfer| {
            let reply = AcquireReply::decode(reply, transfer).unwrap();
            match reply.outcome {
                Outcome::Granted { token, holds } => (token.0, holds, reply.released),
                Outcome::Busy(busy) => panic!("busy: {busy:?}"),
            }
        };
        // hot.lua's grant is the token alone.
        assert_eq!(read(&Value::Int(41), true), (41, 1, Released::Released));
        assert_eq!(read(&Value::Int(41), false), (41, 1, Released::NotHeld));
        let reply = granted(bulk("7"), 0);
        assert_eq!(read(&reply, true), (7, 2, Released::NotHeld));

        let reply = AcquireReply::decode(&busy(&[]), false).unwrap();
        assert_eq!(reply.released, Released::Released);
        let Outcome::Busy(busy) = reply.outcome else {
            panic!("granted");
        };
        assert_eq!(busy.position, Some(3));
        assert_eq!(busy.retry_in, Some(Duration::from_millis(1500)));
        let holder = busy.holder.unwrap();
        let who = (holder.owner.as_str(), holder.host.as_str(), holder.pid);
        assert_eq!(who, ("web", "web-3", 812));
        assert_eq!(holder.token, FencingToken(1732559340123456));
        assert_eq!(holder.kind, LockKind::Permit { permits: 3 });
        assert_eq!(holder.since, since(1_700_000_000_000));
        assert_eq!((holder.lease_left.as_millis(), holder.holds), (1500, 2));
        assert_eq!(holder.value, None);
        for value in ["10.0.0.7:80", ""] {
            let reply = self::busy(&[("value", bulk(value))]);
            let Outcome::Busy(read) = AcquireReply::decode(&reply, false).unwrap().outcome else {
                panic!("granted");
            };
            assert_eq!(read.holder.unwrap().value.as_deref(), Some(value));
        }
    }

    #[test]
    fn a_busy_reply_without_a_holder_in_the_way_has_none_and_no_retry_time() {
        let empty = [
            ("owner", bulk("")),
            ("kind", bulk("")),
            ("permits", Value::Int(0)),
        ];
        let unqueued = [("position", Value::Int(0)), ("retry_in", Value::Int(-1))];
        let reply = busy(&[&empty[..], &unqueued[..]].concat());
        let Outcome::Busy(busy) = AcquireReply::decode(&reply, false).unwrap().outcome else {
            panic!("granted");
        };
        assert!(busy.holder.is_none());
        assert_eq!((busy.position, busy.retry_in), (None, None));
    }

    #[test]
    fn a_malformed_acquire_reply_is_an_error_not_a_default() {
        let changed = |mut reply: Value, change: fn(&mut Vec<Value>)| {
            if let Value::Array(items) = &mut reply {
                change(items);
            }
            reply
        };
        let replies = [
            changed(busy(&[]), |items| drop(items.pop())),
            busy(&[("pid", bulk("eight"))]),
            busy(&[("kind", bulk("reading"))]),
            busy(&[("released", Value::Int(2))]),
            busy(&[("value", Value::Array(vec![]))]),
            granted(Value::Nil, 0),
            changed(granted(Value::Int(7), 1), |items| items[0] = Value::Int(2)),
            bulk("OK"),
        ];
        for reply in replies {
            match AcquireReply::decode(&reply, false) {
                Err(Error::Internal(message)) => assert!(message.contains("malformed")),
                other => panic!("{reply:?} read as {other:?}"),
            }
        }
    }

    #[test]
    fn a_conflict_is_read_by_name_or_not_at_all() {
        let met = |words| Conflict::decode(words).map(|c| (c.code, c.met));
        let permits = LockKind::Permit { permits: 3 };
        assert_eq!(met("permits permit 3"), Some(("permits", permits)));
        assert_eq!(met("upgrade shared 0"), Some(("upgrade", LockKind::Shared)));
        for words in ["primitive exclusive", "primitive exclusive x", "a b 0", ""] {
            assert_eq!(met(words), None, "{words}");
        }
    }

    #[test]
    fn a_release_reply_is_a_number_or_the_release_shape() {
        let read = |v: &Value| ReleaseReply::decode(v).map(|r| (r.released, r.own));
        let own = sent(
            &RELEASE,
            &[("released", Value::Int(1)), ("own", bulk("L=5:900"))],
        );
        assert_eq!(
            read(&Value::Int(1)).unwrap(),
            (Released::Released, "".into())
        );
        assert_eq!(
            read(&Value::Int(0)).unwrap(),
            (Released::NotHeld, "".into())
        );
        assert_eq!(read(&own).unwrap(), (Released::Released, "L=5:900".into()));
        for bad in [Value::Int(2), Value::Nil, Value::Array(vec![Value::Int(1)])] {
            assert!(read(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_state_and_a_rate_decision_are_read_by_name() {
        let state = sent(
            &STATE,
            &[("now", bulk("1700000000000")), ("state", bulk("{}"))],
        );
        let state = StateReply::decode(&state).unwrap();
        assert_eq!((state.now, state.json.as_str()), (1_700_000_000_000, "{}"));
        let numbers = [
            ("allowed", 1),
            ("wait_us", 0),
            ("remaining", 99),
            ("reset_after_us", 10_000),
        ];
        let numbers = numbers.map(|(name, n)| (name, Value::Int(n)));
        let expected = RateDecision {
            allowed: true,
            wait: Duration::ZERO,
            remaining: 99,
            reset_after: Duration::from_millis(10),
        };
        let one = sent(&DECISION, &numbers);
        let mut corrupt = numbers.clone();
        corrupt[0].1 = Value::Int(-1);
        let both = Value::Array(vec![one, sent(&DECISION, &corrupt)]);
        assert_eq!(decisions(&both).unwrap(), [Some(expected), None]);
        assert!(decisions(&Value::Array(vec![Value::Int(1)])).is_err());
        assert!(decisions(&Value::Int(1)).is_err());
    }
}
