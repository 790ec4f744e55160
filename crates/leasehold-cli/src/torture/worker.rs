//! One torture worker process: acquire, read the counter, think, write counter+1, release;
//! every step logged. It writes without asking the lock again after thinking, like an
//! application that checked and was then paused: fencing is what must stop it.

use std::cell::Cell;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use leasehold::{Error, Leasehold, Lock, LockGuard, Released};
use rand::Rng;

use super::history::{instant_ns, Event, Log};
use super::resource::{Client, Reply};
use crate::exit::{self, Failure};

/// Arguments of the hidden `torture-worker` command the coordinator spawns.
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
}

/// Runs cycles until the resource says STOP.
pub async fn worker(store: Option<&str>, args: WorkerArgs) -> Result<ExitCode, Failure> {
    let log = Log::create(&args.history)
        .map_err(|e| Failure::new(exit::USAGE, format!("{}: {e}", args.history.display())))?;
    let locks = Leasehold::from_store(crate::open_store(store).await?);
    let lock = (locks.mutex(args.lock.as_str())?)
        .with_ttl(args.ttl)
        .with_fair(args.fair)
        .with_owner(args.owner.clone());
    let mut resource = Client::connect(&args.resource, &args.owner)
        .await
        .map_err(|e| Failure::new(exit::UNAVAILABLE, format!("the resource: {e}")))?;
    let owner = || args.owner.clone();
    loop {
        log.record(Event::Invoke { owner: owner() });
        let guard = match lock.try_lock_for(args.wait).await {
            Ok(Some(guard)) => guard,
            Ok(None) => {
                let error = "the wait ran out".to_string();
                log.record(Event::AcquireFailed {
                    owner: owner(),
                    unknown: false,
                    error,
                });
                continue;
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
                continue;
            }
        };
        let token = guard.token().get();
        log.record(Event::Acquired {
            owner: owner(),
            token,
            deadline: instant_ns(guard.valid_until()),
        });
        let stop = cycle(&lock, &guard, &mut resource, &log, &args).await;
        log.record(Event::Release {
            owner: owner(),
            token,
            deadline: instant_ns(guard.valid_until()),
        });
        let outcome = match guard.release().await {
            Ok(Released::Released) => "released".to_string(),
            Ok(Released::NotHeld) => "not_held".to_string(),
            Err(e) => format!("error: {e}"),
        };
        log.record(Event::Released {
            owner: owner(),
            token,
            outcome,
        });
        let done = resource.ask("DONE", token, &[]).await;
        if stop || matches!(done, Ok(Reply::Stop) | Err(_)) {
            return Ok(ExitCode::SUCCESS);
        }
    }
}

/// Holds the lock for one cycle while logging renewals and the loss. Returns whether to
/// stop afterwards.
async fn cycle(
    lock: &Lock,
    guard: &LockGuard,
    resource: &mut Client,
    log: &Log,
    args: &WorkerArgs,
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
        if rand::thread_rng().gen_bool(0.1) {
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
        let value = match resource.ask("READ", token, &[]).await {
            Ok(Reply::Ok(value)) => value,
            Ok(_) => return false,
            Err(_) => return true,
        };
        tokio::time::sleep(think(args.ttl)).await;
        resource
            .ask("WRITE", token, &[value + 1, value])
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
fn think(ttl: Duration) -> Duration {
    let mut rng = rand::thread_rng();
    match rng.gen_bool(0.2) {
        true => ttl.mul_f64(rng.gen_range(1.0..1.5)),
        false => ttl.mul_f64(rng.gen_range(0.0..0.1)),
    }
}
