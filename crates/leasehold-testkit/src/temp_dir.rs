//! Temporary directories for stores and tests.

use std::path::{Path, PathBuf};

/// A temporary directory removed on drop (unless leaked for a store that outlives it).
#[derive(Debug)]
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    /// A fresh directory whose name starts with `leasehold-{label}-`.
    pub fn new(label: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("leasehold-{label}-"))
            .tempdir()
            .expect("create a temporary directory");
        TempDir(dir)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// Keeps the directory (for a store that lives until the test process ends).
    pub fn leak(self) -> PathBuf {
        self.0.keep()
    }

    /// Keeps the directory when dropped (for the logs of a store that failed a test).
    pub(crate) fn keep_on_drop(&mut self) {
        self.0.disable_cleanup(true);
    }
}
