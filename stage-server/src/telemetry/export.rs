//! The OTLP/HTTP protobuf pipeline: a tracer provider over the [`QueueingProcessor`], a meter provider over
//! the SDK's `PeriodicReader` (its own thread), both exporting through one [`BlockingClient`], and the
//! instruments that read the [`registry`](super::registry) when the reader collects.

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Histogram, MeterProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::SdkTracerProvider;

use super::client::{AbortHandle, BlockingClient};
use super::names::{self, Kind};
use super::processor::{QueueConfig, QueueingProcessor};
use super::registry::{self, Value};

/// How the exporter runs.
#[derive(Clone, Debug)]
pub struct OtlpConfig {
    /// The collector's base URL (`http://host:4318`); `/v1/traces` and `/v1/metrics` are appended unless
    /// the URL already names a path.
    pub endpoint: String,
    /// How long one export may take (connect, and each read and write).
    pub timeout: Duration,
    /// The span queue.
    pub queue: QueueConfig,
    /// How often metrics are pushed.
    pub metrics_interval: Duration,
    /// Which spans are exported (`RUST_LOG` syntax); `None`: `STAGE_SERVER_OTLP_FILTER`, else `info`.
    pub span_filter: Option<String>,
}

impl OtlpConfig {
    /// Defaults for `endpoint`: 2 s export timeout, a queue of 2048 spans (or `STAGE_SERVER_OTLP_QUEUE`) in
    /// batches of 512 every second, metrics every 5 s.
    pub fn new(endpoint: impl Into<String>) -> OtlpConfig {
        let mut queue = QueueConfig::default();
        if let Some(capacity) = std::env::var(super::OTLP_QUEUE_ENV)
            .ok()
            .and_then(|text| text.trim().parse::<usize>().ok())
        {
            queue.capacity = capacity.max(1);
            queue.max_batch = queue.max_batch.min(queue.capacity);
        }
        OtlpConfig {
            endpoint: endpoint.into(),
            timeout: Duration::from_secs(2),
            queue,
            metrics_interval: Duration::from_secs(5),
            span_filter: None,
        }
    }

    /// The URL of one signal (`traces`, `metrics`).
    pub fn signal_url(&self, signal: &str) -> String {
        let base = self.endpoint.trim_end_matches('/');
        let after_scheme = base.split_once("://").map_or(base, |(_, rest)| rest);
        if after_scheme.contains('/') {
            base.to_owned()
        } else {
            format!("{base}/v1/{signal}")
        }
    }
}

/// The running pipeline.
#[derive(Debug)]
pub(crate) struct Pipeline {
    pub(crate) tracer: SdkTracerProvider,
    pub(crate) meter: SdkMeterProvider,
    pub(crate) abort: AbortHandle,
}

/// The OTLP histograms, set once the pipeline runs.
static HISTOGRAMS: OnceLock<Vec<(&'static str, Histogram<f64>)>> = OnceLock::new();

/// Records `seconds` into the OTLP histogram `name`, if an exporter runs (a lookup in a short list).
pub fn record_histogram(name: &'static str, seconds: f64) {
    if let Some(histograms) = HISTOGRAMS.get()
        && let Some((_, histogram)) = histograms.iter().find(|(known, _)| *known == name)
    {
        histogram.record(seconds, &[]);
    }
}

/// Builds the pipeline; the error says what in the configuration is wrong.
pub(crate) fn start(config: &OtlpConfig, resource: Resource) -> Result<Pipeline, String> {
    let client = BlockingClient::new(config.timeout);
    let abort = client.abort_handle();
    let spans = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client.clone())
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(config.signal_url("traces"))
        .with_timeout(config.timeout)
        .build()
        .map_err(|error| format!("the OTLP span exporter: {error}"))?;
    let processor = QueueingProcessor::new(spans, config.queue)
        .map_err(|error| format!("the span export thread did not start: {error}"))?;
    let tracer = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource.clone())
        .build();
    let metrics = opentelemetry_otlp::MetricExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(config.signal_url("metrics"))
        .with_timeout(config.timeout)
        .build()
        .map_err(|error| format!("the OTLP metric exporter: {error}"))?;
    let reader = PeriodicReader::builder(metrics)
        .with_interval(config.metrics_interval)
        .build();
    let meter = SdkMeterProvider::builder()
        .with_reader(reader)
        .with_resource(resource)
        .build();
    register_instruments(&meter);
    Ok(Pipeline {
        tracer,
        meter,
        abort,
    })
}

/// One instrument per metric name: counters and gauges observe the registry when the reader collects,
/// histograms are recorded as they happen.
fn register_instruments(provider: &SdkMeterProvider) {
    let meter = provider.meter("stage-server");
    let mut histograms = Vec::new();
    for &(name, kind, help) in names::METRICS {
        match kind {
            Kind::Counter => {
                let _ = meter
                    .f64_observable_counter(name)
                    .with_description(help)
                    .with_callback(move |observer| {
                        for (value, labels) in values_of(name) {
                            observer.observe(value, &labels);
                        }
                    })
                    .build();
            }
            Kind::Gauge => {
                let _ = meter
                    .f64_observable_gauge(name)
                    .with_description(help)
                    .with_callback(move |observer| {
                        for (value, labels) in values_of(name) {
                            observer.observe(value, &labels);
                        }
                    })
                    .build();
            }
            Kind::Histogram => {
                let histogram = meter
                    .f64_histogram(name)
                    .with_description(help)
                    .with_unit(if name.ends_with("_seconds") { "s" } else { "1" })
                    .build();
                histograms.push((name, histogram));
            }
        }
    }
    let _ = HISTOGRAMS.set(histograms);
}

/// The current values of metric `name`. Each instrument's callback collects everything and keeps its own:
/// a few dozen samples once per push interval.
fn values_of(name: &str) -> Vec<(f64, Vec<KeyValue>)> {
    registry::all_samples()
        .into_iter()
        .filter(|sample| sample.name == name)
        .filter_map(|sample| match sample.value {
            Value::Number(value) => Some((
                value,
                sample
                    .labels
                    .into_iter()
                    .map(|(key, value)| KeyValue::new(key, value))
                    .collect(),
            )),
            Value::Histogram { .. } => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_url_gets_the_signal_path_and_a_full_url_is_kept() {
        let config = OtlpConfig::new("http://127.0.0.1:4318");
        assert_eq!(
            config.signal_url("traces"),
            "http://127.0.0.1:4318/v1/traces"
        );
        let config = OtlpConfig::new("http://collector:4318/");
        assert_eq!(
            config.signal_url("metrics"),
            "http://collector:4318/v1/metrics"
        );
        let config = OtlpConfig::new("http://collector:4318/custom");
        assert_eq!(config.signal_url("traces"), "http://collector:4318/custom");
    }
}
