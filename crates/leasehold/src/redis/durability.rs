//! What a restart or failover of the server can lose, asked of the server once when the
//! store connects (the store's caveat).

use std::time::Duration;

/// What a restart or failover of the server behind `conn` can lose, from its settings:
/// `None` when nothing (the append-only file written before every answer, no replicas
/// or `?replicas`), or when it does not say (`CONFIG` renamed away, as on some hosted
/// Redis). `replicas`: `Some(asked)` on a single server, where `?replicas` can make
/// grants wait for replicas; `None` on a cluster's node, where it cannot.
pub(super) async fn caveat<C>(conn: &mut C, replicas: Option<bool>) -> Option<String>
where
    C: redis::aio::ConnectionLike + Clone + Send,
{
    let info = |section: &'static str| {
        let mut conn = conn.clone();
        async move {
            redis::cmd("INFO")
                .arg(section)
                .query_async::<String>(&mut conn)
                .await
                .ok()
        }
    };
    let field = |text: &str, name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    };
    let persistence = info("persistence").await?;
    let fsync: Option<(String, String)> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("appendfsync")
        .query_async(&mut conn.clone())
        .await
        .ok();
    let mut risks = Vec::new();
    match (field(&persistence, "aof_enabled").as_deref(), fsync) {
        (Some("0"), _) => risks.push(
            "a restart forgets every held lock (appendonly no), so a waiter can be granted a lock whose holder has not yet learned that it is gone, and what rate limiters have let through, so each lets a fresh burst pass",
        ),
        (Some(_), Some((_, fsync))) if fsync != "always" => risks.push(
            "a crash can lose the last second of lock changes (appendfsync is not always): a lock granted then can be granted again, with a token given before",
        ),
        _ => {}
    }
    let replication = info("replication").await.unwrap_or_default();
    let replicated = field(&replication, "role").as_deref() == Some("slave")
        || field(&replication, "connected_slaves").is_some_and(|n| n != "0");
    match replicas {
        Some(false) if replicated => risks.push("a failover to a replica that missed writes can grant a held lock again (use ?replicas=N)"),
        None if replicated => risks.push("a failover to a replica that missed writes can grant a held lock again"),
        _ => {}
    }
    (!risks.is_empty()).then(|| risks.join("; "))
}

/// What a restart or failover of a cluster's masters can lose, each asked as a server of
/// its own (a lock lives on the master of its slot): every distinct risk once, with the
/// masters it applies to unless it is all of them. A master that cannot be asked is left
/// out, as a server that does not say is.
pub(super) async fn cluster_caveat(
    conn: &mut redis::cluster_async::ClusterConnection,
    prefix: &str,
) -> Option<String> {
    let masters = cluster_masters(conn).await.ok()?.up;
    let asked = masters.iter().map(|addr| async move {
        let client = redis::Client::open(format!("{prefix}{addr}"))?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(3)))
            .set_response_timeout(Some(Duration::from_secs(5)));
        let mut conn = (client.get_multiplexed_async_connection_with_config(&config)).await?;
        redis::RedisResult::Ok((addr, caveat(&mut conn, None).await))
    });
    let mut risks: Vec<(String, Vec<&String>)> = Vec::new();
    for answer in futures_util::future::join_all(asked).await {
        let Ok((addr, Some(caveat))) = answer else {
            continue;
        };
        match risks.iter_mut().find(|(c, _)| *c == caveat) {
            Some((_, addrs)) => addrs.push(addr),
            None => risks.push((caveat, vec![addr])),
        }
    }
    let named = risks.into_iter().map(|(caveat, addrs)| {
        let addrs: Vec<&str> = addrs.iter().map(|a| a.as_str()).collect();
        match addrs.len() == masters.len() {
            true => caveat,
            false => format!("on master {}: {caveat}", addrs.join(", ")),
        }
    });
    let named: Vec<String> = named.collect();
    (!named.is_empty()).then(|| named.join("; "))
}

/// A cluster's masters, by `host:port`.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Masters {
    /// Those not marked failed.
    pub(super) up: Vec<String>,
    /// Those marked failed (or suspected) that still serve slots: their keys cannot be
    /// read until a replica takes over or they come back.
    pub(super) down: Vec<String>,
}

pub(super) async fn cluster_masters(
    conn: &mut redis::cluster_async::ClusterConnection,
) -> redis::RedisResult<Masters> {
    let nodes: String = redis::cmd("CLUSTER").arg("NODES").query_async(conn).await?;
    Ok(masters_of(&nodes))
}

/// The masters in a `CLUSTER NODES` answer: `id host:port@bus flags master ping pong
/// epoch link slot...`, one node a line.
fn masters_of(nodes: &str) -> Masters {
    let mut masters = Masters::default();
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(address), Some(flags)) = (fields.get(1), fields.get(2)) else {
            continue;
        };
        let flag = |name: &str| flags.split(',').any(|f| f == name);
        if !flag("master") {
            continue;
        }
        let address = address.split('@').next().unwrap_or(address).to_string();
        match (flag("fail") || flag("fail?"), fields.len() > 8) {
            (false, _) => masters.up.push(address),
            (true, true) => masters.down.push(address),
            (true, false) => {}
        }
    }
    masters
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_master_that_serves_slots_is_down() {
        let nodes = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7002@17002 master,fail - 0 0 2 disconnected 5461-10922
c3 127.0.0.1:7003@17003 master - 0 0 3 connected 10923-16383
d4 127.0.0.1:7004@17004 master,fail - 0 0 4 disconnected
e5 127.0.0.1:7005@17005 slave a1 0 0 1 connected
";
        let masters = masters_of(nodes);
        assert_eq!(masters.up, ["127.0.0.1:7001", "127.0.0.1:7003"]);
        assert_eq!(masters.down, ["127.0.0.1:7002"]);
    }
}
