//! Rate-limiter decisions, several to a round trip. A line (one per server; on a
//! cluster, one per key) has one or two calls on its way at a time, whichever has lately
//! answered more decisions per second ([`Pace`]; more only when a full call waits,
//! [`IN_FLIGHT`]); what is asked meanwhile waits and goes, together, in the next:
//! tasks hammering limiters share the round trip, the script's fixed cost and each key's
//! GET and SET (rate.lua decides them in the order asked). Before taking what waits, the
//! sender yields once, so the tasks its last answers woke ask again first and ride along
//! rather than one of them going alone.
//!
//! The calls are sent from spawned tasks, never from the caller's future, so a caller
//! that gives up cannot strand the decisions that rode with it.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::keys::push_rate_key;
use super::request::{self, Rate};
use super::scripts::scripts;
use super::{errors::failed, reply, Conn, RedisStore};
use crate::store::RateRequest;
use crate::{Error, LockName, RateDecision, Result};

/// Calls of one line on their way at once, at most. A call beyond the pace's (one or
/// two, [`Pace`]) goes out only when a full call ([`MOST`]) waits: below that, decisions
/// do better waiting for the next call, as overlapping calls carry too few each to share
/// the server's work and every call costs both ends a round of system calls
/// (`docs/BENCHMARKS.md`, rate limiter).
const IN_FLIGHT: usize = 4;
/// Decisions in one call at most.
const MOST: usize = 128;

/// The waiting decisions, by line (one for a server; on a cluster, one per key: a
/// script's keys must share a slot), and the pace of their calls.
#[derive(Default)]
pub(super) struct RateCalls(Mutex<Lines>);

#[derive(Default)]
struct Lines {
    by_line: HashMap<String, Line>,
    pace: Pace,
}

impl RateCalls {
    fn lock(&self) -> MutexGuard<'_, Lines> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

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
            let mut lines = self.inner.rates.lock();
            let Lines { by_line, pace } = &mut *lines;
            let waiting = by_line.entry(line.clone()).or_default();
            waiting.waiting.push(asked);
            take_turn(waiting, pace)
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
fn take_turn(line: &mut Line, pace: &mut Pace) -> bool {
    let room = line.in_flight == 0
        || (line.in_flight < IN_FLIGHT && line.waiting.len() >= MOST)
        || (line.in_flight == 1 && pace.two);
    if room {
        line.in_flight += 1;
        pace.call_started(Instant::now());
    }
    room
}

/// An epoch: how long the calls are measured for before the pace is weighed again.
const EPOCH: Duration = Duration::from_millis(20);
/// Epochs in the chosen pace from one try of the other to the next: at first, and after
/// a try the other won or a change of pace; each try it loses doubles them, up to
/// [`PROBE_MOST`], so a pace that keeps winning costs few tries of the worse.
const PROBE_EVERY: u32 = 8;
const PROBE_MOST: u32 = 64;
/// Tries in a row the other pace must win to be taken.
const WINS: u32 = 2;

/// Whether lines keep two calls on their way while decisions wait, or one, chosen from
/// what the calls themselves did: the decisions answered per second over epochs of
/// [`EPOCH`] in each. Neither wins everywhere (`docs/BENCHMARKS.md`, rate limiter): two
/// overlap the server's work with the client's, one costs both ends fewer system calls
/// per decision, and which is worth more depends on what else keeps the cores busy.
///
/// Every [`PROBE_EVERY`] epochs or more the other pace is tried for one, and wins the try
/// if it did better than the mean of the two epochs before it and the two after (which
/// cancels a steady drift of the load); it is taken when it wins [`WINS`] tries in a row,
/// as a single epoch on loaded cores can be off by half. An epoch with no call on its way for
/// more than a tenth of it counts for neither: demand, not the pace, set its rate. A
/// lone caller's decision goes at once whatever the pace.
struct Pace {
    two: bool,
    /// Calls on their way, on every line.
    calls: usize,
    /// The epoch's start, the decisions answered in it and its time with no call on its
    /// way (so far, and since when, while there is none).
    epoch: Instant,
    answered: usize,
    idle: Duration,
    idle_since: Option<Instant>,
    /// The last counted epoch's decisions per second.
    last: f64,
    step: Step,
    /// Tries the other pace has won in a row.
    wins: u32,
    /// Epochs from one try to the next, now.
    every: u32,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    /// Epochs counted in the chosen pace since the last try.
    Keep(u32),
    /// Trying the other pace; the chosen one's mean over the two epochs before.
    Probe { before: f64 },
    /// Back in the chosen pace: the try's rate, and what the epochs around it sum to.
    Back { probe: f64, around: f64, after: u32 },
}

impl Default for Pace {
    fn default() -> Self {
        Pace::new(Instant::now())
    }
}

impl Pace {
    fn new(now: Instant) -> Self {
        Pace {
            two: false,
            calls: 0,
            epoch: now,
            answered: 0,
            idle: Duration::ZERO,
            idle_since: Some(now),
            last: 0.0,
            step: Step::Keep(0),
            wins: 0,
            every: PROBE_EVERY,
        }
    }

    fn call_started(&mut self, now: Instant) {
        if let Some(since) = self.idle_since.take() {
            self.idle += now.saturating_duration_since(since);
        }
        self.calls += 1;
    }

    fn call_ended(&mut self, now: Instant) {
        self.calls -= 1;
        if self.calls == 0 {
            self.idle_since = Some(now);
        }
    }

    /// `n` decisions answered; at an epoch's end, weighs the pace.
    fn answered(&mut self, n: usize, now: Instant) {
        self.answered += n;
        let span = now.saturating_duration_since(self.epoch);
        if span < EPOCH {
            return;
        }
        let idle = self.idle + self.idle_since.map_or(Duration::ZERO, |s| now - s);
        if idle * 10 <= span {
            self.measured(self.answered as f64 / span.as_secs_f64());
        }
        self.epoch = now;
        self.answered = 0;
        self.idle = Duration::ZERO;
        self.idle_since = self.idle_since.map(|_| now);
    }

    fn measured(&mut self, rate: f64) {
        let last = std::mem::replace(&mut self.last, rate);
        self.step = match self.step {
            Step::Keep(n) if n + 1 < self.every => Step::Keep(n + 1),
            Step::Keep(_) => {
                self.two = !self.two;
                Step::Probe {
                    before: (last + rate) / 2.0,
                }
            }
            Step::Probe { before } => {
                self.two = !self.two;
                Step::Back {
                    probe: rate,
                    around: before,
                    after: 0,
                }
            }
            Step::Back {
                probe,
                around,
                after: 0,
            } => Step::Back {
                probe,
                around: around + rate / 2.0,
                after: 1,
            },
            Step::Back { probe, around, .. } => {
                let around = (around + rate / 2.0) / 2.0;
                if probe > around {
                    self.wins += 1;
                    self.every = PROBE_EVERY;
                } else {
                    self.wins = 0;
                    self.every = (self.every * 2).min(PROBE_MOST);
                }
                if self.wins >= WINS {
                    self.two = !self.two;
                    self.wins = 0;
                }
                Step::Keep(2)
            }
        };
    }
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
        let mut answered = 0;
        loop {
            // The tasks woken by the last answers (or by anything else) run first and
            // ask again: they go in this call, not the next.
            tokio::task::yield_now().await;
            let batch = {
                let mut lines = self.store.inner.rates.lock();
                let Lines { by_line, pace } = &mut *lines;
                let now = Instant::now();
                pace.answered(answered, now);
                let Some(line) = by_line.get_mut(&self.line) else {
                    return;
                };
                // A second call goes on only while the pace is two: else the other call
                // takes what waits.
                let spare = line.in_flight > 1 && line.waiting.len() < MOST && !pace.two;
                if line.waiting.is_empty() || spare {
                    line.in_flight -= 1;
                    if line.in_flight == 0 {
                        by_line.remove(&self.line);
                    }
                    pace.call_ended(now);
                    self.done = true;
                    return;
                }
                let n = line.waiting.len().min(MOST);
                line.waiting.drain(..n).collect::<Vec<_>>()
            };
            answered = batch.len();
            if let Some(e) = self.store.send_batch(batch).await {
                // The server did not answer in time: what waited behind the call fails
                // with it rather than wait as long again.
                let mut lines = self.store.inner.rates.lock();
                if let Some(line) = lines.by_line.get_mut(&self.line) {
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
        let mut lines = self.store.inner.rates.lock();
        let Lines { by_line, pace } = &mut *lines;
        if let Some(line) = by_line.get_mut(&self.line) {
            line.in_flight -= 1;
            pace.call_ended(Instant::now());
            if line.in_flight == 0 {
                // Their senders dropped: each asker hears its decision was dropped.
                by_line.remove(&self.line);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Busy epochs, each answering what `rate(two, epoch)` says per second.
    fn run_epochs(
        pace: &mut Pace,
        now: &mut Instant,
        epochs: u32,
        rate: impl Fn(bool, u32) -> f64,
    ) {
        for epoch in 0..epochs {
            let per_epoch = rate(pace.two, epoch) * EPOCH.as_secs_f64();
            // In ten answers, so the epoch ends at the last.
            for _ in 0..10 {
                *now += EPOCH / 10;
                pace.answered((per_epoch / 10.0) as usize, *now);
            }
        }
    }

    /// Epochs from one try to the next.
    const CYCLE: u32 = PROBE_EVERY + 1;

    fn busy_pace(now: Instant) -> Pace {
        let mut pace = Pace::new(now);
        pace.call_started(now);
        pace
    }

    #[test]
    fn the_pace_takes_whichever_answers_more_and_keeps_trying_the_other() {
        let mut now = Instant::now();
        let mut pace = busy_pace(now);
        let two_wins = |two: bool, _| if two { 80_000.0 } else { 60_000.0 };
        run_epochs(&mut pace, &mut now, (WINS + 1) * CYCLE, two_wins);
        assert!(pace.two);
        // Kept: each try of one call does worse.
        for _ in 0..3 {
            run_epochs(&mut pace, &mut now, CYCLE, two_wins);
            assert!(pace.two);
        }
        // The host changes: one call now does better, and the tries find it.
        let one_wins = |two: bool, _| if two { 50_000.0 } else { 70_000.0 };
        run_epochs(
            &mut pace,
            &mut now,
            PROBE_MOST + (WINS + 1) * CYCLE,
            one_wins,
        );
        assert!(!pace.two);
        run_epochs(&mut pace, &mut now, 3 * CYCLE, one_wins);
        assert!(!pace.two);
    }

    #[test]
    fn one_lucky_try_does_not_change_the_pace() {
        let mut now = Instant::now();
        let mut pace = busy_pace(now);
        // Two does better in the first try only (an epoch on loaded cores can be off by
        // half), worse in every other.
        let tries = std::cell::Cell::new(0);
        let lucky = |two: bool, _| match two {
            true => {
                tries.set(tries.get() + 1);
                if tries.get() == 1 {
                    90_000.0
                } else {
                    40_000.0
                }
            }
            false => 60_000.0,
        };
        for _ in 0..5 {
            run_epochs(&mut pace, &mut now, CYCLE, lucky);
            assert!(!pace.two);
        }
        assert!(tries.get() >= 3, "tried two {} times", tries.get());
    }

    #[test]
    fn a_pace_that_keeps_winning_tries_the_other_less_and_less_often() {
        let mut now = Instant::now();
        let mut pace = busy_pace(now);
        let tries = std::cell::Cell::new(0);
        let one_wins = |two: bool, _| {
            tries.set(tries.get() + two as u32);
            if two {
                50_000.0
            } else {
                70_000.0
            }
        };
        // Tries after 8, 16, 32 epochs, then every 64.
        run_epochs(&mut pace, &mut now, 400, one_wins);
        assert!(!pace.two);
        assert!((8..=10).contains(&tries.get()), "{} tries", tries.get());
        assert_eq!(pace.every, PROBE_MOST);
    }

    #[test]
    fn a_try_is_weighed_against_the_epochs_around_it() {
        let mut now = Instant::now();
        let mut pace = busy_pace(now);
        // The load eases throughout, 2% an epoch: each try of two beats the epochs
        // before it only because it came later, and loses to those around it.
        let easing = |two: bool, epoch: u32| {
            let rate = 50_000.0 * 1.02f64.powi(epoch as i32);
            if two {
                rate * 0.99
            } else {
                rate
            }
        };
        run_epochs(&mut pace, &mut now, 6 * CYCLE, easing);
        assert!(!pace.two);
        assert_eq!(pace.wins, 0);
    }

    #[test]
    fn epochs_of_a_line_mostly_idle_count_for_neither_pace() {
        // A lone caller now and then: a call of 100 µs every 5 ms.
        let mut now = Instant::now();
        let mut pace = Pace::new(now);
        for _ in 0..1000 {
            pace.call_started(now);
            now += Duration::from_micros(100);
            pace.answered(1, now);
            pace.call_ended(now);
            now += Duration::from_millis(5);
        }
        assert!(!pace.two);
        assert_eq!(pace.step, Step::Keep(0));
    }
}
