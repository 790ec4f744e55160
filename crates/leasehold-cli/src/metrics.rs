//! `--metrics ADDR`: the library's metrics as Prometheus text over HTTP, for as long as
//! the command runs (a scrape sees every acquisition, renewal and loss of this process).

use std::net::SocketAddr;

use crate::exit::{self, Failure};

/// Starts serving on `addr`, if given, on the current runtime.
pub fn serve(addr: Option<SocketAddr>) -> Result<(), Failure> {
    let Some(addr) = addr else { return Ok(()) };
    start(addr)
}

#[cfg(feature = "prometheus")]
fn start(addr: SocketAddr) -> Result<(), Failure> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| {
            Failure::new(
                exit::USAGE,
                format!("cannot serve metrics on {addr}: {e}; pick another --metrics address"),
            )
        })
}

#[cfg(not(feature = "prometheus"))]
fn start(addr: SocketAddr) -> Result<(), Failure> {
    Err(Failure::new(
        exit::USAGE,
        format!("cannot serve metrics on {addr}: this leasehold was built without its `prometheus` feature"),
    ))
}
