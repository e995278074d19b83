//! Test certificates generated per test (rcgen): a throw-away CA and a server certificate it
//! signed for `127.0.0.1`, `::1` and `localhost`, written as PEM files into a temp dir; and a
//! one-request HTTPS client (rustls, trusting only a given CA) for the harness.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose, SanType};

/// A CA and one server certificate, as files.
pub struct TestPki {
    dir: tempfile::TempDir,
}

impl TestPki {
    /// Generates a fresh CA (`ca.pem`) and a loopback server certificate (`server.pem`,
    /// `server.key`) signed by it, valid until rcgen's default end (year 4096).
    pub fn generate() -> anyhow::Result<Self> {
        Self::generate_until(None)
    }

    /// [`TestPki::generate`] with a server certificate that expires `days` days from now.
    pub fn generate_expiring_in(days: i64) -> anyhow::Result<Self> {
        Self::generate_until(Some(
            time::OffsetDateTime::now_utc() + time::Duration::days(days),
        ))
    }

    fn generate_until(not_after: Option<time::OffsetDateTime>) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "loxi test CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key)?;

        let key = KeyPair::generate()?;
        let mut server = CertificateParams::new(Vec::<String>::new())?;
        server
            .distinguished_name
            .push(DnType::CommonName, "loxilb API");
        server.subject_alt_names = vec![
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            SanType::IpAddress(IpAddr::V6(Ipv6Addr::LOCALHOST)),
            SanType::DnsName("localhost".try_into()?),
        ];
        if let Some(t) = not_after {
            server.not_after = t;
        }
        let cert = server.signed_by(&key, &ca_cert, &ca_key)?;
        std::fs::write(dir.path().join("ca.pem"), ca_cert.pem())?;
        std::fs::write(dir.path().join("server.pem"), cert.pem())?;
        std::fs::write(dir.path().join("server.key"), key.serialize_pem())?;
        Ok(Self { dir })
    }

    /// The CA certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The server certificate (PEM).
    pub fn cert(&self) -> PathBuf {
        self.dir.path().join("server.pem")
    }

    /// The server's private key (PEM, PKCS#8).
    pub fn key(&self) -> PathBuf {
        self.dir.path().join("server.key")
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `--api-tls-cert <cert> --api-tls-key <key>` for the daemon.
    pub fn daemon_args(&self) -> Vec<String> {
        vec![
            "--api-tls-cert".into(),
            self.cert().display().to_string(),
            "--api-tls-key".into(),
            self.key().display().to_string(),
        ]
    }
}

/// Sends `req` (URI = path and query) over one TLS connection to `addr`, verifying the server
/// against the PEM CA in `ca` with the IP of `addr` as the server name.
pub async fn https_send(
    addr: SocketAddr,
    ca: &Path,
    req: http::Request<Full<Bytes>>,
) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca)? {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::IpAddress(addr.ip().into()), tcp)
        .await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender.send_request(req).await?)
}
