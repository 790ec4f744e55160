//! Faults on the local store.

use super::*;

#[test]
fn holder_killed_with_sigkill_frees_the_lock_long_before_its_lease_ends() {
    // A one-hour lease: only the dead-process reclaim can free it within the test.
    killed_holder_is_taken_over_with_a_higher_token(&Cli::new("kill9"), "1h");
}

/// `leasehold` killed with SIGKILL takes its command's whole process group with it, what
/// the command started included (the kernel's parent-death signal reaches only the
/// command's first process): nothing of the job runs on once the lock is free.
#[test]
fn holder_killed_with_sigkill_takes_what_its_command_started_with_it() {
    let cli = Cli::new("kill9-group");
    let script = "sleep 1000 & echo $! > background.pid; wait";
    let holder = cli.spawn("holder", &["run", "k", "--", "sh", "-c", script]);
    let background = PidGuard(read_pid(&cli, "background.pid"));
    holder.signal(libc::SIGKILL);
    wait_for("the command's background process to be killed", || {
        !pid_alive(background.0)
    });
    cli.run(&["run", "--no-wait", "k", "--", "true"]).expect(0);
    drop(holder);
}

/// `leasehold run` itself stopped (SIGSTOP: a stalled host, a frozen VM), its command
/// not: the watchdog knows the lease's safe deadline and kills the command's group then,
/// so it is gone before the next holder starts. Resumed, `leasehold` finds the lock lost
/// and exits 76. (Before, the command ran on beside the next holder.)
#[test]
fn a_stalled_leasehold_has_its_command_stopped_at_the_safe_deadline() {
    let cli = Cli::new("stalled");
    let script = "echo $$ > child.pid; exec sleep 1000";
    let mut holder = cli.spawn(
        "holder",
        &["run", "--ttl", "2s", "k", "--", "sh", "-c", script],
    );
    let child = PidGuard(read_pid(&cli, "child.pid"));
    holder.signal(libc::SIGSTOP);
    // Once it has the lock: is the first command still running? (A zombie, waiting for
    // the stopped `leasehold` to reap it, is not.)
    let verdict = r#"state=$(cut -d' ' -f3 "/proc/$(cat child.pid)/stat" 2>/dev/null)
        case "$state" in ""|Z) echo gone ;; *) echo "running ($state)" ;; esac > verdict"#;
    cli.run(&["run", "k", "--", "sh", "-c", verdict]).expect(0);
    assert_eq!(cli.read("verdict").trim(), "gone");
    holder.signal(libc::SIGCONT);
    holder.expect_exit(76);
    drop(child);
}

/// After a command that ends normally, `leasehold` exits and leaves alone what the command
/// left running in the background (as `flock` does); only a `leasehold` that dies without
/// exiting has its command's group killed.
#[test]
fn a_normal_exit_leaves_the_commands_background_processes_alone() {
    let cli = Cli::new("leftover");
    let script = "sleep 1000 > /dev/null 2>&1 & echo $! > background.pid";
    let name = "a-lock-only-this-test-uses";
    cli.run(&["run", name, "--", "sh", "-c", script]).expect(0);
    let background = PidGuard(read_pid(&cli, "background.pid"));
    // The watchdog is a fork of `leasehold`, with its command line; once it is gone it
    // can no longer kill anything.
    wait_for("no leasehold process of this test to be left", || {
        processes_whose_command_line_has(name).is_empty()
    });
    assert!(pid_alive(background.0), "the background process was killed");
    drop(background);
}

/// Pids of live processes whose command line contains `text`.
fn processes_whose_command_line_has(text: &str) -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid_alive(pid))
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|line| String::from_utf8_lossy(&line).contains(text))
        })
        .collect()
}

#[test]
fn holder_paused_past_its_ttl_stops_its_command_and_exits_76_when_resumed() {
    paused_holder_loses_the_lock_and_exits_76(&Cli::new("sigstop"));
}

/// A lock file deleted under its holder (a temp cleaner, someone tidying the store's
/// folder) is a store that forgot the lock: the next process finds it free, and the
/// holder finds its lease gone at its next renewal and stops its command (76) rather
/// than renewing it in the deleted file, unseen.
#[test]
fn a_holder_whose_lock_file_was_deleted_stops_its_command_and_exits_76() {
    let cli = Cli::new("deleted-file");
    let script = "touch started; exec sleep 1000";
    let mut holder = cli.spawn(
        "holder",
        &["run", "--ttl", "1s", "k", "--", "sh", "-c", script],
    );
    wait_for("the holder's command to start", || cli.exists("started"));
    let store = cli.store.strip_prefix("local:").unwrap();
    fs::remove_file(PathBuf::from(store).join("locks/k.lock")).unwrap();
    cli.run(&["run", "--no-wait", "k", "--", "true"]).expect(0);
    holder.expect_exit(76);
    let said = fs::read_to_string(cli.path("holder.stderr")).unwrap();
    assert!(said.contains("lost"), "{said}");
}

/// The whole `locks/` folder deleted under a holder and a waiter (with the default TTL,
/// so no renewal is due): the waiter is woken and granted the lock in the folder made
/// again, and the holder stops its command (76). The waiter used to wait for good.
#[test]
fn a_waiter_whose_store_folder_was_deleted_gets_the_lock() {
    let cli = Cli::new("deleted-folder");
    let script = "touch started; exec sleep 1000";
    let mut holder = cli.spawn("holder", &["run", "k", "--", "sh", "-c", script]);
    wait_for("the holder's command to start", || cli.exists("started"));
    let mut waiter = cli.spawn("waiter", &["run", "k", "--", "touch", "got"]);
    wait_for("the waiter to queue", || cli.waiters("k").len() == 1);
    let store = cli.store.strip_prefix("local:").unwrap();
    // The processes using the store make the folder again at once, so the removal may
    // find it not empty: what matters is that the lock's file went.
    let _ = fs::remove_dir_all(PathBuf::from(store).join("locks"));
    waiter.expect_exit(0);
    assert!(cli.exists("got"));
    holder.expect_exit(76);
}

/// Asking about a lock never used (`status`, `release --force`) leaves no file behind.
#[test]
fn reading_a_lock_never_used_makes_no_file() {
    let cli = Cli::new("read-only");
    let out = cli.run(&["status", "never-used"]).expect(0);
    assert!(out.stdout.contains("never-used: free"), "{out:?}");
    cli.run(&["release", "--force", "never-used"]).expect(0);
    let store = cli.store.strip_prefix("local:").unwrap();
    let file = PathBuf::from(store).join("locks/never-used.lock");
    assert!(!file.exists(), "{} was made", file.display());
}

/// Looking at a store whose directory does not exist (a mistyped path) answers from an
/// empty store, and makes no directory there.
#[test]
fn looking_at_a_store_that_does_not_exist_makes_no_directory() {
    let cli = Cli::new("no-store");
    let missing = cli.path("no/such/store");
    let url = format!("local:{}", missing.display());
    let look = |args: &[&str]| {
        let mut all = vec!["--store", &url];
        all.extend_from_slice(args);
        Out::from(cli.bare(&all).output().unwrap()).expect(0)
    };
    assert_eq!(look(&["status", "k"]).stdout.trim(), "k: free");
    assert_eq!(look(&["list"]).stdout.trim(), "no locks held or awaited");
    assert_eq!(
        look(&["leader", "k"]).stdout.trim(),
        "election \"k\": no leader"
    );
    look(&["release", "--force", "k"]);
    assert!(!cli.path("no").exists(), "{} was made", missing.display());
}

#[test]
fn corrupt_lock_state_gives_a_clear_error_and_runs_nothing() {
    let cli = Cli::new("corrupt");
    cli.run(&["run", "k", "--", "true"]).expect(0);
    let store = cli.store.strip_prefix("local:").unwrap();
    let file = PathBuf::from(store).join("locks/k.lock");
    fs::write(&file, b"this is not a lock record").unwrap();
    let out = cli.run(&["run", "k", "--", "touch", "ran"]).expect(70);
    assert!(
        out.stderr.contains("unreadable state") && out.stderr.contains("k.lock"),
        "{}",
        out.stderr
    );
    assert!(!cli.exists("ran"), "the command ran on a corrupt lock");
    cli.run(&["status", "k"]).expect(70);
    // `list` does not hide it either, and names the lock and its file.
    let out = cli.run(&["list"]).expect(70);
    assert!(
        out.stderr.contains("lock \"k\"") && out.stderr.contains("k.lock"),
        "{}",
        out.stderr
    );
}

#[test]
fn verbose_run_logs_acquire_and_release_and_very_verbose_each_renewal() {
    let cli = Cli::new("verbose");
    let renewing = ["run", "--ttl", "300ms", "k", "--", "sleep", "0.5"];
    let out = cli.run(&[&["-v"][..], &renewing].concat()).expect(0);
    for event in ["acquired", "released"] {
        assert!(
            out.stderr.contains(event),
            "no {event:?} in -v output: {}",
            out.stderr
        );
    }
    assert!(!out.stderr.contains("renewed"), "-v: {}", out.stderr);
    let out = cli.run(&[&["-vv"][..], &renewing].concat()).expect(0);
    assert!(out.stderr.contains("renewed"), "-vv: {}", out.stderr);
    let quiet = cli.run(&["run", "k", "--", "true"]).expect(0);
    assert!(
        quiet.stderr.is_empty(),
        "output without -v: {}",
        quiet.stderr
    );
}

#[test]
fn waiting_shows_the_holder_on_a_terminal_and_nothing_on_a_pipe() {
    let cli = Cli::new("progress");
    let (_holder, _) = cli.hold("holder", &["--owner", "web-3", "k"]);
    // `script` (util-linux) gives the command a pseudo-terminal.
    let command = format!("{BIN} --store {} run --wait 300ms k -- true", cli.store);
    let mut on_tty = cli.process("script");
    on_tty.args(["-qec", &command, "/dev/null"]);
    let out = Out::from(on_tty.output().expect("run script"));
    assert_eq!(out.code, Some(75), "{out:?}");
    assert!(
        out.stdout.contains("waiting for lock \"k\"; held by web-3"),
        "no progress line on the terminal: {out:?}"
    );
    let piped = cli
        .run(&["run", "--wait", "300ms", "k", "--", "true"])
        .expect(75);
    assert!(
        !piped.stderr.contains("waiting for lock"),
        "{}",
        piped.stderr
    );
    assert!(
        piped.stderr.contains("is held by web-3"),
        "{}",
        piped.stderr
    );
}

#[test]
fn fair_waiters_in_separate_processes_get_the_lock_in_arrival_order() {
    let cli = Cli::new("fifo");
    let (mut holder, _) = cli.hold("holder", &["--fair", "k"]);
    let mut waiters = Vec::new();
    for i in 0..4 {
        let script = format!("echo {i} >> order");
        waiters.push(cli.spawn(
            &format!("w{i}"),
            &["run", "--fair", "k", "--", "sh", "-c", &script],
        ));
        cli.wait_waiters("k", i + 1);
    }
    holder.signal(libc::SIGTERM);
    holder.expect_exit(0);
    for w in &mut waiters {
        w.expect_exit(0);
    }
    assert_eq!(cli.read("order"), "0\n1\n2\n3\n");
}

#[test]
fn a_waiter_stopped_by_sigint_leaves_the_fair_queue_before_it_exits() {
    let cli = Cli::new("interrupted-waiter");
    interrupted_waiter_leaves_the_queue(&cli, libc::SIGINT, &["--fair"]);
}

/// Runs of another name started in parallel inside a run's command are holders of their
/// own and exclude one another (they used to inherit the outer run's owner, re-enter each
/// other and run together with one token). A run of the outer name still re-enters it,
/// also through a run of another name in between.
#[test]
fn parallel_runs_of_another_name_inside_a_run_exclude_each_other() {
    let cli = Cli::new("nested-names");
    let job = r#"$LH run inner -- sh -c 'echo $LEASEHOLD_TOKEN >> tokens
        mkdir inside 2>/dev/null || echo overlap >> overlaps; sleep 0.2; rmdir inside'"#;
    let jobs = format!("for i in 1 2 3; do {job} & done; wait");
    cli.run(&["run", "outer", "--", "sh", "-c", &jobs])
        .expect(0);
    assert!(!cli.exists("overlaps"), "inner runs overlapped");
    let mut tokens: Vec<String> = cli.read("tokens").lines().map(String::from).collect();
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "inner runs shared a token: {tokens:?}");
    // outer -> other -> outer: the innermost re-enters outer instead of waiting for it.
    let chain = "$LH run other -- $LH run --no-wait outer -- touch reentered";
    cli.run(&["run", "outer", "--", "sh", "-c", chain])
        .expect(0);
    assert!(cli.exists("reentered"));
}

/// Ctrl-Z stops `run` with its command, so the shell shows its prompt (the job stopped,
/// 148), and `fg` continues both: the command goes on under the lock and `run` ends with
/// its status. (A shell with job control, on a pseudo-terminal from `script`.)
#[test]
fn ctrl_z_stops_run_with_its_command_and_fg_continues_both() {
    let cli = Cli::new("ctrl-z");
    let job = format!(
        "set -m\n{BIN} --store {} run k -- sh -c 'kill -TSTP $$; echo resumed'\n\
         echo status=$?\nfg\necho fg=$?\n",
        cli.store
    );
    fs::write(cli.path("job.sh"), job).unwrap();
    let mut shell = cli.process("script");
    shell.args(["-qec", "bash --norc --noprofile job.sh", "/dev/null"]);
    let mut shell = cli.start("shell", shell);
    assert_eq!(shell.exit_code(), 0, "stderr: {}", shell.stderr());
    let out = shell.stdout();
    let at = |text: &str| {
        out.find(text)
            .unwrap_or_else(|| panic!("no {text:?} in {out:?}"))
    };
    assert!(
        at("status=148") < at("resumed") && at("resumed") < at("fg=0"),
        "{out:?}"
    );
}

/// A command stopped by SIGTSTP (no terminal here) still ends when `run` is told to
/// stop: the signal passed on to it comes with a SIGCONT, rather than waiting pending
/// while `run` waits for the command.
#[test]
fn a_stopped_command_gets_the_signal_run_passes_on() {
    let cli = Cli::new("stopped-hup");
    let mut run = cli.spawn(
        "run",
        &["run", "k", "--", "sh", "-c", "echo $$; exec sleep 60"],
    );
    let pid: i32 = run.wait_for_line("the command's pid").parse().unwrap();
    send_signal(pid, libc::SIGTSTP);
    wait_until("the command to stop", PATIENCE, || {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .next();
        (state == Some("T")).then_some(())
    });
    run.signal(libc::SIGHUP);
    assert_eq!(run.exit_code(), 128 + libc::SIGHUP);
}
