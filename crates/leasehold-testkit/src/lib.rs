//! Test support for leasehold: temporary directories and deadlines now; real store
//! processes (redis-server, etcd) on free loopback ports as those stores arrive.

use std::path::{Path, PathBuf};

/// A temporary directory removed on drop (unless leaked for a store that outlives it).
#[derive(Debug)]
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    /// A fresh directory whose name starts with `leasehold-{label}-`.
    pub fn new(label: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("leasehold-{label}-"))
            .tempdir()
            .expect("create a temporary directory");
        TempDir(dir)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// Keeps the directory (for a store that lives until the test process ends).
    pub fn leak(self) -> PathBuf {
        self.0.keep()
    }
}

/// How long a test waits for a condition before it fails: generous, so a loaded machine
/// (parallel tests on two cores) does not fail a correct test.
pub const PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// How often [`wait_until`] looks again.
pub const POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// Looks at `check` every [`POLL`] until it gives a value, and returns it; panics naming
/// `what` after `patience`. For conditions, never for a fixed delay.
pub fn wait_until<T>(
    what: &str,
    patience: std::time::Duration,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    let deadline = std::time::Instant::now() + patience;
    loop {
        if let Some(value) = check() {
            return value;
        }
        if std::time::Instant::now() >= deadline {
            panic!("gave up after {patience:?} waiting for {what}");
        }
        std::thread::sleep(POLL);
    }
}

/// [`wait_until`] for a yes/no condition, with [`PATIENCE`].
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    wait_until(what, PATIENCE, || cond().then_some(()))
}

/// Whether process `pid` still runs: `kill(pid, 0)` succeeds and it is not a zombie (an
/// exited process nobody reaped yet, as orphans stay where PID 1 does not reap them).
pub fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name, which may hold spaces.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Sends `signal` to process `pid`; panics if it cannot.
pub fn send_signal(pid: i32, signal: i32) {
    // SAFETY: plain syscall.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {signal}): {}",
        std::io::Error::last_os_error()
    );
}

/// A free TCP port on 127.0.0.1 (bound and released; a server started right away gets it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A real `redis-server` on a free loopback port with its own directory, stopped by pid
/// when dropped (and killed with the test process, via `PR_SET_PDEATHSIG`).
#[derive(Debug)]
pub struct RedisServer {
    child: Option<std::process::Child>,
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
            child: None,
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
        use std::os::unix::process::CommandExt;
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
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not installed: run ./scripts/test (it installs it) or apt-get install redis-server"
            ),
            Err(e) => panic!("cannot start redis-server: {e}"),
        };
        self.child = Some(child);
        wait_until("redis-server to answer PING", PATIENCE, || {
            if self.ping() {
                return Some(true);
            }
            match self.child.as_mut().map(|c| c.try_wait()) {
                Some(Ok(Some(_))) => Some(false),
                _ => None,
            }
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

    /// Its pid (0 when stopped).
    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// SIGSTOP: the server stops answering but keeps its connections.
    pub fn pause(&self) {
        send_signal(self.pid(), libc::SIGSTOP);
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        send_signal(self.pid(), libc::SIGCONT);
    }

    /// SIGKILL, and reap it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

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

/// A free port whose cluster bus port (port + 10000) is free too.
fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port <= 55535 && std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

/// A Redis Cluster of three masters on loopback (no replicas), each node a
/// [`RedisServer`] of its own, stopped by pid when dropped.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes, in the order of [`url`](Self::url).
    pub nodes: Vec<RedisServer>,
    password: Option<String>,
}

impl RedisCluster {
    /// Starts three nodes, joins them into one cluster and waits until it serves.
    pub fn start() -> Self {
        Self::start_with_password(None)
    }

    /// The same, every node requiring `password` (`requirepass`, `masterauth`).
    pub fn start_with_password(password: Option<&str>) -> Self {
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
            "--save",
            "",
            "--appendonly",
            "no",
        ];
        let mut auth = Vec::new();
        if let Some(pw) = password {
            args.extend(["--requirepass", pw, "--masterauth", pw]);
            auth.extend(["-a", pw, "--no-auth-warning"]);
        }
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::start_on(&args, free_cluster_port))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let out = std::process::Command::new("redis-cli")
            .args(&auth)
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli (package redis-tools) runs");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = RedisCluster {
            nodes,
            password: password.map(str::to_string),
        };
        for node in &cluster.nodes {
            wait_for("the cluster to be ok on every node", || {
                node.cli(&[&auth[..], &["cluster", "info"]].concat())
                    .contains("cluster_state:ok")
            });
        }
        cluster
    }

    /// `redis+cluster://[:PASSWORD@]127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
    pub fn url(&self) -> String {
        let addrs: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let auth = (self.password.as_ref())
            .map(|pw| format!(":{pw}@"))
            .unwrap_or_default();
        format!("redis+cluster://{auth}{}", addrs.join(","))
    }
}
