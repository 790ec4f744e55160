//! What the library adds to a store call, measured on the memory store (no I/O): `workers`
//! tasks, a lock each, in a loop of `try_lock_for` + `release` (`leasehold` mode, as
//! `leasehold bench` W3) or of bare `Store::acquire` + `Store::release` (`store` mode), in
//! rounds that alternate. Prints cycles/s and the process's CPU per cycle (getrusage) by
//! mode, medians over the rounds.
//!
//! ```text
//! cargo run --release -p leasehold --example library_cycle -- [seconds per run, default 2] [rounds, default 6] [workers, default 8] [store|leasehold]
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{lock_cycle, median, store_cycle, Failure};
use leasehold::{Leasehold, MemoryStore};

mod common;

const MODES: [&str; 2] = ["store", "leasehold"];

async fn worker(mode: &str, locks: Leasehold, name: String, end: Instant) -> Result<u64, Failure> {
    let lock = locks.mutex(name.as_str())?;
    let name = lock.name().clone();
    let requester = Arc::new(leasehold::store::Requester::this_process());
    let mut cycles = 0;
    while Instant::now() < end {
        match mode {
            "leasehold" => lock_cycle(&lock).await?,
            _ => store_cycle(&locks, &name, &requester).await?,
        }
        cycles += 1;
    }
    Ok(cycles)
}

fn cpu_us() -> f64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let us = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    us(usage.ru_utime) + us(usage.ru_stime)
}

#[tokio::main]
async fn main() -> Result<(), Failure> {
    let arg = |i: usize, default: u64| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    };
    let (secs, rounds, workers) = (arg(1, 2), arg(2, 6), arg(3, 8));
    // A fourth argument runs that mode alone (for a profiler).
    let only = std::env::args().nth(4);
    let locks = Leasehold::new(MemoryStore::new());
    let mut figures: Vec<Vec<(f64, f64)>> = vec![Vec::new(); MODES.len()];
    for round in 0..rounds as usize {
        for i in 0..MODES.len() {
            let m = (i + round) % MODES.len();
            let mode = MODES[m];
            if only.as_deref().is_some_and(|only| only != mode) {
                continue;
            }
            let end = Instant::now() + Duration::from_secs(secs);
            let (started, cpu) = (Instant::now(), cpu_us());
            let tasks: Vec<_> = (0..workers)
                .map(|w| {
                    tokio::spawn(worker(
                        mode,
                        locks.clone(),
                        format!("{mode}-{round}-{w}"),
                        end,
                    ))
                })
                .collect();
            let mut cycles = 0;
            for task in tasks {
                cycles += task.await??;
            }
            let cpu = (cpu_us() - cpu) / cycles as f64;
            figures[m].push((cycles as f64 / started.elapsed().as_secs_f64(), cpu));
        }
    }
    for (m, mode) in MODES.iter().enumerate() {
        if figures[m].is_empty() {
            continue;
        }
        let rate = median(figures[m].iter().map(|f| f.0).collect());
        let cpu = median(figures[m].iter().map(|f| f.1).collect());
        println!("{mode:>10}: {rate:>10.0} cycles/s, {cpu:.2} µs CPU per cycle");
    }
    Ok(())
}
