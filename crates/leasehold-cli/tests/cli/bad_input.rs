//! Bad input: exit 64, a message, nothing run, nothing held.

use super::*;

/// Runs `leasehold --store ... run ARGS -- touch ran` (store flags in `args` override it)
/// and checks: exit 64, `message` on stderr, the command did not run, nothing is held.
fn rejects(label: &str, args: &[&str], message: &str) {
    let cli = Cli::new(label);
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "touch", "ran"]);
    let out = cli.run(&all).expect(64);
    assert!(
        out.stderr.contains(message),
        "stderr should contain {message:?}: {out:?}"
    );
    assert!(!cli.exists("ran"), "the command ran despite bad input");
    assert_eq!(
        cli.list(""),
        Vec::<Value>::new(),
        "something is held or awaited"
    );
    assert_eq!(cli.holders("k"), Vec::<Value>::new());
}

#[test]
fn empty_name_is_rejected_with_64() {
    rejects("bad-empty", &[""], "must not be empty");
}

#[test]
fn name_of_257_bytes_is_rejected_with_64() {
    let name = "n".repeat(257);
    rejects("bad-long", &[&name], "257 bytes");
}

#[test]
fn name_with_control_characters_is_rejected_with_64() {
    rejects("bad-ctl-tab", &["a\tb"], "control character");
    rejects("bad-ctl-nl", &["a\nb"], "control character");
    rejects("bad-ctl-esc", &["a\u{1b}[31m"], "control character");
}

#[test]
fn zero_ttl_is_rejected_with_64() {
    rejects("bad-ttl0", &["--ttl", "0s", "k"], "ttl");
}

/// A duration that is not one says so in words (not a parser's "expected number at
/// 0"), naming a unit it does not know.
#[test]
fn durations_that_are_not_one_are_rejected_in_words() {
    for (label, ttl, says) in [
        ("bad-ttl-word", "abc", "\"abc\" is not a duration"),
        ("bad-ttl-inf", "inf", "\"inf\" is not a duration"),
        ("bad-ttl-unit", "15S", "\"S\" is not a unit"),
        ("bad-ttl-empty", "", "the duration is empty"),
    ] {
        rejects(label, &["--ttl", ttl, "k"], says);
    }
}

#[test]
fn century_ttl_is_rejected_with_64() {
    rejects("bad-ttl100y", &["--ttl", "100y", "k"], "ttl");
}

#[test]
fn unparsable_wait_is_rejected_with_64() {
    rejects("bad-wait", &["--wait", "abc", "k"], "--wait");
}

#[test]
fn unparsable_grace_is_rejected_with_64() {
    rejects("bad-grace", &["--grace", "soon", "k"], "--grace");
}

#[test]
fn unknown_store_scheme_is_rejected_with_64() {
    rejects(
        "bad-scheme",
        &["--store", "ftp://x", "k"],
        "unknown store scheme",
    );
    // Where the URL came from, as it may be the environment's.
    rejects(
        "bad-scheme-source",
        &["--store", "ftp://x", "k"],
        "(from --store or LEASEHOLD_STORE)",
    );
}

#[test]
fn no_store_url_error_shows_its_password() {
    let cli = Cli::new("url-secrets");
    for (url, code, said) in [
        ("redis://u:QZ1QZ2@127.0.0.1:1/?bogus=1", 64, "\"bogus\""),
        ("redis://u:QZ1QZ2@127.0.0.1:notaport/0", 64, "notaport"),
        (
            "redis+cluster://u:QZ1QZ2@127.0.0.1:1,,127.0.0.1:2",
            64,
            "empty",
        ),
        (
            "redis://u:QZ1/QZ2?QZ3@127.0.0.1:1/0?replicas=0",
            64,
            "replicas=0",
        ),
        (
            "etcd://127.0.0.1:x?user=u&password=QZ1QZ2",
            64,
            "127.0.0.1:x",
        ),
        ("etcd://127.0.0.1:1?user=u&passwd=QZ1QZ2", 64, "\"passwd\""),
        (
            "etcd://u:QZ1QZ2@127.0.0.1:2379",
            64,
            "?user=NAME&password=SECRET",
        ),
        // Parsed, and nothing listens on port 1.
        ("redis://u:QZ1QZ2@127.0.0.1:1/0", 69, "unavailable"),
        (
            "etcd://127.0.0.1:1?user=u&password=QZ1QZ2",
            69,
            "unavailable",
        ),
    ] {
        let out =
            Out::from(cli.bare(&["status", "x", "--store", url]).output().unwrap()).expect(code);
        assert!(out.stderr.contains(said), "{url}: no {said:?} in {out:?}");
        for piece in ["QZ1", "QZ2", "QZ3"] {
            assert!(!out.stderr.contains(piece), "{url}: {piece} in {out:?}");
        }
    }
}

#[test]
fn local_store_url_with_a_host_is_rejected_with_64_and_the_spellings_that_work() {
    let cli = Cli::new("bad-local-host");
    let out = Out::from(
        cli.bare(&[
            "--store",
            "local://srv/locks",
            "run",
            "k",
            "--",
            "touch",
            "ran",
        ])
        .output()
        .unwrap(),
    )
    .expect(64);
    let said = "write local:/srv/locks or local:///srv/locks";
    assert!(out.stderr.contains(said), "{out:?}");
    assert!(!cli.exists("ran"), "the command ran");
    assert!(
        !cli.exists("srv"),
        "a store was made at the relative path srv/locks"
    );
}

#[test]
fn local_store_url_with_three_slashes_is_an_absolute_directory() {
    let cli = Cli::new("local-abs");
    let dir = cli.work.join("abs-store");
    let url = format!("local://{}", dir.display());
    let (mut hold, _) = {
        let mut cmd = cli.bare(&["--store", &url, "hold", "k"]);
        cmd.current_dir(&cli.home);
        let mut proc = cli.start("hold", cmd);
        let token = proc.wait_for_line("hold to print its token");
        (proc, token)
    };
    // The same lock, seen through the plain spelling from another directory.
    let plain = format!("local:{}", dir.display());
    let out = Out::from(
        cli.bare(&["--store", &plain, "status", "k"])
            .output()
            .unwrap(),
    );
    assert!(out.expect(0).stdout.contains("held"));
    hold.signal(libc::SIGTERM);
    hold.expect_exit(0);
}

#[test]
fn memory_store_is_refused_by_the_commands_that_share_locks_between_processes() {
    let cli = Cli::new("memory-refused");
    for args in [
        &["run", "k", "--", "touch", "ran"][..],
        &["hold", "k"],
        &["status", "k"],
        &["list"],
        &["release", "--force", "k"],
    ] {
        let out = Out::from(
            cli.bare(&[&["--store", "memory:"][..], args].concat())
                .output()
                .unwrap(),
        );
        let out = out.expect(64);
        assert!(
            out.stderr.contains("memory:") && out.stderr.contains("local:"),
            "{args:?}: {out:?}"
        );
        let from_env = cli
            .bare(args)
            .env("LEASEHOLD_STORE", "memory:")
            .output()
            .unwrap();
        Out::from(from_env).expect(64);
    }
    assert!(!cli.exists("ran"), "the command ran on a memory: store");
}

#[test]
fn store_under_a_regular_file_is_rejected_with_64() {
    rejects(
        "bad-store-file",
        &["--store", "local:/etc/hostname/x", "k"],
        "local:/etc/hostname/x",
    );
}

#[test]
fn store_dir_that_is_a_regular_file_is_rejected_with_64() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let store = format!("local:{}", file.path().display());
    rejects("bad-store-is-file", &["--store", &store, "k"], &store);
}

#[test]
fn permits_out_of_range_are_rejected_with_64_and_the_range() {
    for (label, n) in [("bad-permits", "0"), ("huge-permits", "99999999999")] {
        rejects(label, &["--permits", n, "k"], "1 to 100000 permits");
    }
}

#[test]
fn empty_owner_is_rejected_with_64() {
    rejects("bad-owner", &["--owner", "", "k"], "owner");
}

#[test]
fn run_without_a_command_is_rejected_with_64() {
    let cli = Cli::new("bad-nocmd");
    let out = cli.run(&["run", "k"]).expect(64);
    assert!(out.stderr.contains("COMMAND"), "{out:?}");
    assert_eq!(cli.list(""), Vec::<Value>::new());
}
