//! Who can touch the local store: the default store is its user's alone, a store shared
//! on purpose keeps its group's access and nobody else's, and a file lock held by a
//! stranger cannot stall `leasehold` past a bound.

mod support;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use support::*;

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().mode() & 0o7777
}

/// Whether the user `nobody` can open `path` for reading.
fn nobody_can_read(path: &Path) -> bool {
    Command::new("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "cat"])
        .arg(path)
        .output()
        .expect("setpriv (util-linux)")
        .status
        .success()
}

#[test]
fn the_default_store_is_private_to_its_user() {
    let cli = Cli::new("default-private");
    let state = cli.home.join("state");
    let store = state.join("leasehold");
    // As an older version left it: readable by everyone.
    fs::create_dir_all(store.join("locks")).unwrap();
    fs::set_permissions(&state, fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(&store, fs::Permissions::from_mode(0o755)).unwrap();
    fs::set_permissions(store.join("locks"), fs::Permissions::from_mode(0o755)).unwrap();
    let old = store.join("locks/old.lock");
    fs::write(&old, "").unwrap();
    fs::set_permissions(&old, fs::Permissions::from_mode(0o644)).unwrap();
    let run = |name: &str| {
        let mut cmd = cli.bare(&["run", name, "--", "true"]);
        cmd.env_remove("LEASEHOLD_HOME")
            .env("XDG_STATE_HOME", &state);
        Out::from(cmd.output().unwrap()).expect(0);
    };
    run("new");
    run("old");
    assert_eq!(mode(&store), 0o700);
    assert_eq!(mode(&store.join("locks")) & 0o077, 0);
    assert_eq!(mode(&store.join("locks/new.lock")), 0o600);
    assert_eq!(
        mode(&old) & 0o077,
        0,
        "an old lock file stays readable by others"
    );
    // Everything above the store lets others pass: the store's own modes must stop them.
    for dir in [cli.home.parent().unwrap(), &cli.home] {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).unwrap();
    }
    assert!(nobody_can_read(Path::new("/etc/hostname")), "setpriv works");
    assert!(!nobody_can_read(&store.join("locks/new.lock")));
    assert!(!nobody_can_read(&old));
}

#[test]
fn a_store_shared_with_a_group_keeps_the_group_and_nobody_else() {
    let cli = Cli::new("group-shared");
    let shared = cli.home.join("shared");
    fs::create_dir(&shared).unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o2770)).unwrap();
    let url = format!("local:{}", shared.display());
    let mut cmd = cli.bare(&["--store", &url, "run", "k", "--", "true"]);
    Out::from(cmd.output().unwrap()).expect(0);
    assert_eq!(mode(&shared.join("locks")) & 0o777, 0o770);
    assert_eq!(mode(&shared.join("locks/k.lock")), 0o660);
    let limited = cli.bare(&["--store", &url, "limit", "r", "--rate", "1/s", "--check"]);
    Out::from({ limited }.output().unwrap()).expect(0);
    assert_eq!(
        mode(&shared.join("limits")) & 0o777,
        0o770,
        "under umask 022"
    );

    // Another user of the group takes the same lock and a limiter of its own. (It was
    // shut out by a probe file the first process left, its own only.)
    for dir in [cli.home.parent().unwrap(), &cli.home] {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let group = format!("--regid={}", fs::metadata(&shared).unwrap().gid());
    let as_other = |args: &[&str]| {
        // The test's environment (its home, its store's settings), as another user.
        let cmd = cli.bare(&[]);
        let setpriv = [
            "--reuid=nobody",
            &group,
            "--clear-groups",
            BIN,
            "--store",
            &url,
        ];
        let mut other = Command::new("setpriv");
        other.args(setpriv).args(args).current_dir(&shared);
        other.envs(cmd.get_envs().filter_map(|(k, v)| Some((k, v?))));
        Out::from(other.output().expect("setpriv (util-linux)"))
    };
    as_other(&["run", "k", "--", "true"]).expect(0);
    as_other(&["limit", "r2", "--rate", "1/s", "--check"]).expect(0);

    // A file the group lost access to: a configuration to fix (78), named for what it
    // is, not a store that is away (69) nor a "lock" for a rate limiter.
    for (file, args, named) in [
        (
            "locks/k.lock",
            &["run", "k", "--", "true"][..],
            "lock \"k\"",
        ),
        (
            "limits/r.lock",
            &["limit", "r", "--rate", "1/s", "--check"][..],
            "rate limiter \"r\"",
        ),
    ] {
        let file = shared.join(file);
        assert!(file.exists(), "{}", file.display());
        fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).unwrap();
        let out = as_other(args).expect(78);
        assert!(
            out.stderr.contains(named) && out.stderr.contains("check the owner and mode"),
            "{}",
            out.stderr
        );
    }

    // A directory its group may only read (as `mkdir` makes it) is not shared.
    let own = cli.home.join("own");
    fs::create_dir(&own).unwrap();
    fs::set_permissions(&own, fs::Permissions::from_mode(0o755)).unwrap();
    let url = format!("local:{}", own.display());
    let mut cmd = cli.bare(&["--store", &url, "run", "k", "--", "true"]);
    Out::from(cmd.output().unwrap()).expect(0);
    assert_eq!(mode(&own.join("locks")) & 0o777, 0o700);
    assert_eq!(mode(&own.join("locks/k.lock")), 0o600);
}

/// Another process holds the lock file's `flock` for a minute (a stranger, or anything
/// that opened the file): `leasehold` gives up after about a second, exit 69, and names
/// that process, instead of blocking for as long as the stranger likes. (Without the
/// bound it ran after the minute, exit 0.)
#[test]
fn a_file_lock_held_by_a_stranger_cannot_stall_a_bounded_wait() {
    let cli = Cli::new("stuck-flock");
    cli.run(&["run", "k", "--", "true"]).expect(0);
    let file = cli.store.strip_prefix("local:").unwrap().to_string() + "/locks/k.lock";
    let mut stranger = Command::new("flock");
    stranger
        .args(["-x", &file, "sh", "-c", "touch locked; exec sleep 60"])
        .current_dir(&cli.work);
    let stranger = cli.start("stranger", stranger);
    cli.wait_file("locked");
    let out = cli
        .run(&["run", "--wait", "2s", "k", "--", "true"])
        .expect(69);
    assert!(
        out.stderr.contains(&format!("process {}", stranger.pid()))
            && out.stderr.contains("file lock"),
        "{}",
        out.stderr
    );
}
