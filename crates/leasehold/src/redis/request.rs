//! What the scripts are asked. Each request is one list of named fields, in the order
//! they are sent ([`Acquire::fields`] and the others): the list packs the EVALSHA's
//! arguments here ([`pack`]) and writes the Lua that names them for the scripts (lua.rs),
//! so a field `ttl` is `req_ttl` in Lua, whichever argument carries it.
//!
//! A field is sent as an argument of its own, or packed with its neighbours into one
//! argument (separated by \x1f), as every argument costs the call time. The acquire's
//! packed `hold` is also the value of a hot hold, which hot.lua stores as it came.

use std::time::Instant;

/// The separators of the record's fields (see record.lua): replaced by `?` in any text
/// sent, so no text can forge a field.
const SEPARATORS: [char; 3] = ['\x1d', '\x1e', '\x1f'];

/// Between the fields packed in one argument.
const PACKED: char = '\x1f';

/// A field's value, as it is sent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Value<'a> {
    Text(&'a str),
    Num(u64),
    /// `1` or `0`.
    Flag(bool),
    /// `1` if nothing was sent for this acquisition before (so it is not queued), else
    /// `0`; always `0` when the call is sent again (the first send may have arrived).
    Fresh(bool),
    /// µs from the instant (if any, else 0) to when the call is built: a wait that goes
    /// on while the call is sent again, after a reconnection or a script load.
    Since(Option<Instant>),
    /// Not sent; the script reads `nil`. Only at the end of a request.
    Absent,
}

/// Whether `s` has one of [`SEPARATORS`] (all ASCII): byte by byte, as every text of
/// every call is checked.
fn has_separator(s: &str) -> bool {
    s.bytes().any(|b| matches!(b, 0x1d..=0x1f))
}

/// µs from `since` to now; 0 without it.
fn micros_since(since: Option<Instant>) -> u64 {
    since.map_or(0, |t| t.elapsed().as_micros() as u64)
}

impl Value<'_> {
    /// Appends the value as the script reads it; `resent` when the call is sent again.
    pub(super) fn write(self, out: &mut String, resent: bool) {
        match self {
            Value::Text(s) if !has_separator(s) => out.push_str(s),
            Value::Text(s) => {
                out.extend(
                    s.chars()
                        .map(|c| if SEPARATORS.contains(&c) { '?' } else { c }),
                )
            }
            Value::Num(n) => out.push_str(itoa::Buffer::new().format(n)),
            Value::Since(since) => Value::Num(micros_since(since)).write(out, resent),
            Value::Flag(on) => out.push(if on { '1' } else { '0' }),
            Value::Fresh(fresh) => out.push(if fresh && !resent { '1' } else { '0' }),
            Value::Absent => {}
        }
    }
}

/// One named field of a request.
#[derive(Clone, Copy, Debug)]
pub(super) struct Field<'a> {
    /// The argument that carries it: its own name, or the packed argument's.
    pub(super) arg: &'static str,
    /// Its name, in Lua the local `req_NAME`.
    pub(super) name: &'static str,
    pub(super) value: Value<'a>,
}

impl<'a> Field<'a> {
    /// A field sent as an argument of its own.
    const fn own(name: &'static str, value: Value<'a>) -> Self {
        Field {
            arg: name,
            name,
            value,
        }
    }

    /// A field packed into the argument `arg` with the fields beside it that name `arg` too.
    const fn packed(arg: &'static str, name: &'static str, value: Value<'a>) -> Self {
        Field { arg, name, value }
    }
}

/// An acquire, or a transfer (acquire.lua, transfer.lua; hot.lua serves the commonest).
#[derive(Debug, Default)]
pub(super) struct Acquire<'a> {
    pub(super) lease: &'a str,
    pub(super) owner: &'a str,
    /// The client's wall clock, ms: shown as the time acquired, never compared.
    pub(super) wall: u64,
    pub(super) host: &'a str,
    pub(super) pid: u32,
    /// This client's wake-up channel.
    pub(super) channel: &'a str,
    /// The lease, ms.
    pub(super) ttl: u64,
    /// `exclusive`, `shared` or `permit`.
    pub(super) kind: &'a str,
    pub(super) permits: u32,
    pub(super) fair: bool,
    pub(super) enqueue: bool,
    /// How long a place in the queue lasts unless renewed, ms.
    pub(super) waiter_lease: u64,
    pub(super) fresh: bool,
    /// A transfer's hold, released first; `Some("")` for an acquire that waited in its
    /// process (see acquire.rs).
    pub(super) released: Option<&'a str>,
    /// Sent if `Some`: since when the request has waited in its process (`None`: no
    /// time), sent as µs up to when the call is built, each time it is.
    pub(super) waited: Option<Option<Instant>>,
    /// Kept with the hold granted (an election's); sent only when there is one, after
    /// `released` and `waited` (see acquire.rs).
    pub(super) value: Option<&'a str>,
}

impl<'a> Acquire<'a> {
    /// The fields in the order they are sent.
    pub(super) fn fields(&self) -> [Field<'a>; 16] {
        use Value::*;
        [
            // `hold`: the value of a hot hold, which hot.lua stores as it came.
            Field::packed("hold", "lease", Text(self.lease)),
            Field::packed("hold", "owner", Text(self.owner)),
            Field::packed("hold", "wall", Num(self.wall)),
            Field::packed("hold", "host", Text(self.host)),
            Field::packed("hold", "pid", Num(self.pid.into())),
            Field::packed("hold", "channel", Text(self.channel)),
            Field::own("ttl", Num(self.ttl)),
            // `kind` first: hot.lua tells an exclusive request from the start of `rest`.
            Field::packed("rest", "kind", Text(self.kind)),
            Field::packed("rest", "permits", Num(self.permits.into())),
            Field::packed("rest", "fair", Flag(self.fair)),
            Field::packed("rest", "enqueue", Flag(self.enqueue)),
            Field::packed("rest", "waiter_lease", Num(self.waiter_lease)),
            Field::packed("rest", "fresh", Fresh(self.fresh)),
            Field::own("released", self.released.map_or(Absent, Text)),
            Field::own("waited", self.waited.map_or(Absent, Since)),
            Field::own("value", self.value.map_or(Absent, Text)),
        ]
    }
}

/// A renewal (renew.lua).
#[derive(Debug, Default)]
pub(super) struct Renew<'a> {
    pub(super) lease: &'a str,
    /// The new lease, ms.
    pub(super) ttl: u64,
}

impl<'a> Renew<'a> {
    /// The fields in the order they are sent.
    pub(super) fn fields(&self) -> [Field<'a>; 2] {
        [
            Field::own("lease", Value::Text(self.lease)),
            Field::own("ttl", Value::Num(self.ttl)),
        ]
    }
}

/// A release (release.lua).
#[derive(Debug, Default)]
pub(super) struct Release<'a> {
    pub(super) lease: &'a str,
    /// This client's wake-up channel: its own waiters are told in the reply.
    pub(super) channel: &'a str,
}

impl<'a> Release<'a> {
    /// The fields in the order they are sent.
    pub(super) fn fields(&self) -> [Field<'a>; 2] {
        [
            Field::own("lease", Value::Text(self.lease)),
            Field::own("channel", Value::Text(self.channel)),
        ]
    }
}

/// A new value for the holder of a hold (proclaim.lua).
#[derive(Debug, Default)]
pub(super) struct Proclaim<'a> {
    pub(super) lease: &'a str,
    pub(super) value: &'a str,
}

impl<'a> Proclaim<'a> {
    /// The fields in the order they are sent.
    pub(super) fn fields(&self) -> [Field<'a>; 2] {
        [
            Field::own("lease", Value::Text(self.lease)),
            Field::own("value", Value::Text(self.value)),
        ]
    }
}

/// A watcher noted, refreshed or (`ttl` 0) removed, and a look at the lock (watch.lua).
#[derive(Debug, Default)]
pub(super) struct Watch<'a> {
    /// The watcher, as the messages that wake it name it.
    pub(super) id: &'a str,
    /// This client's wake-up channel.
    pub(super) channel: &'a str,
    /// How long the entry lasts unless refreshed, ms.
    pub(super) ttl: u64,
}

impl<'a> Watch<'a> {
    /// The fields in the order they are sent.
    pub(super) fn fields(&self) -> [Field<'a>; 3] {
        [
            Field::own("id", Value::Text(self.id)),
            Field::own("channel", Value::Text(self.channel)),
            Field::own("ttl", Value::Num(self.ttl)),
        ]
    }
}

/// Whether a hold is still there (held.lua).
#[derive(Debug, Default)]
pub(super) struct Held<'a> {
    pub(super) lease: &'a str,
}

impl<'a> Held<'a> {
    /// The fields in the order they are sent.
    pub(super) fn fields(&self) -> [Field<'a>; 1] {
        [Field::own("lease", Value::Text(self.lease))]
    }
}

/// One rate-limiter decision (rate.lua): whole numbers, in µs where they are times.
#[derive(Debug, Default)]
pub(super) struct Rate {
    /// The limiter's key: its index in the call's KEYS (1-based).
    pub(super) key: u64,
    pub(super) interval_us: u64,
    pub(super) burst: u64,
    pub(super) units: u64,
    pub(super) max_wait_us: u64,
}

impl Rate {
    /// The fields in the order they are sent.
    pub(super) fn fields(&self) -> [Field<'static>; 5] {
        use Value::Num;
        [
            Field::own("key", Num(self.key)),
            Field::own("interval_us", Num(self.interval_us)),
            Field::own("burst", Num(self.burst)),
            Field::own("units", Num(self.units)),
            Field::own("max_wait_us", Num(self.max_wait_us)),
        ]
    }
}

/// The fields, a slice for each argument, in order.
pub(super) fn arguments<'f, 'a>(fields: &'f [Field<'a>]) -> impl Iterator<Item = &'f [Field<'a>]> {
    fields.chunk_by(|a, b| a.arg == b.arg)
}

/// Whether the argument `arg` (as [`arguments`] gives it) carries packed fields.
pub(super) fn is_packed(arg: &[Field<'_>]) -> bool {
    arg[0].arg != arg[0].name
}

/// Appends the request's arguments to `cmd`, up to the first absent one; `resent` when
/// the call is sent again. `buf` is room for the arguments not sent as they are.
pub(super) fn pack(fields: &[Field<'_>], cmd: &mut redis::Cmd, buf: &mut String, resent: bool) {
    let mut at = 0;
    for arg in arguments(fields) {
        at += arg.len();
        match arg {
            [one] if !is_packed(arg) => match one.value {
                Value::Absent => {
                    // Lua names ARGV[i] by where it stands: nothing may follow a gap.
                    debug_assert!(
                        fields[at..].iter().all(|f| f.value == Value::Absent),
                        "a field sent after an absent one: {fields:?}"
                    );
                    break;
                }
                Value::Num(n) => {
                    cmd.arg(n);
                }
                Value::Since(since) => {
                    cmd.arg(micros_since(since));
                }
                Value::Text(s) if !has_separator(s) => {
                    cmd.arg(s);
                }
                value => {
                    buf.clear();
                    value.write(buf, resent);
                    cmd.arg(&*buf);
                }
            },
            packed => {
                buf.clear();
                for (i, field) in packed.iter().enumerate() {
                    if i > 0 {
                        buf.push(PACKED);
                    }
                    field.value.write(buf, resent);
                }
                cmd.arg(&*buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every request's fields, as the scripts are made from them.
    fn every_request() -> Vec<(&'static str, Vec<Field<'static>>)> {
        vec![
            ("acquire", Acquire::default().fields().to_vec()),
            ("renew", Renew::default().fields().to_vec()),
            ("release", Release::default().fields().to_vec()),
            ("held", Held::default().fields().to_vec()),
            ("proclaim", Proclaim::default().fields().to_vec()),
            ("watch", Watch::default().fields().to_vec()),
            ("rate", Rate::default().fields().to_vec()),
        ]
    }

    fn packed_args(cmd: &redis::Cmd) -> Vec<String> {
        cmd.args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => String::from_utf8(bytes.to_vec()).unwrap(),
                _ => unreachable!("no cursor in a script call"),
            })
            .collect()
    }

    fn packed(fields: &[Field<'_>], resent: bool) -> Vec<String> {
        let mut cmd = redis::Cmd::new();
        pack(fields, &mut cmd, &mut String::new(), resent);
        packed_args(&cmd)
    }

    #[test]
    fn each_request_names_every_field_once_as_a_lua_name() {
        const KEYWORDS: [&str; 21] = [
            "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "if", "in",
            "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while",
        ];
        for (request, fields) in every_request() {
            let mut names: Vec<&str> = fields.iter().map(|f| f.name).collect();
            // A packed argument has a local of its own too (`req_hold`), beside its fields.
            names.extend(
                arguments(&fields)
                    .filter(|a| is_packed(a))
                    .map(|a| a[0].arg),
            );
            let mut unique = names.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(unique.len(), names.len(), "{request}: {names:?}");
            for name in names {
                let lua_name = name.starts_with(|c: char| c.is_ascii_lowercase())
                    && name.chars().all(|c| c.is_ascii_lowercase() || c == '_');
                assert!(lua_name && !KEYWORDS.contains(&name), "{request}: {name}");
            }
            // An argument's fields stand together: `arguments` would split it otherwise.
            let args: Vec<&str> = arguments(&fields).map(|a| a[0].arg).collect();
            let mut distinct = args.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), args.len(), "{request}: {args:?}");
        }
    }

    #[test]
    fn hot_lua_finds_the_lease_and_the_kind_first_in_their_arguments() {
        let fields = Acquire::default().fields();
        let first = |arg: &str| arguments(&fields).find(|a| a[0].arg == arg).unwrap()[0].name;
        // hot_of matches `LEASE \31` at the start of a hot hold's value; an exclusive
        // request's `rest` starts with `exclusive\31`.
        assert_eq!((first("hold"), first("rest")), ("lease", "kind"));
    }

    #[test]
    fn an_acquire_is_packed_as_hot_lua_reads_it() {
        let mut acquire = Acquire {
            lease: "L",
            owner: "o\x1dwn\x1eer",
            wall: 17,
            host: "h",
            pid: 42,
            channel: "lh:client:c",
            ttl: 30_000,
            kind: "exclusive",
            permits: 0,
            fair: true,
            enqueue: false,
            waiter_lease: 4_000,
            fresh: true,
            released: None,
            waited: None,
            value: None,
        };
        let hold = "L\x1fo?wn?er\x1f17\x1fh\x1f42\x1flh:client:c";
        let rest = |fresh| format!("exclusive\x1f0\x1f1\x1f0\x1f4000\x1f{fresh}");
        assert_eq!(packed(&acquire.fields(), false), [hold, "30000", &rest(1)]);
        // Sent again, it may have been queued by the first send.
        assert_eq!(packed(&acquire.fields(), true), [hold, "30000", &rest(0)]);
        acquire.released = Some("F\x1f");
        acquire.waited = Some(None);
        assert_eq!(
            packed(&acquire.fields(), false),
            [hold, "30000", &rest(1), "F?", "0"]
        );
        acquire.released = Some("");
        acquire.value = Some("10.0.0.7:80\x1e");
        let sent = packed(&acquire.fields(), false);
        assert_eq!(&sent[3..], ["", "0", "10.0.0.7:80?"]);
        // How long it waited is reckoned as each call is built: a call sent again (after
        // a script load, say) says it waited that much longer.
        let since = Instant::now() - std::time::Duration::from_millis(250);
        acquire.waited = Some(Some(since));
        let waited = |sent: Vec<String>| sent[4].parse::<u128>().unwrap();
        let first = waited(packed(&acquire.fields(), false));
        let upto = since.elapsed().as_micros();
        assert!((250_000..=upto).contains(&first), "{first}");
        let again = waited(packed(&acquire.fields(), true));
        assert!(again >= upto, "{again} < {upto}");
    }

    #[test]
    fn fields_without_separators_are_sent_as_they_are() {
        let renew = Renew { lease: "L", ttl: 5 };
        assert_eq!(packed(&renew.fields(), false), ["L", "5"]);
        let release = Release {
            lease: "a\x1fb",
            channel: "c",
        };
        assert_eq!(packed(&release.fields(), true), ["a?b", "c"]);
    }
}
