//! Exit codes.

use super::*;

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

/// A command that is not there is refused before the lock is asked for: 127 even while
/// another holds it (not 75), and nothing is taken.
#[test]
fn command_not_found_exits_127_before_the_lock_is_asked_for() {
    let cli = Cli::new("not-found");
    let out = cli
        .run(&["run", "k", "--", "./no-such-command-here"])
        .expect(127);
    assert!(out.stderr.contains("not found"), "{out:?}");
    cli.assert_all_free("k");
    let (mut holder, _) = cli.hold("holder", &["k"]);
    cli.run(&["run", "--no-wait", "k", "--", "no-such-command-here"])
        .expect(127);
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
}

/// A file that may not be executed, or a directory, is refused as a shell refuses it
/// (126), and before the lock is asked for: at once while another holds it. An empty
/// name is not found (127), and says so.
#[test]
fn command_not_executable_exits_126_before_the_lock_is_asked_for() {
    let cli = Cli::new("not-exec");
    cli.script("plain-file", "echo hi\n"); // no execute bit: even root cannot exec it
    let out = cli.run(&["run", "k", "--", "./plain-file"]).expect(126);
    assert!(
        out.stderr.contains("plain-file") && out.stderr.contains("permission denied"),
        "{out:?}"
    );
    cli.assert_all_free("k");
    let (mut holder, _) = cli.hold("holder", &["k"]);
    for (command, code, says) in [
        ("./plain-file", 126, "permission denied"),
        ("/tmp", 126, "is a directory"),
        ("", 127, "an empty name"),
    ] {
        // No --wait: refused before waiting for the holder.
        let out = cli.run(&["run", "k", "--", command]).expect(code);
        assert!(out.stderr.contains(says), "{command:?}: {out:?}");
    }
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
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
