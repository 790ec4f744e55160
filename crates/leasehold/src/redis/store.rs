//! The [`Store`] impl: each call of the trait as one script run (acquire.rs for the
//! attempts), its request from request.rs and its reply read by reply.rs.

use std::time::Duration;

use async_trait::async_trait;
use redis::Value;

use super::durability::cluster_masters;
use super::errors::failed;
use super::keys::{key, key_escape, key_unescape};
use super::reply::{self, ReleaseReply, StateReply};
use super::request::{Held, Proclaim, Release, Renew, Watch};
use super::scripts::scripts;
use super::shared::SharedConn;
use super::state::State;
use super::{Conn, RedisStore};
use crate::store::{
    busy_states, AcquireRequest, Attempt, Capabilities, Grant, Lease, LeaseId, LockState,
    RateRequest, Released, Renewal, Store, Watermark,
};
use crate::{Error, FencingToken, LockName, Locked, RateDecision, Result};

#[async_trait]
impl Store for RedisStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        Ok(self.attempt(req, None).await?.1)
    }

    async fn transfer(&self, from: &Lease, to: &AcquireRequest) -> Result<(Released, Attempt)> {
        self.attempt(to, Some(from)).await
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        let request = Renew {
            lease: lease.id.as_str(),
            ttl: ttl.as_millis() as u64,
        };
        let renewed: i64 = (self.run(&scripts().renew, &lease.name, &request.fields())).await?;
        Ok(if renewed == 1 {
            Renewal::Renewed
        } else {
            Renewal::Lost
        })
    }

    async fn release(&self, lease: &Lease) -> Result<Released> {
        let request = Release {
            lease: lease.id.as_str(),
            channel: &self.inner.channel,
        };
        let reply: Value = (self.run(&scripts().release, &lease.name, &request.fields())).await?;
        let reply = ReleaseReply::decode(&reply)?;
        self.inner.waiters.forget(lease.id.as_str());
        // A hand-over to a waiter of this client: no need to wait for a message.
        (reply.own.split(','))
            .filter(|item| !item.is_empty())
            .for_each(|item| self.inner.waiters.deliver(item));
        Ok(reply.released)
    }

    async fn changed(&self, req: &AcquireRequest, _since: Watermark) -> Result<Option<Grant>> {
        // A message naming this acquisition (kept if it came before we got here).
        let slot = self.inner.waiters.register(&req.lease);
        slot.wake.notified().await;
        let handover = slot.granted.locked().take();
        if self.inner.replicas.is_some() {
            // The grant was written by another client, whose writes our WAIT does not
            // cover: come and take it (rewriting it), then wait for the replicas.
            return Ok(None);
        }
        Ok(handover.map(|handover| {
            self.inner.waiters.forget(req.lease.as_str());
            Grant {
                token: FencingToken(handover.token),
                holds: 1,
                lease: Some(Duration::from_millis(handover.lease_ms)),
            }
        }))
    }

    async fn ended(&self, lease: &Lease) -> Result<()> {
        let slot = self.inner.waiters.register(&lease.id);
        let request = Held {
            lease: lease.id.as_str(),
        };
        loop {
            let (gone, look_again) = (slot.gone.notified(), slot.look_again.notified());
            tokio::pin!(gone, look_again);
            gone.as_mut().enable();
            look_again.as_mut().enable();
            let held = (self.run::<i64>(&scripts().held, &lease.name, &request.fields())).await;
            match held {
                Ok(1) => {}
                Ok(_) => return Ok(()),
                // The server is away: ask again when the subscription is back.
                Err(error) => tracing::debug!(%error, "cannot tell whether a hold ended yet"),
            }
            // After a reconnection, ask again at once: a server that restarted without
            // its data has no hold, and the holder must learn it now, not at its next
            // renewal (meanwhile another client may be granted the lock).
            tokio::select! {
                _ = gone => return Ok(()),
                _ = look_again => {}
            }
        }
    }

    async fn proclaim(&self, lease: &Lease, value: &str) -> Result<Renewal> {
        let request = Proclaim {
            lease: lease.id.as_str(),
            value,
        };
        let done: i64 = (self.run(&scripts().proclaim, &lease.name, &request.fields())).await?;
        Ok(if done == 1 {
            Renewal::Renewed
        } else {
            Renewal::Lost
        })
    }

    async fn downgrade(&self, lease: &Lease) -> Result<Renewal> {
        let request = Held {
            lease: lease.id.as_str(),
        };
        let reply: redis::Value =
            (self.run(&scripts().downgrade, &lease.name, &request.fields())).await?;
        reply::downgrade(&reply, &lease.name)
    }

    /// Notes a watcher in the lock's record and looks, in one script; then waits for a
    /// message naming it (scripts that change the holders publish one), a resubscription,
    /// or the time to refresh the entry, and looks again. A look that fails (the server
    /// is away) is the error.
    async fn watch(&self, name: &LockName, seen: &LockState) -> Result<()> {
        let watcher = Watcher::new(self, name);
        loop {
            // Registered before the look: a message that comes after it is kept.
            let state = self.watching(name, &watcher.id, WATCHER_TTL).await?;
            if !state.same_holders(seen) {
                return Ok(());
            }
            tokio::select! {
                _ = watcher.slot.wake.notified() => {}
                _ = tokio::time::sleep(WATCHER_TTL / 3) => {}
            }
        }
    }

    async fn describe(&self, name: &LockName) -> Result<LockState> {
        let reply: Value = self.run(&scripts().describe, name, &[]).await?;
        self.state(name, &reply)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockState>> {
        let mut pattern = String::from("lh:{");
        for c in key_escape(prefix).chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                pattern.push('\\');
            }
            pattern.push(c);
        }
        pattern.push('*');
        let keys = self.scan(&pattern).await?;
        // A lock in use has its record or its hold key (`}` ends the tag: names escape it).
        let names: std::collections::BTreeSet<_> = keys
            .iter()
            .filter_map(|k| {
                let tagged = k.strip_prefix("lh:{")?;
                let name = (tagged.strip_suffix('}')).or_else(|| tagged.strip_suffix("}:hold"))?;
                LockName::new(key_unescape(name)).ok()
            })
            .collect();
        busy_states(self, names.into_iter().collect()).await
    }

    async fn force_release(&self, name: &LockName) -> Result<bool> {
        let held: i64 = self.run(&scripts().force, name, &[]).await?;
        Ok(held == 1)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            cross_process: true,
            reclaims_dead_processes: false,
            fair_by_default: false,
            queues_by_wait: true,
            failed_calls_change_nothing: false,
            keeps_waiters_alive: false,
        }
    }

    fn describe_store(&self) -> String {
        self.inner.shown.clone()
    }

    fn caveat(&self) -> Option<String> {
        self.inner.caveat.clone()
    }

    /// `rate.lua`: one EVALSHA, one round trip, on the server's clock.
    async fn rate(&self, req: &RateRequest) -> Result<RateDecision> {
        self.rate_decision(req).await
    }
}

/// How long a watcher's entry lasts unless refreshed (a third of it): what a client that
/// dies while watching leaves behind.
const WATCHER_TTL: Duration = Duration::from_secs(15);

/// One [`Store::watch`] call: its entry in the lock's record and its slot among the
/// client's waiters, both removed when it ends (the entry by a spawned script run, as
/// a cancelled call cannot wait for one; it expires anyway).
struct Watcher {
    store: RedisStore,
    name: LockName,
    id: LeaseId,
    slot: std::sync::Arc<super::waker::Slot>,
}

impl Watcher {
    fn new(store: &RedisStore, name: &LockName) -> Self {
        // Not a lease id (32 hex digits), nor a message's separator (`,` `=` `!`).
        let id = LeaseId::from(format!("watch:{}", LeaseId::random().as_str()).as_str());
        let slot = store.inner.waiters.register(&id);
        Watcher {
            store: store.clone(),
            name: name.clone(),
            id,
            slot,
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.store.inner.waiters.forget(self.id.as_str());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (store, name, id) = (self.store.clone(), self.name.clone(), self.id.clone());
            runtime.spawn(async move {
                if let Err(error) = store.watching(&name, &id, Duration::ZERO).await {
                    tracing::debug!(%error, "a watcher's entry is left to expire");
                }
            });
        }
    }
}

impl RedisStore {
    /// The lock after watch.lua has noted the watcher `id` for `ttl` (removed it: zero).
    async fn watching(&self, name: &LockName, id: &LeaseId, ttl: Duration) -> Result<LockState> {
        let request = Watch {
            id: id.as_str(),
            channel: &self.inner.channel,
            ttl: ttl.as_millis() as u64,
        };
        let reply: Value = (self.run(&scripts().watch, name, &request.fields())).await?;
        self.state(name, &reply)
    }

    /// The lock as describe.lua's `reply` shows it.
    fn state(&self, name: &LockName, reply: &Value) -> Result<LockState> {
        let reply = StateReply::decode(reply)?;
        let state = State::read(&reply).map_err(|e| Error::Corrupt {
            store: self.inner.shown.clone(),
            name: name.to_string(),
            reason: format!("key {} does not hold a leasehold record ({e})", key(name)),
        })?;
        Ok(state.shown(name, reply.now))
    }

    /// Every key of ours that matches `pattern`, from each master when clustered.
    async fn scan(&self, pattern: &str) -> Result<Vec<String>> {
        let unavailable = |e: redis::RedisError| failed(&self.inner.shown, e);
        let mut conns = Vec::new();
        match self.inner.conn.clone() {
            Conn::Single(c) => conns.push(c),
            Conn::Cluster(mut c, prefix) => {
                let masters = cluster_masters(&mut c).await.map_err(unavailable)?;
                // A master that is down holds keys nobody can read: a listing without
                // them would say less than there is.
                if let Some(down) = masters.down.first() {
                    return Err(Error::Unavailable {
                        store: self.inner.shown.clone(),
                        source: format!(
                            "cluster master {down} is down; its locks cannot be listed"
                        )
                        .into(),
                    });
                }
                for addr in masters.up {
                    let client =
                        redis::Client::open(format!("{prefix}{addr}")).map_err(unavailable)?;
                    let master = client.get_connection_manager().await.map_err(unavailable)?;
                    conns.push(SharedConn::new(master, None, 0));
                }
            }
        }
        let mut keys = Vec::new();
        for mut conn in conns {
            let mut iter = redis::AsyncCommands::scan_match::<_, String>(&mut conn, pattern)
                .await
                .map_err(unavailable)?;
            while let Some(k) = iter.next_item().await {
                keys.push(k.map_err(unavailable)?);
            }
        }
        Ok(keys)
    }
}
