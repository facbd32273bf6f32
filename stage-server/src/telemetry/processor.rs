//! The span processor in front of the OTLP exporter: a bounded queue that never blocks the thread ending a
//! span (full means drop and count), and one plain thread that sends batches.
//!
//! ```text
//!   any thread: span ends ──on_end──▶ queue (≤ capacity; full: dropped += 1) ──▶ export thread
//!                                          (Mutex + Condvar)                      batch ≤ max_batch, every
//!                                                                                 delay or when a batch fills
//!                                                                                 ──▶ exporter (blocking HTTP)
//! ```
//!
//! Why not the SDK's `BatchSpanProcessor`: it drops the same way but keeps its drop count to itself; an
//! operator must see it rise (`stage_server_telemetry_spans_dropped_total`), and the shutdown here waits
//! only up to its deadline, whatever the exporter does.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};

/// The process's export counters, read by `/metrics` and by the OTLP metrics.
#[derive(Debug, Default)]
pub struct ExportCounters {
    /// Spans taken into the queue.
    pub queued: AtomicU64,
    /// Spans dropped at a full queue.
    pub dropped: AtomicU64,
    /// Spans the collector accepted.
    pub exported: AtomicU64,
    /// Exports that failed or were refused (span batches and metric pushes; the HTTP client counts them).
    pub errors: AtomicU64,
    /// Spans in the queue now.
    pub depth: AtomicU64,
}

/// The one set of export counters of this process.
pub static EXPORT_COUNTERS: ExportCounters = ExportCounters {
    queued: AtomicU64::new(0),
    dropped: AtomicU64::new(0),
    exported: AtomicU64::new(0),
    errors: AtomicU64::new(0),
    depth: AtomicU64::new(0),
};

/// How the queue batches.
#[derive(Clone, Copy, Debug)]
pub struct QueueConfig {
    /// Spans the queue holds; more are dropped.
    pub capacity: usize,
    /// Spans per export at most.
    pub max_batch: usize,
    /// How long a span may wait for a batch to fill.
    pub delay: Duration,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            capacity: 2048,
            max_batch: 512,
            delay: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    spans: VecDeque<SpanData>,
    /// Flushes asked for and flushes done: a flush waits until `flushed` reaches its ticket.
    flush_asked: u64,
    flushed: u64,
    shutdown: bool,
    finished: bool,
}

#[derive(Debug)]
struct Shared<E> {
    state: Mutex<State>,
    /// Wakes the export thread.
    work: Condvar,
    /// Wakes those waiting for a flush or the end.
    done: Condvar,
    exporter: Mutex<E>,
    config: QueueConfig,
}

/// A span processor with a bounded, dropping queue and its own export thread.
#[derive(Debug)]
pub struct QueueingProcessor<E: SpanExporter + 'static> {
    shared: Arc<Shared<E>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<E: SpanExporter + 'static> QueueingProcessor<E> {
    /// Starts the export thread over `exporter`.
    pub fn new(exporter: E, config: QueueConfig) -> std::io::Result<QueueingProcessor<E>> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            done: Condvar::new(),
            exporter: Mutex::new(exporter),
            config: QueueConfig {
                capacity: config.capacity.max(1),
                max_batch: config.max_batch.max(1),
                delay: config.delay,
            },
        });
        let worker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("otlp-spans".into())
            .spawn(move || worker.run())?;
        Ok(QueueingProcessor {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }
}

impl<E: SpanExporter + 'static> Shared<E> {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn run(&self) {
        let mut state = self.lock();
        let mut oldest: Option<Instant> = None;
        loop {
            let flushing = state.flush_asked > state.flushed || state.shutdown;
            let full = state.spans.len() >= self.config.max_batch;
            let due = oldest.is_some_and(|since| since.elapsed() >= self.config.delay);
            if state.spans.is_empty() {
                oldest = None;
                if flushing {
                    state.flushed = state.flush_asked;
                    self.done.notify_all();
                    if state.shutdown {
                        state.finished = true;
                        self.done.notify_all();
                        return;
                    }
                }
                state = self
                    .work
                    .wait(state)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                continue;
            }
            let since = *oldest.get_or_insert_with(Instant::now);
            if !(flushing || full || due) {
                let wait = self.config.delay.saturating_sub(since.elapsed());
                state = self
                    .work
                    .wait_timeout(state, wait)
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .0;
                continue;
            }
            let take = state.spans.len().min(self.config.max_batch);
            let batch: Vec<SpanData> = state.spans.drain(..take).collect();
            EXPORT_COUNTERS
                .depth
                .store(state.spans.len() as u64, Ordering::Relaxed);
            oldest = None;
            drop(state);
            let count = batch.len() as u64;
            let result = {
                let exporter = self
                    .exporter
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                futures_executor::block_on(exporter.export(batch))
            };
            // A failed export is counted by the HTTP client (it sees span and metric pushes alike).
            if result.is_ok() {
                EXPORT_COUNTERS.exported.fetch_add(count, Ordering::Relaxed);
            }
            state = self.lock();
        }
    }
}

impl<E: SpanExporter + 'static> SpanProcessor for QueueingProcessor<E> {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        let mut state = self.shared.lock();
        if state.shutdown || state.spans.len() >= self.shared.config.capacity {
            drop(state);
            EXPORT_COUNTERS.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        state.spans.push_back(span);
        let length = state.spans.len();
        EXPORT_COUNTERS
            .depth
            .store(length as u64, Ordering::Relaxed);
        drop(state);
        EXPORT_COUNTERS.queued.fetch_add(1, Ordering::Relaxed);
        // The first span starts the delay, a full batch goes at once; spans in between wake nobody.
        if length == 1 || length == self.shared.config.max_batch {
            self.shared.work.notify_one();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut state = self.shared.lock();
        state.flush_asked += 1;
        let ticket = state.flush_asked;
        self.shared.work.notify_one();
        while state.flushed < ticket && !state.finished {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(OTelSdkError::Timeout(Duration::from_secs(5)));
            }
            state = self
                .shared
                .done
                .wait_timeout(state, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        Ok(())
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let deadline = Instant::now() + timeout;
        let mut state = self.shared.lock();
        if state.shutdown {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        state.shutdown = true;
        self.shared.work.notify_one();
        while !state.finished {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // The thread is stuck in an export; it is left behind (the process is ending) and the
                // caller's abort cuts its connection.
                return Err(OTelSdkError::Timeout(timeout));
            }
            state = self
                .shared
                .done
                .wait_timeout(state, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        drop(state);
        if let Some(thread) = self
            .thread
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
        {
            let _ = thread.join();
        }
        if let Ok(mut exporter) = self.shared.exporter.try_lock() {
            let _ =
                exporter.shutdown_with_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        Ok(())
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.shared
            .exporter
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .set_resource(resource);
    }
}
