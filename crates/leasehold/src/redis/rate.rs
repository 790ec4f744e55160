//! Rate-limiter decisions, several to a round trip. A line (one per server; on a
//! cluster, one per key) has one call on its way at a time (two while the host's CPUs
//! have idle time, [`cores_idle`]; more only when a full call waits, [`IN_FLIGHT`]);
//! what is asked meanwhile waits and goes, together, in the next:
//! tasks hammering limiters share the round trip, the script's fixed cost and each key's
//! GET and SET (rate.lua decides them in the order asked). Before taking what waits, the
//! sender yields once, so the tasks its last answers woke ask again first and ride along
//! rather than one of them going alone.
//!
//! The calls are sent from spawned tasks, never from the caller's future, so a caller
//! that gives up cannot strand the decisions that rode with it.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::oneshot;

use super::keys::push_rate_key;
use super::request::{self, Rate};
use super::scripts::scripts;
use super::{errors::failed, reply, Conn, RedisStore};
use crate::store::RateRequest;
use crate::{Error, LockName, RateDecision, Result};

/// Calls of one line on their way at once, at most. A call beyond the first goes out
/// only when a full call ([`MOST`]) waits: below that, decisions do better waiting for
/// the next call, as overlapping calls carry too few each to share the server's work and
/// every call costs both ends a round of system calls (`docs/BENCHMARKS.md`, rate
/// limiter).
const IN_FLIGHT: usize = 4;
/// Decisions in one call at most.
const MOST: usize = 128;

/// The waiting decisions, by line: one for a server; on a cluster, one per key (a
/// script's keys must share a slot).
#[derive(Default)]
pub(super) struct RateCalls(Mutex<HashMap<String, Line>>);

#[derive(Default)]
struct Line {
    waiting: Vec<Asked>,
    in_flight: usize,
}

struct Asked {
    name: LockName,
    request: Rate,
    answer: oneshot::Sender<Result<RateDecision>>,
}

impl RedisStore {
    /// One decision, through its line.
    pub(super) async fn rate_decision(&self, req: &RateRequest) -> Result<RateDecision> {
        let line = match self.inner.conn {
            Conn::Single(_) => String::new(),
            Conn::Cluster(..) => req.name.to_string(),
        };
        let (answer, answered) = oneshot::channel();
        let asked = Asked {
            name: req.name.clone(),
            request: Rate {
                key: 0,
                interval_us: req.limit.interval_us(),
                burst: req.limit.burst(),
                units: req.units,
                max_wait_us: req.max_wait_us,
            },
            answer,
        };
        let turn = {
            let mut lines = self.inner.rates.0.lock().unwrap_or_else(|e| e.into_inner());
            let waiting = lines.entry(line.clone()).or_default();
            waiting.waiting.push(asked);
            take_turn(waiting)
        };
        if turn {
            // The turn is the spawned task's from here: a task dropped before it first
            // runs (its runtime ended) still gives the line's place back.
            let turn = Turn {
                store: self.clone(),
                line,
                done: false,
            };
            tokio::spawn(turn.send_line());
        }
        answered.await.unwrap_or_else(|_| {
            Err(Error::Internal(
                "a rate decision was dropped on its way (its runtime ended)".into(),
            ))
        })
    }

    /// One rate.lua call for `batch`, each decision to its asker; the error if the server
    /// did not answer in time.
    async fn send_batch(&self, mut batch: Vec<Asked>) -> Option<Error> {
        // KEYS: each limiter's key once, in the order first asked.
        let mut names: Vec<&LockName> = Vec::new();
        let mut indices = Vec::with_capacity(batch.len());
        for asked in &batch {
            let index = match names.iter().position(|n| **n == asked.name) {
                Some(i) => i,
                None => {
                    names.push(&asked.name);
                    names.len() - 1
                }
            };
            indices.push(index as u64 + 1);
        }
        let keys: Vec<String> = (names.iter())
            .map(|name| {
                let mut key = String::with_capacity(name.as_str().len() + 12);
                push_rate_key(&mut key, name);
                key
            })
            .collect();
        let script = &scripts().rate;
        let command = |resent| {
            let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + 5 * batch.len(), 256);
            cmd.arg("EVALSHA")
                .arg(script.get_hash())
                .arg(keys.len())
                .arg(&keys);
            let mut buf = String::new();
            for (asked, &key) in batch.iter().zip(&indices) {
                let fields = Rate {
                    key,
                    ..asked.request
                }
                .fields();
                request::pack(&fields, &mut cmd, &mut buf, resent);
            }
            cmd
        };
        // A call sent again after a dropped connection whose first send took effect too
        // counts its units twice: the limiter lets fewer through, never more.
        let mut timed_out = false;
        let answers = match self.send(script, command).await {
            Ok(reply) => reply::decisions(&reply).and_then(|d| match d.len() == batch.len() {
                true => Ok(d),
                false => Err(Error::Internal(format!(
                    "rate.lua answered {} decisions for {} asked",
                    d.len(),
                    batch.len()
                ))),
            }),
            Err(e) => {
                timed_out = e.is_timeout();
                Err(failed(&self.inner.shown, e))
            }
        };
        match answers {
            Ok(answers) => {
                for (asked, answer) in batch.drain(..).zip(answers) {
                    let answer = answer.ok_or_else(|| self.corrupt(&asked));
                    let _ = asked.answer.send(answer);
                }
                None
            }
            Err(e) => {
                for asked in batch.drain(..) {
                    let _ = asked.answer.send(Err(copy(&e, &self.inner.shown)));
                }
                timed_out.then_some(e)
            }
        }
    }

    fn corrupt(&self, asked: &Asked) -> Error {
        let mut key = String::new();
        push_rate_key(&mut key, &asked.name);
        Error::Corrupt {
            store: self.inner.shown.clone(),
            name: asked.name.to_string(),
            reason: format!(
                "{key} does not hold a rate limiter's time; delete it to start the limiter afresh (at full burst)"
            ),
        }
    }
}

/// Whether the line has room for another call, which the caller then makes.
fn take_turn(line: &mut Line) -> bool {
    let room = line.in_flight == 0
        || (line.in_flight < IN_FLIGHT && line.waiting.len() >= MOST)
        || (line.in_flight == 1 && cores_idle());
    line.in_flight += room as usize;
    room
}

/// Whether the host's CPUs were idle at least a quarter of the time lately (Linux:
/// `/proc/stat`, looked at no more than every 100 ms; elsewhere, never). With CPU to
/// spare, a second call on a line's way overlaps the server's work with the client's; on
/// busy cores one call at a time costs both ends fewer system calls and does better
/// (`docs/BENCHMARKS.md`, rate limiter). Time of processes at the lowest priority counts
/// as busy.
fn cores_idle() -> bool {
    static LOOK: Mutex<Option<Look>> = Mutex::new(None);
    let mut look = LOOK.lock().unwrap_or_else(|e| e.into_inner());
    let now = std::time::Instant::now();
    let period = std::time::Duration::from_millis(100);
    if let Some(last) = look.as_ref().filter(|last| now < last.at + period) {
        return last.idle;
    }
    let times = (std::fs::read_to_string("/proc/stat").ok()).and_then(|s| cpu_times(&s));
    let idle = match (times, look.as_ref()) {
        (Some((idle, all)), Some(last)) if all > last.times.1 => {
            idle.saturating_sub(last.times.0) * 4 >= all - last.times.1
        }
        _ => false,
    };
    *look = Some(Look {
        at: now,
        times: times.unwrap_or_default(),
        idle,
    });
    idle
}

/// The last look at the CPUs: when, their (idle, all) time so far, and the answer.
struct Look {
    at: std::time::Instant,
    times: (u64, u64),
    idle: bool,
}

/// The CPUs' idle (with waiting for I/O) and total time from `/proc/stat`'s first line:
/// its first eight fields (the two after them, guests' time, are counted in the first two
/// already).
fn cpu_times(stat: &str) -> Option<(u64, u64)> {
    let mut fields = stat.lines().next()?.split_whitespace();
    (fields.next()? == "cpu").then_some(())?;
    let times: Vec<u64> = (fields.take(8))
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let idle = times.get(3)? + times.get(4).unwrap_or(&0);
    Some((idle, times.iter().sum()))
}

/// The same error for each decision of a failed call (errors are not `Clone`).
fn copy(e: &Error, store: &str) -> Error {
    match e {
        Error::Unavailable { .. } => Error::Unavailable {
            store: store.to_string(),
            source: e.to_string().into(),
        },
        Error::Config { reason, .. } => Error::Config {
            store: store.to_string(),
            reason: reason.clone(),
        },
        other => Error::Internal(other.to_string()),
    }
}

/// A place on a line: the task that sends its calls. Dropped before it is done (its
/// runtime ended, even before the task first ran), it gives the place up and fails what
/// waits, if no other call of the line is left to send it.
struct Turn {
    store: RedisStore,
    line: String,
    done: bool,
}

impl Turn {
    /// Sends what waits on the line, a call at a time, until nothing does.
    async fn send_line(mut self) {
        loop {
            // The tasks woken by the last answers (or by anything else) run first and
            // ask again: they go in this call, not the next.
            tokio::task::yield_now().await;
            let batch = {
                let rates = &self.store.inner.rates;
                let mut lines = rates.0.lock().unwrap_or_else(|e| e.into_inner());
                let Some(line) = lines.get_mut(&self.line) else {
                    return;
                };
                // A second call goes on only while the cores stay idle: the other call
                // takes what waits.
                let spare = line.in_flight > 1 && line.waiting.len() < MOST && !cores_idle();
                if line.waiting.is_empty() || spare {
                    line.in_flight -= 1;
                    if line.in_flight == 0 {
                        lines.remove(&self.line);
                    }
                    self.done = true;
                    return;
                }
                let n = line.waiting.len().min(MOST);
                line.waiting.drain(..n).collect()
            };
            if let Some(e) = self.store.send_batch(batch).await {
                // The server did not answer in time: what waited behind the call fails
                // with it rather than wait as long again.
                let rates = &self.store.inner.rates;
                let mut lines = rates.0.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(line) = lines.get_mut(&self.line) {
                    for asked in line.waiting.drain(..) {
                        let _ = asked.answer.send(Err(copy(&e, &self.store.inner.shown)));
                    }
                }
            }
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let rates = &self.store.inner.rates;
        let mut lines = rates.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(line) = lines.get_mut(&self.line) {
            line.in_flight -= 1;
            if line.in_flight == 0 {
                // Their senders dropped: each asker hears its decision was dropped.
                lines.remove(&self.line);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::cpu_times;

    #[test]
    fn cpu_times_are_read_from_the_first_line() {
        // Guests' time (the last two fields) is in the first two already.
        let stat = "cpu  100 5 50 800 40 1 2 0 30 3\ncpu0 50 2 25 400 20 0 1 0 0 0\n";
        assert_eq!(cpu_times(stat), Some((840, 998)));
        assert_eq!(cpu_times("intr 1 2 3\n"), None);
        assert_eq!(cpu_times("cpu  1 x 3 4\n"), None);
        assert_eq!(cpu_times(""), None);
    }
}
