//! `fence`: a fencing check for shell scripts, against a token file.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use leasehold::{FencingToken, FileFence};

use crate::exit::{self, Failure};

// Flags of `fence`.
#[derive(Debug, Args)]
pub struct FenceArgs {
    /// The fence file: the highest token admitted (created if missing)
    pub file: PathBuf,

    /// The token to admit [default: $LEASEHOLD_TOKEN, as `leasehold run` sets it]
    #[arg(long, value_name = "N", value_parser = parse_token)]
    pub token: Option<u64>,

    /// Forget every token admitted (when moving the lock to another store, with no
    /// holder running); takes no token
    #[arg(long, conflicts_with_all = ["token", "command"])]
    pub reset: bool,

    /// Run this while holding the fence file, after `--`, if the token is admitted
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

pub const FENCE_USAGE: &str = "\
leasehold fence [--token N] FILE [-- COMMAND...]
       leasehold fence --reset FILE";

pub const FENCE_AFTER_HELP: &str = "\
Admits the token if it is at least the highest one the file has admitted (and records
it), else exits 76: a newer holder of the lock has written, so this one must not. With
a COMMAND, becomes it (exec), the file's lock (flock) held until it and what inherits
the file exit, so that the check and the write are one step against every other user of
the fence; the exit status is the command's.

Examples:
  leasehold run report -- sh -c 'make-report > new && leasehold fence /srv/report.fence -- mv new /srv/report'
  leasehold fence /srv/report.fence --token 42
  leasehold fence /srv/report.fence --reset";

/// `leasehold fence FILE [--token N] [-- COMMAND]`, or `--reset`.
pub fn fence(args: FenceArgs) -> Result<ExitCode, Failure> {
    let io = |e: std::io::Error| {
        use std::io::ErrorKind as K;
        // A path that cannot be a fence file is the caller's to fix; a failing disk is not.
        let code = match e.kind() {
            K::NotFound | K::PermissionDenied | K::IsADirectory | K::NotADirectory => exit::USAGE,
            _ => exit::INTERNAL,
        };
        Failure::new(code, format!("fence {}: {e}", args.file.display()))
    };
    // Before the token is admitted: a command that cannot run must not move the fence.
    crate::child::must_exist(&args.command)?;
    let mut fence = FileFence::lock(&args.file).map_err(io)?;
    if args.reset {
        fence.reset().map_err(io)?;
        return Ok(ExitCode::SUCCESS);
    }
    let token = match args.token {
        Some(token) => token,
        None => from_env()?,
    };
    if !fence.admit(FencingToken(token)).map_err(io)? {
        let message =
            format!(
            "token {token} is older than {}, which {} has admitted: a newer holder has written{}",
            fence.highest(),
            args.file.display(),
            if args.command.is_empty() { "" } else { "; not running the command" }
        );
        return Err(Failure::new(exit::LOST, message).named(exit::LOST));
    }
    if args.command.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    // The command replaces this process and keeps the fence file open (so locked) until
    // it and whatever inherits the file have exited: a signal to it, or its death, cannot
    // let a stale holder in while it still writes.
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    // SAFETY: plain fcntl on a descriptor `fence` owns.
    unsafe { libc::fcntl(fence.as_raw_fd(), libc::F_SETFD, 0) };
    let failed = std::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .exec();
    Err(crate::child::spawn_failure(&args.command[0], failed))
}

/// `$LEASEHOLD_TOKEN`, as a token.
/// A fencing token: a whole number, as `leasehold run` gives it (`LEASEHOLD_TOKEN`).
fn parse_token(text: &str) -> Result<u64, String> {
    text.trim().parse().map_err(|_| {
        format!(
            "{text:?} is not a fencing token: a whole number from 0 to {}, as LEASEHOLD_TOKEN gives it",
            u64::MAX
        )
    })
}

fn from_env() -> Result<u64, Failure> {
    let text = std::env::var("LEASEHOLD_TOKEN").map_err(|_| {
        Failure::new(
            exit::USAGE,
            "no --token and no LEASEHOLD_TOKEN: run it under `leasehold run`, or give --token",
        )
    })?;
    parse_token(&text).map_err(|why| Failure::new(exit::USAGE, format!("LEASEHOLD_TOKEN: {why}")))
}
