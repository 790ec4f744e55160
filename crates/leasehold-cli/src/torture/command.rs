//! The critical section of a `leasehold run` worker (`torture --workers-as run`): the
//! command that `leasehold run` starts under the lock, as a user's command would be. It
//! takes its token from `$LEASEHOLD_TOKEN`, enters the resource (which logs the entry with
//! the token and its pid), does its role's accesses and goes out; the coordinator logs
//! every access, so the history shows what each command did and when.
//!
//! It never asks the lock anything: stopping it when the lock is lost is `run`'s job.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::history::Role;
use super::resource::{Client, Reply};
use super::worker::{critical, think};
use crate::exit::{self, Failure};

/// Exit status of a command whose access the resource refused (a stale token).
pub const REFUSED: u8 = 3;

// Arguments of the hidden `torture-command` command.
#[derive(Debug, Clone, Args)]
pub struct CommandArgs {
    /// The resource's address.
    #[arg(long)]
    pub resource: String,
    /// Who this is in the history (one `run` process).
    #[arg(long)]
    pub owner: String,
    /// exclusive, shared or permit.
    #[arg(long, value_parser = |w: &str| Role::from_word(w).ok_or("exclusive, shared or permit"))]
    pub role: Role,
    /// The lock's lease: think times are multiples of it.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// Seeds the think time.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Enters, works, goes out.
pub async fn command(args: CommandArgs) -> Result<ExitCode, Failure> {
    let token: u64 = std::env::var("LEASEHOLD_TOKEN")
        .ok()
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| {
            Failure::new(
                exit::USAGE,
                "LEASEHOLD_TOKEN is not set: run me under `leasehold run`",
            )
        })?;
    let mut resource = Client::connect(&args.resource, &args.owner)
        .await
        .map_err(|e| Failure::new(exit::UNAVAILABLE, format!("the resource: {e}")))?;
    let unavailable =
        |e: std::io::Error| Failure::new(exit::UNAVAILABLE, format!("the resource: {e}"));
    let role = args.role.word();
    let pid = std::process::id().to_string();
    let entered = resource
        .ask_words("ENTER", token, &[role, &pid])
        .await
        .map_err(unavailable)?;
    let done = match entered {
        // The run is ending: go out at once.
        Reply::Stop => true,
        _ => {
            let think = think(args.ttl, &mut StdRng::seed_from_u64(args.seed));
            critical(&mut resource, args.role, token, think, false)
                .await
                .map_err(unavailable)?
        }
    };
    resource
        .ask_words("EXIT", token, &[role])
        .await
        .map_err(unavailable)?;
    Ok(match done {
        true => ExitCode::SUCCESS,
        false => ExitCode::from(REFUSED),
    })
}
