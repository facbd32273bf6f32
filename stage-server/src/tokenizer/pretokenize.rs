//! Pre-tokenizers for byte-level BPE: split text into words before merges, as llama.cpp does per `tokenizer.ggml.pre`.
//!
//! Each pre-tokenizer is a list of stages. A stage cuts every piece the previous stage produced into
//! smaller pieces, keeping the text between its matches as pieces of their own, so no character is ever
//! dropped. The splitters are hand-written state machines for the regular expressions in the comments,
//! with llama.cpp's reading of them (`\s+(?!\S)` leaves the last space to the next word, even between
//! two pieces of an earlier stage, where the piece's end counts as "nothing follows").

use super::unicode::CharClass;

/// Which splitting rules a model's BPE vocabulary was trained with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PreTokenizer {
    /// GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2,
    /// StarCoder, SmolLM and others: every `\p{N}` alone first, then GPT-2's rules.
    DigitsThenGpt2,
    /// Llama 3: `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
    Llama3,
    /// Qwen2: Llama 3's rules with every `\p{N}` alone instead of groups of three.
    Qwen2,
}

/// What a pre-tokenizer name implies beyond the splitting rules.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PreTokenizerSpec {
    pub pre_tokenizer: PreTokenizer,
    /// A word that is itself a token is taken whole, without merges (Llama 3 family).
    pub ignore_merges: bool,
    /// Whether BOS is added when the file does not say (`tokenizer.ggml.add_bos_token` absent).
    pub add_bos_default: bool,
}

/// A stage of a pre-tokenizer.
#[derive(Clone, Copy)]
enum Stage {
    Digits,
    Gpt2,
    /// Llama 3's rules with numbers cut into groups of at most this many digits.
    Llama3 {
        digit_group: usize,
    },
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` value, or `None` if this crate lacks it.
    pub fn from_name(name: &str) -> Option<PreTokenizerSpec> {
        let spec = |pre_tokenizer, ignore_merges, add_bos_default| PreTokenizerSpec {
            pre_tokenizer,
            ignore_merges,
            add_bos_default,
        };
        match name {
            "gpt-2" | "phi-2" | "mpt" | "olmo" | "exaone4" => Some(spec(Self::Gpt2, false, false)),
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" | "mellum2" => Some(spec(Self::DigitsThenGpt2, false, false)),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" | "jina-v5-nano" => Some(spec(Self::Llama3, true, true)),
            "dbrx" | "smaug-bpe" => Some(spec(Self::Llama3, false, false)),
            "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => {
                Some(spec(Self::Qwen2, false, false))
            }
            _ => None,
        }
    }

    fn stages(self) -> &'static [Stage] {
        match self {
            Self::Gpt2 => &[Stage::Gpt2],
            Self::DigitsThenGpt2 => &[Stage::Digits, Stage::Gpt2],
            Self::Llama3 => &[Stage::Llama3 { digit_group: 3 }],
            Self::Qwen2 => &[Stage::Llama3 { digit_group: 1 }],
        }
    }

    /// Splits `text` into words, in order; the words concatenate back to `text`.
    pub fn split(self, text: &str) -> Vec<&str> {
        let chars: Vec<char> = text.chars().collect();
        let classes: Vec<CharClass> = chars.iter().map(|&c| CharClass::of(c)).collect();
        // Piece lengths in characters, as llama.cpp keeps them between stages.
        let mut lengths = vec![chars.len()];
        let mut next = Vec::with_capacity(chars.len() / 3 + 1);
        for &stage in self.stages() {
            next.clear();
            let mut start = 0;
            for &length in &lengths {
                let segment = Segment {
                    chars: &chars[start..start + length],
                    classes: &classes[start..start + length],
                };
                match stage {
                    Stage::Digits => segment.split_digits(&mut next),
                    Stage::Gpt2 => segment.split_gpt2(&mut next),
                    Stage::Llama3 { digit_group } => segment.split_llama3(digit_group, &mut next),
                }
                start += length;
            }
            std::mem::swap(&mut lengths, &mut next);
        }
        let mut words = Vec::with_capacity(lengths.len());
        let mut rest = text;
        for length in lengths {
            let bytes: usize = rest.chars().take(length).map(char::len_utf8).sum();
            let (word, tail) = rest.split_at(bytes);
            if !word.is_empty() {
                words.push(word);
            }
            rest = tail;
        }
        words
    }
}

/// One piece of text being split; positions past its end read as "nothing".
struct Segment<'a> {
    chars: &'a [char],
    classes: &'a [CharClass],
}

/// Collects piece lengths: each cut emits the characters since the previous cut.
struct Cuts<'o> {
    out: &'o mut Vec<usize>,
    previous: usize,
}

impl Cuts<'_> {
    /// Cuts at `end`; returns how many characters the new piece holds (0 emits nothing).
    fn cut(&mut self, end: usize) -> usize {
        let length = end - self.previous;
        if length > 0 {
            self.out.push(length);
        }
        self.previous = end;
        length
    }
}

impl Segment<'_> {
    fn len(&self) -> usize {
        self.chars.len()
    }

    fn char_at(&self, position: usize) -> Option<char> {
        self.chars.get(position).copied()
    }

    /// The classes at `position`, all false past the end.
    fn class_at(&self, position: usize) -> CharClass {
        self.classes.get(position).copied().unwrap_or_default()
    }

    fn in_range(&self, position: usize) -> bool {
        position < self.len()
    }

    /// `\p{N}`: each number character becomes a piece, and so does each run between them.
    fn split_digits(&self, out: &mut Vec<usize>) {
        let mut run = 0;
        for class in self.classes {
            if class.number {
                if run > 0 {
                    out.push(run);
                    run = 0;
                }
                out.push(1);
            } else {
                run += 1;
            }
        }
        if run > 0 {
            out.push(run);
        }
    }

    /// A contraction `'s 't 'm 'd 're 've 'll` at `position`: its length in characters.
    fn contraction(&self, position: usize, lowercase: bool) -> Option<usize> {
        if self.char_at(position) != Some('\'') || !self.in_range(position + 1) {
            return None;
        }
        let fold = |c: Option<char>| c.map(|c| if lowercase { c.to_ascii_lowercase() } else { c });
        let next = fold(self.char_at(position + 1));
        if matches!(next, Some('s' | 't' | 'm' | 'd')) {
            return Some(2);
        }
        if self.in_range(position + 2) {
            let after = fold(self.char_at(position + 2));
            if matches!(
                (next, after),
                (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
            ) {
                return Some(3);
            }
        }
        None
    }

    fn whitespace_run(&self, position: usize) -> usize {
        let mut count = 0;
        while self.class_at(position + count).whitespace {
            count += 1;
        }
        count
    }

    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    fn split_gpt2(&self, out: &mut Vec<usize>) {
        let mut cuts = Cuts { out, previous: 0 };
        let mut position = 0;
        while position < self.len() {
            if let Some(length) = self.contraction(position, false) {
                position += cuts.cut(position + length);
                continue;
            }
            let space = self.char_at(position) == Some(' ');
            // The class that decides the branch: the character after an optional leading space.
            let mut class = if space {
                self.class_at(position + 1)
            } else {
                self.class_at(position)
            };
            let after_space = position + usize::from(space);
            if class.letter || class.number || (class.is_other() && self.in_range(after_space)) {
                let same = |c: CharClass, first: CharClass| {
                    if first.letter {
                        c.letter
                    } else if first.number {
                        c.number
                    } else {
                        c.is_other()
                    }
                };
                let first = class;
                position = after_space;
                while self.in_range(position) && same(class, first) {
                    position += 1;
                    class = self.class_at(position);
                }
                cuts.cut(position);
                continue;
            }
            let spaces = self.whitespace_run(position);
            if spaces > 1 && self.in_range(position + spaces) {
                // `\s+(?!\S)`: leave the last space to start the next word.
                position += spaces - 1;
                cuts.cut(position);
                continue;
            }
            if spaces > 0 {
                position += spaces;
                cuts.cut(position);
                continue;
            }
            position += 1;
            cuts.cut(position);
        }
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    fn split_llama3(&self, digit_group: usize, out: &mut Vec<usize>) {
        let mut cuts = Cuts { out, previous: 0 };
        let mut position = 0;
        let is_line_break = |c: Option<char>| matches!(c, Some('\r' | '\n'));
        while position < self.len() {
            if let Some(length) = self.contraction(position, true) {
                position += cuts.cut(position + length);
                continue;
            }
            let c = self.char_at(position);
            let class = self.class_at(position);
            // `[^\r\n\p{L}\p{N}]?\p{L}+`
            if !(is_line_break(c) || class.number)
                && (class.letter || self.class_at(position + 1).letter)
            {
                position += 1;
                while self.class_at(position).letter {
                    position += 1;
                }
                cuts.cut(position);
                continue;
            }
            // `\p{N}{1,3}` (Qwen2: `\p{N}`)
            if class.number {
                let mut group_start = position;
                while self.class_at(position).number {
                    position += 1;
                    if position - group_start >= digit_group {
                        cuts.cut(position);
                        group_start = position;
                    }
                }
                cuts.cut(position);
                continue;
            }
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
            let space = c == Some(' ');
            let mut decider = if space {
                self.class_at(position + 1)
            } else {
                class
            };
            if decider.is_other() && self.in_range(position + usize::from(space)) {
                position += usize::from(space);
                while decider.is_other() && self.in_range(position) {
                    position += 1;
                    decider = self.class_at(position);
                }
                while is_line_break(self.char_at(position)) {
                    position += 1;
                }
                cuts.cut(position);
                continue;
            }
            // `\s*[\r\n]+`, then `\s+(?!\S)`, then `\s+`
            let mut spaces = 0;
            let mut after_last_line_break = None;
            while self.class_at(position + spaces).whitespace {
                if is_line_break(self.char_at(position + spaces)) {
                    after_last_line_break = Some(position + spaces + 1);
                }
                spaces += 1;
            }
            if let Some(end) = after_last_line_break {
                position = end;
                cuts.cut(position);
                continue;
            }
            if spaces > 1 && self.in_range(position + spaces) {
                position += spaces - 1;
                cuts.cut(position);
                continue;
            }
            if spaces > 0 {
                position += spaces;
                cuts.cut(position);
                continue;
            }
            position += 1;
            cuts.cut(position);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GPT2_PATTERN: &str =
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
    const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// Splits with a backtracking regex engine, keeping the text between matches as pieces: an
    /// independent statement of what the hand-written splitters must do.
    fn regex_split<'t>(pattern: &'static str, text: &'t str, out: &mut Vec<&'t str>) {
        // Compiling is the slow part (unoptimised in test builds): keep one compiled copy per pattern.
        static COMPILED: std::sync::Mutex<Vec<(&str, fancy_regex::Regex)>> =
            std::sync::Mutex::new(Vec::new());
        let regex = {
            let mut compiled = COMPILED.lock().unwrap();
            if !compiled.iter().any(|(known, _)| *known == pattern) {
                compiled.push((pattern, fancy_regex::Regex::new(pattern).unwrap()));
            }
            compiled
                .iter()
                .find(|(known, _)| *known == pattern)
                .unwrap()
                .1
                .clone()
        };
        let mut previous = 0;
        for found in regex.find_iter(text) {
            let found = found.unwrap();
            if found.start() > previous {
                out.push(&text[previous..found.start()]);
            }
            if found.end() > found.start() {
                out.push(found.as_str());
            }
            previous = found.end();
        }
        if previous < text.len() {
            out.push(&text[previous..]);
        }
    }

    fn regex_reference(pre: PreTokenizer, text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        match pre {
            PreTokenizer::Gpt2 => regex_split(GPT2_PATTERN, text, &mut out),
            PreTokenizer::Llama3 => regex_split(LLAMA3_PATTERN, text, &mut out),
            PreTokenizer::Qwen2 => regex_split(QWEN2_PATTERN, text, &mut out),
            PreTokenizer::DigitsThenGpt2 => {
                let mut pieces = Vec::new();
                regex_split(r"\p{N}", text, &mut pieces);
                for piece in pieces {
                    regex_split(GPT2_PATTERN, piece, &mut out);
                }
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

        #[test]
        fn splitters_agree_with_their_regular_expressions(
            text in "[ \t\n\ra-zA-Z0-9'éü中😀.,!?_\u{3000}\u{a0}\u{2028}٣-]{0,40}"
        ) {
            for pre in [
                PreTokenizer::Gpt2,
                PreTokenizer::DigitsThenGpt2,
                PreTokenizer::Llama3,
                PreTokenizer::Qwen2,
            ] {
                prop_assert_eq!(pre.split(&text), regex_reference(pre, &text), "{:?} on {:?}", pre, text);
            }
        }
    }

    fn split(pre: PreTokenizer, text: &str) -> Vec<&str> {
        pre.split(text)
    }

    #[test]
    fn gpt2_keeps_one_leading_space_with_each_word() {
        assert_eq!(
            split(PreTokenizer::Gpt2, "Hello  world, it's 42!"),
            ["Hello", " ", " world", ",", " it", "'s", " 42", "!"]
        );
    }

    #[test]
    fn gpt2_leaves_trailing_whitespace_whole() {
        assert_eq!(split(PreTokenizer::Gpt2, "a   "), ["a", "   "]);
        // Only a plain space joins the next word; a line break stands alone.
        assert_eq!(split(PreTokenizer::Gpt2, "a\n\nb"), ["a", "\n", "\n", "b"]);
    }

    #[test]
    fn smollm_isolates_every_digit() {
        assert_eq!(
            split(PreTokenizer::DigitsThenGpt2, "in 2024 x"),
            ["in", " ", "2", "0", "2", "4", " x"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three_and_keeps_line_breaks_together() {
        assert_eq!(
            split(PreTokenizer::Llama3, "1234567 ok\n\n  x"),
            ["123", "456", "7", " ok", "\n\n", " ", " x"]
        );
        assert_eq!(
            split(PreTokenizer::Llama3, "I'M here"),
            ["I", "'M", " here"]
        );
    }

    #[test]
    fn qwen2_cuts_numbers_into_single_digits() {
        assert_eq!(
            split(PreTokenizer::Qwen2, "x 2024\n"),
            ["x", " ", "2", "0", "2", "4", "\n"]
        );
    }

    #[test]
    fn splitting_never_loses_a_character() {
        let text = "  mixed \t\n 12ab 😀 'll\r\n";
        for pre in [
            PreTokenizer::Gpt2,
            PreTokenizer::DigitsThenGpt2,
            PreTokenizer::Llama3,
            PreTokenizer::Qwen2,
        ] {
            assert_eq!(
                split(pre, text).concat(),
                text,
                "{pre:?} dropped or duplicated text"
            );
        }
    }
}
