//! The trace spans of a proxied request and W3C trace-context propagation.
//!
//! | span | kind | attributes |
//! |---|---|---|
//! | `{METHOD} {path}` (one per request) | server | `http.request.method`, `url.path`, `http.response.status_code`, `loxi.rule`, `loxi.model`, `loxi.selector` (the rule's `sel`), `loxi.tier` (`kv` = tier 1.5, `sel` = the rule's selector), `loxi.reason`, `loxi.endpoint` (ep_idx), `loxi.attempts`, `loxi.kv.tokens`, `loxi.kv.blocks`, `loxi.kv.cached_blocks` (leading blocks the chosen endpoint holds), `loxi.kv.miss_reason` (why tier 1.5 passed) |
//! | `kv.tokenize`, `kv.hash`, `kv.score` | internal | `loxi.kv.tokens` / `loxi.kv.blocks` |
//! | `upstream {ep}` (one per attempt) | client | `loxi.endpoint`, `server.address`, `loxi.attempt`, `http.response.status_code`, `error.type` |
//!
//! An incoming `traceparent` / `tracestate` makes the request span a child of the caller's
//! span; each attempt's context is injected into the upstream request's headers, so the
//! engine (vLLM reads `traceparent` with `--otlp-traces-endpoint`) continues the trace.
//! With traces off these spans are disabled (`Span::none()`) and every call here is a no-op.

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector};
use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use super::SPAN_TARGET;

/// The server span of one proxied request, child of the caller's `traceparent` if any.
pub fn request(method: &http::Method, path: &str, headers: &HeaderMap) -> Span {
    let span = tracing::info_span!(
        target: SPAN_TARGET,
        "proxy.request",
        otel.name = %format_args!("{method} {path}"),
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = %method,
        url.path = path,
        http.response.status_code = Empty,
        loxi.rule = Empty,
        loxi.model = Empty,
        loxi.selector = Empty,
        loxi.tier = Empty,
        loxi.reason = Empty,
        loxi.endpoint = Empty,
        loxi.attempts = Empty,
        loxi.kv.tokens = Empty,
        loxi.kv.blocks = Empty,
        loxi.kv.cached_blocks = Empty,
        loxi.kv.miss_reason = Empty,
        loxi.prefill_endpoint = Empty,
    );
    if !span.is_disabled() {
        let parent = opentelemetry::global::get_text_map_propagator(|p| {
            p.extract(&HeaderExtractor(headers))
        });
        // Only fails when the span is disabled or already started, neither the case here.
        let _ = span.set_parent(parent);
    }
    span
}

/// Records the status of the request span (an error status for 5xx, as OTel's HTTP server
/// conventions say).
pub fn record_status(span: &Span, status: http::StatusCode) {
    span.record("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
}

/// A child span of the current span for one stage of tier 1.5 (`kv.tokenize`, `kv.hash`,
/// `kv.score`).
#[macro_export]
macro_rules! kv_stage_span {
    ($name:literal) => {
        tracing::info_span!(
            target: $crate::telemetry::SPAN_TARGET,
            $name,
            loxi.kv.tokens = tracing::field::Empty,
            loxi.kv.blocks = tracing::field::Empty,
        )
    };
}

/// A count as an OTel integer attribute (tracing's unsigned values would become strings).
pub fn int(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Records the rule (service id) and model on the current (request) span.
pub fn record_rule(service: u32, model: Option<&str>) {
    let span = Span::current();
    span.record("loxi.rule", i64::from(service));
    if let Some(m) = model {
        span.record("loxi.model", m);
    }
}

/// Records a decision on the current (request) span: the rule's selector name, the reason
/// label, the endpoint and the attempt number (the last attempt's values stay). The tier is
/// `kv` for tier-1.5 reasons (`kv_overlap`, `kv_spill`, `kv_cold_seed`, `kv_cold_place`), else `sel`.
pub fn record_decision(selector: &str, reason: &str, ep: usize, attempts: usize) {
    let span = Span::current();
    span.record("loxi.selector", selector);
    span.record(
        "loxi.tier",
        if reason.starts_with("kv_") {
            "kv"
        } else {
            "sel"
        },
    );
    span.record("loxi.reason", reason);
    span.record("loxi.endpoint", int(ep));
    span.record("loxi.attempts", int(attempts));
}

/// Records a tier-1.5 miss reason (`no_worker`, `short_prompt`, …) on the current span.
pub fn record_kv_miss(reason: &str) {
    Span::current().record("loxi.kv.miss_reason", reason);
}

/// Records the number of leading request blocks the chosen endpoint holds on the current span.
pub fn record_cached_blocks(blocks: usize) {
    Span::current().record("loxi.kv.cached_blocks", int(blocks));
}

/// Records an attempt's outcome: the backend's status, or the failure kind as `error.type`
/// with an error status.
pub fn record_attempt(span: &Span, status: Option<http::StatusCode>, error: Option<&str>) {
    if let Some(s) = status {
        record_status(span, s);
    }
    if let Some(e) = error {
        span.record("error.type", e);
        span.record("otel.status_code", "ERROR");
    }
}

/// The client span of one upstream attempt (`attempt` counts from 1).
pub fn attempt(ep: usize, authority: &str, attempt: usize) -> Span {
    tracing::info_span!(
        target: SPAN_TARGET,
        "upstream.attempt",
        otel.name = %format_args!("upstream {ep}"),
        otel.kind = "client",
        otel.status_code = Empty,
        loxi.endpoint = int(ep),
        server.address = authority,
        loxi.attempt = int(attempt),
        http.response.status_code = Empty,
        error.type = Empty,
    )
}

/// Records the prefill endpoint of the pair that served (or failed) a P/D request on the
/// current (request) span.
pub fn record_prefill(ep: usize) {
    Span::current().record("loxi.prefill_endpoint", int(ep));
}

/// The client span of one P/D leg (`leg`: `prefill` or `decode`) sent to endpoint `ep`, named
/// `{leg} {ep}`; its context goes into the leg's `traceparent`.
pub fn leg(leg: &'static str, ep: usize, authority: &str) -> Span {
    tracing::info_span!(
        target: SPAN_TARGET,
        "upstream.leg",
        otel.name = %format_args!("{leg} {ep}"),
        otel.kind = "client",
        otel.status_code = Empty,
        loxi.leg = leg,
        loxi.endpoint = int(ep),
        server.address = authority,
        http.response.status_code = Empty,
        error.type = Empty,
    )
}

/// Writes `span`'s context as `traceparent` (and `tracestate`) into `headers`, replacing the
/// caller's. Nothing is written when traces are off.
pub fn inject(span: &Span, headers: &mut HeaderMap) {
    if span.is_disabled() {
        return;
    }
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut HeaderInjector(headers))
    });
}

/// Reads propagation headers from an `http::HeaderMap`.
struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Writes propagation headers into an `http::HeaderMap`.
struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_disabled_and_inject_nothing_without_the_trace_layer() {
        // No subscriber in this test thread: the trace target is not enabled.
        let span = request(&http::Method::POST, "/v1/completions", &HeaderMap::new());
        assert!(span.is_disabled());
        let mut h = HeaderMap::new();
        inject(&attempt(0, "127.0.0.1:1", 1), &mut h);
        assert!(h.is_empty());
    }

    #[test]
    fn header_injector_and_extractor_round_trip() {
        let mut h = HeaderMap::new();
        HeaderInjector(&mut h).set(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        );
        HeaderInjector(&mut h).set("bad header", "x".into());
        assert_eq!(h.len(), 1);
        let x = HeaderExtractor(&h);
        assert_eq!(
            x.get("traceparent"),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        assert_eq!(x.keys(), vec!["traceparent"]);
    }
}
