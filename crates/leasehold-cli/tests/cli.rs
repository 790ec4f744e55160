//! The `leasehold` binary, run for real: exit codes, signals, loss, re-entry, semaphores,
//! shared locks, bad input, mutual exclusion between processes, `status`/`list`/`hold`.
//!
//! Every test has its own store (`--store local:<tempdir>`) and `LEASEHOLD_HOME`, so tests
//! run in parallel. Tests wait for conditions (a file, a printed token, a holder in
//! `status`) with a deadline, never for a fixed time. Spawned processes are killed when
//! their guard drops, also when a test fails.

mod support;

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use leasehold_testkit::{pid_alive, send_signal, wait_for, wait_until, PATIENCE};
use serde_json::Value;
use support::*;

#[path = "cli/bad_input.rs"]
mod bad_input;
#[path = "cli/bench.rs"]
mod bench;
#[path = "cli/elect.rs"]
mod elect;
#[path = "cli/exclusion.rs"]
mod exclusion;
#[path = "cli/exit_codes.rs"]
mod exit_codes;
#[path = "cli/fence.rs"]
mod fence;
#[path = "cli/flags_and_help.rs"]
mod flags_and_help;
#[path = "cli/local_faults.rs"]
mod local_faults;
#[path = "cli/manual.rs"]
mod manual;
#[path = "cli/metrics.rs"]
mod metrics;
#[path = "cli/reentry_and_kinds.rs"]
mod reentry_and_kinds;
#[path = "cli/signals.rs"]
mod signals;
