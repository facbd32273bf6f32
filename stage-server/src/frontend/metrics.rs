//! The API's counters, gauges and latency histograms, rendered as Prometheus text for `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::telemetry::names;
use crate::telemetry::registry::{self, Collect, Sample};

/// Upper bounds (seconds) of the latency histograms' buckets: from a fast decode step to a long prefill.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bound, count) in BUCKETS.iter().zip(self.counts.iter_mut()) {
            if seconds <= *bound {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (bound, count) in BUCKETS.iter().zip(self.counts.iter()) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// Everything `/metrics` reports. Shared by the sessions (requests) and the lanes (tokens, latencies).
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    queue_depth: AtomicUsize,
    lanes_busy: AtomicUsize,
    first_token: Mutex<Histogram>,
    inter_token: Mutex<Histogram>,
    queue_wait: Mutex<Histogram>,
}

impl Metrics {
    /// Counts a finished request to `route` answered with `status`.
    pub(crate) fn count_request(&self, route: &'static str, status: u16) {
        let mut requests = self
            .requests
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *requests.entry((route, status)).or_default() += 1;
    }

    /// Adds a generation's prompt and generated token counts.
    pub(crate) fn add_tokens(&self, prompt: usize, generated: usize) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.generated_tokens
            .fetch_add(generated as u64, Ordering::Relaxed);
    }

    /// Sets the number of jobs waiting for a lane.
    pub(crate) fn set_queue_depth(&self, depth: usize) {
        self.queue_depth.store(depth, Ordering::Relaxed);
    }

    /// Sets the number of lanes running a generation.
    pub(crate) fn set_lanes_busy(&self, busy: usize) {
        self.lanes_busy.store(busy, Ordering::Relaxed);
    }

    /// Records the time from a lane taking a job to its first token.
    pub(crate) fn observe_first_token(&self, seconds: f64) {
        observe(
            &self.first_token,
            names::TIME_TO_FIRST_TOKEN_SECONDS,
            seconds,
        );
    }

    /// Records the gap between two tokens of one generation (one decode step through every stage).
    pub(crate) fn observe_inter_token(&self, seconds: f64) {
        observe(&self.inter_token, names::INTER_TOKEN_SECONDS, seconds);
    }

    /// Records how long a job waited for a lane.
    pub(crate) fn observe_queue_wait(&self, seconds: f64) {
        observe(&self.queue_wait, names::QUEUE_WAIT_SECONDS, seconds);
    }

    /// The Prometheus text exposition of every metric: the API's, then the process's (stage 0's compute and
    /// link, the servers, telemetry).
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP stage_server_requests_total HTTP requests answered, by route and status."
        );
        let _ = writeln!(out, "# TYPE stage_server_requests_total counter");
        for ((route, status), count) in self
            .requests
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "stage_server_requests_total{{route=\"{route}\",status=\"{status}\"}} {count}"
            );
        }
        let counters = [
            (
                names::PROMPT_TOKENS_TOTAL,
                names::help(names::PROMPT_TOKENS_TOTAL),
                self.prompt_tokens.load(Ordering::Relaxed),
            ),
            (
                names::GENERATED_TOKENS_TOTAL,
                names::help(names::GENERATED_TOKENS_TOTAL),
                self.generated_tokens.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {value}");
        }
        let gauges = [
            (
                names::QUEUE_DEPTH,
                names::help(names::QUEUE_DEPTH),
                self.queue_depth.load(Ordering::Relaxed),
            ),
            (
                names::LANES_BUSY,
                names::help(names::LANES_BUSY),
                self.lanes_busy.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {value}");
        }
        let histograms = [
            (
                &self.first_token,
                names::TIME_TO_FIRST_TOKEN_SECONDS,
                names::help(names::TIME_TO_FIRST_TOKEN_SECONDS),
            ),
            (
                &self.inter_token,
                names::INTER_TOKEN_SECONDS,
                names::help(names::INTER_TOKEN_SECONDS),
            ),
            (
                &self.queue_wait,
                names::QUEUE_WAIT_SECONDS,
                names::help(names::QUEUE_WAIT_SECONDS),
            ),
        ];
        for (histogram, name, help) in histograms {
            histogram
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .render(&mut out, name, help);
        }
        out.push_str(&registry::render_process());
        out
    }
}

impl Collect for Metrics {
    /// The counters and gauges, for the OTLP reader (histograms go to it as they are observed).
    fn collect(&self, out: &mut Vec<Sample>) {
        for ((route, status), count) in self
            .requests
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
        {
            out.push(Sample::labelled(
                names::REQUESTS_TOTAL,
                vec![
                    ("route", (*route).to_owned()),
                    ("status", status.to_string()),
                ],
                *count as f64,
            ));
        }
        for (name, value) in [
            (
                names::PROMPT_TOKENS_TOTAL,
                self.prompt_tokens.load(Ordering::Relaxed) as f64,
            ),
            (
                names::GENERATED_TOKENS_TOTAL,
                self.generated_tokens.load(Ordering::Relaxed) as f64,
            ),
            (
                names::QUEUE_DEPTH,
                self.queue_depth.load(Ordering::Relaxed) as f64,
            ),
            (
                names::LANES_BUSY,
                self.lanes_busy.load(Ordering::Relaxed) as f64,
            ),
        ] {
            out.push(Sample::number(name, value));
        }
    }
}

fn observe(histogram: &Mutex<Histogram>, name: &'static str, seconds: f64) {
    histogram
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .observe(seconds);
    crate::telemetry::record_histogram(name, seconds);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_counts_each_observation_in_every_bucket_at_or_above_it() {
        let metrics = Metrics::default();
        metrics.observe_inter_token(0.015);
        metrics.observe_inter_token(3.0);
        let text = metrics.render();
        assert!(text.contains("stage_server_inter_token_seconds_bucket{le=\"0.01\"} 0"));
        assert!(text.contains("stage_server_inter_token_seconds_bucket{le=\"0.02\"} 1"));
        assert!(text.contains("stage_server_inter_token_seconds_bucket{le=\"5\"} 2"));
        assert!(text.contains("stage_server_inter_token_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("stage_server_inter_token_seconds_count 2"));
    }

    #[test]
    fn requests_are_counted_by_route_and_status() {
        let metrics = Metrics::default();
        metrics.count_request("/v1/models", 200);
        metrics.count_request("/v1/models", 200);
        metrics.count_request("/v1/chat/completions", 429);
        let text = metrics.render();
        assert!(
            text.contains("stage_server_requests_total{route=\"/v1/models\",status=\"200\"} 2")
        );
        assert!(text.contains(
            "stage_server_requests_total{route=\"/v1/chat/completions\",status=\"429\"} 1"
        ));
    }
}
