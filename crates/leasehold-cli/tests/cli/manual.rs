//! Completions and the manual.

use super::*;

#[test]
fn bash_completions_pass_bash_n_and_every_shell_gets_a_script() {
    let cli = Cli::new("completions");
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = Out::from(cli.bare(&["completions", shell]).output().unwrap()).expect(0);
        for word in ["leasehold", "conflict-exit-code", "status"] {
            assert!(out.stdout.contains(word), "{shell}: no {word:?}");
        }
        fs::write(cli.path(&format!("leasehold.{shell}")), &out.stdout).unwrap();
    }
    let checked = cli
        .process("bash")
        .args(["-n", "leasehold.bash"])
        .output()
        .unwrap();
    Out::from(checked).expect(0);
    cli.run(&["completions", "tcsh"]).expect(64);
}

/// `man -l FILE` in the work directory, formatted for a plain 80-column terminal.
fn man_page(cli: &Cli, file: &str) -> Out {
    let out = cli
        .process("man")
        .args(["-l", file])
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "80")
        .env("LC_ALL", "C.UTF-8")
        .output()
        .expect("man (Debian package man-db; ./scripts/test installs it)");
    Out::from(out).expect(0)
}

#[test]
fn the_manual_renders_with_man_l_for_leasehold_and_each_command() {
    let cli = Cli::new("man");
    let page = Out::from(cli.bare(&["man"]).output().unwrap()).expect(0);
    fs::write(cli.path("leasehold.1"), &page.stdout).unwrap();
    let shown = man_page(&cli, "leasehold.1").stdout;
    for part in [
        "NAME",
        "SYNOPSIS",
        "leasehold-run(1)",
        "Exit status",
        "--store",
    ] {
        assert!(
            shown.contains(part),
            "no {part:?} in leasehold(1):\n{shown}"
        );
    }
    let run = Out::from(cli.bare(&["man", "run"]).output().unwrap()).expect(0);
    fs::write(cli.path("leasehold-run.1"), &run.stdout).unwrap();
    let shown = man_page(&cli, "leasehold-run.1").stdout;
    for part in [
        "leasehold-run",
        "--conflict-exit-code",
        "--grace",
        "LEASEHOLD_TOKEN",
    ] {
        assert!(
            shown.contains(part),
            "no {part:?} in leasehold-run(1):\n{shown}"
        );
    }
    let out = cli.run(&["man", "torture-worker"]).expect(64);
    assert!(out.stderr.contains("run, hold, status"), "{out:?}");
}

/// Output that cannot be written (a full disk here; a reader gone is the same error) is
/// a clean error, exit 70, not a panic, for every command that prints.
#[test]
fn output_that_cannot_be_written_is_an_error_not_a_panic() {
    let cli = Cli::new("full-stdout");
    let commands: [&[&str]; 7] = [
        &["status", "k"],
        &["leader", "k"],
        &["leader", "k", "--watch", "--json"],
        &["status", "k", "--json"],
        &["list"],
        &["limit", "k", "--rate", "10/s", "--check"],
        &["completions", "bash"],
    ];
    for args in commands {
        let full = fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = cli.cmd(args).stdout(full).output().expect("run leasehold");
        let out = Out::from(out).expect(70);
        assert!(
            out.stderr.contains("cannot write to standard output")
                && !out.stderr.contains("panicked"),
            "{args:?}: {out:?}"
        );
    }
}
