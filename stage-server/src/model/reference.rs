//! An exact forward pass in f64 for `llama` and `gemma3`: a slow test oracle that engines are measured against.
//!
//! Two engines that each sit at the noise floor of 8-bit activation quantisation and an f16 KV cache can differ
//! from each other by the sum of their errors, so the KL between two engines says little about either
//! (`shared/reference/models.md` section 6). The yardstick is each engine's distance to the model the file
//! actually describes: its weights dequantised, and everything after that computed in real arithmetic. This
//! module computes that model as closely as f64 allows.
//!
//! What is exact and what is not:
//! - Weights: every tensor is dequantised by candle's `QTensor::dequantize` to f32 and widened to f64. For the
//!   block formats of the real models (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) each value is a small integer times an f16
//!   scale (plus an f16 offset), which f32 holds exactly or within one rounding of 6e-8 relative.
//! - Activations are never quantised and never rounded below f64: no 8-bit activation blocks, no f16 keys and
//!   values, no f16 GELU table. RMS norms, RoPE (angles `position * scale * base^(-2i / width)` straight in f64,
//!   not ggml's running f32 product), the attention softmax and the feed-forward activations are all f64.
//! - Matrix products are plain f64 sums written here (`multiply`), unrelated to the quantised kernels of
//!   the serving path; an f64 sum of a few thousand terms is exact to about 1e-15 relative.
//!
//! The model semantics follow llama.cpp's graphs (`llama`: RMS norm, GQA attention with adjacent-pair RoPE,
//! SwiGLU; `gemma3`: embeddings times sqrt(width), Q/K RMS norms per head, half-split RoPE, post-attention and
//! post-feed-forward norms, GELU in its tanh form, sliding-window layers with their own RoPE base, an optional
//! final logit softcap) and take every hyper-parameter from [`ModelConfig`], the same reading the serving path
//! uses, so a disagreement is arithmetic, never a different model.
//!
//! Cost: it runs one whole sequence at once and reads and dequantises the weights on each call, one matrix at a
//! time, so besides the activations it holds one matrix (as read, in f32 and in f64: 10 MB in f64 for
//! gemma-3-270m's largest layer matrix). The output head (gemma-3-270m's is 262,144 x 640, 1.3 GB in f64) is
//! never materialised: it is read from the file and dequantised [`HEAD_CHUNK_ROWS`] rows at a time, each chunk
//! multiplied in f64 storage with f64 sums. The result is f64 logits, `positions x vocabulary` (195 MB for 93
//! positions of gemma-3's vocabulary). Time is the matrix products, about `positions x parameters` f64
//! multiply-adds on two threads: in the test profile on the shared 2-core dev box, about 2 s for an 80-token
//! SmolLM2-135M stream and 6 s for gemma-3-270m, whose 168M-value head is most of it.

use std::borrow::Cow;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

use candle_core::quantized::{QStorage, QTensor};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::{Architecture, ModelConfig, ModelError, ModelFile};

/// Rows of the output matrix dequantised at a time: 8,192 rows of gemma-3's 640 columns are 42 MB in f64.
pub const HEAD_CHUNK_ROWS: usize = 8192;

/// A model file opened for the exact forward pass ([`ExactModel::forward`]).
#[derive(Debug)]
pub struct ExactModel {
    file: ModelFile,
    /// A handle for reading rows of the embedding and output matrices by offset.
    handle: File,
    /// `output.weight`, or `token_embd.weight` when the head is tied to the embeddings.
    output_name: &'static str,
}

/// The logits of every position of a sequence, in f64: row `i` predicts the token after position `i`.
#[derive(Clone, Debug, PartialEq)]
pub struct ExactLogits {
    vocab_size: usize,
    values: Vec<f64>,
}

/// Which elements of a head RoPE rotates together.
#[derive(Clone, Copy, Debug)]
enum RopePairing {
    /// Elements `2i` and `2i + 1` (llama.cpp's normal RoPE, used by `llama`).
    Adjacent,
    /// Elements `i` and `i + width / 2` (NeoX style, used by `gemma3`).
    Halves,
}

impl ExactModel {
    /// Opens the model at `path`, reading its header and metadata (the weights are read by each forward pass).
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::from_file(ModelFile::open(path)?)
    }

    /// Wraps an open model file.
    pub fn from_file(file: ModelFile) -> Result<Self, ModelError> {
        let config = file.config();
        let widths = [
            ("embedding_length", config.embedding_length),
            ("feed_forward_length", config.feed_forward_length),
            ("block_count", config.block_count),
            ("vocabulary", config.vocab_size),
        ];
        if let Some((key, _)) = widths.iter().find(|(_, value)| *value == 0) {
            return Err(ModelError::UnsupportedShape {
                path: file.path().to_path_buf(),
                detail: format!("the model's {key} is 0, so there is nothing to compute"),
            });
        }
        if config.sliding_window == Some(0) {
            return Err(ModelError::UnsupportedShape {
                path: file.path().to_path_buf(),
                detail: "the metadata's `attention.sliding_window` is 0: a sliding-window layer would see no \
                         position, not even its own"
                    .to_string(),
            });
        }
        let handle = File::open(file.path()).map_err(|source| ModelError::Io {
            path: file.path().to_path_buf(),
            source,
        })?;
        let output_name = if file.has_tensor("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        Ok(Self {
            file,
            handle,
            output_name,
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        self.file.config()
    }

    /// The logits of every position of `tokens`, computed from position 0 in one pass (no cache, no chunks).
    ///
    /// Cost: about `tokens x parameters` f64 multiply-adds and `tokens x vocabulary x 8` bytes for the result;
    /// attention is quadratic in `tokens`. The model's context length is not enforced: the exact model has no
    /// cache to run out of.
    pub fn forward(&self, tokens: &[u32]) -> Result<ExactLogits, ModelError> {
        let config = self.config();
        if tokens.is_empty() {
            return Err(ModelError::EmptyChunk);
        }
        let rows = tokens.len();
        let width = config.embedding_length;
        let mut hidden = self.embeddings(tokens)?;
        for layer in 0..config.block_count {
            self.block(layer, &mut hidden, rows)?;
        }
        let epsilon = f64::from(config.rms_epsilon);
        let norm = self.vector("output_norm.weight", width)?;
        let normed = rms_norm(&hidden, &norm, epsilon);
        let mut values = self.head(&normed, rows)?;
        if let Some(cap) = config.final_logit_softcap {
            let cap = f64::from(cap);
            values
                .iter_mut()
                .for_each(|logit| *logit = cap * (*logit / cap).tanh());
        }
        Ok(ExactLogits {
            vocab_size: config.vocab_size,
            values,
        })
    }

    /// One transformer block over `hidden` (`rows x width`), in place.
    fn block(&self, layer: usize, hidden: &mut [f64], rows: usize) -> Result<(), ModelError> {
        let config = self.config();
        let name = |suffix: &str| format!("blk.{layer}.{suffix}.weight");
        let width = config.embedding_length;
        let heads = config.head_count;
        let kv_heads = config.head_count_kv;
        let head_width = config.key_length;
        let epsilon = f64::from(config.rms_epsilon);
        let gemma = config.architecture == Architecture::Gemma3;
        let attention = config.layer_attention(layer);

        let normed = rms_norm(hidden, &self.vector(&name("attn_norm"), width)?, epsilon);
        let mut query = self.product(&normed, rows, &name("attn_q"), heads * head_width, width)?;
        let mut key = self.product(&normed, rows, &name("attn_k"), kv_heads * head_width, width)?;
        let value = self.product(&normed, rows, &name("attn_v"), kv_heads * head_width, width)?;
        if gemma {
            // Per head: the norm vector has one head's width, and each head's slice is normed on its own.
            query = rms_norm(
                &query,
                &self.vector(&name("attn_q_norm"), head_width)?,
                epsilon,
            );
            key = rms_norm(
                &key,
                &self.vector(&name("attn_k_norm"), head_width)?,
                epsilon,
            );
        }
        let pairing = match config.architecture {
            Architecture::Llama => RopePairing::Adjacent,
            Architecture::Gemma3 => RopePairing::Halves,
        };
        let base = f64::from(attention.rope_base);
        let position_scale = f64::from(config.rope_position_scale);
        rope(&mut query, head_width, heads, base, position_scale, pairing);
        rope(
            &mut key,
            head_width,
            kv_heads,
            base,
            position_scale,
            pairing,
        );
        let attended = attend(
            &query,
            &key,
            &value,
            rows,
            heads,
            kv_heads,
            head_width,
            attention.window,
            f64::from(config.attention_scale),
        );
        let mut attention_out = self.product(
            &attended,
            rows,
            &name("attn_output"),
            width,
            heads * head_width,
        )?;
        if gemma {
            let norm = self.vector(&name("post_attention_norm"), width)?;
            attention_out = rms_norm(&attention_out, &norm, epsilon);
        }
        hidden
            .iter_mut()
            .zip(&attention_out)
            .for_each(|(value, added)| *value += added);

        let feed_forward = config.feed_forward_length;
        let normed = rms_norm(hidden, &self.vector(&name("ffn_norm"), width)?, epsilon);
        let gate = self.product(&normed, rows, &name("ffn_gate"), feed_forward, width)?;
        let up = self.product(&normed, rows, &name("ffn_up"), feed_forward, width)?;
        let mixed: Vec<f64> = gate
            .iter()
            .zip(&up)
            .map(|(&gate, &up)| {
                let activated = match config.architecture {
                    Architecture::Llama => silu(gate),
                    Architecture::Gemma3 => gelu_tanh(gate),
                };
                activated * up
            })
            .collect();
        let mut feed_forward_out =
            self.product(&mixed, rows, &name("ffn_down"), width, feed_forward)?;
        if gemma {
            let norm = self.vector(&name("post_ffw_norm"), width)?;
            feed_forward_out = rms_norm(&feed_forward_out, &norm, epsilon);
        }
        hidden
            .iter_mut()
            .zip(&feed_forward_out)
            .for_each(|(value, added)| *value += added);
        Ok(())
    }

    /// The embedding rows of `tokens` (`tokens x width`), times sqrt(width) for gemma3.
    fn embeddings(&self, tokens: &[u32]) -> Result<Vec<f64>, ModelError> {
        let config = self.config();
        let width = config.embedding_length;
        let scale = match config.architecture {
            Architecture::Gemma3 => (width as f64).sqrt(),
            Architecture::Llama => 1.0,
        };
        let mut hidden = Vec::with_capacity(tokens.len() * width);
        for &token in tokens {
            let row = token as usize;
            if row >= config.vocab_size {
                return Err(ModelError::TokenOutOfRange {
                    token,
                    vocab_size: config.vocab_size,
                });
            }
            let values = self.matrix_rows("token_embd.weight", row..row + 1, width)?;
            hidden.extend(values.iter().map(|value| value * scale));
        }
        Ok(hidden)
    }

    /// `normed` (`rows x width`) times the output matrix, `rows x vocabulary`, reading the matrix
    /// [`HEAD_CHUNK_ROWS`] rows at a time.
    fn head(&self, normed: &[f64], rows: usize) -> Result<Vec<f64>, ModelError> {
        let config = self.config();
        let (width, vocab) = (config.embedding_length, config.vocab_size);
        let mut logits = vec![0f64; rows * vocab];
        let mut start = 0;
        while start < vocab {
            let end = (start + HEAD_CHUNK_ROWS).min(vocab);
            let weight = self.matrix_rows(self.output_name, start..end, width)?;
            let product = multiply(normed, rows, &weight, width);
            for (row, part) in product.chunks_exact(end - start).enumerate() {
                logits[row * vocab + start..row * vocab + end].copy_from_slice(part);
            }
            start = end;
        }
        Ok(logits)
    }

    /// `input` (`rows x in_features`) times the transpose of matrix `name` (`out_features x in_features`).
    fn product(
        &self,
        input: &[f64],
        rows: usize,
        name: &str,
        out_features: usize,
        in_features: usize,
    ) -> Result<Vec<f64>, ModelError> {
        let tensor = self.file.tensor(name)?;
        let dims = tensor.shape().dims().to_vec();
        if dims != [out_features, in_features] {
            return Err(self.shape_error(
                name,
                format!("expected shape [{out_features}, {in_features}], found {dims:?}"),
            ));
        }
        let weight = widen(&tensor.dequantize(&Device::Cpu)?)?;
        Ok(multiply(input, rows, &weight, in_features))
    }

    /// A vector (a norm's weights) of `length` values.
    fn vector(&self, name: &str, length: usize) -> Result<Vec<f64>, ModelError> {
        let tensor = self.file.tensor(name)?;
        let dims = tensor.shape().dims().to_vec();
        if dims != [length] {
            return Err(
                self.shape_error(name, format!("expected shape [{length}], found {dims:?}"))
            );
        }
        widen(&tensor.dequantize(&Device::Cpu)?)
    }

    /// Rows `rows` of matrix `name` (`vocabulary x width`, the embedding or output matrix), dequantised, read
    /// from the file by offset so the rest of the matrix is never loaded.
    fn matrix_rows(
        &self,
        name: &str,
        rows: Range<usize>,
        width: usize,
    ) -> Result<Vec<f64>, ModelError> {
        let (data_offset, dtype, dims) = self.file.tensor_location(name)?;
        let vocab = self.config().vocab_size;
        if dims != [vocab, width] || !width.is_multiple_of(dtype.block_size()) {
            return Err(self.shape_error(
                name,
                format!("shape {dims:?} is not [{vocab}, {width}] in whole {dtype:?} blocks"),
            ));
        }
        let row_bytes = width / dtype.block_size() * dtype.type_size();
        let mut bytes = vec![0u8; rows.len() * row_bytes];
        // ModelFile::open checked that every tensor lies inside the file, so these offsets cannot overflow.
        let offset = data_offset + (rows.start * row_bytes) as u64;
        self.handle
            .read_exact_at(&mut bytes, offset)
            .map_err(|source| ModelError::Io {
                path: self.file.path().to_path_buf(),
                source,
            })?;
        let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype)?;
        widen(&QTensor::new(storage, (rows.len(), width))?.dequantize(&Device::Cpu)?)
    }

    fn shape_error(&self, name: &str, detail: String) -> ModelError {
        ModelError::Tensor {
            path: self.file.path().to_path_buf(),
            tensor: name.to_string(),
            detail,
        }
    }
}

impl ExactLogits {
    /// Positions (rows of logits).
    pub fn positions(&self) -> usize {
        self.values.len() / self.vocab_size.max(1)
    }

    /// Logits per row.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The logits of position `position`, if there is one.
    pub fn row(&self, position: usize) -> Option<&[f64]> {
        self.values
            .get(position * self.vocab_size..(position + 1) * self.vocab_size)
    }

    /// Every row, in position order.
    pub fn rows(&self) -> std::slice::ChunksExact<'_, f64> {
        self.values.chunks_exact(self.vocab_size.max(1))
    }

    /// All values, `positions x vocab_size`, row-major.
    pub fn values(&self) -> &[f64] {
        &self.values
    }
}

/// The RMS norm of each `weight.len()`-wide row of `values`, times `weight`: `x / sqrt(mean(x^2) + epsilon) * w`.
fn rms_norm(values: &[f64], weight: &[f64], epsilon: f64) -> Vec<f64> {
    let width = weight.len();
    let mut output = Vec::with_capacity(values.len());
    for row in values.chunks_exact(width) {
        let mean = row.iter().map(|x| x * x).sum::<f64>() / width as f64;
        let inverse = 1.0 / (mean + epsilon).sqrt();
        output.extend(row.iter().zip(weight).map(|(x, w)| x * inverse * w));
    }
    output
}

/// Rotates every head of every row of `values` (`rows x heads x width`, row `r` at position `r`) by the angles
/// `position * position_scale * base^(-2i / width)` of its pairs `i`, computed directly in f64.
fn rope(
    values: &mut [f64],
    width: usize,
    heads: usize,
    base: f64,
    position_scale: f64,
    pairing: RopePairing,
) {
    let half = width / 2;
    let frequencies: Vec<f64> = (0..half)
        .map(|pair| base.powf(-2.0 * pair as f64 / width as f64))
        .collect();
    for (row_index, row) in values.chunks_exact_mut(heads * width).enumerate() {
        let position = row_index as f64 * position_scale;
        let angles: Vec<(f64, f64)> = frequencies
            .iter()
            .map(|frequency| (position * frequency).sin_cos())
            .collect();
        for head in row.chunks_exact_mut(width) {
            for (pair, &(sin, cos)) in angles.iter().enumerate() {
                let (first, second) = match pairing {
                    RopePairing::Adjacent => (2 * pair, 2 * pair + 1),
                    RopePairing::Halves => (pair, pair + half),
                };
                let (x0, x1) = (head[first], head[second]);
                head[first] = x0 * cos - x1 * sin;
                head[second] = x0 * sin + x1 * cos;
            }
        }
    }
}

/// Causal attention of every row over the rows up to it (within `window` of it, for a sliding-window layer),
/// `rows x heads x width` out. Query head `h` reads key/value head `h / (heads / kv_heads)`, as ggml broadcasts
/// them. The scale multiplies the scores; gemma3 (which llama.cpp scales through its queries) is the same model.
#[allow(clippy::too_many_arguments)]
fn attend(
    query: &[f64],
    key: &[f64],
    value: &[f64],
    rows: usize,
    heads: usize,
    kv_heads: usize,
    width: usize,
    window: Option<usize>,
    scale: f64,
) -> Vec<f64> {
    let group = heads / kv_heads;
    let mut output = vec![0f64; rows * heads * width];
    let mut weights = Vec::with_capacity(rows);
    for row in 0..rows {
        // As llama.cpp's standard sliding window: key position p is visible from row r when r - p < window.
        let first = window.map_or(0, |window| (row + 1).saturating_sub(window));
        for head in 0..heads {
            let kv_head = head / group;
            let q = &query[(row * heads + head) * width..][..width];
            weights.clear();
            weights.extend((first..=row).map(|position| {
                let k = &key[(position * kv_heads + kv_head) * width..][..width];
                scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>()
            }));
            let maximum = weights.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut sum = 0.0;
            for weight in &mut weights {
                *weight = (*weight - maximum).exp();
                sum += *weight;
            }
            let out = &mut output[(row * heads + head) * width..][..width];
            for (position, weight) in (first..=row).zip(&weights) {
                let v = &value[(position * kv_heads + kv_head) * width..][..width];
                for (accumulated, v) in out.iter_mut().zip(v) {
                    *accumulated += weight / sum * v;
                }
            }
        }
    }
    output
}

/// A dequantised tensor's values, widened from f32 to f64 (exactly).
fn widen(tensor: &Tensor) -> Result<Vec<f64>, ModelError> {
    Ok(tensor
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f64::from)
        .collect())
}

/// `input` (`rows x inner`) times the transpose of `weight` (`features x inner`): `rows x features`, in f64.
///
/// Each output is one fixed-order sum over `inner` (so the result does not depend on the thread count), written
/// as running `y += x * w` updates across [`BLOCK_COLUMNS`] outputs at once, the form the compiler turns into
/// vector instructions at the test profile's optimisation level (a dot-product loop stayed scalar there, and
/// candle's own f64 product, whose `gemm-f64` kernels are built without optimisation in that profile, was a
/// hundred times slower). Blocks of output columns run on rayon's threads.
fn multiply(input: &[f64], rows: usize, weight: &[f64], inner: usize) -> Vec<f64> {
    let features = weight.len() / inner.max(1);
    let mut output = vec![0f64; rows * features];
    if rows == 0 || inner == 0 || features == 0 {
        return output;
    }
    let blocks: Vec<Vec<f64>> = weight
        .par_chunks(inner * BLOCK_COLUMNS)
        .map(|block| multiply_block(input, rows, block, inner))
        .collect();
    for (index, block) in blocks.iter().enumerate() {
        let start = index * BLOCK_COLUMNS;
        let width = BLOCK_COLUMNS.min(features - start);
        for (row, values) in block.chunks_exact(BLOCK_COLUMNS).enumerate() {
            output[row * features + start..][..width].copy_from_slice(&values[..width]);
        }
    }
    output
}

/// Output columns computed together by [`multiply`]: four rows of 64 running sums are 2 KB, which stay in L1.
const BLOCK_COLUMNS: usize = 64;

/// `input` (`rows x inner`) times the transpose of up to [`BLOCK_COLUMNS`] weight rows: `rows x BLOCK_COLUMNS`
/// (columns past the block's weight rows are 0).
fn multiply_block(input: &[f64], rows: usize, block: &[f64], inner: usize) -> Vec<f64> {
    // The block transposed, `inner x BLOCK_COLUMNS`, so one input value multiplies a contiguous run of weights.
    let mut transposed = vec![0f64; inner * BLOCK_COLUMNS];
    for (column, weight_row) in block.chunks_exact(inner).enumerate() {
        for (index, &value) in weight_row.iter().enumerate() {
            transposed[index * BLOCK_COLUMNS + column] = value;
        }
    }
    let zero_row = vec![0f64; inner];
    let mut result = vec![0f64; rows * BLOCK_COLUMNS];
    for first in (0..rows).step_by(4) {
        // Rows past the end read as zeros and are dropped.
        let inputs: [&[f64]; 4] = std::array::from_fn(|offset| {
            let row = first + offset;
            if row < rows {
                &input[row * inner..][..inner]
            } else {
                &zero_row
            }
        });
        let mut sums = [[0f64; BLOCK_COLUMNS]; 4];
        for (index, weights) in transposed.chunks_exact(BLOCK_COLUMNS).enumerate() {
            for (row_sums, row_input) in sums.iter_mut().zip(&inputs) {
                let value = row_input[index];
                for (sum, &weight) in row_sums.iter_mut().zip(weights) {
                    *sum += value * weight;
                }
            }
        }
        for (offset, row_sums) in sums.iter().enumerate().take(rows - first) {
            result[(first + offset) * BLOCK_COLUMNS..][..BLOCK_COLUMNS].copy_from_slice(row_sums);
        }
    }
    result
}

/// SiLU: `x / (1 + e^-x)`.
fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// GELU in its tanh form, as gemma3 is trained with and llama.cpp's `ggml_gelu` approximates:
/// `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`.
fn gelu_tanh(x: f64) -> f64 {
    let sqrt_2_over_pi = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (sqrt_2_over_pi * (x + 0.044_715 * x * x * x)).tanh())
}
