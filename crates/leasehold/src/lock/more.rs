//! What users of tokio's semaphore and `RwLock` reach for, on top of single acquisitions:
//! several permits at once, the free permits, a write lock downgraded to a read lock.

use std::time::Duration;

use tokio::time::Instant;

use super::Lock;
use crate::store::{Attempt, LockKind};
use crate::{Error, LockGuard, Released, Result};

impl Lock {
    /// How many of this semaphore's permits nobody holds now (a snapshot: it may change
    /// at once). [`Error::InvalidOption`] for a lock that is not a semaphore.
    pub async fn free_permits(&self) -> Result<u32> {
        let LockKind::Permit { permits } = self.kind else {
            return Err(Error::option(
                "free_permits",
                "only a semaphore has permits",
            ));
        };
        let state = self.store.describe(&self.name).await?;
        let held = state.holders.len() as u32;
        Ok(permits.saturating_sub(held))
    }

    /// `n` permits of this semaphore, each its own guard (its own lease and token),
    /// waiting as long as it takes. Acquirers of several permits take them one at a time,
    /// one acquirer after another (behind a lock of the name with `#many` appended), so
    /// two of them never each hold part of what both wait for; single permits are not
    /// held up by it. With an owner id, permit `i` is held as `OWNER#i`.
    ///
    /// # Cancel safety
    /// Cancel-safe: permits taken so far are released in the background.
    pub async fn lock_many(&self, n: u32) -> Result<Vec<LockGuard>> {
        self.many(n, None).await.map(|g| g.unwrap_or_default())
    }

    /// As [`lock_many`](Self::lock_many), giving up (releasing what it took) after
    /// `wait`.
    pub async fn try_lock_many_for(
        &self,
        n: u32,
        wait: Duration,
    ) -> Result<Option<Vec<LockGuard>>> {
        self.many(n, Some(Instant::now() + wait)).await
    }

    async fn many(&self, n: u32, deadline: Option<Instant>) -> Result<Option<Vec<LockGuard>>> {
        let LockKind::Permit { permits } = self.kind else {
            return Err(Error::option(
                "permits",
                "only a semaphore has several permits",
            ));
        };
        if n == 0 || n > permits {
            let why = format!("asked for {n} of a semaphore of {permits}: ask for 1 to {permits}");
            return Err(Error::option("permits", why));
        }
        let turn_name = crate::LockName::new(format!("{}#many", self.name))?;
        let turn = Lock {
            name: turn_name,
            kind: LockKind::Exclusive,
            owner: None,
            on_wait: None,
            value: None,
            ..self.clone()
        };
        let left = |deadline: Option<Instant>| {
            deadline.map(|d| d.saturating_duration_since(Instant::now()))
        };
        let turn = match left(deadline) {
            None => Some(turn.lock().await?),
            Some(wait) => turn.try_lock_for(wait).await?,
        };
        let Some(turn) = turn else { return Ok(None) };
        let mut taken = Vec::with_capacity(n as usize);
        for i in 1..=n {
            let permit = match &self.owner {
                Some(owner) => self.clone().with_owner(format!("{owner}#{i}")),
                None => self.clone(),
            };
            let guard = match left(deadline) {
                None => Some(permit.lock().await?),
                Some(wait) => permit.try_lock_for(wait).await?,
            };
            match guard {
                Some(guard) => taken.push(guard),
                // Dropping `taken` releases them, in the background.
                None => return Ok(None),
            }
        }
        let _ = turn.release().await;
        Ok(Some(taken))
    }

    /// Turns `write`, a write (or mutex) hold of this read lock's name, into a read hold
    /// under the same owner, in one store step: no writer can come in between, and the
    /// readers waiting are let in with it. The read hold is a new acquisition, with a new,
    /// higher token.
    ///
    /// [`Error::Lost`] if the write hold had already ended (its work since the safe
    /// deadline was not protected); the read hold taken in that step is released. On a
    /// store error the write guard is dropped, so released in the background.
    pub async fn downgrade(&self, write: LockGuard) -> Result<LockGuard> {
        if self.kind != LockKind::Shared
            || write.kind() != LockKind::Exclusive
            || write.name() != &self.name
        {
            let why = "downgrade takes a write guard of this read lock's name";
            return Err(Error::option("downgrade", why));
        }
        let mut req = self.request(false)?;
        req.owner = write.owner().to_string();
        // A downgrade must not queue behind waiting writers: it holds the lock already.
        req.fair = false;
        let sent = Instant::now();
        let call = self.store.transfer(write.lease(), &req);
        let (released, attempt) = self.meter.store_call("transfer", call).await?;
        let token = write.token();
        let _ = write.leak();
        let read = match attempt {
            Attempt::Granted(grant) => self.guard(&req, grant, sent),
            Attempt::Busy(_) => {
                return Err(Error::Internal(format!(
                    "lock \"{}\": a downgrade found the lock taken",
                    self.name
                )))
            }
        };
        if released == Released::NotHeld {
            let _ = read.release().await;
            return Err(Error::Lost {
                name: self.name.to_string(),
                token: token.0,
                reason: "the write hold had ended before the downgrade".into(),
            });
        }
        Ok(read)
    }
}
