//! The bodies of the fuzz targets in `stage-server/fuzz`, shared with their stable-toolchain twins in `tests/fuzz_twins.rs`.
//!
//! Each body takes the fuzzer's bytes, runs one entry point and panics when an invariant breaks; returning is a
//! pass. The nightly-only targets and the twins that `cargo test` runs call the same functions, so they cannot
//! drift apart.

use std::fmt;
use std::path::Path;

use candle_core::quantized::gguf_file::Content;

use crate::gguf_check::validate_bytes;
use crate::model::testing::{tiny_bpe_tokenizer, tiny_sentencepiece_tokenizer};
use crate::tokenizer::{SpecialTokens, StreamDecoder, Tokenizer};

/// The tokenizers the tokenizer target picks from: byte-level BPE under each pre-tokenizer family, and
/// SentencePiece with byte fallback.
pub struct TokenizerTargets {
    tokenizers: Vec<(&'static str, Tokenizer)>,
}

impl TokenizerTargets {
    /// Builds the tiny tokenizers (a few milliseconds; build once per process).
    pub fn new() -> Self {
        let mut tokenizers: Vec<(&'static str, Tokenizer)> = ["smollm", "llama3", "qwen2", "gpt-2"]
            .into_iter()
            .map(|pre| (pre, tiny_bpe_tokenizer(pre)))
            .collect();
        tokenizers.push(("sentencepiece", tiny_sentencepiece_tokenizer()));
        Self { tokenizers }
    }

    /// Encodes the bytes after the first as text (invalid UTF-8 replaced) with the tokenizer and flags the first
    /// byte picks, and checks what every text must give: an `Ok` encoding, ids inside the vocabulary, a
    /// streaming decode that never splits a character and keeps nothing back, and the text itself back from
    /// the decode (for SentencePiece, unless the text holds its space mark U+2581 or control tokens are parsed).
    ///
    /// # Panics
    ///
    /// When one of those invariants breaks.
    pub fn encode(&self, bytes: &[u8]) {
        let Some((&selector, text)) = bytes.split_first() else {
            return;
        };
        let (name, tokenizer) = &self.tokenizers[usize::from(selector) % self.tokenizers.len()];
        let add_special = selector & 0x40 != 0;
        let parse_special = selector & 0x80 != 0;
        let text = String::from_utf8_lossy(text);
        let ids = tokenizer
            .encode(&text, add_special, parse_special)
            .unwrap_or_else(|error| panic!("{name}: encoding {text:?} failed: {error}"));
        let vocabulary = tokenizer.vocab_size();
        if let Some(id) = ids.iter().find(|&&id| id as usize >= vocabulary) {
            panic!(
                "{name}: encoding {text:?} gave id {id}, outside the vocabulary of {vocabulary}"
            );
        }
        let byte_level = *name != "sentencepiece";
        let rendered = tokenizer.decode_with(&ids, SpecialTokens::Render);
        // SentencePiece writes spaces as U+2581 and decodes that mark as a space, and (as llama.cpp does) puts
        // a space before the text after a parsed control token; other texts come back unchanged.
        let round_trips = byte_level || !(parse_special || text.contains('\u{2581}'));
        if round_trips && !add_special {
            assert_eq!(
                rendered, text,
                "{name}: decoding the encoding of a text did not give the text back"
            );
        }
        if parse_special {
            // Control tokens parsed from the text produce no streamed text, so the checks below do not apply.
            return;
        }
        let mut stream = StreamDecoder::new(tokenizer);
        for &id in &ids {
            let chunk = stream.push(id);
            assert!(
                !chunk.contains(char::REPLACEMENT_CHARACTER)
                    || text.contains(char::REPLACEMENT_CHARACTER),
                "{name}: streaming the encoding of {text:?} emitted a broken character in {chunk:?}"
            );
        }
        assert_eq!(
            stream.finish(),
            "",
            "{name}: streaming the encoding of {text:?} kept bytes back at the end"
        );
    }
}

impl Default for TokenizerTargets {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for TokenizerTargets {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.tokenizers.iter().map(|(name, _)| *name).collect();
        formatter
            .debug_struct("TokenizerTargets")
            .field("tokenizers", &names)
            .finish()
    }
}

/// Runs the GGUF pre-check on `bytes` as a whole file and, where it accepts them, holds it to its promise:
/// candle's reader does not panic on them, and when it reads them it finds the same tensor and metadata counts
/// and data offset, with every tensor's data inside the bytes.
///
/// # Panics
///
/// When the pre-check panics, or accepts bytes that break that promise.
pub fn gguf_check(bytes: &[u8]) {
    let Ok(summary) = validate_bytes(bytes, Path::new("fuzz-input.gguf")) else {
        return;
    };
    // candle may still refuse what the pre-check lets through (it is not a full parser); it must not panic.
    let Ok(content) = Content::read(&mut std::io::Cursor::new(bytes)) else {
        return;
    };
    assert_eq!(
        summary.tensor_count as usize,
        content.tensor_infos.len(),
        "the pre-check and candle count different tensors"
    );
    assert_eq!(
        summary.metadata_count as usize,
        content.metadata.len(),
        "the pre-check and candle count different metadata keys"
    );
    assert_eq!(
        summary.tensor_data_offset, content.tensor_data_offset,
        "the pre-check and candle put the tensor data at different offsets"
    );
    // Without tensors the data section's start may lie past the end (a file cut inside its final padding);
    // nothing is read there, so only files with tensors must hold their data section.
    assert!(
        summary.tensor_count == 0 || summary.tensor_data_end <= bytes.len() as u64,
        "the pre-check accepted tensor data ending at {} in {} bytes",
        summary.tensor_data_end,
        bytes.len()
    );
    for (name, info) in &content.tensor_infos {
        let elements = info.shape.elem_count() as u64;
        let block_size = info.ggml_dtype.block_size() as u64;
        let size = elements / block_size * info.ggml_dtype.type_size() as u64;
        let end = content
            .tensor_data_offset
            .checked_add(info.offset)
            .and_then(|start| start.checked_add(size));
        assert!(
            end.is_some_and(|end| end <= bytes.len() as u64),
            "the pre-check accepted tensor `{name}` whose data (offset {}, {size} bytes) is not inside the {} \
             bytes",
            info.offset,
            bytes.len()
        );
    }
}
