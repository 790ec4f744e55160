//! The few OS facts leasehold needs.

use std::ffi::CStr;

/// This host's name ("localhost" if it cannot be read).
pub(crate) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success
    // when the name fits, and the last byte stays 0 otherwise.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return "localhost".into();
    }
    CStr::from_bytes_until_nul(&buf)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into())
}

#[cfg(feature = "local")]
pub(crate) use local::*;

#[cfg(feature = "local")]
mod local {
    use std::os::fd::{FromRawFd, OwnedFd};

    /// Nanoseconds on CLOCK_BOOTTIME: monotonic, shared by every process on the host, and
    /// counting time spent suspended (a lease must not outlive a suspend).
    pub(crate) fn boottime_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid out-pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    /// Identifies this boot: CLOCK_BOOTTIME values from another boot mean nothing.
    pub(crate) fn boot_id() -> String {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    }

    /// False only if `pid` certainly is not running: it does not exist, or it has exited
    /// and waits to be reaped (a zombie, as orphans stay where PID 1 does not reap).
    pub(crate) fn pid_exists(pid: u32) -> bool {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return true;
        };
        // SAFETY: signal 0 only checks existence and permission.
        if unsafe { libc::kill(pid, 0) } != 0 {
            return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
        }
        // The state letter follows the command name in parentheses (which may hold spaces).
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => !matches!(
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next()),
                Some("Z" | "X")
            ),
            Err(e) => e.kind() != std::io::ErrorKind::NotFound,
        }
    }

    /// A pidfd (readable once the process exits), if the kernel has them.
    pub(crate) fn pidfd_open(pid: u32) -> Option<OwnedFd> {
        // SAFETY: plain syscall; a non-negative result is a new fd that we own.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: fd is a fresh descriptor returned by the kernel.
        Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    /// The process holding a `flock` on the file `(dev, ino)`, and its user id, from
    /// `/proc/locks` (blocked requests, marked `->`, are not holders).
    pub(crate) fn flock_holder(dev: u64, ino: u64) -> Option<(u32, u32)> {
        let wanted = format!(
            "{:02x}:{:02x}:{ino}",
            libc::major(dev as libc::dev_t),
            libc::minor(dev as libc::dev_t)
        );
        let locks = std::fs::read_to_string("/proc/locks").ok()?;
        let pid = locks.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            match fields.as_slice() {
                [_, "FLOCK", _, _, pid, file, ..] if *file == wanted => pid.parse::<u32>().ok(),
                _ => None,
            }
        })?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|u| u.parse().ok())?;
        Some((pid, uid))
    }
}

/// How many names `file` has (0 once deleted, or replaced by a rename), by one `fstat`;
/// `None` if it cannot be read.
pub(crate) fn link_count(file: &std::fs::File) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `st` is written by fstat before it is read, and only when it succeeds.
    let rc = unsafe { libc::fstat(file.as_raw_fd(), st.as_mut_ptr()) };
    // (`nlink_t` is 64 bits on x86-64, 32 on some other targets.)
    #[allow(clippy::unnecessary_cast)]
    let links = |st: libc::stat| st.st_nlink as u64;
    (rc == 0).then(|| links(unsafe { st.assume_init() }))
}

/// Opens the directory `dir` without following a symbolic link there (`ELOOP`; a file
/// that is not a directory: `ENOTDIR`).
#[cfg(feature = "local")]
pub(crate) fn open_dir_own(dir: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
}

/// Opens `name` in the directory `dir` for reading and writing, creating it with `mode`,
/// without following a symbolic link at either: a link there (`dir` itself, or the file)
/// fails with `ELOOP`, so whoever may write in the directory cannot point the store at
/// another file. A file that is not a regular one fails with `InvalidInput`.
#[cfg(feature = "local")]
pub(crate) fn open_own(
    dir: &std::path::Path,
    name: &std::ffi::OsStr,
    mode: u32,
) -> std::io::Result<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::unix::ffi::OsStrExt;
    let dir = open_dir_own(dir)?;
    let name = std::ffi::CString::new(name.as_bytes())?;
    let flags = libc::O_RDWR | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: a directory descriptor we hold and a NUL-terminated name.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, mode) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor, ours alone.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    if !file.metadata()?.file_type().is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(file)
}
