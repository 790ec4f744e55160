//! The conformance suite on a real three-master Redis Cluster, one cluster per case.
#![cfg(feature = "redis")]

leasehold::conformance_suite!(async {
    let cluster = tokio::task::spawn_blocking(leasehold_testkit::RedisCluster::start)
        .await
        .unwrap();
    let store = leasehold::RedisStore::connect(&cluster.url())
        .await
        .unwrap();
    (std::sync::Arc::new(store), cluster)
});

leasehold::conformance_processes!(async {
    let cluster = tokio::task::spawn_blocking(leasehold_testkit::RedisCluster::start)
        .await
        .unwrap();
    let url = cluster.url();
    let open = leasehold::conformance::opener(move || {
        let url = url.clone();
        async move { leasehold::RedisStore::connect(&url).await }
    });
    (open, cluster)
});
