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
    let env_filter = log_filter(filter)?;
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

/// The target of netlink-packet-route's parse warning about kernel attributes newer than the
/// crate (`Specified IFLA_INET6_CONF NLA attribute holds more(most likely new kernel) data which
/// is unknown to netlink-packet-route crate, expecting 236, got 240`), logged on every link dump,
/// so on each daemon start. It is harmless: the extra bytes are attributes loxi does not read.
pub const NETLINK_PARSE_TARGET: &str = "netlink_packet_route";

/// The `zeromq` crate's target: it logs every reconnect of a KV-event socket (`Successfully
/// reconnected`, warnings per failed attempt), several lines a second while a publisher is
/// down or is cut for oversized messages. loxi's subscriber reports the same itself
/// (`loxilb_kv_subscriber_connected`, `..._reconnects_total`, its own rate-limited lines).
pub const ZEROMQ_TARGET: &str = "zeromq";

/// Library targets whose warnings are off (errors still show) unless the filter names them.
const QUIET_TARGETS: [&str; 2] = [NETLINK_PARSE_TARGET, ZEROMQ_TARGET];

/// The log layer's filter: `filter` (the `--log` flag), trace spans off (see [`SPAN_TARGET`])
/// and the warnings of [`NETLINK_PARSE_TARGET`] and [`ZEROMQ_TARGET`] off (errors still show),
/// unless `filter` names that target itself (`--log info,netlink_packet_route=warn` shows
/// them).
fn log_filter(filter: &str) -> Result<EnvFilter, TelemetryError> {
    let mut f = EnvFilter::try_new(filter)
        .map_err(|source| TelemetryError::Filter {
            filter: filter.to_string(),
            source,
        })?
        .add_directive(off_directive());
    for target in QUIET_TARGETS {
        if !filter.contains(target) {
            f = f.add_directive(directive(&format!("{target}=error")));
        }
    }
    Ok(f)
}

/// A constant directive; the parse cannot fail (each use is covered by a unit test), the
/// fallback is `error`.
fn directive(text: &str) -> tracing_subscriber::filter::Directive {
    text.parse()
        .unwrap_or_else(|_| tracing::Level::ERROR.into())
}

/// `loxi::trace=off` for the log layer: trace spans are for the exporter only.
fn off_directive() -> tracing_subscriber::filter::Directive {
    directive(&format!("{SPAN_TARGET}=off"))
}

/// A log sink for tests: a `fmt` layer's writer (`with_writer(move || buf.clone())`) whose
/// lines [`LogBuf::text`] returns.
#[cfg(test)]
#[derive(Clone, Default)]
pub(crate) struct LogBuf(std::sync::Arc<parking_lot::Mutex<Vec<u8>>>);

#[cfg(test)]
impl LogBuf {
    /// Everything written so far.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock()).into_owned()
    }

    /// A log layer writing into this buffer: no colours, no time, so that tests compare
    /// whole lines. Events only: a layer enabling span callsites would, while its test runs,
    /// enable them for every thread (callsite interest is global) and make spans live in other
    /// tests' threads without a subscriber (`span::tests::spans_are_disabled_...`).
    pub(crate) fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + Send + Sync + 'static
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        use tracing_subscriber::Layer as _;
        let sink = self.clone();
        tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .without_time()
            .with_writer(move || sink.clone())
            .with_filter(tracing_subscriber::filter::filter_fn(|m| m.is_event()))
    }

    /// Runs `f` with a subscriber logging into a new buffer; its result and the lines logged.
    pub(crate) fn capture<T>(f: impl FnOnce() -> T) -> (T, String) {
        use tracing_subscriber::layer::SubscriberExt as _;
        let buf = Self::default();
        let out = tracing::subscriber::with_default(
            tracing_subscriber::registry().with(buf.layer()),
            || {
                // Callsite interest is global: one first hit on another test's thread while
                // this subscriber was being registered can be cached as "never"; recomputed
                // now that it is, so every event of `f` reaches the buffer.
                tracing::callsite::rebuild_interest_cache();
                f()
            },
        );
        (out, buf.text())
    }
}

#[cfg(test)]
impl std::io::Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
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

    /// The lines the log layer with `--log filter` writes for one warning and one error of
    /// `target`.
    fn logged(filter: &str, target: &'static str) -> String {
        let buf = LogBuf::default();
        let layer = buf
            .layer()
            .with_filter(log_filter(filter).expect("filter parses"));
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            // `tracing`'s macros need a literal target. (The crate logs through `log`, which
            // the daemon's subscriber forwards with the same target.)
            if target == NETLINK_PARSE_TARGET {
                tracing::warn!(target: "netlink_packet_route::link::buffer_tool", "nla parse warning");
                tracing::error!(target: "netlink_packet_route::link::buffer_tool", "nla parse error");
            } else if target == ZEROMQ_TARGET {
                tracing::info!(target: "zeromq::reconnect", "reconnected");
                tracing::warn!(target: "zeromq::reconnect", "reconnect failed");
                tracing::error!(target: "zeromq::reconnect", "broken");
            } else {
                tracing::warn!(target: "loxi_user::netlink", "nla parse warning");
                tracing::error!(target: "loxi_user::netlink", "nla parse error");
            }
        });
        buf.text()
    }

    #[test]
    fn netlink_parse_warnings_are_off_unless_the_filter_names_their_target() {
        let error = "ERROR netlink_packet_route::link::buffer_tool: nla parse error\n";
        let warn = " WARN netlink_packet_route::link::buffer_tool: nla parse warning\n";
        assert_eq!(logged("info", NETLINK_PARSE_TARGET), error);
        assert_eq!(logged("debug", NETLINK_PARSE_TARGET), error);
        assert_eq!(
            logged("info,netlink_packet_route=warn", NETLINK_PARSE_TARGET),
            format!("{warn}{error}")
        );
        assert_eq!(
            logged("info", "loxi_user::netlink"),
            " WARN loxi_user::netlink: nla parse warning\n\
             ERROR loxi_user::netlink: nla parse error\n"
        );
    }

    #[test]
    fn zeromq_reconnect_lines_are_off_unless_the_filter_names_their_target() {
        let error = "ERROR zeromq::reconnect: broken\n";
        assert_eq!(logged("info", ZEROMQ_TARGET), error);
        assert_eq!(logged("debug", ZEROMQ_TARGET), error);
        assert_eq!(
            logged("info,zeromq=info", ZEROMQ_TARGET),
            format!(
                " INFO zeromq::reconnect: reconnected\n WARN zeromq::reconnect: reconnect \
                 failed\n{error}"
            )
        );
    }

    #[test]
    fn bad_log_filter_is_an_error_naming_the_flag() {
        let e = init("loxi_user=[", LogFormat::Text, |_| None).expect_err("must fail");
        assert!(e.to_string().starts_with("--log \"loxi_user=[\""), "{e}");
    }
}
