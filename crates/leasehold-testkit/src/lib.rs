//! Test support for leasehold: temporary directories, deadlines, and real store processes
//! (redis-server, etcd) on free loopback ports.

use std::path::{Path, PathBuf};
use std::time::Duration;

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

/// Whether every thread of process `pid` is stopped (SIGSTOP), so it answers nothing.
pub fn pid_stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue; // a thread that just exited
        };
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next());
        if !matches!(state, Some("T" | "t" | "Z" | "X") | None) {
            return false;
        }
        any = true;
    }
    any
}

/// SIGSTOP to `pid`, and waits until all its threads stopped: `kill` returns before a
/// thread busy on another core stops, and that thread could still answer a request.
pub fn stop_process(pid: i32) {
    send_signal(pid, libc::SIGSTOP);
    wait_for(&format!("process {pid} to stop"), || pid_stopped(pid));
}

/// Sends `signal` to process `pid`; panics if it cannot, or if `pid` is not a process
/// (0, the pid of a stopped server, would signal the test's own process group).
pub fn send_signal(pid: i32, signal: i32) {
    assert!(pid > 0, "no process to send signal {signal} to (pid {pid})");
    // SAFETY: plain syscall.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {signal}): {}",
        std::io::Error::last_os_error()
    );
}

/// Bytes received but not yet read by the sockets bound to local `port` (from
/// `/proc/net/tcp`): a request that waits in a stopped server's socket.
pub fn unread_bytes(port: u16) -> u64 {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields.get(1)?.rsplit(':').next()?;
            let rx_queue = fields.get(4)?.split(':').nth(1)?;
            (u16::from_str_radix(local_port, 16).ok()? == port)
                .then(|| u64::from_str_radix(rx_queue, 16).ok())
                .flatten()
        })
        .sum()
}

/// A free TCP port on 127.0.0.1 (bound and released; a server started right away gets it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Writes a test CA (`ca.pem`, `ca.key`) and a server certificate it signed (`server.pem`,
/// `server.key`, for `IP:127.0.0.1` and `DNS:localhost`, valid one day) into `dir`, with
/// `openssl`. Clients trust the server via `SSL_CERT_FILE=DIR/ca.pem`; `server.pem` alone
/// is not a CA, so pointing `SSL_CERT_FILE` at it makes the server untrusted.
pub fn make_tls_certs(dir: &Path) {
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .expect("write san.ext");
    // No argument holds a space, so each step is split on whitespace.
    let steps = [
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 -subj /CN=leasehold-test-ca",
        "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
        "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 -extfile san.ext",
    ];
    for step in steps {
        let out = match std::process::Command::new("openssl")
            .args(step.split_whitespace())
            .current_dir(dir)
            .stdin(std::process::Stdio::null())
            .output()
        {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                panic!("openssl is not installed: apt-get install openssl")
            }
            Err(e) => panic!("cannot run openssl: {e}"),
        };
        assert!(
            out.status.success(),
            "openssl {step}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A store server's process: started so that it dies with the test process
/// (`PR_SET_PDEATHSIG`), then paused, resumed and killed by pid.
#[derive(Debug, Default)]
struct ServerProcess(Option<std::process::Child>);

type SpawnCall = (
    std::process::Command,
    std::sync::mpsc::Sender<std::io::Result<std::process::Child>>,
);

/// Spawns `cmd` from one thread that lives as long as the test process.
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the
/// process: a server started from a tokio blocking-pool thread (`spawn_blocking`, which
/// tests use to start etcd and Redis Cluster) was killed when that thread retired after
/// 10 s idle, in the middle of a longer test.
fn spawn_from_lasting_thread(cmd: std::process::Command) -> std::io::Result<std::process::Child> {
    use std::sync::mpsc;
    use std::sync::{Mutex, OnceLock};
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnCall>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnCall>();
        std::thread::Builder::new()
            .name("testkit-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("start the testkit's spawner thread");
        Mutex::new(tx)
    });
    let (reply, answer) = mpsc::channel();
    let sent = spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((cmd, reply));
    sent.expect("the spawner thread lives as long as the process");
    answer.recv().expect("the spawner thread answers")
}

impl ServerProcess {
    /// Starts `cmd`; `package` is the Debian package to name when the binary is missing.
    fn spawn(&mut self, mut cmd: std::process::Command, package: &str) {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let program = cmd.get_program().to_string_lossy().into_owned();
        self.0 = Some(match spawn_from_lasting_thread(cmd) {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "{program} is not installed: run ./scripts/test (it installs it) or apt-get install {package}"
            ),
            Err(e) => panic!("cannot start {program}: {e}"),
        });
    }

    /// Not running: never started, killed, or exited (e.g. its port was taken).
    fn exited(&mut self) -> bool {
        !matches!(self.0.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    fn pid(&self) -> i32 {
        self.0.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// SIGKILL, and reap it.
    fn kill(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

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

    /// Its pid (0 when stopped).
    pub fn pid(&self) -> i32 {
        self.process.pid()
    }

    /// SIGSTOP: the server stops answering but keeps its connections (stopped on return).
    pub fn pause(&self) {
        stop_process(self.pid());
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        send_signal(self.pid(), libc::SIGCONT);
    }

    /// SIGKILL, and reap it.
    pub fn kill(&mut self) {
        self.process.kill();
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

/// `--heartbeat-interval` / `--election-timeout` (ms) of a lone [`EtcdServer`]: faster than
/// etcd's defaults so its minimum lease TTL (1.5 election timeouts, rounded up to seconds)
/// is 1 s rather than 2 s.
const ETCD_SINGLE_TIMING: (u32, u32) = (50, 500);

/// The same for an [`EtcdCluster`]: etcd's defaults, which keep three members from
/// electing spuriously on two loaded cores (the minimum lease TTL is then 2 s).
const ETCD_CLUSTER_TIMING: (u32, u32) = (100, 1000);

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
}

impl EtcdServer {
    /// A single-member cluster, healthy; retried on new ports when another test took one
    /// between our probe and etcd's bind.
    pub fn start() -> Self {
        Self::start_single(None)
    }

    /// The same serving clients over TLS with `cert` and `key` (PEM): its
    /// [`url`](Self::url) is `etcds://`. The certificate must name 127.0.0.1 (see
    /// [`make_tls_certs`]).
    pub fn start_tls(cert: &Path, key: &Path) -> Self {
        Self::start_single(Some((cert.to_path_buf(), key.to_path_buf())))
    }

    fn start_single(tls: Option<(PathBuf, PathBuf)>) -> Self {
        let mut server = EtcdServer::new("m0", ETCD_SINGLE_TIMING);
        server.tls = tls;
        for _ in 0..5 {
            server.client_port = free_port();
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

    /// Its pid (0 when stopped).
    pub fn pid(&self) -> i32 {
        self.process.pid()
    }

    /// SIGSTOP: the member stops answering (clients and peers) but keeps its connections
    /// (stopped on return).
    pub fn pause(&self) {
        stop_process(self.pid());
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        send_signal(self.pid(), libc::SIGCONT);
    }

    /// SIGKILL, and reap it.
    pub fn kill(&mut self) {
        self.process.kill();
    }

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
            self.dir.0.disable_cleanup(true);
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

/// The unsigned number after `"key":` in `json` (etcdctl's flat status output).
fn json_u64(json: &str, key: &str) -> Option<u64> {
    let rest = &json[json.find(&format!("\"{key}\":"))? + key.len() + 3..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// A three-member etcd cluster on loopback, each member an [`EtcdServer`] of its own with
/// etcd's default timing, stopped by pid when dropped.
#[derive(Debug)]
pub struct EtcdCluster {
    /// The members, in the order of [`url`](Self::url).
    pub members: Vec<EtcdServer>,
}

impl EtcdCluster {
    /// Starts three members and waits until each is healthy and one leads; the whole
    /// cluster is started again on new ports when a member could not bind its own.
    pub fn start() -> Self {
        let mut failed = Vec::new();
        for _ in 0..5 {
            failed.clear();
            let mut members: Vec<EtcdServer> = (0..3)
                .map(|i| {
                    let mut m = EtcdServer::new(&format!("m{i}"), ETCD_CLUSTER_TIMING);
                    m.client_port = free_port();
                    m.peer_port = free_port();
                    m
                })
                .collect();
            let initial: Vec<String> = members.iter().map(EtcdServer::peer_entry).collect();
            let cluster = (initial.join(","), etcd_cluster_token());
            for m in &mut members {
                m.cluster = cluster.clone();
                m.spawn();
            }
            if members.iter_mut().all(EtcdServer::wait_started) {
                let cluster = EtcdCluster { members };
                cluster.wait_for_leader();
                return cluster;
            }
            // Dropped (logs and all) before the next attempt; the last one's logs are kept.
            failed = members;
        }
        let logs: Vec<String> = (failed.iter())
            .map(|m| m.log().display().to_string())
            .collect();
        panic!("etcd cluster did not start; see {}", logs.join(", "));
    }

    /// `etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
    pub fn url(&self) -> String {
        let endpoints: Vec<String> = self.members.iter().map(EtcdServer::endpoint).collect();
        format!("etcd://{}", endpoints.join(","))
    }

    /// The index of the member that leads now: of the running members that answer
    /// `endpoint status` within about a second (paused ones are skipped), one that names
    /// itself leader, at the highest raft term if two do (a stale leader just resumed).
    pub fn leader(&self) -> Option<usize> {
        // All asked at once, so a member that does not answer costs one timeout in all.
        let asked: Vec<(usize, std::process::Child)> = (self.members.iter().enumerate())
            .filter(|(_, m)| m.pid() != 0 && !pid_stopped(m.pid()))
            .filter_map(|(i, m)| Some((i, m.status()?)))
            .collect();
        let mut best: Option<(u64, usize)> = None;
        for (i, child) in asked {
            let Ok(out) = child.wait_with_output() else {
                continue;
            };
            let json = String::from_utf8_lossy(&out.stdout);
            let (Some(id), Some(leader), Some(term)) = (
                json_u64(&json, "member_id"),
                json_u64(&json, "leader"),
                json_u64(&json, "raftTerm"),
            ) else {
                continue;
            };
            if id == leader && best.is_none_or(|(t, _)| term > t) {
                best = Some((term, i));
            }
        }
        best.map(|(_, i)| i)
    }

    /// Waits (up to [`PATIENCE`]) until a running member leads, and returns its index.
    pub fn wait_for_leader(&self) -> usize {
        wait_until("an etcd member to lead", PATIENCE, || self.leader())
    }
}

/// A TCP proxy on a free loopback port to `127.0.0.1:target` that holds every reply back
/// by `delay` (a slow link: each answer arrives `delay` after the server sent it).
/// Stops accepting when dropped; open connections end when either side closes.
#[derive(Debug)]
pub struct DelayProxy {
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl DelayProxy {
    pub fn start(target: u16, delay: Duration) -> Self {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let pipe = |mut from: TcpStream, mut to: TcpStream, delay: Duration| {
            // Chunks are stamped when read and written when due, so a delay does not add
            // up over a stream of replies.
            let (tx, rx) = std::sync::mpsc::channel::<(std::time::Instant, Vec<u8>)>();
            let mut writer = to.try_clone().expect("clone a proxied socket");
            std::thread::spawn(move || {
                for (due, chunk) in rx {
                    std::thread::sleep(due.saturating_duration_since(std::time::Instant::now()));
                    if writer.write_all(&chunk).is_err() {
                        break;
                    }
                }
                let _ = writer.shutdown(Shutdown::Write);
            });
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    let due = std::time::Instant::now() + delay;
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
                drop(tx);
                let _ = to.flush();
            });
        };
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                pipe(client, server, Duration::ZERO);
                pipe(s2, c2, delay);
            }
        });
        DelayProxy { port, stop }
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wakes the accept loop so it sees `stop`.
        let _ = std::net::TcpStream::connect(("127.0.0.1", self.port));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server started from a thread that then ends keeps running (the death signal is
    /// tied to the thread that forked it, so that must be one that lasts).
    #[test]
    fn a_server_outlives_the_thread_that_started_it() {
        let (server, tid) = std::thread::spawn(|| {
            // SAFETY: plain syscall.
            (RedisServer::start(), unsafe { libc::gettid() })
        })
        .join()
        .unwrap();
        // The kernel sends the death signal while the thread exits, before its task
        // leaves /proc: once it has left, a server tied to it has been told to die.
        wait_for("the starting thread to be gone", || {
            !Path::new(&format!("/proc/self/task/{tid}")).exists()
        });
        assert!(
            server.ping(),
            "redis-server died with the thread that started it"
        );
    }
}
