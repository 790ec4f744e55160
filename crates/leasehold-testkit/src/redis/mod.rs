//! Real `redis-server` processes: one server, or a cluster of three.

mod cluster;

use std::path::PathBuf;

pub use self::cluster::RedisCluster;
use crate::net::free_port;
use crate::process::{server_process_controls, ServerProcess};
use crate::temp_dir::TempDir;
use crate::wait::{wait_until, PATIENCE};

/// A real `redis-server` on a free loopback port with its own directory, stopped by pid
/// when dropped (and killed with the test process, via `PR_SET_PDEATHSIG`).
#[derive(Debug)]
pub struct RedisServer {
    process: ServerProcess,
    port: u16,
    dir: TempDir,
    extra: Vec<String>,
    /// A directory of [`make_tls_certs`](crate::make_tls_certs) and the TLS port: a
    /// server that also serves TLS, asking clients for a certificate.
    tls: Option<(PathBuf, u16)>,
}

impl RedisServer {
    /// A server without persistence.
    pub fn start() -> Self {
        Self::start_with(&["--save", "", "--appendonly", "no"])
    }

    /// A server that writes every change to its append-only file before answering
    /// (`appendfsync always`), so a restart loses nothing.
    pub fn start_persistent() -> Self {
        Self::start_with(&[
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
        ])
    }

    /// A server with extra `redis-server` arguments (e.g. `--appendonly yes`).
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_on(extra, free_port)
    }

    /// A server without persistence on `port` (e.g. one a client already tries to reach);
    /// panics if it cannot start there.
    pub fn start_at(port: u16) -> Self {
        let mut tries = 0;
        Self::start_on(&["--save", "", "--appendonly", "no"], move || {
            tries += 1;
            assert!(tries == 1, "redis-server could not start on port {port}");
            port
        })
    }

    /// A server on a port `pick` chooses, retried when another test took the port
    /// between our probe and the server's bind.
    fn start_on(extra: &[&str], pick: impl FnMut() -> u16) -> Self {
        let mut server = RedisServer {
            process: ServerProcess::default(),
            port: 0,
            dir: TempDir::new("redis"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            tls: None,
        };
        server.start_trying(pick);
        server
    }

    /// A server without persistence that also serves TLS on [`tls_port`](Self::tls_port)
    /// with the certificates [`make_tls_certs`](crate::make_tls_certs) wrote in `certs`,
    /// and refuses TLS clients without a client certificate the test CA signed
    /// (`--tls-auth-clients yes`). Its plain port stays open, for the test's own checks.
    pub fn start_tls(certs: &std::path::Path) -> Self {
        let mut server = RedisServer {
            process: ServerProcess::default(),
            port: 0,
            dir: TempDir::new("redis-tls"),
            extra: ["--save", "", "--appendonly", "no"]
                .map(String::from)
                .to_vec(),
            tls: Some((certs.to_path_buf(), 0)),
        };
        server.start_trying(free_port);
        server
    }

    /// Starts it on ports `pick` chooses, again when another test took one of them
    /// between our probe and the server's bind.
    fn start_trying(&mut self, mut pick: impl FnMut() -> u16) {
        for _ in 0..5 {
            self.port = pick();
            if let Some((_, port)) = &mut self.tls {
                *port = free_port();
            }
            if self.spawn() {
                return;
            }
        }
        panic!("redis-server did not start; see {}", self.log().display());
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    /// Starts the process on `self.port`; false if it exited before answering.
    fn spawn(&mut self) -> bool {
        let mut cmd = std::process::Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--protected-mode", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.log())
            .args(&self.extra);
        if let Some((certs, port)) = &self.tls {
            cmd.args(["--tls-port", &port.to_string(), "--tls-auth-clients", "yes"])
                .arg("--tls-cert-file")
                .arg(certs.join("server.pem"))
                .arg("--tls-key-file")
                .arg(certs.join("server.key"))
                .arg("--tls-ca-cert-file")
                .arg(certs.join("ca.pem"));
        }
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let started_before = self.starts_logged();
        self.process.spawn(cmd, "redis-server");
        // Its own log says it listens: a PING alone may be answered by the server of
        // another test that took the port first (ours then exits, and a cluster
        // waited forever for the node).
        wait_until("redis-server to answer PING", PATIENCE, || {
            if self.starts_logged() > started_before && self.ping() {
                return Some(true);
            }
            self.process.exited().then_some(false)
        })
    }

    /// How many times its log says it bound its ports and is ready (a restart logs to
    /// the same file).
    fn starts_logged(&self) -> usize {
        std::fs::read_to_string(self.log()).map_or(0, |log| log.matches("Ready to accept").count())
    }

    /// Whether the server answers PING now (`-NOAUTH` counts: it is up).
    pub fn ping(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(1)));
        let mut buf = [0u8; 5];
        s.write_all(b"PING\r\n").is_ok()
            && s.read_exact(&mut buf).is_ok()
            && (&buf == b"+PONG" || &buf == b"-NOAU")
    }

    /// Runs `redis-cli -p PORT ARGS...` against this server and returns what it printed.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(&[&["-p", &self.port.to_string()], args].concat())
    }

    /// `redis://127.0.0.1:PORT/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The TLS port of a server from [`start_tls`](Self::start_tls).
    pub fn tls_port(&self) -> Option<u16> {
        self.tls.as_ref().map(|(_, port)| *port)
    }

    /// `rediss://127.0.0.1:TLS_PORT/0` of a server from [`start_tls`](Self::start_tls).
    pub fn tls_url(&self) -> Option<String> {
        (self.tls_port()).map(|port| format!("rediss://127.0.0.1:{port}/0"))
    }

    server_process_controls!("the server stops answering but keeps its connections");

    /// Kills it (if running) and starts it again on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        assert!(
            self.spawn(),
            "redis-server did not restart; see {}",
            self.log().display()
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `redis-cli ARGS...` and returns what it printed (empty if it could not run).
pub fn redis_cli(args: &[&str]) -> String {
    std::process::Command::new("redis-cli")
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}
