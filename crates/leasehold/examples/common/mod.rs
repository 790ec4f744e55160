//! What the examples share: the Redis floors' scripts, a bare store cycle, a lock cycle,
//! medians. Each example uses part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use leasehold::store::{AcquireRequest, Attempt, LeaseId, Requester};
use leasehold::{Leasehold, LockKind, LockName, Released};

/// Compare-and-delete: the raw floor's release.
pub const RELEASE: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0";
/// `SET NX PX`, then `INCR` of a token counter: the least acquire that issues a token.
pub const TOKEN_ACQUIRE: &str = "if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return redis.call('incr', KEYS[2]) end return 0";

pub type Failure = Box<dyn std::error::Error + Send + Sync>;

/// One `Store::acquire` + `Store::release` of `name`, without the library above the store.
pub async fn store_cycle(
    locks: &Leasehold,
    name: &LockName,
    requester: &Arc<Requester>,
) -> Result<(), Failure> {
    let req = AcquireRequest {
        name: name.clone(),
        lease: LeaseId::random(),
        owner: "o".into(),
        kind: LockKind::Exclusive,
        ttl: Duration::from_secs(30),
        fair: false,
        enqueue: true,
        waited_since: None,
        requester: requester.clone(),
        value: None,
    };
    let store = locks.store();
    match store.acquire(&req).await? {
        Attempt::Granted(_) => {}
        _ => return Err("the lock was busy".into()),
    }
    match store.release(&req.lease()).await? {
        Released::Released => Ok(()),
        _ => Err("the release found the lease ended".into()),
    }
}

/// One `try_lock_for` + `release` of `lock`, as `leasehold bench` W3 does.
pub async fn lock_cycle(lock: &leasehold::Lock) -> Result<(), Failure> {
    let guard = (lock.try_lock_for(Duration::from_secs(5)).await?).ok_or("the lock was busy")?;
    match guard.release().await? {
        Released::Released => Ok(()),
        _ => Err("the release found the lease ended".into()),
    }
}

pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    (values[(n - 1) / 2] + values[n / 2]) / 2.0
}
