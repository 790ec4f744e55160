//! The waiters of one process watch their lock's queue together: one watch for deletions
//! per lock and process, and each waiter is let in when enough of the keys that could keep
//! it out have gone (every key ahead for a writer, the writers ahead for a reader, all but
//! `permits - 1` keys ahead for a semaphore). A hand-over then needs no read and no watch
//! of its own: the release's deletion reaches the process once, and only the waiter it lets
//! in wakes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};

use super::queue::{count, KeyId};
use super::rpc::Watch;
use crate::Locked;

/// Deletions kept for writers that join a line after reading the queue: enough for the
/// few revisions between a read and the join.
const LOG: usize = 1024;

/// The lines of one store, by queue prefix.
#[derive(Default)]
pub(super) struct Lines(Arc<Mutex<HashMap<Vec<u8>, Arc<Line>>>>);

impl Lines {
    /// The line of the queue at `prefix`, if one is being watched.
    pub fn get(&self, prefix: &[u8]) -> Option<Arc<Line>> {
        let lines = self.0.locked();
        lines.get(prefix).filter(|l| !l.ended()).cloned()
    }

    /// A line fed by `watch`, which reports the deletions in the queue at `prefix` after
    /// revision `since`; or the line another task started meanwhile.
    pub fn start(&self, prefix: &[u8], watch: Watch, since: i64) -> Arc<Line> {
        let mut lines = self.0.locked();
        if let Some(line) = lines.get(prefix).filter(|l| !l.ended()) {
            return line.clone();
        }
        let line = Arc::new(Line::new(prefix, Arc::downgrade(&self.0), since));
        let reader = tokio::spawn(read(line.clone(), watch));
        *line.reader.locked() = Some(reader.abort_handle());
        lines.insert(prefix.to_vec(), line.clone());
        line
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        let lines: Vec<_> = self.0.locked().drain().collect();
        for (_, line) in lines {
            line.end();
        }
    }
}

pub(super) struct Line {
    prefix: Vec<u8>,
    lines: Weak<Mutex<HashMap<Vec<u8>, Arc<Line>>>>,
    state: Mutex<State>,
    reader: Mutex<Option<tokio::task::AbortHandle>>,
}

#[derive(Default)]
struct State {
    /// Recent deletions, oldest first: (revision, key).
    log: VecDeque<(i64, KeyId)>,
    /// Every deletion after this revision is in `log` (or was applied before it joined).
    complete_after: i64,
    /// Boxed: a map keeps room for more entries than it has, and a waiter is large.
    waiting: HashMap<u64, Box<Waiter>>,
    next_id: u64,
    ended: bool,
}

struct Waiter {
    own: KeyId,
    /// The keys ahead as its read found them (a list is smaller than a set, and as quick
    /// at this size), shared with its acquisition's record; `gone` marks those deleted
    /// since, and `left` counts the rest.
    ahead: Arc<[KeyId]>,
    gone: Gone,
    left: u32,
    /// How many keys may remain ahead when it holds.
    room: u32,
    /// Deletions at or before this revision are already marked in `gone`.
    seen: i64,
    /// Set when its wait is over, and its task woken (no channel of its own: thousands
    /// of waiters wait in lines).
    turn: Option<Turn>,
    waker: Option<Waker>,
}

/// Which of a waiter's keys ahead have gone, by index: a word for up to 64 keys.
enum Gone {
    Few(u64),
    Many(Box<[u64]>),
}

impl Gone {
    fn none_of(keys: usize) -> Gone {
        match keys {
            0..=64 => Gone::Few(0),
            _ => Gone::Many(vec![0; keys.div_ceil(64)].into()),
        }
    }

    /// Marks key `i` gone; whether it had not been.
    fn mark(&mut self, i: usize) -> bool {
        let (word, bit) = match self {
            Gone::Few(word) => (word, i),
            Gone::Many(words) => (&mut words[i / 64], i % 64),
        };
        let had = *word & (1 << bit) != 0;
        *word |= 1 << bit;
        !had
    }
}

impl Waiter {
    /// Counts `key`'s deletion if it was ahead; whether few enough keys are left then.
    fn deleted(&mut self, key: &KeyId) -> bool {
        let Some(at) = self.ahead.iter().position(|k| k == key) else {
            return false;
        };
        if self.gone.mark(at) {
            self.left -= 1;
        }
        self.left <= self.room
    }
}

/// Why a writer's wait is over.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Turn {
    /// Few enough keys are ahead of it now.
    Free,
    /// Its own key went (its lease ended).
    Gone,
}

pub(super) enum Joined {
    Over(Turn),
    /// The line cannot tell what happened since the writer's read: read again, as of
    /// this revision or later.
    Gap(i64),
    /// The line's watch has ended: start another.
    Ended,
    Waiting(Place),
}

/// A writer's place in a line; leaves it when dropped.
pub(super) struct Place {
    line: Arc<Line>,
    id: u64,
}

impl Place {
    /// `None` if the line's watch ended first.
    pub fn turn(&mut self) -> impl std::future::Future<Output = Option<Turn>> + Send + '_ {
        std::future::poll_fn(|cx| self.line.poll_turn(self.id, cx))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.line.leave(self.id);
    }
}

impl Line {
    fn new(prefix: &[u8], lines: Weak<Mutex<HashMap<Vec<u8>, Arc<Line>>>>, since: i64) -> Self {
        Line {
            prefix: prefix.to_vec(),
            lines,
            state: Mutex::new(State {
                complete_after: since,
                ..State::default()
            }),
            reader: Mutex::new(None),
        }
    }

    /// Joins the waiter whose key is `own`, with the keys `ahead` of it that could keep it
    /// out as read at revision `seen`, `room` of which may remain when it holds.
    pub fn join(
        self: &Arc<Self>,
        own: &KeyId,
        ahead: &Arc<[KeyId]>,
        room: u32,
        seen: i64,
    ) -> Joined {
        let over = |state: std::sync::MutexGuard<'_, State>, turn| {
            // A line nobody waits in ends.
            if state.waiting.is_empty() {
                drop(state);
                self.end();
            }
            Joined::Over(turn)
        };
        let mut state = self.state.locked();
        if state.ended {
            return Joined::Ended;
        }
        if seen < state.complete_after {
            return Joined::Gap(state.complete_after);
        }
        let mut waiter = Waiter {
            own: *own,
            ahead: ahead.clone(),
            gone: Gone::none_of(ahead.len()),
            left: count(ahead.len()),
            room,
            seen,
            turn: None,
            waker: None,
        };
        let mut gone = false;
        for (revision, key) in &state.log {
            if *revision > seen {
                gone |= *key == waiter.own;
                waiter.deleted(key);
            }
        }
        if gone {
            return over(state, Turn::Gone);
        }
        if waiter.left <= waiter.room {
            return over(state, Turn::Free);
        }
        let id = state.next_id;
        state.next_id += 1;
        state.waiting.insert(id, Box::new(waiter));
        Joined::Waiting(Place {
            line: self.clone(),
            id,
        })
    }

    /// Waiter `id`'s turn, once the line has set it; `None` if it left or the line ended.
    fn poll_turn(&self, id: u64, cx: &mut Context<'_>) -> Poll<Option<Turn>> {
        let mut state = self.state.locked();
        let Some(waiter) = state.waiting.get_mut(&id) else {
            return Poll::Ready(None);
        };
        if waiter.turn.is_none() {
            if !waiter
                .waker
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                waiter.waker = Some(cx.waker().clone());
            }
            return Poll::Pending;
        }
        Poll::Ready(state.waiting.remove(&id).and_then(|w| w.turn))
    }

    fn deleted(&self, revision: i64, key: &[u8]) {
        let key = KeyId::of(key);
        let mut state = self.state.locked();
        if state.log.len() == LOG {
            if let Some((oldest, _)) = state.log.pop_front() {
                state.complete_after = oldest;
            }
        }
        state.log.push_back((revision, key));
        let woken: Vec<Waker> = state
            .waiting
            .values_mut()
            .filter(|w| revision > w.seen && w.turn.is_none())
            .filter_map(|w| {
                if w.own == key {
                    w.turn = Some(Turn::Gone);
                } else if w.deleted(&key) {
                    w.turn = Some(Turn::Free);
                } else {
                    return None;
                }
                w.waker.take()
            })
            .collect();
        drop(state);
        woken.into_iter().for_each(Waker::wake);
    }

    /// Whether every deletion in the queue after revision `seen` is known here (a
    /// waiter that read it at `seen` may join), and none of them was `own`.
    pub fn covers(&self, own: &[u8], seen: i64) -> bool {
        let own = KeyId::of(own);
        let state = self.state.locked();
        !state.ended
            && seen >= state.complete_after
            && !(state.log.iter()).any(|(revision, key)| *revision > seen && *key == own)
    }

    fn ended(&self) -> bool {
        self.state.locked().ended
    }

    /// Leaves the line; the last writer to leave ends its watch.
    fn leave(&self, id: u64) {
        let mut state = self.state.locked();
        state.waiting.remove(&id);
        if state.waiting.is_empty() {
            drop(state);
            self.end();
        }
    }

    /// Ends the watch; writers still waiting see their wait end.
    fn end(&self) {
        let woken: Vec<Waker> = {
            let mut state = self.state.locked();
            state.ended = true;
            (state.waiting.drain())
                .filter_map(|(_, w)| w.waker)
                .collect()
        };
        woken.into_iter().for_each(Waker::wake);
        if let Some(reader) = self.reader.locked().take() {
            reader.abort();
        }
        if let Some(lines) = self.lines.upgrade() {
            let mut lines = lines.locked();
            if lines
                .get(&self.prefix)
                .is_some_and(|l| std::ptr::eq(&**l, self))
            {
                lines.remove(&self.prefix);
            }
        }
    }
}

/// Feeds the line the deletions its watch reports, until the watch ends.
async fn read(line: Arc<Line>, mut watch: Watch) {
    while let Some(answer) = watch.message().await {
        if answer.canceled {
            break;
        }
        for kv in answer.events.iter().filter_map(|e| e.kv.as_ref()) {
            line.deleted(kv.mod_revision, &kv.key);
        }
    }
    line.end();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> KeyId {
        KeyId::of(k.as_bytes())
    }

    fn line(since: i64) -> Arc<Line> {
        Arc::new(Line::new(b"p", Weak::new(), since))
    }

    impl Place {
        fn is_ready(&self) -> bool {
            let state = self.line.state.locked();
            state
                .waiting
                .get(&self.id)
                .is_some_and(|w| w.turn.is_some())
        }
    }

    fn waiting(joined: Joined) -> Place {
        match joined {
            Joined::Waiting(place) => place,
            _ => panic!("expected to wait"),
        }
    }

    #[tokio::test]
    async fn a_writer_is_let_in_when_the_last_key_ahead_goes() {
        let line = line(10);
        let mut place = waiting(line.join(&key("me"), &[key("a"), key("b")].into(), 0, 12));
        line.deleted(13, b"zz"); // behind us
        line.deleted(14, b"b");
        assert!(!place.is_ready(), "a is still ahead");
        line.deleted(15, b"a");
        assert_eq!(place.turn().await, Some(Turn::Free));
    }

    #[tokio::test]
    async fn a_writer_behind_many_keys_counts_each_deletion_once() {
        // More keys than one word of `Gone` marks.
        let names: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
        let ahead: Arc<[KeyId]> = names.iter().map(|n| key(n)).collect();
        let line = line(10);
        line.deleted(11, b"k99"); // before our read: still ahead
        let mut place = waiting(line.join(&key("me"), &ahead, 0, 12));
        for (revision, name) in (13..).zip(&names[..99]) {
            line.deleted(revision, name.as_bytes());
        }
        line.deleted(200, b"k98"); // again (put again behind us, and gone)
        assert!(!place.is_ready(), "k99 is still ahead");
        line.deleted(201, b"k99");
        assert_eq!(place.turn().await, Some(Turn::Free));
    }

    #[tokio::test]
    async fn deletions_up_to_the_writers_read_do_not_count() {
        // "a" was deleted at 11 and put again (same name, reused lease) before our read
        // at 12: the new "a" is still ahead of us.
        let line = line(10);
        line.deleted(11, b"a");
        let mut place = waiting(line.join(&key("me"), &[key("a")].into(), 0, 12));
        line.deleted(12, b"a");
        assert!(!place.is_ready());
        line.deleted(13, b"a");
        assert_eq!(place.turn().await, Some(Turn::Free));
    }

    #[test]
    fn deletions_between_the_read_and_the_join_count() {
        let line = line(10);
        line.deleted(13, b"a");
        assert!(matches!(
            line.join(&key("me"), &[key("a")].into(), 0, 12),
            Joined::Over(Turn::Free)
        ));
        assert!(line.ended(), "nobody waits in it");
        let line = super::tests::line(10);
        line.deleted(14, b"me");
        assert!(matches!(
            line.join(&key("me"), &[key("b")].into(), 0, 12),
            Joined::Over(Turn::Gone)
        ));
    }

    #[tokio::test]
    async fn the_writers_own_key_going_ends_its_wait() {
        let line = line(10);
        let mut place = waiting(line.join(&key("me"), &[key("a")].into(), 0, 12));
        line.deleted(13, b"me");
        assert_eq!(place.turn().await, Some(Turn::Gone));
    }

    #[tokio::test]
    async fn a_permit_waiter_is_let_in_when_few_enough_keys_are_ahead() {
        let line = line(10);
        let ahead = [key("a"), key("b"), key("c")];
        let mut place = waiting(line.join(&key("me"), &ahead.into(), 1, 12));
        line.deleted(13, b"b");
        assert!(!place.is_ready(), "a and c are ahead, room for one");
        line.deleted(14, b"c");
        assert_eq!(place.turn().await, Some(Turn::Free));
    }

    #[test]
    fn a_read_older_than_the_line_is_a_gap() {
        let line = line(10);
        assert!(matches!(
            line.join(&key("me"), &[key("a")].into(), 0, 9),
            Joined::Gap(10)
        ));
        // The log drops its oldest deletions (at 11 and 12): it no longer covers 12.
        for revision in 11..13 + LOG as i64 {
            line.deleted(revision, b"x");
        }
        assert!(matches!(
            line.join(&key("me"), &[key("a")].into(), 0, 11),
            Joined::Gap(12)
        ));
        assert!(matches!(
            line.join(&key("me"), &[key("a")].into(), 0, 12),
            Joined::Waiting(_)
        ));
    }

    #[tokio::test]
    async fn the_last_writer_to_leave_ends_the_line() {
        let line = line(10);
        let first = waiting(line.join(&key("me"), &[key("a")].into(), 0, 12));
        let mut second = waiting(line.join(&key("you"), &[key("a"), key("me")].into(), 0, 12));
        drop(first);
        assert!(!line.ended());
        line.end();
        assert_eq!(second.turn().await, None);
        assert!(matches!(
            line.join(&key("x"), &[key("a")].into(), 0, 12),
            Joined::Ended
        ));
    }
}
