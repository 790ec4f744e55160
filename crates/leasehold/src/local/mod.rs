//! Cross-process store on one host: the CLI's default. Nothing to install or run.
//!
//! Each lock is a file under `DIR/locks/`, holding the lock's record (holders, waiters,
//! last fencing token) in two checksummed slots written in turn. Every check-and-change
//! takes the file's `flock(2)`, reads, decides and writes in one step, so any number of
//! processes can use a directory at once.
//!
//! # Guarantees and limits
//! - **Leases** run on `CLOCK_BOOTTIME`, which every process on the host shares and which
//!   keeps counting while the machine is suspended. After a reboot (a new boot id) no old
//!   lease survives.
//! - **Dead holders**: a holder or queue head whose process has exited (same host name,
//!   same pid namespace) is dropped as soon as a waiter looks, and waiters are woken by
//!   the kernel when it exits (pidfd). Otherwise its lease expires.
//! - **Waiters** are woken by inotify when the lock's file changes, not by polling; also
//!   when it is deleted, or the whole `locks/` folder is (a store that forgot its locks:
//!   the folder and files are made again, and the first waiter is granted the lock).
//! - **Tokens** persist in the file and survive process crashes and restarts. Writes are
//!   not fsync'ed: after a power loss the last tokens issued may be issued again. A
//!   name's first token is the wall clock in microseconds, so a lock file that is lost or
//!   moved aside does not make tokens go back (unless the clock stepped back).
//! - **Rate limiters** keep their theoretical arrival time (on `CLOCK_BOOTTIME`) in
//!   `DIR/limits/`, one file each, read and written under the file's `flock` like a
//!   lock's record. A limiter's file stays after it goes idle (a few bytes); after a
//!   reboot the limiter starts again at full burst.
//! - The directory must be on a local file system (`flock` and inotify do not work across
//!   NFS clients).

mod slots;

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::future::Future;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tokio::io::unix::AsyncFd;
use tokio_util::task::AbortOnDropHandle;

use crate::record::{Look, Now, Record, Wake};
use crate::store::{
    busy_states, gcra, AcquireRequest, Attempt, Capabilities, Grant, Lease, LockState, RateRequest,
    Released, Renewal, Store, Watermark,
};
use crate::Locked;
use crate::RateDecision;
use crate::{sys, Error, LockName, Result, StoreUrl};

/// The local store. Cheap to clone.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> leasehold::Result<()> {
/// use leasehold::{Leasehold, LocalStore};
/// let locks = Leasehold::new(LocalStore::open("/var/lib/myapp/locks")?);
/// let guard = locks.mutex("nightly")?.lock().await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct LocalStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    locks_dir: PathBuf,
    /// Mode of new lock files: this user's, and the group's if the store is shared.
    file_mode: u32,
    boot: String,
    host: String,
    files: Mutex<HashMap<LockName, Arc<LockFile>>>,
    /// Rate limiters' files, under `DIR/limits/`.
    limit_files: Mutex<HashMap<LockName, Arc<LockFile>>>,
    wakers: Arc<Wakers>,
    watcher: OnceLock<Option<AbortOnDropHandle<()>>>,
}

/// One lock's file, opened once per store.
#[derive(Debug)]
struct LockFile {
    file: File,
    /// When it was last seen to have a name (boot clock, ns).
    name_checked: AtomicU64,
    /// Tasks of this process take turns (`flock` does not exclude users of the same open
    /// file), and keep the last record read, so an unchanged file is not parsed again.
    turn: tokio::sync::Mutex<Option<Cached>>,
}

/// The store's clocks now: the boot clock leases run on, the wall clock for display, and
/// the first token of a name with no file.
fn now() -> Now {
    let wall_us = Now::wall_us();
    Now {
        mono: sys::boottime_ns(),
        wall_ms: wall_us / 1000,
        first_token: wall_us,
    }
}

/// How often a file in use is checked for a name: see [`LockFile::still_there`].
const NAME_CHECK_EVERY_NS: u64 = 100_000_000;

impl LockFile {
    fn new(file: File) -> Self {
        LockFile {
            file,
            name_checked: AtomicU64::new(sys::boottime_ns()),
            turn: tokio::sync::Mutex::new(None),
        }
    }

    /// Whether the file still has a name, as last seen within [`NAME_CHECK_EVERY_NS`].
    /// One deleted or replaced since it was opened (a temp cleaner, someone tidying the
    /// store's folder) is opened again, so that its holders find their leases gone at
    /// their next renewal (and say so) rather than renewing them in a file no other
    /// process sees. Not at every call: an `fstat` each time cost a third of an
    /// uncontended acquire and release.
    fn still_there(&self) -> bool {
        let now = sys::boottime_ns();
        let last = self.name_checked.load(Ordering::Relaxed);
        if now.saturating_sub(last) < NAME_CHECK_EVERY_NS {
            return true;
        }
        self.name_checked.store(now, Ordering::Relaxed);
        sys::link_count(&self.file).is_none_or(|links| links > 0)
    }
}

/// A record as last read or written, with the slot contents it came from.
#[derive(Debug)]
struct Cached {
    seq: u64,
    json: Vec<u8>,
    record: Record,
}

/// Change notifications per file name, fed by the inotify task.
#[derive(Debug, Default)]
struct Wakers(Mutex<HashMap<OsString, Arc<Watched>>>);

/// One lock file as this process's waiters watch it.
#[derive(Debug, Default)]
struct Watched {
    wake: Wake,
    /// Change notifications so far.
    events: AtomicU64,
    /// The record as read after the last notification, shared by all waiters of this
    /// process, so a change costs one read however many tasks wait.
    snapshot: tokio::sync::Mutex<Option<Snapshot>>,
}

#[derive(Debug)]
struct Snapshot {
    events: u64,
    record: Record,
    /// Processes on this host standing in the way (holders, the queue head).
    pids: Vec<u32>,
}

impl Wakers {
    fn get(&self, file: &OsString) -> Arc<Watched> {
        let mut map = self.0.locked();
        map.entry(file.clone()).or_default().clone()
    }

    fn wake(&self, file: Option<&OsString>) {
        let map = self.0.locked();
        match file {
            Some(file) => map.get(file).iter().for_each(|w| w.changed()),
            // Queue overflow: we do not know what changed.
            None => map.values().for_each(|w| w.changed()),
        }
    }
}

impl Watched {
    fn changed(&self) {
        self.events.fetch_add(1, Ordering::SeqCst);
        self.wake.changed();
    }
}

/// The default directory: `$LEASEHOLD_HOME`, else `$XDG_STATE_HOME/leasehold`, else
/// `~/.local/state/leasehold`.
pub fn default_dir() -> Result<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(home) = var("LEASEHOLD_HOME") {
        return Ok(home);
    }
    if let Some(state) = var("XDG_STATE_HOME") {
        return Ok(state.join("leasehold"));
    }
    match var("HOME") {
        Some(home) => Ok(home.join(".local/state/leasehold")),
        None => Err(Error::InvalidStore {
            store: "local:".into(),
            reason: "no directory given and neither LEASEHOLD_HOME, XDG_STATE_HOME nor HOME is set; use local:DIR".into(),
        }),
    }
}

/// A lock as errors name it.
fn lock(name: &LockName) -> String {
    format!("lock \"{name}\"")
}

/// A rate limiter as errors name it.
fn limiter(name: &LockName) -> String {
    format!("rate limiter \"{name}\"")
}

/// A file name for a lock name: readable when short, a digest when long.
fn file_name(name: &LockName) -> OsString {
    let mut out = String::new();
    for b in name.as_str().bytes() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => out.push(b as char),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    if out.len() > 200 || out.starts_with('.') {
        out = format!("~{:x}", Sha256::digest(name.as_str().as_bytes()));
    }
    out.push_str(".lock");
    out.into()
}

/// The lock name a file of [`file_name`] is for; `None` for one named by a hash (a long
/// name) or not a lock file.
fn name_of_file(file: &str) -> Option<String> {
    let escaped = file.strip_suffix(".lock").filter(|f| !f.starts_with('~'))?;
    let mut bytes = Vec::with_capacity(escaped.len());
    let mut rest = escaped.as_bytes();
    while let Some((&b, tail)) = rest.split_first() {
        match b {
            b'%' => {
                let hex = std::str::from_utf8(tail.get(..2)?).ok()?;
                bytes.push(u8::from_str_radix(hex, 16).ok()?);
                rest = &tail[2..];
            }
            _ => {
                bytes.push(b);
                rest = tail;
            }
        }
    }
    String::from_utf8(bytes).ok()
}

/// Gives a directory or file of the store that we own exactly the access bits `bits`
/// (keeping setgid, which a shared directory passes on), through `set`.
fn set_mode(
    meta: &std::fs::Metadata,
    bits: u32,
    set: impl FnOnce(std::fs::Permissions) -> std::io::Result<()>,
) -> std::io::Result<()> {
    // SAFETY: plain query.
    let mine = meta.uid() == unsafe { libc::geteuid() };
    let mode = (meta.mode() & 0o7000) | bits;
    match mine && meta.mode() & 0o7777 != mode {
        true => set(std::fs::Permissions::from_mode(mode)),
        false => Ok(()),
    }
}

/// Makes `dir` (and any missing parent) with `mode`, whatever the umask (which would
/// take a shared store's group access away); one there already is fine.
fn make_dir(dir: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let made = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir);
    made.or_else(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => Ok(()),
        _ => Err(e),
    })?;
    // Not through a link: its mode would be set on whatever the link points at. Opened
    // without following one and changed through that descriptor, so a link put in its
    // place after the check is not followed either.
    let own = crate::sys::open_dir_own(dir).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP | libc::ENOTDIR) => std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a directory of its own", dir.display()),
        ),
        _ => e,
    })?;
    set_mode(&own.metadata()?, mode, |p| own.set_permissions(p))
}

fn unusable(dir: &Path, what: &str, e: std::io::Error) -> Error {
    Error::InvalidStore {
        store: StoreUrl::local(dir).to_string(),
        reason: format!(
            "{what}: {e}; pick a writable directory with --store local:DIR or LEASEHOLD_HOME"
        ),
    }
}

impl LocalStore {
    /// Opens (creating if needed) the store in `dir`.
    ///
    /// Directories it creates are private to this user (0700). Its `locks` directory and
    /// lock files get the group's access when the group may write to `dir` (a directory
    /// shared on purpose: `chgrp` it to the group and `chmod 2770` it before the first
    /// use), and never anyone else's: a user who can open a lock file can hold its file
    /// lock and stall every user of the lock. It follows no symbolic link inside `dir`:
    /// a link where its locks directory or a file goes is refused
    /// ([`Error::Config`]), so whoever may write there cannot point it at another file.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(dir.as_ref(), false)
    }

    fn open_with(dir: &Path, private: bool) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = dir.to_path_buf();
        let locks_dir = dir.join("locks");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| unusable(&dir, "cannot create it", e))?;
        // The default directory is this user's alone, even if an older version made it
        // readable by others.
        let meta = std::fs::metadata(&dir).map_err(|e| unusable(&dir, "cannot read it", e))?;
        // SAFETY: plain query.
        let me = unsafe { libc::geteuid() };
        if private && meta.uid() == me && meta.mode() & 0o077 != 0 {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| unusable(&dir, "cannot make it private", e))?;
        }
        // A store directory its group may write to is shared with the group on purpose
        // (a plain `mkdir` gives the group read access only): the group gets the locks
        // too. Others get nothing.
        let group = match !private && meta.mode() & 0o020 != 0 {
            true => 0o070,
            false => 0,
        };
        // Made, or given the store's mode if an older version or a umask left it another.
        make_dir(&locks_dir, 0o700 | group)
            .map_err(|e| unusable(&dir, "cannot create its locks directory", e))?;
        std::fs::read_dir(&locks_dir)
            .map_err(|e| unusable(&dir, "cannot read its locks directory", e))?;
        // A probe of this process's own, removed at once: one name for every process
        // would be the first one's file, which the group's other users cannot open.
        let probe = format!(
            ".probe-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        let probe = locks_dir.join(probe);
        OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o600)
            .open(&probe)
            .map_err(|e| unusable(&dir, "cannot write in its locks directory", e))?;
        let _ = std::fs::remove_file(&probe);
        Ok(LocalStore {
            inner: Arc::new(Inner {
                dir,
                locks_dir,
                file_mode: 0o600 | (group & 0o060),
                boot: sys::boot_id(),
                host: sys::hostname(),
                files: Mutex::default(),
                limit_files: Mutex::default(),
                wakers: Arc::default(),
                watcher: OnceLock::new(),
            }),
        })
    }

    /// The default store (see [`default_dir`]), private to this user unless
    /// `LEASEHOLD_HOME` names it (then it is treated as [`open`](Self::open) treats a
    /// directory given).
    pub fn open_default() -> Result<Self> {
        let named = std::env::var_os("LEASEHOLD_HOME").is_some_and(|v| !v.is_empty());
        Self::open_with(&default_dir()?, !named)
    }

    /// Where it keeps its files.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    fn store_name(&self) -> String {
        StoreUrl::local(&self.inner.dir).to_string()
    }

    /// A failed file operation on `subject` (`lock "x"`, `rate limiter "x"`: [`lock`],
    /// [`limiter`]): access refused is a configuration to fix (not retryable); the rest
    /// may pass.
    fn io_error(&self, subject: &str, what: &str, e: std::io::Error) -> Error {
        use std::io::ErrorKind::{InvalidInput, PermissionDenied, ReadOnlyFilesystem};
        let not_its_own = matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR));
        if not_its_own || e.kind() == InvalidInput {
            return Error::Config {
                store: self.store_name(),
                reason: format!(
                    "{what} for {subject}: {e}: the store's directories and files must be its own, not symbolic links or other kinds of file (a link could point it at any file); remove it"
                ),
            };
        }
        match e.kind() {
            PermissionDenied | ReadOnlyFilesystem => Error::Config {
                store: self.store_name(),
                reason: format!(
                    "{what} for {subject}: {e}; check the owner and mode of the store's directory and files (to share a store with a group: mkdir DIR && chgrp TEAM DIR && chmod 2770 DIR, before first use)"
                ),
            },
            _ => Error::Unavailable {
                store: self.store_name(),
                source: format!("{what} for {subject}: {e}").into(),
            },
        }
    }

    /// Whether lock `name` has no file (a name never used, or its file deleted): what only
    /// reads it answers without making one.
    fn no_file(&self, name: &LockName) -> bool {
        !self.inner.locks_dir.join(file_name(name)).exists()
    }

    fn lock_file(&self, name: &LockName) -> Result<Arc<LockFile>> {
        self.open_file(&self.inner.files, &self.inner.locks_dir, name, lock)
    }

    /// A rate limiter's file, in `DIR/limits/` (made on first use, with the locks
    /// directory's mode), so limiters and locks of one name are apart.
    fn limit_file(&self, name: &LockName) -> Result<Arc<LockFile>> {
        let dir = self.inner.dir.join("limits");
        if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            make_dir(&dir, self.dir_mode()).map_err(|e| {
                self.io_error(&limiter(name), "cannot create the limits directory", e)
            })?;
        }
        self.open_file(&self.inner.limit_files, &dir, name, limiter)
    }

    /// The mode of the directories it makes: this user's, and the group's if the store
    /// is shared.
    fn dir_mode(&self) -> u32 {
        match self.inner.file_mode & 0o060 {
            0 => 0o700,
            _ => 0o770,
        }
    }

    fn open_file(
        &self,
        files: &Mutex<HashMap<LockName, Arc<LockFile>>>,
        dir: &Path,
        name: &LockName,
        subject: fn(&LockName) -> String,
    ) -> Result<Arc<LockFile>> {
        let mut files = files.locked();
        if let Some(f) = files.get(name) {
            if f.still_there() {
                return Ok(f.clone());
            }
            files.remove(name);
        }
        let path = dir.join(file_name(name));
        let cannot = |e| {
            self.io_error(
                &subject(name),
                &format!("cannot open {}", path.display()),
                e,
            )
        };
        let open = || sys::open_own(dir, &file_name(name), self.inner.file_mode);
        // Its directory deleted (by hand, or a cleaner): a store that forgot its locks,
        // as for a deleted file; the directory is made again.
        let file = match open() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                make_dir(dir, self.dir_mode()).map_err(cannot)?;
                open()
            }
            opened => opened,
        }
        .map_err(cannot)?;
        // Made by an older version (readable by others), or under a umask that took the
        // group's access away: the store's mode.
        let meta = file.metadata().map_err(cannot)?;
        set_mode(&meta, self.inner.file_mode, |p| file.set_permissions(p)).map_err(cannot)?;
        let f = Arc::new(LockFile::new(file));
        files.insert(name.clone(), f.clone());
        Ok(f)
    }

    fn alive(&self) -> impl Fn(&str, u32) -> bool + '_ {
        let me = std::process::id();
        move |host, pid| host != self.inner.host || pid == me || sys::pid_exists(pid)
    }

    /// Runs `f` on the record of `name` under the file lock, after dropping expired leases,
    /// and writes the record back if `f` (or the expiry) changed it.
    async fn with<T>(&self, name: &LockName, f: impl FnOnce(&mut Record, Now) -> T) -> Result<T> {
        let lf = self.lock_file(name)?;
        let mut cache = lf.turn.lock().await;
        let _flock = match tokio::time::timeout(FLOCK_PATIENCE, flock(&lf)).await {
            Ok(flock) => {
                flock.map_err(|e| self.io_error(&lock(name), "cannot lock its file", e))?
            }
            Err(_) => return Err(self.file_lock_stuck(&lf)),
        };
        let now = now();
        let found = slots::read(&lf.file)
            .map_err(|e| self.io_error(&lock(name), "cannot read its file", e))?;
        let (seq, json, before) = match found {
            slots::Found::Empty => {
                // A file made anew may replace a deleted one: its version starts from the
                // clock, so no waiter's watermark of the old one reads as "unchanged".
                let mut record = Record::new(name.as_str(), &self.inner.boot);
                record.version = now.first_token;
                (0, Vec::new(), record)
            }
            slots::Found::State { seq, json } => {
                let record = match cache.take() {
                    Some(c) if c.seq == seq && c.json == json => c.record,
                    _ => serde_json::from_slice(&json)
                        .map_err(|e| self.corrupt(name, &e.to_string()))?,
                };
                (seq, json, record)
            }
            slots::Found::Corrupt(why) => return Err(self.corrupt(name, &why)),
        };
        let mut record = before.clone();
        record.enter_epoch(&self.inner.boot);
        record.prune(now, &|_, _| true);
        let out = f(&mut record, now);
        if record == before {
            if seq > 0 {
                *cache = Some(Cached {
                    seq,
                    json,
                    record: before,
                });
            }
            return Ok(out);
        }
        let json = serde_json::to_vec(&record).map_err(|e| Error::Internal(e.to_string()))?;
        if json.len() > slots::MAX_RECORD {
            return Err(Error::Conflict {
                name: name.to_string(),
                reason:
                    "too many holders and waiters for the local store (its record exceeds 1 MiB)"
                        .into(),
            });
        }
        slots::write(&lf.file, seq + 1, &json)
            .map_err(|e| self.io_error(&lock(name), "cannot write its file", e))?;
        *cache = Some(Cached {
            seq: seq + 1,
            json,
            record,
        });
        Ok(out)
    }

    /// Our processes hold a lock file's `flock` for microseconds; one held longer than
    /// [`FLOCK_PATIENCE`] is held by a process that is stuck, or that is not leasehold.
    fn file_lock_stuck(&self, lf: &LockFile) -> Error {
        // The file itself, whichever folder it is in (a lock's or a limiter's).
        let path = std::fs::read_link(format!("/proc/self/fd/{}", lf.file.as_raw_fd()))
            .unwrap_or_else(|_| "its lock file".into());
        let holder = lf
            .file
            .metadata()
            .ok()
            .and_then(|m| sys::flock_holder(m.dev(), m.ino()));
        let who = match holder {
            Some((pid, uid)) => format!("process {pid} (user id {uid})"),
            None => "another process".into(),
        };
        Error::Unavailable {
            store: self.store_name(),
            source: format!(
                "{who} has held the file lock of {} for over {}; leasehold holds it only for microseconds, so that process is stopped or is not leasehold",
                path.display(),
                crate::humanize(FLOCK_PATIENCE)
            )
            .into(),
        }
    }

    fn corrupt(&self, name: &LockName, why: &str) -> Error {
        let path = self.inner.locks_dir.join(file_name(name));
        Error::Corrupt {
            store: self.store_name(),
            name: name.to_string(),
            reason: format!(
                "{} {why}; move it aside to start the lock afresh (its fencing tokens then start again from the clock, above the old ones unless the clock stepped back)",
                path.display()
            ),
        }
    }

    fn limit_corrupt(&self, name: &LockName, why: &str) -> Error {
        let path = self.inner.dir.join("limits").join(file_name(name));
        Error::Corrupt {
            store: self.store_name(),
            name: name.to_string(),
            reason: format!(
                "rate limiter file {} {why}; delete it to start the limiter afresh (at full burst)",
                path.display()
            ),
        }
    }

    /// Whether change notifications run (started on first use; a watcher that ended
    /// wakes nobody again, so waiters go by their timers then).
    fn watching(&self) -> bool {
        let watcher = self.inner.watcher.get_or_init(|| self.start_watcher());
        watcher.as_ref().is_some_and(|w| !w.is_finished())
    }

    fn start_watcher(&self) -> Option<AbortOnDropHandle<()>> {
        use inotify::{EventMask, WatchMask};
        let mask = WatchMask::MODIFY
            | WatchMask::DELETE
            | WatchMask::MOVED_FROM
            | WatchMask::DELETE_SELF
            | WatchMask::MOVE_SELF;
        // A lock file, or the whole directory, deleted or moved away (by hand, or a
        // cleaner): a store that forgot those locks. The kernel reports the directory's
        // own deletion only once no process uses it, but its files' at once.
        let (file_gone, dir_gone) = (
            EventMask::DELETE | EventMask::MOVED_FROM,
            EventMask::DELETE_SELF | EventMask::MOVE_SELF,
        );
        let inotify = inotify::Inotify::init().ok()?;
        inotify.watches().add(&self.inner.locks_dir, mask).ok()?;
        let mut events = inotify.into_event_stream([0u8; 4096]).ok()?;
        let wakers = self.inner.wakers.clone();
        let (locks_dir, mode) = (self.inner.locks_dir.clone(), self.dir_mode());
        let store = Arc::downgrade(&self.inner);
        Some(AbortOnDropHandle::new(tokio::spawn(async move {
            while let Some(event) = events.next().await {
                let Ok(event) = event else {
                    wakers.wake(None);
                    return;
                };
                let lock_file =
                    (event.name.as_ref()).is_some_and(|n| n.as_encoded_bytes().ends_with(b".lock"));
                if event.mask.intersects(dir_gone)
                    || (lock_file && event.mask.intersects(file_gone))
                {
                    // The files open here may be the ones that went: open them anew.
                    if let Some(store) = store.upgrade() {
                        store.files.locked().clear();
                    }
                }
                if !event.mask.intersects(dir_gone) {
                    wakers.wake(event.name.as_ref());
                    continue;
                }
                // Watch the directory made again in its place, and wake every waiter to
                // look there.
                tracing::debug!(dir = %locks_dir.display(), "local store: its locks directory went; watching it anew");
                let mut watches = events.watches();
                let _ = watches.remove(event.wd);
                if make_dir(&locks_dir, mode).is_err() || watches.add(&locks_dir, mask).is_err() {
                    wakers.wake(None);
                    return;
                }
                wakers.wake(None);
            }
        })))
    }
}

/// How long a hold lasts before `ended` starts the change watch (see there).
const WATCH_AFTER: Duration = Duration::from_millis(50);

/// How long a store call waits for a lock file's `flock` before giving up: far longer
/// than any update of ours holds it, short enough that a stranger holding it cannot
/// stretch a bounded wait by much.
const FLOCK_PATIENCE: Duration = Duration::from_secs(1);

/// Holds a file's `flock` until dropped: on the store's open file of the lock, or on an
/// open file of its own that a blocking wait made.
enum Flock {
    Shared(Arc<LockFile>),
    /// Closing it lets the lock go.
    Own {
        _file: File,
    },
}

impl Drop for Flock {
    fn drop(&mut self) {
        if let Flock::Shared(lf) = self {
            // SAFETY: the fd is open for as long as the Arc lives.
            unsafe { libc::flock(lf.file.as_raw_fd(), libc::LOCK_UN) };
        }
    }
}

/// Takes the file lock: at once if free, else on a blocking thread, so a process stopped
/// in the middle of its few-microsecond update cannot stall this runtime.
///
/// The blocking wait locks an open file of its own. `flock` belongs to the open file, not
/// to the thread: had a wait whose caller gave up (a timeout, a cancelled renewal) gone on
/// waiting on the shared open file, its lock and unlock when it finally got through would
/// land on the lock a later caller of this process holds there, letting another process
/// in beside it. The thread looks again and again rather than blocking in the kernel, so
/// it ends as soon as its caller has gone, and after [`FLOCK_PATIENCE`] at most: a thread
/// blocked for as long as a stranger holds the file would keep the runtime from shutting
/// down.
async fn flock(lf: &Arc<LockFile>) -> std::io::Result<Flock> {
    let fd = lf.file.as_raw_fd();
    // SAFETY: valid fd; non-blocking attempt.
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(Flock::Shared(lf.clone()));
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
        return Err(err);
    }
    // The same file (even if its path was replaced since), opened anew.
    let own = File::open(format!("/proc/self/fd/{fd}"))?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::task::spawn_blocking(move || {
        // A little past the callers' own patience, so that they say what happened.
        let until = std::time::Instant::now() + FLOCK_PATIENCE + Duration::from_millis(100);
        let mut pause = Duration::from_micros(20);
        loop {
            // SAFETY: valid fd, owned by `own`; non-blocking attempt.
            if unsafe { libc::flock(own.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                // If our caller has given up, the lock goes with the channel's drop.
                let _ = tx.send(Ok(Flock::Own { _file: own }));
                return;
            }
            let err = std::io::Error::last_os_error();
            let busy = err.raw_os_error() == Some(libc::EWOULDBLOCK)
                || err.kind() == std::io::ErrorKind::Interrupted;
            if !busy {
                let _ = tx.send(Err(err));
                return;
            }
            if tx.is_closed() || std::time::Instant::now() >= until {
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    });
    rx.await
        .unwrap_or_else(|_| Err(std::io::Error::other("file-lock thread ended")))
}

type Exit = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Resolves when the process behind `fd` exits.
fn exited(fd: std::os::fd::OwnedFd) -> Option<Exit> {
    // SAFETY: the AsyncFd owns the OwnedFd, which stays open and unchanged until dropped.
    let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }.ok()?;
    Some(Box::pin(async move {
        let _ = fd.readable().await;
    }))
}

#[async_trait]
impl Store for LocalStore {
    async fn acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        let alive = self.alive();
        self.with(&req.name, |r, now| {
            let attempt = r.acquire(req, now)?;
            // Someone in the way: drop those whose process has died and try once more.
            if matches!(attempt, Attempt::Busy(_)) && r.prune(now, &alive) {
                return r.acquire(req, now);
            }
            Ok(attempt)
        })
        .await?
    }

    async fn transfer(&self, from: &Lease, to: &AcquireRequest) -> Result<(Released, Attempt)> {
        self.with(&to.name, |r, now| {
            Ok((r.release(from), r.acquire(to, now)?))
        })
        .await?
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        self.with(&lease.name, |r, now| r.renew(lease, ttl, now))
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<Released> {
        self.with(&lease.name, |r, _| r.release(lease)).await
    }

    async fn changed(&self, req: &AcquireRequest, mut since: Watermark) -> Result<Option<Grant>> {
        let watching = self.watching();
        let watched = self.inner.wakers.get(&file_name(&req.name));
        let (host, me) = (self.inner.host.clone(), std::process::id());
        loop {
            let notified = watched.wake.notified(req);
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (look, pids) = {
                let mut snapshot = watched.snapshot.lock().await;
                let events = watched.events.load(Ordering::SeqCst);
                let fresh = snapshot.as_ref().filter(|s| s.events == events && watching);
                if fresh.is_none() {
                    let (record, pids) = self
                        .with(&req.name, |r, _| {
                            let pids = r
                                .blocking_pids()
                                .filter(|(h, pid)| *h == host && *pid != me)
                                .map(|(_, pid)| pid)
                                .collect();
                            (r.clone(), pids)
                        })
                        .await?;
                    *snapshot = Some(Snapshot {
                        events,
                        record,
                        pids,
                    });
                }
                let snapshot = snapshot.as_ref().expect("just filled");
                (snapshot.record.look(req, since), snapshot.pids.clone())
            };
            match look {
                Look::TryNow => return Ok(None),
                Look::Wait(seen) => since = seen,
            }
            let mut exits: Vec<Exit> = Vec::new();
            for pid in pids {
                match sys::pidfd_open(pid) {
                    Some(fd) => exits.extend(exited(fd)),
                    // Gone already (or no pidfds): let the caller look again.
                    None if !sys::pid_exists(pid) => return Ok(None),
                    None => {}
                }
            }
            let any_exit = async {
                if exits.is_empty() {
                    std::future::pending::<()>().await;
                }
                futures_util::future::select_all(exits).await;
            };
            if !watching {
                // No inotify: the caller's timers (holder expiry) still bound the wait.
                any_exit.await;
                return Ok(None);
            }
            tokio::select! {
                _ = notified => {}
                _ = any_exit => return Ok(None),
            }
        }
    }

    async fn ended(&self, lease: &Lease) -> Result<()> {
        // The watch starts only for a hold that lasts: a process that holds a lock for a
        // moment (`leasehold run NAME -- true`) would pay ~10 ms at exit to take an
        // inotify watch down (the kernel waits for a grace period), more than the whole
        // acquire and release. A force-release in that first moment is learned that late.
        if self.inner.watcher.get().is_none() {
            tokio::time::sleep(WATCH_AFTER).await;
        }
        let watching = self.watching();
        if !watching {
            // Without change notifications the renewals tell.
            return std::future::pending().await;
        }
        let watched = self.inner.wakers.get(&file_name(&lease.name));
        loop {
            let notified = watched.wake.notified_any();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.with(&lease.name, |r, _| r.holds(lease)).await? {
                return Ok(());
            }
            notified.await;
        }
    }

    async fn proclaim(&self, lease: &Lease, value: &str) -> Result<Renewal> {
        (self.with(&lease.name, |r, _| r.proclaim(lease, value))).await
    }

    async fn downgrade(&self, lease: &Lease) -> Result<Renewal> {
        (self.with(&lease.name, |r, _| r.downgrade(lease))).await?
    }

    async fn watch(&self, name: &LockName, seen: &LockState) -> Result<()> {
        let watching = self.watching();
        if !watching {
            return crate::store::poll_holders(self, name, seen).await;
        }
        let watched = self.inner.wakers.get(&file_name(name));
        loop {
            let notified = watched.wake.notified_holders();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.describe(name).await?.same_holders(seen) {
                return Ok(());
            }
            notified.await;
        }
    }

    async fn describe(&self, name: &LockName) -> Result<LockState> {
        if self.no_file(name) {
            return Ok(Record::new(name.as_str(), &self.inner.boot).state(now()));
        }
        let alive = self.alive();
        self.with(name, |r, now| {
            r.prune(now, &alive);
            r.state(now)
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockState>> {
        let entries = std::fs::read_dir(&self.inner.locks_dir)
            .map_err(|e| self.io_error("the listing", "cannot read the locks directory", e))?;
        let mut names = Vec::new();
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            if !file_name.to_string_lossy().ends_with(".lock") {
                continue;
            }
            // (Not through a link: it could point at any file.)
            if !entry.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            let Ok(file) = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(entry.path())
            else {
                continue;
            };
            // A file that cannot be read could hide a held lock: say so, as the lock's
            // own calls do, rather than list less than there is.
            let file_text = file_name.to_string_lossy();
            let unreadable = |why: String| Error::Corrupt {
                store: self.store_name(),
                name: name_of_file(&file_text).unwrap_or_else(|| file_text.to_string()),
                reason: format!(
                    "{} {why}; move it aside to start that lock afresh",
                    entry.path().display()
                ),
            };
            let json = match slots::read(&file) {
                Ok(slots::Found::State { json, .. }) => json,
                Ok(slots::Found::Empty) | Err(_) => continue,
                Ok(slots::Found::Corrupt(why)) => return Err(unreadable(why)),
            };
            let record = serde_json::from_slice::<Record>(&json)
                .map_err(|e| unreadable(format!("does not hold a lock's record ({e})")))?;
            if !record.name.starts_with(prefix) || record.is_idle() {
                continue;
            }
            names.extend(LockName::new(record.name).ok());
        }
        busy_states(self, names).await
    }

    async fn force_release(&self, name: &LockName) -> Result<bool> {
        if self.no_file(name) {
            return Ok(false);
        }
        self.with(name, |r, _| r.force_release()).await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            cross_process: true,
            reclaims_dead_processes: true,
            fair_by_default: false,
            queues_by_wait: false,
            failed_calls_change_nothing: true,
            keeps_waiters_alive: false,
        }
    }

    fn describe_store(&self) -> String {
        self.store_name()
    }

    fn caveat(&self) -> Option<String> {
        None
    }

    /// Under the limiter file's `flock`, on `CLOCK_BOOTTIME` as the leases are: a TAT
    /// from another boot (a new boot id) counts as absent.
    async fn rate(&self, req: &RateRequest) -> Result<RateDecision> {
        let name = &req.name;
        let lf = self.limit_file(name)?;
        let _turn = lf.turn.lock().await;
        let _flock = match tokio::time::timeout(FLOCK_PATIENCE, flock(&lf)).await {
            Ok(flock) => {
                flock.map_err(|e| self.io_error(&limiter(name), "cannot lock its file", e))?
            }
            Err(_) => return Err(self.file_lock_stuck(&lf)),
        };
        let now = sys::boottime_ns() / 1000;
        let (seq, tat) = match slots::read(&lf.file)
            .map_err(|e| self.io_error(&limiter(name), "cannot read its file", e))?
        {
            slots::Found::Empty => (0, None),
            slots::Found::State { seq, json } => {
                let kept: Tat = serde_json::from_slice(&json)
                    .map_err(|e| self.limit_corrupt(name, &e.to_string()))?;
                (seq, (kept.boot == self.inner.boot).then_some(kept.tat_us))
            }
            slots::Found::Corrupt(why) => return Err(self.limit_corrupt(name, &why)),
        };
        let (decision, new_tat) = gcra(tat, now, req.limit, req.units, req.max_wait_us);
        if let Some(tat_us) = new_tat {
            let kept = Tat {
                boot: self.inner.boot.clone(),
                tat_us,
            };
            let json = serde_json::to_vec(&kept).map_err(|e| Error::Internal(e.to_string()))?;
            slots::write(&lf.file, seq + 1, &json)
                .map_err(|e| self.io_error(&limiter(name), "cannot write its file", e))?;
        }
        Ok(decision)
    }
}

/// A rate limiter's file: its theoretical arrival time on this boot's `CLOCK_BOOTTIME`.
#[derive(serde::Serialize, serde::Deserialize)]
struct Tat {
    boot: String,
    tat_us: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn try_flock(file: &File) -> bool {
        // SAFETY: valid fd; non-blocking attempt.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
    }

    /// A lock file's name gives the lock's name back, unless it is a hash.
    #[test]
    fn a_file_name_gives_its_lock_name_back() {
        for name in ["k", "jobs/nightly report", "é ~%.x", ".hidden"] {
            let file = file_name(&LockName::new(name).unwrap());
            let back = name_of_file(&file.to_string_lossy());
            match name.starts_with('.') {
                true => assert_eq!(back, None, "{file:?}"),
                false => assert_eq!(back.as_deref(), Some(name), "{file:?}"),
            }
        }
        assert_eq!(
            name_of_file(&file_name(&LockName::new("x".repeat(201)).unwrap()).to_string_lossy()),
            None
        );
        assert_eq!(name_of_file("k%4.lock"), None);
        assert_eq!(name_of_file(".probe"), None);
    }

    /// A caller that gave up waiting for the file lock leaves its wait running on a
    /// thread. When that wait gets through, it must not let go of the lock a later caller
    /// of this process took meanwhile: another process would get in beside it (two
    /// writers of one record: a token given twice, a semaphore over its size).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_abandoned_file_lock_wait_leaves_a_later_holder_locked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        let open = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .unwrap()
        };
        let lf = Arc::new(LockFile::new(open()));
        let (other, third) = (open(), open());
        // Each round: another process holds the file lock; a caller here waits behind
        // it and gives up; the other lets go and a later caller here takes the lock,
        // while the abandoned wait wakes and gets through too. (A wait on the shared open
        // file broke the later caller's lock in about half the rounds: when it got
        // through after that caller did.)
        for round in 0..8 {
            // (The last round's abandoned wait may still be getting through and letting go.)
            assert!(
                eventually(|| try_flock(&other)).await,
                "the lock was not let go"
            );
            let gave_up = tokio::time::timeout(Duration::from_millis(20), flock(&lf)).await;
            assert!(gave_up.is_err(), "the file lock was free");
            // SAFETY: valid fd.
            unsafe { libc::flock(other.as_raw_fd(), libc::LOCK_UN) };
            let held = flock(&lf).await.unwrap();
            // Nobody else gets in while `held` lives. (The abandoned wait let go within
            // microseconds of getting through; 100 ms shows it on a loaded machine.)
            let until = Instant::now() + Duration::from_millis(100);
            while Instant::now() < until {
                assert!(
                    !try_flock(&third),
                    "round {round}: another process got the file lock beside ours"
                );
                tokio::task::yield_now().await;
            }
            drop(held);
            // The abandoned wait gets through and lets go.
            assert!(
                eventually(|| try_flock(&third)).await,
                "the lock was not let go"
            );
            // SAFETY: valid fd.
            unsafe { libc::flock(third.as_raw_fd(), libc::LOCK_UN) };
        }
    }

    /// Polls `ready` until it says yes, for at most 10 s.
    async fn eventually(mut ready: impl FnMut() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if ready() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        false
    }
}
