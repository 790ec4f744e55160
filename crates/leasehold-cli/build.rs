//! Links `leasehold` as a position-dependent executable on Linux.
//!
//! Each `leasehold run` is a process of its own, and a position-independent one pays at
//! every start for relocating its ~16,000 pointers in read-only data (the loader writes
//! to, and so copies, some 70 pages of the binary), again at every fork, and at exit:
//! about 0.2 ms a run, 15 % of `flock FILE true`. The cost is that the binary's own code
//! sits at a fixed address (the libraries, heap and stack are still randomized).
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg-bin=leasehold=-no-pie");
    }
}
