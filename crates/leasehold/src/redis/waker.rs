//! Waking waiters: one subscription per client, to a channel of its own, on which the
//! scripts name the acquisitions that may now get in (see `notify` in common.lua).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_util::task::AbortOnDropHandle;

use super::errors::failed;
use crate::store::{ByLease, LeaseId};
use crate::{Error, Locked, Result};

/// This client's waiting acquisitions, by lease id, woken by messages naming them.
#[derive(Debug, Default)]
pub(super) struct Waiters(Mutex<ByLease<Arc<Slot>>>);

/// One waiting acquisition: woken, and told its token if the lock was handed to it.
#[derive(Debug, Default)]
pub(super) struct Slot {
    pub(super) wake: Notify,
    /// The lock, if a script handed it over.
    pub(super) granted: Mutex<Option<Handover>>,
    /// Told when the hold was taken away (force-release).
    pub(super) gone: Notify,
    /// Told after every (re)subscription: messages may have been missed, and a server
    /// that came back may have forgotten the hold.
    pub(super) look_again: Notify,
    /// An attempt was sent: the acquisition may be queued.
    pub(super) sent: AtomicBool,
}

/// A lock handed over by a script (`LEASE=TOKEN:MS`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Handover {
    pub(super) token: u64,
    /// The hold's lease: what was left of the waiter's.
    pub(super) lease_ms: u64,
}

impl Waiters {
    fn map(&self) -> std::sync::MutexGuard<'_, ByLease<Arc<Slot>>> {
        self.0.locked()
    }

    pub(super) fn register(&self, lease: &LeaseId) -> Arc<Slot> {
        self.map().entry(lease.clone()).or_default().clone()
    }

    pub(super) fn forget(&self, lease: &str) {
        self.map().remove(lease);
    }

    /// One item of a message: `LEASE` (look again), `LEASE=TOKEN:MS` (handed over
    /// with a lease of MS) or `LEASE!` (the hold was taken away). `notify_one` keeps the
    /// wake-up for a waiter that is between two looks.
    pub(super) fn deliver(&self, item: &str) {
        if let Some(lease) = item.strip_suffix('!') {
            if let Some(slot) = self.map().get(lease) {
                slot.gone.notify_one();
            }
            return;
        }
        let (lease, handover) = match item.split_once('=') {
            Some((lease, grant)) => {
                let parsed = grant.split_once(':').and_then(|(token, ms)| {
                    Some(Handover {
                        token: token.parse().ok()?,
                        lease_ms: ms.parse().ok()?,
                    })
                });
                (lease, parsed)
            }
            None => (item, None),
        };
        if let Some(slot) = self.map().get(lease) {
            if handover.is_some() {
                *slot.granted.locked() = handover;
            }
            slot.wake.notify_one();
        }
    }

    fn wake_all(&self) {
        self.map().values().for_each(|s| {
            s.wake.notify_one();
            s.look_again.notify_waiters();
        });
    }
}

/// Subscribes to `channel` through `client` (waiting 5 s at most for the first
/// subscription): this client's waiters, and the task that wakes them while it lives.
pub(super) async fn subscribed(
    client: redis::Client,
    channel: &str,
    shown: &str,
) -> Result<(Arc<Waiters>, AbortOnDropHandle<()>)> {
    let waiters = Arc::new(Waiters::default());
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let subscriber = tokio::spawn(subscribe(
        client,
        channel.to_string(),
        waiters.clone(),
        ready_tx,
    ));
    match tokio::time::timeout(Duration::from_secs(5), ready_rx).await {
        Ok(Ok(Ok(()))) => Ok((waiters, AbortOnDropHandle::new(subscriber))),
        Ok(Ok(Err(e))) => Err(failed(shown, e)),
        _ => Err(Error::Unavailable {
            store: shown.to_string(),
            source: "no answer to SUBSCRIBE within 5s".into(),
        }),
    }
}

/// The subscription task: one connection, one channel, reconnecting as needed. After
/// every (re)subscription all waiters look again, since messages may have been missed.
async fn subscribe(
    client: redis::Client,
    channel: String,
    waiters: Arc<Waiters>,
    ready: tokio::sync::oneshot::Sender<redis::RedisResult<()>>,
) {
    let mut ready = Some(ready);
    loop {
        let subscribed = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        }
        .await;
        match subscribed {
            Ok(mut pubsub) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Ok(()));
                }
                waiters.wake_all();
                let mut messages = pubsub.on_message();
                while let Some(msg) = messages.next().await {
                    if let Ok(leases) = msg.get_payload::<String>() {
                        leases.split(',').for_each(|item| waiters.deliver(item));
                    }
                }
                tracing::debug!("redis subscription ended; reconnecting");
            }
            Err(e) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Err(e));
                    return;
                }
                tracing::debug!(error = %e, "redis subscription failed; retrying");
            }
        }
        waiters.wake_all();
        tokio::time::sleep(crate::keepalive::jitter(Duration::from_millis(200))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_wakes_the_acquisitions_it_names_and_hands_over_with_a_token() {
        let waiters = Waiters::default();
        let (a, b) = (LeaseId::from("a"), LeaseId::from("b"));
        let (slot_a, slot_b) = (waiters.register(&a), waiters.register(&b));
        "a=17:900,b,x".split(',').for_each(|i| waiters.deliver(i));
        let handed = Handover {
            token: 17,
            lease_ms: 900,
        };
        assert_eq!(*slot_a.granted.locked(), Some(handed));
        assert_eq!(*slot_b.granted.locked(), None);
        waiters.forget("a");
        waiters.deliver("a=18:1");
        assert_eq!(
            *slot_a.granted.locked(),
            Some(handed),
            "forgotten: not told"
        );
    }
}
