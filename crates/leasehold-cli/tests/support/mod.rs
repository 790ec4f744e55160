//! Shared by the CLI test files: a test's world (work dir, store, home), spawned
//! processes that are killed on drop, and waits on conditions with deadlines.
#![allow(dead_code)]

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use leasehold_testkit::{
    pid_alive, send_signal, wait_for, wait_until, wait_until_explained, TempDir, PATIENCE,
};
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_leasehold");

/// One test's world: a work directory (the commands' cwd), a store and a home.
pub struct Cli {
    pub _dir: TempDir,
    pub work: PathBuf,
    pub home: PathBuf,
    pub store: String,
}

/// A finished `leasehold` invocation.
#[derive(Debug)]
pub struct Out {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    pub fn from(output: Output) -> Out {
        Out {
            code: output.status.code(),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }

    /// Asserts the exit code; shows the output when it is not.
    pub fn expect(self, code: i32) -> Out {
        assert_eq!(self.code, Some(code), "unexpected exit; {self:#?}");
        self
    }
}

impl Cli {
    pub fn new(label: &str) -> Cli {
        Self::with_store(label, None)
    }

    /// A world whose commands use `store` (a URL), or a local store of its own.
    pub fn with_store(label: &str, store: Option<String>) -> Cli {
        let dir = TempDir::new(&format!("cli-{label}"));
        let work = dir.path().join("work");
        let home = dir.path().join("home");
        fs::create_dir_all(&work).unwrap();
        fs::create_dir_all(&home).unwrap();
        let store =
            store.unwrap_or_else(|| format!("local:{}", dir.path().join("store").display()));
        Cli {
            _dir: dir,
            work,
            home,
            store,
        }
    }

    /// A file in the work directory.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.work.join(rel)
    }

    pub fn exists(&self, rel: &str) -> bool {
        self.path(rel).exists()
    }

    pub fn read(&self, rel: &str) -> String {
        fs::read_to_string(self.path(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
    }

    pub fn touch(&self, rel: &str) {
        fs::write(self.path(rel), "").unwrap();
    }

    /// Writes a shell script into the work directory (run it as `sh NAME`).
    pub fn script(&self, name: &str, body: &str) {
        fs::write(self.path(name), body).unwrap();
    }

    /// A process in the work directory with a hermetic environment; `$LH` is the binary.
    pub fn process(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.current_dir(&self.work)
            .env_remove("LEASEHOLD_OWNER")
            .env_remove("LEASEHOLD_HELD")
            .env_remove("LEASEHOLD_NAME")
            .env_remove("LEASEHOLD_STORE")
            .env_remove("RUST_LOG")
            .env("LEASEHOLD_HOME", &self.home)
            .env("LH", BIN)
            .stdin(Stdio::null());
        cmd
    }

    /// `leasehold ARGS` without a store flag (for store-related input tests).
    pub fn bare(&self, args: &[&str]) -> Command {
        let mut cmd = self.process(BIN);
        cmd.args(args);
        cmd
    }

    /// `leasehold --store <this test's store> ARGS`.
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut cmd = self.process(BIN);
        cmd.arg("--store").arg(&self.store).args(args);
        cmd
    }

    /// Runs `leasehold --store ... ARGS` to its end.
    pub fn run(&self, args: &[&str]) -> Out {
        Out::from(self.cmd(args).output().expect("run leasehold"))
    }

    /// Starts a process, its stdout and stderr going to files in the work directory.
    pub fn start(&self, label: &str, mut cmd: Command) -> Proc {
        let stdout = self.path(&format!("{label}.stdout"));
        let stderr = self.path(&format!("{label}.stderr"));
        cmd.stdout(fs::File::create(&stdout).unwrap())
            .stderr(fs::File::create(&stderr).unwrap());
        let child = cmd.spawn().expect("spawn");
        Proc {
            label: label.to_string(),
            child,
            stdout,
            stderr,
        }
    }

    /// Starts `leasehold --store ... ARGS`.
    pub fn spawn(&self, label: &str, args: &[&str]) -> Proc {
        self.start(label, self.cmd(args))
    }

    /// Starts `leasehold hold ARGS` and waits for the token it prints.
    pub fn hold(&self, label: &str, args: &[&str]) -> (Proc, u64) {
        let mut all = vec!["hold"];
        all.extend_from_slice(args);
        let mut proc = self.spawn(label, &all);
        let token = proc.wait_for_line(&format!("{label} to print its token"));
        let token = token
            .parse()
            .unwrap_or_else(|_| panic!("hold printed {token:?}, not a decimal token"));
        (proc, token)
    }

    /// `leasehold status NAME --json`.
    pub fn status(&self, name: &str) -> Value {
        let out = self.run(&["status", name, "--json"]).expect(0);
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("status --json: {e}: {out:?}"))
    }

    pub fn holders(&self, name: &str) -> Vec<Value> {
        self.status(name)["holders"]
            .as_array()
            .expect("holders array")
            .clone()
    }

    pub fn waiters(&self, name: &str) -> Vec<Value> {
        self.status(name)["waiters"]
            .as_array()
            .expect("waiters array")
            .clone()
    }

    /// `leasehold list [PREFIX] --json`.
    pub fn list(&self, prefix: &str) -> Vec<Value> {
        let out = self.run(&["list", prefix, "--json"]).expect(0);
        let value: Value = serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("list --json: {e}: {out:?}"));
        value
            .as_array()
            .expect("list --json gives an array")
            .clone()
    }

    pub fn wait_waiters(&self, name: &str, n: usize) {
        wait_for(&format!("{n} waiter(s) of {name:?}"), || {
            self.waiters(name).len() == n
        });
    }

    pub fn wait_file(&self, rel: &str) {
        wait_for(&format!("file {rel}"), || self.exists(rel));
    }

    /// The lock is free and nothing is held or awaited in the store.
    pub fn assert_all_free(&self, name: &str) {
        let status = self.status(name);
        assert_eq!(
            status["holders"],
            Value::Array(vec![]),
            "holders left: {status}"
        );
        assert_eq!(
            status["waiters"],
            Value::Array(vec![]),
            "waiters left: {status}"
        );
        assert_eq!(self.list(""), Vec::<Value>::new(), "list is not empty");
        // The text says so too, and names no token 0 (etcd keeps no last token).
        let text = self.run(&["status", name]).expect(0).stdout;
        let first = text.lines().next().unwrap_or_default();
        let free = format!("{name}: free");
        assert!(
            first == free
                || (first.starts_with(&format!("{free} (last token "))
                    && !first.contains("(last token 0)")),
            "status says: {text}"
        );
    }
}

/// A running process, SIGKILLed (and reaped) on drop if it still runs.
pub struct Proc {
    pub label: String,
    pub child: Child,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn stdout(&self) -> String {
        fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn signal(&self, signal: i32) {
        send_signal(self.pid(), signal);
    }

    /// Waits for the first line of stdout; fails at once if the process exits first.
    pub fn wait_for_line(&mut self, what: &str) -> String {
        wait_until(what, PATIENCE, || {
            if let Some(line) = self.stdout().strip_suffix('\n') {
                return Some(line.to_string());
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "{} exited ({status}) before {what}; stderr:\n{}",
                    self.label,
                    self.stderr()
                );
            }
            None
        })
    }

    pub fn exits_within(&mut self, patience: Duration) -> i32 {
        let what = format!("{} to exit", self.label);
        let status = wait_until(&what, patience, || self.child.try_wait().unwrap());
        match status.code() {
            Some(code) => code,
            None => panic!(
                "{} died of {status}; stderr:\n{}",
                self.label,
                self.stderr()
            ),
        }
    }

    /// Waits for it to exit; its exit code (it must not die of a signal itself).
    pub fn exit_code(&mut self) -> i32 {
        self.exits_within(PATIENCE)
    }

    /// Waits for it to exit with `code`.
    pub fn expect_exit(&mut self, code: i32) {
        let got = self.exit_code();
        assert_eq!(
            got,
            code,
            "{} exited {got}, not {code}; stdout:\n{}\nstderr:\n{}",
            self.label,
            self.stdout(),
            self.stderr()
        );
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Kills a process we only know by pid (a grandchild) on drop.
pub struct PidGuard(pub i32);

impl Drop for PidGuard {
    fn drop(&mut self) {
        if self.0 > 0 && pid_alive(self.0) {
            // SAFETY: plain syscall.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
}

pub fn read_pid(cli: &Cli, rel: &str) -> i32 {
    cli.wait_file(rel);
    wait_until(&format!("a pid in {rel}"), PATIENCE, || {
        cli.read(rel).trim().parse().ok()
    })
}

/// A holder (TTL 500 ms) is stopped with SIGSTOP past its lease: another process gets the
/// lock with a higher token; resumed, the holder stops its command and exits 76.
pub fn paused_holder_loses_the_lock_and_exits_76(cli: &Cli) {
    let script = "echo $LEASEHOLD_TOKEN > token1; echo $$ > child.pid; exec sleep 1000";
    let args = [
        "run", "--ttl", "500ms", "--grace", "1s", "k", "--", "sh", "-c", script,
    ];
    let mut paused = cli.spawn("paused", &args);
    let child = PidGuard(read_pid(cli, "child.pid"));
    paused.signal(libc::SIGSTOP);
    let next = [
        "run",
        "--wait",
        "1h",
        "k",
        "--",
        "sh",
        "-c",
        "echo $LEASEHOLD_TOKEN > token2",
    ];
    cli.run(&next).expect(0);
    let token1: u64 = cli.read("token1").trim().parse().unwrap();
    let token2: u64 = cli.read("token2").trim().parse().unwrap();
    assert!(token2 > token1, "token {token2} after {token1}");
    paused.signal(libc::SIGCONT);
    paused.expect_exit(76);
    assert!(paused.stderr().contains("lost"), "{}", paused.stderr());
    wait_for("the paused holder's command to be stopped", || {
        !pid_alive(child.0)
    });
}

/// A holder with lease `ttl` is killed with SIGKILL (and not reaped: a zombie must count
/// as dead too) while another process waits: the waiter gets the lock with a higher
/// token, within the test's patience.
pub fn killed_holder_is_taken_over_with_a_higher_token(cli: &Cli, ttl: &str) {
    let (holder, token) = cli.hold("holder", &["--ttl", ttl, "k"]);
    let script = "echo $LEASEHOLD_TOKEN > token2";
    let mut waiter = cli.spawn(
        "waiter",
        &["run", "--wait", "1h", "k", "--", "sh", "-c", script],
    );
    cli.wait_waiters("k", 1);
    holder.signal(libc::SIGKILL);
    waiter.expect_exit(0);
    let token2: u64 = cli.read("token2").trim().parse().unwrap();
    assert!(token2 > token, "token {token2} after {token}");
    cli.assert_all_free("k");
    drop(holder);
}

/// A holder, waiter 1 (`run`) and waiter 2 (`hold`) of lock `k` (TTL 30 s, with
/// `flags` such as `--fair`); waiter 1 gets `signal` while it waits. It exits 128+N and
/// has left the queue by then (`status` no longer lists it), and waiter 2 gets the lock
/// promptly once the holder is done: long before waiter 1's place could have ended with
/// its waiter lease (5 s), had it been left behind.
pub fn interrupted_waiter_leaves_the_queue(cli: &Cli, signal: i32, flags: &[&str]) {
    let args = |head: &[&'static str], tail: &[&'static str]| {
        let mut all = head.to_vec();
        all.extend_from_slice(&["--ttl", "30s"]);
        all.extend_from_slice(flags);
        all.push("k");
        all.extend_from_slice(tail);
        all
    };
    let (mut holder, _) = cli.hold("holder", &args(&[], &[]));
    let mut w1 = cli.spawn("w1", &args(&["run"], &["--", "touch", "w1-ran"]));
    cli.wait_waiters("k", 1);
    let mut w2 = cli.spawn("w2", &args(&["hold"], &[]));
    cli.wait_waiters("k", 2);
    w1.signal(signal);
    w1.expect_exit(128 + signal);
    let waiters = cli.waiters("k");
    let pids: Vec<i64> = waiters.iter().filter_map(|w| w["pid"].as_i64()).collect();
    assert_eq!(
        pids,
        [w2.pid() as i64],
        "waiter 1 left its place: {waiters:?}"
    );
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
    wait_until("waiter 2 to get the lock", Duration::from_secs(3), || {
        (!w2.stdout().is_empty()).then_some(())
    });
    w2.signal(libc::SIGTERM);
    w2.expect_exit(0);
    assert!(!cli.exists("w1-ran"));
    cli.assert_all_free("k");
}

/// Three `elect` candidates of election `e` (lease `ttl`), their commands recording
/// `LEASEHOLD_TERM` and `LEASEHOLD_VALUE` and then running until stopped, and a
/// `leader e --watch --json`: one candidate leads at a time; a leader killed with
/// SIGKILL is replaced by the next with a higher term (its command stopped by the
/// watchdog); the watcher prints each leader, in order, terms increasing.
///
/// A leader that loses its lease with nobody killed (renewals starved on a loaded host:
/// a 2 s lease on Redis, beside a build, went 1.3 s without a confirmed renewal) lets
/// another candidate lead, which these rounds do not expect: callers give a lease of
/// a few seconds, as a leader's renewals need on a loaded host.
pub fn candidates_take_over_from_killed_leaders(cli: &Cli, ttl: &str) {
    let mut watch = cli.spawn("watch", &["leader", "e", "--watch", "--json"]);
    let first = watch.wait_for_line("the watcher's first line");
    assert_eq!(
        serde_json::from_str::<Value>(&first).unwrap()["leader"],
        Value::Null,
        "{first}"
    );
    let script = "echo $LEASEHOLD_TERM > term-$LEASEHOLD_VALUE.tmp && \
                  mv term-$LEASEHOLD_VALUE.tmp term-$LEASEHOLD_VALUE && exec sleep 3600";
    let mut candidates: Vec<Proc> = ["a", "b", "c"]
        .iter()
        .map(|value| {
            let args = [
                "elect", "--ttl", ttl, "--value", value, "e", "--", "sh", "-c", script,
            ];
            cli.spawn(value, &args)
        })
        .collect();
    let leading = |cli: &Cli| -> Vec<&str> {
        ["a", "b", "c"]
            .into_iter()
            .filter(|v| cli.exists(&format!("term-{v}")))
            .collect()
    };
    let mut order: Vec<(String, u64)> = Vec::new();
    for round in 0..3 {
        let said = || {
            let said = candidates.iter().zip(["a", "b", "c"]);
            let said = said.map(|(c, v)| format!("candidate {v} said: {}", c.stderr()));
            said.collect::<Vec<_>>().join("\n")
        };
        let now = wait_until_explained(
            "the next leader",
            PATIENCE,
            || {
                let leading = leading(cli);
                (leading.len() == round + 1).then_some(leading)
            },
            said,
        );
        let value = (now.iter())
            .find(|v| !order.iter().any(|(o, _)| o == *v))
            .unwrap()
            .to_string();
        let term: u64 = cli.read(&format!("term-{value}")).trim().parse().unwrap();
        if let Some((_, last)) = order.last() {
            assert!(term > *last, "term {term} after {last}");
        }
        let shown = cli.run(&["leader", "e", "--json"]).expect(0).stdout;
        let shown: Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(shown["leader"]["value"], value.as_str(), "{shown}");
        assert_eq!(shown["leader"]["term"], term, "{shown}");
        order.push((value.clone(), term));
        let seen = format!("\"term\":{term},\"value\":\"{value}\"");
        wait_until("the watcher to show the leader", PATIENCE, || {
            watch.stdout().contains(&seen).then_some(())
        });
        let i = ["a", "b", "c"].iter().position(|v| *v == value).unwrap();
        let signal = if round < 2 {
            libc::SIGKILL
        } else {
            libc::SIGTERM
        };
        candidates[i].signal(signal);
        let what = format!("candidate {value} to end");
        wait_until(&what, PATIENCE, || candidates[i].child.try_wait().unwrap());
    }
    wait_until("the watcher to see no leader", PATIENCE, || {
        watch
            .stdout()
            .ends_with("\"leader\":null,\"name\":\"e\"}\n")
            .then_some(())
    });
    watch.signal(libc::SIGINT);
    watch.expect_exit(0);
    let shown: Vec<(String, u64)> = (watch.stdout().lines())
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .filter(|line| !line["leader"].is_null())
        .map(|line| {
            let leader = &line["leader"];
            let value = leader["value"].as_str().unwrap().to_string();
            (value, leader["term"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(shown, order, "the watcher's leaders, in order");
}
