//! The one updating line shown on a terminal while waiting for a lock.

use std::io::{IsTerminal, Write};
use std::time::SystemTime;

use leasehold::{humanize, Busy};

/// Shows waiting progress on stderr when it is a terminal; silent otherwise.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    on: bool,
}

impl Progress {
    /// Only when stderr is a terminal.
    pub fn for_stderr() -> Self {
        Progress {
            on: std::io::stderr().is_terminal(),
        }
    }

    /// Rewrites the line with what `busy` says.
    pub fn update(&self, name: &str, busy: &Busy) {
        if !self.on {
            return;
        }
        let mut line = format!("leasehold: waiting for lock \"{name}\"");
        if let Some(h) = &busy.holder {
            let held = SystemTime::now()
                .duration_since(h.since)
                .unwrap_or_default();
            line.push_str(&format!(
                "; held by {} ({}, pid {}) for {}",
                h.owner,
                h.host,
                h.pid,
                humanize(held)
            ));
        }
        if let Some(pos) = busy.position {
            line.push_str(&format!("; queue position {pos}"));
        }
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[K{line}");
        let _ = err.flush();
    }

    /// Clears the line.
    pub fn clear(&self) {
        if self.on {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}
