//! OpenTelemetry trace settings from the standard environment (read once at start).
//!
//! | variable | loxi |
//! |---|---|
//! | `OTEL_SDK_DISABLED` | `true` turns traces off whatever else is set; a value other than `true`/`false` too, with a warning |
//! | `OTEL_TRACES_EXPORTER` | `otlp` on, `none` off; unset: on when an OTLP endpoint is set. Any other exporter is refused (traces off, warning) |
//! | `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` | full URL of the traces endpoint (e.g. `http://collector:4318/v1/traces`) |
//! | `OTEL_EXPORTER_OTLP_ENDPOINT` | base URL; `/v1/traces` is appended (default `http://localhost:4318`) |
//! | `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` | `http/protobuf` (the default, the only one built in); `grpc` and `http/json` are refused (traces off, warning) |
//! | `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS` | read by the exporter (`opentelemetry-otlp`) |
//! | `OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT` | read by the exporter: milliseconds, an integer; anything else is a warning (the exporter's 10 s) |
//! | `OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION` | `gzip` or `none` (built in); anything else (`zstd` included): warning, spans sent uncompressed |
//! | `OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG` | `always_on`, `always_off`, `traceidratio`, `parentbased_always_on` (default), `parentbased_always_off`, `parentbased_traceidratio`; ratio in 0..=1. Anything else: warning, default used |
//! | `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES` | the resource (`service.name` defaults to `loxilb`) |
//! | `OTEL_BSP_*` | the batch span processor (queue size, delay, batch size, export timeout): integers; anything else is a warning (the SDK's default) |
//! | `OTEL_PROPAGATORS` | W3C `tracecontext` is what loxi reads and writes; a list without it, or with others (`b3`, `jaeger`, ...), is a warning |
//! | `OTEL_METRICS_EXPORTER`, `OTEL_LOGS_EXPORTER` | loxi exports neither over OTLP (metrics: `/netlox/v1/metrics`; logs: stderr); a value other than `none` is a warning |
//!
//! An endpoint URL that is not `http://` or `https://` turns traces off with a warning.

use std::fmt;

use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};

/// A trace setting that was not accepted, and what loxi did instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtelWarning {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What happened instead (`traces off`, `parentbased_always_on`, …).
    pub used: String,
}

impl fmt::Display for OtelWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={:?} is not accepted; {}",
            self.var, self.value, self.used
        )
    }
}

/// The sampler chosen by `OTEL_TRACES_SAMPLER[_ARG]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SamplerSpec {
    /// Every trace.
    AlwaysOn,
    /// None.
    AlwaysOff,
    /// A fraction (0..=1) of trace ids.
    Ratio(f64),
    /// Follow the caller's `traceparent` sampled flag; for root spans use the inner spec.
    ParentBased(RootSampler),
}

/// The root sampler of [`SamplerSpec::ParentBased`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RootSampler {
    /// Sample every root.
    AlwaysOn,
    /// Sample no root.
    AlwaysOff,
    /// A fraction of roots.
    Ratio(f64),
}

impl SamplerSpec {
    fn sampler(self) -> Sampler {
        let root = |r: RootSampler| match r {
            RootSampler::AlwaysOn => Sampler::AlwaysOn,
            RootSampler::AlwaysOff => Sampler::AlwaysOff,
            RootSampler::Ratio(f) => Sampler::TraceIdRatioBased(f),
        };
        match self {
            Self::AlwaysOn => Sampler::AlwaysOn,
            Self::AlwaysOff => Sampler::AlwaysOff,
            Self::Ratio(f) => Sampler::TraceIdRatioBased(f),
            Self::ParentBased(r) => Sampler::ParentBased(Box::new(root(r))),
        }
    }
}

/// Traces are on: how to sample (the exporter reads its own variables).
#[derive(Debug, Clone, PartialEq)]
pub struct OtelSettings {
    /// `OTEL_TRACES_SAMPLER[_ARG]`.
    pub sampler: SamplerSpec,
}

const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];
const PROTOCOL_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
];

impl OtelSettings {
    /// `Some` when the environment turns traces on (see the module table), with the settings
    /// that were refused.
    pub fn from_lookup(
        lookup: &impl Fn(&str) -> Option<String>,
    ) -> (Option<Self>, Vec<OtelWarning>) {
        let get = |k: &str| {
            lookup(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let mut warnings = Vec::new();
        let off = |var: &'static str, value: String, why: &str| OtelWarning {
            var,
            value,
            used: format!("{why}; traces stay off"),
        };
        match get("OTEL_SDK_DISABLED") {
            Some(v) if v.eq_ignore_ascii_case("true") => return (None, warnings),
            Some(v) if v.eq_ignore_ascii_case("false") => {}
            None => {}
            // `1`, `yes`, ...: the OTel spec reads them as false (traces on); an operator who
            // set the switch most likely meant off, so nothing is exported and it is said.
            Some(v) => {
                let w = off(
                    "OTEL_SDK_DISABLED",
                    v,
                    "neither `true` nor `false` (the OTel spec's only values)",
                );
                return (None, vec![w]);
            }
        }
        let endpoint_set = ENDPOINT_VARS.iter().any(|v| get(v).is_some());
        match get("OTEL_TRACES_EXPORTER").map(|v| v.to_ascii_lowercase()) {
            None if !endpoint_set => return (None, warnings),
            None => {}
            Some(e) if e == "otlp" => {}
            Some(e) if e == "none" => return (None, warnings),
            Some(e) => {
                let w = off(
                    "OTEL_TRACES_EXPORTER",
                    e,
                    "only `otlp` and `none` are supported",
                );
                return (None, vec![w]);
            }
        }
        // The traces-specific variable wins over the generic one (OTel spec).
        if let Some((var, p)) = PROTOCOL_VARS.iter().find_map(|v| get(v).map(|p| (*v, p)))
            && p != "http/protobuf"
        {
            let w = off(var, p, "this build exports OTLP over http/protobuf only");
            return (None, vec![w]);
        }
        if let Some((var, url)) = ENDPOINT_VARS.iter().find_map(|v| get(v).map(|u| (*v, u)))
            && !["http://", "https://"]
                .iter()
                .any(|s| url.to_ascii_lowercase().starts_with(s))
        {
            let w = off(
                var,
                url,
                "the OTLP exporter sends to http:// or https:// URLs only",
            );
            return (None, vec![w]);
        }
        let sampler = sampler_from(&get, &mut warnings);
        exporter_knobs(&get, &mut warnings);
        (Some(Self { sampler }), warnings)
    }

    /// Builds the tracer provider: OTLP/HTTP exporter behind a batch processor, the sampler
    /// and the resource. An exporter that cannot be built (a malformed endpoint URL) is
    /// refused with a warning naming the variable.
    pub fn provider(
        &self,
        lookup: &impl Fn(&str) -> Option<String>,
    ) -> Result<SdkTracerProvider, OtelWarning> {
        use opentelemetry_otlp::WithExportConfig as _;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .build()
            .map_err(|e| {
                let (var, value) = ENDPOINT_VARS
                    .iter()
                    .find_map(|v| lookup(v).map(|x| (*v, x)))
                    .unwrap_or(("OTEL_EXPORTER_OTLP_ENDPOINT", String::new()));
                OtelWarning {
                    var,
                    value,
                    used: format!("the OTLP exporter cannot be built ({e}); traces stay off"),
                }
            })?;
        Ok(SdkTracerProvider::builder()
            .with_batch_exporter(Reporting::new(exporter))
            .with_sampler(self.sampler.sampler())
            .with_resource(resource(lookup))
            .build())
    }
}

/// How often failed exports are reported while they keep failing: the first failure at once,
/// then one warning per this interval with the number of failures in between.
pub const EXPORT_FAILURE_REPORT_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Keeps the last value of each attribute key, in the order of those last values: a field
/// recorded again on a span (the decision of each retry on the request span) is appended by
/// `tracing-opentelemetry`, and OTLP wants each key once.
pub fn last_value_per_key(attrs: &mut Vec<opentelemetry::KeyValue>) {
    if attrs.len() < 2 {
        return;
    }
    let mut seen = std::collections::HashSet::with_capacity(attrs.len());
    let mut kept: Vec<opentelemetry::KeyValue> = attrs
        .drain(..)
        .rev()
        .filter(|kv| seen.insert(kv.key.clone()))
        .collect();
    kept.reverse();
    *attrs = kept;
}

/// A span exporter that reports its own failures (and writes each attribute key once,
/// [`last_value_per_key`]). The OTLP exporter's errors (collector down,
/// refused, a 4xx/5xx answer, a timeout) otherwise reach only the SDK's internal logs, which
/// loxi does not show: spans were dropped without a word. The first failure is a warning at
/// once, later ones one warning per [`EXPORT_FAILURE_REPORT_EVERY`] with their count, and the
/// first success after failures an info line.
#[derive(Debug)]
pub struct Reporting<E> {
    inner: E,
    state: parking_lot::Mutex<FailureState>,
}

#[derive(Debug, Default)]
struct FailureState {
    /// Failures since the last report.
    unreported: u64,
    /// Failures since the last success.
    failing: u64,
    /// When the last warning was logged.
    reported: Option<std::time::Instant>,
}

impl<E> Reporting<E> {
    /// Wraps `inner`.
    pub fn new(inner: E) -> Self {
        Self {
            inner,
            state: parking_lot::Mutex::new(FailureState::default()),
        }
    }

    fn record(&self, result: &opentelemetry_sdk::error::OTelSdkResult, spans: usize) {
        let now = std::time::Instant::now();
        let mut st = self.state.lock();
        match result {
            Ok(()) => {
                if st.failing > 0 {
                    tracing::info!(
                        failed_exports = st.failing,
                        "OTLP span export succeeds again"
                    );
                }
                *st = FailureState::default();
            }
            Err(e) => {
                st.failing += 1;
                st.unreported += 1;
                let due = st
                    .reported
                    .is_none_or(|t| now.duration_since(t) >= EXPORT_FAILURE_REPORT_EVERY);
                if due {
                    tracing::warn!(
                        error = %e,
                        spans,
                        failed_exports = st.unreported,
                        "OTLP span export failed; these spans are dropped (reported at most once a minute while it keeps failing)"
                    );
                    st.unreported = 0;
                    st.reported = Some(now);
                }
            }
        }
    }
}

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter
    for Reporting<E>
{
    async fn export(
        &self,
        mut batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        let spans = batch.len();
        for span in &mut batch {
            last_value_per_key(&mut span.attributes);
        }
        let result = self.inner.export(batch).await;
        self.record(&result, spans);
        result
    }

    fn shutdown_with_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The resource from `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES`, `service.name` `loxilb`
/// unless one of them names it.
fn resource(lookup: &impl Fn(&str) -> Option<String>) -> Resource {
    let named = lookup("OTEL_SERVICE_NAME").is_some_and(|v| !v.trim().is_empty())
        || lookup("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|v| {
            v.split(',')
                .any(|kv| kv.trim_start().starts_with("service.name="))
        });
    let b = Resource::builder();
    if named {
        b.build()
    } else {
        b.with_service_name("loxilb").build()
    }
}

/// The exporter's and batch processor's own variables, checked for values they would ignore
/// without a word (the exporter logs nothing loxi shows): warnings, the default used.
fn exporter_knobs(get: &impl Fn(&str) -> Option<String>, warnings: &mut Vec<OtelWarning>) {
    let mut warn = |var: &'static str, value: String, used: &str| {
        warnings.push(OtelWarning {
            var,
            value,
            used: used.to_string(),
        });
    };
    for var in [
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
        "OTEL_EXPORTER_OTLP_COMPRESSION",
    ] {
        if let Some(v) = get(var)
            && !["gzip", "none"].contains(&v.to_ascii_lowercase().as_str())
        {
            warn(
                var,
                v,
                "gzip and none are built in; spans are sent uncompressed",
            );
        }
    }
    for var in [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "OTEL_BSP_SCHEDULE_DELAY",
        "OTEL_BSP_EXPORT_TIMEOUT",
        "OTEL_BSP_MAX_QUEUE_SIZE",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
        "OTEL_BSP_MAX_CONCURRENT_EXPORTS",
    ] {
        if let Some(v) = get(var)
            && v.parse::<u64>().is_err()
        {
            warn(var, v, "not an integer; the SDK's default is used");
        }
    }
    if let Some(v) = get("OTEL_PROPAGATORS") {
        let names: Vec<String> = v
            .split(',')
            .map(|p| p.trim().to_ascii_lowercase())
            .collect();
        if names.iter().any(|p| p != "tracecontext" && p != "none")
            || !names.iter().any(|p| p == "tracecontext")
        {
            warn(
                "OTEL_PROPAGATORS",
                v,
                "loxi reads and writes W3C tracecontext (traceparent, tracestate) only",
            );
        }
    }
    for (var, what) in [
        (
            "OTEL_METRICS_EXPORTER",
            "metrics are served on /netlox/v1/metrics",
        ),
        ("OTEL_LOGS_EXPORTER", "logs go to stderr"),
    ] {
        if let Some(v) = get(var)
            && !v.eq_ignore_ascii_case("none")
        {
            warn(
                var,
                v,
                &format!("loxi exports only traces over OTLP; {what}"),
            );
        }
    }
}

fn sampler_from(
    get: &impl Fn(&str) -> Option<String>,
    warnings: &mut Vec<OtelWarning>,
) -> SamplerSpec {
    let default = SamplerSpec::ParentBased(RootSampler::AlwaysOn);
    let Some(name) = get("OTEL_TRACES_SAMPLER") else {
        return default;
    };
    let mut ratio = || {
        let arg = get("OTEL_TRACES_SAMPLER_ARG");
        match arg.as_deref().map(str::parse::<f64>) {
            Some(Ok(f)) if (0.0..=1.0).contains(&f) => f,
            None => 1.0,
            Some(_) => {
                warnings.push(OtelWarning {
                    var: "OTEL_TRACES_SAMPLER_ARG",
                    value: arg.unwrap_or_default(),
                    used: "a ratio is a number in 0..=1; using 1.0".into(),
                });
                1.0
            }
        }
    };
    match name.to_ascii_lowercase().as_str() {
        "always_on" => SamplerSpec::AlwaysOn,
        "always_off" => SamplerSpec::AlwaysOff,
        "traceidratio" => SamplerSpec::Ratio(ratio()),
        "parentbased_always_on" => default,
        "parentbased_always_off" => SamplerSpec::ParentBased(RootSampler::AlwaysOff),
        "parentbased_traceidratio" => SamplerSpec::ParentBased(RootSampler::Ratio(ratio())),
        _ => {
            warnings.push(OtelWarning {
                var: "OTEL_TRACES_SAMPLER",
                value: name,
                used: "accepted: always_on, always_off, traceidratio, parentbased_always_on, \
                       parentbased_always_off, parentbased_traceidratio; using parentbased_always_on"
                    .into(),
            });
            default
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> (Option<OtelSettings>, Vec<OtelWarning>) {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        OtelSettings::from_lookup(&|k| m.get(k).cloned())
    }

    #[test]
    fn a_key_recorded_twice_keeps_its_last_value() {
        use opentelemetry::KeyValue;
        let mut attrs = vec![
            KeyValue::new("loxi.endpoint", 0),
            KeyValue::new("loxi.rule", 1),
            KeyValue::new("loxi.endpoint", 1),
            KeyValue::new("loxi.attempts", 2),
        ];
        last_value_per_key(&mut attrs);
        assert_eq!(
            attrs,
            vec![
                KeyValue::new("loxi.rule", 1),
                KeyValue::new("loxi.endpoint", 1),
                KeyValue::new("loxi.attempts", 2),
            ]
        );
    }

    #[test]
    fn traces_are_off_without_an_endpoint_or_exporter() {
        assert_eq!(parse(&[]), (None, vec![]));
        assert_eq!(
            parse(&[("OTEL_TRACES_SAMPLER", "always_on")]),
            (None, vec![])
        );
    }

    /// An exporter that fails, then keeps failing, then succeeds: one warning at the first
    /// failure (the next failures within a minute counted, not logged), one info line at the
    /// recovery; the results pass through unchanged.
    #[test]
    fn failed_exports_are_reported_and_rate_limited() {
        use opentelemetry_sdk::trace::SpanExporter as _;
        #[derive(Debug)]
        struct Flaky(parking_lot::Mutex<Vec<bool>>);
        impl opentelemetry_sdk::trace::SpanExporter for Flaky {
            async fn export(
                &self,
                _batch: Vec<opentelemetry_sdk::trace::SpanData>,
            ) -> opentelemetry_sdk::error::OTelSdkResult {
                if self.0.lock().remove(0) {
                    Ok(())
                } else {
                    Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                        "connection refused".into(),
                    ))
                }
            }
        }
        let buf = crate::telemetry::LogBuf::default();
        let sink = buf.clone();
        // Only this module's events: a subscriber enabling every callsite would, while this
        // test runs, make other tests' spans live in threads without a subscriber (callsite
        // interest is global), e.g. `span::tests::spans_are_disabled_...`.
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .without_time()
            .with_writer(move || sink.clone())
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "loxi_user::telemetry::otel=info",
            ))
            .finish();
        let exporter = Reporting::new(Flaky(parking_lot::Mutex::new(vec![
            false, false, false, true, false,
        ])));
        let results: Vec<bool> = tracing::subscriber::with_default(subscriber, || {
            (0..5)
                .map(|_| futures::executor::block_on(exporter.export(Vec::new())).is_ok())
                .collect()
        });
        assert_eq!(results, [false, false, false, true, false]);
        let text = buf.text();
        let warns: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
        assert_eq!(
            warns.len(),
            2,
            "first failure, then the first after recovery: {text}"
        );
        assert!(
            warns[0].contains("OTLP span export failed") && warns[0].contains("connection refused"),
            "{text}"
        );
        assert!(
            text.lines().any(|l| l.contains("INFO")
                && l.contains("succeeds again")
                && l.contains("failed_exports=3")),
            "{text}"
        );
    }

    /// The exporter's own variables with values it would ignore silently are warnings naming
    /// them; accepted values are not; a non-HTTP endpoint turns traces off.
    #[test]
    fn exporter_knobs_it_would_ignore_are_warnings() {
        let on = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        let (s, w) = parse(&[
            on,
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "5000"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "4096"),
            ("OTEL_PROPAGATORS", "tracecontext"),
            ("OTEL_METRICS_EXPORTER", "none"),
        ]);
        assert!(s.is_some() && w.is_empty(), "{w:?}");
        let (s, w) = parse(&[
            on,
            ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "-1"),
            ("OTEL_PROPAGATORS", "b3"),
            ("OTEL_METRICS_EXPORTER", "otlp"),
            ("OTEL_LOGS_EXPORTER", "otlp"),
        ]);
        assert!(s.is_some(), "traces stay on");
        let vars: Vec<&str> = w.iter().map(|w| w.var).collect();
        assert_eq!(
            vars,
            [
                "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
                "OTEL_EXPORTER_OTLP_TIMEOUT",
                "OTEL_BSP_MAX_QUEUE_SIZE",
                "OTEL_PROPAGATORS",
                "OTEL_METRICS_EXPORTER",
                "OTEL_LOGS_EXPORTER"
            ]
        );
        assert!(w[0].to_string().contains("sent uncompressed"), "{}", w[0]);
        let (s, w) = parse(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "ftp://x/v1/traces")]);
        assert!(s.is_none());
        assert_eq!(w.len(), 1);
        assert!(w[0].to_string().contains("http:// or https://"), "{}", w[0]);
    }

    #[test]
    fn an_endpoint_turns_traces_on_with_parent_based_sampling() {
        let (s, w) = parse(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")]);
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(
            s.expect("on").sampler,
            SamplerSpec::ParentBased(RootSampler::AlwaysOn)
        );
        let (s, _) = parse(&[("OTEL_TRACES_EXPORTER", "otlp")]);
        assert!(s.is_some());
    }

    #[test]
    fn sdk_disabled_and_exporter_none_win_over_an_endpoint() {
        let ep = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        assert_eq!(parse(&[ep, ("OTEL_SDK_DISABLED", "TRUE")]), (None, vec![]));
        assert_eq!(
            parse(&[ep, ("OTEL_TRACES_EXPORTER", "none")]),
            (None, vec![])
        );
        assert!(parse(&[ep, ("OTEL_SDK_DISABLED", "False")]).0.is_some());
        // Not a value of the switch: off, and said (it was read as false, traces on, silently).
        for v in ["1", "yes", "maybe"] {
            let (s, w) = parse(&[ep, ("OTEL_SDK_DISABLED", v)]);
            assert!(s.is_none(), "{v}");
            assert_eq!((w[0].var, w[0].value.as_str()), ("OTEL_SDK_DISABLED", v));
            assert!(w[0].to_string().contains("traces stay off"), "{}", w[0]);
        }
    }

    #[test]
    fn unsupported_exporter_and_protocol_are_refused_by_name() {
        let (s, w) = parse(&[("OTEL_TRACES_EXPORTER", "zipkin")]);
        assert!(s.is_none());
        assert_eq!(w[0].var, "OTEL_TRACES_EXPORTER");
        assert!(w[0].to_string().contains("traces stay off"), "{}", w[0]);
        let (s, w) = parse(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ]);
        assert!(s.is_none());
        assert_eq!(
            (w[0].var, w[0].value.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        );
        // The traces-specific protocol wins over the generic one.
        let (s, w) = parse(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
        ]);
        assert!(s.is_some() && w.is_empty(), "{w:?}");
    }

    #[test]
    fn samplers_parse_and_bad_values_fall_back_with_a_warning() {
        let ep = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        let s = |vars: &[(&str, &str)]| parse(vars).0.expect("on").sampler;
        assert_eq!(
            s(&[ep, ("OTEL_TRACES_SAMPLER", "always_off")]),
            SamplerSpec::AlwaysOff
        );
        assert_eq!(
            s(&[
                ep,
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25")
            ]),
            SamplerSpec::ParentBased(RootSampler::Ratio(0.25))
        );
        let (st, w) = parse(&[
            ep,
            ("OTEL_TRACES_SAMPLER", "traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
        ]);
        assert_eq!(st.expect("on").sampler, SamplerSpec::Ratio(1.0));
        assert_eq!(w[0].var, "OTEL_TRACES_SAMPLER_ARG");
        let (st, w) = parse(&[ep, ("OTEL_TRACES_SAMPLER", "sometimes")]);
        assert_eq!(
            st.expect("on").sampler,
            SamplerSpec::ParentBased(RootSampler::AlwaysOn)
        );
        assert_eq!(
            (w[0].var, w[0].value.as_str()),
            ("OTEL_TRACES_SAMPLER", "sometimes")
        );
    }

    #[test]
    fn service_name_defaults_to_loxilb_unless_the_environment_names_it() {
        let name = |vars: &[(&str, &str)]| {
            let m: HashMap<&str, &str> = vars.iter().copied().collect();
            let r = resource(&|k| m.get(k).map(|v| v.to_string()));
            r.get(&opentelemetry::Key::new("service.name"))
                .map(|v| v.to_string())
        };
        assert_eq!(name(&[]).as_deref(), Some("loxilb"));
    }
}
