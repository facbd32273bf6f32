//! One HTTP/1.1 connection of the API, as a net-io-blocking session on an event loop: it parses requests,
//! answers the quick routes at once, and for a generation submits a job and listens until its events wake it.
//!
//! ```text
//!   Reading ──request──▶ quick route: response ──▶ Reading (keep-alive) or Closing
//!      │
//!      └─generation──▶ Generating (Step::Listen: a wake brings events, a FIN or close cancels the job)
//!                           │ Delta: chunks (the first with a stream's head); Finished/Failed: the end
//!                           └──────────────▶ Reading / Closing
//! ```
//!
//! While a generation runs the session keeps reading (so a client that goes away is seen at once and its
//! lane freed), but takes in at most [`INBOX_MAX`] bytes of whatever the client pipelines behind it.

use std::sync::Arc;
use std::time::Duration;

use net_io_blocking::{
    CloseReason, ConnectionInfo, Input, Phase, Session, SessionContext, Step, TimeoutKind,
};
use task_runtime::{Compute, Runtime};

use super::engine::{EVENTS_TOKEN, Job, JobEvent, queue_wait_left};
use super::routes::{self, Routed};
use super::state::ApiState;
use crate::api::{
    self, ApiError, FinishReason, Reply, TokenLogprob, Usage, chat_chunk_content,
    chat_chunk_finish, chat_chunk_role, completion_chunk, usage_chunk,
};
use crate::http::{
    CONTINUE_RESPONSE, Framing, HttpError, Parsed, Request, RequestParser, write_head,
    write_last_chunk, write_response, write_sse_event,
};

/// Bytes of pipelined input a session takes in while a generation runs.
const INBOX_MAX: usize = 64 << 10;
/// How long a request may take to arrive once its first byte came (a slow client is cut, not waited on).
const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

/// A generation in progress on this connection.
#[derive(Debug)]
struct Generating {
    job: Arc<Job>,
    route: &'static str,
    chat: bool,
    stream: bool,
    include_usage: bool,
    keep_alive: bool,
    /// Whether a stream goes in chunks (HTTP/1.1); to an HTTP/1.0 client it is bare and ends with the
    /// connection.
    chunked: bool,
    id: String,
    created: u64,
    /// Whether a stream's head went out: with its first output, so that a generation that fails before any
    /// (the chain down, no lane free at a stage) is answered with its own status instead of a 200 whose stream
    /// carries the error.
    head_sent: bool,
    text: String,
    logprobs: Option<Vec<TokenLogprob>>,
    /// The request's id, echoed in the reply's `x-request-id` header.
    request_id: String,
    /// The request's span, held and never entered, so that it ends when the reply does (and not before
    /// the generation under it: a child keeps its parent open).
    span: tracing::Span,
}

#[derive(Debug)]
enum State {
    Reading,
    Generating(Box<Generating>),
    /// The last response is going out; then the connection closes.
    Closing,
}

/// The API session of one connection.
#[derive(Debug)]
pub(crate) struct HttpSession {
    state: Arc<ApiState>,
    parser: RequestParser,
    inbox: Vec<u8>,
    phase: State,
    receiving: bool,
    /// Output built during a hook, queued on the connection when the hook ends (see [`HttpSession::queue`]).
    scratch: Vec<u8>,
}

impl HttpSession {
    pub(crate) fn new(state: Arc<ApiState>) -> HttpSession {
        let parser = RequestParser::new(state.config.http_limits);
        HttpSession {
            state,
            parser,
            inbox: Vec::new(),
            phase: State::Reading,
            receiving: false,
            scratch: Vec::new(),
        }
    }

    /// Queues what the hook wrote and passes its step on; output beyond the connection's budget (a reply no
    /// client of this API makes the server write) resets the connection.
    fn queue(&mut self, step: Step, context: &mut SessionContext<'_>) -> Step {
        if !self.scratch.is_empty() {
            if context.output().push(&self.scratch).is_err() {
                self.cancel();
                return Step::Abort;
            }
            self.scratch.clear();
        }
        step
    }

    /// Reads the next request from buffered input and answers it, or asks for more input.
    fn process(&mut self, context: &mut SessionContext<'_>) -> Step {
        match self.phase {
            State::Reading => {}
            State::Generating(_) => return Step::Listen,
            State::Closing => return Step::Write,
        }
        let (consumed, parsed) = match self.parser.parse(&self.inbox) {
            Ok(parsed) => parsed,
            Err(error) => return self.refuse_http(error, context),
        };
        self.inbox.drain(..consumed.min(self.inbox.len()));
        match parsed {
            Parsed::NeedMore => {
                self.track_request_deadline(context);
                Step::Read
            }
            Parsed::Continue => {
                self.scratch.extend_from_slice(CONTINUE_RESPONSE);
                Step::Write
            }
            // Every answer is written before the next request is read (`on_writable` comes back here).
            Parsed::Request(request) => {
                self.receiving = false;
                context.set_exchange_deadline(None);
                self.handle(request, context)
            }
        }
    }

    /// A request that started arriving must be complete within [`REQUEST_DEADLINE`].
    fn track_request_deadline(&mut self, context: &mut SessionContext<'_>) {
        let in_progress = self.parser.in_progress() || !self.inbox.is_empty();
        if in_progress && !self.receiving {
            self.receiving = true;
            context.set_exchange_deadline(Some(context.now() + REQUEST_DEADLINE));
        }
    }

    /// Answers `request`: a quick response is written (and, kept alive, the next request read once it is
    /// out), a generation is queued and listened for.
    ///
    /// The request's span is not entered here: a generation holds it until its reply ends, and
    /// tracing-opentelemetry would end an entered span at this hook's return (see `telemetry`'s doc).
    fn handle(&mut self, request: Request, context: &mut SessionContext<'_>) -> Step {
        let (request_id, span) = request_span(&request);
        let keep_alive = request.keep_alive && !context.draining();
        match routes::route(&self.state, &request) {
            Routed::Respond {
                route,
                status,
                content_type,
                body,
                retry_after,
            } => {
                span.record("route", route);
                span.record("status", status);
                self.state.metrics.count_request(route, status);
                let mut headers = vec![
                    ("Content-Type", content_type),
                    ("x-request-id", request_id.as_str()),
                ];
                if retry_after {
                    headers.push(("Retry-After", "1"));
                }
                if status == 401 {
                    // What a client must send (RFC 9110, section 11.6.1).
                    headers.push(("WWW-Authenticate", "Bearer"));
                }
                write_response(&mut self.scratch, status, &headers, &body, keep_alive);
                if !keep_alive {
                    self.phase = State::Closing;
                }
                Step::Write
            }
            Routed::Generate {
                route,
                spec,
                chat,
                stream,
                include_usage,
                logprobs,
            } => {
                let Some(completer) = context.completer() else {
                    let error =
                        ApiError::server_error("this connection cannot be woken by the lanes");
                    return self.respond_error(route, &error, false, &request_id, &span, context);
                };
                let Some(ready) = self.state.ready.get() else {
                    let error = ApiError::unavailable("the model is still loading");
                    return self.respond_error(
                        route,
                        &error,
                        keep_alive,
                        &request_id,
                        &span,
                        context,
                    );
                };
                span.record("route", route);
                // The job holds this request's span as its generation's parent.
                let job = Job::new(*spec, completer, span.clone());
                if let Err(error) = ready.engine.submit(&job) {
                    return self.respond_error(
                        route,
                        &error,
                        keep_alive,
                        &request_id,
                        &span,
                        context,
                    );
                }
                // The queue deadline runs as a task: if no lane took the job by then, it takes the job out
                // of the queue and fails it, which reaches this session as the job's own event (so a
                // deadline can never touch a later job of the same connection).
                let wait = queue_wait_left(&job, self.state.config.queue_timeout);
                // Weak: a job that ended meanwhile is dropped at once (and with it the request's span, which
                // ends when its last handle goes), not kept until its deadline would have passed.
                let (state, waiting) = (Arc::clone(&self.state), Arc::downgrade(&job));
                let _ = Runtime::task(Compute::compute(move |()| {
                    let Some(waiting) = waiting.upgrade() else {
                        return;
                    };
                    let withdrawn = state
                        .ready
                        .get()
                        .is_some_and(|ready| ready.engine.withdraw(&waiting));
                    if withdrawn {
                        waiting.fail(ApiError::overloaded(format!(
                            "no lane came free within the queue timeout ({} s); retry shortly",
                            state.config.queue_timeout.as_secs_f64()
                        )));
                    }
                }))
                .after(wait)
                .spawn();
                // Busy while the generation runs, so a drain waits for it; reads go on (see the module doc).
                context.set_phase(Phase::Sending);
                self.phase = State::Generating(Box::new(Generating {
                    job,
                    route,
                    chat,
                    stream,
                    include_usage,
                    // A stream to an HTTP/1.0 client ends with the connection: nothing can follow it.
                    keep_alive: keep_alive && (request.version >= 1 || !stream),
                    chunked: request.version >= 1,
                    id: api::new_id(if chat { "chatcmpl-" } else { "cmpl-" }),
                    created: unix_seconds(),
                    head_sent: false,
                    text: String::new(),
                    logprobs: logprobs.then(Vec::new),
                    request_id,
                    span,
                }));
                Step::Listen
            }
        }
    }

    /// An error response for request `request_id` (its status recorded on `span`); the connection stays
    /// open when `keep_alive`.
    fn respond_error(
        &mut self,
        route: &'static str,
        error: &ApiError,
        keep_alive: bool,
        request_id: &str,
        span: &tracing::Span,
        context: &mut SessionContext<'_>,
    ) -> Step {
        span.record("status", error.status);
        self.state.metrics.count_request(route, error.status);
        let mut headers = vec![
            ("Content-Type", "application/json"),
            ("x-request-id", request_id),
        ];
        if error.status == 429 || error.status == 503 {
            headers.push(("Retry-After", "1"));
        }
        let body = error.to_json();
        write_response(
            &mut self.scratch,
            error.status,
            &headers,
            body.as_bytes(),
            keep_alive,
        );
        if keep_alive {
            context.set_phase(Phase::Idle);
            self.phase = State::Reading;
        } else {
            self.phase = State::Closing;
        }
        Step::Write
    }

    /// A request the HTTP layer could not read: the answer, then the close (the stream cannot be resynced).
    fn refuse_http(&mut self, error: HttpError, context: &mut SessionContext<'_>) -> Step {
        let api_error = ApiError::from_status(error.status, error.message.clone());
        self.inbox.clear();
        // No header could be read, so the id is a fresh one; no span (nothing was routed).
        let request_id = api::new_id("req-");
        self.respond_error(
            "(unparsed)",
            &api_error,
            false,
            &request_id,
            &tracing::Span::none(),
            context,
        )
    }

    /// Turns the job's events into output.
    fn deliver(&mut self, context: &mut SessionContext<'_>) -> Step {
        let generating = match &mut self.phase {
            State::Generating(generating) => generating,
            // A late event of a job whose reply already ended (a drain's deadline failed it while its lane
            // was still at work): nothing to send, and the connection stays as its phase says.
            State::Reading => return Step::Read,
            State::Closing => return Step::Write,
        };
        let model = self.state.model_id.as_str();
        let fingerprint = self.state.fingerprint.as_str();
        let events = generating.job.take_events();
        let out = &mut self.scratch;
        let mut ended: Option<bool> = None;
        for event in events {
            let reply = Reply {
                id: &generating.id,
                created: generating.created,
                model,
                fingerprint,
            };
            match event {
                JobEvent::Delta { text, logprobs } => {
                    if generating.stream {
                        if !std::mem::replace(&mut generating.head_sent, true) {
                            write_stream_head(generating, &reply, out);
                        }
                        let logprobs = generating.logprobs.as_ref().map(|_| logprobs.as_slice());
                        let chunk = if generating.chat {
                            chat_chunk_content(&reply, &text, logprobs)
                        } else {
                            completion_chunk(&reply, &text, logprobs, None)
                        };
                        write_sse_event(out, &chunk, generating.chunked);
                    } else {
                        generating.text.push_str(&text);
                        if let Some(all) = generating.logprobs.as_mut() {
                            all.extend(logprobs);
                        }
                    }
                }
                JobEvent::Finished { finish, usage } => {
                    if generating.stream && !std::mem::replace(&mut generating.head_sent, true) {
                        write_stream_head(generating, &reply, out);
                    }
                    finish_reply(generating, &reply, finish, &usage, out);
                    generating.span.record("status", 200);
                    self.state.metrics.count_request(generating.route, 200);
                    ended = Some(generating.keep_alive);
                    break;
                }
                JobEvent::Failed(error) => {
                    if generating.stream && generating.head_sent {
                        // Headers went out: the error is the stream's last event (as llama-server sends it).
                        write_sse_event(out, &error.to_json(), generating.chunked);
                        write_sse_event(out, "[DONE]", generating.chunked);
                        if generating.chunked {
                            write_last_chunk(out);
                        }
                        generating.span.record("status", error.status);
                        self.state
                            .metrics
                            .count_request(generating.route, error.status);
                        ended = Some(generating.keep_alive);
                    } else {
                        let route = generating.route;
                        let keep_alive = generating.keep_alive;
                        let (request_id, span) =
                            (generating.request_id.clone(), generating.span.clone());
                        return self.respond_error(
                            route,
                            &error,
                            keep_alive,
                            &request_id,
                            &span,
                            context,
                        );
                    }
                    break;
                }
            }
        }
        match ended {
            Some(keep_alive) => {
                context.set_phase(Phase::Idle);
                self.phase = if keep_alive {
                    State::Reading
                } else {
                    State::Closing
                };
                Step::Write
            }
            None if out.is_empty() => Step::Listen,
            None => Step::Write,
        }
    }

    /// Cancels a running or queued job (the client went away).
    fn cancel(&mut self) {
        if let State::Generating(generating) = &self.phase {
            generating.job.cancel();
            if let Some(ready) = self.state.ready.get() {
                ready.engine.withdraw(&generating.job);
            }
        }
    }
}

/// Writes a stream's head (and a chat stream's role chunk), before its first output.
fn write_stream_head(generating: &Generating, reply: &Reply<'_>, out: &mut Vec<u8>) {
    write_head(
        out,
        200,
        &[
            ("Content-Type", "text/event-stream"),
            ("Cache-Control", "no-cache"),
            ("x-request-id", generating.request_id.as_str()),
        ],
        if generating.chunked {
            Framing::Chunked
        } else {
            Framing::UntilClose
        },
        generating.keep_alive,
    );
    if generating.chat {
        write_sse_event(out, &chat_chunk_role(reply), generating.chunked);
    }
}

/// The end of a successful reply: the whole response, or the stream's last chunks.
fn finish_reply(
    generating: &Generating,
    reply: &Reply<'_>,
    finish: FinishReason,
    usage: &Usage,
    out: &mut Vec<u8>,
) {
    if generating.stream {
        let chunk = if generating.chat {
            chat_chunk_finish(reply, finish)
        } else {
            completion_chunk(reply, "", None, Some(finish))
        };
        write_sse_event(out, &chunk, generating.chunked);
        if generating.include_usage {
            write_sse_event(
                out,
                &usage_chunk(reply, generating.chat, usage),
                generating.chunked,
            );
        }
        write_sse_event(out, "[DONE]", generating.chunked);
        if generating.chunked {
            write_last_chunk(out);
        }
    } else {
        let logprobs = generating.logprobs.as_deref();
        let body = if generating.chat {
            api::chat_completion(reply, &generating.text, finish, usage, logprobs)
        } else {
            api::completion(reply, &generating.text, finish, usage, logprobs)
        };
        write_response(
            out,
            200,
            &[
                ("Content-Type", "application/json"),
                ("x-request-id", generating.request_id.as_str()),
            ],
            body.as_bytes(),
            generating.keep_alive,
        );
    }
}

fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

impl Session for HttpSession {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let room = match self.phase {
            State::Reading => usize::MAX,
            _ => INBOX_MAX.saturating_sub(self.inbox.len()),
        };
        let bytes = input.bytes();
        let taken = bytes.len().min(room);
        self.inbox.extend_from_slice(&bytes[..taken]);
        input.consume(taken);
        let step = self.process(context);
        self.queue(step, context)
    }

    fn on_writable(&mut self, context: &mut SessionContext<'_>) -> Step {
        let step = match self.phase {
            State::Closing => Step::Close,
            State::Generating(_) => Step::Listen,
            State::Reading => self.process(context),
        };
        self.queue(step, context)
    }

    fn on_wake(&mut self, token: u64, _value: u64, context: &mut SessionContext<'_>) -> Step {
        let step = match token {
            EVENTS_TOKEN => self.deliver(context),
            _ => match self.phase {
                State::Generating(_) => Step::Listen,
                State::Reading => Step::Read,
                State::Closing => Step::Write,
            },
        };
        self.queue(step, context)
    }

    fn on_timeout(&mut self, _kind: TimeoutKind, _context: &mut SessionContext<'_>) -> Step {
        self.cancel();
        Step::Close
    }

    fn on_peer_closed(&mut self, _context: &mut SessionContext<'_>) -> Step {
        // A client that half-closes is treated as gone (HTTP clients close both ways), so its lane is freed.
        self.cancel();
        Step::Close
    }

    fn on_close(&mut self, _info: &ConnectionInfo, _reason: CloseReason) {
        self.cancel();
    }
}

/// Makes the sessions of the API's listener.
pub(crate) fn factory(
    state: Arc<ApiState>,
) -> impl Fn(&ConnectionInfo) -> Option<HttpSession> + Send + Sync + 'static {
    move |_: &ConnectionInfo| Some(HttpSession::new(Arc::clone(&state)))
}

/// The id and the span of one request: `request_id` from `x-request-id` (or a fresh one), continuing the
/// trace of a `traceparent` header. Lifecycle, so info: one per request, never per token.
fn request_span(request: &Request) -> (String, tracing::Span) {
    let request_id = request
        .header("x-request-id")
        .map(request_id_from_header)
        .filter(|id| !id.is_empty())
        .unwrap_or_else(|| api::new_id("req-"));
    let span = tracing::info_span!(
        "stage.openai_http_request",
        request_id = %request_id,
        method = %request.method,
        route = tracing::field::Empty,
        status = tracing::field::Empty,
    );
    if let Some(parent) = request
        .header("traceparent")
        .and_then(crate::telemetry::TraceContext::parse_traceparent)
    {
        crate::telemetry::continue_trace(&span, &parent);
    }
    (request_id, span)
}

/// A client's `x-request-id`, made safe to echo in a header and to log: printable ASCII only (no space,
/// no control), at most 128 characters.
fn request_id_from_header(value: &str) -> String {
    value
        .chars()
        .filter(char::is_ascii_graphic)
        .take(128)
        .collect()
}
