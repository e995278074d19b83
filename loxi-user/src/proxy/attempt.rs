//! The outcome of one upstream attempt, shared by both upstream clients (`upstream.rs`'s pooled
//! hyper-util client and `upstream_h1.rs`'s driven HTTP/1.1 connections) and by the proxy's
//! error mapping.

use hyper::Response;
use hyper::body::Incoming;

/// A failure after the request may have reached the backend (hyper's or hyper-util's error).
pub type UpstreamError = Box<dyn std::error::Error + Send + Sync>;

/// A backend answered `101 Switching Protocols` although the request asked for no upgrade
/// (loxi strips `Upgrade` as hop-by-hop, so none of its upstream requests does): a head the
/// client cannot be given (its connection would be switched to a protocol nobody speaks), so
/// the attempt failed ([`Attempt::answered`]).
#[derive(Debug, thiserror::Error)]
#[error("answered 101 Switching Protocols to a request that asked for no protocol upgrade")]
pub struct UnsolicitedUpgrade;

/// A request over cleartext HTTP/2 with prior knowledge (`backend_protocol: http2`) that failed
/// before its answer, not by the peer's own HTTP/2 GOAWAY or stream reset: the text says what
/// an HTTP/1.1-only backend behind that setting looks like, since hyper-util's own error names
/// neither (`client error (SendRequest)`, then the h2 frame error the backend's HTTP/1.1 answer
/// read as, or the broken pipe of its close). The cause is its source.
#[derive(Debug, thiserror::Error)]
#[error(
    "HTTP/2 with prior knowledge failed (backend_protocol http2; a backend that speaks only \
     HTTP/1.1 fails this way: use http1 for it)"
)]
pub struct H2cFailed(#[source] pub hyper_util::client::legacy::Error);

/// The outcome of one upstream attempt; `B` is the response body type.
#[derive(Debug)]
pub enum Attempt<B = Incoming> {
    /// The backend answered (head received; body streams).
    Response(Response<B>),
    /// The connection could not be established; the request was not sent. Retry elsewhere.
    /// The text is the whole error chain (a TLS verification failure names its reason).
    ConnectFailed(String),
    /// The request failed after it may have reached the backend. Not retried.
    Failed(UpstreamError),
    /// The gateway could not open the connection for lack of its own resources; the request
    /// was not sent. Not the endpoint's failure: not fed to the breaker, not retried on
    /// another endpoint (that would need the same resource).
    NoLocalResources(LocalShortage),
}

/// A connection the gateway could not open because it ran out of one of its own resources:
/// file descriptors (`EMFILE` for the process, `ENFILE` for the system), local ports or
/// addresses (`EADDRNOTAVAIL`), kernel memory (`ENOBUFS`, `ENOMEM`). Answered 503
/// `gateway_resources_exhausted` (`Retry-After: 1`) and counted in
/// `loxilb_proxy_local_resource_errors_total{errno}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{errno} ({message})")]
pub struct LocalShortage {
    /// The error's name: `EMFILE`, `ENFILE`, `EADDRNOTAVAIL`, `ENOBUFS` or `ENOMEM`.
    pub errno: &'static str,
    /// The whole error as the OS and the client library reported it.
    pub message: String,
}

impl LocalShortage {
    /// `Some` when `e`, or an error under it, is an OS error of the gateway's own resources
    /// (see the type's doc); `None` for anything else (a refused or timed-out connection is
    /// the endpoint's).
    pub fn of(e: &(dyn std::error::Error + 'static)) -> Option<Self> {
        let errno = sources(e).find_map(|err| {
            let io = err.downcast_ref::<std::io::Error>()?;
            local_errno(io.raw_os_error()?)
        })?;
        Some(Self {
            errno,
            message: error_chain(e),
        })
    }
}

/// The name of an errno that means the gateway, not the peer, lacks a resource.
fn local_errno(code: i32) -> Option<&'static str> {
    Some(match code {
        libc::EMFILE => "EMFILE",
        libc::ENFILE => "ENFILE",
        libc::EADDRNOTAVAIL => "EADDRNOTAVAIL",
        libc::ENOBUFS => "ENOBUFS",
        libc::ENOMEM => "ENOMEM",
        _ => return None,
    })
}

impl<B> Attempt<B> {
    /// The outcome of a response head: [`Attempt::Response`], or for an unsolicited
    /// `101 Switching Protocols` [`Attempt::Failed`] with [`UnsolicitedUpgrade`] (a failure of
    /// the backend after the request reached it: 502, fed to the breaker, not retried).
    pub fn answered(resp: Response<B>) -> Self {
        if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS {
            return Self::Failed(Box::new(UnsolicitedUpgrade));
        }
        Self::Response(resp)
    }

    /// The same outcome with the response body mapped by `f`.
    pub fn map_body<C>(self, f: impl FnOnce(B) -> C) -> Attempt<C> {
        match self {
            Self::Response(r) => Attempt::Response(r.map(f)),
            Self::ConnectFailed(e) => Attempt::ConnectFailed(e),
            Self::Failed(e) => Attempt::Failed(e),
            Self::NoLocalResources(s) => Attempt::NoLocalResources(s),
        }
    }

    /// The backend's status, when it answered.
    pub fn status(&self) -> Option<http::StatusCode> {
        match self {
            Self::Response(r) => Some(r.status()),
            _ => None,
        }
    }

    /// `connect`, `request` or `local_resources` when the attempt failed (the trace's
    /// `error.type`).
    pub fn error_type(&self) -> Option<&'static str> {
        match self {
            Self::Response(_) => None,
            Self::ConnectFailed(_) => Some("connect"),
            Self::Failed(_) => Some("request"),
            Self::NoLocalResources(_) => Some("local_resources"),
        }
    }
}

/// The text of `e` and every error under it, joined by `: ` (hyper-util's client errors say
/// only "client error (Connect)"; the reason, e.g. a certificate for another name, is below).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let texts: Vec<String> = sources(e).map(in_words).collect();
    texts.join(": ")
}

/// One error of a chain as text: a TLS verification failure (rustls' error, or the I/O error
/// tokio-rustls wraps it in) in words ([`crate::certs::parse::rustls_reason`]: an unknown issuer
/// names the CA setting, a wrong name lists the certificate's names), anything else as itself.
fn in_words(e: &(dyn std::error::Error + 'static)) -> String {
    let tls = e.downcast_ref::<rustls::Error>().or_else(|| {
        e.downcast_ref::<std::io::Error>()?
            .get_ref()?
            .downcast_ref::<rustls::Error>()
    });
    match tls {
        Some(t) => crate::certs::parse::rustls_reason(t, "the rule's backend_ca_file"),
        None => e.to_string(),
    }
}

/// `e` and every error under it, outermost first.
pub fn sources<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |err| err.source())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(status: u16) -> Response<()> {
        let mut r = Response::new(());
        *r.status_mut() = http::StatusCode::from_u16(status).expect("status");
        r
    }

    #[test]
    fn an_unsolicited_101_fails_the_attempt_and_other_heads_are_responses() {
        let Attempt::Failed(e) = Attempt::answered(head(101)) else {
            panic!("a 101 is no response to forward");
        };
        assert_eq!(
            e.to_string(),
            "answered 101 Switching Protocols to a request that asked for no protocol upgrade"
        );
        for status in [100, 200, 204, 304, 404, 500] {
            let a = Attempt::answered(head(status));
            assert_eq!(a.status().map(|s| s.as_u16()), Some(status), "{status}");
        }
    }

    /// An error with `inner` as its source, as client libraries wrap an OS error.
    #[derive(Debug, thiserror::Error)]
    #[error("client error (Connect)")]
    struct Wrapped(#[source] std::io::Error);

    #[test]
    fn the_gateways_own_shortages_are_told_from_the_backends_failures() {
        for (code, name) in [
            (libc::EMFILE, "EMFILE"),
            (libc::ENFILE, "ENFILE"),
            (libc::EADDRNOTAVAIL, "EADDRNOTAVAIL"),
            (libc::ENOBUFS, "ENOBUFS"),
            (libc::ENOMEM, "ENOMEM"),
        ] {
            let e = Wrapped(std::io::Error::from_raw_os_error(code));
            let s = LocalShortage::of(&e).expect(name);
            assert_eq!(s.errno, name);
            assert!(s.message.starts_with("client error (Connect): "), "{s}");
        }
        for code in [
            libc::ECONNREFUSED,
            libc::ETIMEDOUT,
            libc::EHOSTUNREACH,
            libc::ENETUNREACH,
            libc::ECONNRESET,
        ] {
            let e = Wrapped(std::io::Error::from_raw_os_error(code));
            assert_eq!(LocalShortage::of(&e), None, "{code}");
        }
        assert_eq!(
            LocalShortage::of(&std::io::Error::other("tls: certificate for another name")),
            None
        );
    }
}
