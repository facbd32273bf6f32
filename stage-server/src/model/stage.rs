//! One pipeline stage: a contiguous layer range with per-lane KV caches, run over token or activation chunks.
//!
//! ```text
//!  tokens ──▶ [embedding rows, first stage] ──▶ blocks start..end ──▶ [norm + head, last stage] ──▶ logits
//!                                                 │  per lane: KV cache of each block
//!  activation rows (f32, rows x width) ───────────┘  (later stages)      other stages ──▶ activation rows
//! ```

use std::borrow::Cow;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};

use super::config::LayerAttention;
use super::{Architecture, ModelConfig, ModelError, ModelFile};
use crate::kernels::{ActivationPrecision, Linear};

mod ops;

use ops::{
    AttentionScale, RopePairing, add_in_place, attend, gelu_as_ggml_in_place, heads_first,
    rms_norm_rows, rotate_rows,
};

/// Which part of the model a stage runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpec {
    /// The transformer blocks `[start, end)` this stage owns.
    pub layers: Range<usize>,
    /// The stage owns the token embeddings and takes token ids as input.
    pub first: bool,
    /// The stage owns the output norm and head and returns logits.
    pub last: bool,
}

impl StageSpec {
    /// The whole model of `block_count` layers as one stage.
    pub fn whole(block_count: usize) -> Self {
        Self {
            layers: 0..block_count,
            first: true,
            last: true,
        }
    }

    /// The stages a split at `boundaries` makes: `[10, 20]` over 30 layers gives `0..10`, `10..20`, `20..30`.
    /// Boundaries must rise strictly inside `1..block_count`.
    pub fn split(block_count: usize, boundaries: &[usize]) -> Result<Vec<Self>, SplitError> {
        let mut starts = vec![0];
        for &boundary in boundaries {
            let previous = *starts.last().unwrap_or(&0);
            if boundary <= previous || boundary >= block_count {
                return Err(SplitError {
                    boundary,
                    block_count,
                });
            }
            starts.push(boundary);
        }
        let count = starts.len();
        Ok(starts
            .iter()
            .enumerate()
            .map(|(index, &start)| Self {
                layers: start..starts.get(index + 1).copied().unwrap_or(block_count),
                first: index == 0,
                last: index + 1 == count,
            })
            .collect())
    }
}

/// A split boundary that is not strictly rising inside the model's layers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "split boundary {boundary} must rise strictly and lie inside 1..{block_count} (the model has {block_count} layers)"
)]
pub struct SplitError {
    /// The offending boundary.
    pub boundary: usize,
    /// Layers in the model.
    pub block_count: usize,
}

/// Run-time options of a stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageOptions {
    /// Independent sessions, each with its own KV cache.
    pub lane_count: usize,
    /// Context limit per lane; `None` takes the model's trained context length.
    pub context_length: Option<usize>,
}

impl Default for StageOptions {
    fn default() -> Self {
        Self {
            lane_count: 1,
            context_length: None,
        }
    }
}

/// The input of one chunk.
#[derive(Clone, Copy, Debug)]
pub enum StageInput<'a> {
    /// Token ids (first stage).
    Tokens(&'a [u32]),
    /// Activation rows, `rows x width` f32 values (later stages).
    Activations(&'a [f32]),
}

/// One lane's chunk in a batch ([`Stage::forward_batch`]).
#[derive(Clone, Copy, Debug)]
pub struct BatchEntry<'a> {
    /// The lane whose cache the chunk extends; a lane appears at most once per batch.
    pub lane: usize,
    /// The chunk's first absolute position, which must equal the lane's length.
    pub position: usize,
    /// Its rows.
    pub input: StageInput<'a>,
    /// Which logit rows it wants back (last stage).
    pub logits: Logits,
}

/// An admitted entry's place in the batch's rows.
#[derive(Clone, Copy, Debug)]
struct Segment {
    /// Its index among the entries.
    entry: usize,
    lane: usize,
    position: usize,
    rows: usize,
    /// Its first row among the batch's rows.
    offset: usize,
    logits: Logits,
}

/// Which rows of logits the last stage returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's row (decode and the end of a prompt).
    Last,
    /// One row per position of the chunk (for agreement tests and verification).
    All,
}

/// The result of one chunk.
#[derive(Clone, Debug, PartialEq)]
pub enum StageOutput {
    /// Activation rows for the next stage, `rows x width` f32 values.
    Activations(Vec<f32>),
    /// Logit rows, `rows x vocab_size` f32 values.
    Logits(Vec<f32>),
}

/// One loaded stage of a model with `lane_count` independent lanes.
#[derive(Debug)]
pub struct Stage {
    path: PathBuf,
    config: ModelConfig,
    spec: StageSpec,
    context_length: usize,
    embedding: Option<EmbeddingRows>,
    blocks: Vec<Block>,
    head: Option<Head>,
    lanes: Vec<Lane>,
    /// Tests only: the next pass panics, as a bug in a kernel would.
    #[cfg(test)]
    pub(crate) panic_next_pass: bool,
}

/// One transformer block's weights.
#[derive(Debug)]
struct Block {
    attention_norm: Vec<f32>,
    /// Query, key and value projections (fused where their types match).
    attention_input: Projections,
    output: Linear,
    query_norm: Option<Vec<f32>>,
    key_norm: Option<Vec<f32>>,
    post_attention_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    /// Gate and up projections (fused where their types match).
    ffn_input: Projections,
    down: Linear,
    post_ffn_norm: Option<Vec<f32>>,
    attention: LayerAttention,
}

/// The final norm and the output projection.
#[derive(Debug)]
struct Head {
    norm: Vec<f32>,
    output: Linear,
}

/// Reads embedding rows straight from the file, so no stage keeps the whole embedding matrix for a lookup.
#[derive(Debug)]
struct EmbeddingRows {
    path: PathBuf,
    file: File,
    data_offset: u64,
    dtype: GgmlDType,
    row_bytes: usize,
    width: usize,
    vocab_size: usize,
    scale: Option<f64>,
}

/// One lane's cache: how many positions it holds, and each block's keys and values.
#[derive(Debug)]
struct Lane {
    length: usize,
    caches: Vec<LayerCache>,
}

/// Keys and values of one block, `[kv_heads][capacity][head_width]` f16 values (as bits), grown in
/// chunks so appends rarely copy.
///
/// A global layer keeps every position from 0. A sliding-window layer of window `w` keeps only what later
/// queries can see: when its buffer is full it moves the last `w - 1 + TRIM_SLACK` positions to the front
/// instead of growing, so its memory stays near `w + TRIM_SLACK + CACHE_CHUNK` positions however long the
/// session runs. The slack lets a lane be trimmed back a little (speculative decoding, a retried step) after
/// the window has slid past position 0.
///
/// ```text
///   stored rows:  [ start ........................ length )   capacity
///                   ^ absolute position of row 0          ^ next append
/// ```
#[derive(Debug)]
struct LayerCache {
    /// f16 bits: the values are rounded to f16 anyway (llama.cpp's default cache type), and reading half the
    /// bytes matters once the cache of a few lanes is as large as the weights (SmolLM2, 4 lanes at 400
    /// positions: 74 MB a step against 98 MB of weights).
    keys: Vec<u16>,
    values: Vec<u16>,
    kv_heads: usize,
    width: usize,
    /// Positions each head's buffer has room for.
    capacity: usize,
    /// The absolute position of stored row 0 (0 for global layers).
    start: usize,
    /// The layer's sliding window, if it has one.
    window: Option<usize>,
}

/// The cache grows by whole chunks of this many positions.
const CACHE_CHUNK: usize = 256;

/// Positions a sliding-window layer keeps beyond its window, so a lane can always be trimmed back by at least
/// this many positions.
pub const TRIM_SLACK: usize = 64;

impl Stage {
    /// Loads the stage `spec` of the model at `path`.
    pub fn load(
        path: &std::path::Path,
        spec: StageSpec,
        options: StageOptions,
    ) -> Result<Self, ModelError> {
        let file = ModelFile::open(path)?;
        Self::from_file(&file, spec, options)
    }

    /// Loads the stage `spec` from an open model file, reading only the tensors the range needs.
    pub fn from_file(
        file: &ModelFile,
        spec: StageSpec,
        options: StageOptions,
    ) -> Result<Self, ModelError> {
        let mut config = file.config().clone();
        let path = file.path().to_path_buf();
        match config.sliding_window {
            Some(0) => {
                return Err(ModelError::UnsupportedShape {
                    path,
                    detail: "the metadata's `attention.sliding_window` is 0: a sliding-window layer would see no \
                             position, not even its own"
                        .to_string(),
                });
            }
            // A window at least the context wide slides past nothing; clamping keeps the layer's local RoPE base
            // and keeps window arithmetic far from overflow whatever the file says.
            Some(window) if window > config.context_length => {
                config.sliding_window = Some(config.context_length.max(1));
            }
            _ => {}
        }
        if spec.layers.start >= spec.layers.end || spec.layers.end > config.block_count {
            return Err(ModelError::LayerRange {
                path,
                start: spec.layers.start,
                end: spec.layers.end,
                block_count: config.block_count,
            });
        }
        let ends = [
            (
                spec.first && spec.layers.start != 0,
                "first",
                "start at layer 0".to_string(),
            ),
            (
                spec.last && spec.layers.end != config.block_count,
                "last",
                format!("end at layer {}", config.block_count),
            ),
        ];
        if let Some((_, role, rule)) = ends.into_iter().find(|(wrong, _, _)| *wrong) {
            return Err(ModelError::StageEnds {
                path,
                role,
                rule,
                start: spec.layers.start,
                end: spec.layers.end,
                block_count: config.block_count,
            });
        }
        if options.lane_count == 0 {
            return Err(ModelError::NoLanes);
        }
        let context_length = options
            .context_length
            .map_or(config.context_length, |limit| {
                limit.min(config.context_length)
            });
        let embedding = if spec.first {
            Some(EmbeddingRows::open(file, &config)?)
        } else {
            None
        };
        let blocks = spec
            .layers
            .clone()
            .map(|layer| Block::load(file, &config, layer))
            .collect::<Result<Vec<_>, _>>()?;
        let head = if spec.last {
            let output_name = if file.has_tensor("output.weight") {
                "output.weight"
            } else {
                "token_embd.weight"
            };
            Some(Head {
                norm: load_norm(file, "output_norm.weight", config.embedding_length)?,
                // The head's activations at about 15 bits instead of ggml's 8, at about the same cost: the
                // logits come closer to the exact forward than llama.cpp's (`kernels::ActivationPrecision`).
                output: load_linear(
                    file,
                    output_name,
                    config.embedding_length,
                    config.vocab_size,
                )?
                .with_activation_precision(ActivationPrecision::Wide),
            })
        } else {
            None
        };
        // The caches grow as lanes fill; checked now, with the weights loaded, so that a configuration whose full
        // caches cannot fit is refused here rather than found out by the allocation of a long generation.
        let needed = cache_bytes_at_most(&blocks, &config, context_length)
            .saturating_mul(options.lane_count as u64);
        if let Some(available) = super::memory::available_bytes()
            && needed > available
        {
            return Err(ModelError::CacheMemory {
                lanes: options.lane_count,
                context_length,
                start: spec.layers.start,
                end: spec.layers.end,
                needed_mib: needed.div_ceil(1 << 20),
                available_mib: available >> 20,
            });
        }
        let lanes = (0..options.lane_count)
            .map(|_| Lane::new(&blocks, &config))
            .collect();
        Ok(Self {
            path,
            config,
            spec,
            context_length,
            embedding,
            blocks,
            head,
            lanes,
            #[cfg(test)]
            panic_next_pass: false,
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The part of the model this stage runs.
    pub fn spec(&self) -> &StageSpec {
        &self.spec
    }

    /// The activation width: f32 values per token crossing a stage boundary.
    pub fn width(&self) -> usize {
        self.config.embedding_length
    }

    /// The context limit of each lane.
    pub fn context_length(&self) -> usize {
        self.context_length
    }

    /// Lanes this stage has.
    pub fn lane_count(&self) -> usize {
        self.lanes.len()
    }

    /// Positions lane `lane` holds in its cache: where its next chunk starts.
    pub fn lane_length(&self, lane: usize) -> Result<usize, ModelError> {
        Ok(self.lane(lane)?.length)
    }

    /// Runs one chunk on `lane` starting at absolute `position`, which must equal the lane's length.
    /// A prefill is a chunk of many rows; a decode step is a chunk of one. The last stage returns the
    /// logit rows `logits` asks for; other stages return one activation row per input row.
    ///
    /// Cost: the weights are read once per chunk, so long chunks amortise them; attention needs
    /// `heads x rows x (position + rows)` f32 scores at once, so callers bound `rows` (a few hundred).
    /// It is [`Stage::forward_batch`] of one entry.
    pub fn forward(
        &mut self,
        lane: usize,
        position: usize,
        input: StageInput<'_>,
        logits: Logits,
    ) -> Result<StageOutput, ModelError> {
        let entry = BatchEntry {
            lane,
            position,
            input,
            logits,
        };
        self.forward_batch(std::slice::from_ref(&entry))
            .pop()
            .unwrap_or(Err(ModelError::EmptyChunk))
    }

    /// Runs one chunk for each entry, all in one pass: the rows of every entry go through each block
    /// together, so the weights are read once for the batch, while each entry's attention sees only its own
    /// lane's cache at its own positions. Returns one result per entry, in order.
    ///
    /// Every entry's result is bit-identical to running it alone with [`Stage::forward`] (every op outside
    /// attention works on each row by itself, and attention on each lane by itself), so batching changes
    /// speed, never tokens. An entry that is wrong on its own (lane out of range or named twice, position not
    /// the lane's length, wrong input, context full, a non-finite value) fails alone; the others run. Should
    /// the pass itself fail, or panic (a bug: every input is checked before it), every entry in it fails and
    /// no lane advances; the stage serves on.
    pub fn forward_batch(
        &mut self,
        entries: &[BatchEntry<'_>],
    ) -> Vec<Result<StageOutput, ModelError>> {
        // The products and attention split their rows over our compute pool, on the calling thread and the
        // pool's workers; inside one pass the workers spin between ops (each op reaches them at once) and park
        // as soon as the pass ends, so an idle stage leaves the cores to whatever runs next (on one host, the
        // next stage of the pipeline). Nothing in the pass uses rayon, so it runs on the caller's thread with no
        // hand-off.
        //
        // A panic is caught here, once for every caller (stage 0's shared stage, a stage process's compute
        // thread): unwinding further would end the thread that owns the stage, leaving its generations waiting
        // on a stage that computes nothing.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crate::kernels::ComputePool::global().pass(|| {
                // Inside the pass, so the test also unwinds through the pool's bookkeeping.
                #[cfg(test)]
                if std::mem::take(&mut self.panic_next_pass) {
                    panic!("a forward pass panicked, as the test asked");
                }
                self.forward_batch_in_pool(entries)
            })
        }))
        .unwrap_or_else(|_| {
            entries
                .iter()
                .map(|_| {
                    Err(ModelError::Compute(
                        "the forward pass panicked; every entry of its batch is failed".into(),
                    ))
                })
                .collect()
        })
    }

    /// [`Stage::forward_batch`] inside a pass of the compute pool.
    fn forward_batch_in_pool(
        &mut self,
        entries: &[BatchEntry<'_>],
    ) -> Vec<Result<StageOutput, ModelError>> {
        let mut results: Vec<Option<Result<StageOutput, ModelError>>> =
            entries.iter().map(|_| None).collect();
        let mut segments: Vec<Segment> = Vec::with_capacity(entries.len());
        let mut rows_in: Vec<Tensor> = Vec::with_capacity(entries.len());
        let mut offset = 0;
        for (index, entry) in entries.iter().enumerate() {
            let repeated = segments.iter().any(|segment| segment.lane == entry.lane);
            match self.admit(entry, repeated) {
                Ok(hidden) => {
                    let rows = match hidden.dim(0) {
                        Ok(rows) => rows,
                        Err(error) => {
                            results[index] = Some(Err(error.into()));
                            continue;
                        }
                    };
                    segments.push(Segment {
                        entry: index,
                        lane: entry.lane,
                        position: entry.position,
                        rows,
                        offset,
                        logits: entry.logits,
                    });
                    rows_in.push(hidden);
                    offset += rows;
                }
                Err(error) => results[index] = Some(Err(error)),
            }
        }
        if !segments.is_empty() {
            match self.run_segments(&segments, &rows_in) {
                Ok(outputs) => {
                    for (segment, output) in segments.iter().zip(outputs) {
                        if output.is_ok() {
                            self.lanes[segment.lane].length = segment.position + segment.rows;
                        }
                        results[segment.entry] = Some(output);
                    }
                }
                Err(error) => {
                    let message = error.to_string();
                    for segment in &segments {
                        results[segment.entry] = Some(Err(ModelError::Compute(message.clone())));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|result| result.unwrap_or(Err(ModelError::EmptyChunk)))
            .collect()
    }

    /// Checks one entry on its own and returns its input rows as `[rows, width]`.
    fn admit(&self, entry: &BatchEntry<'_>, repeated: bool) -> Result<Tensor, ModelError> {
        let lane = entry.lane;
        let length = self.lane(lane)?.length;
        if repeated {
            return Err(ModelError::Compute(format!(
                "lane {lane} appears twice in one batch; its chunks must run one after the other"
            )));
        }
        if entry.position != length {
            return Err(ModelError::PositionMismatch {
                lane,
                length,
                position: entry.position,
            });
        }
        let width = self.width();
        let hidden = match (&self.embedding, entry.input) {
            (Some(embedding), StageInput::Tokens(tokens)) => embedding.lookup(tokens)?,
            (None, StageInput::Activations(values)) => {
                if values.is_empty() {
                    return Err(ModelError::EmptyChunk);
                }
                if !values.len().is_multiple_of(width) {
                    return Err(ModelError::ActivationSize {
                        values: values.len(),
                        width,
                    });
                }
                if values.iter().any(|value| !value.is_finite()) {
                    // Refused before the cache sees it: the lane stays usable.
                    return Err(ModelError::NonFinite {
                        start: self.spec.layers.start,
                        end: self.spec.layers.end,
                        lane,
                    });
                }
                Tensor::from_slice(values, (values.len() / width, width), &Device::Cpu)?
            }
            (Some(_), StageInput::Activations(_)) => {
                return Err(ModelError::WrongInput {
                    expected: "token ids",
                });
            }
            (None, StageInput::Tokens(_)) => {
                return Err(ModelError::WrongInput {
                    expected: "activation rows",
                });
            }
        };
        let rows = hidden.dim(0)?;
        if entry.position + rows > self.context_length {
            return Err(ModelError::ContextOverflow {
                lane,
                position: entry.position,
                tokens: rows,
                context_length: self.context_length,
            });
        }
        Ok(hidden)
    }

    /// Runs the admitted segments through every block and the head; one result per segment. An `Err` of
    /// the whole is a failed pass; an `Err` inside is one segment's non-finite output. Lane lengths are
    /// left to the caller.
    fn run_segments(
        &mut self,
        segments: &[Segment],
        rows_in: &[Tensor],
    ) -> Result<Vec<Result<StageOutput, ModelError>>, ModelError> {
        let ropes = segments
            .iter()
            .map(|segment| {
                RopeTables::new(&self.config, &self.blocks, segment.position, segment.rows)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let total_rows: usize = segments.iter().map(|segment| segment.rows).sum();
        let mut hidden = if rows_in.len() == 1 {
            rows_in[0].flatten_all()?.to_vec1::<f32>()?
        } else {
            Tensor::cat(rows_in, 0)?.flatten_all()?.to_vec1::<f32>()?
        };
        // Each segment's lane's caches, taken out for the pass (the lanes are distinct) and put back after.
        let mut caches: Vec<Vec<LayerCache>> = segments
            .iter()
            .map(|segment| std::mem::take(&mut self.lanes[segment.lane].caches))
            .collect();
        let mut outcome = Ok(());
        for (layer, block) in self.blocks.iter().enumerate() {
            let mut layer_caches: Vec<&mut LayerCache> =
                caches.iter_mut().map(|lane| &mut lane[layer]).collect();
            match block.forward(
                &self.config,
                &hidden,
                total_rows,
                segments,
                &ropes,
                &mut layer_caches,
            ) {
                Ok(next) => hidden = next,
                Err(error) => {
                    outcome = Err(error);
                    break;
                }
            }
        }
        for (segment, lane_caches) in segments.iter().zip(caches) {
            self.lanes[segment.lane].caches = lane_caches;
        }
        outcome?;
        let width = self.width();
        let (start, end) = (self.spec.layers.start, self.spec.layers.end);
        let non_finite = |segment: &Segment| ModelError::NonFinite {
            start,
            end,
            lane: segment.lane,
        };
        let Some(head) = &self.head else {
            return Ok(segments
                .iter()
                .map(|segment| {
                    let rows = &hidden[segment.offset * width..][..segment.rows * width];
                    if rows.iter().all(|value| value.is_finite()) {
                        Ok(StageOutput::Activations(rows.to_vec()))
                    } else {
                        // The cache now holds poisoned keys and values; the session is unusable.
                        Err(non_finite(segment))
                    }
                })
                .collect());
        };
        // Only the rows each segment asks for go through the head; a bad value in a row not returned must still
        // be an error, because the quantised products downstream would read it as 0 and turn it into plausible
        // text.
        let mut hidden_finite = vec![true; segments.len()];
        if segments
            .iter()
            .any(|segment| segment.logits == Logits::Last && segment.rows > 1)
        {
            for (finite, segment) in hidden_finite.iter_mut().zip(segments) {
                *finite = hidden[segment.offset * width..][..segment.rows * width]
                    .iter()
                    .all(|value| value.is_finite());
            }
        }
        let mut normed = Vec::new();
        let mut wanted_rows = Vec::with_capacity(segments.len());
        for segment in segments {
            let (from, count) = match segment.logits {
                Logits::Last => (segment.offset + segment.rows - 1, 1),
                Logits::All => (segment.offset, segment.rows),
            };
            normed.extend_from_slice(&hidden[from * width..(from + count) * width]);
            wanted_rows.push(count);
        }
        let total: usize = wanted_rows.iter().sum();
        rms_norm_rows(&mut normed, &head.norm, self.config.rms_epsilon);
        let mut values = head.output.forward_rows(&normed, total)?;
        if let Some(cap) = self.config.final_logit_softcap {
            let logits =
                Tensor::from_vec(values, (total, head.output.out_features()), &Device::Cpu)?;
            values = ((logits / cap as f64)?.tanh()? * cap as f64)?
                .flatten_all()?
                .to_vec1::<f32>()?;
        }
        let vocab = values.len() / total.max(1);
        let mut from = 0;
        Ok(segments
            .iter()
            .zip(wanted_rows)
            .zip(hidden_finite)
            .map(|((segment, count), finite)| {
                let rows = &values[from * vocab..][..count * vocab];
                from += count;
                if finite && rows.iter().all(|value| value.is_finite()) {
                    Ok(StageOutput::Logits(rows.to_vec()))
                } else {
                    Err(non_finite(segment))
                }
            })
            .collect())
    }

    /// Cuts lane `lane` back to its first `length` positions, so the next chunk starts at `length`.
    ///
    /// Sliding-window layers keep only the last window of positions plus [`TRIM_SLACK`], so a lane can always be
    /// trimmed back by [`TRIM_SLACK`] positions, and to 0; a trim further back than its sliding-window layers still
    /// cover fails with [`ModelError::TrimBeyondWindow`] and leaves the lane as it was.
    pub fn trim(&mut self, lane: usize, length: usize) -> Result<(), ModelError> {
        self.check_trim(lane, length)?;
        if length == 0 {
            return self.reset(lane);
        }
        self.lanes[lane].length = length;
        Ok(())
    }

    /// Says whether [`Stage::trim`] of lane `lane` to `length` would succeed, changing nothing.
    ///
    /// A pipeline checks every stage before trimming any, so a refusal leaves all its stages as they were.
    pub fn check_trim(&self, lane: usize, length: usize) -> Result<(), ModelError> {
        let current = self.lane(lane)?.length;
        if length > current {
            return Err(ModelError::TrimBeyondEnd {
                lane,
                length: current,
                target: length,
            });
        }
        if length == 0 {
            return Ok(());
        }
        let earliest = self.lanes[lane]
            .caches
            .iter()
            .map(LayerCache::earliest_trim)
            .max()
            .unwrap_or(0);
        if length < earliest {
            return Err(ModelError::TrimBeyondWindow {
                lane,
                target: length,
                earliest,
            });
        }
        Ok(())
    }

    /// Empties lane `lane` and frees its cache memory.
    pub fn reset(&mut self, lane: usize) -> Result<(), ModelError> {
        self.lane(lane)?;
        self.lanes[lane] = Lane::new(&self.blocks, &self.config);
        Ok(())
    }

    /// How many positions each block's key and value buffers on lane `lane` have room for, in block order: the
    /// cache memory the lane holds is this times `2 x kv_heads x head_width x 2` bytes (f16) per block. Global layers
    /// grow with the session; sliding-window layers stay bounded (see [`TRIM_SLACK`]).
    pub fn lane_cache_capacity(&self, lane: usize) -> Result<Vec<usize>, ModelError> {
        Ok(self
            .lane(lane)?
            .caches
            .iter()
            .map(|cache| cache.capacity)
            .collect())
    }

    fn lane(&self, lane: usize) -> Result<&Lane, ModelError> {
        self.lanes.get(lane).ok_or(ModelError::LaneOutOfRange {
            lane,
            lane_count: self.lanes.len(),
        })
    }

    /// The file this stage was loaded from.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

/// How finely a block's products quantise their activations, by architecture (the output head's are always wide).
///
/// gemma-3 takes every product wide: with 8-bit activations (ggml's) its 18 layers amplify the rounding into an
/// argmax against llama.cpp's at a position llama.cpp calls confident (the agreement prompt "After the long
/// winter", position 28: llama.cpp's margin 0.26, the exact forward's 0.025, ours -0.012), and with every product
/// wide its logits sit within 2e-6 KL of the exact f64 forward (llama.cpp's: 2e-3 to 3e-3), at no cost to a decode
/// step, which its 262,144-row head dominates. SmolLM2's 8-bit products already agree with llama.cpp and sit
/// closer to the exact forward than llama.cpp does (`tests/exact_reference.rs`), and wide ones would cost its
/// prefill 8% and a batched step up to a fifth of its products' time (docs/PERFORMANCE.md, session 25); more
/// since session 26, when a block of 8-bit products became one integer converted once (a wide 128-row product
/// takes about 1.5x the 8-bit one's time).
fn block_precision(architecture: Architecture) -> ActivationPrecision {
    match architecture {
        Architecture::Gemma3 => ActivationPrecision::Wide,
        Architecture::Llama => ActivationPrecision::Byte,
    }
}

impl Block {
    fn load(file: &ModelFile, config: &ModelConfig, layer: usize) -> Result<Self, ModelError> {
        let name = |suffix: &str| format!("blk.{layer}.{suffix}.weight");
        let width = config.embedding_length;
        let query_width = config.head_count * config.key_length;
        let kv_width = config.head_count_kv * config.key_length;
        let gemma = config.architecture == Architecture::Gemma3;
        let precision = block_precision(config.architecture);
        let optional_vector = |suffix: &str, length: usize| {
            if gemma {
                load_norm(file, &name(suffix), length).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(Self {
            attention_norm: load_norm(file, &name("attn_norm"), width)?,
            attention_input: Projections::load(
                file,
                &[
                    (&name("attn_q"), query_width),
                    (&name("attn_k"), kv_width),
                    (&name("attn_v"), kv_width),
                ],
                width,
                precision,
            )?,
            output: load_linear(file, &name("attn_output"), query_width, width)?
                .with_activation_precision(precision),
            query_norm: optional_vector("attn_q_norm", config.key_length)?,
            key_norm: optional_vector("attn_k_norm", config.key_length)?,
            post_attention_norm: optional_vector("post_attention_norm", width)?,
            ffn_norm: load_norm(file, &name("ffn_norm"), width)?,
            ffn_input: Projections::load(
                file,
                &[
                    (&name("ffn_gate"), config.feed_forward_length),
                    (&name("ffn_up"), config.feed_forward_length),
                ],
                width,
                precision,
            )?,
            down: load_linear(file, &name("ffn_down"), config.feed_forward_length, width)?
                .with_activation_precision(precision),
            post_ffn_norm: optional_vector("post_ffw_norm", width)?,
            attention: config.layer_attention(layer),
        })
    }

    /// Runs the block over `hidden` (`[rows, width]`: the rows of every segment, in order). Each segment's rows
    /// are rotated at its own positions and attend over its own lane's cache of this block (`caches[i]` for
    /// `segments[i]`); every other op works on each row alone.
    ///
    /// Between the products the values stay plain `f32` slices: a decode step is about twenty small ops per
    /// block, and as candle tensors each cost an allocation and a dispatch that outweighed its arithmetic
    /// (0.45 ms of a 3.8 ms SmolLM2 step). Every op computes what the tensor version did, in the same order.
    fn forward(
        &self,
        config: &ModelConfig,
        hidden: &[f32],
        rows: usize,
        segments: &[Segment],
        ropes: &[RopeTables],
        caches: &mut [&mut LayerCache],
    ) -> Result<Vec<f32>, ModelError> {
        let epsilon = config.rms_epsilon;
        let heads = config.head_count;
        let kv_heads = config.head_count_kv;
        let head_width = config.key_length;

        let mut normed = hidden.to_vec();
        rms_norm_rows(&mut normed, &self.attention_norm, epsilon);
        let [mut query, mut key, value] = self.attention_input.forward_rows::<3>(&normed, rows)?;
        if let Some(norm) = &self.query_norm {
            rms_norm_rows(&mut query, norm, epsilon);
        }
        if let Some(norm) = &self.key_norm {
            rms_norm_rows(&mut key, norm, epsilon);
        }
        // Llama rotates adjacent pairs, gemma (NeoX style) the two halves of each head.
        let pairing = match config.architecture {
            Architecture::Llama => RopePairing::Adjacent,
            Architecture::Gemma3 => RopePairing::Halves,
        };
        let scale = match config.architecture {
            Architecture::Gemma3 => AttentionScale {
                query: config.attention_scale,
                score: 1.0,
            },
            Architecture::Llama => AttentionScale {
                query: 1.0,
                score: config.attention_scale,
            },
        };
        let mut attended = vec![0f32; rows * heads * head_width];
        let mut queries: Vec<Vec<f32>> = Vec::with_capacity(segments.len());
        for ((segment, rope), cache) in segments.iter().zip(ropes).zip(caches.iter_mut()) {
            let (cos, sin) = rope.tables(self.attention.rope_base);
            let mut segment_query = heads_first(&query, heads, head_width, segment);
            let mut segment_key = heads_first(&key, kv_heads, head_width, segment);
            let segment_value = heads_first(&value, kv_heads, head_width, segment);
            rotate_rows(
                &mut segment_query,
                segment.rows,
                head_width,
                cos,
                sin,
                pairing,
            );
            rotate_rows(
                &mut segment_key,
                segment.rows,
                head_width,
                cos,
                sin,
                pairing,
            );
            // Keys and values are rounded to f16 in the cache, as llama.cpp's default f16 KV cache stores them;
            // queries, scores and attention weights stay f32, as in its flash-attention kernel for prompt
            // batches (the evaluation the agreement fixtures come from). Rounding queries and weights to f16 as
            // well (its non-flash matmul path) moved gemma-3's logits by a few tenths against that reference.
            cache.append(&segment_key, &segment_value, segment.position, segment.rows)?;
            queries.push(segment_query);
        }
        // Every segment's head-rows in one job: a decode step's lanes are one row each, too little work to
        // split alone, and their attention ran on the calling thread one lane after another.
        let caches: Vec<&LayerCache> = caches.iter().map(|cache| &**cache).collect();
        attend(&queries, segments, heads, &caches, scale, &mut attended);
        let mut attention_out = self.output.forward_rows(&attended, rows)?;
        if let Some(norm) = &self.post_attention_norm {
            rms_norm_rows(&mut attention_out, norm, epsilon);
        }
        let mut hidden = hidden.to_vec();
        add_in_place(&mut hidden, &attention_out);

        let mut normed = hidden.clone();
        rms_norm_rows(&mut normed, &self.ffn_norm, epsilon);
        let [mut gate, up] = self.ffn_input.forward_rows::<2>(&normed, rows)?;
        match config.architecture {
            // candle's silu, element by element: x / (1 + e^-x).
            Architecture::Llama => gate.iter_mut().for_each(|x| *x = *x / (1.0 + (-*x).exp())),
            Architecture::Gemma3 => gelu_as_ggml_in_place(&mut gate),
        }
        gate.iter_mut().zip(&up).for_each(|(x, &u)| *x *= u);
        let mut ffn_out = self.down.forward_rows(&gate, rows)?;
        if let Some(norm) = &self.post_ffn_norm {
            rms_norm_rows(&mut ffn_out, norm, epsilon);
        }
        add_in_place(&mut hidden, &ffn_out);
        Ok(hidden)
    }
}

impl EmbeddingRows {
    fn open(file: &ModelFile, config: &ModelConfig) -> Result<Self, ModelError> {
        let name = "token_embd.weight";
        let (data_offset, dtype, dims) = file.tensor_location(name)?;
        let width = config.embedding_length;
        if dims != [config.vocab_size, width] || !width.is_multiple_of(dtype.block_size()) {
            return Err(ModelError::Tensor {
                path: file.path().to_path_buf(),
                tensor: name.to_string(),
                detail: format!("shape {dims:?} is not [vocab, {width}] in whole {dtype:?} blocks"),
            });
        }
        let handle = File::open(file.path()).map_err(|source| ModelError::Io {
            path: file.path().to_path_buf(),
            source,
        })?;
        Ok(Self {
            path: file.path().to_path_buf(),
            file: handle,
            data_offset,
            dtype,
            row_bytes: width / dtype.block_size() * dtype.type_size(),
            width,
            vocab_size: config.vocab_size,
            scale: (config.architecture == Architecture::Gemma3)
                .then(|| (width as f32).sqrt() as f64),
        })
    }

    /// The embedding rows of `tokens` as `[tokens, width]` f32.
    fn lookup(&self, tokens: &[u32]) -> Result<Tensor, ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::EmptyChunk);
        }
        let mut bytes = vec![0u8; tokens.len() * self.row_bytes];
        for (&token, row) in tokens.iter().zip(bytes.chunks_exact_mut(self.row_bytes)) {
            if token as usize >= self.vocab_size {
                return Err(ModelError::TokenOutOfRange {
                    token,
                    vocab_size: self.vocab_size,
                });
            }
            let offset = self.data_offset + token as u64 * self.row_bytes as u64;
            self.file
                .read_exact_at(row, offset)
                .map_err(|source| ModelError::Io {
                    path: self.path.clone(),
                    source,
                })?;
        }
        let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, self.dtype)?;
        let rows = QTensor::new(storage, (tokens.len(), self.width))?.dequantize(&Device::Cpu)?;
        Ok(match self.scale {
            Some(scale) => (rows * scale)?,
            None => rows,
        })
    }
}

/// The most bytes one lane's key/value caches over `blocks` take at `context_length` tokens: a global layer keeps
/// every position, a sliding-window layer its window, the trim slack and a prefill chunk (what `LayerCache::append`
/// keeps at most), each rounded up to whole growth chunks; keys and values in f16.
fn cache_bytes_at_most(blocks: &[Block], config: &ModelConfig, context_length: usize) -> u64 {
    let per_position = (config.head_count_kv * config.key_length * 2 * 2) as u64;
    blocks
        .iter()
        .map(|block| {
            let positions = block.attention.window.map_or(context_length, |window| {
                window
                    .saturating_add(TRIM_SLACK)
                    .saturating_add(super::PREFILL_CHUNK)
                    .min(context_length)
            });
            (positions.div_ceil(CACHE_CHUNK) * CACHE_CHUNK) as u64 * per_position
        })
        .fold(0u64, u64::saturating_add)
}

impl Lane {
    fn new(blocks: &[Block], config: &ModelConfig) -> Self {
        Self {
            length: 0,
            caches: blocks
                .iter()
                .map(|block| {
                    LayerCache::new(
                        block.attention.window,
                        config.head_count_kv,
                        config.key_length,
                    )
                })
                .collect(),
        }
    }
}

impl LayerCache {
    fn new(window: Option<usize>, kv_heads: usize, width: usize) -> Self {
        Self {
            keys: Vec::new(),
            values: Vec::new(),
            kv_heads,
            width,
            capacity: 0,
            start: 0,
            window,
        }
    }

    /// The first position a query at `position` can see.
    fn first_visible(&self, position: usize) -> usize {
        self.window
            .map_or(0, |window| (position + 1).saturating_sub(window))
    }

    /// The shortest non-zero length the lane can be trimmed to: the next query there must still see its whole
    /// window.
    fn earliest_trim(&self) -> usize {
        match self.window {
            Some(window) if self.start > 0 => self.start.saturating_add(window - 1),
            _ => 0,
        }
    }

    /// Writes `rows` new keys and values at `position`, each `[kv_heads][rows][width]`, rounded to f16 as
    /// llama.cpp's default f16 KV cache stores them.
    fn append(
        &mut self,
        key: &[f32],
        value: &[f32],
        position: usize,
        rows: usize,
    ) -> Result<(), ModelError> {
        let (kv_heads, width) = (self.kv_heads, self.width);
        let total = position + rows;
        let visible = self.first_visible(position);
        if visible < self.start {
            // Stage::trim refuses lengths that would need dropped positions, so this is a bug, not bad input.
            return Err(ModelError::Compute(format!(
                "the cache holds positions from {} but a chunk at {position} needs them from {visible}",
                self.start
            )));
        }
        if total - self.start > self.capacity {
            // Keep what later queries (and a trim of TRIM_SLACK) can still need; a global layer keeps all.
            let keep_from = match self.window {
                Some(window) => (position + 1)
                    .saturating_sub(window.saturating_add(TRIM_SLACK))
                    .max(self.start),
                None => self.start,
            };
            let capacity = (total - keep_from).div_ceil(CACHE_CHUNK) * CACHE_CHUNK;
            let kept = (position - keep_from) * width;
            let offset = keep_from - self.start;
            let mut keys = vec![0u16; kv_heads * capacity * width];
            let mut values = vec![0u16; kv_heads * capacity * width];
            for head in 0..kv_heads {
                let from = (head * self.capacity + offset) * width;
                let to = head * capacity * width;
                keys[to..to + kept].copy_from_slice(&self.keys[from..from + kept]);
                values[to..to + kept].copy_from_slice(&self.values[from..from + kept]);
            }
            self.keys = keys;
            self.values = values;
            self.capacity = capacity;
            self.start = keep_from;
        }
        for head in 0..kv_heads {
            let from = head * rows * width;
            let to = (head * self.capacity + position - self.start) * width;
            let count = rows * width;
            for (stored, &new) in self.keys[to..to + count]
                .iter_mut()
                .zip(&key[from..from + count])
            {
                *stored = half::f16::from_f32(new).to_bits();
            }
            for (stored, &new) in self.values[to..to + count]
                .iter_mut()
                .zip(&value[from..from + count])
            {
                *stored = half::f16::from_f32(new).to_bits();
            }
        }
        Ok(())
    }

    /// The rows of key head `head` at absolute positions `positions`, `width` f16 values each.
    fn keys(&self, head: usize, positions: Range<usize>) -> &[u16] {
        let from = (head * self.capacity + positions.start - self.start) * self.width;
        &self.keys[from..from + positions.len() * self.width]
    }

    /// The rows of value head `head` at absolute positions `positions`, `width` f16 values each.
    fn values(&self, head: usize, positions: Range<usize>) -> &[u16] {
        let from = (head * self.capacity + positions.start - self.start) * self.width;
        &self.values[from..from + positions.len() * self.width]
    }
}

/// cos/sin tables for the chunk's positions, `[rows][width / 2]`, one pair per RoPE base the stage uses.
struct RopeTables {
    tables: Vec<(f32, Vec<f32>, Vec<f32>)>,
}

impl RopeTables {
    /// The angles are computed as ggml computes them: in f32, pair `i`'s angle being pair `i - 1`'s times
    /// `base^(-2 / width)`, and the position scale applied to the angle. Exact angles (in f64) differ from
    /// llama.cpp's by about 1e-6 relative, which through the 8-bit activation quantisation downstream became
    /// visible noise in the logits; with these tables and [`rotate_rows`], gemma-3's rotated queries equal
    /// llama.cpp's bit for bit.
    fn new(
        config: &ModelConfig,
        blocks: &[Block],
        position: usize,
        rows: usize,
    ) -> Result<Self, ModelError> {
        let mut tables: Vec<(f32, Vec<f32>, Vec<f32>)> = Vec::new();
        let half = config.key_length / 2;
        for block in blocks {
            let base = block.attention.rope_base;
            if tables.iter().any(|(known, _, _)| *known == base) {
                continue;
            }
            let step = base.powf(-2.0 / config.key_length as f32);
            let mut cos = Vec::with_capacity(rows * half);
            let mut sin = Vec::with_capacity(rows * half);
            for row in 0..rows {
                let mut angle = (position + row) as f32;
                for _ in 0..half {
                    let scaled = config.rope_position_scale * angle;
                    cos.push(scaled.cos());
                    sin.push(scaled.sin());
                    angle *= step;
                }
            }
            tables.push((base, cos, sin));
        }
        Ok(Self { tables })
    }

    fn tables(&self, base: f32) -> (&[f32], &[f32]) {
        let entry = self
            .tables
            .iter()
            .find(|(known, _, _)| *known == base)
            .unwrap_or(&self.tables[0]);
        (&entry.1, &entry.2)
    }
}

/// Weight matrices over the same input. Consecutive matrices of one ggml type are stacked into one
/// matrix (their rows are independent blocks, so stacking the raw data is exact): one activation
/// quantization and one kernel call instead of several, which matters for small models' decode.
#[derive(Debug)]
struct Projections {
    /// Each stacked matrix and the output widths of the matrices it holds, in order.
    groups: Vec<(Linear, Vec<usize>)>,
}

impl Projections {
    /// Loads the members, stacking neighbours of one type, with activations quantised at `precision`.
    fn load(
        file: &ModelFile,
        members: &[(&str, usize)],
        in_features: usize,
        precision: ActivationPrecision,
    ) -> Result<Self, ModelError> {
        let mut pending: Vec<(QTensor, usize)> = Vec::new();
        let mut groups = Vec::new();
        for &(name, out_features) in members {
            let tensor = load_weight(file, name, in_features, out_features)?;
            if let Some((first, _)) = pending.first()
                && first.dtype() != tensor.dtype()
            {
                groups.push(stack(
                    file,
                    name,
                    std::mem::take(&mut pending),
                    in_features,
                )?);
            }
            pending.push((tensor, out_features));
        }
        let last = members.last().map_or("", |(name, _)| *name);
        if !pending.is_empty() {
            groups.push(stack(file, last, pending, in_features)?);
        }
        let groups = groups
            .into_iter()
            .map(|(linear, widths)| (linear.with_activation_precision(precision), widths))
            .collect();
        Ok(Self { groups })
    }

    /// The products of `input` (`rows` rows) with each member matrix, in the order they were given, each
    /// `[rows][its width]`.
    fn forward_rows<const N: usize>(
        &self,
        input: &[f32],
        rows: usize,
    ) -> Result<[Vec<f32>; N], ModelError> {
        let mut outputs = Vec::with_capacity(N);
        for (linear, widths) in &self.groups {
            let product = linear.forward_rows(input, rows)?;
            if widths.len() == 1 {
                outputs.push(product);
                continue;
            }
            // The stacked product is `[rows][sum of widths]`: each member takes its columns of every row.
            let total: usize = widths.iter().sum();
            let mut offset = 0;
            for &width in widths {
                let mut part = Vec::with_capacity(rows * width);
                for row in product.chunks_exact(total.max(1)) {
                    part.extend_from_slice(&row[offset..offset + width]);
                }
                outputs.push(part);
                offset += width;
            }
        }
        outputs.try_into().map_err(|outputs: Vec<Vec<f32>>| {
            ModelError::Compute(format!(
                "expected {N} projections, computed {}",
                outputs.len()
            ))
        })
    }
}

/// One linear layer from matrices of one type, stacked by rows.
fn stack(
    file: &ModelFile,
    name: &str,
    members: Vec<(QTensor, usize)>,
    in_features: usize,
) -> Result<(Linear, Vec<usize>), ModelError> {
    let widths: Vec<usize> = members.iter().map(|(_, width)| *width).collect();
    let tensor_error = |detail: String| ModelError::Tensor {
        path: file.path().to_path_buf(),
        tensor: name.to_string(),
        detail,
    };
    let tensor = if members.len() == 1 {
        members
            .into_iter()
            .next()
            .map(|(tensor, _)| tensor)
            .ok_or_else(|| tensor_error("no matrix to load".to_string()))?
    } else {
        let dtype = members[0].0.dtype();
        let mut bytes = Vec::new();
        for (tensor, _) in &members {
            bytes.extend_from_slice(&tensor.data()?);
        }
        drop(members);
        let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype)?;
        QTensor::new(storage, (widths.iter().sum::<usize>(), in_features))?
    };
    let linear = Linear::from_qtensor(tensor)
        .map_err(|error| tensor_error(super::error::candle_message(&error)))?;
    Ok((linear, widths))
}

/// Loads a norm vector as f32, checking its length.
fn load_vector(file: &ModelFile, name: &str, length: usize) -> Result<Tensor, ModelError> {
    let tensor = file.tensor(name)?;
    let dims = tensor.shape().dims().to_vec();
    if dims != [length] {
        return Err(ModelError::Tensor {
            path: file.path().to_path_buf(),
            tensor: name.to_string(),
            detail: format!("expected shape [{length}], found {dims:?}"),
        });
    }
    Ok(tensor.dequantize(&Device::Cpu)?.to_dtype(DType::F32)?)
}

/// Loads a norm vector as plain f32 values (what the blocks' slice-based ops take), checking its length.
fn load_norm(file: &ModelFile, name: &str, length: usize) -> Result<Vec<f32>, ModelError> {
    Ok(load_vector(file, name, length)?.to_vec1::<f32>()?)
}

/// Reads weight matrix `name`, checking that it is `[out_features, in_features]`.
fn load_weight(
    file: &ModelFile,
    name: &str,
    in_features: usize,
    out_features: usize,
) -> Result<QTensor, ModelError> {
    let tensor = file.tensor(name)?;
    let dims = tensor.shape().dims().to_vec();
    if dims != [out_features, in_features] {
        return Err(ModelError::Tensor {
            path: file.path().to_path_buf(),
            tensor: name.to_string(),
            detail: format!("expected shape [{out_features}, {in_features}], found {dims:?}"),
        });
    }
    Ok(tensor)
}

/// Loads a weight matrix `[out_features, in_features]` as a linear layer, checking its shape.
fn load_linear(
    file: &ModelFile,
    name: &str,
    in_features: usize,
    out_features: usize,
) -> Result<Linear, ModelError> {
    let tensor = load_weight(file, name, in_features, out_features)?;
    Linear::from_qtensor(tensor).map_err(|error| ModelError::Tensor {
        path: file.path().to_path_buf(),
        tensor: name.to_string(),
        detail: super::error::candle_message(&error),
    })
}
