//! Loopback ports: free ones, and what waits unread on one.

/// Bytes received but not yet read by the sockets bound to local `port` (from
/// `/proc/net/tcp`): a request that waits in a stopped server's socket.
pub fn unread_bytes(port: u16) -> u64 {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields.get(1)?.rsplit(':').next()?;
            let rx_queue = fields.get(4)?.split(':').nth(1)?;
            (u16::from_str_radix(local_port, 16).ok()? == port)
                .then(|| u64::from_str_radix(rx_queue, 16).ok())
                .flatten()
        })
        .sum()
}

/// A free TCP port on 127.0.0.1 (bound and released; a server started right away gets it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}
