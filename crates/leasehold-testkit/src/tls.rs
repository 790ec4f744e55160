//! A test certificate authority and a server certificate it signed.

use std::path::Path;

/// Writes a test CA (`ca.pem`, `ca.key`), a server certificate it signed (`server.pem`,
/// `server.key`, for `IP:127.0.0.1` and `DNS:localhost`, valid one day) and a client
/// certificate it signed (`client.pem`, `client.key`, for servers that ask for one) into
/// `dir`, with `openssl`. Clients trust the server via `SSL_CERT_FILE=DIR/ca.pem`; `server.pem` alone
/// is not a CA, so pointing `SSL_CERT_FILE` at it makes the server untrusted.
pub fn make_tls_certs(dir: &Path) {
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .expect("write san.ext");
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n")
        .expect("write client.ext");
    // No argument holds a space, so each step is split on whitespace.
    let steps = [
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 -subj /CN=leasehold-test-ca",
        "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
        "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 -extfile san.ext",
        "req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=leasehold-test-client",
        "x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 1 -extfile client.ext",
    ];
    for step in steps {
        let out = match std::process::Command::new("openssl")
            .args(step.split_whitespace())
            .current_dir(dir)
            .stdin(std::process::Stdio::null())
            .output()
        {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                panic!("openssl is not installed: apt-get install openssl")
            }
            Err(e) => panic!("cannot run openssl: {e}"),
        };
        assert!(
            out.status.success(),
            "openssl {step}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
