//! The blocking API's conformance cases on the in-process and local stores.

mod memory {
    leasehold::conformance_blocking!((std::sync::Arc::new(leasehold::MemoryStore::new()), ()));
}

mod local {
    leasehold::conformance_blocking!({
        let dir = leasehold_testkit::TempDir::new("blocking-local");
        let store = leasehold::LocalStore::open(dir.path()).unwrap();
        (std::sync::Arc::new(store), dir)
    });
}
