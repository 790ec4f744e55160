//! `leasehold torture` smoke runs (10 to 25 s each) on the local store, a redis-server and
//! etcd, each started by the command itself; and its usage errors.
//!
//! The runs take turns (one lock): each spawns its workers and its store, and several at
//! once on two cores would starve renewals and report losses that no fault caused.

use std::sync::Mutex;

use serde_json::Value;

mod support;
use support::Cli;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `leasehold torture ARGS --json` and returns its report.
fn torture(label: &str, args: &[&str]) -> Value {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cli = Cli::new(label);
    let history = cli.path("history");
    let mut cmd = cli.bare(&["torture", "--json", "--history"]);
    cmd.arg(&history).args(args);
    let out = support::Out::from(cmd.output().expect("run leasehold torture"));
    let json: Value = serde_json::from_str(out.stdout.trim())
        .unwrap_or_else(|e| panic!("no JSON report ({e}): {out:#?}"));
    assert_eq!(
        out.code,
        Some(0),
        "violations: {}\n{out:#?}",
        json["report"]["violations"]
    );
    json["report"].clone()
}

fn count(report: &Value, key: &str) -> u64 {
    report[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} in {report}"))
}

fn faults(report: &Value, kind: &str) -> u64 {
    report["faults"][kind].as_u64().unwrap_or(0)
}

/// What every fenced run must show besides exit 0: work was done, the faults landed, and
/// every lease that expired under a pause was reported lost.
fn assert_landed(report: &Value, kinds: &[&str]) {
    assert!(count(report, "acquisitions") > 0, "{report}");
    for kind in kinds {
        assert!(faults(report, kind) > 0, "no {kind} landed: {report}");
    }
    assert_eq!(count(report, "service_overlap"), 0);
    assert_eq!(count(report, "lost_updates"), 0);
    assert_eq!(
        count(report, "losses_reported"),
        count(report, "expired_while_held"),
        "{report}"
    );
    if faults(report, "pause") > 0 {
        assert!(count(report, "expired_while_held") > 0, "{report}");
    }
}

#[test]
fn local_store_holds_under_pauses_and_kills() {
    let report = torture(
        "torture-local",
        &[
            "--duration",
            "10s",
            "--ttl",
            "500ms",
            "--faults",
            "pause,short-pause,kill",
        ],
    );
    assert_landed(&report, &["pause", "short-pause", "kill"]);
    assert_eq!(count(&report, "false_losses"), 0);
    assert!(count(&report, "stale_rejected") > 0, "{report}");
}

#[test]
fn the_unfenced_control_shows_lost_updates() {
    let report = torture(
        "torture-control",
        &[
            "--duration",
            "10s",
            "--ttl",
            "500ms",
            "--fence",
            "none",
            "--faults",
            "pause",
        ],
    );
    assert!(faults(&report, "pause") > 0, "{report}");
    assert!(count(&report, "lost_updates") > 0, "{report}");
    assert_eq!(count(&report, "service_overlap"), 0);
}

#[test]
fn redis_holds_under_holder_store_and_link_faults() {
    let report = torture(
        "torture-redis",
        &[
            "--spawn",
            "redis",
            "--duration",
            "18s",
            "--ttl",
            "500ms",
            "--faults",
            "pause,kill,restart-store,delay,reset",
        ],
    );
    assert_landed(
        &report,
        &["pause", "kill", "restart-store", "delay", "reset"],
    );
}

#[test]
fn etcd_holds_under_holder_and_store_faults() {
    let report = torture(
        "torture-etcd",
        &[
            "--spawn",
            "etcd",
            "--duration",
            "18s",
            "--ttl",
            "1s",
            "--faults",
            "pause,kill,restart-store",
        ],
    );
    assert_landed(&report, &["pause", "kill", "restart-store"]);
}

#[test]
fn etcd_cluster_holds_when_a_member_and_the_leader_die() {
    let report = torture(
        "torture-etcd-cluster",
        &[
            "--spawn",
            "etcd-cluster",
            "--duration",
            "25s",
            "--ttl",
            "1s",
            "--faults",
            "kill-member,kill-leader,pause",
        ],
    );
    assert_landed(&report, &["kill-member", "kill-leader", "pause"]);
}

#[test]
fn faults_the_run_cannot_apply_are_usage_errors() {
    let cli = Cli::new("torture-usage");
    let out = cli.bare(&["torture", "--faults", "restart-store"]).output();
    let out = support::Out::from(out.unwrap()).expect(64);
    assert!(
        out.stderr.contains("restart-store needs --spawn"),
        "{out:#?}"
    );
    let out = cli.cmd(&["torture", "--spawn", "redis"]).output();
    let out = support::Out::from(out.unwrap()).expect(64);
    assert!(out.stderr.contains("leave out --store"), "{out:#?}");
    let out = cli.cmd(&["torture", "--faults", "delay"]).output();
    let out = support::Out::from(out.unwrap()).expect(64);
    assert!(
        out.stderr.contains("needs a redis:// or etcd:// store"),
        "{out:#?}"
    );
    let out = cli.cmd(&["torture", "--faults", "explode"]).output();
    support::Out::from(out.unwrap()).expect(64);
}
