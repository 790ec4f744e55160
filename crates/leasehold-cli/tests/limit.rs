//! `leasehold limit`, run for real: decisions and their exit codes, the refusal message,
//! the command's own status, bad input, processes spaced by the limiter, and Redis.

mod support;

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use leasehold_testkit::{RedisServer, PATIENCE};
use serde_json::Value;
use support::*;

fn check(cli: &Cli, args: &[&str], code: i32) -> Value {
    let mut all = vec!["limit", "api", "--check", "--json"];
    all.extend_from_slice(args);
    let out = cli.run(&all).expect(code);
    serde_json::from_str(out.stdout.trim()).unwrap_or_else(|e| panic!("--json: {e}: {out:?}"))
}

#[test]
fn check_takes_units_until_the_burst_is_spent_then_exits_75_with_the_wait() {
    let cli = Cli::new("limit-check");
    let rate = ["--rate", "1/h", "--burst", "3"];
    let first = check(&cli, &rate, 0);
    assert_eq!(first["allowed"], true);
    assert_eq!(first["remaining"], 2);
    assert_eq!(first["burst"], 3);
    assert_eq!(first["rate"], "1/h");
    assert_eq!(
        check(&cli, &[&rate[..], &["--cost", "2"]].concat(), 0)["remaining"],
        0
    );
    let refused = check(&cli, &rate, 75);
    assert_eq!(refused["allowed"], false);
    let wait_ms = refused["wait_ms"].as_f64().unwrap();
    assert!(wait_ms > 3_500_000.0 && wait_ms <= 3_600_000.0, "{refused}");
    // To the µs: at most three decimals as printed.
    for field in ["wait_ms", "reset_after_ms"] {
        let text = refused[field].to_string();
        let decimals = text.split_once('.').map_or(0, |(_, d)| d.len());
        assert!(decimals <= 3, "{field}: {refused}");
    }
    // Text form.
    let out = cli
        .run(&["limit", "api", "--rate", "1/h", "--burst", "3", "--check"])
        .expect(75);
    assert!(
        out.stdout
            .contains("api: refused; 1 unit would be allowed in"),
        "{out:?}"
    );
}

#[test]
fn no_wait_or_a_short_wait_exits_75_at_once_saying_how_long_it_would_take() {
    let cli = Cli::new("limit-refused");
    cli.run(&["limit", "api", "--rate", "1/m", "--", "touch", "first"])
        .expect(0);
    assert!(cli.exists("first"));
    let started = Instant::now();
    // The short flags are `run`'s: -n, -w.
    for flags in [
        &["--no-wait"][..],
        &["--wait", "2s"],
        &["-n"],
        &["-w", "2s"],
    ] {
        let mut args = vec!["limit", "api", "--rate", "1/m"];
        args.extend_from_slice(flags);
        args.extend_from_slice(&["--", "touch", "second"]);
        let out = cli.run(&args).expect(75);
        assert!(
            out.stderr.contains("1 unit would be allowed in")
                && out.stderr.contains("gave up at once"),
            "{out:?}"
        );
    }
    assert!(!cli.exists("second"));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a refusal waited"
    );
}

#[test]
fn the_command_runs_in_place_of_leasehold_with_its_own_exit_status() {
    let cli = Cli::new("limit-status");
    cli.run(&[
        "limit", "api", "--rate", "100/s", "--", "sh", "-c", "exit 7",
    ])
    .expect(7);
    // It is the command that dies of the signal: leasehold is gone, replaced by it.
    let status = cli
        .cmd(&[
            "limit",
            "api",
            "--rate",
            "100/s",
            "--",
            "sh",
            "-c",
            "kill -TERM $$",
        ])
        .status()
        .unwrap();
    assert_eq!(status.signal(), Some(15), "{status:?}");
    let out = cli
        .run(&[
            "limit",
            "api",
            "--rate",
            "100/s",
            "--",
            "no-such-command-here",
        ])
        .expect(127);
    assert!(out.stderr.contains("command not found"), "{out:?}");
}

/// On a terminal (`script(1)` gives it one) a wait shows its turn coming, then the
/// command runs; the line is cleared first.
#[test]
fn a_wait_on_a_terminal_counts_down_to_its_turn() {
    let cli = Cli::new("limit-countdown");
    // Five seconds apart: the second run waits, however slowly it starts.
    let rate = "--rate 1/5s --burst 1";
    cli.run(&[
        "limit", "api", "--rate", "1/5s", "--burst", "1", "--", "true",
    ])
    .expect(0);
    let line = format!(
        "\"$LH\" --store '{}' limit api {rate} -- touch ran",
        cli.store
    );
    let out = Out::from(
        cli.process("script")
            .args(["-qec", &line, "/dev/null"])
            .output()
            .expect("run script(1)"),
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout
            .contains("waiting for rate limiter \"api\" (1/5s): 1 unit in"),
        "{out:?}"
    );
    assert!(
        out.stdout.contains("\r\x1b[K"),
        "the line is cleared: {out:?}"
    );
    assert!(cli.exists("ran"));
}

/// A mistyped command spends nothing: 127 (126 for a file that may not be executed)
/// before the units are taken, so the next run of the one-unit limiter still passes.
#[test]
fn a_missing_command_exits_127_without_taking_units() {
    let cli = Cli::new("limit-missing");
    let rate = ["limit", "once", "--rate", "1/h"];
    let out = cli
        .run(&[&rate[..], &["--", "no-such-command-here"]].concat())
        .expect(127);
    assert!(out.stderr.contains("command not found"), "{out:?}");
    // Nor does a file that may not be executed (126).
    cli.script("plain-file", "echo hi\n");
    cli.run(&[&rate[..], &["--", "./plain-file"]].concat())
        .expect(126);
    cli.run(&[&rate[..], &["--", "touch", "ran"]].concat())
        .expect(0);
    assert!(cli.exists("ran"));
}

/// `memory:` lives in one process: each `leasehold limit` would have a limiter of its
/// own and limit nothing, so it is refused (64), as `run` refuses it.
#[test]
fn the_memory_store_is_refused_as_it_would_limit_nothing() {
    let cli = Cli::with_store("limit-memory", Some("memory:".to_string()));
    for args in [&["--", "touch", "ran"][..], &["--check"]] {
        let out = cli
            .run(&[&["limit", "api", "--rate", "1/h"][..], args].concat())
            .expect(64);
        assert!(out.stderr.contains("limit nothing"), "{out:?}");
    }
    assert!(!cli.exists("ran"));
}

#[test]
fn bad_rates_bursts_and_costs_exit_64_naming_the_rule() {
    let cli = Cli::new("limit-bad");
    for (args, says) in [
        (&["--rate", "0/s"][..], "lets nothing through"),
        (&["--rate", "10"], "COUNT/PERIOD"),
        (&["--rate", "10/fortnight"], "period unit"),
        (&["--rate", "5000000/s"], "microsecond"),
        (&["--rate", "1/d", "--burst", "400"], "366 days"),
        (&["--rate", "10/s", "--burst", "0"], "1 or more"),
        (
            &["--rate", "10/s", "--burst", "2", "--cost", "3"],
            "more than the burst",
        ),
        (&["--rate", "10/s", "--cost", "-1"], "1 or more"),
        (
            &["--rate", "10/s", "--burst", "99999999999999999999"],
            "too many units",
        ),
        (&["--rate", "1/367d"], "1/367d"),
    ] {
        let mut all = vec!["limit", "api", "--check"];
        all.extend_from_slice(args);
        let out = cli.run(&all).expect(64);
        assert!(out.stderr.contains(says), "{args:?}: {out:?}");
    }
    // A command or --check, not neither.
    cli.run(&["limit", "api", "--rate", "1/s"]).expect(64);
}

#[test]
fn processes_asking_at_once_are_spaced_by_the_rate() {
    let cli = Cli::new("limit-spaced");
    // 10/s with a burst of 2: six processes asking at once cannot all have run before
    // four more intervals (400 ms) have passed since the first ask.
    let started = Instant::now();
    let mut procs: Vec<Proc> = (0..6)
        .map(|i| {
            let name = format!("ran-{i}");
            cli.spawn(
                &format!("p{i}"),
                &[
                    "limit", "api", "--rate", "10/s", "--burst", "2", "--", "touch", &name,
                ],
            )
        })
        .collect();
    for p in &mut procs {
        assert_eq!(p.exits_within(PATIENCE), 0);
    }
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
    for i in 0..6 {
        assert!(cli.exists(&format!("ran-{i}")));
    }
}

#[test]
fn redis_keeps_one_limiter_for_all_processes_its_key_expiring_when_back_to_full() {
    let server = RedisServer::start();
    let cli = Cli::with_store("limit-redis", Some(server.url()));
    let rate = ["--rate", "1/h", "--burst", "2"];
    assert_eq!(check(&cli, &rate, 0)["remaining"], 1);
    assert_eq!(check(&cli, &rate, 0)["remaining"], 0);
    assert_eq!(check(&cli, &rate, 75)["allowed"], false);
    let pttl: i64 = server
        .cli(&["PTTL", "lh:rate:{api}"])
        .trim()
        .parse()
        .unwrap();
    assert!(pttl > 7_000_000 && pttl <= 7_200_000, "{pttl}");
}

#[test]
fn bench_prints_one_ratebench_line_per_rate_workload_within_the_bound() {
    let cli = Cli::new("limit-bench");
    for workload in ["R1", "R3", "R4"] {
        let out = cli
            .run(&[
                "bench",
                "--json",
                "--workload",
                workload,
                "--duration",
                "1",
                "--workers",
                "4",
                "--rate",
                "200",
                "--burst",
                "20",
                "--wait",
                "0.5",
                "--key-prefix",
                "t",
            ])
            .expect(0);
        let line: Value = serde_json::from_str(out.stdout.trim()).unwrap();
        assert_eq!(line["schema"], "ratebench.v1");
        assert_eq!(line["workload"], workload);
        assert_eq!(line["algorithm"], "gcra");
        assert_eq!(line["errors"], 0);
        // GCRA's bound, by the harness's lower-bound count: rate + burst in any second.
        assert!(line["max_allowed_1s"].as_u64().unwrap() <= 220, "{line}");
        assert!(line["allowed"].as_u64().unwrap() >= 20, "{line}");
    }
    let out = cli
        .run(&[
            "bench",
            "--json",
            "--workload",
            "R2",
            "--duration",
            "1",
            "--key-prefix",
            "t",
        ])
        .expect(0);
    let line: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(line["keys"], 8);
    assert!(line["max_allowed_1s"].is_null());
    cli.run(&["bench", "--workload", "R5"]).expect(64);
}

#[test]
fn an_unreachable_store_exits_69_and_does_not_run_the_command() {
    let url = format!("redis://127.0.0.1:{}/0", leasehold_testkit::free_port());
    let cli = Cli::with_store("limit-unreachable", Some(url));
    let out = cli
        .run(&["limit", "api", "--rate", "1/s", "--", "touch", "ran"])
        .expect(69);
    assert!(out.stderr.contains("unavailable"), "{out:?}");
    assert!(!cli.exists("ran"));
}

/// Up or down, etcd has no rate limiters: 64, before any connect.
#[test]
fn etcd_has_no_rate_limiters_and_says_so_with_64() {
    let server = leasehold_testkit::EtcdServer::start();
    let down = "etcd://127.0.0.1:1".to_string();
    for (case, url) in [("up", server.url()), ("down", down)] {
        let cli = Cli::with_store(&format!("limit-etcd-{case}"), Some(url));
        for args in [&["--", "touch", "ran"][..], &["--check"]] {
            let out = cli
                .run(&[&["limit", "api", "--rate", "1/s"][..], args].concat())
                .expect(64);
            assert!(
                out.stderr.contains("does not offer rate limiters"),
                "{case}: {out:?}"
            );
        }
        assert!(!cli.exists("ran"));
    }
}

/// A store that does not answer (a paused Redis) cannot stretch `--no-wait`, `--check`
/// or `--wait` by the client's connect and response timeouts: exit 69 saying so, and
/// the command does not run. (Without the bound: 9.5 s whatever the flags.)
#[test]
fn a_paused_redis_cannot_stretch_a_bounded_limit() {
    let server = RedisServer::start();
    let cli = Cli::with_store("limit-paused", Some(server.url()));
    server.pause();
    let out = cli.run(&[
        "limit",
        "p",
        "--rate",
        "10/s",
        "--no-wait",
        "--",
        "touch",
        "ran",
    ]);
    let out = out.expect(69);
    assert!(
        out.stderr.contains("did not answer within 2s to connect"),
        "{out:?}"
    );
    let out = cli
        .run(&["limit", "p", "--rate", "10/s", "--check"])
        .expect(69);
    assert!(out.stderr.contains("did not answer within"), "{out:?}");
    let out = cli.run(&[
        "limit", "p", "--rate", "10/s", "--wait", "1s", "--", "touch", "ran",
    ]);
    let out = out.expect(69);
    assert!(
        out.stderr
            .contains("did not answer within the --wait of 1s"),
        "{out:?}"
    );
    server.resume();
    assert!(!cli.exists("ran"));
}
