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

    /// A server on a port `pick` chooses, retried when another test took the port
    /// between our probe and the server's bind.
    fn start_on(extra: &[&str], pick: fn() -> u16) -> Self {
        let mut server = RedisServer {
            process: ServerProcess::default(),
            port: 0,
            dir: TempDir::new("redis"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        for _ in 0..5 {
            server.port = pick();
            if server.spawn() {
                return server;
            }
        }
        panic!("redis-server did not start; see {}", server.log().display());
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
            .args(&self.extra)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        self.process.spawn(cmd, "redis-server");
        wait_until("redis-server to answer PING", PATIENCE, || {
            if self.ping() {
                return Some(true);
            }
            self.process.exited().then_some(false)
        })
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
