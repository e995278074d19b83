//! The REST API (axum), LoxiLB-compatible, under `/netlox/v1`.
//!
//! | Method | Path | Answer |
//! |---|---|---|
//! | `POST` | `/config/loadbalancer` | 200 `{"result":"Success"}`; 400 naming the field; 409 same key other shape; 500 state file not written |
//! | `GET` | `/config/loadbalancer/all` | 200 `{"lbAttr":[LoadbalanceEntry...]}` in LoxiLB's shape ([`rules::loxilb_entry`]) |
//! | `GET` | `/config/loadbalancer/id/{id}` | 200 one `LoadbalanceEntry`; 404 |
//! | `GET` | `/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}[?host=..&model_name=..]` | 200 one `LoadbalanceEntry`; 404; 409 when several rules (model pools, hosts) share the address and no `host`/`model_name` selects one ([`status`]) |
//! | `GET` | `.../protocol/{proto}/status[?host=..&model_name=..]` | 200 `{"adminStateUp":true,"operatingStatus":"ONLINE\|DEGRADED\|OFFLINE\|NO_MONITOR","lastUpdated":RFC3339}`; 404; 409 as above |
//! | `GET` | `.../protocol/{proto}/stats` | 200 `{"activeConnections","bytesIn","bytesOut","totalConnections"}` (zeros omitted): a mode-4 address's client connections and bytes, an L4 rule's flows and bytes from the conntrack map (no `totalConnections`); 404 |
//! | `DELETE` | `/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}[?host=..&model_name=..]` | 200 `{"result":"Success"}`; 404 no rule with exactly this key (absent host/model = none, never "any") |
//! | `DELETE` | `/config/loadbalancer/hosturl/{host\|any}/externalipaddress/{ip}/port/{port}[/portmax/{0}]/protocol/{proto}[?model_name=..]` | the same (LoxiLB's loxicmd) |
//! | `DELETE` | `/config/loadbalancer/externalipaddress/{ip}/port/{port}/portmax/{0}/protocol/{proto}` | the same |
//! | `DELETE` | `/config/loadbalancer/name/{name}` | 200; 404 no rule with this name |
//! | `POST`, `GET` | `/config/cert[/all]` | LoxiLB's cert API, see [`certs`] |
//! | `GET`, `PUT`, `DELETE` | `/config/cert/{certId}` | one certificate: read, rotate, delete ([`certs`]) |
//! | `DELETE` | `/config/cert/all` | the certificate with id `all` an older version accepted (the id is reserved now) |
//! | `GET` | `/version` | 200 `{"version","buildInfo","product"}` (no token needed) |
//! | `GET` | `/config/endpoint/all` | 200 `{"Attr":[...]}` endpoint health |
//! | `GET` | `/config/conntrack/all` | 200 `{"ctAttr":[...]}`: the live XDP conntrack map in LoxiLB's shape and order (≤ 65,536 entries, `"truncated": true` beyond); `[]` without the L4 data path or before it is loaded |
//! | `GET` | `/config/ai/kv/inventory?service_id=N[&ep_idx=M]` | 200 the KV tier's block inventory (LoxiLB's shape with `ep_idx`); 400 bad query field; 404 ([`kv`]) |
//! | `GET` | `/config/ai/kv/parity?service_id=N` | 200 every endpoint's readiness and hash-contract parity; 400; 404 ([`kv`]) |
//! | `GET` | `/config/metrics` | 200 `{"prometheus":true}` |
//! | `GET` | `/metrics` | 200 Prometheus text 0.0.4, or OpenMetrics when `Accept` asks |
//!
//! Bodies are built in [`error`] (LoxiLB's success and error shapes); LoxiLB's field schema and
//! strict field checking are in [`fields`]; the Origin, token and content-type guard in
//! [`security`]; HTTPS in [`tls`]; connection bounds (header and request timeouts, a connection
//! cap) in [`serve`]. Request bodies are limited to axum's default 2 MiB (413 beyond; at once,
//! before any byte of it is read, when `Content-Length` declares more). A method a route does
//! not serve gets 405 in the error shape. A query parameter a route does not read is 400 naming
//! it on every route ([`query::NoQuery`] for the routes that read none).
pub mod certs;
pub mod error;
pub mod fields;
pub mod kv;
pub mod loxilb;
pub mod query;
pub mod rules;
pub mod security;
pub mod serve;
pub mod status;
pub mod tls;

use std::sync::Arc;

use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use prometheus_client::registry::Registry;

use crate::metrics::{self, ControlMetrics};
use crate::rules::RuleStore;

pub use crate::health::board::{AllActive, EndpointHealth, HealthBoard};
pub use error::ApiError;

/// Base path of every route.
pub const BASE: &str = "/netlox/v1";

/// Shared state of the API handlers.
#[derive(Clone)]
pub struct ApiState {
    /// The rule store.
    pub store: Arc<RuleStore>,
    /// The process registry, complete (every module registered) before the API starts.
    pub registry: Arc<Registry>,
    /// The control plane's metric families.
    pub metrics: ControlMetrics,
    /// Live endpoint health.
    pub health: Arc<dyn EndpointHealth>,
    /// The fullproxy's listening sockets: a mode-4 rule is stored only once its address is
    /// bound; `GET .../all` reports each rule's `listenerState` from here.
    pub sockets: Arc<crate::listen::ListenSockets>,
    /// True when the daemon runs the L4 (XDP) data path (`--xdp-iface`); without it rules with
    /// `mode` other than 4 are refused (400), since nothing would forward them.
    pub l4_datapath: bool,
    /// The loaded XDP conntrack map (published by the L4 task), listed by
    /// `GET /config/conntrack/all`.
    pub conntrack: crate::l4::ConntrackHandle,
    /// The fullproxy's TLS certificates (the cert API; `security: 1` rules need one).
    pub certs: Arc<crate::certs::CertStore>,
}

/// The API router with every route, `views` (routes with their own state, e.g. the KV views of
/// [`kv::router`]) merged in, the content-type check on the routes
/// ([`security::require_json`]: a method no route serves is 405 before it), LoxiLB's JSON
/// 404 and 405, and the request-counting middleware.
pub fn router(state: ApiState, views: Router) -> Router {
    let metrics = state.metrics.clone();
    Router::new()
        .route(&format!("{BASE}/config/loadbalancer"), post(rules::create))
        .route(&format!("{BASE}/config/loadbalancer/all"), get(rules::list))
        .route(
            &format!("{BASE}/config/loadbalancer/id/{{id}}"),
            get(rules::get_by_id),
        )
        .route(
            &format!("{BASE}/config/loadbalancer/externalipaddress/{{ip}}/port/{{port}}/protocol/{{proto}}"),
            delete(rules::remove).get(status::get_by_key),
        )
        .route(
            &format!("{BASE}/config/loadbalancer/externalipaddress/{{ip}}/port/{{port}}/protocol/{{proto}}/status"),
            get(status::status),
        )
        .route(
            &format!("{BASE}/config/loadbalancer/externalipaddress/{{ip}}/port/{{port}}/protocol/{{proto}}/stats"),
            get(status::stats),
        )
        .route(
            &format!("{BASE}/config/loadbalancer/externalipaddress/{{ip}}/port/{{port}}/portmax/{{portmax}}/protocol/{{proto}}"),
            delete(rules::remove_portmax),
        )
        .route(
            &format!("{BASE}/config/loadbalancer/hosturl/{{hosturl}}/externalipaddress/{{ip}}/port/{{port}}/protocol/{{proto}}"),
            delete(rules::remove_hosturl),
        )
        .route(
            &format!("{BASE}/config/loadbalancer/hosturl/{{hosturl}}/externalipaddress/{{ip}}/port/{{port}}/portmax/{{portmax}}/protocol/{{proto}}"),
            delete(rules::remove_hosturl_portmax),
        )
        .route(
            &format!("{BASE}/config/loadbalancer/name/{{name}}"),
            delete(rules::remove_by_name),
        )
        .route(
            &format!("{BASE}/config/cert"),
            post(certs::create).get(certs::list),
        )
        .route(
            &format!("{BASE}/config/cert/all"),
            get(certs::list).delete(certs::remove_all_id),
        )
        .route(
            &format!("{BASE}/config/cert/{{id}}"),
            get(certs::get_one).put(certs::replace).delete(certs::remove),
        )
        .route(&format!("{BASE}/version"), get(loxilb::version))
        .route(&format!("{BASE}/config/endpoint/all"), get(loxilb::endpoints))
        .route(&format!("{BASE}/config/conntrack/all"), get(loxilb::conntrack))
        .route(&format!("{BASE}/config/metrics"), get(loxilb::metrics_config))
        .route(&format!("{BASE}/metrics"), get(serve_metrics))
        .with_state(state)
        .merge(views)
        // Before the 405 fallback: axum layers a route's default fallback with its routes,
        // and `method_not_allowed_fallback` replaces only a default one.
        .route_layer(middleware::from_fn(refuse_declared_oversize))
        .route_layer(middleware::from_fn(security::require_json))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(metrics, count_requests))
}

/// `GET /metrics`: OpenMetrics when the client's `Accept` asks for it, else text 0.0.4.
async fn serve_metrics(
    State(st): State<ApiState>,
    _: query::NoQuery,
    headers: HeaderMap,
) -> Response {
    refresh_endpoint_metrics(&st);
    let wants_om = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    let (encoded, content_type) = if wants_om {
        (
            metrics::encode(&st.registry),
            metrics::OPENMETRICS_CONTENT_TYPE,
        )
    } else {
        (
            metrics::encode_text(&st.registry),
            metrics::TEXT_CONTENT_TYPE,
        )
    };
    match encoded {
        Ok(text) => ([(header::CONTENT_TYPE, content_type)], text).into_response(),
        Err(e) => ApiError::internal(format!("encoding metrics failed: {e}")).into_response(),
    }
}

/// `loxilb_pd_ep_info` and the healthy/unhealthy endpoint gauges, from the rules and the
/// live health board at scrape time.
fn refresh_endpoint_metrics(st: &ApiState) {
    let snap = st.store.snapshot();
    let health = st.health.as_ref();
    st.metrics.set_endpoints(snap.rules.values().flat_map(|r| {
        r.rule.endpoints.iter().enumerate().map(move |(i, ep)| {
            (
                r.id,
                i,
                ep.endpoint_ip.as_str(),
                ep.target_port,
                health.healthy(r, i).unwrap_or(true),
            )
        })
    }));
}

/// 413 at once for a request whose `Content-Length` declares more than the API's body limit
/// ([`rules::API_BODY_LIMIT`]): the body would be refused when read, and waiting for a client
/// that declares a terabyte and sends nothing would end in the 408 of the request timeout.
/// The connection is closed after the answer; until then the body is read and discarded for
/// at most [`OVERSIZE_DRAIN_TIME`] ([`crate::proxy::body::discard_for`]), so that a client
/// still writing it reads the 413 instead of a reset.
async fn refuse_declared_oversize(req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > rules::API_BODY_LIMIT as u64) {
        crate::proxy::body::discard_for(req.into_body(), OVERSIZE_DRAIN_TIME);
        let mut resp = error::body_too_large().into_response();
        resp.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        return resp;
    }
    next.run(req).await
}

/// How long an oversized body is drained after its 413 at most.
const OVERSIZE_DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// 405 in LoxiLB's error shape (axum's own answer has an empty body).
async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::with_status(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "method {} is not allowed on {}",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
}

async fn count_requests(State(m): State<ControlMetrics>, req: Request, next: Next) -> Response {
    let method = req.method().to_string();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let resp = next.run(req).await;
    m.api_request(&method, &route, resp.status().as_u16());
    resp
}
