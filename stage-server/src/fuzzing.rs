//! The bodies of the fuzz targets in `stage-server/fuzz`, shared with their stable-toolchain twins in `tests/fuzz_twins.rs`.
//!
//! Each body takes the fuzzer's bytes, runs one entry point and panics when an invariant breaks; returning is a
//! pass. The nightly-only targets and the twins that `cargo test` runs call the same functions, so they cannot
//! drift apart.

use std::fmt;
use std::path::Path;

use candle_core::quantized::gguf_file::Content;

use crate::api::{decode_chat, decode_completion};
use crate::http::{HttpError, HttpLimits, Parsed, Request, RequestParser};
use crate::model::gguf_check::validate_bytes;
use crate::model::testing::{tiny_bpe_tokenizer, tiny_sentencepiece_tokenizer};
use crate::tokenizer::{SpecialTokens, StreamDecoder, Tokenizer};
use crate::wire::{Decoder, Frame, WireError, WireLimits, encode_to_vec};

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

/// Small limits for the wire target, so that random bytes reach them often.
pub const WIRE_FUZZ_LIMITS: WireLimits = WireLimits {
    // Past the 4 KiB a decoder keeps between frames, so the bound on what it holds mid-frame is tested.
    max_frame_bytes: 1 << 16,
    max_rows: 16,
    max_width: 64,
    max_top_logprobs: 4,
    max_stop_tokens: 8,
    max_history: 8,
    max_logit_bias: 8,
    max_message_bytes: 64,
    max_timings: 8,
};

/// Decodes the bytes after the first as a link's stream, once whole and once in pieces whose sizes the first
/// byte picks, and holds the decoder to its promises: no panic; the same frames and the same error whatever
/// the read boundaries; every frame encodes back to exactly the bytes it came from (the encoding is
/// canonical); activations hold as many bytes as their shape says; the decoder never holds more than the
/// frame limit, nor more than about twice what it was given of the frame it is in.
///
/// # Panics
///
/// When one of those promises breaks.
pub fn wire_decoder(bytes: &[u8]) {
    let Some((&selector, input)) = bytes.split_first() else {
        return;
    };
    // Sizes from 1 to 16 and from 1 to 16 again, alternating: small enough to cut every field.
    let pieces = [
        usize::from(selector & 0x0f) + 1,
        usize::from(selector >> 4) + 1,
    ];
    let (whole, whole_error) = decode_wire_stream(input, &[usize::MAX]);
    let (split, split_error) = decode_wire_stream(input, &pieces);
    assert_eq!(
        whole_error, split_error,
        "reading in pieces of {pieces:?} changed the error"
    );
    assert_eq!(
        whole.len(),
        split.len(),
        "reading in pieces of {pieces:?} changed the number of frames"
    );
    let mut offset = 0;
    for ((whole_frame, whole_bytes), (_, split_bytes)) in whole.iter().zip(&split) {
        assert_eq!(
            whole_bytes,
            split_bytes,
            "reading in pieces of {pieces:?} changed a {} frame",
            whole_frame.kind_name()
        );
        assert_eq!(
            &input[offset..offset + whole_bytes.len()],
            &whole_bytes[..],
            "a {} frame does not encode back to the bytes it was decoded from",
            whole_frame.kind_name()
        );
        offset += whole_bytes.len();
        if let Frame::Prefill { rows, .. } | Frame::Decode { rows, .. } = whole_frame {
            let expected = rows.rows as usize * rows.width as usize * rows.codec.value_bytes();
            assert_eq!(
                rows.bytes.len(),
                expected,
                "an activation payload of {} x {} values in {} holds {} bytes",
                rows.rows,
                rows.width,
                rows.codec,
                rows.bytes.len()
            );
            assert_eq!(
                rows.decode().len(),
                rows.values_len(),
                "decoding activations gave another number of values than they hold"
            );
        }
    }
}

/// Feeds `input` to a decoder in pieces of the given sizes (cycled); returns each frame with its encoding,
/// and the error that ended the stream, if any.
fn decode_wire_stream(
    input: &[u8],
    pieces: &[usize],
) -> (Vec<(Frame, Vec<u8>)>, Option<WireError>) {
    let limits = WIRE_FUZZ_LIMITS;
    let mut decoder = Decoder::new(limits);
    let mut frames = Vec::new();
    let mut offset = 0;
    for &size in pieces.iter().cycle() {
        if offset == input.len() {
            break;
        }
        let mut chunk = &input[offset..offset.saturating_add(size).min(input.len())];
        while !chunk.is_empty() {
            let (taken, frame) = match decoder.decode(chunk) {
                Ok(outcome) => outcome,
                Err(error) => return (frames, Some(error)),
            };
            assert!(
                taken > 0,
                "the decoder took nothing from {} bytes",
                chunk.len()
            );
            assert!(
                decoder.held_bytes() <= limits.max_frame_bytes + 5,
                "the decoder holds {} bytes, over the frame limit of {}",
                decoder.held_bytes(),
                limits.max_frame_bytes
            );
            assert!(
                decoder.held_bytes() <= (2 * decoder.buffered() + 64).max(4096) + 5,
                "the decoder holds {} bytes for the {} it was given of a frame",
                decoder.held_bytes(),
                decoder.buffered()
            );
            chunk = &chunk[taken..];
            offset += taken;
            if let Some(frame) = frame {
                let encoded = encode_to_vec(&frame);
                frames.push((frame, encoded));
            }
        }
    }
    (frames, None)
}

/// Small limits for the HTTP target, so that random bytes reach every limit often.
pub const HTTP_FUZZ_LIMITS: HttpLimits = HttpLimits {
    max_head_bytes: 1024,
    max_headers: 8,
    max_body_bytes: 2048,
};

/// Parses the bytes after the first as a connection's byte stream with a [`RequestParser`] under
/// [`HTTP_FUZZ_LIMITS`], once whole and once in pieces whose sizes the first byte picks, and holds the parser
/// to its promises: no panic; the same requests whatever the read boundaries, and the same error when both
/// reads end in one; consumed never past the input; `NeedMore` only with (nearly) everything consumed; at
/// most one `Continue` a request; errors 4xx or 5xx; requests within the limits, with lower-cased header names
/// and a path that starts the target. Every request's body also goes through the API's chat and completion
/// decoders, which must not panic either.
///
/// # Panics
///
/// When one of those promises breaks.
pub fn http_request(bytes: &[u8]) {
    let Some((&selector, input)) = bytes.split_first() else {
        return;
    };
    // Sizes from 1 to 16 and from 1 to 61: small enough to cut every line, large enough to hold some whole.
    let pieces = [
        usize::from(selector & 0x0f) + 1,
        usize::from(selector >> 4) * 4 + 1,
    ];
    let (whole, whole_error) = parse_http_stream(input, &[usize::MAX]);
    let (split, split_error) = parse_http_stream(input, &pieces);
    assert_eq!(
        whole, split,
        "reading in pieces of {pieces:?} changed the requests"
    );
    // Read boundaries may decide whether bytes after the last line feed already show an error (the head
    // is parsed at line ends), but never which error.
    if let (Some(whole_error), Some(split_error)) = (&whole_error, &split_error) {
        assert_eq!(
            whole_error, split_error,
            "reading in pieces of {pieces:?} changed the error"
        );
    }
    for request in &whole {
        // The API decoders see whatever body a client sends; only a panic is a failure here.
        let _ = decode_chat(&request.body);
        let _ = decode_completion(&request.body);
    }
}

/// Feeds `input` to a request parser as a session would, in pieces of the given sizes (cycled), dropping what
/// each call consumed; returns the requests and the error that ended the stream, if any.
fn parse_http_stream(input: &[u8], pieces: &[usize]) -> (Vec<Request>, Option<HttpError>) {
    let limits = HTTP_FUZZ_LIMITS;
    let mut parser = RequestParser::new(limits);
    let mut requests = Vec::new();
    let mut pending: Vec<u8> = Vec::new();
    let mut continued = false;
    let mut offset = 0;
    for &size in pieces.iter().cycle() {
        if offset == input.len() {
            break;
        }
        let end = offset.saturating_add(size).min(input.len());
        pending.extend_from_slice(&input[offset..end]);
        offset = end;
        loop {
            let (consumed, parsed) = match parser.parse(&pending) {
                Ok(outcome) => outcome,
                Err(error) => {
                    assert!(
                        (400..600).contains(&error.status) && !error.message.is_empty(),
                        "an error is not a 4xx or 5xx with a message: {error:?}"
                    );
                    return (requests, Some(error));
                }
            };
            assert!(
                consumed <= pending.len(),
                "the parser consumed {consumed} of {} bytes",
                pending.len()
            );
            pending.drain(..consumed);
            match parsed {
                Parsed::NeedMore => {
                    assert!(
                        pending.len() <= 1,
                        "the parser asked for more with {} bytes unconsumed",
                        pending.len()
                    );
                    break;
                }
                Parsed::Continue => {
                    assert!(
                        !continued,
                        "the parser returned Continue twice for one request"
                    );
                    assert!(
                        parser.in_progress(),
                        "after Continue the request is not in progress"
                    );
                    continued = true;
                }
                Parsed::Request(request) => {
                    check_http_request(&request, limits);
                    assert!(
                        !parser.in_progress(),
                        "a returned request is still in progress"
                    );
                    continued = false;
                    requests.push(request);
                }
            }
        }
    }
    (requests, None)
}

/// Panics when `request` breaks what the parser promises of every request.
fn check_http_request(request: &Request, limits: HttpLimits) {
    assert!(
        request.body.len() <= limits.max_body_bytes,
        "a body of {} bytes passed the limit of {}",
        request.body.len(),
        limits.max_body_bytes
    );
    assert!(
        request.headers.len() <= limits.max_headers,
        "{} headers passed the limit of {}",
        request.headers.len(),
        limits.max_headers
    );
    assert!(
        request.version <= 1,
        "a request of HTTP/1.{}",
        request.version
    );
    assert!(
        request.target.starts_with(&request.path) && !request.path.contains('?'),
        "the path {:?} is not the target {:?} before its query",
        request.path,
        request.target
    );
    assert!(!request.method.is_empty(), "a request without a method");
    for (name, value) in &request.headers {
        assert!(
            !name.bytes().any(|byte| byte.is_ascii_uppercase()),
            "the header name {name:?} is not lower-cased"
        );
        assert_eq!(
            value.trim_matches([' ', '\t']),
            value,
            "the value of {name:?} is not trimmed"
        );
    }
}
