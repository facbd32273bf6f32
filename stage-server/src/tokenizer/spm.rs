//! SentencePiece-style merges (`tokenizer.ggml.model = llama`): join neighbours into the best-scoring token.
//!
//! Start from single characters; repeatedly merge the adjacent pair whose concatenation is the token with
//! the highest score (leftmost on ties); spell whatever never became a token as `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::hash::FastMap;

/// A merge candidate: the pair `(left, right)` whose text is a token with `score`.
#[derive(Debug)]
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the pair when queued; a mismatch later means it went stale.
    length: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Candidate {
    /// Higher score first; on equal scores the leftmost pair first.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    length: usize,
    previous: Option<usize>,
    next: Option<usize>,
}

/// Encodes `text` (spaces already replaced by `▁`) and appends the tokens to `output`.
///
/// `byte_token` maps a byte to its `<0xXX>` token; a byte without one yields `Err(byte)`.
pub(crate) fn encode(
    text: &str,
    token_to_id: &FastMap<String, u32>,
    scores: &[f32],
    byte_token: &dyn Fn(u8) -> Option<u32>,
    output: &mut Vec<u32>,
) -> Result<(), u8> {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let index = symbols.len();
        symbols.push(Symbol {
            start,
            length: c.len_utf8(),
            previous: index.checked_sub(1),
            next: None,
        });
        if index > 0 {
            symbols[index - 1].next = Some(index);
        }
    }
    let mut queue = BinaryHeap::new();
    let push =
        |queue: &mut BinaryHeap<Candidate>, symbols: &[Symbol], left: usize, right: usize| {
            let start = symbols[left].start;
            let end = symbols[right].start + symbols[right].length;
            if let Some(&token) = token_to_id.get(&text[start..end]) {
                queue.push(Candidate {
                    score: scores.get(token as usize).copied().unwrap_or(0.0),
                    left,
                    right,
                    length: end - start,
                });
            }
        };
    for index in 1..symbols.len() {
        push(&mut queue, &symbols, index - 1, index);
    }
    while let Some(candidate) = queue.pop() {
        let (left, right) = (symbols[candidate.left], symbols[candidate.right]);
        if left.length == 0 || right.length == 0 || left.length + right.length != candidate.length {
            continue;
        }
        symbols[candidate.left].length += right.length;
        symbols[candidate.left].next = right.next;
        symbols[candidate.right].length = 0;
        if let Some(after) = right.next {
            symbols[after].previous = Some(candidate.left);
        }
        if let Some(before) = left.previous {
            push(&mut queue, &symbols, before, candidate.left);
        }
        if let Some(after) = right.next {
            push(&mut queue, &symbols, candidate.left, after);
        }
    }
    let mut cursor = (!symbols.is_empty()).then_some(0);
    while let Some(index) = cursor {
        let symbol = symbols[index];
        cursor = symbol.next;
        let piece = &text[symbol.start..symbol.start + symbol.length];
        if let Some(&token) = token_to_id.get(piece) {
            output.push(token);
            continue;
        }
        for byte in piece.bytes() {
            output.push(byte_token(byte).ok_or(byte)?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_scoring_pair_merges_first_and_unknown_characters_become_bytes() {
        let vocabulary = ["▁", "a", "b", "▁a", "ab", "▁ab", "<0xC3>", "<0xA9>"];
        let scores = [-1.0, -1.0, -1.0, -2.0, -0.5, -0.1, 0.0, 0.0];
        let token_to_id: FastMap<String, u32> = vocabulary
            .iter()
            .enumerate()
            .map(|(id, text)| (text.to_string(), id as u32))
            .collect();
        let byte_token = |byte: u8| match byte {
            0xc3 => Some(6),
            0xa9 => Some(7),
            _ => None,
        };
        let mut output = Vec::new();
        encode("▁abé", &token_to_id, &scores, &byte_token, &mut output).unwrap();
        // "ab" (-0.5) beats "▁a" (-2.0); then "▁" + "ab" makes "▁ab"; é has no token.
        assert_eq!(output, [5, 6, 7]);
        let failure = encode("▁x", &token_to_id, &scores, &byte_token, &mut Vec::new());
        assert_eq!(
            failure,
            Err(b'x'),
            "a byte without a token must be reported"
        );
    }
}
