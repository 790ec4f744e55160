//! Txns that meet share one request. A Txn goes at once, alone, when the client has no
//! request of Txns in flight, or has one in flight or waiting of the same scope (a lock's
//! Txns, which could not share a request: many tasks queueing for one lock send their
//! Txns as they would alone). Otherwise it waits, with the Txns that come while their
//! gatherer (the first of them) lets the other tasks ready now run; then they go
//! together, as one Txn whose only ops are theirs: etcd applies it as one raft entry with
//! one reply, where each Txn alone costs an entry, a request and a reply. At most
//! [`AT_ONCE`] requests of Txns are in flight; Txns that come meanwhile wait for one to
//! end, and go then. A Txn waits a few times as long as a request of Txns has lately
//! taken, at least [`PATIENCE`]'s least and at most its most, and then goes alone: a
//! stalled request holds the Txns behind it up for that long only.
//!
//! Each Txn stays what it would be alone: etcd takes every inner Txn's compares against
//! the keys as they were before the request, and Txns of one scope (one lock's keys, as
//! the caller's [`Scope`] says) never share a request, so a Txn compares, reads and writes
//! only keys no other Txn of its request touches. Two differences, neither seen by a
//! scope: the Txns of a request take one revision (a put's create revision, the fencing
//! token, stays unique per lock), and its header's revision counts the others' writes.
//! A request etcd refuses as a whole (a lease one of them names has ended, a
//! permission, a size limit) changed nothing: each Txn is then sent alone, for its own
//! answer.

use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
/// How long a Txn waits to share a request, at least and at most (four times as long as
/// requests of Txns have lately taken, in between).
const PATIENCE: (Duration, Duration) = (Duration::from_millis(20), Duration::from_millis(100));

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
    /// The scopes of the Txns waiting or in flight, hashed, and how many of each (two
    /// scopes with one hash: a Txn of the second goes alone, which is always right).
    scopes: HashMap<u64, usize>,
    /// How long requests of Txns have lately taken (a moving average).
    lately: Duration,
    ids: u64,
}

#[derive(Debug)]
struct Waiting {
    id: u64,
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
    /// What a Txn of `scope` does; its scope counts from now until it has been answered.
    fn enter(&mut self, scope: u64) -> Enter {
        let others = self.scopes.entry(scope).or_default();
        *others += 1;
        if *others > 1 || self.in_flight == 0 && !self.gathering {
            self.in_flight += 1;
            return Enter::Alone;
        }
        if self.gathering || self.in_flight >= AT_ONCE {
            return Enter::Wait;
        }
        self.gathering = true;
        Enter::Gather
    }

    /// How long a Txn that comes now waits at most before it goes alone.
    fn patience(&self) -> Duration {
        (self.lately * 4).clamp(PATIENCE.0, PATIENCE.1)
    }

    /// A request of Txns of `scopes` has ended after `took`.
    fn ended(&mut self, scopes: &[u64], took: Duration) {
        self.in_flight -= 1;
        self.lately = self.lately - self.lately / 8 + took / 8;
        for scope in scopes {
            self.answered(*scope);
        }
    }

    fn answered(&mut self, scope: u64) {
        if let Some(count) = self.scopes.get_mut(&scope) {
            *count -= 1;
            if *count == 0 {
                self.scopes.remove(&scope);
            }
        }
    }

    /// Waiting Txn `id`, taken out to go alone (counted in flight); `None` if it is on
    /// its way already.
    fn withdraw(&mut self, id: u64) -> Option<Waiting> {
        let at = self.waiting.iter().position(|w| w.id == id)?;
        self.in_flight += 1;
        self.waiting.remove(at)
    }

    /// The waiting Txns that go next, in the order they came, within [`MOST`] and
    /// [`MOST_BYTES`], counted in flight if any. Those whose callers have gone are
    /// dropped unsent.
    fn take(&mut self) -> Vec<Waiting> {
        let mut gone = Vec::new();
        self.waiting.retain(|w| {
            let closed = w.answer.is_closed();
            if closed {
                gone.push(w.scope);
            }
            !closed
        });
        for scope in gone {
            self.answered(scope);
        }
        let (mut batch, mut bytes) = (Vec::new(), 0);
        while let Some(next) = self.waiting.front() {
            let len = next.request.encoded_len();
            if batch.len() == MOST || (!batch.is_empty() && bytes + len > MOST_BYTES) {
                break;
            }
            bytes += len;
            batch.extend(self.waiting.pop_front());
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
struct Slot {
    client: Arc<Client>,
    scopes: Vec<u64>,
    sent: Instant,
}

impl Slot {
    fn new(client: &Arc<Client>, scopes: Vec<u64>) -> Self {
        Slot {
            client: client.clone(),
            scopes,
            sent: Instant::now(),
        }
    }

    /// Its Txns have been answered: Txns of their scopes may wait to share a request.
    fn answered(&mut self) {
        let mut queue = self.client.batches.0.locked();
        for scope in self.scopes.drain(..) {
            queue.answered(scope);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let took = self.sent.elapsed();
        (self.client).send_waiting(|queue| queue.ended(&self.scopes, took));
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
        let (enter, waiting) = {
            let mut queue = self.batches.0.locked();
            match queue.enter(scope) {
                Enter::Alone => (Enter::Alone, Err(request)),
                enter => {
                    let (answer, answered) = oneshot::channel();
                    queue.ids += 1;
                    let id = queue.ids;
                    (queue.waiting).push_back(Waiting {
                        id,
                        request,
                        scope,
                        answer,
                    });
                    (enter, Ok((id, answered, queue.patience())))
                }
            }
        };
        let (id, mut answered, patience) = match waiting {
            Err(request) => return self.alone(request, scope).await,
            Ok(waiting) => waiting,
        };
        let cancelled = |_| {
            Err(Status::cancelled(
                "the request this Txn shared ended unanswered",
            ))
        };
        let waited = async {
            if enter == Enter::Gather {
                let _gathering = Gathering(self.clone());
                tokio::task::yield_now().await;
            }
            (&mut answered).await
        };
        if let Ok(answer) = tokio::time::timeout(patience, waited).await {
            return answer.unwrap_or_else(cancelled);
        }
        let withdrawn = self.batches.0.locked().withdraw(id);
        match withdrawn {
            Some(mine) => self.alone(mine.request, scope).await,
            None => answered.await.unwrap_or_else(cancelled),
        }
    }

    /// A Txn counted in flight, sent alone.
    async fn alone(
        self: &Arc<Self>,
        request: TxnRequest,
        scope: u64,
    ) -> Result<TxnResponse, Status> {
        let _slot = Slot::new(self, vec![scope]);
        self.unary(TXN, request).await
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
            let slot = Slot::new(self, batch.iter().map(|w| w.scope).collect());
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        let mut slot = slot;
                        slot.client.send_batch(batch).await;
                        // The tasks just answered run first: their next Txns (their
                        // scopes answered) go in the request this slot's end sends.
                        slot.answered();
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

    type Answered = oneshot::Receiver<Result<TxnResponse, Status>>;

    fn put(key: &[u8], lease: i64) -> TxnRequest {
        TxnRequest {
            compare: vec![Compare::created_at(key, 0)],
            success: vec![Op::Put(PutRequest {
                key: key.to_vec(),
                lease,
                ..Default::default()
            })
            .into()],
            failure: Vec::new(),
        }
    }

    fn waiting_for(request: TxnRequest, scope: u64) -> (Waiting, Answered) {
        let (answer, answered) = oneshot::channel();
        let waiting = Waiting {
            id: scope,
            request,
            scope,
            answer,
        };
        (waiting, answered)
    }

    /// A Txn of `scope` comes: what it does, and its answer's receiver if it waits.
    fn comes(queue: &mut Queue, scope: u64) -> (Enter, Option<Answered>) {
        let enter = queue.enter(scope);
        if enter == Enter::Alone {
            return (enter, None);
        }
        let (waiting, answered) = waiting_for(put(&scope.to_be_bytes(), 0), scope);
        queue.waiting.push_back(waiting);
        (enter, Some(answered))
    }

    fn scopes(batch: &[Waiting]) -> Vec<u64> {
        batch.iter().map(|w| w.scope).collect()
    }

    /// With nothing in flight a Txn goes alone; the next gathers, and those that come
    /// meanwhile wait with it; a Txn of a scope in flight or waiting goes alone. Waiting
    /// Txns go in the order they came, one whose caller has gone not at all; with two
    /// requests in flight a Txn waits for one to end, and a Txn withdrawn goes alone.
    #[test]
    fn a_txn_goes_alone_gathers_or_waits() {
        let mut queue = Queue::default();
        assert_eq!(comes(&mut queue, 1).0, Enter::Alone);
        let (enter, _b) = comes(&mut queue, 2);
        assert_eq!(enter, Enter::Gather);
        let (enter, c) = comes(&mut queue, 3);
        assert_eq!(enter, Enter::Wait);
        assert_eq!(comes(&mut queue, 3).0, Enter::Alone, "3 waits");
        assert_eq!(comes(&mut queue, 1).0, Enter::Alone, "1 is in flight");
        let (_, _d) = comes(&mut queue, 4);
        assert_eq!(queue.in_flight, 3);
        drop(c);
        queue.gathering = false;
        assert_eq!(scopes(&queue.take()), [2, 4]);
        assert_eq!(queue.in_flight, 4);
        assert!(queue.take().is_empty());
        assert_eq!(
            queue.scopes.get(&3),
            Some(&1),
            "the second of 3 is in flight"
        );
        queue.ended(&[2, 4], Duration::from_millis(8));
        queue.ended(&[3], Duration::ZERO);
        queue.ended(&[1], Duration::ZERO);
        queue.ended(&[1], Duration::ZERO);
        assert!(queue.scopes.is_empty());
        assert_eq!((queue.in_flight, queue.patience()), (0, PATIENCE.0));
        queue.in_flight = AT_ONCE;
        let (enter, _e) = comes(&mut queue, 5);
        assert_eq!(enter, Enter::Wait, "two requests in flight");
        assert!(queue.withdraw(5).is_some());
        assert!(queue.waiting.is_empty());
        assert_eq!(queue.in_flight, AT_ONCE + 1);
    }

    /// A Txn waits four times as long as requests have lately taken, within bounds.
    #[test]
    fn patience_follows_how_long_requests_take() {
        let mut queue = Queue::default();
        for _ in 0..64 {
            queue.in_flight += 1;
            queue.ended(&[], Duration::from_millis(10));
        }
        let patience = queue.patience();
        assert!(
            patience > Duration::from_millis(39) && patience <= Duration::from_millis(40),
            "{patience:?}"
        );
        for _ in 0..64 {
            queue.in_flight += 1;
            queue.ended(&[], Duration::from_secs(3));
        }
        assert_eq!(queue.patience(), PATIENCE.1);
    }

    #[test]
    fn a_request_takes_at_most_its_share() {
        let mut queue = Queue {
            in_flight: AT_ONCE,
            ..Queue::default()
        };
        let waiting: Vec<_> = (0..=MOST as u64)
            .map(|scope| comes(&mut queue, scope).1.expect("waits"))
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
        let client = Client::new(&[server.endpoint()], false, None, &settings).unwrap();
        let (batch, answered): (Vec<_>, Vec<_>) = [(&b"a"[..], 0), (b"b", 0x7eed), (b"c", 0)]
            .into_iter()
            .enumerate()
            .map(|(i, (key, lease))| waiting_for(put(key, lease), i as u64))
            .unzip();
        client.send_batch(batch).await;
        let mut answers = Vec::new();
        for answered in answered {
            answers.push(answered.await.expect("an answer"));
        }
        assert!(answers[0].as_ref().is_ok_and(|a| a.succeeded));
        let refused = answers[1].as_ref().expect_err("no lease 0x7eed");
        assert!(refused.message().contains("lease not found"), "{refused:?}");
        assert!(answers[2].as_ref().is_ok_and(|a| a.succeeded));
        let keys = server.etcdctl(&["get", "", "--from-key", "--keys-only"]);
        assert_eq!(keys.split_whitespace().collect::<Vec<_>>(), ["a", "c"]);
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
