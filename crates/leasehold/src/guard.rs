//! The guard of a held lock.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{sleep_until, Instant};
use tokio_util::task::TaskTracker;

use crate::gate::Turn;
use crate::keepalive::{Lifeline, Renewals, Status};
use crate::metrics::Call;
use crate::options::{check_ttl, humanize};
use crate::store::{AcquireRequest, Grant, Lease, LockKind, Released, Renewal, Store};
use crate::{Error, FencingToken, LockName, Result};

/// A held lock. Renewed in the background while it lives.
///
/// Release it with [`release`](Self::release). Dropping it stops the renewal and makes a
/// best-effort release on the current tokio runtime, if there is one; the only promise
/// is that the lease then expires within its TTL.
///
/// Its `Debug` form is one short line for logs: name, token, owner, kind, holds, and how
/// long the lock is provably held (or why it is lost).
#[must_use = "the lock is released (best effort) as soon as the guard is dropped"]
pub struct LockGuard {
    /// Boxed: a task that waits for a lock and then releases it carries the guard and its
    /// release's future for as long as it waits (thousands of them, on busy names).
    held: Option<Box<Held>>,
}

impl std::fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some(held) = &self.held else {
            return f.write_str("LockGuard { ended }");
        };
        let mut out = f.debug_struct("LockGuard");
        out.field("name", &held.line.lease.name)
            .field("token", &held.token.0)
            .field("owner", &held.owner)
            .field("kind", &held.kind)
            .field("holds", &held.holds);
        show_status(&mut out, &held.status.borrow());
        out.finish()
    }
}

/// How a guard's status shows in `Debug` (the guard's and its [`Deadlines`]'): how long
/// the hold is safe for, or why it is lost; and whether renewals are failing.
fn show_status(out: &mut std::fmt::DebugStruct<'_, '_>, status: &Status) {
    let now = Instant::now();
    match &status.lost {
        Some(reason) => out.field("lost", reason),
        None if now >= status.valid_until => out.field(
            "lost",
            &format_args!(
                "safe deadline passed {} ago",
                humanize(now - status.valid_until)
            ),
        ),
        None => out.field(
            "valid_for",
            &format_args!("{}", humanize(status.valid_until - now)),
        ),
    };
    if status.failing {
        out.field("renewal_failing", &true);
    }
}

struct Held {
    line: Arc<Lifeline>,
    status: watch::Receiver<Status>,
    token: FencingToken,
    holds: u32,
    kind: LockKind,
    owner: Arc<str>,
    acquired: Instant,
    /// Where the release runs when the guard is dropped (see `Leasehold::shutdown`).
    tasks: TaskTracker,
}

impl LockGuard {
    /// The guard of `grant`, answered to `req` by `acquired`.
    pub(crate) fn start(
        line: Arc<Lifeline>,
        (renewals, tasks): (&Arc<Renewals>, &TaskTracker),
        grant: &Grant,
        req: &AcquireRequest,
        acquired: Instant,
    ) -> Self {
        let status = line.status.subscribe();
        renewals.add(&line);
        line.start_holding(acquired);
        LockGuard {
            held: Some(Box::new(Held {
                line,
                status,
                token: grant.token,
                holds: grant.holds,
                kind: req.kind,
                owner: req.owner.clone(),
                acquired,
                tasks: tasks.clone(),
            })),
        }
    }

    /// The hold came through this process's gate with `turn` (see
    /// [`Lifeline::keep_turn`]).
    pub(crate) fn with_turn(self, turn: Option<Turn>) -> Self {
        if let (Some(held), Some(turn)) = (self.held.as_ref(), turn) {
            held.line.keep_turn(turn);
        }
        self
    }

    /// When the store's grant was seen.
    pub(crate) fn acquired_at(&self) -> Instant {
        self.held().acquired
    }

    fn held(&self) -> &Held {
        // Only `release` and `leak` take it, and they consume the guard.
        self.held.as_ref().expect("guard is held until consumed")
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.held().line.lease.name
    }

    /// The fencing token of this acquisition. Prefer [`check`](Self::check) right before
    /// using it, which fails once the lock can no longer be proven held.
    pub fn token(&self) -> FencingToken {
        self.held().token
    }

    /// The owner id this lock is held under (the re-entry key).
    pub fn owner(&self) -> &str {
        &self.held().owner
    }

    /// How many holds this owner had right after this acquisition (1 unless re-entered).
    pub fn holds(&self) -> u32 {
        self.held().holds
    }

    /// Exclusive, shared or permit.
    pub fn kind(&self) -> LockKind {
        self.held().kind
    }

    /// The lease this guard holds (name and acquisition id).
    pub fn lease(&self) -> &Lease {
        &self.held().line.lease
    }

    /// The token, if the lock is provably held at this instant; otherwise
    /// [`Error::Lost`]. Judged against the clock at the call, so a process that resumes
    /// from a long pause learns of the loss here before its renewal task runs.
    pub fn check(&self) -> Result<FencingToken> {
        let held = self.held();
        let status = held.status.borrow();
        let now = Instant::now();
        if !status.is_lost(now) {
            return Ok(held.token);
        }
        let reason = status.lost.clone().unwrap_or_else(|| {
            format!(
                "its safe deadline passed {} ago without a confirmed renewal",
                humanize(now - status.valid_until)
            )
        });
        Err(Error::Lost {
            name: held.line.lease.name.to_string(),
            token: held.token.0,
            reason,
        })
    }

    /// Until when the lock is provably held, given the renewals confirmed so far, as a
    /// [`tokio::time::Instant`] (`.into_std()` gives a `std::time::Instant`).
    pub fn valid_until(&self) -> Instant {
        self.held().status.borrow().valid_until
    }

    /// Follows the safe deadline as confirmed renewals move it, e.g. to log renewals.
    pub fn deadlines(&self) -> Deadlines {
        let mut status = self.held().status.clone();
        status.mark_unchanged();
        Deadlines(status)
    }

    /// Whether the lock can no longer be proven held.
    pub fn is_lost(&self) -> bool {
        self.held().status.borrow().is_lost(Instant::now())
    }

    /// Resolves once the lock can no longer be proven held: at the safe deadline if no
    /// renewal was confirmed by then, or at once when the store says the lease is gone.
    ///
    /// The first call starts one watch of the store for this guard; every later call,
    /// however often it is polled anew (in a `select!` loop), only watches its status.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only watches.
    pub async fn lost(&self) {
        // One watch of the store per guard, however often this is polled anew.
        self.held().line.watch_ended();
        self.deadline_or_known_loss().await
    }

    /// Whether the last renewal attempt failed (an error, or no answer within its
    /// budget) with none confirmed since: the lock may be lost at its safe deadline.
    pub fn renewal_failing(&self) -> bool {
        self.held().status.borrow().failing
    }

    /// Resolves once renewals are failing and the lock can be proven held for less than
    /// `margin` more (or it is lost): the moment to stop work that must end before anyone
    /// else can hold the lock, with `margin` left to stop it. A lease that is short only
    /// because it was just handed over, or that is being renewed normally, is not at risk.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only watches.
    pub async fn at_risk(&self, margin: Duration) {
        let mut status = self.held().status.clone();
        loop {
            let (failing, valid_until) = {
                let s = status.borrow_and_update();
                if s.is_lost(Instant::now()) {
                    return;
                }
                (s.failing, s.valid_until)
            };
            let warn_at = valid_until.checked_sub(margin).unwrap_or(valid_until);
            if failing && Instant::now() >= warn_at {
                return;
            }
            tokio::select! {
                _ = sleep_until(warn_at), if failing => {}
                _ = sleep_until(valid_until) => return,
                changed = status.changed() => {
                    if changed.is_err() {
                        // The renewal task is gone; nothing will move the deadline.
                        sleep_until(valid_until.min(warn_at)).await;
                        return;
                    }
                }
            }
        }
    }

    /// Resolves at the safe deadline, or once the lease is known to be gone.
    async fn deadline_or_known_loss(&self) {
        deadline_or_known_loss(self.held().status.clone()).await
    }

    /// A handle on this lock's loss, cheap to clone into spawned tasks: it watches the
    /// same local state as [`lost`](Self::lost) (no store call per poll) and outlives
    /// neither the guard's meaning nor its deadline — once the guard is released or
    /// dropped it reads as lost.
    pub fn lost_signal(&self) -> LostSignal {
        let held = self.held();
        held.line.watch_ended();
        LostSignal(held.status.clone())
    }

    /// Runs `work` while the lock is held: its output, or [`Error::Lost`] (with `work`
    /// dropped, so cancelled at its next await) once the lock can no longer be proven
    /// held. A guard already lost never polls `work` at all, and the loss is looked at
    /// before each poll of it.
    ///
    /// # Cancel safety
    /// Cancelling drops `work`; the lock stays held.
    pub async fn run_while_held<F: std::future::Future>(&self, work: F) -> Result<F::Output> {
        self.check()?;
        tokio::select! {
            biased;
            _ = self.lost() => Err(self.check().err().unwrap_or_else(|| Error::Lost {
                name: self.name().to_string(),
                token: self.token().0,
                reason: "it can no longer be proven held".into(),
            })),
            output = work => Ok(output),
        }
    }

    /// Renews now with a new TTL, which later renewals also use.
    ///
    /// # Cancel safety
    /// Cancelling may leave the lease renewed with either TTL; the safe deadline is
    /// only moved by a confirmed renewal.
    pub async fn extend(&self, ttl: Duration) -> Result<()> {
        let ttl = check_ttl(ttl)?;
        match self.held().line.renew(ttl).await? {
            Renewal::Renewed => Ok(()),
            Renewal::Lost => self.check().map(|_| ()),
        }
    }

    /// Turns this write hold into a read hold in place: the same lease, token and
    /// renewal, with nobody let in between (unlike a release and a new read). Readers
    /// waiting for it are let in at once; writers wait until it is released. Writers of
    /// this process waiting behind this one (tasks without an owner id queue in the
    /// process first) join the store's queue before the downgrade, so readers that came
    /// after them wait: in fair mode by arrival; in non-fair mode, readers already in the
    /// store's queue before they joined it come in first.
    ///
    /// Only a write (or mutex) hold that is its owner's only hold can be: a read hold
    /// or a permit is [`Error::InvalidOption`], and an owner holding the lock more than
    /// once is [`Error::Conflict`] (its holds are one holder: the others would turn
    /// shared under guards that count on holding alone). Both leave the guard as it was.
    /// [`Error::Lost`] if the hold was gone.
    ///
    /// ```
    /// # async fn job(locks: leasehold::Leasehold) -> leasehold::Result<()> {
    /// let mut guard = locks.write("config")?.lock().await?;
    /// // ... write the new config ...
    /// guard.downgrade().await?;
    /// // ... read it back beside other readers; no writer gets in before the release ...
    /// let _ = guard.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// If cancelled, or on another error (the store could not be reached), the store may
    /// or may not have made the hold shared: the guard is then lost (its `check` fails)
    /// and should be dropped.
    pub async fn downgrade(&mut self) -> Result<()> {
        match self.kind() {
            LockKind::Exclusive => {}
            LockKind::Shared => {
                return Err(Error::option(
                    "downgrade",
                    "the guard is a read hold already",
                ))
            }
            LockKind::Permit { .. } => {
                return Err(Error::option(
                    "downgrade",
                    "a semaphore's permit has no read hold",
                ))
            }
        }
        self.check()?;
        let line = self.held().line.clone();
        // Writers of this process waiting behind this one at its gate are not in the
        // store's queue: the next joins it first, so that readers arriving after it
        // do not pass it (fair ones keep their place by arrival).
        if let Some(turn) = line.take_turn() {
            turn.queue_next(line.store.as_ref()).await;
        }
        let unanswered = Unanswered(Some(line.clone()));
        let answer = line.store.downgrade(&line.lease).await;
        // After any other answer (or if this call is dropped while it waits) the hold may
        // have turned shared or not: `unanswered` marks the guard lost when dropped.
        if matches!(answer, Ok(_) | Err(Error::Conflict { .. })) {
            unanswered.answered();
        }
        match answer {
            Ok(Renewal::Renewed) => {
                if let Some(held) = self.held.as_mut() {
                    held.kind = LockKind::Shared;
                }
                Ok(())
            }
            Ok(Renewal::Lost) => {
                self.gone("the store no longer has this hold (found by a downgrade)");
                self.check().map(|_| ())
            }
            // A refusal by the lock rules changed nothing.
            Err(error) => Err(error),
        }
    }

    /// The store said the hold is gone (found by a call other than a renewal): the guard
    /// is lost from now on.
    pub(crate) fn gone(&self, reason: &str) {
        self.held()
            .line
            .mark_lost(crate::metrics::Loss::Gone, reason);
    }

    /// Releases this hold (the lock is free once its owner's last hold is released).
    /// `Released::NotHeld` means the lease had already ended: work done since its safe
    /// deadline was not protected. (Cautiously, it is also the answer when a release
    /// sent again after a dropped connection finds that its first send had released the
    /// hold: the store cannot tell the two apart.)
    ///
    /// If the store cannot be reached ([`Error::is_retryable`]), the error is returned and
    /// the release is sent again in the background until the store answers (for at least
    /// a minute, or ten TTLs): the lock frees as soon as the store is back, not when the
    /// lease ends, and a later acquisition by the same owner does not re-enter the hold.
    ///
    /// # Cancel safety
    /// If cancelled, the release may or may not have reached the store; the lease
    /// expires in any case.
    pub async fn release(self) -> Result<Released> {
        // Boxed, all of it but the guard: a task that waits for a lock and then releases
        // it carries the larger of the two futures while it waits (thousands of waiters,
        // on a busy name).
        Box::pin(self.release_boxed()).await
    }

    async fn release_boxed(mut self) -> Result<Released> {
        let held = self.held.take().expect("guard is held until consumed");
        held.line.close();
        tokio::task::consume_budget().await;
        let released = release(held.line.clone(), &held.tasks).await?;
        tracing::debug!(
            lock = %held.line.lease.name,
            token = held.token.0,
            held = ?held.acquired.elapsed(),
            not_held = (released == Released::NotHeld),
            "released"
        );
        Ok(released)
    }

    /// Stops renewing and forgets the lock without releasing it: it stays held until its
    /// lease expires. Returns the lease so it can be released elsewhere.
    pub fn leak(mut self) -> Lease {
        let held = self.held.take().expect("guard is held until consumed");
        held.line.close();
        // The lock stays held, but not by a task of this process: the next asks the store.
        drop(held.line.take_turn());
        held.line.lease.clone()
    }
}

/// Marks a guard lost when dropped before [`answered`](Self::answered): a downgrade with
/// no answer may or may not have made the hold shared.
struct Unanswered(Option<Arc<Lifeline>>);

impl Unanswered {
    fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(line) = self.0.take() {
            let why = "a downgrade got no answer, so the hold may be shared";
            line.mark_lost(crate::metrics::Loss::Gone, why);
        }
    }
}

/// Resolves at the safe deadline that `status` carries, or once it says the lease is
/// gone (a renewal found it gone, the store said so, or the guard ended).
async fn deadline_or_known_loss(mut status: watch::Receiver<Status>) {
    loop {
        let valid_until = {
            let s = status.borrow_and_update();
            if s.is_lost(Instant::now()) {
                return;
            }
            s.valid_until
        };
        tokio::select! {
            _ = sleep_until(valid_until) => {}
            changed = status.changed() => {
                if changed.is_err() {
                    // The guard is gone: so is the lock, as far as its holder knows.
                    return;
                }
            }
        }
    }
}

/// A lock's loss, to watch from other tasks (see [`LockGuard::lost_signal`]). Clone it
/// freely; every clone watches the same guard.
#[derive(Clone, Debug)]
pub struct LostSignal(watch::Receiver<Status>);

impl LostSignal {
    /// Whether the lock can no longer be proven held (or its guard has ended).
    pub fn is_lost(&self) -> bool {
        self.0.has_changed().is_err() || self.0.borrow().is_lost(Instant::now())
    }

    /// Resolves once the lock can no longer be proven held, or its guard has ended.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only watches.
    pub async fn lost(&self) {
        deadline_or_known_loss(self.0.clone()).await
    }
}

/// The safe deadlines of one guard, from [`LockGuard::deadlines`].
pub struct Deadlines(watch::Receiver<Status>);

impl std::fmt::Debug for Deadlines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = f.debug_struct("Deadlines");
        show_status(&mut out, &self.0.borrow());
        out.finish()
    }
}

impl Deadlines {
    /// Waits for the next confirmed renewal and returns the new safe deadline; `None`
    /// once the lock is lost or the guard is gone.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only watches.
    pub async fn next(&mut self) -> Option<Instant> {
        self.0.changed().await.ok()?;
        let status = self.0.borrow_and_update();
        status.lost.is_none().then_some(status.valid_until)
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else { return };
        held.line.close();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (line, tasks) = (held.line, held.tasks);
            let release = {
                let tasks = tasks.clone();
                async move {
                    let _ = release(line, &tasks).await;
                }
            };
            tasks.spawn_on(release, &runtime);
        }
    }
}

/// Ends a hold: through this process's gate when it has the turn (handing the lock to the
/// next task in one store step), else by a plain store release.
async fn release(line: Arc<Lifeline>, tasks: &TaskTracker) -> Result<Released> {
    let ttl = line.status.borrow().ttl;
    let released = async {
        match line.take_turn() {
            Some(turn) => turn.release(line.store.as_ref(), &line.lease).await,
            None => line.store.release(&line.lease).await,
        }
    };
    let released = line
        .meter
        .store_call(Call::Release, Instant::now(), released)
        .await;
    line.meter.released(&released);
    again_on_trouble(&released, &line.store, &line.lease, ttl, tasks);
    released
}

/// Releases `lease` (of a lock with `ttl`), sending it again later on store trouble (see
/// [`again_on_trouble`]).
pub(crate) async fn release_or_again(
    store: &Arc<dyn Store>,
    lease: &Lease,
    ttl: Duration,
    tasks: &TaskTracker,
) -> Result<Released> {
    let released = store.release(lease).await;
    again_on_trouble(&released, store, lease, ttl, tasks);
    released
}

/// A release the store may have missed is sent again in the background until the store
/// answers: left behind, the hold would stay with our owner, whose next acquisition would
/// re-enter it (same token) and renew it, keeping the lock from everyone else.
fn again_on_trouble(
    released: &Result<Released>,
    store: &Arc<dyn Store>,
    lease: &Lease,
    ttl: Duration,
    tasks: &TaskTracker,
) {
    if matches!(released, Err(e) if e.is_retryable()) {
        tasks.spawn(release_again(store.clone(), lease.clone(), ttl));
    }
}

/// First pause before [`release_again`] retries, doubled up to [`RETRY_AT_MOST`].
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_AT_MOST: Duration = Duration::from_secs(2);
/// How long [`release_again`] keeps trying, at least: a store away longer has let the
/// lease expire (no one renews it) or, restarted, will after one more TTL.
const RETRY_FOR: Duration = Duration::from_secs(60);

/// Retries a release that met store trouble until the store answers it.
async fn release_again(store: Arc<dyn Store>, lease: Lease, ttl: Duration) {
    let give_up = Instant::now() + RETRY_FOR.max(ttl * 10);
    let mut pause = RETRY_FIRST;
    loop {
        tokio::time::sleep(crate::keepalive::jitter(pause)).await;
        match store.release(&lease).await {
            Err(e) if e.is_retryable() && Instant::now() < give_up => {
                tracing::debug!(lock = %lease.name, error = %e, "release retried");
                pause = (pause * 2).min(RETRY_AT_MOST);
            }
            outcome => {
                tracing::debug!(lock = %lease.name, ?outcome, "release finished");
                return;
            }
        }
    }
}
