//! The etcd helpers against real etcd processes: a lone member paused, killed and
//! restarted; a three-member cluster losing its leader and getting the member back.

use leasehold_testkit::{pid_alive, wait_for, wait_until, EtcdCluster, EtcdServer, PATIENCE};
use std::time::{Duration, Instant};

/// Reading a key takes longer than this only when something hangs.
const QUICK: Duration = Duration::from_secs(5);

fn get(member: &EtcdServer, key: &str) -> String {
    member
        .etcdctl(&["get", key, "--print-value-only"])
        .trim()
        .to_string()
}

#[test]
fn a_single_server_pauses_resumes_and_keeps_its_data_across_a_restart() {
    let mut etcd = EtcdServer::start();
    assert_eq!(etcd.url(), format!("etcd://{}", etcd.endpoint()));
    assert_eq!(etcd.endpoint(), format!("127.0.0.1:{}", etcd.port()));
    assert!(etcd.healthy());

    assert_eq!(etcd.etcdctl(&["put", "k", "v1"]).trim(), "OK");
    assert_eq!(get(&etcd, "k"), "v1");
    // The fast timing is what lets a lease live 1 s (etcd would raise it to 2 s).
    let lease = etcd.etcdctl(&["lease", "grant", "1"]);
    assert!(lease.contains("TTL(1s)"), "{lease}");

    etcd.pause();
    let asked = Instant::now();
    assert!(!etcd.healthy());
    assert!(
        asked.elapsed() < QUICK,
        "healthy() hung {:?}",
        asked.elapsed()
    );
    etcd.resume();
    wait_for("etcd to be healthy again after resume", || etcd.healthy());

    let pid = etcd.pid();
    etcd.kill();
    assert_eq!(etcd.pid(), 0);
    assert!(!pid_alive(pid));
    assert!(!etcd.healthy());
    etcd.restart();
    assert_ne!(etcd.pid(), 0);
    assert!(etcd.healthy());
    assert_eq!(get(&etcd, "k"), "v1");
}

#[test]
fn a_cluster_elects_a_new_leader_and_takes_a_killed_member_back() {
    let mut cluster = EtcdCluster::start();
    assert_eq!(cluster.members.len(), 3);
    let endpoints: Vec<String> = cluster.members.iter().map(|m| m.endpoint()).collect();
    assert_eq!(cluster.url(), format!("etcd://{}", endpoints.join(",")));
    assert!(cluster.members.iter().all(EtcdServer::healthy));

    assert_eq!(cluster.members[0].etcdctl(&["put", "k", "v1"]).trim(), "OK");
    assert_eq!(get(&cluster.members[1], "k"), "v1");

    let leader = cluster.wait_for_leader();
    assert_eq!(cluster.leader(), Some(leader));

    // A paused follower is skipped, quickly.
    let follower = (leader + 1) % 3;
    cluster.members[follower].pause();
    let asked = Instant::now();
    assert_eq!(cluster.leader(), Some(leader));
    assert!(
        asked.elapsed() < QUICK,
        "leader() hung {:?}",
        asked.elapsed()
    );
    cluster.members[follower].resume();

    cluster.members[leader].kill();
    let new_leader = cluster.wait_for_leader();
    assert_ne!(new_leader, leader);
    assert_eq!(get(&cluster.members[new_leader], "k"), "v1");
    // The other survivor may learn of the new leader a heartbeat later.
    let other = 3 - leader - new_leader;
    wait_until("the other survivor to read k", PATIENCE, || {
        (get(&cluster.members[other], "k") == "v1").then_some(())
    });

    cluster.members[leader].restart();
    assert!(cluster.members[leader].healthy());
    assert_eq!(get(&cluster.members[leader], "k"), "v1");
    assert!(cluster.leader().is_some());
}
