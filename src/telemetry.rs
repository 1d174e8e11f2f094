//! Process telemetry: structured logs (text or JSON) and, optionally, OTLP/gRPC trace export.
//!
//! One filter string (`RUST_LOG` syntax, e.g. `info,continuum_actors=debug`) decides both what
//! is logged and which spans are exported, so "I see it in the log" and "I see it in Jaeger"
//! agree. The exporter's own crates (tonic, hyper, h2, tower, opentelemetry) are never exported:
//! their spans would describe the export itself and feed back into it.
//!
//! Export never blocks or fails the daemon: the tonic channel connects lazily, the SDK's batch
//! processor exports from its own thread with a bounded timeout, and a missing collector only
//! produces rate-limited `BatchSpanProcessor.ExportError` warnings in the log.
//!
//! `main` calls [`init`] once inside the tokio runtime and [`TelemetryGuard::shutdown`] on exit.
//! Tests build the same layers without a global subscriber through [`layers`] / [`subscriber`]
//! and install them with `tracing::subscriber::set_default`.

pub mod metrics_push;

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithTonicConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Subscriber;
use tracing_subscriber::filter::{EnvFilter, ParseError};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{Layer, Registry};

/// How long one OTLP export may take before the batch processor gives up on that batch. It also
/// bounds [`TelemetryGuard::shutdown`] when a collector accepts connections but never answers.
pub const OTLP_EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the batch processor exports finished spans (the SDK default is 5 s), so short spans
/// such as `actor.start` reach the collector about a second after they end.
/// `OTEL_BSP_SCHEDULE_DELAY` (milliseconds), when set, wins.
pub const OTLP_SCHEDULE_DELAY: Duration = Duration::from_secs(1);

/// Targets never exported as spans: the export pipeline's own instrumentation.
const EXPORT_PIPELINE_TARGETS: &[&str] = &[
    "h2",
    "hyper",
    "hyper_util",
    "tonic",
    "tower",
    "opentelemetry",
    "opentelemetry_sdk",
    "opentelemetry_otlp",
];

pub use crate::config::LogFormat;
use crate::config::TelemetryConfig;

/// What [`init`] sets up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TelemetryOptions {
    pub log_format: LogFormat,
    /// An `EnvFilter` directive string, e.g. `info` or `info,continuum_actors=debug`.
    pub log_level: String,
    /// The OpenTelemetry `service.name` resource attribute.
    pub service_name: String,
    /// `http://host:4317` of an OTLP/gRPC collector (Jaeger, otelcol); `None` disables export.
    pub otlp_endpoint: Option<String>,
}

impl Default for TelemetryOptions {
    fn default() -> Self {
        Self {
            log_format: LogFormat::Text,
            log_level: "info".to_owned(),
            service_name: "continuum-router".to_owned(),
            otlp_endpoint: None,
        }
    }
}

impl From<&TelemetryConfig> for TelemetryOptions {
    fn from(config: &TelemetryConfig) -> Self {
        Self {
            log_format: config.log_format,
            log_level: config.log_level.clone(),
            service_name: config.service_name.clone(),
            otlp_endpoint: config.otlp.as_ref().map(|otlp| otlp.endpoint.clone()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid log filter {filter:?}: {source}")]
    Filter {
        filter: String,
        #[source]
        source: ParseError,
    },
    /// `tracing_subscriber`'s directive parser slices by character position, so a non-ASCII
    /// directive can panic it (found by the `config_yaml` fuzz target); such filters are refused.
    #[error("invalid log filter {0:?}: only ASCII characters are allowed")]
    FilterNotAscii(String),
    #[error("invalid OTLP exporter configuration for {endpoint:?}: {message}")]
    Exporter { endpoint: String, message: String },
    #[error("OTLP export needs a tokio runtime: call telemetry::init inside the runtime")]
    NoRuntime,
    #[error("a global tracing subscriber is already installed: {0}")]
    AlreadyInstalled(String),
    #[error("flushing or shutting down the trace exporter failed: {0}")]
    Export(String),
}

/// Keeps the trace pipeline alive; [`TelemetryGuard::shutdown`] flushes it.
#[derive(Debug, Default)]
#[must_use = "dropping the guard without shutdown() may lose the last spans"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// The tracer provider when OTLP export is on.
    pub fn tracer_provider(&self) -> Option<&SdkTracerProvider> {
        self.provider.as_ref()
    }

    /// Exports every span ended so far. The SDK blocks the calling thread while it waits for
    /// its export thread, so this runs on tokio's blocking pool.
    pub async fn force_flush(&self) -> Result<(), TelemetryError> {
        let Some(provider) = self.provider.clone() else {
            return Ok(());
        };
        blocking(move || provider.force_flush()).await
    }

    /// Flushes and stops the exporter. Bounded by [`OTLP_EXPORT_TIMEOUT`] per pending batch
    /// when a collector hangs; immediate when none listens.
    pub async fn shutdown(mut self) -> Result<(), TelemetryError> {
        let Some(provider) = self.provider.take() else {
            return Ok(());
        };
        blocking(move || provider.shutdown()).await
    }
}

async fn blocking(
    work: impl FnOnce() -> opentelemetry_sdk::error::OTelSdkResult + Send + 'static,
) -> Result<(), TelemetryError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(TelemetryError::Export(error.to_string())),
        Err(join) => Err(TelemetryError::Export(join.to_string())),
    }
}

/// Installs the global subscriber: filtered fmt layer (text or JSON) plus, with an endpoint,
/// the OTLP trace layer. Also routes `log` records into tracing and sets the global tracer
/// provider and W3C trace-context propagator for code that uses OpenTelemetry directly.
pub fn init(options: &TelemetryOptions) -> Result<TelemetryGuard, TelemetryError> {
    let (layer, guard) = layers::<Registry>(options)?;
    install(tracing_subscriber::registry().with(layer), guard)
}

/// [`init`] with the log lines going to `writer`, without ANSI colours. Tests pass
/// `tracing_subscriber::fmt::TestWriter` so the log of a passing test stays captured.
pub fn init_with_writer<W>(
    options: &TelemetryOptions,
    writer: W,
) -> Result<TelemetryGuard, TelemetryError>
where
    W: for<'writer> MakeWriter<'writer> + Send + Sync + 'static,
{
    let (subscriber, guard) = subscriber_with_writer(options, writer)?;
    install(subscriber, guard)
}

fn install(
    subscriber: impl Subscriber + Send + Sync + 'static,
    guard: TelemetryGuard,
) -> Result<TelemetryGuard, TelemetryError> {
    subscriber
        .try_init()
        .map_err(|error| TelemetryError::AlreadyInstalled(error.to_string()))?;
    if let Some(provider) = guard.tracer_provider() {
        opentelemetry::global::set_tracer_provider(provider.clone());
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
    }
    Ok(guard)
}

/// The subscriber [`init`] installs, for a scoped `tracing::subscriber::set_default`.
pub fn subscriber(
    options: &TelemetryOptions,
) -> Result<(impl Subscriber + Send + Sync + 'static, TelemetryGuard), TelemetryError> {
    let (layer, guard) = layers::<Registry>(options)?;
    Ok((tracing_subscriber::registry().with(layer), guard))
}

/// [`subscriber`] with the log lines going to `writer` (see [`init_with_writer`]).
pub fn subscriber_with_writer<W>(
    options: &TelemetryOptions,
    writer: W,
) -> Result<(impl Subscriber + Send + Sync + 'static, TelemetryGuard), TelemetryError>
where
    W: for<'writer> MakeWriter<'writer> + Send + Sync + 'static,
{
    let (layer, guard) = layers_with_writer::<Registry, W>(options, writer)?;
    Ok((tracing_subscriber::registry().with(layer), guard))
}

/// The layers of [`init`] (log output to stdout), to compose with other layers in tests. Text
/// logs carry ANSI colours only when stdout is a terminal (not in a file, a pipe or a journal).
pub fn layers<S>(
    options: &TelemetryOptions,
) -> Result<(Box<dyn Layer<S> + Send + Sync + 'static>, TelemetryGuard), TelemetryError>
where
    S: Subscriber + for<'span> LookupSpan<'span> + Send + Sync,
{
    use std::io::IsTerminal as _;
    build_layers(options, std::io::stdout, std::io::stdout().is_terminal())
}

/// [`layers`] with the log lines going to `writer`, without ANSI colours (a writer other than
/// stdout is a file or a buffer).
pub fn layers_with_writer<S, W>(
    options: &TelemetryOptions,
    writer: W,
) -> Result<(Box<dyn Layer<S> + Send + Sync + 'static>, TelemetryGuard), TelemetryError>
where
    S: Subscriber + for<'span> LookupSpan<'span> + Send + Sync,
    W: for<'writer> MakeWriter<'writer> + Send + Sync + 'static,
{
    build_layers(options, writer, false)
}

fn build_layers<S, W>(
    options: &TelemetryOptions,
    writer: W,
    ansi: bool,
) -> Result<(Box<dyn Layer<S> + Send + Sync + 'static>, TelemetryGuard), TelemetryError>
where
    S: Subscriber + for<'span> LookupSpan<'span> + Send + Sync,
    W: for<'writer> MakeWriter<'writer> + Send + Sync + 'static,
{
    let log_filter = parse_filter(&options.log_level)?;
    let fmt = match options.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(writer)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(writer)
            .boxed(),
    }
    .with_filter(log_filter);

    let Some(endpoint) = options.otlp_endpoint.as_deref() else {
        return Ok((fmt.boxed(), TelemetryGuard::default()));
    };
    let provider = tracer_provider(endpoint, &options.service_name)?;
    let mut trace_filter = parse_filter(&options.log_level)?;
    for target in EXPORT_PIPELINE_TARGETS {
        trace_filter = trace_filter.add_directive(
            format!("{target}=off")
                .parse()
                .expect("a crate name and a level form a valid directive"),
        );
    }
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("continuum-router"))
        .with_filter(trace_filter);
    Ok((
        fmt.and_then(otel).boxed(),
        TelemetryGuard {
            provider: Some(provider),
        },
    ))
}

/// Parses an `EnvFilter` directive string; refuses non-ASCII text before the parser sees it.
fn parse_filter(filter: &str) -> Result<EnvFilter, TelemetryError> {
    if !filter.is_ascii() {
        return Err(TelemetryError::FilterNotAscii(filter.to_owned()));
    }
    EnvFilter::builder()
        .parse(filter)
        .map_err(|source| TelemetryError::Filter {
            filter: filter.to_owned(),
            source,
        })
}

fn tracer_provider(
    endpoint: &str,
    service_name: &str,
) -> Result<SdkTracerProvider, TelemetryError> {
    // tonic's lazy channel spawns its connection worker on the current runtime; without one it
    // would panic, so refuse cleanly instead.
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(TelemetryError::NoRuntime);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(OTLP_EXPORT_TIMEOUT)
        .with_retry_policy(opentelemetry_otlp::RetryPolicy::recommended())
        .build()
        .map_err(|error| TelemetryError::Exporter {
            endpoint: endpoint.to_owned(),
            message: error.to_string(),
        })?;
    let resource = Resource::builder()
        .with_service_name(service_name.to_owned())
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .build();
    // The SDK's batch processor exports from a dedicated thread; the tonic channel it drives runs
    // on the tokio runtime. (The tokio-task variant is still behind an experimental SDK feature.)
    let mut batch = opentelemetry_sdk::trace::BatchConfigBuilder::default();
    if std::env::var_os("OTEL_BSP_SCHEDULE_DELAY").is_none() {
        batch = batch.with_scheduled_delay(OTLP_SCHEDULE_DELAY);
    }
    let processor = opentelemetry_sdk::trace::BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch.build())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource)
        .build())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex, PoisonError};

    use super::*;

    /// Collects log output in memory.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().unwrap_or_else(PoisonError::into_inner))
                .into_owned()
        }
    }

    fn log_with(options: &TelemetryOptions, body: impl FnOnce()) -> String {
        let captured = Captured::default();
        let writer = captured.clone();
        let (layer, guard) =
            layers_with_writer::<Registry, _>(options, move || writer.clone()).expect("layers");
        assert!(guard.tracer_provider().is_none());
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), body);
        captured.text()
    }

    #[test]
    fn json_lines_carry_fields_and_span_context() {
        let options = TelemetryOptions {
            log_format: LogFormat::Json,
            log_level: "info".to_owned(),
            ..TelemetryOptions::default()
        };
        let text = log_with(&options, || {
            let span = tracing::info_span!("dispatch", worker_id = 7);
            let _entered = span.enter();
            tracing::warn!(error = "gap", "Dropped kv-events batch after gap.");
            tracing::debug!("Filtered out at info.");
        });
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|line| serde_json::from_str(line).expect("one JSON object per line"))
            .collect();
        assert_eq!(lines.len(), 1, "{text}");
        let line = &lines[0];
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["message"], "Dropped kv-events batch after gap.");
        assert_eq!(line["error"], "gap");
        assert_eq!(line["span"]["name"], "dispatch");
        assert_eq!(line["span"]["worker_id"], 7);
    }

    #[test]
    fn text_lines_follow_the_filter_directives() {
        let options = TelemetryOptions {
            log_level: "warn,continuum_router=debug".to_owned(),
            ..TelemetryOptions::default()
        };
        let text = log_with(&options, || {
            tracing::debug!(target: "continuum_router::probe", "Kept by the crate directive.");
            tracing::info!(target: "other_crate", "Dropped by the default level.");
        });
        assert!(text.contains("Kept by the crate directive."), "{text}");
        assert!(!text.contains("Dropped by the default level."), "{text}");
        assert!(!text.starts_with('{'), "text format, not JSON: {text}");
        assert!(
            !text.contains('\x1b'),
            "no ANSI colour codes in a non-terminal writer: {text:?}"
        );
    }

    #[test]
    fn a_bad_filter_is_a_clear_error() {
        let options = TelemetryOptions {
            log_level: "info,=[".to_owned(),
            ..TelemetryOptions::default()
        };
        let error = layers::<Registry>(&options)
            .err()
            .expect("bad filter refused");
        assert!(matches!(error, TelemetryError::Filter { .. }), "{error}");
    }

    #[test]
    fn otlp_without_a_runtime_is_refused_not_a_panic() {
        let options = TelemetryOptions {
            otlp_endpoint: Some("http://127.0.0.1:4317".to_owned()),
            ..TelemetryOptions::default()
        };
        let error = layers::<Registry>(&options).err().expect("no runtime here");
        assert!(matches!(error, TelemetryError::NoRuntime), "{error}");
    }

    #[test]
    fn the_yaml_section_maps_onto_options() {
        let yaml = "telemetry:\n  log_format: json\n  log_level: debug\n  otlp:\n    endpoint: \"http://127.0.0.1:4317\"\n";
        let config = crate::config::Config::from_yaml_str(yaml, &crate::config::ProcessEnv)
            .expect("valid section");
        let options = TelemetryOptions::from(&config.telemetry);
        assert_eq!(options.log_format, LogFormat::Json);
        assert_eq!(options.log_level, "debug");
        assert_eq!(options.service_name, "continuum-router");
        assert_eq!(
            options.otlp_endpoint.as_deref(),
            Some("http://127.0.0.1:4317")
        );
        let empty = crate::config::Config::from_yaml_str("{}", &crate::config::ProcessEnv)
            .expect("all defaults");
        assert_eq!(
            TelemetryOptions::from(&empty.telemetry),
            TelemetryOptions::default()
        );
        // A typo must not silently disable export.
        let typo = "telemetry:\n  otlp:\n    endpiont: x\n";
        assert!(crate::config::Config::from_yaml_str(typo, &crate::config::ProcessEnv).is_err());
    }

    /// Fuzz finding: the directive parser slices by character position; non-ASCII is refused
    /// before it can panic.
    #[test]
    fn a_non_ascii_filter_is_refused_not_parsed() {
        assert!(matches!(
            parse_filter("a[\u{e9}]"),
            Err(TelemetryError::FilterNotAscii(_))
        ));
        assert!(parse_filter("info,continuum_router=debug").is_ok());
    }

    #[test]
    fn the_deploy_example_parses() {
        let example = crate::config::Config::from_yaml_str(
            include_str!("../deploy/observability/router-otlp.yaml"),
            &crate::config::ProcessEnv,
        )
        .expect("deploy/observability/router-otlp.yaml parses");
        let options = TelemetryOptions::from(&example.telemetry);
        assert_eq!(
            options.otlp_endpoint.as_deref(),
            Some("http://127.0.0.1:4317")
        );
        assert!(parse_filter(&options.log_level).is_ok());
    }

    #[test]
    fn log_format_reads_from_config_text() {
        let format: LogFormat = serde_json::from_str("\"json\"").expect("json");
        assert_eq!(format, LogFormat::Json);
        let format: LogFormat = serde_json::from_str("\"text\"").expect("text");
        assert_eq!(format, LogFormat::Text);
        assert!(serde_json::from_str::<LogFormat>("\"xml\"").is_err());
    }
}
