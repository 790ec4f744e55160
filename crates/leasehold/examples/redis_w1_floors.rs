//! W1 (one worker, one key, acquire + release) on Redis: leasehold and its store beside three floors,
//! all driven by the same loop in the same process, in alternating rounds, so their
//! ratios do not depend on a harness's runner or on which minute of a noisy machine
//! each one ran in.
//!
//! - `floor`: `SET NX PX`, then a compare-and-delete script (the raw floor peer's steps);
//! - `multi`: `SET NX PX` and `INCR` of a token counter in one `MULTI`, then the same
//!   release: a floor that also issues a fencing token;
//! - `script`: a two-command script (`SET NX PX`, then `INCR`) returning the token, then
//!   the same release: the least a token issued inside a script costs;
//! - `store`: the Redis store's own `Store::acquire` and `Store::release`, without the
//!   library above it (no guard, renewal or in-process queue): what the store costs;
//! - `leasehold`: `Lock::try_lock` and `LockGuard::release` on the Redis store.
//!
//! ```text
//! cargo run --release -p leasehold --features redis --example redis_w1_floors -- \
//!     redis://127.0.0.1:6379/0 [cycles per round, default 5000] [rounds, default 8] [modes]
//! ```
//!
//! `modes` (comma-separated, default all) runs some of them only: one mode a process,
//! to count its instructions (callgrind) or Redis's time per call (`INFO commandstats`).

use std::time::{Duration, Instant};

use common::{median, store_cycle, RELEASE, TOKEN_ACQUIRE};
use leasehold::Leasehold;
use redis::aio::MultiplexedConnection;

mod common;

const MODES: [&str; 5] = ["floor", "multi", "script", "store", "leasehold"];

/// Cycles per second of one mode for `cycles` cycles on a key of its own.
async fn run(
    mode: &str,
    conn: &mut MultiplexedConnection,
    locks: &Leasehold,
    cycles: usize,
    round: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let (release, acquire) = (
        redis::Script::new(RELEASE),
        redis::Script::new(TOKEN_ACQUIRE),
    );
    let tag = format!("w1floors:{}:{round}:{mode}", std::process::id());
    let (key, counter) = (format!("{{{tag}}}:k"), format!("{{{tag}}}:t"));
    let lock = locks.mutex(tag.as_str())?.with_ttl(Duration::from_secs(30));
    let name: leasehold::LockName = tag.as_str().try_into()?;
    let requester = std::sync::Arc::new(leasehold::store::Requester::this_process());
    let started = Instant::now();
    for i in 0..cycles {
        if mode == "store" {
            store_cycle(locks, &name, &requester)
                .await
                .map_err(|e| e.to_string())?;
            continue;
        }
        if mode == "leasehold" {
            let guard = lock.try_lock().await?.ok_or("the lock was busy")?;
            let _ = guard.release().await?;
            continue;
        }
        let token = format!("w0-{i}");
        let taken = match mode {
            "floor" => redis::cmd("SET")
                .arg(&key)
                .arg(&token)
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async::<Option<String>>(conn)
                .await?
                .is_some(),
            "multi" => {
                let (set, _token): (Option<String>, i64) = redis::pipe()
                    .atomic()
                    .cmd("SET")
                    .arg(&key)
                    .arg(&token)
                    .arg("NX")
                    .arg("PX")
                    .arg(30_000)
                    .cmd("INCR")
                    .arg(&counter)
                    .query_async(conn)
                    .await?;
                set.is_some()
            }
            _ => {
                let issued: i64 = acquire
                    .key(&key)
                    .key(&counter)
                    .arg(&token)
                    .arg(30_000)
                    .invoke_async(conn)
                    .await?;
                issued > 0
            }
        };
        let released: i64 = release.key(&key).arg(&token).invoke_async(conn).await?;
        if !taken || released != 1 {
            return Err(format!("{mode}: cycle {i} found the key taken").into());
        }
    }
    Ok(cycles as f64 / started.elapsed().as_secs_f64())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "redis://127.0.0.1:6379/0".into());
    let mut count = |what: &str, default: usize| -> Result<usize, String> {
        args.next().map_or(Ok(default), |s| {
            s.parse()
                .map_err(|_| format!("{what}: expected a whole number, got {s:?}"))
        })
    };
    let cycles = count("cycles per round", 5000)?;
    let rounds = count("rounds", 8)?;
    if cycles == 0 || rounds == 0 {
        return Err("cycles per round and rounds must be at least 1".into());
    }
    let chosen: Vec<&str> = match args.next() {
        None => MODES.to_vec(),
        Some(list) => (list.split(','))
            .map(|m| MODES.iter().find(|&&known| known == m).copied())
            .collect::<Option<_>>()
            .ok_or_else(|| format!("modes: {list:?}, expected some of {}", MODES.join(",")))?,
    };
    let conn = redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let locks = Leasehold::connect(&url).await?;

    // rates[round][mode]; each round runs every chosen mode once, in a rotating order.
    let mut rates = vec![vec![0.0; chosen.len()]; rounds];
    for (round, row) in rates.iter_mut().enumerate() {
        for k in 0..chosen.len() {
            let m = (round + k) % chosen.len();
            row[m] = tokio::spawn({
                let (mut conn, locks, mode) = (conn.clone(), locks.clone(), chosen[m]);
                async move {
                    run(mode, &mut conn, &locks, cycles, round)
                        .await
                        .map_err(|e| e.to_string())
                }
            })
            .await??;
        }
        println!(
            "round {round}: {}",
            chosen
                .iter()
                .zip(row.iter())
                .map(|(m, r)| format!("{m} {r:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    for (m, mode) in chosen.iter().enumerate() {
        let rate = median(rates.iter().map(|row| row[m]).collect());
        let ratio = median(rates.iter().map(|row| row[m] / row[0]).collect());
        println!(
            "{mode:>9}: median {rate:.0} cycles/s, median ratio to {} {ratio:.2}",
            chosen[0]
        );
    }
    Ok(())
}
