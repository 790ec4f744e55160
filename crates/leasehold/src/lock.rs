//! The entry point ([`Leasehold`]), lock handles, and the one place where waiting happens.

mod more;

use std::fmt;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep_until, timeout_at, Instant};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::gate::{Gates, Until};
use crate::guard::{release_or_again, LockGuard};
use crate::keepalive::{jitter, usable_as_granted, Lifeline, Renewals};
use crate::metrics::{Call, Meter};
use crate::options::{check_owner, check_permits, check_ttl, waiter_lease, DEFAULT_TTL};
use crate::store::{
    AcquireRequest, Admission, Admitted, Attempt, Busy, Grant, LeaseId, LockKind, LockState,
    Renewal, Requester, Store,
};
use crate::{Error, IntoLockName, LeaseholdBuilder, LockName, Result};

/// A store plus this process's identity: makes lock handles.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold::Result<()> {
/// use std::time::Duration;
/// use leasehold::{Leasehold, MemoryStore, Released};
///
/// let locks = Leasehold::new(MemoryStore::new());
/// let nightly = locks.mutex("nightly")?.with_ttl(Duration::from_secs(30));
/// if let Some(guard) = nightly.try_lock().await? {
///     let token = guard.check()?;      // send it with every write the lock protects
///     println!("running the nightly job with fencing token {token}");
///     if guard.release().await? == Released::NotHeld {
///         eprintln!("the lease ended before the job did: its last writes were unprotected");
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Leasehold {
    client: Arc<Client>,
    /// The lease of the locks it makes ([`LeaseholdBuilder::ttl`]).
    ttl: Duration,
    /// [`LeaseholdBuilder::key_prefix`]. Applied here, to names, rather than in each store's
    /// key layout: every store (and a store of one's own) gets it alike, and a store sees
    /// only names, so its `describe`, `list`, queues and wake-ups need no change.
    prefix: Option<Arc<str>>,
    /// The labels of this store's metrics.
    meter: Meter,
    /// Whether metrics carry the lock name ([`Leasehold::with_lock_name_metrics`]).
    lock_name_metrics: bool,
}

/// What a [`Leasehold`] and every lock handle it makes share: one pointer in each handle
/// (a task that waits for a lock holds its handle).
struct Client {
    store: Arc<dyn Store>,
    requester: Arc<Requester>,
    gates: Arc<Gates>,
    renewals: Arc<Renewals>,
    /// Releases and undos running in the background, for [`Leasehold::shutdown`].
    tasks: TaskTracker,
}

impl fmt::Debug for Leasehold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leasehold")
            .field("store", &self.client.store.describe_store())
            .finish()
    }
}

impl Leasehold {
    /// Locks on `store`.
    pub fn new(store: impl Store) -> Self {
        Self::from_store(Arc::new(store))
    }

    /// Locks on a shared store.
    pub fn from_store(store: Arc<dyn Store>) -> Self {
        Leasehold {
            meter: Meter::new(store.as_ref()),
            client: Arc::new(Client {
                store,
                requester: Arc::new(Requester::this_process()),
                gates: Arc::default(),
                renewals: Arc::default(),
                tasks: TaskTracker::new(),
            }),
            ttl: DEFAULT_TTL,
            prefix: None,
            lock_name_metrics: false,
        }
    }

    /// With a default lease and a key prefix (checked by the builder).
    pub(crate) fn configured(self, ttl: Duration, prefix: Option<Arc<str>>) -> Self {
        Leasehold {
            ttl,
            prefix,
            ..self
        }
    }

    /// Labels every metric of this `Leasehold`'s locks with the lock name (`lock`) too.
    /// Off by default: each name is a series of its own in every metric, too many where
    /// names are made per job, user or request. The crate docs list the metrics.
    pub fn with_lock_name_metrics(mut self, on: bool) -> Self {
        self.lock_name_metrics = on;
        self
    }

    /// Opens the store a URL names (see [`open_store`](crate::open_store)), with the
    /// defaults of [`builder`](Self::builder).
    pub async fn connect(url: &str) -> Result<Self> {
        Self::builder(url).build().await
    }

    /// A client of the store `url` names, with settings beyond the URL: see
    /// [`LeaseholdBuilder`].
    pub fn builder(url: &str) -> LeaseholdBuilder {
        LeaseholdBuilder::new(url)
    }

    /// `name` as the store knows it: behind the key prefix.
    fn stored(&self, name: LockName) -> Result<LockName> {
        match &self.prefix {
            None => Ok(name),
            Some(prefix) => LockName::new(format!("{prefix}{}", name.as_str())),
        }
    }

    /// A name from the store as this client knows it: `None` outside its prefix.
    fn unprefixed<'a>(&self, stored: &'a str) -> Option<&'a str> {
        match &self.prefix {
            None => Some(stored),
            Some(prefix) => stored.strip_prefix(&**prefix),
        }
    }

    /// Waits, for `patience` at most, for what this `Leasehold`'s locks left to finish in
    /// the background: the releases of dropped guards, the undos of abandoned acquires (a
    /// dropped [`Lock::lock`] future leaves its place in the queue this way) and releases
    /// sent again after store trouble. Returns whether all of it finished in time.
    ///
    /// Call it before the process exits, after dropping or releasing its guards: a
    /// runtime that ends drops its background tasks, and then a lock held by a dropped
    /// guard stays held until its lease ends, and a place in a fair queue holds up the
    /// waiters behind it until its waiter lease ([`waiter_lease`](crate::store::waiter_lease))
    /// ends. Guards that still live are left alone. The locks stay usable; a later call
    /// waits for what they leave behind after this one.
    ///
    /// `#[must_use]`: `false` means some of that work had not finished, so a lock may
    /// stay held until its lease ends; say so, or ignore it with `let _ =`.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only waits; the work goes on in the background.
    #[must_use = "false: some releases had not reached the store; those locks end with their leases"]
    pub async fn shutdown(&self, patience: Duration) -> bool {
        self.client.tasks.close();
        let finished = async {
            self.client.tasks.wait().await;
            self.client.store.shed().await;
        };
        tokio::time::timeout(patience, finished).await.is_ok()
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.client.store
    }

    fn handle(&self, name: LockName, kind: LockKind) -> Result<Lock> {
        let name = self.stored(name)?;
        Ok(Lock {
            client: self.client.clone(),
            meter: (self.meter).of(Some(kind), self.lock_name_metrics.then_some(&name)),
            name,
            kind,
            ttl: self.ttl,
            fair: self.client.store.capabilities().fair_by_default,
            extras: None,
        })
    }

    /// A mutex: one holder at a time.
    ///
    /// `mutex(name)` and [`write(name)`](Self::write) are the same lock: a mutex is the
    /// write side of the read-write lock of its name, so a mutex holder excludes
    /// [`read`](Self::read) holders of the name, and a holder taken with one is re-entered
    /// (with the same owner) or waited for through the other.
    pub fn mutex<N: IntoLockName>(&self, name: N) -> Result<Lock> {
        self.handle(name.into_lock_name()?, LockKind::Exclusive)
    }

    /// A semaphore: at most `permits` holders at a time, each with its own lease and token.
    /// Everyone using the name must pass the same `permits`.
    pub fn semaphore<N: IntoLockName>(&self, name: N, permits: u32) -> Result<Lock> {
        let permits = check_permits(permits)?;
        self.handle(name.into_lock_name()?, LockKind::Permit { permits })
    }

    /// The read side of a read-write lock: many readers together, never with a writer.
    /// A waiting writer is not passed by readers that arrive after it.
    pub fn read<N: IntoLockName>(&self, name: N) -> Result<Lock> {
        self.handle(name.into_lock_name()?, LockKind::Shared)
    }

    /// The write side of a read-write lock: one writer, no readers.
    ///
    /// The same lock as [`mutex(name)`](Self::mutex): a writer and a mutex holder of one
    /// name exclude each other as two writers do.
    pub fn write<N: IntoLockName>(&self, name: N) -> Result<Lock> {
        self.handle(name.into_lock_name()?, LockKind::Exclusive)
    }

    /// A rate limiter (GCRA): `rate` units per period in the long run, up to `burst` at
    /// once from idle; in every window of length `t`, at most `burst + rate·t` units
    /// pass. Everyone using the name must pass the same rate and burst. Limiters have
    /// names of their own: a limiter and a lock may share a name.
    ///
    /// Offered by the memory, local and Redis stores; etcd answers
    /// [`Error::Unsupported`] (it has no server clock every client can trust).
    pub fn rate_limiter<N: IntoLockName>(
        &self,
        name: N,
        rate: crate::Rate,
        burst: u64,
    ) -> Result<crate::RateLimiter> {
        let name = self.stored(name.into_lock_name()?)?;
        crate::RateLimiter::new(self.client.store.clone(), name, rate, burst)
    }

    /// A leader election: candidates [`campaign`](crate::Election::campaign), anyone
    /// asks for the [`leader`](crate::Election::leader) or
    /// [`observe`](crate::Election::observe)s it. The election is the mutex of the same
    /// name, fair, whose holder publishes a value.
    pub fn election<N: IntoLockName>(&self, name: N) -> Result<crate::Election> {
        let lock = self.mutex(name)?;
        Ok(crate::Election::new(lock, self.client.store.clone()))
    }

    /// Holders and waiters of one lock. Tasks of this process that wait behind another
    /// of its tasks (see [`Lock::lock`]) are listed after the store's waiters; other
    /// processes see only the one of them that the store queues.
    pub async fn describe<N: IntoLockName>(&self, name: N) -> Result<LockState> {
        let name = name.into_lock_name()?;
        let stored = self.stored(name.clone())?;
        let mut state = self.client.store.describe(&stored).await?;
        state.waiters.extend(self.client.gates.waiting(&stored));
        state.name = name.to_string();
        Ok(state)
    }

    /// Locks with holders or waiters whose names start with `prefix` (with this
    /// process's waiting tasks, as [`describe`](Self::describe)). With a key prefix,
    /// only the locks behind it, named without it.
    pub async fn list(&self, prefix: &str) -> Result<Vec<LockState>> {
        let within = format!("{}{prefix}", self.prefix.as_deref().unwrap_or_default());
        let mut states = self.client.store.list(&within).await?;
        for state in &mut states {
            if let Ok(name) = LockName::try_from(state.name.as_str()) {
                state.waiters.extend(self.client.gates.waiting(&name));
            }
            if let Some(name) = self.unprefixed(&state.name) {
                state.name = name.to_string();
            }
        }
        Ok(states)
    }

    /// Frees a lock whoever holds it; the holders' guards report it lost. Returns whether
    /// it was held.
    pub async fn force_release<N: IntoLockName>(&self, name: N) -> Result<bool> {
        let name = self.stored(name.into_lock_name()?)?;
        let meter = (self.meter).of(None, self.lock_name_metrics.then_some(&name));
        let held = meter
            .store_call(
                Call::ForceRelease,
                Instant::now(),
                self.client.store.force_release(&name),
            )
            .await?;
        meter.force_released();
        tracing::debug!(lock = %name, held, "force-released");
        Ok(held)
    }
}

type OnWait = Arc<dyn Fn(&Busy) + Send + Sync>;

/// A handle on one lock name with its options. Cheap to clone; acquire as often as needed.
#[derive(Clone)]
pub struct Lock {
    client: Arc<Client>,
    name: LockName,
    kind: LockKind,
    ttl: Duration,
    fair: bool,
    meter: Meter,
    /// The options few handles set, behind one pointer: every task that waits for a
    /// lock holds its handle (thousands of them, on busy names).
    extras: Option<Arc<Extras>>,
}

/// A [`Lock`]'s rarer options.
#[derive(Clone, Default)]
struct Extras {
    owner: Option<Arc<str>>,
    on_wait: Option<OnWait>,
    /// Published with each hold ([`AcquireRequest::value`]): an election's.
    value: Option<Arc<str>>,
}

static NO_EXTRAS: Extras = Extras {
    owner: None,
    on_wait: None,
    value: None,
};

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("ttl", &self.ttl)
            .field("fair", &self.fair)
            .field("owner", &self.extras().owner)
            .finish()
    }
}

/// An acquire under way (see [`Lock::acquire`]).
type Acquiring<'a> = Pin<Box<dyn Future<Output = Acquired> + Send + 'a>>;

/// `acquire`, boxed, in `span` if that is enabled (a disabled span would still take its
/// room in every waiter's box).
fn in_span<'a>(
    acquire: impl Future<Output = Acquired> + Send + 'a,
    span: tracing::Span,
) -> Acquiring<'a> {
    match span.is_disabled() {
        true => Box::pin(acquire),
        false => Box::pin(acquire.instrument(span)),
    }
}

#[derive(Clone, Copy)]
enum Wait {
    No,
    Until(Instant),
    Forever,
}

impl Lock {
    /// Lease length (default 15 s; from 100 ms to 24 h, checked when acquiring).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// FIFO: never pass a waiter queued earlier (default: off, the fastest hand-off; on
    /// for stores whose [`Capabilities::fair_by_default`](crate::store::Capabilities) says so).
    pub fn with_fair(mut self, fair: bool) -> Self {
        self.fair = fair;
        self
    }

    /// The re-entry key: acquiring again under the same owner id adds a hold and returns
    /// the same fencing token instead of waiting for itself. Default: each acquisition's
    /// own random id (no re-entry, like `std::sync::Mutex`).
    pub fn with_owner(mut self, owner: impl Into<String>) -> Self {
        self.extras_mut().owner = Some(owner.into().into());
        self
    }

    /// Called each time the store answers an attempt busy while waiting (who holds it,
    /// our queue position), e.g. to show progress. A task that waits behind another task
    /// of the same [`Leasehold`] (at its process's gate, where no attempt reaches the
    /// store) is not called until its turn to ask comes.
    pub fn on_wait(mut self, f: impl Fn(&Busy) + Send + Sync + 'static) -> Self {
        self.extras_mut().on_wait = Some(Arc::new(f));
        self
    }

    /// Publishes `value` with each hold this lock takes (an election candidate's).
    pub(crate) fn with_value(mut self, value: Option<Arc<str>>) -> Self {
        self.extras_mut().value = value;
        self
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    fn extras(&self) -> &Extras {
        self.extras.as_deref().unwrap_or(&NO_EXTRAS)
    }

    fn extras_mut(&mut self) -> &mut Extras {
        Arc::make_mut(self.extras.get_or_insert_with(Arc::default))
    }

    /// One attempt; `None` if someone else holds it, or if another task of this process
    /// is acquiring the same mutex at that moment (it asks the store for both: its
    /// answer is not waited for, so `None` can come while the store is unreachable, when
    /// that task's call then fails).
    ///
    /// # Cancel safety
    /// Cancel-safe: a cancelled attempt that the store may have granted is released in
    /// the background by its acquisition id.
    pub async fn try_lock(&self) -> Result<Option<LockGuard>> {
        let acquire = self.acquire(Wait::No, Instant::now())?;
        acquire.await
    }

    /// Waits as long as it takes.
    ///
    /// Tasks of one process waiting for the same mutex (without an owner id) wait in the
    /// process, behind the one of them that asks the store; a release hands the lock to
    /// the next of them in the same store step. In fair mode this needs a store that
    /// queues by arrival ([`Capabilities::queues_by_wait`](crate::store::Capabilities)): the
    /// task handed over takes its place in the store's queue by when it arrived.
    ///
    /// # Cancel safety
    /// Cancel-safe: dropping the future leaves the queue and releases anything the store
    /// granted meanwhile, in the background, by acquisition id.
    pub async fn lock(&self) -> Result<LockGuard> {
        let acquire = self.acquire(Wait::Forever, Instant::now())?;
        match acquire.await? {
            Some(guard) => Ok(guard),
            None => Err(Error::Internal(
                "an unbounded wait ended without the lock".into(),
            )),
        }
    }

    /// Waits at most `wait`; `None` if it ran out.
    ///
    /// # Cancel safety
    /// As [`lock`](Self::lock).
    pub async fn try_lock_for(&self, wait: Duration) -> Result<Option<LockGuard>> {
        let now = Instant::now();
        let wait = now.checked_add(wait).map_or(Wait::Forever, Wait::Until);
        let acquire = self.acquire(wait, now)?;
        acquire.await
    }

    /// Waits until `deadline` at most; `None` if it passed.
    ///
    /// # Cancel safety
    /// As [`lock`](Self::lock).
    pub async fn try_lock_until(&self, deadline: std::time::Instant) -> Result<Option<LockGuard>> {
        // A deadline already past asks once, as `try_lock_for(ZERO)` does; counted from
        // it, the store's time for the answer would have run out before the question.
        let now = Instant::now();
        let acquire = self.acquire(Wait::Until(Instant::from_std(deadline).max(now)), now)?;
        acquire.await
    }

    fn request(&self, enqueue: bool) -> Result<AcquireRequest> {
        let ttl = check_ttl(self.ttl)?;
        let extras = self.extras();
        if let Some(value) = &extras.value {
            crate::options::check_value(value)?;
        }
        let lease = LeaseId::random();
        let owner = match &extras.owner {
            Some(owner) => {
                check_owner(owner)?;
                owner.clone()
            }
            // Unique to this acquisition, so it cannot re-enter another: its id (a store
            // need not keep both, thousands of waiters would).
            None => lease.shared_text(),
        };
        Ok(AcquireRequest {
            name: self.name.clone(),
            lease,
            owner,
            kind: self.kind,
            ttl,
            fair: self.fair,
            enqueue,
            waited_since: None,
            requester: self.client.requester.clone(),
            value: extras.value.clone(),
        })
    }

    /// An acquire that began at `started` (the caller's clock read: each read costs, and
    /// an uncontended acquire needs only this one and the one at the store's answer): its
    /// turn at the process's gate, if it takes one, then the store.
    ///
    /// Boxed, as one block that owns its request: a task that waits for a lock
    /// (thousands of them, on busy names) then carries a pointer rather than this state
    /// inline, which its task's size would round up (tokio allocates a task in steps of
    /// 128 bytes), and an `async fn` would lay out its arguments twice. An acquire that
    /// takes no turn at the gate carries the store loop in the same box.
    fn acquire(&self, wait: Wait, started: Instant) -> Result<Acquiring<'_>> {
        let req = self.request(!matches!(wait, Wait::No))?;
        let span = tracing::debug_span!("acquire", lock = %self.name, kind = self.kind.word(), owner = %req.owner);
        let gated = self.kind == LockKind::Exclusive
            && self.extras().owner.is_none()
            && (!self.fair || self.client.store.capabilities().queues_by_wait);
        if gated {
            return Ok(in_span(self.through_gate(req, wait, started), span));
        }
        let acquire = async move {
            let acquired = self.acquire_from_store(&req, wait, started, true).await;
            self.counted(acquired, wait, started)
        };
        Ok(in_span(acquire, span))
    }

    /// How an acquire that began at `started` ended, counted in the metrics.
    fn counted(&self, acquired: Acquired, wait: Wait, started: Instant) -> Acquired {
        self.meter
            .acquired(&acquired, !matches!(wait, Wait::No), started);
        acquired
    }

    /// [`acquire`](Self::acquire) for a request that takes its turn at the process's gate
    /// first.
    #[allow(clippy::manual_async_fn)] // an `async fn` keeps its arguments twice
    fn through_gate(
        &self,
        mut req: AcquireRequest,
        wait: Wait,
        started: Instant,
    ) -> impl Future<Output = Acquired> + Send + '_ {
        async move {
            let acquired = 'acquire: {
                // When the first attempt is sent: at `started`, unless it waits at the gate
                // first (counting a lease from earlier than its request is safe).
                let mut sent_at_start = true;
                let until = match wait {
                    Wait::No => Until::Now,
                    Wait::Until(deadline) => Until::Deadline(deadline),
                    Wait::Forever => Until::Forever,
                };
                let gate = self.client.gates.gate(&self.name, self.fair);
                let undo = || Pending::new(&self.client, &req);
                // The turn of a free gate is taken at once; a wait for it is boxed, so
                // that acquires that never wait here do not carry its state (0.6 KB).
                let entered = match gate.free_turn() {
                    Some(turn) => Some((turn, None)),
                    None => {
                        sent_at_start = false;
                        let enter = Box::pin(gate.enter(&req, until, undo()));
                        self.meter.waiting_while(enter).await
                    }
                };
                let turn = match entered {
                    None => break 'acquire Ok(None),
                    Some((turn, handed)) => {
                        // Handed over by the task before us, in one store step. Boxed:
                        // it is not what a task waits in.
                        if let Some(answer) = handed {
                            let handed = Box::pin(self.handed_over(&req, answer, wait)).await;
                            if let Some(done) = handed {
                                break 'acquire done.map(|g| g.map(|g| g.with_turn(Some(turn))));
                            }
                        }
                        // Our turn to ask (the task before us gave up, its hold ended
                        // without a hand-over, or the hand-over lapsed before this task
                        // ran): a fair request keeps its place by when it arrived here,
                        // as a hand-over would have kept it.
                        if self.fair {
                            req.waited_since = Some(started.into_std());
                        }
                        turn
                    }
                };
                // Boxed: a task waiting at the gate (thousands of them, on a busy name) then
                // carries a pointer rather than the store loop's state.
                let acquired =
                    Box::pin(self.acquire_from_store(&req, wait, started, sent_at_start)).await;
                acquired.map(|guard| guard.map(|g| g.with_turn(Some(turn))))
            };
            self.counted(acquired, wait, started)
        }
    }

    /// How a hand-over from the task before us at the gate (sent at the answer's instant)
    /// ends the acquire; `None` if its lease lapsed before this task ran, to ask again.
    async fn handed_over(
        &self,
        req: &AcquireRequest,
        (grant, sent): (Grant, Instant),
        wait: Wait,
    ) -> Option<Acquired> {
        let mut pending = Pending::new(&self.client, req);
        let answer = (grant, sent, Instant::now());
        let done = self.settle(req, answer, &mut pending, bound(wait)).await;
        if done.is_none() {
            // The store no longer has it: nothing to undo.
            pending.disarm();
        }
        done
    }

    /// The guard of a granted acquisition whose request was sent at `sent` and answered
    /// by `now`.
    fn guard(&self, req: &AcquireRequest, grant: Grant, sent: Instant, now: Instant) -> LockGuard {
        tracing::debug!(token = grant.token.0, holds = grant.holds, "acquired");
        let granted = grant.lease.unwrap_or(req.ttl);
        let line = Lifeline::new(
            self.client.store.clone(),
            req.lease(),
            sent,
            req.ttl,
            granted,
            self.meter.clone(),
        );
        LockGuard::start(
            line,
            (&self.client.renewals, &self.client.tasks),
            &grant,
            req,
            now,
        )
    }

    /// The guard of a grant, or `None` if its lease lapsed before it arrived. A grant that
    /// arrives after its safe deadline (a slow link, a paused store or client) proves
    /// nothing by itself; one ownership-checked renewal sent now does, since a lease id
    /// that lapsed cannot be renewed once anyone else has taken the lock. A grant with
    /// under a third of its lease left is renewed first too (`usable_as_granted`).
    async fn accept(
        &self,
        req: &AcquireRequest,
        (grant, sent, now): (Grant, Instant, Instant),
        bound: Option<Instant>,
    ) -> Result<Option<LockGuard>> {
        let granted = grant.lease.unwrap_or(req.ttl).min(req.ttl);
        if usable_as_granted(sent, granted, now) {
            return Ok(Some(self.guard(req, grant, sent, now)));
        }
        // Boxed: rare, and the largest step of an attempt (every waiter's attempt carries
        // its steps while it waits for the store).
        Box::pin(self.confirm_late(req, grant, bound)).await
    }

    /// [`accept`](Self::accept)'s grant that arrived late, confirmed by a renewal.
    async fn confirm_late(
        &self,
        req: &AcquireRequest,
        grant: Grant,
        bound: Option<Instant>,
    ) -> Result<Option<LockGuard>> {
        let resent = Instant::now();
        let lease = req.lease();
        let renewal = self.meter.store_call(
            Call::Renew,
            resent,
            self.client.store.renew(&lease, req.ttl),
        );
        match self
            .bounded(renewal, bound, "confirming a late grant", resent)
            .await?
        {
            Renewal::Renewed => {
                tracing::debug!("a grant that arrived late was confirmed by a renewal");
                let grant = Grant {
                    lease: None,
                    ..grant
                };
                Ok(Some(self.guard(req, grant, resent, Instant::now())))
            }
            Renewal::Lost => {
                tracing::debug!("a grant arrived after its lease had lapsed");
                Ok(None)
            }
        }
    }

    /// How a grant (to the request sent at the first instant, answered by the second)
    /// ends the acquire: with its guard, or with the error that confirming it met (the
    /// attempt undone); `None` if its lease lapsed on the way, to ask again. A store call
    /// it makes ends by `bound`, if any.
    async fn settle(
        &self,
        req: &AcquireRequest,
        answer: (Grant, Instant, Instant),
        pending: &mut Pending<'_>,
        bound: Option<Instant>,
    ) -> Option<Result<Option<LockGuard>>> {
        match self.accept(req, answer, bound).await {
            Ok(Some(guard)) => {
                pending.disarm();
                Some(Ok(Some(guard)))
            }
            Ok(None) => None,
            Err(error) => {
                pending.undo_within(LATE_ANSWER).await;
                Some(Err(error))
            }
        }
    }

    /// The error of a bounded wait that the store's slowness ended: `what` (sent at
    /// `sent`) came too late, although nobody may have held the lock.
    fn too_slow(&self, what: &str, sent: Instant) -> Error {
        self.unavailable(format!(
            "{what} for lock \"{}\" took {}, too slow for the wait or for the lease ({}); the lock may well be free: look at the link to the store, or use a longer TTL",
            self.name,
            crate::humanize(sent.elapsed()),
            crate::humanize(self.ttl)
        ))
    }

    /// The error of a bounded wait that ended with `what` (sent at `sent`) unanswered:
    /// whether the lock was free is not known.
    fn unanswered(&self, what: &str, sent: Instant) -> Error {
        self.unavailable(format!(
            "no answer from the store to {what} for lock \"{}\" within {}, so whether it is free is not known: look at the link to the store",
            self.name,
            crate::humanize(sent.elapsed()),
        ))
    }

    fn unavailable(&self, source: String) -> Error {
        Error::Unavailable {
            store: self.client.store.describe_store(),
            source: source.into(),
        }
    }

    /// Asks the store until the lock is granted or `wait` says to stop.
    /// `started` is when the acquire began, and when its first attempt counts as sent if
    /// `sent_at_start` (no clock read is needed for it).
    ///
    /// Not an `async fn`, which would keep its arguments twice: a waiter in a store's
    /// queue (thousands of them) carries this state while it waits.
    fn acquire_from_store<'a>(
        &'a self,
        req: &'a AcquireRequest,
        wait: Wait,
        started: Instant,
        mut sent_at_start: bool,
    ) -> impl Future<Output = Acquired> + Send + 'a {
        let mut progress = Progress {
            wait,
            pending: Pending::new(&self.client, req),
            started,
            answered: false,
            troubles: 0,
            waiting: None,
        };
        async move {
            loop {
                // A store answering from memory never yields; let other tasks run.
                tokio::task::consume_budget().await;
                let sent = match std::mem::take(&mut sent_at_start) {
                    true => progress.started,
                    false => Instant::now(),
                };
                let admitted = match self.client.store.admit(req) {
                    Admission::Now(admitted) => admitted,
                    // Boxed: it is not what a waiter waits in.
                    Admission::Wait(wait) => {
                        match Box::pin(self.admitted(wait, sent, &mut progress)).await {
                            ControlFlow::Break(done) => return done,
                            ControlFlow::Continue(None) => continue,
                            ControlFlow::Continue(Some(admitted)) => admitted,
                        }
                    }
                };
                // The attempt and what its answer takes (a grant's confirmation, an undo, a
                // backoff) are boxed: between attempts a waiter (thousands of them in a
                // store's queue) keeps the loop's state and its wait, not theirs (0.9 KB).
                // The admission goes with it, held until its answer: the loop keeps
                // nothing of it while it waits.
                let attempt = self.attempt(req, sent, &mut progress, admitted);
                let wake = match Box::pin(attempt).await {
                    ControlFlow::Break(done) => return done,
                    ControlFlow::Continue(None) => continue,
                    ControlFlow::Continue(Some(wake)) => wake,
                };
                // Until the store signals a change, or `wake.at`; only a change that needs
                // more (a hand-over's confirmation, a backoff) is boxed.
                let Wake { watermark, at } = wake;
                let changed = timeout_at(at, self.client.store.changed(req, watermark));
                // What the change leads to is built in the match, so that the loop keeps
                // no room for the change itself while it waits.
                let step = match changed.await {
                    Ok(Ok(None)) | Err(_) => continue,
                    Ok(changed) => {
                        Box::pin(self.after_change(req, changed, sent, at, &mut progress))
                    }
                };
                if let ControlFlow::Break(done) = step.await {
                    return done;
                }
            }
        }
    }

    /// The store's admission of the next attempt, sent at `sent` once admitted, or the
    /// step that failing to wait for it (within the wait) leads to.
    async fn admitted(
        &self,
        wait: Pin<Box<dyn Future<Output = Admitted> + Send>>,
        sent: Instant,
        progress: &mut Progress<'_>,
    ) -> ControlFlow<Acquired, Option<Admitted>> {
        let admitted = async { Ok(wait.await) };
        match self
            .bounded(admitted, progress.bound(), "an attempt", sent)
            .await
        {
            Ok(admitted) => ControlFlow::Continue(Some(admitted)),
            Err(error) => match self.trouble(error, progress).await {
                ControlFlow::Break(done) => ControlFlow::Break(done),
                ControlFlow::Continue(()) => ControlFlow::Continue(None),
            },
        }
    }

    /// One attempt sent at `sent` (`_admitted` by the store until it is answered), and
    /// the step its answer leads to: the acquire ends, asks again at once, or waits for
    /// the [`Wake`] it returns.
    async fn attempt(
        &self,
        req: &AcquireRequest,
        sent: Instant,
        progress: &mut Progress<'_>,
        _admitted: Admitted,
    ) -> ControlFlow<Acquired, Option<Wake>> {
        let attempt =
            (self.meter).store_call_answered(Call::Acquire, sent, self.client.store.acquire(req));
        let step = match self
            .bounded(attempt, progress.bound(), "an attempt", sent)
            .await
        {
            Ok((Attempt::Granted(grant), now)) => {
                self.granted(req, (grant, sent, now), progress).await
            }
            Ok((Attempt::Busy(busy), _)) => return self.busy(req, busy, progress).await,
            // Boxed: rare, and larger than the rest (its backoff's timer, an undo).
            Err(error) => Box::pin(self.trouble(error, progress)).await,
        };
        match step {
            ControlFlow::Break(done) => ControlFlow::Break(done),
            ControlFlow::Continue(()) => ControlFlow::Continue(None),
        }
    }

    /// `call` (`what`, sent at `sent`), ended by `bound` if any.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T>>,
        bound: Option<Instant>,
        what: &str,
        sent: Instant,
    ) -> Result<T> {
        match bound {
            Some(bound) => timeout_at(bound, call)
                .await
                .unwrap_or_else(|_| Err(self.unanswered(what, sent))),
            None => call.await,
        }
    }

    /// A grant to the attempt sent and answered at the `answer`'s instants: the acquire
    /// ends with its guard or the error confirming it met; if its lease lapsed on the
    /// way, the same request is asked again while the wait allows.
    async fn granted(
        &self,
        req: &AcquireRequest,
        answer: (Grant, Instant, Instant),
        progress: &mut Progress<'_>,
    ) -> Step {
        let (bound, sent) = (progress.bound(), answer.1);
        if let Some(done) = self.settle(req, answer, &mut progress.pending, bound).await {
            return ControlFlow::Break(done);
        }
        // Lapsed on the way: ask again (the same request) while we may wait.
        match progress.wait {
            Wait::Forever => ControlFlow::Continue(()),
            Wait::Until(deadline) if Instant::now() < deadline => ControlFlow::Continue(()),
            _ => {
                progress.pending.undo_within(LATE_ANSWER).await;
                // Nobody else had it: say what happened, not "busy".
                ControlFlow::Break(Err(self.too_slow("the grant", sent)))
            }
        }
    }

    /// A busy answer: the acquire ends if it may not wait (or no longer), else it waits
    /// for a chance to ask again.
    async fn busy(
        &self,
        req: &AcquireRequest,
        busy: Busy,
        progress: &mut Progress<'_>,
    ) -> ControlFlow<Acquired, Option<Wake>> {
        progress.answered = true;
        progress.troubles = 0;
        let deadline = match progress.wait {
            Wait::No => {
                progress.pending.disarm();
                return ControlFlow::Break(Ok(None));
            }
            Wait::Until(deadline) if Instant::now() >= deadline => {
                progress.pending.undo_within(LATE_ANSWER).await;
                tracing::debug!(waited = ?progress.started.elapsed(), "gave up waiting");
                return ControlFlow::Break(Ok(None));
            }
            Wait::Until(deadline) => Some(deadline),
            Wait::Forever => None,
        };
        if progress.waiting.is_none() {
            progress.waiting = Some(self.meter.waiting());
        }
        if let Some(on_wait) = &self.extras().on_wait {
            on_wait(&busy);
        }
        tracing::trace!(holder = ?busy.holder.as_ref().map(|h| &h.owner), position = ?busy.position, "waiting");
        // Ask again when a holder's lease (or a waiter ahead) can have expired, or in time
        // to refresh our own waiter lease (where the store does not keep it alive: then
        // now and then, should a change have gone unsignalled), or at the deadline, if no
        // change comes first.
        let refresh = match self.client.store.capabilities().keeps_waiters_alive {
            true => req.ttl.min(QUIET_WAIT),
            false => waiter_lease(req.ttl) / 2,
        };
        let retry_in = busy
            .retry_in
            .map_or(refresh, |d| (d + Duration::from_millis(1)).min(refresh));
        let at = Instant::now() + retry_in;
        ControlFlow::Continue(Some(Wake {
            watermark: busy.watermark,
            at: deadline.map_or(at, |deadline| at.min(deadline)),
        }))
    }

    /// What a change the store signalled leads to: a store that handed the lock over
    /// with it ends the acquire; a failed signal is asked again after a backoff (by `at`
    /// at the latest).
    async fn after_change(
        &self,
        req: &AcquireRequest,
        changed: Result<Option<Grant>>,
        sent: Instant,
        at: Instant,
        progress: &mut Progress<'_>,
    ) -> Step {
        match changed {
            // Handed over by the store: the lease runs from after `sent`, our last
            // request, so counting from it is safe.
            Ok(Some(grant)) => {
                let (bound, answer) = (progress.bound(), (grant, sent, Instant::now()));
                if let Some(done) = self.settle(req, answer, &mut progress.pending, bound).await {
                    return ControlFlow::Break(done);
                }
            }
            Ok(None) => {}
            Err(error) => {
                tracing::debug!(%error, "change notification failed; backing off");
                let backoff = Instant::now() + jitter(Duration::from_millis(50));
                sleep_until(backoff.min(at)).await;
            }
        }
        ControlFlow::Continue(())
    }

    /// A failed call: once the store has answered, a waiter rides out store trouble (a
    /// restart, a failover) until its deadline, asking again after a backoff; the same
    /// request is retried, so an attempt that was granted unseen is simply granted
    /// again. Otherwise the acquire ends with the error, its attempt undone.
    async fn trouble(&self, error: Error, progress: &mut Progress<'_>) -> Step {
        if progress.answered && error.is_retryable() && !matches!(progress.wait, Wait::No) {
            let retry = Instant::now() + jitter(progress.backoff());
            if let Wait::Until(deadline) = progress.wait {
                if retry >= deadline {
                    progress.pending.undo_within(LATE_ANSWER).await;
                    return ControlFlow::Break(Err(error));
                }
            }
            match error {
                // Our place went (our process or the store stalled for longer than the
                // waiter lease): the next attempt joins again, at the end of the queue.
                Error::WaitEnded { .. } => {
                    tracing::warn!(%error, "joining the queue again, at its end")
                }
                _ => tracing::debug!(%error, "store trouble while waiting; retrying"),
            }
            sleep_until(retry).await;
            return ControlFlow::Continue(());
        }
        if !progress.answered && self.client.store.capabilities().failed_calls_change_nothing {
            // Nothing of this request can be in the store.
            progress.pending.disarm();
        } else {
            // The attempt may have been granted or queued: undo it by its id,
            // within what is left of a bounded wait (then in the background).
            let now = Instant::now();
            let patience = progress
                .bound()
                .map_or(LATE_ANSWER, |b| b.saturating_duration_since(now));
            progress.pending.undo_within(patience).await;
        }
        ControlFlow::Break(Err(error))
    }
}

/// When a store call of `wait` is given up on: however slow the store, a bounded wait
/// ends soon after its deadline.
fn bound(wait: Wait) -> Option<Instant> {
    match wait {
        Wait::Until(deadline) => Some(deadline + LATE_ANSWER),
        _ => None,
    }
}

/// What an acquire ends with: a guard, or `None` when it did not wait or gave up.
type Acquired = Result<Option<LockGuard>>;

/// Whether an acquire ends after a step, and with what.
type Step = ControlFlow<Acquired>;

/// What a busy answer leaves a waiter to wait for: a change since `watermark`, until
/// `at` at the latest.
struct Wake {
    watermark: crate::store::Watermark,
    at: Instant,
}

/// Where an acquire stands between attempts.
struct Progress<'a> {
    wait: Wait,
    /// What the acquisition may have left in the store.
    pending: Pending<'a>,
    started: Instant,
    /// Whether the store has answered an attempt.
    answered: bool,
    /// Store troubles in a row while waiting: the next backoff doubles with each.
    troubles: u8,
    /// Counts this acquire as waiting once the store said busy.
    waiting: Option<crate::metrics::Waiting>,
}

impl Progress<'_> {
    /// When a store call of the wait is given up on.
    fn bound(&self) -> Option<Instant> {
        bound(self.wait)
    }

    /// How long to wait before asking again after store trouble, counting this one.
    fn backoff(&mut self) -> Duration {
        let doubled = FIRST_BACKOFF.saturating_mul(1 << self.troubles.min(5));
        self.troubles = self.troubles.saturating_add(1);
        doubled.min(Duration::from_secs(1))
    }
}

/// The first backoff after store trouble while waiting (it doubles, up to a second).
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

/// Longest a waiter goes without asking again where the store keeps its place alive
/// (see [`Capabilities::keeps_waiters_alive`](crate::store::Capabilities)): its changes
/// come signalled, and this bounds a missed one.
const QUIET_WAIT: Duration = Duration::from_secs(30);

/// How long a bounded wait lets a store call finish after its deadline (and an undo then
/// take, before it goes on in the background): a slow store cannot stretch the wait by
/// more.
const LATE_ANSWER: Duration = Duration::from_secs(1);

/// An acquisition that may exist in the store without a guard (an attempt whose answer
/// was lost, or a place in the queue): undone by its id unless disarmed (sent again on
/// store trouble, as a guard's release is).
///
/// It borrows the request and the client: a waiter (thousands of them) carries it.
pub(crate) struct Pending<'a> {
    client: &'a Arc<Client>,
    req: &'a AcquireRequest,
    armed: bool,
}

impl<'a> Pending<'a> {
    fn new(client: &'a Arc<Client>, req: &'a AcquireRequest) -> Self {
        Pending {
            client,
            req,
            armed: true,
        }
    }

    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Undoes the acquisition by its id (a release of what the store may have granted
    /// or queued), waited for at most `patience`; then it goes on in the background (the
    /// lease stays armed, so dropping this sends it).
    async fn undo_within(&mut self, patience: Duration) {
        if self.armed {
            // Boxed: rare, and every step of an attempt that may undo would carry it.
            Box::pin(self.undo_now(patience)).await;
        }
    }

    async fn undo_now(&mut self, patience: Duration) {
        let Client { store, tasks, .. } = &**self.client;
        let lease = self.req.lease();
        let undo = release_or_again(store, &lease, self.req.ttl, tasks);
        if tokio::time::timeout(patience, undo).await.is_ok() {
            self.armed = false;
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !std::mem::take(&mut self.armed) {
            return;
        }
        // Tracked, so that `Leasehold::shutdown` can wait for it before the process ends.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (client, lease, ttl) = (self.client.clone(), self.req.lease(), self.req.ttl);
            let undo = async move {
                let _ = release_or_again(&client.store, &lease, ttl, &client.tasks).await;
            };
            self.client.tasks.spawn_on(undo, &runtime);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    /// A waiter in its store's queue (thousands of them) carries its acquire's box while
    /// it waits: the request, the loop's progress and its wait for a change, and no room
    /// for what a change or an attempt leads to.
    #[tokio::test]
    async fn an_acquire_that_waits_in_the_store_stays_small() {
        let locks = Leasehold::new(MemoryStore::new());
        // With an owner id: not gated, the store loop runs in the box.
        let lock = locks.mutex("box-size").unwrap().with_owner("o");
        let acquiring = lock.acquire(Wait::Forever, Instant::now()).unwrap();
        let size = std::mem::size_of_val(&*acquiring);
        assert!(size <= 464, "the acquire's box: {size} bytes");
    }

    /// Every task that waits for a lock holds its handle; tokio allocates a task in steps
    /// of 128 bytes, so each byte of the handle can cost a waiter 128 of them.
    #[test]
    fn a_lock_handle_keeps_its_rarer_options_behind_one_pointer() {
        let size = std::mem::size_of::<Lock>();
        assert!(size <= 80, "a lock handle: {size} bytes");
    }
}
