//! The protected resource: a counter served by the coordinator (which is never paused),
//! fenced by token, and the workers' line protocol to it.
//!
//! ```text
//! HELD owner token              -> OK | STOP     (the worker holds the lock)
//! READ owner token              -> OK value | REJECTED
//! WRITE owner token value base  -> OK | REJECTED (base: the value the writer read)
//! DONE owner token              -> OK | STOP     (released)
//! ```
//! STOP asks the worker to end after this cycle.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

use super::check::Fence;
use super::history::{Event, Log, Op};

/// Where a worker is in its cycle, as the resource saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Holds the lock, has not read yet.
    Held,
    /// Read the counter and has not written yet: thinking.
    Thinking,
}

/// The counter and what the nemesis needs to know about holders.
#[derive(Debug)]
pub struct Resource {
    fence: Fence,
    log: Arc<Log>,
    state: Mutex<State>,
    stopping: AtomicBool,
    phase_changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    value: u64,
    highest: u64,
    phases: HashMap<String, Phase>,
}

impl Resource {
    /// A counter at 0.
    pub fn new(fence: Fence, log: Arc<Log>) -> Arc<Self> {
        Arc::new(Resource {
            fence,
            log,
            state: Mutex::default(),
            stopping: AtomicBool::new(false),
            phase_changed: Notify::new(),
        })
    }

    /// Serves workers on `listener` until the process ends.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        while let Ok((stream, _)) = listener.accept().await {
            let resource = self.clone();
            tokio::spawn(async move { resource.session(stream).await });
        }
    }

    /// Tell workers to end after their cycle.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// Workers in `phase` now.
    pub fn in_phase(&self, phase: Phase) -> Vec<String> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        (state.phases.iter())
            .filter(|(_, p)| **p == phase)
            .map(|(o, _)| o.clone())
            .collect()
    }

    /// Resolves at the next change of a worker's phase.
    pub fn changed(&self) -> Notified<'_> {
        self.phase_changed.notified()
    }

    /// Forget a worker (killed).
    pub fn forget(&self, owner: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.phases.remove(owner);
    }

    async fn session(&self, stream: TcpStream) {
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let reply = self.serve_line(&line);
            self.phase_changed.notify_waiters();
            if write.write_all(reply.as_bytes()).await.is_err() {
                return;
            }
        }
    }

    fn serve_line(&self, line: &str) -> String {
        let words: Vec<&str> = line.split_ascii_whitespace().collect();
        let num = |i: usize| words.get(i).and_then(|w| w.parse::<u64>().ok());
        let (Some(&verb), Some(&owner), Some(token)) = (words.first(), words.get(1), num(2)) else {
            return "ERROR bad request\n".into();
        };
        let stop_or_ok = || match self.stopping.load(Ordering::SeqCst) {
            true => "STOP\n".to_string(),
            false => "OK\n".to_string(),
        };
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match (verb, num(3)) {
            ("HELD", _) => {
                state.phases.insert(owner.to_string(), Phase::Held);
                stop_or_ok()
            }
            ("DONE", _) => {
                state.phases.remove(owner);
                stop_or_ok()
            }
            ("READ", _) => {
                let accepted = self.fence != Fence::All || token >= state.highest;
                if accepted && self.fence == Fence::All {
                    state.highest = token;
                }
                let value = state.value;
                self.access(owner, token, Op::Read, value, None, accepted);
                if !accepted {
                    return "REJECTED\n".into();
                }
                state.phases.insert(owner.to_string(), Phase::Thinking);
                format!("OK {value}\n")
            }
            ("WRITE", Some(value)) => {
                let accepted = self.fence == Fence::None || token >= state.highest;
                if accepted {
                    state.highest = state.highest.max(token);
                    state.value = value;
                }
                self.access(owner, token, Op::Write, value, num(4), accepted);
                state.phases.insert(owner.to_string(), Phase::Held);
                match accepted {
                    true => "OK\n".into(),
                    false => "REJECTED\n".into(),
                }
            }
            _ => "ERROR bad request\n".into(),
        }
    }

    /// Logged under the state lock, so the history has the order the counter saw.
    fn access(&self, owner: &str, token: u64, op: Op, value: u64, base: Option<u64>, ok: bool) {
        self.log.record(Event::Access {
            owner: owner.to_string(),
            token,
            op,
            value,
            base,
            accepted: ok,
        });
    }
}

/// A worker's connection to the resource.
#[derive(Debug)]
pub struct Client {
    lines: tokio::io::Lines<BufReader<tokio::net::tcp::OwnedReadHalf>>,
    write: tokio::net::tcp::OwnedWriteHalf,
    owner: String,
}

/// The resource's answer.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// Done (with the value, for a read).
    Ok(u64),
    /// Refused: the token is stale.
    Rejected,
    /// Done; end after this cycle.
    Stop,
}

impl Client {
    /// Connects as `owner`.
    pub async fn connect(addr: &str, owner: &str) -> std::io::Result<Self> {
        let (read, write) = TcpStream::connect(addr).await?.into_split();
        Ok(Client {
            lines: BufReader::new(read).lines(),
            write,
            owner: owner.to_string(),
        })
    }

    /// Sends `VERB owner token args...` and reads the reply.
    pub async fn ask(&mut self, verb: &str, token: u64, args: &[u64]) -> std::io::Result<Reply> {
        let mut line = format!("{verb} {} {token}", self.owner);
        for a in args {
            line.push_str(&format!(" {a}"));
        }
        line.push('\n');
        self.write.write_all(line.as_bytes()).await?;
        let reply = self.lines.next_line().await?.unwrap_or_default();
        let mut words = reply.split_ascii_whitespace();
        match (words.next(), words.next().map(str::parse::<u64>)) {
            (Some("OK"), Some(Ok(v))) => Ok(Reply::Ok(v)),
            (Some("OK"), None) => Ok(Reply::Ok(0)),
            (Some("REJECTED"), _) => Ok(Reply::Rejected),
            (Some("STOP"), _) => Ok(Reply::Stop),
            _ => Err(std::io::Error::other(format!(
                "the resource answered {reply:?}"
            ))),
        }
    }
}
