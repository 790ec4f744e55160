//! Keepalives: every keepalive of a client goes over one LeaseKeepAlive stream, opened by
//! the first and again after it broke (or went silent), as watches share one Watch
//! stream: thousands of waiters renewing their leases cost one message each, not an
//! HTTP/2 stream each.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot};
use tonic::{Status, Streaming};

use super::{
    Client, LeaseId, LeaseKeepAliveResponse, OneStream, Shared, CALL_TIMEOUT, TRY_TIMEOUT,
};
use crate::Locked;

/// The client's keepalive stream.
pub(super) type KeepAlives = OneStream<KeepAliveStream>;

impl Shared for KeepAliveStream {
    fn member(&self) -> usize {
        self.member
    }

    fn end(&self) {
        KeepAliveStream::end(self);
    }
}

#[derive(Debug)]
pub(super) struct KeepAliveStream {
    member: usize,
    requests: mpsc::UnboundedSender<LeaseId>,
    /// Keepalives sent and not yet answered, by lease id, oldest first (etcd answers each
    /// with its id, in the order sent).
    waiting: Mutex<Option<HashMap<i64, VecDeque<oneshot::Sender<LeaseKeepAliveResponse>>>>>,
    reader: Mutex<Option<tokio::task::AbortHandle>>,
}

impl KeepAliveStream {
    /// Sends a keepalive of `id`; `None` if the stream has ended.
    fn send(&self, id: i64, first: bool) -> Option<oneshot::Receiver<LeaseKeepAliveResponse>> {
        let mut waiting = self.waiting.locked();
        let waiting = waiting.as_mut()?;
        if !first && self.requests.send(LeaseId { id }).is_err() {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        waiting.entry(id).or_default().push_back(tx);
        Some(rx)
    }

    /// Hands `answer` to the oldest keepalive of its lease, the one it answers. Not to a
    /// later one too: its sender would count the lease from its own send, later than
    /// etcd renewed it, and believe it alive past its end.
    fn deliver(&self, answer: LeaseKeepAliveResponse) {
        let mut waiting = self.waiting.locked();
        let Some(waiting) = waiting.as_mut() else {
            return;
        };
        let Some(senders) = waiting.get_mut(&answer.id) else {
            return;
        };
        let oldest = senders.pop_front();
        if senders.is_empty() {
            waiting.remove(&answer.id);
        }
        if let Some(sender) = oldest {
            let _ = sender.send(answer);
        }
    }

    /// Ends the stream; keepalives waiting on it see their senders dropped.
    fn end(&self) {
        self.waiting.locked().take();
        if let Some(reader) = self.reader.locked().take() {
            reader.abort();
        }
    }
}

async fn read(stream: Arc<KeepAliveStream>, mut answers: Streaming<LeaseKeepAliveResponse>) {
    while let Ok(Some(answer)) = answers.message().await {
        stream.deliver(answer);
    }
    stream.end();
}

impl Client {
    /// One keepalive of lease `id` on the client's keepalive stream: etcd's answer (a TTL
    /// of 0 or less when the lease is gone). Bounded by [`CALL_TIMEOUT`] (less inside
    /// [`trying_each_for`](super::trying_each_for)); a stream that does not answer in
    /// time is ended, so the next keepalive opens one where calls go now.
    pub async fn keep_alive(&self, id: i64) -> Result<LeaseKeepAliveResponse, Status> {
        // As a call's try on one member (see `failover`): the tighter limit only while
        // another member is left to try.
        let limit = match TRY_TIMEOUT.try_with(|l| *l) {
            Ok(limit) if self.members() > 1 => limit,
            _ => CALL_TIMEOUT,
        };
        let (stream, answer) = {
            let mut open = self.keepalives.0.lock().await;
            let sent = open
                .as_ref()
                .and_then(|s| Some((s.clone(), s.send(id, false)?)));
            match sent {
                Some(sent) => sent,
                None => {
                    if let Some(old) = open.take() {
                        old.end();
                    }
                    // Boxed: every waiting key's recheck waits here, and carries the
                    // keepalive's answer, not the opening of a stream (about 2 KB).
                    let (requests, answers) =
                        Box::pin(self.open("/etcdserverpb.Lease/LeaseKeepAlive", LeaseId { id }))
                            .await?;
                    let stream = Arc::new(KeepAliveStream {
                        member: self.current.load(Ordering::Relaxed),
                        requests,
                        waiting: Mutex::new(Some(HashMap::new())),
                        reader: Mutex::new(None),
                    });
                    let answer = stream.send(id, true).expect("a new stream is open");
                    let reader = tokio::spawn(read(stream.clone(), answers));
                    *stream.reader.locked() = Some(reader.abort_handle());
                    *open = Some(stream.clone());
                    (stream, answer)
                }
            }
        };
        match tokio::time::timeout(limit, answer).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(_)) => Err(Status::unavailable("keepalive stream ended")),
            Err(_) => {
                stream.end();
                Err(Status::deadline_exceeded(format!(
                    "no answer to a keepalive within {limit:?}"
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(id: i64, ttl: i64) -> LeaseKeepAliveResponse {
        LeaseKeepAliveResponse { id, ttl }
    }

    /// Two keepalives of one lease in flight: etcd's first answer is the first one's, and
    /// the second waits for its own (renewed after it was sent).
    #[test]
    fn an_answer_goes_to_the_oldest_keepalive_of_its_lease_only() {
        let (requests, mut sent) = mpsc::unbounded_channel();
        let stream = KeepAliveStream {
            member: 0,
            requests,
            waiting: Mutex::new(Some(HashMap::new())),
            reader: Mutex::new(None),
        };
        let mut first = stream.send(7, false).expect("open");
        let mut second = stream.send(7, false).expect("open");
        let mut other = stream.send(8, false).expect("open");
        assert_eq!(sent.try_recv().map(|r| r.id), Ok(7));
        stream.deliver(answer(7, 5));
        assert_eq!(first.try_recv().map(|a| a.ttl), Ok(5));
        assert!(
            second.try_recv().is_err(),
            "the second got the first's answer"
        );
        stream.deliver(answer(7, 4));
        assert_eq!(second.try_recv().map(|a| a.ttl), Ok(4));
        assert!(other.try_recv().is_err());
        stream.deliver(answer(8, 3));
        assert_eq!(other.try_recv().map(|a| a.ttl), Ok(3));
        assert!(stream
            .waiting
            .locked()
            .as_ref()
            .is_some_and(HashMap::is_empty));
    }
}
