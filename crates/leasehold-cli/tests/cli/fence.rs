//! `fence`: a stale token is refused (76) and its command not run; the token comes from
//! `leasehold run`; `--reset` forgets the tokens.

use super::*;

#[test]
fn fence_admits_newer_tokens_refuses_older_ones_and_runs_the_command_only_when_admitted() {
    let cli = Cli::new("fence");
    let fence = cli.path("out.fence");
    let fence = fence.to_str().unwrap();
    // Under `run`, the token is the lock's.
    let script = format!("leasehold fence {fence} -- sh -c 'echo $LEASEHOLD_TOKEN > first'");
    let mut run = cli.cmd(&["run", "k", "--", "sh", "-c", &script]);
    let bin_dir = std::path::Path::new(env!("CARGO_BIN_EXE_leasehold"))
        .parent()
        .unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    run.env("PATH", path);
    let out = Out::from(run.output().unwrap()).expect(0);
    let token: u64 = cli
        .read("first")
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{out:?}"));
    let older = (token - 1).to_string();
    let out = cli
        .run(&[
            "fence",
            fence,
            "--token",
            &older,
            "--",
            "touch",
            "stale-ran",
        ])
        .expect(76);
    assert!(out.stderr.contains("newer holder"), "{}", out.stderr);
    assert!(!cli.exists("stale-ran"));
    let newer = (token + 1).to_string();
    cli.run(&[
        "fence", fence, "--token", &newer, "--", "sh", "-c", "exit 3",
    ])
    .expect(3);
    cli.run(&["fence", fence, "--token", &token.to_string()])
        .expect(76);
    cli.run(&["fence", fence, "--reset"]).expect(0);
    cli.run(&["fence", fence, "--token", "1"]).expect(0);
    let out = cli.run(&["fence", fence]).expect(64);
    assert!(out.stderr.contains("LEASEHOLD_TOKEN"), "{}", out.stderr);
    let out = cli.run(&["fence", fence, "--token", "abc"]).expect(64);
    assert!(
        out.stderr.contains("is not a fencing token"),
        "{}",
        out.stderr
    );
}

/// A command that cannot run (127, 126) admits nothing: the fence keeps its highest
/// token, and the same token is admitted afterwards.
#[test]
fn a_command_that_cannot_run_does_not_move_the_fence() {
    let cli = Cli::new("fence-no-command");
    let fence = cli.path("out.fence");
    let fence = fence.to_str().unwrap();
    cli.run(&["fence", fence, "--token", "3"]).expect(0);
    cli.run(&["fence", fence, "--token", "4", "--", "no-such-command-here"])
        .expect(127);
    cli.run(&["fence", fence, "--token", "4", "--", "/tmp"])
        .expect(126);
    cli.run(&["fence", fence, "--token", "4", "--", "touch", "ran"])
        .expect(0);
    assert!(cli.exists("ran"));
}

/// The command holds the fence until it exits, whatever is sent to it: a newer token's
/// command waits for it (blocked on the file, as /proc/locks shows) and writes after it.
#[test]
fn fence_is_held_until_the_command_exits_even_when_it_is_signalled() {
    let cli = Cli::new("fence-held");
    let fence = cli.path("out.fence");
    let fence = fence.to_str().unwrap();
    let first =
        "trap '' TERM; touch started; while [ ! -e go ]; do sleep 0.02; done; echo first >> log";
    let mut old = cli.spawn(
        "old",
        &["fence", fence, "--token", "5", "--", "sh", "-c", first],
    );
    cli.wait_file("started");
    old.signal(libc::SIGTERM);
    let mut new = cli.spawn(
        "new",
        &[
            "fence",
            fence,
            "--token",
            "6",
            "--",
            "sh",
            "-c",
            "echo second >> log",
        ],
    );
    let blocked = format!("-> FLOCK  ADVISORY  WRITE {} ", new.pid());
    wait_until("the newer command to wait for the fence", PATIENCE, || {
        let locks = fs::read_to_string("/proc/locks").unwrap();
        locks.contains(&blocked).then_some(())
    });
    assert!(
        !cli.exists("log"),
        "the newer command ran while the older held the fence"
    );
    cli.touch("go");
    old.expect_exit(0);
    new.expect_exit(0);
    assert_eq!(cli.read("log"), "first\nsecond\n");
}
