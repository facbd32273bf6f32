//! Test support: tiny deterministic GGUF models written by a seeded generator, and the gate for real-model tests.
//!
//! The tiny models (llama and gemma3, any quant type) have random weights reproducible from the seed; the files
//! carry a small SentencePiece-style vocabulary (control tokens, the 256 byte tokens and a few pieces) so
//! tokenizer code can load them.
//!
//! Tests that need a real model ask [`real_model`] for it. Whether an absent model skips the test or fails it
//! is decided there and nowhere else ([`MissingModel`]): on a developer's machine it skips with a note naming
//! `cargo xtask fetch-models`; under CI it fails, so that a green CI run means the real-model tests ran.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::{Architecture, ModelError, default_model_dir, find_model_in};
use crate::tokenizer::Tokenizer;

/// The environment variable that, set to `1`, makes an absent real model fail its test outside CI too.
/// `cargo xtask ci` sets it for its test runs.
pub const REQUIRE_MODELS_VARIABLE: &str = "STAGE_SERVER_REQUIRE_MODELS";

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

/// What a test does when a real model it needs is absent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissingModel {
    /// Print a note naming `cargo xtask fetch-models` and return without checking anything.
    Skip,
    /// Fail the test, naming the missing file and the fetch command.
    Fail,
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

    /// Writes the model into a fresh scratch directory named after `name` (and this process) and loads all its
    /// layers with `lanes` lanes; returns the directory, for the caller to remove, and the stage.
    pub fn scratch_stage(&self, name: &str, lanes: usize) -> (PathBuf, super::Stage) {
        let dir = std::env::temp_dir().join(format!("stage-server-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let path = self.write_to_dir(&dir).expect("write the tiny model");
        let stage = super::Stage::load(
            &path,
            super::StageSpec::whole(self.block_count),
            super::StageOptions {
                lane_count: lanes,
                context_length: None,
            },
        )
        .expect("load the tiny model");
        (dir, stage)
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
        ];
        metadata.extend(sentencepiece_metadata(&vocabulary));
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

impl MissingModel {
    /// The policy of this process: [`MissingModel::Fail`] when `CI` is set and not empty (CI services set it to
    /// `true`) or [`REQUIRE_MODELS_VARIABLE`] is `1`, else [`MissingModel::Skip`].
    pub fn from_environment() -> Self {
        Self::from_variables(
            std::env::var_os("CI").as_deref(),
            std::env::var_os(REQUIRE_MODELS_VARIABLE).as_deref(),
        )
    }

    /// The policy for the given values of `CI` and [`REQUIRE_MODELS_VARIABLE`] (`None` when unset).
    pub fn from_variables(ci: Option<&OsStr>, require_models: Option<&OsStr>) -> Self {
        let under_ci = ci.is_some_and(|value| !value.is_empty());
        let required = require_models.is_some_and(|value| value == "1");
        if under_ci || required {
            Self::Fail
        } else {
            Self::Skip
        }
    }
}

/// The path of the real model `file_name` in the model directory, or `None` when it is absent and this process
/// skips missing models (see [`MissingModel::from_environment`]). Every test that needs a real model calls this
/// and returns on `None`.
///
/// # Panics
///
/// When the model is absent and this process requires the real models.
pub fn real_model(file_name: &str) -> Option<PathBuf> {
    real_model_in(
        &default_model_dir(),
        file_name,
        MissingModel::from_environment(),
    )
}

/// As [`real_model`], with the directory and the policy given.
///
/// # Panics
///
/// When the model is absent and `missing` is [`MissingModel::Fail`].
pub fn real_model_in(directory: &Path, file_name: &str, missing: MissingModel) -> Option<PathBuf> {
    let explanation = match find_model_in(directory, file_name) {
        Ok(path) => return Some(path),
        Err(explanation) => explanation,
    };
    match missing {
        MissingModel::Skip => {
            eprintln!("skipping: {explanation}");
            None
        }
        MissingModel::Fail => panic!(
            "{explanation}. This run requires the real models (CI is set or {REQUIRE_MODELS_VARIABLE}=1), so a \
             missing model fails the test instead of skipping it"
        ),
    }
}

/// The tokenizer of the tiny models: SentencePiece (`llama`) over [`TinyModel::vocabulary`], with byte fallback.
///
/// # Panics
///
/// Never for this fixed vocabulary; a panic means the tokenizer rejects a vocabulary it used to accept.
pub fn tiny_sentencepiece_tokenizer() -> Tokenizer {
    let mut metadata = vec![(
        "general.architecture".to_owned(),
        Value::String("llama".into()),
    )];
    metadata.extend(sentencepiece_metadata(&TinyModel::vocabulary()));
    tokenizer_from_metadata(&metadata)
}

/// A tiny byte-level BPE tokenizer (`gpt2`) with pre-tokenizer `pre` (`smollm`, `llama3`, `qwen2`, `gpt-2`, ...):
/// control tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as ids 0 to 2, the 256 byte characters of GPT-2's
/// alphabet as ids 3 to 258, then a few merged pieces. Every text encodes, and decodes back to itself.
///
/// # Panics
///
/// When this crate has no pre-tokenizer named `pre`.
pub fn tiny_bpe_tokenizer(pre: &str) -> Tokenizer {
    const MERGED: [&str; 7] = ["Ġt", "he", "Ġthe", "in", "ing", "Ġs", "Ġsing"];
    const MERGES: [&str; 7] = ["Ġ t", "h e", "Ġt he", "i n", "in g", "Ġ s", "Ġs ing"];
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .map(String::from)
        .to_vec();
    tokens.extend(gpt2_byte_alphabet().iter().map(char::to_string));
    tokens.extend(MERGED.map(String::from));
    let strings =
        |items: &[String]| Value::Array(items.iter().cloned().map(Value::String).collect());
    let metadata = vec![
        (
            "general.architecture".to_owned(),
            Value::String("llama".into()),
        ),
        (
            "tokenizer.ggml.model".to_owned(),
            Value::String("gpt2".into()),
        ),
        ("tokenizer.ggml.pre".to_owned(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".to_owned(), strings(&tokens)),
        (
            "tokenizer.ggml.token_type".to_owned(),
            Value::Array(
                (0..tokens.len())
                    .map(|id| Value::I32(if id < 3 { 3 } else { 1 }))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.merges".to_owned(),
            strings(&MERGES.map(String::from)),
        ),
        ("tokenizer.ggml.bos_token_id".to_owned(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".to_owned(), Value::U32(2)),
        (
            "tokenizer.ggml.add_bos_token".to_owned(),
            Value::Bool(false),
        ),
    ];
    tokenizer_from_metadata(&metadata)
}

/// The SentencePiece tokenizer keys of the tiny models: scores falling with the id, types control (BOS, EOS),
/// unknown, byte (the 256 `<0xXX>` tokens) and normal.
fn sentencepiece_metadata(vocabulary: &[String]) -> Vec<(String, Value)> {
    vec![
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
    ]
}

/// Writes `metadata` as an in-memory GGUF file without tensors and builds the tokenizer candle reads back.
fn tokenizer_from_metadata(metadata: &[(String, Value)]) -> Tokenizer {
    let pairs: Vec<(&str, &Value)> = metadata
        .iter()
        .map(|(key, value)| (key.as_str(), value))
        .collect();
    let mut bytes = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut bytes, &pairs, &[]).expect("an in-memory GGUF file is written");
    bytes.set_position(0);
    let content = gguf_file::Content::read(&mut bytes).expect("the written GGUF file reads back");
    Tokenizer::from_gguf(&content)
        .unwrap_or_else(|error| panic!("the tiny tokenizer does not load: {error}"))
}

/// GPT-2's byte alphabet: printable bytes stand for themselves, the rest for the characters from U+0100 on.
fn gpt2_byte_alphabet() -> Vec<char> {
    let mut spare = 0x100u32;
    (0u8..=255)
        .map(|byte| {
            if matches!(byte, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff) {
                char::from(byte)
            } else {
                spare += 1;
                char::from_u32(spare - 1).unwrap_or(char::REPLACEMENT_CHARACTER)
            }
        })
        .collect()
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
