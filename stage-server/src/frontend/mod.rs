//! Stage 0's OpenAI-compatible API: an HTTP/1.1 listener on net-io-blocking's event loops in front of the
//! lanes that run generations, over the whole model in this process or over a chain of stage processes.
//!
//! ```text
//!   clients ──HTTP──▶ event loop: HttpSession (parse, route, admit) ──job──▶ lane workers ──▶ LaneRunner
//!                          ▲                                                     │ (whole model, or
//!                          └────────────── completion ring (events) ◀────────────┘  stage 0 + chain link)
//! ```
//!
//! The listener starts before the model loads, so `/health` answers 503 ("Loading model") until every lane
//! is ready (for a chain, until every lane's link to stage 1 passed its hello), then 200.

mod batcher;
mod engine;
mod health;
mod metrics;
mod prompt;
mod routes;
mod runner;
mod session;
mod state;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use net_io_blocking::{DrainReport, Limits, NetError, Server, ServerBuilder, SessionDriver};

use crate::driver::{ChainOptions, StageShare, first_stage_hello, load_first_stage};
use crate::model::{self, ModelError, ModelFile, Stage, StageOptions, StageSpec};
use crate::telemetry::names;
use crate::tokenizer::Tokenizer;
use crate::tokenizer::chat::ChatTemplate;
use batcher::Batcher;
use engine::{Engine, RunnerFactory};
use health::ChainHealth;
use metrics::Metrics;
use prompt::TextModel;
use runner::{ChainLane, ChainLimits, LaneRunner};
pub use state::{ApiConfig, MAX_PER_SOURCE_DEFAULT};
use state::{ApiState, Ready};

/// What the API's lanes generate with.
#[derive(Clone, Debug)]
pub enum Backend {
    /// The whole model in this process.
    Whole,
    /// Layers `0..layers_end` here and the rest in a chain of stage processes whose first is at `next`.
    Chain {
        /// Where stage 0's layers end.
        layers_end: usize,
        /// The first downstream stage.
        next: SocketAddr,
        /// How the links are driven.
        options: ChainOptions,
    },
}

/// Why the API could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiStartError {
    /// The model file could not be read.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The listener could not start (an address in use).
    #[error("the API's listener did not start")]
    Server(#[from] NetError),
    /// The loading thread could not start.
    #[error("the loading thread did not start")]
    Thread(#[source] std::io::Error),
}

/// A running API.
#[derive(Debug)]
pub struct ApiServer {
    server: Server,
    state: Arc<ApiState>,
    loader: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Starts listening on `config.http` at once and loads `model` for `backend` in the background.
    pub fn start(
        model: &Path,
        backend: Backend,
        config: ApiConfig,
    ) -> Result<ApiServer, ApiStartError> {
        // Queue deadlines run as tasks (a second init changes nothing).
        let _ = task_runtime::Runtime::init();
        let fingerprint = model::fingerprint(model)?;
        let model_id = config.model_id.clone().unwrap_or_else(|| {
            model.file_stem().map_or_else(
                || "model".to_owned(),
                |stem| stem.to_string_lossy().into_owned(),
            )
        });
        let state = Arc::new(ApiState {
            fingerprint: format!(
                "stage-server-{}-{}",
                env!("CARGO_PKG_VERSION"),
                fingerprint[..4]
                    .iter()
                    .map(|byte| format!("{byte:02x}"))
                    .collect::<String>()
            ),
            model_id,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.as_secs()),
            metrics: Arc::new(Metrics::default()),
            ready: OnceLock::new(),
            load_error: Mutex::new(None),
            chain: Arc::new(ChainHealth::default()),
            probe: Mutex::new(None),
            config,
        });
        let server = ServerBuilder::new()
            .listen(state.config.http)
            .session_driver(SessionDriver::EventLoop { loops: 1 })
            .limits(http_limits(state.config.max_per_source))
            .sessions(session::factory(Arc::clone(&state)))
            .allow_all()
            .build()?;
        crate::telemetry::registry::register_server("api", server.handle());
        let collector: Arc<dyn crate::telemetry::registry::Collect> = state.metrics.clone();
        crate::telemetry::registry::register_collector(&collector);
        let loader_state = Arc::clone(&state);
        let path = model.to_path_buf();
        let address = server.local_addr();
        let loader = std::thread::Builder::new()
            .name("api-loader".into())
            .spawn(move || match load(&path, backend, &loader_state) {
                Ok(ready) => {
                    tracing::info!(
                        address = %address,
                        model_id = loader_state.model_id,
                        lanes = loader_state.config.lanes.max(1),
                        context_length = ready.text.context_length,
                        "{}",
                        names::EVENT_API_READY
                    );
                    let _ = loader_state.ready.set(ready);
                }
                Err(error) => {
                    tracing::error!(
                        address = %address,
                        model_id = loader_state.model_id,
                        reason = error,
                        "{}",
                        names::EVENT_API_LOAD_FAILED
                    );
                    *loader_state
                        .load_error
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(error);
                }
            })
            .map_err(ApiStartError::Thread)?;
        Ok(ApiServer {
            server,
            state,
            loader: Some(loader),
        })
    }

    /// Where the API listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The model id requests name.
    pub fn model_id(&self) -> &str {
        &self.state.model_id
    }

    /// Waits until the model is loaded (`Ok`), loading failed (the reason), or `timeout` passed.
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.state.ready.get().is_some() {
                return Ok(());
            }
            if let Some(error) = &*self
                .state
                .load_error
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
            {
                return Err(error.clone());
            }
            if Instant::now() >= deadline {
                return Err(format!("the model did not load within {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Drains (idle connections close at once, running generations get until `deadline`) and stops. Requests
    /// still queued or running at the deadline fail with a 503 in words (a stream's last event), which their
    /// connections get [`crate::serve::DRAIN_ERROR_GRACE`] to send before they are reset.
    pub fn shutdown(mut self, deadline: Instant) -> DrainReport {
        let drained = crate::serve::drain_with_last_word(self.server.handle(), deadline, || {
            if let Some(ready) = self.state.ready.get() {
                ready.engine.cut();
            }
        });
        let report = drained.unwrap_or_else(|| self.server.handle().drain(Instant::now()));
        let ApiServer {
            server,
            state,
            loader,
        } = &mut self;
        let _ = server;
        if let Some(loader) = loader.take() {
            let _ = loader.join();
        }
        if let Some(probe) = state
            .probe
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
        {
            probe.cancel();
        }
        report
    }
}

/// Limits of the API's connections: keep-alive connections idle for up to a minute; while a generation
/// runs, the read deadline bounds the gap between its events (a long prefill, a queue wait), so it is
/// generous, and a request that is slow to arrive is cut by the session's own deadline instead.
fn http_limits(max_per_source: usize) -> Limits {
    Limits::new()
        .max_per_source(max_per_source.max(1))
        .idle_timeout(Duration::from_secs(60))
        .read_timeout(Duration::from_secs(600))
        .park_timeout(Duration::from_secs(600))
        .completion_queue(256)
        .output_budget(16 << 20)
        .min_rate(None)
}

/// Loads the tokenizer, the template and the lanes.
fn load(path: &Path, backend: Backend, state: &ApiState) -> Result<Ready, String> {
    let file = ModelFile::open(path).map_err(|error| error.to_string())?;
    let tokenizer = Tokenizer::from_gguf(file.content()).map_err(|error| error.to_string())?;
    let template = match ChatTemplate::from_gguf(file.content()) {
        Ok(template) => template,
        Err(error) => {
            tracing::warn!(
                "the model's chat template cannot be used, so /v1/chat/completions is off: {error}"
            );
            None
        }
    };
    let lanes = state.config.lanes.max(1);
    let block_count = file.config().block_count;
    let vocab_size = file.config().vocab_size;
    let context = state.config.context_length;
    // Stage 0's steps hear of queued requests, so requests that free lanes can take together are admitted in
    // one pass (the whole model's compute thread, or a chain's stage 0's callers).
    let backlog;
    let limits = ChainLimits::unset(lanes);
    let (runners, context_length) = match backend {
        Backend::Whole => {
            let stage = Stage::from_file(
                &file,
                StageSpec::whole(block_count),
                StageOptions {
                    lane_count: lanes,
                    context_length: context,
                },
            )
            .map_err(|error| error.to_string())?;
            let context_length = stage.context_length();
            let batcher = Batcher::start(
                stage,
                state.config.batch_tokens,
                state.config.decode_stretch,
                state.config.prompt_hold_steps,
            )?;
            backlog = Some(batcher.backlog());
            let runners = (0..lanes)
                .map(|_| {
                    let batcher = Arc::clone(&batcher);
                    Box::new(move || Ok(LaneRunner::Local(batcher))) as RunnerFactory
                })
                .collect();
            (runners, context_length)
        }
        Backend::Chain {
            layers_end,
            next,
            options,
        } => {
            let stage = load_first_stage(&file, layers_end, lanes, context)
                .map_err(|error| error.to_string())?;
            let context_length = stage.context_length();
            let width = stage.width();
            let stage = Arc::new(
                // No gather: a lane's next chunk waits for its token's round trip down the chain; the lanes
                // that went down together are held together instead (batches in flight).
                model::SharedStage::start(
                    stage,
                    model::StepPolicy {
                        decode_stretch: state.config.decode_stretch,
                        prompt_hold_steps: state.config.prompt_hold_steps,
                        batches_in_flight: state.config.batches_in_flight,
                        ..model::StepPolicy::new(state.config.batch_tokens, Duration::ZERO)
                    },
                )
                .map_err(|error| format!("stage 0's compute thread did not start: {error}"))?,
            );
            backlog = Some(stage.backlog());
            let ours = first_stage_hello(&file, layers_end, width, context_length)
                .map_err(|error| error.to_string())?;
            let health = Arc::clone(&state.chain);
            let runners = (0..lanes)
                .map(|lane| {
                    let share = StageShare {
                        stage: Arc::clone(&stage),
                        lane,
                    };
                    let (ours, options, health, limits) = (
                        ours.clone(),
                        options.clone(),
                        Arc::clone(&health),
                        limits.clone(),
                    );
                    Box::new(move || {
                        ChainLane::connect(share, ours, next, options, health, limits)
                            .map(|lane| LaneRunner::Chain(Box::new(lane)))
                            .map_err(|error| {
                                format!("lane {lane}'s link to stage 1 at {next}: {error}")
                            })
                    }) as RunnerFactory
                })
                .collect();
            let probe = health::start_probe(Arc::clone(&state.chain), ours, next, options);
            *state
                .probe
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(probe);
            (runners, context_length)
        }
    };
    let stop_tokens = tokenizer.end_of_generation_ids();
    let text = Arc::new(TextModel {
        tokenizer,
        template,
        stop_tokens,
        context_length,
        chain_context: Arc::clone(&limits.context),
        vocab_size,
    });
    let engine = Engine::start(
        runners,
        state.config.queue_limit(),
        Arc::clone(&text),
        Arc::clone(&state.metrics),
        backlog,
        limits.lanes,
    )?;
    Ok(Ready { engine, text })
}
