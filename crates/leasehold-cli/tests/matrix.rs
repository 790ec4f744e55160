//! The CLI matrix: every primitive on every store, driven through the real binary with
//! the default flags a new user types (no shortened `--ttl` or `--grace`).
//!
//! A cell is a store (local, Redis, Redis Cluster, etcd) × a primitive (mutex, semaphore
//! of 2, read-write lock) × a fairness flag (none, `--fair`, and `--no-fair` on etcd,
//! where fair is the default). Each cell takes the lock with `leasehold hold`, queues
//! waiters (`leasehold run`) behind it one by one — each visible in `status --json`
//! before the next starts, so their arrival order is known — and releases the holders:
//! the lock is handed from process to process. Every waiter's command is a critical
//! section that appends `enter KIND ID` and `exit KIND ID` to one log (single `write`s
//! with `O_APPEND`, so the log is one order of events); the log must show every command
//! run exactly once, to its end, never beside an incompatible holder, and in arrival
//! order where the lock is fair.
//!
//! Per store, also: a waiter interrupted with SIGINT leaves the queue before it exits
//! and the next waiter runs; a waiter killed with SIGKILL (with a 10-minute `--ttl`)
//! stops blocking the queue once its short waiter lease ends; and re-entry through a
//! nested `leasehold run` of the same name with the same owner (exclusive or shared in
//! exclusive, shared in shared and permit in permit re-enter with the same token;
//! exclusive in shared is refused with 64, alone or beside another owner's reader).

mod support;

use std::any::Any;
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use leasehold_testkit::{wait_for, EtcdServer, RedisCluster, RedisServer};
use support::*;

/// How long a test waits for one process to exit; only spent when something is wrong.
const EXIT_PATIENCE: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq)]
enum StoreKind {
    Local,
    Redis,
    Cluster,
    Etcd,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fairness {
    /// No flag: the store's default (non-fair, except on etcd).
    Default,
    Fair,
    NoFair,
}

impl Fairness {
    fn flags(self) -> &'static [&'static str] {
        match self {
            Fairness::Default => &[],
            Fairness::Fair => &["--fair"],
            Fairness::NoFair => &["--no-fair"],
        }
    }

    /// Whether waiters must be served in arrival order.
    fn ordered(self, store: StoreKind) -> bool {
        match self {
            Fairness::Fair => true,
            Fairness::Default => store == StoreKind::Etcd,
            Fairness::NoFair => false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Primitive {
    /// Plain `leasehold run NAME`.
    Mutex,
    /// `--permits N`.
    Semaphore(u32),
    /// `--shared` readers and plain writers of the same name.
    ReadWrite,
}

/// What a participant takes; its letter in the log.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Writer,
    Reader,
    Permit,
}

impl Kind {
    fn letter(self) -> &'static str {
        match self {
            Kind::Writer => "W",
            Kind::Reader => "R",
            Kind::Permit => "P",
        }
    }

    fn from_letter(letter: &str) -> Kind {
        match letter {
            "W" => Kind::Writer,
            "R" => Kind::Reader,
            "P" => Kind::Permit,
            _ => panic!("unknown kind {letter:?}"),
        }
    }
}

/// A test's world: the CLI's work dir and a store server of its own (if it needs one),
/// stopped when the world is dropped.
struct World {
    cli: Cli,
    _server: Box<dyn Any>,
}

impl World {
    fn new(store: StoreKind, label: &str) -> World {
        let (url, server): (Option<String>, Box<dyn Any>) = match store {
            StoreKind::Local => (None, Box::new(())),
            StoreKind::Redis => {
                let server = RedisServer::start();
                (Some(server.url()), Box::new(server))
            }
            StoreKind::Cluster => {
                let cluster = RedisCluster::start();
                (Some(cluster.url()), Box::new(cluster))
            }
            StoreKind::Etcd => {
                let server = EtcdServer::start();
                (Some(server.url()), Box::new(server))
            }
        };
        let cli = Cli::with_store(&format!("matrix-{label}"), url);
        cli.script("cs.sh", CRITICAL_SECTION);
        World {
            cli,
            _server: server,
        }
    }

    /// Appends one line to the log (as the test, for the `hold` processes it drives).
    fn log(&self, line: &str) {
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.cli.path("log"))
            .unwrap();
        log.write_all(format!("{line}\n").as_bytes()).unwrap();
    }

    fn read_log(&self) -> String {
        if self.cli.exists("log") {
            self.cli.read("log")
        } else {
            String::new()
        }
    }

    /// `leasehold hold` with `flags`; logged as inside from its token on.
    fn hold(&self, id: &str, kind: Kind, flags: &[&str]) -> Proc {
        let mut args = flags.to_vec();
        args.push(NAME);
        let (proc, _token) = self.cli.hold(id, &args);
        self.log(&format!("enter {} {id}", kind.letter()));
        proc
    }

    /// Logs the holder as outside, then lets it go (SIGTERM); it must exit 0.
    fn release(&self, id: &str, kind: Kind, holder: &mut Proc) {
        self.log(&format!("exit {} {id}", kind.letter()));
        holder.signal(libc::SIGTERM);
        expect_exit(holder, 0);
    }

    /// Starts `leasehold run [flags] NAME -- sh cs.sh KIND ID` and waits until it waits:
    /// until `status` lists it as one more waiter (`listed` counts those before it).
    fn queue(&self, id: &str, kind: Kind, flags: &[&str], listed: &mut usize) -> Proc {
        let mut args = vec!["run"];
        args.extend_from_slice(flags);
        args.extend_from_slice(&[NAME, "--", "sh", "cs.sh", kind.letter(), id]);
        let mut proc = self.cli.start(id, self.cli.cmd(&args));
        let pid = proc.pid();
        let queued = *listed + 1;
        wait_for(&format!("{id} to wait for {NAME:?}"), || {
            if let Some(status) = proc.child.try_wait().unwrap() {
                panic!(
                    "{id} exited ({status}) before it waited; log:\n{}\nstderr:\n{}",
                    self.read_log(),
                    proc.stderr()
                );
            }
            let waiters = self.cli.waiters(NAME);
            waiters.len() == queued && waiters.iter().any(|w| w["pid"] == pid)
        });
        *listed = queued;
        proc
    }
}

const NAME: &str = "k";

/// A participant's critical section: `sh cs.sh KIND ID`. The pause makes any overlap
/// show in the log.
const CRITICAL_SECTION: &str = r#"echo "enter $1 $2" >> log
sleep 0.5
echo "exit $1 $2" >> log
"#;

fn expect_exit(proc: &mut Proc, code: i32) {
    let got = proc.exits_within(EXIT_PATIENCE);
    assert_eq!(
        got,
        code,
        "{} exited {got}, not {code}; stdout:\n{}\nstderr:\n{}",
        proc.label,
        proc.stdout(),
        proc.stderr()
    );
}

/// Replays the log: every participant enters once and exits once after, never beside
/// an incompatible one (`limit` for permits). Returns the order in which ids entered.
fn check_log(log: &str, limit: usize) -> Vec<String> {
    let mut inside: BTreeMap<String, Kind> = BTreeMap::new();
    let mut entered = Vec::new();
    let mut exited = Vec::new();
    for line in log.lines() {
        let mut words = line.split(' ');
        let (Some(event), Some(kind), Some(id), None) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            panic!("unexpected log line {line:?}:\n{log}");
        };
        let kind = Kind::from_letter(kind);
        match event {
            "enter" => {
                assert!(
                    !entered.iter().any(|e| e == id),
                    "{id} entered twice:\n{log}"
                );
                let shares = |other: Kind| {
                    matches!(
                        (kind, other),
                        (Kind::Reader, Kind::Reader) | (Kind::Permit, Kind::Permit)
                    )
                };
                let clash = inside.iter().find(|(_, &other)| !shares(other));
                assert!(
                    clash.is_none(),
                    "{id} ({kind:?}) entered beside {clash:?}:\n{log}"
                );
                assert!(
                    inside.len() < limit,
                    "{id} entered beside {} others (at most {limit} at once):\n{log}",
                    inside.len()
                );
                inside.insert(id.to_string(), kind);
                entered.push(id.to_string());
            }
            "exit" => {
                assert_eq!(
                    inside.remove(id),
                    Some(kind),
                    "{id} exited without entering:\n{log}"
                );
                exited.push(id.to_string());
            }
            _ => panic!("unexpected log line {line:?}:\n{log}"),
        }
    }
    assert!(inside.is_empty(), "never exited: {inside:?}\n{log}");
    assert_eq!(entered.len(), exited.len(), "{log}");
    entered
}

/// Whether `entered` is the concatenation, in order, of `batches`, each in any order
/// (readers queued next to each other are let in together, and may log in any order).
fn in_batches(entered: &[String], batches: &[Vec<String>]) -> bool {
    let mut rest = entered;
    for batch in batches {
        if rest.len() < batch.len() {
            return false;
        }
        let (head, tail) = rest.split_at(batch.len());
        let mut head = head.to_vec();
        let mut want = batch.clone();
        head.sort();
        want.sort();
        if head != want {
            return false;
        }
        rest = tail;
    }
    rest.is_empty()
}

/// One cell of the matrix: holders, waiters queued behind them one by one, hand-offs.
fn hand_offs(store: StoreKind, primitive: Primitive, fairness: Fairness) {
    let label = format!("{store:?}-{primitive:?}-{fairness:?}").to_lowercase();
    let world = World::new(store, &label);
    let fair = fairness.flags();
    let ordered = fairness.ordered(store);
    let permits;
    let (limit, kind_flags): (usize, Vec<&str>) = match primitive {
        Primitive::Semaphore(n) => {
            permits = n.to_string();
            (n as usize, vec!["--permits", permits.as_str()])
        }
        _ => (usize::MAX, vec![]),
    };
    let flags = |kind: Kind| -> Vec<&str> {
        let mut flags = fair.to_vec();
        flags.extend_from_slice(&kind_flags);
        if kind == Kind::Reader {
            flags.push("--shared");
        }
        flags
    };
    // The holders, and the waiters (id, kind) in arrival order.
    let (holder_kind, holders, waiters): (Kind, usize, Vec<Kind>) = match primitive {
        Primitive::Mutex => (Kind::Writer, 1, vec![Kind::Writer; 4]),
        Primitive::Semaphore(n) => (Kind::Permit, n as usize, vec![Kind::Permit; 4]),
        Primitive::ReadWrite => (
            Kind::Writer,
            1,
            vec![
                Kind::Writer,
                Kind::Reader,
                Kind::Reader,
                Kind::Writer,
                Kind::Reader,
            ],
        ),
    };
    let mut held: Vec<(String, Proc)> = (0..holders)
        .map(|i| {
            let id = format!("h{i}");
            let proc = world.hold(&id, holder_kind, &flags(holder_kind));
            (id, proc)
        })
        .collect();
    let mut runs: Vec<(String, Proc)> = Vec::new();
    let mut listed = 0;
    for (i, &kind) in waiters.iter().enumerate() {
        let id = format!("w{i}");
        let proc = world.queue(&id, kind, &flags(kind), &mut listed);
        runs.push((id, proc));
    }
    // Let the waiters in. A fair semaphore keeps one permit held throughout, so permits
    // pass from waiter to waiter one at a time and their order shows in the log.
    let keep = match (primitive, ordered) {
        (Primitive::Semaphore(_), true) => 1,
        _ => 0,
    };
    let kept: Vec<(String, Proc)> = held.drain(..keep).collect();
    for (id, holder) in &mut held {
        world.release(id, holder_kind, holder);
    }
    for (_, run) in &mut runs {
        expect_exit(run, 0);
    }
    for (id, mut holder) in kept {
        world.release(&id, holder_kind, &mut holder);
    }
    let log = world.read_log();
    let entered = check_log(&log, limit);
    let ids: Vec<String> = runs.iter().map(|(id, _)| id.clone()).collect();
    for id in &ids {
        assert!(entered.contains(id), "{id} never ran:\n{log}");
    }
    if ordered {
        // Readers queued next to each other form one batch.
        let mut batches: Vec<Vec<String>> = Vec::new();
        let mut last_was_reader = false;
        for (id, &kind) in ids.iter().zip(&waiters) {
            let reader = kind == Kind::Reader;
            match batches.last_mut() {
                Some(batch) if reader && last_was_reader => batch.push(id.clone()),
                _ => batches.push(vec![id.clone()]),
            }
            last_was_reader = reader;
        }
        let served: Vec<String> = entered.into_iter().filter(|e| ids.contains(e)).collect();
        assert!(
            in_batches(&served, &batches),
            "not served in arrival order {batches:?}:\n{log}"
        );
    }
    world.cli.assert_all_free(NAME);
}

/// A queued waiter interrupted with SIGINT exits 130 and is gone from the queue when it
/// has exited; the waiter behind it then gets the lock when the holder lets go.
fn interrupted_waiter_leaves(store: StoreKind, fairness: Fairness) {
    let label = format!("{store:?}-sigint-{fairness:?}").to_lowercase();
    let world = World::new(store, &label);
    let flags = fairness.flags();
    let mut holder = world.hold("h", Kind::Writer, flags);
    let mut listed = 0;
    let mut first = world.queue("w0", Kind::Writer, flags, &mut listed);
    let mut second = world.queue("w1", Kind::Writer, flags, &mut listed);
    first.signal(libc::SIGINT);
    expect_exit(&mut first, 130);
    // Gone from the queue once it has exited (at once, not when its waiter lease ends).
    let waiters = world.cli.waiters(NAME);
    assert!(
        !waiters.iter().any(|w| w["pid"] == first.pid()) && waiters.len() == 1,
        "the interrupted waiter (pid {}) did not leave the queue: {waiters:?}",
        first.pid()
    );
    world.release("h", Kind::Writer, &mut holder);
    expect_exit(&mut second, 0);
    let log = world.read_log();
    assert_eq!(check_log(&log, usize::MAX), ["h", "w1"], "{log}");
    world.cli.assert_all_free(NAME);
}

/// A queued waiter killed with SIGKILL (it cannot leave the queue itself) with a long
/// `--ttl` stops blocking the queue once its short waiter lease ends, not its lock lease:
/// the waiter behind it runs, well within the test's patience and long before the dead
/// waiter's 10-minute lease could end.
fn killed_waiter_stops_blocking(store: StoreKind, fairness: Fairness) {
    let label = format!("{store:?}-kill9-{fairness:?}").to_lowercase();
    let world = World::new(store, &label);
    let flags = fairness.flags();
    let mut holder = world.hold("h", Kind::Writer, flags);
    let long: Vec<&str> = [flags, &["--ttl", "10m"]].concat();
    let mut listed = 0;
    let mut dead = world.queue("w0", Kind::Writer, &long, &mut listed);
    let mut next = world.queue("w1", Kind::Writer, flags, &mut listed);
    dead.signal(libc::SIGKILL);
    let status = dead.child.wait().unwrap();
    assert_eq!(status.code(), None, "w0 was to die of SIGKILL: {status}");
    world.release("h", Kind::Writer, &mut holder);
    // PATIENCE (30 s) is six times the longest waiter lease (5 s) and a twentieth of the
    // dead waiter's lock lease.
    let code = next.exits_within(leasehold_testkit::PATIENCE);
    assert_eq!(code, 0, "w1 exited {code}: {}", next.stderr());
    wait_for("the killed waiter to be dropped from the queue", || {
        world.cli.waiters(NAME).is_empty()
    });
    let log = world.read_log();
    assert_eq!(check_log(&log, usize::MAX), ["h", "w1"], "{log}");
    world.cli.assert_all_free(NAME);
}

/// The outer command of the re-entry test: `sh reenter.sh FLAGS...` runs a nested
/// `leasehold run FLAGS k` (its owner passed down by the outer run unless FLAGS name one) with
/// --no-wait, so that waiting shows as 75, not a hang.
const REENTER: &str = r#"echo "$LEASEHOLD_TOKEN" > outer.token
"$LH" run "$@" k --no-wait -- sh -c 'echo "$LEASEHOLD_TOKEN" > inner.token'
echo $? > inner.code
"#;

/// Runs `leasehold run --owner x OUTER k -- sh reenter.sh INNER` and says what the nested
/// run got: "re-entered" (exit 0, the outer token), "refused" (64, did not run), "busy"
/// (75, did not run), or what else happened.
fn nested(world: &World, outer: &[&str], inner: &[&str]) -> String {
    for file in ["outer.token", "inner.token", "inner.code"] {
        let _ = std::fs::remove_file(world.cli.path(file));
    }
    let mut args = vec!["run", "--owner", "x"];
    args.extend_from_slice(outer);
    args.extend_from_slice(&[NAME, "--", "sh", "reenter.sh"]);
    args.extend_from_slice(inner);
    world.cli.run(&args).expect(0);
    let code: i32 = world.cli.read("inner.code").trim().parse().unwrap();
    let outer = world.cli.read("outer.token");
    let inner = world
        .cli
        .exists("inner.token")
        .then(|| world.cli.read("inner.token"));
    match (code, inner) {
        (0, Some(inner)) if inner == outer => "re-entered".into(),
        (64, None) => "refused".into(),
        (75, None) => "busy".into(),
        (code, inner) => format!("exit {code}, ran with token {inner:?} (outer {outer:?})"),
    }
}

/// The re-entry rules through nested runs of the same name and owner.
fn nested_runs(store: StoreKind) {
    let world = World::new(store, &format!("{store:?}-reentry").to_lowercase());
    world.cli.script("reenter.sh", REENTER);
    let permits: &[&str] = &["--permits", "2"];
    let cases: [(&str, &[&str], &[&str], &str); 6] = [
        ("exclusive in exclusive", &[], &[], "re-entered"),
        ("shared in exclusive", &[], &["--shared"], "re-entered"),
        (
            "shared in shared",
            &["--shared"],
            &["--shared"],
            "re-entered",
        ),
        ("permit in permit", permits, permits, "re-entered"),
        ("exclusive in shared", &["--shared"], &[], "refused"),
        // Control: another owner's nested run is just another contender.
        ("owner z in exclusive", &[], &["--owner", "z"], "busy"),
    ];
    let mut want = Vec::new();
    let mut got = Vec::new();
    for (case, outer, inner, expected) in cases {
        want.push(format!("{case}: {expected}"));
        got.push(format!("{case}: {}", nested(&world, outer, inner)));
    }
    // The same upgrade beside another owner's reader.
    let mut reader = world.hold("y", Kind::Reader, &["--shared", "--owner", "y"]);
    want.push("exclusive in shared beside reader y: refused".to_string());
    got.push(format!(
        "exclusive in shared beside reader y: {}",
        nested(&world, &["--shared"], &[])
    ));
    world.release("y", Kind::Reader, &mut reader);
    assert_eq!(got, want, "nested runs of the same owner");
    world.cli.assert_all_free(NAME);
}

macro_rules! cells {
    ($store:ident: $($test:ident => $body:expr;)*) => {
        mod $store {
            #[allow(unused_imports)]
            use super::{Fairness::*, Primitive::*, StoreKind::*, *};
            $(
                #[test]
                fn $test() {
                    $body
                }
            )*
        }
    };
}

cells! { local:
    mutex => hand_offs(Local, Mutex, Default);
    mutex_fair => hand_offs(Local, Mutex, Fair);
    semaphore => hand_offs(Local, Semaphore(2), Default);
    semaphore_fair => hand_offs(Local, Semaphore(2), Fair);
    rwlock => hand_offs(Local, ReadWrite, Default);
    rwlock_fair => hand_offs(Local, ReadWrite, Fair);
    sigint => interrupted_waiter_leaves(Local, Default);
    sigint_fair => interrupted_waiter_leaves(Local, Fair);
    kill9 => killed_waiter_stops_blocking(Local, Default);
    kill9_fair => killed_waiter_stops_blocking(Local, Fair);
    reentry => nested_runs(Local);
}

cells! { redis:
    mutex => hand_offs(Redis, Mutex, Default);
    mutex_fair => hand_offs(Redis, Mutex, Fair);
    semaphore => hand_offs(Redis, Semaphore(2), Default);
    semaphore_fair => hand_offs(Redis, Semaphore(2), Fair);
    rwlock => hand_offs(Redis, ReadWrite, Default);
    rwlock_fair => hand_offs(Redis, ReadWrite, Fair);
    sigint => interrupted_waiter_leaves(Redis, Default);
    sigint_fair => interrupted_waiter_leaves(Redis, Fair);
    kill9 => killed_waiter_stops_blocking(Redis, Default);
    kill9_fair => killed_waiter_stops_blocking(Redis, Fair);
    reentry => nested_runs(Redis);
}

cells! { cluster:
    mutex => hand_offs(Cluster, Mutex, Default);
    mutex_fair => hand_offs(Cluster, Mutex, Fair);
    semaphore => hand_offs(Cluster, Semaphore(2), Default);
    semaphore_fair => hand_offs(Cluster, Semaphore(2), Fair);
    rwlock => hand_offs(Cluster, ReadWrite, Default);
    rwlock_fair => hand_offs(Cluster, ReadWrite, Fair);
    sigint => interrupted_waiter_leaves(Cluster, Default);
    sigint_fair => interrupted_waiter_leaves(Cluster, Fair);
    kill9 => killed_waiter_stops_blocking(Cluster, Default);
    kill9_fair => killed_waiter_stops_blocking(Cluster, Fair);
    reentry => nested_runs(Cluster);
}

cells! { etcd:
    mutex => hand_offs(Etcd, Mutex, Default);
    mutex_fair => hand_offs(Etcd, Mutex, Fair);
    mutex_no_fair => hand_offs(Etcd, Mutex, NoFair);
    semaphore => hand_offs(Etcd, Semaphore(2), Default);
    semaphore_fair => hand_offs(Etcd, Semaphore(2), Fair);
    semaphore_no_fair => hand_offs(Etcd, Semaphore(2), NoFair);
    rwlock => hand_offs(Etcd, ReadWrite, Default);
    rwlock_fair => hand_offs(Etcd, ReadWrite, Fair);
    rwlock_no_fair => hand_offs(Etcd, ReadWrite, NoFair);
    sigint => interrupted_waiter_leaves(Etcd, Default);
    sigint_no_fair => interrupted_waiter_leaves(Etcd, NoFair);
    kill9 => killed_waiter_stops_blocking(Etcd, Default);
    reentry => nested_runs(Etcd);
}

#[test]
fn the_log_checker_catches_overlap_excess_and_disorder() {
    let ok = "enter W a\nexit W a\nenter R b\nenter R c\nexit R b\nexit R c\n";
    assert_eq!(check_log(ok, usize::MAX), ["a", "b", "c"]);
    for bad in [
        "enter W a\nenter W b\nexit W a\nexit W b\n",
        "enter R a\nenter W b\nexit R a\nexit W b\n",
        "enter W a\nenter R b\nexit W a\nexit R b\n",
        "enter W a\nexit W a\nenter W a\nexit W a\n",
        "enter W a\n",
    ] {
        assert!(
            std::panic::catch_unwind(|| check_log(bad, usize::MAX)).is_err(),
            "accepted {bad:?}"
        );
    }
    let three = "enter P a\nenter P b\nenter P c\nexit P a\nexit P b\nexit P c\n";
    assert_eq!(check_log(three, 3).len(), 3);
    assert!(std::panic::catch_unwind(|| check_log(three, 2)).is_err());
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let batches = vec![s(&["w0"]), s(&["w1", "w2"]), s(&["w3"])];
    assert!(in_batches(&s(&["w0", "w2", "w1", "w3"]), &batches));
    assert!(!in_batches(&s(&["w0", "w1", "w3", "w2"]), &batches));
    assert!(!in_batches(&s(&["w1", "w0", "w2", "w3"]), &batches));
}
