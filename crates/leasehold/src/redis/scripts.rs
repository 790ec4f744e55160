//! The scripts, and how they are run. Each lock script is made once from the `.lua` files
//! beside this file and the Lua that request.rs and reply.rs write, in this order:
//!
//! 1. `PREFIX` and `HOT` (which of hot.lua's calls it serves), and the request's
//!    arguments by name (`req_hold`, `req_ttl`, ...);
//! 2. hot.lua, which serves the commonest calls from the hold key and returns;
//! 3. the packed fields by name (`req_lease`, ...), and the fields of a hot hold's value
//!    (`read_hot_hold`);
//! 4. read.lua and record.lua (the record, read and parsed), the script's fast paths,
//!    common.lua, then its own files; each `reply.NAME{...}` in them is written out as the
//!    list its shape sends (lua.rs).
//!
//! Scripts run by EVALSHA, loaded on the first NOSCRIPT; each is one atomic step.

use std::sync::OnceLock;

use redis::Script;

use super::keys::push_key;
use super::lua;
use super::reply::{Shape, BUSY, CONFLICT, DECISION, GRANTED, RELEASE, STATE};
use super::request::{self, Acquire, Field, Held, Proclaim, Rate, Release, Renew, Watch};
use super::{Conn, RedisStore};
use crate::{LockName, Result};

pub(super) struct Scripts {
    pub(super) acquire: Script,
    pub(super) transfer: Script,
    pub(super) renew: Script,
    pub(super) release: Script,
    pub(super) force: Script,
    pub(super) held: Script,
    pub(super) describe: Script,
    pub(super) proclaim: Script,
    pub(super) downgrade: Script,
    pub(super) watch: Script,
    pub(super) rate: Script,
}

/// A lock script's parts, beyond those every lock script has.
struct LockScript<'a> {
    /// hot.lua's call that the script serves, if any.
    hot: Option<&'static str>,
    /// How much of the record read.lua reads at first (all of it: `None`).
    prefix: Option<u32>,
    request: &'a [Field<'a>],
    replies: &'a [&'a Shape],
    /// Fast paths, which may answer before common.lua is even defined.
    fast: &'a [&'static str],
    /// The script's own files, after common.lua.
    own: &'a [&'static str],
}

const HOT: &str = include_str!("hot.lua");
const READ: &str = include_str!("read.lua");
const RECORD: &str = include_str!("record.lua");
const COMMON: &str = include_str!("common.lua");

impl LockScript<'_> {
    fn script(&self) -> Script {
        let or_nil = |v: Option<String>| v.unwrap_or_else(|| "nil".into());
        // RECORD_TTL: how long a record outlives its last whole write (record.lua).
        let mut text = format!(
            "local PREFIX, HOT, RECORD_TTL = {}, {}, {}\n",
            or_nil(self.prefix.map(|n| n.to_string())),
            or_nil(self.hot.map(|h| format!("'{h}'"))),
            2 * crate::MAX_TTL.as_millis(),
        );
        text += &lua::request_arguments(self.request);
        text += HOT;
        text += "\n";
        text += &lua::request_fields(self.request);
        // A hot hold's value is an acquire's `hold`, as it came.
        let acquire = Acquire::default().fields();
        text += &lua::unpacker(&acquire, "hold", "hot_", "read_hot_hold");
        for part in [READ, RECORD].iter().chain(self.fast).chain([&COMMON]) {
            text += part;
            text += "\n";
        }
        text += &self.own.join("\n");
        Script::new(&lua::replies(&text, self.replies))
    }
}

pub(super) fn scripts() -> &'static Scripts {
    static SCRIPTS: OnceLock<Scripts> = OnceLock::new();
    SCRIPTS.get_or_init(|| {
        let acquire = LockScript {
            hot: Some("acquire"),
            // The record's header, its holds and the head of the queue, mostly.
            prefix: Some(1024),
            request: &Acquire::default().fields(),
            replies: &[&GRANTED, &BUSY, &CONFLICT],
            fast: &[include_str!("acquire_fast.lua")],
            own: &[include_str!("acquire.lua")],
        };
        let transfer = LockScript {
            hot: Some("transfer"),
            own: &[include_str!("transfer.lua"), include_str!("acquire.lua")],
            ..acquire
        };
        Scripts {
            acquire: acquire.script(),
            transfer: transfer.script(),
            renew: plain(
                Some("renew"),
                &Renew::default().fields(),
                &[],
                include_str!("renew.lua"),
            ),
            release: LockScript {
                hot: Some("release"),
                // With the head of the queue, to hand the lock over.
                prefix: Some(3072),
                request: &Release::default().fields(),
                replies: &[&RELEASE],
                fast: &[include_str!("release_fast.lua")],
                own: &[include_str!("release.lua")],
            }
            .script(),
            force: plain(None, &[], &[], include_str!("force.lua")),
            held: plain(
                Some("held"),
                &Held::default().fields(),
                &[],
                include_str!("held.lua"),
            ),
            describe: plain(None, &[], &[&STATE], include_str!("describe.lua")),
            proclaim: plain(
                None,
                &Proclaim::default().fields(),
                &[],
                include_str!("proclaim.lua"),
            ),
            // The hold's lease alone, as held.lua's request.
            downgrade: plain(
                None,
                &Held::default().fields(),
                &[],
                include_str!("downgrade.lua"),
            ),
            watch: LockScript {
                hot: None,
                prefix: None,
                request: &Watch::default().fields(),
                replies: &[&STATE],
                fast: &[],
                own: &[include_str!("watch.lua"), include_str!("describe.lua")],
            }
            .script(),
            // Alone: a limiter's decision needs none of the locks' code.
            rate: Script::new(&lua::replies(
                &(lua::repeated_request(&Rate::default().fields()) + include_str!("rate.lua")),
                &[&DECISION],
            )),
        }
    })
}

/// A lock script with no fast path that reads the whole record.
fn plain(
    hot: Option<&'static str>,
    request: &[Field<'_>],
    replies: &[&Shape],
    own: &'static str,
) -> Script {
    let script = LockScript {
        hot,
        prefix: None,
        request,
        replies,
        fast: &[],
        own: &[own],
    };
    script.script()
}

/// Runs the EVALSHA of `script` that `command` builds, loading the script first if the
/// server lacks it. The call is built again after a load: what it says of time (how long
/// a request has waited, see [`Value::Since`](super::request::Value)) is reckoned up to
/// when it is sent.
async fn eval<T: redis::FromRedisValue>(
    command: impl Fn() -> redis::Cmd,
    script: &Script,
    conn: &mut impl redis::aio::ConnectionLike,
) -> redis::RedisResult<T> {
    match command().query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(conn).await?;
            command().query_async(conn).await
        }
        result => result,
    }
}

impl RedisStore {
    /// Runs the lock script `script` on `name`'s keys with the request's `fields`.
    pub(super) async fn run<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        name: &LockName,
        fields: &[Field<'_>],
    ) -> Result<T> {
        // EVALSHA built here rather than through redis::ScriptInvocation, which copies
        // every argument twice: this is the hot path of every lock call.
        let command = |resent: bool| {
            let mut cmd = redis::Cmd::with_capacity(fields.len() + 6, 512);
            // The record's key, then its hold key and token counter (see hot.lua), then
            // the arguments, each made in one buffer sized for them.
            let mut text = String::with_capacity(name.as_str().len() + 256);
            push_key(&mut text, name);
            let record = text.len();
            cmd.arg("EVALSHA").arg(script.get_hash()).arg(3).arg(&text);
            text.push_str(":hold");
            cmd.arg(&text);
            text.truncate(record);
            text.push_str(":token");
            cmd.arg(&text);
            request::pack(fields, &mut cmd, &mut text, resent);
            cmd
        };
        // Every script is safe to repeat for its lease id. (A release whose first send
        // took effect then answers "not held": the cautious answer, as the two cannot be
        // told apart.)
        (self.send(script, command).await).map_err(|e| self.error(e, name))
    }

    /// Runs the EVALSHA `command(resent)` builds, on the lane when it is idle. A call
    /// that met a dropped connection (a server restart) is sent once more on each
    /// connection that dropped it, built with `resent`: after the lane's, on the
    /// multiplexed one, which may have been dropped too and learns of it only by sending.
    /// One that timed out is not: the server is slow or stopped, not gone, and a second
    /// wait would double the request timeout the caller set.
    pub(super) async fn send<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        command: impl Fn(bool) -> redis::Cmd,
    ) -> redis::RedisResult<T> {
        let (mut sent, mut lane_dropped, mut shared_dropped) = (0, false, false);
        loop {
            sent += 1;
            let resent = sent > 1;
            let on_lane = match &self.inner.lane {
                Some(lane) if !lane_dropped => {
                    lane.run(async |line| eval(|| command(resent), script, line).await)
                        .await
                }
                _ => None,
            };
            let on_lane_now = on_lane.is_some();
            let result = match (on_lane, self.inner.conn.clone()) {
                (Some(result), _) => result,
                (None, Conn::Single(mut c)) => eval(|| command(resent), script, &mut c).await,
                (None, Conn::Cluster(mut c, _)) => eval(|| command(resent), script, &mut c).await,
            };
            let dropped = |e: &redis::RedisError| {
                !e.is_timeout()
                    && (e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal())
            };
            let first_drop = match on_lane_now {
                true => !std::mem::replace(&mut lane_dropped, true),
                false => !std::mem::replace(&mut shared_dropped, true),
            };
            match result {
                Err(e) if first_drop && dropped(&e) => {
                    tracing::debug!(error = %e, "redis connection dropped; sending again");
                }
                result => return result,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_script_is_made_with_its_replies_written_out() {
        // Made once: a reply that does not fit its shape panics here (see lua::replies).
        let scripts = super::scripts();
        assert_ne!(scripts.acquire.get_hash(), scripts.transfer.get_hash());
    }
}
