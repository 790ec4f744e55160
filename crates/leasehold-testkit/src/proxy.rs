//! A slow link: a TCP proxy that delays replies.

use std::time::Duration;

/// A TCP proxy on a free loopback port to `127.0.0.1:target` that holds every reply back
/// by `delay` (a slow link: each answer arrives `delay` after the server sent it).
/// Stops accepting when dropped; open connections end when either side closes.
#[derive(Debug)]
pub struct DelayProxy {
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl DelayProxy {
    pub fn start(target: u16, delay: Duration) -> Self {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let pipe = |mut from: TcpStream, mut to: TcpStream, delay: Duration| {
            // Chunks are stamped when read and written when due, so a delay does not add
            // up over a stream of replies.
            let (tx, rx) = std::sync::mpsc::channel::<(std::time::Instant, Vec<u8>)>();
            let mut writer = to.try_clone().expect("clone a proxied socket");
            std::thread::spawn(move || {
                for (due, chunk) in rx {
                    std::thread::sleep(due.saturating_duration_since(std::time::Instant::now()));
                    if writer.write_all(&chunk).is_err() {
                        break;
                    }
                }
                let _ = writer.shutdown(Shutdown::Write);
            });
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    let due = std::time::Instant::now() + delay;
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
                drop(tx);
                let _ = to.flush();
            });
        };
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                pipe(client, server, Duration::ZERO);
                pipe(s2, c2, delay);
            }
        });
        DelayProxy { port, stop }
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wakes the accept loop so it sees `stop`.
        let _ = std::net::TcpStream::connect(("127.0.0.1", self.port));
    }
}
