//! The conformance suite on a real redis-server, one server per case.
#![cfg(feature = "redis")]

leasehold::conformance_suite!(async {
    let server = leasehold_testkit::RedisServer::start();
    let store = leasehold::RedisStore::connect(&server.url()).await.unwrap();
    (std::sync::Arc::new(store), server)
});

leasehold::conformance_processes!(async {
    let server = leasehold_testkit::RedisServer::start();
    let url = server.url();
    let open = leasehold::conformance::opener(move || {
        let url = url.clone();
        async move { leasehold::RedisStore::connect(&url).await }
    });
    (open, server)
});
