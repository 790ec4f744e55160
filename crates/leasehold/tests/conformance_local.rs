//! The conformance suite on the local store, each case in its own directory.

leasehold::conformance_suite!(async {
    let dir = leasehold_testkit::TempDir::new("conformance-local");
    std::sync::Arc::new(leasehold::LocalStore::open(dir.leak()).unwrap())
});
