//! `leasehold bench --workload S1`: many waiters in one process. `--names` locks, each
//! held by one task while `--waiters` more tasks per name wait for it (`lock()`, no
//! limit), all through one [`Leasehold`] client; then every holder releases and each
//! waiter takes its lock once and releases it at once.
//!
//! Reported: the waiters queued, the TCP connections the process has open (to the store),
//! the growth of its resident memory per held lock and per waiter, the time from the
//! releases to every waiter served, the errors, and what the run left in the store
//! afterwards (locks still listed; on etcd, leases and keys, via `etcdctl`; on Redis,
//! keys, via `redis-cli`, when those are on the PATH).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::{Leasehold, Lock, LockGuard, StoreUrl};
use serde::Serialize;
use tokio::task::JoinHandle;

use super::BenchArgs;
use crate::exit::{Failure, INTERNAL, USAGE};

/// Whether `--workload` names the many-waiters workload.
pub fn is_scale_workload(text: &str) -> bool {
    text.trim().eq_ignore_ascii_case("S1")
}

/// Most waiters accepted.
const MAX_WAITERS: usize = 100_000;
/// How long the queued count may stay still before the waiters count as settled: gated
/// waiters (in-process queues) never reach the store, so no callback says they wait.
const SETTLED: Duration = Duration::from_millis(500);
/// How long the store may take to drop what the client leaves when it is dropped.
const LEFT_PATIENCE: Duration = Duration::from_secs(5);
/// Holders acquired at once.
const HOLDER_BATCH: usize = 100;

#[derive(Debug, Serialize)]
struct Report {
    schema: &'static str,
    workload: &'static str,
    backend: &'static str,
    fair: bool,
    names: usize,
    waiters: usize,
    /// Waiters whose request the store answered "busy" before the releases.
    queued: usize,
    /// Established TCP connections of the process while the waiters waited.
    connections: usize,
    held_lock_bytes: Option<u64>,
    waiter_bytes: Option<u64>,
    /// The heap in use per waiter (glibc), once they wait: what they hold, where RSS also
    /// counts what the allocator kept of what was in flight while they arrived.
    waiter_heap_bytes: Option<u64>,
    /// From the first release to the last waiter served.
    served_s: Option<f64>,
    served: usize,
    errors: usize,
    first_error: Option<String>,
    /// Locks with holders or waiters under the run's prefix after shutdown.
    left_locks: Option<usize>,
    /// etcd: leases in the cluster after shutdown (all of them: use a cluster of its own).
    left_leases: Option<usize>,
    /// etcd / Redis: keys in the store after shutdown that carry the run's prefix.
    left_keys: Option<usize>,
}

fn usage(message: impl Into<String>) -> Failure {
    Failure::new(USAGE, message)
}

/// Resident memory of this process, in bytes (Linux; `None` elsewhere).
fn rss() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

/// The heap's bytes in use (glibc's `mallinfo2`, every arena; `None` elsewhere).
fn heap_in_use() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 has no preconditions.
        let info = unsafe { libc::mallinfo2() };
        u64::try_from(info.uordblks).ok()
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}

/// Established TCP connections of this process (to `port`, if given): its sockets'
/// inodes, found in the kernel's TCP tables (which list the whole network namespace).
pub fn connections(port: Option<u16>) -> usize {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    let ours: std::collections::HashSet<String> = fds
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().into_owned();
            Some(
                link.strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    let remote = port.map(|port| format!(":{port:04X}"));
    ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .map(|table| {
            table
                .lines()
                .skip(1)
                .filter(|line| {
                    let cols: Vec<&str> = line.split_whitespace().collect();
                    // Column 2 is the remote address, 3 the state (01: established), 9
                    // the inode.
                    let to = cols.get(2).is_some_and(|r| {
                        remote
                            .as_ref()
                            .is_none_or(|remote| r.ends_with(remote.as_str()))
                    });
                    to && cols.get(3) == Some(&"01")
                        && cols.get(9).is_some_and(|i| ours.contains(*i))
                })
                .count()
        })
        .sum()
}

/// Bytes of growth per item, if both readings exist.
fn per(before: Option<u64>, after: Option<u64>, items: usize) -> Option<u64> {
    Some(after?.saturating_sub(before?) / items.max(1) as u64)
}

/// Output lines of a command, or `None` if it cannot run or fails.
fn lines_of(program: &str, args: &[&str]) -> Option<Vec<String>> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .ok()?;
    out.status.success().then(|| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    })
}

/// What the store holds: (etcd: every lease; etcd, Redis: keys with `prefix`), `None`
/// where it cannot tell (another store, or no `etcdctl` / `redis-cli` on the PATH).
pub fn left_in_store(url: &StoreUrl, prefix: &str) -> (Option<usize>, Option<usize>) {
    let Some(endpoint) = url.endpoints().first() else {
        return (None, None);
    };
    let (host, port) = (endpoint.host(), endpoint.port().unwrap_or(0));
    match url.scheme().backend() {
        "etcd" => {
            let endpoints = format!("--endpoints={host}:{port}");
            // "found N leases", then their ids.
            let leases = lines_of("etcdctl", &[&endpoints, "lease", "list"])
                .map(|l| l.iter().skip(1).filter(|l| !l.is_empty()).count());
            let keys = lines_of(
                "etcdctl",
                &[&endpoints, "get", "--prefix", "leasehold", "--keys-only"],
            )
            .map(|l| l.iter().filter(|l| l.contains(prefix)).count());
            (leases, keys)
        }
        "redis" if !url.scheme().cluster() => {
            let port = port.to_string();
            let pattern = format!("*{prefix}*");
            let keys = lines_of(
                "redis-cli",
                &["-h", host, "-p", &port, "--scan", "--pattern", &pattern],
            )
            .map(|l| l.iter().filter(|l| !l.is_empty()).count());
            (None, keys)
        }
        _ => (None, None),
    }
}

/// Runs the workload.
pub async fn bench(url: &StoreUrl, args: &BenchArgs) -> Result<ExitCode, Failure> {
    let (names, waiters) = sizes(args)?;
    let budget = args.wait.unwrap_or(Duration::from_secs(120));
    let store = url.open().await?;
    let fair = args.fair || (!args.no_fair && store.capabilities().fair_by_default);
    let store_name = store.describe_store();
    let locks = Leasehold::from_store(store);
    let run = format!("{}:S1:{}", args.key_prefix, std::process::id());
    let lock = |i: usize| {
        Ok::<_, Failure>(
            locks
                .mutex(format!("{run}:n{i}").as_str())?
                .with_ttl(args.ttl.unwrap_or(super::DEFAULT_TTL))
                .with_fair(fair),
        )
    };
    // Warm up: the connections and whatever the store opens on first use.
    if let Some(guard) = lock(names)?.try_lock().await? {
        let _ = guard.release().await?;
    }

    let before_holders = rss();
    let holders = hold_all(names, &lock).await?;
    let before_waiters = rss();
    let heap_before = heap_in_use();
    let waiting = Waiting::default();
    let tasks = (0..waiters)
        .map(|i| Ok(waiting.spawn(lock(i % names)?)))
        .collect::<Result<Vec<_>, Failure>>()?;
    waiting.settle(waiters, budget).await;
    let after_waiters = rss();
    let heap_after = heap_in_use();
    let open = connections(None);

    let released = Instant::now();
    futures_util::future::join_all(holders.into_iter().map(|g| g.release())).await;
    let served = Served::collect(tasks, released + budget).await;
    // Undo of cancelled waiters, then what the store still has.
    let _ = locks.shutdown(Duration::from_secs(30)).await;
    let left_locks = locks.list(&run).await.ok().map(|l| l.len());
    // The client gone, what it kept for reuse goes too (etcd's spare leases, revoked in
    // the background).
    drop(locks);
    let (left_leases, left_keys) = left_after(url, &run).await;
    let (errors, first_error) = waiting
        .errors
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();

    let report = Report {
        schema: "leasehold.scale.v1",
        workload: "S1",
        backend: url.scheme().backend(),
        fair,
        names,
        waiters,
        queued: waiting.queued.load(Ordering::Relaxed),
        connections: open,
        held_lock_bytes: per(before_holders, before_waiters, names),
        waiter_bytes: per(before_waiters, after_waiters, waiters),
        waiter_heap_bytes: per(heap_before, heap_after, waiters),
        served_s: (served.count == waiters)
            .then(|| served.last.map(|l| (l - released).as_secs_f64()))
            .flatten(),
        served: served.count,
        errors,
        first_error,
        left_locks,
        left_leases,
        left_keys,
    };
    super::show_report(args.json, &report, || {
        table(&report, &store_name, served.stuck)
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `--names` and the waiters in all (`--names` x `--waiters`), checked.
fn sizes(args: &BenchArgs) -> Result<(usize, usize), Failure> {
    let waiters = args.names.saturating_mul(args.waiters);
    if args.names == 0 || args.waiters == 0 {
        return Err(usage("--names and --waiters must be at least 1"));
    }
    if waiters > MAX_WAITERS {
        return Err(usage(format!(
            "--names x --waiters = {waiters}: at most {MAX_WAITERS} waiters"
        )));
    }
    Ok((args.names, waiters))
}

/// A holder for each of `names` locks, `HOLDER_BATCH` at a time.
async fn hold_all(
    names: usize,
    lock: &impl Fn(usize) -> Result<Lock, Failure>,
) -> Result<Vec<LockGuard>, Failure> {
    let mut holders: Vec<LockGuard> = Vec::with_capacity(names);
    for start in (0..names).step_by(HOLDER_BATCH) {
        let batch = (start..(start + HOLDER_BATCH).min(names))
            .map(|i| {
                let lock = lock(i);
                async move {
                    lock?
                        .try_lock()
                        .await?
                        .ok_or_else(|| Failure::new(INTERNAL, "a fresh lock name was taken"))
                }
            })
            .collect::<Vec<_>>();
        for guard in futures_util::future::join_all(batch).await {
            holders.push(guard?);
        }
    }
    Ok(holders)
}

/// The waiting tasks' shared counts: how many the store answered busy, and errors.
#[derive(Default)]
struct Waiting {
    queued: Arc<AtomicUsize>,
    errors: Arc<Mutex<(usize, Option<String>)>>,
}

impl Waiting {
    /// A task that waits for `lock` (no limit), takes it, releases it, and returns when
    /// it was served.
    fn spawn(&self, lock: Lock) -> JoinHandle<Option<Instant>> {
        let counted = AtomicBool::new(false);
        let queued = self.queued.clone();
        let handle = lock.on_wait(move |_| {
            if !counted.swap(true, Ordering::Relaxed) {
                queued.fetch_add(1, Ordering::Relaxed);
            }
        });
        let errors = self.errors.clone();
        // The answer is taken apart before the release's wait, so the task does not keep
        // room for it while it waits (a task is allocated in steps of 128 bytes).
        tokio::spawn(async move {
            let guard = match handle.lock().await {
                Ok(guard) => guard,
                Err(e) => {
                    let mut errors = errors.lock().unwrap_or_else(|e| e.into_inner());
                    errors.0 += 1;
                    errors.1.get_or_insert(e.to_string());
                    return None;
                }
            };
            let served = Instant::now();
            let _ = guard.release().await;
            Some(served)
        })
    }

    /// Until every waiter answered busy, or the count stood still for a while (gated
    /// waiters wait in the process without asking the store), within `budget`.
    async fn settle(&self, waiters: usize, budget: Duration) {
        let settle_by = Instant::now() + budget;
        let (mut last, mut still_since) = (usize::MAX, Instant::now());
        loop {
            let now = self.queued.load(Ordering::Relaxed);
            if now != last {
                (last, still_since) = (now, Instant::now());
            }
            if now == waiters || still_since.elapsed() >= SETTLED || Instant::now() >= settle_by {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// How the waiters ended: served (and the last of them when), or still waiting when the
/// budget ran out (abandoned).
struct Served {
    count: usize,
    last: Option<Instant>,
    stuck: usize,
}

impl Served {
    async fn collect(tasks: Vec<JoinHandle<Option<Instant>>>, serve_by: Instant) -> Served {
        let mut served = Served {
            count: 0,
            last: None,
            stuck: 0,
        };
        for task in tasks {
            let left = serve_by.saturating_duration_since(Instant::now());
            let abort = task.abort_handle();
            match tokio::time::timeout(left, task).await {
                Ok(Ok(Some(at))) => {
                    served.count += 1;
                    served.last = Some(served.last.map_or(at, |l| l.max(at)));
                }
                Ok(_) => {}
                Err(_) => {
                    abort.abort();
                    served.stuck += 1;
                }
            }
        }
        served
    }
}

/// What the store still has of run `run`: looked at until nothing is left, or for
/// `LEFT_PATIENCE`.
async fn left_after(url: &StoreUrl, run: &str) -> (Option<usize>, Option<usize>) {
    let look_until = Instant::now() + LEFT_PATIENCE;
    loop {
        let (leases, keys) = left_in_store(url, run);
        let clean = leases.unwrap_or(0) == 0 && keys.unwrap_or(0) == 0;
        if clean || Instant::now() >= look_until {
            return (leases, keys);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn bytes(b: Option<u64>) -> String {
    b.map_or_else(|| "n/a".into(), |b| format!("{b} B"))
}

fn count(n: Option<usize>) -> String {
    n.map_or_else(|| "n/a".into(), |n| n.to_string())
}

fn table(r: &Report, store: &str, stuck: usize) -> String {
    let mode = if r.fair { "fair" } else { "non-fair" };
    let served = match r.served_s {
        Some(s) => format!("{:.3} s (all {})", s, r.served),
        None => format!(
            "not all: {} of {} ({stuck} still waiting)",
            r.served, r.waiters
        ),
    };
    format!(
        "workload       S1 ({} names x {} waiters = {} waiters, {mode})\n\
         store          {store}\n\
         queued         {} (answered busy by the store; the rest wait in the process)\n\
         connections    {}\n\
         per held lock  {} (RSS growth)\n\
         per waiter     {} (RSS growth; heap in use {})\n\
         served         {served}\n\
         errors         {}{}\n\
         left after     {} locks, {} leases, {} keys\n",
        r.names,
        r.waiters / r.names.max(1),
        r.waiters,
        r.queued,
        r.connections,
        bytes(r.held_lock_bytes),
        bytes(r.waiter_bytes),
        bytes(r.waiter_heap_bytes),
        r.errors,
        r.first_error
            .as_ref()
            .map_or_else(String::new, |e| format!(" (first: {e})")),
        count(r.left_locks),
        count(r.left_leases),
        count(r.left_keys),
    )
}
