//! The spans of one generation through stage 0's API and two in-process stages, as an in-memory exporter
//! behind `tracing-opentelemetry` gets them: names, ids as fields, parent links and lifetimes. Its own test
//! binary, because it installs the process's subscriber.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use candle_core::quantized::GgmlDType;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use stage_server::driver::ChainOptions;
use stage_server::frontend::{ApiConfig, ApiServer, Backend};
use stage_server::model::testing::TinyModel;
use stage_server::serve::{LinkShape, StageConfig, StageProcess};
use stage_server::telemetry::names;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The trace the request continues and the span it names as the parent (a W3C `traceparent` header).
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const REMOTE_PARENT: &str = "00f067aa0ba902b7";
/// Generous: three stages load a model on a loaded 2-core machine.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// The one-way delay on stage 1's link to stage 2: a floor under stage 1's frames' link write times.
const LINK_DELAY: Duration = Duration::from_millis(5);

/// Keeps every span it is given.
#[derive(Clone, Debug, Default)]
struct Memory(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Memory {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .extend(batch);
        std::future::ready(Ok(()))
    }
}

/// One span, flattened for assertions.
#[derive(Clone, Debug)]
struct Got {
    name: String,
    trace_id: String,
    span_id: String,
    parent_id: String,
    start: SystemTime,
    end: SystemTime,
    fields: HashMap<String, Value>,
}

impl Got {
    fn from(span: &SpanData) -> Got {
        Got {
            name: span.name.to_string(),
            trace_id: span.span_context.trace_id().to_string(),
            span_id: span.span_context.span_id().to_string(),
            parent_id: span.parent_span_id.to_string(),
            start: span.start_time,
            end: span.end_time,
            fields: span
                .attributes
                .iter()
                .map(|KeyValue { key, value, .. }| (key.to_string(), value.clone()))
                .collect(),
        }
    }

    fn int(&self, field: &str) -> Option<i64> {
        match self.fields.get(field)? {
            Value::I64(value) => Some(*value),
            _ => None,
        }
    }

    fn text(&self, field: &str) -> Option<String> {
        match self.fields.get(field)? {
            Value::String(value) => Some(value.to_string()),
            _ => None,
        }
    }

    fn contains(&self, inner: &Got) -> bool {
        self.start <= inner.start && inner.end <= self.end
    }

    /// One line for messages: name, times from `origin` in ms, ids.
    fn line(&self, origin: SystemTime) -> String {
        let ms = |at: SystemTime| match at.duration_since(origin) {
            Ok(after) => after.as_secs_f64() * 1e3,
            Err(before) => -before.duration().as_secs_f64() * 1e3,
        };
        // The span's own fields, without the layer's bookkeeping (code location, thread, timings).
        let mut fields: Vec<String> = self
            .fields
            .iter()
            .filter(|(key, _)| {
                !key.starts_with("code.")
                    && !key.starts_with("thread.")
                    && !matches!(key.as_str(), "target" | "busy_ns" | "idle_ns")
            })
            .map(|(key, value)| format!("{key}={value}"))
            .collect();
        fields.sort();
        format!(
            "{:<28} [{:>8.3}, {:>8.3}] ms  span {} parent {}  {}",
            self.name,
            ms(self.start),
            ms(self.end),
            self.span_id,
            self.parent_id,
            fields.join(" ")
        )
    }
}

/// Installs the process's subscriber: every stage-server span, trace level included, into `memory`.
fn install(memory: &Memory) -> SdkTracerProvider {
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(memory.clone())
        .build();
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("telemetry-spans-test"))
        .with_filter(EnvFilter::new("stage_server=trace"));
    tracing_subscriber::registry().with(layer).init();
    provider
}

/// A completion over `api`: the response's head and body.
fn complete(api: SocketAddr, extra_headers: &str) -> (String, serde_json::Value) {
    let body = r#"{"prompt":[1,300,301],"max_tokens":6,"temperature":0}"#;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{extra_headers}Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(api).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete response: {response:?}"));
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "the completion failed: {response}"
    );
    let body = serde_json::from_str(body).unwrap_or_else(|error| panic!("{error}: {body}"));
    (head.to_owned(), body)
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.trim().eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

#[test]
fn one_generation_through_three_in_process_stages_has_named_spans_with_ids_parents_and_lifetimes() {
    let memory = Memory::default();
    let provider = install(&memory);
    let directory = std::env::temp_dir().join(format!("stage-server-spans-{}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();
    let model = TinyModel::llama(GgmlDType::Q8_0)
        .write_to_dir(&directory)
        .unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let last = StageProcess::start(StageConfig::new(model.clone(), 3..4, any)).unwrap();
    let mut middle = StageConfig::new(model.clone(), 1..3, any);
    middle.next = Some(last.local_addr());
    middle.shape = LinkShape {
        delay: LINK_DELAY,
        rate_bits_per_second: None,
    };
    let middle = StageProcess::start(middle).unwrap();
    let mut config = ApiConfig::new(any);
    config.lanes = 1;
    let backend = Backend::Chain {
        layers_end: 1,
        next: middle.local_addr(),
        options: ChainOptions::default(),
    };
    let api = ApiServer::start(&model, backend, config).unwrap();
    api.wait_ready(READY_TIMEOUT).unwrap();

    let (head, body) = complete(
        api.local_addr(),
        &format!("traceparent: 00-{TRACE_ID}-{REMOTE_PARENT}-01\r\nx-request-id: spans-test-1\r\n"),
    );
    assert_eq!(
        header(&head, "x-request-id"),
        Some("spans-test-1"),
        "the response does not echo the request's id:\n{head}"
    );
    let output_tokens = body["usage"]["completion_tokens"].as_i64().unwrap();

    // The session spans end when each stage has handled the Stop frame, after the reply went out.
    let deadline = Instant::now() + Duration::from_secs(10);
    let spans = loop {
        let spans: Vec<Got> = memory.0.lock().unwrap().iter().map(Got::from).collect();
        let sessions = spans
            .iter()
            .filter(|span| span.name == names::SPAN_STAGE_SESSION)
            .count();
        if sessions == 2 || Instant::now() > deadline {
            break spans;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let trace: Vec<&Got> = spans
        .iter()
        .filter(|span| span.trace_id == TRACE_ID)
        .collect();
    let origin = trace
        .iter()
        .map(|span| span.start)
        .min()
        .unwrap_or(UNIX_EPOCH);
    let picture: String = trace
        .iter()
        .map(|span| format!("  {}\n", span.line(origin)))
        .collect();
    let named = |name: &str| -> Vec<&Got> {
        trace
            .iter()
            .copied()
            .filter(|span| span.name == name)
            .collect()
    };
    let one = |name: &str| -> &Got {
        let found = named(name);
        assert_eq!(found.len(), 1, "one {name} span expected:\n{picture}");
        found[0]
    };

    // The request: its id from the header, its route and status, under the header's remote parent.
    let request = one(names::SPAN_HTTP_REQUEST);
    assert_eq!(request.parent_id, REMOTE_PARENT, "{picture}");
    assert_eq!(
        request.text("request_id").as_deref(),
        Some("spans-test-1"),
        "{picture}"
    );
    assert_eq!(
        request.text("route").as_deref(),
        Some("/v1/completions"),
        "{picture}"
    );
    assert_eq!(request.int("status"), Some(200), "{picture}");

    // The generation: its lane and token counts, under the request, inside its time.
    let generation = one(names::SPAN_GENERATION);
    assert_eq!(generation.parent_id, request.span_id, "{picture}");
    assert_eq!(generation.int("lane"), Some(0), "{picture}");
    assert_eq!(generation.int("prompt_tokens"), Some(3), "{picture}");
    assert_eq!(
        generation.int("output_tokens"),
        Some(output_tokens),
        "{picture}"
    );
    assert!(
        request.contains(generation),
        "the request span does not cover its generation:\n{picture}"
    );

    // Stage 0's prefill chunk and decode steps, under the generation.
    let chunk = one(names::SPAN_PREFILL_CHUNK);
    let steps = named(names::SPAN_DECODE_STEP);
    assert_eq!(
        steps.len() as i64,
        output_tokens - 1,
        "a decode step per token after the first:\n{picture}"
    );
    for span in steps.iter().chain([&chunk]) {
        assert_eq!(span.parent_id, generation.span_id, "{picture}");
        assert!(span.text("session_id").is_some(), "{picture}");
        assert!(
            generation.contains(span),
            "{} outlives the generation:\n{picture}",
            span.name
        );
    }

    // A session span per later stage, chained (stage 1 under the generation, stage 2 under stage 1), each
    // covering its frames.
    let sessions = named(names::SPAN_STAGE_SESSION);
    assert_eq!(
        sessions.len(),
        2,
        "a session span per later stage:\n{picture}"
    );
    let session_of = |stage: i64| -> &Got {
        sessions
            .iter()
            .copied()
            .find(|span| span.int("stage_index") == Some(stage))
            .unwrap_or_else(|| panic!("no session span of stage {stage}:\n{picture}"))
    };
    let (first, second) = (session_of(1), session_of(2));
    assert_eq!(first.parent_id, generation.span_id, "{picture}");
    assert_eq!(second.parent_id, first.span_id, "{picture}");
    assert_eq!(
        first.text("session_id"),
        second.text("session_id"),
        "both stages name the same session:\n{picture}"
    );
    assert_eq!(first.int("layer_start"), Some(1), "{picture}");
    assert_eq!(second.int("layer_end"), Some(4), "{picture}");
    for (stage, session) in [(1, first), (2, second)] {
        let frames: Vec<&Got> = named(names::SPAN_STAGE_FRAME)
            .into_iter()
            .filter(|frame| frame.parent_id == session.span_id)
            .collect();
        let kinds: Vec<String> = frames
            .iter()
            .filter_map(|frame| frame.text("kind"))
            .collect();
        for kind in ["configure", "prefill", "decode"] {
            assert!(
                kinds.iter().any(|got| got == kind),
                "stage {stage} has no {kind} frame span (kinds {kinds:?}):\n{picture}"
            );
        }
        // The session ends with a stop, or with a keep (the chain keeps it for the next generation to resume).
        assert!(
            kinds.iter().any(|got| got == "stop" || got == "keep"),
            "stage {stage} has no stop or keep frame span (kinds {kinds:?}):\n{picture}"
        );
        for frame in &frames {
            assert_eq!(frame.int("stage_index"), Some(stage), "{picture}");
            assert_eq!(
                frame.text("session_id"),
                session.text("session_id"),
                "{picture}"
            );
            if frame.text("kind").is_some_and(|kind| kind == "decode") {
                assert_eq!(frame.int("rows"), Some(1), "{picture}");
                assert!(frame.int("compute_micros").is_some(), "{picture}");
            }
            // Every frame waited (if only a moment) for the compute thread; a computed chunk's answer (rows
            // down to stage 2, a token or an acknowledgement up from it) was written, and the frame span says
            // how long that took; configure and stop answer nothing, so they have no write time.
            let kind = frame.text("kind").unwrap_or_default();
            assert!(
                frame.int("queue_wait_micros").is_some_and(|wait| wait >= 0),
                "stage {stage}'s {kind} frame has no queue wait:\n{picture}"
            );
            let write = frame.int("write_micros");
            if kind == "prefill" || kind == "decode" {
                assert!(
                    write.is_some_and(|write| write >= 0),
                    "stage {stage}'s {kind} frame has no link write time:\n{picture}"
                );
                // Stage 1's rows reach its socket only after the link's delay: the write time covers the
                // hand-over to the link and the wait for it, not just the encoding.
                if stage == 1 {
                    let floor = LINK_DELAY.as_micros() as i64;
                    assert!(
                        write.is_some_and(|write| write >= floor),
                        "stage 1's {kind} frame was written in {write:?} us, under the link's {floor} us delay:\n{picture}"
                    );
                }
            } else {
                assert_eq!(
                    write, None,
                    "stage {stage}'s {kind} frame wrote nothing, yet has a write time:\n{picture}"
                );
            }
            assert!(
                session.contains(frame),
                "stage {stage}'s session span does not cover its {:?} frame:\n{picture}",
                frame.text("kind")
            );
        }
    }

    // A request without an id gets a fresh one, in its span and in its response alike.
    memory.0.lock().unwrap().clear();
    let (head, _) = complete(api.local_addr(), "");
    let echoed = header(&head, "x-request-id")
        .unwrap_or_else(|| panic!("no x-request-id in the response:\n{head}"))
        .to_owned();
    assert!(echoed.starts_with("req-"), "{echoed}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let recorded = loop {
        let recorded = memory
            .0
            .lock()
            .unwrap()
            .iter()
            .map(Got::from)
            .find(|span| span.name == names::SPAN_HTTP_REQUEST)
            .and_then(|span| span.text("request_id"));
        if recorded.is_some() || Instant::now() > deadline {
            break recorded;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(recorded.as_deref(), Some(echoed.as_str()));

    let _ = api.shutdown(Instant::now() + Duration::from_secs(5));
    let _ = middle.shutdown(Instant::now() + Duration::from_secs(5));
    let _ = last.shutdown(Instant::now() + Duration::from_secs(5));
    let _ = provider.shutdown();
}
