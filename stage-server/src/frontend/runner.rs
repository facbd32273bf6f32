//! One lane's generator: the whole model in this process, or stage 0's layers with a link down a chain.

use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::driver::{Chain, Predicted, SamplerExtras};
use crate::model::{
    Finish, GenerateOptions, Generation, Logits, ModelError, PREFILL_CHUNK, Sampler,
    SamplingParams, Stage, StageInput, StageOutput, log_probabilities,
};

/// What a lane generates with.
#[derive(Debug)]
pub(crate) enum LaneRunner {
    /// Every layer here: lane `lane` of a stage shared by all the lanes.
    Local {
        /// The whole model, loaded once.
        stage: Arc<Mutex<Stage>>,
        /// This runner's lane of its KV cache.
        lane: usize,
    },
    /// Stage 0's layers here (the chain link holds its share), the rest down the chain.
    Chain(Box<Chain>),
}

impl LaneRunner {
    /// Generates from `prompt`; `on_token` sees each token and may end the generation with `Break`.
    pub(crate) fn generate(
        &mut self,
        prompt: &[u32],
        sampling: SamplingParams,
        extras: &SamplerExtras,
        options: &GenerateOptions,
        on_token: impl FnMut(&Predicted) -> ControlFlow<()>,
    ) -> Result<Generation, String> {
        match self {
            LaneRunner::Local { stage, lane } => {
                generate_local(stage, *lane, prompt, sampling, extras, options, on_token)
                    .map_err(|error| error.to_string())
            }
            LaneRunner::Chain(chain) => chain
                .generate_with(prompt, sampling, extras, options, on_token)
                .map_err(|error| error.to_string()),
        }
    }
}

fn lock(stage: &Mutex<Stage>) -> MutexGuard<'_, Stage> {
    // A panicked pass leaves only its own lane suspect, and every generation resets its lane first.
    stage
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The whole model on one lane, as `Pipeline::generate` runs it, with the chain's last stage's extras
/// (logit bias, log-probabilities) so the two backends answer alike. The stage is locked per forward pass
/// only, so the lanes take turns at every step.
fn generate_local(
    stage: &Mutex<Stage>,
    lane: usize,
    prompt: &[u32],
    sampling: SamplingParams,
    extras: &SamplerExtras,
    options: &GenerateOptions,
    mut on_token: impl FnMut(&Predicted) -> ControlFlow<()>,
) -> Result<Generation, ModelError> {
    let mut generation = Generation {
        tokens: Vec::new(),
        logits: Vec::new(),
        prompt_time: Duration::ZERO,
        decode_time: Duration::ZERO,
        finish: Finish::Length,
    };
    if prompt.is_empty() {
        return Err(ModelError::EmptyChunk);
    }
    lock(stage).reset(lane)?;
    if options.max_tokens == 0 {
        return Ok(generation);
    }
    let mut sampler = Sampler::new(sampling);
    for &token in prompt {
        sampler.accept(token);
    }
    let forward = |position: usize, tokens: &[u32]| -> Result<Vec<f32>, ModelError> {
        match lock(stage).forward(lane, position, StageInput::Tokens(tokens), Logits::Last)? {
            StageOutput::Logits(row) => Ok(row),
            StageOutput::Activations(_) => Err(ModelError::Compute(
                "the local stage returned activations; it must hold every layer".into(),
            )),
        }
    };
    let started = Instant::now();
    let mut row = Vec::new();
    for (index, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
        row = forward(index * PREFILL_CHUNK, chunk)?;
    }
    generation.prompt_time = started.elapsed();
    let decode_started = Instant::now();
    let mut position = prompt.len();
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
        let (logprob, top) = log_probabilities(&row, token, extras.top_logprobs.min(20));
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
        row = forward(position, &[token])?;
        position += 1;
    }
    generation.decode_time = decode_started.elapsed();
    Ok(generation)
}
