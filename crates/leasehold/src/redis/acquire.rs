//! One acquire (or transfer) attempt: the request as [`Acquire`], one run of the acquire
//! (or transfer) script, its [`AcquireReply`] as an [`Attempt`].

use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use redis::Value;

use super::reply::{AcquireReply, Conflict, Outcome};
use super::request::Acquire;
use super::scripts::scripts;
use super::{Conn, RedisStore};
use crate::options::waiter_lease;
use crate::store::{AcquireRequest, Attempt, Grant, Lease, LockKind, Released};
use crate::{rules, Error, LockName, Result};

impl RedisStore {
    /// An acquire attempt, after releasing `from` in the same script when given.
    pub(super) async fn attempt(
        &self,
        req: &AcquireRequest,
        from: Option<&Lease>,
    ) -> Result<(Released, Attempt)> {
        // Registered before the attempt, so a wake-up sent right after it is not missed.
        let fresh = req.enqueue
            && !(self.inner.waiters.register(&req.lease).sent).swap(true, Ordering::SeqCst);
        let request = self.acquire_request(req, from, fresh);
        let script = match from {
            Some(_) => &scripts().transfer,
            None => &scripts().acquire,
        };
        let reply: Value = match self.run(script, &req.name, &request.fields()).await {
            Err(Error::Conflict { name, reason }) => {
                return Err(Error::Conflict {
                    name,
                    reason: refusal(&reason, req),
                })
            }
            reply => reply?,
        };
        let reply = AcquireReply::decode(&reply, from.is_some())?;
        let attempt = match reply.outcome {
            Outcome::Granted { token, holds } => {
                self.inner.waiters.forget(req.lease.as_str());
                // Not on enough replicas (a failover could lose it): the error makes the
                // caller undo the acquisition by its id.
                self.replicated(&req.name).await?;
                Attempt::Granted(Grant {
                    token,
                    holds,
                    lease: None,
                })
            }
            Outcome::Busy(busy) => Attempt::Busy(busy),
        };
        Ok((reply.released, attempt))
    }

    /// The request as the script takes it.
    fn acquire_request<'a>(
        &'a self,
        req: &'a AcquireRequest,
        from: Option<&'a Lease>,
        fresh: bool,
    ) -> Acquire<'a> {
        // Only a fair request keeps its place by how long it waited in its process (as
        // `AcquireRequest::waited_since` says); a non-fair one joins the queue's end.
        let waited = req.waited_since.filter(|_| req.fair);
        let (released, waited) = match from {
            Some(from) => (Some(from.id.as_str()), Some(waited)),
            // A request that waited in its process (its gate's turn came without a
            // hand-over) says how long, as a transfer's does; `released` empty (a
            // transfer names its released hold there) keeps it off the tail-only fast
            // path.
            // A value is sent after both (nothing may follow a field not sent): so empty
            // and 0, as if it had waited no time (which only keeps it off the tail-only
            // fast path).
            None if req.waited_since.is_some() || req.value.is_some() => (Some(""), Some(waited)),
            None => (None, None),
        };
        Acquire {
            lease: req.lease.as_str(),
            owner: &req.owner,
            wall: wall_ms(),
            host: &req.requester.host,
            pid: req.requester.pid,
            channel: &self.inner.channel,
            ttl: req.ttl.as_millis() as u64,
            kind: req.kind.word(),
            permits: match req.kind {
                LockKind::Permit { permits } => permits,
                _ => 0,
            },
            fair: req.fair,
            enqueue: req.enqueue,
            waiter_lease: waiter_lease(req.ttl).as_millis() as u64,
            fresh,
            released,
            waited,
            value: req.value.as_deref(),
        }
    }

    /// With `?replicas=N`: waits until N replicas have our writes so far (`WAIT`).
    async fn replicated(&self, name: &LockName) -> Result<()> {
        let (Some((want, timeout)), Conn::Single(mut conn)) =
            (self.inner.replicas, self.inner.conn.clone())
        else {
            return Ok(());
        };
        let acked: u32 = redis::cmd("WAIT")
            .arg(want)
            .arg(timeout.as_millis() as u64)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.error(e, name))?;
        if acked >= want {
            return Ok(());
        }
        Err(Error::Unavailable {
            store: self.inner.shown.clone(),
            source: format!(
                "lock \"{name}\" was granted but only {acked} of {want} replicas confirmed it within {}; it was released",
                crate::humanize(timeout)
            )
            .into(),
        })
    }
}

/// The message for a refusal by acquire.lua (its [`Conflict`]): the lock rules' own
/// words (rules.rs), or the script's text if it is not one of them.
fn refusal(answer: &str, req: &AcquireRequest) -> String {
    let ask = rules::Ask {
        owner: &req.owner,
        kind: req.kind,
        fair: req.fair,
    };
    let refusal = Conflict::decode(answer)
        .and_then(|conflict| rules::Refusal::from_code(conflict.code, &ask, conflict.met));
    match refusal {
        Some(refusal) => refusal.message(),
        None => answer.to_string(),
    }
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}
