//! Txns that meet share one request. A Txn goes at once, alone, when the client has no
//! request of Txns in flight. Otherwise it waits, with the Txns that come while their
//! gatherer (the first of them) lets the other tasks ready now run; then they go
//! together, as one Txn whose only ops are theirs: etcd applies it as one raft entry with
//! one reply, where each Txn alone costs an entry, a request and a reply. At most
//! [`AT_ONCE`] requests of Txns are in flight; Txns that come meanwhile wait for one to
//! end, and go then.
//!
//! Each Txn stays what it would be alone: etcd takes every inner Txn's compares against
//! the keys as they were before the request, and Txns of one scope (one lock's keys, as
//! the caller's [`Scope`] says) never share a request, so a Txn compares, reads and writes
//! only keys no other Txn of its request touches. Only one Txn of a scope waits: another
//! of that scope, which could not share its request, goes alone at once (many tasks
//! queueing for one lock send their Txns as they did). Two differences, neither seen by a
//! scope: the Txns of a request take one revision (a put's create revision, the fencing
//! token, stays unique per lock), and its header's revision counts the others' writes.
//! A request etcd refuses as a whole (a lease one of them names has ended, a
//! permission, a size limit) changed nothing: each Txn is then sent alone, for its own
//! answer.

use std::collections::{HashSet, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use prost::Message;
use tokio::sync::oneshot;
use tonic::Status;

use super::client::{try_next_member, Client};
use super::{Op, OpResponse, TxnRequest, TxnResponse, TRY_TIMEOUT};
use crate::Locked;

/// Requests of Txns a client has in flight before Txns wait to share one.
const AT_ONCE: usize = 2;
/// Txns in one request: etcd takes at most 128 ops at each level of a Txn by default.
const MOST: usize = 32;
/// Encoded bytes of Txns in one request: etcd refuses requests over 1.5 MiB by default.
const MOST_BYTES: usize = 256 * 1024;

const TXN: &str = "/etcdserverpb.KV/Txn";

/// The keys a Txn touches, named: Txns of one scope never share a request; a Txn without
/// one (keys of several scopes, or none known) is sent alone.
pub type Scope = fn(&TxnRequest) -> Option<&[u8]>;

/// The Txns of a client waiting to share a request, and its requests of Txns in flight.
#[derive(Debug, Default)]
pub(super) struct Batches(Mutex<Queue>);

#[derive(Debug, Default)]
struct Queue {
    in_flight: usize,
    waiting: VecDeque<Waiting>,
    /// A gatherer is letting the tasks ready now run before the waiting Txns go.
    gathering: bool,
    /// The scopes of the waiting Txns, hashed (two scopes with one hash: the second goes
    /// alone, which is always right).
    scopes: HashSet<u64>,
}

#[derive(Debug)]
struct Waiting {
    request: TxnRequest,
    scope: u64,
    answer: oneshot::Sender<Result<TxnResponse, Status>>,
}

/// What a Txn that comes does.
#[derive(Debug, PartialEq)]
enum Enter {
    /// Goes now, alone (counted in flight).
    Alone,
    /// Waits, and gathers those that come while the tasks ready now run.
    Gather,
    /// Waits for a gatherer or for a request to end.
    Wait,
}

impl Queue {
    /// What a Txn of `scope` does; one that is to wait takes its scope.
    fn enter(&mut self, scope: u64) -> Enter {
        if self.in_flight == 0 && !self.gathering || !self.scopes.insert(scope) {
            self.in_flight += 1;
            return Enter::Alone;
        }
        if self.gathering || self.in_flight >= AT_ONCE {
            return Enter::Wait;
        }
        self.gathering = true;
        Enter::Gather
    }

    /// The waiting Txns that go next, in the order they came, within [`MOST`] and
    /// [`MOST_BYTES`], counted in flight if any. Those whose callers have gone are
    /// dropped unsent.
    fn take(&mut self) -> Vec<Waiting> {
        let scopes = &mut self.scopes;
        self.waiting.retain(|w| {
            let gone = w.answer.is_closed();
            if gone {
                scopes.remove(&w.scope);
            }
            !gone
        });
        let (mut batch, mut bytes) = (Vec::new(), 0);
        while let Some(next) = self.waiting.front() {
            let len = next.request.encoded_len();
            if batch.len() == MOST || (!batch.is_empty() && bytes + len > MOST_BYTES) {
                break;
            }
            bytes += len;
            let next = self.waiting.pop_front().expect("a front");
            self.scopes.remove(&next.scope);
            batch.push(next);
        }
        if !batch.is_empty() {
            self.in_flight += 1;
        }
        batch
    }
}

fn hashed(scope: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    scope.hash(&mut hasher);
    hasher.finish()
}

/// A request of Txns in flight: its end lets the Txns waiting go.
struct Slot(Arc<Client>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.send_waiting(|queue| queue.in_flight -= 1);
    }
}

/// A gatherer's turn: its end (or its caller's going) lets the Txns gathered go.
struct Gathering(Arc<Client>);

impl Drop for Gathering {
    fn drop(&mut self) {
        self.0.send_waiting(|queue| queue.gathering = false);
    }
}

impl Client {
    /// One Txn, sent alone or in a request with others (see the module docs), failing
    /// over between members as [`unary`](Self::unary).
    pub async fn txn(
        self: &Arc<Self>,
        request: TxnRequest,
        scope: Scope,
    ) -> Result<TxnResponse, Status> {
        // Inside `trying_each_for`, a call keeps its tighter limits: alone.
        let scope = match scope(&request) {
            Some(scope) if TRY_TIMEOUT.try_with(|_| ()).is_err() => hashed(scope),
            _ => return self.unary(TXN, request).await,
        };
        let (enter, answered) = {
            let mut queue = self.batches.0.locked();
            match queue.enter(scope) {
                Enter::Alone => (Enter::Alone, Err(request)),
                enter => {
                    let (answer, answered) = oneshot::channel();
                    (queue.waiting).push_back(Waiting {
                        request,
                        scope,
                        answer,
                    });
                    (enter, Ok(answered))
                }
            }
        };
        let answered = match answered {
            Err(request) => {
                let _slot = Slot(self.clone());
                return self.unary(TXN, request).await;
            }
            Ok(answered) => answered,
        };
        if enter == Enter::Gather {
            let _gathering = Gathering(self.clone());
            tokio::task::yield_now().await;
        }
        answered.await.unwrap_or_else(|_| {
            Err(Status::cancelled(
                "the request this Txn shared ended unanswered",
            ))
        })
    }

    /// Sends what waits, after `change` (a request ended, or a gatherer's turn), while no
    /// gatherer is at work and fewer than [`AT_ONCE`] requests are in flight.
    fn send_waiting(self: &Arc<Self>, change: impl FnOnce(&mut Queue)) {
        let mut batches = Vec::new();
        {
            let mut queue = self.batches.0.locked();
            change(&mut queue);
            while queue.in_flight < AT_ONCE && !queue.gathering {
                let batch = queue.take();
                if batch.is_empty() {
                    break;
                }
                batches.push(batch);
            }
        }
        // Spawned outside the lock: a runtime that is shutting down drops the task at
        // once, and its slot's drop comes back here.
        for batch in batches {
            let slot = Slot(self.clone());
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        slot.0.send_batch(batch).await;
                        // The tasks just answered run first: their next Txns go in the
                        // request this slot's end sends.
                        tokio::task::yield_now().await;
                        drop(slot);
                    });
                }
                // No runtime to send on: the callers see their request end unanswered.
                Err(_) => drop((batch, slot)),
            }
        }
    }

    async fn send_batch(&self, mut batch: Vec<Waiting>) {
        if batch.len() == 1 {
            let alone = batch.remove(0);
            let _ = alone.answer.send(self.unary(TXN, alone.request).await);
            return;
        }
        let (requests, answers): (Vec<_>, Vec<_>) =
            batch.into_iter().map(|w| (w.request, w.answer)).unzip();
        let count = requests.len();
        let shared = TxnRequest {
            compare: Vec::new(),
            success: (requests.into_iter())
                .map(|r| Op::Txn(Box::new(r)).into())
                .collect(),
            failure: Vec::new(),
        };
        let encoded = Bytes::from(shared.encode_to_vec());
        match self.unary_encoded::<TxnResponse>(TXN, encoded).await {
            Ok(answer) => {
                for (answer, to) in split(answer, count).into_iter().zip(answers) {
                    let _ = to.send(answer);
                }
            }
            // Not known to be applied or not: as for a Txn alone.
            Err(status) if try_next_member(&status) => {
                for to in answers {
                    let _ = to.send(Err(status.clone()));
                }
            }
            Err(_) => {
                let alone = (shared.success.into_iter()).filter_map(|op| match op.request {
                    Some(Op::Txn(request)) => Some(self.unary(TXN, *request)),
                    _ => None,
                });
                let answered = futures_util::future::join_all(alone).await;
                for (answer, to) in answered.into_iter().zip(answers) {
                    let _ = to.send(answer);
                }
            }
        }
    }
}

/// The answers of the `count` Txns a shared request carried, each with the request's
/// header (an inner Txn's own has no revision).
fn split(answer: TxnResponse, count: usize) -> Vec<Result<TxnResponse, Status>> {
    if answer.responses.len() != count {
        let wrong = format!(
            "etcd answered {count} Txns in one request with {} answers",
            answer.responses.len()
        );
        return (0..count).map(|_| Err(Status::internal(&wrong))).collect();
    }
    let header = answer.header;
    (answer.responses.into_iter())
        .map(|op| match op.response {
            Some(OpResponse::Txn(inner)) => Ok(TxnResponse {
                header: header.clone(),
                ..*inner
            }),
            _ => Err(Status::internal(
                "etcd answered a Txn in a shared request with another op",
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd::rpc::{Compare, PutRequest, ResponseHeader, ResponseOp};
    use std::time::Duration;

    fn waiting(
        queue: &mut Queue,
        scope: u64,
    ) -> (
        Enter,
        Option<oneshot::Receiver<Result<TxnResponse, Status>>>,
    ) {
        let enter = queue.enter(scope);
        if enter == Enter::Alone {
            return (enter, None);
        }
        let (answer, answered) = oneshot::channel();
        let request = TxnRequest {
            compare: vec![Compare::created_at(&scope.to_be_bytes(), 0)],
            success: vec![Op::Put(PutRequest::default()).into()],
            failure: Vec::new(),
        };
        queue.waiting.push_back(Waiting {
            request,
            scope,
            answer,
        });
        (enter, Some(answered))
    }

    fn scopes(batch: &[Waiting]) -> Vec<u64> {
        batch.iter().map(|w| w.scope).collect()
    }

    /// With nothing in flight a Txn goes alone; the next gathers, and those that come
    /// meanwhile wait with it, one of each scope: another of a scope that waits goes
    /// at once. Waiting Txns go in the order they came, one whose caller has gone not
    /// at all; with two requests in flight, a Txn waits for one to end.
    #[test]
    fn a_txn_goes_alone_gathers_or_waits() {
        let mut queue = Queue::default();
        assert_eq!(waiting(&mut queue, 1).0, Enter::Alone);
        let (enter, _b) = waiting(&mut queue, 2);
        assert_eq!(enter, Enter::Gather);
        let (enter, c) = waiting(&mut queue, 3);
        assert_eq!(enter, Enter::Wait);
        assert_eq!(
            waiting(&mut queue, 3).0,
            Enter::Alone,
            "a second of scope 3"
        );
        let (_, _d) = waiting(&mut queue, 4);
        assert_eq!(queue.in_flight, 2);
        drop(c);
        queue.gathering = false;
        assert_eq!(scopes(&queue.take()), [2, 4]);
        assert_eq!(queue.in_flight, 3);
        assert!(queue.take().is_empty());
        assert!(queue.scopes.is_empty());
        let (enter, _e) = waiting(&mut queue, 3);
        assert_eq!(enter, Enter::Wait, "three requests in flight");
        queue.in_flight = 1;
        assert_eq!(waiting(&mut queue, 5).0, Enter::Gather);
    }

    #[test]
    fn a_request_takes_at_most_its_share() {
        let mut queue = Queue {
            in_flight: AT_ONCE,
            ..Queue::default()
        };
        let waiting: Vec<_> = (0..=MOST as u64)
            .map(|scope| waiting(&mut queue, scope).1.expect("waits"))
            .collect();
        assert_eq!(queue.take().len(), MOST);
        assert_eq!(queue.take().len(), 1);
        drop(waiting);
    }

    /// A shared request that etcd refuses as a whole (one Txn puts on a lease it does not
    /// have) changed nothing: each Txn is then sent alone, and gets its own answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_request_is_sent_again_a_txn_at_a_time() {
        let server = tokio::task::spawn_blocking(leasehold_testkit::EtcdServer::start)
            .await
            .unwrap();
        let settings = crate::builder::ClientSettings::default();
        let client = Arc::new(Client::new(&[server.endpoint()], false, None, &settings).unwrap());
        let put = |key: &str, lease: i64| TxnRequest {
            compare: vec![Compare::created_at(key.as_bytes(), 0)],
            success: vec![Op::Put(PutRequest {
                key: key.as_bytes().to_vec(),
                lease,
                ..Default::default()
            })
            .into()],
            failure: Vec::new(),
        };
        let by_key: Scope = |request| request.compare.first().map(|c| &c.key[..]);
        // Two requests in flight: the three Txns wait, then go together.
        client.batches.0.locked().in_flight = AT_ONCE;
        let calls: Vec<_> = [("a", 0), ("b", 0x7eed), ("c", 0)]
            .into_iter()
            .map(|(key, lease)| {
                let client = client.clone();
                tokio::spawn(async move { client.txn(put(key, lease), by_key).await })
            })
            .collect();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while client.batches.0.locked().waiting.len() < 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the Txns never waited"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        client.send_waiting(|queue| queue.in_flight -= 1);
        let answers = tokio::time::timeout(
            Duration::from_secs(30),
            futures_util::future::join_all(calls),
        )
        .await
        .expect("the three Txns answered");
        let answers: Vec<_> = answers.into_iter().map(Result::unwrap).collect();
        assert!(answers[0].as_ref().is_ok_and(|a| a.succeeded));
        let refused = answers[1].as_ref().expect_err("no lease 0x7eed");
        assert!(refused.message().contains("lease not found"), "{refused:?}");
        assert!(answers[2].as_ref().is_ok_and(|a| a.succeeded));
        let keys = server.etcdctl(&["get", "", "--from-key", "--keys-only"]);
        assert_eq!(keys.split_whitespace().collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(client.batches.0.locked().in_flight, AT_ONCE - 1);
    }

    /// Each Txn gets its own answer with the request's revision; a reply that does not
    /// match the request is an error for each.
    #[test]
    fn each_txn_gets_its_answer_with_the_shared_revision() {
        let inner = |succeeded| ResponseOp {
            response: Some(OpResponse::Txn(Box::new(TxnResponse {
                header: None,
                succeeded,
                responses: Vec::new(),
            }))),
        };
        let answer = TxnResponse {
            header: Some(ResponseHeader { revision: 42 }),
            succeeded: true,
            responses: vec![inner(true), inner(false)],
        };
        let answers = split(answer.clone(), 2);
        let answers: Vec<_> = answers.into_iter().map(Result::unwrap).collect();
        assert_eq!(
            answers
                .iter()
                .map(|a| (a.succeeded, a.revision()))
                .collect::<Vec<_>>(),
            [(true, 42), (false, 42)]
        );
        assert!(split(answer, 3).iter().all(Result::is_err));
    }
}
