//! Every metric and span name stage-server emits, in one place, so `/metrics`, OTLP and the docs agree.
//!
//! Metric names are Prometheus-style (`stage_server_…`, counters end in `_total`, times in `_seconds`) and are
//! the same over OTLP. Span names follow skippy's `stage.*` vocabulary (`../shared/reference/stage-protocol.md`
//! section 11) where it has one.

/// What kind of value a metric is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// Observations in buckets.
    Histogram,
}

/// HTTP requests answered, by route and status.
pub const REQUESTS_TOTAL: &str = "stage_server_requests_total";
/// Prompt tokens prefilled.
pub const PROMPT_TOKENS_TOTAL: &str = "stage_server_prompt_tokens_total";
/// Tokens generated.
pub const GENERATED_TOKENS_TOTAL: &str = "stage_server_generated_tokens_total";
/// Requests waiting for a lane.
pub const QUEUE_DEPTH: &str = "stage_server_queue_depth";
/// Lanes running a generation.
pub const LANES_BUSY: &str = "stage_server_lanes_busy";
/// From a lane taking a request to its first token.
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "stage_server_time_to_first_token_seconds";
/// Between consecutive tokens of one generation.
pub const INTER_TOKEN_SECONDS: &str = "stage_server_inter_token_seconds";
/// How long a request waited for a lane.
pub const QUEUE_WAIT_SECONDS: &str = "stage_server_queue_wait_seconds";

/// One stage's compute time for one step (a prefill chunk or a decode step), on every stage.
pub const STAGE_COMPUTE_SECONDS: &str = "stage_server_stage_compute_seconds";
/// Activation rows computed (the batch size of each step, summed).
pub const STAGE_ROWS_TOTAL: &str = "stage_server_stage_rows_total";
/// Steps computed (prefill chunks and decode steps).
pub const STAGE_STEPS_TOTAL: &str = "stage_server_stage_steps_total";
/// Histogram: entries (lanes) per forward pass, the batch size.
pub const BATCH_ENTRIES: &str = "stage_server_batch_entries";
/// Bytes written on stage links, by link (`upstream` toward stage 0, `downstream` away from it).
pub const LINK_BYTES_SENT_TOTAL: &str = "stage_server_link_bytes_sent_total";
/// Bytes read from stage links, by link.
pub const LINK_BYTES_RECEIVED_TOTAL: &str = "stage_server_link_bytes_received_total";
/// Stage 0: from sending a step down the chain to its answer coming back (every later stage and the links).
pub const LINK_ROUND_TRIP_SECONDS: &str = "stage_server_link_round_trip_seconds";
/// Stage 0: times a prefill waited for the chain to give a reply credit back.
pub const CREDIT_WAITS_TOTAL: &str = "stage_server_credit_waits_total";

/// Spans handed to the exporter's queue.
pub const TELEMETRY_SPANS_QUEUED_TOTAL: &str = "stage_server_telemetry_spans_queued_total";
/// Spans dropped because the export queue was full (the collector is slow or gone).
pub const TELEMETRY_SPANS_DROPPED_TOTAL: &str = "stage_server_telemetry_spans_dropped_total";
/// Spans the collector accepted.
pub const TELEMETRY_SPANS_EXPORTED_TOTAL: &str = "stage_server_telemetry_spans_exported_total";
/// Exports (span batches and metric pushes) that failed or timed out.
pub const TELEMETRY_EXPORT_ERRORS_TOTAL: &str = "stage_server_telemetry_export_errors_total";
/// Spans waiting in the export queue.
pub const TELEMETRY_QUEUE_DEPTH: &str = "stage_server_telemetry_queue_depth";

/// net-io-blocking: connections open, by server (`links`, `api`, `metrics`).
pub const NET_CONNECTIONS_OPEN: &str = "stage_server_net_connections_open";
/// net-io-blocking: connections accepted, by server.
pub const NET_CONNECTIONS_ACCEPTED_TOTAL: &str = "stage_server_net_connections_accepted_total";
/// net-io-blocking: connections refused, by server and cause.
pub const NET_REFUSED_TOTAL: &str = "stage_server_net_refused_total";
/// net-io-blocking: connections closed, by server and close reason.
pub const NET_CLOSED_TOTAL: &str = "stage_server_net_closed_total";
/// net-io-blocking: bytes received on closed connections, by server.
pub const NET_BYTES_RECEIVED_TOTAL: &str = "stage_server_net_bytes_received_total";
/// net-io-blocking: bytes sent on closed connections, by server.
pub const NET_BYTES_SENT_TOTAL: &str = "stage_server_net_bytes_sent_total";
/// task-runtime: live tasks.
pub const TASKS_LIVE: &str = "stage_server_tasks_live";
/// task-runtime: tasks queued for a worker.
pub const TASKS_QUEUED: &str = "stage_server_tasks_queued";
/// task-runtime: pool workers.
pub const TASK_WORKERS: &str = "stage_server_task_workers";

/// Every metric: name, kind and help text (the `# HELP` line and the OTLP description).
pub const METRICS: &[(&str, Kind, &str)] = &[
    (
        REQUESTS_TOTAL,
        Kind::Counter,
        "HTTP requests answered, by route and status.",
    ),
    (
        PROMPT_TOKENS_TOTAL,
        Kind::Counter,
        "Prompt tokens prefilled.",
    ),
    (GENERATED_TOKENS_TOTAL, Kind::Counter, "Tokens generated."),
    (QUEUE_DEPTH, Kind::Gauge, "Requests waiting for a lane."),
    (LANES_BUSY, Kind::Gauge, "Lanes running a generation."),
    (
        TIME_TO_FIRST_TOKEN_SECONDS,
        Kind::Histogram,
        "From a lane taking a request to its first token (the prefill through every stage).",
    ),
    (
        INTER_TOKEN_SECONDS,
        Kind::Histogram,
        "Between consecutive tokens of one generation (a decode step through every stage).",
    ),
    (
        QUEUE_WAIT_SECONDS,
        Kind::Histogram,
        "How long a request waited for a lane.",
    ),
    (
        STAGE_COMPUTE_SECONDS,
        Kind::Histogram,
        "This stage's compute time per step (a prefill chunk or a decode step).",
    ),
    (
        STAGE_ROWS_TOTAL,
        Kind::Counter,
        "Activation rows this stage computed.",
    ),
    (
        STAGE_STEPS_TOTAL,
        Kind::Counter,
        "Steps this stage computed.",
    ),
    (
        BATCH_ENTRIES,
        Kind::Histogram,
        "Entries (lanes) per forward pass of this stage: how many requests one pass served.",
    ),
    (
        LINK_BYTES_SENT_TOTAL,
        Kind::Counter,
        "Bytes written on stage links, by link.",
    ),
    (
        LINK_BYTES_RECEIVED_TOTAL,
        Kind::Counter,
        "Bytes read from stage links, by link.",
    ),
    (
        LINK_ROUND_TRIP_SECONDS,
        Kind::Histogram,
        "Stage 0: from a step going down the chain to its answer coming back.",
    ),
    (
        CREDIT_WAITS_TOTAL,
        Kind::Counter,
        "Stage 0: prefill waits for a reply credit.",
    ),
    (
        TELEMETRY_SPANS_QUEUED_TOTAL,
        Kind::Counter,
        "Spans handed to the export queue.",
    ),
    (
        TELEMETRY_SPANS_DROPPED_TOTAL,
        Kind::Counter,
        "Spans dropped because the export queue was full.",
    ),
    (
        TELEMETRY_SPANS_EXPORTED_TOTAL,
        Kind::Counter,
        "Spans the collector accepted.",
    ),
    (
        TELEMETRY_EXPORT_ERRORS_TOTAL,
        Kind::Counter,
        "OTLP exports that failed or timed out.",
    ),
    (
        TELEMETRY_QUEUE_DEPTH,
        Kind::Gauge,
        "Spans waiting in the export queue.",
    ),
    (
        NET_CONNECTIONS_OPEN,
        Kind::Gauge,
        "Connections open, by server.",
    ),
    (
        NET_CONNECTIONS_ACCEPTED_TOTAL,
        Kind::Counter,
        "Connections accepted, by server.",
    ),
    (
        NET_REFUSED_TOTAL,
        Kind::Counter,
        "Connections refused, by server and cause.",
    ),
    (
        NET_CLOSED_TOTAL,
        Kind::Counter,
        "Connections closed, by server and reason.",
    ),
    (
        NET_BYTES_RECEIVED_TOTAL,
        Kind::Counter,
        "Bytes received on closed connections.",
    ),
    (
        NET_BYTES_SENT_TOTAL,
        Kind::Counter,
        "Bytes sent on closed connections.",
    ),
    (TASKS_LIVE, Kind::Gauge, "task-runtime: live tasks."),
    (
        TASKS_QUEUED,
        Kind::Gauge,
        "task-runtime: tasks queued for a worker.",
    ),
    (TASK_WORKERS, Kind::Gauge, "task-runtime: pool workers."),
];

/// Span: one HTTP request on stage 0's API (`request_id`, `route`, `status`).
pub const SPAN_HTTP_REQUEST: &str = "stage.openai_http_request";
/// Span: one generation on a lane (`lane`, `prompt_tokens`, `output_tokens`).
pub const SPAN_GENERATION: &str = "stage.openai_generation";
/// Span: one prefill chunk at stage 0 (`position`, `rows`).
pub const SPAN_PREFILL_CHUNK: &str = "stage.openai_prefill_chunk";
/// Span: one decode step at stage 0 (`position`).
pub const SPAN_DECODE_STEP: &str = "stage.openai_decode";
/// Span: one session on a stage process, Configure to Stop (`stage_index`, `session_id`).
pub const SPAN_STAGE_SESSION: &str = "stage.binary_session";
/// Span: one frame's compute on a stage process (`stage_index`, `session_id`, `kind`, `rows`,
/// `compute_micros`; `queue_wait_micros` from the link handing the frame to the compute thread to its
/// compute; `write_micros` from the end of its compute to its answer, the rows for the next stage or the
/// token, acknowledgement or error for the one before, being written to the link's socket).
pub const SPAN_STAGE_FRAME: &str = "stage.binary_llama_decode";

// Lifecycle events: the moments a process or a link changes state, each an event whose message is its name
// (so a JSON log line's `fields.message` says which), with the ids that identify it as fields. Process
// moments (start, ready, drain, exit) are at info, link moments at debug (a broken link or chain at warn),
// per-frame work stays at trace. Names follow skippy's `stage.binary_*` (stage processes) and
// `stage.openai_*` (stage 0) vocabulary (`../shared/reference/stage-protocol.md` section 11).

/// Event (info): a stage process opens its model (`stage_index` when given, `layer_start`, `layer_end`,
/// `model_id`, `lanes`).
pub const EVENT_STAGE_LOADING: &str = "stage.binary_server_loading";
/// Event (info): a stage process serves (`stage_index`, `layer_start`, `layer_end`, `address`, `width`,
/// `model_id`, `lanes`, `next` unless it is last): the moment of its `… serving layers A..B on ADDR` line.
pub const EVENT_STAGE_READY: &str = "stage.binary_server_start";
/// Event (debug): a stage accepted a link from the stage before it (`connection_id`, `peer`).
pub const EVENT_UPSTREAM_ACCEPTED: &str = "stage.binary_upstream_accepted";
/// Event (debug): a link from the stage before closed (`stage_index`, `connection_id`, `peer`, `reason`,
/// `sessions_stopped`: its sessions still open, whose lanes the close frees).
pub const EVENT_UPSTREAM_CLOSED: &str = "stage.binary_upstream_closed";
/// Event (debug): the link to the next stage passed its hello (`stage_index`, `peer`).
pub const EVENT_DOWNSTREAM_UP: &str = "stage.binary_downstream_up";
/// Event (warn while the link before it is still open, debug when it closes with it): the link to the next
/// stage closed or failed its hello (`stage_index`, `peer`, `reason`). A stage process does not retry: the
/// next link from the stage before opens a new one.
pub const EVENT_DOWNSTREAM_DOWN: &str = "stage.binary_downstream_down";
/// Event (info): a stage process drains (`stage_index`, `address`, `reason`, `drain_timeout_millis`,
/// `sessions_open`).
pub const EVENT_STAGE_DRAIN: &str = "stage.binary_server_drain";
/// Event (info): a stage process's drain ended (`stage_index`, `address`, `sessions_finished`,
/// `sessions_stopped` at the deadline, `links_graceful`, `links_killed`, `elapsed_millis`).
pub const EVENT_STAGE_DRAINED: &str = "stage.binary_server_drained";
/// Event (info): a stage process exits (`stage_index`, `reason`).
pub const EVENT_STAGE_EXIT: &str = "stage.binary_server_stop";
/// Event (debug): `run` started a stage process (`stage_index`, `layer_start`, `layer_end`, `pid`).
pub const EVENT_PIPELINE_STAGE_SPAWNED: &str = "stage.pipeline_stage_spawned";
/// Event (info): a stage process `run` started serves (`stage_index`, `layer_start`, `layer_end`, `pid`,
/// `address`, `metrics_address` when it has one).
pub const EVENT_PIPELINE_STAGE_READY: &str = "stage.pipeline_stage_ready";
/// Event (error): a stage process `run` started ended on its own (`stage_index`, `layer_start`,
/// `layer_end`, `pid`, `status`).
pub const EVENT_PIPELINE_STAGE_EXITED: &str = "stage.pipeline_stage_exited";
/// Event (info): stage 0's API serves: every lane is ready (`address`, `model_id`, `lanes`,
/// `context_length`).
pub const EVENT_API_READY: &str = "stage.openai_pool_ready";
/// Event (error): stage 0's model or lanes did not load (`address`, `model_id`, `reason`).
pub const EVENT_API_LOAD_FAILED: &str = "stage.openai_load_error";
/// Event (debug): a stage 0 lane whose link broke opens a new one (`lane`, `peer`).
pub const EVENT_DOWNSTREAM_RECONNECT: &str = "stage.openai_downstream_connect";
/// Event (warn): the chain behind stage 0 stopped answering (`reason`): a probe or a lane's link failed.
pub const EVENT_CHAIN_DOWN: &str = "stage.openai_chain_down";
/// Event (info): the chain behind stage 0 answers again (`reason`: why it was down).
pub const EVENT_CHAIN_UP: &str = "stage.openai_chain_up";
/// Event (info): `run` drains (`reason`, `drain_timeout_millis`).
pub const EVENT_PIPELINE_DRAIN: &str = "stage.pipeline_drain";
/// Event (info): `run`'s drain ended and its stage processes stopped (`connections_graceful`,
/// `connections_killed`, `elapsed_millis`).
pub const EVENT_PIPELINE_DRAINED: &str = "stage.pipeline_drained";

/// The help text of metric `name`.
pub fn help(name: &str) -> &'static str {
    METRICS
        .iter()
        .find(|(known, _, _)| *known == name)
        .map_or("", |(_, _, help)| help)
}
