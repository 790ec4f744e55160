//! `--json` output of the real binary, every line parsed with serde_json: `hold --json`'s
//! held and end lines (released on a signal, lost to a force-release), `release --force
//! --json`, and errors (`run --json`'s lost lock too) as one JSON object on stderr with a
//! stable `kind` per exit code.
//!
//! Each test has its own store: a temporary local directory, or its own redis-server.

mod support;

use std::time::{SystemTime, UNIX_EPOCH};

use leasehold_testkit::{free_port, RedisServer};
use serde_json::Value;
use support::*;

/// Every line of `text`, each one JSON object.
fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|line| {
            let value: Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?} in {text:?}"));
            assert!(value.is_object(), "not an object: {line}");
            value
        })
        .collect()
}

/// A failed `--json` run: nothing on stdout, one error object on stderr with `exit` (the
/// exit status) and `kind`; its message.
fn json_error(out: &Out, code: i32, kind: &str) -> String {
    assert_eq!(out.code, Some(code), "{out:?}");
    assert_eq!(out.stdout, "", "{out:?}");
    error_object(&out.stderr, code, kind)
}

/// The one error object among the JSON lines of `stderr` (the others are log events);
/// its message.
fn error_object(stderr: &str, code: i32, kind: &str) -> String {
    let errors: Vec<Value> = (json_lines(stderr).into_iter())
        .filter(|line| line.get("exit").is_some())
        .collect();
    assert_eq!(errors.len(), 1, "one error object: {stderr:?}");
    let error = &errors[0];
    assert_eq!(error["exit"], code, "{error}");
    assert_eq!(error["kind"], kind, "{error}");
    let message = error["message"].as_str().expect("message is a string");
    assert!(!message.is_empty(), "{error}");
    message.to_string()
}

fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Starts `hold --json ARGS` and checks its held line against `status --json`: the token
/// and owner the store shows, its pid, the lease. The held line.
fn hold_json(cli: &Cli, label: &str, name: &str) -> (Proc, Value) {
    let before = unix_ms_now();
    let mut hold = cli.spawn(label, &["hold", "--json", "--ttl", "10s", name]);
    let line = hold.wait_for_line(&format!("{label}'s held line"));
    let after = unix_ms_now();
    let held = json_lines(&line).remove(0);
    assert_eq!(held["event"], "held", "{held}");
    assert_eq!(held["name"], name, "{held}");
    assert_eq!(held["pid"], hold.pid(), "{held}");
    let holders = cli.holders(name);
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert_eq!(held["token"], holders[0]["token"], "{held} {holders:?}");
    assert_eq!(held["owner"], holders[0]["owner"], "{held} {holders:?}");
    let left = held["lease_left"].as_u64().expect("lease_left ms");
    assert!(left > 0 && left <= 10_000, "{held}");
    let until = held["lease_until"].as_u64().expect("lease_until Unix ms");
    assert!(
        until > before && until <= after + 10_000,
        "{held} (printed between {before} and {after})"
    );
    (hold, held)
}

#[test]
fn hold_json_prints_a_held_line_then_a_released_line_on_sigterm() {
    let cli = Cli::new("json-hold-term");
    let (mut hold, held) = hold_json(&cli, "hold", "app/k");
    hold.signal(libc::SIGTERM);
    hold.expect_exit(0);
    let lines = json_lines(&hold.stdout());
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0], held);
    assert_eq!(lines[1]["event"], "released", "{lines:?}");
    assert_eq!(lines[1]["name"], "app/k");
    assert_eq!(lines[1]["token"], held["token"]);
    assert_eq!(hold.stderr(), "");
    cli.assert_all_free("app/k");
}

/// A holder force-released from another process prints a lost line and exits 76 with a
/// `lost` error object; the release said it was held, and by whom.
fn force_release_shows_as_lost(cli: &Cli) {
    let (mut hold, held) = hold_json(cli, "hold", "k");
    let out = cli.run(&["release", "--force", "--json", "k"]).expect(0);
    let released = json_lines(&out.stdout);
    assert_eq!(released.len(), 1, "{out:?}");
    let released = &released[0];
    assert_eq!(released["name"], "k", "{released}");
    assert_eq!(released["was_held"], true, "{released}");
    let holders = released["holders"].as_array().expect("holders");
    assert_eq!(holders.len(), 1, "{released}");
    assert_eq!(holders[0]["token"], held["token"], "{released}");
    assert_eq!(holders[0]["pid"], hold.pid(), "{released}");
    // Nothing but (JSON) log events on stderr, such as the store's caveat.
    let logs = json_lines(&out.stderr);
    assert!(logs.iter().all(|l| l["level"] == "WARN"), "{logs:?}");

    hold.expect_exit(76);
    let lines = json_lines(&hold.stdout());
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[1]["event"], "lost", "{lines:?}");
    assert_eq!(lines[1]["name"], "k");
    assert_eq!(lines[1]["token"], held["token"]);
    let reason = lines[1]["reason"].as_str().expect("reason");
    assert!(reason.contains("lost"), "{reason}");
    assert_eq!(error_object(&hold.stderr(), 76, "lost"), reason);

    let out = cli.run(&["release", "--force", "--json", "k"]).expect(0);
    let again = json_lines(&out.stdout);
    assert_eq!(again.len(), 1, "{out:?}");
    assert_eq!(again[0]["was_held"], false, "{out:?}");
    assert_eq!(again[0]["holders"], Value::Array(vec![]), "{out:?}");
    cli.assert_all_free("k");
}

/// `run --json` whose lock is force-released: the command's output is its own, and the
/// loss is one `lost` object on stderr, said while the command is being stopped.
#[test]
fn run_json_lost_is_one_lost_object_and_exit_76() {
    let cli = Cli::new("json-run-lost");
    let command = ["sh", "-c", "echo started; exec sleep 60"];
    let args = [&["run", "--json", "--grace", "1s", "k", "--"][..], &command].concat();
    let mut run = cli.spawn("run", &args);
    assert_eq!(run.wait_for_line("the command's first line"), "started");
    cli.run(&["release", "--force", "k"]).expect(0);
    run.expect_exit(76);
    assert_eq!(run.stdout(), "started\n");
    let message = error_object(&run.stderr(), 76, "lost");
    assert!(message.contains("stopping the command"), "{message}");
}

#[test]
fn hold_json_force_released_prints_lost_and_exits_76() {
    force_release_shows_as_lost(&Cli::new("json-lost"));
}

#[test]
fn hold_json_on_redis_force_released_prints_lost_and_exits_76() {
    let server = RedisServer::start();
    force_release_shows_as_lost(&Cli::with_store("json-lost-redis", Some(server.url())));
}

#[test]
fn usage_errors_with_json_are_one_object_exit_64() {
    let cli = Cli::new("json-usage");
    // Refused by the argument parser: NAME is missing.
    let message = json_error(&cli.run(&["hold", "--json"]), 64, "usage");
    assert!(message.contains("<NAME>"), "{message}");
    // Refused by release itself.
    let message = json_error(&cli.run(&["release", "--json", "k"]), 64, "usage");
    assert!(message.contains("--force"), "{message}");
    // Refused by the store: a bad name.
    json_error(&cli.run(&["hold", "--json", ""]), 64, "usage");
    // Without --json, the same error is text, as before.
    let out = cli.run(&["release", "k"]).expect(64);
    assert!(out.stderr.starts_with("leasehold: "), "{out:?}");
}

#[test]
fn busy_lock_with_json_is_a_not_acquired_object_under_any_exit_code() {
    let cli = Cli::new("json-busy");
    let (holder, _) = cli.hold("holder", &["k"]);
    let message = json_error(
        &cli.run(&["hold", "--json", "--no-wait", "k"]),
        75,
        "not_acquired",
    );
    assert!(
        message.contains(&format!("pid {}", holder.pid())),
        "{message}"
    );
    // -E changes the exit status, not the kind.
    json_error(
        &cli.run(&["hold", "--json", "-n", "-E", "3", "k"]),
        3,
        "not_acquired",
    );
    // run and elect: stdout is the command's (it never ran), the error is JSON.
    for command in [
        &["run", "--json", "-n", "k", "--", "true"][..],
        &["elect", "--json", "-n", "k", "--", "true"],
    ] {
        let out = cli.run(command);
        assert_eq!(out.stdout, "", "{command:?}");
        let message = json_error(&out, 75, "not_acquired");
        assert!(
            message.contains(&format!("pid {}", holder.pid())),
            "{message}"
        );
    }
}

#[test]
fn unreachable_store_with_json_is_an_unavailable_object_exit_69() {
    let url = format!("redis://127.0.0.1:{}/0", free_port());
    let cli = Cli::with_store("json-unreachable", Some(url));
    json_error(
        &cli.run(&["hold", "--json", "--no-wait", "k"]),
        69,
        "unavailable",
    );
    json_error(
        &cli.run(&["release", "--force", "--json", "k"]),
        69,
        "unavailable",
    );
    for args in [
        &["leader", "--json", "e"][..],
        &["leader", "--json", "--watch", "e"],
    ] {
        json_error(&cli.run(args), 69, "unavailable");
    }
}
