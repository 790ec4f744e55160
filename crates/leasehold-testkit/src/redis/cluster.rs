//! A Redis Cluster of three masters.

use super::RedisServer;
use crate::net::free_port;
use crate::wait::wait_for;

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
