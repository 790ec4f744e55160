//! One torture worker process: acquire, read the counter, think, write counter+1, release;
//! every step logged. It writes without asking the lock again after thinking, like an
//! application that checked and was then paused: fencing is what must stop it.
//!
//! A read-write lock's worker is a writer in one cycle in three (as above) and else a
//! reader (read, think, read again); a semaphore's enters the resource, thinks there and
//! goes out. An election's candidate campaigns with a value of its own each cycle and,
//! leading, does a mutex holder's cycle with its term as the token.

use std::cell::Cell;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use leasehold::{Election, Error, Leasehold, Lock, LockGuard, Released};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::check::Primitive;
use super::history::{instant_ns, Event, Log, Role};
use super::resource::{Client, Reply};
use crate::exit::{self, Failure};

// Arguments of the hidden `torture-worker` command the coordinator spawns.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Lock name.
    #[arg(long)]
    pub lock: String,
    /// Owner id (worker and incarnation).
    #[arg(long)]
    pub owner: String,
    /// Lease length.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// How long one acquire may wait.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub wait: Duration,
    /// The resource's address.
    #[arg(long)]
    pub resource: String,
    /// The history file to write.
    #[arg(long)]
    pub history: PathBuf,
    /// Fair (FIFO) or not.
    #[arg(long)]
    pub fair: bool,
    /// The lock: mutex, semaphore:N or rwlock.
    #[arg(long, default_value = "mutex")]
    pub primitive: Primitive,
    /// Seeds this worker's random choices (role, think time, re-entry).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Picks the role of the next acquisition: one in three a writer on a read-write lock.
pub fn pick_role(primitive: Primitive, rng: &mut impl Rng) -> Role {
    match primitive {
        Primitive::Mutex | Primitive::Election => Role::Exclusive,
        Primitive::Semaphore(_) => Role::Permit,
        Primitive::RwLock if rng.gen_ratio(1, 3) => Role::Exclusive,
        Primitive::RwLock => Role::Shared,
    }
}

/// The critical section of `role`, once the holder has checked its lock: a mutex holder
/// or writer reads, thinks and writes the value plus one; a reader reads, thinks and
/// reads again; a permit holder thinks (`gauge`: entering and leaving the resource's
/// gauge around it). Ok(false) if the resource refused an access.
pub async fn critical(
    resource: &mut Client,
    role: Role,
    token: u64,
    think: Duration,
    gauge: bool,
) -> std::io::Result<bool> {
    match role {
        Role::Exclusive => {
            let Reply::Ok(value) = resource.ask("READ", token, &[]).await? else {
                return Ok(false);
            };
            tokio::time::sleep(think).await;
            let written = resource.ask("WRITE", token, &[value + 1, value]).await?;
            Ok(written != Reply::Rejected)
        }
        Role::Shared => {
            let Reply::Ok(_) = resource.ask("READS", token, &[]).await? else {
                return Ok(false);
            };
            tokio::time::sleep(think).await;
            Ok(resource.ask("REREAD", token, &[]).await? != Reply::Rejected)
        }
        Role::Permit => {
            if gauge {
                resource.ask_words("ENTER", token, &["permit", "0"]).await?;
            }
            tokio::time::sleep(think).await;
            if gauge {
                resource.ask_words("EXIT", token, &["permit"]).await?;
            }
            Ok(true)
        }
    }
}

/// Runs cycles until the resource says STOP.
pub async fn worker(store: Option<&str>, args: WorkerArgs) -> Result<ExitCode, Failure> {
    let log = Arc::new(
        Log::create(&args.history)
            .map_err(|e| Failure::new(exit::USAGE, format!("{}: {e}", args.history.display())))?,
    );
    // Logs the first answer of each acquire that says the store has queued it.
    let queued = Arc::new(AtomicBool::new(false));
    let locks = open_locks(store, &args, &log, &queued).await?;
    let mut resource = Client::connect(&args.resource, &args.owner)
        .await
        .map_err(|e| Failure::new(exit::UNAVAILABLE, format!("the resource: {e}")))?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut campaigns = 0_u64;
    loop {
        let role = pick_role(args.primitive, &mut rng);
        let candidate;
        let lock = match (role, &locks) {
            (Role::Shared, Locks::ReadWrite { read, .. }) => read,
            (_, Locks::ReadWrite { write: lock, .. } | Locks::One(lock)) => lock,
            (_, Locks::Election(election)) => {
                // A value of its own per campaign: the checker matches what the
                // observers report to the campaign that was granted the term.
                campaigns += 1;
                let value = format!("{}/{campaigns}", args.owner);
                log.record(Event::Campaign {
                    owner: args.owner.clone(),
                    value: value.clone(),
                });
                candidate = configure(election.candidate(value), &args, &log, &queued);
                &candidate
            }
        };
        let plan = Plan {
            role,
            reenter: rng.gen_bool(0.1),
            think: think(args.ttl, &mut rng),
        };
        queued.store(false, Ordering::SeqCst);
        let Some(guard) = acquire(lock, role, &log, &args).await else {
            continue;
        };
        let token = guard.token().get();
        let stop = cycle(lock, &guard, &mut resource, &log, &args, &plan).await;
        release(guard, &log, &args.owner).await;
        let done = resource.ask("DONE", token, &[]).await;
        if stop || matches!(done, Ok(Reply::Stop) | Err(_)) {
            return Ok(ExitCode::SUCCESS);
        }
    }
}

/// What a worker acquires: one lock (a mutex, a semaphore), a read-write lock's two
/// sides, or an election whose candidate for each campaign is a lock of its own.
enum Locks {
    One(Lock),
    ReadWrite { write: Lock, read: Lock },
    Election(Election),
}

/// The worker's locks (see [`Locks`]) on the store.
async fn open_locks(
    store: Option<&str>,
    args: &WorkerArgs,
    log: &Arc<Log>,
    queued: &Arc<AtomicBool>,
) -> Result<Locks, Failure> {
    let locks = Leasehold::from_store(crate::args::open_store(store).await?);
    let name = args.lock.as_str();
    let handle = |lock: Lock| configure(lock, args, log, queued);
    Ok(match args.primitive {
        Primitive::Mutex => Locks::One(handle(locks.mutex(name)?)),
        Primitive::Semaphore(n) => Locks::One(handle(locks.semaphore(name, n)?)),
        Primitive::RwLock => Locks::ReadWrite {
            write: handle(locks.write(name)?),
            read: handle(locks.read(name)?),
        },
        Primitive::Election => Locks::Election(locks.election(name)?),
    })
}

/// `lock` with the worker's TTL, fairness and owner, logging `Queued` at the first
/// answer of an acquire that says the store queued it (once `queued` is reset).
fn configure(lock: Lock, args: &WorkerArgs, log: &Arc<Log>, queued: &Arc<AtomicBool>) -> Lock {
    let (log, queued, owner) = (log.clone(), queued.clone(), args.owner.clone());
    lock.with_ttl(args.ttl)
        .with_fair(args.fair)
        .with_owner(args.owner.clone())
        .on_wait(move |busy| {
            if busy.position.is_some() && !queued.swap(true, Ordering::SeqCst) {
                log.record(Event::Queued {
                    owner: owner.clone(),
                });
            }
        })
}

/// Acquires `lock` as `role` within `--wait`, logging the invocation and the guard, or
/// the failure (after which it waits a little when the store is away).
async fn acquire(lock: &Lock, role: Role, log: &Log, args: &WorkerArgs) -> Option<LockGuard> {
    let owner = || args.owner.clone();
    log.record(Event::Invoke { owner: owner() });
    match lock.try_lock_for(args.wait).await {
        Ok(Some(guard)) => {
            log.record(Event::Acquired {
                owner: owner(),
                token: guard.token().get(),
                deadline: instant_ns(guard.valid_until()),
                role,
            });
            Some(guard)
        }
        Ok(None) => {
            let error = "the wait ran out".to_string();
            log.record(Event::AcquireFailed {
                owner: owner(),
                unknown: false,
                error,
            });
            None
        }
        Err(e) => {
            let unknown = !matches!(e, Error::WaitEnded { .. });
            let error = e.to_string();
            log.record(Event::AcquireFailed {
                owner: owner(),
                unknown,
                error,
            });
            // The store is away (a fault): try again soon, not in a busy loop.
            tokio::time::sleep(args.ttl / 10).await;
            None
        }
    }
}

/// Releases `guard`, logging the deadline it had then and the outcome.
async fn release(guard: LockGuard, log: &Log, owner: &str) {
    let token = guard.token().get();
    log.record(Event::Release {
        owner: owner.to_string(),
        token,
        deadline: instant_ns(guard.valid_until()),
    });
    let outcome = match guard.release().await {
        Ok(Released::Released) => "released".to_string(),
        Ok(Released::NotHeld) => "not_held".to_string(),
        Err(e) => format!("error: {e}"),
    };
    log.record(Event::Released {
        owner: owner.to_string(),
        token,
        outcome,
    });
}

/// One cycle's random choices, made before it starts.
#[derive(Debug)]
struct Plan {
    role: Role,
    reenter: bool,
    think: Duration,
}

/// Holds the lock for one cycle while logging renewals and the loss. Returns whether to
/// stop afterwards.
async fn cycle(
    lock: &Lock,
    guard: &LockGuard,
    resource: &mut Client,
    log: &Log,
    args: &WorkerArgs,
    plan: &Plan,
) -> bool {
    let token = guard.token().get();
    let owner = || args.owner.clone();
    let lost_logged = Cell::new(false);
    let log_lost = || {
        if !lost_logged.replace(true) {
            log.record(Event::Lost {
                owner: owner(),
                token,
            });
        }
    };
    let watch = async {
        let mut deadlines = guard.deadlines();
        loop {
            tokio::select! {
                _ = guard.lost() => {
                    log_lost();
                    std::future::pending::<()>().await;
                }
                Some(deadline) = deadlines.next() => log.record(Event::Renewed {
                    owner: owner(),
                    token,
                    deadline: instant_ns(deadline),
                }),
            }
        }
    };
    let work = async {
        if matches!(
            resource.ask("HELD", token, &[]).await,
            Ok(Reply::Stop) | Err(_)
        ) {
            return true;
        }
        if plan.reenter {
            reenter(lock, token, log, &owner()).await;
        }
        let ok = guard.check().is_ok();
        let deadline = instant_ns(guard.valid_until());
        log.record(Event::Check {
            owner: owner(),
            token,
            ok,
            deadline,
        });
        if !ok {
            return false;
        }
        critical(resource, plan.role, token, plan.think, true)
            .await
            .is_err()
    };
    let stop = tokio::select! {
        stop = work => stop,
        _ = watch => unreachable!("the watch never ends"),
    };
    // After a pause both may have woken at once and the work won: ask `lost` once more.
    if guard.is_lost() {
        tokio::select! {
            biased;
            _ = guard.lost() => log_lost(),
            _ = std::future::ready(()) => {}
        }
    }
    stop
}

/// Acquires again under the same owner while holding: the token must not change.
async fn reenter(lock: &Lock, outer: u64, log: &Log, owner: &str) {
    if let Ok(Some(inner)) = lock.try_lock().await {
        log.record(Event::Reentered {
            owner: owner.to_string(),
            token: inner.token().get(),
            outer,
        });
        let _ = inner.release().await;
    }
}

/// Mostly short; one cycle in five longer than the TTL, which renewals must cover.
pub fn think(ttl: Duration, rng: &mut impl Rng) -> Duration {
    match rng.gen_bool(0.2) {
        true => ttl.mul_f64(rng.gen_range(1.0..1.5)),
        false => ttl.mul_f64(rng.gen_range(0.0..0.1)),
    }
}
