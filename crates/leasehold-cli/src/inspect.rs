//! `status`, `list` and `release --force`.

use std::process::ExitCode;
use std::time::SystemTime;

use clap::Args;
use leasehold::{humanize, Leasehold, LockKind, LockState};

use crate::exit::{self, Failure};

// Flags of `status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Lock name
    pub name: String,
    /// One JSON object on stdout
    #[arg(long)]
    pub json: bool,
}

// Flags of `list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only locks whose names start with this
    #[arg(default_value = "")]
    pub prefix: String,
    /// One JSON array on stdout
    #[arg(long)]
    pub json: bool,
}

// Flags of `release`.
#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// Lock name
    pub name: String,
    /// Required: frees the lock whoever holds it; the holder's guard reports it lost
    /// (`leasehold run` stops its command and exits 76). The next waiter gets the lock
    /// at once, while the old command may still be running out its --grace: use it on
    /// a holder that is stuck or gone, and fence what the lock protects
    /// ($LEASEHOLD_TOKEN)
    #[arg(long)]
    pub force: bool,
    /// One JSON line on stdout: whether it was held; errors as JSON on stderr
    #[arg(long)]
    pub json: bool,
}

async fn connect(store: Option<&str>, command: &str) -> Result<Leasehold, Failure> {
    Ok(Leasehold::from_store(
        crate::args::open_to_look(store, command).await?,
    ))
}

fn ago(t: SystemTime) -> String {
    humanize(SystemTime::now().duration_since(t).unwrap_or_default())
}

/// What `status` and `list` print of one lock.
fn state_text(s: &LockState) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let state = if s.holders.is_empty() { "free" } else { "held" };
    // 0: never held, or (etcd, which keeps no counter per name) nobody holds it now.
    let _ = match s.last_token.get() {
        0 => writeln!(out, "{}: {state}", s.name),
        token => writeln!(out, "{}: {state} (last token {token})", s.name),
    };
    for h in &s.holders {
        let holds = if h.holds > 1 {
            format!(", {} holds", h.holds)
        } else {
            String::new()
        };
        // An election's leader: the value it campaigned with (or proclaimed).
        let value = match &h.value {
            Some(v) => format!(", value {v:?}"),
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "  holder  {} on {} pid {}: token {}, {} for {}, lease left {}{holds}{value}",
            h.owner,
            h.host,
            h.pid,
            h.token,
            kind(h.kind),
            ago(h.since),
            humanize(h.lease_left)
        );
    }
    for (i, w) in s.waiters.iter().enumerate() {
        let _ = writeln!(
            out,
            "  waiter {}  {} on {} pid {}: {} for {}",
            i + 1,
            w.owner,
            w.host,
            w.pid,
            kind(w.kind),
            ago(w.since)
        );
    }
    out
}

/// `exclusive`, `shared`, or `permit of N` (a semaphore's size).
fn kind(kind: LockKind) -> String {
    match kind {
        LockKind::Permit { permits } => format!("permit of {permits}"),
        other => other.word().to_string(),
    }
}

fn json<T: serde::Serialize>(value: &T) -> Result<(), Failure> {
    let text =
        serde_json::to_string(value).map_err(|e| Failure::new(exit::INTERNAL, e.to_string()))?;
    exit::print(&format!("{text}\n"))
}

/// `leasehold status NAME`.
pub async fn status(store: Option<&str>, args: StatusArgs) -> Result<ExitCode, Failure> {
    let locks = connect(store, "status").await?;
    let state = locks.describe(args.name.as_str()).await?;
    // What a restart of the store can lose: with the lock's state, where one looks.
    let caveat = locks.store().caveat();
    if args.json {
        let mut value = serde_json::to_value(&state)
            .map_err(|e| Failure::new(exit::INTERNAL, e.to_string()))?;
        if let Some(caveat) = caveat {
            value["store_caveat"] = caveat.into();
        }
        json(&value)?;
    } else {
        let mut text = state_text(&state);
        if let Some(caveat) = caveat {
            text.push_str(&format!("  store: {caveat}\n"));
        }
        exit::print(&text)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `leasehold list [PREFIX]`.
pub async fn list(store: Option<&str>, args: ListArgs) -> Result<ExitCode, Failure> {
    let locks = connect(store, "list").await?;
    let states = locks.list(&args.prefix).await?;
    if args.json {
        json(&states)?;
    } else if states.is_empty() {
        exit::print("no locks held or awaited\n")?;
    } else {
        exit::print(&states.iter().map(state_text).collect::<String>())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `leasehold release --force NAME`.
pub async fn release(store: Option<&str>, args: ReleaseArgs) -> Result<ExitCode, Failure> {
    if !args.force {
        return Err(Failure::new(
            exit::USAGE,
            format!(
                "release frees lock \"{}\" from whoever holds it; say so with --force (holders release their own locks by exiting)",
                args.name
            ),
        ));
    }
    let locks = connect(store, "release").await?;
    let before = locks.describe(args.name.as_str()).await?;
    let was_held = locks.force_release(args.name.as_str()).await?;
    if args.json {
        crate::json::release(&args.name, was_held, &before)?;
    } else if was_held {
        let who: Vec<String> = before
            .holders
            .iter()
            .map(|h| format!("{} (pid {}, token {})", h.owner, h.pid, h.token))
            .collect();
        exit::print(&format!(
            "released \"{}\", held by {}\n",
            args.name,
            who.join(", ")
        ))?;
    } else {
        exit::print(&format!("\"{}\" was not held\n", args.name))?;
    }
    Ok(ExitCode::SUCCESS)
}
