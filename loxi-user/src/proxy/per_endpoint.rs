//! Pooled upstream clients that each reach one endpoint while the request's URI names the
//! client's host: requests that may go out over HTTP/2 carry the host as `:authority` (RFC 9113
//! §8.3.1), which hyper-util's client takes from the URI, and that client pools per URI
//! authority, so [`PerEndpoint`] keeps a client per (endpoint, host), bounded. Used by the
//! cleartext HTTP/2 path (`upstream.rs`) and by backend TLS (`upstream_tls.rs`).

use std::collections::HashMap;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{Request, Uri, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;

/// A connector that reaches one endpoint whatever host the URI names (the request's URI
/// carries the client's host, see [`host_as_authority`]).
#[derive(Clone, Debug)]
pub struct ToEndpoint<C> {
    inner: C,
    endpoint: Uri,
}

impl<C: tower_service::Service<Uri>> tower_service::Service<Uri> for ToEndpoint<C> {
    type Response = C::Response;
    type Error = C::Error;
    type Future = C::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), C::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, _host: Uri) -> C::Future {
        self.inner.call(self.endpoint.clone())
    }
}

/// Pooled clients per endpoint, each connecting with `C` to its endpoint alone: a request's
/// URI names the client's host (its HTTP/2 `:authority`), so the URI cannot choose the
/// connection, and hyper-util's pool keeps connections apart per URI authority. So each
/// (endpoint, host) pair gets its own client, built at its first request, and the pairs are
/// bounded: at most [`HOSTS_PER_ENDPOINT`] hosts an endpoint and [`MAX_ENDPOINTS`] endpoints,
/// the least recently used dropped beyond either (its idle connections close with it; requests
/// in flight on it finish). A client cycling `Host` values costs connection setups, never
/// connections without bound.
pub struct PerEndpoint<C> {
    connector: C,
    builder: hyper_util::client::legacy::Builder,
    scheme: Scheme,
    clients: parking_lot::Mutex<Pairs<C>>,
}

/// Distinct hosts kept pooled for one endpoint of a [`PerEndpoint`].
pub const HOSTS_PER_ENDPOINT: usize = 16;

/// Endpoints kept pooled by one [`PerEndpoint`].
pub const MAX_ENDPOINTS: usize = 4096;

/// The pooled client of one (endpoint, host) pair in a [`PerEndpoint`].
type EndpointClient<C> = Client<ToEndpoint<C>, Full<Bytes>>;

/// The (endpoint, host) clients of a [`PerEndpoint`] and their last use (a counter).
struct Pairs<C> {
    endpoints: HashMap<Authority, EndpointHosts<C>>,
    clock: u64,
}

/// One endpoint's clients, per host, with the last use of each and of the endpoint.
struct EndpointHosts<C> {
    hosts: Vec<(Authority, EndpointClient<C>, u64)>,
    last: u64,
}

impl<C> std::fmt::Debug for PerEndpoint<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pairs = self.clients.lock();
        f.debug_struct("PerEndpoint")
            .field("endpoints", &pairs.endpoints.len())
            .field(
                "pairs",
                &pairs
                    .endpoints
                    .values()
                    .map(|e| e.hosts.len())
                    .sum::<usize>(),
            )
            .finish()
    }
}

impl<C> PerEndpoint<C>
where
    C: tower_service::Service<Uri> + Clone + Send + Sync + 'static,
    C::Response: hyper::rt::Read
        + hyper::rt::Write
        + hyper_util::client::legacy::connect::Connection
        + Unpin
        + Send
        + 'static,
    C::Future: Unpin + Send + 'static,
    C::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// Clients built by `builder` on `connector`, whose connections are cleartext (`scheme`
    /// `http`) or TLS (`https`): the scheme requests are sent with.
    pub fn new(connector: C, builder: hyper_util::client::legacy::Builder, scheme: Scheme) -> Self {
        Self {
            connector,
            builder,
            scheme,
            clients: parking_lot::Mutex::new(Pairs {
                endpoints: HashMap::new(),
                clock: 0,
            }),
        }
    }

    /// Sends `req`, whose URI names the endpoint, to that endpoint with the client's host
    /// (its `Host`) as the URI's authority ([`host_as_authority`]).
    pub async fn request(
        &self,
        mut req: Request<Full<Bytes>>,
    ) -> Result<http::Response<Incoming>, hyper_util::client::legacy::Error> {
        let client = host_as_authority(&mut req, &self.scheme).and_then(|endpoint| {
            let host = req.uri().authority()?.clone();
            Some(self.client(endpoint, host))
        });
        match client {
            Some(c) => c.request(req).await,
            // No endpoint in the URI: the client refuses it (absolute URI required).
            None => {
                self.builder
                    .build(self.connector.clone())
                    .request(req)
                    .await
            }
        }
    }

    /// The client of `host` on `endpoint`, built (evicting the least recently used beyond the
    /// bounds) when not pooled.
    fn client(&self, endpoint: Authority, host: Authority) -> EndpointClient<C> {
        let mut pairs = self.clients.lock();
        pairs.clock += 1;
        let now = pairs.clock;
        if !pairs.endpoints.contains_key(&endpoint) && pairs.endpoints.len() >= MAX_ENDPOINTS {
            let oldest = pairs
                .endpoints
                .iter()
                .min_by_key(|(_, e)| e.last)
                .map(|(a, _)| a.clone());
            if let Some(a) = oldest {
                pairs.endpoints.remove(&a);
            }
        }
        let entry = pairs
            .endpoints
            .entry(endpoint.clone())
            .or_insert_with(|| EndpointHosts {
                hosts: Vec::new(),
                last: now,
            });
        entry.last = now;
        if let Some((_, c, last)) = entry.hosts.iter_mut().find(|(h, _, _)| *h == host) {
            *last = now;
            return c.clone();
        }
        if entry.hosts.len() >= HOSTS_PER_ENDPOINT
            && let Some(i) = (0..entry.hosts.len()).min_by_key(|&i| entry.hosts[i].2)
        {
            entry.hosts.swap_remove(i);
        }
        let uri = Uri::builder()
            .scheme("http")
            .authority(endpoint)
            .path_and_query("/")
            .build()
            .unwrap_or_default();
        let c = self.builder.build(ToEndpoint {
            inner: self.connector.clone(),
            endpoint: uri,
        });
        entry.hosts.push((host, c.clone(), now));
        c
    }
}

/// Moves `req`'s `Host` into its URI: the URI's authority (the endpoint, as
/// [`super::upstream::upstream_request`] built it) becomes the `Host` value, so HTTP/2 sends it
/// as `:authority` with no `Host` header, and HTTP/1.1 sends it as `Host` (hyper-util's client
/// sets it from the URI). A request without `Host` (HTTP/1.0 without one), or whose `Host` is
/// no URI authority, keeps the endpoint's address, as over HTTP/1.1
/// ([`super::upstream::origin_request`]). The URI's scheme becomes `scheme` (`https` on a TLS
/// connection: HTTP/2's `:scheme`, RFC 9113 §8.3.1). Returns the endpoint; `None` when the URI
/// names none.
pub fn host_as_authority(req: &mut Request<Full<Bytes>>, scheme: &Scheme) -> Option<Authority> {
    let endpoint = req.uri().authority()?.clone();
    let host = req
        .headers_mut()
        .remove(header::HOST)
        .and_then(|h| Authority::try_from(h.as_bytes()).ok());
    if host.is_some() || req.uri().scheme() != Some(scheme) {
        let mut parts = req.uri().clone().into_parts();
        if let Some(host) = host {
            parts.authority = Some(host);
        }
        parts.scheme = Some(scheme.clone());
        if let Ok(uri) = Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
    }
    Some(endpoint)
}
