//! One lane's generator: the whole model in this process, or stage 0's layers with a link down a chain.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use std::net::SocketAddr;

use super::batcher::Batcher;
use super::health::ChainHealth;
use crate::driver::{Chain, ChainOptions, DriverError, Predicted, SamplerExtras, StageShare};
use crate::model::{
    Arrival, Finish, GenerateOptions, Generation, ModelError, Sampler, SamplingParams,
    wanted_log_probabilities,
};
use crate::telemetry::names;
use crate::wire::{ErrorCode, Hello};

/// What a lane generates with.
#[derive(Debug)]
pub(crate) enum LaneRunner {
    /// Every layer here: the whole model, loaded once, its lanes leased per generation and their forward
    /// passes batched together.
    Local(Arc<Batcher>),
    /// Stage 0's layers here (the chain link holds its share), the rest down the chain.
    Chain(Box<ChainLane>),
}

/// Why a lane could not generate.
#[derive(Debug)]
pub(crate) struct RunError {
    /// The chain is down or refused (503 with `Retry-After`), rather than the generation failing (500).
    pub unavailable: bool,
    /// The prompt does not fit the chain's lanes, whose context length this is (a 400, nothing was sent).
    pub context: Option<usize>,
    /// A stage had no free lane for the generation (its lanes are busy, or fewer than the chain said when the
    /// lane's link opened): it may run once another generation ends.
    pub busy: bool,
    /// What happened, in words.
    pub message: String,
}

impl RunError {
    /// The chain is down for `reason`: a 503 with `Retry-After`, since it may be back in moments.
    fn chain_down(reason: impl std::fmt::Display) -> RunError {
        RunError {
            unavailable: true,
            context: None,
            busy: false,
            message: format!("the chain is down ({reason}); retry shortly"),
        }
    }
}

/// What the chain said in its hello, shared by its lanes and the API: every link that opens sets it, so a stage
/// restarted with other settings is followed.
#[derive(Clone, Debug)]
pub(crate) struct ChainLimits {
    /// Tokens a lane holds (the chain's shortest), for the API's prompt checks.
    pub context: Arc<AtomicUsize>,
    /// Generations the chain runs at once (its fewest lanes), for the engine's lanes.
    pub lanes: Arc<AtomicUsize>,
}

impl ChainLimits {
    /// Limits no link has set yet.
    pub(crate) fn unset(lanes: usize) -> ChainLimits {
        ChainLimits {
            context: Arc::new(AtomicUsize::new(usize::MAX)),
            lanes: Arc::new(AtomicUsize::new(lanes)),
        }
    }

    fn follow(&self, link: &Chain) {
        self.context.store(link.context_length(), Ordering::Relaxed);
        self.lanes.store(link.chain_lanes(), Ordering::Release);
    }
}

/// A lane's link down the chain, opened again for the next request after it broke.
#[derive(Debug)]
pub(crate) struct ChainLane {
    link: Option<Chain>,
    /// The chain's outage count when `link` was opened (see [`ChainHealth::outages`]).
    link_outages: u64,
    share: StageShare,
    ours: Hello,
    next: SocketAddr,
    options: ChainOptions,
    health: Arc<ChainHealth>,
    /// What the chain said, shared with the API's prompt checks and its lanes.
    limits: ChainLimits,
}

impl ChainLane {
    /// A lane on `share` that links to the chain at `next`, opening its first link now.
    pub(crate) fn connect(
        share: StageShare,
        ours: Hello,
        next: SocketAddr,
        options: ChainOptions,
        health: Arc<ChainHealth>,
        limits: ChainLimits,
    ) -> Result<ChainLane, DriverError> {
        let link_outages = health.outages();
        let link = Chain::connect_with(share.clone(), &ours, next, options.clone())?;
        limits.follow(&link);
        Ok(ChainLane {
            link: Some(link),
            link_outages,
            share,
            ours,
            next,
            options,
            health,
            limits,
        })
    }

    fn generate(
        &mut self,
        prompt: &[u32],
        sampling: SamplingParams,
        extras: &SamplerExtras,
        options: &GenerateOptions,
        cancelled: &dyn Fn() -> bool,
        mut on_token: impl FnMut(&Predicted) -> ControlFlow<()>,
    ) -> Result<Generation, RunError> {
        let delivered = std::cell::Cell::new(false);
        let mut counted = |predicted: &Predicted| {
            delivered.set(true);
            on_token(predicted)
        };
        let started = Instant::now();
        let first = self.attempt(
            prompt,
            sampling.clone(),
            extras,
            options,
            cancelled,
            &mut counted,
        );
        match first {
            // The link was open from before and broke at once at this generation's first frames, nothing of it
            // reached the client: the stage behind it restarted (or the chain's probe has not seen it go yet).
            // Once more on a fresh link; if the chain is really down, opening it fails and says so. Not a chain
            // that fell silent (a stopped stage): its check takes longer than the silence before it, and a new
            // link would wait out its hello's deadline on top.
            Err(failure)
                if failure.link_lost
                    && !delivered.get()
                    && started.elapsed() < self.options.silence_probe.max(QUICK_BREAK) =>
            {
                tracing::info!(
                    lane = self.share.lane,
                    peer = %self.next,
                    "the lane's link broke before the generation's first token ({}); trying once more on a new link",
                    failure.error.message
                );
                self.attempt(prompt, sampling, extras, options, cancelled, &mut counted)
                    .map_err(|failure| failure.error)
            }
            Err(failure) => {
                // Not tried again: the chain is down as far as this lane can tell (see `attempt`).
                if failure.link_lost {
                    self.health.mark_down(format!(
                        "stage 1 at {}: {}",
                        self.next, failure.error.message
                    ));
                }
                Err(failure.error)
            }
            Ok(generation) => Ok(generation),
        }
    }

    /// One try of [`generate`](Self::generate): on the lane's link, or a new one.
    fn attempt(
        &mut self,
        prompt: &[u32],
        sampling: SamplingParams,
        extras: &SamplerExtras,
        options: &GenerateOptions,
        cancelled: &dyn Fn() -> bool,
        on_token: impl FnMut(&Predicted) -> ControlFlow<()>,
    ) -> Result<Generation, Failure> {
        if self.link.is_some() && self.link_outages != self.health.outages() {
            // The chain went down since this link opened: the stage it leads to died, even if one is back on
            // its address now; writing into the old link would fail this request.
            self.link = None;
        }
        let reused = self.link.is_some();
        let link = match self.link.take() {
            Some(link) => link,
            None => {
                if let Some(reason) = self.health.down_reason() {
                    return Err(Failure::fresh(RunError::chain_down(reason)));
                }
                tracing::debug!(
                    lane = self.share.lane,
                    peer = %self.next,
                    "{}",
                    names::EVENT_DOWNSTREAM_RECONNECT
                );
                // The new link postdates every outage counted so far (read before it opens: one during the open
                // drops it at the next request). Without this, one outage made the lane drop and reopen its link
                // at every request from then on, losing its kept prefix each time.
                self.link_outages = self.health.outages();
                let opened = Chain::connect_with(
                    self.share.clone(),
                    &self.ours,
                    self.next,
                    self.options.clone(),
                )
                .map_err(|error| {
                    let message = format!("stage 1 at {}: {error}", self.next);
                    self.health.mark_down(message.clone());
                    Failure::fresh(RunError::chain_down(message))
                })?;
                // Only a new link's hello is news: one open from before would put back what a stage said
                // before it restarted (with fewer lanes, say).
                self.limits.follow(&opened);
                opened
            }
        };
        let mut link = link;
        match link.generate_cancellable(prompt, sampling, extras, options, cancelled, on_token) {
            Ok(generation) => {
                self.link = Some(link);
                Ok(generation)
            }
            // A prompt too long for the chain was refused before anything was sent: the link is as it was.
            Err(error @ DriverError::Context { context, .. }) => {
                self.link = Some(link);
                Err(Failure::fresh(RunError {
                    unavailable: false,
                    context: Some(context),
                    busy: false,
                    message: error.to_string(),
                }))
            }
            // Otherwise the link is dropped whatever failed: the next request opens a fresh one, so a stage that
            // restarted meanwhile is found, and no half-read frame is ever taken for an answer.
            Err(error) => {
                let unavailable = matches!(error, DriverError::Link { .. })
                    || matches!(
                        &error,
                        DriverError::Stage {
                            code: ErrorCode::StageDown,
                            ..
                        }
                    );
                // A link from before that broke is tried again on a new one before the chain is called down
                // (which fails every other lane's requests until the probe sees it back).
                let link_lost = unavailable && reused;
                if unavailable && !reused {
                    self.health
                        .mark_down(format!("stage 1 at {}: {error}", self.next));
                }
                // A stage with no free lane is busy, not broken: the request may wait for a lane, and the
                // chain is not marked down for it.
                let busy = matches!(
                    &error,
                    DriverError::Stage {
                        code: ErrorCode::NoFreeLane,
                        ..
                    }
                );
                Err(Failure {
                    error: RunError {
                        unavailable: unavailable || busy,
                        context: None,
                        busy,
                        message: error.to_string(),
                    },
                    link_lost,
                })
            }
        }
    }
}

/// A link from before that fails sooner than this (or than the chain's silence check begins, if later) broke at
/// once, rather than found its chain silent.
const QUICK_BREAK: Duration = Duration::from_millis(500);

/// How one try of a chain lane's generation failed.
struct Failure {
    error: RunError,
    /// The lane's link, open from before, broke (or its stage said it lost the next one): worth a try on a new
    /// link before the client hears of it.
    link_lost: bool,
}

impl Failure {
    /// A failure not worth a second try.
    fn fresh(error: RunError) -> Failure {
        Failure {
            error,
            link_lost: false,
        }
    }
}

impl LaneRunner {
    /// The tokens this lane keeps from its last generation for the next to reuse, where lanes keep their own
    /// (a chain's: its session stays open at every stage); `None` for the whole model, whose lanes are leased
    /// by prefix from one pool whichever worker asks.
    pub(crate) fn held(&self) -> Option<&[u32]> {
        match self {
            LaneRunner::Local(_) => None,
            LaneRunner::Chain(lane) => Some(lane.link.as_ref().map_or(&[], Chain::held)),
        }
    }

    /// How much of `prompt` this lane would reuse, where lanes keep their own prefixes (see
    /// [`LaneRunner::held`]).
    pub(crate) fn reusable(&self, prompt: &[u32]) -> Option<usize> {
        match self {
            LaneRunner::Local(_) => None,
            LaneRunner::Chain(lane) => {
                Some(lane.link.as_ref().map_or(0, |link| link.reusable(prompt)))
            }
        }
    }

    /// Announces a generation this runner is about to start (its prompt is being prepared), where batching
    /// wants to know: the whole model's next step waits for it. Pass it to [`LaneRunner::generate`].
    pub(crate) fn expect_arrival(&self) -> Option<Arrival> {
        match self {
            LaneRunner::Local(batcher) => Some(batcher.expect_arrival()),
            // Bound to the lane: it lasts until the lane's first chunk, which comes after the chain's
            // Configure, not when the lane becomes active.
            LaneRunner::Chain(lane) => Some(lane.share.stage.expect_arrival_on(lane.share.lane)),
        }
    }

    /// Announces a generation this lane takes from the queue and hands to lane `other` of the same stage (whose
    /// session holds a longer prefix of its prompt), where lanes route jobs so (a chain's); `None` otherwise.
    pub(crate) fn expect_arrival_for(&self, other: usize) -> Option<Arrival> {
        match self {
            LaneRunner::Local(_) => None,
            LaneRunner::Chain(lane) => Some(lane.share.stage.expect_arrival_on(other)),
        }
    }

    /// Generates from `prompt`; `on_token` sees each token and may end the generation with `Break`, and
    /// `cancelled`, asked before each prompt chunk, ends it before its first token.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn generate(
        &mut self,
        prompt: &[u32],
        sampling: SamplingParams,
        extras: &SamplerExtras,
        options: &GenerateOptions,
        arrival: Option<Arrival>,
        cancelled: &dyn Fn() -> bool,
        on_token: impl FnMut(&Predicted) -> ControlFlow<()>,
    ) -> Result<Generation, RunError> {
        match self {
            LaneRunner::Local(batcher) => generate_local(
                batcher, prompt, sampling, extras, options, arrival, cancelled, on_token,
            )
            .map_err(|error| RunError {
                unavailable: false,
                context: None,
                busy: false,
                message: error.to_string(),
            }),
            LaneRunner::Chain(lane) => {
                // Held through the generation: the lane's first chunk ends it (see `expect_arrival`).
                let _arrival = arrival;
                lane.generate(prompt, sampling, extras, options, cancelled, on_token)
            }
        }
    }
}

/// The whole model on a leased lane, as `Pipeline::generate` runs it, with the chain's last stage's extras
/// (logit bias, log-probabilities) so the two backends answer alike. The lane starts from the longest prefix
/// of the prompt it already holds; every forward pass runs in a batch with the other lanes' next steps. The
/// prompt goes in chunks of a pass's budget (at least [`crate::model::PREFILL_CHUNK`] rows), `cancelled` asked before each
/// (a client that went away during a long prompt frees the lane within a chunk); chunked prefill gives the
/// same bits as one chunk.
#[allow(clippy::too_many_arguments)]
fn generate_local(
    batcher: &Arc<Batcher>,
    prompt: &[u32],
    sampling: SamplingParams,
    extras: &SamplerExtras,
    options: &GenerateOptions,
    arrival: Option<Arrival>,
    cancelled: &dyn Fn() -> bool,
    mut on_token: impl FnMut(&Predicted) -> ControlFlow<()>,
) -> Result<Generation, ModelError> {
    let mut generation = Generation::empty();
    if prompt.is_empty() {
        return Err(ModelError::EmptyChunk);
    }
    let mut lease = batcher.lease(prompt, arrival)?;
    generation.cached_tokens = lease.cached();
    if options.max_tokens == 0 {
        return Ok(generation);
    }
    let mut sampler = Sampler::new(sampling);
    for &token in prompt {
        sampler.accept(token);
    }
    let started = Instant::now();
    let mut row = Vec::new();
    for chunk in prompt[lease.cached()..].chunks(batcher.prompt_chunk()) {
        if cancelled() {
            generation.finish = Finish::Stop;
            return Ok(generation);
        }
        row = lease.forward(chunk)?;
    }
    generation.prompt_time = started.elapsed();
    let decode_started = Instant::now();
    loop {
        for &(token, bias) in &extras.logit_bias {
            if let Some(logit) = row.get_mut(token as usize) {
                *logit += bias;
            }
        }
        let token = sampler.sample(&row);
        if options.stop_tokens.contains(&token) {
            generation.finish = Finish::Stop;
            break;
        }
        sampler.accept(token);
        let (logprob, top) =
            wanted_log_probabilities(&row, token, extras.logprobs, extras.top_logprobs.min(20));
        generation.tokens.push(token);
        if on_token(&Predicted {
            token,
            logprob,
            top,
        })
        .is_break()
        {
            generation.finish = Finish::Stop;
            break;
        }
        if generation.tokens.len() >= options.max_tokens {
            break;
        }
        // This token's pass and at most one per token still to come: a prompt arriving at another lane may
        // wait for this stream's end instead of stalling it.
        lease.expect_end(options.max_tokens - generation.tokens.len());
        row = lease.forward(&[token])?;
    }
    generation.decode_time = decode_started.elapsed();
    Ok(generation)
}
