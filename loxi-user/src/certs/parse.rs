//! One certificate as the cert API takes it: PEM text in, a checked [`Certificate`] out.
//!
//! The leaf comes first (`certPem`, optionally followed by its chain), then `chainPem` (the
//! intermediates, optional). The key (`keyPem`) is PKCS#8, PKCS#1 or SEC1, of a type rustls'
//! `ring` provider signs with (RSA, ECDSA P-256/P-384, Ed25519). Hostnames are the leaf's SAN
//! DNS names, else (no subjectAltName extension at all: RFC 6125 §6.4.4) its subject CN,
//! lower-cased; `*.example.com` covers one label. IP addresses
//! are the leaf's SAN IP addresses (`IP:10.0.0.5`), kept apart: an IP host is covered by an IP
//! address only, never by a DNS name spelled like one ([`Certificate::covers`]), as TLS
//! clients verify an IP (RFC 6125 §6.2, webpki, OpenSSL).

use std::net::IpAddr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

/// Longest certificate id (`certId`).
pub const MAX_ID_LEN: usize = 63;

/// A certificate expiring within this many seconds is accepted with a warning (14 days).
pub const EXPIRY_WARNING_SECS: i64 = 14 * 86_400;

/// The PEM text a certificate was created from (what the state dir keeps).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CertPem {
    /// The leaf certificate (PEM), optionally followed by its chain.
    pub cert_pem: String,
    /// The leaf's private key (PEM).
    pub key_pem: String,
    /// Intermediate certificates (PEM), sent after the leaf.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain_pem: Option<String>,
}

/// A checked certificate: its signing key, hostnames and validity.
#[derive(Debug)]
pub struct Certificate {
    /// The certificate's id (`certId`).
    pub id: String,
    /// Names it serves (SAN DNS names; the CN only when there is no subjectAltName extension),
    /// lower-case; may start with `*.`. Empty when the leaf's SAN names IP addresses only.
    pub hostnames: Vec<String>,
    /// The SAN IP addresses (`IP:10.0.0.5`), in certificate order.
    pub ip_addresses: Vec<IpAddr>,
    /// Start of validity (Unix seconds).
    pub not_before: i64,
    /// End of validity (Unix seconds).
    pub not_after: i64,
    /// The chain and key rustls serves.
    pub key: Arc<CertifiedKey>,
    /// The PEM it was made from.
    pub pem: CertPem,
}

/// Why a certificate was refused (HTTP 400 with this message).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CertError {
    /// `certId` is not usable as an id.
    #[error(
        "certId {0:?}: 1 to 63 characters of letters, digits, '.', '_' and '-' (no path separators)"
    )]
    BadId(String),
    /// A PEM field does not parse.
    #[error("{field}: malformed PEM: {reason}")]
    Pem {
        /// `certPem`, `keyPem` or `chainPem`.
        field: &'static str,
        /// The parser's message.
        reason: String,
    },
    /// `certPem` holds no CERTIFICATE block.
    #[error("certPem: no CERTIFICATE block")]
    NoCertificate,
    /// `certId` is `all`, which names the list in `/config/cert/all` (so that certificate could
    /// never be read, rotated or deleted through the API).
    #[error(
        "certId \"all\" is reserved: GET /netlox/v1/config/cert/all lists every certificate, \
         so one with that id could not be read, rotated or deleted; choose another id"
    )]
    ReservedId,
    /// `certPem` or `chainPem` holds a PEM item other than a certificate (a private key, which
    /// would be stored and kept with the certificates, or anything rustls would skip unsaid).
    #[error(
        "{field}: PEM item {index} is a {label}, not a CERTIFICATE; {field} holds certificates \
         only{hint}"
    )]
    NotACertificate {
        /// `certPem` or `chainPem`.
        field: &'static str,
        /// The item's position in the field (1 for the first).
        index: usize,
        /// Its PEM label (`PRIVATE KEY`).
        label: String,
        /// What to do instead, when it is a key.
        hint: &'static str,
    },
    /// `keyPem` holds no usable private key: none, an encrypted one, several, malformed PEM,
    /// contents that do not decode, or a type loxi does not sign with.
    #[error("keyPem: {0}")]
    Key(#[from] KeyPemError),
    /// The key is not the leaf certificate's (the reason in words, [`rustls_reason`]).
    #[error("keyPem does not match the certificate in certPem: {0}")]
    KeyMismatch(String),
    /// The leaf certificate does not parse as X.509.
    #[error("certPem: not an X.509 certificate: {0}")]
    X509(String),
    /// The leaf has expired or is not valid yet.
    #[error("certPem: {0}")]
    Validity(#[from] ValidityError),
    /// A certificate of the chain is not the issuer of the one before it.
    #[error(
        "{field}: certificate {index} of the chain (subject {subject}) did not issue the one \
         before it (issuer {issuer}); give the leaf's issuer first, then its issuer, and so on"
    )]
    BrokenChain {
        /// The body field that certificate came from: `certPem` (which may hold the leaf and
        /// its chain) or `chainPem`.
        field: &'static str,
        /// Position in the served chain (the leaf is 0).
        index: usize,
        /// That certificate's subject.
        subject: String,
        /// The issuer named by the certificate before it.
        issuer: String,
    },
    /// The leaf names no host (no SAN DNS name or IP address, no CN without a SAN).
    #[error(
        "certPem: the certificate names no host (no SAN DNS name or IP address, and no subject CN \
         on a certificate without a subjectAltName extension); issue it with a DNS or IP \
         subjectAltName for the host it serves"
    )]
    NoHostnames,
    /// The leaf is a CA certificate (`basicConstraints` `CA:TRUE`): rustls/webpki clients (and
    /// browsers) refuse a CA certificate presented as the server's own, so every handshake
    /// would fail.
    #[error(
        "certPem: the certificate is a CA certificate (basicConstraints CA:TRUE); TLS clients \
         refuse a CA certificate as a server's certificate: give the server's own (end-entity) \
         certificate signed by that CA (the CA may follow it in chainPem); for a self-signed \
         test certificate, mark it an end-entity one: openssl req -x509 ... -addext \
         basicConstraints=critical,CA:FALSE"
    )]
    CaCertificate,
}

impl CertError {
    /// The body field at fault (the API's `field`): `certId`, `certPem`, `keyPem` or
    /// `chainPem`.
    pub fn field(&self) -> &'static str {
        match self {
            Self::BadId(_) | Self::ReservedId => "certId",
            Self::Pem { field, .. }
            | Self::BrokenChain { field, .. }
            | Self::NotACertificate { field, .. } => field,
            Self::Key(_) | Self::KeyMismatch(_) => "keyPem",
            Self::NoCertificate
            | Self::X509(_)
            | Self::Validity(_)
            | Self::NoHostnames
            | Self::CaCertificate => "certPem",
        }
    }
}

/// Why a private key's PEM text gives no usable key. One reader for every key loxi loads
/// ([`private_key`]): the cert API's `keyPem`, `--cert-dir`'s `server.key` and
/// `--api-tls-key`.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum KeyPemError {
    /// No private key block at all.
    #[error("no private key (PKCS#8, PKCS#1 or SEC1 PEM block)")]
    NoKey,
    /// The key is encrypted (`ENCRYPTED PRIVATE KEY`, PKCS#8; or OpenSSL's legacy
    /// `Proc-Type: 4,ENCRYPTED` header): loxi has no passphrase to decrypt it with.
    #[error(
        "the key is encrypted ({0}); loxi needs an unencrypted key: `openssl pkey -in KEY -out \
         KEY.plain` writes one (it asks for the passphrase)"
    )]
    Encrypted(&'static str),
    /// Several private keys: which one is the certificate's would be a guess.
    #[error("the PEM holds {0} private keys; one is expected (the certificate's)")]
    Several(usize),
    /// The PEM text does not parse ([`pem_reason`]).
    #[error("malformed PEM: {0}")]
    Pem(String),
    /// The PEM markers are fine but the key data between them does not decode: corrupt or
    /// truncated DER, or values that do not check ([`KeyForm`] says which form was read).
    #[error(
        "the private key's contents could not be decoded: the {form} key data between the PEM \
         markers is corrupt or truncated{detail}; copy the key again from where it was made"
    )]
    Corrupt {
        /// The key's form: `PKCS#8`, `PKCS#1 RSA`, `SEC1 EC`.
        form: &'static str,
        /// More, when the structure decodes but its values do not check (`: an RSA key of
        /// 2048 bits whose values ring refuses`); empty otherwise.
        detail: String,
    },
    /// A well-formed key of another form than its PEM label says (a PKCS#8 key between
    /// `RSA PRIVATE KEY` markers, say, as a hand-edited file has): the label to use instead.
    #[error(
        "the private key is labelled {label} but holds a {holds} key; change its PEM markers to \
         `-----BEGIN {right}-----` and `-----END {right}-----`"
    )]
    Mislabelled {
        /// The PEM label it came under (`RSA PRIVATE KEY`).
        label: &'static str,
        /// The form its data is (`PKCS#8`).
        holds: &'static str,
        /// That form's label (`PRIVATE KEY`).
        right: &'static str,
    },
    /// A well-formed key of a type rustls' `ring` provider does not sign with (`Ed448`,
    /// `ECDSA on curve P-521`, `RSA of 1024 bits`).
    #[error(
        "unsupported private key type: {0}; loxi signs with RSA keys of 2048 to 8192 bits, ECDSA \
         keys on P-256 or P-384, and Ed25519 keys"
    )]
    Unsupported(String),
}

/// The signing key of `key` (rustls' `ring` provider), or why there is none in words: its
/// contents do not decode ([`KeyPemError::Corrupt`]), decode as another form than its label
/// ([`KeyPemError::Mislabelled`]), or it is a well-formed key of a type loxi does not sign
/// with ([`KeyPemError::Unsupported`]).
pub fn signing_key(
    key: &PrivateKeyDer<'_>,
) -> Result<Arc<dyn rustls::sign::SigningKey>, KeyPemError> {
    rustls::crypto::ring::sign::any_supported_type(key).map_err(|e| {
        let (form, label) = match key {
            PrivateKeyDer::Pkcs8(_) => ("PKCS#8", "PRIVATE KEY"),
            PrivateKeyDer::Pkcs1(_) => ("PKCS#1 RSA", "RSA PRIVATE KEY"),
            _ => ("SEC1 EC", "EC PRIVATE KEY"),
        };
        match key_type(key) {
            None => match other_form(key) {
                Some((holds, right)) => KeyPemError::Mislabelled {
                    label,
                    holds,
                    right,
                },
                None => KeyPemError::Corrupt {
                    form,
                    detail: String::new(),
                },
            },
            Some(KeyType::Unsupported(t)) => KeyPemError::Unsupported(t),
            Some(KeyType::Supported(t)) => KeyPemError::Corrupt {
                form,
                detail: format!(": a well-formed {t} key whose values do not check ({e})"),
            },
        }
    })
}

/// A well-formed key's type, in words, and whether ring signs with that type.
enum KeyType {
    /// RSA of 2048 to 8192 bits, ECDSA P-256/P-384 (or no named curve), Ed25519.
    Supported(String),
    /// Any other.
    Unsupported(String),
}

/// The type of the key `key`; `None` when its DER is not a well-formed key of its form.
fn key_type(key: &PrivateKeyDer<'_>) -> Option<KeyType> {
    match key {
        PrivateKeyDer::Pkcs1(k) => rsa_type(k.secret_pkcs1_der()),
        PrivateKeyDer::Sec1(k) => {
            let (curve, _) = sec1_parts(k.secret_sec1_der())?;
            Some(ec_type(curve.as_deref()))
        }
        PrivateKeyDer::Pkcs8(k) => pkcs8_type(k.secret_pkcs8_der()),
        _ => None,
    }
}

/// The form (and its PEM label) that `key`'s data decodes as when it is not its own form's
/// well-formed key; `None` when it is no key of any form.
fn other_form(key: &PrivateKeyDer<'_>) -> Option<(&'static str, &'static str)> {
    let der = key.secret_der();
    let is = |k: &PrivateKeyDer<'_>| std::mem::discriminant(k) == std::mem::discriminant(key);
    let pkcs8 = PrivateKeyDer::Pkcs8(der.to_vec().into());
    let pkcs1 = PrivateKeyDer::Pkcs1(der.to_vec().into());
    let sec1 = PrivateKeyDer::Sec1(der.to_vec().into());
    [
        (pkcs8, "PKCS#8", "PRIVATE KEY"),
        (pkcs1, "PKCS#1 RSA", "RSA PRIVATE KEY"),
        (sec1, "SEC1 EC", "EC PRIVATE KEY"),
    ]
    .into_iter()
    .find(|(k, _, _)| !is(k) && key_type(k).is_some())
    .map(|(_, holds, right)| (holds, right))
}

/// `der` as one complete DER object, nothing after it; `None` when it does not parse.
fn whole_der(der: &[u8]) -> Option<x509_parser::der_parser::ber::BerObject<'_>> {
    match x509_parser::der_parser::parse_der(der) {
        Ok(([], obj)) => Some(obj),
        _ => None,
    }
}

/// A PKCS#1 `RSAPrivateKey` (nine INTEGERs): its size decides.
fn rsa_type(der: &[u8]) -> Option<KeyType> {
    let obj = whole_der(der)?;
    let seq = obj.as_sequence().ok()?;
    if seq.len() < 9 || seq.iter().any(|i| i.as_slice().is_err()) {
        return None;
    }
    let modulus = seq[1].as_slice().ok()?;
    let digits: Vec<u8> = modulus.iter().copied().skip_while(|b| *b == 0).collect();
    let bits = digits
        .first()
        .map_or(0, |b| digits.len() * 8 - b.leading_zeros() as usize);
    let text = format!("RSA of {bits} bits");
    Some(if (2048..=8192).contains(&bits) {
        KeyType::Supported(text)
    } else {
        KeyType::Unsupported(text)
    })
}

/// An ECDSA key on the curve of OID `curve` (dotted; `None`: not named in the key).
fn ec_type(curve: Option<&str>) -> KeyType {
    match curve {
        None => KeyType::Supported("ECDSA".into()),
        Some("1.2.840.10045.3.1.7") => KeyType::Supported("ECDSA P-256".into()),
        Some("1.3.132.0.34") => KeyType::Supported("ECDSA P-384".into()),
        Some(oid) => KeyType::Unsupported(format!(
            "ECDSA on curve {}",
            match oid {
                "1.3.132.0.35" => "P-521".to_string(),
                "1.3.132.0.10" => "secp256k1".to_string(),
                o => format!("OID {o}"),
            }
        )),
    }
}

/// A SEC1 `ECPrivateKey`: its curve (the `[0]` parameters' OID, when present) and private key.
fn sec1_parts(der: &[u8]) -> Option<(Option<String>, &[u8])> {
    use x509_parser::der_parser::ber::BerObjectContent;
    let obj = whole_der(der)?;
    let seq = obj.as_sequence().ok()?;
    let (version, private) = (seq.first()?, seq.get(1)?);
    version.as_slice().ok()?;
    let private = private.as_slice().ok()?;
    let mut curve = None;
    for item in &seq[2..] {
        if item.header.tag().0 == 0 {
            let inner = match &item.content {
                BerObjectContent::Unknown(any) => whole_der(any.data)?,
                BerObjectContent::Tagged(_, _, inner) => (**inner).clone(),
                _ => return None,
            };
            curve = Some(inner.as_oid().ok()?.to_id_string());
        }
    }
    Some((curve, private))
}

/// A PKCS#8 `PrivateKeyInfo`: its algorithm OID names the type; the key inside must be
/// well-formed DER too.
fn pkcs8_type(der: &[u8]) -> Option<KeyType> {
    let obj = whole_der(der)?;
    let seq = obj.as_sequence().ok()?;
    let (version, algorithm, private) = (seq.first()?, seq.get(1)?, seq.get(2)?);
    version.as_slice().ok()?;
    let algorithm = algorithm.as_sequence().ok()?;
    let oid = algorithm.first()?.as_oid().ok()?.to_id_string();
    let private = private.as_slice().ok()?;
    whole_der(private)?;
    let unsupported = |name: &str| Some(KeyType::Unsupported(name.to_string()));
    match oid.as_str() {
        "1.2.840.113549.1.1.1" => rsa_type(private),
        "1.2.840.10045.2.1" => {
            let named = algorithm
                .get(1)
                .and_then(|p| p.as_oid().ok())
                .map(|o| o.to_id_string());
            let (own, _) = sec1_parts(private)?;
            Some(ec_type(named.or(own).as_deref()))
        }
        "1.3.101.112" => Some(KeyType::Supported("Ed25519".into())),
        "1.3.101.113" => unsupported("Ed448"),
        "1.3.101.110" => unsupported("X25519 (a key-agreement key, which cannot sign)"),
        "1.3.101.111" => unsupported("X448 (a key-agreement key, which cannot sign)"),
        "1.2.840.10040.4.1" => unsupported("DSA"),
        "1.2.840.113549.1.1.10" => unsupported("RSASSA-PSS (an RSA key restricted to PSS)"),
        o => Some(KeyType::Unsupported(format!("algorithm OID {o}"))),
    }
}

/// The one private key of the PEM text `text` (PKCS#8, PKCS#1 or SEC1), one loxi can sign with
/// ([`signing_key`]). An encrypted key, and several keys, are refused saying so (rustls would
/// skip an encrypted key as an unknown block and report no key, and take the first of
/// several); so are a key whose contents do not decode and one of a type loxi does not sign
/// with, in words that tell the two apart.
pub fn private_key(text: &[u8]) -> Result<PrivateKeyDer<'static>, KeyPemError> {
    use rustls::pki_types::pem::{Error, SectionKind};
    const LEGACY_ENCRYPTED: &[u8] = b"Proc-Type: 4,ENCRYPTED";
    let encrypted = pem_labels(text)
        .iter()
        .filter(|l| l.as_str() == "ENCRYPTED PRIVATE KEY")
        .count();
    let plain = <(SectionKind, Vec<u8>)>::pem_slice_iter(text)
        .filter_map(Result::ok)
        .filter(|(kind, _)| {
            matches!(
                kind,
                SectionKind::PrivateKey | SectionKind::RsaPrivateKey | SectionKind::EcPrivateKey
            )
        })
        .count();
    if plain + encrypted > 1 {
        return Err(KeyPemError::Several(plain + encrypted));
    }
    if text
        .windows(LEGACY_ENCRYPTED.len())
        .any(|w| w == LEGACY_ENCRYPTED)
    {
        return Err(KeyPemError::Encrypted(
            "a Proc-Type: 4,ENCRYPTED header, OpenSSL's legacy encrypted PEM",
        ));
    }
    match PrivateKeyDer::from_pem_slice(text) {
        Ok(k) => signing_key(&k).map(|_| k),
        Err(Error::NoItemsFound) if encrypted > 0 => {
            Err(KeyPemError::Encrypted("ENCRYPTED PRIVATE KEY"))
        }
        Err(Error::NoItemsFound) => Err(KeyPemError::NoKey),
        Err(e) => Err(KeyPemError::Pem(pem_reason(&e))),
    }
}

/// What a file given where PEM is expected should hold: [`der_file_reason`] names the openssl
/// command that converts its DER form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PemFile {
    /// Certificates (a server's chain, a CA bundle).
    Certificate,
    /// A private key.
    PrivateKey,
}

/// `Some(reason)` when `bytes`, the content of a file that should be PEM, look DER-encoded
/// (binary ASN.1: a SEQUENCE's `0x30` first, and no PEM BEGIN marker anywhere): the reason says
/// so and gives the openssl command that writes the file as PEM. Every PEM file option uses it
/// (`--api-tls-cert`, `--api-tls-key`, loxicmd's `--cacert`, `--cert-file`, `--key-file`,
/// `--chain-file`), prefixing the option and the file.
pub fn der_file_reason(bytes: &[u8], kind: PemFile) -> Option<String> {
    const BEGIN: &[u8] = b"-----BEGIN ";
    if bytes.first() != Some(&0x30) || bytes.windows(BEGIN.len()).any(|w| w == BEGIN) {
        return None;
    }
    let command = match kind {
        PemFile::Certificate => "openssl x509 -inform DER -in FILE -out FILE.pem",
        PemFile::PrivateKey => "openssl pkey -inform DER -in FILE -out FILE.pem",
    };
    Some(format!(
        "the file looks DER-encoded (binary), not PEM: `{command}` writes it as PEM; give that \
         file instead"
    ))
}

/// The labels of the PEM BEGIN lines of `text` (`CERTIFICATE`, `ENCRYPTED PRIVATE KEY`), in
/// order, whether rustls reads that kind or not.
pub fn pem_labels(text: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(text)
        .lines()
        .filter_map(|l| {
            l.trim_end()
                .strip_prefix("-----BEGIN ")
                .and_then(|r| r.split_once("-----"))
                .map(|(label, _)| label.to_owned())
        })
        .collect()
}

/// A rustls error in words: the key/certificate mismatch and an undecodable certificate are
/// said as such (rustls prints Rust names, `keys may not be consistent: KeyMismatch`, and
/// calls any certificate a "peer certificate"). `ca` names where the side that verified sets
/// the CAs it trusts (a rule's `backend_ca_file` for the fullproxy, `--cacert` for loxicmd),
/// said in the unknown-issuer and bad-signature reasons; empty where no peer is verified.
pub fn rustls_reason(e: &rustls::Error, ca: &str) -> String {
    let give_ca = if ca.is_empty() {
        String::new()
    } else {
        format!(" ({ca})")
    };
    use rustls::{CertificateError, Error, InconsistentKeys};
    match e {
        Error::InconsistentKeys(InconsistentKeys::KeyMismatch) => {
            "the private key does not match the certificate's public key".into()
        }
        Error::InconsistentKeys(_) => "rustls cannot tell whether the private key matches the \
                                       certificate's public key"
            .into(),
        Error::InvalidCertificate(CertificateError::BadEncoding) => TRUNCATED_OR_NOT_DER.into(),
        Error::InvalidCertificate(CertificateError::UnknownIssuer) => format!(
            "the peer's certificate is not signed by a CA this side trusts (unknown issuer): give \
             the CA that signed it{give_ca}"
        ),
        Error::InvalidCertificate(CertificateError::BadSignature) => format!(
            "the peer's certificate does not verify with the trusted CA of its issuer's name \
             (another CA of the same name signed it?): give the CA that signed it{give_ca}"
        ),
        Error::InvalidCertificate(CertificateError::NotValidForNameContext {
            expected,
            presented,
        }) => {
            let names: Vec<String> = presented.iter().map(|p| presented_name(p)).collect();
            format!(
                "the peer's certificate is not valid for the name {}; it names {}",
                server_name_text(expected),
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            )
        }
        Error::InvalidCertificate(CertificateError::Other(o)) => {
            format!("the certificate is refused: {o}")
        }
        Error::InvalidCertificate(c) => format!("the certificate is refused: {c}"),
        e => e.to_string(),
    }
}

/// A server name as text (`api.example`, `10.0.0.1`), not its Rust form.
fn server_name_text(n: &rustls::pki_types::ServerName<'_>) -> String {
    use rustls::pki_types::ServerName;
    match n {
        ServerName::DnsName(d) => d.as_ref().to_string(),
        ServerName::IpAddress(ip) => std::net::IpAddr::from(*ip).to_string(),
        other => format!("{other:?}"),
    }
}

/// A name rustls lists from a certificate (`DnsName("localhost")`, `IpAddress(127.0.0.1)`, its
/// Debug forms) as the name alone; an address as std writes it (webpki writes `::1` as `0::1`).
fn presented_name(p: &str) -> String {
    for prefix in ["DnsName(", "IpAddress("] {
        if let Some(inner) = p.strip_prefix(prefix).and_then(|r| r.strip_suffix(')')) {
            let inner = inner.trim_matches('"');
            return match inner.parse::<IpAddr>() {
                Ok(ip) if prefix == "IpAddress(" => ip.to_string(),
                _ => inner.to_string(),
            };
        }
    }
    p.to_string()
}

/// What a certificate whose DER does not parse is called.
const TRUNCATED_OR_NOT_DER: &str = "the certificate is truncated or not DER";

/// An x509-parser error in words: a DER that ends early or is not DER at all (its
/// `NomError(Eof)`, `Der(...)` and `Incomplete` forms) is [`TRUNCATED_OR_NOT_DER`]; its other
/// errors are words already (`invalid X.509 name`).
pub fn x509_reason(e: &x509_parser::nom::Err<x509_parser::error::X509Error>) -> String {
    use x509_parser::error::X509Error;
    use x509_parser::nom::Err;
    match e {
        Err::Incomplete(_) => TRUNCATED_OR_NOT_DER.into(),
        Err::Error(e) | Err::Failure(e) => match e {
            X509Error::NomError(_) => TRUNCATED_OR_NOT_DER.into(),
            X509Error::Der(d) => format!("{TRUNCATED_OR_NOT_DER} (DER: {d})"),
            e => e.to_string(),
        },
    }
}

/// A CA file's certificates as rustls trust anchors, and why each other PEM item is not one.
#[derive(Debug)]
pub struct CaBundle {
    /// The certificates rustls/webpki take as trust anchors.
    pub roots: rustls::RootCertStore,
    /// Each PEM item that is not a usable CA certificate, in file order.
    pub refused: Vec<RefusedItem>,
}

/// A PEM item of a CA file that is not a usable CA certificate. Shown as `PEM item 2
/// (CERTIFICATE): the certificate is truncated or not DER` or `PEM item 1 is a PRIVATE KEY,
/// not a CERTIFICATE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedItem {
    /// Its position among the file's PEM items (1 is the first).
    pub item: usize,
    /// Its PEM label (`CERTIFICATE`, `PRIVATE KEY`).
    pub label: String,
    /// Why rustls/webpki refused a certificate; `None`: the item is not a certificate.
    pub reason: Option<String>,
}

impl std::fmt::Display for RefusedItem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.reason {
            Some(why) => write!(f, "PEM item {} ({}): {why}", self.item, self.label),
            None => write!(
                f,
                "PEM item {} is a {}, not a CERTIFICATE",
                self.item, self.label
            ),
        }
    }
}

impl CaBundle {
    /// The CA certificates of the PEM text `text` (a CA file's content). `Err` is the PEM
    /// parse error in words ([`pem_reason`]).
    pub fn from_pem(text: &[u8]) -> Result<Self, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(text)
            .collect::<Result<_, _>>()
            .map_err(|e| pem_reason(&e))?;
        let mut certs = certs.into_iter();
        let mut roots = rustls::RootCertStore::empty();
        let mut refused = Vec::new();
        for (i, label) in pem_labels(text).iter().enumerate() {
            let item = i + 1;
            let refuse = |reason| RefusedItem {
                item,
                label: label.clone(),
                reason,
            };
            if label != "CERTIFICATE" {
                refused.push(refuse(None));
                continue;
            }
            let Some(der) = certs.next() else { break };
            if let Err(e) = roots.add(der) {
                refused.push(refuse(Some(rustls_reason(&e, ""))));
            }
        }
        Ok(Self { roots, refused })
    }

    /// `Err` naming the first private key of the file (a CA file holds certificates; a key in
    /// a trust bundle, such as a CA's own, is one copy too many of a secret), else `Ok`.
    pub fn no_private_key(&self) -> Result<(), String> {
        match self
            .refused
            .iter()
            .find(|r| r.label.ends_with("PRIVATE KEY"))
        {
            Some(k) => Err(format!(
                "PEM item {} is a {}: a CA file holds certificates only; keep private keys out \
                 of trust bundles (remove it from the file)",
                k.item, k.label
            )),
            None => Ok(()),
        }
    }

    /// Why no certificate is usable (when [`Self::roots`] is empty): `no CERTIFICATE block`,
    /// or `no usable CA certificate: ` and each refusal.
    pub fn none_usable(&self) -> String {
        if self.refused.is_empty() {
            "no CERTIFICATE block".into()
        } else {
            let each: Vec<String> = self.refused.iter().map(ToString::to_string).collect();
            format!("no usable CA certificate: {}", each.join("; "))
        }
    }
}

/// A certificate that clients would refuse now: expired, or valid only from a later time.
/// The cert API and `--api-tls-cert` refuse such a certificate alike.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ValidityError {
    /// The certificate has expired.
    #[error("the certificate expired at {} (now {})", rfc3339(*not_after), rfc3339(*now))]
    Expired {
        /// End of validity.
        not_after: i64,
        /// The time of the check.
        now: i64,
    },
    /// The validity starts more than [`NOT_BEFORE_SKEW_SECS`] from now: every client would
    /// refuse the certificate until then.
    #[error(
        "the certificate is not valid before {} (now {}); clients would refuse it until then",
        rfc3339(*not_before),
        rfc3339(*now)
    )]
    NotYetValid {
        /// Start of validity.
        not_before: i64,
        /// The time of the check.
        now: i64,
    },
}

/// RFC 3339 text (UTC) of Unix time `secs` (`2021-01-01T00:00:00Z`; the number itself when out
/// of the representable range): how certificate times are said in errors and warnings.
pub fn rfc3339(secs: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| secs.to_string())
}

/// `Ok` when a certificate valid from `not_before` to `not_after` (Unix seconds) is usable at
/// `now`: not expired, and its start no more than [`NOT_BEFORE_SKEW_SECS`] ahead.
pub fn check_validity(not_before: i64, not_after: i64, now: i64) -> Result<(), ValidityError> {
    if not_after <= now {
        return Err(ValidityError::Expired { not_after, now });
    }
    if not_before > now + NOT_BEFORE_SKEW_SECS {
        return Err(ValidityError::NotYetValid { not_before, now });
    }
    Ok(())
}

/// The validity (`notBefore`, `notAfter`, Unix seconds) of the X.509 certificate `der`.
pub fn validity(der: &CertificateDer<'_>) -> Result<(i64, i64), CertError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
        .map_err(|e| CertError::X509(x509_reason(&e)))?;
    let v = cert.validity();
    Ok((v.not_before.timestamp(), v.not_after.timestamp()))
}

/// How far in the future a leaf's `notBefore` may be (clock skew between the issuer and this
/// host) before the certificate is refused as not yet valid.
pub const NOT_BEFORE_SKEW_SECS: i64 = 300;

/// `Ok` when `id` is a usable certificate id.
pub fn check_id(id: &str) -> Result<(), CertError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id != "."
        && id != ".."
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(CertError::BadId(id.to_string()))
    }
}

/// Checks `pem` and builds the certificate `id` at Unix time `now` (what an upload takes: a
/// certificate that has expired or is not valid yet is refused, [`CertError::Validity`]).
///
/// Beyond what a stored certificate is checked for ([`parse_stored`]): the id `all` is
/// reserved ([`CertError::ReservedId`]). The API also holds an upload's `certPem` and
/// `chainPem` to certificates only ([`check_items`]); staged files are not (LoxiLB, like Go's
/// `tls.X509KeyPair`, reads a `server.crt` holding the certificate and then its key).
pub fn parse(id: &str, pem: CertPem, now: i64) -> Result<Certificate, CertError> {
    if id == "all" {
        return Err(CertError::ReservedId);
    }
    let (cert, validity) = parse_any_validity(id, pem, now)?;
    match validity {
        Some(e) => Err(e.into()),
        None => Ok(cert),
    }
}

/// [`parse`] for a certificate stored in the state dir at restore: every check but the
/// validity one, which is returned beside the certificate instead (`Some` when it has expired
/// or is not valid yet at `now`). A stored certificate keeps being served across a restart as
/// it was before it (see [`super::store::CertStore::open`]).
pub fn parse_stored(
    id: &str,
    pem: CertPem,
    now: i64,
) -> Result<(Certificate, Option<ValidityError>), CertError> {
    parse_any_validity(id, pem, now)
}

fn parse_any_validity(
    id: &str,
    pem: CertPem,
    now: i64,
) -> Result<(Certificate, Option<ValidityError>), CertError> {
    check_id(id)?;
    let mut chain = certs("certPem", &pem.cert_pem)?;
    if chain.is_empty() {
        return Err(CertError::NoCertificate);
    }
    let in_cert_pem = chain.len();
    if let Some(extra) = pem.chain_pem.as_deref().filter(|c| !c.trim().is_empty()) {
        let more = certs("chainPem", extra)?;
        if more.is_empty() {
            return Err(CertError::Pem {
                field: "chainPem",
                reason: "no CERTIFICATE block".into(),
            });
        }
        chain.extend(more);
    }
    check_chain(&chain, in_cert_pem)?;
    let key = private_key(pem.key_pem.as_bytes())?;
    let signer = signing_key(&key)?;
    let facts = leaf_facts(&chain[0])?;
    let validity = check_validity(facts.not_before, facts.not_after, now).err();
    let certified = CertifiedKey::new(chain, signer);
    certified
        .keys_match()
        .map_err(|e| CertError::KeyMismatch(rustls_reason(&e, "")))?;
    let cert = Certificate {
        id: id.to_string(),
        hostnames: facts.hostnames,
        ip_addresses: facts.ip_addresses,
        not_before: facts.not_before,
        not_after: facts.not_after,
        key: Arc::new(certified),
        pem,
    };
    Ok((cert, validity))
}

/// `Ok` when `pem`'s `certPem` and `chainPem` hold certificates only
/// ([`CertError::NotACertificate`] naming the first other item: a private key there would be
/// stored in the state dir beside the certificate). What the cert API checks an upload for.
pub fn check_items(pem: &CertPem) -> Result<(), CertError> {
    only_certificates("certPem", &pem.cert_pem)?;
    match &pem.chain_pem {
        Some(chain) => only_certificates("chainPem", chain),
        None => Ok(()),
    }
}

/// `Ok` when every PEM item of `text` is a `CERTIFICATE`; else the first other one, named.
/// Every `-----BEGIN ` marker counts, wherever it stands (indented, or glued to the END
/// marker before it), not only those at the start of a line.
fn only_certificates(field: &'static str, text: &str) -> Result<(), CertError> {
    let labels = text.match_indices("-----BEGIN ").filter_map(|(i, m)| {
        text[i + m.len()..]
            .split_once("-----")
            .map(|(label, _)| label.trim().to_owned())
    });
    match labels.enumerate().find(|(_, l)| l != "CERTIFICATE") {
        None => Ok(()),
        Some((i, label)) => Err(CertError::NotACertificate {
            field,
            index: i + 1,
            hint: if label.ends_with("PRIVATE KEY") {
                " (the certificate's own key goes in keyPem; no other key belongs in the body)"
            } else {
                ""
            },
            label,
        }),
    }
}

fn certs(field: &'static str, text: &str) -> Result<Vec<CertificateDer<'static>>, CertError> {
    CertificateDer::pem_slice_iter(text.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::Pem {
            field,
            reason: pem_reason(&e),
        })
}

/// A PEM parse error as text: the marker or line it names quoted as text, and a base64 error
/// named in words (rustls-pki-types 1.x prints them as byte arrays and Rust debug forms such as
/// `InvalidCharacter(33)`).
pub fn pem_reason(e: &rustls::pki_types::pem::Error) -> String {
    use rustls::pki_types::pem::Error;
    match e {
        Error::Base64Decode(debug) => base64_reason(debug),
        Error::MissingSectionEnd { end_marker: line } | Error::IllegalSectionStart { line }
            if line.windows(8).any(|w| w == b"-----END") =>
        {
            ONE_LINE.into()
        }
        Error::MissingSectionEnd { end_marker } => format!(
            "missing section end marker {:?}",
            String::from_utf8_lossy(end_marker)
        ),
        Error::IllegalSectionStart { line } => {
            format!("illegal section start {:?}", String::from_utf8_lossy(line))
        }
        e => e.to_string(),
    }
}

/// A PEM whose BEGIN marker, body and END marker are on one line (its line breaks lost, as
/// an unquoted `echo $PEM` writes it): rustls-pki-types reads the whole line as the BEGIN
/// marker and reports the END marker missing.
const ONE_LINE: &str = "the PEM's line breaks are missing: its BEGIN marker, base64 body and \
                        END marker are on one line; the BEGIN and END markers must be on lines of \
                        their own (write the PEM with its line breaks, e.g. echo \"$PEM\" with \
                        the quotes)";

/// rustls-pki-types' base64 error (its `Debug` form) in words.
fn base64_reason(debug: &str) -> String {
    let what = match debug {
        "PrematurePadding" => "a padding '=' before the last block".to_owned(),
        "InvalidTrailingPadding" => "invalid padding at the end".to_owned(),
        d => match d
            .strip_prefix("InvalidCharacter(")
            .and_then(|n| n.strip_suffix(')'))
            .and_then(|n| n.parse::<u8>().ok())
        {
            Some(b) if b.is_ascii_graphic() || b == b' ' => {
                format!("character {:?} (byte {b}) is not base64", char::from(b))
            }
            Some(b) => format!("byte {b} is not base64"),
            None => d.to_owned(),
        },
    };
    format!("the base64 body does not decode: {what}")
}

/// Whether `der` is a CA certificate (`basicConstraints` `CA:TRUE`); false for one that does
/// not parse (its parse error is reported where it is parsed).
pub fn is_ca(der: &CertificateDer<'_>) -> bool {
    x509_parser::parse_x509_certificate(der.as_ref())
        .ok()
        .and_then(|(_, c)| c.basic_constraints().ok().flatten().map(|bc| bc.value.ca))
        .unwrap_or(false)
}

/// Each certificate after the leaf must be the issuer of the one before it (its subject is
/// that one's issuer name), so that clients can build the path from what is served; a
/// version 1 leaf is refused here with its own message (rustls reads only v3), and so is a CA
/// leaf ([`CertError::CaCertificate`]).
fn check_chain(chain: &[CertificateDer<'_>], in_cert_pem: usize) -> Result<(), CertError> {
    let parsed = chain
        .iter()
        .map(|der| {
            x509_parser::parse_x509_certificate(der.as_ref())
                .map(|(_, c)| c)
                .map_err(|e| CertError::X509(x509_reason(&e)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(leaf) = parsed.first()
        && leaf.version() != x509_parser::x509::X509Version::V3
    {
        return Err(CertError::X509(format!(
            "X.509 version {} (TLS needs a version 3 certificate, with extensions)",
            leaf.version().0 + 1
        )));
    }
    if let Some(leaf) = parsed.first()
        && let Ok(Some(bc)) = leaf.basic_constraints()
        && bc.value.ca
    {
        return Err(CertError::CaCertificate);
    }
    for (index, pair) in parsed.windows(2).enumerate() {
        if pair[0].issuer() != pair[1].subject() {
            return Err(CertError::BrokenChain {
                field: if index + 1 < in_cert_pem {
                    "certPem"
                } else {
                    "chainPem"
                },
                index: index + 1,
                subject: pair[1].subject().to_string(),
                issuer: pair[0].issuer().to_string(),
            });
        }
    }
    Ok(())
}

/// What the cert API reads from a leaf.
struct LeafFacts {
    hostnames: Vec<String>,
    ip_addresses: Vec<IpAddr>,
    not_before: i64,
    not_after: i64,
}

fn leaf_facts(der: &CertificateDer<'_>) -> Result<LeafFacts, CertError> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
        .map_err(|e| CertError::X509(x509_reason(&e)))?;
    let mut hostnames: Vec<String> = Vec::new();
    let mut ip_addresses: Vec<IpAddr> = Vec::new();
    let san = cert.subject_alternative_name();
    // RFC 6125 §6.4.4 (and webpki, OpenSSL, browsers): a certificate with a subjectAltName
    // extension is never matched by its CN, whatever the SAN lists (IP addresses only, say).
    let has_san = !matches!(san, Ok(None));
    if let Ok(Some(san)) = san {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(n) => hostnames.push(n.to_ascii_lowercase()),
                GeneralName::IPAddress(bytes) => {
                    if let Some(ip) = san_ip(bytes)
                        && !ip_addresses.contains(&ip)
                    {
                        ip_addresses.push(ip);
                    }
                }
                _ => {}
            }
        }
    }
    if !has_san {
        hostnames.extend(
            cert.subject()
                .iter_common_name()
                .filter_map(|cn| cn.as_str().ok())
                .map(str::to_ascii_lowercase),
        );
    }
    hostnames.retain(|h| !h.is_empty());
    hostnames.dedup();
    if hostnames.is_empty() && ip_addresses.is_empty() {
        return Err(CertError::NoHostnames);
    }
    let v = cert.validity();
    Ok(LeafFacts {
        hostnames,
        ip_addresses,
        not_before: v.not_before.timestamp(),
        not_after: v.not_after.timestamp(),
    })
}

/// A SAN `iPAddress` (4 bytes IPv4, 16 bytes IPv6, RFC 5280 §4.2.1.6); `None` for another
/// length (a name constraint's address and mask has 8 or 32, never in a leaf's SAN).
fn san_ip(bytes: &[u8]) -> Option<IpAddr> {
    if let Ok(v4) = <[u8; 4]>::try_from(bytes) {
        return Some(IpAddr::from(v4));
    }
    <[u8; 16]>::try_from(bytes).ok().map(IpAddr::from)
}

/// The IP address host `name` is, if it is one: `10.0.0.5`, `::1` or `[::1]` (a host is
/// either an IP address or a DNS name, never both).
pub fn ip_host(name: &str) -> Option<IpAddr> {
    let bare = name
        .strip_prefix('[')
        .and_then(|n| n.strip_suffix(']'))
        .unwrap_or(name);
    bare.parse::<IpAddr>().ok()
}

impl Certificate {
    /// True when this certificate is valid at Unix time `now` as clients check it:
    /// `notBefore` ≤ `now` < `notAfter`. (An upload allows a `notBefore` up to
    /// [`NOT_BEFORE_SKEW_SECS`] ahead, [`check_validity`]; such a certificate is stored, but
    /// served for a name only when nothing valid covers it, and covers no rule, until then.)
    pub fn valid_at(&self, now: i64) -> bool {
        self.not_before <= now && now < self.not_after
    }

    /// True when this certificate is valid for host `name` as TLS clients check it: an IP
    /// address ([`ip_host`]) against the SAN IP addresses only, the same address family
    /// (`::ffff:10.0.0.5` is not `10.0.0.5`; a DNS name or CN spelled like that address does
    /// not count); a DNS name against the hostnames ([`name_matches`]:
    /// exact, or a `*.` wildcard covering one label).
    pub fn covers(&self, name: &str) -> bool {
        match ip_host(name) {
            // Byte for byte, as webpki and OpenSSL compare: an IPv4-mapped IPv6 address is
            // not its IPv4 address to a TLS client.
            Some(ip) => self.ip_addresses.contains(&ip),
            None => self.hostnames.iter().any(|h| name_matches(h, name)),
        }
    }

    /// Every name the certificate is valid for, as the API lists it: the hostnames, then each
    /// IP address as `IP:<address>` (openssl's `subjectAltName` notation, which tells an IP
    /// address from a DNS name spelled like one).
    pub fn names(&self) -> Vec<String> {
        self.hostnames
            .iter()
            .cloned()
            .chain(self.ip_addresses.iter().map(|ip| format!("IP:{ip}")))
            .collect()
    }
}

/// True when certificate name `pattern` (maybe `*.example.com`) covers host `name`
/// (case-insensitive; a wildcard covers exactly one leftmost label).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let name = name.trim_end_matches('.');
    if let Some(suffix) = pattern.strip_prefix("*.") {
        return match name.split_once('.') {
            Some((label, rest)) => !label.is_empty() && rest.eq_ignore_ascii_case(suffix),
            None => false,
        };
    }
    pattern.eq_ignore_ascii_case(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::testutil::ca_and_leaf;

    fn now() -> i64 {
        time::OffsetDateTime::now_utc().unix_timestamp()
    }

    fn pem_for(names: &[&str], not_after: time::OffsetDateTime) -> CertPem {
        crate::certs::testutil::self_signed(names, Some(not_after))
    }

    fn in_days(d: i64) -> time::OffsetDateTime {
        time::OffsetDateTime::now_utc() + time::Duration::days(d)
    }

    /// A private key (or any item but a certificate) in an upload's `certPem` or `chainPem`
    /// is refused naming the field and the item, indented or glued to the END marker before
    /// it too: it was accepted and stored in the state dir beside the certificate (a CA's key
    /// appended to the chain, say); an upload or a staged pair with the id `all` is refused,
    /// since `/config/cert/all` is the list. A stored certificate is not held to either
    /// (restore keeps what an older daemon stored), nor a staged `server.crt` holding its
    /// key (LoxiLB's layout). A `chainPem` of a key alone was refused as `no CERTIFICATE
    /// block`; it now says what it holds.
    #[test]
    fn keys_outside_key_pem_and_the_id_all_are_refused() {
        let good = pem_for(&["a.example"], in_days(30));
        let other_key = pem_for(&["b.example"], in_days(30)).key_pem;
        let with_key_in = |cert_pem: String, chain_pem: Option<String>| CertPem {
            cert_pem,
            key_pem: good.key_pem.clone(),
            chain_pem,
        };
        let indented: String = other_key.lines().map(|l| format!("  {l}\n")).collect();
        let glued = format!("{}{other_key}", good.cert_pem.trim_end());
        for (pem, field) in [
            (
                with_key_in(format!("{}{other_key}", good.cert_pem), None),
                "certPem",
            ),
            (
                with_key_in(format!("{}{indented}", good.cert_pem), None),
                "certPem",
            ),
            (with_key_in(glued, None), "certPem"),
            (
                with_key_in(good.cert_pem.clone(), Some(other_key.clone())),
                "chainPem",
            ),
        ] {
            let e = check_items(&pem).expect_err("a key outside keyPem");
            assert_eq!(e.field(), field, "{e}");
            assert!(
                e.to_string().contains("PRIVATE KEY, not a CERTIFICATE"),
                "{e}"
            );
            if field == "certPem" {
                parse_stored("a", pem.clone(), now()).expect("a stored one still loads");
                parse("a", pem, now()).expect("a staged server.crt may hold its key");
            }
        }
        let e = parse("all", good.clone(), now()).expect_err("reserved");
        assert_eq!(e.field(), "certId", "{e}");
        assert!(e.to_string().contains("is reserved"), "{e}");
        parse("all2", good, now()).expect("another id");
    }

    #[test]
    fn hostnames_come_from_the_san_dns_names() {
        let c = parse(
            "a",
            pem_for(&["A.example", "*.b.example"], in_days(30)),
            now(),
        )
        .expect("valid");
        assert_eq!(c.hostnames, ["a.example", "*.b.example"]);
        assert!(c.not_after > now() + 29 * 86_400);
    }

    /// SAN IP addresses are read apart from the DNS names (they were dropped, and a
    /// certificate naming only addresses was refused as naming no host); an IP host is covered
    /// by an IP address only, never by a DNS name or CN spelled like it; a DNS host never by an
    /// IP address.
    #[test]
    fn ip_addresses_come_from_the_san_ip_addresses_and_cover_ip_hosts_only() {
        use crate::certs::testutil::{dns, ip, with_sans};
        let c = parse(
            "a",
            with_sans(vec![dns("A.example"), ip("10.0.0.5"), ip("fd00::5")], None),
            now(),
        )
        .expect("valid");
        assert_eq!(c.hostnames, ["a.example"]);
        assert_eq!(
            c.ip_addresses,
            [
                "10.0.0.5".parse::<IpAddr>().expect("ip"),
                "fd00::5".parse().expect("ip")
            ]
        );
        assert_eq!(c.names(), ["a.example", "IP:10.0.0.5", "IP:fd00::5"]);
        assert!(c.covers("10.0.0.5") && c.covers("fd00::5") && c.covers("[fd00::5]"));
        assert!(c.covers("a.example") && !c.covers("10.0.0.6"));
        let only_ips = parse("b", with_sans(vec![ip("10.0.0.5")], None), now()).expect("valid");
        assert!(only_ips.hostnames.is_empty());
        assert!(only_ips.covers("10.0.0.5"));
        let spelled = parse(
            "c",
            with_sans(vec![dns("10.0.0.5")], Some("10.0.0.6")),
            now(),
        )
        .expect("valid");
        assert_eq!(spelled.hostnames, ["10.0.0.5"]);
        assert!(spelled.ip_addresses.is_empty());
        assert!(
            !spelled.covers("10.0.0.5"),
            "a DNS name spelled like the address"
        );
        let cn = parse("d", with_sans(vec![], Some("10.0.0.6")), now()).expect("valid");
        assert_eq!(cn.hostnames, ["10.0.0.6"], "the CN when there is no SAN");
        assert!(!cn.covers("10.0.0.6"), "a CN spelled like an address");
        assert_eq!(
            parse("e", with_sans(vec![], None), now()).expect_err("no name"),
            CertError::NoHostnames
        );
        let mut snap = crate::certs::CertSnapshot::default();
        for c in [c, spelled] {
            snap.certs.insert(c.id.clone(), Arc::new(c));
        }
        assert_eq!(snap.for_name("10.0.0.5").map(|c| c.id.as_str()), Some("a"));
        assert_eq!(snap.for_name("10.0.0.7").map(|c| c.id.as_str()), None);
    }

    /// An IPv4 address and its IPv4-mapped IPv6 spelling are different IP hosts to a TLS
    /// client (webpki and OpenSSL compare the SAN's 4 or 16 bytes with the address's): a SAN
    /// `IP:10.0.0.5` does not cover `::ffff:10.0.0.5`, nor `IP:::ffff:10.0.0.5` the IPv4 host
    /// (both were taken as covered, so a TLS rule for the other spelling was accepted and every
    /// verifying client refused its handshake).
    #[test]
    fn an_ipv4_mapped_address_is_not_its_ipv4_address_to_a_tls_client() {
        use crate::certs::testutil::{ip, with_sans};
        let v4 = parse("a", with_sans(vec![ip("10.0.0.5")], None), now()).expect("valid");
        assert!(v4.covers("10.0.0.5"));
        assert!(!v4.covers("::ffff:10.0.0.5") && !v4.covers("[::ffff:10.0.0.5]"));
        let mapped = parse("b", with_sans(vec![ip("::ffff:10.0.0.5")], None), now()).expect("ok");
        assert_eq!(mapped.names(), ["IP:::ffff:10.0.0.5"]);
        assert!(mapped.covers("::ffff:10.0.0.5") && !mapped.covers("10.0.0.5"));
    }

    /// RFC 6125 §6.4.4: once a certificate has a subjectAltName extension its CN names no
    /// host, also when the SAN lists IP addresses only (the CN was taken as a hostname then,
    /// so the certificate was listed for, and served, a name no client accepts it for).
    #[test]
    fn the_cn_is_no_hostname_when_a_san_extension_is_present() {
        use crate::certs::testutil::{ip, with_sans};
        let c = parse(
            "a",
            with_sans(vec![ip("10.0.0.9")], Some("lb.example")),
            now(),
        )
        .expect("valid");
        assert!(c.hostnames.is_empty(), "{:?}", c.hostnames);
        assert_eq!(c.names(), ["IP:10.0.0.9"]);
        assert!(!c.covers("lb.example") && c.covers("10.0.0.9"));
        let no_san = parse("b", with_sans(vec![], Some("LB.example")), now()).expect("valid");
        assert_eq!(
            no_san.hostnames,
            ["lb.example"],
            "the CN without a SAN extension"
        );
        assert!(no_san.covers("lb.example"));
    }

    #[test]
    fn an_expired_certificate_is_refused() {
        let e = parse("a", pem_for(&["a.example"], in_days(-1)), now()).expect_err("expired");
        assert!(
            matches!(e, CertError::Validity(ValidityError::Expired { .. })),
            "{e}"
        );
        assert!(
            e.to_string()
                .starts_with("certPem: the certificate expired at "),
            "{e}"
        );
        // Times are said as dates, not Unix seconds.
        assert_eq!(
            ValidityError::Expired {
                not_after: 1_609_459_200,
                now: 1_609_459_260
            }
            .to_string(),
            "the certificate expired at 2021-01-01T00:00:00Z (now 2021-01-01T00:01:00Z)"
        );
        assert_eq!(
            ValidityError::NotYetValid {
                not_before: 32_472_144_000,
                now: 1_609_459_200
            }
            .to_string(),
            "the certificate is not valid before 2999-01-01T00:00:00Z (now \
             2021-01-01T00:00:00Z); clients would refuse it until then"
        );
    }

    #[test]
    fn two_private_keys_are_refused_naming_key_pem() {
        let mut p = pem_for(&["a.example"], in_days(30));
        let other = pem_for(&["a.example"], in_days(30)).key_pem;
        p.key_pem = format!("{}{other}", p.key_pem);
        let e = parse("a", p, now()).expect_err("two keys");
        assert_eq!(e, CertError::Key(KeyPemError::Several(2)));
        assert_eq!(
            e.to_string(),
            "keyPem: the PEM holds 2 private keys; one is expected (the certificate's)"
        );
    }

    /// A fake PEM block labelled `label` (the body is base64 of a few bytes).
    fn block(label: &str) -> String {
        format!("-----BEGIN {label}-----\nAAECAwQFBgcI\n-----END {label}-----\n")
    }

    /// An encrypted key (PKCS#8's ENCRYPTED PRIVATE KEY, OpenSSL's legacy Proc-Type header)
    /// is named as such with the command that decrypts it, not reported as no key; with a
    /// plain key beside it, the file holds two keys.
    #[test]
    fn an_encrypted_key_is_named_with_how_to_decrypt_it() {
        let e = private_key(block("ENCRYPTED PRIVATE KEY").as_bytes()).expect_err("encrypted");
        assert_eq!(e, KeyPemError::Encrypted("ENCRYPTED PRIVATE KEY"));
        assert_eq!(
            e.to_string(),
            "the key is encrypted (ENCRYPTED PRIVATE KEY); loxi needs an unencrypted key: \
             `openssl pkey -in KEY -out KEY.plain` writes one (it asks for the passphrase)"
        );
        let legacy = "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: \
                      AES-128-CBC,00\n\nAAECAwQFBgcI\n-----END RSA PRIVATE KEY-----\n";
        let e = private_key(legacy.as_bytes()).expect_err("legacy encrypted");
        assert!(
            e.to_string().starts_with(
                "the key is encrypted (a Proc-Type: 4,ENCRYPTED header, OpenSSL's legacy \
                 encrypted PEM); loxi needs an unencrypted key"
            ),
            "{e}"
        );
        let mut p = pem_for(&["a.example"], in_days(30));
        let plain = p.key_pem.clone();
        p.key_pem = block("ENCRYPTED PRIVATE KEY");
        assert_eq!(
            parse("a", p.clone(), now())
                .expect_err("encrypted")
                .to_string(),
            "keyPem: the key is encrypted (ENCRYPTED PRIVATE KEY); loxi needs an unencrypted \
             key: `openssl pkey -in KEY -out KEY.plain` writes one (it asks for the passphrase)"
        );
        p.key_pem = format!("{plain}{}", block("ENCRYPTED PRIVATE KEY"));
        assert_eq!(
            parse("a", p, now()).expect_err("two keys"),
            CertError::Key(KeyPemError::Several(2))
        );
    }

    /// A PEM written on one line (its line breaks lost) says so, instead of quoting the whole
    /// line as a missing end marker; for the certificate and for the key alike.
    #[test]
    fn a_pem_on_one_line_says_its_line_breaks_are_missing() {
        let good = pem_for(&["a.example"], in_days(30));
        let one_line = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
        let mut p = good.clone();
        p.cert_pem = one_line(&good.cert_pem);
        let e = parse("a", p, now()).expect_err("one-line cert");
        assert_eq!(e.to_string(), format!("certPem: malformed PEM: {ONE_LINE}"));
        assert!(
            ONE_LINE.starts_with(
                "the PEM's line breaks are missing: its BEGIN marker, base64 body and END \
                 marker are on one line; the BEGIN and END markers must be on lines of their own"
            ),
            "{ONE_LINE}"
        );
        let mut p = good.clone();
        p.key_pem = one_line(&good.key_pem);
        let e = parse("a", p, now()).expect_err("one-line key");
        assert_eq!(e, CertError::Key(KeyPemError::Pem(ONE_LINE.into())));
        // Something after the END marker on that line: rustls calls the line an illegal
        // start; the same words.
        let mut p = good;
        p.cert_pem = format!("{} x", one_line(&p.cert_pem));
        let e = parse("a", p, now()).expect_err("one-line cert and more");
        assert_eq!(e.to_string(), format!("certPem: malformed PEM: {ONE_LINE}"));
    }

    /// A certificate whose DER was cut short is said to be truncated, not x509-parser's
    /// `NomError(Eof)`.
    #[test]
    fn a_truncated_certificate_is_said_in_words() {
        use base64::Engine as _;
        let mut p = pem_for(&["a.example"], in_days(30));
        let der = CertificateDer::from_pem_slice(p.cert_pem.as_bytes()).expect("der");
        let cut = base64::engine::general_purpose::STANDARD.encode(&der.as_ref()[..100]);
        p.cert_pem = format!("-----BEGIN CERTIFICATE-----\n{cut}\n-----END CERTIFICATE-----\n");
        let e = parse("a", p, now()).expect_err("truncated");
        assert_eq!(
            e.to_string(),
            "certPem: not an X.509 certificate: the certificate is truncated or not DER"
        );
    }

    /// rustls' errors in words: the mismatch and an undecodable certificate.
    #[test]
    fn rustls_errors_are_said_in_words() {
        use rustls::{CertificateError, Error, InconsistentKeys};
        assert_eq!(
            rustls_reason(&Error::InconsistentKeys(InconsistentKeys::KeyMismatch), ""),
            "the private key does not match the certificate's public key"
        );
        assert_eq!(
            rustls_reason(
                &Error::InvalidCertificate(CertificateError::BadEncoding),
                ""
            ),
            "the certificate is truncated or not DER"
        );
        // Each side names its own CA setting, and only that one.
        assert_eq!(
            rustls_reason(
                &Error::InvalidCertificate(CertificateError::UnknownIssuer),
                "loxicmd --cacert FILE"
            ),
            "the peer's certificate is not signed by a CA this side trusts (unknown issuer): \
             give the CA that signed it (loxicmd --cacert FILE)"
        );
        assert_eq!(
            rustls_reason(
                &Error::InvalidCertificate(CertificateError::BadSignature),
                "the rule's backend_ca_file"
            ),
            "the peer's certificate does not verify with the trusted CA of its issuer's name \
             (another CA of the same name signed it?): give the CA that signed it (the rule's \
             backend_ca_file)"
        );
        let expected = rustls::pki_types::ServerName::try_from("wrong.example").expect("name");
        assert_eq!(
            rustls_reason(
                &Error::InvalidCertificate(CertificateError::NotValidForNameContext {
                    expected,
                    presented: vec![
                        "DnsName(\"localhost\")".into(),
                        "IpAddress(127.0.0.1)".into()
                    ],
                }),
                ""
            ),
            "the peer's certificate is not valid for the name wrong.example; it names \
             localhost, 127.0.0.1"
        );
        // webpki writes IPv6 its own way (`0::1` for ::1): named as std writes an address.
        let expected = rustls::pki_types::ServerName::try_from("wrong.example").expect("name");
        assert_eq!(
            rustls_reason(
                &Error::InvalidCertificate(CertificateError::NotValidForNameContext {
                    expected,
                    presented: vec!["IpAddress(0::1)".into(), "IpAddress(fd00::5)".into()],
                }),
                ""
            ),
            "the peer's certificate is not valid for the name wrong.example; it names ::1, \
             fd00::5"
        );
    }

    /// A CA file's items that are not usable CA certificates are each named with why.
    #[test]
    fn a_ca_bundle_names_each_refused_item() {
        let ca = ca_and_leaf("Test CA").1;
        let key = pem_for(&["a.example"], in_days(30)).key_pem;
        let text = format!("{key}{}{ca}", block("CERTIFICATE"));
        let b = CaBundle::from_pem(text.as_bytes()).expect("parses");
        assert_eq!(b.roots.len(), 1, "the CA is taken");
        let refused: Vec<String> = b.refused.iter().map(ToString::to_string).collect();
        assert_eq!(
            refused,
            [
                "PEM item 1 is a PRIVATE KEY, not a CERTIFICATE",
                "PEM item 2 (CERTIFICATE): the certificate is truncated or not DER"
            ]
        );
        assert_eq!(
            b.no_private_key(),
            Err(
                "PEM item 1 is a PRIVATE KEY: a CA file holds certificates only; keep private \
                 keys out of trust bundles (remove it from the file)"
                    .to_string()
            )
        );
        let ca_only = CaBundle::from_pem(ca.as_bytes()).expect("parses");
        assert_eq!(ca_only.no_private_key(), Ok(()));
        let none = CaBundle::from_pem(key.as_bytes()).expect("parses");
        assert!(none.roots.is_empty());
        assert_eq!(
            none.none_usable(),
            "no usable CA certificate: PEM item 1 is a PRIVATE KEY, not a CERTIFICATE"
        );
        let empty = CaBundle::from_pem(b"hello").expect("parses");
        assert_eq!(empty.none_usable(), "no CERTIFICATE block");
    }

    /// A PEM block without its end marker names the marker as text, not as bytes.
    #[test]
    fn a_truncated_pem_names_its_missing_end_marker() {
        let mut p = pem_for(&["a.example"], in_days(30));
        p.key_pem = p.key_pem.replace("-----END PRIVATE KEY-----", "");
        let e = parse("a", p, now()).expect_err("truncated key");
        assert_eq!(
            e.to_string(),
            "keyPem: malformed PEM: missing section end marker \"PRIVATE KEY\""
        );
    }

    /// A body with a character outside base64 names it, not rustls-pki-types' debug form.
    #[test]
    fn a_pem_body_that_is_not_base64_names_the_character() {
        let mut p = pem_for(&["a.example"], in_days(30));
        let body = p.key_pem.find('\n').expect("a line after the BEGIN marker") + 1;
        p.key_pem.replace_range(body..body + 1, "!");
        let e = parse("a", p, now()).expect_err("bad base64");
        assert_eq!(
            e.to_string(),
            "keyPem: malformed PEM: the base64 body does not decode: character '!' (byte 33) is \
             not base64"
        );
        assert_eq!(
            base64_reason("PrematurePadding"),
            "the base64 body does not decode: a padding '=' before the last block"
        );
        assert_eq!(
            base64_reason("InvalidCharacter(10)"),
            "the base64 body does not decode: byte 10 is not base64"
        );
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let mut p = pem_for(&["a.example"], in_days(30));
        p.key_pem = pem_for(&["a.example"], in_days(30)).key_pem;
        let e = parse("a", p, now()).expect_err("mismatch");
        assert_eq!(
            e.to_string(),
            "keyPem does not match the certificate in certPem: the private key does not match \
             the certificate's public key"
        );
    }

    #[test]
    fn missing_key_and_garbage_are_refused_with_the_field() {
        let mut p = pem_for(&["a.example"], in_days(30));
        p.key_pem = String::new();
        let e = parse("a", p.clone(), now()).expect_err("no key");
        assert_eq!(e, CertError::Key(KeyPemError::NoKey));
        assert_eq!(
            e.to_string(),
            "keyPem: no private key (PKCS#8, PKCS#1 or SEC1 PEM block)"
        );
        p.cert_pem = "hello".into();
        assert_eq!(
            parse("a", p, now()).expect_err("no cert"),
            CertError::NoCertificate
        );
    }

    /// Throwaway keys openssl wrote (`genpkey -algorithm ed448`, `ecparam -name secp521r1
    /// -genkey -noout`, `genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:1024`): well-formed
    /// keys of types ring does not sign with.
    const ED448_KEY: &str = "-----BEGIN PRIVATE KEY-----\n\
MEcCAQAwBQYDK2VxBDsEOc6dFk4GdgktMM+lRBBetqre5GYsH1hOpEP/UBda7LjB\n\
zw+poNwC0sX0nyxz5tjAwM+whYGsagu9ow==\n\
-----END PRIVATE KEY-----\n";
    const P521_SEC1_KEY: &str = "-----BEGIN EC PRIVATE KEY-----\n\
MIHcAgEBBEIBxYsgW/ZBZ9gunQTRy38m8TPKgBwH7Cms/u76MKMUtIVnE95Hiid5\n\
qPKuo+m4ux9dnjn5d2iOS7EFC4hMjncz4qWgBwYFK4EEACOhgYkDgYYABADedhYL\n\
Wrs2cZi9wUz1qM1/2c5JPVCpOSGRSSuNmGAOrMrVC9e9il36pIq7mMGIfIF1YKYM\n\
GQHVP4msKNUUfNEeCwF84B0/5OexoE4CzVajqYpeVep6QITUHCQL17VRWYjM7tQs\n\
KNu64/Rau3P135v2wYOnmlEznUYymRorrgkPnjCQGA==\n\
-----END EC PRIVATE KEY-----\n";
    const RSA1024_KEY: &str = "-----BEGIN PRIVATE KEY-----\n\
MIICdwIBADANBgkqhkiG9w0BAQEFAASCAmEwggJdAgEAAoGBALWssOEWducp4aC0\n\
pUqwwjy1blXmaqt5BsC6gHLAS0vTBAslpt+dEwEND3JdSugZVOjsVSLAn0cYbWH3\n\
U+Y44m/C2DYI2tE9Wn2C0nWpiqnrHQqz0LuJcUKY+U09odgBlXK2dhHzYFWTMGCQ\n\
GM2pyAysqmugVUqOLJWtaHlzu01NAgMBAAECgYAYlTmJ+6QzO3OQb2E+bhSaamJ3\n\
tSoR8dp8EcB3xpVpuS/+4iVmdLaxmbbRXtZX+bWHnxMWFMJ4uFF0xCbSLDhXdMS4\n\
O5ZgVt1wPmZnOf7mREAdxWljl4Ax9+9jgc9EeNQmbi2VfL776csxXm8f9PhlN205\n\
3oAKBOPtPSpukibb8QJBANjsPQFWK7JUtwgTlN35oSyecY94NcPz5v/pgu1ULyuI\n\
erpA6k1c9jh0w1l1itH007WlH8PrkrBnSFzC5ZIQpH8CQQDWZuu9xai9jDWu3Lz8\n\
z7o/hdCGLJ1NSkbsvT6PCiiLcC4S9IAl04xdpTyh5Xj/Ez75fZSAGKRwtabjpr1v\n\
MXgzAkEAnAsUt2ltdZNLNxwe8q8oKhiwSCyJQLSrb1xjOqZcaEx9PI6F/bDpziLw\n\
g+HyQqaDxR9LgnxrwUoK2++3hSNDsQJBAJxaaBZ3u8unIUsI/OVc05UZj+0ZQgmo\n\
Xjqs8586qECvqVn3ZjCvqpBsPOBPyUIzFdy54P7deaYcQr2HzmP1bpMCQANL5s4X\n\
+Qgz5MlEY9pAWR64zh4Trn19gZjC4oHKvZbEUiaIrFjpwUntOkVQ69q0bYdscM4c\n\
n4nDGOMISzkcZLY=\n\
-----END PRIVATE KEY-----\n";

    /// A key whose PEM markers are fine but whose data is garbage or cut short is said to be
    /// corrupt (its contents could not be decoded), not "unsupported"; a well-formed key of a
    /// type ring does not sign with is named as unsupported, with the types loxi signs with.
    #[test]
    fn a_corrupt_key_and_an_unsupported_key_type_are_told_apart() {
        let mut p = pem_for(&["a.example"], in_days(30));
        let corrupt = |form: &str| {
            format!(
                "keyPem: the private key's contents could not be decoded: the {form} key data \
                 between the PEM markers is corrupt or truncated; copy the key again from where \
                 it was made"
            )
        };
        p.key_pem = "-----BEGIN PRIVATE KEY-----\nAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8g\n\
                     -----END PRIVATE KEY-----\n"
            .into();
        let e = parse("a", p.clone(), now()).expect_err("garbage");
        assert_eq!(e.to_string(), corrupt("PKCS#8"));
        assert_eq!(e.field(), "keyPem");
        // The certificate's own key, its base64 body cut after its first line.
        let own = pem_for(&["a.example"], in_days(30)).key_pem;
        let lines: Vec<&str> = own.lines().collect();
        p.key_pem = format!("{}\n{}\n{}\n", lines[0], lines[1], lines[lines.len() - 1]);
        assert_eq!(
            parse("a", p.clone(), now())
                .expect_err("truncated")
                .to_string(),
            corrupt("PKCS#8")
        );
        p.key_pem =
            "-----BEGIN EC PRIVATE KEY-----\nAAECAwQFBgcI\n-----END EC PRIVATE KEY-----\n".into();
        assert_eq!(
            parse("a", p.clone(), now())
                .expect_err("garbage")
                .to_string(),
            corrupt("SEC1 EC")
        );
        let unsupported = |what: &str| {
            format!(
                "unsupported private key type: {what}; loxi signs with RSA keys of 2048 to 8192 \
                 bits, ECDSA keys on P-256 or P-384, and Ed25519 keys"
            )
        };
        for (key, what) in [
            (ED448_KEY, "Ed448"),
            (P521_SEC1_KEY, "ECDSA on curve P-521"),
            (RSA1024_KEY, "RSA of 1024 bits"),
        ] {
            let e = private_key(key.as_bytes()).expect_err(what);
            assert_eq!(e.to_string(), unsupported(what));
            p.key_pem = key.into();
            assert_eq!(
                parse("a", p.clone(), now()).expect_err(what).to_string(),
                format!("keyPem: {}", unsupported(what))
            );
        }
        assert!(!corrupt("PKCS#8").contains("unsupported"));
        // A well-formed key under another form's label is said to be mislabelled, with the
        // label its data needs: the certificate's own PKCS#8 key between RSA markers, an EC
        // (SEC1) key between PKCS#8 ones.
        let relabel = |pem: &str, from: &str, to: &str| {
            pem.replace(&format!("BEGIN {from}-"), &format!("BEGIN {to}-"))
                .replace(&format!("END {from}-"), &format!("END {to}-"))
        };
        p.key_pem = relabel(&own, "PRIVATE KEY", "RSA PRIVATE KEY");
        assert_eq!(
            parse("a", p.clone(), now())
                .expect_err("mislabelled")
                .to_string(),
            "keyPem: the private key is labelled RSA PRIVATE KEY but holds a PKCS#8 key; change \
             its PEM markers to `-----BEGIN PRIVATE KEY-----` and `-----END PRIVATE KEY-----`"
        );
        let sec1 = relabel(P521_SEC1_KEY, "EC PRIVATE KEY", "PRIVATE KEY");
        assert_eq!(
            private_key(sec1.as_bytes())
                .expect_err("mislabelled")
                .to_string(),
            "the private key is labelled PRIVATE KEY but holds a SEC1 EC key; change its PEM \
             markers to `-----BEGIN EC PRIVATE KEY-----` and `-----END EC PRIVATE KEY-----`"
        );
    }

    #[test]
    fn ids_are_bounded_and_have_no_path_separators() {
        assert!(check_id("web-1.example_A").is_ok());
        for bad in ["", "a/b", "..", "a\\b", &"x".repeat(64)] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn wildcards_cover_one_label() {
        assert!(name_matches("*.example.com", "API.example.com"));
        assert!(!name_matches("*.example.com", "a.b.example.com"));
        assert!(!name_matches("*.example.com", "example.com"));
        assert!(name_matches("api.example.com", "api.example.com."));
    }

    /// `chainPem` is served after the leaf: garbage, or a certificate that did not issue the
    /// one before it, is refused naming the field; the leaf's real issuer is accepted.
    #[test]
    fn a_chain_must_parse_and_link() {
        let (mut p, ca) = ca_and_leaf("Test CA");
        p.chain_pem = Some("garbage".into());
        let e = parse("a", p.clone(), now()).expect_err("garbage chain");
        assert!(
            matches!(
                e,
                CertError::Pem {
                    field: "chainPem",
                    ..
                }
            ),
            "{e}"
        );
        p.chain_pem = Some(ca_and_leaf("Other CA").1);
        let e = parse("a", p.clone(), now()).expect_err("unrelated chain");
        assert_eq!(
            e,
            CertError::BrokenChain {
                field: "chainPem",
                index: 1,
                subject: "CN=Other CA".into(),
                issuer: "CN=Test CA".into(),
            }
        );
        p.chain_pem = Some(ca);
        let c = parse("a", p.clone(), now()).expect("the issuer");
        assert_eq!(c.key.cert.len(), 2, "leaf and its issuer are served");
        // A break inside `certPem` (here the leaf twice, no `chainPem`) names `certPem`.
        let mut twice = p;
        twice.cert_pem = format!("{}{}", twice.cert_pem, twice.cert_pem);
        twice.chain_pem = None;
        let e = parse("a", twice, now()).expect_err("the leaf twice");
        assert!(
            matches!(
                e,
                CertError::BrokenChain {
                    field: "certPem",
                    index: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().starts_with("certPem: "), "{e}");
    }

    /// A leaf whose validity starts beyond the skew allowance is refused (rcgen's leaves start
    /// on 1975-01-01, so "now" is put in 1970 for the check).
    #[test]
    fn a_not_yet_valid_certificate_is_refused() {
        let p = pem_for(&["a.example"], in_days(30));
        let e = parse("a", p.clone(), 0).expect_err("not yet valid");
        assert!(
            matches!(
                e,
                CertError::Validity(ValidityError::NotYetValid { now: 0, .. })
            ),
            "{e}"
        );
        let starts = parse("a", p.clone(), now()).expect("valid now").not_before;
        assert!(
            parse("a", p, starts - NOT_BEFORE_SKEW_SECS).is_ok(),
            "within the skew"
        );
    }

    /// A CA certificate (`basicConstraints CA:TRUE`) as the leaf is refused naming `certPem`
    /// and saying why (clients refuse it as a server certificate); the same CA after a leaf it
    /// signed (a chain) is accepted.
    #[test]
    fn a_ca_certificate_as_the_leaf_is_refused() {
        let (leaf, ca_pem) = ca_and_leaf("Test CA");
        let mut ca_params =
            rcgen::CertificateParams::new(vec!["ca.example".to_string()]).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().expect("key");
        let ca = ca_params.self_signed(&key).expect("ca");
        let p = CertPem {
            cert_pem: ca.pem(),
            key_pem: key.serialize_pem(),
            chain_pem: None,
        };
        let e = parse("ca", p, now()).expect_err("a CA certificate");
        assert_eq!(e, CertError::CaCertificate);
        assert_eq!(e.field(), "certPem");
        assert!(
            e.to_string().starts_with(
                "certPem: the certificate is a CA certificate (basicConstraints CA:TRUE); TLS \
                 clients refuse a CA certificate as a server's certificate"
            ),
            "{e}"
        );
        // A self-signed test certificate (openssl req -x509 marks it CA:TRUE): the message
        // gives the openssl option the README gives.
        assert!(
            e.to_string()
                .contains("openssl req -x509 ... -addext basicConstraints=critical,CA:FALSE"),
            "{e}"
        );
        let mut chained = leaf;
        chained.chain_pem = Some(ca_pem);
        assert!(
            parse("a", chained, now()).is_ok(),
            "a CA in the chain is fine"
        );
    }

    /// Each refusal names the body field at fault.
    #[test]
    fn errors_name_their_field() {
        let mut p = pem_for(&["a.example"], in_days(30));
        assert_eq!(
            parse("a/b", p.clone(), now()).expect_err("id").field(),
            "certId"
        );
        p.key_pem = pem_for(&["a.example"], in_days(30)).key_pem;
        assert_eq!(
            parse("a", p.clone(), now()).expect_err("key").field(),
            "keyPem"
        );
        p.key_pem = String::new();
        assert_eq!(
            parse("a", p.clone(), now()).expect_err("no key").field(),
            "keyPem"
        );
        let old = pem_for(&["a.example"], in_days(-1));
        assert_eq!(
            parse("a", old, now()).expect_err("expired").field(),
            "certPem"
        );
        p.cert_pem = "hello".into();
        assert_eq!(
            parse("a", p, now()).expect_err("no cert").field(),
            "certPem"
        );
    }

    /// A stored certificate is loaded whatever its validity, the validity error beside it;
    /// every other check still refuses.
    #[test]
    fn parse_stored_loads_an_expired_certificate_and_reports_it() {
        let old = pem_for(&["a.example"], in_days(-1));
        let (c, validity) = parse_stored("a", old.clone(), now()).expect("loaded");
        assert_eq!(c.hostnames, ["a.example"]);
        assert!(
            matches!(validity, Some(ValidityError::Expired { not_after, .. }) if not_after == c.not_after),
            "{validity:?}"
        );
        let (_, fine) = parse_stored("a", pem_for(&["a.example"], in_days(3)), now()).expect("ok");
        assert_eq!(fine, None);
        let mut mismatched = old;
        mismatched.key_pem = pem_for(&["a.example"], in_days(30)).key_pem;
        assert!(matches!(
            parse_stored("a", mismatched, now()),
            Err(CertError::KeyMismatch(_))
        ));
    }
}
