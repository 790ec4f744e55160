//! Rate limiters: GCRA on the lock stores ([`Leasehold::rate_limiter`](crate::Leasehold)).
//!
//! The generic cell rate algorithm keeps one number per limiter, the *theoretical arrival
//! time* (TAT): when the limiter would be back to full burst if nothing else were let
//! through. Letting `n` units through moves it `n` emission intervals later; a request
//! is allowed when the new TAT is at most `burst` intervals ahead of now. From idle,
//! `burst` units pass at once; after that one unit per interval. In every window of
//! length `t` at most `burst + rate·t` units pass, at any position of the window (no
//! doubling at window edges, unlike a fixed-window counter).
//!
//! The arithmetic is [`gcra`], in whole microseconds of the store's clock; the memory and
//! local stores call it, the Redis store's `rate.lua` repeats it line for line.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use crate::store::Store;
use crate::{Error, LockName, Result};

/// Longest tolerance (`burst` emission intervals) a limiter may have: 366 days. It
/// keeps every time the stores compute below 2^53 µs, exact in Lua's doubles.
pub const MAX_RATE_TOLERANCE: Duration = Duration::from_secs(366 * 24 * 3600);

/// A rate: `count` units per `period`, e.g. `Rate::per_second(100)` or `"10/s"`.
///
/// Kept to a whole number of microseconds per unit, rounded up (toward letting fewer
/// through): `3/s` runs at one unit per 333,334 µs. At most one unit per microsecond
/// (1,000,000/s).
///
/// ```
/// use std::time::Duration;
/// use leasehold::Rate;
/// let rate: Rate = "100/m".parse()?;
/// assert_eq!(rate, Rate::new(100, Duration::from_secs(60)));
/// assert_eq!("10/500ms".parse::<Rate>()?.to_string(), "10/500ms");
/// # Ok::<(), leasehold::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    /// Units per period.
    pub count: u64,
    /// The period.
    pub period: Duration,
}

impl Rate {
    /// `count` units per `period` (checked when a limiter is made).
    pub const fn new(count: u64, period: Duration) -> Self {
        Rate { count, period }
    }

    /// `count` units per second.
    pub const fn per_second(count: u64) -> Self {
        Self::new(count, Duration::from_secs(1))
    }

    /// `count` units per minute.
    pub const fn per_minute(count: u64) -> Self {
        Self::new(count, Duration::from_secs(60))
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self.period;
        if !p.subsec_nanos().is_multiple_of(1000) {
            // A part below a microsecond (only `Rate::new` makes one).
            return write!(f, "{}/{}ns", self.count, p.as_nanos());
        }
        let unit = match p.as_micros() {
            1 => "us".to_string(),
            1_000 => "ms".to_string(),
            1_000_000 => "s".to_string(),
            60_000_000 => "m".to_string(),
            3_600_000_000 => "h".to_string(),
            86_400_000_000 => "d".to_string(),
            us if us != 0 && us % 86_400_000_000 == 0 => format!("{}d", us / 86_400_000_000),
            us if us != 0 && us % 3_600_000_000 == 0 => format!("{}h", us / 3_600_000_000),
            us if us != 0 && us % 60_000_000 == 0 => format!("{}m", us / 60_000_000),
            us if us % 1_000_000 == 0 => format!("{}s", us / 1_000_000),
            us if us % 1000 == 0 => format!("{}ms", us / 1000),
            us => format!("{us}us"),
        };
        write!(f, "{}/{unit}", self.count)
    }
}

/// `COUNT/PERIOD`: `10/s`, `100/m`, `5/h`, `1000/d`, or a period with a number:
/// `10/500ms`, `3/2s`, `1/90m`.
impl FromStr for Rate {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::option(
                "rate",
                format!(
                    "\"{}\" {why}; give COUNT/PERIOD, e.g. 10/s, 100/m, 5/h, 10/500ms",
                    text.escape_debug()
                ),
            )
        };
        let (count, period) = text
            .trim()
            .split_once('/')
            .ok_or_else(|| bad("has no '/'"))?;
        let count: u64 =
            count
                .trim()
                .parse()
                .map_err(|e: std::num::ParseIntError| match e.kind() {
                    std::num::IntErrorKind::PosOverflow => bad("has too many units"),
                    _ => bad("does not start with a whole number of units"),
                })?;
        let period = period.trim();
        let digits = period
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(period.len());
        let (number, unit) = period.split_at(digits);
        let number: u64 = match number {
            "" => 1,
            n => n
                .parse()
                .map_err(|_| bad("has a period that is too long"))?,
        };
        let unit = match unit {
            "us" | "µs" => Duration::from_micros(1),
            "ms" => Duration::from_millis(1),
            "s" | "sec" | "second" => Duration::from_secs(1),
            "m" | "min" | "minute" => Duration::from_secs(60),
            "h" | "hour" => Duration::from_secs(3600),
            "d" | "day" => Duration::from_secs(86_400),
            _ if unit.starts_with('.') => {
                return Err(bad(
                    "has a fractional period: give whole units, e.g. 2/3s, not 1/1.5s",
                ))
            }
            _ => return Err(bad("has a period unit other than us, ms, s, m, h or d")),
        };
        let period = u32::try_from(number)
            .ok()
            .and_then(|k| unit.checked_mul(k))
            .ok_or_else(|| bad("has a period that is too long"))?;
        Ok(Rate { count, period })
    }
}

/// A limiter's parameters as a store sees them, checked: an emission interval of whole
/// microseconds and a burst.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    interval_us: u64,
    burst: u64,
}

impl RateLimit {
    /// Checks `rate` and `burst`: at least one unit per period, at most one per
    /// microsecond, a period above zero, a burst of at least 1, and `burst` intervals
    /// within [`MAX_RATE_TOLERANCE`].
    pub fn new(rate: Rate, burst: u64) -> Result<Self> {
        let bad = |reason: String| Err(Error::option("rate", reason));
        if rate.count == 0 {
            return bad(format!(
                "{rate} lets nothing through; a rate is at least 1 unit per period"
            ));
        }
        if rate.period.is_zero() {
            return bad(format!("{rate} has a zero period"));
        }
        // From nanoseconds, rounded up: a period's part below a microsecond lets no more
        // through (1 per 1.5 µs is one per 2 µs, not 1).
        let interval_us = rate.period.as_nanos().div_ceil(rate.count as u128 * 1000);
        if rate.period.as_nanos() < rate.count as u128 * 1000 {
            return bad(format!(
                "{rate} is faster than one unit per microsecond, the limiter's resolution (at most 1000000/s)"
            ));
        }
        if burst == 0 {
            return Err(Error::option(
                "burst",
                "a burst of 0 lets nothing through; it is at least 1 (the units that may pass at once)",
            ));
        }
        let max = MAX_RATE_TOLERANCE.as_micros();
        if interval_us.saturating_mul(burst as u128) > max {
            return Err(Error::option(
                "burst",
                format!(
                    "a burst of {burst} at {rate} takes {} to refill; the limiter allows at most 366 days",
                    crate::humanize(Duration::from_micros(
                        interval_us.saturating_mul(burst as u128).min(u64::MAX as u128) as u64
                    ))
                ),
            ));
        }
        Ok(RateLimit {
            interval_us: interval_us as u64,
            burst,
        })
    }

    /// The emission interval in microseconds: one unit per interval in the long run.
    pub fn interval_us(&self) -> u64 {
        self.interval_us
    }

    /// Units that may pass at once from idle.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Checks a request for `n` units: 1 to `burst` (more could never be allowed).
    pub fn check_units(&self, n: u64) -> Result<u64> {
        if n == 0 || n > self.burst {
            return Err(Error::option(
                "units",
                format!(
                    "{n} units: a request takes 1 to the burst ({}) units; more could never pass",
                    self.burst
                ),
            ));
        }
        Ok(n)
    }
}

/// One decision of a limiter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateDecision {
    /// The units were let through.
    pub allowed: bool,
    /// Refused: how long until the units would be allowed, if nobody else takes any
    /// meanwhile. Allowed: how long the caller had to wait for its turn (zero for
    /// [`RateLimiter::try_acquire`]; [`RateLimiter::acquire`] has slept it already).
    pub wait: Duration,
    /// Units that could pass at once after this decision.
    pub remaining: u64,
    /// How long until the limiter is back to its full burst, if nothing else passes.
    pub reset_after: Duration,
}

/// One GCRA decision: the whole arithmetic of every store that keeps its own state.
///
/// `tat_us` is the stored theoretical arrival time (`None`: never set or expired),
/// `now_us` the store's clock, both in microseconds; `n` units are asked for (1 to
/// `burst`). They are allowed when they could pass within `max_wait_us` of now; then
/// the new TAT is returned for the store to keep (a reservation: the caller waits
/// [`RateDecision::wait`] before going ahead). A refusal changes nothing (`None`).
///
/// The Redis store's `rate.lua` is the same arithmetic; change both together.
pub fn gcra(
    tat_us: Option<u64>,
    now_us: u64,
    limit: RateLimit,
    n: u64,
    max_wait_us: u64,
) -> (RateDecision, Option<u64>) {
    let interval = limit.interval_us;
    let tau = interval * limit.burst;
    let tat = tat_us.unwrap_or(now_us).max(now_us);
    let new_tat = tat + n * interval;
    let wait = (new_tat - now_us).saturating_sub(tau);
    let left = |tat: u64| (now_us + tau).saturating_sub(tat) / interval;
    let us = Duration::from_micros;
    if wait <= max_wait_us {
        let decision = RateDecision {
            allowed: true,
            wait: us(wait),
            remaining: left(new_tat),
            reset_after: us(new_tat - now_us),
        };
        (decision, Some(new_tat))
    } else {
        let decision = RateDecision {
            allowed: false,
            wait: us(wait),
            remaining: left(tat),
            reset_after: us(tat - now_us),
        };
        (decision, None)
    }
}

/// The longest wait a request may reserve for: far beyond any sensible wait, and small
/// enough that times stay below 2^53 µs.
pub(crate) const MAX_WAIT_US: u64 = 100 * 366 * 86_400 * 1_000_000;

/// A limiter handle: `rate` units per period with bursts of up to `burst`, shared by
/// everyone using the same name on the same store. Cheap to clone.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold::Result<()> {
/// use std::time::Duration;
/// use leasehold::{Leasehold, MemoryStore, Rate};
///
/// let limits = Leasehold::new(MemoryStore::new());
/// let api = limits.rate_limiter("payments-api", Rate::per_second(100), 20)?;
/// let first = api.try_acquire(20).await?;
/// assert!(first.allowed);
/// let next = api.try_acquire(1).await?;
/// assert!(!next.allowed && next.wait <= Duration::from_millis(10));
/// api.acquire(1).await?; // sleeps until its turn (about 10 ms)
/// # Ok(()) }
/// ```
///
/// # When the store is unreachable
/// Every call returns [`Error::Unavailable`] (see [`Error::is_retryable`]); nothing is
/// decided for you. Fail closed (treat it as refused) for limits that protect someone
/// else (a paid API, a struggling service); fail open (go ahead) where the limit is a
/// courtesy and an outage of the store must not stop the work.
#[derive(Clone)]
pub struct RateLimiter {
    store: Arc<dyn Store>,
    name: LockName,
    rate: Rate,
    limit: RateLimit,
}

impl fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimiter")
            .field("name", &self.name)
            .field("rate", &self.rate.to_string())
            .field("burst", &self.limit.burst)
            .finish()
    }
}

impl RateLimiter {
    pub(crate) fn new(
        store: Arc<dyn Store>,
        name: LockName,
        rate: Rate,
        burst: u64,
    ) -> Result<Self> {
        let limit = RateLimit::new(rate, burst)?;
        Ok(RateLimiter {
            store,
            name,
            rate,
            limit,
        })
    }

    /// The limiter's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// Its rate and burst, as checked.
    pub fn limit(&self) -> RateLimit {
        self.limit
    }

    async fn decide(&self, n: u64, max_wait_us: u64) -> Result<RateDecision> {
        let n = self.limit.check_units(n)?;
        let req = crate::store::RateRequest {
            name: self.name.clone(),
            limit: self.limit,
            units: n,
            max_wait_us,
        };
        self.store.rate(&req).await
    }

    /// One decision for `n` units (1 to the burst), at once: allowed now or not, with
    /// how long until they would be, and what is left of the burst. A refusal takes
    /// nothing.
    ///
    /// # Cancel safety
    /// A cancelled call may or may not have taken its units (the store may have
    /// answered); the limiter then lets fewer through, never more. So may a call that
    /// failed with [`Error::Unavailable`] (its answer lost, or a retry after it).
    pub async fn try_acquire(&self, n: u64) -> Result<RateDecision> {
        self.decide(n, 0).await
    }

    /// Takes `n` units, waiting as long as it takes. One store call: the store reserves
    /// the units at the earliest moment they may pass, in the order the calls reach
    /// it, and this sleeps until then (no polling).
    ///
    /// # Cancel safety
    /// Cancelling it while it sleeps leaves its reserved units spent: the limiter then
    /// lets fewer through for a while, never more.
    pub async fn acquire(&self, n: u64) -> Result<RateDecision> {
        self.wait_turn(self.decide(n, MAX_WAIT_US).await?).await
    }

    /// Takes `n` units if they can pass within `wait`, waiting for them; otherwise
    /// returns at once, refused, with how long they would take ([`RateDecision::wait`]).
    /// One store call, as [`acquire`](Self::acquire).
    ///
    /// # Cancel safety
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_for(&self, n: u64, wait: Duration) -> Result<RateDecision> {
        self.wait_turn(self.reserve(n, wait).await?).await
    }

    /// Reserves `n` units at the earliest moment they may pass, if that is within
    /// `within` (`Duration::MAX`: however long), without waiting for it: allowed, they
    /// are the caller's [`RateDecision::wait`] from now, to wait for as it likes (with a
    /// progress display, in a scheduler); refused, nothing is taken. One store call.
    ///
    /// ```no_run
    /// # async fn f(locks: leasehold::Leasehold) -> leasehold::Result<()> {
    /// let limiter = locks.rate_limiter("mail", "10/m".parse()?, 3)?;
    /// let turn = limiter.reserve(1, std::time::Duration::from_secs(30)).await?;
    /// if turn.allowed {
    ///     println!("sending in {:?}", turn.wait);
    ///     tokio::time::sleep(turn.wait).await;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// As [`try_acquire`](Self::try_acquire); reserved units stay spent if the caller
    /// does not use them.
    pub async fn reserve(&self, n: u64, within: Duration) -> Result<RateDecision> {
        let max_wait_us = u64::try_from(within.as_micros()).unwrap_or(u64::MAX);
        self.decide(n, max_wait_us.min(MAX_WAIT_US)).await
    }

    async fn wait_turn(&self, decision: RateDecision) -> Result<RateDecision> {
        if decision.allowed && !decision.wait.is_zero() {
            tokio::time::sleep(decision.wait).await;
        }
        Ok(decision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(per_s: u64, burst: u64) -> RateLimit {
        RateLimit::new(Rate::per_second(per_s), burst).unwrap()
    }

    #[test]
    fn a_burst_passes_at_once_then_one_unit_per_interval() {
        let l = limit(10, 3); // 100 ms per unit
        let mut tat = None;
        for left in [2, 1, 0] {
            let (d, t) = gcra(tat, 1_000_000, l, 1, 0);
            assert!(d.allowed);
            assert_eq!(d.remaining, left);
            tat = t;
        }
        let (d, t) = gcra(tat, 1_000_000, l, 1, 0);
        assert!(!d.allowed && t.is_none());
        assert_eq!(d.wait, Duration::from_millis(100));
        assert_eq!(d.reset_after, Duration::from_millis(300));
        // One interval later one more passes, and only one.
        let (d, t) = gcra(tat, 1_100_000, l, 1, 0);
        assert!(d.allowed && d.remaining == 0);
        let (d, _) = gcra(t, 1_100_000, l, 1, 0);
        assert!(!d.allowed);
    }

    #[test]
    fn an_idle_limiter_refills_to_its_burst_and_no_further() {
        let l = limit(10, 3);
        let (_, tat) = gcra(None, 0, l, 3, 0);
        let (d, _) = gcra(tat, 10_000_000, l, 3, 0);
        assert!(d.allowed);
        let (d, _) = gcra(tat, 10_000_000, l, 1, 0);
        assert_eq!(d.remaining, 2);
    }

    #[test]
    fn a_wait_reserves_the_earliest_slot_and_later_calls_queue_behind_it() {
        let l = limit(10, 1);
        let (_, tat) = gcra(None, 0, l, 1, 0);
        let (d, tat) = gcra(tat, 0, l, 1, 1_000_000);
        assert!(d.allowed);
        assert_eq!(d.wait, Duration::from_millis(100));
        let (d, tat2) = gcra(tat, 0, l, 1, 1_000_000);
        assert_eq!(d.wait, Duration::from_millis(200));
        // Too far for this wait: refused, nothing reserved.
        let (d, none) = gcra(tat2, 0, l, 1, 250_000);
        assert!(!d.allowed && none.is_none());
        assert_eq!(d.wait, Duration::from_millis(300));
    }

    #[test]
    fn a_request_larger_than_what_is_left_waits_for_all_of_it() {
        let l = limit(10, 5);
        let (_, tat) = gcra(None, 0, l, 4, 0);
        let (d, _) = gcra(tat, 0, l, 3, 0);
        assert!(!d.allowed);
        assert_eq!(d.remaining, 1);
        assert_eq!(d.wait, Duration::from_millis(200));
    }

    /// Every window of every length holds at most burst + rate·t: a brute-force check
    /// over a pseudo-random arrival pattern.
    #[test]
    fn no_window_admits_more_than_burst_plus_rate_times_length() {
        let l = RateLimit::new(Rate::new(7, Duration::from_millis(100)), 4).unwrap();
        let (mut tat, mut now, mut seed) = (None, 0u64, 7u64);
        let mut allowed = Vec::new();
        for _ in 0..5000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            now += (seed >> 33) % 9000;
            let n = 1 + (seed >> 20) % 2;
            let (d, t) = gcra(tat, now, l, n, 0);
            if d.allowed {
                tat = t;
                allowed.extend(std::iter::repeat_n(now, n as usize));
            }
        }
        for (i, &start) in allowed.iter().enumerate() {
            for len in [0, 1_000, 14_285, 50_000, 300_000, 1_000_000] {
                let count = allowed[i..]
                    .iter()
                    .take_while(|&&t| t <= start + len)
                    .count() as u64;
                assert!(
                    count <= 4 + len / l.interval_us(),
                    "{count} in {len} µs from {start}"
                );
            }
        }
        assert!(allowed.len() > 1000);
    }

    #[test]
    fn bad_rates_and_bursts_are_refused_with_the_rule() {
        let err = |r: Result<RateLimit>| r.unwrap_err().to_string();
        assert!(err(RateLimit::new(Rate::per_second(0), 1)).contains("at least 1 unit"));
        assert!(err(RateLimit::new(Rate::new(1, Duration::ZERO), 1)).contains("zero period"));
        assert!(err(RateLimit::new(Rate::per_second(2_000_000), 1)).contains("microsecond"));
        assert!(err(RateLimit::new(Rate::per_second(1), 0)).contains("burst of 0"));
        assert!(err(RateLimit::new(
            Rate::new(1, Duration::from_secs(86_400)),
            400
        ))
        .contains("366 days"));
        let l = limit(10, 5);
        assert!(l.check_units(0).is_err() && l.check_units(6).is_err());
        assert_eq!(l.check_units(5).unwrap(), 5);
        assert_eq!(
            RateLimit::new(Rate::per_second(3), 1)
                .unwrap()
                .interval_us(),
            333_334
        );
    }

    #[test]
    fn rates_parse_and_print() {
        let ok = |s: &str| s.parse::<Rate>().unwrap();
        assert_eq!(ok("10/s"), Rate::per_second(10));
        assert_eq!(ok("100/m"), Rate::per_minute(100));
        assert_eq!(ok(" 5 / 2h "), Rate::new(5, Duration::from_secs(7200)));
        assert_eq!(ok("10/500ms").to_string(), "10/500ms");
        // Printed in the largest unit that divides the period, as a user would write it.
        for (text, shown) in [("1/367d", "1/367d"), ("5/2h", "5/2h"), ("1/90m", "1/90m")] {
            assert_eq!(ok(text).to_string(), shown);
        }
        assert_eq!(ok("1/120m").to_string(), "1/2h");
        // A unit alone is printed alone, as it was written.
        for (text, shown) in [
            ("10/us", "10/us"),
            ("10/ms", "10/ms"),
            ("10/1000ms", "10/s"),
        ] {
            assert_eq!(ok(text).to_string(), shown);
        }
        assert_eq!(Rate::new(10, Duration::ZERO).to_string(), "10/0s");
        for bad in [
            "",
            "10",
            "x/s",
            "10/",
            "10/fortnight",
            "-1/s",
            "10/99999999999s",
        ] {
            assert!(bad.parse::<Rate>().is_err(), "{bad:?} was taken");
        }
        // A count past u64 says so, not that it is no number.
        let huge = "99999999999999999999/s".parse::<Rate>().unwrap_err();
        assert!(huge.to_string().contains("too many units"), "{huge}");
        // A period's part below a microsecond is rounded up, toward fewer.
        let interval = |ns| {
            let rate = Rate::new(1, Duration::from_nanos(ns));
            RateLimit::new(rate, 1).unwrap().interval_us()
        };
        assert_eq!((interval(1_500), interval(1_000_500)), (2, 1001));
        assert_eq!(
            Rate::new(1, Duration::from_nanos(1_500)).to_string(),
            "1/1500ns"
        );
        // A fractional period is named as such, not as an unknown unit.
        let half = "3/1.5s".parse::<Rate>().unwrap_err();
        assert!(half.to_string().contains("fractional period"), "{half}");
    }
}
