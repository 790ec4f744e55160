//! The `leasehold` binary against real etcd: exit codes for an unreachable or refusing
//! store, and faults — a holder killed or paused past its lease, members and the leader
//! of a 3-member cluster killed under a holder and waiters, many processes on one lock.

mod support;

use leasehold_testkit::{free_port, wait_for, EtcdCluster, EtcdServer};
use support::*;

fn world(label: &str, server: &EtcdServer) -> Cli {
    Cli::with_store(label, Some(server.url()))
}

/// Each run appends "start I" and "end I" around its critical section; returns the runs'
/// indexes in the order they held the lock, failing on any overlap.
fn served_in_turn(log: &str) -> Vec<usize> {
    let mut order = Vec::new();
    let mut inside: Option<&str> = None;
    for line in log.lines() {
        match line.split_once(' ') {
            Some(("start", who)) => {
                assert!(inside.is_none(), "two holders at once:\n{log}");
                inside = Some(who);
                order.push(who.parse().unwrap());
            }
            Some(("end", who)) => {
                assert_eq!(inside, Some(who), "an end without its start:\n{log}");
                inside = None;
            }
            _ => panic!("unexpected log line {line:?}:\n{log}"),
        }
    }
    order
}

/// `status` names the etcd issue a member of the running version is exposed to (leases
/// kept alive revoked by a resumed leader: etcd issue 15247, fixed in 3.4.31 and 3.5.13),
/// and says nothing of a version with the fix.
#[test]
fn status_says_when_the_etcd_version_can_revoke_leases_kept_alive() {
    let server = EtcdServer::start();
    let cli = world("etcd-caveat", &server);
    let out = std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .expect("etcd --version");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let version = (text.lines())
        .find_map(|l| l.strip_prefix("etcd Version: "))
        .unwrap_or_else(|| panic!("no version in {text:?}"))
        .trim()
        .to_string();
    let number = |i: usize| -> u64 {
        let part = version.split(['.', '-']).nth(i);
        part.and_then(|p| p.parse().ok()).unwrap_or(0)
    };
    let affected = match (number(0), number(1)) {
        (3, 4) => number(2) < 31,
        (3, 5) => number(2) < 13,
        (major, minor) => (major, minor) < (3, 4),
    };
    let caveat = cli.status("k")["store_caveat"].clone();
    if affected {
        let caveat = caveat.as_str().unwrap_or_default();
        assert!(
            caveat.contains(&version) && caveat.contains("15247"),
            "{caveat:?}"
        );
        let out = cli.run(&["status", "k"]).expect(0);
        assert!(out.stdout.contains("store: etcd "), "{out:?}");
    } else {
        assert!(caveat.is_null(), "etcd {version}: {caveat}");
    }
}

#[test]
fn unreachable_etcd_exits_69_with_the_address() {
    let url = format!("etcd://127.0.0.1:{}", free_port());
    let cli = Cli::with_store("etcd-unreachable", Some(url.clone()));
    let out = cli.run(&["run", "k", "--", "touch", "ran"]).expect(69);
    assert!(
        out.stderr.contains("unavailable") && out.stderr.contains(&url[7..]),
        "{}",
        out.stderr
    );
    assert!(!cli.exists("ran"));
}

#[test]
fn wrong_etcd_password_exits_78_without_showing_it() {
    let server = EtcdServer::start();
    server.etcdctl(&["user", "add", "root:right-secret"]);
    let enabled = server.etcdctl(&["auth", "enable"]);
    assert!(enabled.contains("Enabled"), "auth enable said {enabled:?}");
    let url = format!("{}?user=root&password=wrong-secret", server.url());
    let out = Cli::with_store("etcd-auth", Some(url))
        .run(&["run", "k", "--", "true"])
        .expect(78);
    assert!(out.stderr.contains("authentication"), "{}", out.stderr);
    assert!(
        !out.stderr.contains("wrong-secret"),
        "the password leaked: {}",
        out.stderr
    );
    let good = format!("{}?user=root&password=right-secret", server.url());
    let cli = Cli::with_store("etcd-auth-ok", Some(good));
    cli.run(&["run", "k", "--", "touch", "ran"]).expect(0);
    assert!(cli.exists("ran"));
}

#[test]
fn bad_etcd_urls_are_rejected_with_64() {
    for url in [
        "etcd://",
        "etcd://host-without-port",
        "etcd://127.0.0.1:2379?user=only",
        "etcd://127.0.0.1:2379?timeout=1s",
    ] {
        let out = Cli::with_store("etcd-bad-url", Some(url.into()))
            .run(&["run", "k", "--", "true"])
            .expect(64);
        assert!(
            out.stderr.contains("invalid store"),
            "{url}: {}",
            out.stderr
        );
    }
}

#[test]
fn etcd_holder_killed_with_sigkill_frees_the_lock_within_its_ttl() {
    let server = EtcdServer::start();
    killed_holder_is_taken_over_with_a_higher_token(&world("etcd-kill9", &server), "1s");
}

#[test]
fn etcd_holder_paused_past_its_ttl_stops_its_command_and_exits_76() {
    let server = EtcdServer::start();
    paused_holder_loses_the_lock_and_exits_76(&world("etcd-sigstop", &server));
}

/// 32 processes queue on one lock (fair, etcd's default) in a known order: each is
/// served once, in that order, and the counter they share loses no update.
#[test]
fn thirty_two_processes_on_one_etcd_lock_are_served_in_order_and_lose_no_update() {
    let server = EtcdServer::start();
    let cli = world("etcd-fifo", &server);
    std::fs::write(cli.path("counter"), "0\n").unwrap();
    let (mut holder, _) = cli.hold("holder", &["k"]);
    let mut runs = Vec::new();
    for i in 0..32 {
        let body = format!(
            "echo start {i} >> log; n=$(cat counter); echo $((n+1)) > counter; echo end {i} >> log"
        );
        runs.push(cli.spawn(
            &format!("run{i}"),
            &["run", "--wait", "120s", "k", "--", "sh", "-c", &body],
        ));
        cli.wait_waiters("k", i + 1);
    }
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
    for run in &mut runs {
        run.expect_exit(0);
    }
    assert_eq!(cli.read("counter").trim(), "32");
    assert_eq!(
        served_in_turn(&cli.read("log")),
        (0..32).collect::<Vec<_>>()
    );
}

/// The same with everyone arriving at once, three times each, fair and non-fair.
#[test]
fn thirty_two_processes_racing_on_one_etcd_lock_lose_no_update() {
    let server = EtcdServer::start();
    let cli = world("etcd-counter", &server);
    cli.script(
        "worker.sh",
        r#"for i in 1 2 3; do
  "$LH" --store "$STORE" run $FAIRNESS --wait 120s k -- sh -c 'n=$(cat counter); echo $((n+1)) > counter' || exit 1
done
"#,
    );
    std::fs::write(cli.path("counter"), "0\n").unwrap();
    let mut workers = Vec::new();
    for i in 0..32 {
        let mut cmd = cli.process("sh");
        let fairness = if i % 2 == 0 { "--fair" } else { "--no-fair" };
        cmd.arg("worker.sh")
            .env("STORE", &cli.store)
            .env("FAIRNESS", fairness);
        workers.push(cli.start(&format!("w{i}"), cmd));
    }
    for w in &mut workers {
        w.expect_exit(0);
    }
    assert_eq!(cli.read("counter").trim(), "96");
}

/// In a 3-member cluster, the member the clients talk to first is killed, brought back,
/// and then the leader is killed, all while one process holds the lock and three wait:
/// the holder keeps it (its command is not stopped), the waiters are served in the order
/// they queued, and never two at once.
#[test]
fn etcd_cluster_survives_losing_the_first_member_and_then_the_leader() {
    let mut cluster = EtcdCluster::start();
    let cli = Cli::with_store("etcd-cluster", Some(cluster.url()));
    let body = |i: usize| {
        format!(
            "echo start {i} >> log; while [ ! -e go{i} ]; do sleep 0.05; done; echo end {i} >> log"
        )
    };
    // A renewal sent while the cluster has no leader waits on a member for up to its call
    // timeout (3s) before the next member is tried. The CLI stops the command when the
    // safe deadline is that near without a renewal (--grace, at most a third of the TTL):
    // a renewal due at a third of the TTL then has 8s to succeed with a 20s TTL (two call
    // timeouts), and under 3s with 8s.
    let run = |i: usize| {
        cli.spawn(
            &format!("run{i}"),
            &[
                "run",
                "--ttl",
                "20s",
                "--wait",
                "120s",
                "k",
                "--",
                "sh",
                "-c",
                &body(i),
            ],
        )
    };
    let mut runs = vec![run(0)];
    cli.wait_file("log");
    for i in 1..4 {
        runs.push(run(i));
        cli.wait_waiters("k", i);
    }
    cluster.members[0].kill();
    cluster.wait_for_leader();
    cluster.members[0].restart();
    wait_for("the restarted member to be healthy", || {
        cluster.members[0].healthy()
    });
    let leader = cluster.wait_for_leader();
    cluster.members[leader].kill();
    let next_leader = cluster.wait_for_leader();
    assert_ne!(leader, next_leader);
    // The holder still holds after both losses: every run may finish now, in turn.
    for i in 0..4 {
        cli.touch(&format!("go{i}"));
    }
    for run in &mut runs {
        let code = run.exits_within(leasehold_testkit::PATIENCE * 2);
        assert_eq!(code, 0, "{} exited {code}: {}", run.label, run.stderr());
    }
    assert_eq!(served_in_turn(&cli.read("log")), vec![0, 1, 2, 3]);
}

#[test]
fn a_waiter_stopped_by_sigint_leaves_the_etcd_queue_before_it_exits() {
    let server = EtcdServer::start();
    let cli = world("etcd-interrupted-waiter", &server);
    interrupted_waiter_leaves_the_queue(&cli, libc::SIGINT, &[]);
}

#[test]
fn a_waiter_stopped_by_sigterm_leaves_the_etcd_queue_before_it_exits() {
    let server = EtcdServer::start();
    let cli = world("etcd-terminated-waiter", &server);
    interrupted_waiter_leaves_the_queue(&cli, libc::SIGTERM, &[]);
}

#[test]
fn etcd_elect_candidates_take_over_from_killed_leaders_and_the_watcher_sees_each() {
    let server = EtcdServer::start();
    candidates_take_over_from_killed_leaders(&world("etcd-elect", &server), "4s");
}

/// `bench` ends by shedding what its run left in etcd (the spare leases its locks
/// reused): none of them stays behind until its TTL.
#[test]
fn a_bench_on_etcd_leaves_no_lease_behind() {
    let server = EtcdServer::start();
    let cli = world("etcd-bench-leases", &server);
    cli.run(&[
        "bench",
        "--workload",
        "W3",
        "--workers",
        "4",
        "--duration",
        "1s",
    ])
    .expect(0);
    let leases = server.etcdctl(&["lease", "list"]);
    assert!(leases.starts_with("found 0 leases"), "{leases}");
}

/// The member listed first is paused (a follower, so the cluster keeps its leader):
/// `run --no-wait` takes the lock through another member, and the release after the
/// command reaches one, so the lock is free once `run` exits. (The first waited 3 s on the
/// paused member and exited 69 at its 2 s bound; the release gave up after 1 s and left
/// the lock to its lease.)
#[test]
fn a_paused_first_member_is_passed_by_no_wait_runs_and_releases() {
    let cluster = EtcdCluster::start();
    let leader = cluster.wait_for_leader();
    let first = (leader + 1) % cluster.members.len();
    let order = [first, (first + 1) % 3, (first + 2) % 3];
    let endpoints: Vec<String> = order
        .iter()
        .map(|&i| cluster.members[i].endpoint())
        .collect();
    let cli = Cli::with_store(
        "etcd-paused-first",
        Some(format!("etcd://{}", endpoints.join(","))),
    );
    cluster.members[first].pause();
    cli.run(&["run", "--no-wait", "k", "--", "true"]).expect(0);
    let status = cli.status("k");
    assert_eq!(
        status["holders"].as_array().map(Vec::len),
        Some(0),
        "{status}"
    );
    cluster.members[first].resume();
}
