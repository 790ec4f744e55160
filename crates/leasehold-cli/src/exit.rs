//! Exit codes: documented constants (sysexits.h values where one fits).

use std::process::ExitCode;

/// Bad usage or bad input: name, duration, URL, permits, owner, store directory.
pub const USAGE: u8 = 64;
/// The store could not be reached.
pub const UNAVAILABLE: u8 = 69;
/// An internal error (including unreadable store state).
pub const INTERNAL: u8 = 70;
/// The store refused us for a configuration reason (credentials, permissions, database).
pub const CONFIG: u8 = 78;
/// Not acquired within `--wait`, or busy with `--no-wait`; `limit`: over the rate.
pub const NOT_ACQUIRED: u8 = 75;
/// The lock was lost while the command ran (the command was stopped).
pub const LOST: u8 = 76;
/// The command could not be executed (found but not runnable).
pub const CANNOT_EXECUTE: u8 = 126;
/// The command was not found.
pub const NOT_FOUND: u8 = 127;

/// The table shown in `--help`.
pub const TABLE: &str = "\
Exit status:
  N      the command's own exit status, when it ran to the end
  128+N  the command died of signal N (not one sent because the lock was lost)
  64     bad usage or bad input (name, duration, URL, permits, owner, store directory)
  69     the store is unreachable
  70     internal error (including unreadable store state)
  78     the store refused the configuration (credentials, permissions, database)
  75     not acquired within --wait, or busy with --no-wait (--conflict-exit-code N sets it);
         limit: over the rate
  76     the lock was lost while the command ran; the command was stopped
  126    the command could not be executed
  127    the command was not found";

/// Writes `text` to standard output: a write that fails (a reader gone, `| head`; a full
/// disk) is a clean error, exit 70, not a panic.
pub fn print(text: &str) -> Result<(), Failure> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    (out.write_all(text.as_bytes()).and_then(|()| out.flush()))
        .map_err(|e| Failure::new(INTERNAL, format!("cannot write to standard output: {e}")))
}

/// An expected failure: what to print and which code to exit with.
#[derive(Debug)]
pub struct Failure {
    /// Exit status.
    pub code: u8,
    /// Message for stderr (without the `leasehold: ` prefix).
    pub message: String,
}

impl Failure {
    /// A failure with `code`.
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }

    /// Prints it and gives the exit code.
    pub fn report(self) -> ExitCode {
        eprintln!("leasehold: {}", self.message);
        ExitCode::from(self.code)
    }
}

impl From<leasehold::Error> for Failure {
    fn from(e: leasehold::Error) -> Self {
        use leasehold::Error as E;
        let code = match &e {
            E::InvalidName { .. }
            | E::InvalidOption { .. }
            | E::InvalidStore { .. }
            | E::Conflict { .. }
            | E::Unsupported { .. } => USAGE,
            E::Unavailable { .. } | E::WaitEnded { .. } => UNAVAILABLE,
            E::Config { .. } => CONFIG,
            E::Lost { .. } => LOST,
            _ => INTERNAL,
        };
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            let s_text = s.to_string();
            if !message.contains(&s_text) {
                message.push_str(": ");
                message.push_str(&s_text);
            }
            source = s.source();
        }
        Failure { code, message }
    }
}
