//! The one updating line shown on a terminal while waiting for a lock, an election or a
//! rate limiter's turn.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use leasehold::{humanize, Busy};

/// Shows waiting progress on stderr when it is a terminal; silent otherwise. Clones
/// share the last thing the store said, so a ticker can keep the line's clock moving.
#[derive(Debug, Clone)]
pub struct Progress {
    /// What is waited for: a lock, or an election (led, not held).
    noun: &'static str,
    name: String,
    last: Option<Arc<Mutex<Option<Busy>>>>,
}

impl Progress {
    /// For `noun` (lock, election, rate limiter) `name`; draws only when stderr is a
    /// terminal.
    pub fn for_stderr(noun: &'static str, name: &str) -> Self {
        Progress {
            noun,
            name: name.to_string(),
            last: std::io::stderr().is_terminal().then(Arc::default),
        }
    }

    /// Whether anything is drawn.
    pub fn is_on(&self) -> bool {
        self.last.is_some()
    }

    /// Remembers what `busy` says and redraws.
    pub fn update(&self, busy: &Busy) {
        if let Some(last) = &self.last {
            *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(busy.clone());
            self.redraw();
        }
    }

    /// Redraws the line from what the store said last ("held for" keeps counting).
    pub fn redraw(&self) {
        let Some(last) = &self.last else { return };
        let Some(busy) = last.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            return;
        };
        let mut line = format!("leasehold: waiting for {} \"{}\"", self.noun, self.name);
        let verb = match self.noun {
            "election" => "led",
            _ => "held",
        };
        if let Some(h) = &busy.holder {
            let held = SystemTime::now()
                .duration_since(h.since)
                .unwrap_or_default();
            line.push_str(&format!(
                "; {verb} by {} ({}, pid {}) for {}",
                h.owner,
                h.host,
                h.pid,
                humanize(held)
            ));
        }
        if let Some(pos) = busy.position {
            line.push_str(&format!("; queue position {pos}"));
        }
        draw(&line);
    }

    /// Draws how long is `left` of a wait for `what` (a rate limiter's reserved turn).
    pub fn countdown(&self, what: &str, left: Duration) {
        if self.is_on() {
            draw(&format!("leasehold: {what} in {}", humanize(left)));
        }
    }

    /// Clears the line.
    pub fn clear(&self) {
        if self.is_on() {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}

fn draw(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = write!(err, "\r\x1b[K{line}");
    let _ = err.flush();
}
