//! The flags and values the commands share: durations, permits, owner ids, `--store`
//! and how long a bounded wait lets the store take.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use leasehold::url::Scheme;
use leasehold::{Leasehold, Lock, Store, StoreUrl};

use crate::exit::{self, Failure};

/// `--store`'s long help: the library's list of URL forms.
pub(crate) fn store_help() -> String {
    let mut help = "Store URL [default: local:]. One of:\n".to_string();
    for form in leasehold::url::URL_FORMS {
        help.push_str(&format!(
            "  {}\n      {}\n",
            form.form,
            form.store.replace('`', "")
        ));
    }
    help.push_str(
        "memory: is for bench: run, hold, status, list, release and torture refuse it. Without --store, \
the LEASEHOLD_STORE environment variable (empty: the default).",
    );
    help
}

// The lock flags `run`, `hold` share (a plain comment: see `Command`).
#[derive(Debug, Clone, Args)]
pub struct LockArgs {
    /// Lock name (1 to 256 bytes, no control characters)
    pub name: String,

    /// Lease length; renewed at about a third of it while held (100ms to 24h)
    #[arg(long, value_name = "DUR", default_value = "15s", value_parser = parse_duration, allow_hyphen_values = true)]
    pub ttl: Duration,

    /// Give up after waiting this long (exit 75, or --conflict-exit-code) [default: wait
    /// without limit]
    #[arg(short = 'w', long, value_name = "DUR", value_parser = parse_duration, allow_hyphen_values = true, conflicts_with = "no_wait")]
    pub wait: Option<Duration>,

    /// Do not wait: give up at once if the lock is busy (exit 75, or --conflict-exit-code)
    #[arg(short = 'n', long)]
    pub no_wait: bool,

    /// Exit status when the lock is busy with --no-wait or --wait runs out, as flock's -E
    /// (0 to 255; e.g. 0 for a cron job that skips quietly when another host runs it:
    /// with 0 nothing is printed, but with --json)
    #[arg(short = 'E', long, value_name = "N", default_value_t = exit::NOT_ACQUIRED,
          allow_hyphen_values = true, value_parser = parse_exit_code)]
    pub conflict_exit_code: u8,

    /// First come, first served: do not pass earlier waiters [default: on for etcd, off
    /// for the other stores]
    #[arg(long, overrides_with = "no_fair")]
    pub fair: bool,

    /// Not first come, first served: a release may go to any waiter (the fastest
    /// hand-off; on etcd, whose queue is its shape, waiters are still served in order)
    #[arg(long, overrides_with = "fair")]
    pub no_fair: bool,

    /// Make it a semaphore with N permits (everyone must use the same N)
    #[arg(
        long,
        value_name = "N",
        conflicts_with = "shared",
        allow_hyphen_values = true,
        value_parser = parse_permits
    )]
    pub permits: Option<u32>,

    /// Take a shared (read) lock; plain holders are writers
    #[arg(short = 's', long)]
    pub shared: bool,

    /// Owner id: holders with the same id re-enter instead of waiting [default: the
    /// owner of this NAME held by an enclosing `leasehold run` (LEASEHOLD_HELD), else
    /// LEASEHOLD_OWNER when not inside a run, else random]
    #[arg(long, value_name = "ID")]
    pub owner: Option<String>,

    /// Serve the library's metrics as Prometheus text over HTTP on ADDR (e.g.
    /// 127.0.0.1:9185) while it runs: acquisitions, waits, renewals, losses, releases
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,

    /// Set by `elect`: campaign for the election of NAME, publishing this value.
    #[arg(skip)]
    pub value: Option<String>,
}

/// The locks that enclosing `leasehold run`s hold for the command, one `NAME\tOWNER`
/// line each (names and owner ids have no control characters): a nested run of one of
/// those names re-enters it, and only of those names.
pub const HELD_VAR: &str = "LEASEHOLD_HELD";

/// The owner a run of `name` uses without `--owner`: the enclosing run's owner of that
/// name, if any; else `LEASEHOLD_OWNER` as the user set it (not inside a run, which sets
/// it for its own name only); else none (a fresh owner).
fn inherited_owner(name: &str) -> Option<String> {
    let held = std::env::var(HELD_VAR).unwrap_or_default();
    let enclosing = held.lines().find_map(|line| {
        let (held_name, owner) = line.split_once('\t')?;
        (held_name == name).then(|| owner.to_string())
    });
    let outside_a_run = std::env::var_os("LEASEHOLD_NAME").is_none();
    enclosing.or_else(|| {
        std::env::var("LEASEHOLD_OWNER")
            .ok()
            .filter(|owner| outside_a_run && !owner.is_empty())
    })
}

/// `LEASEHOLD_HELD` for a command run under `name` held by `owner`: the enclosing runs'
/// lines, and this one's unless it re-entered a lock they hold (its line is there).
pub fn held_with(name: &str, owner: &str) -> String {
    with_line(std::env::var(HELD_VAR).unwrap_or_default(), name, owner)
}

fn with_line(mut held: String, name: &str, owner: &str) -> String {
    let line = format!("{name}\t{owner}");
    if held.lines().any(|held_line| held_line == line) {
        return held;
    }
    if !held.is_empty() {
        held.push('\n');
    }
    held.push_str(&line);
    held
}

impl LockArgs {
    /// What messages call it: an election (a lock that carries a value) or a lock.
    pub fn noun(&self) -> &'static str {
        match self.value {
            Some(_) => "election",
            None => "lock",
        }
    }
    /// The lock handle these flags describe.
    pub fn lock(&self, locks: &Leasehold) -> Result<Lock, Failure> {
        let lock = match (self.permits, self.shared) {
            _ if self.value.is_some() => (locks.election(self.name.as_str())?)
                .candidate(self.value.clone().unwrap_or_default()),
            (Some(permits), _) => locks.semaphore(self.name.as_str(), permits)?,
            (None, true) => locks.read(self.name.as_str())?,
            (None, false) => locks.write(self.name.as_str())?,
        };
        let owner = (self.owner.clone())
            .or_else(|| inherited_owner(&self.name))
            .unwrap_or_else(random_owner);
        let lock = match (self.fair, self.no_fair) {
            (true, _) => lock.with_fair(true),
            (_, true) => lock.with_fair(false),
            _ => lock,
        };
        Ok(lock.with_ttl(self.ttl).with_owner(owner))
    }
}

/// The longest duration a flag takes: far beyond any sensible TTL, wait or grace, and
/// short enough that no deadline counted from now can overflow.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// A duration flag: `500ms`, `1m30s`, `2h` (humantime), or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    const EXAMPLES: &str = "give e.g. 30s, 500ms, 1m30s or 2h";
    // Flags take values that start with '-' so that `--ttl -5s` gets this message rather
    // than clap's advice to write `-- -5s`; a flag or `--` in the value's place too.
    if let Some(rest) = text.trim_start().strip_prefix('-') {
        if rest.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
            return Err(format!("a duration cannot be negative; {EXAMPLES}"));
        }
        return Err(format!(
            "the duration is missing ({text:?} is not one); {EXAMPLES}"
        ));
    }
    let too_long = || {
        format!(
            "{text:?} is too long: at most {}d",
            MAX_DURATION.as_secs() / 86_400
        )
    };
    // A bare number is digits with a fraction at most: not `1e3`, read as 1000 s by
    // someone who meant milliseconds.
    let bare = text.trim();
    let plain = bare.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && bare.bytes().any(|b| b.is_ascii_digit());
    let duration = match bare.parse::<f64>().ok().filter(|_| plain) {
        Some(secs) => Duration::try_from_secs_f64(secs).map_err(|_| too_long())?,
        None => humantime::parse_duration(text).map_err(|e| {
            use humantime::DurationError as E;
            match e {
                E::NumberOverflow => too_long(),
                E::Empty => format!("the duration is empty; {EXAMPLES}"),
                E::UnknownUnit { unit, .. } if !unit.is_empty() => format!(
                    "{text:?}: {unit:?} is not a unit (ms, s, m, h, d; also us, ns); {EXAMPLES}"
                ),
                _ => format!("{text:?} is not a duration; {EXAMPLES}"),
            }
        })?,
    };
    if duration > MAX_DURATION {
        return Err(too_long());
    }
    Ok(duration)
}

/// `-E N`: an exit status, said as one for any other input (`-1` too, which clap would
/// otherwise take for a flag and advise `-- -1`, where `--` starts the command).
pub fn parse_exit_code(text: &str) -> Result<u8, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("{text:?} is not an exit status: a whole number from 0 to 255"))
}

/// `--permits N`: a whole number from 1 to the library's limit, said as such for any
/// other input (clap's own message for a u32 names the type's range).
fn parse_permits(text: &str) -> Result<u32, String> {
    let max = leasehold::MAX_PERMITS;
    text.trim()
        .parse::<u32>()
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| format!("a semaphore has 1 to {max} permits"))
}

/// `pid-random`: unique, and readable in `status`.
fn random_owner() -> String {
    format!("{}-{:08x}", std::process::id(), rand::random::<u32>())
}

/// The URL `--store` gives (default: the local store's default directory), read.
pub fn store_url(url: Option<&str>) -> Result<StoreUrl, Failure> {
    StoreUrl::parse(url.unwrap_or("local:")).map_err(|e| {
        let failure = Failure::from(e);
        let message = format!("{} (from --store or LEASEHOLD_STORE)", failure.message);
        Failure { message, ..failure }
    })
}

/// Opens the store `--store` names (default: the local store's default directory).
pub async fn open_store(url: Option<&str>) -> Result<Arc<dyn Store>, Failure> {
    Ok(store_url(url)?.open().await?)
}

/// Opens `url` for work that [`within_wait`] bounds (`bound`, the wait): the client's own
/// connect timeout is set past that bound, so that the bound, and its message, is what
/// ends a connect to a store that does not answer, never the two at once.
pub async fn open_within(
    url: &StoreUrl,
    bound: Option<Duration>,
) -> leasehold::Result<Arc<dyn Store>> {
    let networked = matches!(url.scheme().backend(), "redis" | "etcd");
    match bound {
        Some(wait) if networked => {
            let past = wait.saturating_add(STORE_SLACK + Duration::from_secs(1));
            let builder = leasehold::Leasehold::builder(&url.expose())
                .connect_timeout(past.min(leasehold::MAX_CLIENT_TIMEOUT));
            Ok(builder.build().await?.store().clone())
        }
        _ => url.open().await,
    }
}

/// Opens the store for `command` (`run`, `hold`, `status`, `list`, `release`), as
/// `open_within` does for work that `bound` bounds. Its locks are meant for other
/// processes: `memory:` is refused (exit 64), as each `leasehold` process would have a
/// store of its own and nothing would be excluded.
pub async fn open_shared_store(
    url: Option<&str>,
    command: &str,
    bound: Option<Duration>,
) -> Result<Arc<dyn Store>, Failure> {
    let url = store_url(url)?;
    let in_vain = "share its locks with no other process and exclude nothing";
    refuse_memory(&url, command, in_vain, "redis://... or etcd://...")?;
    Ok(open_within(&url, bound).await?)
}

/// Opens the store for `command`, which only looks at locks (`status`, `list`, `leader`,
/// `release`), as [`open_shared_store`] does; a local store whose directory does not
/// exist holds no lock, so an empty store answers for it rather than the directory be
/// made (at a mistyped path, say).
pub async fn open_to_look(url: Option<&str>, command: &str) -> Result<Arc<dyn Store>, Failure> {
    let parsed = store_url(url)?;
    if parsed.scheme() == Scheme::Local {
        let dir = match parsed.dir() {
            Some(dir) => dir.to_path_buf(),
            None => leasehold::local::default_dir()?,
        };
        if !dir.exists() {
            return Ok(Arc::new(leasehold::MemoryStore::new()));
        }
    }
    open_shared_store(url, command, None).await
}

/// `memory:` lives in one process: `leasehold COMMAND` with it would `in_vain` (exit 64);
/// the message suggests local: and the `shared` stores.
pub fn refuse_memory(
    url: &StoreUrl,
    command: &str,
    in_vain: &str,
    shared: &str,
) -> Result<(), Failure> {
    if url.scheme() != Scheme::Memory {
        return Ok(());
    }
    Err(Failure::new(
        exit::USAGE,
        format!(
            "store memory: (from --store or LEASEHOLD_STORE) lives in one process only, so \
`leasehold {command}` would {in_vain}; use local: (the processes of this host) or {shared} \
(memory: is for bench)"
        ),
    ))
}

/// What a bounded wait allows the store beyond the wait itself: a connect and a few round
/// trips on a loaded machine.
pub(crate) const STORE_SLACK: Duration = Duration::from_secs(2);

/// Runs `work`, which talks to `store`; with a bounded `wait` (`Some(ZERO)` for
/// `--no-wait`), for at most the wait and `STORE_SLACK`, so a store that does not answer
/// (paused, a black-holed link) cannot stretch it by the client's connect and response
/// timeouts (9.5 s for a paused Redis): exit 69 then.
pub async fn within_wait<T, E: Into<Failure>>(
    store: &StoreUrl,
    wait: Option<Duration>,
    work: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, Failure> {
    let Some(wait) = wait else {
        return work.await.map_err(Into::into);
    };
    match tokio::time::timeout(wait.saturating_add(STORE_SLACK), work).await {
        Ok(done) => done.map_err(Into::into),
        Err(_) => {
            let allowed = match wait.is_zero() {
                true => format!("{} to connect", leasehold::humanize(STORE_SLACK)),
                false => format!(
                    "the --wait of {} and {} to connect",
                    leasehold::humanize(wait),
                    leasehold::humanize(STORE_SLACK)
                ),
            };
            Err(Failure::new(
                exit::UNAVAILABLE,
                format!("store {store} did not answer within {allowed}"),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_is_listed_once_and_a_re_entry_adds_no_line() {
        let outer = with_line(String::new(), "a", "o1");
        assert_eq!(outer, "a\to1");
        let inner = with_line(outer.clone(), "b", "o2");
        assert_eq!(inner, "a\to1\nb\to2");
        assert_eq!(with_line(inner.clone(), "a", "o1"), inner);
        // Another owner of the same name is another hold (a nested run given --owner).
        assert_eq!(with_line(outer, "a", "o3"), "a\to1\na\to3");
    }

    #[test]
    fn durations_are_humantime_or_seconds_and_bounded() {
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("60"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("365d"), Ok(MAX_DURATION));
        for bad in [
            "-5s",
            "-1",
            "--",
            "--no-wait",
            "nan",
            "inf",
            "soon",
            "",
            "366d",
            "18000000000000000000s",
            "1e3",
            "1e-1",
            "1.0e1",
            "1.2.3",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} was taken");
        }
    }

    #[test]
    fn exit_codes_are_0_to_255() {
        assert_eq!(parse_exit_code("0"), Ok(0));
        assert_eq!(parse_exit_code("255"), Ok(255));
        for bad in ["-1", "256", "x", ""] {
            let said = parse_exit_code(bad).unwrap_err();
            assert!(said.contains("0 to 255"), "{bad:?}: {said}");
        }
    }
}
