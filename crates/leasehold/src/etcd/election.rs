//! A holder's entry rewritten in place, and the watches that hear of it: the value an
//! election's leader publishes (`proclaim`) and `watch`, an etcd watch of the queue woken
//! by any change there; a writer's downgrade to a reader, and the watch that lets the
//! readers behind it know (they otherwise wait for deletions only).

use std::time::Duration;

use super::acquisitions::{Acquisition, State};
use super::queue::*;
use super::reentry::{Holding, Role};
use super::rpc::{self, prefix_end, Compare, KeyValue};
use super::wait::{Blocker, WatchEnd};
use super::EtcdStore;
use crate::store::{AcquireRequest, Lease, LockKind, LockState, Renewal, Store};
use crate::{rules, LockName, Locked, Result};

impl EtcdStore {
    /// The election's proclamation: the holder's entry with `value`.
    pub(super) async fn proclaim_value(&self, lease: &Lease, value: &str) -> Result<Renewal> {
        self.rewrite_holder(lease, |now| {
            Ok(Some(Entry {
                value: Some(value.to_string()),
                ..now.member.entry.clone()
            }))
        })
        .await
    }

    /// A downgrade: the holder's entry as a reader's, by the lock rules. Readers waiting
    /// behind it learn it from [`downgraded`](Self::downgraded): it deletes nothing.
    pub(super) async fn downgrade_hold(&self, lease: &Lease) -> Result<Renewal> {
        self.rewrite_holder(lease, |now| {
            let entry = &now.member.entry;
            let change = rules::downgrade(entry.kind, now.count(), &entry.owner)
                .map_err(|refusal| refusal.conflict(lease.name.as_str()))?;
            Ok(change.then(|| Entry {
                kind: LockKind::Shared,
                ..entry.clone()
            }))
        })
        .await
    }

    /// Replaces the entry of the queue key that holds through `lease` (its own hold or a
    /// re-entry's) with what `change` makes of it (`None`: nothing to change): a put that
    /// keeps the key's lease, so its create revision (the token) stays, compared against
    /// the entry and the re-entries it was read with.
    async fn rewrite_holder(
        &self,
        lease: &Lease,
        change: impl Fn(&Holding) -> Result<Option<Entry>>,
    ) -> Result<Renewal> {
        let (key, create) = match self.acquisition(&lease.id) {
            Some(Acquisition {
                key,
                state: State::Held { create, .. },
                ..
            }) => (key.key_in(&lease.name), create),
            Some(_) => return Ok(Renewal::Lost),
            None => match self.find(&lease.name, &lease.id).await? {
                Some((member, _, true)) => (member.kv.key, member.kv.create_revision),
                _ => return Ok(Renewal::Lost),
            },
        };
        let holds = holds_prefix(&lease.name, create);
        loop {
            // A key that held once holds until it is deleted: nothing queues ahead of it.
            let Some(now) = self.holding(&lease.name, &key, create).await? else {
                return Ok(Renewal::Lost);
            };
            let mut compare = vec![
                Compare::modified_at(&key, now.member.kv.mod_revision),
                Compare::created_before(&holds, &prefix_end(&holds), now.revision + 1),
            ];
            match now.role(&lease.id) {
                None => return Ok(Renewal::Lost),
                Some(Role::Carrier) => {}
                // A re-entry holds while its hold key is there (etcd deletes it with its
                // lease).
                Some(Role::Reentry(hold)) => {
                    compare.push(Compare::modified_at(&hold.key, hold.mod_revision))
                }
            }
            let Some(entry) = change(&now)? else {
                return Ok(Renewal::Renewed);
            };
            let answer = self
                .call_txn(txn(compare, vec![rewrite(&key, &entry)], vec![]))
                .await?;
            if answer.succeeded {
                self.rewritten(&key, create, answer.revision());
                return Ok(Renewal::Renewed);
            }
            // Changed meanwhile (a renewal moved the key, a re-entry came or went): look
            // again.
        }
    }

    /// Our acquisitions of `key` (created at `create`) see it written at `revision`, so
    /// that a release still finds it unchanged (see [`delete_alone`](Self::delete_alone)).
    fn rewritten(&self, key: &[u8], create: i64, revision: i64) {
        let key = KeyId::of(key);
        for a in self.inner.acquisitions.locked().values_mut() {
            if let State::Held {
                create: c,
                modified,
            } = &mut a.state
            {
                if a.key == key && *c == create && *modified < revision {
                    *modified = revision;
                }
            }
        }
    }

    /// Resolves once the holders of `name` differ from `seen`: a watch of every put and
    /// deletion in the queue (grants, joins, releases, expiries, proclamations), started
    /// before each look, so a change made after the look reaches it. A broken watch (a
    /// member went away, or calls moved to another) is started again, through another
    /// member if need be; with no member left, starting it fails.
    pub(super) async fn holders_changed(&self, name: &LockName, seen: &LockState) -> Result<()> {
        let prefix = queue_prefix(name);
        let mut trouble = Duration::from_millis(50);
        loop {
            let Some((mut watch, _)) =
                (self.watch_from(&prefix, prefix_end(&prefix), 0, vec![])).await?
            else {
                // Compacted: not from now. Resolve early; the caller looks again.
                return Ok(());
            };
            let broken = loop {
                if !self.describe(name).await?.same_holders(seen) {
                    return Ok(());
                }
                match self.next_event(&mut watch).await {
                    Ok(()) => {}
                    Err(WatchEnd::Compacted) => return Ok(()),
                    Err(WatchEnd::Broken(error)) if error.is_retryable() => break error,
                    Err(WatchEnd::Broken(error)) => return Err(error),
                }
            };
            tracing::debug!(%name, error = %broken, "watch of the holders broke; watching again");
            tokio::time::sleep(trouble).await;
            trouble = (trouble * 2).min(Duration::from_secs(1));
        }
    }

    /// Resolves at the first rewrite, after revision `seen`, of a key that keeps the
    /// reader `req` out into a reader's entry: a writer's downgrade, which readers waiting
    /// behind it must hear of and which deletes nothing. A watch compacted away resolves
    /// it too: the caller looks again.
    pub(super) async fn downgraded(&self, req: &AcquireRequest, seen: i64) -> Result<()> {
        let state = self.acquisition(&req.lease).map(|a| a.state);
        let keeps_out = |key: &[u8]| match &state {
            Some(State::Queued { waiting, .. }) => waiting.ahead.contains(&KeyId::of(key)),
            Some(State::Outside {
                blocker: Blocker::Key(blocker),
            }) => key == blocker.as_slice(),
            _ => true,
        };
        let prefix = queue_prefix(&req.name);
        let end = prefix_end(&prefix);
        let puts = vec![rpc::NO_DELETE];
        let Some((mut watch, _)) = self.watch_from(&prefix, end, seen + 1, puts).await? else {
            return Ok(());
        };
        let reader = |kv: &KeyValue| {
            kv.mod_revision > kv.create_revision
                && keeps_out(&kv.key)
                && serde_json::from_slice::<Entry>(&kv.value)
                    .is_ok_and(|e| e.kind == LockKind::Shared)
        };
        loop {
            let Some(answer) = watch.message().await else {
                return Err(self.watch_ended());
            };
            let answer = match self.deletions(answer) {
                Ok(answer) => answer,
                Err(WatchEnd::Compacted) => return Ok(()),
                Err(WatchEnd::Broken(error)) => return Err(error),
            };
            if answer
                .events
                .iter()
                .filter_map(|e| e.kv.as_ref())
                .any(reader)
            {
                return Ok(());
            }
        }
    }
}
