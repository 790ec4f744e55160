//! The protected resource: a counter served by the coordinator (which is never paused),
//! fenced by token, and the workers' line protocol to it.
//!
//! ```text
//! HELD owner token              -> OK | STOP     (the worker holds the lock)
//! READ owner token              -> OK value | REJECTED   (a mutex holder or a writer)
//! WRITE owner token value base  -> OK | REJECTED (base: the value the writer read)
//! READS owner token             -> OK value | REJECTED   (a reader's first read)
//! REREAD owner token            -> OK value | REJECTED   (a reader's second read)
//! ENTER owner token role pid    -> OK | STOP     (into the resource: a permit holder, a
//!                                                 `run` command; pid: the command's)
//! EXIT owner token role         -> OK | STOP
//! DONE owner token              -> OK | STOP     (released)
//! ```
//! STOP asks the worker to end after this cycle.
//!
//! Fencing (`--fence all`): an exclusive holder's read or write is refused below the
//! highest token accepted from anyone; a reader's read below the highest accepted from
//! an exclusive holder (readers hold together: their tokens interleave). A writer that
//! can hold has a token above every reader that held before it, and a reader above every
//! writer before it, so nothing valid is refused. `writes` fences writes only. Enter and
//! exit are never refused: a semaphore's permits hold together with interleaved tokens,
//! and nothing in a token alone tells a stale permit from a live one with a lower token;
//! the checker counts what the gauge saw instead.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

use super::check::Fence;
use super::history::{Event, Log, Op, Role};

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
    highest_exclusive: u64,
    phases: HashMap<String, Phase>,
    /// Inside (entered, not out): owner → the pid it gave.
    inside: HashMap<String, i32>,
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
        state.inside.remove(owner);
    }

    /// The pid `owner` gave when it entered, if it is inside.
    pub fn pid_inside(&self, owner: &str) -> Option<i32> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.inside.get(owner).copied()
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
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match (verb, num(3)) {
            ("HELD", _) => {
                state.phases.insert(owner.to_string(), Phase::Held);
                self.stop_or_ok()
            }
            ("DONE", _) => {
                state.phases.remove(owner);
                self.stop_or_ok()
            }
            ("READ", _) => self.read(&mut state, owner, token),
            ("WRITE", Some(value)) => self.write(&mut state, owner, token, value, num(4)),
            ("READS", _) => self.read_shared(&mut state, owner, token, Op::ReadShared),
            ("REREAD", _) => self.read_shared(&mut state, owner, token, Op::Reread),
            ("ENTER" | "EXIT", _) => {
                let Some(role) = words.get(3).and_then(|w| Role::from_word(w)) else {
                    return "ERROR bad role\n".into();
                };
                match verb {
                    "ENTER" => {
                        let pid = words.get(4).and_then(|w| w.parse().ok()).unwrap_or(0);
                        self.enter(&mut state, owner, token, role, pid)
                    }
                    _ => self.exit(&mut state, owner, token, role),
                }
            }
            _ => "ERROR bad request\n".into(),
        }
    }

    /// `STOP` once the run is stopping, else `OK`.
    fn stop_or_ok(&self) -> String {
        match self.stopping.load(Ordering::SeqCst) {
            true => "STOP\n".to_string(),
            false => "OK\n".to_string(),
        }
    }

    /// A mutex holder's or writer's read: fenced against every token accepted before.
    fn read(&self, state: &mut State, owner: &str, token: u64) -> String {
        let fenced = self.fence == Fence::All;
        let accepted = !fenced || token >= state.highest;
        if accepted && fenced {
            state.highest = token;
            state.highest_exclusive = token;
        }
        let value = state.value;
        self.access(
            owner,
            token,
            Op::Read,
            value,
            None,
            accepted,
            Role::Exclusive,
        );
        if !accepted {
            return "REJECTED\n".into();
        }
        state.phases.insert(owner.to_string(), Phase::Thinking);
        format!("OK {value}\n")
    }

    /// A write of `value` by a writer that read `base`: fenced unless `--fence none`.
    fn write(
        &self,
        state: &mut State,
        owner: &str,
        token: u64,
        value: u64,
        base: Option<u64>,
    ) -> String {
        let accepted = self.fence == Fence::None || token >= state.highest;
        if accepted {
            state.highest = state.highest.max(token);
            state.highest_exclusive = state.highest_exclusive.max(token);
            state.value = value;
        }
        self.access(
            owner,
            token,
            Op::Write,
            value,
            base,
            accepted,
            Role::Exclusive,
        );
        state.phases.insert(owner.to_string(), Phase::Held);
        match accepted {
            true => "OK\n".into(),
            false => "REJECTED\n".into(),
        }
    }

    /// A reader's first (`ReadShared`) or second (`Reread`) read: fenced against writers
    /// only, as readers hold together.
    fn read_shared(&self, state: &mut State, owner: &str, token: u64, op: Op) -> String {
        let fenced = self.fence == Fence::All;
        let accepted = !fenced || token >= state.highest_exclusive;
        if accepted && fenced {
            state.highest = state.highest.max(token);
        }
        let phase = match op {
            Op::ReadShared => Phase::Thinking,
            _ => Phase::Held,
        };
        let value = state.value;
        self.access(owner, token, op, value, None, accepted, Role::Shared);
        if !accepted {
            return "REJECTED\n".into();
        }
        state.phases.insert(owner.to_string(), phase);
        format!("OK {value}\n")
    }

    /// Into the resource (never refused): the gauge counts who is inside.
    fn enter(&self, state: &mut State, owner: &str, token: u64, role: Role, pid: i32) -> String {
        state.inside.insert(owner.to_string(), pid);
        // A permit holder has nothing to read: it thinks inside.
        let phase = match role {
            Role::Permit => Phase::Thinking,
            _ => Phase::Held,
        };
        state.phases.insert(owner.to_string(), phase);
        let inside = state.inside.len() as u64;
        self.access(owner, token, Op::Enter, inside, None, true, role);
        self.stop_or_ok()
    }

    /// Out of the resource (never refused).
    fn exit(&self, state: &mut State, owner: &str, token: u64, role: Role) -> String {
        state.inside.remove(owner);
        state.phases.insert(owner.to_string(), Phase::Held);
        let inside = state.inside.len() as u64;
        self.access(owner, token, Op::Exit, inside, None, true, role);
        self.stop_or_ok()
    }

    /// Logged under the state lock, so the history has the order the counter saw.
    #[allow(clippy::too_many_arguments)]
    fn access(
        &self,
        owner: &str,
        token: u64,
        op: Op,
        value: u64,
        base: Option<u64>,
        ok: bool,
        role: Role,
    ) {
        self.log.record(Event::Access {
            owner: owner.to_string(),
            token,
            op,
            value,
            base,
            accepted: ok,
            role,
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
        let args: Vec<String> = args.iter().map(u64::to_string).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.ask_words(verb, token, &args).await
    }

    /// Sends `VERB owner token words...` and reads the reply.
    pub async fn ask_words(
        &mut self,
        verb: &str,
        token: u64,
        words: &[&str],
    ) -> std::io::Result<Reply> {
        let mut line = format!("{verb} {} {token}", self.owner);
        for w in words {
            line.push(' ');
            line.push_str(w);
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
