//! Streaming detokenisation: turn ids into text one at a time without ever splitting a UTF-8 character.

use super::{SpecialTokens, Tokenizer};

/// Turns a stream of token ids into text, emitting only complete UTF-8 characters.
///
/// Byte-level BPE and SentencePiece byte tokens can end inside a character (an emoji is often three or
/// four tokens). `push` returns the text that is complete so far and keeps the unfinished bytes; a byte
/// sequence that can never become valid UTF-8 is replaced by U+FFFD as soon as that is certain, so the
/// stream never stalls. `finish` flushes whatever is left (lossily).
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    special: SpecialTokens,
    pending: Vec<u8>,
}

impl<'t> StreamDecoder<'t> {
    /// A decoder that renders control tokens as nothing, like [`Tokenizer::decode`].
    pub fn new(tokenizer: &'t Tokenizer) -> Self {
        Self::with_special(tokenizer, SpecialTokens::Skip)
    }

    /// A decoder with a choice of how control tokens render.
    pub fn with_special(tokenizer: &'t Tokenizer, special: SpecialTokens) -> Self {
        Self {
            tokenizer,
            special,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text completed by it (often empty while a character is unfinished).
    pub fn push(&mut self, id: u32) -> String {
        self.pending
            .extend_from_slice(self.tokenizer.piece(id, self.special));
        let mut text = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(valid) => {
                    text.push_str(valid);
                    self.pending.clear();
                    return text;
                }
                Err(error) => {
                    let valid_up_to = error.valid_up_to();
                    // The prefix was just checked to be valid UTF-8.
                    text.push_str(&String::from_utf8_lossy(&self.pending[..valid_up_to]));
                    match error.error_len() {
                        // The tail is an unfinished character: keep it for the next token.
                        None => {
                            self.pending.drain(..valid_up_to);
                            return text;
                        }
                        // Bytes that no continuation can repair: replace them and go on.
                        Some(invalid) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid_up_to + invalid);
                        }
                    }
                }
            }
        }
    }

    /// Ends the stream: the unfinished bytes, if any, as U+FFFD.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }
}
