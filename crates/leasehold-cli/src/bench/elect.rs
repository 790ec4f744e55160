//! `leasehold bench --workload E1`: an election's hand-overs.
//!
//! `--workers` candidates (4 unless given), each with a client of its own as separate
//! processes would have, campaign for one election; one more client observes it. The
//! leader steps down `--rounds` times by resigning, then `--deaths` times by dying: it
//! stops renewing ([`Leadership::leak`]), so only its lease's end (`--ttl`, 1 s unless
//! given) frees the election. After stepping down it campaigns again, at the back of the
//! queue. Each round starts once every other candidate waits in the store's queue.
//!
//! Measured on one monotonic clock, per case: the *hand-over*, from the step down (just
//! before `resign` is called, or `leak`) to the next candidate's `campaign` returning;
//! the *observed* time, from the step down to the observer's [`Observer::next`]
//! returning the new leader; and for deaths the hand-over *past the lease's end*, from
//! the earliest end the store's readings of the leaked lease allow (see [`lease_end`]) to
//! the next campaign returning. A new leader before the step down, or before that end,
//! counts as an overlap and fails the run.
//!
//! [`Observer::next`]: leasehold::Observer::next

use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::{Election, Leasehold, Released, Store, StoreUrl};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::locks::nanos;
use super::report::pct_us;
use super::{seconds, ttl, usage, BenchArgs, ERROR_PAUSE};
use crate::exit::{Failure, INTERNAL};

const SCHEMA: &str = "leasehold.elect.v1";
/// Candidates unless `--workers` says.
const CANDIDATES: usize = 4;
/// Most candidates accepted: each is a client with its own connections.
const MAX_CANDIDATES: usize = 100;
/// Lease unless `--ttl` says: short, as a death's hand-over waits for it.
const TTL: Duration = Duration::from_secs(1);
/// Wait budget unless `--wait` says: how long past what a round must take (the lease
/// left, for a death) a hand-over, an observation or the queue may take.
const WAIT: Duration = Duration::from_secs(5);
/// Resignations first, not counted: each candidate leads once (connections, files).
const WARM_UP: usize = 1;
/// Between two looks at the queue while it fills, or at a dead leader's lease left.
const QUEUE_LOOK: Duration = Duration::from_millis(2);
/// Longest a death's lease is read for its whole seconds to tick down.
const TICK_PATIENCE: Duration = Duration::from_millis(1100);
/// How long each client may take to undo what it started, at the end.
const SHUTDOWN_PATIENCE: Duration = Duration::from_secs(10);

/// Whether `--workload` names the election workload.
pub(super) fn is_elect_workload(text: &str) -> bool {
    text.trim().eq_ignore_ascii_case("E1")
}

/// How the leader steps down: what the coordinator orders it to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Case {
    Resign,
    Death,
}

/// What a candidate tells the coordinator.
#[derive(Debug)]
enum Event {
    /// Its campaign returned.
    Elected {
        candidate: usize,
        term: u64,
        at: Instant,
    },
    /// It stepped down at `at`; after a death, the leaked lease's end as the store gave it.
    SteppedDown {
        at: Instant,
        lease_end: Option<Instant>,
    },
    Error(String),
}

/// One hand-over.
#[derive(Debug, Clone, Copy)]
struct Round {
    handover: Duration,
    /// The new leader's campaign returned after the lease's end by this much (deaths).
    past_lease: Option<Duration>,
    observed: Option<Duration>,
    /// It returned before the old leader stepped down, or before the lease's end.
    overlap: bool,
}

/// Nearest-rank percentiles of one figure, in µs as lockbench.v1's.
#[derive(Debug, Default, PartialEq, Serialize)]
struct Spread {
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    max_us: Option<f64>,
}

impl Spread {
    fn of(mut ns: Vec<u64>) -> Spread {
        ns.sort_unstable();
        Spread {
            p50_us: pct_us(&ns, 50.0),
            p99_us: pct_us(&ns, 99.0),
            max_us: pct_us(&ns, 100.0),
        }
    }
}

/// The figures of one case.
#[derive(Debug, Default, Serialize)]
struct Figures {
    rounds: usize,
    handovers: usize,
    handover: Spread,
    past_lease: Spread,
    /// Hand-overs whose new leader the observer reported within the wait budget.
    observed: usize,
    observed_after: Spread,
    /// Hand-overs where the new leader started before the old one stepped down, or
    /// (deaths) before the lease's end: two leaders at once.
    overlaps: usize,
    /// A round that did not finish within its budget: the run stops there.
    timeouts: usize,
}

#[derive(Debug, Serialize)]
struct Report {
    schema: &'static str,
    workload: &'static str,
    backend: &'static str,
    candidates: usize,
    ttl_s: f64,
    wait_s: f64,
    resign: Figures,
    death: Figures,
    errors: u64,
    first_error: Option<String>,
    notes: String,
}

fn figures(rounds: usize, measured: &[Round], timeouts: usize) -> Figures {
    let ns = |f: fn(&Round) -> Option<Duration>| -> Vec<u64> {
        measured.iter().filter_map(f).map(nanos).collect()
    };
    let observed = ns(|r| r.observed);
    Figures {
        rounds,
        handovers: measured.len(),
        handover: Spread::of(ns(|r| Some(r.handover))),
        past_lease: Spread::of(ns(|r| r.past_lease)),
        observed: observed.len(),
        observed_after: Spread::of(observed),
        overlaps: measured.iter().filter(|r| r.overlap).count(),
        timeouts,
    }
}

/// A candidate: campaigns, reports each win, steps down as ordered, campaigns again;
/// until the coordinator is gone.
async fn candidate(
    index: usize,
    election: Election,
    mut orders: mpsc::Receiver<Case>,
    events: mpsc::UnboundedSender<Event>,
) {
    let value = format!("candidate-{index}");
    loop {
        let leadership = match election.campaign(value.as_str()).await {
            Ok(leadership) => leadership,
            Err(e) => {
                let _ = events.send(Event::Error(format!("campaign: {e}")));
                tokio::time::sleep(ERROR_PAUSE).await;
                continue;
            }
        };
        let at = Instant::now();
        let term = leadership.term().0;
        let elected = Event::Elected {
            candidate: index,
            term,
            at,
        };
        if events.send(elected).is_err() {
            return;
        }
        let Some(order) = orders.recv().await else {
            let _ = leadership.resign().await;
            return;
        };
        let at = Instant::now();
        match order {
            Case::Resign => {
                let _ = events.send(Event::SteppedDown {
                    at,
                    lease_end: None,
                });
                let error = match leadership.resign().await {
                    Ok(Released::Released) => None,
                    Ok(Released::NotHeld) => {
                        Some("resign: the leadership had already ended".into())
                    }
                    Err(e) => Some(format!("resign: {e}")),
                };
                if let Some(error) = error {
                    let _ = events.send(Event::Error(error));
                }
            }
            Case::Death => {
                let _ = leadership.leak();
                // Read after the leak, so that no renewal can move the end afterwards.
                let lease_end = lease_end(&election, term).await;
                let lease_end = lease_end.unwrap_or_else(|e| {
                    let _ = events.send(Event::Error(e));
                    None
                });
                let _ = events.send(Event::SteppedDown { at, lease_end });
            }
        }
    }
}

/// The earliest end of the leaked lease of `term`: each reading of the lease left, from
/// the instant it was asked, bounds the end from below, and the latest bound is kept. A
/// store that gives whole seconds (etcd) is read again until its reading ticks down,
/// which puts the bound within a look of the end.
async fn lease_end(election: &Election, term: u64) -> Result<Option<Instant>, String> {
    let give_up = Instant::now() + TICK_PATIENCE;
    let (mut end, mut first) = (None::<Instant>, None);
    loop {
        let asked = Instant::now();
        let left = match election.leader().await {
            Ok(Some(leader)) if leader.term.0 == term => leader.lease_left,
            Ok(_) if end.is_some() => return Ok(end),
            Ok(_) => return Err("the leaked leadership was gone before its lease was read".into()),
            Err(e) => return Err(format!("leader: {e}")),
        };
        end = end.max(Some(asked + left));
        let first = *first.get_or_insert(left);
        if left.subsec_nanos() != 0 || left < first || Instant::now() >= give_up {
            return Ok(end);
        }
        tokio::time::sleep(QUEUE_LOOK).await;
    }
}

/// The observer: reports (when, term) of each leader `next` returns.
async fn observer(election: Election, seen: mpsc::UnboundedSender<(Instant, u64)>) {
    let mut observer = election.observe();
    loop {
        match observer.next().await {
            Ok(leader) => {
                let term = leader.map_or(0, |l| l.term.0);
                if seen.send((Instant::now(), term)).is_err() {
                    return;
                }
            }
            Err(_) => tokio::time::sleep(ERROR_PAUSE).await,
        }
    }
}

/// Why a round did not finish.
#[derive(Debug)]
struct Stuck(String);

/// The coordinator's side of a run.
struct Run {
    watcher: Leasehold,
    name: String,
    candidates: usize,
    wait: Duration,
    orders: Vec<mpsc::Sender<Case>>,
    events: mpsc::UnboundedReceiver<Event>,
    seen: mpsc::UnboundedReceiver<(Instant, u64)>,
    /// The leader: its candidate and term.
    leader: (usize, u64),
    errors: u64,
    first_error: Option<String>,
}

impl Run {
    fn error(&mut self, what: String) {
        self.errors += 1;
        self.first_error.get_or_insert(what);
    }

    /// The next event other than an error, by `deadline`.
    async fn event(&mut self, deadline: Instant) -> Option<Event> {
        loop {
            match tokio::time::timeout_at(deadline.into(), self.events.recv()).await {
                Ok(Some(Event::Error(e))) => self.error(e),
                Ok(Some(event)) => return Some(event),
                Ok(None) | Err(_) => return None,
            }
        }
    }

    /// The first leader, by the wait budget.
    async fn first_leader(&mut self) -> Result<(), Stuck> {
        match self.event(Instant::now() + self.wait).await {
            Some(Event::Elected {
                candidate, term, ..
            }) => {
                self.leader = (candidate, term);
                Ok(())
            }
            other => Err(Stuck(format!("no candidate was elected first ({other:?})"))),
        }
    }

    /// Until every candidate but the leader waits in the store's queue.
    async fn queue_filled(&mut self) -> Result<(), Stuck> {
        let deadline = Instant::now() + self.wait;
        loop {
            match self.watcher.describe(self.name.as_str()).await {
                Ok(state) if state.waiters.len() + 1 >= self.candidates => return Ok(()),
                Ok(_) => {}
                Err(e) => self.error(format!("describe: {e}")),
            }
            if Instant::now() >= deadline {
                return Err(Stuck("the candidates did not all queue".into()));
            }
            tokio::time::sleep(QUEUE_LOOK).await;
        }
    }

    /// One hand-over: the leader steps down as `case` says.
    async fn round(&mut self, case: Case) -> Result<Round, Stuck> {
        self.queue_filled().await?;
        let (leader, old_term) = self.leader;
        if self.orders[leader].send(case).await.is_err() {
            return Err(Stuck(format!("candidate {leader} is gone")));
        }
        let (stepped, lease_end) = match self.event(Instant::now() + self.wait).await {
            Some(Event::SteppedDown { at, lease_end }) => (at, lease_end),
            other => return Err(Stuck(format!("the leader did not step down ({other:?})"))),
        };
        let lease_left =
            lease_end.map_or(Duration::ZERO, |end| end.saturating_duration_since(stepped));
        let (candidate, term, elected) = match self.event(stepped + lease_left + self.wait).await {
            Some(Event::Elected {
                candidate,
                term,
                at,
            }) => (candidate, term, at),
            other => return Err(Stuck(format!("no next leader ({other:?})"))),
        };
        if term <= old_term {
            self.error(format!("the term went from {old_term} to {term}, not up"));
        }
        self.leader = (candidate, term);
        Ok(Round {
            handover: elected.saturating_duration_since(stepped),
            past_lease: lease_end.map(|end| elected.saturating_duration_since(end)),
            observed: self.observed(term, stepped, elected).await,
            overlap: elected < stepped || lease_end.is_some_and(|end| elected < end),
        })
    }

    /// When the observer reported `term` (or a later one), by the wait budget past
    /// `elected`, as the time since `stepped`.
    async fn observed(
        &mut self,
        term: u64,
        stepped: Instant,
        elected: Instant,
    ) -> Option<Duration> {
        let deadline = elected + self.wait;
        loop {
            match tokio::time::timeout_at(deadline.into(), self.seen.recv()).await {
                Ok(Some((at, seen))) if seen >= term => {
                    return Some(at.saturating_duration_since(stepped))
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return None,
            }
        }
    }

    /// `rounds` hand-overs of `case`, into `measured`; until one gets stuck.
    async fn rounds(
        &mut self,
        case: Case,
        rounds: usize,
        measured: &mut Vec<Round>,
    ) -> Result<(), Stuck> {
        for _ in 0..rounds {
            measured.push(self.round(case).await?);
        }
        Ok(())
    }
}

/// A client of its own for each candidate and for the observer; on the memory store,
/// which lives in this process, clients of one store.
async fn clients(url: &StoreUrl, count: usize) -> Result<Vec<Leasehold>, Failure> {
    let mut clients = Vec::with_capacity(count);
    let shared: Option<Arc<dyn Store>> = match url.scheme().backend() {
        "memory" => Some(url.open().await?),
        _ => None,
    };
    for _ in 0..count {
        let store = match &shared {
            Some(store) => store.clone(),
            None => url.open().await?,
        };
        clients.push(Leasehold::from_store(store));
    }
    Ok(clients)
}

/// Runs the workload.
pub(super) async fn bench(url: &StoreUrl, args: &BenchArgs) -> Result<ExitCode, Failure> {
    let candidates = match args.workers {
        None => CANDIDATES,
        Some(k) if (2..=MAX_CANDIDATES).contains(&k) => k,
        Some(k) => {
            return Err(usage(format!(
                "--workers {k}: E1 needs 2 to {MAX_CANDIDATES} candidates"
            )))
        }
    };
    let ttl = ttl(args, TTL)?;
    let wait = args.wait.unwrap_or(WAIT);
    seconds("wait", wait)?;
    if wait.is_zero() {
        return Err(usage("--wait must be more than 0s"));
    }
    let name = format!("{}:E1:{candidates}:{}", args.key_prefix, std::process::id());
    let mut clients = clients(url, candidates + 1).await?;
    let store_name = clients[0].store().describe_store();
    let watcher = clients.pop().expect("one client more than the candidates");
    let election = |client: &Leasehold| -> Result<Election, Failure> {
        Ok(client.election(name.as_str())?.with_ttl(ttl))
    };

    let (events_tx, events) = mpsc::unbounded_channel();
    let (seen_tx, seen) = mpsc::unbounded_channel();
    let mut tasks: Vec<JoinHandle<()>> = Vec::new();
    tasks.push(tokio::spawn(observer(election(&watcher)?, seen_tx)));
    let mut orders = Vec::with_capacity(candidates);
    for (index, client) in clients.iter().enumerate() {
        let (tx, rx) = mpsc::channel(1);
        orders.push(tx);
        let task = candidate(index, election(client)?, rx, events_tx.clone());
        tasks.push(tokio::spawn(task));
    }
    drop(events_tx);
    let mut run = Run {
        watcher,
        name: name.clone(),
        candidates,
        wait,
        orders,
        events,
        seen,
        leader: (0, 0),
        errors: 0,
        first_error: None,
    };

    let (mut warm_up, mut resigns, mut deaths) = (Vec::new(), Vec::new(), Vec::new());
    let mut stuck = (run.first_leader().await.err()).map(|s| (Case::Resign, s));
    for (case, rounds, measured) in [
        (Case::Resign, WARM_UP * candidates, &mut warm_up),
        (Case::Resign, args.rounds, &mut resigns),
        (Case::Death, args.deaths, &mut deaths),
    ] {
        if stuck.is_some() {
            break;
        }
        if let Err(s) = run.rounds(case, rounds, measured).await {
            stuck = Some((case, s));
        }
    }
    let timeouts = |case| usize::from(stuck.as_ref().is_some_and(|(c, _)| *c == case));

    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        let _ = task.await;
    }
    for client in clients.iter().chain([&run.watcher]) {
        let _ = client.shutdown(SHUTDOWN_PATIENCE).await;
    }

    let report = Report {
        schema: SCHEMA,
        workload: "E1",
        backend: url.scheme().backend(),
        candidates,
        ttl_s: ttl.as_secs_f64(),
        wait_s: wait.as_secs_f64(),
        resign: figures(args.rounds, &resigns, timeouts(Case::Resign)),
        death: figures(args.deaths, &deaths, timeouts(Case::Death)),
        errors: run.errors,
        first_error: run.first_error.clone(),
        notes: format!(
            "leasehold CLI, {} store; {candidates} candidates, a client each, and an observer on one more; fair (elections always are)",
            url.scheme().backend()
        ),
    };
    super::show_report(args.json, &report, || table(&report, &store_name))?;
    if let Some((_, Stuck(why))) = stuck {
        return Err(Failure::new(
            INTERNAL,
            format!(
                "a hand-over did not finish within --wait {}: {why}",
                leasehold::humanize(wait)
            ),
        ));
    }
    let overlaps = report.resign.overlaps + report.death.overlaps;
    if overlaps > 0 {
        return Err(Failure::new(
            INTERNAL,
            format!("{overlaps} hand-over(s) made a leader before the last one stepped down or its lease ended"),
        ));
    }
    Ok(ExitCode::SUCCESS)
}

fn ms(us: Option<f64>) -> String {
    us.map_or_else(|| "–".into(), |us| format!("{:.3}", us / 1000.0))
}

/// The human-readable form of a report.
fn table(r: &Report, store: &str) -> String {
    let (resign, death) = (&r.resign, &r.death);
    let rows = [
        ("resign: next leads", &resign.handover, resign.handovers),
        ("resign: observed", &resign.observed_after, resign.observed),
        ("death: next leads", &death.handover, death.handovers),
        ("  past the lease's end", &death.past_lease, death.handovers),
        ("death: observed", &death.observed_after, death.observed),
    ];
    let mut out = format!(
        "workload       E1 ({} candidates, a client each; ttl {} s)\n\
         store          {store}\n\
         {:<24} {:>9} {:>9} {:>9} {:>6}\n",
        r.candidates, r.ttl_s, "ms after stepping down", "p50", "p99", "max", "n"
    );
    for (label, s, n) in rows {
        let (p50, p99, max) = (ms(s.p50_us), ms(s.p99_us), ms(s.max_us));
        let _ = writeln!(out, "{label:<24} {p50:>9} {p99:>9} {max:>9} {n:>6}");
    }
    let _ = write!(
        out,
        "overlaps       {} resign, {} death\n\
         timeouts       {} resign, {} death\n\
         errors         {}{}\n",
        resign.overlaps,
        death.overlaps,
        resign.timeouts,
        death.timeouts,
        r.errors,
        r.first_error
            .as_ref()
            .map_or_else(String::new, |e| format!(" (first: {e})")),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(handover_ms: u64, past_lease_ms: Option<u64>, overlap: bool) -> Round {
        Round {
            handover: Duration::from_millis(handover_ms),
            past_lease: past_lease_ms.map(Duration::from_millis),
            observed: (!overlap).then(|| Duration::from_millis(handover_ms + 1)),
            overlap,
        }
    }

    #[test]
    fn figures_count_overlaps_and_leave_out_what_was_not_seen() {
        let rounds = [
            round(3, Some(1), false),
            round(1, None, true),
            round(2, Some(2), false),
        ];
        let f = figures(5, &rounds, 1);
        assert_eq!((f.rounds, f.handovers, f.observed), (5, 3, 2));
        assert_eq!((f.overlaps, f.timeouts), (1, 1));
        assert_eq!(f.handover.p50_us, Some(2000.0));
        assert_eq!(f.handover.max_us, Some(3000.0));
        assert_eq!(f.past_lease.p50_us, Some(1000.0));
        assert_eq!(f.observed_after.p50_us, Some(3000.0));
        assert_eq!(figures(0, &[], 0).handover, Spread::default());
    }

    #[test]
    fn names_its_workload() {
        assert!(is_elect_workload(" e1"));
        assert!(!is_elect_workload("E2"));
    }
}
