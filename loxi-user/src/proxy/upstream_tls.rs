//! Backend TLS for `security: 2` rules: a connector that opens TCP (hyper-util's
//! `HttpConnector`, with the proxy's connect timeout) and completes a rustls handshake,
//! verifying the backend's certificate against the rule's CA bundle (`backend_ca_file`, else
//! the webpki root set) and name (`backend_tls_server_name`, else the endpoint's IP); with
//! `backend_tls_insecure: true` verification is off (warned at every pool build).
//!
//! ALPN follows `backend_protocol`: `http1` offers `http/1.1`, `http2` offers `h2`, `both`
//! offers both and the backend's choice decides (hyper-util's client speaks HTTP/2 on a
//! connection that negotiated `h2`). Each rule gets its own pooled client, so connections are
//! pooled per endpoint and never shared between rules verifying other names.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::rules::spec::BackendProtocol;

/// The pooled clients of one `security: 2` rule, one per endpoint (the request's URI names the
/// client's host, see `per_endpoint::host_as_authority`).
pub type TlsClient = Arc<super::per_endpoint::PerEndpoint<TlsConnect>>;

/// What a rule asks of its backends' TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendTls {
    /// The name verified in (and sent as SNI to) every backend; `None`: the endpoint's IP.
    pub server_name: Option<String>,
    /// PEM CA bundle; `None`: the webpki root set (Mozilla's roots).
    pub ca_file: Option<String>,
    /// Skip verification (explicitly asked).
    pub insecure: bool,
    /// ALPN offered.
    pub protocol: BackendProtocol,
}

/// Why a backend TLS configuration cannot be built (refused at `POST`).
#[derive(Debug, thiserror::Error)]
pub enum BackendTlsError {
    /// The CA bundle does not load.
    #[error("backend_ca_file {path}: {reason}")]
    Ca {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// `backend_tls_server_name` is not a DNS name or IP.
    #[error("backend_tls_server_name {0:?} is not a DNS name or an IP address")]
    Name(String),
    /// rustls refused the configuration.
    #[error("backend TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

impl BackendTls {
    /// The rustls client configuration (checks the CA bundle and the name).
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, BackendTlsError> {
        if let Some(n) = &self.server_name {
            ServerName::try_from(n.clone()).map_err(|_| BackendTlsError::Name(n.clone()))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let mut cfg = if self.insecure {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
                .with_no_client_auth()
        } else {
            builder
                .with_root_certificates(self.roots()?)
                .with_no_client_auth()
        };
        cfg.alpn_protocols = match self.protocol {
            BackendProtocol::Http1 => vec![b"http/1.1".to_vec()],
            BackendProtocol::Http2 => vec![b"h2".to_vec()],
            BackendProtocol::Both => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        };
        Ok(Arc::new(cfg))
    }

    fn roots(&self) -> Result<rustls::RootCertStore, BackendTlsError> {
        let Some(path) = &self.ca_file else {
            let mut roots = rustls::RootCertStore::empty();
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            return Ok(roots);
        };
        let ca = |reason: String| BackendTlsError::Ca {
            path: path.clone(),
            reason,
        };
        if !std::path::Path::new(path).is_absolute() {
            // Read from the daemon's working directory, which a restart under another service
            // manager or shell changes: accepted today, the rule would be dropped at restart.
            return Err(ca(
                "not an absolute path (the daemon reads it from its own working directory, which \
                 a restart may change); give the full path on the daemon's host"
                    .into(),
            ));
        }
        let text = std::fs::read(path).map_err(|e| ca(e.to_string()))?;
        // Items that are not CA certificates are skipped while one is usable (a private key is
        // refused); with none, each is named with why.
        let bundle = crate::certs::parse::CaBundle::from_pem(&text).map_err(ca)?;
        if bundle.roots.is_empty() {
            return Err(ca(bundle.none_usable()));
        }
        bundle.no_private_key().map_err(ca)?;
        Ok(bundle.roots)
    }

    /// The pooled client of a rule: TCP within `connect_timeout`, then the handshake.
    pub fn client(&self, connect_timeout: Duration) -> Result<TlsClient, BackendTlsError> {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(connect_timeout));
        http.set_nodelay(true);
        let connect = TlsConnect {
            http,
            tls: tokio_rustls::TlsConnector::from(self.client_config()?),
            server_name: self.server_name.clone(),
            timeout: connect_timeout,
            h2_only: self.protocol == BackendProtocol::Http2,
        };
        let mut b = Client::builder(TokioExecutor::new());
        if self.protocol == BackendProtocol::Http2 {
            b.http2_only(true);
        }
        Ok(Arc::new(super::per_endpoint::PerEndpoint::new(
            connect,
            b,
            http::uri::Scheme::HTTPS,
        )))
    }
}

/// The connector of [`TlsClient`].
#[derive(Clone)]
pub struct TlsConnect {
    http: HttpConnector,
    tls: tokio_rustls::TlsConnector,
    server_name: Option<String>,
    timeout: Duration,
    /// `backend_protocol: http2`: a backend that does not choose `h2` over ALPN fails the
    /// connect with a message that says so (hyper's HTTP/2 client would fail the request with
    /// a bare `SendRequest` error).
    h2_only: bool,
}

impl std::fmt::Debug for TlsConnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConnect")
            .field("server_name", &self.server_name)
            .finish()
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for TlsConnect {
    type Response = TlsIo;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<TlsIo, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let name = self
            .server_name
            .clone()
            .or_else(|| uri.host().map(|h| h.trim_matches(['[', ']']).to_string()));
        let (tcp, tls, timeout) = (self.http.call(uri), self.tls.clone(), self.timeout);
        let h2_only = self.h2_only;
        Box::pin(async move {
            let shown = name.ok_or("backend URI without a host")?;
            let name = ServerName::try_from(shown.clone())
                .map_err(|_| format!("backend TLS name {shown:?} is not a DNS name or IP"))?;
            let stream: TcpStream = tcp.await?.into_inner();
            let shake = tokio::time::timeout(timeout, tls.connect(name.clone(), stream));
            match shake.await {
                Ok(Ok(s)) => {
                    let alpn = s.get_ref().1.alpn_protocol();
                    if h2_only && alpn != Some(b"h2") {
                        return Err(format!(
                            "backend {shown} did not agree on HTTP/2 over ALPN (it chose {}); \
                             backend_protocol http2 needs an h2 backend: use http1, or both to \
                             follow the backend's choice",
                            alpn.map_or("none".to_owned(), |p| {
                                format!("{:?}", String::from_utf8_lossy(p))
                            })
                        )
                        .into());
                    }
                    Ok(TlsIo(TokioIo::new(s)))
                }
                Ok(Err(e)) => Err(format!(
                    "backend TLS handshake with {shown}: {}",
                    super::attempt::error_chain(&e)
                )
                .into()),
                Err(_) => Err(format!("backend TLS handshake with {shown} timed out").into()),
            }
        })
    }
}

/// A backend TLS connection as hyper reads and writes it.
pub struct TlsIo(TokioIo<TlsStream<TcpStream>>);

impl Connection for TlsIo {
    fn connected(&self) -> Connected {
        let h2 = self.0.inner().get_ref().1.alpn_protocol() == Some(b"h2");
        let c = Connected::new();
        if h2 { c.negotiated_h2() } else { c }
    }
}

impl hyper::rt::Read for TlsIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for TlsIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The verifier of `backend_tls_insecure: true`: accepts any certificate (signatures still
/// checked with the provider's algorithms, so the handshake itself is sound). Public for tests
/// that look at what a server presents (an expired certificate, say).
#[derive(Debug)]
pub struct NoVerify(pub Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `Err` when a `security: 2` rule's backend TLS cannot be configured (an unreadable or empty
/// `backend_ca_file`, a `backend_tls_server_name` that is no name); checked at `POST`.
pub fn check(s: &crate::rules::ServiceArgs) -> Result<(), BackendTlsError> {
    if s.security != 2 {
        return Ok(());
    }
    BackendTls {
        server_name: Some(s.backend_tls_server_name.clone()).filter(|n| !n.is_empty()),
        ca_file: Some(s.backend_ca_file.clone()).filter(|f| !f.is_empty()),
        insecure: s.backend_tls_insecure,
        protocol: BackendProtocol::Http1,
    }
    .client_config()
    .map(drop)
}

/// The backend TLS a rule asks for: `Some` for `security: 2` (the rule's
/// `backend_tls_server_name`, `backend_ca_file`, `backend_tls_insecure` and
/// `backend_protocol`), `None` otherwise.
pub fn backend_tls(rule: &crate::rules::StoredRule) -> Option<BackendTls> {
    let s = &rule.rule.service;
    (s.security == 2).then(|| BackendTls {
        server_name: Some(s.backend_tls_server_name.clone()).filter(|n| !n.is_empty()),
        ca_file: Some(s.backend_ca_file.clone()).filter(|f| !f.is_empty()),
        insecure: s.backend_tls_insecure,
        protocol: rule.spec.backend,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(ca_file: &std::path::Path) -> String {
        let tls = BackendTls {
            server_name: None,
            ca_file: Some(ca_file.display().to_string()),
            insecure: false,
            protocol: BackendProtocol::Http1,
        };
        match tls.client_config() {
            Ok(_) => "accepted".into(),
            Err(e) => e.to_string(),
        }
    }

    /// A CA file with no usable certificate says which PEM item was refused and why; a private
    /// key beside a usable CA is refused too.
    #[test]
    fn a_ca_file_without_a_usable_certificate_says_why() {
        let dir = tempfile::tempdir().expect("tmp");
        let ca = dir.path().join("ca.pem");
        let key = crate::certs::testutil::self_signed(&["a.example"], None).key_pem;
        let bad = "-----BEGIN CERTIFICATE-----\nAAECAwQFBgcI\n-----END CERTIFICATE-----\n";
        std::fs::write(&ca, format!("{key}{bad}")).expect("write");
        assert_eq!(
            refusal(&ca),
            format!(
                "backend_ca_file {}: no usable CA certificate: PEM item 1 is a PRIVATE KEY, not \
                 a CERTIFICATE; PEM item 2 (CERTIFICATE): the certificate is truncated or not DER",
                ca.display()
            )
        );
        std::fs::write(&ca, "hello\n").expect("write");
        assert_eq!(
            refusal(&ca),
            format!("backend_ca_file {}: no CERTIFICATE block", ca.display())
        );
        let good = crate::certs::testutil::self_signed(&["ca.example"], None).cert_pem;
        std::fs::write(&ca, format!("{good}{key}")).expect("write");
        assert_eq!(
            refusal(&ca),
            format!(
                "backend_ca_file {}: PEM item 2 is a PRIVATE KEY: a CA file holds certificates \
                 only; keep private keys out of trust bundles (remove it from the file)",
                ca.display()
            ),
            "a usable CA beside a key"
        );
        std::fs::write(&ca, &good).expect("write");
        assert_eq!(refusal(&ca), "accepted");
    }
}
