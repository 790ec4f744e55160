//! Fencing tokens, and a small gate for resources that check them.
//!
//! A lease can end while its holder still believes it holds the lock (a long GC or VM
//! pause, a stalled network). The holder's writes then race the next holder's. A
//! fencing token closes that hole: every acquisition of a lock name gets a token larger
//! than any before it, the holder sends it with each write, and the resource refuses a
//! token lower than the highest it has accepted.
//!
//! In SQL, keep the highest accepted token next to the data and make the check part of
//! the write itself:
//!
//! ```sql
//! -- once: ALTER TABLE jobs ADD COLUMN fence BIGINT NOT NULL DEFAULT 0;
//! UPDATE jobs SET state = $1, fence = $2
//!  WHERE id = $3 AND fence <= $2;      -- $2 = guard.check()?.get()
//! -- 0 rows updated: a newer holder has written; stop and do not retry.
//! ```
//!
//! In-process resources can use [`FenceGate`].

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// A token that strictly increases per lock name across holders and is never reused,
/// including across restarts of a store that keeps its data. Re-entering a held lock
/// (same owner) gives the same token.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The number itself, e.g. to store next to a row.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Accepts a token only if it is at least the highest accepted so far.
///
/// ```
/// use leasehold::{FenceGate, FencingToken};
/// let gate = FenceGate::new();
/// assert!(gate.admit(FencingToken(7)));
/// assert!(gate.admit(FencingToken(7)));   // the same holder again
/// assert!(!gate.admit(FencingToken(6)));  // a stale holder
/// assert_eq!(gate.highest(), FencingToken(7));
/// ```
#[derive(Debug, Default)]
pub struct FenceGate {
    highest: AtomicU64,
}

impl FenceGate {
    /// A gate that has seen no token.
    pub fn new() -> Self {
        Self::default()
    }

    /// Admits `token` if it is ≥ every token admitted before, and remembers it.
    ///
    /// `#[must_use]`: `false` is the gate refusing a stale holder, and a write made
    /// anyway is the one fencing exists to stop.
    ///
    /// ```compile_fail
    /// #![deny(unused_must_use)]
    /// leasehold::FenceGate::new().admit(leasehold::FencingToken(1));
    /// ```
    #[must_use = "false means a newer holder has been admitted: do not write"]
    pub fn admit(&self, token: FencingToken) -> bool {
        self.highest.fetch_max(token.0, Ordering::AcqRel) <= token.0
    }

    /// The highest token admitted so far (0 before any).
    pub fn highest(&self) -> FencingToken {
        FencingToken(self.highest.load(Ordering::Acquire))
    }
}

/// A fence kept in a file: the highest token admitted, for a resource outside the
/// process that several processes write — files a job replaces, a directory it
/// publishes to — or for shell scripts holding `$LEASEHOLD_TOKEN` (`leasehold fence`).
///
/// [`lock`](Self::lock) takes the file's `flock` and holds it until the `FileFence` is
/// dropped, so a check and the write it guards are one step against every other user of
/// the fence. Admitted tokens are written durably (fsync) before [`admit`](Self::admit)
/// says yes. Blocking: in async code, call it from `spawn_blocking`. The file must be on
/// a file system where `flock` works between its users (a local one; not every network
/// file system).
///
/// ```
/// use leasehold::{FileFence, FencingToken};
/// # let dir = std::env::temp_dir().join(format!("fence-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir)?;
/// let path = dir.join("report.fence");
/// let mut fence = FileFence::lock(&path)?;
/// assert!(fence.admit(FencingToken(7))?);   // write the report now, then drop the fence
/// drop(fence);
/// let mut stale = FileFence::lock(&path)?;
/// assert!(!stale.admit(FencingToken(6))?);  // a holder whose lease ended: do not write
/// assert_eq!(stale.highest(), FencingToken(7));
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct FileFence {
    file: std::fs::File,
    highest: u64,
}

/// The fence file's descriptor, whose open file holds the `flock`: a process that keeps
/// it open across `exec` (without close-on-exec) holds the fence until it exits.
impl std::os::fd::AsRawFd for FileFence {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }
}

impl FileFence {
    /// Opens `path` (creating it, empty: no token admitted yet), waits for its `flock`
    /// and reads the highest token admitted. An unreadable file is an
    /// [`InvalidData`](std::io::ErrorKind::InvalidData) error, never read as 0.
    pub fn lock(path: impl AsRef<std::path::Path>) -> std::io::Result<FileFence> {
        use std::io::Read;
        use std::os::fd::AsRawFd;
        let path = path.as_ref();
        let existed = path.exists();
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        if !existed {
            // The new file's name too must survive a crash, or a token admitted into it
            // could vanish with it.
            let dir = match path.parent() {
                Some(dir) if !dir.as_os_str().is_empty() => dir,
                _ => std::path::Path::new("."),
            };
            std::fs::File::open(dir)?.sync_all()?;
        }
        // SAFETY: a valid fd, owned by `file`; the lock goes with it.
        while unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        let highest = match text.trim() {
            "" => 0,
            number => number.parse().map_err(|_| {
                let what = format!("{} holds {text:?}, not a fencing token", path.display());
                std::io::Error::new(std::io::ErrorKind::InvalidData, what)
            })?,
        };
        Ok(FileFence { file, highest })
    }

    /// The highest token admitted so far (0 before any).
    pub fn highest(&self) -> FencingToken {
        FencingToken(self.highest)
    }

    /// Admits `token` if it is ≥ every token admitted before, and records it durably.
    #[must_use = "Ok(false) means a newer holder has been admitted: do not write"]
    pub fn admit(&mut self, token: FencingToken) -> std::io::Result<bool> {
        if token.0 < self.highest {
            return Ok(false);
        }
        if token.0 > self.highest {
            self.write(token.0)?;
        }
        Ok(true)
    }

    /// Forgets every token admitted: for moving a lock to another store, whose tokens
    /// may start lower, at a moment when no holder of the lock runs.
    pub fn reset(&mut self) -> std::io::Result<()> {
        self.write(0)
    }

    /// One write of the same length in place (20 digits and a newline), so that a crash
    /// leaves the old token or the new one, never an empty file that would read as 0.
    fn write(&mut self, token: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let text = format!("{token:020}\n");
        self.file.write_all_at(text.as_bytes(), 0)?;
        // Anything longer that was there before (written by hand) goes.
        self.file.set_len(text.len() as u64)?;
        self.file.sync_data()?;
        self.highest = token;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token written by hand, padded past what `admit` writes, is read and then
    /// replaced whole: no tail is left to make the file unreadable.
    #[test]
    fn a_longer_file_is_replaced_whole() {
        let dir = std::env::temp_dir().join(format!("fence-long-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("padded.fence");
        std::fs::write(&path, format!("7{}\n", " ".repeat(40))).unwrap();
        let mut fence = FileFence::lock(&path).unwrap();
        assert_eq!(fence.highest(), FencingToken(7));
        assert!(fence.admit(FencingToken(8)).unwrap());
        drop(fence);
        assert_eq!(FileFence::lock(&path).unwrap().highest(), FencingToken(8));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
