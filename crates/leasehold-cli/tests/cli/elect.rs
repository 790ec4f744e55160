//! `elect` and `leader` on the default (local) store.

use super::*;

#[test]
fn elect_candidates_take_over_from_killed_leaders_and_the_watcher_sees_each() {
    candidates_take_over_from_killed_leaders(&Cli::new("elect"), "15s");
}

#[test]
fn elect_without_a_wait_exits_75_naming_the_leader_and_leader_shows_it() {
    let cli = Cli::new("elect-no-wait");
    let out = cli.run(&["leader", "e"]).expect(0);
    assert_eq!(out.stdout.trim(), "election \"e\": no leader");
    let mut leader = cli.spawn(
        "leader",
        &[
            "elect",
            "--value",
            "10.0.0.7:80",
            "e",
            "--",
            "sh",
            "-c",
            "echo $LEASEHOLD_TERM; exec sleep 3600",
        ],
    );
    let term = leader.wait_for_line("the leader's term");
    let out = cli
        .run(&["elect", "--no-wait", "e", "--", "touch", "ran"])
        .expect(75);
    assert!(
        out.stderr.contains("election \"e\" is led by"),
        "{}",
        out.stderr
    );
    assert!(!cli.exists("ran"));
    let out = cli.run(&["leader", "e"]).expect(0);
    assert!(
        out.stdout
            .contains(&format!("term {term}, value \"10.0.0.7:80\"")),
        "{}",
        out.stdout
    );
    let out = cli
        .run(&["elect", "--no-wait", "-E", "0", "e", "--", "touch", "ran"])
        .expect(0);
    assert!(!cli.exists("ran"), "{}", out.stderr);
    assert_eq!(out.stderr, "", "-E 0 skips quietly");
    // The election is the lock of its name: status shows the leader holding it.
    assert_eq!(cli.holders("e")[0]["value"], "10.0.0.7:80");
    let out = cli.run(&["status", "e"]).expect(0);
    assert!(
        out.stdout.contains("value \"10.0.0.7:80\""),
        "{}",
        out.stdout
    );
    // Deposed: the leader's command is stopped, and the message names the election.
    cli.run(&["release", "--force", "e"]).expect(0);
    leader.expect_exit(76);
    let stderr = leader.stderr();
    assert!(stderr.contains("election \"e\" is lost"), "{stderr}");
    cli.assert_all_free("e");
}

#[test]
fn elect_refuses_flags_of_other_lock_kinds() {
    let cli = Cli::new("elect-flags");
    for flag in ["--permits", "--shared", "--no-fair"] {
        let out = cli.run(&["elect", flag, "e", "--", "true"]).expect(64);
        assert!(out.stderr.contains(flag), "{flag}: {}", out.stderr);
    }
}

/// A name held as a read lock has no leader, and keeps every candidate out: `leader` says
/// both (it said only "no leader", while `elect` said the election was led).
#[test]
fn leader_says_when_a_name_held_otherwise_keeps_candidates_out() {
    let cli = Cli::new("leader-shared");
    let (_reader, _) = cli.hold("reader", &["--shared", "e"]);
    let out = cli.run(&["leader", "e"]).expect(0);
    assert_eq!(
        out.stdout.trim(),
        "election \"e\": no leader; the name is held as a shared lock by 1 holder(s), which keeps candidates out"
    );
    cli.run(&["elect", "--no-wait", "e", "--", "true"])
        .expect(75);
    let json = cli.run(&["leader", "e", "--json"]).expect(0);
    assert_eq!(json.stdout.trim(), r#"{"leader":null,"name":"e"}"#);
}
