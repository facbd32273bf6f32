//! The closed-loop load client of `cargo xtask bench serve`: workers that post streaming chat completions over
//! plain HTTP/1.1 and time every token of the server-sent events that come back.
//!
//! ```text
//!   worker thread 1 ─┐   POST /v1/chat/completions (stream)    ┌─> ResponseDecoder (status, chunked or
//!   worker thread 2 ─┼── one TCP connection per request ─────> │   Content-Length body)
//!   worker thread C ─┘   next request only after [DONE]        └─> EventDecoder (SSE `data:` events)
//!                                                                    └─> classify: content, usage, done, error
//! ```
//!
//! The decoders are sans-IO (bytes in, decisions out), so the unit tests feed them recorded responses split at
//! every byte. Each worker owns its socket and its records; the threads share nothing until they are joined.
//! [`stream_request`] sends any chat-completion body and calls back at the first content delta, for the shaped
//! scenarios that time one request against the progress of others.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

/// How long one read may wait for the next bytes: a stalled server becomes an error, not a hung benchmark.
const READ_TIMEOUT: Duration = Duration::from_secs(120);
/// How long connecting to a server on loopback may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest response head accepted; real ones are a few hundred bytes.
const HEAD_LIMIT: usize = 64 * 1024;

/// The subjects the prompts ask about, so consecutive requests differ in more than a counter.
const TOPICS: [&str; 8] = [
    "how bread is baked, from the flour to the crust",
    "the water cycle and what drives each of its stages",
    "how the gears of a bicycle trade speed for force",
    "the history of the printing press and what it changed",
    "how vaccines teach the immune system to recognise a disease",
    "how a compiler turns source code into machine instructions",
    "the life cycle of a star, from a cloud of gas to its end",
    "how bees find flowers and turn nectar into honey",
];

/// What one load level asks of a server.
#[derive(Debug, Clone)]
pub(crate) struct Load {
    /// The server's address on loopback.
    pub(crate) address: SocketAddr,
    /// The `model` field of every request: the id the server lists first in `GET /v1/models`.
    pub(crate) model: String,
    /// Concurrent workers, each with one request in flight at a time (a closed loop).
    pub(crate) concurrency: usize,
    /// Requests each worker sends, one after another.
    pub(crate) requests_per_worker: usize,
    /// `max_tokens` of every request.
    pub(crate) max_tokens: usize,
    /// `temperature` of every request (0: greedy).
    pub(crate) temperature: f64,
}

/// The timing of one streamed completion, as the client saw it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct RequestRecord {
    /// From the first byte of the request written to the read that carried the first content delta.
    pub(crate) first_token: Duration,
    /// The time between consecutive reads that carried content deltas, one entry per delta after the first
    /// (deltas that arrived in the same read get a zero gap: that is what a client observes).
    pub(crate) gaps: Vec<Duration>,
    /// Completion tokens: the usage chunk's `completion_tokens` when the server sent one, else the number of
    /// content deltas.
    pub(crate) tokens: u64,
    /// The usage chunk's `prompt_tokens`: the prompt as the server tokenized it, chat template included.
    pub(crate) prompt_tokens: Option<u64>,
    /// The usage chunk's `prompt_tokens_details.cached_tokens`: prompt tokens the server says it did not
    /// compute again. `None` when the server does not report it.
    pub(crate) cached_tokens: Option<u64>,
}

/// What one load level measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct LevelOutcome {
    /// The completed requests.
    pub(crate) records: Vec<RequestRecord>,
    /// The failed requests' messages, in the order the workers were joined.
    pub(crate) errors: Vec<String>,
    /// From the start of the first worker to the end of the last.
    pub(crate) wall: Duration,
}

/// The summary figures of one load level, in the units of the report.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LevelFigures {
    /// Completed requests.
    pub(crate) completed: usize,
    /// Failed requests.
    pub(crate) errors: usize,
    /// The first failure's message, for the report.
    pub(crate) first_error: Option<String>,
    /// Completion tokens of all completed requests over the level's wall time.
    pub(crate) tokens_per_second: f64,
    /// The median completion tokens per request, to show whether generations stopped early.
    pub(crate) tokens_per_request: f64,
    /// Time to first token, milliseconds.
    pub(crate) first_token_p50_ms: f64,
    /// Time to first token, milliseconds.
    pub(crate) first_token_p99_ms: f64,
    /// Inter-token gap, milliseconds.
    pub(crate) gap_p50_ms: f64,
    /// Inter-token gap, milliseconds.
    pub(crate) gap_p99_ms: f64,
}

/// Where a response decoder is in the message.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ResponseState {
    Head,
    Body(Framing),
    Complete,
}

/// How the body's end is known (RFC 9112 section 6.3).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Framing {
    Length { remaining: usize },
    Chunked(Chunk),
    UntilClose,
}

/// Where a chunked body decoder is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Chunk {
    Size,
    Data { remaining: usize },
    DataEnd,
    Trailers,
}

/// Whether a response has been read to its end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Progress {
    /// More bytes are needed.
    More,
    /// The message is complete.
    Complete,
}

/// A push decoder for one HTTP/1.1 response: bytes go in, body bytes come out with chunk framing removed.
#[derive(Debug)]
pub(crate) struct ResponseDecoder {
    state: ResponseState,
    pending: Vec<u8>,
    status: Option<u16>,
}

/// A push decoder for `text/event-stream`: body bytes go in, the `data` of each complete event comes out.
#[derive(Debug, Default)]
pub(crate) struct EventDecoder {
    pending: Vec<u8>,
    data: Option<String>,
}

/// The token counts of a usage object; a count the server left out is `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Usage {
    /// `completion_tokens`.
    pub(crate) completion_tokens: Option<u64>,
    /// `prompt_tokens`.
    pub(crate) prompt_tokens: Option<u64>,
    /// `prompt_tokens_details.cached_tokens`.
    pub(crate) cached_tokens: Option<u64>,
}

/// What one server-sent event means to the benchmark.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Event {
    /// A completion chunk: whether its delta carried content, and its usage object if it had one (OpenAI
    /// sends `"usage": null` on the other chunks of a stream with `include_usage`; that is no usage).
    Chunk { content: bool, usage: Option<Usage> },
    /// `data: [DONE]`, the end of the stream.
    Done,
    /// `data: {"error": ...}`: the server gave up after streaming began.
    Error(String),
}

impl Load {
    /// The JSON body of request `index` of `worker`: a chat prompt of about 100 tokens that asks for a long
    /// answer. The numbers and the topic lead the prompt, so no two requests share more than the chat
    /// template's prefix and a prompt cache cannot skip the prefill.
    pub(crate) fn body(&self, worker: usize, index: usize) -> String {
        let topic = TOPICS[(worker * 3 + index) % TOPICS.len()];
        let prompt = format!(
            "Note {worker}-{index}. Please write a long, thorough explanation of {topic}. I am preparing a \
             study guide and need as much detail as you can give. Start with a short history, then describe \
             how it works step by step, give at least five concrete examples, list the mistakes beginners \
             make and how to avoid them, compare it with two related ideas, and finish with a summary of the \
             key points. Use full sentences and several paragraphs, and do not stop early."
        );
        serde_json::json!({
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        })
        .to_string()
    }
}

impl LevelOutcome {
    /// Reduces the records to the report's figures; percentiles are NaN when nothing completed.
    pub(crate) fn figures(&self) -> LevelFigures {
        let milliseconds = |duration: &Duration| duration.as_secs_f64() * 1e3;
        let first_tokens: Vec<f64> = self
            .records
            .iter()
            .map(|record| milliseconds(&record.first_token))
            .collect();
        let gaps: Vec<f64> = self
            .records
            .iter()
            .flat_map(|record| record.gaps.iter().map(milliseconds))
            .collect();
        let tokens: Vec<f64> = self
            .records
            .iter()
            .map(|record| record.tokens as f64)
            .collect();
        let wall = self.wall.as_secs_f64();
        LevelFigures {
            completed: self.records.len(),
            errors: self.errors.len(),
            first_error: self.errors.first().cloned(),
            tokens_per_second: if wall > 0.0 {
                tokens.iter().sum::<f64>() / wall
            } else {
                f64::NAN
            },
            tokens_per_request: percentile(&tokens, 50.0),
            first_token_p50_ms: percentile(&first_tokens, 50.0),
            first_token_p99_ms: percentile(&first_tokens, 99.0),
            gap_p50_ms: percentile(&gaps, 50.0),
            gap_p99_ms: percentile(&gaps, 99.0),
        }
    }
}

impl ResponseDecoder {
    /// A decoder waiting for the status line.
    pub(crate) fn new() -> ResponseDecoder {
        ResponseDecoder {
            state: ResponseState::Head,
            pending: Vec::new(),
            status: None,
        }
    }

    /// The status code, once the head has been read.
    pub(crate) fn status(&self) -> Option<u16> {
        self.status
    }

    /// Takes the next bytes from the socket and appends the body bytes they complete to `body`.
    pub(crate) fn push(&mut self, bytes: &[u8], body: &mut Vec<u8>) -> Result<Progress> {
        self.pending.extend_from_slice(bytes);
        loop {
            match self.state {
                ResponseState::Complete => return Ok(Progress::Complete),
                ResponseState::Head => {
                    let Some(end) = find(&self.pending, b"\r\n\r\n") else {
                        ensure!(
                            self.pending.len() <= HEAD_LIMIT,
                            "the response head is longer than {HEAD_LIMIT} bytes"
                        );
                        return Ok(Progress::More);
                    };
                    let head = String::from_utf8_lossy(&self.pending[..end]).into_owned();
                    self.pending.drain(..end + 4);
                    let (status, framing) = parse_head(&head)?;
                    self.status = Some(status);
                    self.state = match framing {
                        Framing::Length { remaining: 0 } => ResponseState::Complete,
                        framing => ResponseState::Body(framing),
                    };
                }
                ResponseState::Body(Framing::UntilClose) => {
                    body.append(&mut self.pending);
                    return Ok(Progress::More);
                }
                ResponseState::Body(Framing::Length { remaining }) => {
                    let taken = remaining.min(self.pending.len());
                    body.extend(self.pending.drain(..taken));
                    if taken == remaining {
                        self.state = ResponseState::Complete;
                    } else {
                        self.state = ResponseState::Body(Framing::Length {
                            remaining: remaining - taken,
                        });
                        return Ok(Progress::More);
                    }
                }
                ResponseState::Body(Framing::Chunked(chunk)) => {
                    let Some(next) = self.step_chunk(chunk, body)? else {
                        return Ok(Progress::More);
                    };
                    self.state = next;
                }
            }
        }
    }

    /// Called at end of file: an error unless the body's framing says the message may end here.
    pub(crate) fn finish(&self) -> Result<()> {
        match self.state {
            ResponseState::Complete | ResponseState::Body(Framing::UntilClose) => Ok(()),
            ResponseState::Head => {
                bail!("the server closed the connection before a full response head")
            }
            ResponseState::Body(_) => {
                bail!("the server closed the connection in the middle of the body")
            }
        }
    }

    /// One step of the chunked decoder; `None` when it needs more bytes.
    fn step_chunk(&mut self, chunk: Chunk, body: &mut Vec<u8>) -> Result<Option<ResponseState>> {
        let chunked = |chunk| Some(ResponseState::Body(Framing::Chunked(chunk)));
        Ok(match chunk {
            Chunk::Size => {
                let Some(end) = find(&self.pending, b"\r\n") else {
                    ensure!(
                        self.pending.len() <= HEAD_LIMIT,
                        "a chunk size line is too long"
                    );
                    return Ok(None);
                };
                let line = String::from_utf8_lossy(&self.pending[..end]).into_owned();
                self.pending.drain(..end + 2);
                // A size may carry extensions after `;`, which mean nothing to this client.
                let digits = line.split(';').next().unwrap_or_default().trim();
                let size = usize::from_str_radix(digits, 16)
                    .with_context(|| format!("the chunk size line {line:?} is not hexadecimal"))?;
                if size == 0 {
                    chunked(Chunk::Trailers)
                } else {
                    chunked(Chunk::Data { remaining: size })
                }
            }
            Chunk::Data { remaining } => {
                if self.pending.is_empty() {
                    return Ok(None);
                }
                let taken = remaining.min(self.pending.len());
                body.extend(self.pending.drain(..taken));
                if taken == remaining {
                    chunked(Chunk::DataEnd)
                } else {
                    chunked(Chunk::Data {
                        remaining: remaining - taken,
                    })
                }
            }
            Chunk::DataEnd => {
                if self.pending.len() < 2 {
                    return Ok(None);
                }
                ensure!(
                    self.pending.starts_with(b"\r\n"),
                    "a chunk's data is not followed by CRLF"
                );
                self.pending.drain(..2);
                chunked(Chunk::Size)
            }
            Chunk::Trailers => {
                let Some(end) = find(&self.pending, b"\r\n") else {
                    return Ok(None);
                };
                self.pending.drain(..end + 2);
                if end == 0 {
                    Some(ResponseState::Complete)
                } else {
                    chunked(Chunk::Trailers)
                }
            }
        })
    }
}

impl EventDecoder {
    /// Takes body bytes and returns the `data` of every event they complete, in order.
    ///
    /// Lines end in LF, CRLF or CR-less LF alike; `data:` lines of one event are joined with newlines;
    /// comments (`: ping`) and other fields (`event:`, `id:`) are skipped; an event is dispatched at the blank
    /// line that ends it (the WHATWG event-stream rules).
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = self.pending.iter().position(|&byte| byte == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches('\n').trim_end_matches('\r');
            if line.is_empty() {
                if let Some(data) = self.data.take() {
                    events.push(data);
                }
                continue;
            }
            let (field, value) = match line.split_once(':') {
                Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
                None => (line, ""),
            };
            if field == "data" {
                match &mut self.data {
                    Some(data) => {
                        data.push('\n');
                        data.push_str(value);
                    }
                    None => self.data = Some(value.to_owned()),
                }
            }
        }
        events
    }
}

/// Reads one event's `data` as an OpenAI chat completion chunk.
pub(crate) fn classify(data: &str) -> Result<Event> {
    if data.trim() == "[DONE]" {
        return Ok(Event::Done);
    }
    let value: serde_json::Value = serde_json::from_str(data)
        .with_context(|| format!("an event is neither [DONE] nor JSON: {data:?}"))?;
    if let Some(error) = value.get("error") {
        let message = error["message"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| error.to_string());
        return Ok(Event::Error(message));
    }
    let content = value["choices"].as_array().is_some_and(|choices| {
        choices.iter().any(|choice| {
            choice["delta"]["content"]
                .as_str()
                .is_some_and(|text| !text.is_empty())
        })
    });
    let usage = value
        .get("usage")
        .filter(|usage| usage.is_object())
        .map(|usage| Usage {
            completion_tokens: usage["completion_tokens"].as_u64(),
            prompt_tokens: usage["prompt_tokens"].as_u64(),
            cached_tokens: usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
        });
    Ok(Event::Chunk { content, usage })
}

/// The `p`-th percentile of `values` by the nearest-rank rule: the smallest value with at least `p` percent
/// of the values at or below it. NaN for no values, so an empty series never reads as a measured zero.
pub(crate) fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Runs one load level: `concurrency` threads, each sending its requests back to back.
pub(crate) fn run_level(load: &Load) -> LevelOutcome {
    let started = Instant::now();
    let workers: Vec<_> = (0..load.concurrency)
        .map(|worker| {
            let load = load.clone();
            thread::spawn(move || {
                (0..load.requests_per_worker)
                    .map(|index| stream_completion(&load, worker, index))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut outcome = LevelOutcome::default();
    for worker in workers {
        let results = worker
            .join()
            .unwrap_or_else(|_| vec![Err(anyhow::anyhow!("a load worker panicked"))]);
        for result in results {
            match result {
                Ok(record) => outcome.records.push(record),
                Err(error) => outcome.errors.push(format!("{error:#}")),
            }
        }
    }
    outcome.wall = started.elapsed();
    outcome
}

/// Sends request `index` of `worker` and times its stream to `[DONE]`.
pub(crate) fn stream_completion(load: &Load, worker: usize, index: usize) -> Result<RequestRecord> {
    stream_request(load.address, &load.body(worker, index), || {})
}

/// Posts `body`, a streaming chat-completion request in JSON, to `/v1/chat/completions` on `address` and
/// times its stream to `[DONE]`. `on_first_token` runs once, on this thread, as soon as the read carrying the
/// first content delta has been classified, so another thread can act the moment this stream is decoding; it
/// does not run when the stream fails before any content.
pub(crate) fn stream_request(
    address: SocketAddr,
    body: &str,
    on_first_token: impl FnOnce(),
) -> Result<RequestRecord> {
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut on_first_token = Some(on_first_token);
    let started = Instant::now();
    let mut stream = connect(address)?;
    stream
        .write_all(request.as_bytes())
        .context("could not send the request")?;
    let mut response = ResponseDecoder::new();
    let mut events = EventDecoder::default();
    let mut body_bytes = Vec::new();
    let mut buffer = vec![0_u8; 16 * 1024];
    let mut content_deltas = 0_u64;
    let mut usage = Usage::default();
    let mut first_token = None;
    let mut last_token_at = None;
    let mut gaps = Vec::new();
    let mut done = false;
    loop {
        let read = match stream.read(&mut buffer) {
            Ok(read) => read,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(error).context("reading the response failed"),
        };
        let arrived = Instant::now();
        if read == 0 {
            response.finish()?;
            break;
        }
        let progress = response.push(&buffer[..read], &mut body_bytes)?;
        if let Some(status) = response.status()
            && status != 200
        {
            if progress == Progress::More {
                // The error body is short; read it all so the message can be shown.
                continue;
            }
            bail!(
                "status {status}: {}",
                String::from_utf8_lossy(&body_bytes).trim()
            );
        }
        for data in events.push(&body_bytes) {
            match classify(&data)? {
                Event::Done => done = true,
                Event::Error(message) => bail!("the server sent an error event: {message}"),
                Event::Chunk {
                    content,
                    usage: reported,
                } => {
                    if let Some(reported) = reported {
                        usage = Usage {
                            completion_tokens: reported
                                .completion_tokens
                                .or(usage.completion_tokens),
                            prompt_tokens: reported.prompt_tokens.or(usage.prompt_tokens),
                            cached_tokens: reported.cached_tokens.or(usage.cached_tokens),
                        };
                    }
                    if content {
                        content_deltas += 1;
                        match last_token_at {
                            None => first_token = Some(arrived - started),
                            Some(last) => gaps.push(arrived - last),
                        }
                        last_token_at = Some(arrived);
                    }
                }
            }
        }
        body_bytes.clear();
        if first_token.is_some()
            && let Some(callback) = on_first_token.take()
        {
            callback();
        }
        if done || progress == Progress::Complete {
            break;
        }
    }
    if let Some(status) = response.status()
        && status != 200
    {
        bail!(
            "status {status}: {}",
            String::from_utf8_lossy(&body_bytes).trim()
        );
    }
    ensure!(done, "the stream ended without `data: [DONE]`");
    let first_token = first_token.context("the stream carried no content")?;
    Ok(RequestRecord {
        first_token,
        gaps,
        tokens: usage.completion_tokens.unwrap_or(content_deltas),
        prompt_tokens: usage.prompt_tokens,
        cached_tokens: usage.cached_tokens,
    })
}

/// `GET /health` once; returns the status code.
pub(crate) fn health(address: SocketAddr) -> Result<u16> {
    get(address, "/health").map(|(status, _)| status)
}

/// The id of the first model `GET /v1/models` lists. Our server refuses other names with 404 (as OpenAI
/// does); llama-server accepts any, so asking both keeps one request shape for every server.
pub(crate) fn served_model(address: SocketAddr) -> Result<String> {
    let (status, body) = get(address, "/v1/models")?;
    ensure!(status == 200, "GET /v1/models answered {status}");
    let value: serde_json::Value =
        serde_json::from_slice(&body).context("GET /v1/models did not answer JSON")?;
    value["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .context("GET /v1/models listed no model id")
}

/// One `GET` with a short read timeout; returns the status and the whole body.
fn get(address: SocketAddr, path: &str) -> Result<(u16, Vec<u8>)> {
    let mut stream = connect(address)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .context("could not set a read timeout")?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .with_context(|| format!("could not send GET {path}"))?;
    let mut response = ResponseDecoder::new();
    let mut body = Vec::new();
    let mut buffer = [0_u8; 4096];
    loop {
        let read = stream
            .read(&mut buffer)
            .with_context(|| format!("reading GET {path} failed"))?;
        if read == 0 {
            response.finish()?;
            break;
        }
        if response.push(&buffer[..read], &mut body)? == Progress::Complete {
            break;
        }
    }
    let status = response
        .status()
        .with_context(|| format!("GET {path} answered without a status line"))?;
    Ok((status, body))
}

/// A connection with the read timeout set and Nagle off (the request goes out in one write anyway, but the
/// client should not be the one adding delay).
fn connect(address: SocketAddr) -> Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&address, CONNECT_TIMEOUT)
        .with_context(|| format!("could not connect to {address}"))?;
    stream
        .set_read_timeout(Some(READ_TIMEOUT))
        .context("could not set a read timeout")?;
    stream
        .set_nodelay(true)
        .context("could not set TCP_NODELAY")?;
    Ok(stream)
}

/// The status code and body framing of a response head (status line and header lines, no final CRLF).
fn parse_head(head: &str) -> Result<(u16, Framing)> {
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.split_whitespace();
    let version = parts.next().unwrap_or_default();
    ensure!(
        version.starts_with("HTTP/1."),
        "the response does not start with an HTTP/1.x status line: {status_line:?}"
    );
    let status: u16 = parts
        .next()
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("the status line {status_line:?} has no status code"))?;
    let mut chunked = false;
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            bail!("the header line {line:?} has no colon");
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked |= value
                .split(',')
                .any(|coding| coding.trim().eq_ignore_ascii_case("chunked"));
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(
                value
                    .parse::<usize>()
                    .with_context(|| format!("Content-Length {value:?} is not a number"))?,
            );
        }
    }
    // Transfer-Encoding wins over Content-Length (RFC 9112 section 6.3, rule 3).
    let framing = match (chunked, length) {
        (true, _) => Framing::Chunked(Chunk::Size),
        (false, Some(remaining)) => Framing::Length { remaining },
        (false, None) if status == 204 || status == 304 => Framing::Length { remaining: 0 },
        (false, None) => Framing::UntilClose,
    };
    Ok((status, framing))
}

/// The first position of `needle` in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A llama-server stream as it goes over the wire: chunked, a role chunk, two content chunks, the finish
    /// chunk, the usage chunk, `[DONE]`, split over chunks so that one event spans two of them.
    fn recorded_stream() -> Vec<u8> {
        let events = [
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Bread\"}}]}\n\n",
            ": ping\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" is\"}}]}\r\n\r\n",
            "data: {\"choices\":[{\"index\":0,\"finish_reason\":\"length\",\"delta\":{}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":9}}\n\n",
            "data: [DONE]\n\n",
        ];
        let joined = events.concat();
        let (first, second) = joined.split_at(joined.len() / 2);
        let mut wire = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
                         Transfer-Encoding: chunked\r\nServer: llama.cpp\r\n\r\n"
            .to_vec();
        for piece in [first, second] {
            wire.extend_from_slice(format!("{:x};ext=1\r\n", piece.len()).as_bytes());
            wire.extend_from_slice(piece.as_bytes());
            wire.extend_from_slice(b"\r\n");
        }
        wire.extend_from_slice(b"0\r\n\r\n");
        wire
    }

    /// Feeds `wire` to the decoders `step` bytes at a time; returns the events, the status and the progress.
    fn decode(wire: &[u8], step: usize) -> (Vec<Event>, Option<u16>, Progress) {
        let mut response = ResponseDecoder::new();
        let mut events = EventDecoder::default();
        let mut found = Vec::new();
        let mut progress = Progress::More;
        for piece in wire.chunks(step) {
            let mut body = Vec::new();
            progress = response
                .push(piece, &mut body)
                .expect("a recorded response must decode");
            for data in events.push(&body) {
                found.push(classify(&data).expect("every recorded event must classify"));
            }
        }
        (found, response.status(), progress)
    }

    #[test]
    fn a_recorded_chunked_stream_decodes_to_the_same_events_at_every_split() {
        let wire = recorded_stream();
        let expected = vec![
            Event::Chunk {
                content: false,
                usage: None,
            },
            Event::Chunk {
                content: true,
                usage: None,
            },
            Event::Chunk {
                content: true,
                usage: None,
            },
            Event::Chunk {
                content: false,
                usage: None,
            },
            Event::Chunk {
                content: false,
                usage: Some(Usage {
                    completion_tokens: Some(2),
                    prompt_tokens: Some(9),
                    cached_tokens: None,
                }),
            },
            Event::Done,
        ];
        for step in 1..=wire.len() {
            let (events, status, progress) = decode(&wire, step);
            assert_eq!(
                events, expected,
                "feeding {step} bytes at a time gave other events"
            );
            assert_eq!(
                status,
                Some(200),
                "the status line was misread at step {step}"
            );
            assert_eq!(
                progress,
                Progress::Complete,
                "the last chunk must end the message at step {step}"
            );
        }
    }

    #[test]
    fn a_content_length_body_ends_at_its_length_and_an_error_event_is_reported() {
        let body = "data: {\"error\":{\"code\":500,\"message\":\"out of memory\"}}\n\n";
        let wire = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let (events, _, progress) = decode(wire.as_bytes(), 7);
        assert_eq!(
            events,
            vec![Event::Error("out of memory".to_owned())],
            "the error event's message should be read out"
        );
        assert_eq!(
            progress,
            Progress::Complete,
            "a body is complete at its Content-Length"
        );
    }

    #[test]
    fn a_connection_closed_mid_chunk_is_an_error_but_an_unframed_body_may_end_at_close() {
        let mut chunked = ResponseDecoder::new();
        let mut body = Vec::new();
        chunked
            .push(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nshort",
                &mut body,
            )
            .unwrap();
        assert_eq!(body, b"short", "the partial chunk's bytes are passed on");
        assert!(
            chunked.finish().is_err(),
            "end of file inside a chunk must be an error"
        );
        let mut unframed = ResponseDecoder::new();
        unframed
            .push(b"HTTP/1.0 200 OK\r\n\r\ndata: x\n\n", &mut Vec::new())
            .unwrap();
        assert!(
            unframed.finish().is_ok(),
            "a body without length or chunking ends when the server closes"
        );
    }

    #[test]
    fn a_usage_chunk_gives_its_prompt_and_cached_tokens_and_a_null_usage_is_none() {
        let usage = classify(
            "{\"choices\":[],\"usage\":{\"completion_tokens\":16,\"prompt_tokens\":1043,\
             \"total_tokens\":1059,\"prompt_tokens_details\":{\"cached_tokens\":1024}}}",
        )
        .expect("a usage chunk classifies");
        assert_eq!(
            usage,
            Event::Chunk {
                content: false,
                usage: Some(Usage {
                    completion_tokens: Some(16),
                    prompt_tokens: Some(1043),
                    cached_tokens: Some(1024),
                }),
            },
            "the usage chunk's three counts should be read out"
        );
        let without_details = classify("{\"choices\":[],\"usage\":{\"prompt_tokens\":9}}").unwrap();
        assert_eq!(
            without_details,
            Event::Chunk {
                content: false,
                usage: Some(Usage {
                    prompt_tokens: Some(9),
                    ..Usage::default()
                }),
            },
            "a server without prompt_tokens_details reports no cached tokens, not zero"
        );
        let null =
            classify("{\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}").unwrap();
        assert_eq!(
            null,
            Event::Chunk {
                content: true,
                usage: None,
            },
            "a null usage on a content chunk is no usage"
        );
    }

    #[test]
    fn percentiles_follow_the_nearest_rank_rule() {
        let values: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&values, 50.0), 50.0, "p50 of 1..=100");
        assert_eq!(percentile(&values, 99.0), 99.0, "p99 of 1..=100");
        assert_eq!(percentile(&values, 100.0), 100.0, "p100 is the maximum");
        assert_eq!(percentile(&values, 0.0), 1.0, "p0 is the minimum");
        assert_eq!(
            percentile(&[3.0, 1.0, 2.0], 50.0),
            2.0,
            "p50 of three is the middle"
        );
        assert_eq!(
            percentile(&[7.0], 99.0),
            7.0,
            "one value is every percentile"
        );
        assert!(
            percentile(&[], 50.0).is_nan(),
            "no values give NaN, not zero"
        );
    }

    #[test]
    fn the_figures_divide_all_tokens_by_the_wall_time() {
        let record = |first_ms: u64, gaps_ms: &[u64], tokens| RequestRecord {
            first_token: Duration::from_millis(first_ms),
            gaps: gaps_ms
                .iter()
                .map(|&gap| Duration::from_millis(gap))
                .collect(),
            tokens,
            ..RequestRecord::default()
        };
        let outcome = LevelOutcome {
            records: vec![record(100, &[10, 20], 3), record(300, &[30], 2)],
            errors: vec!["status 503: busy".to_owned()],
            wall: Duration::from_millis(500),
        };
        let figures = outcome.figures();
        assert_eq!(figures.completed, 2, "two requests completed");
        assert_eq!(figures.errors, 1, "one request failed");
        assert_eq!(figures.first_error.as_deref(), Some("status 503: busy"));
        assert!(
            (figures.tokens_per_second - 10.0).abs() < 1e-9,
            "5 tokens in 0.5 s is 10 tok/s, got {}",
            figures.tokens_per_second
        );
        assert_eq!(figures.first_token_p50_ms, 100.0, "nearest-rank p50 of two");
        assert_eq!(figures.first_token_p99_ms, 300.0);
        assert_eq!(figures.gap_p50_ms, 20.0, "the gaps of all requests pool");
    }

    #[test]
    fn every_request_body_differs_and_asks_for_a_stream_with_usage() {
        let load = Load {
            address: "127.0.0.1:1".parse().unwrap(),
            model: "smollm2".to_owned(),
            concurrency: 2,
            requests_per_worker: 2,
            max_tokens: 128,
            temperature: 0.0,
        };
        let bodies: Vec<String> = (0..2)
            .flat_map(|worker| (0..2).map(move |index| (worker, index)))
            .map(|(worker, index)| load.body(worker, index))
            .collect();
        for (position, body) in bodies.iter().enumerate() {
            assert!(
                !bodies[..position].contains(body),
                "request {position}'s body repeats an earlier one"
            );
            let value: serde_json::Value = serde_json::from_str(body).expect("the body is JSON");
            assert_eq!(value["stream"], true, "requests must stream");
            assert_eq!(value["stream_options"]["include_usage"], true);
            assert_eq!(value["max_tokens"], 128);
        }
    }
}
