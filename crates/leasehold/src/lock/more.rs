//! What users of tokio's semaphore reach for, on top of single acquisitions: several
//! permits at once, and the free permits.

use std::time::Duration;

use tokio::time::Instant;

use super::Lock;
use crate::store::LockKind;
use crate::{Error, LockGuard, Result};

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
        let state = self.client.store.describe(&self.name).await?;
        let held = state.holders.len() as u32;
        Ok(permits.saturating_sub(held))
    }

    /// `n` permits of this semaphore, each its own guard (its own lease and token),
    /// waiting as long as it takes. Acquirers of several permits take them one at a time,
    /// one acquirer after another (behind the lock `NAME#many`; do not use that name), so
    /// two of them never each hold part of what both wait for; single permits are not
    /// held up by it. A permit lost while the others are waited for (the store stalled
    /// past its lease) is taken again: no guard returned is lost already. With an owner
    /// id, permit `i` is held as `OWNER#i`.
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
        // A wait too long to add to now is no limit, as in `try_lock_for`.
        self.many(n, Instant::now().checked_add(wait)).await
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
        let turn_name = turn_name(&self.name)?;
        let turn = Lock {
            name: turn_name,
            kind: LockKind::Exclusive,
            extras: None,
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
        // Permit `i` in slot `i - 1`. A permit lost while the others are waited for (its
        // renewals failed: the store stalled) is taken again, so that no guard returned
        // is lost already.
        let mut slots: Vec<Option<LockGuard>> = (0..n).map(|_| None).collect();
        while let Some(empty) = slots
            .iter()
            .position(|s| s.as_ref().is_none_or(|g| g.check().is_err()))
        {
            slots[empty] = None;
            let permit = match &self.extras().owner {
                Some(owner) => self.clone().with_owner(format!("{owner}#{}", empty + 1)),
                None => self.clone(),
            };
            let guard = match left(deadline) {
                None => Some(permit.lock().await?),
                Some(wait) => permit.try_lock_for(wait).await?,
            };
            match guard {
                Some(guard) => slots[empty] = Some(guard),
                None => {
                    // Given back before saying so, so that the caller finds them free.
                    for guard in slots.into_iter().flatten() {
                        let _ = guard.release().await;
                    }
                    return Ok(None);
                }
            }
        }
        let taken: Vec<LockGuard> = slots.into_iter().flatten().collect();
        let _ = turn.release().await;
        Ok(Some(taken))
    }
}

/// The lock acquirers of several permits of `name` take turns behind: `NAME#many`, or
/// for a name too long for that, `#many#` and a hash of it (FNV-1a: the same in every
/// process).
fn turn_name(name: &crate::LockName) -> Result<crate::LockName> {
    let plain = format!("{name}#many");
    if plain.len() <= crate::MAX_NAME_LEN {
        return crate::LockName::new(plain);
    }
    let hash = (name.as_str().bytes()).fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    crate::LockName::new(format!("#many#{hash:016x}"))
}
