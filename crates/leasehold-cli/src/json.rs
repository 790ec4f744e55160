//! `--json` output of `hold` and `release`: one object per line on stdout, flushed at
//! once, as scripts read them while `hold` runs. Field names are `status --json`'s.

use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use leasehold::{FencingToken, LockGuard, LockState};
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::exit::{self, Failure};

/// `hold --help`'s closing text.
pub const HOLD_AFTER_HELP: &str = "\
With --json, stdout has one JSON line when the lock is held:
  {\"event\":\"held\",\"name\",\"token\",\"owner\",\"pid\",\"lease_left\" (ms),\"lease_until\" (Unix time, ms)}
and one when the hold ends:
  {\"event\":\"released\",\"name\",\"token\"}            on SIGINT, SIGTERM or SIGHUP (exit 0)
  {\"event\":\"lost\",\"name\",\"token\",\"reason\"}       lost while held (exit 76)
Errors are then one JSON object on stderr: {\"exit\",\"kind\",\"message\"} (see leasehold --help).";

/// `release --help`'s closing text.
pub const RELEASE_AFTER_HELP: &str = "\
With --json, stdout has one JSON line: {\"name\",\"was_held\",\"holders\"}, holders as in
status --json (those it freed). Errors are then one JSON object on stderr:
{\"exit\",\"kind\",\"message\"} (see leasehold --help).";

/// The top-level help's note on `--json` errors, with each exit code's `kind`.
pub fn errors_help() -> String {
    let kinds: Vec<String> = (exit::KINDS.iter())
        .map(|(code, kind)| format!("{kind} ({code})"))
        .collect();
    let text = format!(
        "With --json (run, elect, hold, release, status, leader, list, limit, bench, torture), an error is one JSON \
object on stderr, {{\"exit\": 75, \"kind\": \"not_acquired\", \"message\": \"...\"}}, whose kind \
names the exit code: {}; signal (128+N).",
        kinds.join(", ")
    );
    exit::wrap("\n".into(), &text, 0).split_off(1)
}

/// Prints `value` as one line.
fn line(value: &Value) -> Result<(), Failure> {
    exit::print(&format!("{value}\n"))
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// `hold`: the lock is held.
pub fn held(name: &str, guard: &LockGuard) -> Result<(), Failure> {
    let left = guard
        .valid_until()
        .saturating_duration_since(Instant::now());
    line(&json!({
        "event": "held",
        "name": name,
        "token": guard.token().get(),
        "owner": guard.owner(),
        "pid": std::process::id(),
        "lease_left": left.as_millis() as u64,
        "lease_until": unix_ms(SystemTime::now() + left),
    }))
}

/// `hold`: released on a signal; exit 0.
pub fn released(name: &str, token: FencingToken) -> Result<ExitCode, Failure> {
    line(&json!({"event": "released", "name": name, "token": token.get()}))?;
    Ok(ExitCode::SUCCESS)
}

/// `hold`: the lock was lost for `reason`; exit 76 (with `json`, after the `lost` line
/// and as an error object, like every failure).
pub fn lost(
    json: bool,
    name: &str,
    token: FencingToken,
    reason: String,
) -> Result<ExitCode, Failure> {
    if !json {
        eprintln!("leasehold: {reason}");
        return Ok(ExitCode::from(exit::LOST));
    }
    line(&json!({"event": "lost", "name": name, "token": token.get(), "reason": reason}))?;
    Err(Failure::new(exit::LOST, reason))
}

/// `release --force --json`: whether it was held, and by whom.
pub fn release(name: &str, was_held: bool, before: &LockState) -> Result<(), Failure> {
    let holders = match was_held {
        true => serde_json::to_value(&before.holders)
            .map_err(|e| Failure::new(exit::INTERNAL, e.to_string()))?,
        false => json!([]),
    };
    line(&json!({"name": name, "was_held": was_held, "holders": holders}))
}

/// With `--json`, log events on stderr are JSON lines too (`level`, `target`, `message`
/// and the event's fields), so that every line there parses; the error object is the
/// one with `exit`.
pub struct JsonLog;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for JsonLog
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        let mut fields = serde_json::Map::new();
        fields.insert("level".into(), meta.level().as_str().into());
        fields.insert("target".into(), meta.target().into());
        event.record(&mut Fields(&mut fields));
        writeln!(writer, "{}", Value::Object(fields))
    }
}

/// Collects an event's fields as JSON values.
struct Fields<'a>(&'a mut serde_json::Map<String, Value>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        (self.0).insert(field.name().into(), format!("{value:?}").into());
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        (self.0).insert(field.name().into(), value.into());
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        (self.0).insert(field.name().into(), value.into());
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        (self.0).insert(field.name().into(), value.into());
    }

    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        (self.0).insert(field.name().into(), value.into());
    }
}
