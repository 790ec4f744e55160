//! Limits and validation of lock options, checked before anything is sent.

use std::time::Duration;

use crate::{Error, Result};

/// Default lease length.
pub const DEFAULT_TTL: Duration = Duration::from_secs(15);
/// Shortest lease accepted: shorter leases leave no room for a renewal round trip.
pub const MIN_TTL: Duration = Duration::from_millis(100);
/// Longest lease accepted: a crashed holder blocks others for at most this long.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 3600);
/// Longest owner id accepted, in bytes.
pub const MAX_OWNER_LEN: usize = 128;
/// Longest lease of a place in a wait queue. A waiter renews its place at half of it
/// while it waits, so one that died or gave up stops blocking a fair queue within it.
pub const MAX_WAITER_LEASE: Duration = Duration::from_secs(5);

/// The lease of a waiter's place in the queue, for a lock lease of `ttl`.
pub fn waiter_lease(ttl: Duration) -> Duration {
    ttl.min(MAX_WAITER_LEASE)
}

/// Most permits a semaphore may have.
pub const MAX_PERMITS: u32 = 100_000;

pub(crate) fn check_ttl(ttl: Duration) -> Result<Duration> {
    if ttl < MIN_TTL || ttl > MAX_TTL {
        return Err(Error::option(
            "ttl",
            format!(
                "{} is out of range; a lease must last from {} to {}",
                beside_bounds(ttl),
                humanize(MIN_TTL),
                humanize(MAX_TTL)
            ),
        ));
    }
    Ok(ttl)
}

/// A TTL out of range as it reads beside the bounds: `humanize` rounds, and a value just
/// past a bound (86401 s) must not read as the bound itself (24h).
fn beside_bounds(ttl: Duration) -> String {
    let shown = humanize(ttl);
    match shown == humanize(MIN_TTL) || shown == humanize(MAX_TTL) {
        true => format!("{shown} ({ttl:?})"),
        false => shown,
    }
}

/// Longest value of an election's leader, in bytes: what every store can keep beside
/// the lock (etcd and the local store refuse records of a MiB or more).
pub const MAX_VALUE_LEN: usize = 64 * 1024;

pub(crate) fn check_value(value: &str) -> Result<()> {
    if value.len() <= MAX_VALUE_LEN {
        return Ok(());
    }
    Err(Error::option(
        "value",
        format!(
            "a leader's value of {} bytes is longer than {MAX_VALUE_LEN} bytes; publish where to find it (an address, a key) rather than the thing itself",
            value.len()
        ),
    ))
}

pub(crate) fn check_owner(owner: &str) -> Result<()> {
    let rule = if owner.is_empty() {
        "must not be empty"
    } else if owner.len() > MAX_OWNER_LEN {
        "is longer than 128 bytes"
    } else if owner.chars().any(char::is_control) {
        "contains a control character"
    } else {
        return Ok(());
    };
    Err(Error::option(
        "owner",
        format!("owner id \"{}\" {rule}", crate::error::shown(owner)),
    ))
}

pub(crate) fn check_permits(permits: u32) -> Result<u32> {
    if permits == 0 || permits > MAX_PERMITS {
        return Err(Error::option(
            "permits",
            format!("{permits} is out of range; a semaphore has 1 to {MAX_PERMITS} permits"),
        ));
    }
    Ok(permits)
}

/// `1.5s`, `250ms`, `2h` — for messages.
pub fn humanize(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 && !d.is_zero() {
        format!("{}µs", d.as_micros())
    } else if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        let s = d.as_secs_f64();
        if ms.is_multiple_of(1000) {
            format!("{s:.0}s")
        } else {
            format!("{s:.1}s")
        }
    } else if ms < 3_600_000 {
        match (ms / 60_000, (ms % 60_000) / 1000) {
            (m, 0) => format!("{m}m"),
            (m, s) => format!("{m}m{s}s"),
        }
    } else if ms < 172_800_000 {
        match (ms / 3_600_000, (ms % 3_600_000) / 60_000) {
            (h, 0) => format!("{h}h"),
            (h, m) => format!("{h}h{m}m"),
        }
    } else {
        // Two days and more in days (366d, not 8784h).
        match (ms / 86_400_000, (ms % 86_400_000) / 3_600_000) {
            (d, 0) => format!("{d}d"),
            (d, h) => format!("{d}d{h}h"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ttl_just_past_a_bound_does_not_read_as_the_bound() {
        let message = |ttl| check_ttl(ttl).unwrap_err().to_string();
        assert!(message(Duration::from_secs(86_401)).contains("24h (86401s) is out of range"));
        assert!(message(Duration::from_micros(99_900)).contains("99ms is out of range"));
        assert!(message(Duration::from_secs(100_000)).contains("27h46m is out of range"));
    }

    #[test]
    fn durations_read_in_the_largest_unit_that_fits() {
        let s = Duration::from_secs;
        assert_eq!(humanize(Duration::from_micros(250)), "250µs");
        assert_eq!(humanize(Duration::from_millis(1500)), "1.5s");
        assert_eq!(humanize(s(90)), "1m30s");
        assert_eq!(humanize(s(5400)), "1h30m");
        assert_eq!(humanize(s(47 * 3600)), "47h");
        assert_eq!(humanize(s(366 * 86_400)), "366d");
        assert_eq!(humanize(s(3 * 86_400 + 7200)), "3d2h");
    }
}
