//! Real `etcd` processes: a lone member, or a cluster of three.

mod cluster;

use std::path::{Path, PathBuf};

pub use self::cluster::EtcdCluster;
use crate::net::free_port;
use crate::process::{server_process_controls, ServerProcess};
use crate::temp_dir::TempDir;
use crate::wait::{wait_until, PATIENCE, POLL};

/// `--heartbeat-interval` / `--election-timeout` (ms) of a lone [`EtcdServer`]: faster than
/// etcd's defaults so its minimum lease TTL (1.5 election timeouts, rounded up to seconds)
/// is 1 s rather than 2 s.
const ETCD_SINGLE_TIMING: (u32, u32) = (50, 500);

/// A real `etcd` member on free loopback ports (client and peer) with its data and log in
/// a directory of its own, stopped by pid when dropped (and killed with the test process,
/// via `PR_SET_PDEATHSIG`). Alone ([`start`](Self::start)) or one of an [`EtcdCluster`].
#[derive(Debug)]
pub struct EtcdServer {
    process: ServerProcess,
    name: String,
    client_port: u16,
    peer_port: u16,
    dir: TempDir,
    /// `(heartbeat, election timeout)` in ms.
    timing: (u32, u32),
    /// `--initial-cluster` and `--initial-cluster-token`. Kept for restarts, where etcd
    /// ignores them: the data directory already knows its cluster.
    cluster: (String, String),
    /// The length of its log when it was last started: what follows is this run's.
    log_start: u64,
    /// `(certificate, key)` of a member serving clients over TLS (peers stay plain).
    tls: Option<(PathBuf, PathBuf)>,
    /// A [`make_tls_certs`](crate::make_tls_certs) directory: clients must present a
    /// certificate its CA signed (`--client-cert-auth`); etcdctl presents `client.pem`.
    client_auth: Option<PathBuf>,
}

impl EtcdServer {
    /// A single-member cluster, healthy; retried on new ports when another test took one
    /// between our probe and etcd's bind.
    pub fn start() -> Self {
        Self::start_single(None, None, None)
    }

    /// The same serving clients over TLS with `cert` and `key` (PEM): its
    /// [`url`](Self::url) is `etcds://`. The certificate must name 127.0.0.1 (see
    /// [`make_tls_certs`](crate::make_tls_certs)).
    pub fn start_tls(cert: &Path, key: &Path) -> Self {
        Self::start_single(Some((cert.to_path_buf(), key.to_path_buf())), None, None)
    }

    /// The same serving clients over TLS with the certificates
    /// [`make_tls_certs`](crate::make_tls_certs) wrote in `certs`, and refusing clients
    /// without a client certificate its CA signed (`--client-cert-auth`).
    pub fn start_tls_client_auth(certs: &Path) -> Self {
        let tls = (certs.join("server.pem"), certs.join("server.key"));
        Self::start_single(Some(tls), Some(certs.to_path_buf()), None)
    }

    /// A plain single member on `client_port` (e.g. one a client already tries to
    /// reach); panics if it cannot start there.
    pub fn start_at(client_port: u16) -> Self {
        Self::start_single(None, None, Some(client_port))
    }

    fn start_single(
        tls: Option<(PathBuf, PathBuf)>,
        client_auth: Option<PathBuf>,
        client_port: Option<u16>,
    ) -> Self {
        let mut server = EtcdServer::new("m0", ETCD_SINGLE_TIMING);
        server.tls = tls;
        server.client_auth = client_auth;
        let tries = if client_port.is_some() { 1 } else { 5 };
        for _ in 0..tries {
            server.client_port = client_port.unwrap_or_else(free_port);
            server.peer_port = free_port();
            server.cluster = (server.peer_entry(), etcd_cluster_token());
            // A failed attempt may have left a data directory naming the old ports.
            let _ = std::fs::remove_dir_all(server.data_dir());
            server.spawn();
            if server.wait_started() {
                return server;
            }
        }
        panic!("etcd did not start; see {}", server.log().display());
    }

    /// A member not started yet, without ports.
    fn new(name: &str, timing: (u32, u32)) -> Self {
        EtcdServer {
            process: ServerProcess::default(),
            name: name.to_string(),
            client_port: 0,
            peer_port: 0,
            dir: TempDir::new("etcd"),
            timing,
            cluster: Default::default(),
            log_start: 0,
            tls: None,
            client_auth: None,
        }
    }

    /// Its `--initial-cluster` entry: `NAME=http://127.0.0.1:PEER_PORT`.
    fn peer_entry(&self) -> String {
        format!("{}=http://127.0.0.1:{}", self.name, self.peer_port)
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// Starts the process on its ports, without waiting: a cluster's members only become
    /// healthy once a majority of them runs.
    fn spawn(&mut self) {
        // Appended to, so the log of a restart follows that of the run before.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .expect("create the etcd log");
        self.log_start = log.metadata().map_or(0, |m| m.len());
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = std::process::Command::new("etcd");
        cmd.args(["--name", &self.name])
            .arg("--data-dir")
            .arg(self.data_dir())
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.cluster.0])
            .args(["--initial-cluster-token", &self.cluster.1])
            .args(["--initial-cluster-state", "new"])
            .args(["--heartbeat-interval", &self.timing.0.to_string()])
            .args(["--election-timeout", &self.timing.1.to_string()])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log);
        if let Some((cert, key)) = &self.tls {
            cmd.arg("--cert-file").arg(cert).arg("--key-file").arg(key);
        }
        if let Some(certs) = &self.client_auth {
            cmd.arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(certs.join("ca.pem"));
        }
        // etcd reads its flags from ETCD_* variables too; keep the caller's out of it.
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            if key.starts_with("ETCD_") && key != "ETCD_UNSUPPORTED_ARCH" {
                cmd.env_remove(&*key);
            }
        }
        self.process.spawn(cmd, "etcd-server");
    }

    /// Waits until the process is healthy (true) or has exited (false, e.g. a port taken).
    fn wait_started(&mut self) -> bool {
        let what = format!("etcd to be healthy; see {}", self.log().display());
        wait_until(&what, PATIENCE, || {
            if self.process.exited() {
                return Some(false);
            }
            // Its own log first: until it serves, a healthy answer on its port may come
            // from another test's etcd that took the port (ours then exits).
            (self.serving() && self.healthy()).then_some(true)
        })
    }

    /// Whether its log, since the last spawn, says it serves clients (its ports are its):
    /// "serving client traffic", followed by "securely" over TLS.
    fn serving(&self) -> bool {
        use std::io::{Read, Seek};
        let mut log = String::new();
        std::fs::File::open(self.log())
            .and_then(|mut f| {
                f.seek(std::io::SeekFrom::Start(self.log_start))?;
                f.read_to_string(&mut log)
            })
            .is_ok_and(|_| log.contains("serving client traffic"))
    }

    /// Whether `GET /health` answers `"health":"true"` now: the member runs, knows a leader
    /// and got a quorum read through. False within about a second when it is paused.
    pub fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        if self.tls.is_some() {
            return self.healthy_tls();
        }
        let timeout = std::time::Duration::from_secs(1);
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.client_port));
        let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, timeout) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(timeout));
        let _ = s.set_write_timeout(Some(timeout));
        let request = format!(
            "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
            self.client_port
        );
        let mut response = Vec::new();
        s.write_all(request.as_bytes()).is_ok()
            && s.read_to_end(&mut response).is_ok()
            && String::from_utf8_lossy(&response).contains(r#""health":"true""#)
    }

    /// [`healthy`](Self::healthy) over TLS, where a bare HTTP request gets no answer:
    /// `etcdctl endpoint health` (the same quorum read), killed if it outlives its own
    /// timeouts.
    fn healthy_tls(&self) -> bool {
        let args = [
            "--dial-timeout=1s",
            "--command-timeout=1s",
            "endpoint",
            "health",
        ];
        let Ok(mut child) = (self.etcdctl_command(&args))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
        else {
            return false;
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return status.success(),
                Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(POLL),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return false;
                }
            }
        }
    }

    /// Runs `etcdctl --endpoints 127.0.0.1:PORT ARGS...` (API v3) against this member and
    /// returns what it printed on stdout (empty when it failed).
    pub fn etcdctl(&self, args: &[&str]) -> String {
        let out = self
            .etcdctl_command(args)
            .stdin(std::process::Stdio::null())
            .output();
        match out {
            Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "etcdctl is not installed: run ./scripts/test (it installs it) or apt-get install etcd-client"
            ),
            Err(e) => panic!("cannot run etcdctl: {e}"),
        }
    }

    fn etcdctl_command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new("etcdctl");
        // etcdctl reads its flags from ETCDCTL_* variables too; keep the caller's out of it.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("ETCDCTL_") {
                cmd.env_remove(key);
            }
        }
        cmd.env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoint()]);
        if self.tls.is_some() {
            // etcdctl 3.4 dials TLS only with `--insecure-transport=false` (an https://
            // endpoint is not enough); the test CA is not at hand here, so no verification.
            cmd.args(["--insecure-transport=false", "--insecure-skip-tls-verify"]);
        }
        if let Some(certs) = &self.client_auth {
            cmd.arg("--cert")
                .arg(certs.join("client.pem"))
                .arg("--key")
                .arg(certs.join("client.key"));
        }
        cmd.args(args);
        cmd
    }

    /// `etcdctl endpoint status -w json` against this member, started: it prints its
    /// member id, the leader it knows (none when 0) and its raft term, or nothing if the
    /// member did not answer within about a second.
    fn status(&self) -> Option<std::process::Child> {
        let args = [
            "--dial-timeout=1s",
            "--command-timeout=1s",
            "endpoint",
            "status",
            "-w",
            "json",
        ];
        self.etcdctl_command(&args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()
    }

    /// `etcd://127.0.0.1:PORT`, or `etcds://` when it serves clients over TLS.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "etcds" } else { "etcd" };
        format!("{scheme}://{}", self.endpoint())
    }

    /// `127.0.0.1:PORT`, its client address (for `etcdctl --endpoints`).
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Its client port.
    pub fn port(&self) -> u16 {
        self.client_port
    }

    server_process_controls!(
        "the member stops answering (clients and peers) but keeps its connections"
    );

    /// Kills it (if running), starts it again on the same ports and data directory (same
    /// data, same cluster) and waits until it is healthy.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
        assert!(
            self.wait_started(),
            "etcd did not restart; see {}",
            self.log().display()
        );
    }
}

impl Drop for EtcdServer {
    /// Kills it; during a panic keeps its log (whose path the panic shows), not its data.
    fn drop(&mut self) {
        self.kill();
        let logged = std::fs::metadata(self.log()).is_ok_and(|m| m.len() > 0);
        if std::thread::panicking() && logged {
            let _ = std::fs::remove_dir_all(self.data_dir());
            self.dir.keep_on_drop();
        }
    }
}

/// An `--initial-cluster-token` no other cluster (of this or another test process) has,
/// so members never join a stranger that reused a port.
fn etcd_cluster_token() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("leasehold-{}-{n}", std::process::id())
}
