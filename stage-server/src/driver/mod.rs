//! Stage 0's side of a generation over a chain of stage processes: it runs the first layer range itself (with
//! the embeddings), streams chunks of activations down the chain and gets the predicted tokens back.
//!
//! ```text
//!   prompt ──▶ Stage (layers 0..K, here) ──Prefill chunks (credits)──▶ stage 1 ──▶ … ──▶ last stage (samples)
//!                     ▲                                                                     │
//!                     └──────────── Decode (one row) ◀── token ◀── Token frames ◀────────────┘
//! ```
//!
//! [`Chain`] holds one link to the first downstream stage and runs one generation at a time on it (one lane
//! down the whole chain). A stage that fails or refuses ends the generation with an error that names it; a
//! generation always ends with a `Stop` down the chain, so no lane is left taken.
//!
//! Direct prediction return: when the first stage's hello names where the chain's last stage takes
//! prediction returns, the chain also opens a link there (role `PredictionReturn`) and registers each
//! generation on it (`OpenReturn`, answered with an `Ack` before the last prefill chunk goes down), so the
//! last stage sends its tokens straight back and middle stages never relay them: a decode step crosses one hop
//! back instead of as many as there are stages after stage 0. Acknowledgements and errors still come up the
//! chain, so stage 0 waits on both links at once ([`net_io_blocking::wait_any_readable`]). If the return link
//! cannot be opened, tokens come back up the chain as before (and a warning says why).
//!
//! ```text
//!   stage 0 ──Prefill/Decode──▶ stage 1 ──▶ … ──▶ last stage
//!      ▲  ▲                        │                 │
//!      │  └──── Ack, Error ────────┘                 │
//!      └───────────── Token (return link) ───────────┘
//! ```

use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use net_io_blocking::{Limits, NetError, TcpConnection, TimeoutKind, wait_any_readable};

use crate::model::{
    self, DEFAULT_BATCH_TOKENS, Finish, GenerateOptions, Generation, Logits, ModelError, ModelFile,
    PREFILL_CHUNK, SamplingParams, SharedStage, Stage, StageInput, StageOptions, StageOutput,
    StageSpec, StepPolicy,
};
use crate::serve::LinkShape;
use crate::telemetry::registry::{LinkSide, STAGE};
use crate::wire::{
    Activations, Batch, ClusterKey, CodecPolicy, CodecSet, Decoder, ErrorCode, Frame, Hello,
    PROTOCOL_VERSION, Role, Side, WireError, WireLimits, check_adjacent, check_same_model, encode,
    fresh_nonce, proof, verify,
};

/// How long stage 0 waits for an answer from the chain by default ([`ChainOptions::reply_timeout`]).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long stage 0 waits in silence by default before it pings through the chain
/// ([`ChainOptions::silence_probe`]).
pub const SILENCE_PROBE: Duration = Duration::from_secs(1);

/// How long a ping may go unanswered by default ([`ChainOptions::probe_timeout`]).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// How stage 0 drives a chain.
#[derive(Clone, Debug)]
pub struct ChainOptions {
    /// How activations go down the chain.
    pub codec: CodecPolicy,
    /// Non-final prefill chunks in flight before stage 0 waits for the chain to acknowledge one.
    pub credits: usize,
    /// The most prompt tokens one prefill chunk carries, 1 to [`PREFILL_CHUNK`] (values outside are clamped):
    /// the default, [`PREFILL_CHUNK`], runs the fewest passes; a smaller chunk costs more passes and round trips
    /// but bounds what every stage holds in flight to about `(credits + 2) x chunk` rows, where a long prompt in
    /// large chunks brings nearly all of itself. Beside other lanes' streams the chunk may be cut shorter still
    /// (see [`SharedStage::prompt_share`]).
    pub prefill_chunk: usize,
    /// The cluster's shared key, if its stages have one.
    pub cluster_key: Option<ClusterKey>,
    /// How long the connect to the first stage may take.
    pub connect_timeout: Duration,
    /// How long stage 0 waits for an answer from the chain before it gives up on it.
    pub reply_timeout: Duration,
    /// How long stage 0 waits in silence for an answer before it checks that the chain is alive: a `Ping` down
    /// the chain, which every stage passes on as it reads it (its event loops serve its links apart from its
    /// compute, so a stage busy with a long prompt answers at once) and the last answers. A stage that is
    /// stopped or cut off does not, and the generation fails then instead of at the reply timeout. Zero turns the
    /// check off.
    pub silence_probe: Duration,
    /// How long a ping may go unanswered, at least (it gets four times what opening the chain's link took, if
    /// that is longer, so a chain over slow links is not taken for a stopped one).
    pub probe_timeout: Duration,
    /// Alternatives (top log-probabilities) each token comes with, up to 20.
    pub top_logprobs: u8,
    /// Whether [`Chain::generate`]'s tokens come with their log-probability (NaN otherwise). It costs the
    /// last stage a softmax over the vocabulary per token (gemma-3's has 262,144 entries), so it is off
    /// unless asked; alternatives (`top_logprobs`) bring it along.
    pub logprobs: bool,
    /// Delay and rate on the link to stage 1, each way (tests and benchmarks): stage 0 holds each frame it
    /// sends, and each answer it reads, back until such a link would have delivered it.
    pub shape: LinkShape,
    /// Whether tokens come straight back from the last stage over a prediction-return link, when the chain
    /// names one (on by default); off, they are relayed back up the chain by every stage.
    pub direct_return: bool,
}

impl Default for ChainOptions {
    fn default() -> Self {
        ChainOptions {
            codec: CodecPolicy::F32,
            credits: 1,
            prefill_chunk: PREFILL_CHUNK,
            cluster_key: None,
            connect_timeout: Duration::from_secs(5),
            reply_timeout: REPLY_TIMEOUT,
            silence_probe: SILENCE_PROBE,
            probe_timeout: PROBE_TIMEOUT,
            top_logprobs: 0,
            logprobs: false,
            shape: LinkShape::default(),
            direct_return: true,
        }
    }
}

/// Why a generation over the chain failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// Stage 0's own layers failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A link of stage 0's failed (it is down, or it closed): to stage 1, or the prediction-return link to the
    /// last stage.
    #[error("the link to {peer} at {address} failed: {error}")]
    Link {
        /// The stage at the other end, as named in errors (`stage 1`, `stage 2 (the last)`).
        peer: String,
        /// Its address.
        address: SocketAddr,
        /// What the link said.
        error: NetError,
    },
    /// A stage refused or failed, in its own words.
    #[error("{message} ({code})", code = code.as_str())]
    Stage {
        /// The error code it sent.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// The chain sent something stage 0 cannot read.
    #[error("the chain sent a frame stage 0 cannot read: {0}")]
    Wire(#[from] WireError),
    /// The chain broke the protocol.
    #[error("the chain broke the stage protocol: {0}")]
    Protocol(String),
    /// The layer range does not fit the model.
    #[error("{0}")]
    Layers(String),
    /// The prompt does not leave room for a token in the chain's lanes; nothing was sent.
    #[error(
        "the chain's lanes hold {context} tokens (the least of every stage's --context-length, stage 0's \
         included), but the prompt has {prompt_tokens}; shorten the prompt"
    )]
    Context {
        /// The prompt's length in tokens.
        prompt_tokens: usize,
        /// The chain's context length.
        context: usize,
    },
}

/// One token the chain predicted, with its log-probability and the alternatives asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Predicted {
    /// The token id.
    pub token: u32,
    /// Its log-probability under the raw logits (NaN where it was not asked for and not computed).
    pub logprob: f32,
    /// The most likely tokens with theirs, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Stage 0's layers and the lane of them one chain link uses: several links (one per API lane) share one
/// loaded stage, each on its own lane of its KV cache, and their forward passes run batched together.
#[derive(Clone, Debug)]
pub struct StageShare {
    /// The layers from 0, loaded once, behind their batching compute thread.
    pub stage: Arc<SharedStage>,
    /// The lane of `stage` this link's generations use.
    pub lane: usize,
}

/// Keeps a lane active at its shared stage for one generation (see [`SharedStage::activate`]).
struct Active<'a>(&'a StageShare);

impl<'a> Active<'a> {
    fn new(share: &'a StageShare) -> Active<'a> {
        share.stage.activate(share.lane, true);
        Active(share)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.stage.activate(self.0.lane, false);
    }
}

/// What a generation asks of the last stage's sampler beyond its parameters.
#[derive(Clone, Debug, Default)]
pub struct SamplerExtras {
    /// Added to the logits of these tokens before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// Alternatives (top log-probabilities) each token comes with, up to 20.
    pub top_logprobs: u8,
    /// Whether the caller reads each token's log-probability. It costs a softmax over the vocabulary per
    /// token wherever the sampling runs (here for a whole model in one process, at a chain's last stage
    /// otherwise, told so in the `Configure` frame), so it is skipped when not asked.
    pub logprobs: bool,
}

/// Stage 0 with a link to the rest of a running chain.
#[derive(Debug)]
pub struct Chain {
    stage: StageShare,
    wire: Wire,
    /// The first downstream stage's hello.
    next: Hello,
    /// How long opening the link took (connect and every stage's hello): the scale of a ping's deadline.
    opening: Duration,
    /// The prediction-return link to the last stage, when the chain named one and it opened.
    returns: Option<Wire>,
    /// Tokens that came back over the return link, over this chain's life.
    direct_tokens: u64,
    /// The session the last generation left open down the chain, for the next one to reuse its prefix.
    kept: Option<Kept>,
}

/// A session left open down the chain after a generation that ended cleanly (nothing of it still in flight):
/// every stage's lane for it, stage 0's included, holds the keys and values of `history`.
#[derive(Debug)]
struct Kept {
    session: u64,
    history: Vec<u32>,
}

/// Which of stage 0's links a frame came on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// The link down the chain (to stage 1).
    Chain,
    /// The prediction-return link (from the last stage).
    Return,
}

/// What a generation waits on: prefill chunks not yet acknowledged and the return link's `Ack` of its
/// `OpenReturn`.
#[derive(Debug, Default)]
struct Pending {
    acknowledgements: usize,
    return_awaited: bool,
}

/// Stage 0's end of one link (to stage 1, or the prediction return from the last stage): frames out (shaped
/// when asked), frames in.
#[derive(Debug)]
struct Wire {
    link: TcpConnection<'static>,
    address: SocketAddr,
    /// Who is at the other end, for messages ("stage 1", "stage 3 (the last)").
    peer: String,
    /// What the link is for.
    role: Role,
    decoder: Decoder,
    /// Bytes read from the link and not yet decoded.
    unread: Vec<u8>,
    unread_start: usize,
    options: ChainOptions,
    /// When the shaped link is free again.
    link_free: Instant,
    /// When the shaped link's other direction (answers to stage 0) is free again.
    answers_free: Instant,
    /// When the last read brought bytes in (a shaped link's answers are delivered a delay after it).
    filled_at: Instant,
    /// Bytes taken by the decoder since the last whole frame (the size of the next one, for a shaped rate).
    frame_bytes: usize,
}

impl Chain {
    /// Loads layers `0..layers_end` of `file` and opens the link to the first stage at `next`, which must
    /// serve the layers from `layers_end` on (checked in the hellos, as are the model and the width).
    pub fn connect(
        file: &ModelFile,
        layers_end: usize,
        next: SocketAddr,
        options: ChainOptions,
    ) -> Result<Chain, DriverError> {
        let stage = load_first_stage(file, layers_end, 1, None)?;
        let stage =
            SharedStage::start(stage, StepPolicy::new(DEFAULT_BATCH_TOKENS, Duration::ZERO))
                .map_err(|error| {
                    DriverError::Model(ModelError::Compute(format!(
                        "stage 0's compute thread did not start: {error}"
                    )))
                })?;
        let share = StageShare {
            stage: Arc::new(stage),
            lane: 0,
        };
        Chain::connect_lane(file, share, next, options)
    }

    /// Opens a link to the first stage at `next` for lane `share.lane` of an already loaded stage 0 (see
    /// [`load_first_stage`]); the chain must serve the layers after stage 0's.
    pub fn connect_lane(
        file: &ModelFile,
        share: StageShare,
        next: SocketAddr,
        options: ChainOptions,
    ) -> Result<Chain, DriverError> {
        let (layers_end, width, context_length) = share.stage.with_stage(|stage| {
            (
                stage.spec().layers.end,
                stage.width(),
                stage.context_length(),
            )
        });
        let ours = first_stage_hello(file, layers_end, width, context_length)?;
        Chain::connect_with(share, &ours, next, options)
    }

    /// [`Chain::connect_lane`] with stage 0's hello already made (see [`first_stage_hello`]), as a server
    /// that opens many links does.
    pub fn connect_with(
        share: StageShare,
        ours: &Hello,
        next: SocketAddr,
        options: ChainOptions,
    ) -> Result<Chain, DriverError> {
        let direct_return = options.direct_return;
        let started = Instant::now();
        let (wire, theirs) = Wire::open(ours, next, options.clone(), Role::StageLink)?;
        let opening = started.elapsed();
        let returns = match theirs.return_address {
            Some(address) if direct_return => {
                let options = ChainOptions {
                    // The last stage shapes the tokens it sends; stage 0 sends only OpenReturn and Stop.
                    shape: LinkShape::default(),
                    ..options
                };
                match Wire::open(ours, address, options, Role::PredictionReturn) {
                    Ok((wire, _)) => Some(wire),
                    Err(error) => {
                        tracing::warn!(
                            address = %address,
                            "the prediction-return link to the last stage did not open, so tokens come back up the chain: {error}"
                        );
                        None
                    }
                }
            }
            _ => None,
        };
        Ok(Chain {
            stage: share,
            wire,
            next: theirs,
            opening,
            returns,
            direct_tokens: 0,
            kept: None,
        })
    }

    /// Where tokens come back from directly (the last stage's prediction-return address), if they do.
    pub fn direct_return(&self) -> Option<SocketAddr> {
        self.returns.as_ref().map(|wire| wire.address)
    }

    /// Tokens that came straight back from the last stage over this chain's life (the rest were relayed up
    /// the chain).
    pub fn direct_tokens(&self) -> u64 {
        self.direct_tokens
    }

    /// The first downstream stage's hello.
    pub fn next_stage(&self) -> &Hello {
        &self.next
    }

    /// Tokens a lane of the whole chain holds: the least of stage 0's context length and what the chain said
    /// in its hello (the least of every stage's after it).
    pub fn context_length(&self) -> usize {
        self.stage
            .stage
            .context_length()
            .min(self.next.context_length as usize)
    }

    /// Generations the stages after stage 0 run at once: the fewest lanes of any of them, as the chain said in
    /// its hello. A front end with more lanes than this queues the rest: a stage out of lanes refuses a new
    /// session (or takes a kept one's lane).
    pub fn chain_lanes(&self) -> usize {
        usize::from(self.next.lanes).max(1)
    }

    /// Generates from `prompt` as [`crate::model::Pipeline::generate`] does, with the last stage sampling
    /// under `sampling`; `on_token` sees each token as it arrives. The logits stay at the last stage, so
    /// `Generation::logits` is empty.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        sampling: SamplingParams,
        options: &GenerateOptions,
        mut on_token: impl FnMut(&Predicted),
    ) -> Result<Generation, DriverError> {
        let extras = SamplerExtras {
            logit_bias: Vec::new(),
            top_logprobs: self.wire.options.top_logprobs,
            logprobs: self.wire.options.logprobs,
        };
        self.generate_with(prompt, sampling, &extras, options, |predicted| {
            on_token(predicted);
            ControlFlow::Continue(())
        })
    }

    /// The tokens whose keys and values the session kept from the last generation holds at every stage (empty
    /// when none is kept): the next generation reuses as much of its prompt's start as matches.
    pub fn held(&self) -> &[u32] {
        self.kept.as_ref().map_or(&[], |kept| &kept.history)
    }

    /// How many leading tokens of `prompt` the next generation would reuse from the kept session instead of
    /// prefilling them: the longest common prefix, at most all but the prompt's last token (which must run to
    /// give the first prediction), and 0 where a sliding-window layer no longer holds what cutting back that
    /// far needs.
    pub fn reusable(&self, prompt: &[u32]) -> usize {
        let common = model::common_prefix(self.held(), prompt).min(prompt.len().saturating_sub(1));
        if common == 0 {
            return 0;
        }
        let lane = self.stage.lane;
        match self
            .stage
            .stage
            .with_stage(|stage| stage.check_trim(lane, common))
        {
            Ok(()) => common,
            Err(_) => 0,
        }
    }

    /// [`Chain::generate`] with a logit bias and log-probabilities, where `on_token` may end the generation
    /// early (a stop string matched, the client went away): `Break` stops it at once, and the generation so far
    /// is returned with `Finish::Stop`.
    ///
    /// Prefix reuse: a generation that ends with nothing of it in flight leaves its session open at every
    /// stage. The next one whose prompt starts with the same tokens cuts every stage's lane back to the common
    /// prefix (`Trim`), resumes the session (`Configure` with `resume`) and prefills only the rest
    /// (`Generation::cached_tokens` says how much was reused); otherwise the kept session is stopped, freeing
    /// its lanes, and a new one starts. If resuming fails at a stage (it restarted and lost the session), the
    /// generation runs again from scratch before any token is delivered. Any other end stops the session.
    pub fn generate_with(
        &mut self,
        prompt: &[u32],
        sampling: SamplingParams,
        extras: &SamplerExtras,
        options: &GenerateOptions,
        on_token: impl FnMut(&Predicted) -> ControlFlow<()>,
    ) -> Result<Generation, DriverError> {
        self.generate_cancellable(prompt, sampling, extras, options, &|| false, on_token)
    }

    /// [`Chain::generate_with`], where `cancelled` can also end the generation before its first token: it is
    /// asked before each prefill chunk, so a client that went away during a long prompt frees the lanes down
    /// the chain within a chunk instead of after the whole prefill. Once `cancelled` says yes, stage 0 waits for
    /// the chunks already sent to be acknowledged (nothing is left in flight), stops the session, and returns
    /// the generation with no token and `Finish::Stop`.
    pub fn generate_cancellable(
        &mut self,
        prompt: &[u32],
        sampling: SamplingParams,
        extras: &SamplerExtras,
        options: &GenerateOptions,
        cancelled: &dyn Fn() -> bool,
        mut on_token: impl FnMut(&Predicted) -> ControlFlow<()>,
    ) -> Result<Generation, DriverError> {
        if prompt.is_empty() {
            return Err(ModelError::EmptyChunk.into());
        }
        // Checked before anything is sent: a stage whose lanes are shorter than stage 0's would otherwise fail
        // the generation midway, after tokens were delivered.
        let context = self.context_length();
        if prompt.len() >= context {
            return Err(DriverError::Context {
                prompt_tokens: prompt.len(),
                context,
            });
        }
        // And the generation ends where the shortest lane does, as a length stop rather than a stage's error.
        let capped;
        let options = if prompt.len().saturating_add(options.max_tokens) > context {
            capped = GenerateOptions {
                max_tokens: context - prompt.len(),
                ..options.clone()
            };
            &capped
        } else {
            options
        };
        if options.max_tokens == 0 {
            return Ok(Generation::empty());
        }
        let cached = self.reusable(prompt);
        let session = match self.kept.take() {
            Some(kept) if cached > 0 => kept.session,
            Some(kept) => {
                self.end_session(kept.session)?;
                new_session_id()
            }
            None => new_session_id(),
        };
        let mut delivered = false;
        let mut counting = |predicted: &Predicted| {
            delivered = true;
            on_token(predicted)
        };
        let mut fed = Vec::new();
        let result = self.run(
            session,
            cached,
            prompt,
            sampling.clone(),
            extras,
            options,
            cancelled,
            &mut counting,
            &mut fed,
        );
        match result {
            Ok((generation, true)) => {
                self.keep_session(session)?;
                self.kept = Some(Kept {
                    session,
                    history: fed,
                });
                Ok(generation)
            }
            // Only a stage that lost the session (restarted, or lent its lane to another) warrants a second run:
            // a stage that is down or stopped answering would only fail it again, as late.
            Err(DriverError::Stage {
                code: code @ ErrorCode::UnknownSession,
                message,
            }) if cached > 0 && !delivered => {
                tracing::debug!(
                    session,
                    "resuming the kept session failed ({code:?}: {message}); running the prompt from scratch"
                );
                self.end_session(session)?;
                self.generate_cancellable(prompt, sampling, extras, options, cancelled, on_token)
            }
            other => {
                // Free the session's lanes down the chain, however the generation ended.
                let stopped = self.end_session(session);
                let (generation, _) = other?;
                stopped?;
                Ok(generation)
            }
        }
    }

    /// Keeps `session` down the chain for the next generation (`Keep`: every stage holds its lane and cache,
    /// idle) and takes it off the prediction-return link (the next generation registers it again).
    fn keep_session(&mut self, session: u64) -> Result<(), DriverError> {
        let kept = self.send(&Frame::Keep { session });
        self.leave_return(session);
        kept
    }

    /// Takes `session` off the prediction-return link; a return link that fails is given up (tokens come back
    /// up the chain from then on).
    fn leave_return(&mut self, session: u64) {
        if let Some(returns) = self.returns.as_mut()
            && let Err(error) = returns.send(&Frame::Stop { session })
        {
            tracing::warn!(
                address = %returns.address,
                "the prediction-return link failed, so tokens come back up the chain from now on: {error}"
            );
            self.returns = None;
        }
    }

    /// Stops `session` down the chain and on the prediction-return link (a return link that fails is given up:
    /// tokens come back up the chain from then on).
    fn end_session(&mut self, session: u64) -> Result<(), DriverError> {
        let stopped = self.send(&Frame::Stop { session });
        self.leave_return(session);
        stopped
    }

    /// Runs one generation on `session`, the first `cached` tokens of `prompt` already in its lanes (0: a new
    /// session). Leaves in `fed` the tokens whose keys and values the lanes now hold, and says whether the
    /// session can be kept: nothing of it is still on its way (every prefill chunk acknowledged).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        session: u64,
        cached: usize,
        prompt: &[u32],
        sampling: SamplingParams,
        extras: &SamplerExtras,
        options: &GenerateOptions,
        cancelled: &dyn Fn() -> bool,
        on_token: &mut impl FnMut(&Predicted) -> ControlFlow<()>,
        fed: &mut Vec<u32>,
    ) -> Result<(Generation, bool), DriverError> {
        let mut generation = Generation::empty();
        let lane = self.stage.lane;
        if cached == 0 {
            self.stage.stage.with_stage(|stage| stage.reset(lane))?;
        } else {
            self.stage
                .stage
                .with_stage(|stage| stage.trim(lane, cached))?;
        }
        generation.cached_tokens = cached;
        let share = self.stage.clone();
        let _active = Active::new(&share);
        let mut pending = Pending::default();
        if cached > 0 {
            // Every stage cuts its lane back to the prefix this prompt shares with the session's last one.
            self.send(&Frame::Trim {
                session,
                length: cached as u32,
            })?;
        }
        if let Some(returns) = self.returns.as_mut() {
            // Registered per generation: a kept session left the return table when it was kept.
            returns.send(&Frame::OpenReturn { session })?;
            pending.return_awaited = true;
        }
        self.send(&Frame::Configure {
            session,
            sampling: (&sampling).into(),
            stop_tokens: options.stop_tokens.clone(),
            logit_bias: extras.logit_bias.clone(),
            // The penalties at the last stage look back on the prompt's tail, as they do unsplit.
            history: prompt[prompt.len().saturating_sub(sampling.penalty_last_n)..].to_vec(),
            top_logprobs: extras.top_logprobs.min(20),
            logprob: extras.logprobs,
            resume: cached > 0,
            // The lane's generation span, when it is exported: every stage's spans join its trace.
            trace: crate::telemetry::current_trace_context().map(|context| context.to_wire()),
        })?;
        let started = Instant::now();
        let largest = self.wire.options.prefill_chunk.clamp(1, PREFILL_CHUNK);
        let mut position = cached;
        while position < prompt.len() {
            if cancelled() {
                // Nothing of the session left in flight, then the caller stops it (not kept: its lanes hold
                // part of a prompt).
                while pending.acknowledgements > 0 || pending.return_awaited {
                    self.expect_no_token(session, &mut pending, "a prefill acknowledgement")?;
                }
                generation.finish = Finish::Stop;
                return Ok((generation, false));
            }
            // Beside other lanes' streams, a chunk no longer than a pass can take without stretching their
            // steps past the bound (at every stage, since each batches what queues up); alone, the largest.
            let size = share
                .stage
                .prompt_share(share.lane)
                .unwrap_or(largest)
                .clamp(1, largest);
            let chunk = &prompt[position..(position + size).min(prompt.len())];
            let last = position + chunk.len() == prompt.len();
            let _chunk = tracing::debug_span!(
                "stage.openai_prefill_chunk",
                session_id = session,
                position = position as i64,
                rows = chunk.len() as i64
            )
            .entered();
            // The prompt's last chunk comes back as a token: the lane's next chunk waits for it.
            let (rows, batch) = self.rows(position, StageInput::Tokens(chunk), last)?;
            if last {
                // The first token must find its way back: the last stage has registered the session (its
                // Ack came, almost always long before, while stage 0 computed).
                while pending.return_awaited {
                    self.expect_no_token(
                        session,
                        &mut pending,
                        "the return link's acknowledgement",
                    )?;
                }
            }
            self.send(&Frame::Prefill {
                session,
                position: position as u32,
                last,
                batch,
                rows,
            })?;
            if !last {
                pending.acknowledgements += 1;
                while pending.acknowledgements > self.wire.options.credits {
                    STAGE.credit_wait();
                    let waiting = pending.acknowledgements;
                    while pending.acknowledgements == waiting {
                        self.expect_no_token(session, &mut pending, "a prefill acknowledgement")?;
                    }
                }
            }
            position += chunk.len();
        }
        let mut predicted = self.wait_for_token(session, position, &mut pending)?;
        generation.prompt_time = started.elapsed();
        fed.clear();
        fed.extend_from_slice(prompt);
        // From here the lane is a stream: other lanes' prompts are cut to spare it (with a decode stretch).
        share.stage.mark_decoding(share.lane);
        let decode_started = Instant::now();
        loop {
            if options.stop_tokens.contains(&predicted.token) {
                generation.finish = Finish::Stop;
                break;
            }
            generation.tokens.push(predicted.token);
            if on_token(&predicted).is_break() {
                generation.finish = Finish::Stop;
                break;
            }
            if generation.tokens.len() >= options.max_tokens {
                break;
            }
            // Per token: debug, so off unless asked for.
            let _step = tracing::debug_span!(
                "stage.openai_decode",
                session_id = session,
                position = position as i64
            )
            .entered();
            let (rows, batch) =
                self.rows(position, StageInput::Tokens(&[predicted.token]), true)?;
            let sent = Instant::now();
            self.send(&Frame::Decode {
                session,
                position: position as u32,
                batch,
                rows,
            })?;
            position += 1;
            fed.push(predicted.token);
            predicted = self.wait_for_token(session, position, &mut pending)?;
            STAGE.round_trip.observe(sent.elapsed().as_secs_f64());
        }
        generation.decode_time = decode_started.elapsed();
        let clean = pending.acknowledgements == 0 && !pending.return_awaited;
        Ok((generation, clean))
    }

    /// Runs stage 0's layers over `input` at `position` and encodes the rows for the chain, with the step they
    /// ran in (stage 1 runs the step's frames together). `awaits_answer`: a token comes back for these rows.
    fn rows(
        &mut self,
        position: usize,
        input: StageInput<'_>,
        awaits_answer: bool,
    ) -> Result<(Activations, Batch), DriverError> {
        // The shared stage's compute thread counts the step (and its batch) in the stage metrics.
        let (output, step) = self.stage.stage.forward_tagged(
            self.stage.lane,
            position,
            input,
            Logits::Last,
            awaits_answer,
        )?;
        let width = self.stage.stage.width();
        // Ids wrap: the next stage only compares those of frames close in time.
        let frames = u16::try_from(step.chunks.max(1)).unwrap_or(u16::MAX);
        let batch = Batch {
            id: step.id as u32,
            frames,
            rows: u32::try_from(step.rows)
                .unwrap_or(u32::MAX)
                .max(u32::from(frames)),
        };
        match output {
            StageOutput::Activations(values) => Ok((
                Activations::encode(&values, width as u32, self.wire.options.codec),
                batch,
            )),
            StageOutput::Logits(_) => Err(DriverError::Protocol(
                "stage 0 produced logits; it must not hold the model's last layer".into(),
            )),
        }
    }

    /// Takes one frame about `session` and counts it off `pending` if it is an acknowledgement; returns a
    /// token, with where it came from. Anything else is a protocol error.
    fn next_answer(
        &mut self,
        session: u64,
        pending: &mut Pending,
        waiting_for: &str,
    ) -> Result<Option<(Source, Frame)>, DriverError> {
        match self.receive_for(session)? {
            (Source::Chain, Frame::Ack { .. }) if pending.acknowledgements > 0 => {
                pending.acknowledgements -= 1;
                Ok(None)
            }
            (Source::Return, Frame::Ack { .. }) if pending.return_awaited => {
                pending.return_awaited = false;
                Ok(None)
            }
            (source, frame @ Frame::Token { .. }) => Ok(Some((source, frame))),
            (source, other) => Err(DriverError::Protocol(format!(
                "a {} frame came {} while stage 0 waited for {waiting_for}",
                other.kind_name(),
                match source {
                    Source::Chain => "down the chain",
                    Source::Return => "on the prediction-return link",
                }
            ))),
        }
    }

    /// [`Chain::next_answer`] where no token may come yet (none is owed before the last prefill chunk).
    fn expect_no_token(
        &mut self,
        session: u64,
        pending: &mut Pending,
        waiting_for: &str,
    ) -> Result<(), DriverError> {
        match self.next_answer(session, pending, waiting_for)? {
            None => Ok(()),
            Some(_) => Err(DriverError::Protocol(format!(
                "a token came before the prompt's last chunk went down, while stage 0 waited for {waiting_for}"
            ))),
        }
    }

    fn wait_for_token(
        &mut self,
        session: u64,
        position: usize,
        pending: &mut Pending,
    ) -> Result<Predicted, DriverError> {
        loop {
            let Some((source, frame)) = self.next_answer(session, pending, "a token")? else {
                continue;
            };
            let Frame::Token {
                position: at,
                token,
                logprob,
                top,
                ..
            } = frame
            else {
                continue;
            };
            if at as usize != position {
                return Err(DriverError::Protocol(format!(
                    "the chain predicted a token for position {at}, but stage 0 is at {position}"
                )));
            }
            if source == Source::Return {
                self.direct_tokens += 1;
            }
            return Ok(Predicted {
                token,
                logprob,
                top,
            });
        }
    }

    /// The next frame about `session` on either link: an `Error` for it (or for the whole link) ends the
    /// generation.
    fn receive_for(&mut self, session: u64) -> Result<(Source, Frame), DriverError> {
        loop {
            let (source, frame) = self.receive()?;
            match frame {
                Frame::Error {
                    session: about,
                    code,
                    message,
                } if about == session || about == 0 => {
                    return Err(DriverError::Stage { code, message });
                }
                frame if frame.session() == Some(session) => return Ok((source, frame)),
                // Answers about an earlier, finished session (its Stop raced them) are dropped.
                _ => {}
            }
        }
    }

    /// Sends `frame` down the chain. A write that fails because stage 1 closed the link (a stage after it was
    /// lost during a prompt) reports what stage 1 said before it closed, naming the stage that was lost,
    /// instead of only the broken pipe.
    fn send(&mut self, frame: &Frame) -> Result<(), DriverError> {
        match self.wire.send(frame) {
            Err(failed @ DriverError::Link { .. }) => {
                Err(self.wire.closing_words().unwrap_or(failed))
            }
            sent => sent,
        }
    }

    /// The next frame from either link, whichever has one first. After [`ChainOptions::silence_probe`] without
    /// one, a `Ping` goes down the chain; if nothing at all comes back within the check's deadline, a stage is
    /// stopped or cut off and the wait ends with `StageDown`. The wait ends at [`ChainOptions::reply_timeout`].
    fn receive(&mut self) -> Result<(Source, Frame), DriverError> {
        let deadline = Instant::now() + self.wire.options.reply_timeout;
        let silence = self.wire.options.silence_probe;
        let check = self.check_deadline();
        // The ping on its way and when it went.
        let mut pinged: Option<Instant> = None;
        loop {
            let frame = match self.wire.buffered()? {
                Some(frame) => Some((Source::Chain, frame)),
                None => self
                    .returns
                    .as_mut()
                    .map(Wire::buffered)
                    .transpose()?
                    .flatten()
                    .map(|frame| (Source::Return, frame)),
            };
            match frame {
                // Whatever comes shows the chain alive; a pong is only that.
                Some((_, Frame::Pong { .. })) => {
                    pinged = None;
                    continue;
                }
                Some(frame) => return Ok(frame),
                None => {}
            }
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                return Err(DriverError::Link {
                    peer: self.wire.peer.clone(),
                    address: self.wire.address,
                    error: NetError::Timeout(TimeoutKind::Read),
                });
            }
            let slice = match pinged {
                Some(sent) => {
                    let waited = now.saturating_duration_since(sent);
                    if waited >= check {
                        return Err(self.stopped_answering(silence, check));
                    }
                    check - waited
                }
                // A zero silence turns the check off.
                None if silence.is_zero() => left,
                None => silence,
            };
            let slice = slice.min(left);
            let ready = match self.returns.as_ref() {
                Some(returns) => wait_any_readable(&[&self.wire.link, &returns.link], Some(slice)),
                None => wait_any_readable(&[&self.wire.link], Some(slice)),
            }
            .map_err(|error| DriverError::Link {
                peer: self.wire.peer.clone(),
                address: self.wire.address,
                error,
            })?;
            match ready {
                Some(0) => {
                    self.wire.fill()?;
                    pinged = None;
                }
                Some(_) => {
                    match self.returns.as_mut() {
                        Some(returns) => returns.fill()?,
                        None => self.wire.fill()?,
                    }
                    pinged = None;
                }
                None if pinged.is_none() && !silence.is_zero() => {
                    self.send(&Frame::Ping {
                        nonce: random_u64(),
                    })?;
                    pinged = Some(Instant::now());
                }
                None => {}
            }
        }
    }

    /// How long a ping may go unanswered: [`ChainOptions::probe_timeout`], or four times what opening the link
    /// took where that is longer (a chain over slow links is not taken for a stopped one).
    fn check_deadline(&self) -> Duration {
        self.wire
            .options
            .probe_timeout
            .max(self.opening.saturating_mul(4))
    }

    /// The error of a chain that answered neither its frames nor a ping.
    fn stopped_answering(&self, silence: Duration, check: Duration) -> DriverError {
        DriverError::Stage {
            code: ErrorCode::StageDown,
            message: format!(
                "{} at {}, or a stage after it, stopped answering: nothing came for {} ms, nor an answer to a ping through the chain within {} ms after it (a stage is stopped, hung or cut off)",
                self.wire.peer,
                self.wire.address,
                silence.as_millis(),
                check.as_millis()
            ),
        }
    }
}

impl Wire {
    /// Connects to `next`, exchanges hellos (and the cluster key's proofs) and checks the stage there: for a
    /// stage link, that the chain there continues `ours`; for a prediction return, that it is the last stage of
    /// the same model. Returns the link with the stage's hello.
    fn open(
        ours: &Hello,
        next: SocketAddr,
        options: ChainOptions,
        role: Role,
    ) -> Result<(Wire, Hello), DriverError> {
        let mut ours = Hello {
            role,
            ..ours.clone()
        };
        let peer = match role {
            Role::StageLink => "stage 1".to_owned(),
            Role::PredictionReturn => "the last stage".to_owned(),
        };
        if options.cluster_key.is_some() {
            ours.nonce = fresh_nonce();
        }
        let limits = Limits::new()
            .handshake_timeout(options.connect_timeout)
            .idle_timeout(options.reply_timeout)
            .read_timeout(options.reply_timeout)
            .write_timeout(options.reply_timeout)
            .min_rate(None);
        let link = net_io_blocking::connect(next, &limits).map_err(|error| DriverError::Link {
            peer: peer.clone(),
            address: next,
            error,
        })?;
        let mut wire = Wire {
            link,
            address: next,
            peer,
            role,
            decoder: Decoder::new(WireLimits::default()),
            unread: Vec::new(),
            unread_start: 0,
            options,
            link_free: Instant::now(),
            answers_free: Instant::now(),
            filled_at: Instant::now(),
            frame_bytes: 0,
        };
        // The hello's answer is part of opening the link: it comes once every later stage has answered its own
        // link's hello, so it waits under twice the connect deadline (room for stage 1's own connect to stage 2
        // to time out first and say why), not the minute-long reply timeout, and a stage that accepts but never
        // answers (stopped, hung) fails the open in seconds.
        let answer_within = wire.options.connect_timeout.saturating_mul(2);
        wire.link
            .set_exchange_deadline(Some(Instant::now() + answer_within));
        let theirs = wire
            .handshake(ours, next, role)
            .map_err(|error| match error {
                DriverError::Link {
                    error: NetError::Timeout(TimeoutKind::Exchange),
                    ..
                } => DriverError::Stage {
                    code: ErrorCode::StageDown,
                    message: format!(
                        "{} at {next} accepted the link but did not answer its hello within {} ms (it, or a stage after it, is stopped, hung or cut off)",
                        wire.peer,
                        answer_within.as_millis()
                    ),
                },
                other => other,
            })?;
        wire.link.set_exchange_deadline(None);
        Ok((wire, theirs))
    }

    /// The hellos (and the cluster key's proofs) of a link `open` just connected: says `ours`, checks the
    /// answer, and returns it.
    fn handshake(
        &mut self,
        ours: Hello,
        next: SocketAddr,
        role: Role,
    ) -> Result<Hello, DriverError> {
        let peer = self.peer.clone();
        self.send(&Frame::Hello(ours.clone()))?;
        let theirs = match self.receive()? {
            Frame::Hello(theirs) => theirs,
            Frame::Error { code, message, .. } => return Err(DriverError::Stage { code, message }),
            other => {
                return Err(DriverError::Protocol(format!(
                    "{peer} answered the hello with a {} frame",
                    other.kind_name()
                )));
            }
        };
        let checked = match role {
            Role::StageLink => check_adjacent(&ours, &theirs),
            Role::PredictionReturn => check_same_model(&ours, &theirs),
        };
        checked.map_err(|mismatch| DriverError::Stage {
            code: mismatch.code(),
            message: mismatch.to_string(),
        })?;
        if role == Role::PredictionReturn {
            if theirs.layer_end != theirs.block_count {
                return Err(DriverError::Protocol(format!(
                    "the stage at {next} serves layers {}..{} of {}, so it is not the chain's last stage; a prediction return goes to the last one",
                    theirs.layer_start, theirs.layer_end, theirs.block_count
                )));
            }
            self.peer = format!("stage {} (the last)", theirs.stage_index);
        }
        if let Some(key) = self.options.cluster_key.clone() {
            let proven = theirs.proof.is_some_and(|proof| {
                verify(&key, Side::Accepting, &ours.nonce, &theirs.nonce, &proof)
            });
            if !proven {
                return Err(DriverError::Stage {
                    code: ErrorCode::Auth,
                    message: format!(
                        "{peer} did not prove the cluster key; give every stage the same --cluster-key file"
                    ),
                });
            }
            let answer = proof(&key, Side::Connecting, &ours.nonce, &theirs.nonce);
            self.send(&Frame::Proof { proof: answer })?;
        }
        Ok(theirs)
    }

    fn send(&mut self, frame: &Frame) -> Result<(), DriverError> {
        let mut bytes = Vec::new();
        encode(frame, &mut bytes);
        if self.options.shape.is_shaped() {
            let now = Instant::now();
            let (release, free) = self
                .options
                .shape
                .schedule(now, self.link_free, bytes.len());
            self.link_free = free;
            std::thread::sleep(release.saturating_duration_since(now));
        }
        STAGE.sent(LinkSide::Downstream, bytes.len());
        self.link
            .write_all(&bytes)
            .map_err(|error| DriverError::Link {
                peer: self.peer.clone(),
                address: self.address,
                error,
            })
    }

    fn receive(&mut self) -> Result<Frame, DriverError> {
        loop {
            if let Some(frame) = self.buffered()? {
                return Ok(frame);
            }
            self.fill()?;
        }
    }

    /// The next whole frame among the bytes already read, if there is one (on a shaped link, once the link
    /// would have delivered it).
    fn buffered(&mut self) -> Result<Option<Frame>, DriverError> {
        while self.unread_start < self.unread.len() {
            let (taken, frame) = self.decoder.decode(&self.unread[self.unread_start..])?;
            self.unread_start += taken;
            self.frame_bytes += taken;
            if frame.is_some() {
                let bytes = std::mem::take(&mut self.frame_bytes);
                // Stage 0 shapes its own link to stage 1; the last stage shapes the tokens it returns.
                if self.role == Role::StageLink && self.options.shape.is_shaped() {
                    let (release, free) =
                        self.options
                            .shape
                            .schedule(self.filled_at, self.answers_free, bytes);
                    self.answers_free = free;
                    std::thread::sleep(release.saturating_duration_since(Instant::now()));
                }
                return Ok(frame);
            }
        }
        self.unread.clear();
        self.unread_start = 0;
        Ok(None)
    }

    /// The `Error` frame among what the stage sent before its end of the link closed, once a write failed
    /// (reading what the kernel still holds, without waiting: it came before the close, so it is here if it
    /// came at all; the link itself reports the failure from then on).
    fn closing_words(&mut self) -> Option<DriverError> {
        let mut scratch = [0u8; 16 * 1024];
        loop {
            loop {
                match self.buffered() {
                    Ok(Some(Frame::Error { code, message, .. })) => {
                        return Some(DriverError::Stage { code, message });
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(_) => return None,
                }
            }
            match self.link.read_left(&mut scratch) {
                Ok(count) if count > 0 => self.unread.extend_from_slice(&scratch[..count]),
                _ => return None,
            }
        }
    }

    /// Reads once from the link (waiting under its deadlines); the end of the link is an error naming the
    /// stage.
    fn fill(&mut self) -> Result<(), DriverError> {
        let mut scratch = [0u8; 64 * 1024];
        let count = self
            .link
            .read(&mut scratch)
            .map_err(|error| DriverError::Link {
                peer: self.peer.clone(),
                address: self.address,
                error,
            })?;
        if count == 0 {
            let message = match self.role {
                Role::StageLink => format!(
                    "{} at {} closed the link (the stage, or one after it, stopped)",
                    self.peer, self.address
                ),
                Role::PredictionReturn => format!(
                    "{} at {} closed the prediction-return link (the stage stopped)",
                    self.peer, self.address
                ),
            };
            return Err(DriverError::Stage {
                code: ErrorCode::StageDown,
                message,
            });
        }
        STAGE.received(LinkSide::Downstream, count);
        self.filled_at = Instant::now();
        self.unread.extend_from_slice(&scratch[..count]);
        Ok(())
    }
}

/// Stage 0's hello for a chain after its layers `0..layers_end` of `file` (rows of `width` values).
pub fn first_stage_hello(
    file: &ModelFile,
    layers_end: usize,
    width: usize,
    context_length: usize,
) -> Result<Hello, DriverError> {
    Ok(Hello {
        version: PROTOCOL_VERSION,
        role: Role::StageLink,
        fingerprint: model::fingerprint(file.path())?,
        stage_index: 0,
        layer_start: 0,
        layer_end: layers_end as u32,
        block_count: file.config().block_count as u32,
        width: width as u32,
        vocab_size: file.config().vocab_size as u32,
        lanes: 1,
        context_length: u32::try_from(context_length).unwrap_or(u32::MAX),
        codecs: CodecSet::all(),
        nonce: [0; 16],
        proof: None,
        return_address: None,
    })
}

/// Checks that the chain at `next` is up and continues `ours`: a link is opened, its hellos exchanged (the
/// first stage answers only once every stage after it did) and closed again. Returns the first stage's hello.
pub fn probe(ours: &Hello, next: SocketAddr, options: ChainOptions) -> Result<Hello, DriverError> {
    Wire::open(ours, next, options, Role::StageLink).map(|(_, theirs)| theirs)
}

/// Loads stage 0's layers `0..layers_end` of `file` with `lanes` lanes (each of `context_length` tokens, by
/// default the model's), checking that they leave some layers to the chain.
pub fn load_first_stage(
    file: &ModelFile,
    layers_end: usize,
    lanes: usize,
    context_length: Option<usize>,
) -> Result<Stage, DriverError> {
    let block_count = file.config().block_count;
    if layers_end == 0 || layers_end >= block_count {
        return Err(DriverError::Layers(format!(
            "stage 0 must keep some layers and leave some to the chain: 0..{layers_end} is not inside 0..{block_count}"
        )));
    }
    let spec = StageSpec {
        layers: 0..layers_end,
        first: true,
        last: false,
    };
    Ok(Stage::from_file(
        file,
        spec,
        StageOptions {
            lane_count: lanes.max(1),
            context_length,
        },
    )?)
}

/// A session id no other stage 0 uses at the same time: random, so that stage 0 processes on different hosts
/// sharing a chain do not collide (and never 0, which names the whole link).
fn new_session_id() -> u64 {
    random_u64().max(1)
}

/// Eight random bytes as a number, from the same source as a hello's nonce.
fn random_u64() -> u64 {
    let nonce = fresh_nonce();
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&nonce[..8]);
    u64::from_le_bytes(bytes)
}
