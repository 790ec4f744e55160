//! A TCP proxy between the workers and one store endpoint, with link faults: replies
//! delayed (a grant that arrives after its lease would have ended), traffic dropped, and
//! connections reset (requests whose outcome is unknown).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// The faults all connections of one proxy share.
#[derive(Debug)]
pub struct Link {
    /// Delay added to each reply chunk read while it is set, in nanoseconds (0: none).
    delay_ns: AtomicU64,
    /// Discard everything in both directions.
    dropping: AtomicBool,
    /// Bumped to close every open connection.
    resets: watch::Sender<u64>,
}

impl Link {
    fn new() -> Arc<Self> {
        Arc::new(Link {
            delay_ns: AtomicU64::new(0),
            dropping: AtomicBool::new(false),
            resets: watch::Sender::new(0),
        })
    }

    /// Delays replies by `delay` until called again with zero.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ns
            .store(delay.as_nanos() as u64, Ordering::SeqCst);
    }

    /// Drops all traffic until called with false.
    pub fn set_dropping(&self, dropping: bool) {
        self.dropping.store(dropping, Ordering::SeqCst);
    }

    /// Closes every open connection; new ones are served.
    pub fn reset(&self) {
        self.resets.send_modify(|n| *n += 1);
    }
}

/// Listens on a free loopback port and forwards to `upstream`; returns the port.
pub async fn start(upstream: String) -> std::io::Result<(u16, Arc<Link>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let link = Link::new();
    let shared = link.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (link, upstream) = (shared.clone(), upstream.clone());
            tokio::spawn(async move {
                if let Ok(server) = TcpStream::connect(&upstream).await {
                    forward(client, server, &link).await;
                }
            });
        }
    });
    Ok((port, link))
}

async fn forward(client: TcpStream, server: TcpStream, link: &Link) {
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let mut resets = link.resets.subscribe();
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = pump(client_read, server_write, link, false) => {}
        _ = pump(server_read, client_write, link, true) => {}
        _ = resets.changed() => {}
    }
}

/// Copies one direction; replies (`delayed`) may be held back, in order.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    link: &Link,
    delayed: bool,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if link.dropping.load(Ordering::SeqCst) {
                continue;
            }
            let delay = match delayed {
                true => Duration::from_nanos(link.delay_ns.load(Ordering::SeqCst)),
                false => Duration::ZERO,
            };
            if tx
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
            {
                return;
            }
        }
    };
    let write = async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(read, write);
}
