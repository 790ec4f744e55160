//! `--metrics ADDR`: the library's metrics as Prometheus text over HTTP, for as long as
//! the command runs (a scrape sees every acquisition, renewal and loss of this process).

use std::net::SocketAddr;

use crate::exit::{self, Failure};

/// Starts serving on `addr`, if given, on the current runtime.
pub fn serve(addr: Option<SocketAddr>) -> Result<(), Failure> {
    let Some(addr) = addr else { return Ok(()) };
    start(addr)
}

/// Bucket bounds (seconds) of every timing: store calls take from a fraction of a
/// millisecond, waits and holds up to minutes. As histograms (`_bucket` series), not the
/// exporter's default summaries, so `histogram_quantile` can aggregate across processes.
#[cfg(feature = "prometheus")]
const BUCKETS: [f64; 17] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
];

#[cfg(feature = "prometheus")]
fn start(addr: SocketAddr) -> Result<(), Failure> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(&BUCKETS)
        .map_err(|e| Failure::new(exit::INTERNAL, format!("metrics buckets: {e}")))?
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
