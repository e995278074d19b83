//! Logs and traces of the daemon: the `tracing` subscriber (`--log` filter, `--log-format
//! text|json`) and, when the standard `OTEL_*` environment asks for it, OpenTelemetry traces
//! exported over OTLP (HTTP/protobuf).
//!
//! Traces are off by default. They are on when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, or `OTEL_TRACES_EXPORTER=otlp`; see [`otel`] for every
//! variable read and what is refused. The spans (one per proxied request with the routing
//! decision as attributes, children for tokenize / hash / score and each upstream attempt) are
//! `tracing` spans with target [`SPAN_TARGET`], built by [`span`]. Only the OpenTelemetry
//! layer listens to that target, so with traces off their callsites are disabled and cost a
//! branch; the log output never shows them.
pub mod otel;
pub mod span;

use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _, filter::Targets};

pub use otel::{OtelSettings, OtelWarning};

/// The `tracing` target of every span meant for OpenTelemetry (the log layer drops it).
pub const SPAN_TARGET: &str = "loxi::trace";

/// `--log-format`: how log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// `tracing_subscriber`'s human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields` (with `message`).
    Json,
}

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The `--log` filter does not parse.
    #[error("--log {filter:?}: {source}")]
    Filter {
        /// The filter as given.
        filter: String,
        /// The parser's error.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// A global subscriber was already installed.
    #[error("installing the log subscriber: {0}")]
    Init(#[from] tracing_subscriber::util::TryInitError),
}

/// Keeps the trace exporter alive; [`Telemetry::shutdown`] (or drop) flushes queued spans.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// Trace settings that were refused (log them once the subscriber is up).
    pub warnings: Vec<OtelWarning>,
}

impl Telemetry {
    /// Are traces exported?
    pub fn tracing_enabled(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports the spans still queued and stops the exporter (bounded by the SDK's export
    /// timeout, `OTEL_EXPORTER_OTLP_TIMEOUT`, 10 s by default).
    pub fn shutdown(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown()
        {
            tracing::warn!(error = %e, "flushing OpenTelemetry spans at shutdown");
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Installs the global subscriber: the log layer (`filter`, `format`, stderr) and, when
/// `lookup` (the process environment in the daemon) enables traces, the OpenTelemetry layer
/// and the W3C trace-context propagator.
pub fn init(
    filter: &str,
    format: LogFormat,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Telemetry, TelemetryError> {
    let env_filter = EnvFilter::try_new(filter)
        .map_err(|source| TelemetryError::Filter {
            filter: filter.to_string(),
            source,
        })?
        .add_directive(off_directive());
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_writer(std::io::stderr);
    let log = match format {
        LogFormat::Text => fmt.with_filter(env_filter).boxed(),
        LogFormat::Json => fmt.json().with_filter(env_filter).boxed(),
    };
    let (settings, mut warnings) = OtelSettings::from_lookup(&lookup);
    let provider = match settings.map(|s| s.provider(&lookup)) {
        Some(Ok(p)) => Some(p),
        Some(Err(w)) => {
            warnings.push(w);
            None
        }
        None => None,
    };
    let otel = provider.as_ref().map(|p| {
        use opentelemetry::trace::TracerProvider as _;
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("loxilb"))
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_level(false)
            .with_filter(Targets::new().with_target(SPAN_TARGET, tracing::Level::TRACE))
    });
    tracing_subscriber::registry()
        .with(log)
        .with(otel)
        .try_init()?;
    Ok(Telemetry { provider, warnings })
}

/// `loxi::trace=off` for the log layer: trace spans are for the exporter only.
fn off_directive() -> tracing_subscriber::filter::Directive {
    // A constant directive; the parse cannot fail (covered by a unit test).
    format!("{SPAN_TARGET}=off")
        .parse()
        .unwrap_or_else(|_| tracing::Level::ERROR.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_target_is_switched_off_for_the_log_layer() {
        let d: tracing_subscriber::filter::Directive = format!("{SPAN_TARGET}=off")
            .parse()
            .expect("directive parses");
        assert_eq!(d.to_string(), off_directive().to_string());
        assert_eq!(d.to_string(), "loxi::trace=off");
    }

    #[test]
    fn bad_log_filter_is_an_error_naming_the_flag() {
        let e = init("loxi_user=[", LogFormat::Text, |_| None).expect_err("must fail");
        assert!(e.to_string().starts_with("--log \"loxi_user=[\""), "{e}");
    }
}
