//! Watches: every watch of a client shares one Watch stream, opened by the first watch
//! and again after it broke.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::{
    Client, OneStream, Shared, WatchCancelRequest, WatchCreateRequest, WatchOp, WatchRequest,
    WatchResponse, CALL_TIMEOUT,
};
use crate::Locked;

impl Client {
    /// A watch, multiplexed with this client's other watches on one Watch stream: a new
    /// watch costs one message, not a new HTTP/2 stream and etcd watch stream. The first
    /// message of the watch is etcd's answer to the create.
    pub async fn watch(&self, create: WatchCreateRequest) -> Result<Watch, Status> {
        let (sender, mut events) = mpsc::unbounded_channel::<Answer>();
        let request = WatchRequest {
            request: Some(WatchOp::Create(create)),
        };
        let stream = {
            let mut open = self.watches.0.lock().await;
            match open.as_ref().filter(|s| s.add(&request, &sender)) {
                Some(stream) => stream.clone(),
                None => {
                    if let Some(old) = open.take() {
                        old.end();
                    }
                    let (requests, answers) =
                        self.open("/etcdserverpb.Watch/Watch", request).await?;
                    let stream = Arc::new(WatchStream {
                        member: self.current.load(Ordering::Relaxed),
                        requests,
                        routes: Mutex::new(Routes {
                            pending: VecDeque::from([sender]),
                            ..Routes::default()
                        }),
                        reader: Mutex::new(None),
                    });
                    let reader = tokio::spawn(route(stream.clone(), answers));
                    *stream.reader.locked() = Some(reader.abort_handle());
                    *open = Some(stream.clone());
                    stream
                }
            }
        };
        // A member that stopped answering (paused) must not hold every later watch:
        // end this stream so the next watch opens one, on another member if need be.
        let created = match tokio::time::timeout(CALL_TIMEOUT, events.recv()).await {
            Ok(Some(created)) => created,
            Ok(None) => return Err(Status::unavailable("watch stream ended")),
            Err(_) => {
                stream.end();
                return Err(Status::deadline_exceeded(format!(
                    "no answer to a watch within {CALL_TIMEOUT:?}"
                )));
            }
        };
        Ok(Watch {
            id: (!created.canceled).then_some(created.watch_id),
            stream,
            first: Some(created),
            events,
        })
    }
}

/// The client's watch stream.
pub(super) type Watches = OneStream<WatchStream>;

/// A watch's answer on its way to the watch, boxed: a channel allocates room for 32 of
/// what it carries when it opens, 3.5 KB of bare answers for every watch (every held
/// lock and every line has one) against 0.3 KB of boxes.
type Answer = Box<WatchResponse>;

impl Shared for WatchStream {
    fn member(&self) -> usize {
        self.member
    }

    fn end(&self) {
        WatchStream::end(self);
    }
}

#[derive(Debug)]
pub(super) struct WatchStream {
    /// The member it is open to.
    member: usize,
    requests: mpsc::UnboundedSender<WatchRequest>,
    routes: Mutex<Routes>,
    /// The task reading etcd's answers.
    reader: Mutex<Option<tokio::task::AbortHandle>>,
}

/// Where each watch's answers go.
#[derive(Debug, Default)]
struct Routes {
    /// Creates sent and not yet answered, in the order sent: etcd answers them in order.
    pending: VecDeque<mpsc::UnboundedSender<Answer>>,
    by_id: HashMap<i64, mpsc::UnboundedSender<Answer>>,
    ended: bool,
}

impl WatchStream {
    /// Sends a create on this stream; `false` if the stream has ended.
    fn add(&self, create: &WatchRequest, sender: &mpsc::UnboundedSender<Answer>) -> bool {
        let mut routes = self.routes.locked();
        // Under the lock, so creates are sent in the order of `pending`.
        if routes.ended || self.requests.send(create.clone()).is_err() {
            return false;
        }
        routes.pending.push_back(sender.clone());
        true
    }

    fn deliver(&self, answer: WatchResponse) {
        let mut routes = self.routes.locked();
        let id = answer.watch_id;
        if answer.created {
            let Some(sender) = routes.pending.pop_front() else {
                return;
            };
            let canceled = answer.canceled;
            if sender.send(Box::new(answer)).is_ok() && !canceled {
                routes.by_id.insert(id, sender);
            } else if !canceled {
                // Its waiter left before the answer came.
                self.cancel(id);
            }
            return;
        }
        let Some(sender) = routes.by_id.get(&id) else {
            return;
        };
        let canceled = answer.canceled;
        if sender.send(Box::new(answer)).is_err() || canceled {
            routes.by_id.remove(&id);
            if !canceled {
                self.cancel(id);
            }
        }
    }

    fn cancel(&self, id: i64) {
        let _ = self.requests.send(WatchRequest {
            request: Some(WatchOp::Cancel(WatchCancelRequest { watch_id: id })),
        });
    }

    /// Ends every watch on this stream (their receivers see the end) and the stream.
    fn end(&self) {
        let mut routes = self.routes.locked();
        routes.ended = true;
        routes.pending.clear();
        routes.by_id.clear();
        if let Some(reader) = self.reader.locked().take() {
            reader.abort();
        }
    }
}

async fn route(stream: Arc<WatchStream>, mut answers: Streaming<WatchResponse>) {
    while let Ok(Some(answer)) = answers.message().await {
        stream.deliver(answer);
    }
    stream.end();
}

/// One watch on the client's watch stream; cancelled in etcd when dropped.
#[derive(Debug)]
pub struct Watch {
    stream: Arc<WatchStream>,
    /// etcd's id for it; `None` if etcd refused it.
    id: Option<i64>,
    first: Option<Answer>,
    events: mpsc::UnboundedReceiver<Answer>,
}

impl Watch {
    /// The next answer for this watch (the first is the create's); `None` when the stream
    /// has ended.
    pub async fn message(&mut self) -> Option<WatchResponse> {
        let answer = match self.first.take() {
            Some(first) => first,
            None => self.events.recv().await?,
        };
        Some(*answer)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        let mut routes = self.stream.routes.locked();
        if routes.by_id.remove(&id).is_some() {
            self.stream.cancel(id);
        }
    }
}
