//! The conformance suite on the local store, each case in its own directory.

leasehold::conformance_suite!(async {
    let dir = leasehold_testkit::TempDir::new("conformance-local");
    let store = leasehold::LocalStore::open(dir.path()).unwrap();
    (std::sync::Arc::new(store), dir)
});
