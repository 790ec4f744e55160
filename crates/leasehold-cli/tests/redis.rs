//! The `leasehold` binary against a real redis-server (one per test): exit codes for an
//! unreachable or refusing store, and faults — a holder killed or paused past its lease,
//! the server restarted under holders and waiters, many processes on one lock.

mod support;

use leasehold_testkit::{free_port, pid_alive, wait_for, RedisServer};
use support::*;

fn world(label: &str, server: &RedisServer) -> Cli {
    Cli::with_store(label, Some(server.url()))
}

#[test]
fn unreachable_redis_exits_69_with_the_address() {
    let url = format!("redis://127.0.0.1:{}/0", free_port());
    let cli = Cli::with_store("redis-unreachable", Some(url.clone()));
    let out = cli.run(&["run", "k", "--", "touch", "ran"]).expect(69);
    assert!(
        out.stderr.contains("unavailable") && out.stderr.contains(&url[8..]),
        "{}",
        out.stderr
    );
    assert!(!cli.exists("ran"));
}

/// A redis:// URL that points at another service (here one that answers in HTTP) is a
/// configuration error, said in words, not a parser's message or a retryable outage.
#[test]
fn a_server_that_is_not_redis_exits_78_saying_so() {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
            // Kept open, so that what the client meets is the answer, not an EOF.
            std::mem::forget(conn);
        }
    });
    let url = format!("redis://127.0.0.1:{port}/0");
    refused_as_configuration("redis-not-redis", url, "does not answer as Redis does");
}

/// `run` at `url` exits 78 saying `says`, and runs nothing.
fn refused_as_configuration(label: &str, url: String, says: &str) {
    let cli = Cli::with_store(label, Some(url));
    let out = cli.run(&["run", "k", "--", "touch", "ran"]).expect(78);
    assert!(out.stderr.contains(says), "{}", out.stderr);
    assert!(!cli.exists("ran"));
}

/// A redis+cluster:// URL at a server that is not a cluster node: a configuration error.
#[test]
fn a_cluster_url_at_a_single_server_exits_78_saying_so() {
    let server = RedisServer::start();
    let url = format!("redis+cluster://127.0.0.1:{}", server.port());
    refused_as_configuration("redis-not-cluster", url, "not a Redis Cluster node");
}

#[test]
fn wrong_redis_password_or_database_exits_78_without_showing_it() {
    let server = RedisServer::start_with(&["--save", "", "--requirepass", "right-secret"]);
    let url = format!("redis://:wrong-secret@127.0.0.1:{}/0", server.port());
    let cli = Cli::with_store("redis-auth", Some(url));
    let out = cli.run(&["run", "k", "--", "true"]).expect(78);
    assert!(out.stderr.contains("password"), "{}", out.stderr);
    assert!(
        !out.stderr.contains("wrong-secret"),
        "the password leaked: {}",
        out.stderr
    );
    let good = format!("redis://:right-secret@127.0.0.1:{}/0", server.port());
    Cli::with_store("redis-auth-ok", Some(good))
        .run(&["run", "k", "--", "true"])
        .expect(0);
    // A database the server does not have (it has 16): configuration too.
    let no_db = format!("redis://:right-secret@127.0.0.1:{}/99", server.port());
    let out = Cli::with_store("redis-no-db", Some(no_db))
        .run(&["run", "k", "--", "true"])
        .expect(78);
    assert!(out.stderr.contains("database"), "{}", out.stderr);
}

#[test]
fn redis_holder_killed_with_sigkill_frees_the_lock_within_its_ttl() {
    let server = RedisServer::start();
    killed_holder_is_taken_over_with_a_higher_token(&world("redis-kill9", &server), "1s");
}

#[test]
fn redis_holder_paused_past_its_ttl_stops_its_command_and_exits_76() {
    let server = RedisServer::start();
    paused_holder_loses_the_lock_and_exits_76(&world("redis-sigstop", &server));
}

/// With `appendfsync always` the restarted server has every lock it had, so holders
/// renew again and waiters carry on. (Without persistence a restart forgets the locks:
/// see the module docs of the Redis store and the next test.)
#[test]
fn persistent_redis_restart_under_a_holder_and_waiters_leaves_no_hung_waiter_and_no_overlap() {
    let mut server = RedisServer::start_persistent();
    let cli = world("redis-restart", &server);
    // Each run appends "start" and "end" around its critical section, which lasts until
    // the test says go; an overlap shows as two starts in a row.
    let body = "echo start >> log; while [ ! -e go ]; do sleep 0.05; done; echo end >> log";
    let mut runs = Vec::new();
    for i in 0..4 {
        runs.push(cli.spawn(
            &format!("run{i}"),
            &[
                "run", "--ttl", "1s", "--wait", "60s", "k", "--", "sh", "-c", body,
            ],
        ));
    }
    // Everyone has reached the store (a run that cannot reach it at its start exits 69,
    // which is not what this test is about).
    wait_for("a holder and three waiters", || {
        let status = cli.status("k");
        status["holders"].as_array().map_or(0, Vec::len) == 1
            && status["waiters"].as_array().map_or(0, Vec::len) == 3
    });
    server.restart();
    cli.touch("go");
    for run in &mut runs {
        // A run that lost its lock in the restart exits 76; none may hang.
        let code = run.exits_within(leasehold_testkit::PATIENCE);
        assert!(
            code == 0 || code == 76,
            "{} exited {code}: {}",
            run.label,
            run.stderr()
        );
    }
    let log = cli.read("log");
    let mut inside = false;
    for line in log.lines() {
        match line {
            "start" => {
                assert!(!inside, "two holders at once:\n{log}");
                inside = true;
            }
            _ => inside = false,
        }
    }
}

#[test]
fn thirty_two_processes_on_one_redis_lock_lose_no_update() {
    let server = RedisServer::start();
    let cli = world("redis-counter", &server);
    cli.script(
        "worker.sh",
        r#"for i in 1 2 3; do
  "$LH" --store "$STORE" run --wait 120s k -- sh -c 'n=$(cat counter); echo $((n+1)) > counter' || exit 1
done
"#,
    );
    std::fs::write(cli.path("counter"), "0\n").unwrap();
    let mut workers = Vec::new();
    for i in 0..32 {
        let mut cmd = cli.process("sh");
        cmd.arg("worker.sh").env("STORE", &cli.store);
        workers.push(cli.start(&format!("w{i}"), cmd));
    }
    for w in &mut workers {
        w.expect_exit(0);
    }
    assert_eq!(cli.read("counter").trim(), "96");
}

/// A restart without persistence forgets every lock: the holder hears it at its next
/// renewal, stops its command and exits 76; nobody hangs.
#[test]
fn volatile_redis_restart_makes_the_holder_stop_its_command_and_exit_76() {
    let mut server = RedisServer::start();
    let cli = world("redis-volatile", &server);
    let mut holder = cli.spawn(
        "holder",
        &[
            "run",
            "--ttl",
            "1s",
            "k",
            "--",
            "sh",
            "-c",
            "echo $$ > child.pid; exec sleep 1000",
        ],
    );
    let child = PidGuard(read_pid(&cli, "child.pid"));
    server.restart();
    holder.expect_exit(76);
    wait_for("the holder's command to be stopped", || !pid_alive(child.0));
    cli.run(&["run", "--no-wait", "k", "--", "true"]).expect(0);
}

/// A server that stops answering (paused) under a holder: the holder stops its command
/// and exits 76, and does not wait on the server for the release of the lost lock (it
/// tries once, until the safe deadline, and leaves nothing to retry in the background).
#[test]
fn paused_redis_makes_the_holder_exit_76_without_waiting_to_release() {
    let server = RedisServer::start();
    let cli = world("redis-paused-store", &server);
    let script = "echo $$ > child.pid; exec sleep 1000";
    let mut holder = cli.spawn(
        "holder",
        &["run", "--ttl", "1s", "k", "--", "sh", "-c", script],
    );
    let child = PidGuard(read_pid(&cli, "child.pid"));
    server.pause();
    holder.expect_exit(76);
    server.resume();
    wait_for("the holder's command to be stopped", || !pid_alive(child.0));
    let stderr = holder.stderr();
    assert!(stderr.contains("about to be lost"), "{stderr}");
    assert!(
        !stderr.contains("could not release") && !stderr.contains("before every release"),
        "{stderr}"
    );
}

/// The same for `hold`: it exits 76 once the lock is lost, without waiting on the
/// paused server for a release (it waited for the release's timeout and then for the
/// resends in the background, and said it left them unsent).
#[test]
fn paused_redis_makes_hold_exit_76_without_waiting_to_release() {
    let server = RedisServer::start();
    let cli = world("redis-paused-hold", &server);
    let (mut holder, _) = cli.hold("holder", &["--ttl", "1s", "k"]);
    server.pause();
    holder.expect_exit(76);
    server.resume();
    let stderr = holder.stderr();
    assert!(stderr.contains("lost"), "{stderr}");
    assert!(!stderr.contains("before every release"), "{stderr}");
}

#[test]
fn run_status_and_list_work_on_a_redis_cluster_with_a_password() {
    let cluster = leasehold_testkit::RedisCluster::start_with_password(Some("cluster-secret"));
    let cli = Cli::with_store("redis-cluster", Some(cluster.url()));
    let (mut holder, token) = cli.hold("holder", &["{braces}/and%percent"]);
    let holders = cli.holders("{braces}/and%percent");
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0]["token"], token);
    assert_eq!(
        cli.list("{braces}").len(),
        1,
        "list finds it on the master that has it"
    );
    cli.run(&["run", "--no-wait", "{braces}/and%percent", "--", "true"])
        .expect(75);
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
    cli.run(&["run", "--no-wait", "{braces}/and%percent", "--", "true"])
        .expect(0);
}

#[test]
fn cluster_url_with_a_database_is_rejected_with_64() {
    let cli = Cli::with_store(
        "redis-cluster-db",
        Some("redis+cluster://127.0.0.1:7000/2".into()),
    );
    let out = cli.run(&["run", "k", "--", "true"]).expect(64);
    assert!(out.stderr.contains("seed nodes"), "{}", out.stderr);
}

/// A fair waiter killed in the queue stops blocking it within its short waiter lease
/// (5 s), not the lock's TTL (60 s here, longer than the test's patience), even when the
/// lock is handed to it on release.
#[test]
fn dead_fair_waiter_blocks_the_queue_only_for_its_waiter_lease() {
    let server = RedisServer::start();
    let cli = world("redis-dead-waiter", &server);
    let (mut holder, _) = cli.hold("holder", &["--fair", "--ttl", "60s", "k"]);
    let dead = cli.spawn(
        "dead",
        &["run", "--fair", "--ttl", "60s", "k", "--", "true"],
    );
    cli.wait_waiters("k", 1);
    dead.signal(libc::SIGKILL);
    let script = "touch done";
    let mut live = cli.spawn(
        "live",
        &[
            "run", "--fair", "--ttl", "60s", "k", "--", "sh", "-c", script,
        ],
    );
    cli.wait_waiters("k", 2);
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
    live.expect_exit(0);
    assert!(cli.exists("done"));
    drop(dead);
}

/// Waiters queued behind a holder with default flags (`--ttl 15s`, `--grace 5s`) are
/// handed the lock one after another by the store, each first on a short waiter lease:
/// every command runs to its end in arrival order and exits 0. (The CLI used to take the
/// short lease for one about to be lost and stop each command with exit 76.)
fn handed_over_commands_run_to_their_end(label: &str, holder: &[&str], flags: &[&str]) {
    let server = RedisServer::start();
    let cli = world(label, &server);
    let hold: Vec<&str> = holder.iter().copied().chain(["k"]).collect();
    let (mut holder, _) = cli.hold("holder", &hold);
    let mut waiters = Vec::new();
    for i in 1..=3 {
        let script = format!("echo {i} >> order; sleep 1");
        let args: Vec<&str> = ["run"]
            .into_iter()
            .chain(flags.iter().copied())
            .chain(["k", "--", "sh", "-c", &script])
            .collect();
        waiters.push(cli.spawn(&format!("waiter-{i}"), &args));
        cli.wait_waiters("k", i);
    }
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
    for waiter in &mut waiters {
        waiter.expect_exit(0);
    }
    let order: Vec<String> = cli.read("order").lines().map(str::to_string).collect();
    if flags == ["--fair"] {
        assert_eq!(order, ["1", "2", "3"], "served out of arrival order");
    } else {
        assert_eq!(order.len(), 3, "{order:?}");
    }
}

#[test]
fn fair_hand_offs_run_every_command_to_its_end() {
    handed_over_commands_run_to_their_end("redis-fair-handoff", &["--fair"], &["--fair"]);
}

#[test]
fn permit_hand_offs_run_every_command_to_its_end() {
    let flags = ["--fair", "--permits", "1"];
    handed_over_commands_run_to_their_end("redis-permit-handoff", &flags, &flags);
}

#[test]
fn shared_hand_offs_run_every_command_to_its_end() {
    // Readers queued behind a writer are let in together when it leaves.
    handed_over_commands_run_to_their_end(
        "redis-shared-handoff",
        &["--fair"],
        &["--fair", "--shared"],
    );
}

/// `?replicas=1`: a grant counts once a replica has it; with the replica stopped the
/// grant is given back and `run` exits 69 without running anything.
#[test]
fn replica_sync_confirms_grants_and_refuses_when_the_replica_is_away() {
    let master = RedisServer::start_with(&[
        "--save",
        "",
        "--appendonly",
        "no",
        "--repl-diskless-sync-delay",
        "0",
    ]);
    let replica = RedisServer::start_with(&[
        "--save",
        "",
        "--appendonly",
        "no",
        "--replicaof",
        "127.0.0.1",
        &master.port().to_string(),
    ]);
    wait_for("the replica to sync", || {
        replica
            .cli(&["info", "replication"])
            .contains("master_link_status:up")
    });
    let url = format!("{}?replicas=1&replica_timeout=3s", master.url());
    let cli = Cli::with_store("redis-replicas", Some(url));
    cli.run(&["run", "k", "--", "true"]).expect(0);
    replica.pause();
    let out = cli.run(&["run", "k", "--", "touch", "ran"]).expect(69);
    replica.resume();
    assert!(out.stderr.contains("0 of 1 replicas"), "{}", out.stderr);
    assert!(!cli.exists("ran"), "ran without a replicated grant");
    wait_for("the refused grant to be given back", || {
        cli.holders("k").is_empty()
    });
}

#[test]
fn bad_replica_options_are_rejected_with_64() {
    let cli = Cli::with_store(
        "redis-replicas-bad",
        Some("redis://127.0.0.1:1/0?replicas=0".into()),
    );
    let out = cli.run(&["run", "k", "--", "true"]).expect(64);
    assert!(out.stderr.contains("replicas=0"), "{}", out.stderr);
    // A misspelt option is refused, not ignored (which would skip the replica check).
    let cli = Cli::with_store(
        "redis-replicas-misspelt",
        Some("redis://127.0.0.1:1/0?replica=1".into()),
    );
    let out = cli.run(&["run", "k", "--", "touch", "ran"]).expect(64);
    assert!(
        out.stderr.contains("unknown URL parameter \"replica\""),
        "{}",
        out.stderr
    );
    assert!(!cli.exists("ran"));
}

/// `rediss://`: TLS with rustls, verifying the server against a CA given by
/// `SSL_CERT_FILE` (openssl makes the CA and the server's certificate).
#[test]
fn tls_redis_runs_commands_and_refuses_an_untrusted_server() {
    let certs = leasehold_testkit::TempDir::new("redis-tls");
    let dir = certs.path().display().to_string();
    leasehold_testkit::make_tls_certs(certs.path());
    let tls_port = free_port().to_string();
    let server = RedisServer::start_with(&[
        "--save",
        "",
        "--appendonly",
        "no",
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        &format!("{dir}/server.pem"),
        "--tls-key-file",
        &format!("{dir}/server.key"),
        "--tls-ca-cert-file",
        &format!("{dir}/ca.pem"),
        "--tls-auth-clients",
        "no",
    ]);
    let cli = Cli::with_store(
        "redis-tls",
        Some(format!("rediss://127.0.0.1:{tls_port}/0")),
    );
    let trusted = |args: &[&str]| {
        let mut cmd = cli.cmd(args);
        cmd.env("SSL_CERT_FILE", format!("{dir}/ca.pem"));
        Out::from(cmd.output().expect("run leasehold"))
    };
    trusted(&[
        "run",
        "k",
        "--",
        "sh",
        "-c",
        "echo $LEASEHOLD_TOKEN > token",
    ])
    .expect(0);
    let token: u64 = cli.read("token").trim().parse().expect("a token");
    assert!(token > 0);
    // Without the CA the server's certificate is not trusted: a configuration to fix,
    // exit 78, not a server that is away.
    let mut untrusted = cli.cmd(&["run", "k", "--", "touch", "ran"]);
    untrusted.env("SSL_CERT_FILE", format!("{dir}/server.pem"));
    let out = Out::from(untrusted.output().unwrap()).expect(78);
    assert!(
        out.stderr.contains("certificate is not trusted"),
        "{}",
        out.stderr
    );
    assert!(!cli.exists("ran"));
    drop(server);
}

/// Every waiter and holder killed: the queue lives in the record (with the hold key as its
/// marker; the record carries the token), both expiring by themselves should nothing
/// touch the lock again; once the dead holder's and waiter's leases end, the next look
/// leaves the lock its token counter alone, which has the dead holder's token.
#[test]
fn a_dead_queue_leaves_only_the_token_counter_behind() {
    let server = RedisServer::start();
    let cli = world("redis-dead-queue", &server);
    let (holder, token) = cli.hold("holder", &["--ttl", "2s", "k"]);
    let waiter = cli.spawn("waiter", &["run", "--ttl", "2s", "k", "--", "true"]);
    cli.wait_waiters("k", 1);
    waiter.signal(libc::SIGKILL);
    holder.signal(libc::SIGKILL);
    let keys = || {
        let mut keys: Vec<String> = server
            .cli(&["--scan", "--pattern", "lh:{k}*"])
            .lines()
            .map(String::from)
            .collect();
        keys.sort();
        keys
    };
    assert_eq!(keys(), ["lh:{k}", "lh:{k}:hold"]);
    for key in ["lh:{k}", "lh:{k}:hold"] {
        let left: i64 = server.cli(&["PTTL", key]).trim().parse().unwrap();
        assert!(left > 0, "{key} has no expiry (PTTL {left})");
    }
    wait_for("the dead holder and waiter to leave", || {
        let status = cli.status("k");
        status["holders"] == serde_json::json!([]) && status["waiters"] == serde_json::json!([])
    });
    assert_eq!(keys(), ["lh:{k}:token"]);
    assert_eq!(
        server.cli(&["GET", "lh:{k}:token"]).trim(),
        token.to_string()
    );
    drop((holder, waiter));
}

#[test]
fn a_waiter_stopped_by_sigterm_leaves_the_fair_redis_queue_before_it_exits() {
    let server = RedisServer::start();
    let cli = world("redis-interrupted-waiter", &server);
    interrupted_waiter_leaves_the_queue(&cli, libc::SIGTERM, &["--fair"]);
}

#[test]
fn a_waiter_stopped_by_sighup_leaves_the_fair_redis_cluster_queue_before_it_exits() {
    let cluster = leasehold_testkit::RedisCluster::start();
    let cli = Cli::with_store("cluster-interrupted-waiter", Some(cluster.url()));
    interrupted_waiter_leaves_the_queue(&cli, libc::SIGHUP, &["--fair"]);
}

/// The store says what a restart can lose: a Redis without persistence is named in
/// `status` (and warned of), `?durable=1` refuses it; a Redis that writes every change
/// before answering says nothing and is accepted.
#[test]
fn status_says_what_a_restart_of_redis_can_lose_and_durable_refuses_it() {
    let volatile = RedisServer::start();
    let cli = world("redis-volatile", &volatile);
    let out = cli.run(&["status", "k"]).expect(0);
    assert!(
        out.stdout
            .contains("store: a restart forgets every held lock"),
        "{out:?}"
    );
    assert!(out.stderr.contains("appendonly no"), "no warning: {out:?}");
    assert!(cli.status("k")["store_caveat"].is_string());
    let durable = Cli::with_store(
        "redis-durable",
        Some(format!("{}?durable=1", volatile.url())),
    );
    let out = durable.run(&["run", "k", "--", "touch", "ran"]).expect(64);
    assert!(
        out.stderr.contains("appendonly yes and appendfsync always"),
        "{out:?}"
    );
    assert!(!durable.exists("ran"));

    let persistent = RedisServer::start_persistent();
    let cli = Cli::with_store(
        "redis-persistent",
        Some(format!("{}?durable=1", persistent.url())),
    );
    cli.run(&["run", "k", "--", "true"]).expect(0);
    let out = cli.run(&["status", "k"]).expect(0);
    assert!(
        !out.stdout.contains("store:") && out.stderr.is_empty(),
        "{out:?}"
    );
    assert!(cli.status("k").get("store_caveat").is_none());
}

/// Each row of the README's table of Redis settings: what `status` says of a server that
/// writes its append-only file once a second, and of one with a replica (with and
/// without `?replicas`), and whether `?durable=1` takes it.
#[test]
fn the_readme_table_of_redis_settings_holds() {
    let store_line = |url: String, label: &str| {
        let out = Cli::with_store(label, Some(url))
            .run(&["status", "k"])
            .expect(0);
        (out.stdout.lines())
            .find_map(|l| l.trim_start().strip_prefix("store: "))
            .map(str::to_string)
    };
    let durable = |url: String, label: &str| {
        let join = if url.contains('?') { '&' } else { '?' };
        let cli = Cli::with_store(label, Some(format!("{url}{join}durable=1")));
        cli.run(&["status", "k"]).code
    };
    let everysec = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "everysec"]);
    let said = store_line(everysec.url(), "redis-everysec");
    assert!(said.is_some_and(|s| s.contains("last second")));
    assert_eq!(durable(everysec.url(), "redis-everysec-durable"), Some(64));

    let master = RedisServer::start_persistent();
    let port = master.port().to_string();
    let _replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    wait_for("the replica to connect", || {
        master
            .cli(&["INFO", "replication"])
            .contains("connected_slaves:1")
    });
    let said = store_line(master.url(), "redis-replicated");
    assert!(said.is_some_and(|s| s.contains("failover to a replica")));
    assert_eq!(durable(master.url(), "redis-replicated-durable"), Some(64));
    let waits = format!("{}?replicas=1", master.url());
    assert_eq!(store_line(waits.clone(), "redis-replicas"), None);
    assert_eq!(durable(waits, "redis-replicas-durable"), Some(0));
}

/// The same for a Redis Cluster: each master is asked, and a cluster whose masters keep
/// nothing across a restart is named in `status` and refused by `?durable=1`.
#[test]
fn status_says_what_a_restart_of_a_cluster_can_lose_and_durable_refuses_it() {
    let cluster = leasehold_testkit::RedisCluster::start();
    let cli = Cli::with_store("cluster-volatile", Some(cluster.url()));
    let out = cli.run(&["status", "k"]).expect(0);
    assert!(
        out.stdout
            .contains("store: a restart forgets every held lock"),
        "{out:?}"
    );
    let durable = Cli::with_store(
        "cluster-durable",
        Some(format!("{}?durable=1", cluster.url())),
    );
    let out = durable.run(&["run", "k", "--", "touch", "ran"]).expect(64);
    assert!(out.stderr.contains("appendonly yes"), "{out:?}");
    assert!(!durable.exists("ran"));
}

/// A key of ours that something else wrote (garbage, another type) is unreadable state:
/// exit 70 with the key named, not "unavailable".
#[test]
fn garbage_in_a_lock_key_exits_70_naming_the_key() {
    let server = RedisServer::start();
    let cli = world("redis-garbage", &server);
    server.cli(&["SET", "lh:{bad}", "garbage"]);
    server.cli(&["HSET", "lh:{hash}", "f", "v"]);
    for name in ["bad", "hash"] {
        let out = cli.run(&["run", name, "--", "touch", "ran"]).expect(70);
        assert!(
            out.stderr.contains(&format!("lh:{{{name}}}")),
            "{}",
            out.stderr
        );
        cli.run(&["status", name]).expect(70);
    }
    assert!(!cli.exists("ran"));
}

/// A store that does not answer (a paused Redis) cannot stretch a bounded wait by the
/// client's connect and response timeouts: `run --wait` and `--no-wait` give up on the
/// connect too, exit 69, and say so. (Without the bound: 9.5 s for any --wait.)
#[test]
fn a_paused_redis_cannot_stretch_a_bounded_wait_by_its_connect() {
    let server = RedisServer::start();
    let cli = world("redis-paused-connect", &server);
    server.pause();
    let out = cli
        .run(&["run", "--wait", "1s", "k", "--", "touch", "ran"])
        .expect(69);
    assert!(
        out.stderr
            .contains("did not answer within the --wait of 1s and 2s to connect"),
        "{out:?}"
    );
    let out = cli
        .run(&["run", "--no-wait", "k", "--", "touch", "ran"])
        .expect(69);
    assert!(
        out.stderr.contains("did not answer within 2s to connect"),
        "{out:?}"
    );
    // Which store: its address.
    let port = format!("127.0.0.1:{}", server.port());
    assert!(out.stderr.contains(&port), "{out:?}");
    server.resume();
    assert!(!cli.exists("ran"));
}

#[test]
fn redis_elect_candidates_take_over_from_killed_leaders_and_the_watcher_sees_each() {
    let server = RedisServer::start();
    candidates_take_over_from_killed_leaders(&world("redis-elect", &server), "4s");
}

/// `leader --watch` ends with 69, saying the store is unavailable, when the server goes
/// away: a watcher must not sit silent on a dead store.
#[test]
fn redis_leader_watch_exits_69_when_the_server_goes_away() {
    let mut server = RedisServer::start();
    let cli = world("redis-watch-gone", &server);
    let mut watch = cli.spawn("watch", &["leader", "e", "--watch"]);
    watch.wait_for_line("the watcher's first line");
    server.kill();
    watch.expect_exit(69);
    assert!(watch.stderr().contains("unavailable"), "{}", watch.stderr());
}
