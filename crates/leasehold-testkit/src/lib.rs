//! Test support for leasehold: temporary directories, deadlines, and real store processes
//! (redis-server, etcd) on free loopback ports.

mod etcd;
mod net;
mod process;
mod proxy;
mod redis;
mod temp_dir;
mod tls;
mod wait;

pub use etcd::{EtcdCluster, EtcdServer};
pub use net::{free_port, unread_bytes};
pub use process::{pid_alive, pid_stopped, send_signal, stop_process};
pub use proxy::DelayProxy;
pub use redis::{redis_cli, RedisCluster, RedisServer};
pub use temp_dir::TempDir;
pub use tls::make_tls_certs;
pub use wait::{wait_for, wait_until, wait_until_explained, PATIENCE, POLL};
