//! The tiny HTTP/1.1 client `loxicmd` uses: one connection per call, plain or TLS (rustls with
//! the `ring` provider, server certificate verified against `--cacert` or the system bundle),
//! with an optional bearer token. The integration tests use it to talk to an HTTPS API too.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// The CA bundle used for `https` when no `--cacert` is given (Debian's `ca-certificates`).
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Errors reaching the API (not HTTP error statuses, which are answers).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The request could not be built (bad host or path).
    #[error("bad request URL {url}: {source}")]
    Url {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: http::Error,
    },
    /// The TLS settings cannot be used (CA file, server name).
    #[error("TLS setup: {0}")]
    TlsSetup(String),
    /// Connecting (TCP or the TLS handshake) failed.
    #[error("cannot reach the loxilb API at {url}: {source}")]
    Connect {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Sending or reading the answer failed.
    #[error("talking to the loxilb API at {url}: {source}")]
    Http {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: hyper::Error,
    },
}

/// Where and how to reach the API.
#[derive(Clone)]
pub struct Target {
    /// Host name or IP literal (no brackets).
    pub host: String,
    /// Port.
    pub port: u16,
    /// TLS client settings for `https`; `None` = plain `http`.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Bearer token sent as `Authorization: Bearer <token>`.
    pub token: Option<String>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("base", &self.base_url())
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl Target {
    /// A plain-HTTP target without token.
    pub fn http(host: &str, port: u16) -> Self {
        Self {
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port,
            tls: None,
            token: None,
        }
    }

    /// `scheme://host:port` (IPv6 literals in brackets).
    pub fn base_url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.authority())
    }

    /// `host:port` (`[host]:port` for an IPv6 literal).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// Sends `req` (its URI is the path and query) and returns the response head and body.
    pub async fn send(
        &self,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, ClientError> {
        let url = format!("{}{}", self.base_url(), req.uri());
        let connect = |source| ClientError::Connect {
            url: url.clone(),
            source,
        };
        if let Ok(v) = HeaderValue::from_str(&self.authority()) {
            req.headers_mut().entry(header::HOST).or_insert(v);
        }
        if let Some(t) = &self.token
            && let Ok(v) = HeaderValue::from_str(&format!("Bearer {t}"))
        {
            req.headers_mut().insert(header::AUTHORIZATION, v);
        }
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(connect)?;
        let Some(cfg) = &self.tls else {
            return exchange(tcp, req, &url).await;
        };
        let name = ServerName::try_from(self.host.clone())
            .map_err(|e| ClientError::TlsSetup(format!("server name {:?}: {e}", self.host)))?;
        let tls = tokio_rustls::TlsConnector::from(cfg.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| connect(tls_in_words(e)))?;
        exchange(tls, req, &url).await
    }
}

async fn exchange<I>(
    io: I,
    req: Request<Full<Bytes>>,
    url: &str,
) -> Result<Response<Incoming>, ClientError>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let http = |source| ClientError::Http {
        url: url.to_string(),
        source,
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(http)?;
    #[allow(
        clippy::disallowed_methods,
        reason = "the connection driver of a one-shot CLI request; it ends with the connection"
    )]
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender.send_request(req).await.map_err(http)
}

/// A TLS handshake error with rustls' reason in words (`UnknownIssuer`: the server's
/// certificate is not signed by a CA this side trusts, naming `--cacert`;
/// [`crate::certs::parse::rustls_reason`]); other I/O errors as they are.
fn tls_in_words(e: std::io::Error) -> std::io::Error {
    let reason = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .map(|r| crate::certs::parse::rustls_reason(r, "loxicmd --cacert FILE"));
    match reason {
        Some(r) => std::io::Error::new(e.kind(), format!("TLS handshake: {r}")),
        None => e,
    }
}

/// TLS client settings trusting the PEM certificates in `cacert` (default
/// [`SYSTEM_CA_BUNDLE`]). A certificate of the file that rustls cannot take as a CA is an
/// error naming its PEM item and why, and so is a private key in it (other PEM items are
/// skipped while a certificate is usable).
pub fn tls_config(cacert: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, ClientError> {
    let path = cacert.unwrap_or(Path::new(SYSTEM_CA_BUNDLE));
    let setup = |e: String| ClientError::TlsSetup(format!("CA file {}: {e}", path.display()));
    let text = std::fs::read(path).map_err(|e| setup(e.to_string()))?;
    if let Some(reason) =
        crate::certs::parse::der_file_reason(&text, crate::certs::parse::PemFile::Certificate)
    {
        return Err(ClientError::TlsSetup(match cacert {
            Some(p) => format!("--cacert {}: {reason}", p.display()),
            None => format!("CA file {}: {reason}", path.display()),
        }));
    }
    let bundle = crate::certs::parse::CaBundle::from_pem(&text).map_err(setup)?;
    if bundle.roots.is_empty() {
        return Err(setup(bundle.none_usable()));
    }
    if let Some(bad) = bundle.refused.iter().find(|r| r.reason.is_some()) {
        return Err(setup(bad.to_string()));
    }
    bundle.no_private_key().map_err(setup)?;
    let roots = bundle.roots;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientError::TlsSetup(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// One request to `target` + `path` (JSON `body` when given); returns `(status, body text)`.
pub async fn call(
    target: &Target,
    method: http::Method,
    path: &str,
    body: Option<String>,
) -> Result<(u16, String), ClientError> {
    let mut req = Request::builder().method(method).uri(path);
    if body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|source| ClientError::Url {
            url: format!("{}{path}", target.base_url()),
            source,
        })?;
    let resp = target.send(req).await?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|source| ClientError::Http {
            url: format!("{}{path}", target.base_url()),
            source,
        })?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DER CA file given as `--cacert` is refused naming the option, the file and the
    /// openssl command that writes it as PEM (it was "no CERTIFICATE block").
    #[test]
    fn a_der_cacert_is_refused_with_the_openssl_command() {
        let dir = tempfile::tempdir().expect("tmp");
        let ca = dir.path().join("ca.der");
        let pem = crate::certs::testutil::self_signed(&["ca.example"], None);
        std::fs::write(&ca, crate::certs::testutil::der_files(&pem).0).expect("write");
        let e = tls_config(Some(&ca)).expect_err("DER");
        assert_eq!(
            e.to_string(),
            format!(
                "TLS setup: --cacert {}: the file looks DER-encoded (binary), not PEM: `openssl \
                 x509 -inform DER -in FILE -out FILE.pem` writes it as PEM; give that file \
                 instead",
                ca.display()
            )
        );
        std::fs::write(&ca, &pem.cert_pem).expect("write");
        tls_config(Some(&ca)).expect("the PEM form is taken");
    }

    /// A CA file whose certificate does not decode names the file, the PEM item and why, not
    /// a "peer certificate"; one without a certificate says so.
    #[test]
    fn a_bad_ca_file_is_named_as_the_ca_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let ca = dir.path().join("ca.pem");
        let bad = "-----BEGIN CERTIFICATE-----\nAAECAwQFBgcI\n-----END CERTIFICATE-----\n";
        std::fs::write(&ca, bad).expect("write");
        let e = tls_config(Some(&ca)).expect_err("not a certificate");
        assert_eq!(
            e.to_string(),
            format!(
                "TLS setup: CA file {}: no usable CA certificate: PEM item 1 (CERTIFICATE): the \
                 certificate is truncated or not DER",
                ca.display()
            )
        );
        // A bad certificate after a good one is refused too (the file is the user's choice).
        let good = crate::certs::testutil::self_signed(&["ca.example"], None).cert_pem;
        std::fs::write(&ca, format!("{good}{bad}")).expect("write");
        let e = tls_config(Some(&ca)).expect_err("a bad second certificate");
        assert_eq!(
            e.to_string(),
            format!(
                "TLS setup: CA file {}: PEM item 2 (CERTIFICATE): the certificate is truncated \
                 or not DER",
                ca.display()
            )
        );
        assert!(!e.to_string().contains("peer"), "{e}");
        let key = crate::certs::testutil::self_signed(&["a.example"], None).key_pem;
        std::fs::write(&ca, key).expect("write");
        let e = tls_config(Some(&ca)).expect_err("a key");
        assert!(
            e.to_string().ends_with(
                "no usable CA certificate: PEM item 1 is a PRIVATE KEY, not a CERTIFICATE"
            ),
            "{e}"
        );
    }
}
