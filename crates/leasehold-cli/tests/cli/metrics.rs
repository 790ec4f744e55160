//! Metrics.

use super::*;

/// The samples of a Prometheus text page: `name{k="v",...}` (labels sorted) to value.
fn scrape(port: u16) -> std::collections::HashMap<String, f64> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut page = String::new();
    conn.read_to_string(&mut page).unwrap();
    let (head, body) = page.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let mut samples = std::collections::HashMap::new();
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').expect("a sample line");
        let key = match series.split_once('{') {
            Some((name, labels)) => {
                let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                labels.sort();
                format!("{name}{{{}}}", labels.join(","))
            }
            None => series.to_string(),
        };
        samples.insert(key, value.parse().unwrap());
    }
    samples
}

/// The key [`scrape`] gives the series `name` of the local store's exclusive locks, with
/// `extra` labels.
fn series(name: &str, extra: &[&str]) -> String {
    let mut labels = vec![r#"kind="exclusive""#, r#"store="local""#];
    labels.extend_from_slice(extra);
    labels.sort();
    format!("{name}{{{}}}", labels.join(","))
}

#[test]
fn run_serves_metrics_while_held_and_after_a_loss() {
    let cli = Cli::new("metrics");
    let port = leasehold_testkit::free_port();
    let addr = format!("127.0.0.1:{port}");
    // The command stays after the loss (it ignores the SIGTERM until told), so the
    // metrics can be read then. A long TTL: no renewal can see the loss before the
    // store's watch does.
    let mut run = cli.spawn(
        "run",
        &[
            "run",
            "--metrics",
            &addr,
            "--ttl",
            "60s",
            "--grace",
            "60s",
            "k",
            "--",
            "sh",
            "-c",
            "trap 'touch lost; while [ ! -f done ]; do sleep 0.05; done; exit 0' TERM; \
             touch started; while :; do sleep 0.05; done",
        ],
    );
    cli.wait_file("started");
    let held = scrape(port);
    let value = |samples: &std::collections::HashMap<String, f64>, key: String| {
        *samples
            .get(&key)
            .unwrap_or_else(|| panic!("no {key} in {samples:?}"))
    };
    assert_eq!(value(&held, series("leasehold_held", &[])), 1.0);
    let acquired = series("leasehold_acquisitions_total", &[r#"outcome="acquired""#]);
    assert_eq!(value(&held, acquired), 1.0);
    assert_eq!(
        value(&held, series("leasehold_wait_seconds_count", &[])),
        1.0
    );
    // A histogram (buckets), as the README lists it, not a summary.
    let all = series("leasehold_wait_seconds_bucket", &[r#"le="+Inf""#]);
    assert_eq!(value(&held, all), 1.0);

    cli.run(&["release", "--force", "k"]).expect(0);
    cli.wait_file("lost");
    let lost = scrape(port);
    let reason = r#"reason="force_released""#;
    assert_eq!(
        value(&lost, series("leasehold_losses_total", &[reason])),
        1.0
    );
    cli.touch("done");
    run.expect_exit(76);
}

#[test]
fn metrics_address_in_use_is_refused_with_64() {
    let cli = Cli::new("metrics-in-use");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = cli.run(&["hold", "--metrics", &addr, "k"]).expect(64);
    assert!(out.stderr.contains("cannot serve metrics"), "{out:?}");
}
