//! A three-member etcd cluster.

use super::{etcd_cluster_token, EtcdServer};
use crate::net::free_port;
use crate::process::pid_stopped;
use crate::wait::{wait_until, PATIENCE};

/// The same for an [`EtcdCluster`]: etcd's defaults, which keep three members from
/// electing spuriously on two loaded cores (the minimum lease TTL is then 2 s).
const ETCD_CLUSTER_TIMING: (u32, u32) = (100, 1000);

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
