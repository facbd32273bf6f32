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

    /// [`push`](Self::push), and how many characters at the head of the text it returns belong before this
    /// token: 1 when bytes held back for an unfinished character come out as U+FFFD because this token cannot
    /// finish it (the U+FFFD belongs to the token that brought its first byte, even if it takes some of this
    /// token's bytes too), else 0 (a character this token finishes starts before it, so the token's text starts
    /// where that character does). So a token's place in the output, in characters, is what came out before
    /// it plus this.
    pub fn push_placed(&mut self, id: u32) -> (String, usize) {
        let held = self.pending.len();
        let earlier = if held == 0 {
            0
        } else {
            let mut joined = self.pending.clone();
            joined.extend_from_slice(self.tokenizer.piece(id, self.special));
            // What is held is the start of a character, so an error at byte 0 with a known length is that
            // character broken for good (no later byte can finish it).
            match std::str::from_utf8(&joined) {
                Err(error) if error.valid_up_to() == 0 && error.error_len().is_some() => 1,
                _ => 0,
            }
        };
        (self.push(id), earlier)
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
