//! The compute core: loads a layer range of a GGUF model and runs prefill and decode on lanes.
//!
//! A [`Stage`] owns layers `[start, end)` of a model ([`StageSpec`]), the embeddings if it is first and
//! the output norm and head if it is last. It keeps `lane_count` independent KV caches and runs chunks of
//! token ids (first stage) or f32 activation rows (later stages) at absolute positions. The last stage
//! returns logits; a [`Sampler`] turns them into tokens. [`Pipeline`] chains stages in one process.

mod config;
mod error;
mod file;
mod pipeline;
mod sampling;
mod stage;
pub mod testing;

use std::path::PathBuf;

pub use config::{Architecture, LayerAttention, ModelConfig};
pub use error::ModelError;
pub use file::{ModelFile, TensorTypeSummary, type_name};
pub use pipeline::{
    Finish, GenerateOptions, Generation, PREFILL_CHUNK, Pipeline, decode_activations,
    encode_activations,
};
pub use sampling::{Sampler, SamplingParams};
pub use stage::{
    Logits, SplitError, Stage, StageInput, StageOptions, StageOutput, StageSpec, TRIM_SLACK,
};

/// The file name of the SmolLM2 test model in the model directory.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The file name of the gemma-3 test model in the model directory.
pub const GEMMA3_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// Where the real models live: `$STAGE_SERVER_MODEL_DIR`, else `$HOME/.cache/stage-server/models`
/// (the directory `cargo xtask fetch-models` fills).
pub fn default_model_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("STAGE_SERVER_MODEL_DIR").filter(|dir| !dir.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("stage-server").join("models")
}

/// The path of model `name` in [`default_model_dir`], or an explanation naming `cargo xtask fetch-models`.
pub fn find_model(name: &str) -> Result<PathBuf, String> {
    let path = default_model_dir().join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "model {} is absent; run `cargo xtask fetch-models` to download it (or set STAGE_SERVER_MODEL_DIR)",
            path.display()
        ))
    }
}
