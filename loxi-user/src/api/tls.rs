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

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
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
    /// A PEM file could not be read or holds nothing usable.
    #[error("{what} {path}: {}", crate::certs::parse::pem_reason(source))]
    Pem {
        /// `certificate` or `private key`.
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// The certificate file holds no certificate.
    #[error("certificate {0}: no CERTIFICATE block")]
    NoCertificate(String),
    /// The leaf certificate does not parse as X.509.
    #[error("certificate {path}: {source}")]
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

/// The server configuration of `cert` (PEM chain) and `key` (PEM private key), ALPN
/// `http/1.1` (the API speaks HTTP/1.1). A leaf certificate that has expired or is not valid
/// yet is refused, as the cert API refuses it.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(pem("certificate", cert))?
        .collect::<Result<_, _>>()
        .map_err(pem("certificate", cert))?;
    let Some(leaf) = chain.first() else {
        return Err(TlsError::NoCertificate(cert.display().to_string()));
    };
    check_validity(cert, leaf, crate::certs::store::unix_now())?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(pem("private key", key))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// `Ok` when the leaf `der` of file `path` is valid at `now` (Unix seconds).
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
    })
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
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    let _ = tx.send((tls, peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "API TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "API TLS handshake timed out"),
            }
        });
    }
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
