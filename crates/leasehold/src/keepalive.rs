//! Safe-deadline arithmetic and the renewal task a guard owns.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::{watch, Mutex};
use tokio::time::{sleep_until, timeout_at, Instant};

use crate::gate::Turn;
use crate::metrics::{Call, Holding, Loss, Meter};
use crate::store::{Lease, Renewal, Store};
use crate::Locked;
use crate::Result;

/// Clock drift allowed between the client and the store, as a fraction of the TTL.
pub const DRIFT: f64 = 0.01;
/// Fixed margin subtracted from every safe deadline.
pub const MARGIN: Duration = Duration::from_millis(2);

/// The last moment a lease granted or renewed by a request sent at `sent` is provably
/// ours: the store counts the TTL from when it handled the request, which is no earlier
/// than `sent`, so its expiry is later than this by at least the drift and the margin.
pub fn safe_deadline(sent: Instant, ttl: Duration) -> Instant {
    sent + ttl.mul_f64(1.0 - DRIFT).saturating_sub(MARGIN)
}

/// Whether a grant of `granted`, counted from a request sent at `sent`, can be handed to
/// its caller as it is at `now`: with at least a third of it left, its keepalive has time
/// to renew it. A grant with less (a hand-over to a waiter whose last request was long
/// ago, a slow answer) is confirmed by a renewal first; returned as it was, its guard
/// could be lost before that renewal came back, though the store had just granted it.
pub(crate) fn usable_as_granted(sent: Instant, granted: Duration, now: Instant) -> bool {
    safe_deadline(sent, granted) > now + granted / 3
}

#[derive(Clone, Debug)]
pub(crate) struct Status {
    pub valid_until: Instant,
    pub renewed_at: Instant,
    pub ttl: Duration,
    pub lost: Option<String>,
    /// The last renewal attempt failed (an error, or no answer within its budget) and
    /// none has succeeded since: the lease may run out.
    pub failing: bool,
}

impl Status {
    pub fn is_lost(&self, now: Instant) -> bool {
        self.lost.is_some() || now >= self.valid_until
    }
}

/// State shared by a guard and its renewal task.
#[derive(Debug)]
pub(crate) struct Lifeline {
    pub store: Arc<dyn Store>,
    pub lease: Lease,
    pub status: watch::Sender<Status>,
    pub meter: Meter,
    /// One renewal in flight at a time, so an older answer cannot overwrite a newer one.
    renewing: Mutex<()>,
    /// Released, leaked or dropped: renew no more.
    closed: AtomicBool,
    /// The one task that waits for the store to say the lease is gone ([`Store::ended`]),
    /// started by the first [`watch_ended`](Self::watch_ended); it ends with the lease.
    ended_watch: std::sync::Mutex<Option<tokio_util::task::AbortOnDropHandle<()>>>,
    /// This process's turn at the lock (see gate.rs), if the hold came through it: the
    /// release hands the lock to the next task of this process. Passed on as soon as the
    /// hold is known lost, so the process's other tasks need not wait for the guard's end.
    turn: std::sync::Mutex<Option<Turn>>,
    /// The hold as the metrics count it (the `held` gauge, the hold time), from the
    /// guard's start to its end or the loss, whichever comes first.
    holding: std::sync::Mutex<Option<Holding>>,
}

impl Lifeline {
    /// A lease granted for `granted` (at most `ttl`) by a request sent at `sent`;
    /// renewals ask for `ttl`.
    pub fn new(
        store: Arc<dyn Store>,
        lease: Lease,
        sent: Instant,
        ttl: Duration,
        granted: Duration,
        meter: Meter,
    ) -> Arc<Self> {
        let (status, _) = watch::channel(Status {
            valid_until: safe_deadline(sent, granted.min(ttl)),
            renewed_at: sent,
            ttl,
            lost: None,
            failing: false,
        });
        Arc::new(Lifeline {
            store,
            lease,
            status,
            meter,
            renewing: Mutex::new(()),
            closed: AtomicBool::new(false),
            ended_watch: std::sync::Mutex::new(None),
            turn: std::sync::Mutex::new(None),
            holding: std::sync::Mutex::new(None),
        })
    }

    /// Counts the hold in the metrics from `acquired` until [`close`](Self::close) or the
    /// loss.
    pub fn start_holding(&self, acquired: Instant) {
        let mut holding = self.holding.locked();
        if self.status.borrow().lost.is_none() && !self.is_closed() {
            *holding = Some(self.meter.holding(acquired));
        }
    }

    pub fn mark_lost(&self, why: Loss, reason: &str) {
        self.status.send_if_modified(|s| {
            if s.lost.is_some() {
                return false;
            }
            self.meter.lost(why);
            // Debug, not warn: the guard's owner hears of it from `lost()`, `check()` and
            // `release()`, and says it in its own words (the CLI does); the failing
            // renewals that can lead here are warned of as they happen.
            tracing::debug!(lock = %self.lease.name, reason, "lock lost");
            s.lost = Some(reason.to_string());
            true
        });
        drop(self.take_turn());
        // Nothing is held any more, whatever the guard does next.
        drop(self.holding.locked().take());
    }

    /// Keeps the gate's `turn` with this hold, unless it is lost already.
    pub fn keep_turn(&self, turn: Turn) {
        *self.turn.locked() = Some(turn);
        if self.status.borrow().lost.is_some() {
            drop(self.take_turn());
        }
    }

    pub fn take_turn(&self) -> Option<Turn> {
        self.turn.locked().take()
    }

    /// Renews for `ttl`. The answer counts only if it arrives before the current safe
    /// deadline; the new deadline is counted from this request's send time.
    pub async fn renew(&self, ttl: Duration) -> Result<Renewal> {
        let _one_at_a_time = self.renewing.lock().await;
        let current = self.status.borrow().clone();
        let sent = Instant::now();
        if current.is_lost(sent) {
            self.mark_lost(
                Loss::RenewalFailed,
                "the safe deadline passed before the lease was renewed",
            );
            return Ok(Renewal::Lost);
        }
        let renewal = self
            .meter
            .store_call(Call::Renew, sent, self.store.renew(&self.lease, ttl));
        let outcome = timeout_at(current.valid_until, renewal).await;
        self.meter
            .renewed(matches!(outcome, Ok(Ok(Renewal::Renewed))), sent);
        match outcome {
            Err(_) => {
                self.mark_lost(
                    Loss::RenewalFailed,
                    "no renewal was confirmed before the safe deadline",
                );
                Ok(Renewal::Lost)
            }
            Ok(Ok(Renewal::Renewed)) => {
                self.status.send_modify(|s| {
                    if s.lost.is_none() {
                        s.valid_until = safe_deadline(sent, ttl);
                        s.renewed_at = sent;
                        s.ttl = ttl;
                        s.failing = false;
                    }
                });
                tracing::trace!(lock = %self.lease.name, ttl = ?ttl, "renewed");
                Ok(Renewal::Renewed)
            }
            Ok(Ok(Renewal::Lost)) => {
                self.mark_lost(
                    Loss::Gone,
                    "the store no longer has the lease (it expired or was force-released)",
                );
                Ok(Renewal::Lost)
            }
            Ok(Err(e)) => Err(e),
        }
    }

    /// One renewal step, run by the [`Renewals`] scheduler when due; says when the
    /// next step is due, or `None` when the lease is over (lost or closed).
    async fn renew_step(&self) -> Option<Instant> {
        if self.is_closed() {
            return None;
        }
        let (ttl, valid_until) = {
            let status = self.status.borrow();
            (status.ttl, status.valid_until)
        };
        let sent = Instant::now();
        let budget = attempt_budget(valid_until.saturating_duration_since(sent));
        let (outcome, unanswered) = match tokio::time::timeout(budget, self.renew(ttl)).await {
            Ok(outcome) => (outcome, false),
            Err(_) => {
                // `renew` was cut short before it could count its attempt.
                self.meter.renewed(false, sent);
                let source = format!("no answer to a renewal within {}", crate::humanize(budget));
                let store = self.store.describe_store();
                (
                    Err(crate::Error::Unavailable {
                        store,
                        source: source.into(),
                    }),
                    true,
                )
            }
        };
        match outcome {
            Ok(Renewal::Renewed) => {
                let status = self.status.borrow();
                Some(status.renewed_at + status.ttl / 3)
            }
            Ok(Renewal::Lost) => None,
            Err(_) if self.is_closed() => None,
            Err(error) => {
                let first = self
                    .status
                    .send_if_modified(|s| !std::mem::replace(&mut s.failing, true));
                // Once per run of failures: the retries that follow come several a second.
                match first {
                    true => {
                        tracing::warn!(lock = %self.lease.name, %error, "renewal failed; retrying until the safe deadline")
                    }
                    false => {
                        tracing::debug!(lock = %self.lease.name, %error, "renewal failed again")
                    }
                }
                // An error answer waits a little before the next try; an unanswered one
                // has waited already, and the time left is short.
                let backoff = match unanswered {
                    true => Duration::ZERO,
                    false => jitter(ttl.div_f64(10.0).min(Duration::from_millis(500))),
                };
                let valid_until = self.status.borrow().valid_until;
                // At the deadline the next step finds the lease lost and says so.
                Some((Instant::now() + backoff).min(valid_until))
            }
        }
    }

    /// No renewals after the guard is released, leaked or dropped.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.ended_watch.locked().take();
        drop(self.holding.locked().take());
    }

    /// Starts, once, the task that marks the lease lost as soon as the store says it is
    /// gone (a force-release, a store that forgot it): every `lost()` of the guard then
    /// only watches the status, however often it is polled anew.
    pub fn watch_ended(self: &Arc<Self>) {
        let mut watch = self.ended_watch.locked();
        if watch.is_some() || self.is_closed() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, lease, line) = (self.store.clone(), self.lease.clone(), Arc::downgrade(self));
        *watch = Some(tokio_util::task::AbortOnDropHandle::new(runtime.spawn(
            async move {
                // An error: the store cannot watch now; the safe deadline still decides.
                if store.ended(&lease).await.is_ok() {
                    if let Some(line) = line.upgrade() {
                        line.mark_lost(
                            Loss::ForceReleased,
                            "the store no longer has the lease (it was force-released or ended)",
                        );
                    }
                }
            },
        )));
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

/// The least time a renewal attempt waits for its answer, unless half the time left is
/// less: a healthy store on a loaded host can take this long, and an attempt cut short
/// marks the lease failing (`leasehold run` then stops its command early).
const MIN_ATTEMPT: Duration = Duration::from_millis(250);

/// How long a renewal attempt with `left` until the safe deadline waits for its answer
/// before it counts as failed and is tried again: a third of the time left (so a store
/// that hangs is noticed, and retried, well before the deadline), but not less than
/// [`MIN_ATTEMPT`] while the time left allows it.
fn attempt_budget(left: Duration) -> Duration {
    (left / 3)
        .max(MIN_ATTEMPT.min(left / 2))
        .max(Duration::from_millis(50))
}

/// Renews the leases of every guard made through one [`Leasehold`](crate::Leasehold):
/// one task sleeps until the earliest due renewal and starts it. A new guard is one push
/// onto a list, and wakes the task only if its renewal is due before the task's next
/// wake-up: short holds, acquired and released within a third of their TTL, cost no
/// task, no wake-up and no place in the task's schedule (they are gone when it looks).
#[derive(Debug, Default)]
pub(crate) struct Renewals {
    arrivals: std::sync::Mutex<Arrivals>,
    /// The driver's schedule: only the driver locks it, and it outlives a driver whose
    /// runtime ended (the next driver, on another runtime, takes it over).
    due: std::sync::Mutex<Due>,
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Due {
    at: BTreeMap<(Instant, u64), Weak<Lifeline>>,
    next_id: u64,
}

/// What guards tell the driver; the lock is held for a push, not for a schedule's upkeep.
#[derive(Debug, Default)]
struct Arrivals {
    /// Renewals due, added since the driver last looked.
    new: Vec<(Instant, Weak<Lifeline>)>,
    /// The earliest of `new`.
    earliest: Option<Instant>,
    /// Entries of `new` left by the last cleanup.
    after_cleanup: usize,
    /// When the driver will look next; `None` when no driver runs in this runtime.
    driver_wakes_at: Option<Instant>,
    driver: Option<tokio::task::JoinHandle<()>>,
}

impl Renewals {
    /// Schedules the first renewal of a new guard's lease.
    pub fn add(self: &Arc<Self>, line: &Arc<Lifeline>) {
        let first = first_renewal(&line.status.borrow(), Instant::now());
        self.schedule(Arc::downgrade(line), first);
    }

    fn schedule(self: &Arc<Self>, line: Weak<Lifeline>, at: Instant) {
        let mut a = self.arrivals.locked();
        a.new.push((at, line));
        a.earliest = Some(a.earliest.map_or(at, |e| e.min(at)));
        // Entries of released guards leave when the driver looks; under a high
        // acquisition rate, drop them sooner so the list stays near the live guards.
        if a.new.len() > a.after_cleanup * 2 + 64 {
            a.new.retain(|(_, line)| line.strong_count() > 0);
            a.after_cleanup = a.new.len();
            a.earliest = a.new.iter().map(|(at, _)| *at).min();
        }
        let running = a.driver.as_ref().is_some_and(|d| !d.is_finished());
        if !running {
            a.driver_wakes_at = Some(at);
            a.driver = Some(tokio::spawn(self.clone().drive()));
        } else if a.driver_wakes_at.is_none_or(|w| at < w) {
            a.driver_wakes_at = Some(at);
            self.changed.notify_one();
        }
    }

    async fn drive(self: Arc<Self>) {
        // Guards only push to `arrivals`; the schedule is the driver's.
        let mut taken = Vec::new();
        loop {
            {
                let mut a = self.arrivals.locked();
                std::mem::swap(&mut taken, &mut a.new);
                (a.earliest, a.after_cleanup) = (None, 0);
            }
            let next_due = {
                let mut due = self.due.locked();
                for (at, line) in taken.drain(..) {
                    if line.strong_count() > 0 {
                        due.next_id += 1;
                        let id = due.next_id;
                        due.at.insert((at, id), line);
                    }
                }
                let later = due.at.split_off(&(Instant::now(), u64::MAX));
                let now_due = std::mem::replace(&mut due.at, later);
                // Drop entries of guards that are gone, so the schedule does not grow.
                due.at.retain(|_, line| line.strong_count() > 0);
                for line in now_due.into_values() {
                    let Some(line) = line.upgrade() else { continue };
                    let renewals = self.clone();
                    tokio::spawn(async move {
                        if let Some(at) = line.renew_step().await {
                            renewals.schedule(Arc::downgrade(&line), at);
                        }
                    });
                }
                due.at.keys().next().map(|(at, _)| *at)
            };
            let next = {
                let mut a = self.arrivals.locked();
                // Arrivals since the swap above count too.
                let next = match (next_due, a.earliest) {
                    (Some(n), Some(e)) => Some(n.min(e)),
                    (n, e) => n.or(e),
                };
                a.driver_wakes_at = next;
                next
            };
            match next {
                Some(at) => {
                    tokio::select! {
                        _ = sleep_until(at) => {}
                        _ = self.changed.notified() => {}
                    }
                }
                None => self.changed.notified().await,
            }
        }
    }
}

/// When a new guard's lease is first renewed: a third of the way to its safe deadline
/// (a third of the TTL for a full lease); at once (`now`) when it was granted less than
/// half the TTL asked for: a lock handed to a queued waiter runs on its short waiter
/// lease until renewed to the full TTL. A lease granted with most of its TTL (a spare
/// etcd lease, reused part-way through its life) waits its turn like a full one:
/// renewing it at once would cost every such acquisition a round trip.
fn first_renewal(status: &Status, now: Instant) -> Instant {
    let granted = status
        .valid_until
        .saturating_duration_since(status.renewed_at);
    let full = safe_deadline(status.renewed_at, status.ttl);
    match granted < full.saturating_duration_since(status.renewed_at) / 2 {
        true => now,
        false => status.renewed_at + granted / 3,
    }
}

/// `d` scaled by a random factor in [0.5, 1.5).
pub(crate) fn jitter(d: Duration) -> Duration {
    d.mul_f64(0.5 + rand::random::<f64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewal_attempt_gets_a_loaded_stores_time_while_the_deadline_allows() {
        let ms = Duration::from_millis;
        // On time for a 1 s lease: 250 ms, not a third (218 ms).
        assert_eq!(attempt_budget(ms(655)), ms(250));
        // Late, after a pause of 0.3 of that lease: half of what is left.
        assert_eq!(
            attempt_budget(ms(355)),
            ms(177) + Duration::from_micros(500)
        );
        // Long leases keep a third; the last moments a floor of 50 ms.
        assert_eq!(attempt_budget(ms(6000)), ms(2000));
        assert_eq!(attempt_budget(ms(60)), ms(50));
    }

    #[test]
    fn a_lease_granted_short_is_renewed_at_once_and_one_granted_most_of_its_ttl_in_turn() {
        let (s, now) = (Duration::from_secs, Instant::now());
        let granted = |granted: Duration| Status {
            valid_until: safe_deadline(now, granted),
            renewed_at: now,
            ttl: s(30),
            lost: None,
            failing: false,
        };
        let third_of = |granted: Duration| now + (safe_deadline(now, granted) - now) / 3;
        let later = now + s(1);
        // The full TTL, and a spare lease with 25 s of 30 left: a third of the way.
        assert_eq!(first_renewal(&granted(s(30)), later), third_of(s(30)));
        assert_eq!(first_renewal(&granted(s(25)), later), third_of(s(25)));
        // A waiter's 5 s lease handed over: at once.
        assert_eq!(first_renewal(&granted(s(5)), later), later);
    }

    /// A lease of `ttl` on the memory store, granted now, as a guard's renewals see it.
    async fn line(store: &Arc<dyn Store>, name: &str, ttl: Duration) -> Arc<Lifeline> {
        let lease = Lease {
            name: name.try_into().expect("a valid name"),
            id: crate::store::LeaseId::random(),
        };
        let req = crate::store::AcquireRequest {
            name: lease.name.clone(),
            lease: lease.id.clone(),
            owner: "test".into(),
            kind: crate::LockKind::Exclusive,
            ttl,
            fair: false,
            enqueue: false,
            waited_since: None,
            requester: Arc::new(crate::store::Requester::this_process()),
            value: None,
        };
        let sent = Instant::now();
        let granted = store.acquire(&req).await.expect("the memory store answers");
        assert!(matches!(granted, crate::store::Attempt::Granted(_)));
        let meter = Meter::new(store.as_ref());
        Lifeline::new(store.clone(), lease, sent, ttl, ttl, meter)
    }

    #[tokio::test]
    async fn a_lease_due_before_the_drivers_next_wake_is_renewed_in_time() {
        let store: Arc<dyn Store> = Arc::new(crate::MemoryStore::new());
        let renewals = Arc::new(Renewals::default());
        // The driver sleeps until this one is due, about 10 s from now.
        let long = line(&store, "long", Duration::from_secs(30)).await;
        renewals.add(&long);
        // Until the driver has taken it and sleeps.
        taken_by_the_driver(&renewals).await;
        // Due in about 100 ms: it must wake the driver, or this lease is lost.
        let short = line(&store, "short", Duration::from_millis(300)).await;
        renewals.add(&short);
        renewed_within_5s(short.status.subscribe()).await;
    }

    /// Until the lease `status` follows is renewed; fails if it is lost first, or late.
    async fn renewed_within_5s(mut status: watch::Receiver<Status>) {
        let granted = status.borrow().renewed_at;
        let renewed = timeout_at(
            Instant::now() + Duration::from_secs(5),
            status.wait_for(|s| s.renewed_at > granted || s.lost.is_some()),
        )
        .await;
        let status = renewed
            .expect("no renewal within 5 s")
            .expect("the lease lives");
        assert!(status.lost.is_none(), "lost: {:?}", status.lost);
    }

    /// Until the driver has taken what guards added.
    async fn taken_by_the_driver(renewals: &Renewals) {
        let taken = async {
            while !renewals.arrivals.locked().new.is_empty() {
                tokio::task::yield_now().await;
            }
        };
        timeout_at(Instant::now() + Duration::from_secs(5), taken)
            .await
            .expect("the driver takes what was added");
    }

    #[test]
    fn a_driver_on_a_later_runtime_renews_what_an_ended_one_had_scheduled() {
        let store: Arc<dyn Store> = Arc::new(crate::MemoryStore::new());
        let renewals = Arc::new(Renewals::default());
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime")
        };
        // Scheduled by a driver whose runtime then ends.
        let first = runtime().block_on(async {
            let first = line(&store, "first", Duration::from_millis(600)).await;
            renewals.add(&first);
            taken_by_the_driver(&renewals).await;
            first
        });
        runtime().block_on(async {
            let second = line(&store, "second", Duration::from_secs(30)).await;
            renewals.add(&second);
            renewed_within_5s(first.status.subscribe()).await;
        });
    }

    #[tokio::test]
    async fn leases_released_before_their_first_renewal_leave_no_entry_behind() {
        let store: Arc<dyn Store> = Arc::new(crate::MemoryStore::new());
        let renewals = Arc::new(Renewals::default());
        let held = line(&store, "held", Duration::from_secs(30)).await;
        renewals.add(&held);
        for i in 0..5_000 {
            let short = line(&store, &format!("short{i}"), Duration::from_secs(30)).await;
            renewals.add(&short);
            short.close();
            let released = store
                .release(&short.lease)
                .await
                .expect("the store answers");
            assert_eq!(released, crate::Released::Released);
        }
        // Cleaned as the list grows: at most twice what lived at the last cleanup (the
        // held lease and the one just added), plus 64 and one.
        let kept = renewals.arrivals.locked().new.len();
        assert!(
            kept <= 2 * 2 + 64 + 1,
            "{kept} entries kept for 1 live lease"
        );
    }

    #[test]
    fn a_grant_with_under_a_third_of_its_lease_left_is_renewed_before_use() {
        let ms = Duration::from_millis;
        let sent = Instant::now();
        // Answered at once: used as granted.
        assert!(usable_as_granted(sent, ms(500), sent + ms(10)));
        // A hand-over counted from a request sent 499 ms before it on a 500 ms lease:
        // about 1 ms would be left, so it is renewed first.
        assert!(!usable_as_granted(sent, ms(500), sent + ms(490)));
        // The boundary: a third left (after the drift and the margin).
        let third_left = safe_deadline(sent, ms(600)) - ms(200);
        assert!(usable_as_granted(sent, ms(600), third_left - ms(1)));
        assert!(!usable_as_granted(sent, ms(600), third_left));
    }
}
