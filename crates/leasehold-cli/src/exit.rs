//! Exit codes: documented constants (sysexits.h values where one fits).

use std::process::ExitCode;

/// Declares each exit code once, with its `kind` (the name `--json` errors give it) and
/// its meaning: the constant, its doc, its row in [`CODES`] and in [`KINDS`] come from the
/// same line.
macro_rules! exit_codes {
    ($($name:ident = $code:literal, $kind:literal: $meaning:literal;)*) => {
        $(#[doc = $meaning] pub const $name: u8 = $code;)*
        /// leasehold's own exit codes and their meanings (Markdown), in the order the docs
        /// list them.
        pub const CODES: &[(u8, &str)] = &[$(($code, $meaning)),*];
        /// leasehold's own exit codes and their stable names, for scripts.
        pub const KINDS: &[(u8, &str)] = &[$(($code, $kind)),*];
    };
}

exit_codes! {
    USAGE = 64, "usage": "bad usage or bad input: name, duration, URL, permits, owner, store directory; a request the lock rules refuse";
    UNAVAILABLE = 69, "unavailable": "the store is unreachable";
    INTERNAL = 70, "internal": "internal error (including unreadable store state)";
    CONFIG = 78, "config": "the store refused the configuration: wrong credentials, missing permissions (a local store's files too), a database the server does not have, a TLS certificate not trusted (retrying cannot help)";
    NOT_ACQUIRED = 75, "not_acquired": "not acquired within `--wait`, or busy with `--no-wait` (`-E N` / `--conflict-exit-code N` makes it N); `limit`: over the rate (with `--no-wait`, or longer than `--wait`)";
    LOST = 76, "lost": "the lock was lost while the command ran; the command was stopped";
    CANNOT_EXECUTE = 126, "cannot_execute": "the command could not be executed";
    NOT_FOUND = 127, "not_found": "the command was not found";
}

/// The `kind` of exit code `code` in [`KINDS`]; a code of no row is a signal's (128+N, a
/// wait given up on a signal) or else the command's own.
pub fn kind(code: u8) -> &'static str {
    match KINDS.iter().find(|&&(c, _)| c == code) {
        Some(&(_, kind)) => kind,
        None if code > 128 => "signal",
        None => "exit",
    }
}

/// The exit status of `run` when its command ran: not leasehold's own codes.
const COMMAND_STATUS: [(&str, &str); 2] = [
    ("N", "the command's own exit status, when it ran to the end"),
    (
        "128+N",
        "the command died of signal N (not one sent because the lock was lost)",
    ),
];

/// Every row of the exit status table: the command's statuses, then [`CODES`].
pub fn rows() -> Vec<(String, &'static str)> {
    let command = COMMAND_STATUS.iter().map(|&(c, m)| (c.to_string(), m));
    command
        .chain(CODES.iter().map(|&(c, m)| (c.to_string(), m)))
        .collect()
}

/// The table shown in `--help` and the manual, from [`rows`].
pub fn table() -> String {
    let mut table = "Exit status:".to_string();
    for (code, meaning) in rows() {
        table.push_str(&wrap(
            format!("\n  {code:<6} "),
            &meaning.replace('`', ""),
            9,
        ));
    }
    table
}

/// `text` after `start` (which begins with its line break), in lines of at most 88
/// columns, each further one indented by `indent`.
pub fn wrap(start: String, text: &str, indent: usize) -> String {
    let mut wrapped = String::new();
    let mut line = start;
    for word in text.split(' ') {
        if line.len() + word.len() > 88 {
            wrapped.push_str(line.trim_end());
            line = format!("\n{:indent$}", "");
        }
        line.push_str(word);
        line.push(' ');
    }
    wrapped.push_str(line.trim_end());
    wrapped
}

/// Writes `text` to standard output: a write that fails (a reader gone, `| head`; a full
/// disk) is a clean error, exit 70, not a panic.
pub fn print(text: &str) -> Result<(), Failure> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    (out.write_all(text.as_bytes()).and_then(|()| out.flush()))
        .map_err(|e| Failure::new(INTERNAL, format!("cannot write to standard output: {e}")))
}

/// A warning on stderr: `leasehold: warning: ...`, or with `json` a log line as the
/// JSON log prints one.
pub fn warning(json: bool, message: &str) {
    match json {
        true => eprintln!(
            "{}",
            serde_json::json!({"level": "WARN", "target": "leasehold", "message": message})
        ),
        false => eprintln!("leasehold: warning: {message}"),
    }
}

/// An expected failure: what to print and which code to exit with.
#[derive(Debug)]
pub struct Failure {
    /// Exit status.
    pub code: u8,
    /// Its name for `--json` ([`kind`] of the code, unless the code was chosen by the
    /// user: `--conflict-exit-code`).
    pub kind: &'static str,
    /// Message for stderr (without the `leasehold: ` prefix).
    pub message: String,
}

impl Failure {
    /// A failure with `code`.
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Failure {
            code,
            kind: kind(code),
            message: message.into(),
        }
    }

    /// The same failure under the name of exit code `table_code`, whatever it exits with.
    pub fn named(self, table_code: u8) -> Self {
        Failure {
            kind: kind(table_code),
            ..self
        }
    }

    /// Prints it (one JSON object with `json`) and gives the exit code. One that exits 0
    /// (a busy lock skipped with `-E 0`, as the caller asked) prints nothing but its
    /// JSON: a cron job that skips quietly mails nobody.
    pub fn report(self, json: bool) -> ExitCode {
        if json {
            eprintln!("{}", self.to_json());
        } else if self.code != 0 {
            eprintln!("leasehold: {}", self.message);
        }
        ExitCode::from(self.code)
    }

    /// `{"exit": 75, "kind": "not_acquired", "message": "..."}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"exit": self.code, "kind": self.kind, "message": self.message})
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
        Failure::new(code, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_code_has_its_own_kind_and_a_chosen_code_keeps_the_kind_it_stands_for() {
        let mut kinds: Vec<&str> = KINDS.iter().map(|&(_, kind)| kind).collect();
        kinds.sort_unstable();
        kinds.dedup();
        assert_eq!(kinds.len(), CODES.len());
        assert_eq!(kind(NOT_ACQUIRED), "not_acquired");
        assert_eq!(kind(130), "signal");
        assert_eq!(kind(3), "exit");
        let busy = Failure::new(0, "busy").named(NOT_ACQUIRED);
        assert_eq!(busy.to_json()["exit"], 0);
        assert_eq!(busy.to_json()["kind"], "not_acquired");
    }
}
