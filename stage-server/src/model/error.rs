//! The error type of the compute core: one variant per cause a caller can act on.

use std::path::PathBuf;

/// Why a model could not be loaded or a stage could not run a chunk.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The model file could not be opened or read.
    #[error(
        "cannot read model file {path}: {source}; check the path (models live in the directory `cargo xtask fetch-models` fills)"
    )]
    Io {
        /// The model file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// The file is not a well-formed GGUF file (truncated, corrupt or another format).
    #[error(
        "{path} is not a readable GGUF file: {detail}; the file is truncated or corrupt, download it again"
    )]
    Format {
        /// The model file.
        path: PathBuf,
        /// What the GGUF reader found.
        detail: String,
    },
    /// The GGUF pre-check found the file malformed; its text names the offset, the key or tensor and the limit.
    #[error(transparent)]
    Gguf(crate::model::gguf_check::GgufError),
    /// A tensor uses a ggml type this server cannot compute with.
    #[error(
        "{path} uses a tensor type this server cannot compute ({detail}); supported are F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: re-quantize the model"
    )]
    UnsupportedTensorType {
        /// The model file.
        path: PathBuf,
        /// Which tensor or type id.
        detail: String,
    },
    /// `general.architecture` names a model family this server does not implement.
    #[error(
        "{path} has architecture `{architecture}`, which this server does not implement; supported are `llama` and `gemma3`"
    )]
    UnsupportedArchitecture {
        /// The model file.
        path: PathBuf,
        /// The architecture the file declares.
        architecture: String,
    },
    /// A metadata key the architecture needs is absent or has the wrong type.
    #[error(
        "{path} lacks metadata key `{key}` (or it has the wrong type); the file was not converted for this architecture"
    )]
    MissingMetadata {
        /// The model file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// The metadata describes a shape this implementation cannot run.
    #[error("{path}: {detail}")]
    UnsupportedShape {
        /// The model file.
        path: PathBuf,
        /// What is unsupported.
        detail: String,
    },
    /// A tensor the layer range needs is absent from the file.
    #[error(
        "{path} has no tensor `{tensor}`, which this stage needs; the file is incomplete or of another architecture"
    )]
    MissingTensor {
        /// The model file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor could not be read or has an unexpected shape.
    #[error("{path}: cannot load tensor `{tensor}`: {detail}")]
    Tensor {
        /// The model file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// What went wrong.
        detail: String,
    },
    /// The requested layer range does not fit the model.
    #[error(
        "{path}: layer range {start}..{end} is not a non-empty range inside the model's {block_count} layers"
    )]
    LayerRange {
        /// The model file.
        path: PathBuf,
        /// First layer asked for.
        start: usize,
        /// One past the last layer asked for.
        end: usize,
        /// Layers the model has.
        block_count: usize,
    },
    /// A first stage that does not start at layer 0, or a last stage that does not end at the model's last layer.
    #[error(
        "{path}: a {role} stage must {rule}, but this one runs layers {start}..{end} of {block_count}; the embeddings \
         feed layer 0 and the output head reads the last layer"
    )]
    StageEnds {
        /// The model file.
        path: PathBuf,
        /// `first` or `last`.
        role: &'static str,
        /// What that role requires.
        rule: String,
        /// First layer asked for.
        start: usize,
        /// One past the last layer asked for.
        end: usize,
        /// Layers the model has.
        block_count: usize,
    },
    /// Split boundaries that do not cut the model into non-empty consecutive stages.
    #[error(
        "{path}: cannot split at layers {boundaries:?}; boundaries must rise strictly and lie inside 1..{block_count} (the model has {block_count} layers)"
    )]
    Split {
        /// The model file.
        path: PathBuf,
        /// The boundaries asked for.
        boundaries: Vec<usize>,
        /// Layers the model has.
        block_count: usize,
    },
    /// A stage was built without lanes.
    #[error("a stage needs at least one lane; pass lane_count >= 1")]
    NoLanes,
    /// The lanes' key/value caches, full, would not fit the memory the machine has available: refused at load
    /// rather than discovered when a long generation grows them.
    #[error(
        "{lanes} lanes of {context_length} tokens need up to {needed_mib} MiB of key/value cache in layers \
         {start}..{end}, more than the {available_mib} MiB this machine (or its cgroup) has available; lower \
         --lanes or --context-length"
    )]
    CacheMemory {
        /// Lanes asked for.
        lanes: usize,
        /// Tokens per lane.
        context_length: usize,
        /// First layer of the stage.
        start: usize,
        /// One past its last layer.
        end: usize,
        /// The caches' most, full, in MiB.
        needed_mib: u64,
        /// What the kernel says is available, in MiB.
        available_mib: u64,
    },
    /// The lane index is not one of this stage's lanes.
    #[error("lane {lane} does not exist; this stage has {lane_count} lanes")]
    LaneOutOfRange {
        /// The lane asked for.
        lane: usize,
        /// Lanes the stage has.
        lane_count: usize,
    },
    /// The chunk does not start where the lane's cache ends.
    #[error(
        "lane {lane} holds {length} positions, so the next chunk must start at position {length}, not {position}; trim the session first to rewrite earlier positions"
    )]
    PositionMismatch {
        /// The lane.
        lane: usize,
        /// Positions the lane's cache holds.
        length: usize,
        /// Where the chunk claimed to start.
        position: usize,
    },
    /// The chunk would run past the context limit.
    #[error(
        "lane {lane}: {tokens} tokens at position {position} exceed the context limit of {context_length} tokens; shorten the prompt or raise the context size"
    )]
    ContextOverflow {
        /// The lane.
        lane: usize,
        /// Where the chunk starts.
        position: usize,
        /// Tokens in the chunk.
        tokens: usize,
        /// The context limit.
        context_length: usize,
    },
    /// A trim asked to keep more positions than the lane holds.
    #[error("lane {lane} holds {length} positions; cannot trim it to {target}")]
    TrimBeyondEnd {
        /// The lane.
        lane: usize,
        /// Positions the lane holds.
        length: usize,
        /// The asked length.
        target: usize,
    },
    /// A trim reached back past what the sliding-window layers still hold: they keep only the last window of
    /// positions (and some slack), so earlier keys and values are gone.
    #[error(
        "lane {lane} can be trimmed back to position {earliest} at the earliest, not {target}: its sliding-window \
         layers no longer hold the keys and values before that; reset the lane and prefill it again"
    )]
    TrimBeyondWindow {
        /// The lane.
        lane: usize,
        /// The asked length.
        target: usize,
        /// The shortest length the lane can be trimmed to (other than 0, which always works).
        earliest: usize,
    },
    /// The chunk is empty.
    #[error("a chunk needs at least one token or activation row")]
    EmptyChunk,
    /// The first stage got activations or a later stage got tokens.
    #[error(
        "this stage expects {expected} as input; the first stage takes token ids, later stages take activation rows"
    )]
    WrongInput {
        /// What the stage expects.
        expected: &'static str,
    },
    /// An activation chunk is not a whole number of rows of the model's width.
    #[error("{values} activation values are not a whole number of rows of width {width}")]
    ActivationSize {
        /// Values received.
        values: usize,
        /// The model's activation width.
        width: usize,
    },
    /// A token id is outside the vocabulary.
    #[error("token id {token} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfRange {
        /// The token.
        token: u32,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// The computation produced NaN or infinite values.
    #[error(
        "layers {start}..{end} produced NaN or infinite values on lane {lane}; the model file or the input activations are broken"
    )]
    NonFinite {
        /// First layer of the stage.
        start: usize,
        /// End of the stage's layer range.
        end: usize,
        /// The lane.
        lane: usize,
    },
    /// A tensor operation failed inside candle.
    #[error("tensor computation failed: {0}")]
    Compute(String),
}

impl From<candle_core::Error> for ModelError {
    fn from(error: candle_core::Error) -> Self {
        Self::Compute(candle_message(&error))
    }
}

/// The first line of a candle error: its message without the backtrace candle appends when
/// `RUST_BACKTRACE` is set.
pub(crate) fn candle_message(error: &candle_core::Error) -> String {
    error
        .to_string()
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}
