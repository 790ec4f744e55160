//! The conformance suite on a real single-member etcd, one member per case.
#![cfg(feature = "etcd")]

leasehold::conformance_suite!(async {
    let server = tokio::task::spawn_blocking(leasehold_testkit::EtcdServer::start)
        .await
        .unwrap();
    let store = leasehold::EtcdStore::connect(&server.url()).await.unwrap();
    (std::sync::Arc::new(store), server)
});

leasehold::conformance_processes!(async {
    let server = tokio::task::spawn_blocking(leasehold_testkit::EtcdServer::start)
        .await
        .unwrap();
    let url = server.url();
    let open = leasehold::conformance::opener(move || {
        let url = url.clone();
        async move { leasehold::EtcdStore::connect(&url).await }
    });
    (open, server)
});
