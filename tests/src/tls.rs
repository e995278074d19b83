//! Test certificates generated per test (rcgen): a throw-away CA and a server certificate it
//! signed for `127.0.0.1`, `::1` and `localhost`, written as PEM files into a temp dir.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose, SanType};

/// A CA and one server certificate, as files.
pub struct TestPki {
    dir: tempfile::TempDir,
}

impl TestPki {
    /// Generates a fresh CA (`ca.pem`) and a loopback server certificate (`server.pem`,
    /// `server.key`) signed by it.
    pub fn generate() -> anyhow::Result<Self> {
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
