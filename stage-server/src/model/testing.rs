//! Tiny deterministic GGUF models (llama and gemma3, any quant type) written by a seeded generator, for tests.
//!
//! The weights are random but reproducible from the seed; the files carry a small SentencePiece-style
//! vocabulary (control tokens, the 256 byte tokens and a few pieces) so tokenizer code can load them.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::{Architecture, ModelError};

/// The shape and seed of a tiny model.
#[derive(Clone, Debug, PartialEq)]
pub struct TinyModel {
    /// Which family to write.
    pub architecture: Architecture,
    /// The type of the weight matrices (matrices whose rows do not fit its block size fall back to
    /// Q8_0, as llama.cpp's quantizer does for K-quants).
    pub weight_type: GgmlDType,
    /// Seed of the weights.
    pub seed: u64,
    /// Transformer blocks.
    pub block_count: usize,
    /// Activation width.
    pub embedding_length: usize,
    /// Feed-forward width.
    pub feed_forward_length: usize,
    /// Query heads.
    pub head_count: usize,
    /// Key/value heads.
    pub head_count_kv: usize,
    /// Width of one head.
    pub key_length: usize,
    /// Context length written to the metadata.
    pub context_length: usize,
    /// Gemma 3's sliding window (ignored for llama).
    pub sliding_window: usize,
}

/// Id of the beginning-of-sequence token in the tiny vocabulary.
pub const TINY_BOS: u32 = 1;
/// Id of the end-of-sequence token in the tiny vocabulary.
pub const TINY_EOS: u32 = 2;

impl TinyModel {
    /// A 4-layer llama (width 64, 4 query and 2 key/value heads, separate output matrix).
    pub fn llama(weight_type: GgmlDType) -> Self {
        Self {
            architecture: Architecture::Llama,
            weight_type,
            seed: 0x5EED_1A3A,
            block_count: 4,
            embedding_length: 64,
            feed_forward_length: 256,
            head_count: 4,
            head_count_kv: 2,
            key_length: 16,
            context_length: 256,
            sliding_window: 0,
        }
    }

    /// A 6-layer gemma3 (width 64, 4 query heads of 32 and 1 key/value head, window 4, layer 5 global,
    /// tied output).
    pub fn gemma3(weight_type: GgmlDType) -> Self {
        Self {
            architecture: Architecture::Gemma3,
            weight_type,
            seed: 0x5EED_6E3A,
            block_count: 6,
            embedding_length: 64,
            feed_forward_length: 256,
            head_count: 4,
            head_count_kv: 1,
            key_length: 32,
            context_length: 256,
            sliding_window: 4,
        }
    }

    /// The vocabulary the file carries.
    pub fn vocabulary() -> Vec<String> {
        let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
        tokens.extend((0..=255u8).map(|byte| format!("<0x{byte:02X}>")));
        tokens.push("\u{2581}".to_string());
        tokens.extend(('a'..='z').map(|letter| letter.to_string()));
        tokens.extend(('a'..='z').map(|letter| format!("\u{2581}{letter}")));
        for word in ["the", "capital", "of", "France", "is", "Paris"] {
            tokens.push(format!("\u{2581}{word}"));
        }
        tokens.push(".".to_string());
        tokens.push(",".to_string());
        tokens
    }

    /// A file name that tells the variants apart, e.g. `tiny-llama-Q4_1.gguf`.
    pub fn file_name(&self) -> String {
        format!(
            "tiny-{}-{}.gguf",
            self.architecture.name(),
            super::type_name(self.weight_type)
        )
    }

    /// Writes the model into `dir` under [`TinyModel::file_name`] and returns its path.
    pub fn write_to_dir(&self, dir: &Path) -> Result<PathBuf, ModelError> {
        let path = dir.join(self.file_name());
        self.write(&path)?;
        Ok(path)
    }

    /// Writes the model to `path`.
    pub fn write(&self, path: &Path) -> Result<(), ModelError> {
        let vocabulary = Self::vocabulary();
        let mut random = Random(self.seed);
        let arch = self.architecture.name();
        let width = self.embedding_length;
        let query_width = self.head_count * self.key_length;
        let kv_width = self.head_count_kv * self.key_length;
        let ffn = self.feed_forward_length;
        let gemma = self.architecture == Architecture::Gemma3;

        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        // Gemma multiplies embeddings by sqrt(width) and reuses them as the output matrix; rows of
        // standard deviation 1/sqrt(width) keep its logits near 1 so sampling tests see a spread.
        let embedding_scale = if gemma {
            1.0 / (width as f32).sqrt()
        } else {
            1.0
        };
        tensors.push((
            "token_embd.weight".to_string(),
            random.matrix(vocabulary.len(), width, embedding_scale, GgmlDType::Q8_0)?,
        ));
        for layer in 0..self.block_count {
            let name = |suffix: &str| format!("blk.{layer}.{suffix}.weight");
            let mut matrix = |suffix: &str, rows: usize, columns: usize| {
                let scale = 1.0 / (columns as f32).sqrt();
                let dtype = fitting_type(self.weight_type, columns);
                random
                    .matrix(rows, columns, scale, dtype)
                    .map(|tensor| (name(suffix), tensor))
            };
            let mut layer_tensors = vec![
                matrix("attn_q", query_width, width)?,
                matrix("attn_k", kv_width, width)?,
                matrix("attn_v", kv_width, width)?,
                matrix("attn_output", width, query_width)?,
                matrix("ffn_gate", ffn, width)?,
                matrix("ffn_up", ffn, width)?,
                matrix("ffn_down", width, ffn)?,
            ];
            let mut norms = vec![("attn_norm", width), ("ffn_norm", width)];
            if gemma {
                norms.extend([
                    ("attn_q_norm", self.key_length),
                    ("attn_k_norm", self.key_length),
                    ("post_attention_norm", width),
                    ("post_ffw_norm", width),
                ]);
            }
            for (suffix, length) in norms {
                layer_tensors.push((name(suffix), random.norm(length)?));
            }
            tensors.extend(layer_tensors);
        }
        tensors.push(("output_norm.weight".to_string(), random.norm(width)?));
        if !gemma {
            let dtype = fitting_type(self.weight_type, width);
            tensors.push((
                "output.weight".to_string(),
                random.matrix(vocabulary.len(), width, 1.0 / (width as f32).sqrt(), dtype)?,
            ));
        }

        let u32_value = |value: usize| Value::U32(value as u32);
        let mut metadata: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(arch.into())),
            (
                "general.name".into(),
                Value::String(format!(
                    "tiny {arch} {}",
                    super::type_name(self.weight_type)
                )),
            ),
            (format!("{arch}.block_count"), u32_value(self.block_count)),
            (
                format!("{arch}.context_length"),
                u32_value(self.context_length),
            ),
            (format!("{arch}.embedding_length"), u32_value(width)),
            (format!("{arch}.feed_forward_length"), u32_value(ffn)),
            (
                format!("{arch}.attention.head_count"),
                u32_value(self.head_count),
            ),
            (
                format!("{arch}.attention.head_count_kv"),
                u32_value(self.head_count_kv),
            ),
            (
                format!("{arch}.attention.key_length"),
                u32_value(self.key_length),
            ),
            (
                format!("{arch}.attention.value_length"),
                u32_value(self.key_length),
            ),
            (
                format!("{arch}.attention.layer_norm_rms_epsilon"),
                Value::F32(if gemma { 1e-6 } else { 1e-5 }),
            ),
            (
                format!("{arch}.rope.freq_base"),
                Value::F32(if gemma { 1_000_000.0 } else { 10_000.0 }),
            ),
            (
                format!("{arch}.rope.dimension_count"),
                u32_value(self.key_length),
            ),
            ("tokenizer.ggml.model".into(), Value::String("llama".into())),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(vocabulary.iter().cloned().map(Value::String).collect()),
            ),
            (
                "tokenizer.ggml.scores".into(),
                Value::Array(
                    (0..vocabulary.len())
                        .map(|index| Value::F32(-(index as f32)))
                        .collect(),
                ),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(
                    (0..vocabulary.len())
                        .map(|index| {
                            Value::I32(match index {
                                0 => 2,
                                1 | 2 => 3,
                                3..=258 => 6,
                                _ => 1,
                            })
                        })
                        .collect(),
                ),
            ),
            ("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(TINY_BOS)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(TINY_EOS)),
            ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
        ];
        if gemma {
            metadata.push((
                format!("{arch}.attention.sliding_window"),
                u32_value(self.sliding_window),
            ));
        }

        let metadata_refs: Vec<(&str, &Value)> = metadata
            .iter()
            .map(|(key, value)| (key.as_str(), value))
            .collect();
        let tensor_refs: Vec<(&str, &QTensor)> = tensors
            .iter()
            .map(|(name, tensor)| (name.as_str(), tensor))
            .collect();
        let io_error = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::create(path).map_err(io_error)?;
        let mut writer = std::io::BufWriter::new(file);
        gguf_file::write(&mut writer, &metadata_refs, &tensor_refs)?;
        std::io::Write::flush(&mut writer).map_err(io_error)?;
        Ok(())
    }
}

/// `wanted` if a row of `columns` values is a whole number of its blocks, else Q8_0 (or F32).
fn fitting_type(wanted: GgmlDType, columns: usize) -> GgmlDType {
    if columns.is_multiple_of(wanted.block_size()) {
        wanted
    } else if columns.is_multiple_of(GgmlDType::Q8_0.block_size()) {
        GgmlDType::Q8_0
    } else {
        GgmlDType::F32
    }
}

/// The seeded source of weights (SplitMix64).
struct Random(u64);

impl Random {
    fn next_unit(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform values with standard deviation `scale`.
    fn values(&mut self, count: usize, scale: f32) -> Vec<f32> {
        let half_width = scale * 3f32.sqrt();
        (0..count)
            .map(|_| (self.next_unit() * 2.0 - 1.0) * half_width)
            .collect()
    }

    fn matrix(
        &mut self,
        rows: usize,
        columns: usize,
        scale: f32,
        dtype: GgmlDType,
    ) -> Result<QTensor, ModelError> {
        let values = self.values(rows * columns, scale);
        let tensor = Tensor::from_vec(values, (rows, columns), &Device::Cpu)?;
        Ok(QTensor::quantize(&tensor, dtype)?)
    }

    fn norm(&mut self, length: usize) -> Result<QTensor, ModelError> {
        let values: Vec<f32> = self
            .values(length, 0.1)
            .into_iter()
            .map(|value| 1.0 + value)
            .collect();
        let tensor = Tensor::from_vec(values, length, &Device::Cpu)?;
        Ok(QTensor::quantize(&tensor, GgmlDType::F32)?)
    }
}
