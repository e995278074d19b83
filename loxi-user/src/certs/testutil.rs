//! Test certificates (compiled for tests only).

use super::CertPem;

/// A fresh self-signed certificate (new P-256 key) for the DNS `names`, valid until
/// `not_after` (rcgen's default, far in the future, when `None`).
pub fn self_signed(names: &[&str], not_after: Option<time::OffsetDateTime>) -> CertPem {
    let mut params =
        rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("params");
    if let Some(t) = not_after {
        params.not_after = t;
    }
    signed(params)
}

/// Certificate `id` for the DNS `names`, expired a day ago, as a stored one is restored
/// (uploads refuse it).
pub fn expired(id: &str, names: &[&str]) -> std::sync::Arc<super::Certificate> {
    let past = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    let (c, validity) =
        super::parse::parse_stored(id, self_signed(names, Some(past)), super::store::unix_now())
            .expect("stored");
    assert!(validity.is_some(), "expired");
    std::sync::Arc::new(c)
}

/// The DER forms of `pem`'s certificate and key (what `openssl ... -outform DER` writes).
pub fn der_files(pem: &CertPem) -> (Vec<u8>, Vec<u8>) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let cert = CertificateDer::from_pem_slice(pem.cert_pem.as_bytes()).expect("cert");
    let key = PrivateKeyDer::from_pem_slice(pem.key_pem.as_bytes()).expect("key");
    (cert.to_vec(), key.secret_der().to_vec())
}

/// A fresh self-signed certificate whose subjectAltName is `sans` as given (`DNS:` names that
/// rcgen would otherwise read as IP addresses stay DNS names) and whose subject is CN `cn`, or
/// empty when `None`.
pub fn with_sans(sans: Vec<rcgen::SanType>, cn: Option<&str>) -> CertPem {
    let mut params = rcgen::CertificateParams::default();
    params.subject_alt_names = sans;
    params.distinguished_name = rcgen::DistinguishedName::new();
    if let Some(cn) = cn {
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
    }
    signed(params)
}

/// A CA named `ca` and a leaf for `a.example` it signed, as PEM (leaf, CA certificate).
pub fn ca_and_leaf(ca: &str) -> (CertPem, String) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, ca);
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let ca_cert = ca_params.self_signed(&ca_key).expect("ca");
    let leaf_params = rcgen::CertificateParams::new(vec!["a.example".to_string()]).expect("p");
    let key = rcgen::KeyPair::generate().expect("key");
    let leaf = leaf_params
        .signed_by(&key, &ca_cert, &ca_key)
        .expect("leaf");
    let pem = CertPem {
        cert_pem: leaf.pem(),
        key_pem: key.serialize_pem(),
        chain_pem: None,
    };
    (pem, ca_cert.pem())
}

/// `DNS:<name>` as rcgen's SAN entry.
pub fn dns(name: &str) -> rcgen::SanType {
    rcgen::SanType::DnsName(name.try_into().expect("IA5 name"))
}

/// `IP:<ip>` as rcgen's SAN entry.
pub fn ip(ip: &str) -> rcgen::SanType {
    rcgen::SanType::IpAddress(ip.parse().expect("IP address"))
}

/// `params` self-signed with a fresh key, as PEM (no chain).
fn signed(params: rcgen::CertificateParams) -> CertPem {
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = params.self_signed(&key).expect("cert");
    CertPem {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        chain_pem: None,
    }
}
