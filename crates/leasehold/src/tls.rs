//! TLS handshakes that failed for a reason retrying cannot fix: a certificate that is
//! not trusted, or a client certificate the server wants and did not get.

/// What to check when `error` (or one of its causes) is a TLS refusal; `None` otherwise.
pub(crate) fn refusal(error: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    use rustls::{AlertDescription as Alert, Error as Tls};
    let mut cause = Some(error);
    while let Some(error) = cause {
        // tokio-rustls reports rustls's error inside an I/O error, which the redis crate
        // keeps in an `Arc`.
        let shared = error.downcast_ref::<std::sync::Arc<dyn std::error::Error + Send + Sync>>();
        let error: &(dyn std::error::Error + 'static) = match shared {
            Some(shared) => &**shared,
            None => error,
        };
        let inner = (error.downcast_ref::<std::io::Error>()).and_then(|io| io.get_ref());
        let tls = (error.downcast_ref::<Tls>()).or_else(|| inner?.downcast_ref::<Tls>());
        match tls {
            Some(Tls::InvalidCertificate(_)) => return Some(SERVER_NOT_TRUSTED),
            Some(Tls::AlertReceived(
                Alert::CertificateRequired
                | Alert::BadCertificate
                | Alert::UnknownCA
                | Alert::CertificateUnknown
                | Alert::UnsupportedCertificate
                | Alert::CertificateExpired
                | Alert::CertificateRevoked
                | Alert::AccessDenied,
            )) => return Some(CLIENT_REFUSED),
            _ => {}
        }
        cause = error.source();
    }
    None
}

const SERVER_NOT_TRUSTED: &str = "the server's certificate is not trusted: give its CA (the builder's tls_ca, or SSL_CERT_FILE) and check that the URL's host is a name in the certificate";
const CLIENT_REFUSED: &str = "the server refused our client certificate, or wants one: give one its CA signed (the builder's tls_client_cert)";
