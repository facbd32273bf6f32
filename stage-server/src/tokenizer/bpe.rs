//! Byte-level BPE merges (GPT-2 style): apply `tokenizer.ggml.merges` by rank to the characters of one word.
//!
//! Strings are interned once at load time: every token text, both sides of every merge and every merge
//! result get a piece number, so a merge step is one hash lookup on a pair of integers and never allocates.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::hash::FastMap;

/// A piece number; `NO_PIECE` marks text that is neither a token nor a merge side.
type Piece = u32;
const NO_PIECE: Piece = u32::MAX;

/// A queued merge: (rank, left symbol, right symbol, left piece, right piece), smallest first.
type Candidate = Reverse<(u32, usize, usize, Piece, Piece)>;

/// The merge table of a byte-level BPE vocabulary.
#[derive(Debug)]
pub(crate) struct Merges {
    /// Piece number of every interned string.
    pieces: FastMap<Box<str>, Piece>,
    /// The token id of each piece, if the piece is a token.
    piece_token: Vec<Option<u32>>,
    /// `(left, right)` -> (rank, merged piece).
    ranks: FastMap<(Piece, Piece), (u32, Piece)>,
}

/// Buffers reused from word to word so that merging allocates only while they grow.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Candidate>,
}

/// One symbol of a word during merging: a byte range of the word and its neighbours.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    length: usize,
    piece: Piece,
    previous: Option<usize>,
    next: Option<usize>,
}

impl Merges {
    /// Interns the vocabulary and the merges (`"left right"` strings, rank = position).
    pub fn new(tokens: &[String], merges: &[String]) -> Self {
        let mut table = Self {
            pieces: FastMap::with_capacity_and_hasher(
                tokens.len() + merges.len(),
                Default::default(),
            ),
            piece_token: Vec::with_capacity(tokens.len() + merges.len()),
            ranks: FastMap::with_capacity_and_hasher(merges.len(), Default::default()),
        };
        for (id, text) in tokens.iter().enumerate() {
            let piece = table.intern(text);
            // A later duplicate wins, as in llama.cpp's text-to-token map.
            table.piece_token[piece as usize] = Some(id as u32);
        }
        for (rank, merge) in merges.iter().enumerate() {
            // The separator is the first space after the first character: a side may itself be " ".
            let separator = merge.bytes().skip(1).position(|byte| byte == b' ');
            let (left, right) = match separator {
                Some(at) => (&merge[..at + 1], &merge[at + 2..]),
                None => ("", ""),
            };
            let left_piece = table.intern(left);
            let right_piece = table.intern(right);
            let merged = table.intern(&format!("{left}{right}"));
            // The first occurrence of a pair keeps its rank (llama.cpp's map emplace keeps the first).
            table
                .ranks
                .entry((left_piece, right_piece))
                .or_insert((rank as u32, merged));
        }
        table
    }

    fn intern(&mut self, text: &str) -> Piece {
        if let Some(&piece) = self.pieces.get(text) {
            return piece;
        }
        let piece = self.piece_token.len() as Piece;
        self.pieces.insert(text.into(), piece);
        self.piece_token.push(None);
        piece
    }

    fn piece_of(&self, text: &str) -> Piece {
        self.pieces.get(text).copied().unwrap_or(NO_PIECE)
    }

    /// The token of a piece, if it is one.
    fn token_of(&self, piece: Piece) -> Option<u32> {
        self.piece_token.get(piece as usize).copied().flatten()
    }

    /// Merges one word (already spelled in the byte alphabet) and appends its tokens to `output`.
    /// `whole_word_token` short-cuts words that are tokens themselves (llama.cpp's `ignore_merges`).
    pub fn encode_word(
        &self,
        word: &str,
        whole_word_token: bool,
        scratch: &mut Scratch,
        output: &mut Vec<u32>,
    ) {
        if whole_word_token && let Some(token) = self.token_of(self.piece_of(word)) {
            output.push(token);
            return;
        }
        let Scratch { symbols, queue } = scratch;
        symbols.clear();
        queue.clear();
        for (start, c) in word.char_indices() {
            let index = symbols.len();
            symbols.push(Symbol {
                start,
                length: c.len_utf8(),
                piece: self.piece_of(&word[start..start + c.len_utf8()]),
                previous: index.checked_sub(1),
                next: None,
            });
            if index > 0 {
                symbols[index - 1].next = Some(index);
            }
        }
        // Candidates ordered by rank, then leftmost first, as llama.cpp's queue orders them.
        let push = |queue: &mut BinaryHeap<_>, symbols: &[Symbol], left: usize, right: usize| {
            let (left_piece, right_piece) = (symbols[left].piece, symbols[right].piece);
            if let Some(&(rank, _)) = self.ranks.get(&(left_piece, right_piece)) {
                queue.push(Reverse((rank, left, right, left_piece, right_piece)));
            }
        };
        for index in 1..symbols.len() {
            push(queue, symbols, index - 1, index);
        }
        while let Some(Reverse((_, left, right, left_piece, right_piece))) = queue.pop() {
            let (left_symbol, right_symbol) = (symbols[left], symbols[right]);
            // Stale: one side has been merged away or grown since the candidate was queued.
            if left_symbol.length == 0
                || right_symbol.length == 0
                || left_symbol.piece != left_piece
                || right_symbol.piece != right_piece
            {
                continue;
            }
            let Some(&(_, merged)) = self.ranks.get(&(left_piece, right_piece)) else {
                continue;
            };
            symbols[left].length += right_symbol.length;
            symbols[left].piece = merged;
            symbols[left].next = right_symbol.next;
            symbols[right].length = 0;
            if let Some(after) = right_symbol.next {
                symbols[after].previous = Some(left);
            }
            if let Some(before) = symbols[left].previous {
                push(queue, symbols, before, left);
            }
            if let Some(after) = symbols[left].next {
                push(queue, symbols, left, after);
            }
        }
        let mut cursor = (!symbols.is_empty()).then_some(0);
        while let Some(index) = cursor {
            let symbol = symbols[index];
            cursor = symbol.next;
            if let Some(token) = self.token_of(symbol.piece) {
                output.push(token);
                continue;
            }
            // Not a token: llama.cpp falls back to single-byte tokens, dropping bytes that have none.
            let text = &word[symbol.start..symbol.start + symbol.length];
            for byte in text.bytes().filter(u8::is_ascii) {
                let mut buffer = [0u8; 4];
                let single = char::from(byte).encode_utf8(&mut buffer);
                if let Some(token) = self.token_of(self.piece_of(single)) {
                    output.push(token);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn merges_apply_lowest_rank_first() {
        let tokens = strings(&["a", "b", "c", "ab", "bc", "abc"]);
        // "b c" outranks "a b", so "abc" splits as a + bc, and "a bc" is not a merge.
        let merges = Merges::new(&tokens, &strings(&["b c", "a b", "ab c"]));
        let mut output = Vec::new();
        merges.encode_word("abc", false, &mut Scratch::default(), &mut output);
        assert_eq!(
            output,
            [0, 4],
            "expected a + bc when b c has the better rank"
        );
        output.clear();
        let merges = Merges::new(&tokens, &strings(&["a b", "b c", "ab c"]));
        merges.encode_word("abc", false, &mut Scratch::default(), &mut output);
        assert_eq!(
            output,
            [5],
            "expected ab then abc when a b has the better rank"
        );
    }

    #[test]
    fn a_merge_side_may_be_a_space_like_character() {
        let tokens = strings(&["Ġ", "ĠĠ", "x"]);
        let merges = Merges::new(&tokens, &strings(&["Ġ Ġ"]));
        let mut output = Vec::new();
        merges.encode_word("ĠĠx", false, &mut Scratch::default(), &mut output);
        assert_eq!(output, [1, 2]);
    }

    #[test]
    fn whole_word_tokens_skip_merges_when_asked() {
        let tokens = strings(&["a", "b", "ab"]);
        let merges = Merges::new(&tokens, &[]);
        let mut output = Vec::new();
        merges.encode_word("ab", false, &mut Scratch::default(), &mut output);
        assert_eq!(
            output,
            [0, 1],
            "without merges the word stays in characters"
        );
        output.clear();
        merges.encode_word("ab", true, &mut Scratch::default(), &mut output);
        assert_eq!(
            output,
            [2],
            "ignore_merges takes a word that is a token whole"
        );
    }
}
