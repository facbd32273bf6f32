//! Telemetry: the `tracing` subscriber the binaries install (text or JSON logs, `RUST_LOG` filters), W3C
//! trace context across the stage links, OTLP/HTTP export on plain threads, and the metrics every stage
//! serves on `/metrics`.
//!
//! ```text
//!   spans (tracing) ──▶ registry ─┬─▶ fmt layer (RUST_LOG, default info) ──▶ stderr, text or JSON
//!                                 └─▶ OpenTelemetry layer (STAGE_SERVER_OTLP_FILTER, default info)
//!                                        └─▶ QueueingProcessor (bounded, drops and counts) ──▶ thread ──┐
//!   metrics (atomics in registry) ──▶ /metrics (Prometheus text)                                       ├─▶ BlockingClient
//!                                └──▶ PeriodicReader (its own thread) ─────────────────────────────────┘   OTLP/HTTP protobuf
//! ```
//!
//! Libraries never install a subscriber: [`init`] is for the binary (and tests). Nothing here needs an async
//! runtime, and nothing on a serving path waits for an export: spans are queued under a short lock or
//! dropped, metrics are atomics read by the reader's own thread. Trace context crosses processes in the
//! `Configure` frame's `trace` field ([`TraceContext`]).
//!
//! Held spans are never entered. `tracing-opentelemetry` (0.32) stamps a span's end time at its *last
//! exit* and uses its close only when it was never entered; a span that is entered in one hook and held
//! across later ones (the HTTP request across the whole generation, a stage's session across its frames)
//! would end at the first hook's return. So such a span is a parent by `parent: &span`, its fields are
//! recorded on the handle, its context is read with [`trace_context_of`], and it ends when its last handle
//! (its holder's, its children's) closes. Only spans whose work is one scope (a generation on its lane, a
//! frame on the compute thread) are entered.

mod client;
mod context;
mod export;
mod metrics_http;
pub mod names;
mod processor;
pub mod registry;

use std::ops::Range;
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

pub use client::{AbortHandle, BlockingClient};
pub use context::TraceContext;
pub use export::{OtlpConfig, record_histogram};
pub use metrics_http::MetricsListener;
pub use processor::{EXPORT_COUNTERS, ExportCounters, QueueConfig, QueueingProcessor};

/// The environment variable naming the collector when `--otlp-endpoint` is not given.
pub const OTLP_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The environment variable with the filter of the spans that are exported (`RUST_LOG` syntax; default
/// `info`: requests, generations and stage sessions; `stage_server=trace` adds every frame).
pub const OTLP_FILTER_ENV: &str = "STAGE_SERVER_OTLP_FILTER";
/// The environment variable with the span queue's capacity (default 2048): a full queue drops and counts.
pub const OTLP_QUEUE_ENV: &str = "STAGE_SERVER_OTLP_QUEUE";
/// How long a shutdown waits for the last export at most: `run` flushes its own while its stage processes
/// flush theirs (all at once), so a black-hole collector costs an exit about this once.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_millis(750);

/// How logs are written on stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object a line.
    Json,
}

impl LogFormat {
    /// `text` or `json`.
    pub fn parse(text: &str) -> Result<LogFormat, String> {
        match text {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("`{other}` is not a log format; use text or json")),
        }
    }
}

/// What this process is, for the OTLP resource.
#[derive(Clone, Debug, Default)]
pub struct Identity {
    /// The stage's index in the chain (0 drives it and serves the API).
    pub stage_index: Option<u16>,
    /// The stage's layers.
    pub layers: Option<Range<usize>>,
    /// The model id.
    pub model_id: Option<String>,
}

/// What [`init`] sets up.
#[derive(Clone, Debug, Default)]
pub struct TelemetryOptions {
    /// How logs look.
    pub log_format: LogFormat,
    /// The OTLP exporter, if any.
    pub otlp: Option<OtlpConfig>,
    /// The process's identity.
    pub identity: Identity,
}

/// The installed telemetry; [`Telemetry::shutdown`] (or the drop) flushes the exporter within
/// [`SHUTDOWN_TIMEOUT`].
#[derive(Debug)]
pub struct Telemetry {
    pipeline: Option<export::Pipeline>,
}

/// The collector from `--otlp-endpoint` or, without it, `OTEL_EXPORTER_OTLP_ENDPOINT` (empty means none).
pub fn otlp_endpoint(flag: Option<&str>) -> Option<String> {
    flag.map(str::to_owned)
        .or_else(|| std::env::var(OTLP_ENDPOINT_ENV).ok())
        .filter(|endpoint| !endpoint.trim().is_empty())
}

/// Installs the process's subscriber (once; a second call changes nothing but returns a working guard) and,
/// with `options.otlp`, the exporter. An exporter that cannot be built is reported on stderr and left out:
/// telemetry never stops a stage from serving.
pub fn init(options: TelemetryOptions) -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt: Box<dyn Layer<Registry> + Send + Sync> = match options.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    let mut layers = vec![fmt];
    let mut pipeline = None;
    if let Some(config) = &options.otlp {
        match export::start(config, resource(&options.identity)) {
            Ok(started) => {
                let otlp_filter = config
                    .span_filter
                    .clone()
                    .or_else(|| std::env::var(OTLP_FILTER_ENV).ok())
                    .and_then(|text| EnvFilter::try_new(text).ok())
                    .unwrap_or_else(|| EnvFilter::new("info"));
                let tracer = started.tracer.tracer("stage-server");
                layers.push(
                    tracing_opentelemetry::layer()
                        .with_tracer(tracer)
                        .with_threads(false)
                        .with_filter(otlp_filter)
                        .boxed(),
                );
                pipeline = Some(started);
            }
            Err(error) => eprintln!("stage-server: telemetry export is off: {error}"),
        }
    }
    let installed = tracing_subscriber::registry()
        .with(layers)
        .try_init()
        .is_ok();
    if !installed && pipeline.is_some() {
        eprintln!("stage-server: a subscriber was already installed; spans are not exported");
    }
    if let (Some(pipeline), Some(config)) = (&pipeline, &options.otlp) {
        let _ = pipeline;
        tracing::info!(endpoint = %config.endpoint, "exporting telemetry over OTLP/HTTP");
    }
    Telemetry { pipeline }
}

impl Telemetry {
    /// Whether an exporter runs.
    pub fn exporting(&self) -> bool {
        self.pipeline.is_some()
    }

    /// Flushes what is queued and stops the exporter, within [`SHUTDOWN_TIMEOUT`] whatever the collector
    /// does (a collector that never answers has its connection cut at the deadline).
    pub fn shutdown(&mut self) {
        let Some(pipeline) = self.pipeline.take() else {
            return;
        };
        let started = Instant::now();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let abort = pipeline.abort.clone();
        // The watchdog cuts the exports at the deadline; it ends early when the shutdown does.
        let watchdog = std::thread::Builder::new()
            .name("otlp-shutdown".into())
            .spawn(move || {
                if stopped.recv_timeout(SHUTDOWN_TIMEOUT).is_err() {
                    abort.abort();
                }
            });
        // Errors here mean the collector is down or slow; the process is ending, so they are not reported.
        let _ = pipeline.tracer.shutdown_with_timeout(SHUTDOWN_TIMEOUT);
        let _ = pipeline
            .meter
            .shutdown_with_timeout(SHUTDOWN_TIMEOUT.saturating_sub(started.elapsed()));
        let _ = stop.send(());
        pipeline.abort.abort();
        if let Ok(watchdog) = watchdog {
            let _ = watchdog.join();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The trace context of the current span, to carry to the next stage; `None` when nothing is exported.
pub fn current_trace_context() -> Option<TraceContext> {
    trace_context_of(&tracing::Span::current())
}

/// The trace context of `span`, read without entering it (see [the module doc](self) on held spans);
/// `None` when nothing is exported.
pub fn trace_context_of(span: &tracing::Span) -> Option<TraceContext> {
    let context = span.context();
    let otel = context.span();
    TraceContext::from_span_context(otel.span_context())
}

/// Makes `span` a child of the remote span `parent` (from a `traceparent` header or a `Configure` frame).
pub fn continue_trace(span: &tracing::Span, parent: &TraceContext) {
    let context = opentelemetry::Context::new().with_remote_span_context(parent.to_span_context());
    let _ = span.set_parent(context);
}

/// The OTLP resource of this process.
fn resource(identity: &Identity) -> Resource {
    let mut attributes = vec![KeyValue::new("host.name", host_name())];
    if let Some(index) = identity.stage_index {
        attributes.push(KeyValue::new("stage.index", i64::from(index)));
    }
    if let Some(layers) = &identity.layers {
        attributes.push(KeyValue::new("stage.layer_start", layers.start as i64));
        attributes.push(KeyValue::new("stage.layer_end", layers.end as i64));
    }
    if let Some(model) = &identity.model_id {
        attributes.push(KeyValue::new("model.id", model.clone()));
    }
    attributes.push(KeyValue::new("process.pid", i64::from(std::process::id())));
    Resource::builder()
        .with_service_name("stage-server")
        .with_attributes(attributes)
        .build()
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".to_owned())
}
