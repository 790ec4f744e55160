//! W3 (8 workers, a key each, acquire + release loops) on Redis: leasehold and its store
//! beside two floors, all driven by the peer harness's loop (tokio tasks on the default
//! runtime, one multiplexed connection) in the same process, in alternating rounds:
//!
//! - `floor`: `SET NX PX`, then a compare-and-delete script (the raw floor peer's steps);
//! - `token`: a script doing `SET NX PX` and `INCR` of a token counter under the same
//!   hash tag (cluster-safe), returning the token, then the same release: the least an
//!   acquisition that issues a fencing token costs;
//! - `layout`: the same two steps with the Redis store's key layout and arguments: the
//!   three keys of a lock (record, hold, token counter) declared in every call, a hold
//!   value of the store's size, the TTL and the request's other fields; a release that
//!   checks the hold's lease prefix and sends the client's channel too;
//! - `store`: the Redis store's `Store::acquire` and `Store::release`, without the library
//!   above it (no guard, renewal or in-process queue);
//! - `leasehold`: `Lock::try_lock_for` and `LockGuard::release`, as `leasehold bench`.
//!
//! Per mode it prints the median rate, the median ratios to `floor`, `token` and `layout`,
//! the client's CPU and context switches per cycle (getrusage of this process) and, from
//! `INFO commandstats` (reset before each run: use a server of its own), Redis commands
//! and server µs per cycle.
//!
//! ```text
//! cargo run --release -p leasehold --features redis --example redis_w3_floors -- \
//!     redis://127.0.0.1:6379/0 [seconds per run, default 2] [rounds, default 6] [workers, default 8]
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{lock_cycle, median, store_cycle, Failure, RELEASE, TOKEN_ACQUIRE};
use leasehold::Leasehold;
use redis::aio::MultiplexedConnection;

mod common;

const LAYOUT_ACQUIRE: &str = "if redis.call('set', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return redis.call('incr', KEYS[3]) end return 0";
const LAYOUT_RELEASE: &str = "local v = redis.call('get', KEYS[2]) if v and string.find(v, ARGV[1] .. '\\31', 1, true) == 1 then return redis.call('del', KEYS[2]) end return 0";
const MODES: [&str; 5] = ["floor", "token", "layout", "store", "leasehold"];

/// What one run of a mode measured.
#[derive(Clone, Copy, Default)]
struct Figures {
    rate: f64,
    cpu_us: f64,
    switches: f64,
    commands: f64,
    server_us: f64,
}

/// One worker of `mode` on a key of its own until `end`; its cycles.
async fn worker(
    mode: &'static str,
    mut conn: MultiplexedConnection,
    locks: Leasehold,
    tag: String,
    end: Instant,
) -> Result<u64, Failure> {
    let (release, acquire) = (
        redis::Script::new(RELEASE),
        redis::Script::new(TOKEN_ACQUIRE),
    );
    let (key, counter) = (format!("{{{tag}}}:k"), format!("{{{tag}}}:t"));
    let layout = (
        redis::Script::new(LAYOUT_ACQUIRE),
        redis::Script::new(LAYOUT_RELEASE),
    );
    let (record, hold) = (format!("lh:{{{tag}}}"), format!("lh:{{{tag}}}:hold"));
    let channel = format!("lh:wake:{}", leasehold::store::LeaseId::random().as_str());
    let lock = locks.mutex(tag.as_str())?.with_ttl(Duration::from_secs(30));
    let name: leasehold::LockName = tag.as_str().try_into()?;
    let requester = Arc::new(leasehold::store::Requester::this_process());
    let mut cycles = 0;
    while Instant::now() < end {
        cycles += 1;
        match mode {
            "leasehold" => lock_cycle(&lock).await?,
            "store" => store_cycle(&locks, &name, &requester).await?,
            "layout" => {
                let lease = leasehold::store::LeaseId::random();
                let owner = leasehold::store::LeaseId::random();
                let value = format!(
                    "{}\x1f{}{}\x1f{}\x1flocalhost\x1f{}\x1f{channel}",
                    lease.as_str(),
                    owner.as_str(),
                    owner.as_str(),
                    1_764_000_000_000u64 + cycles,
                    std::process::id()
                );
                let issued: i64 = (layout.0.key(&record).key(&hold).key(&counter))
                    .arg(&value)
                    .arg(30_000)
                    .arg("exclusive\x1f1\x1f0\x1f1\x1f30000\x1f1")
                    .invoke_async(&mut conn)
                    .await?;
                let released: i64 = (layout.1.key(&record).key(&hold).key(&counter))
                    .arg(lease.as_str())
                    .arg(&channel)
                    .invoke_async(&mut conn)
                    .await?;
                if issued <= 0 || released != 1 {
                    return Err(format!("{mode}: cycle {cycles} found the key taken").into());
                }
            }
            _ => {
                let token = format!("{}-{tag}-{cycles}", std::process::id());
                let taken = if mode == "floor" {
                    redis::cmd("SET")
                        .arg(&key)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(30_000)
                        .query_async::<Option<String>>(&mut conn)
                        .await?
                        .is_some()
                } else {
                    let issued: i64 = acquire
                        .key(&key)
                        .key(&counter)
                        .arg(&token)
                        .arg(30_000)
                        .invoke_async(&mut conn)
                        .await?;
                    issued > 0
                };
                let released: i64 = release
                    .key(&key)
                    .arg(&token)
                    .invoke_async(&mut conn)
                    .await?;
                if !taken || released != 1 {
                    return Err(format!("{mode}: cycle {cycles} found the key taken").into());
                }
            }
        }
    }
    Ok(cycles)
}

/// User + system CPU time of this process.
/// CPU time of this process, and its context switches (voluntary and not): how often its
/// threads slept or were put off, each a round trip through the kernel.
fn cpu_time() -> (Duration, f64) {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid out-pointer for getrusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    let switches = (usage.ru_nvcsw + usage.ru_nivcsw) as f64;
    (tv(usage.ru_utime) + tv(usage.ru_stime), switches)
}

/// Calls and µs of the commands run since the last `CONFIG RESETSTAT`, but INFO's own.
async fn commandstats(conn: &mut MultiplexedConnection) -> Result<(f64, f64), Failure> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let (mut calls, mut usec) = (0.0, 0.0);
    for line in info.lines() {
        let Some((command, stats)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        if command == "info" || command.starts_with("config") {
            continue;
        }
        for (field, value) in stats.split(',').filter_map(|f| f.split_once('=')) {
            match field {
                "calls" => calls += value.parse::<f64>()?,
                "usec" => usec += value.parse::<f64>()?,
                _ => {}
            }
        }
    }
    Ok((calls, usec))
}

/// Runs `workers` workers of `mode` for `secs`.
async fn run(
    mode: &'static str,
    conn: &MultiplexedConnection,
    locks: &Leasehold,
    (secs, workers, round): (f64, usize, usize),
) -> Result<Figures, Failure> {
    let mut admin = conn.clone();
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut admin)
        .await?;
    let (cpu, started) = (cpu_time(), Instant::now());
    let end = started + Duration::from_secs_f64(secs);
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let tag = format!("w3floors:{}:{round}:{mode}:k{w}", std::process::id());
            tokio::spawn(worker(mode, conn.clone(), locks.clone(), tag, end))
        })
        .collect();
    let mut cycles = 0;
    for task in tasks {
        cycles += task.await??;
    }
    let (elapsed, (cpu_after, switches_after)) = (started.elapsed(), cpu_time());
    let (cpu, switches) = (cpu_after - cpu.0, switches_after - cpu.1);
    let (calls, usec) = commandstats(&mut admin).await?;
    let n = cycles as f64;
    Ok(Figures {
        rate: n / elapsed.as_secs_f64(),
        cpu_us: cpu.as_secs_f64() * 1e6 / n,
        switches: switches / n,
        commands: calls / n,
        server_us: usec / n,
    })
}

#[tokio::main]
async fn main() -> Result<(), Failure> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "redis://127.0.0.1:6379/0".into());
    let mut number = |what: &str, default: f64| -> Result<f64, String> {
        args.next().map_or(Ok(default), |s| {
            s.parse()
                .ok()
                .filter(|n: &f64| *n > 0.0)
                .ok_or(format!("{what}: expected a positive number, got {s:?}"))
        })
    };
    let secs = number("seconds per run", 2.0)?;
    let rounds = number("rounds", 6.0)? as usize;
    let workers = number("workers", 8.0)? as usize;
    let conn = redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let locks = Leasehold::connect(&url).await?;

    // runs[round][mode]; each round runs every mode once, in a rotating order.
    let mut runs = vec![[Figures::default(); MODES.len()]; rounds.max(1)];
    for (round, row) in runs.iter_mut().enumerate() {
        for k in 0..MODES.len() {
            let m = (round + k) % MODES.len();
            row[m] = run(MODES[m], &conn, &locks, (secs, workers.max(1), round)).await?;
        }
        let shown: Vec<_> = (MODES.iter().zip(row.iter()))
            .map(|(m, f)| format!("{m} {:.0}", f.rate))
            .collect();
        println!("round {round}: {}", shown.join(", "));
    }
    for (m, mode) in MODES.iter().enumerate() {
        let of = |f: &dyn Fn(&[Figures; MODES.len()]) -> f64| median(runs.iter().map(f).collect());
        println!(
            "{mode:>9}: median {:.0} cycles/s, ratio to floor {:.2}, to token {:.2}, to layout {:.2}; client CPU {:.1} µs/cycle, {:.2} context switches/cycle; Redis {:.2} commands, {:.1} µs/cycle",
            of(&|r| r[m].rate),
            of(&|r| r[m].rate / r[0].rate),
            of(&|r| r[m].rate / r[1].rate),
            of(&|r| r[m].rate / r[2].rate),
            of(&|r| r[m].cpu_us),
            of(&|r| r[m].switches),
            of(&|r| r[m].commands),
            of(&|r| r[m].server_us),
        );
    }
    Ok(())
}
