//! Model hyper-parameters read from GGUF metadata, for the `llama` and `gemma3` architectures.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};

use super::ModelError;

/// The model families this core implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Architecture {
    /// Llama and its kin: GQA, interleaved RoPE, SwiGLU, RMSNorm.
    Llama,
    /// Gemma 3: QK-norm, post-norms, GELU-tanh, scaled embeddings, sliding-window layers.
    Gemma3,
}

impl Architecture {
    /// The `general.architecture` string.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Gemma3 => "gemma3",
        }
    }
}

/// How each layer attends: to every earlier position, or to a sliding window of them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    /// `Some(n)`: a query sees only the `n` most recent positions (itself included).
    pub window: Option<usize>,
    /// The RoPE frequency base of this layer.
    pub rope_base: f32,
}

/// The hyper-parameters of a model, read from its GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The model family.
    pub architecture: Architecture,
    /// Transformer blocks in the whole model.
    pub block_count: usize,
    /// Activation width (`n_embd`): the f32 values per token that cross a stage boundary.
    pub embedding_length: usize,
    /// Hidden width of the feed-forward network.
    pub feed_forward_length: usize,
    /// Query heads.
    pub head_count: usize,
    /// Key/value heads (fewer than query heads under grouped-query attention).
    pub head_count_kv: usize,
    /// Width of one key (and query) head.
    pub key_length: usize,
    /// Width of one value head.
    pub value_length: usize,
    /// The context length the model was trained for.
    pub context_length: usize,
    /// Epsilon of the RMS norms.
    pub rms_epsilon: f32,
    /// RoPE frequency base of global layers.
    pub rope_base: f32,
    /// RoPE position scale (1 / linear scaling factor).
    pub rope_position_scale: f32,
    /// Sliding-window width of local layers, if the model has them.
    pub sliding_window: Option<usize>,
    /// RoPE base of sliding-window layers.
    pub rope_base_local: f32,
    /// Multiplier applied to attention scores before the softmax.
    pub attention_scale: f32,
    /// `Some(c)`: logits become `c * tanh(logits / c)`.
    pub final_logit_softcap: Option<f32>,
    /// Vocabulary size (rows of the embedding matrix).
    pub vocab_size: usize,
}

impl ModelConfig {
    /// Reads the configuration of the model in `content`; `path` only names the file in errors.
    pub fn from_gguf(path: &Path, content: &Content) -> Result<Self, ModelError> {
        let metadata = Metadata {
            path,
            map: &content.metadata,
        };
        let architecture_name = metadata.string("general.architecture")?;
        let architecture = match architecture_name.as_str() {
            "llama" => Architecture::Llama,
            "gemma3" => Architecture::Gemma3,
            other => {
                return Err(ModelError::UnsupportedArchitecture {
                    path: path.to_path_buf(),
                    architecture: other.to_string(),
                });
            }
        };
        let prefix = architecture.name();
        let key = |suffix: &str| format!("{prefix}.{suffix}");
        let embedding_length = metadata.integer(&key("embedding_length"))?;
        let head_count = metadata.integer(&key("attention.head_count"))?;
        let head_count_kv = metadata
            .optional_integer(&key("attention.head_count_kv"))?
            .unwrap_or(head_count);
        let default_head = embedding_length.checked_div(head_count).unwrap_or(0);
        let key_length = metadata
            .optional_integer(&key("attention.key_length"))?
            .unwrap_or(default_head);
        let value_length = metadata
            .optional_integer(&key("attention.value_length"))?
            .unwrap_or(key_length);
        let rope_dimensions = metadata
            .optional_integer(&key("rope.dimension_count"))?
            .unwrap_or(key_length);
        let vocab_size = match content.tensor_infos.get("token_embd.weight") {
            Some(info) => info.shape.dims().first().copied().unwrap_or(0),
            None => {
                return Err(ModelError::MissingTensor {
                    path: path.to_path_buf(),
                    tensor: "token_embd.weight".to_string(),
                });
            }
        };
        let unsupported = |detail: String| ModelError::UnsupportedShape {
            path: path.to_path_buf(),
            detail,
        };
        if head_count == 0 || head_count_kv == 0 || !head_count.is_multiple_of(head_count_kv) {
            return Err(unsupported(format!(
                "{head_count} query heads cannot share {head_count_kv} key/value heads evenly"
            )));
        }
        if key_length == 0 || !key_length.is_multiple_of(2) || rope_dimensions != key_length {
            return Err(unsupported(format!(
                "RoPE over {rope_dimensions} of {key_length} head dimensions is not supported; it must cover the whole, even-sized head"
            )));
        }
        if key_length != value_length {
            return Err(unsupported(format!(
                "key width {key_length} differs from value width {value_length}, which is not supported"
            )));
        }
        let rope_scale = match metadata.optional_string(&key("rope.scaling.type"))? {
            Some(kind) if kind == "linear" => metadata
                .optional_float(&key("rope.scaling.factor"))?
                .filter(|factor| *factor > 0.0)
                .map_or(1.0, |factor| 1.0 / factor),
            Some(kind) if kind != "none" => {
                return Err(unsupported(format!(
                    "RoPE scaling `{kind}` is not supported"
                )));
            }
            _ => 1.0,
        };
        let (sliding_window, attention_scale, softcap_default) = match architecture {
            Architecture::Llama => (None, 1.0 / (key_length as f32).sqrt(), None),
            Architecture::Gemma3 => (
                metadata.optional_integer(&key("attention.sliding_window"))?,
                // llama.cpp scales queries by 1/sqrt(head width) for every gemma3 size except 27B, whose
                // query_pre_attn_scalar is n_embd / n_head; a GGUF stores neither, so follow its rule.
                gemma3_attention_scale(embedding_length, head_count, key_length),
                None,
            ),
        };
        Ok(Self {
            architecture,
            block_count: metadata.integer(&key("block_count"))?,
            embedding_length,
            feed_forward_length: metadata.integer(&key("feed_forward_length"))?,
            head_count,
            head_count_kv,
            key_length,
            value_length,
            context_length: metadata.integer(&key("context_length"))?,
            rms_epsilon: metadata.float(&key("attention.layer_norm_rms_epsilon"))?,
            rope_base: metadata
                .optional_float(&key("rope.freq_base"))?
                .unwrap_or(10_000.0),
            rope_position_scale: rope_scale,
            sliding_window,
            rope_base_local: metadata
                .optional_float(&key("rope.local.freq_base"))?
                .unwrap_or(10_000.0),
            attention_scale,
            final_logit_softcap: metadata
                .optional_float(&key("final_logit_softcapping"))?
                .or(softcap_default)
                .filter(|cap| *cap > 0.0),
            vocab_size,
        })
    }

    /// How layer `layer` attends. Gemma 3 makes every sixth layer global (layers 5, 11, 17, ...,
    /// as llama.cpp does when the file stores no pattern) and the others sliding-window.
    pub fn layer_attention(&self, layer: usize) -> LayerAttention {
        match (self.architecture, self.sliding_window) {
            (Architecture::Gemma3, Some(window)) if !(layer + 1).is_multiple_of(6) => {
                LayerAttention {
                    window: Some(window),
                    rope_base: self.rope_base_local,
                }
            }
            _ => LayerAttention {
                window: None,
                rope_base: self.rope_base,
            },
        }
    }
}

/// Gemma 3's attention scale; the 27B model (62 layers, n_embd 5376) divides by sqrt(n_embd / n_head).
fn gemma3_attention_scale(embedding_length: usize, head_count: usize, key_length: usize) -> f32 {
    if embedding_length == 5376 {
        1.0 / ((embedding_length / head_count) as f32).sqrt()
    } else {
        1.0 / (key_length as f32).sqrt()
    }
}

/// Typed access to GGUF metadata that names the file and key in its errors.
struct Metadata<'a> {
    path: &'a Path,
    map: &'a HashMap<String, Value>,
}

impl Metadata<'_> {
    fn missing(&self, key: &str) -> ModelError {
        ModelError::MissingMetadata {
            path: self.path.to_path_buf(),
            key: key.to_string(),
        }
    }

    fn string(&self, key: &str) -> Result<String, ModelError> {
        self.optional_string(key)?.ok_or_else(|| self.missing(key))
    }

    fn optional_string(&self, key: &str) -> Result<Option<String>, ModelError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(_) => Err(self.missing(key)),
        }
    }

    fn integer(&self, key: &str) -> Result<usize, ModelError> {
        self.optional_integer(key)?.ok_or_else(|| self.missing(key))
    }

    fn optional_integer(&self, key: &str) -> Result<Option<usize>, ModelError> {
        let Some(value) = self.map.get(key) else {
            return Ok(None);
        };
        value_as_integer(value)
            .map(Some)
            .ok_or_else(|| self.missing(key))
    }

    fn float(&self, key: &str) -> Result<f32, ModelError> {
        self.optional_float(key)?.ok_or_else(|| self.missing(key))
    }

    fn optional_float(&self, key: &str) -> Result<Option<f32>, ModelError> {
        let Some(value) = self.map.get(key) else {
            return Ok(None);
        };
        let number = match value {
            Value::F32(v) => *v as f64,
            Value::F64(v) => *v,
            other => match value_as_integer(other) {
                Some(v) => v as f64,
                None => return Err(self.missing(key)),
            },
        };
        Ok(Some(number as f32))
    }
}

/// A non-negative integer from any integer metadata type; arrays (per-layer values) must be uniform.
fn value_as_integer(value: &Value) -> Option<usize> {
    let number: i128 = match value {
        Value::U8(v) => (*v).into(),
        Value::I8(v) => (*v).into(),
        Value::U16(v) => (*v).into(),
        Value::I16(v) => (*v).into(),
        Value::U32(v) => (*v).into(),
        Value::I32(v) => (*v).into(),
        Value::U64(v) => (*v).into(),
        Value::I64(v) => (*v).into(),
        Value::Array(items) => {
            let first = value_as_integer(items.first()?)?;
            let uniform = items
                .iter()
                .all(|item| value_as_integer(item) == Some(first));
            return uniform.then_some(first);
        }
        _ => return None,
    };
    usize::try_from(number).ok()
}
