//! Re-entry, semaphores, shared locks.

use super::*;

#[test]
fn nested_run_of_the_same_name_reenters_with_the_same_token() {
    let cli = Cli::new("nested");
    // Move the token past 1, so a nested run on another store cannot match by chance.
    cli.run(&["run", "k", "--", "true"]).expect(0);
    cli.run(&["run", "k", "--", "true"]).expect(0);
    cli.script(
        "outer.sh",
        r#"echo "$LEASEHOLD_TOKEN" > outer.token
"$LH" run k --no-wait -- sh -c 'echo "$LEASEHOLD_TOKEN"' > inner.token || exit 90
# Control: without what the outer run passes down, the same run is another contender.
env -u LEASEHOLD_OWNER -u LEASEHOLD_HELD "$LH" run k --no-wait -- true
echo $? > stranger.code
"#,
    );
    let out = cli.run(&["run", "k", "--", "sh", "outer.sh"]).expect(0);
    let outer = cli.read("outer.token");
    let inner = cli.read("inner.token");
    assert!(
        outer.trim().parse::<u64>().unwrap() >= 3,
        "outer token {outer:?}; {out:?}"
    );
    assert_eq!(inner, outer, "the nested run saw another token");
    assert_eq!(
        cli.read("stranger.code").trim(),
        "75",
        "a different owner got in"
    );
    cli.assert_all_free("k");
}

/// Holds its permit until `go.$1` appears, leaves `held.$1` and `done.$1`.
const BLOCK: &str = r#"echo "$LEASEHOLD_TOKEN" > held.$1
while [ ! -e go.$1 ]; do sleep 0.05; done
touch done.$1
"#;

#[test]
fn semaphore_admits_two_and_the_third_waits_for_a_permit() {
    let cli = Cli::new("permits");
    cli.script("block.sh", BLOCK);
    let mut one = cli.spawn(
        "one",
        &["run", "--permits", "2", "sem", "--", "sh", "block.sh", "1"],
    );
    let mut two = cli.spawn(
        "two",
        &["run", "--permits", "2", "sem", "--", "sh", "block.sh", "2"],
    );
    cli.wait_file("held.1");
    cli.wait_file("held.2");
    assert_eq!(cli.holders("sem").len(), 2);

    cli.run(&[
        "run",
        "--permits",
        "2",
        "--no-wait",
        "sem",
        "--",
        "touch",
        "ran",
    ])
    .expect(75);
    assert!(!cli.exists("ran"), "a third holder got in with --no-wait");

    // Its command checks that one of the first two was done before it got the permit.
    cli.script(
        "third.sh",
        "if [ -e done.1 ] || [ -e done.2 ]; then touch third.ok; fi\n",
    );
    let mut third = cli.spawn(
        "third",
        &["run", "--permits", "2", "sem", "--", "sh", "third.sh"],
    );
    cli.wait_waiters("sem", 1);
    assert!(!cli.exists("third.ok"));
    cli.touch("go.1");
    one.expect_exit(0);
    third.expect_exit(0);
    assert!(
        cli.exists("third.ok"),
        "the third ran before a permit was free"
    );
    cli.touch("go.2");
    two.expect_exit(0);
    cli.assert_all_free("sem");
}

#[test]
fn shared_readers_hold_together_and_exclude_a_writer() {
    let cli = Cli::new("shared");
    cli.script("block.sh", BLOCK);
    let mut r1 = cli.spawn(
        "r1",
        &["run", "--shared", "rw", "--", "sh", "block.sh", "1"],
    );
    let mut r2 = cli.spawn(
        "r2",
        &["run", "--shared", "rw", "--", "sh", "block.sh", "2"],
    );
    cli.wait_file("held.1");
    cli.wait_file("held.2");
    let holders = cli.holders("rw");
    assert_eq!(holders.len(), 2, "{holders:?}");
    assert!(holders.iter().all(|h| h["kind"] == "shared"), "{holders:?}");

    cli.run(&["run", "--no-wait", "rw", "--", "touch", "ran"])
        .expect(75);
    assert!(!cli.exists("ran"), "a writer got in beside readers");

    cli.script(
        "writer.sh",
        "if [ -e done.1 ] && [ -e done.2 ]; then touch writer.ok; fi\n",
    );
    let mut writer = cli.spawn("writer", &["run", "rw", "--", "sh", "writer.sh"]);
    cli.wait_waiters("rw", 1);
    cli.touch("go.1");
    cli.touch("go.2");
    r1.expect_exit(0);
    r2.expect_exit(0);
    writer.expect_exit(0);
    assert!(
        cli.exists("writer.ok"),
        "the writer ran while a reader held the lock"
    );
    cli.run(&["run", "--no-wait", "rw", "--", "true"]).expect(0);
    cli.assert_all_free("rw");
}

#[test]
fn a_nested_run_from_another_directory_reenters_in_the_same_relative_local_store() {
    let cli = Cli::new("nested-relative");
    fs::create_dir_all(cli.path("elsewhere")).unwrap();
    cli.script(
        "outer.sh",
        r#"echo "$LEASEHOLD_STORE" > store.seen
echo "$LEASEHOLD_TOKEN" > outer.token
cd elsewhere && "$LH" run k --no-wait -- sh -c 'echo "$LEASEHOLD_TOKEN"' > ../inner.token
echo $? > ../inner.code
"#,
    );
    let out = Out::from(
        cli.bare(&[
            "--store",
            "local:rel-store",
            "run",
            "k",
            "--",
            "sh",
            "outer.sh",
        ])
        .output()
        .unwrap(),
    )
    .expect(0);
    let absolute = format!("local:{}", cli.path("rel-store").display());
    assert_eq!(cli.read("store.seen").trim(), absolute, "{out:?}");
    assert_eq!(cli.read("inner.code").trim(), "0", "{out:?}");
    assert_eq!(cli.read("inner.token"), cli.read("outer.token"));
    assert!(
        !cli.exists("elsewhere/rel-store"),
        "the nested run opened a store of its own"
    );
}
