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
}
