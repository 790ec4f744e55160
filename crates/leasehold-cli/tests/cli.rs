//! The `leasehold` binary, run for real: exit codes, signals, loss, re-entry, semaphores,
//! shared locks, bad input, mutual exclusion between processes, `status`/`list`/`hold`.
//!
//! Every test has its own store (`--store local:<tempdir>`) and `LEASEHOLD_HOME`, so tests
//! run in parallel. Tests wait for conditions (a file, a printed token, a holder in
//! `status`) with a deadline, never for a fixed time. Spawned processes are killed when
//! their guard drops, also when a test fails.

mod support;

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use leasehold_testkit::{pid_alive, wait_for};
use serde_json::Value;
use support::*;

// ---------------------------------------------------------------------------------------
// Exit codes
// ---------------------------------------------------------------------------------------

#[test]
fn command_exit_status_passes_through() {
    let cli = Cli::new("status-through");
    cli.run(&["run", "k", "--", "sh", "-c", "exit 7"]).expect(7);
    cli.run(&["run", "k", "--", "sh", "-c", "exit 0"]).expect(0);
    cli.run(&["run", "k", "--", "sh", "-c", "exit 255"])
        .expect(255);
    cli.assert_all_free("k");
}

#[test]
fn command_killed_by_signal_exits_128_plus_the_signal() {
    let cli = Cli::new("status-signal");
    cli.run(&["run", "k", "--", "sh", "-c", "kill -KILL $$"])
        .expect(137);
    cli.run(&["run", "k", "--", "sh", "-c", "kill -TERM $$"])
        .expect(143);
    cli.assert_all_free("k");
}

#[test]
fn command_gets_name_token_owner_and_store() {
    let cli = Cli::new("env");
    let out = cli
        .run(&[
            "run",
            "--owner",
            "me-1",
            "job/nightly",
            "--",
            "sh",
            "-c",
            "echo \"$LEASEHOLD_NAME|$LEASEHOLD_TOKEN|$LEASEHOLD_OWNER|$LEASEHOLD_STORE\"",
        ])
        .expect(0);
    let fields: Vec<&str> = out.stdout.trim_end().split('|').collect();
    assert_eq!(fields.len(), 4, "{out:?}");
    assert_eq!(fields[0], "job/nightly");
    assert!(
        fields[1].parse::<u64>().is_ok(),
        "token {:?} is not decimal",
        fields[1]
    );
    assert_eq!(fields[2], "me-1");
    assert_eq!(fields[3], cli.store);
}

#[test]
fn busy_lock_with_no_wait_exits_75_without_running_the_command() {
    let cli = Cli::new("busy-nowait");
    let (holder, _) = cli.hold("holder", &["k"]);
    let out = cli
        .run(&["run", "--no-wait", "k", "--", "touch", "ran"])
        .expect(75);
    assert!(!cli.exists("ran"), "the command ran without the lock");
    assert!(
        out.stderr.contains(&format!("pid {}", holder.pid())) && out.stderr.contains("--no-wait"),
        "stderr should say who holds it: {out:?}"
    );
    // The holder still holds it.
    assert_eq!(cli.holders("k")[0]["pid"], holder.pid());
}

#[test]
fn busy_lock_gives_up_after_wait_with_75() {
    let cli = Cli::new("busy-wait");
    let (_holder, _) = cli.hold("holder", &["k"]);
    let started = Instant::now();
    let out = cli
        .run(&["run", "--wait", "200ms", "k", "--", "touch", "ran"])
        .expect(75);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200),
        "gave up after {waited:?}, before --wait 200ms"
    );
    assert!(!cli.exists("ran"), "the command ran without the lock");
    assert!(
        out.stderr.contains("--wait"),
        "stderr should name --wait: {out:?}"
    );
    assert_eq!(
        cli.waiters("k"),
        Vec::<Value>::new(),
        "the waiter left its place in the queue"
    );
}

#[test]
fn lock_lost_while_running_exits_76() {
    let cli = Cli::new("lost");
    let mut run = cli.spawn(
        "run",
        &[
            "run",
            "--ttl",
            "3s",
            "k",
            "--",
            "sh",
            "-c",
            "touch started; while :; do sleep 0.05; done",
        ],
    );
    cli.wait_file("started");
    cli.run(&["release", "--force", "k"]).expect(0);
    run.expect_exit(76);
    assert!(
        run.stderr().contains("lost"),
        "stderr should say the lock was lost: {}",
        run.stderr()
    );
    cli.assert_all_free("k");
}

#[test]
fn unusable_store_file_exits_69() {
    // The only way to reach "unavailable" without a network store: the lock's file in a
    // valid local store cannot be opened (here it is a directory).
    let cli = Cli::new("unavailable");
    let dir = cli.work.join("store69");
    fs::create_dir_all(dir.join("locks/k.lock")).unwrap();
    let store = format!("local:{}", dir.display());
    let out = Out::from(
        cli.bare(&["--store", &store, "run", "k", "--", "touch", "ran"])
            .output()
            .unwrap(),
    );
    let out = out.expect(69);
    assert!(out.stderr.contains("unavailable"), "{out:?}");
    assert!(!cli.exists("ran"));
}

#[test]
fn command_not_found_exits_127_and_releases() {
    let cli = Cli::new("not-found");
    let out = cli
        .run(&["run", "k", "--", "./no-such-command-here"])
        .expect(127);
    assert!(out.stderr.contains("not found"), "{out:?}");
    cli.assert_all_free("k");
}

#[test]
fn command_not_executable_exits_126_and_releases() {
    let cli = Cli::new("not-exec");
    cli.script("plain-file", "echo hi\n"); // no execute bit: even root cannot exec it
    let out = cli.run(&["run", "k", "--", "./plain-file"]).expect(126);
    assert!(out.stderr.contains("plain-file"), "{out:?}");
    cli.assert_all_free("k");
}

/// A script whose `#!` interpreter is missing exists: exec's "not found" is about the
/// interpreter, so 126 (as a shell says "bad interpreter"), not 127.
#[test]
fn script_with_a_missing_interpreter_exits_126_and_says_so() {
    let cli = Cli::new("bad-interpreter");
    cli.script("job", "#!/no/such/interpreter\necho hi\n");
    let executable = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    fs::set_permissions(cli.path("job"), executable).unwrap();
    let out = cli.run(&["run", "k", "--", "./job"]).expect(126);
    assert!(out.stderr.contains("interpreter"), "{out:?}");
    cli.assert_all_free("k");
}

#[test]
fn release_without_force_exits_64_and_keeps_the_lock() {
    let cli = Cli::new("release-noforce");
    let (mut holder, token) = cli.hold("holder", &["k"]);
    let out = cli.run(&["release", "k"]).expect(64);
    assert!(out.stderr.contains("--force"), "{out:?}");
    let holders = cli.holders("k");
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0]["token"], token);
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
}

// ---------------------------------------------------------------------------------------
// Signals
// ---------------------------------------------------------------------------------------

/// Sends `signal` to `leasehold run`; its command traps it, records that it still held the
/// lock then, and exits `code`; a background grandchild shows the whole group got it.
fn signal_is_forwarded(label: &str, signal: i32, trap: &str, code: i32, grandchild_dies: bool) {
    let cli = Cli::new(label);
    cli.script(
        "child.sh",
        &format!(
            r#"trap 'echo {trap} > got; "$LH" status "$LEASEHOLD_NAME" --json > during.json; exit {code}' {trap}
sleep 1000 &
echo $! > grandchild.pid
echo "$LEASEHOLD_TOKEN" > token
touch ready
while :; do sleep 0.05; done
"#
        ),
    );
    let mut run = cli.spawn("run", &["run", "k", "--", "sh", "child.sh"]);
    cli.wait_file("ready");
    let grandchild = PidGuard(read_pid(&cli, "grandchild.pid"));
    run.signal(signal);
    run.expect_exit(code);
    assert_eq!(
        cli.read("got").trim(),
        trap,
        "the command did not get {trap}"
    );
    // The lock was still held while the command handled the signal...
    let during: Value = serde_json::from_str(&cli.read("during.json")).unwrap();
    let token: u64 = cli.read("token").trim().parse().unwrap();
    assert_eq!(
        during["holders"].as_array().map(Vec::len),
        Some(1),
        "{during}"
    );
    assert_eq!(during["holders"][0]["token"], token, "{during}");
    // ...and is free once it exited.
    cli.assert_all_free("k");
    if grandchild_dies {
        let pid = grandchild.0;
        wait_for("the grandchild to die of the forwarded signal", || {
            !pid_alive(pid)
        });
    }
}

#[test]
fn sigterm_goes_to_the_command_group_and_the_lock_is_released_after() {
    signal_is_forwarded("sigterm", libc::SIGTERM, "TERM", 42, true);
}

#[test]
fn sigint_goes_to_the_command_and_the_lock_is_released_after() {
    // A shell starts background jobs with SIGINT ignored, so no grandchild check here.
    signal_is_forwarded("sigint", libc::SIGINT, "INT", 43, false);
}

#[test]
fn sighup_goes_to_the_command_group_and_the_lock_is_released_after() {
    signal_is_forwarded("sighup", libc::SIGHUP, "HUP", 44, true);
}

#[test]
fn lost_lock_terms_then_kills_the_whole_process_group() {
    let cli = Cli::new("lost-kill");
    // The command records SIGTERM and goes on; its grandchild ignores SIGTERM. Only the
    // SIGKILL after --grace, sent to the group, ends them. (--grace leaves the shell time
    // to run its trap on a loaded machine.)
    cli.script(
        "stubborn.sh",
        r#"trap 'echo TERM >> term.got' TERM
(trap '' TERM; exec sleep 1000) &
echo $! > grandchild.pid
echo $$ > child.pid
while :; do sleep 0.05; done
"#,
    );
    let mut run = cli.spawn(
        "run",
        &[
            "run",
            "--ttl",
            "3s",
            "--grace",
            "2s",
            "k",
            "--",
            "sh",
            "stubborn.sh",
        ],
    );
    let child = PidGuard(read_pid(&cli, "child.pid"));
    let grandchild = PidGuard(read_pid(&cli, "grandchild.pid"));
    assert!(pid_alive(child.0) && pid_alive(grandchild.0));
    cli.run(&["release", "--force", "k"]).expect(0);
    run.expect_exit(76);
    assert!(
        cli.exists("term.got"),
        "the command never got SIGTERM before SIGKILL"
    );
    wait_for("the command to be gone", || !pid_alive(child.0));
    wait_for("the grandchild to be gone", || !pid_alive(grandchild.0));
    cli.assert_all_free("k");
}

/// Bug check: a `leasehold run` waiting for a busy lock must stop waiting on SIGTERM, not
/// swallow it, run the command later and kill it then.
#[test]
fn sigterm_while_waiting_stops_waiting_without_running_the_command() {
    let cli = Cli::new("sigterm-waiting");
    let (_holder, _) = cli.hold("holder", &["k"]);
    let mut waiter = cli.spawn("waiter", &["run", "k", "--", "touch", "ran"]);
    cli.wait_waiters("k", 1);
    waiter.signal(libc::SIGTERM);
    let code = waiter.exit_code();
    assert_ne!(code, 0, "a waiter stopped by SIGTERM must not exit 0");
    assert!(
        !cli.exists("ran"),
        "the command ran although leasehold was told to stop"
    );
    assert_eq!(
        cli.waiters("k"),
        Vec::<Value>::new(),
        "the stopped waiter is still queued"
    );
}

/// Bug check: the same for `hold` while it waits.
#[test]
fn sigint_while_waiting_stops_hold() {
    let cli = Cli::new("sigint-hold-waiting");
    let (_holder, _) = cli.hold("holder", &["k"]);
    let mut waiter = cli.spawn("waiter", &["hold", "k"]);
    cli.wait_waiters("k", 1);
    waiter.signal(libc::SIGINT);
    let code = waiter.exit_code();
    assert_ne!(code, 0, "a waiting hold stopped by SIGINT must not exit 0");
    assert_eq!(
        waiter.stdout(),
        "",
        "it printed a token although it was told to stop"
    );
}

// ---------------------------------------------------------------------------------------
// Re-entry, semaphores, shared locks
// ---------------------------------------------------------------------------------------

#[test]
fn nested_run_of_the_same_name_reenters_with_the_same_token() {
    let cli = Cli::new("nested");
    // Move the token past 1, so a nested run on another store cannot match by chance.
    cli.run(&["run", "k", "--", "true"]).expect(0);
    cli.run(&["run", "k", "--", "true"]).expect(0);
    cli.script(
        "outer.sh",
        r#"echo "$LEASEHOLD_TOKEN" > outer.token
"$LH" run k --no-wait -- sh -c 'echo "$LEASEHOLD_TOKEN"' > inner.token || exit 90
# Control: without what the outer run passes down, the same run is another contender.
env -u LEASEHOLD_OWNER -u LEASEHOLD_HELD "$LH" run k --no-wait -- true
echo $? > stranger.code
"#,
    );
    let out = cli.run(&["run", "k", "--", "sh", "outer.sh"]).expect(0);
    let outer = cli.read("outer.token");
    let inner = cli.read("inner.token");
    assert!(
        outer.trim().parse::<u64>().unwrap() >= 3,
        "outer token {outer:?}; {out:?}"
    );
    assert_eq!(inner, outer, "the nested run saw another token");
    assert_eq!(
        cli.read("stranger.code").trim(),
        "75",
        "a different owner got in"
    );
    cli.assert_all_free("k");
}

/// Holds its permit until `go.$1` appears, leaves `held.$1` and `done.$1`.
const BLOCK: &str = r#"echo "$LEASEHOLD_TOKEN" > held.$1
while [ ! -e go.$1 ]; do sleep 0.05; done
touch done.$1
"#;

#[test]
fn semaphore_admits_two_and_the_third_waits_for_a_permit() {
    let cli = Cli::new("permits");
    cli.script("block.sh", BLOCK);
    let mut one = cli.spawn(
        "one",
        &["run", "--permits", "2", "sem", "--", "sh", "block.sh", "1"],
    );
    let mut two = cli.spawn(
        "two",
        &["run", "--permits", "2", "sem", "--", "sh", "block.sh", "2"],
    );
    cli.wait_file("held.1");
    cli.wait_file("held.2");
    assert_eq!(cli.holders("sem").len(), 2);

    cli.run(&[
        "run",
        "--permits",
        "2",
        "--no-wait",
        "sem",
        "--",
        "touch",
        "ran",
    ])
    .expect(75);
    assert!(!cli.exists("ran"), "a third holder got in with --no-wait");

    // Its command checks that one of the first two was done before it got the permit.
    cli.script(
        "third.sh",
        "if [ -e done.1 ] || [ -e done.2 ]; then touch third.ok; fi\n",
    );
    let mut third = cli.spawn(
        "third",
        &["run", "--permits", "2", "sem", "--", "sh", "third.sh"],
    );
    cli.wait_waiters("sem", 1);
    assert!(!cli.exists("third.ok"));
    cli.touch("go.1");
    one.expect_exit(0);
    third.expect_exit(0);
    assert!(
        cli.exists("third.ok"),
        "the third ran before a permit was free"
    );
    cli.touch("go.2");
    two.expect_exit(0);
    cli.assert_all_free("sem");
}

#[test]
fn shared_readers_hold_together_and_exclude_a_writer() {
    let cli = Cli::new("shared");
    cli.script("block.sh", BLOCK);
    let mut r1 = cli.spawn(
        "r1",
        &["run", "--shared", "rw", "--", "sh", "block.sh", "1"],
    );
    let mut r2 = cli.spawn(
        "r2",
        &["run", "--shared", "rw", "--", "sh", "block.sh", "2"],
    );
    cli.wait_file("held.1");
    cli.wait_file("held.2");
    let holders = cli.holders("rw");
    assert_eq!(holders.len(), 2, "{holders:?}");
    assert!(holders.iter().all(|h| h["kind"] == "shared"), "{holders:?}");

    cli.run(&["run", "--no-wait", "rw", "--", "touch", "ran"])
        .expect(75);
    assert!(!cli.exists("ran"), "a writer got in beside readers");

    cli.script(
        "writer.sh",
        "if [ -e done.1 ] && [ -e done.2 ]; then touch writer.ok; fi\n",
    );
    let mut writer = cli.spawn("writer", &["run", "rw", "--", "sh", "writer.sh"]);
    cli.wait_waiters("rw", 1);
    cli.touch("go.1");
    cli.touch("go.2");
    r1.expect_exit(0);
    r2.expect_exit(0);
    writer.expect_exit(0);
    assert!(
        cli.exists("writer.ok"),
        "the writer ran while a reader held the lock"
    );
    cli.run(&["run", "--no-wait", "rw", "--", "true"]).expect(0);
    cli.assert_all_free("rw");
}

// ---------------------------------------------------------------------------------------
// Bad input: exit 64, a message, nothing run, nothing held
// ---------------------------------------------------------------------------------------

/// Runs `leasehold --store ... run ARGS -- touch ran` (store flags in `args` override it)
/// and checks: exit 64, `message` on stderr, the command did not run, nothing is held.
fn rejects(label: &str, args: &[&str], message: &str) {
    let cli = Cli::new(label);
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "touch", "ran"]);
    let out = cli.run(&all).expect(64);
    assert!(
        out.stderr.contains(message),
        "stderr should contain {message:?}: {out:?}"
    );
    assert!(!cli.exists("ran"), "the command ran despite bad input");
    assert_eq!(
        cli.list(""),
        Vec::<Value>::new(),
        "something is held or awaited"
    );
    assert_eq!(cli.holders("k"), Vec::<Value>::new());
}

#[test]
fn empty_name_is_rejected_with_64() {
    rejects("bad-empty", &[""], "must not be empty");
}

#[test]
fn name_of_257_bytes_is_rejected_with_64() {
    let name = "n".repeat(257);
    rejects("bad-long", &[&name], "257 bytes");
}

#[test]
fn name_with_control_characters_is_rejected_with_64() {
    rejects("bad-ctl-tab", &["a\tb"], "control character");
    rejects("bad-ctl-nl", &["a\nb"], "control character");
    rejects("bad-ctl-esc", &["a\u{1b}[31m"], "control character");
}

#[test]
fn zero_ttl_is_rejected_with_64() {
    rejects("bad-ttl0", &["--ttl", "0s", "k"], "ttl");
}

#[test]
fn century_ttl_is_rejected_with_64() {
    rejects("bad-ttl100y", &["--ttl", "100y", "k"], "ttl");
}

#[test]
fn unparsable_wait_is_rejected_with_64() {
    rejects("bad-wait", &["--wait", "abc", "k"], "--wait");
}

#[test]
fn unparsable_grace_is_rejected_with_64() {
    rejects("bad-grace", &["--grace", "soon", "k"], "--grace");
}

#[test]
fn unknown_store_scheme_is_rejected_with_64() {
    rejects(
        "bad-scheme",
        &["--store", "ftp://x", "k"],
        "unknown store scheme",
    );
}

#[test]
fn no_store_url_error_shows_its_password() {
    let cli = Cli::new("url-secrets");
    for (url, code, said) in [
        ("redis://u:QZ1QZ2@127.0.0.1:1/?bogus=1", 64, "\"bogus\""),
        ("redis://u:QZ1QZ2@127.0.0.1:notaport/0", 64, "notaport"),
        (
            "redis+cluster://u:QZ1QZ2@127.0.0.1:1,,127.0.0.1:2",
            64,
            "empty",
        ),
        (
            "redis://u:QZ1/QZ2?QZ3@127.0.0.1:1/0?replicas=0",
            64,
            "replicas=0",
        ),
        (
            "etcd://127.0.0.1:x?user=u&password=QZ1QZ2",
            64,
            "127.0.0.1:x",
        ),
        ("etcd://127.0.0.1:1?user=u&passwd=QZ1QZ2", 64, "\"passwd\""),
        (
            "etcd://u:QZ1QZ2@127.0.0.1:2379",
            64,
            "?user=NAME&password=SECRET",
        ),
        // Parsed, and nothing listens on port 1.
        ("redis://u:QZ1QZ2@127.0.0.1:1/0", 69, "unavailable"),
        (
            "etcd://127.0.0.1:1?user=u&password=QZ1QZ2",
            69,
            "unavailable",
        ),
    ] {
        let out =
            Out::from(cli.bare(&["status", "x", "--store", url]).output().unwrap()).expect(code);
        assert!(out.stderr.contains(said), "{url}: no {said:?} in {out:?}");
        for piece in ["QZ1", "QZ2", "QZ3"] {
            assert!(!out.stderr.contains(piece), "{url}: {piece} in {out:?}");
        }
    }
}

#[test]
fn local_store_url_with_a_host_is_rejected_with_64_and_the_spellings_that_work() {
    let cli = Cli::new("bad-local-host");
    let out = Out::from(
        cli.bare(&[
            "--store",
            "local://srv/locks",
            "run",
            "k",
            "--",
            "touch",
            "ran",
        ])
        .output()
        .unwrap(),
    )
    .expect(64);
    let said = "write local:/srv/locks or local:///srv/locks";
    assert!(out.stderr.contains(said), "{out:?}");
    assert!(!cli.exists("ran"), "the command ran");
    assert!(
        !cli.exists("srv"),
        "a store was made at the relative path srv/locks"
    );
}

#[test]
fn local_store_url_with_three_slashes_is_an_absolute_directory() {
    let cli = Cli::new("local-abs");
    let dir = cli.work.join("abs-store");
    let url = format!("local://{}", dir.display());
    let (mut hold, _) = {
        let mut cmd = cli.bare(&["--store", &url, "hold", "k"]);
        cmd.current_dir(&cli.home);
        let mut proc = cli.start("hold", cmd);
        let token = proc.wait_for_line("hold to print its token");
        (proc, token)
    };
    // The same lock, seen through the plain spelling from another directory.
    let plain = format!("local:{}", dir.display());
    let out = Out::from(
        cli.bare(&["--store", &plain, "status", "k"])
            .output()
            .unwrap(),
    );
    assert!(out.expect(0).stdout.contains("held"));
    hold.signal(libc::SIGTERM);
    hold.expect_exit(0);
}

#[test]
fn memory_store_is_refused_by_the_commands_that_share_locks_between_processes() {
    let cli = Cli::new("memory-refused");
    for args in [
        &["run", "k", "--", "touch", "ran"][..],
        &["hold", "k"],
        &["status", "k"],
        &["list"],
        &["release", "--force", "k"],
    ] {
        let out = Out::from(
            cli.bare(&[&["--store", "memory:"][..], args].concat())
                .output()
                .unwrap(),
        );
        let out = out.expect(64);
        assert!(
            out.stderr.contains("memory:") && out.stderr.contains("local:"),
            "{args:?}: {out:?}"
        );
        let from_env = cli
            .bare(args)
            .env("LEASEHOLD_STORE", "memory:")
            .output()
            .unwrap();
        Out::from(from_env).expect(64);
    }
    assert!(!cli.exists("ran"), "the command ran on a memory: store");
}

#[test]
fn store_under_a_regular_file_is_rejected_with_64() {
    rejects(
        "bad-store-file",
        &["--store", "local:/etc/hostname/x", "k"],
        "local:/etc/hostname/x",
    );
}

#[test]
fn store_dir_that_is_a_regular_file_is_rejected_with_64() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let store = format!("local:{}", file.path().display());
    rejects("bad-store-is-file", &["--store", &store, "k"], &store);
}

#[test]
fn permits_out_of_range_are_rejected_with_64_and_the_range() {
    for (label, n) in [("bad-permits", "0"), ("huge-permits", "99999999999")] {
        rejects(label, &["--permits", n, "k"], "1 to 100000 permits");
    }
}

#[test]
fn empty_owner_is_rejected_with_64() {
    rejects("bad-owner", &["--owner", "", "k"], "owner");
}

#[test]
fn run_without_a_command_is_rejected_with_64() {
    let cli = Cli::new("bad-nocmd");
    let out = cli.run(&["run", "k"]).expect(64);
    assert!(out.stderr.contains("COMMAND"), "{out:?}");
    assert_eq!(cli.list(""), Vec::<Value>::new());
}

// ---------------------------------------------------------------------------------------
// Mutual exclusion between processes
// ---------------------------------------------------------------------------------------

#[test]
fn concurrent_runs_never_overlap_counter_reaches_80() {
    let cli = Cli::new("mutex");
    fs::write(cli.path("counter"), "0\n").unwrap();
    // The read-sleep-write is a lost update whenever two commands overlap.
    let loop_script = r#"for i in $(seq 20); do
  "$LH" run k -- sh -c 'n=$(cat counter); sleep 0.01; echo $((n+1)) > counter' || exit 1
done
"#;
    let mut loops: Vec<Proc> = (0..4)
        .map(|i| {
            let mut sh = cli.process("sh");
            sh.arg("-c")
                .arg(loop_script)
                .env("LEASEHOLD_STORE", &cli.store);
            cli.start(&format!("loop{i}"), sh)
        })
        .collect();
    for l in &mut loops {
        let code = l.exits_within(Duration::from_secs(180));
        assert_eq!(code, 0, "{} failed; stderr:\n{}", l.label, l.stderr());
    }
    assert_eq!(cli.read("counter").trim(), "80", "runs overlapped");
    cli.assert_all_free("k");
}

// ---------------------------------------------------------------------------------------
// hold, status, list, release
// ---------------------------------------------------------------------------------------

fn hold_is_shown_and_released_on(label: &str, signal: i32) {
    let cli = Cli::new(label);
    let (mut hold, token) = cli.hold("hold", &["app/k"]);
    let status = cli.status("app/k");
    let holders = status["holders"].as_array().expect("holders");
    assert_eq!(holders.len(), 1, "{status}");
    let h = &holders[0];
    assert_eq!(h["token"], token, "{status}");
    assert_eq!(h["pid"], hold.pid(), "{status}");
    assert_eq!(h["kind"], "exclusive", "{status}");
    assert!(
        h["owner"].as_str().is_some_and(|o| !o.is_empty()),
        "{status}"
    );
    assert!(
        h["host"].is_string() && h["since"].is_u64() && h["holds"] == 1,
        "{status}"
    );
    assert!(
        h["lease_left"].as_u64().is_some_and(|ms| ms > 0),
        "{status}"
    );
    assert_eq!(status["name"], "app/k");
    assert!(status["last_token"].as_u64() >= Some(token), "{status}");

    let listed = cli.list("");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["name"], "app/k");
    assert_eq!(listed[0]["holders"][0]["token"], token);
    assert_eq!(cli.list("app/").len(), 1);
    assert_eq!(
        cli.list("other/"),
        Vec::<Value>::new(),
        "PREFIX does not filter"
    );

    hold.signal(signal);
    hold.expect_exit(0);
    cli.assert_all_free("app/k");
}

#[test]
fn hold_prints_token_shows_in_status_and_list_and_sigterm_releases() {
    hold_is_shown_and_released_on("hold-term", libc::SIGTERM);
}

#[test]
fn hold_sigint_releases_and_exits_0() {
    hold_is_shown_and_released_on("hold-int", libc::SIGINT);
}

#[test]
fn hold_tokens_increase() {
    let cli = Cli::new("hold-tokens");
    let (mut first, t1) = cli.hold("first", &["k"]);
    first.signal(libc::SIGTERM);
    first.expect_exit(0);
    let (mut second, t2) = cli.hold("second", &["k"]);
    assert!(t2 > t1, "token {t2} after {t1}");
    second.signal(libc::SIGTERM);
    second.expect_exit(0);
}

#[test]
fn force_release_makes_hold_exit_76() {
    let cli = Cli::new("hold-lost");
    let (mut hold, token) = cli.hold("hold", &["--ttl", "3s", "k"]);
    let out = cli.run(&["release", "--force", "k"]).expect(0);
    assert!(out.stdout.contains(&format!("token {token}")), "{out:?}");
    hold.expect_exit(76);
    cli.assert_all_free("k");
}

#[test]
fn help_lists_the_exit_codes() {
    let cli = Cli::new("help");
    for args in [&["--help"][..], &["run", "--help"][..]] {
        let out = Out::from(cli.bare(args).output().unwrap()).expect(0);
        for code in ["64", "69", "70", "75", "76", "78", "126", "127"] {
            assert!(
                out.stdout.contains(code),
                "`leasehold {args:?}` does not list {code}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Faults on the local store
// ---------------------------------------------------------------------------------------

#[test]
fn holder_killed_with_sigkill_frees_the_lock_long_before_its_lease_ends() {
    // A one-hour lease: only the dead-process reclaim can free it within the test.
    killed_holder_is_taken_over_with_a_higher_token(&Cli::new("kill9"), "1h");
}

/// `leasehold` killed with SIGKILL takes its command's whole process group with it, what
/// the command started included (the kernel's parent-death signal reaches only the
/// command's first process): nothing of the job runs on once the lock is free.
#[test]
fn holder_killed_with_sigkill_takes_what_its_command_started_with_it() {
    let cli = Cli::new("kill9-group");
    let script = "sleep 1000 & echo $! > background.pid; wait";
    let holder = cli.spawn("holder", &["run", "k", "--", "sh", "-c", script]);
    let background = PidGuard(read_pid(&cli, "background.pid"));
    holder.signal(libc::SIGKILL);
    wait_for("the command's background process to be killed", || {
        !pid_alive(background.0)
    });
    cli.run(&["run", "--no-wait", "k", "--", "true"]).expect(0);
    drop(holder);
}

/// `leasehold run` itself stopped (SIGSTOP: a stalled host, a frozen VM), its command
/// not: the watchdog knows the lease's safe deadline and kills the command's group then,
/// so it is gone before the next holder starts. Resumed, `leasehold` finds the lock lost
/// and exits 76. (Before, the command ran on beside the next holder.)
#[test]
fn a_stalled_leasehold_has_its_command_stopped_at_the_safe_deadline() {
    let cli = Cli::new("stalled");
    let script = "echo $$ > child.pid; exec sleep 1000";
    let mut holder = cli.spawn(
        "holder",
        &["run", "--ttl", "2s", "k", "--", "sh", "-c", script],
    );
    let child = PidGuard(read_pid(&cli, "child.pid"));
    holder.signal(libc::SIGSTOP);
    // Once it has the lock: is the first command still running? (A zombie, waiting for
    // the stopped `leasehold` to reap it, is not.)
    let verdict = r#"state=$(cut -d' ' -f3 "/proc/$(cat child.pid)/stat" 2>/dev/null)
        case "$state" in ""|Z) echo gone ;; *) echo "running ($state)" ;; esac > verdict"#;
    cli.run(&["run", "k", "--", "sh", "-c", verdict]).expect(0);
    assert_eq!(cli.read("verdict").trim(), "gone");
    holder.signal(libc::SIGCONT);
    holder.expect_exit(76);
    drop(child);
}

/// After a command that ends normally, `leasehold` exits and leaves alone what the command
/// left running in the background (as `flock` does); only a `leasehold` that dies without
/// exiting has its command's group killed.
#[test]
fn a_normal_exit_leaves_the_commands_background_processes_alone() {
    let cli = Cli::new("leftover");
    let script = "sleep 1000 > /dev/null 2>&1 & echo $! > background.pid";
    let name = "a-lock-only-this-test-uses";
    cli.run(&["run", name, "--", "sh", "-c", script]).expect(0);
    let background = PidGuard(read_pid(&cli, "background.pid"));
    // The watchdog is a fork of `leasehold`, with its command line; once it is gone it
    // can no longer kill anything.
    wait_for("no leasehold process of this test to be left", || {
        processes_whose_command_line_has(name).is_empty()
    });
    assert!(pid_alive(background.0), "the background process was killed");
    drop(background);
}

/// Pids of live processes whose command line contains `text`.
fn processes_whose_command_line_has(text: &str) -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid_alive(pid))
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|line| String::from_utf8_lossy(&line).contains(text))
        })
        .collect()
}

#[test]
fn holder_paused_past_its_ttl_stops_its_command_and_exits_76_when_resumed() {
    paused_holder_loses_the_lock_and_exits_76(&Cli::new("sigstop"));
}

#[test]
fn corrupt_lock_state_gives_a_clear_error_and_runs_nothing() {
    let cli = Cli::new("corrupt");
    cli.run(&["run", "k", "--", "true"]).expect(0);
    let store = cli.store.strip_prefix("local:").unwrap();
    let file = PathBuf::from(store).join("locks/k.lock");
    fs::write(&file, b"this is not a lock record").unwrap();
    let out = cli.run(&["run", "k", "--", "touch", "ran"]).expect(70);
    assert!(
        out.stderr.contains("unreadable state") && out.stderr.contains("k.lock"),
        "{}",
        out.stderr
    );
    assert!(!cli.exists("ran"), "the command ran on a corrupt lock");
    cli.run(&["status", "k"]).expect(70);
    // `list` does not hide it either.
    let out = cli.run(&["list"]).expect(70);
    assert!(out.stderr.contains("k.lock"), "{}", out.stderr);
}

#[test]
fn verbose_run_logs_acquire_and_release_and_very_verbose_each_renewal() {
    let cli = Cli::new("verbose");
    let renewing = ["run", "--ttl", "300ms", "k", "--", "sleep", "0.5"];
    let out = cli.run(&[&["-v"][..], &renewing].concat()).expect(0);
    for event in ["acquired", "released"] {
        assert!(
            out.stderr.contains(event),
            "no {event:?} in -v output: {}",
            out.stderr
        );
    }
    assert!(!out.stderr.contains("renewed"), "-v: {}", out.stderr);
    let out = cli.run(&[&["-vv"][..], &renewing].concat()).expect(0);
    assert!(out.stderr.contains("renewed"), "-vv: {}", out.stderr);
    let quiet = cli.run(&["run", "k", "--", "true"]).expect(0);
    assert!(
        quiet.stderr.is_empty(),
        "output without -v: {}",
        quiet.stderr
    );
}

#[test]
fn waiting_shows_the_holder_on_a_terminal_and_nothing_on_a_pipe() {
    let cli = Cli::new("progress");
    let (_holder, _) = cli.hold("holder", &["--owner", "web-3", "k"]);
    // `script` (util-linux) gives the command a pseudo-terminal.
    let command = format!("{BIN} --store {} run --wait 300ms k -- true", cli.store);
    let mut on_tty = cli.process("script");
    on_tty.args(["-qec", &command, "/dev/null"]);
    let out = Out::from(on_tty.output().expect("run script"));
    assert_eq!(out.code, Some(75), "{out:?}");
    assert!(
        out.stdout.contains("waiting for lock \"k\"; held by web-3"),
        "no progress line on the terminal: {out:?}"
    );
    let piped = cli
        .run(&["run", "--wait", "300ms", "k", "--", "true"])
        .expect(75);
    assert!(
        !piped.stderr.contains("waiting for lock"),
        "{}",
        piped.stderr
    );
    assert!(
        piped.stderr.contains("is held by web-3"),
        "{}",
        piped.stderr
    );
}

#[test]
fn fair_waiters_in_separate_processes_get_the_lock_in_arrival_order() {
    let cli = Cli::new("fifo");
    let (mut holder, _) = cli.hold("holder", &["--fair", "k"]);
    let mut waiters = Vec::new();
    for i in 0..4 {
        let script = format!("echo {i} >> order");
        waiters.push(cli.spawn(
            &format!("w{i}"),
            &["run", "--fair", "k", "--", "sh", "-c", &script],
        ));
        cli.wait_waiters("k", i + 1);
    }
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
    for w in &mut waiters {
        w.expect_exit(0);
    }
    assert_eq!(cli.read("order"), "0\n1\n2\n3\n");
}

#[test]
fn a_waiter_stopped_by_sigint_leaves_the_fair_queue_before_it_exits() {
    let cli = Cli::new("interrupted-waiter");
    interrupted_waiter_leaves_the_queue(&cli, libc::SIGINT, &["--fair"]);
}

/// Runs of another name started in parallel inside a run's command are holders of their
/// own and exclude one another (they used to inherit the outer run's owner, re-enter each
/// other and run together with one token). A run of the outer name still re-enters it,
/// also through a run of another name in between.
#[test]
fn parallel_runs_of_another_name_inside_a_run_exclude_each_other() {
    let cli = Cli::new("nested-names");
    let job = r#"$LH run inner -- sh -c 'echo $LEASEHOLD_TOKEN >> tokens
        mkdir inside 2>/dev/null || echo overlap >> overlaps; sleep 0.2; rmdir inside'"#;
    let jobs = format!("for i in 1 2 3; do {job} & done; wait");
    cli.run(&["run", "outer", "--", "sh", "-c", &jobs])
        .expect(0);
    assert!(!cli.exists("overlaps"), "inner runs overlapped");
    let mut tokens: Vec<String> = cli.read("tokens").lines().map(String::from).collect();
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "inner runs shared a token: {tokens:?}");
    // outer -> other -> outer: the innermost re-enters outer instead of waiting for it.
    let chain = "$LH run other -- $LH run --no-wait outer -- touch reentered";
    cli.run(&["run", "outer", "--", "sh", "-c", chain])
        .expect(0);
    assert!(cli.exists("reentered"));
}

// ---------------------------------------------------------------------------------------
// One way to write durations, flags and help
// ---------------------------------------------------------------------------------------

#[test]
fn bench_takes_durations_as_run_does_and_bare_seconds_still() {
    let cli = Cli::new("bench-durations");
    let help = Out::from(cli.bare(&["bench", "--help"]).output().unwrap()).expect(0);
    for flag in [
        "--ttl <DUR>",
        "--wait <DUR>",
        "--duration <DUR>",
        "--max-seconds <DUR>",
    ] {
        assert!(help.stdout.contains(flag), "no {flag:?} in {}", help.stdout);
    }
    let bench = |extra: &[&str]| {
        let base = ["--store", "memory:", "bench", "--json", "--workload"];
        Out::from(cli.bare(&[&base[..], extra].concat()).output().unwrap())
    };
    let out = bench(&[
        "W1",
        "--ops",
        "5",
        "--ttl",
        "500ms",
        "--wait",
        "2s",
        "--max-seconds",
        "1m",
    ]);
    let line: Value = serde_json::from_str(&out.expect(0).stdout).unwrap();
    assert_eq!(line["params"]["ttl_s"], 0.5);
    assert_eq!(line["params"]["wait_s"], 2.0);
    let out = bench(&["W3", "--workers", "1", "--duration", "0.2", "--ttl", "1"]);
    let line: Value = serde_json::from_str(&out.expect(0).stdout).unwrap();
    assert_eq!(line["params"]["duration_s"], 0.2);
    assert_eq!(line["params"]["ttl_s"], 1.0);
    let out = bench(&["W1", "--ttl", "soon"]).expect(64);
    assert!(out.stderr.contains("give e.g. 30s"), "{out:?}");
}

#[test]
fn flock_short_flags_and_a_chosen_busy_exit_code() {
    let cli = Cli::new("flock-flags");
    let (mut holder, _) = cli.hold("holder", &["k"]);
    // -n: no wait; -E: the busy exit code (0 to skip quietly, as with flock -E 0).
    cli.run(&["run", "-n", "k", "--", "touch", "ran"])
        .expect(75);
    cli.run(&["run", "-n", "-E", "3", "k", "--", "touch", "ran"])
        .expect(3);
    cli.run(&["run", "-n", "-E", "0", "k", "--", "touch", "ran"])
        .expect(0);
    cli.run(&[
        "run",
        "--conflict-exit-code",
        "9",
        "-w",
        "200ms",
        "k",
        "--",
        "touch",
        "ran",
    ])
    .expect(9);
    cli.run(&["hold", "-n", "-E", "4", "k"]).expect(4);
    assert!(!cli.exists("ran"), "a command ran while the lock was busy");
    cli.run(&["run", "-E", "300", "k", "--", "true"]).expect(64);
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
    // -s: readers hold together.
    let (mut reader, _) = cli.hold("reader", &["-s", "r"]);
    cli.run(&["run", "-s", "-n", "r", "--", "touch", "read"])
        .expect(0);
    assert!(cli.exists("read"));
    cli.run(&["run", "-n", "r", "--", "touch", "wrote"])
        .expect(75);
    reader.signal(libc::SIGTERM);
    reader.expect_exit(0);
    let help = Out::from(cli.bare(&["run", "--help"]).output().unwrap()).expect(0);
    for flag in [
        "-n, --no-wait",
        "-w, --wait",
        "-s, --shared",
        "-E, --conflict-exit-code",
    ] {
        assert!(help.stdout.contains(flag), "no {flag:?} in run --help");
    }
}

#[test]
fn run_without_the_double_dash_says_how_to_write_it() {
    let cli = Cli::new("no-dashes");
    let out = cli.run(&["run", "k", "touch", "ran"]).expect(64);
    assert!(
        out.stderr.contains("leasehold run [OPTIONS] NAME -- touch"),
        "{out:?}"
    );
    assert!(!cli.exists("ran"));
}

#[test]
fn the_usage_line_does_not_show_store_as_required_when_leasehold_store_is_set() {
    let cli = Cli::new("usage-env");
    for args in [&["run", "k"][..], &["run"], &["status"]] {
        let out = cli
            .bare(args)
            .env("LEASEHOLD_STORE", &cli.store)
            .output()
            .unwrap();
        let out = Out::from(out).expect(64);
        assert!(out.stderr.contains("Usage: leasehold"), "{out:?}");
        assert!(
            !out.stderr.contains("--store <URL>"),
            "{args:?}: {}",
            out.stderr
        );
    }
    let help = cli
        .bare(&["run", "--help"])
        .env("LEASEHOLD_STORE", &cli.store)
        .output()
        .unwrap();
    let help = Out::from(help).expect(0);
    assert!(help.stdout.contains("LEASEHOLD_STORE"), "{}", help.stdout);
    // The variable still chooses the store.
    let (mut holder, _) = cli.hold("holder", &["k"]);
    let busy = cli
        .bare(&["run", "-n", "k", "--", "true"])
        .env("LEASEHOLD_STORE", &cli.store)
        .output()
        .unwrap();
    Out::from(busy).expect(75);
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
}

#[test]
fn a_loss_says_when_sigkill_really_comes() {
    let cli = Cli::new("lost-when");
    // The command ignores SIGTERM; --grace is longer than what is left of the 1s lease
    // when the lock is force-released, so SIGKILL comes at the safe deadline.
    let script = "trap '' TERM; touch started; while :; do sleep 0.05; done";
    let mut run = cli.spawn(
        "run",
        &[
            "run", "--ttl", "1s", "--grace", "5s", "k", "--", "sh", "-c", script,
        ],
    );
    cli.wait_file("started");
    cli.run(&["release", "--force", "k"]).expect(0);
    run.expect_exit(76);
    let stderr = run.stderr();
    assert!(stderr.contains("at the safe deadline"), "{stderr}");
    assert!(!stderr.contains("after --grace"), "{stderr}");
}

// ---------------------------------------------------------------------------------------
// Completions and the manual
// ---------------------------------------------------------------------------------------

#[test]
fn bash_completions_pass_bash_n_and_every_shell_gets_a_script() {
    let cli = Cli::new("completions");
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = Out::from(cli.bare(&["completions", shell]).output().unwrap()).expect(0);
        for word in ["leasehold", "conflict-exit-code", "status"] {
            assert!(out.stdout.contains(word), "{shell}: no {word:?}");
        }
        fs::write(cli.path(&format!("leasehold.{shell}")), &out.stdout).unwrap();
    }
    let checked = cli
        .process("bash")
        .args(["-n", "leasehold.bash"])
        .output()
        .unwrap();
    Out::from(checked).expect(0);
    cli.run(&["completions", "tcsh"]).expect(64);
}

/// `man -l FILE` in the work directory, formatted for a plain 80-column terminal.
fn man_page(cli: &Cli, file: &str) -> Out {
    let out = cli
        .process("man")
        .args(["-l", file])
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "80")
        .env("LC_ALL", "C.UTF-8")
        .output()
        .expect("man (Debian package man-db; ./scripts/test installs it)");
    Out::from(out).expect(0)
}

#[test]
fn the_manual_renders_with_man_l_for_leasehold_and_each_command() {
    let cli = Cli::new("man");
    let page = Out::from(cli.bare(&["man"]).output().unwrap()).expect(0);
    fs::write(cli.path("leasehold.1"), &page.stdout).unwrap();
    let shown = man_page(&cli, "leasehold.1").stdout;
    for part in [
        "NAME",
        "SYNOPSIS",
        "leasehold-run(1)",
        "Exit status",
        "--store",
    ] {
        assert!(
            shown.contains(part),
            "no {part:?} in leasehold(1):\n{shown}"
        );
    }
    let run = Out::from(cli.bare(&["man", "run"]).output().unwrap()).expect(0);
    fs::write(cli.path("leasehold-run.1"), &run.stdout).unwrap();
    let shown = man_page(&cli, "leasehold-run.1").stdout;
    for part in [
        "leasehold-run",
        "--conflict-exit-code",
        "--grace",
        "LEASEHOLD_TOKEN",
    ] {
        assert!(
            shown.contains(part),
            "no {part:?} in leasehold-run(1):\n{shown}"
        );
    }
    let out = cli.run(&["man", "torture-worker"]).expect(64);
    assert!(out.stderr.contains("run, hold, status"), "{out:?}");
}

/// Output that cannot be written (a full disk here; a reader gone is the same error) is
/// a clean error, exit 70, not a panic, for every command that prints.
#[test]
fn output_that_cannot_be_written_is_an_error_not_a_panic() {
    let cli = Cli::new("full-stdout");
    let commands: [&[&str]; 5] = [
        &["status", "k"],
        &["status", "k", "--json"],
        &["list"],
        &["limit", "k", "--rate", "10/s", "--check"],
        &["completions", "bash"],
    ];
    for args in commands {
        let full = fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = cli.cmd(args).stdout(full).output().expect("run leasehold");
        let out = Out::from(out).expect(70);
        assert!(
            out.stderr.contains("cannot write to standard output")
                && !out.stderr.contains("panicked"),
            "{args:?}: {out:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------

/// The samples of a Prometheus text page: `name{k="v",...}` (labels sorted) to value.
fn scrape(port: u16) -> std::collections::HashMap<String, f64> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut page = String::new();
    conn.read_to_string(&mut page).unwrap();
    let (head, body) = page.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let mut samples = std::collections::HashMap::new();
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').expect("a sample line");
        let key = match series.split_once('{') {
            Some((name, labels)) => {
                let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                labels.sort();
                format!("{name}{{{}}}", labels.join(","))
            }
            None => series.to_string(),
        };
        samples.insert(key, value.parse().unwrap());
    }
    samples
}

/// The key [`scrape`] gives the series `name` of the local store's exclusive locks, with
/// `extra` labels.
fn series(name: &str, extra: &[&str]) -> String {
    let mut labels = vec![r#"kind="exclusive""#, r#"store="local""#];
    labels.extend_from_slice(extra);
    labels.sort();
    format!("{name}{{{}}}", labels.join(","))
}

#[test]
fn run_serves_metrics_while_held_and_after_a_loss() {
    let cli = Cli::new("metrics");
    let port = leasehold_testkit::free_port();
    let addr = format!("127.0.0.1:{port}");
    // The command stays after the loss (it ignores the SIGTERM until told), so the
    // metrics can be read then. A long TTL: no renewal can see the loss before the
    // store's watch does.
    let mut run = cli.spawn(
        "run",
        &[
            "run",
            "--metrics",
            &addr,
            "--ttl",
            "60s",
            "--grace",
            "60s",
            "k",
            "--",
            "sh",
            "-c",
            "trap 'touch lost; while [ ! -f done ]; do sleep 0.05; done; exit 0' TERM; \
             touch started; while :; do sleep 0.05; done",
        ],
    );
    cli.wait_file("started");
    let held = scrape(port);
    let value = |samples: &std::collections::HashMap<String, f64>, key: String| {
        *samples
            .get(&key)
            .unwrap_or_else(|| panic!("no {key} in {samples:?}"))
    };
    assert_eq!(value(&held, series("leasehold_held", &[])), 1.0);
    let acquired = series("leasehold_acquisitions_total", &[r#"outcome="acquired""#]);
    assert_eq!(value(&held, acquired), 1.0);
    assert_eq!(
        value(&held, series("leasehold_wait_seconds_count", &[])),
        1.0
    );
    // A histogram (buckets), as the README lists it, not a summary.
    let all = series("leasehold_wait_seconds_bucket", &[r#"le="+Inf""#]);
    assert_eq!(value(&held, all), 1.0);

    cli.run(&["release", "--force", "k"]).expect(0);
    cli.wait_file("lost");
    let lost = scrape(port);
    let reason = r#"reason="force_released""#;
    assert_eq!(
        value(&lost, series("leasehold_losses_total", &[reason])),
        1.0
    );
    cli.touch("done");
    run.expect_exit(76);
}

#[test]
fn metrics_address_in_use_is_refused_with_64() {
    let cli = Cli::new("metrics-in-use");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = cli.run(&["hold", "--metrics", &addr, "k"]).expect(64);
    assert!(out.stderr.contains("cannot serve metrics"), "{out:?}");
}
