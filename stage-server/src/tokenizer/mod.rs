//! Tokenizers read from GGUF metadata: GPT-2 style BPE and SentencePiece, with streaming detokenisation.
//!
//! The behaviour follows llama.cpp's `llama_tokenize` so that the same text gives the same ids:
//!
//! ```text
//!   text ──► special-token partition ──► per text fragment:
//!            (parse_special: control      BPE: pre-tokenizer words ─► byte alphabet ─► merges by rank
//!             tokens too; user-defined    SPM: " "→"▁" (+ leading "▁") ─► merges by score ─► <0xXX> bytes
//!             tokens always)
//! ```
//!
//! Decoding maps each id to its bytes (byte-level BPE undoes the byte alphabet, SentencePiece turns `▁`
//! back into a space and `<0xXX>` into its byte). [`StreamDecoder`] holds back the bytes of an unfinished
//! UTF-8 character so a stream never shows half a character.

mod bpe;
pub mod chat;
mod hash;
mod pretokenize;
mod spm;
mod stream;
mod unicode;

use std::collections::{HashMap, HashSet};

use candle_core::quantized::gguf_file::{Content, Value};

pub use stream::StreamDecoder;

use bpe::{Merges, Scratch};
use hash::FastMap;
use pretokenize::PreTokenizer;
use unicode::ByteAlphabet;

/// Why a tokenizer could not be built or could not encode.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The GGUF metadata lacks a key the tokenizer needs.
    #[error(
        "the model has no tokenizer metadata key `{0}`; it cannot tokenize text (pass --prompt-ids instead)"
    )]
    MissingKey(&'static str),
    /// A metadata key holds a value of the wrong type.
    #[error(
        "tokenizer metadata key `{key}` should be {expected}; the file is malformed or from an unknown converter"
    )]
    WrongType {
        /// The key.
        key: &'static str,
        /// What the key should hold.
        expected: &'static str,
    },
    /// A per-token array is shorter than the token list.
    #[error(
        "tokenizer metadata key `{key}` has {length} entries but the vocabulary has {tokens} tokens; the file is malformed"
    )]
    ArrayTooShort {
        /// The key.
        key: &'static str,
        /// Entries in the array.
        length: usize,
        /// Tokens in `tokenizer.ggml.tokens`.
        tokens: usize,
    },
    /// `tokenizer.ggml.model` names a tokenizer this crate does not implement.
    #[error(
        "tokenizer model `{0}` is not supported (only `gpt2` byte-level BPE and `llama` SentencePiece are); pass --prompt-ids instead"
    )]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a BPE pre-tokenizer this crate does not implement.
    #[error(
        "BPE pre-tokenizer `{0}` is not supported (supported: gpt-2, smollm/starcoder, llama3 and qwen2 families); pass --prompt-ids instead"
    )]
    UnsupportedPreTokenizer(String),
    /// SentencePiece byte fallback met a byte with no `<0xXX>` token.
    #[error("the vocabulary has no byte token for byte 0x{0:02X}, so this text cannot be encoded")]
    NoTokenForByte(u8),
}

/// Which of the two tokenizer families a vocabulary uses.
#[derive(Debug)]
enum Model {
    /// Byte-level BPE (`tokenizer.ggml.model = gpt2`).
    BytePairs {
        merges: Merges,
        pre_tokenizer: PreTokenizer,
        /// Take a word that is a token whole, without merges (Llama 3 family).
        ignore_merges: bool,
    },
    /// SentencePiece (`tokenizer.ggml.model = llama`).
    SentencePiece {
        scores: Vec<f32>,
        /// The `<0xXX>` token of each byte.
        byte_tokens: Box<[Option<u32>; 256]>,
    },
}

/// Token attributes, from `tokenizer.ggml.token_type` plus llama.cpp's by-name corrections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Attributes(u8);

impl Attributes {
    const NORMAL: u8 = 1;
    const UNKNOWN: u8 = 2;
    const CONTROL: u8 = 4;
    const USER_DEFINED: u8 = 8;
    const UNUSED: u8 = 16;
    const BYTE: u8 = 32;
    const UNDEFINED: u8 = 64;

    /// From a GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
    fn from_token_type(token_type: i64) -> Self {
        Self(match token_type {
            1 => Self::NORMAL,
            2 => Self::UNKNOWN,
            3 => Self::CONTROL,
            4 => Self::USER_DEFINED,
            5 => Self::UNUSED,
            6 => Self::BYTE,
            _ => Self::UNDEFINED,
        })
    }

    fn has(self, flags: u8) -> bool {
        self.0 & flags != 0
    }
}

/// How special (control and unknown) tokens render when decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecialTokens {
    /// Control tokens such as `<|im_end|>` produce no text (llama.cpp's default output).
    Skip,
    /// Control tokens produce their own text, so text encoded with `parse_special` round-trips.
    Render,
}

/// A piece of input text after special tokens have been cut out.
#[derive(Clone, Copy, Debug)]
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// A tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata.
///
/// Building it interns the vocabulary and merges (about 50k to 260k strings; tens of milliseconds).
/// Encoding costs one pass over the special tokens plus merges per word; the tokenizer is immutable and
/// can be shared between threads. Its `Debug` output is a summary, not the vocabulary.
pub struct Tokenizer {
    model: Model,
    /// Vocabulary text of each token (empty entries replaced as llama.cpp does).
    texts: Vec<String>,
    attributes: Vec<Attributes>,
    /// The decoded bytes of each token with control tokens rendered as their text.
    pieces: Vec<Box<[u8]>>,
    token_to_id: FastMap<String, u32>,
    /// Control, user-defined and unknown tokens, longest text first: the partition order.
    special_tokens: Vec<u32>,
    end_of_generation: HashSet<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

/// Token texts that end a turn in common chat formats (llama.cpp's list, which keys on text because
/// converters do not mark them); they are end-of-generation tokens and are forced to control tokens.
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle prefix / suffix / middle markers: not end-of-generation, but forced to control
/// tokens like the others (llama.cpp's by-name detection).
const FILL_IN_THE_MIDDLE_MARKERS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];

/// Fill-in-the-middle padding / repository / file-separator tokens, also end-of-generation.
const FILL_IN_THE_MIDDLE_TEXTS: &[&str] = &[
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

impl Tokenizer {
    /// Builds the tokenizer the file describes.
    ///
    /// Errors name the missing or malformed key, or the unsupported tokenizer model / pre-tokenizer.
    pub fn from_gguf(content: &Content) -> Result<Self, TokenizerError> {
        let metadata = Metadata(&content.metadata);
        let model_name = metadata.string("tokenizer.ggml.model")?;
        let mut texts = metadata.string_array("tokenizer.ggml.tokens")?;
        for (id, text) in texts.iter_mut().enumerate() {
            if text.is_empty() {
                *text = format!("[EMPTY_{id}]");
            }
        }
        let count = texts.len();
        let mut attributes = match metadata.optional_integer_array("tokenizer.ggml.token_type")? {
            Some(types) => {
                check_length("tokenizer.ggml.token_type", types.len(), count)?;
                types
                    .iter()
                    .take(count)
                    .map(|&t| Attributes::from_token_type(t))
                    .collect()
            }
            None => vec![Attributes(Attributes::NORMAL); count],
        };
        let mut token_to_id = FastMap::with_capacity_and_hasher(count, Default::default());
        for (id, text) in texts.iter().enumerate() {
            token_to_id.insert(text.clone(), id as u32);
        }
        let valid = |id: u32| (id as usize) < count;

        let (mut bos, mut eos, mut add_bos, mut add_space_prefix, model) = match model_name.as_str()
        {
            "gpt2" => {
                let pre = metadata.optional_string("tokenizer.ggml.pre")?;
                let pre_name = pre.unwrap_or_else(|| "(none)".to_string());
                let spec = PreTokenizer::from_name(&pre_name)
                    .ok_or(TokenizerError::UnsupportedPreTokenizer(pre_name))?;
                let merges = metadata.string_array("tokenizer.ggml.merges")?;
                let model = Model::BytePairs {
                    merges: Merges::new(&texts, &merges),
                    pre_tokenizer: spec.pre_tokenizer,
                    ignore_merges: spec.ignore_merges,
                };
                (Some(11), Some(11), spec.add_bos_default, false, model)
            }
            "llama" => {
                let scores = match metadata.optional_float_array("tokenizer.ggml.scores")? {
                    Some(scores) => {
                        check_length("tokenizer.ggml.scores", scores.len(), count)?;
                        scores
                    }
                    None => vec![0.0; count],
                };
                let mut byte_tokens = Box::new([None; 256]);
                for (byte, slot) in (0u8..=255).zip(byte_tokens.iter_mut()) {
                    *slot = token_to_id
                        .get(&format!("<0x{byte:02X}>"))
                        .copied()
                        .or_else(|| {
                            // llama.cpp falls back to the byte itself as a one-character token.
                            byte.is_ascii()
                                .then(|| token_to_id.get(&char::from(byte).to_string()).copied())
                                .flatten()
                        });
                }
                let model = Model::SentencePiece {
                    scores,
                    byte_tokens,
                };
                (Some(1), Some(2), true, true, model)
            }
            _ => return Err(TokenizerError::UnsupportedModel(model_name)),
        };
        bos = bos.filter(|&id| valid(id));
        eos = eos.filter(|&id| valid(id));
        if let Some(id) = metadata.optional_integer("tokenizer.ggml.bos_token_id")? {
            bos = u32::try_from(id).ok().filter(|&id| valid(id)).or(bos);
        }
        if let Some(id) = metadata.optional_integer("tokenizer.ggml.eos_token_id")? {
            eos = u32::try_from(id).ok().filter(|&id| valid(id)).or(eos);
        }
        if let Some(flag) = metadata.optional_bool("tokenizer.ggml.add_bos_token")? {
            add_bos = flag;
        }
        let add_eos = metadata
            .optional_bool("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false);
        if let Some(flag) = metadata.optional_bool("tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = flag;
        }

        // End of generation: EOS, the end-of-turn tokens named in metadata, and the known texts.
        let mut end_of_generation = HashSet::new();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = metadata.optional_integer(key)?
                && let Ok(id) = u32::try_from(id)
                && valid(id)
            {
                end_of_generation.insert(id);
            }
        }
        for text in END_OF_GENERATION_TEXTS
            .iter()
            .chain(FILL_IN_THE_MIDDLE_TEXTS)
        {
            if let Some(&id) = token_to_id.get(*text) {
                end_of_generation.insert(id);
            }
        }
        // llama.cpp forces the tokens it recognises by name to control tokens, which also makes them
        // partition as special tokens.
        for text in END_OF_GENERATION_TEXTS
            .iter()
            .chain(FILL_IN_THE_MIDDLE_TEXTS)
            .chain(FILL_IN_THE_MIDDLE_MARKERS)
        {
            if let Some(&id) = token_to_id.get(*text) {
                attributes[id as usize].0 |= Attributes::CONTROL;
            }
        }
        // Formats where `<|end|>` or `</s>` is ordinary text next to their real end markers (llama.cpp's
        // workarounds for o200k-harmony / solar-open and gemma4 / paddleocr).
        let has = |text: &str| {
            token_to_id
                .get(text)
                .is_some_and(|id| end_of_generation.contains(id))
        };
        let demote =
            if (has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>")) {
                Some(("<|end|>", Attributes::USER_DEFINED))
            } else if has("<|tool_response>") {
                Some(("</s>", Attributes::NORMAL))
            } else {
                None
            };
        if let Some((text, attribute)) = demote
            && let Some(&id) = token_to_id.get(text)
        {
            end_of_generation.remove(&id);
            attributes[id as usize] = Attributes(attribute);
        }
        end_of_generation.extend(eos);

        let mut special_tokens: Vec<u32> = (0..count as u32)
            .filter(|&id| {
                attributes[id as usize]
                    .has(Attributes::CONTROL | Attributes::USER_DEFINED | Attributes::UNKNOWN)
            })
            .collect();
        special_tokens.sort_by_key(|&id| std::cmp::Reverse(texts[id as usize].len()));

        let mut tokenizer = Self {
            model,
            texts,
            attributes,
            pieces: Vec::new(),
            token_to_id,
            special_tokens,
            end_of_generation,
            bos,
            eos,
            add_bos,
            add_eos,
            add_space_prefix,
        };
        tokenizer.pieces = (0..count)
            .map(|id| tokenizer.render_piece(id).into_boxed_slice())
            .collect();
        Ok(tokenizer)
    }

    /// Encodes `text`; `add_special` adds BOS (and EOS) when the model asks for it, `parse_special` turns
    /// control-token text such as `<|im_start|>` into its id (llama.cpp's `llama_tokenize` flags).
    /// User-defined tokens are matched literally either way, as llama.cpp does.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let fragments = self.partition(text, parse_special);
        let mut output = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            output.extend(self.bos);
        }
        match &self.model {
            Model::BytePairs {
                merges,
                pre_tokenizer,
                ignore_merges,
            } => {
                let alphabet = ByteAlphabet::get();
                let mut spelled = String::new();
                let mut scratch = Scratch::default();
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => output.push(id),
                        Fragment::Text(text) => {
                            for word in pre_tokenizer.split(text) {
                                spelled.clear();
                                alphabet.encode_into(word, &mut spelled);
                                merges.encode_word(
                                    &spelled,
                                    *ignore_merges,
                                    &mut scratch,
                                    &mut output,
                                );
                            }
                        }
                    }
                }
            }
            Model::SentencePiece {
                scores,
                byte_tokens,
            } => {
                let byte_token = |byte: u8| byte_tokens[byte as usize];
                let mut previous_was_special = true;
                let mut escaped = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => {
                            output.push(id);
                            previous_was_special = true;
                        }
                        Fragment::Text(text) => {
                            escaped.clear();
                            if self.add_space_prefix && previous_was_special {
                                escaped.push('▁');
                            }
                            for c in text.chars() {
                                escaped.push(if c == ' ' { '▁' } else { c });
                            }
                            spm::encode(
                                &escaped,
                                &self.token_to_id,
                                scores,
                                &byte_token,
                                &mut output,
                            )
                            .map_err(TokenizerError::NoTokenForByte)?;
                            previous_was_special = false;
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            output.extend(self.eos);
        }
        Ok(output)
    }

    /// Decodes `ids` to text as llama.cpp's detokenizer does without clean-up: control tokens produce
    /// nothing, and with SentencePiece's space prefix the first token's leading space is dropped.
    /// Invalid UTF-8 (an id sequence cut inside a character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, SpecialTokens::Skip)
    }

    /// Decodes `ids`, choosing how control tokens render.
    pub fn decode_with(&self, ids: &[u32], special: SpecialTokens) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for (index, &id) in ids.iter().enumerate() {
            let piece = self.piece(id, special);
            let piece = match (index, self.add_space_prefix, piece) {
                (0, true, [b' ', rest @ ..]) => rest,
                (_, _, piece) => piece,
            };
            bytes.extend_from_slice(piece);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes token `id` stands for, control tokens rendered as their text; empty for an unknown id.
    /// A byte token or part of a byte-level BPE token may hold only part of a UTF-8 character.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], |piece| piece)
    }

    /// The token's bytes as text, lossily (a partial UTF-8 character becomes U+FFFD).
    pub fn token_to_piece(&self, id: u32) -> String {
        String::from_utf8_lossy(self.token_bytes(id)).into_owned()
    }

    /// The token's vocabulary string as stored in the file (`Ġthe`, `▁the`, `<|im_end|>`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The id of a vocabulary string, if the vocabulary has it.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// The beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether `encode(.., add_special = true, ..)` puts BOS first (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// Whether `encode(.., add_special = true, ..)` puts EOS last (`tokenizer.ggml.add_eos_token`).
    pub fn add_eos(&self) -> bool {
        self.add_eos && self.eos.is_some()
    }

    /// Whether generation should stop at `id`: EOS, end-of-turn tokens (`<|im_end|>`, `<end_of_turn>`,
    /// `<|eot_id|>` ...), and the ids the metadata names as end of turn or message.
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.end_of_generation.contains(&id)
    }

    /// All end-of-generation ids, sorted.
    pub fn end_of_generation_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.end_of_generation.iter().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Whether `id` is a control or unknown token (its text is not part of ordinary output).
    pub fn is_control(&self, id: u32) -> bool {
        self.attributes
            .get(id as usize)
            .is_some_and(|a| a.has(Attributes::CONTROL | Attributes::UNKNOWN))
    }

    /// Number of tokens in the vocabulary (the logits' width).
    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    /// The bytes of `id` under `special`.
    fn piece(&self, id: u32, special: SpecialTokens) -> &[u8] {
        if special == SpecialTokens::Skip && self.is_control(id) {
            return &[];
        }
        self.token_bytes(id)
    }

    /// llama.cpp's token-to-piece with special tokens rendered.
    fn render_piece(&self, id: usize) -> Vec<u8> {
        let text = &self.texts[id];
        let attributes = self.attributes[id];
        if attributes.has(Attributes::CONTROL | Attributes::UNKNOWN | Attributes::USER_DEFINED) {
            return text.as_bytes().to_vec();
        }
        if attributes.has(Attributes::NORMAL) {
            return match self.model {
                Model::SentencePiece { .. } => text.replace('▁', " ").into_bytes(),
                Model::BytePairs { .. } => {
                    let alphabet = ByteAlphabet::get();
                    let mut bytes = Vec::with_capacity(text.len());
                    for c in text.chars() {
                        match alphabet.byte_of(c) {
                            Some(byte) => bytes.push(byte),
                            // Not in the byte alphabet: keep the character as it is.
                            None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    bytes
                }
            };
        }
        if attributes.has(Attributes::BYTE) {
            return match parse_byte_token(text) {
                Some(byte) => vec![byte],
                None => text.as_bytes().to_vec(),
            };
        }
        // Unused and undefined tokens render as nothing.
        Vec::new()
    }

    /// Cuts special tokens out of `text`, longest first, as llama.cpp's partition does.
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut fragments = Vec::new();
        if text.is_empty() {
            return fragments;
        }
        fragments.push(Fragment::Text(text));
        // Most special tokens start with a byte the text lacks (often `<`): skip those without a search.
        let mut present = [false; 256];
        for &byte in text.as_bytes() {
            present[byte as usize] = true;
        }
        for &id in &self.special_tokens {
            let attributes = self.attributes[id as usize];
            if !parse_special && attributes.has(Attributes::CONTROL | Attributes::UNKNOWN) {
                continue;
            }
            let special = self.texts[id as usize].as_str();
            if !special.bytes().all(|byte| present[byte as usize]) {
                continue;
            }
            let occurs = fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(special)));
            if !occurs {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(at) = rest.find(special) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + special.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let model = match &self.model {
            Model::BytePairs { pre_tokenizer, .. } => format!("byte-level BPE ({pre_tokenizer:?})"),
            Model::SentencePiece { .. } => "SentencePiece".to_string(),
        };
        formatter
            .debug_struct("Tokenizer")
            .field("model", &model)
            .field("vocab_size", &self.vocab_size())
            .field("special_tokens", &self.special_tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("add_space_prefix", &self.add_space_prefix)
            .field("end_of_generation", &self.end_of_generation_ids())
            .finish_non_exhaustive()
    }
}

/// `<0xAB>` -> 0xAB.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

fn check_length(key: &'static str, length: usize, tokens: usize) -> Result<(), TokenizerError> {
    if length < tokens {
        return Err(TokenizerError::ArrayTooShort {
            key,
            length,
            tokens,
        });
    }
    Ok(())
}

/// Typed access to GGUF metadata with errors naming the key.
struct Metadata<'c>(&'c HashMap<String, Value>);

impl Metadata<'_> {
    fn optional_string(&self, key: &'static str) -> Result<Option<String>, TokenizerError> {
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(_) => Err(TokenizerError::WrongType {
                key,
                expected: "a string",
            }),
        }
    }

    fn string(&self, key: &'static str) -> Result<String, TokenizerError> {
        self.optional_string(key)?
            .ok_or(TokenizerError::MissingKey(key))
    }

    fn string_array(&self, key: &'static str) -> Result<Vec<String>, TokenizerError> {
        let wrong = TokenizerError::WrongType {
            key,
            expected: "an array of strings",
        };
        let Some(value) = self.0.get(key) else {
            return Err(TokenizerError::MissingKey(key));
        };
        let Value::Array(items) = value else {
            return Err(wrong);
        };
        items
            .iter()
            .map(|item| match item {
                Value::String(text) => Ok(text.clone()),
                _ => Err(TokenizerError::WrongType {
                    key,
                    expected: "an array of strings",
                }),
            })
            .collect()
    }

    fn optional_integer(&self, key: &'static str) -> Result<Option<i64>, TokenizerError> {
        match self.0.get(key) {
            None => Ok(None),
            Some(value) => integer(value).map(Some).ok_or(TokenizerError::WrongType {
                key,
                expected: "an integer",
            }),
        }
    }

    fn optional_bool(&self, key: &'static str) -> Result<Option<bool>, TokenizerError> {
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::Bool(flag)) => Ok(Some(*flag)),
            Some(_) => Err(TokenizerError::WrongType {
                key,
                expected: "a boolean",
            }),
        }
    }

    fn optional_integer_array(
        &self,
        key: &'static str,
    ) -> Result<Option<Vec<i64>>, TokenizerError> {
        let wrong = || TokenizerError::WrongType {
            key,
            expected: "an array of integers",
        };
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| integer(item).ok_or_else(wrong))
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(wrong()),
        }
    }

    fn optional_float_array(&self, key: &'static str) -> Result<Option<Vec<f32>>, TokenizerError> {
        let wrong = || TokenizerError::WrongType {
            key,
            expected: "an array of numbers",
        };
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| match item {
                    Value::F32(x) => Ok(*x),
                    Value::F64(x) => Ok(*x as f32),
                    other => integer(other).map(|x| x as f32).ok_or_else(wrong),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(wrong()),
        }
    }
}

fn integer(value: &Value) -> Option<i64> {
    Some(match value {
        Value::U8(x) => i64::from(*x),
        Value::I8(x) => i64::from(*x),
        Value::U16(x) => i64::from(*x),
        Value::I16(x) => i64::from(*x),
        Value::U32(x) => i64::from(*x),
        Value::I32(x) => i64::from(*x),
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}
