//! `leasehold torture`: worker processes contend for one lock and increment a fenced
//! counter while a nemesis pauses and kills the holder, restarts the store and breaks the
//! link; every process logs its history and a checker judges the merged history.
//!
//! The coordinator (this process) is never paused: it serves the counter (see
//! `resource.rs`), runs the nemesis and the link proxies, and spawns the workers
//! (copies of this binary running the hidden `torture-worker` command).
//!
//! The rooms: `plan.rs` (the flags, their checks, the store and its proxies),
//! `workers.rs` (starting and ending the workers), `nemesis.rs` (the faults),
//! `observer.rs` (following an election's leader), `report.rs` (the verdict).

pub mod check;
pub mod command;
pub mod history;
mod nemesis;
mod observer;
mod plan;
mod proxy;
mod report;
mod resource;
mod spawn;
pub mod worker;
mod workers;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::time::Instant;

use self::history::Log;
use self::plan::Target;
pub use self::plan::{FaultKind, Spawn, TortureArgs, WorkersAs};
use self::proxy::Link;
use self::resource::Resource;
use self::spawn::Keeper;
use self::workers::Worker;
use crate::exit::{self, Failure};

/// Exit status when the history broke an invariant (or the control stayed clean).
pub const VIOLATED: u8 = 1;

/// Everything the nemesis touches.
struct Run {
    args: TortureArgs,
    url: String,
    lock: String,
    /// The store's name in the report.
    label: String,
    fair: bool,
    seed: u64,
    rng: std::sync::Mutex<StdRng>,
    /// `run` workers: the `leasehold run` process of each owner now running.
    runs: std::sync::Mutex<HashMap<String, i32>>,
    /// The run is ending: start no more `run` workers.
    stopping: AtomicBool,
    dir: PathBuf,
    resource_addr: String,
    resource: Arc<Resource>,
    log: Arc<Log>,
    workers: tokio::sync::Mutex<Vec<Worker>>,
    keeper: Option<Keeper>,
    links: Vec<Arc<Link>>,
}

/// Runs a torture scenario and prints its report.
pub async fn torture(store: Option<&str>, args: TortureArgs) -> Result<ExitCode, Failure> {
    plan::check_times(&args)?;
    plan::check_primitive(&args)?;
    // Every flag checked before the history's directory is made: a refused run leaves
    // none behind.
    plan::check_store(&args, store)?;
    let dir = plan::history_dir(&args)?;
    let target = Target::open(&args, store, &dir).await?;
    let run = Arc::new(Run::start(args, target, dir).await?);
    let observer = run.observe();
    let slots = run.start_workers().await?;
    let until = Instant::now() + run.args.duration;
    run.nemesis(until).await;
    run.finish(slots).await;
    if let Some(observer) = observer {
        observer.abort();
    }
    report::verdict(&run)
}

/// The seed given, or a fresh one.
fn run_seed(given: Option<u64>) -> u64 {
    given.unwrap_or_else(rand::random)
}

impl Run {
    /// The run's state, with the counter served (not yet any worker).
    async fn start(args: TortureArgs, target: Target, dir: PathBuf) -> Result<Run, Failure> {
        let log = Arc::new(
            Log::create(&dir.join("coordinator.jsonl"))
                .map_err(|e| Failure::new(exit::USAGE, format!("{}: {e}", dir.display())))?,
        );
        let resource = Resource::new(args.fence, log.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| Failure::new(exit::INTERNAL, format!("resource: {e}")))?;
        let resource_addr = listener
            .local_addr()
            .map_err(|e| Failure::new(exit::INTERNAL, format!("resource: {e}")))?
            .to_string();
        tokio::spawn(resource.clone().serve(listener));

        let seed = run_seed(args.seed);
        Ok(Run {
            lock: format!(
                "torture-{}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ),
            url: target.url,
            fair: target.fair,
            label: target.label,
            seed,
            rng: std::sync::Mutex::new(StdRng::seed_from_u64(seed)),
            runs: std::sync::Mutex::default(),
            stopping: AtomicBool::new(false),
            dir,
            resource_addr,
            resource,
            log,
            workers: tokio::sync::Mutex::new(Vec::new()),
            keeper: target.keeper,
            links: target.links,
            args,
        })
    }

    fn ttl(&self, factor: f64) -> Duration {
        self.args.ttl.mul_f64(factor)
    }

    /// Whether the workers are `leasehold run`s.
    fn via_run(&self) -> bool {
        self.args.workers_as == WorkersAs::Run
    }

    /// A random choice from the run's seeded generator.
    fn random<T>(&self, f: impl FnOnce(&mut StdRng) -> T) -> T {
        f(&mut self.rng.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
