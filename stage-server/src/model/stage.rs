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
use candle_core::{D, DType, Device, Tensor};

use super::config::LayerAttention;
use super::{Architecture, ModelConfig, ModelError, ModelFile};
use crate::kernels::Linear;

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
}

/// One transformer block's weights.
#[derive(Debug)]
struct Block {
    attention_norm: Tensor,
    /// Query, key and value projections (fused where their types match).
    attention_input: Projections,
    output: Linear,
    query_norm: Option<Tensor>,
    key_norm: Option<Tensor>,
    post_attention_norm: Option<Tensor>,
    ffn_norm: Tensor,
    /// Gate and up projections (fused where their types match).
    ffn_input: Projections,
    down: Linear,
    post_ffn_norm: Option<Tensor>,
    attention: LayerAttention,
}

/// The final norm and the output projection.
#[derive(Debug)]
struct Head {
    norm: Tensor,
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

/// Keys and values of one block, `[kv_heads, capacity, head_width]`, grown in chunks so appends rarely copy.
#[derive(Debug, Default)]
struct LayerCache {
    keys: Option<Tensor>,
    values: Option<Tensor>,
    capacity: usize,
}

/// The cache grows by whole chunks of this many positions.
const CACHE_CHUNK: usize = 256;

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
        let config = file.config().clone();
        let path = file.path().to_path_buf();
        if spec.layers.start >= spec.layers.end || spec.layers.end > config.block_count {
            return Err(ModelError::LayerRange {
                path,
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
                norm: load_vector(file, "output_norm.weight", config.embedding_length)?,
                output: load_linear(
                    file,
                    output_name,
                    config.embedding_length,
                    config.vocab_size,
                )?,
            })
        } else {
            None
        };
        let lanes = (0..options.lane_count)
            .map(|_| Lane::new(blocks.len()))
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
    pub fn forward(
        &mut self,
        lane: usize,
        position: usize,
        input: StageInput<'_>,
        logits: Logits,
    ) -> Result<StageOutput, ModelError> {
        // candle-nn's norms, softmax and RoPE and candle's f32 matmuls split their work with rayon. Called from
        // outside a rayon worker, each of them hands a job to the pool and sleeps until it is done: two context
        // switches per op, a few hundred per decoded token. Running the whole chunk on a worker of candle's pool
        // makes those calls run in place (idle workers still steal halves of large ops), for one hand-off per chunk.
        candle_core::utils::with_threadpool(|| self.forward_in_pool(lane, position, input, logits))
    }

    /// [`Stage::forward`] on a thread of candle's rayon pool.
    fn forward_in_pool(
        &mut self,
        lane: usize,
        position: usize,
        input: StageInput<'_>,
        logits: Logits,
    ) -> Result<StageOutput, ModelError> {
        let length = self.lane(lane)?.length;
        if position != length {
            return Err(ModelError::PositionMismatch {
                lane,
                length,
                position,
            });
        }
        let width = self.width();
        let hidden = match (&self.embedding, input) {
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
        if position + rows > self.context_length {
            return Err(ModelError::ContextOverflow {
                lane,
                position,
                tokens: rows,
                context_length: self.context_length,
            });
        }
        let rope = RopeTables::new(&self.config, &self.blocks, position, rows)?;
        let lane_state = &mut self.lanes[lane];
        let mut hidden = hidden;
        for (block, cache) in self.blocks.iter().zip(lane_state.caches.iter_mut()) {
            hidden = block.forward(&self.config, &hidden, position, &rope, cache)?;
        }
        lane_state.length = position + rows;
        let output = match &self.head {
            Some(head) => {
                let rows_wanted = match logits {
                    Logits::Last => hidden.narrow(0, rows - 1, 1)?,
                    Logits::All => hidden,
                };
                let normed =
                    candle_nn::ops::rms_norm(&rows_wanted, &head.norm, self.config.rms_epsilon)?;
                let mut values = head.output.forward(&normed)?;
                if let Some(cap) = self.config.final_logit_softcap {
                    values = ((values / cap as f64)?.tanh()? * cap as f64)?;
                }
                StageOutput::Logits(values.flatten_all()?.to_vec1::<f32>()?)
            }
            None => StageOutput::Activations(hidden.flatten_all()?.to_vec1::<f32>()?),
        };
        let values = match &output {
            StageOutput::Logits(values) | StageOutput::Activations(values) => values,
        };
        if values.iter().any(|value| !value.is_finite()) {
            // The cache now holds poisoned keys and values; the session is unusable.
            self.lanes[lane].length = position;
            return Err(ModelError::NonFinite {
                start: self.spec.layers.start,
                end: self.spec.layers.end,
                lane,
            });
        }
        Ok(output)
    }

    /// Cuts lane `lane` back to its first `length` positions, so the next chunk starts at `length`.
    pub fn trim(&mut self, lane: usize, length: usize) -> Result<(), ModelError> {
        let current = self.lane(lane)?.length;
        if length > current {
            return Err(ModelError::TrimBeyondEnd {
                lane,
                length: current,
                target: length,
            });
        }
        self.lanes[lane].length = length;
        Ok(())
    }

    /// Empties lane `lane` and frees its cache memory.
    pub fn reset(&mut self, lane: usize) -> Result<(), ModelError> {
        self.lane(lane)?;
        self.lanes[lane] = Lane::new(self.blocks.len());
        Ok(())
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

impl Block {
    fn load(file: &ModelFile, config: &ModelConfig, layer: usize) -> Result<Self, ModelError> {
        let name = |suffix: &str| format!("blk.{layer}.{suffix}.weight");
        let width = config.embedding_length;
        let query_width = config.head_count * config.key_length;
        let kv_width = config.head_count_kv * config.key_length;
        let gemma = config.architecture == Architecture::Gemma3;
        let optional_vector = |suffix: &str, length: usize| {
            if gemma {
                load_vector(file, &name(suffix), length).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(Self {
            attention_norm: load_vector(file, &name("attn_norm"), width)?,
            attention_input: Projections::load(
                file,
                &[
                    (&name("attn_q"), query_width),
                    (&name("attn_k"), kv_width),
                    (&name("attn_v"), kv_width),
                ],
                width,
            )?,
            output: load_linear(file, &name("attn_output"), query_width, width)?,
            query_norm: optional_vector("attn_q_norm", config.key_length)?,
            key_norm: optional_vector("attn_k_norm", config.key_length)?,
            post_attention_norm: optional_vector("post_attention_norm", width)?,
            ffn_norm: load_vector(file, &name("ffn_norm"), width)?,
            ffn_input: Projections::load(
                file,
                &[
                    (&name("ffn_gate"), config.feed_forward_length),
                    (&name("ffn_up"), config.feed_forward_length),
                ],
                width,
            )?,
            down: load_linear(file, &name("ffn_down"), config.feed_forward_length, width)?,
            post_ffn_norm: optional_vector("post_ffw_norm", width)?,
            attention: config.layer_attention(layer),
        })
    }

    /// Runs the block over `hidden` (`[rows, width]`) whose first row is at absolute `position`.
    fn forward(
        &self,
        config: &ModelConfig,
        hidden: &Tensor,
        position: usize,
        rope: &RopeTables,
        cache: &mut LayerCache,
    ) -> Result<Tensor, ModelError> {
        let epsilon = config.rms_epsilon;
        let rows = hidden.dim(0)?;
        let heads = config.head_count;
        let kv_heads = config.head_count_kv;
        let head_width = config.key_length;
        let group = heads / kv_heads;

        let normed = candle_nn::ops::rms_norm(hidden, &self.attention_norm, epsilon)?;
        let [query, key, value] = self.attention_input.forward::<3>(&normed)?;
        let mut query = query.reshape((rows, heads, head_width))?;
        let mut key = key.reshape((rows, kv_heads, head_width))?;
        let value = value.reshape((rows, kv_heads, head_width))?;
        if let Some(norm) = &self.query_norm {
            query = candle_nn::ops::rms_norm(&query, norm, epsilon)?;
        }
        if let Some(norm) = &self.key_norm {
            key = candle_nn::ops::rms_norm(&key, norm, epsilon)?;
        }
        // [rows, heads, width] -> [1, heads, rows, width] for the RoPE kernels.
        let query = query.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        let key = key.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        let value = value.transpose(0, 1)?.contiguous()?;
        let (cos, sin) = rope.tables(self.attention.rope_base);
        let (query, key) = match config.architecture {
            Architecture::Llama => (
                candle_nn::rotary_emb::rope_i(&query, cos, sin)?,
                candle_nn::rotary_emb::rope_i(&key, cos, sin)?,
            ),
            Architecture::Gemma3 => (
                candle_nn::rotary_emb::rope(&query, cos, sin)?,
                candle_nn::rotary_emb::rope(&key, cos, sin)?,
            ),
        };
        // Keys, values, queries and attention weights are rounded to f16 as llama.cpp's default f16
        // KV cache does (its matmuls convert the other operand to f16 too); this keeps our logits
        // within its noise instead of drifting with head width.
        let key = round_to_half(&key.squeeze(0)?)?;
        let value = round_to_half(&value)?;
        let (keys, values) = cache.append(&key, &value, position)?;
        let total = position + rows;
        // Query heads h*group..(h+1)*group share key head h: fold them into one matrix per key head
        // so the cached keys and values are used in place, never repeated.
        let query = query.reshape((kv_heads, group * rows, head_width))?;
        let scores = match config.architecture {
            // Gemma scales the queries before the product, llama the scores after it.
            Architecture::Gemma3 => {
                round_to_half(&(query * config.attention_scale as f64)?)?.matmul(&keys.t()?)?
            }
            Architecture::Llama => {
                (round_to_half(&query)?.matmul(&keys.t()?)? * config.attention_scale as f64)?
            }
        };
        let scores = match attention_mask(rows, group, position, total, self.attention.window)? {
            Some(mask) => scores.broadcast_add(&mask)?,
            None => scores,
        };
        let probabilities = round_to_half(&candle_nn::ops::softmax_last_dim(&scores)?)?;
        let attended = probabilities
            .matmul(&values)?
            .reshape((heads, rows, head_width))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((rows, heads * head_width))?;
        let mut attention_out = self.output.forward(&attended)?;
        if let Some(norm) = &self.post_attention_norm {
            attention_out = candle_nn::ops::rms_norm(&attention_out, norm, epsilon)?;
        }
        let hidden = (hidden + attention_out)?;

        let normed = candle_nn::ops::rms_norm(&hidden, &self.ffn_norm, epsilon)?;
        let [gate, up] = self.ffn_input.forward::<2>(&normed)?;
        let activated = match config.architecture {
            Architecture::Llama => candle_nn::ops::silu(&gate)?,
            // llama.cpp's CPU GELU reads a table indexed by the f16 input and holding f16 outputs.
            Architecture::Gemma3 => round_to_half(&round_to_half(&gate)?.gelu()?)?,
        };
        let mixed = (activated * up)?;
        let mut ffn_out = self.down.forward(&mixed)?;
        if let Some(norm) = &self.post_ffn_norm {
            ffn_out = candle_nn::ops::rms_norm(&ffn_out, norm, epsilon)?;
        }
        Ok((hidden + ffn_out)?)
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

impl Lane {
    fn new(blocks: usize) -> Self {
        Self {
            length: 0,
            caches: (0..blocks).map(|_| LayerCache::default()).collect(),
        }
    }
}

impl LayerCache {
    /// Writes `key` and `value` (`[kv_heads, rows, width]`) at `position` and returns views of every
    /// cached position up to and including them.
    fn append(
        &mut self,
        key: &Tensor,
        value: &Tensor,
        position: usize,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let (kv_heads, rows, width) = key.dims3()?;
        let total = position + rows;
        if total > self.capacity || self.keys.is_none() {
            let capacity = total.div_ceil(CACHE_CHUNK) * CACHE_CHUNK;
            let grow = |old: &Option<Tensor>| -> candle_core::Result<Tensor> {
                let fresh = Tensor::zeros((kv_heads, capacity, width), DType::F32, &Device::Cpu)?;
                if let Some(old) = old
                    && position > 0
                {
                    fresh.slice_set(&old.narrow(1, 0, position)?.contiguous()?, 1, 0)?;
                }
                Ok(fresh)
            };
            self.keys = Some(grow(&self.keys)?);
            self.values = Some(grow(&self.values)?);
            self.capacity = capacity;
        }
        let (Some(keys), Some(values)) = (&self.keys, &self.values) else {
            unreachable!("the cache was allocated above");
        };
        keys.slice_set(key, 1, position)?;
        values.slice_set(value, 1, position)?;
        Ok((keys.narrow(1, 0, total)?, values.narrow(1, 0, total)?))
    }
}

/// cos/sin tables for the chunk's positions, one pair per RoPE base the stage uses.
struct RopeTables {
    tables: Vec<(f32, Tensor, Tensor)>,
}

impl RopeTables {
    fn new(
        config: &ModelConfig,
        blocks: &[Block],
        position: usize,
        rows: usize,
    ) -> Result<Self, ModelError> {
        let mut tables: Vec<(f32, Tensor, Tensor)> = Vec::new();
        let half = config.key_length / 2;
        for block in blocks {
            let base = block.attention.rope_base;
            if tables.iter().any(|(known, _, _)| *known == base) {
                continue;
            }
            let mut cos = Vec::with_capacity(rows * half);
            let mut sin = Vec::with_capacity(rows * half);
            for row in 0..rows {
                let scaled = (position + row) as f64 * config.rope_position_scale as f64;
                for pair in 0..half {
                    let frequency =
                        (base as f64).powf(-2.0 * pair as f64 / config.key_length as f64);
                    let angle = scaled * frequency;
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
            tables.push((
                base,
                Tensor::from_vec(cos, (rows, half), &Device::Cpu)?,
                Tensor::from_vec(sin, (rows, half), &Device::Cpu)?,
            ));
        }
        Ok(Self { tables })
    }

    fn tables(&self, base: f32) -> (&Tensor, &Tensor) {
        let entry = self
            .tables
            .iter()
            .find(|(known, _, _)| *known == base)
            .unwrap_or(&self.tables[0]);
        (&entry.1, &entry.2)
    }
}

/// The additive mask for `rows` queries at `position..` (repeated for `group` heads) over `total` keys,
/// or `None` when every query sees every key.
fn attention_mask(
    rows: usize,
    group: usize,
    position: usize,
    total: usize,
    window: Option<usize>,
) -> Result<Option<Tensor>, ModelError> {
    let windowed = window.is_some_and(|window| total > window);
    if rows == 1 && !windowed {
        return Ok(None);
    }
    let mut mask = Vec::with_capacity(group * rows * total);
    for _ in 0..group {
        for row in 0..rows {
            let query_position = position + row;
            for key_position in 0..total {
                let visible = key_position <= query_position
                    && window.is_none_or(|window| query_position - key_position < window);
                mask.push(if visible { 0.0 } else { f32::NEG_INFINITY });
            }
        }
    }
    Ok(Some(Tensor::from_vec(
        mask,
        (group * rows, total),
        &Device::Cpu,
    )?))
}

/// `values` rounded to the nearest f16 and back to f32.
fn round_to_half(values: &Tensor) -> candle_core::Result<Tensor> {
    values.to_dtype(DType::F16)?.to_dtype(DType::F32)
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
    fn load(
        file: &ModelFile,
        members: &[(&str, usize)],
        in_features: usize,
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
        Ok(Self { groups })
    }

    /// The products of `input` with each member matrix, in the order they were given.
    fn forward<const N: usize>(&self, input: &Tensor) -> Result<[Tensor; N], ModelError> {
        let mut outputs = Vec::with_capacity(N);
        for (linear, widths) in &self.groups {
            let product = linear.forward(input)?;
            if widths.len() == 1 {
                outputs.push(product);
                continue;
            }
            let mut offset = 0;
            for &width in widths {
                outputs.push(product.narrow(D::Minus1, offset, width)?.contiguous()?);
                offset += width;
            }
        }
        outputs.try_into().map_err(|outputs: Vec<Tensor>| {
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
