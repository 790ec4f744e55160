//! The torture history: one JSON line per event, stamped with CLOCK_MONOTONIC, which every
//! process on the host shares (and which keeps running while a process is stopped).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// Nanoseconds on CLOCK_MONOTONIC.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A tokio (std) instant on the shared clock: both count CLOCK_MONOTONIC on Linux.
pub fn instant_ns(at: Instant) -> u64 {
    let (now, ns) = (Instant::now(), now_ns());
    if at >= now {
        ns + (at - now).as_nanos() as u64
    } else {
        ns.saturating_sub((now - at).as_nanos() as u64)
    }
}

/// A resource access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Read the counter (a mutex holder or a writer: it will write after).
    Read,
    /// Write the counter.
    Write,
    /// A reader's first read of the counter.
    ReadShared,
    /// A reader's second read, after thinking: a write in between tore the read.
    Reread,
    /// Came in (a permit holder into the gauge; a `run` command into the resource).
    Enter,
    /// Went out.
    Exit,
}

/// What one acquisition asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A mutex, or the write side of a read-write lock.
    #[default]
    Exclusive,
    /// The read side of a read-write lock.
    Shared,
    /// A semaphore permit.
    Permit,
}

impl Role {
    /// The word on the resource's wire.
    pub fn word(self) -> &'static str {
        match self {
            Role::Exclusive => "exclusive",
            Role::Shared => "shared",
            Role::Permit => "permit",
        }
    }

    /// Parses [`word`](Self::word).
    pub fn from_word(word: &str) -> Option<Self> {
        [Role::Exclusive, Role::Shared, Role::Permit]
            .into_iter()
            .find(|r| r.word() == word)
    }
}

/// What happened. `owner` names one worker process (worker id and incarnation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Event {
    /// A worker process started (the coordinator logs it).
    Spawned { owner: String, pid: i32 },
    /// Acquire invoked.
    Invoke { owner: String },
    /// Acquire returned a guard: its token and the safe deadline the library promised.
    Acquired {
        owner: String,
        token: u64,
        deadline: u64,
        /// What it asked for (absent in mutex histories: exclusive).
        #[serde(default)]
        role: Role,
    },
    /// The acquire's first answer from the store that put it in the queue (position
    /// known): from now on the store has it queued, ahead of any request sent later.
    Queued { owner: String },
    /// Acquire returned without the lock; `unknown` when the store may have granted it
    /// (an error, not a plain "busy" or "wait ran out").
    AcquireFailed {
        owner: String,
        unknown: bool,
        error: String,
    },
    /// The owner acquired again while holding: must get the same token.
    Reentered {
        owner: String,
        token: u64,
        outer: u64,
    },
    /// A renewal was confirmed: the new safe deadline.
    Renewed {
        owner: String,
        token: u64,
        deadline: u64,
    },
    /// The guard's `lost` signal fired.
    Lost { owner: String, token: u64 },
    /// The worker asked the guard before using the resource: `ok` is its answer.
    Check {
        owner: String,
        token: u64,
        ok: bool,
        deadline: u64,
    },
    /// The resource (in the coordinator) served or refused an access. A write carries the
    /// value it wrote and the value its writer had read; an enter or exit the number of
    /// holders inside after it.
    Access {
        owner: String,
        token: u64,
        op: Op,
        value: u64,
        base: Option<u64>,
        accepted: bool,
        /// Who accessed (absent in mutex histories: exclusive).
        #[serde(default)]
        role: Role,
    },
    /// Release invoked, with the deadline the guard had then.
    Release {
        owner: String,
        token: u64,
        deadline: u64,
    },
    /// Release returned: `released`, `not_held` or an error.
    Released {
        owner: String,
        token: u64,
        outcome: String,
    },
    /// The coordinator killed a worker (a fault, or the end of the run).
    Killed { owner: String },
    /// A `leasehold run` worker exited: its exit code, or the signal that killed it.
    RunExited {
        owner: String,
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// A candidate's campaign (`--primitive election`), logged before its acquire: the
    /// value, unique to the campaign, that it leads with if elected.
    Campaign { owner: String, value: String },
    /// An observer reported the leader (`Election::observe`): its term, value and owner;
    /// all absent when it reported no leader.
    Observed {
        observer: String,
        term: Option<u64>,
        value: Option<String>,
        leader: Option<String>,
    },
    /// An observer's look failed (it tries again); `regressed` when it refused to show a
    /// term below one it had shown.
    ObserveFailed {
        observer: String,
        error: String,
        regressed: bool,
    },
    /// The nemesis started a fault (`target`: the worker it hit, if any).
    FaultStart {
        kind: String,
        target: Option<String>,
    },
    /// The nemesis healed it (resumed, restarted, ...).
    FaultEnd {
        kind: String,
        target: Option<String>,
    },
}

/// An event and when it happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// CLOCK_MONOTONIC nanoseconds.
    pub t: u64,
    /// The event.
    #[serde(flatten)]
    pub event: Event,
}

/// Appends entries to a file, one `write` per line, so a killed process loses at most the
/// line it was writing.
#[derive(Debug)]
pub struct Log(Mutex<File>);

impl Log {
    /// Creates (truncates) `path`.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Ok(Log(Mutex::new(File::create(path)?)))
    }

    /// Records `event` now.
    pub fn record(&self, event: Event) {
        self.record_at(now_ns(), event);
    }

    /// Records `event` at `t`.
    pub fn record_at(&self, t: u64, event: Event) {
        let mut line = serde_json::to_vec(&Entry { t, event }).unwrap_or_default();
        line.push(b'\n');
        if let Ok(mut file) = self.0.lock() {
            // A full disk must not stop the run; the checker sees the gap as a short history.
            let _ = file.write_all(&line);
        }
    }
}

/// Reads every `*.jsonl` in `dir`, merged in time order. A torn last line (a killed
/// writer) is skipped.
pub fn read_dir(dir: &Path) -> std::io::Result<Vec<Entry>> {
    let mut entries = Vec::new();
    for file in std::fs::read_dir(dir)? {
        let path = file?.path();
        if path.extension().is_some_and(|e| e == "jsonl") {
            for line in BufReader::new(File::open(&path)?).lines() {
                if let Ok(entry) = serde_json::from_str::<Entry>(&line?) {
                    entries.push(entry);
                }
            }
        }
    }
    entries.sort_by_key(|e| e.t);
    Ok(entries)
}
