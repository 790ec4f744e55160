//! What a torture run is asked for and what it sets up before any worker starts: its
//! flags and their checks, the store it runs on and the link proxies in front of it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use leasehold::url::{Endpoint, Scheme};
use leasehold::StoreUrl;

use super::check::{Fence, Primitive};
use super::proxy::{self, Link};
use super::spawn::Keeper;
use crate::exit::{self, Failure};

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
    #[arg(long, value_name = "DUR", default_value = "60s", value_parser = crate::args::parse_duration)]
    pub duration: Duration,

    /// The lock's lease; pauses and delays are multiples of it
    #[arg(long, value_name = "DUR", default_value = "1s", value_parser = crate::args::parse_duration)]
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

    /// The lock: mutex, semaphore:N (N permits), rwlock (one worker cycle in three a
    /// writer) or election (candidates campaign; an observer follows the leader)
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
--primitive election: each cycle campaigns (Election::candidate) with a value of its
own and, leading, does a mutex holder's cycle with its term as the token; the
coordinator follows the leader (Election::observe) and logs every leader it reports.
Always fair; library workers only.
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
latency; for an election, each observer's terms (never going back) and each leader it
reported (a term some candidate was granted, with that campaign's value).

Exit status: 0 all invariants held; 1 an invariant was broken, or the unfenced control
(--fence none with pauses, or restarts of redis-volatile) showed no damage, which means
the faults did not land;
64 bad usage; 69 the store is unreachable.

Examples:
  leasehold torture --duration 60s
  leasehold torture --primitive semaphore:2 --workers 6
  leasehold torture --primitive rwlock --workers-as run --fair
  leasehold torture --primitive election --spawn redis --faults pause,kill,restart-store
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
    pub(super) fn label(self) -> &'static str {
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
    pub(super) fn name(self) -> String {
        self.to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }

    pub(super) fn on_link(self) -> bool {
        matches!(self, FaultKind::Delay | FaultKind::Drop | FaultKind::Reset)
    }
}

/// `--ttl` and `--duration` in their ranges.
pub(super) fn check_times(args: &TortureArgs) -> Result<(), Failure> {
    if !(leasehold::MIN_TTL..=leasehold::MAX_TTL).contains(&args.ttl) {
        return Err(Failure::new(exit::USAGE, "--ttl must be from 100ms to 24h"));
    }
    if args.duration < Duration::from_secs(1) {
        return Err(Failure::new(exit::USAGE, "--duration must be at least 1s"));
    }
    Ok(())
}

/// An election is fair and campaigns through the library.
pub(super) fn check_primitive(args: &TortureArgs) -> Result<(), Failure> {
    let problem = match args.primitive {
        Primitive::Election if args.no_fair => "is always fair: leave out --no-fair",
        Primitive::Election if args.workers_as == WorkersAs::Run => {
            "takes library workers: leave out --workers-as run"
        }
        _ => return Ok(()),
    };
    Err(Failure::new(
        exit::USAGE,
        format!("--primitive {} {problem}", args.primitive),
    ))
}

/// The directory for the histories, created.
pub(super) fn history_dir(args: &TortureArgs) -> Result<PathBuf, Failure> {
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
    Ok(dir)
}

/// The store flags agree and allow the faults.
pub(super) fn check_store(args: &TortureArgs, store: Option<&str>) -> Result<(), Failure> {
    if args.spawn.is_some() && store.is_some() {
        return Err(Failure::new(
            exit::USAGE,
            "--spawn starts its own store: leave out --store",
        ));
    }
    if let Some(store) = store {
        // Each worker is a process of its own: on memory: each would have a store of its
        // own, and the run would report the overlaps of locks that were never shared.
        let url = crate::args::store_url(Some(store))?;
        let in_vain =
            "give each worker a store of its own and report overlaps that no lock could prevent";
        crate::args::refuse_memory(&url, "torture", in_vain, "redis://... or etcd://...")?;
    }
    check_faults(
        &args.faults,
        args.spawn,
        store,
        args.workers_as == WorkersAs::Run,
    )
}

/// The store the run uses: the one it started or was given, as the workers reach it.
pub(super) struct Target {
    /// The store the run started (--spawn).
    pub(super) keeper: Option<Keeper>,
    /// The URL the workers get: through the link proxies when there are link faults.
    pub(super) url: String,
    /// The store's name in the report.
    pub(super) label: String,
    /// Whether the lock is first come, first served (the flags, else the store's default).
    pub(super) fair: bool,
    pub(super) links: Vec<Arc<Link>>,
}

impl Target {
    /// Starts the store (--spawn) or names the one given, checks that it answers and
    /// puts the link proxies in front of it.
    pub(super) async fn open(
        args: &TortureArgs,
        store: Option<&str>,
        dir: &Path,
    ) -> Result<Target, Failure> {
        let keeper = args.spawn.map(Keeper::start).transpose()?;
        let (mut url, label) = match (&keeper, store) {
            (Some(k), _) => (k.url.clone(), k.label.to_string()),
            (None, Some(url)) => (
                url.to_string(),
                crate::args::store_url(Some(url))?.scheme().to_string(),
            ),
            (None, None) => (
                format!("local:{}", dir.join("store").display()),
                "local".into(),
            ),
        };
        // Reachable, and which mode is its default, before any worker starts.
        let probe = crate::args::open_store(Some(&url)).await?;
        let fair = match (args.fair, args.no_fair) {
            _ if args.primitive == Primitive::Election => true,
            (true, _) => true,
            (_, true) => false,
            _ => probe.capabilities().fair_by_default,
        };
        drop(probe);
        let mut links = Vec::new();
        if args.faults.iter().any(|f| f.on_link()) {
            (url, links) = through_proxies(&url).await?;
        }
        Ok(Target {
            keeper,
            url,
            label,
            fair,
            links,
        })
    }
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
            (f, None) if f.on_link() && !store.is_some_and(proxyable) => {
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

/// Whether link faults can put proxies in front of the store `url` names: a plain
/// `redis://` or `etcd://` one (TLS would not take a proxy's address as the server's
/// name, and a cluster's nodes send clients on to each other's own addresses).
fn proxyable(url: &str) -> bool {
    StoreUrl::parse(url).is_ok_and(|url| matches!(url.scheme(), Scheme::Redis | Scheme::Etcd))
}

/// Starts a link proxy in front of each endpoint of `url`; returns the URL through them.
async fn through_proxies(url: &str) -> Result<(String, Vec<Arc<Link>>), Failure> {
    if !proxyable(url) {
        return Err(Failure::new(
            exit::USAGE,
            "link faults need a redis:// or etcd:// store",
        ));
    }
    let url = crate::args::store_url(Some(url))?;
    let mut proxies = Vec::new();
    let mut links = Vec::new();
    for endpoint in url.endpoints() {
        let (port, link) = proxy::start(endpoint.to_string())
            .await
            .map_err(|e| Failure::new(exit::INTERNAL, format!("proxy: {e}")))?;
        proxies.push(Endpoint::new("127.0.0.1", port));
        links.push(link);
    }
    Ok((url.with_endpoints(proxies).expose(), links))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_faults_take_plain_redis_and_etcd_stores_only() {
        for url in ["redis://user:pw@h:1/2", "etcd://a:1,b:2?user=u&password=p"] {
            assert!(proxyable(url), "{url}");
        }
        for url in [
            "local:/tmp/x",
            "rediss://h:1",
            "redis+cluster://h:1,h:2",
            "etcds://h:1",
            "redis://h:port",
        ] {
            assert!(!proxyable(url), "{url}");
        }
    }
}
