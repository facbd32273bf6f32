//! Unicode facts the pre-tokenizers need: letter / number / whitespace classes and GPT-2's byte-to-character map.
//!
//! The letter (`\p{L}`) and number (`\p{N}`) classes come from regex-syntax's general-category tables, read
//! once into sorted range lists; whitespace is Unicode's `White_Space` property (`char::is_whitespace`), the
//! same 25 code points llama.cpp treats as `\s`.

use std::sync::OnceLock;

use regex_syntax::hir::{Class, HirKind};

/// The classes of one code point that the splitters look at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CharClass {
    /// General category L (`\p{L}`).
    pub letter: bool,
    /// General category N (`\p{N}`).
    pub number: bool,
    /// The `White_Space` property (`\s`).
    pub whitespace: bool,
}

/// Sorted, disjoint inclusive ranges of the letter and number categories.
struct Tables {
    letters: Vec<(u32, u32)>,
    numbers: Vec<(u32, u32)>,
}

impl CharClass {
    /// Classifies `c`; ASCII takes a branch-only path, the rest a binary search over a few hundred ranges.
    pub fn of(c: char) -> Self {
        if c.is_ascii() {
            return Self {
                letter: c.is_ascii_alphabetic(),
                number: c.is_ascii_digit(),
                whitespace: c.is_ascii_whitespace() || c == '\u{0b}',
            };
        }
        let tables = tables();
        let code = c as u32;
        Self {
            letter: in_ranges(&tables.letters, code),
            number: in_ranges(&tables.numbers, code),
            whitespace: c.is_whitespace(),
        }
    }

    /// Neither whitespace, letter nor number: what `[^\s\p{L}\p{N}]` matches.
    pub fn is_other(self) -> bool {
        !(self.whitespace || self.letter || self.number)
    }
}

fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| Tables {
        letters: category_ranges(r"\p{L}"),
        numbers: category_ranges(r"\p{N}"),
    })
}

/// The code point ranges of a one-class pattern such as `\p{L}`; empty if the pattern were not a class
/// (it always is: the patterns are constants of this file).
fn category_ranges(pattern: &str) -> Vec<(u32, u32)> {
    let Ok(hir) = regex_syntax::Parser::new().parse(pattern) else {
        return Vec::new();
    };
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => class
            .ranges()
            .iter()
            .map(|range| (range.start() as u32, range.end() as u32))
            .collect(),
        _ => Vec::new(),
    }
}

fn in_ranges(ranges: &[(u32, u32)], code: u32) -> bool {
    // Index of the first range whose end is at or past `code`.
    let index = ranges.partition_point(|&(_, end)| end < code);
    ranges.get(index).is_some_and(|&(start, _)| start <= code)
}

/// GPT-2's byte-level alphabet: every byte gets a printable character so that BPE never sees raw
/// whitespace or control bytes. Printable Latin-1 bytes stand for themselves; the other 68 bytes take
/// U+0100 onwards in byte order.
pub(crate) struct ByteAlphabet {
    byte_to_char: [char; 256],
    /// The byte each spare character U+0100.. stands for.
    spare_to_byte: [u8; 68],
}

impl ByteAlphabet {
    /// The shared alphabet (built once).
    pub fn get() -> &'static Self {
        static ALPHABET: OnceLock<ByteAlphabet> = OnceLock::new();
        ALPHABET.get_or_init(|| {
            let mut byte_to_char = ['\0'; 256];
            let mut spare_to_byte = [0u8; 68];
            let mut spare = 0usize;
            for (byte, slot) in (0u8..=255).zip(byte_to_char.iter_mut()) {
                let printable = matches!(byte, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
                let code = if printable {
                    u32::from(byte)
                } else {
                    spare_to_byte[spare] = byte;
                    spare += 1;
                    0x100 + spare as u32 - 1
                };
                *slot = char::from_u32(code).unwrap_or('\u{fffd}');
            }
            Self {
                byte_to_char,
                spare_to_byte,
            }
        })
    }

    /// The character standing for `byte`.
    pub fn char_of(&self, byte: u8) -> char {
        self.byte_to_char[byte as usize]
    }

    /// The byte a character stands for, if it is one of the alphabet's 256 characters.
    pub fn byte_of(&self, c: char) -> Option<u8> {
        let code = c as u32;
        match code {
            0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff => Some(code as u8),
            0x100..=0x143 => Some(self.spare_to_byte[(code - 0x100) as usize]),
            _ => None,
        }
    }

    /// Appends the alphabet spelling of `text`'s UTF-8 bytes to `out`.
    pub fn encode_into(&self, text: &str, out: &mut String) {
        for &byte in text.as_bytes() {
            out.push(self.char_of(byte));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letters_and_numbers_follow_the_general_categories() {
        assert!(CharClass::of('é').letter, "é is a letter");
        assert!(
            CharClass::of('中').letter,
            "a Han ideograph is a letter (Lo)"
        );
        assert!(
            CharClass::of('٣').number,
            "Arabic-Indic three is a number (Nd)"
        );
        assert!(
            CharClass::of('Ⅻ').number,
            "Roman numeral twelve is a number (Nl)"
        );
        assert!(
            CharClass::of('😀').is_other(),
            "an emoji is a symbol, not a letter"
        );
        assert!(
            CharClass::of('\u{3000}').whitespace,
            "ideographic space is whitespace"
        );
        assert!(
            !CharClass::of('\u{200b}').whitespace,
            "zero width space is not White_Space"
        );
        assert!(
            CharClass::of('\u{0301}').is_other(),
            "a combining mark is neither L nor N"
        );
    }

    #[test]
    fn the_byte_alphabet_is_a_bijection_matching_gpt2() {
        let alphabet = ByteAlphabet::get();
        assert_eq!(alphabet.char_of(b' '), 'Ġ', "space is spelled Ġ");
        assert_eq!(alphabet.char_of(b'\n'), 'Ċ', "newline is spelled Ċ");
        assert_eq!(
            alphabet.char_of(b'a'),
            'a',
            "printable ASCII stands for itself"
        );
        for byte in 0..=255u8 {
            assert_eq!(
                alphabet.byte_of(alphabet.char_of(byte)),
                Some(byte),
                "byte {byte} does not round-trip through the alphabet"
            );
        }
    }
}
