//! In-process pipelines: a model split into stages that pass each other f32 activation bytes, and generation.

use std::path::Path;
use std::time::{Duration, Instant};

use super::{
    Logits, ModelError, ModelFile, Sampler, Stage, StageInput, StageOptions, StageOutput, StageSpec,
};

/// Prompt tokens per prefill chunk. Attention scores take `heads x chunk x context` f32 values, so
/// bounded chunks keep a long prompt from needing gigabytes at once.
pub const PREFILL_CHUNK: usize = 512;

/// A whole model run as consecutive stages in one process. Between stages the activations are turned
/// into little-endian f32 bytes and back, exactly what a stage would send over the wire.
#[derive(Debug)]
pub struct Pipeline {
    stages: Vec<Stage>,
}

/// What one generation produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The generated token ids (without the prompt; the end-of-generation token is not included).
    pub tokens: Vec<u32>,
    /// One logit row per generated step when asked for, `tokens x vocab_size` values (the row that
    /// produced each token, and the row that produced the stop token if generation stopped on one).
    pub logits: Vec<f32>,
    /// Wall time of the prompt prefill.
    pub prompt_time: Duration,
    /// Wall time of the decode steps after the first token.
    pub decode_time: Duration,
    /// Why generation ended.
    pub finish: Finish,
    /// Leading prompt tokens whose keys and values were already in the lane's cache (a reused prefix), so
    /// they were not prefilled again.
    pub cached_tokens: usize,
}

impl Generation {
    /// Nothing generated yet (and, if nothing more is, ended by the token budget).
    pub fn empty() -> Generation {
        Generation {
            tokens: Vec::new(),
            logits: Vec::new(),
            prompt_time: Duration::ZERO,
            decode_time: Duration::ZERO,
            finish: Finish::Length,
            cached_tokens: 0,
        }
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model produced an end-of-generation token.
    Stop,
    /// The token budget ran out.
    Length,
}

/// Settings of [`Pipeline::generate`].
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Tokens that end generation (EOS, end-of-turn).
    pub stop_tokens: Vec<u32>,
    /// Keep each step's logit row in [`Generation::logits`].
    pub keep_logits: bool,
}

impl Pipeline {
    /// Loads the model at `path` split at `boundaries` (empty: one stage) with `options` on every stage.
    pub fn load(
        path: &Path,
        boundaries: &[usize],
        options: StageOptions,
    ) -> Result<Self, ModelError> {
        let file = ModelFile::open(path)?;
        Self::from_file(&file, boundaries, options)
    }

    /// Builds the stages from an open model file.
    pub fn from_file(
        file: &ModelFile,
        boundaries: &[usize],
        options: StageOptions,
    ) -> Result<Self, ModelError> {
        let block_count = file.config().block_count;
        let specs = StageSpec::split(block_count, boundaries).map_err(|_| ModelError::Split {
            path: file.path().to_path_buf(),
            boundaries: boundaries.to_vec(),
            block_count,
        })?;
        let stages = specs
            .into_iter()
            .map(|spec| Stage::from_file(file, spec, options.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { stages })
    }

    /// The stages, first to last.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// The model configuration.
    pub fn config(&self) -> &super::ModelConfig {
        self.stages[0].config()
    }

    /// Runs `tokens` at `position` on `lane` through every stage and returns the logit rows.
    ///
    /// The stages run inside one pass of the compute pool, as one stage would: each stage's own pass nests in
    /// it, so the pool's workers spin from one stage to the next instead of parking at each stage's end and
    /// being woken by the next (a wake costs 12 to 60 µs on the hosts we measure on, and a split of three paid
    /// two more per token than the whole model).
    pub fn forward(
        &mut self,
        lane: usize,
        position: usize,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>, ModelError> {
        crate::kernels::ComputePool::global()
            .pass(|| self.forward_through_stages(lane, position, tokens, logits))
    }

    /// [`Pipeline::forward`] inside a pass of the compute pool.
    fn forward_through_stages(
        &mut self,
        lane: usize,
        position: usize,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>, ModelError> {
        let mut wire: Vec<u8> = Vec::new();
        let mut activations: Vec<f32>;
        let stage_count = self.stages.len();
        for (index, stage) in self.stages.iter_mut().enumerate() {
            let input = if index == 0 {
                StageInput::Tokens(tokens)
            } else {
                activations = decode_activations(&wire);
                StageInput::Activations(&activations)
            };
            match stage.forward(lane, position, input, logits)? {
                StageOutput::Logits(rows) => return Ok(rows),
                StageOutput::Activations(rows) => {
                    debug_assert!(index + 1 < stage_count, "only the last stage has a head");
                    wire = encode_activations(&rows);
                }
            }
        }
        Err(ModelError::WrongInput {
            expected: "a last stage that owns the head",
        })
    }

    /// Cuts `lane` back to `length` positions on every stage, or on none.
    ///
    /// Stages can refuse different trims (a stage whose layers are all global can go back further than one with
    /// sliding-window layers), so every stage is checked before any is changed.
    pub fn trim(&mut self, lane: usize, length: usize) -> Result<(), ModelError> {
        self.stages
            .iter()
            .try_for_each(|stage| stage.check_trim(lane, length))?;
        self.stages
            .iter_mut()
            .try_for_each(|stage| stage.trim(lane, length))
    }

    /// Empties `lane` on every stage.
    pub fn reset(&mut self, lane: usize) -> Result<(), ModelError> {
        self.stages
            .iter_mut()
            .try_for_each(|stage| stage.reset(lane))
    }

    /// Prefills `prompt` on an empty `lane` in chunks of [`PREFILL_CHUNK`] tokens, then decodes until a stop token or
    /// `max_tokens`. `on_token` sees each token as it is chosen.
    pub fn generate(
        &mut self,
        lane: usize,
        prompt: &[u32],
        sampler: &mut Sampler,
        options: &GenerateOptions,
        mut on_token: impl FnMut(u32),
    ) -> Result<Generation, ModelError> {
        self.reset(lane)?;
        for &token in prompt {
            sampler.accept(token);
        }
        let mut generation = Generation::empty();
        if options.max_tokens == 0 {
            return Ok(generation);
        }
        if prompt.is_empty() {
            return Err(ModelError::EmptyChunk);
        }
        let started = Instant::now();
        let mut row = Vec::new();
        for (index, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
            row = self.forward(lane, index * PREFILL_CHUNK, chunk, Logits::Last)?;
        }

        generation.prompt_time = started.elapsed();
        let decode_started = Instant::now();
        let mut position = prompt.len();
        loop {
            let token = sampler.sample(&row);
            if options.keep_logits {
                generation.logits.extend_from_slice(&row);
            }
            if options.stop_tokens.contains(&token) {
                generation.finish = Finish::Stop;
                break;
            }
            sampler.accept(token);
            generation.tokens.push(token);
            on_token(token);
            if generation.tokens.len() >= options.max_tokens {
                break;
            }
            row = self.forward(lane, position, &[token], Logits::Last)?;
            position += 1;
        }
        generation.decode_time = decode_started.elapsed();
        Ok(generation)
    }
}

/// Activation rows as the wire carries them: little-endian f32.
pub fn encode_activations(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

/// Little-endian f32 bytes back into values (a trailing partial value is ignored).
pub fn decode_activations(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
        .collect()
}
