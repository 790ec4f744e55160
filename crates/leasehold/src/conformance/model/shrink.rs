//! A failed run, shrunk to a short sequence that still fails, and the report of it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::driver::run;
use super::plan::{Op, Plan};
use crate::store::Store;

/// Why a run failed: at which step (`None`: the final drain), what, and the trace.
#[derive(Debug)]
pub(super) struct Failure {
    pub(super) step: Option<usize>,
    pub(super) message: String,
    pub(super) trace: Vec<String>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Shrinks `failure`, a failed run of `plan`, for at most `budget`, and says what failed:
/// the shapes, the failing step and its message, the shrunk sequence and the failure and
/// trace of its last run.
pub(super) async fn report(
    store: &Arc<dyn Store>,
    plan: &Plan,
    failure: Failure,
    budget: Duration,
) -> String {
    let first = failure.to_string();
    let at = failure.step.map_or(String::from("the final drain"), |i| {
        format!("step {i}: {}", plan.ops[i])
    });
    let (ops, last, runs) = shrink(store, plan, failure, budget).await;
    let listing: String = ops
        .iter()
        .enumerate()
        .map(|(i, op)| format!("  {i:3}  {op}\n"))
        .collect();
    format!(
        "shapes: {}\n\
         failed at {at}\n{first}\n\n\
         shrunk to {} operations in {runs} runs:\n{listing}\
         which fail with:\n{}\n\ntrace of that run:\n{}",
        plan.shapes_text(),
        ops.len(),
        last.message,
        last.trace.join("\n")
    )
}

/// Delta debugging within `budget`: the shortest failing sequence found, its failure and
/// the number of runs.
async fn shrink(
    store: &Arc<dyn Store>,
    plan: &Plan,
    first: Failure,
    budget: Duration,
) -> (Vec<Op>, Failure, usize) {
    let until = Instant::now() + budget;
    let mut ops: Vec<Op> = match first.step {
        Some(i) => plan.ops[..=i].to_vec(),
        None => plan.ops.clone(),
    };
    let mut last = first;
    let mut runs = 0;
    let mut chunks = 2;
    while ops.len() > 1 && Instant::now() < until {
        let size = ops.len().div_ceil(chunks);
        let mut cut = false;
        let mut start = 0;
        while start < ops.len() && Instant::now() < until {
            let mut fewer = ops.clone();
            fewer.drain(start..(start + size).min(ops.len()));
            runs += 1;
            match run(store, plan, &fewer).await {
                Err(failure) => {
                    // Everything after the failing step is not needed either.
                    if let Some(i) = failure.step {
                        fewer.truncate(i + 1);
                    }
                    ops = fewer;
                    last = failure;
                    cut = true;
                }
                Ok(_) => start += size,
            }
        }
        if cut {
            chunks = chunks.saturating_sub(1).max(2);
        } else if size == 1 {
            break;
        } else {
            chunks = (chunks * 2).min(ops.len());
        }
    }
    (ops, last, runs)
}
