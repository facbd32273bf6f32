//! What every API session shares: the configuration, the model's identity, the metrics, and (once loaded)
//! the lanes with the tokenizer and chat template.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use task_runtime::TaskHandle;

use super::engine::Engine;
use super::health::ChainHealth;
use super::metrics::Metrics;
use super::prompt::TextModel;
use crate::http::HttpLimits;

/// How stage 0's API serves.
#[derive(Clone, Debug)]
pub struct ApiConfig {
    /// Where the API listens.
    pub http: SocketAddr,
    /// The model id `/v1/models` lists and requests must name (default: the file's stem).
    pub model_id: Option<String>,
    /// A bearer key every `/v1` route requires, if set.
    pub api_key: Option<String>,
    /// Generations at a time (each with its own lane of every stage's KV cache).
    pub lanes: usize,
    /// Requests that may wait for a lane (default: twice the lanes).
    pub queue: Option<usize>,
    /// How long a request may wait for a lane before it gets 429.
    pub queue_timeout: Duration,
    /// Context per lane (default: the model's).
    pub context_length: Option<usize>,
    /// Request size limits.
    pub http_limits: HttpLimits,
    /// How long a drain lets running generations finish.
    pub drain_timeout: Duration,
    /// Rows one forward pass of the whole model runs at most: every running stream's next token, then
    /// prompt chunks of newly admitted requests in what is left (a longer prompt spans several passes).
    pub batch_tokens: usize,
    /// While streams decode, the most a pass that also runs prompt rows may take, as a multiple of a
    /// decode-only pass (`None`: prompt rows up to `batch_tokens` whatever the streams wait); see
    /// [`crate::model::StepPolicy::decode_stretch`].
    pub decode_stretch: Option<f64>,
    /// The most decode steps a newly admitted prompt waits for running streams about to end; see
    /// [`crate::model::StepPolicy::prompt_hold_steps`].
    pub prompt_hold_steps: usize,
    /// In front of a chain, how many steps' lanes may be out on their round trips at once before a lane that
    /// came back waits for the others (see [`crate::model::StepPolicy::batches_in_flight`]): 1 (the default)
    /// keeps the streams in one batch through every stage, best when the stages share this host's cores.
    pub batches_in_flight: usize,
    /// Connections one client address may hold open at once (more are refused at admission, before a byte
    /// is read); 64 by default, so a client's pool of parallel requests fits while one address cannot take
    /// the whole server. Behind a reverse proxy every request comes from the proxy's address: raise it.
    pub max_per_source: usize,
}

/// [`ApiConfig::max_per_source`] by default.
pub const MAX_PER_SOURCE_DEFAULT: usize = 64;

impl ApiConfig {
    /// The defaults on `http`: 4 lanes, a queue of 8, a 30 s queue timeout, the HTTP layer's limits, 512
    /// rows per forward pass, no bound on how far prompt rows stretch a decode pass.
    pub fn new(http: SocketAddr) -> ApiConfig {
        ApiConfig {
            http,
            model_id: None,
            api_key: None,
            lanes: 4,
            queue: None,
            queue_timeout: Duration::from_secs(30),
            context_length: None,
            http_limits: HttpLimits::default(),
            drain_timeout: Duration::from_secs(30),
            batch_tokens: crate::model::DEFAULT_BATCH_TOKENS,
            decode_stretch: None,
            prompt_hold_steps: crate::model::PROMPT_HOLD_STEPS,
            batches_in_flight: 1,
            max_per_source: MAX_PER_SOURCE_DEFAULT,
        }
    }

    /// The queue's length: `queue`, or twice the lanes.
    pub fn queue_limit(&self) -> usize {
        self.queue.unwrap_or(self.lanes.max(1) * 2)
    }
}

/// The loaded half: lanes, tokenizer, template.
#[derive(Debug)]
pub(crate) struct Ready {
    pub engine: Engine,
    pub text: Arc<TextModel>,
}

/// Shared by every session of the API.
#[derive(Debug)]
pub(crate) struct ApiState {
    pub config: ApiConfig,
    pub model_id: String,
    /// `system_fingerprint` of every reply: the server version and the model's fingerprint.
    pub fingerprint: String,
    /// When the model was loaded (the `created` of `/v1/models`).
    pub created: u64,
    pub metrics: Arc<Metrics>,
    pub ready: OnceLock<Ready>,
    /// Why loading failed, if it did (`/health` says so).
    pub load_error: Mutex<Option<String>>,
    /// Whether the chain behind stage 0 answers (always up for a whole model).
    pub chain: Arc<ChainHealth>,
    /// The chain's repeating probe, cancelled at shutdown.
    pub probe: Mutex<Option<TaskHandle<()>>>,
}

impl ApiState {
    /// Why the API cannot serve generations yet: loading, or failed to load.
    pub(crate) fn not_ready_reason(&self) -> String {
        match &*self
            .load_error
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
        {
            Some(error) => format!("the model failed to load: {error}"),
            None => "Loading model".to_owned(),
        }
    }
}
