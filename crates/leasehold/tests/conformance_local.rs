//! The conformance suite on the local store, each case in its own directory.

leasehold::conformance_suite!(async {
    let dir = leasehold_testkit::TempDir::new("conformance-local");
    let store = leasehold::LocalStore::open(dir.path()).unwrap();
    (std::sync::Arc::new(store), dir)
});

leasehold::conformance_processes!(async {
    let dir = leasehold_testkit::TempDir::new("conformance-local");
    let path = dir.path().to_path_buf();
    let open = leasehold::conformance::opener(move || {
        let path = path.clone();
        async move { leasehold::LocalStore::open(&path) }
    });
    (open, dir)
});
