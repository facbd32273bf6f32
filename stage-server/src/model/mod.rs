//! The compute core: loads a layer range of a GGUF model and runs prefill and decode on lanes.
//!
//! A [`Stage`] owns layers `[start, end)` of a model ([`StageSpec`]), the embeddings if it is first and
//! the output norm and head if it is last. It keeps `lane_count` independent KV caches and runs chunks of
//! token ids (first stage) or f32 activation rows (later stages) at absolute positions. The last stage
//! returns logits; a [`Sampler`] turns them into tokens. [`Pipeline`] chains stages in one process.
//! [`ExactModel`] is the slow f64 forward the tests measure engines against.

mod config;
mod error;
mod file;
mod fingerprint;
pub mod gguf_check;
pub mod memory;
mod pipeline;
pub mod reference;
mod sampling;
mod shared;
mod stage;
pub mod testing;

use std::path::{Path, PathBuf};

pub use config::{Architecture, LayerAttention, ModelConfig};
pub use error::ModelError;
pub use file::{ModelFile, TensorTypeSummary, type_name};
pub use fingerprint::fingerprint;
pub use pipeline::{
    Finish, GenerateOptions, Generation, PREFILL_CHUNK, Pipeline, decode_activations,
    encode_activations,
};
pub use reference::{ExactLogits, ExactModel};
pub use sampling::{Sampler, SamplingParams, log_probabilities, wanted_log_probabilities};
pub use shared::{
    ARRIVAL_WAIT, Arrival, Backlog, DEFAULT_BATCH_TOKENS, GATHER_WAIT, HOLD_WAIT_MAX,
    HOLD_WAIT_MIN, PROMPT_HOLD_STEPS, SharedStage, StepPolicy, StepTag,
};
pub use stage::{
    BatchEntry, Logits, SplitError, Stage, StageInput, StageOptions, StageOutput, StageSpec,
    TRIM_SLACK,
};

/// How many leading tokens `held` and `wanted` share: what a lane holding `held` can reuse of a prompt `wanted`.
pub fn common_prefix(held: &[u32], wanted: &[u32]) -> usize {
    held.iter()
        .zip(wanted)
        .take_while(|(held, wanted)| held == wanted)
        .count()
}

/// The file name of the SmolLM2 test model in the model directory.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The file name of the gemma-3 test model in the model directory.
pub const GEMMA3_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// The environment variable that overrides the model directory; empty counts as unset.
pub const MODEL_DIR_VARIABLE: &str = "STAGE_SERVER_MODEL_DIR";

/// One real model the tests know: its file in the model directory and the sha256 its fixtures were made from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownModel {
    /// The short name `cargo xtask fetch-models` takes (`smollm2`, `gemma3`).
    pub short_name: &'static str,
    /// The file name inside the model directory.
    pub file_name: &'static str,
    /// The file's sha256, lower-case hex.
    pub sha256: &'static str,
}

/// The real models, with the digests `xtask/src/models.rs` pins when it fetches them.
///
/// xtask cannot depend on this crate (it must build before anything else does), so the table is written twice;
/// `tests/model_gate.rs` reads xtask's copy as text and fails when the two differ.
pub const KNOWN_MODELS: [KnownModel; 2] = [
    KnownModel {
        short_name: "smollm2",
        file_name: SMOLLM2_FILE,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    KnownModel {
        short_name: "gemma3",
        file_name: GEMMA3_FILE,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
];

/// Where the real models live: `$STAGE_SERVER_MODEL_DIR` unless it is unset or empty, else
/// `$HOME/.cache/stage-server/models` (the directory `cargo xtask fetch-models` fills).
///
/// The one definition of the model directory in this crate; `xtask/src/models.rs` keeps a copy with the same
/// rule (an empty variable is ignored, as shells leave `VAR=` set but empty).
pub fn default_model_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(MODEL_DIR_VARIABLE).filter(|dir| !dir.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("stage-server").join("models")
}

/// The path of model `name` in [`default_model_dir`], or an explanation naming `cargo xtask fetch-models`.
pub fn find_model(name: &str) -> Result<PathBuf, String> {
    find_model_in(&default_model_dir(), name)
}

/// The path of model `name` in `directory`, or an explanation naming `cargo xtask fetch-models`.
pub fn find_model_in(directory: &Path, name: &str) -> Result<PathBuf, String> {
    let path = directory.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "model {} is absent; run `cargo xtask fetch-models` to download it (or set {MODEL_DIR_VARIABLE})",
            path.display()
        ))
    }
}
