//! The process's metrics: lock-free counters and histograms that the stage's hot paths bump, the servers and
//! pools whose own statistics are read at collection time, and the Prometheus text rendering of all of them.
//!
//! Two kinds of sources: the process metrics here (one stage per process: compute, links, net-io-blocking
//! servers, task-runtime, telemetry itself), rendered by [`render_process`] on every `/metrics`; and
//! collectors (stage 0's API metrics, one per API server) that register with [`register_collector`] so the
//! OTLP reader sees them too. A bump is one relaxed atomic add; histograms also record into OTLP when an
//! exporter is installed.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use net_io_blocking::{CloseReason, RefusalCause, ServerHandle};

use super::names::{self, Kind};
use super::processor::EXPORT_COUNTERS;

/// Bucket bounds (seconds) of the per-step histograms: from a tiny model's 50 µs step to a long prefill.
pub const STEP_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2,
    2.5, 5.0,
];

/// Bucket bounds of the batch-size histogram (entries per forward pass).
pub const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0];

/// The most buckets a histogram here has.
const MAX_BUCKETS: usize = 16;

/// A value of one sample.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A counter's or gauge's value.
    Number(f64),
    /// A histogram: cumulative counts per bound of `bounds`, then the total count and the sum.
    Histogram {
        /// Upper bounds.
        bounds: &'static [f64],
        /// Observations at or below each bound.
        cumulative: Vec<u64>,
        /// Observations.
        count: u64,
        /// Their sum.
        sum: f64,
    },
}

/// One labelled value of a metric.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// A name from [`names`].
    pub name: &'static str,
    /// Label names and values.
    pub labels: Vec<(&'static str, String)>,
    /// The value.
    pub value: Value,
}

impl Sample {
    /// An unlabelled number.
    pub fn number(name: &'static str, value: f64) -> Sample {
        Sample {
            name,
            labels: Vec::new(),
            value: Value::Number(value),
        }
    }

    /// A labelled number.
    pub fn labelled(name: &'static str, labels: Vec<(&'static str, String)>, value: f64) -> Sample {
        Sample {
            name,
            labels,
            value: Value::Number(value),
        }
    }
}

/// A source of samples beyond the process metrics (stage 0's API metrics).
pub trait Collect: Send + Sync + std::fmt::Debug {
    /// Appends the current samples.
    fn collect(&self, out: &mut Vec<Sample>);
}

/// A histogram of atomics (over [`STEP_BUCKETS`] unless made with other bounds): observing is a few relaxed
/// adds, no lock.
#[derive(Debug)]
pub struct AtomicHistogram {
    name: &'static str,
    bounds: &'static [f64],
    counts: [AtomicU64; MAX_BUCKETS],
    count: AtomicU64,
    /// The sum of the observations, in billionths (nanoseconds for seconds).
    sum_nanos: AtomicU64,
}

impl AtomicHistogram {
    const fn new(name: &'static str) -> AtomicHistogram {
        AtomicHistogram::with_bounds(name, &STEP_BUCKETS)
    }

    /// A histogram over `bounds` (at most 16, ascending).
    const fn with_bounds(name: &'static str, bounds: &'static [f64]) -> AtomicHistogram {
        assert!(bounds.len() <= MAX_BUCKETS);
        AtomicHistogram {
            name,
            bounds,
            counts: [const { AtomicU64::new(0) }; MAX_BUCKETS],
            count: AtomicU64::new(0),
            sum_nanos: AtomicU64::new(0),
        }
    }

    /// Records one observation of `value` (seconds, or a count for a count histogram).
    pub fn observe(&self, value: f64) {
        // Only the first bucket at or above it: the rendering sums them up.
        if let Some(index) = self.bounds.iter().position(|bound| value <= *bound) {
            self.counts[index].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos
            .fetch_add((value * 1e9) as u64, Ordering::Relaxed);
        super::export::record_histogram(self.name, value);
    }

    fn sample(&self) -> Sample {
        let mut running = 0;
        let cumulative = self.counts[..self.bounds.len()]
            .iter()
            .map(|count| {
                running += count.load(Ordering::Relaxed);
                running
            })
            .collect();
        Sample {
            name: self.name,
            labels: Vec::new(),
            value: Value::Histogram {
                bounds: self.bounds,
                cumulative,
                count: self.count.load(Ordering::Relaxed),
                sum: self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            },
        }
    }
}

/// Which side of a stage a link is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkSide {
    /// Toward stage 0 (a link this stage accepted).
    Upstream = 0,
    /// Away from stage 0 (a link this stage opened, or stage 0's link to stage 1).
    Downstream = 1,
}

/// The metrics of this process's stage.
#[derive(Debug)]
pub struct StageMetrics {
    /// Compute time per step.
    pub compute: AtomicHistogram,
    /// Stage 0: a step's round trip down the chain.
    pub round_trip: AtomicHistogram,
    /// Entries (lanes) per forward pass.
    pub batch: AtomicHistogram,
    rows: AtomicU64,
    steps: AtomicU64,
    credit_waits: AtomicU64,
    sent: [AtomicU64; 2],
    received: [AtomicU64; 2],
}

impl StageMetrics {
    /// Counts one computed step of `rows` rows that took `seconds`.
    pub fn step(&self, rows: usize, seconds: f64) {
        self.rows.fetch_add(rows as u64, Ordering::Relaxed);
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.compute.observe(seconds);
    }

    /// Counts `bytes` written on a link.
    pub fn sent(&self, side: LinkSide, bytes: usize) {
        self.sent[side as usize].fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts `bytes` read from a link.
    pub fn received(&self, side: LinkSide, bytes: usize) {
        self.received[side as usize].fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts one wait for a reply credit.
    pub fn credit_wait(&self) {
        self.credit_waits.fetch_add(1, Ordering::Relaxed);
    }
}

/// The process's stage metrics.
pub static STAGE: StageMetrics = StageMetrics {
    compute: AtomicHistogram::new(names::STAGE_COMPUTE_SECONDS),
    round_trip: AtomicHistogram::new(names::LINK_ROUND_TRIP_SECONDS),
    batch: AtomicHistogram::with_bounds(names::BATCH_ENTRIES, &BATCH_BUCKETS),
    rows: AtomicU64::new(0),
    steps: AtomicU64::new(0),
    credit_waits: AtomicU64::new(0),
    sent: [const { AtomicU64::new(0) }; 2],
    received: [const { AtomicU64::new(0) }; 2],
};

type Servers = Mutex<Vec<(&'static str, ServerHandle)>>;

fn servers() -> &'static Servers {
    static SERVERS: OnceLock<Servers> = OnceLock::new();
    SERVERS.get_or_init(|| Mutex::new(Vec::new()))
}

fn collectors() -> &'static Mutex<Vec<Weak<dyn Collect>>> {
    static COLLECTORS: OnceLock<Mutex<Vec<Weak<dyn Collect>>>> = OnceLock::new();
    COLLECTORS.get_or_init(|| Mutex::new(Vec::new()))
}

/// Reports `handle`'s net-io-blocking statistics as server `name` (`links`, `api`, `metrics`) from now on.
/// A server registered again under the same name replaces the old one.
pub fn register_server(name: &'static str, handle: ServerHandle) {
    let mut servers = servers()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    servers.retain(|(known, _)| *known != name);
    servers.push((name, handle));
}

/// Adds `collector` to what the OTLP reader collects, for as long as it lives.
pub fn register_collector(collector: &Arc<dyn Collect>) {
    let mut collectors = collectors()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    collectors.retain(|weak| weak.strong_count() > 0);
    collectors.push(Arc::downgrade(collector));
}

/// The process metrics' samples.
pub fn process_samples() -> Vec<Sample> {
    let stage = &STAGE;
    let mut out = vec![
        stage.compute.sample(),
        Sample::number(
            names::STAGE_ROWS_TOTAL,
            stage.rows.load(Ordering::Relaxed) as f64,
        ),
        Sample::number(
            names::STAGE_STEPS_TOTAL,
            stage.steps.load(Ordering::Relaxed) as f64,
        ),
    ];
    for (name, values) in [
        (names::LINK_BYTES_SENT_TOTAL, &stage.sent),
        (names::LINK_BYTES_RECEIVED_TOTAL, &stage.received),
    ] {
        for (side, value) in ["upstream", "downstream"].iter().zip(values.iter()) {
            out.push(Sample::labelled(
                name,
                vec![("link", (*side).to_owned())],
                value.load(Ordering::Relaxed) as f64,
            ));
        }
    }
    out.push(stage.round_trip.sample());
    out.push(stage.batch.sample());
    out.push(Sample::number(
        names::CREDIT_WAITS_TOTAL,
        stage.credit_waits.load(Ordering::Relaxed) as f64,
    ));
    let export = &EXPORT_COUNTERS;
    for (name, counter) in [
        (names::TELEMETRY_SPANS_QUEUED_TOTAL, &export.queued),
        (names::TELEMETRY_SPANS_DROPPED_TOTAL, &export.dropped),
        (names::TELEMETRY_SPANS_EXPORTED_TOTAL, &export.exported),
        (names::TELEMETRY_EXPORT_ERRORS_TOTAL, &export.errors),
        (names::TELEMETRY_QUEUE_DEPTH, &export.depth),
    ] {
        out.push(Sample::number(name, counter.load(Ordering::Relaxed) as f64));
    }
    net_samples(&mut out);
    let pool = task_runtime::Runtime::pool();
    out.push(Sample::number(names::TASKS_LIVE, pool.live as f64));
    out.push(Sample::number(names::TASKS_QUEUED, pool.queued as f64));
    out.push(Sample::number(
        names::TASK_WORKERS,
        pool.worker_count as f64,
    ));
    out
}

/// Every registered server's statistics, grouped by metric.
fn net_samples(out: &mut Vec<Sample>) {
    let servers: Vec<(&'static str, ServerHandle)> = servers()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone();
    let stats: Vec<_> = servers
        .iter()
        .map(|(name, handle)| (*name, handle.stats()))
        .collect();
    let server = |name: &str| vec![("server", name.to_owned())];
    for (name, stats) in &stats {
        out.push(Sample::labelled(
            names::NET_CONNECTIONS_OPEN,
            server(name),
            stats.open as f64,
        ));
    }
    for (name, stats) in &stats {
        out.push(Sample::labelled(
            names::NET_CONNECTIONS_ACCEPTED_TOTAL,
            server(name),
            stats.accepted as f64,
        ));
    }
    for (name, stats) in &stats {
        for cause in RefusalCause::ALL {
            out.push(Sample::labelled(
                names::NET_REFUSED_TOTAL,
                vec![
                    ("server", (*name).to_owned()),
                    ("cause", cause.as_str().to_owned()),
                ],
                stats.refused_by(cause) as f64,
            ));
        }
    }
    for (name, stats) in &stats {
        for reason in CloseReason::ALL {
            let count = stats.closed_by(reason);
            if count > 0 {
                out.push(Sample::labelled(
                    names::NET_CLOSED_TOTAL,
                    vec![
                        ("server", (*name).to_owned()),
                        ("reason", reason.as_str().to_owned()),
                    ],
                    count as f64,
                ));
            }
        }
    }
    for (metric, pick) in [
        (names::NET_BYTES_RECEIVED_TOTAL, 0usize),
        (names::NET_BYTES_SENT_TOTAL, 1),
    ] {
        for (name, stats) in &stats {
            let value = if pick == 0 {
                stats.bytes_in
            } else {
                stats.bytes_out
            };
            out.push(Sample::labelled(metric, server(name), value as f64));
        }
    }
}

/// Every sample the OTLP reader exports: the process metrics and every live collector's.
pub fn all_samples() -> Vec<Sample> {
    let mut out = process_samples();
    let live: Vec<Arc<dyn Collect>> = collectors()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    for collector in live {
        collector.collect(&mut out);
    }
    out
}

/// The process metrics as Prometheus text (the whole `/metrics` of a stage process; appended to stage 0's).
pub fn render_process() -> String {
    let mut out = String::new();
    render(&process_samples(), &mut out);
    out
}

/// Renders `samples` as Prometheus text; samples of one metric must be adjacent.
pub fn render(samples: &[Sample], out: &mut String) {
    let mut last: Option<&str> = None;
    for sample in samples {
        if last != Some(sample.name) {
            last = Some(sample.name);
            let kind = names::METRICS
                .iter()
                .find(|(name, _, _)| *name == sample.name)
                .map_or(Kind::Gauge, |(_, kind, _)| *kind);
            let kind = match kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            let _ = writeln!(out, "# HELP {} {}", sample.name, names::help(sample.name));
            let _ = writeln!(out, "# TYPE {} {kind}", sample.name);
        }
        let labels = |extra: Option<String>| {
            let mut parts: Vec<String> = sample
                .labels
                .iter()
                .map(|(name, value)| format!("{name}=\"{}\"", escape(value)))
                .collect();
            parts.extend(extra);
            if parts.is_empty() {
                String::new()
            } else {
                format!("{{{}}}", parts.join(","))
            }
        };
        match &sample.value {
            Value::Number(value) => {
                let _ = writeln!(out, "{}{} {value}", sample.name, labels(None));
            }
            Value::Histogram {
                bounds,
                cumulative,
                count,
                sum,
            } => {
                for (bound, value) in bounds.iter().zip(cumulative) {
                    let _ = writeln!(
                        out,
                        "{}_bucket{} {value}",
                        sample.name,
                        labels(Some(format!("le=\"{bound}\"")))
                    );
                }
                let _ = writeln!(
                    out,
                    "{}_bucket{} {count}",
                    sample.name,
                    labels(Some("le=\"+Inf\"".to_owned()))
                );
                let _ = writeln!(out, "{}_sum{} {sum}", sample.name, labels(None));
                let _ = writeln!(out, "{}_count{} {count}", sample.name, labels(None));
            }
        }
    }
}

fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_atomic_histogram_renders_cumulative_buckets() {
        let histogram = AtomicHistogram::new(names::STAGE_COMPUTE_SECONDS);
        histogram.observe(0.0002);
        histogram.observe(0.003);
        histogram.observe(100.0);
        let mut text = String::new();
        render(&[histogram.sample()], &mut text);
        assert!(
            text.contains("# TYPE stage_server_stage_compute_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains("stage_server_stage_compute_seconds_bucket{le=\"0.0001\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("stage_server_stage_compute_seconds_bucket{le=\"0.00025\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("stage_server_stage_compute_seconds_bucket{le=\"5\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("stage_server_stage_compute_seconds_bucket{le=\"+Inf\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("stage_server_stage_compute_seconds_count 3"),
            "{text}"
        );
    }

    #[test]
    fn the_process_metrics_name_every_metric_once_in_a_block() {
        let text = render_process();
        for line in text.lines().filter(|line| line.starts_with("# TYPE")) {
            let name = line.split_whitespace().nth(2).unwrap_or_default();
            assert_eq!(
                text.matches(&format!("# TYPE {name} ")).count(),
                1,
                "{name} has more than one TYPE line"
            );
            assert!(
                !names::help(name).is_empty(),
                "{name} is not in names::METRICS"
            );
        }
    }
}
