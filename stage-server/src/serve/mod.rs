//! A stage process: serves one layer range of a model to the stage before it over the stage protocol, on the
//! event loops of a net-io-blocking server, with one compute thread owning the layers and their lanes.
//!
//! ```text
//!   stage-server serve --model F --layers 10..20 --bind ADDR [--next ADDR]
//!
//!     listener ──(caps, --allow-from gate)──▶ event loops: Link::Upstream sessions ──▶ compute thread
//!                                                 │ (one per link of the stage before)      (Stage, lanes)
//!                                                 └─▶ Link::Downstream sessions, outbound ──▶ next stage
//! ```
//!
//! What a stage keeps: a link never holds a thread (sessions listen on the loops), compute never runs on a
//! loop thread, a lane is freed the moment its link ends, and every refusal is an `Error` frame in words
//! before the close. Stage 0 (the layers from 0, with the embeddings) is not served here: it drives the
//! chain (see [`crate::driver`]).

mod budget;
mod compute;
mod downstream;
mod gate;
mod link;
mod onward;
mod pair;
mod retry;
mod returns;
mod shaping;
mod topology;

use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use net_io_blocking::{
    DrainReport, Limits, NetError, Server, ServerBuilder, ServerHandle, SessionDriver,
    TrustedProxies,
};

use crate::model::{self, ModelError, ModelFile, Stage, StageOptions, StageSpec};
use crate::telemetry::names;
use crate::wire::{ClusterKey, CodecPolicy, CodecSet, Hello, PROTOCOL_VERSION, Role, WireLimits};
use link::{Link, StageShared};
pub use shaping::LinkShape;
pub use topology::{Topology, TopologyError, TopologyStage};

/// How long a stage keeps trying to reach the next one by default: long enough for a next stage whose
/// process is restarting to be listening again on a loaded host, short enough that stage 0 hears of one that
/// is down well inside its own handshake timeout.
pub const CONNECT_RETRY_TIMEOUT_DEFAULT: Duration = Duration::from_secs(1);

/// How a stage process runs.
#[derive(Clone, Debug)]
pub struct StageConfig {
    /// The GGUF model.
    pub model: PathBuf,
    /// The layers this stage serves; must not start at 0 (that is stage 0's, with the embeddings).
    pub layers: Range<usize>,
    /// Where the stage listens for the stage before it.
    pub bind: SocketAddr,
    /// The next stage, unless this one serves the model's last layers.
    pub next: Option<SocketAddr>,
    /// Concurrent sessions (each with its own KV cache).
    pub lanes: usize,
    /// Context limit per lane (default: the model's).
    pub context_length: Option<usize>,
    /// A shared secret every stage of the cluster holds; links without it are refused.
    pub cluster_key: Option<ClusterKey>,
    /// Addresses allowed to connect (empty: any).
    pub allow_from: Option<TrustedProxies>,
    /// How activations go to the next stage.
    pub codec: CodecPolicy,
    /// How long the connect to the next stage may take.
    pub connect_timeout: Duration,
    /// How long a link keeps trying to reach the next stage (a refused or timed-out connect, or a close
    /// before the next stage answered), with a doubling backoff from 25 ms, before it refuses the stage before
    /// it with `StageDown`; zero: one attempt. A next stage that answers and refuses is not tried again.
    pub connect_retry_timeout: Duration,
    /// Delay and rate on each direction of the link to the next stage, or at the last stage on the tokens it
    /// returns to stage 0 directly, applied in the process (for tests and benchmarks).
    pub shape: LinkShape,
    /// This stage's place in the chain as the operator gave it (`--stage`), for its lifecycle events; links
    /// learn theirs from the stage before.
    pub stage_index: Option<u16>,
    /// At the last stage: the address stage 0 should open its prediction-return links to (`--advertise`),
    /// named in the hellos up the chain; `None`: the address each upstream link reached this stage at, which
    /// is right unless stage 0 reaches the stage by another address (a NAT, another interface).
    pub advertise: Option<SocketAddr>,
    /// The most bytes each link pair holds for the next stage (rows computing, queued, shaped or in the
    /// output) and the most an upstream link reads ahead of its answers (`--link-buffer-mib`). Past it the
    /// link hands compute no further chunk, and stops reading the stage before it, until the next stage
    /// catches up: back-pressure, never a refusal. `None`: `lanes + 2` prefill chunks of 512 rows at the
    /// model's width in f32 (no larger than a frame may be), at least 64 MiB.
    pub link_buffer: Option<usize>,
}

impl StageConfig {
    /// A stage of `model` serving `layers` on `bind` with the defaults: 4 lanes, f32 activations, no key,
    /// any peer, a 5 s connect timeout.
    pub fn new(model: PathBuf, layers: Range<usize>, bind: SocketAddr) -> StageConfig {
        StageConfig {
            model,
            layers,
            bind,
            next: None,
            lanes: 4,
            context_length: None,
            cluster_key: None,
            allow_from: None,
            codec: CodecPolicy::F32,
            connect_timeout: Duration::from_secs(5),
            connect_retry_timeout: CONNECT_RETRY_TIMEOUT_DEFAULT,
            shape: LinkShape::default(),
            stage_index: None,
            advertise: None,
            link_buffer: None,
        }
    }
}

/// Why a stage process could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The model could not be loaded.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The layer range does not fit the model or this command.
    #[error("{0}")]
    Layers(String),
    /// The server could not start (an address in use, a bad limit).
    #[error("the stage's server did not start")]
    Server(#[from] NetError),
    /// The compute thread could not start.
    #[error("the compute thread did not start")]
    Thread(#[source] std::io::Error),
}

/// A running stage process.
#[derive(Debug)]
pub struct StageProcess {
    server: Server,
    hello: Hello,
    compute: Option<JoinHandle<()>>,
    shared: Arc<StageShared>,
}

impl StageProcess {
    /// Loads the stage's layers (only those), starts its compute thread and its server. Returns once the
    /// stage accepts links.
    pub fn start(config: StageConfig) -> Result<StageProcess, ServeError> {
        let layers = config.layers.clone();
        let model_id = config
            .model
            .file_stem()
            .map(|stem| stem.to_string_lossy().into_owned());
        tracing::info!(
            stage_index = config.stage_index,
            layer_start = layers.start,
            layer_end = layers.end,
            model_id,
            lanes = config.lanes.max(1),
            "{}",
            names::EVENT_STAGE_LOADING
        );
        let file = ModelFile::open(&config.model)?;
        let block_count = file.config().block_count;
        if layers.start == 0 {
            return Err(ServeError::Layers(format!(
                "layers {}..{} start at 0, which is stage 0's (it holds the embeddings and drives the chain); run it with `stage-server generate --layers 0..{} --next ADDR`",
                layers.start, layers.end, layers.end
            )));
        }
        if layers.is_empty() || layers.end > block_count {
            return Err(ServeError::Layers(format!(
                "layers {}..{} are not a range of this model's {block_count} layers",
                layers.start, layers.end
            )));
        }
        let last = layers.end == block_count;
        if last && config.next.is_some() {
            return Err(ServeError::Layers(format!(
                "layers {}..{} end the model, so this stage is last and takes no --next",
                layers.start, layers.end
            )));
        }
        if !last && config.next.is_none() {
            return Err(ServeError::Layers(format!(
                "layers {}..{} stop before the model's last layer ({block_count}); give the next stage with --next ADDR",
                layers.start, layers.end
            )));
        }
        let fingerprint = model::fingerprint(&config.model)?;
        let spec = StageSpec {
            layers: layers.clone(),
            first: false,
            last,
        };
        let options = StageOptions {
            lane_count: config.lanes.max(1),
            context_length: config.context_length,
        };
        let stage = Stage::from_file(&file, spec, options)?;
        let model_config = file.config();
        let hello = Hello {
            version: PROTOCOL_VERSION,
            role: Role::StageLink,
            fingerprint,
            stage_index: 0,
            layer_start: layers.start as u32,
            layer_end: layers.end as u32,
            block_count: block_count as u32,
            width: stage.width() as u32,
            vocab_size: model_config.vocab_size as u32,
            lanes: stage.lane_count().min(usize::from(u16::MAX)) as u16,
            // This stage's own; an answer to the stage before carries the least of it and the next stage's.
            context_length: u32::try_from(stage.context_length()).unwrap_or(u32::MAX),
            codecs: CodecSet::all(),
            nonce: [0; 16],
            proof: None,
            // Named per link (the last stage's own address, or what the next stage said).
            return_address: None,
        };
        let limits = WireLimits::default();
        let link_budget = match config.link_buffer {
            Some(bytes) => budget::LinkBudget::new(bytes),
            None => budget::LinkBudget::default_for(hello.width, stage.lane_count(), &limits),
        };
        let (compute, compute_thread) = compute::start(stage).map_err(ServeError::Thread)?;
        let shared = Arc::new(StageShared {
            hello: hello.clone(),
            key: config.cluster_key.clone(),
            compute,
            handle: OnceLock::new(),
            upstreams: std::sync::Mutex::new(std::collections::HashMap::new()),
            next: config.next,
            limits,
            codec: config.codec,
            connect_timeout: config.connect_timeout,
            connect_retry_timeout: config.connect_retry_timeout,
            shape: config.shape,
            stage_index: config.stage_index,
            open_sessions: std::sync::atomic::AtomicUsize::new(0),
            stopped_sessions: std::sync::atomic::AtomicUsize::new(0),
            returns: returns::Returns::default(),
            advertise: config.advertise,
            chain_index: std::sync::atomic::AtomicU16::new(config.stage_index.unwrap_or(0)),
            link_budget,
        });
        if config.shape.is_shaped() || config.next.is_some() {
            // The shaper's and the connect retries' timers run on the task runtime (a second init changes
            // nothing).
            let _ = task_runtime::Runtime::init();
        }
        let factory_shared = Arc::clone(&shared);
        let builder = ServerBuilder::new()
            .listen(config.bind)
            .session_driver(SessionDriver::EventLoop { loops: 2 })
            .limits(link_limits(config.lanes))
            // Downstream links are opened from the first upstream hello: the handle must be set by then.
            .open_door_at_build(false)
            .sessions(move |_: &net_io_blocking::ConnectionInfo| {
                Some(Link::accepted(Arc::clone(&factory_shared)))
            });
        let server = match config.allow_from {
            Some(allowed) => builder.gate(gate::AllowFrom::new(allowed)).build()?,
            None => builder.allow_all().build()?,
        };
        let _ = shared.handle.set(server.handle());
        crate::telemetry::registry::register_server("links", server.handle());
        server.handle().open_door();
        tracing::info!(
            stage_index = config.stage_index,
            layer_start = layers.start,
            layer_end = layers.end,
            address = %server.local_addr(),
            width = hello.width,
            model_id,
            lanes = hello.lanes,
            // As i64: tracing-opentelemetry exports unsigned fields as strings.
            link_buffer_bytes = i64::try_from(link_budget.bytes()).unwrap_or(i64::MAX),
            next = config.next.map(tracing::field::display),
            "{}",
            names::EVENT_STAGE_READY
        );
        Ok(StageProcess {
            server,
            hello,
            compute: Some(compute_thread),
            shared,
        })
    }

    /// Where the stage listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The stage's hello (its stage index is learned per link from the stage before).
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// The server's handle: stats, kill, drain.
    pub fn handle(&self) -> ServerHandle {
        self.server.handle()
    }

    /// Drains (idle links close at once, links with a generation in flight get until `deadline`) and stops.
    /// At the deadline every session still open gets an `Error` frame (`draining`) and its link closes
    /// gracefully; a link still open [`DRAIN_ERROR_GRACE`] later is reset. Such links count as graceful in
    /// the report.
    pub fn shutdown(self, deadline: Instant) -> DrainReport {
        self.shutdown_because(deadline, "shutdown")
    }

    /// [`shutdown`](Self::shutdown), with `reason` (a signal's name, say) in its drain events.
    pub fn shutdown_because(self, deadline: Instant, reason: &str) -> DrainReport {
        let StageProcess {
            server,
            compute,
            shared,
            ..
        } = self;
        let address = server.local_addr();
        let sessions_open = shared.open_sessions.load(Ordering::Relaxed);
        tracing::info!(
            stage_index = shared.stage_index,
            address = %address,
            reason,
            drain_timeout_millis =
                u64::try_from(deadline.saturating_duration_since(Instant::now()).as_millis())
                    .unwrap_or(u64::MAX),
            sessions_open,
            "{}",
            names::EVENT_STAGE_DRAIN
        );
        let drained = drain_with_last_word(server.handle(), deadline, || {
            let upstreams: Vec<_> = shared
                .upstreams
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .values()
                .cloned()
                .collect();
            for completer in upstreams {
                let _ = completer.post(link::DRAIN_DEADLINE_TOKEN, 0);
            }
        });
        let stopped = server.shutdown(Instant::now());
        // The drain thread cannot panic short of a bug in the driver; its report is then the stop's.
        let report = drained.unwrap_or(stopped);
        let sessions_stopped = shared.stopped_sessions.load(Ordering::Relaxed);
        tracing::info!(
            stage_index = shared.stage_index,
            address = %address,
            sessions_finished = sessions_open.saturating_sub(sessions_stopped),
            sessions_stopped,
            links_graceful = report.graceful,
            links_killed = report.killed,
            elapsed_millis = u64::try_from(report.elapsed.as_millis()).unwrap_or(u64::MAX),
            "{}",
            names::EVENT_STAGE_DRAINED
        );
        // The compute thread ends once the last link, and with it the last compute handle, is gone.
        drop(shared);
        drop(compute);
        report
    }
}

/// How long links get, after the drain deadline, to flush the `Error` frames that stop their sessions (and the
/// API's connections the error events that end their streams).
pub const DRAIN_ERROR_GRACE: Duration = Duration::from_secs(1);

/// Drains the server behind `handle`: idle connections close at once and busy ones get until `deadline`; if
/// some are still busy then, `at_deadline` runs, for the sessions to end what they hold in words, and they get
/// [`DRAIN_ERROR_GRACE`] to flush it before what is left is reset. `None` if the draining thread failed.
pub(crate) fn drain_with_last_word(
    handle: ServerHandle,
    deadline: Instant,
    at_deadline: impl FnOnce(),
) -> Option<DrainReport> {
    let drainer = std::thread::spawn(move || handle.drain(deadline + DRAIN_ERROR_GRACE));
    while !drainer.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    if !drainer.is_finished() {
        at_deadline();
    }
    drainer.join().ok()
}

/// Limits for stage links: frames up to a prefill chunk of activations, links that idle between generations
/// for long, a read deadline generous enough for the slowest stage of a chain to answer, and a write deadline
/// as long: the next stage may stop reading for as long as its own next link takes to drain its byte budget
/// (`serve::budget`), which over a slow link is well past the 30 s default.
///
/// Links from one address: where stage 0 and the stage before share a host (a pipeline on loopback, or two
/// stages on one machine), this stage takes a link per lane from each, the last stage also a prediction-return
/// link per lane from stage 0, and stage 0's health probe and a lane's reconnect overlap them for a moment:
/// four per lane and a few more, never fewer than net-io's default of 16. Past that, a source is refused at
/// admission.
fn link_limits(lanes: usize) -> Limits {
    Limits::new()
        .max_per_source(lanes.saturating_mul(4).saturating_add(4).max(16))
        .output_budget(256 << 20)
        .completion_queue(64)
        .read_timeout(Duration::from_secs(300))
        .write_timeout(Duration::from_secs(300))
        .park_timeout(Duration::from_secs(300))
        .min_rate(None)
}
