//! `leasehold torture`: worker processes contend for one lock and increment a fenced
//! counter while a nemesis pauses and kills the holder, restarts the store and breaks the
//! link; every process logs its history and a checker judges the merged history.
//!
//! The coordinator (this process) is never paused: it serves the counter (see
//! `resource.rs`), runs the nemesis and the link proxies, and spawns the workers
//! (copies of this binary running the hidden `torture-worker` command).

pub mod check;
pub mod command;
pub mod history;
mod proxy;
mod resource;
mod spawn;
pub mod worker;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::process::{Child, Command};
use tokio::time::{sleep, Instant};

use self::check::{Fence, Primitive, Report, Setup};
use self::history::{Event, Log, Role};
use self::proxy::Link;
use self::resource::{Phase, Resource};
use self::spawn::{Keeper, Spawned};
use crate::exit::{self, Failure};

/// Exit status when the history broke an invariant (or the control stayed clean).
pub const VIOLATED: u8 = 1;

// `leasehold torture` flags.
#[derive(Debug, Args)]
#[command(after_help = TORTURE_AFTER_HELP)]
pub struct TortureArgs {
    /// Start the store for this run, so the nemesis can pause, kill and restart it:
    /// a persistent redis-server, one without persistence (a restart forgets every lock),
    /// one etcd member, or a 3-member etcd cluster (instead of --store; needs a build
    /// with the `spawn` feature)
    #[arg(long, value_enum, value_name = "KIND")]
    pub spawn: Option<Spawn>,

    /// Worker processes contending for the lock (1 to 64)
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,

    /// How long the nemesis runs (then the workers finish their cycle)
    #[arg(long, value_name = "DUR", default_value = "60s", value_parser = crate::parse_duration)]
    pub duration: Duration,

    /// The lock's lease; pauses and delays are multiples of it
    #[arg(long, value_name = "DUR", default_value = "1s", value_parser = crate::parse_duration)]
    pub ttl: Duration,

    /// How the counter checks tokens: all (reads and writes; stale ones are refused),
    /// writes (writes only), none (the unfenced control: it must show lost updates)
    #[arg(long, value_enum, default_value = "all")]
    pub fence: Fence,

    /// Faults, comma-separated, applied in turn with a quiet time of 1-2 TTL between
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "pause,short-pause,kill"
    )]
    pub faults: Vec<FaultKind>,

    /// First come, first served [default: the store's default]
    #[arg(long, overrides_with = "no_fair")]
    pub fair: bool,

    /// Not first come, first served
    #[arg(long, overrides_with = "fair")]
    pub no_fair: bool,

    /// The lock: mutex, semaphore:N (N permits) or rwlock (one worker cycle in three a
    /// writer)
    #[arg(long, value_name = "KIND", default_value = "mutex")]
    pub primitive: Primitive,

    /// What a worker is: a process of the library's (library), or a `leasehold run`
    /// whose command is the critical section (run)
    #[arg(long, value_enum, value_name = "KIND", default_value = "library")]
    pub workers_as: WorkersAs,

    /// Seed of the random choices (fault order and lengths, roles, think times); printed
    /// in the report. The same seed repeats the choices, not the interleaving
    #[arg(long)]
    pub seed: Option<u64>,

    /// Directory for the histories (one JSONL file per process) [default: a new
    /// directory under the temp dir]
    #[arg(long, value_name = "DIR")]
    pub history: Option<PathBuf>,

    /// Print the report as one JSON object
    #[arg(long)]
    pub json: bool,
}

const TORTURE_AFTER_HELP: &str = "\
Each worker loops: acquire the lock, read the counter with its fencing token, think
(usually briefly, one cycle in five longer than the TTL), write counter+1 with its token,
release. It does not ask the lock again before writing, like an application that was
paused after its check: fencing is what must refuse the stale write.

--primitive semaphore:N: workers take permits and enter a gauge that counts who is inside
(permits cannot be fenced by token); --primitive rwlock: one cycle in three a writer
(as above), else a reader (read, think, read again: a write between is a torn read).
--workers-as run: each acquisition is a `leasehold run` process whose command does the
cycle; the nemesis pauses (SIGSTOP) the run and its command together, and kills the run.

Faults (the nemesis targets the worker that holds the lock and has read the counter):
  pause          SIGSTOP the holder for 1.5-2x TTL, then SIGCONT: it must report the loss
  short-pause    SIGSTOP the holder for 0.3x TTL: it must NOT report a loss
  stall-run      SIGSTOP a holding `leasehold run` alone (not its command) for 1.5-2x
                 TTL: its watchdog must stop the command by the lease's safe deadline
                 (--workers-as run)
  kill           SIGKILL the holder and start a new worker
  pause-store    SIGSTOP the store for 1.5x TTL (--spawn only)
  restart-store  kill the store and start it again (--spawn redis, redis-volatile or etcd)
  kill-member    kill an etcd member that does not lead, restart it after 2x TTL
  kill-leader    kill the etcd leader, restart it after 2x TTL (--spawn etcd-cluster)
  delay          a proxy holds store replies back 1.5x TTL for 1x TTL (grants arrive late)
  drop           a proxy drops all traffic for 1.5x TTL, then resets the connections
  reset          a proxy resets every store connection (requests with unknown outcome)
The link faults (delay, drop, reset) need a redis:// or etcd:// store. Without --store
or --spawn the run uses a local store of its own, in the history directory.

The report: service overlap (two valid leases at once; must be 0, except where a
restart of --spawn redis-volatile forgot the lock: fencing must then refuse the holder
it left behind, so stale accesses accepted must be 0 with --fence all), belief overlap
(workers that believed they held at once; reported), stale accesses accepted and lost
updates (must be 0 with --fence all), tokens (unique, rising, unchanged on re-entry),
expired leases reported lost, false losses (must be 0), takeover after a kill, acquire
latency.

Exit status: 0 all invariants held; 1 an invariant was broken, or the unfenced control
(--fence none with pauses, or restarts of redis-volatile) showed no damage, which means
the faults did not land;
64 bad usage; 69 the store is unreachable.

Examples:
  leasehold torture --duration 60s
  leasehold torture --primitive semaphore:2 --workers 6
  leasehold torture --primitive rwlock --workers-as run --fair
  leasehold torture --spawn redis --faults pause,short-pause,kill,restart-store
  leasehold torture --spawn etcd-cluster --ttl 2s --faults pause,kill,kill-member,kill-leader
  leasehold torture --spawn redis --fence none --faults pause    # the control
  leasehold torture --spawn redis-volatile --faults restart-store # a Redis that forgets";

/// What a worker process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkersAs {
    /// A loop over the library's lock, logging every step (the hidden `torture-worker`)
    Library,
    /// `leasehold run` with default flags (but --ttl and the lock's kind), one per
    /// acquisition, whose command (the hidden `torture-command`) is the critical section
    Run,
}

/// A store the run starts itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Spawn {
    /// redis-server with every write fsynced before it answers (a restart loses nothing)
    Redis,
    /// redis-server without persistence, as a cache is run: a restart forgets every
    /// lock (fencing must refuse the holder it leaves behind)
    RedisVolatile,
    /// one etcd member
    Etcd,
    /// three etcd members (kill-member, kill-leader)
    EtcdCluster,
}

impl Spawn {
    /// The store's name in the report.
    fn label(self) -> &'static str {
        match self {
            Spawn::Redis => "redis",
            Spawn::RedisVolatile => "redis-volatile",
            Spawn::Etcd => "etcd",
            Spawn::EtcdCluster => "etcd-cluster",
        }
    }
}

/// What the nemesis does (see the help).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FaultKind {
    /// Pause the holder past its lease
    Pause,
    /// Pause the holder for a third of its lease
    ShortPause,
    /// Pause a `run` worker's `leasehold` alone, past its lease (not its command)
    StallRun,
    /// Kill the holder
    Kill,
    /// Pause the store
    PauseStore,
    /// Restart the store
    RestartStore,
    /// Kill an etcd member that does not lead
    KillMember,
    /// Kill the etcd leader
    KillLeader,
    /// Delay store replies
    Delay,
    /// Drop store traffic
    Drop,
    /// Reset store connections
    Reset,
}

impl FaultKind {
    fn name(self) -> String {
        self.to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }

    fn on_link(self) -> bool {
        matches!(self, FaultKind::Delay | FaultKind::Drop | FaultKind::Reset)
    }
}

/// Signals a worker; one that has just exited is no error (the testkit's `send_signal`
/// panics on that, as a test should).
fn signal(pid: i32, signal: i32) {
    if pid > 0 {
        // SAFETY: kill has no memory effects; a gone process gives ESRCH.
        unsafe { libc::kill(pid, signal) };
    }
}

/// One worker slot: its current process (library workers).
#[derive(Debug)]
struct Worker {
    owner: String,
    incarnation: u32,
    child: Child,
}

/// Everything the nemesis touches.
struct Run {
    args: TortureArgs,
    url: String,
    lock: String,
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
    let ttl = args.ttl;
    if !(leasehold::MIN_TTL..=leasehold::MAX_TTL).contains(&ttl) {
        return Err(Failure::new(exit::USAGE, "--ttl must be from 100ms to 24h"));
    }
    if args.duration < Duration::from_secs(1) {
        return Err(Failure::new(exit::USAGE, "--duration must be at least 1s"));
    }
    let dir = match &args.history {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!(
            "leasehold-torture-{}-{:06x}",
            std::process::id(),
            rand::random::<u32>() & 0xff_ffff
        )),
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| Failure::new(exit::USAGE, format!("{}: {e}", dir.display())))?;
    if args.spawn.is_some() && store.is_some() {
        return Err(Failure::new(
            exit::USAGE,
            "--spawn starts its own store: leave out --store",
        ));
    }
    check_faults(
        &args.faults,
        args.spawn,
        store,
        args.workers_as == WorkersAs::Run,
    )?;
    let keeper = args.spawn.map(Keeper::start).transpose()?;
    let (mut url, label) = match (&keeper, store) {
        (Some(k), _) => (k.url.clone(), k.label.to_string()),
        (None, Some(url)) => (url.to_string(), scheme(url).to_string()),
        (None, None) => (
            format!("local:{}", dir.join("store").display()),
            "local".into(),
        ),
    };
    // Reachable, and which mode is its default, before any worker starts.
    let probe = crate::open_store(Some(&url)).await?;
    let fair = match (args.fair, args.no_fair) {
        (true, _) => true,
        (_, true) => false,
        _ => probe.capabilities().fair_by_default,
    };
    drop(probe);
    let mut links = Vec::new();
    if args.faults.iter().any(|f| f.on_link()) {
        (url, links) = through_proxies(&url).await?;
    }

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
    let run = Arc::new(Run {
        lock: format!(
            "torture-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ),
        url,
        fair,
        seed,
        rng: std::sync::Mutex::new(StdRng::seed_from_u64(seed)),
        runs: std::sync::Mutex::default(),
        stopping: AtomicBool::new(false),
        dir: dir.clone(),
        resource_addr,
        resource,
        log,
        workers: tokio::sync::Mutex::new(Vec::new()),
        keeper,
        links,
        args,
    });
    let via_run = run.args.workers_as == WorkersAs::Run;
    let mut slots = Vec::new();
    for id in 0..run.args.workers {
        match via_run {
            true => slots.push(tokio::spawn(run.clone().slot(id))),
            false => {
                let worker = run.spawn_worker(id, 0)?;
                run.workers.lock().await.push(worker);
            }
        }
    }
    let until = Instant::now() + run.args.duration;
    run.nemesis(until).await;
    run.finish(slots).await;

    let entries = history::read_dir(&dir)
        .map_err(|e| Failure::new(exit::INTERNAL, format!("{}: {e}", dir.display())))?;
    let setup = Setup {
        fence: run.args.fence,
        primitive: run.args.primitive,
        fair,
        via_run,
        workers_lock_the_store: label == "local" && !via_run,
        store_forgets: run.args.spawn == Some(Spawn::RedisVolatile),
    };
    let report = check::check(&entries, &setup);
    let headline = summary(&label, &run.args, ttl, fair, seed, &report);
    let json = serde_json::json!({
            "store": label,
            "primitive": run.args.primitive,
            "workers_as": if via_run { "run" } else { "library" },
            "seed": seed,
            "fence": run.args.fence,
            "workers": run.args.workers,
            "ttl_ms": ttl.as_millis() as u64,
            "duration_s": run.args.duration.as_secs_f64(),
            "fair": fair,
            "history": dir,
            "summary": headline,
            "report": report,
    });
    // Kept beside the histories; a failure to write it must not hide the verdict.
    let _ = std::fs::write(dir.join("report.json"), format!("{json}\n"));
    if run.args.json {
        println!("{json}");
    } else {
        println!("{headline}");
        for violation in &report.violations {
            println!("  VIOLATED: {violation}");
        }
        println!("  history: {}", dir.display());
    }
    Ok(match report.violations.is_empty() {
        true => ExitCode::SUCCESS,
        false => ExitCode::from(VIOLATED),
    })
}

/// The seed given, or a fresh one.
fn run_seed(given: Option<u64>) -> u64 {
    given.unwrap_or_else(rand::random)
}

/// A seed for one process of the run, from the run's.
fn child_seed(seed: u64, slot: u32, incarnation: u32) -> u64 {
    let mix = (u64::from(slot) << 32 | u64::from(incarnation)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    seed ^ mix.rotate_left(17)
}

/// Faults this run can apply.
fn check_faults(
    faults: &[FaultKind],
    spawn: Option<Spawn>,
    store: Option<&str>,
    via_run: bool,
) -> Result<(), Failure> {
    for &f in faults {
        let problem = match (f, spawn) {
            (FaultKind::PauseStore | FaultKind::RestartStore, None) => Some("needs --spawn"),
            (FaultKind::RestartStore, Some(Spawn::EtcdCluster)) => {
                Some("is for one server; use kill-member or kill-leader on a cluster")
            }
            (FaultKind::KillMember | FaultKind::KillLeader, Some(Spawn::EtcdCluster)) => None,
            (FaultKind::KillMember | FaultKind::KillLeader, _) => {
                Some("needs --spawn etcd-cluster")
            }
            (FaultKind::StallRun, _) if !via_run => Some("needs --workers-as run"),
            (f, None)
                if f.on_link()
                    && store.is_none_or(|s| rewrite_endpoints(s, |e| e.into()).is_none()) =>
            {
                Some("needs a redis:// or etcd:// store")
            }
            _ => None,
        };
        if let Some(problem) = problem {
            return Err(Failure::new(
                exit::USAGE,
                format!("fault {} {problem}", f.name()),
            ));
        }
    }
    Ok(())
}

fn scheme(url: &str) -> &str {
    url.split_once(':').map_or(url, |(s, _)| s)
}

/// `url` with each `host:port` of a redis:// or etcd:// URL replaced by `f`'s result.
fn rewrite_endpoints(url: &str, mut f: impl FnMut(&str) -> String) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    if !matches!(scheme, "redis" | "etcd") {
        return None;
    }
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (user, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (format!("{user}@"), hosts),
        None => (String::new(), authority),
    };
    let hosts: Vec<String> = hosts.split(',').map(&mut f).collect();
    Some(format!("{scheme}://{user}{}{tail}", hosts.join(",")))
}

/// Starts a link proxy in front of each endpoint of `url`; returns the URL through them.
async fn through_proxies(url: &str) -> Result<(String, Vec<Arc<Link>>), Failure> {
    let mut endpoints = Vec::new();
    rewrite_endpoints(url, |endpoint| {
        endpoints.push(endpoint.to_string());
        String::new()
    })
    .ok_or_else(|| Failure::new(exit::USAGE, "link faults need a redis:// or etcd:// store"))?;
    let mut proxies = Vec::new();
    for endpoint in endpoints {
        let proxy = proxy::start(endpoint)
            .await
            .map_err(|e| Failure::new(exit::INTERNAL, format!("proxy: {e}")))?;
        proxies.push(proxy);
    }
    let mut ports = proxies.iter().map(|(port, _)| *port);
    let url = rewrite_endpoints(url, |_| format!("127.0.0.1:{}", ports.next().unwrap_or(0)))
        .unwrap_or_default();
    Ok((url, proxies.into_iter().map(|(_, link)| link).collect()))
}

/// The one-line summary.
fn summary(
    label: &str,
    args: &TortureArgs,
    ttl: Duration,
    fair: bool,
    seed: u64,
    r: &Report,
) -> String {
    let faults: Vec<String> = r.faults.iter().map(|(k, n)| format!("{k}×{n}")).collect();
    let fence = format!("{:?}", args.fence).to_lowercase();
    let via = match args.workers_as {
        WorkersAs::Run => " via run",
        WorkersAs::Library => "",
    };
    let fifo = match fair {
        true => format!(
            "fifo {} broken of {} pairs; ",
            r.fifo_violations, r.fifo_checked
        ),
        false => String::new(),
    };
    format!(
        "{label} {}{via}{} fence={fence} W={} TTL={} seed={seed} {}: {} acq; \
service overlap {} (most holders {}); belief overlap {}; \
stale accepted {} / rejected {}; lost updates {}; torn reads {}; over capacity {}; \
losses reported {}/{} (p50 {:.0} ms); false losses {}; {fifo}\
tokens: {} duplicate, {} backwards, {} re-entries changed; \
takeover {}; acquire p50 {:.1} ms p99 {:.1} ms",
        args.primitive,
        if fair { " fair" } else { "" },
        args.workers,
        leasehold::humanize(ttl),
        if faults.is_empty() {
            "no faults".to_string()
        } else {
            faults.join(" ")
        },
        r.acquisitions,
        r.service_overlap,
        r.max_valid_holders,
        r.belief_overlap,
        r.stale_accepted,
        r.stale_rejected,
        r.lost_updates,
        r.torn_reads,
        r.resource_over_capacity,
        r.losses_reported,
        r.expired_while_held,
        r.loss_report.p50_ms,
        r.false_losses,
        r.duplicate_tokens,
        r.tokens_backwards,
        r.reentry_token_changed,
        match r.takeover.n {
            0 => "n/a".to_string(),
            _ => format!("p50 {:.0} ms", r.takeover.p50_ms),
        },
        r.acquire.p50_ms,
        r.acquire.p99_ms,
    )
}

impl Run {
    fn ttl(&self, factor: f64) -> Duration {
        self.args.ttl.mul_f64(factor)
    }

    /// Starts worker `id`'s process number `incarnation`.
    fn spawn_worker(&self, id: u32, incarnation: u32) -> Result<Worker, Failure> {
        let owner = format!("w{id}.{incarnation}");
        let exe = std::env::current_exe()
            .map_err(|e| Failure::new(exit::INTERNAL, format!("own executable: {e}")))?;
        let stderr = std::fs::File::create(self.dir.join(format!("{owner}.stderr")))
            .map_err(|e| Failure::new(exit::INTERNAL, format!("{}: {e}", self.dir.display())))?;
        let wait = self
            .ttl(4.0 * f64::from(self.args.workers))
            .max(Duration::from_secs(5));
        let mut cmd = Command::new(exe);
        cmd.arg("--store")
            .arg(&self.url)
            .arg("torture-worker")
            .args(["--lock", &self.lock, "--owner", &owner])
            .args(["--resource", &self.resource_addr])
            .arg("--ttl")
            .arg(humantime::format_duration(self.args.ttl).to_string())
            .arg("--wait")
            .arg(humantime::format_duration(wait).to_string())
            .arg("--history")
            .arg(self.dir.join(format!("{owner}.jsonl")))
            .arg("--primitive")
            .arg(self.args.primitive.to_string())
            .arg("--seed")
            .arg(child_seed(self.seed, id, incarnation).to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true);
        if self.fair {
            cmd.arg("--fair");
        }
        // SAFETY: prctl is async-signal-safe. Workers die with the coordinator.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .map_err(|e| Failure::new(exit::INTERNAL, format!("cannot start a worker: {e}")))?;
        let pid = child.id().unwrap_or(0) as i32;
        self.log.record(Event::Spawned {
            owner: owner.clone(),
            pid,
        });
        Ok(Worker {
            owner,
            incarnation,
            child,
        })
    }

    /// Applies the faults in turn until `until`, with a quiet time between them.
    async fn nemesis(&self, until: Instant) {
        let mut next = 0;
        loop {
            sleep(self.ttl(self.random(|r| r.gen_range(1.0..2.0)))).await;
            if Instant::now() >= until || self.args.faults.is_empty() {
                if self.args.faults.is_empty() {
                    tokio::time::sleep_until(until).await;
                }
                return;
            }
            let fault = self.args.faults[next % self.args.faults.len()];
            // A fault that found nothing to hit (no holder, no leader) is tried again next.
            if self.apply(fault).await {
                next += 1;
            }
        }
    }

    /// Applies `fault`; false if it found nothing to hit.
    async fn apply(&self, fault: FaultKind) -> bool {
        let kind = fault.name();
        match fault {
            FaultKind::Pause | FaultKind::ShortPause | FaultKind::StallRun => {
                let factor = match fault {
                    FaultKind::ShortPause => 0.3,
                    _ => self.random(|r| r.gen_range(1.5..2.0)),
                };
                let Some((owner, pid)) = self.holder().await else {
                    return false;
                };
                // A `run` worker's command is in a process group of its own: both stop,
                // as on a paused machine; or `leasehold` alone stalls.
                let command = (self.resource.pid_inside(&owner))
                    .filter(|&p| p > 0 && fault != FaultKind::StallRun);
                signal(pid, libc::SIGSTOP);
                if let Some(command) = command {
                    signal(-command, libc::SIGSTOP);
                }
                self.fault_start(&kind, Some(&owner));
                sleep(self.ttl(factor)).await;
                signal(pid, libc::SIGCONT);
                if let Some(command) = command {
                    signal(-command, libc::SIGCONT);
                }
                self.fault_end(&kind, Some(&owner));
            }
            FaultKind::Kill if self.args.workers_as == WorkersAs::Run => {
                let Some((owner, pid)) = self.holder().await else {
                    return false;
                };
                self.fault_start(&kind, Some(&owner));
                // Logged first: it cannot act after the signal. Its command dies with it
                // (the run's watchdog); the slot starts the next run.
                self.log.record(Event::Killed {
                    owner: owner.clone(),
                });
                signal(pid, libc::SIGKILL);
                self.fault_end(&kind, Some(&owner));
            }
            FaultKind::Kill => {
                let Some((owner, _)) = self.holder().await else {
                    return false;
                };
                self.fault_start(&kind, Some(&owner));
                let mut workers = self.workers.lock().await;
                if let Some((id, w)) = workers
                    .iter_mut()
                    .enumerate()
                    .find(|(_, w)| w.owner == owner)
                {
                    // Logged first: it cannot act after the signal.
                    self.log.record(Event::Killed {
                        owner: owner.clone(),
                    });
                    let _ = w.child.kill().await;
                    self.resource.forget(&owner);
                    if let Ok(new) = self.spawn_worker(id as u32, w.incarnation + 1) {
                        *w = new;
                    }
                }
                self.fault_end(&kind, Some(&owner));
            }
            FaultKind::PauseStore => {
                self.with_store(|s| s.pause(true)).await;
                self.fault_start(&kind, None);
                sleep(self.ttl(1.5)).await;
                self.with_store(|s| s.pause(false)).await;
                self.fault_end(&kind, None);
            }
            FaultKind::RestartStore => {
                self.fault_start(&kind, None);
                self.with_store(Spawned::restart).await;
                self.fault_end(&kind, None);
            }
            FaultKind::KillMember | FaultKind::KillLeader => {
                let leader = fault == FaultKind::KillLeader;
                let killed = (self.with_store(move |s| s.kill_member(leader))).await;
                let Some(i) = killed.flatten() else {
                    return false;
                };
                self.fault_start(&kind, None);
                sleep(self.ttl(2.0)).await;
                self.with_store(move |s| s.restart_member(i)).await;
                self.fault_end(&kind, None);
            }
            FaultKind::Delay => {
                let delay = self.ttl(1.5);
                self.links.iter().for_each(|l| l.set_delay(delay));
                self.fault_start(&kind, None);
                sleep(self.ttl(1.0)).await;
                self.links.iter().for_each(|l| l.set_delay(Duration::ZERO));
                // The last delayed reply is delivered a delay later.
                sleep(delay).await;
                self.fault_end(&kind, None);
            }
            FaultKind::Drop => {
                self.links.iter().for_each(|l| l.set_dropping(true));
                self.fault_start(&kind, None);
                sleep(self.ttl(1.5)).await;
                self.links.iter().for_each(|l| {
                    l.set_dropping(false);
                    l.reset();
                });
                self.fault_end(&kind, None);
            }
            FaultKind::Reset => {
                self.fault_start(&kind, None);
                self.links.iter().for_each(|l| l.reset());
                self.fault_end(&kind, None);
            }
        }
        true
    }

    fn fault_start(&self, kind: &str, target: Option<&str>) {
        self.log.record(Event::FaultStart {
            kind: kind.to_string(),
            target: target.map(String::from),
        });
    }

    fn fault_end(&self, kind: &str, target: Option<&str>) {
        self.log.record(Event::FaultEnd {
            kind: kind.to_string(),
            target: target.map(String::from),
        });
    }

    /// Runs `f` on the spawned store (see [`Keeper`]); `None` without one, or if it failed.
    async fn with_store<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Spawned) -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.keeper.as_ref()?.send(move |s: &mut Spawned| {
            let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(s)));
            let _ = tx.send(done.ok());
        })?;
        rx.await.ok().flatten()
    }

    /// The worker that holds the lock and has read the counter (so a fault lands between
    /// its read and its write), waiting up to 2 TTL for one; else any holder.
    async fn holder(&self) -> Option<(String, i32)> {
        let deadline = Instant::now() + self.ttl(2.0);
        let owner = loop {
            let changed = self.resource.changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(owner) = self.resource.in_phase(Phase::Thinking).pop() {
                break owner;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                break self.resource.in_phase(Phase::Held).pop()?;
            }
        };
        if self.args.workers_as == WorkersAs::Run {
            let pid = *self
                .runs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&owner)?;
            return Some((owner, pid));
        }
        let workers = self.workers.lock().await;
        let worker = workers.iter().find(|w| w.owner == owner)?;
        Some((owner, worker.child.id()? as i32))
    }

    /// A random choice from the run's seeded generator.
    fn random<T>(&self, f: impl FnOnce(&mut StdRng) -> T) -> T {
        f(&mut self.rng.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// One `run` worker slot: starts `leasehold run` processes one after another (each
    /// one acquisition) until the run ends, logging each one's start and exit status.
    async fn slot(self: Arc<Self>, id: u32) {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("r{id}.stderr")));
        for incarnation in 0.. {
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            let owner = format!("r{id}.{incarnation}");
            let role = self.random(|r| worker::pick_role(self.args.primitive, r));
            let seed = child_seed(self.seed, id, incarnation);
            let stderr = match stderr.as_ref().map(|f| f.try_clone()) {
                Ok(Ok(f)) => Stdio::from(f),
                _ => Stdio::null(),
            };
            let mut child = match self.spawn_run(&owner, role, seed, stderr) {
                Ok(child) => child,
                Err(e) => {
                    eprintln!("leasehold torture: cannot start leasehold run: {e}");
                    return;
                }
            };
            let pid = child.id().unwrap_or(0) as i32;
            (self.runs.lock().unwrap_or_else(|e| e.into_inner())).insert(owner.clone(), pid);
            self.log.record(Event::Spawned {
                owner: owner.clone(),
                pid,
            });
            self.log.record(Event::Invoke {
                owner: owner.clone(),
            });
            let status = child.wait().await;
            (self.runs.lock().unwrap_or_else(|e| e.into_inner())).remove(&owner);
            self.resource.forget(&owner);
            let (code, signal) = match status {
                Ok(status) => {
                    use std::os::unix::process::ExitStatusExt;
                    (status.code(), status.signal())
                }
                Err(_) => (None, None),
            };
            self.log.record(Event::RunExited {
                owner,
                code,
                signal,
            });
            // A run that could not even start (the store away): not in a busy loop.
            if code.is_some_and(|c| c != 0 && c != i32::from(command::REFUSED)) {
                sleep(self.ttl(0.1)).await;
            }
        }
    }

    /// `leasehold --store URL run NAME --ttl TTL [kind] -- leasehold torture-command ...`.
    fn spawn_run(
        &self,
        owner: &str,
        role: Role,
        seed: u64,
        stderr: Stdio,
    ) -> std::io::Result<Child> {
        let exe = std::env::current_exe()?;
        let ttl = humantime::format_duration(self.args.ttl).to_string();
        let mut cmd = Command::new(&exe);
        cmd.arg("--store")
            .arg(&self.url)
            .args(["run", &self.lock, "--ttl", &ttl])
            .arg(if self.fair { "--fair" } else { "--no-fair" });
        match (self.args.primitive, role) {
            (Primitive::Semaphore(n), _) => {
                cmd.arg("--permits").arg(n.to_string());
            }
            (_, Role::Shared) => {
                cmd.arg("--shared");
            }
            _ => {}
        }
        cmd.arg("--")
            .arg(&exe)
            .arg("torture-command")
            .args(["--resource", &self.resource_addr, "--owner", owner])
            .args(["--role", role.word(), "--ttl", &ttl])
            .arg("--seed")
            .arg(seed.to_string())
            .env_remove("LEASEHOLD_OWNER")
            .env_remove("LEASEHOLD_HELD")
            .env_remove("LEASEHOLD_NAME")
            .env_remove("LEASEHOLD_STORE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe. Runs die with the coordinator.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        cmd.spawn()
    }

    /// Asks the workers to end after their cycle; kills those still running after a grace.
    async fn finish(&self, slots: Vec<tokio::task::JoinHandle<()>>) {
        self.resource.stop();
        self.stopping.store(true, Ordering::SeqCst);
        let grace = Instant::now() + self.ttl(3.0) + Duration::from_secs(2);
        // `run` workers: each command that enters now goes out at once, so the runs that
        // wait get their turn and end; those left after the grace are stopped.
        for slot in slots {
            let abort = slot.abort_handle();
            if tokio::time::timeout_at(grace, slot).await.is_err() {
                let left: Vec<(String, i32)> = (self.runs.lock())
                    .unwrap_or_else(|e| e.into_inner())
                    .drain()
                    .collect();
                for (owner, pid) in left {
                    self.log.record(Event::Killed { owner });
                    signal(pid, libc::SIGKILL);
                }
                abort.abort();
            }
        }
        let mut workers = self.workers.lock().await;
        for w in workers.iter_mut() {
            if tokio::time::timeout_at(grace, w.child.wait())
                .await
                .is_err()
            {
                self.log.record(Event::Killed {
                    owner: w.owner.clone(),
                });
                let _ = w.child.kill().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_rewritten_and_other_stores_refused() {
        let swap = |url: &str| rewrite_endpoints(url, |e| format!("<{e}>"));
        assert_eq!(
            swap("redis://user:pw@h:1/2").as_deref(),
            Some("redis://user:pw@<h:1>/2")
        );
        assert_eq!(
            swap("etcd://a:1,b:2?user=u&password=p").as_deref(),
            Some("etcd://<a:1>,<b:2>?user=u&password=p")
        );
        assert_eq!(swap("local:/tmp/x"), None);
        assert_eq!(swap("rediss://h:1"), None);
    }
}
