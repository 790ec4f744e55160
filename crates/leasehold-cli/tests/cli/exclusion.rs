//! Mutual exclusion between processes; hold, status, list, release.

use super::*;

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
