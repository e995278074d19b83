//! TLS termination of the fullproxy (`security: 1`): one rustls server configuration per
//! listener, the certificate chosen per handshake by SNI from the cert store.
//!
//! A handshake whose SNI name equals the `host` of one of the listener's rules gets the
//! certificate covering that name ([`CertSnapshot::for_name`]); no SNI, an IP, or another name
//! gets the `default` certificate; with neither rustls refuses the handshake (alert). ALPN
//! offers `h2` and `http/1.1`; TLS 1.3 and 1.2 (rustls' safe cipher suites, `ring`). The
//! certificate is looked up per handshake, so a rotation reaches the next handshake while an
//! established connection keeps its session.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use super::pool::PoolTable;
use crate::certs::{CertSnapshot, CertStore, Certificate};

/// Longest a client may take to complete the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Marks a request that arrived over TLS (a request extension; `X-Forwarded-Proto: https`),
/// with the rule host its connection's SNI named, if any (the name whose certificate the
/// handshake got, see [`SniResolver::pick`]), and that certificate.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// The SNI name, when it equals the `host` of one of the listener's rules.
    pub sni_host: Option<Arc<str>>,
    /// The certificate the connection was given, when `sni_host` is set and the handshake was
    /// a full one: what the 421 check reads ([`Self::misdirected`]), so a rotation or a new
    /// certificate in the store changes nothing for a connection already open (it keeps the
    /// certificate its client verified).
    pub cert: Option<Arc<Certificate>>,
}

impl ClientTls {
    /// Of a handshake whose SNI was `sni`, on a listener serving `table`, with the
    /// certificates `certs` (the store's snapshot right after the handshake; the certificate
    /// is picked as [`SniResolver::pick`] picked it during the handshake, which differs only
    /// when a certificate change lands during its last round trip). A `resumed` handshake
    /// (TLS session resumption) sent no certificate: the one its client verified, at the
    /// session's first handshake, may no longer be the store's, so none is known and every
    /// request for another host on it is 421 (the client retries on a connection of its own).
    pub fn of(sni: Option<&str>, table: &PoolTable, certs: &CertSnapshot, resumed: bool) -> Self {
        let sni_host: Option<Arc<str>> = sni.filter(|n| table.has_host(n)).map(Arc::from);
        let cert = sni_host
            .as_deref()
            .filter(|_| !resumed)
            .and_then(|n| certs.for_name(n).or_else(|| certs.default_cert()))
            .cloned();
        Self { sni_host, cert }
    }

    /// Whether a request routed to a rule with `host` came on a connection made for another
    /// rule's host whose certificate (the one this connection got, [`Self::cert`]) does not
    /// cover `host` (RFC 9110 §15.5.20: 421, the client retries on a connection of its own).
    /// A connection with no rule host in its SNI (no SNI, an IP, another name: the `default`
    /// certificate) and a host-less rule never are; nor is a connection whose certificate
    /// also covers `host` (HTTP/2 connection reuse, RFC 9113 §9.1.1).
    pub fn misdirected(&self, host: &str) -> bool {
        let Some(sni) = self.sni_host.as_deref() else {
            return false;
        };
        if host.is_empty() || super::pool::same_host(host, sni) {
            return false;
        }
        !self.cert.as_ref().is_some_and(|c| c.covers(host))
    }

    /// [`Self::misdirected`] as the request's answer: `Err` 421 `misdirected_request` naming
    /// the connection's SNI and the rule's host.
    pub fn check_host(&self, host: &str) -> Result<(), super::error::ProxyError> {
        if !self.misdirected(host) {
            return Ok(());
        }
        Err(super::error::ProxyError::Misdirected {
            sni: self.sni_host.as_deref().unwrap_or_default().to_string(),
            host: host.to_string(),
        })
    }
}

/// Picks a listener's certificate per handshake.
pub struct SniResolver {
    certs: Arc<CertStore>,
    table: Arc<ArcSwap<PoolTable>>,
}

impl std::fmt::Debug for SniResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SniResolver")
    }
}

impl SniResolver {
    /// The certificate for SNI `name` on a listener serving `table` (see the module doc).
    pub fn pick(
        snap: &CertSnapshot,
        table: &PoolTable,
        name: Option<&str>,
    ) -> Option<Arc<CertifiedKey>> {
        let by_host = name.filter(|n| table.has_host(n));
        by_host
            .and_then(|n| snap.for_name(n))
            .or_else(|| snap.default_cert())
            .map(|c| c.key.clone())
    }
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let name = hello.server_name();
        let picked = Self::pick(&self.certs.snapshot(), &self.table.load(), name);
        if picked.is_none() {
            tracing::debug!(sni = ?name, "TLS handshake refused: no certificate for this name and no default");
        }
        picked
    }
}

/// The debug data of the GOAWAY answering an HTTP/2 prior-knowledge client on a TLS port.
pub const H2_ON_TLS_DEBUG: &str = "plain_http_on_tls_port: plain HTTP/2 (h2c) was sent to a port that terminates TLS \
     (security 1): use https://";

/// Answers an HTTP/2 prior-knowledge (h2c) client on a TLS listener with the server's
/// connection preface and a GOAWAY (`PROTOCOL_ERROR`) whose debug data is [`H2_ON_TLS_DEBUG`]
/// ([`crate::listen::plain::h2_goaway`]) and closes (a lingering close, as
/// [`refuse_plain_http`]). Runs within the handshake timeout and counts as a failed handshake.
pub async fn refuse_plain_h2(stream: tokio::net::TcpStream) {
    crate::listen::plain::answer_goaway_and_close(stream, H2_ON_TLS_DEBUG).await;
}

/// Answers a plain-HTTP client on a TLS listener with 400 `plain_http_on_tls_port` (the
/// fullproxy's JSON error shape, `Connection: close`) and closes; the request is drained, not
/// read. Runs within the handshake timeout and counts as a failed handshake.
pub async fn refuse_plain_http(stream: tokio::net::TcpStream) {
    let body = serde_json::json!({"error": {
        "type": "plain_http_on_tls_port",
        "message": "this port terminates TLS (security 1): use https://",
        "code": 400,
        "party": "client",
        "retryable": false,
    }})
    .to_string();
    crate::listen::plain::answer_400_and_close(stream, "application/json", &body).await;
}

/// The server configuration of a listener serving `table`, certificates from `certs`.
pub fn server_config(
    certs: Arc<CertStore>,
    table: Arc<ArcSwap<PoolTable>>,
) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(SniResolver { certs, table }));
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}
