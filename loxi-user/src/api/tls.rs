//! TLS for the REST API (rustls with the `ring` provider).
//!
//! `--api-tls-cert FILE --api-tls-key FILE` (PEM: the certificate chain, leaf first, and its
//! PKCS#8, PKCS#1 or SEC1 private key) make the API speak HTTPS only. Handshakes run in their
//! own tasks, at most [`MAX_HANDSHAKES`] at once and each bounded by [`HANDSHAKE_TIMEOUT`], so a
//! client that connects and says nothing neither blocks other clients nor holds memory for long.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// Longest a client may take to complete the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most TLS handshakes in progress at once; further connections wait in the kernel backlog.
pub const MAX_HANDSHAKES: usize = 256;

/// Why the TLS configuration could not be loaded (the daemon does not start).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable (the reason in words: not a
    /// source, whose own text is rustls-pki-types' byte arrays and debug names).
    #[error(
        "{what} {path} (--api-tls-cert): {}",
        crate::certs::parse::pem_reason(source)
    )]
    Pem {
        /// `certificate`.
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        source: rustls::pki_types::pem::Error,
    },
    /// The private key file could not be read.
    #[error("private key {path} (--api-tls-key): {source}")]
    ReadKey {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The private key file holds no usable key: none, an encrypted one, several, or
    /// malformed PEM (the cert API's words, [`crate::certs::parse::private_key`]).
    #[error("private key {path} (--api-tls-key): {source}")]
    Key {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: crate::certs::parse::KeyPemError,
    },
    /// The key is not the certificate's (or rustls refused the pair otherwise).
    #[error("certificate {cert} and private key {key} (--api-tls-cert, --api-tls-key): {reason}")]
    Pair {
        /// The certificate file.
        cert: String,
        /// The key file.
        key: String,
        /// Why, in words ([`crate::certs::parse::rustls_reason`]).
        reason: String,
    },
    /// The certificate file holds no certificate.
    #[error("certificate {0} (--api-tls-cert): no CERTIFICATE block")]
    NoCertificate(String),
    /// A file is DER, not PEM ([`crate::certs::parse::der_file_reason`], with the openssl
    /// command that converts it).
    #[error("{what} {path} ({flag}): {reason}")]
    Der {
        /// `certificate` or `private key`.
        what: &'static str,
        /// `--api-tls-cert` or `--api-tls-key`.
        flag: &'static str,
        /// The file.
        path: String,
        /// Why, with the command.
        reason: String,
    },
    /// The leaf is a CA certificate (`basicConstraints CA:TRUE`): clients refuse it as a
    /// server's certificate (the cert API refuses it too).
    #[error(
        "certificate {0} (--api-tls-cert): the certificate is a CA certificate (basicConstraints \
         CA:TRUE); TLS clients refuse a CA certificate as the server's own: give the server \
         certificate the CA signed, and the CA to the clients (loxicmd --cacert); for a \
         self-signed test certificate, mark it an end-entity one: openssl req -x509 ... -addext \
         basicConstraints=critical,CA:FALSE"
    )]
    CaCertificate(String),
    /// The leaf certificate does not parse as X.509.
    #[error("certificate {path} (--api-tls-cert): {source}")]
    Certificate {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: crate::certs::CertError,
    },
    /// The leaf certificate has expired or is not valid yet: every client would refuse it (the
    /// cert API refuses such a certificate too).
    #[error("certificate {path} (--api-tls-cert): {source}")]
    Validity {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: crate::certs::parse::ValidityError,
    },
    /// rustls refused the certificate/key pair.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The server configuration of `cert` (PEM chain) and `key` (PEM private key), ALPN `h2` and
/// `http/1.1` (the API speaks both, [`super::serve`]). A leaf certificate that has expired or
/// is not valid yet is refused, as the cert API refuses it.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    use crate::certs::parse::{PemFile, der_file_reason};
    let cert_text = std::fs::read(cert).map_err(|e| TlsError::Pem {
        what: "certificate",
        path: cert.display().to_string(),
        source: rustls::pki_types::pem::Error::Io(e),
    })?;
    if let Some(reason) = der_file_reason(&cert_text, PemFile::Certificate) {
        return Err(TlsError::Der {
            what: "certificate",
            flag: "--api-tls-cert",
            path: cert.display().to_string(),
            reason,
        });
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_text)
        .collect::<Result<_, _>>()
        .map_err(pem("certificate", cert))?;
    let Some(leaf) = chain.first() else {
        return Err(TlsError::NoCertificate(cert.display().to_string()));
    };
    check_validity(cert, leaf, crate::certs::store::unix_now())?;
    if crate::certs::parse::is_ca(leaf) {
        return Err(TlsError::CaCertificate(cert.display().to_string()));
    }
    let key_path = || key.display().to_string();
    let text = std::fs::read(key).map_err(|source| TlsError::ReadKey {
        path: key_path(),
        source,
    })?;
    if let Some(reason) = der_file_reason(&text, PemFile::PrivateKey) {
        return Err(TlsError::Der {
            what: "private key",
            flag: "--api-tls-key",
            path: key_path(),
            reason,
        });
    }
    let private_key = crate::certs::parse::private_key(&text).map_err(|source| TlsError::Key {
        path: key_path(),
        source,
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, private_key)
        .map_err(|e| TlsError::Pair {
            cert: cert.display().to_string(),
            key: key_path(),
            reason: crate::certs::parse::rustls_reason(&e, ""),
        })?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// `Ok` when the leaf `der` of file `path` is valid at `now` (Unix seconds). One expiring
/// within [`crate::certs::parse::EXPIRY_WARNING_SECS`] (14 days) is taken with a warning, as
/// the cert API takes such a certificate; the file is read once, at start, so the warning says
/// to replace it and restart.
fn check_validity(path: &Path, der: &CertificateDer<'_>, now: i64) -> Result<(), TlsError> {
    let path = || path.display().to_string();
    let (not_before, not_after) =
        crate::certs::parse::validity(der).map_err(|source| TlsError::Certificate {
            path: path(),
            source,
        })?;
    crate::certs::parse::check_validity(not_before, not_after, now).map_err(|source| {
        TlsError::Validity {
            path: path(),
            source,
        }
    })?;
    let left = not_after - now;
    if left < crate::certs::parse::EXPIRY_WARNING_SECS {
        tracing::warn!(cert = %path(), not_after = not_after,
            not_after_utc = %crate::certs::parse::rfc3339(not_after), days_left = left / 86_400,
            "the REST API's TLS certificate (--api-tls-cert) expires within 14 days; clients \
             that verify it will refuse the handshake then: replace the file and restart loxilb");
    }
    Ok(())
}

fn pem<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl Fn(rustls::pki_types::pem::Error) -> TlsError + 'a {
    move |source| TlsError::Pem {
        what,
        path: path.display().to_string(),
        source,
    }
}

/// A listener yielding TLS streams whose handshake completed (an `axum::serve` listener).
pub struct TlsListener {
    local: SocketAddr,
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    acceptor_task: JoinHandle<()>,
}

impl TlsListener {
    /// Accepts on `tcp` and runs handshakes with `config` in the background.
    pub fn new(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(MAX_HANDSHAKES);
        #[allow(
            clippy::disallowed_methods,
            reason = "the listener keeps the JoinHandle and aborts the accept loop on drop"
        )]
        let acceptor_task = tokio::spawn(accept_loop(tcp, TlsAcceptor::from(config), tx));
        Ok(Self {
            local,
            ready,
            acceptor_task,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.acceptor_task.abort();
    }
}

async fn accept_loop(
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    tx: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let permits = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match tcp.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "API accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (acceptor, tx) = (acceptor.clone(), tx.clone());
        #[allow(
            clippy::disallowed_methods,
            reason = "one handshake per accepted connection, bounded by the permit it holds and its timeout"
        )]
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&acceptor, stream)).await {
                Ok(Ok(tls)) => {
                    let _ = tx.send((tls, peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "API TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "API TLS handshake timed out"),
            }
        });
    }
}

/// The TLS handshake of `stream`, unless its first bytes (peeked: one byte, then at most
/// three read, each waiting within the caller's [`HANDSHAKE_TIMEOUT`]) are plain HTTP: an
/// HTTP/1 client gets `400 Bad Request` saying this port speaks HTTPS, with the URL to use
/// ([`plain_http_answer`]), as nginx answers (its 497) rather than a TLS alert the client
/// shows as garbage; an HTTP/2 prior-knowledge (h2c) client gets a GOAWAY whose debug data
/// says the same ([`h2c_answer`]), where it got an empty reply. Either way the connection is
/// closed.
async fn handshake(
    acceptor: &TlsAcceptor,
    mut stream: TcpStream,
) -> std::io::Result<TlsStream<TcpStream>> {
    use crate::listen::plain::{self, PlainHttp};
    match plain::plain_http(&mut stream).await {
        None => acceptor.accept(stream).await,
        Some(PlainHttp::H1) => {
            let body = plain_http_answer(stream.local_addr().ok());
            plain::answer_400_and_close(stream, "text/plain; charset=utf-8", &body).await;
            Err(std::io::Error::other(
                "plain HTTP sent to the HTTPS API port; answered 400",
            ))
        }
        Some(PlainHttp::H2) => {
            let debug = h2c_answer(stream.local_addr().ok());
            plain::answer_goaway_and_close(stream, &debug).await;
            Err(std::io::Error::other(
                "plain HTTP/2 (h2c) sent to the HTTPS API port; answered GOAWAY",
            ))
        }
    }
}

/// The GOAWAY debug data answering an HTTP/2 prior-knowledge (h2c) client on the HTTPS API
/// port reached at `local`: [`plain_http_answer`]'s words, on one line.
pub fn h2c_answer(local: Option<SocketAddr>) -> String {
    plain_http_answer(local).trim_end().replacen(
        "the plain HTTP request",
        "the plain HTTP/2 (h2c) request",
        1,
    )
}

/// How [`plain_http_answer`] starts (loxicmd recognises it and says to add `--protocol https`).
pub const PLAIN_HTTP_ANSWER_START: &str = "this port speaks HTTPS only";

/// The body answering a plain-HTTP client on the HTTPS API port reached at `local`.
pub fn plain_http_answer(local: Option<SocketAddr>) -> String {
    let url = match local {
        Some(a) => format!("https://{a}"),
        None => "https://HOST:PORT".to_string(),
    };
    format!(
        "{PLAIN_HTTP_ANSWER_START} (the API was started with --api-tls-cert); the plain HTTP \
         request was not served: use {url}\n"
    )
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The acceptor task only ends when the listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate and key file pair in `dir` (`cert.pem`, `key.pem`), the key's text being
    /// `key` applied to the certificate's own key.
    fn files(dir: &Path, key: impl Fn(&str) -> String) -> (std::path::PathBuf, std::path::PathBuf) {
        let pem = crate::certs::testutil::self_signed(&["api.example"], None);
        let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&c, &pem.cert_pem).expect("cert");
        std::fs::write(&k, key(&pem.key_pem)).expect("key");
        (c, k)
    }

    fn refusal(cert: &Path, key: &Path) -> String {
        match server_config(cert, key) {
            Ok(_) => "accepted".into(),
            Err(e) => e.to_string(),
        }
    }

    /// A key file holding two private keys is refused at start, as the cert API refuses it
    /// (rustls would take the first).
    #[test]
    fn a_key_file_with_two_keys_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let other = crate::certs::testutil::self_signed(&["x.example"], None).key_pem;
        let (c, k) = files(dir.path(), |own| format!("{own}{other}"));
        assert_eq!(
            refusal(&c, &k),
            format!(
                "private key {} (--api-tls-key): the PEM holds 2 private keys; one is expected \
                 (the certificate's)",
                k.display()
            )
        );
        let (c, k) = files(dir.path(), str::to_owned);
        assert_eq!(refusal(&c, &k), "accepted");
    }

    /// An encrypted key is named as such, not "no private key".
    #[test]
    fn an_encrypted_key_file_is_named() {
        let dir = tempfile::tempdir().expect("tmp");
        let (c, k) = files(dir.path(), |_| {
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAECAwQFBgcI\n-----END ENCRYPTED PRIVATE \
             KEY-----\n"
                .into()
        });
        assert_eq!(
            refusal(&c, &k),
            format!(
                "private key {} (--api-tls-key): the key is encrypted (ENCRYPTED PRIVATE KEY); \
                 loxi needs an unencrypted key: `openssl pkey -in KEY -out KEY.plain` writes one \
                 (it asks for the passphrase)",
                k.display()
            )
        );
    }

    /// A CA certificate as the API's own is refused at start (clients refuse it: rustls'
    /// `CaUsedAsEndEntity`), and PEM faults in the certificate file are said in words with the
    /// flag, never as byte arrays or debug names.
    #[test]
    fn a_ca_certificate_or_a_broken_pem_is_refused_in_words() {
        let dir = tempfile::tempdir().expect("tmp");
        let mut params = rcgen::CertificateParams::new(vec!["api.example".to_string()]).expect("p");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().expect("key");
        let ca = params.self_signed(&key).expect("ca");
        let (c, k) = (dir.path().join("ca.pem"), dir.path().join("ca.key"));
        std::fs::write(&c, ca.pem()).expect("cert");
        std::fs::write(&k, key.serialize_pem()).expect("key");
        let e = refusal(&c, &k);
        assert!(
            e.starts_with(&format!(
                "certificate {} (--api-tls-cert): the certificate is a CA certificate",
                c.display()
            )),
            "{e}"
        );
        let (c, k) = files(dir.path(), str::to_owned);
        let pem = std::fs::read_to_string(&c).expect("read");
        std::fs::write(&c, &pem[..pem.len() / 2]).expect("truncate");
        assert_eq!(
            refusal(&c, &k),
            format!(
                "certificate {} (--api-tls-cert): missing section end marker \"CERTIFICATE\"",
                c.display()
            )
        );
        std::fs::write(&c, pem.replacen('M', "#", 1)).expect("bad base64");
        let e = refusal(&c, &k);
        assert!(
            e.contains("(--api-tls-cert): the base64 body does not decode: character '#'"),
            "{e}"
        );
    }

    /// A DER certificate or key file is refused at start naming the flag, the file and the
    /// openssl command that writes it as PEM (the same words as loxicmd's, one helper).
    #[test]
    fn a_der_certificate_or_key_file_is_refused_with_the_openssl_command() {
        let dir = tempfile::tempdir().expect("tmp");
        let (c, k) = files(dir.path(), str::to_owned);
        let pem = crate::certs::parse::CertPem {
            cert_pem: std::fs::read_to_string(&c).expect("cert"),
            key_pem: std::fs::read_to_string(&k).expect("key"),
            chain_pem: None,
        };
        let (cert_der, key_der) = crate::certs::testutil::der_files(&pem);
        let (cd, kd) = (dir.path().join("cert.der"), dir.path().join("key.der"));
        std::fs::write(&cd, cert_der).expect("write");
        std::fs::write(&kd, key_der).expect("write");
        assert_eq!(
            refusal(&cd, &k),
            format!(
                "certificate {} (--api-tls-cert): the file looks DER-encoded (binary), not PEM: \
                 `openssl x509 -inform DER -in FILE -out FILE.pem` writes it as PEM; give that \
                 file instead",
                cd.display()
            )
        );
        assert_eq!(
            refusal(&c, &kd),
            format!(
                "private key {} (--api-tls-key): the file looks DER-encoded (binary), not PEM: \
                 `openssl pkey -inform DER -in FILE -out FILE.pem` writes it as PEM; give that \
                 file instead",
                kd.display()
            )
        );
        std::fs::write(&cd, "").expect("write");
        assert_eq!(
            refusal(&cd, &k),
            format!(
                "certificate {} (--api-tls-cert): no CERTIFICATE block",
                cd.display()
            )
        );
    }

    /// Another certificate's key is said in words (rustls: `KeyMismatch`).
    #[test]
    fn a_key_of_another_certificate_is_said_in_words() {
        let dir = tempfile::tempdir().expect("tmp");
        let other = crate::certs::testutil::self_signed(&["x.example"], None).key_pem;
        let (c, k) = files(dir.path(), |_| other.clone());
        assert_eq!(
            refusal(&c, &k),
            format!(
                "certificate {} and private key {} (--api-tls-cert, --api-tls-key): the private \
                 key does not match the certificate's public key",
                c.display(),
                k.display()
            )
        );
    }
}
