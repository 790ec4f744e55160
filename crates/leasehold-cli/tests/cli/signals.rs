//! Signals.

use super::*;

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
