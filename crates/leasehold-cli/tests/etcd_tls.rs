//! The `leasehold` binary against real etcd serving clients over TLS (`etcds://`): rustls
//! with the native roots, which honour `SSL_CERT_FILE`.

mod support;

use leasehold_testkit::{make_tls_certs, EtcdServer, TempDir};
use support::*;

/// A trusted CA (`SSL_CERT_FILE`): commands run under the lock. Without it the server's
/// certificate is not trusted: a configuration to fix, exit 78, and the command does not
/// run.
#[test]
fn tls_etcd_runs_commands_and_refuses_an_untrusted_server() {
    let certs = TempDir::new("etcd-tls");
    make_tls_certs(certs.path());
    let server = EtcdServer::start_tls(
        &certs.path().join("server.pem"),
        &certs.path().join("server.key"),
    );
    assert!(server.url().starts_with("etcds://"), "{}", server.url());
    let cli = Cli::with_store("etcd-tls", Some(server.url()));
    let run = |cert_file: &str, body: &str| {
        let mut cmd = cli.cmd(&["run", "k", "--", "sh", "-c", body]);
        // The only roots: rustls-native-certs reads SSL_CERT_DIR too.
        cmd.env("SSL_CERT_FILE", certs.path().join(cert_file))
            .env_remove("SSL_CERT_DIR");
        Out::from(cmd.output().expect("run leasehold"))
    };
    run("ca.pem", "echo $LEASEHOLD_TOKEN > token").expect(0);
    let token = cli.read("token");
    assert!(
        token.trim().parse::<u64>().is_ok(),
        "LEASEHOLD_TOKEN was {token:?}, not a decimal token"
    );
    let out = run("server.pem", "touch ran").expect(78);
    assert!(!cli.exists("ran"), "the command ran: {}", out.stderr);
    assert!(
        out.stderr.contains("certificate is not trusted") && out.stderr.contains("SSL_CERT_FILE"),
        "{}",
        out.stderr
    );
    drop(server);
}
