//! TLS handshakes that failed for a reason retrying cannot fix: a certificate that is
//! not trusted, or a client certificate the server wants and did not get.

/// What to check when `error` (or one of its causes) is a TLS refusal; `None` otherwise.
pub(crate) fn refusal(error: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    use rustls::Error as Tls;
    let mut cause = Some(error);
    while let Some(error) = cause {
        // tokio-rustls reports rustls's error inside an I/O error, which the redis crate
        // keeps in an `Arc`.
        let shared = error.downcast_ref::<std::sync::Arc<dyn std::error::Error + Send + Sync>>();
        let error: &(dyn std::error::Error + 'static) = match shared {
            Some(shared) => &**shared,
            None => error,
        };
        let io = error.downcast_ref::<std::io::Error>();
        // h2's error gives its I/O error's causes, not the I/O error itself.
        #[cfg(feature = "etcd")]
        let io = io.or_else(|| error.downcast_ref::<h2::Error>()?.get_io());
        let inner = io.and_then(|io| io.get_ref());
        match (error.downcast_ref::<Tls>()).or_else(|| inner?.downcast_ref::<Tls>()) {
            Some(Tls::InvalidCertificate(_)) => return Some(SERVER_NOT_TRUSTED),
            Some(Tls::AlertReceived(alert)) if REFUSALS.contains(alert) => {
                return Some(CLIENT_REFUSED)
            }
            _ => {}
        }
        // An alert that reached us as text only (h2 keeps an I/O error's message, not
        // the error): as rustls itself words it.
        let text = error.to_string();
        let said = |alert: &rustls::AlertDescription| {
            text.contains(&Tls::AlertReceived(*alert).to_string())
        };
        if REFUSALS.iter().any(said) {
            return Some(CLIENT_REFUSED);
        }
        cause = error.source();
    }
    None
}

/// The alerts of a server that refused our client certificate, or wanted one.
const REFUSALS: [rustls::AlertDescription; 8] = {
    use rustls::AlertDescription as Alert;
    [
        Alert::CertificateRequired,
        Alert::BadCertificate,
        Alert::UnknownCA,
        Alert::CertificateUnknown,
        Alert::UnsupportedCertificate,
        Alert::CertificateExpired,
        Alert::CertificateRevoked,
        Alert::AccessDenied,
    ]
};

const SERVER_NOT_TRUSTED: &str = "the server's certificate is not trusted: give its CA (the builder's tls_ca, or SSL_CERT_FILE) and check that the URL's host is a name in the certificate";
const CLIENT_REFUSED: &str = "the server refused our client certificate, or wants one: give one its CA signed (the builder's tls_client_cert)";

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal that reached us as an I/O error's text only (as h2 passes it on) is
    /// found as one that kept rustls's error is; other failures are not refusals.
    #[test]
    fn a_refusal_is_found_as_an_error_or_as_its_text() {
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::BadCertificate);
        let kept = std::io::Error::new(std::io::ErrorKind::InvalidData, alert.clone());
        let text = std::io::Error::new(std::io::ErrorKind::InvalidData, alert.to_string());
        assert_eq!(refusal(&kept), Some(CLIENT_REFUSED));
        assert_eq!(refusal(&text), Some(CLIENT_REFUSED));
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(refusal(&reset), None);
    }
}
