//! The multiplexed connection to one server, made again when redis-rs's connection
//! manager is stuck.
//!
//! The manager reconnects after an I/O error, but a reconnect whose setup the server
//! refused (`AUTH` with a password being changed, a `SELECT` it refused) is kept as the
//! connection and answered to every later call at once, without another try: one short
//! password change under load left a store failing for good. So a call that gets such
//! an answer has a new manager made in the background (one at a time, then at most once
//! a [`RETRY`]); calls go on failing as the server refused access until one is made.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};

use crate::Locked;

/// How long after a failed remake the next may start.
const RETRY: Duration = Duration::from_secs(1);

/// The shared connection of a store on one server; clones share it.
#[derive(Clone)]
pub(super) struct SharedConn(Arc<Shared>);

struct Shared {
    current: Mutex<ConnectionManager>,
    /// What it was made from, to make it again; `None` for the application's own
    /// connection ([`RedisStore::from_connection`](super::RedisStore::from_connection)),
    /// whose making is the application's.
    remake: Option<(redis::Client, ConnectionManagerConfig)>,
    remaking: AtomicBool,
    db: i64,
}

impl SharedConn {
    pub(super) fn new(
        manager: ConnectionManager,
        remake: Option<(redis::Client, ConnectionManagerConfig)>,
        db: i64,
    ) -> Self {
        SharedConn(Arc::new(Shared {
            current: Mutex::new(manager),
            remake,
            remaking: AtomicBool::new(false),
            db,
        }))
    }

    fn manager(&self) -> ConnectionManager {
        self.0.current.locked().clone()
    }

    /// After `e` from the manager: a refused setup has a new manager made.
    fn after(&self, e: &RedisError) {
        if self.0.remake.is_none() || !setup_refused(e) {
            return;
        }
        if self.0.remaking.swap(true, Ordering::AcqRel) {
            return;
        }
        let shared = self.0.clone();
        tokio::spawn(async move {
            let Some((client, config)) = &shared.remake else {
                return;
            };
            match client
                .get_connection_manager_with_config(config.clone())
                .await
            {
                Ok(manager) => *shared.current.locked() = manager,
                Err(_) => tokio::time::sleep(RETRY).await,
            }
            shared.remaking.store(false, Ordering::Release);
        });
    }
}

/// Whether the manager answered with a connection setup the server refused: what it
/// keeps answering until it is made again. redis-rs names these by kind (a failed
/// `AUTH` or `HELLO`) or only by its message (`SELECT`, an `AUTH` answered oddly).
pub(super) fn setup_refused(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || e.to_string().starts_with("Redis server refused to")
}

impl ConnectionLike for SharedConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let answer = self.manager().req_packed_command(cmd).await;
            if let Err(e) = &answer {
                self.after(e);
            }
            answer
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let answer = (self.manager())
                .req_packed_commands(cmd, offset, count)
                .await;
            if let Err(e) = &answer {
                self.after(e);
            }
            answer
        })
    }

    fn get_db(&self) -> i64 {
        self.0.db
    }
}
