//! The conformance suite on the in-process store.

leasehold::conformance_suite!(async { (std::sync::Arc::new(leasehold::MemoryStore::new()), ()) });
