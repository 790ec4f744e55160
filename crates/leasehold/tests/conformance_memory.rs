//! The conformance suite on the in-process store.

leasehold::conformance_suite!(async { (std::sync::Arc::new(leasehold::MemoryStore::new()), ()) });

leasehold::conformance_processes!(async {
    let store = leasehold::MemoryStore::new();
    let open = leasehold::conformance::opener(move || {
        let store = store.clone();
        async move { Ok(store) }
    });
    (open, ())
});
