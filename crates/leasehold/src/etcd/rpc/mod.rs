//! The slice of etcd's v3 gRPC API the store uses, and a client that fails over between
//! endpoints.
//!
//! The messages are written out here with `prost` derives, field numbers as in etcd's
//! `rpc.proto` and `kv.proto` (fields we never read are left out; protobuf skips them), so
//! building needs no `protoc` and no build script.
//!
//! `messages`: the messages; `client`: calls that fail over between members; `batch`: Txns
//! that meet sharing one request; `link`: a
//! member's HTTP/2 connection (made again on the calling runtime when it has ended);
//! `body`: request bodies that end with their last frame; `watch`: the watches of a client
//! on one stream; `keepalive`: its keepalives on one stream.

mod batch;
mod body;
mod client;
mod keepalive;
mod link;
mod messages;
mod watch;

use std::time::Duration;

pub use client::{Client, TlsRefused};
pub use messages::*;
pub use watch::Watch;

/// How long one call to one member may take before the next member is tried: a paused
/// member must not stall the client for longer than this.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);

tokio::task_local! {
    /// Set by [`trying_each_for`]: how long a call may wait for one member while another
    /// is left to try.
    static TRY_TIMEOUT: Duration;
}

/// A stream that a client's calls of one kind share (watches, keepalives).
pub(super) trait Shared {
    /// The member it is open to.
    fn member(&self) -> usize;
    /// Ends it; what waits on it sees the end.
    fn end(&self);
}

/// A client's one stream of a kind, opened by the first call and again after it broke.
#[derive(Debug)]
pub(super) struct OneStream<S: Shared>(tokio::sync::Mutex<Option<std::sync::Arc<S>>>);

impl<S: Shared> Default for OneStream<S> {
    fn default() -> Self {
        OneStream(tokio::sync::Mutex::new(None))
    }
}

impl<S: Shared> OneStream<S> {
    /// Calls moved away from `member`: a stream there may be silent (a paused member), so
    /// end it and let what used it start again where calls now go.
    pub(super) fn left(&self, member: usize) {
        if let Ok(open) = self.0.try_lock() {
            if let Some(stream) = open.as_ref().filter(|s| s.member() == member) {
                stream.end();
            }
        }
    }
}

impl<S: Shared> Drop for OneStream<S> {
    fn drop(&mut self) {
        if let Some(stream) = self.0.get_mut().take() {
            stream.end();
        }
    }
}

/// Runs `calls` with each member tried for at most `limit` (and [`CALL_TIMEOUT`]) while
/// another member is left to try; the last one tried keeps [`CALL_TIMEOUT`]. For calls
/// that must be answered within a lease's TTL: a renewal of a 2 s lease cannot wait 3 s
/// on a paused member before trying a healthy one.
pub async fn trying_each_for<F: std::future::Future>(limit: Duration, calls: F) -> F::Output {
    TRY_TIMEOUT.scope(limit.min(CALL_TIMEOUT), calls).await
}
