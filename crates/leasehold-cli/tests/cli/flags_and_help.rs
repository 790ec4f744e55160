//! One way to write durations, flags and help.

use super::*;

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
    let skipped = cli
        .run(&["run", "-n", "-E", "0", "k", "--", "touch", "ran"])
        .expect(0);
    assert_eq!(skipped.stderr, "", "-E 0 skips quietly");
    let skipped = cli
        .run(&["run", "-n", "-E", "0", "--json", "k", "--", "touch", "ran"])
        .expect(0);
    assert!(
        skipped.stderr.contains("\"kind\":\"not_acquired\""),
        "{skipped:?}"
    );
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
