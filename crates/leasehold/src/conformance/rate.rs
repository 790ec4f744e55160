//! Rate-limiter cases every store that offers limiters ([`Store::rate`]) passes.
//!
//! Each takes an [`Open`]: every client is a [`Leasehold`] on a store opened anew, as a
//! process of its own would be, so the limiter's state is shared only through the store.

use std::time::Duration;

use tokio::time::Instant;

use super::{join_all, unique, within, Open};
use crate::store::Store;
use crate::{Error, Leasehold, Rate, RateDecision};

/// One allowed decision as a client saw it: `units`, let through at some moment of the
/// store's clock that lies between `from` and `to` on this process's monotonic clock.
#[derive(Clone, Copy, Debug)]
pub struct Admitted {
    /// Before the request was sent (plus, for a reservation, the wait it was given).
    pub from: Instant,
    /// After the answer came back (plus the same wait).
    pub to: Instant,
    /// Units let through.
    pub units: u64,
}

/// Checks GCRA's bound on every window: for any window of length `t`, the units let
/// through in it are at most `burst + t / interval`.
///
/// The store decides on its own clock, which the client cannot read; it only knows that
/// each decision happened between its send and its answer. A decision is counted in a
/// window only when that whole span lies inside it, so the count is a lower bound of
/// what the store let through there and client-side jitter (scheduling, a slow answer)
/// can only lower it: a failure is a real excess, never noise. The tightest windows are
/// those from one decision's send to another's answer; each is checked. The store's
/// clock may run a little faster than ours (Redis's `TIME` is the wall clock, which NTP
/// may slew by up to 500 ppm): the window is stretched by 0.1 % for that.
pub fn assert_window_bound(admitted: &[Admitted], interval: Duration, burst: u64) {
    let mut by_start = admitted.to_vec();
    by_start.sort_by_key(|a| a.from);
    for (i, first) in by_start.iter().enumerate() {
        let mut ends: Vec<(Instant, u64)> = by_start[i..].iter().map(|a| (a.to, a.units)).collect();
        ends.sort();
        let mut count = 0;
        for (end, units) in ends {
            count += units;
            let t = end.saturating_duration_since(first.from).mul_f64(1.001);
            let bound = burst + (t.as_nanos() / interval.as_nanos()) as u64;
            assert!(
                count <= bound,
                "{count} units let through within {t:?} (from {:?} on), more than burst {burst} + {t:?} / {interval:?} = {bound}",
                first.from
            );
        }
    }
}

/// `clients` clients with `tasks` tasks each ask `try_acquire` (1 or 2 units) as fast as
/// they can for `run`, well above the rate: every window keeps the bound
/// ([`assert_window_bound`]) and at least 98 % of what the limiter could let through in
/// the run was let through. The rate is 200/s (5 ms per unit), burst 20.
///
/// The 98 % is measured against `burst + rate × (last answer − first send)`, more than
/// the store's own span of decisions, so it is no easier than the ideal. It is robust on
/// a loaded machine because a GCRA limiter loses capacity only while it is full and
/// nobody asks: under constant demand a stall of the clients shorter than the burst's
/// 100 ms is made up afterwards.
pub async fn bound_holds_under_contention(open: Open, clients: usize, tasks: usize, run: Duration) {
    let name = unique("rate-bound");
    let (rate, burst) = (Rate::per_second(200), 20);
    let interval = Duration::from_millis(5);
    let mut handles = Vec::new();
    let start = Instant::now();
    let end = start + run;
    for c in 0..clients {
        let limits = Leasehold::from_store(open().await);
        let limiter = limits.rate_limiter(name.as_str(), rate, burst).unwrap();
        for t in 0..tasks {
            let limiter = limiter.clone();
            handles.push(tokio::spawn(async move {
                let mut admitted = Vec::new();
                let mut i = c + t;
                while Instant::now() < end {
                    i += 1;
                    let units = 1 + (i % 3 == 0) as u64;
                    let from = Instant::now();
                    let d = limiter.try_acquire(units).await.unwrap();
                    let to = Instant::now();
                    if d.allowed {
                        assert!(d.wait.is_zero());
                        admitted.push(Admitted { from, to, units });
                    } else {
                        assert!(d.wait > Duration::ZERO && d.wait <= interval * 2);
                    }
                    // The memory store answers without awaiting anything.
                    tokio::task::yield_now().await;
                }
                admitted
            }));
        }
    }
    let admitted: Vec<Admitted> = join_all("the hammering tasks", handles)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert_window_bound(&admitted, interval, burst);
    let first = admitted.iter().map(|a| a.from).min().unwrap();
    let last = admitted.iter().map(|a| a.to).max().unwrap().max(end);
    let ideal = burst as f64 + (last - first.min(start)).as_secs_f64() * 200.0;
    let got: u64 = admitted.iter().map(|a| a.units).sum();
    assert!(
        got as f64 >= 0.98 * ideal,
        "let through {got} units, below 98 % of the ideal {ideal:.0}"
    );
}

/// Waiters of several clients calling `acquire` at once are each given their own turn,
/// one interval apart, in the order the store saw them, and each wakes at its turn:
/// never before it (no more than the bound by any moment) and not long after it (they
/// sleep until it, not poll). `acquire_for` with too short a wait returns at once,
/// refused, with the wait it would need, and takes nothing.
pub async fn acquire_waits_for_its_turn(open: Open) {
    let name = unique("rate-turns");
    let interval = Duration::from_millis(60);
    let (rate, burst) = (Rate::new(1, interval), 1);
    let mut handles = Vec::new();
    let mut limiters = Vec::new();
    for _ in 0..3 {
        let limits = Leasehold::from_store(open().await);
        limiters.push(limits.rate_limiter(name.as_str(), rate, burst).unwrap());
    }
    let start = Instant::now();
    for i in 0..6 {
        let limiter = limiters[i % 3].clone();
        handles.push(tokio::spawn(async move {
            let d = limiter.acquire(1).await.unwrap();
            (Instant::now(), d)
        }));
    }
    let mut woke: Vec<(Instant, RateDecision)> = join_all("the waiters", handles).await;
    woke.sort_by_key(|(at, _)| *at);
    let late = Duration::from_millis(250);
    for (k, (at, d)) in woke.iter().enumerate() {
        assert!(d.allowed);
        let turn = start + interval * k as u32;
        assert!(
            *at >= turn,
            "waiter {k} woke {:?} before its turn",
            turn - *at
        );
        assert!(
            *at <= turn + late,
            "waiter {k} woke {:?} after its turn",
            *at - turn
        );
    }
    // A bounded wait too short for the next turn is refused at once, with the wait it
    // would need, and takes nothing (else the next answer would be a turn later).
    let slow = Duration::from_secs(10);
    let name = unique("rate-bounded");
    let limiter = limiters[0].clone();
    let limits = Leasehold::from_store(open().await);
    let slow_limiter = limits
        .rate_limiter(name.as_str(), Rate::new(1, slow), 1)
        .unwrap();
    assert!(slow_limiter.try_acquire(1).await.unwrap().allowed);
    let asked = Instant::now();
    let refused = slow_limiter
        .acquire_for(1, Duration::from_secs(1))
        .await
        .unwrap();
    assert!(!refused.allowed);
    assert!(refused.wait > slow - Duration::from_secs(2) && refused.wait <= slow);
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "a refused acquire_for waited"
    );
    let again = slow_limiter.try_acquire(1).await.unwrap();
    assert!(!again.allowed && again.wait <= refused.wait);
    // A bounded wait long enough is served like acquire.
    let granted = within("acquire_for", limiter.acquire_for(1, interval * 20))
        .await
        .unwrap();
    assert!(granted.allowed);
}

/// From idle, exactly the burst passes at once, each answer counting what is left; the
/// next unit is refused with the wait for one interval, and asking for more than is left
/// takes nothing. (The contention case cannot see one unit too many at the start when
/// many calls are in flight at once; this one asks one call at a time.)
pub async fn burst_from_idle_is_exact(open: Open) {
    let limits = Leasehold::from_store(open().await);
    let interval = Duration::from_secs(10);
    let name = unique("rate-burst");
    let limiter = limits
        .rate_limiter(name.as_str(), Rate::new(1, interval), 5)
        .unwrap();
    assert!(limiter.try_acquire(2).await.unwrap().allowed);
    let too_many = limiter.try_acquire(4).await.unwrap();
    assert!(!too_many.allowed && too_many.remaining == 3);
    assert!(too_many.wait > interval / 2 && too_many.wait <= interval);
    for left in [2, 1, 0] {
        let d = limiter.try_acquire(1).await.unwrap();
        assert!(d.allowed && d.wait.is_zero(), "{d:?}");
        assert_eq!(d.remaining, left);
    }
    let refused = limiter.try_acquire(1).await.unwrap();
    assert!(!refused.allowed && refused.remaining == 0, "{refused:?}");
    assert!(refused.wait > interval / 2 && refused.wait <= interval);
    assert!(refused.reset_after > interval * 4 && refused.reset_after <= interval * 5);
}

/// Bad rates, bursts and unit counts are refused before anything is sent, naming the
/// option; nothing panics.
pub async fn bad_limiter_input_is_refused(store: std::sync::Arc<dyn Store>) {
    let limits = Leasehold::from_store(store);
    fn option<T: std::fmt::Debug>(r: crate::Result<T>) -> &'static str {
        match r {
            Err(Error::InvalidOption { option, .. }) => option,
            other => panic!("expected an invalid option, got {other:?}"),
        }
    }
    let day = Duration::from_secs(86_400);
    let name = unique("rate-bad");
    let make = |rate, burst| limits.rate_limiter(name.as_str(), rate, burst);
    assert_eq!(option(make(Rate::per_second(0), 1)), "rate");
    assert_eq!(option(make(Rate::new(5, Duration::ZERO), 1)), "rate");
    assert_eq!(option(make(Rate::per_second(10_000_000), 1)), "rate");
    assert_eq!(option(make(Rate::per_second(10), 0)), "burst");
    assert_eq!(option(make(Rate::new(1, day * 30), 100)), "burst");
    assert!(matches!(
        limits.rate_limiter("", Rate::per_second(1), 1),
        Err(Error::InvalidName { .. })
    ));
    let limiter = make(Rate::per_second(10), 5).unwrap();
    for units in [0, 6, u64::MAX] {
        assert_eq!(option(limiter.try_acquire(units).await), "units");
        assert_eq!(option(limiter.acquire(units).await), "units");
        assert_eq!(
            option(within("acquire_for", limiter.acquire_for(units, day)).await),
            "units"
        );
    }
    // Still untouched: the whole burst passes.
    assert!(limiter.try_acquire(5).await.unwrap().allowed);
}
