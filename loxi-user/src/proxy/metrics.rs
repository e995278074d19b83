//! Fullproxy metrics (prometheus-client, registered into the registry the app passes).
//!
//! | name | type | labels |
//! |---|---|---|
//! | `loxilb_proxy_requests_total` | counter | `service` (`0` before a rule is known), `ep_idx` (the endpoint that answered or failed; `none` for the gateway's own refusals and for requests whose client left before the answer's head, counted as `4xx`, nginx's 499), `class` (`2xx`…`5xx`) |
//! | `loxilb_proxy_selections_total` | counter | `selector` (`rr`, `chwbl`, `kv`…), `reason` ([`crate::routing::Reason::as_str`]) |
//! | `loxilb_proxy_upstream_connect_failures_total` | counter | `service`, `ep_idx` |
//! | `loxilb_proxy_active_connections` | gauge | `service`, `ep_idx` (requests in flight) |
//! | `loxilb_proxy_request_duration_seconds` | histogram | `service` (until the response body ends) |
//! | `loxilb_proxy_upstream_stream_errors_total` | counter | `service`, `ep_idx` (backend body failed mid-stream) |
//! | `loxilb_proxy_upstream_timeouts_total` | counter | `service`, `ep_idx` (no response head within `LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS`; 504) |
//! | `loxilb_proxy_upstream_retries_total` | counter | `service`, `ep_idx` (an idempotent request, e.g. `GET /v1/models`, the endpoint dropped after it was sent, without a response head; sent again to another endpoint, as nginx's `proxy_next_upstream error`) |
//! | `loxilb_proxy_open_connections` | gauge | `listener` (`ip:port`) |
//! | `loxilb_proxy_worker_connections` | gauge | `worker` (`1`..=`--proxy-workers`; open client connections each connection worker serves, [`super::workers`]) |
//! | `loxilb_proxy_connections_closed_total` | counter | `listener`, `reason` (`header_timeout`, `idle_timeout`, `send_timeout`, `head_too_large`: a request head over 64 KiB, answered 431 (HTTP/1) and closed; `malformed_request`: hyper answered a malformed HTTP/1 head 400/414/431 and closed) |
//! | `loxilb_proxy_connections_drained_total` | counter | `listener`, `reason` (`stream_stall`: an HTTP/2 stream waited `LOXI_SEND_TIMEOUT_MS` for its client while other streams progressed; the connection got a GOAWAY, its open streams finish) |
//! | `loxilb_proxy_connections_queued_total` | counter | `listener` (accepted only after waiting for a slot under `LOXI_MAX_CONNS_PER_LISTENER`) |
//! | `loxilb_proxy_local_resource_errors_total` | counter | `errno` (`EMFILE`, `ENFILE`, `EADDRNOTAVAIL`, `ENOBUFS`, `ENOMEM`: upstream connections the gateway could not open for lack of its own descriptors, ports or buffers; 503 `gateway_resources_exhausted`, no endpoint blamed) |
//! | `loxilb_proxy_tls_handshake_failures_total` | counter | `listener` (TLS handshakes that failed or timed out: no certificate for the name, a client that does not speak TLS, ...) |
//! | `loxilb_pd_admission_shed_total` | counter | `reason`: `total_inflight` (429, `LLB_PD_MAX_TOTAL_INFLIGHT`), `ep_queue_full` (429, the endpoint's gate and park queue full), `park_timeout` (504, parked past `LLB_PD_MAX_PARK_SEC`), `closed` (503, the gate closed while parked) |
//! | `loxilb_pd_admission_queued_total` | counter | `service` (requests parked at an endpoint's admission gate) |
//! | `loxilb_pd_admission_parked` | gauge | `service` (requests parked now) |
//!
//! LoxiLB's `loxilb_ai_*` request families are in [`super::ai_metrics`].

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// `service`, `ep_idx`, `class`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Service id.
    pub service: String,
    /// Endpoint index or `none`.
    pub ep_idx: String,
    /// Status class, e.g. `2xx`.
    pub class: String,
}

/// `selector`, `reason`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SelectionLabels {
    /// Selector name (or `kv` for tier 1.5).
    pub selector: String,
    /// Reason label.
    pub reason: String,
}

/// `service`, `ep_idx`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    /// Service id.
    pub service: String,
    /// Endpoint index.
    pub ep_idx: String,
}

/// `service`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    /// Service id.
    pub service: String,
}

/// `listener`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    /// The listener's `ip:port`.
    pub listener: String,
}

/// `listener`, `reason`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnCloseLabels {
    /// The listener's `ip:port`.
    pub listener: String,
    /// [`super::conn::Expiry::as_str`].
    pub reason: String,
}

/// `errno`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrnoLabels {
    /// The OS error's name, e.g. `EMFILE` ([`super::attempt::LocalShortage::errno`]).
    pub errno: String,
}

/// `reason`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShedLabels {
    /// Why the request was refused (`total_inflight`, `ep_queue_full`, `park_timeout`,
    /// `closed`).
    pub reason: String,
}

type HistogramFamily = Family<ServiceLabels, Histogram, fn() -> Histogram>;

/// The proxy's metric handles. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ProxyMetrics {
    /// Requests by service, endpoint and status class.
    pub requests: Family<RequestLabels, Counter>,
    /// Selection decisions by selector and reason.
    pub selections: Family<SelectionLabels, Counter>,
    /// Failed upstream connects by service and endpoint.
    pub connect_failures: Family<EndpointLabels, Counter>,
    /// Requests in flight per endpoint.
    pub active: Family<EndpointLabels, Gauge>,
    /// Request duration in seconds, head to end of response body.
    pub duration: HistogramFamily,
    /// Responses whose backend body failed mid-stream, by service and endpoint.
    pub stream_errors: Family<EndpointLabels, Counter>,
    /// Requests whose backend sent no response head within the response timeout.
    pub upstream_timeouts: Family<EndpointLabels, Counter>,
    /// Idempotent requests an endpoint dropped without a response head, sent again elsewhere.
    pub upstream_retries: Family<EndpointLabels, Counter>,
    /// Open client connections per listener.
    pub open_connections: Family<ListenerLabels, Gauge>,
    /// Client connections closed by a connection limit, by listener and reason.
    pub connections_closed: Family<ConnCloseLabels, Counter>,
    /// Client connections that waited for a slot under the per-listener cap.
    pub connections_queued: Family<ListenerLabels, Counter>,
    /// HTTP/2 connections drained by the stream-stall rule, by listener and reason.
    pub connections_drained: Family<ConnCloseLabels, Counter>,
    /// TLS handshakes that failed or timed out, by listener.
    pub tls_handshake_failures: Family<ListenerLabels, Counter>,
    /// Upstream connections the gateway could not open for lack of its own resources.
    pub local_resource_errors: Family<ErrnoLabels, Counter>,
    /// Requests refused by an admission limit, by reason.
    pub shed: Family<ShedLabels, Counter>,
    /// Requests parked at an endpoint's admission gate, by service.
    pub admission_queued: Family<ServiceLabels, Counter>,
    /// Requests parked now, by service.
    pub admission_parked: Family<ServiceLabels, Gauge>,
    /// The P/D families (`loxilb_ai_pd_*`, see [`crate::pd::metrics`]).
    pub pd: crate::pd::PdMetrics,
    /// LoxiLB's AI request families (`loxilb_ai_*`, see [`super::ai_metrics`]).
    pub ai: super::ai_metrics::AiMetrics,
}

fn duration_histogram() -> Histogram {
    // 1 ms … ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

impl ProxyMetrics {
    /// Registers the families in `reg`.
    pub fn register(reg: &mut Registry) -> Self {
        let m = Self {
            pd: crate::pd::PdMetrics::register(reg),
            ai: super::ai_metrics::AiMetrics::register(reg),
            ..Self::unregistered()
        };
        reg.register(
            "loxilb_proxy_requests",
            "Fullproxy requests by service, endpoint and status class",
            m.requests.clone(),
        );
        reg.register(
            "loxilb_proxy_selections",
            "Selection decisions by selector and reason",
            m.selections.clone(),
        );
        reg.register(
            "loxilb_proxy_upstream_connect_failures",
            "Failed upstream connection attempts",
            m.connect_failures.clone(),
        );
        reg.register(
            "loxilb_proxy_active_connections",
            "Requests in flight per endpoint",
            m.active.clone(),
        );
        reg.register(
            "loxilb_proxy_request_duration_seconds",
            "Request duration until the response body ends",
            m.duration.clone(),
        );
        reg.register(
            "loxilb_proxy_upstream_timeouts",
            "Requests whose backend sent no response head within LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS (answered 504)",
            m.upstream_timeouts.clone(),
        );
        reg.register(
            "loxilb_proxy_upstream_retries",
            "Idempotent requests an endpoint dropped after they were sent, without a response head, sent again to another endpoint",
            m.upstream_retries.clone(),
        );
        reg.register(
            "loxilb_proxy_upstream_stream_errors",
            "Responses whose backend body failed mid-stream (counted as 5xx)",
            m.stream_errors.clone(),
        );
        reg.register(
            "loxilb_proxy_open_connections",
            "Open client connections per fullproxy listener",
            m.open_connections.clone(),
        );
        reg.register(
            "loxilb_proxy_connections_closed",
            "Client connections closed by the header-read, idle or send timeout, an oversized or a malformed request head",
            m.connections_closed.clone(),
        );
        reg.register(
            "loxilb_proxy_connections_drained",
            "Client HTTP/2 connections drained (GOAWAY) because a stream waited the send timeout \
             for its client while other streams progressed",
            m.connections_drained.clone(),
        );
        reg.register(
            "loxilb_proxy_connections_queued",
            "Client connections that waited for a slot under the per-listener connection cap",
            m.connections_queued.clone(),
        );
        reg.register(
            "loxilb_proxy_tls_handshake_failures",
            "TLS handshakes of fullproxy listeners that failed or timed out",
            m.tls_handshake_failures.clone(),
        );
        reg.register(
            "loxilb_proxy_local_resource_errors",
            "Upstream connections the gateway could not open for lack of its own file \
             descriptors, local ports or kernel buffers (503 gateway_resources_exhausted), by errno",
            m.local_resource_errors.clone(),
        );
        reg.register(
            "loxilb_pd_admission_shed",
            "Requests refused by an admission limit (429 pd_overloaded), by reason",
            m.shed.clone(),
        );
        reg.register(
            "loxilb_pd_admission_queued",
            "Requests parked at an endpoint's admission gate (LLB_PD_MAX_INFLIGHT_PER_EP), by service",
            m.admission_queued.clone(),
        );
        reg.register(
            "loxilb_pd_admission_parked",
            "Requests parked at an endpoint's admission gate now, by service",
            m.admission_parked.clone(),
        );
        m
    }

    /// Handles not attached to any registry (tools and tests).
    pub fn unregistered() -> Self {
        Self {
            requests: Family::default(),
            selections: Family::default(),
            connect_failures: Family::default(),
            active: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
            stream_errors: Family::default(),
            upstream_timeouts: Family::default(),
            upstream_retries: Family::default(),
            open_connections: Family::default(),
            connections_closed: Family::default(),
            connections_queued: Family::default(),
            connections_drained: Family::default(),
            tls_handshake_failures: Family::default(),
            local_resource_errors: Family::default(),
            shed: Family::default(),
            admission_queued: Family::default(),
            admission_parked: Family::default(),
            pd: crate::pd::PdMetrics::unregistered(),
            ai: super::ai_metrics::AiMetrics::unregistered(),
        }
    }

    /// The open-connections gauge of listener `addr`.
    pub fn open_connections(&self, addr: std::net::SocketAddr) -> Gauge {
        self.open_connections
            .get_or_create(&ListenerLabels {
                listener: addr.to_string(),
            })
            .clone()
    }

    /// Removes every series of listener `addr` (open connections, connections queued, closed
    /// and drained at a limit, TLS handshake failures) when its last rule is deleted, so a closed
    /// listener is not shown with its last values until a restart. The connections it still
    /// drains keep their own gauge handle, no longer exported.
    pub fn forget_listener(&self, addr: std::net::SocketAddr) {
        let l = ListenerLabels {
            listener: addr.to_string(),
        };
        self.open_connections.remove(&l);
        self.connections_queued.remove(&l);
        self.tls_handshake_failures.remove(&l);
        for why in super::conn::Expiry::ALL {
            let labels = ConnCloseLabels {
                listener: l.listener.clone(),
                reason: why.as_str().to_string(),
            };
            self.connections_closed.remove(&labels);
            self.connections_drained.remove(&labels);
        }
    }

    /// Counts one connection closed at a limit.
    pub fn connection_closed(&self, addr: std::net::SocketAddr, why: super::conn::Expiry) {
        self.connections_closed
            .get_or_create(&ConnCloseLabels {
                listener: addr.to_string(),
                reason: why.as_str().into(),
            })
            .inc();
    }

    /// Counts one connection drained by a limit (not closed: see [`super::conn::Expiry::StreamStall`]).
    pub fn connection_drained(&self, addr: std::net::SocketAddr, why: super::conn::Expiry) {
        self.connections_drained
            .get_or_create(&ConnCloseLabels {
                listener: addr.to_string(),
                reason: why.as_str().into(),
            })
            .inc();
    }

    /// Counts one failed TLS handshake on listener `addr`.
    pub fn tls_handshake_failed(&self, addr: std::net::SocketAddr) {
        self.tls_handshake_failures
            .get_or_create(&ListenerLabels {
                listener: addr.to_string(),
            })
            .inc();
    }

    /// Counts one connection that waited for a slot.
    pub fn connection_queued(&self, addr: std::net::SocketAddr) {
        self.connections_queued
            .get_or_create(&ListenerLabels {
                listener: addr.to_string(),
            })
            .inc();
    }

    /// Counts one upstream connection the gateway could not open for lack of `errno`'s
    /// resource, and logs it.
    pub fn local_shortage(&self, service: u32, s: &super::attempt::LocalShortage) {
        tracing::warn!(
            service,
            errno = s.errno,
            error = %s.message,
            "cannot open an upstream connection: the gateway is out of its own resources; 503, no endpoint blamed"
        );
        self.local_resource_errors
            .get_or_create(&ErrnoLabels {
                errno: s.errno.into(),
            })
            .inc();
    }

    /// Counts one request refused by an admission limit.
    pub fn shed(&self, reason: &str) {
        self.shed
            .get_or_create(&ShedLabels {
                reason: reason.into(),
            })
            .inc();
    }

    /// Counts one response.
    pub fn request(&self, service: u32, ep: Option<usize>, status: http::StatusCode) {
        let labels = RequestLabels {
            service: service.to_string(),
            ep_idx: ep.map_or_else(|| "none".into(), |e| e.to_string()),
            class: format!("{}xx", status.as_u16() / 100),
        };
        self.requests.get_or_create(&labels).inc();
    }

    /// Counts one selection decision.
    pub fn selection(&self, selector: &str, reason: crate::routing::Reason) {
        let labels = SelectionLabels {
            selector: selector.into(),
            reason: reason.as_str().into(),
        };
        self.selections.get_or_create(&labels).inc();
    }

    /// Counts one failed connect.
    pub fn connect_failure(&self, service: u32, ep: usize) {
        self.connect_failures
            .get_or_create(&ep_labels(service, ep))
            .inc();
    }

    /// The active gauge of an endpoint.
    pub fn active_gauge(&self, service: u32, ep: usize) -> Gauge {
        self.active.get_or_create(&ep_labels(service, ep)).clone()
    }

    /// The duration histogram of a service.
    pub fn duration_histogram(&self, service: u32) -> Histogram {
        self.duration
            .get_or_create(&ServiceLabels {
                service: service.to_string(),
            })
            .clone()
    }
}

impl ProxyMetrics {
    /// Removes every series of position `ep` of service `service`
    /// (`loxilb_proxy_requests_total` of each class, connect failures, in-flight, stream
    /// errors): the endpoint there was removed or replaced, and its series must neither stay
    /// in the scrape nor be continued by whichever endpoint takes the position (issue 12 §1).
    pub fn forget_endpoint(&self, service: u32, ep: usize) {
        let l = ep_labels(service, ep);
        self.connect_failures.remove(&l);
        self.active.remove(&l);
        self.stream_errors.remove(&l);
        self.upstream_timeouts.remove(&l);
        self.upstream_retries.remove(&l);
        self.forget_requests(service, &l.ep_idx);
    }

    /// Removes every series of service `service`, whose pool had `endpoints` positions: each
    /// position's (see [`Self::forget_endpoint`]), its `ep_idx="none"` requests, its
    /// duration histogram, its admission series and its P/D series. For a deleted rule.
    pub fn forget_service(&self, service: u32, endpoints: usize) {
        for ep in 0..endpoints {
            self.forget_endpoint(service, ep);
        }
        self.forget_requests(service, "none");
        let svc = ServiceLabels {
            service: service.to_string(),
        };
        self.duration.remove(&svc);
        self.admission_queued.remove(&svc);
        self.admission_parked.remove(&svc);
        self.pd.forget_service(service);
    }

    fn forget_requests(&self, service: u32, ep_idx: &str) {
        for class in 1..=5 {
            self.requests.remove(&RequestLabels {
                service: service.to_string(),
                ep_idx: ep_idx.to_string(),
                class: format!("{class}xx"),
            });
        }
    }
}

fn ep_labels(service: u32, ep: usize) -> EndpointLabels {
    EndpointLabels {
        service: service.to_string(),
        ep_idx: ep.to_string(),
    }
}

/// Selection reasons cached per pool (see [`PoolMetrics`]); others use the family lookup.
const CACHED_REASONS: [crate::routing::Reason; 15] = crate::routing::Reason::ALL;

/// Metric handles of one endpoint, resolved once.
#[derive(Debug)]
pub struct EndpointMetrics {
    /// Requests in flight.
    pub active: Gauge,
    /// Failed connects.
    pub connect_failures: Counter,
    by_class: [std::sync::OnceLock<Counter>; 6],
    stream_errors: std::sync::OnceLock<Counter>,
}

/// Metric handles of one pool, resolved once per pool instead of a label lookup (and its
/// string allocations) on every request.
#[derive(Debug)]
pub struct PoolMetrics {
    family: ProxyMetrics,
    service: u32,
    selector: &'static str,
    /// Per endpoint.
    pub eps: Vec<EndpointMetrics>,
    /// Request duration.
    pub duration: Histogram,
    /// The pool's `loxilb_ai_*` handles.
    pub ai: super::ai_metrics::AiPoolMetrics,
    selections: [[std::sync::OnceLock<Counter>; CACHED_REASONS.len()]; 2],
}

impl PoolMetrics {
    /// Handles for service `service` (selector label `selector`, rule model name `model`,
    /// empty for the wildcard pool) with `n` endpoints.
    pub fn new(
        m: &ProxyMetrics,
        service: u32,
        selector: &'static str,
        model: &str,
        n: usize,
    ) -> Self {
        let eps = (0..n)
            .map(|ep| EndpointMetrics {
                active: m.active_gauge(service, ep),
                connect_failures: m
                    .connect_failures
                    .get_or_create(&ep_labels(service, ep))
                    .clone(),
                by_class: Default::default(),
                stream_errors: Default::default(),
            })
            .collect();
        Self {
            family: m.clone(),
            service,
            selector,
            eps,
            duration: m.duration_histogram(service),
            ai: super::ai_metrics::AiPoolMetrics::new(&m.ai, model),
            selections: Default::default(),
        }
    }

    /// Counts one response from endpoint `ep` (the cached counter incremented in place, no
    /// handle cloned).
    pub fn request(&self, ep: usize, status: http::StatusCode) {
        let class = usize::from(status.as_u16() / 100).min(5);
        match self.eps.get(ep) {
            Some(e) => {
                e.by_class[class]
                    .get_or_init(|| self.class_family_counter(ep, status))
                    .inc();
            }
            None => {
                self.class_family_counter(ep, status).inc();
            }
        }
    }

    /// The family's `loxilb_proxy_requests_total` counter of endpoint `ep` for `status`'s
    /// class (a label lookup: the uncached path).
    fn class_family_counter(&self, ep: usize, status: http::StatusCode) -> Counter {
        let labels = RequestLabels {
            service: self.service.to_string(),
            ep_idx: ep.to_string(),
            class: format!("{}xx", status.as_u16() / 100),
        };
        self.family.requests.get_or_create(&labels).clone()
    }

    /// Counts one response timeout of endpoint `ep` (rare: looked up in the family).
    pub fn upstream_timeout(&self, ep: usize) {
        self.family
            .upstream_timeouts
            .get_or_create(&ep_labels(self.service, ep))
            .inc();
    }

    /// Counts one idempotent request endpoint `ep` dropped without an answer, sent again to
    /// another endpoint (rare: looked up in the family).
    pub fn upstream_retry(&self, ep: usize) {
        self.family
            .upstream_retries
            .get_or_create(&ep_labels(self.service, ep))
            .inc();
    }

    /// The `loxilb_proxy_upstream_stream_errors_total` counter of endpoint `ep`.
    pub fn stream_errors(&self, ep: usize) -> Counter {
        let make = || {
            self.family
                .stream_errors
                .get_or_create(&ep_labels(self.service, ep))
                .clone()
        };
        match self.eps.get(ep) {
            Some(e) => e.stream_errors.get_or_init(make).clone(),
            None => make(),
        }
    }

    /// Counts one selection by the rule's selector (`kv == false`) or tier 1.5 (`kv == true`).
    pub fn selection(&self, kv: bool, reason: crate::routing::Reason) {
        let selector = if kv { "kv" } else { self.selector };
        match CACHED_REASONS.iter().position(|r| *r == reason) {
            Some(i) => {
                self.selections[usize::from(kv)][i]
                    .get_or_init(|| {
                        let labels = SelectionLabels {
                            selector: selector.into(),
                            reason: reason.as_str().into(),
                        };
                        self.family.selections.get_or_create(&labels).clone()
                    })
                    .inc();
            }
            None => self.family.selection(selector, reason),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_selection_reason_counts_for_both_selectors() {
        // One cached counter per reason: a reason added to `Reason::ALL` must have its slot
        // (a missing one was an index panic on the request path).
        let mut reg = Registry::default();
        let m = ProxyMetrics::register(&mut reg);
        let pool = PoolMetrics::new(&m, 7, "rr", "tiny", 2);
        for reason in crate::routing::Reason::ALL {
            pool.selection(false, reason);
            pool.selection(true, reason);
            pool.selection(true, reason);
        }
        for reason in crate::routing::Reason::ALL {
            let get = |selector: &str| {
                m.selections
                    .get_or_create(&SelectionLabels {
                        selector: selector.into(),
                        reason: reason.as_str().into(),
                    })
                    .get()
            };
            assert_eq!((get("rr"), get("kv")), (1, 2), "{}", reason.as_str());
        }
    }

    #[test]
    fn a_removed_listener_loses_every_close_and_drain_series() {
        let mut reg = Registry::default();
        let m = ProxyMetrics::register(&mut reg);
        let (gone, kept): (std::net::SocketAddr, std::net::SocketAddr) = (
            "127.0.0.1:8080".parse().expect("addr"),
            "127.0.0.1:8081".parse().expect("addr"),
        );
        for why in super::super::conn::Expiry::ALL {
            m.connection_closed(gone, why);
            m.connection_closed(kept, why);
        }
        m.connection_drained(gone, super::super::conn::Expiry::StreamStall);
        m.connection_drained(kept, super::super::conn::Expiry::StreamStall);
        m.forget_listener(gone);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).expect("encode");
        let series = |name: &str, addr: &str| {
            text.lines()
                .filter(|l| l.starts_with(name) && l.contains(&format!("listener=\"{addr}\"")))
                .count()
        };
        let closed = "loxilb_proxy_connections_closed_total";
        let drained = "loxilb_proxy_connections_drained_total";
        assert_eq!(series(closed, "127.0.0.1:8080"), 0, "{text}");
        assert_eq!(series(drained, "127.0.0.1:8080"), 0, "{text}");
        assert_eq!(series(closed, "127.0.0.1:8081"), 6, "{text}");
        assert_eq!(series(drained, "127.0.0.1:8081"), 1, "{text}");
    }
}
