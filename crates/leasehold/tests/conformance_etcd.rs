//! The conformance suite on a real single-member etcd, one member per case.
#![cfg(feature = "etcd")]

leasehold::conformance_suite!(async {
    let server = tokio::task::spawn_blocking(leasehold_testkit::EtcdServer::start)
        .await
        .unwrap();
    let store = leasehold::EtcdStore::connect(&server.url()).await.unwrap();
    (std::sync::Arc::new(store), server)
});
