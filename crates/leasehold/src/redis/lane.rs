//! Connections of their own for calls, each call written and read by the calling task.
//!
//! The multiplexed connection hands every call to its driver task and the answer back:
//! a channel, a second task woken, a reply parsed there and a one-shot channel. For a
//! lone call (one holder taking and releasing a lock in turn) that hand-off is a share
//! of the round trip, and with several callers at once that one task does every call's
//! writing, reading and parsing on one core (docs/BENCHMARKS.md, "A lane of its own for
//! a lone call"). So a store on one plain-TCP server keeps a few such connections, the
//! lane's lines (up to [`MOST_LINES`], made as calls find none idle): a call that finds
//! one idle runs on it; calls that find them all busy go on the multiplexed connection,
//! which pipelines them. A line that fails or times out, or whose call is cancelled, is
//! dropped, never reused half-read, and another is connected in the background for a
//! later call.
//!
//! Not for TLS, Unix sockets or RESP3 (those stay on the multiplexed connection), nor
//! with `?replicas=N`, whose `WAIT` must follow the grant on the connection that wrote it.

use std::io;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, ConnectionAddr, ConnectionInfo, RedisFuture, RedisResult, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::Locked;

/// The lane's name in `CLIENT LIST`.
const NAME: &str = "leasehold-lane";

/// Calls a store sends on the multiplexed connection before it connects a lane.
const CALLS_BEFORE_A_LANE: u32 = 8;

/// How long after a failed connect the lane tries again.
const RETRY_CONNECT: Duration = Duration::from_secs(1);

/// Most lines a lane keeps; calls that find them all busy go on the multiplexed
/// connection. W3-8 (8 tasks, a lock each) ran 1.14x the multiplexed connection alone
/// with one line, 1.29x with two and 1.71x with four.
const MOST_LINES: usize = 4;

/// The lane of one store: its lines, idle or in use.
pub(super) struct Lane {
    idle: Mutex<Vec<Line>>,
    /// Lines that exist, idle or in use, or are being connected: only so many are made,
    /// and a busy line is waited for by no one (its call goes on the shared connection).
    lines: AtomicUsize,
    calls_before: AtomicU32,
    host: String,
    port: u16,
    settings: redis::RedisConnectionInfo,
    /// Bounds each call on the lane, and its connect: the store's request timeout.
    timeout: Duration,
}

/// One connection of the lane.
pub(super) struct Line {
    stream: TcpStream,
    /// Read and not yet parsed.
    input: Vec<u8>,
    output: Vec<u8>,
    db: i64,
}

/// A line taken for a call: given back when the call left it in step (`in_step`), else
/// (a failure, a timeout, the call cancelled) dropped and no longer counted.
struct Taken<'a> {
    lane: &'a Lane,
    line: Option<Line>,
    in_step: bool,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        match (self.line.take(), self.in_step) {
            (Some(line), true) => self.lane.idle.locked().push(line),
            _ => {
                self.lane.lines.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

impl Lane {
    /// A lane to the server `info` names, if its calls can take one (see the module).
    pub(super) fn to(info: &ConnectionInfo, timeout: Duration) -> Option<Arc<Lane>> {
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            return None;
        };
        let settings = info.redis_settings();
        if settings.protocol() != redis::ProtocolVersion::RESP2 {
            return None;
        }
        Some(Arc::new(Lane {
            idle: Mutex::new(Vec::new()),
            lines: AtomicUsize::new(0),
            calls_before: AtomicU32::new(0),
            host: host.clone(),
            port: *port,
            settings: settings.clone(),
            timeout,
        }))
    }

    /// Runs `call` on an idle line, within the request timeout, and keeps the line for
    /// the next call unless it failed on the way; `None` when no line is idle (one is
    /// then connected for a later call, unless there are enough).
    pub(super) async fn run<T, F>(self: &Arc<Self>, call: F) -> Option<RedisResult<T>>
    where
        F: AsyncFnOnce(&mut Line) -> RedisResult<T>,
    {
        let Some(line) = self.idle.locked().pop() else {
            // A process that makes a few calls (the CLI's `run`: an acquire and a
            // release) does not pay for a connection it would hardly use.
            if self.calls_before.load(Ordering::Relaxed) < CALLS_BEFORE_A_LANE {
                self.calls_before.fetch_add(1, Ordering::Relaxed);
            } else {
                self.connect_one();
            }
            return None;
        };
        // (Cancelled, the line is dropped with the call: it may be half-written.)
        let mut taken = Taken {
            lane: self,
            line: Some(line),
            in_step: false,
        };
        let line = taken.line.as_mut()?;
        let result = match tokio::time::timeout(self.timeout, call(line)).await {
            Ok(result) => result,
            Err(_) => Err(io::Error::from(io::ErrorKind::TimedOut).into()),
        };
        // An answer read whole, or an error the server answered (a missing script):
        // the line is where it was. Anything else may have left bytes in flight.
        taken.in_step = match &result {
            Ok(_) => true,
            Err(e) => matches!(e.kind(), redis::ErrorKind::Server(_)),
        };
        Some(result)
    }

    /// Connects a line in the background, unless there are enough, made or on their way.
    fn connect_one(self: &Arc<Self>) {
        let more = |n: usize| (n < MOST_LINES).then_some(n + 1);
        if (self.lines)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, more)
            .is_err()
        {
            return;
        }
        let lane = self.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(lane.timeout, lane.connect()).await {
                Ok(Ok(line)) => lane.idle.locked().push(line),
                // Calls go on the multiplexed connection meanwhile; try again later
                // rather than at every call while the server is away.
                _ => {
                    tokio::time::sleep(RETRY_CONNECT).await;
                    lane.lines.fetch_sub(1, Ordering::AcqRel);
                }
            }
        });
    }

    async fn connect(&self) -> RedisResult<Line> {
        let stream = TcpStream::connect((self.host.as_str(), self.port)).await?;
        stream.set_nodelay(true)?;
        let mut line = Line {
            stream,
            input: Vec::with_capacity(4096),
            output: Vec::with_capacity(1024),
            db: self.settings.db(),
        };
        if let Some(password) = self.settings.password() {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = self.settings.username() {
                auth.arg(user);
            }
            auth.arg(password).query_async::<()>(&mut line).await?;
        }
        if line.db != 0 {
            (redis::cmd("SELECT").arg(line.db))
                .query_async::<()>(&mut line)
                .await?;
        }
        // Named for whoever reads CLIENT LIST; a server that refuses names still serves.
        let mut name = redis::cmd("CLIENT");
        let _ = name
            .arg("SETNAME")
            .arg(NAME)
            .query_async::<()>(&mut line)
            .await;
        Ok(line)
    }
}

impl Line {
    async fn call(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        self.output.clear();
        cmd.write_packed_command(&mut self.output);
        self.stream.write_all(&self.output).await?;
        loop {
            if let Some((value, end)) = read_reply(&self.input)? {
                self.input.drain(..end);
                return value.extract_error();
            }
            if self.stream.read_buf(&mut self.input).await? == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
            }
        }
    }
}

impl ConnectionLike for Line {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.call(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        _: &'a redis::Pipeline,
        _: usize,
        _: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        // The store sends scripts one at a time; pipelines go on the multiplexed connection.
        Box::pin(async {
            Err(io::Error::new(io::ErrorKind::Unsupported, "no pipelines on the lane").into())
        })
    }

    fn get_db(&self) -> i64 {
        self.db
    }
}

/// The first whole RESP2 reply at the start of `buf`, if it holds one, and its length:
/// a line (`+`, `-`, `:`), a bulk string (`$`) or an array (`*`) of them. (The redis
/// crate's own parser zeroes an 8 KB buffer for every reply it reads: a quarter of a
/// store call's instructions, docs/BENCHMARKS.md.)
fn read_reply(buf: &[u8]) -> io::Result<Option<(Value, usize)>> {
    let mut at = 0;
    Ok(read_value(buf, &mut at, 0)?.map(|value| (value, at)))
}

/// How deep arrays may nest in a reply (the store's replies nest two deep).
const MOST_NESTING: usize = 16;

/// The value that starts at `*at`, moving `*at` past it; `None` if it is not all there.
fn read_value(buf: &[u8], at: &mut usize, depth: usize) -> io::Result<Option<Value>> {
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed reply");
    let Some(newline) = buf[*at..].iter().position(|&b| b == b'\n') else {
        return Ok(None);
    };
    let line = &buf[*at..*at + newline + 1];
    let body = line
        .get(1..line.len() - 1)
        .and_then(|b| b.strip_suffix(b"\r"))
        .ok_or_else(malformed)?;
    let number = || -> io::Result<i64> {
        let text = std::str::from_utf8(body).map_err(|_| malformed())?;
        text.parse().map_err(|_| malformed())
    };
    *at += line.len();
    Ok(Some(match line[0] {
        b':' => Value::Int(number()?),
        b'+' if body == b"OK" => Value::Okay,
        b'+' => Value::SimpleString(String::from_utf8(body.to_vec()).map_err(|_| malformed())?),
        // Errors are rare (a script the server lost): the redis crate names their kinds.
        b'-' => redis::parse_redis_value(line).map_err(|_| malformed())?,
        b'$' => match usize::try_from(number()?) {
            Err(_) => Value::Nil,
            Ok(n) => {
                let Some(data) = buf.get(*at..*at + n) else {
                    return Ok(None);
                };
                match buf.get(*at + n..*at + n + 2) {
                    None => return Ok(None),
                    Some(b"\r\n") => {}
                    Some(_) => return Err(malformed()),
                }
                *at += n + 2;
                Value::BulkString(data.to_vec())
            }
        },
        b'*' if depth < MOST_NESTING => match usize::try_from(number()?) {
            Err(_) => Value::Nil,
            Ok(n) => {
                // (Not more room than the bytes left could fill: the count is the server's word.)
                let mut values = Vec::with_capacity(n.min(buf.len() - *at));
                for _ in 0..n {
                    match read_value(buf, at, depth + 1)? {
                        Some(value) => values.push(value),
                        None => return Ok(None),
                    }
                }
                Value::Array(values)
            }
        },
        _ => return Err(malformed()),
    }))
}

#[cfg(test)]
mod tests {
    use super::read_reply;

    #[test]
    fn a_reply_is_read_once_every_value_in_it_has_arrived_and_as_the_redis_crate_reads_it() {
        let replies: [&[u8]; 9] = [
            b"*3\r\n:7\r\n$5\r\nab\r\nc\r\n*2\r\n$-1\r\n+OK\r\n",
            b":-12\r\n",
            b"+QUEUED\r\n",
            b"$0\r\n\r\n",
            b"*0\r\n",
            b"*-1\r\n",
            b"-NOSCRIPT No matching script\r\n",
            b"-ERR no\r\n",
            b"*2\r\n*1\r\n:1\r\n$3\r\n\xff\x00\n\r\n",
        ];
        for reply in replies {
            for cut in 0..reply.len() {
                assert!(read_reply(&reply[..cut]).unwrap().is_none(), "cut at {cut}");
            }
            let (value, end) = read_reply(reply).unwrap().unwrap();
            assert_eq!(end, reply.len());
            assert_eq!(value, redis::parse_redis_value(reply).unwrap());
        }
        // What follows the first reply is the next one's.
        let two = b":1\r\n-ERR no\r\n";
        assert_eq!(read_reply(two).unwrap().unwrap().1, 4);
        for malformed in [&b"$x\r\n"[..], b"%1\r\n", b":1\n", b"$2\r\nabcd", b"\r\n"] {
            assert!(read_reply(malformed).is_err(), "{malformed:?}");
        }
        let deep = b"*1\r\n".repeat(17);
        assert!(read_reply(&deep).is_err());
    }
}
