//! Stop strings over streamed text: release what cannot start a stop string, hold back what might, cut at a match.
//!
//! Text arrives a token's piece at a time, and a stop string may span pieces, so a piece cannot always be sent
//! as it comes: `"\nUs"` may be the start of the stop string `"\nUser:"`. The matcher keeps back exactly the
//! longest tail of the pending text that is still a prefix of some stop string, and releases everything before
//! it. An occurrence of a stop string therefore always starts inside the held-back tail, never in released text.
//!
//! The first match is the one that completes first (the earliest end), and of those the longest: what
//! llama-server does when it checks after each token, but independent of how the text was split.

/// Finds stop strings in text pushed piece by piece.
#[derive(Clone, Debug)]
pub struct StopMatcher {
    /// The stop strings, none empty.
    stops: Vec<String>,
    /// Text pushed but not yet released: a proper prefix of some stop string.
    pending: String,
    /// Set on the first match; nothing is released after it.
    stopped: bool,
}

/// What one [`StopMatcher::push`] releases.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopRelease {
    /// Text that can be sent to the client now; on a match, everything before the stop string.
    pub text: String,
    /// A stop string matched: generation should end, and this is the last text to send.
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings are ignored (they would match before any text). With no stop
    /// strings every push releases its text whole.
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops
                .iter()
                .filter(|stop| !stop.is_empty())
                .cloned()
                .collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Takes the next piece of generated text and returns what can be emitted now.
    ///
    /// Held back: the longest tail of the pending text that could still begin a stop string. On a match,
    /// `text` is everything before the stop string and `stopped` is true; every later push returns nothing
    /// and `stopped`. Costs a scan of the held-back tail and the new piece for each stop string.
    pub fn push(&mut self, text: &str) -> StopRelease {
        if self.stopped {
            return StopRelease {
                text: String::new(),
                stopped: true,
            };
        }
        self.pending.push_str(text);
        if let Some(start) = self.first_match() {
            self.pending.truncate(start);
            self.stopped = true;
            return StopRelease {
                text: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        let keep = self.held_start();
        let held = self.pending.split_off(keep);
        StopRelease {
            text: std::mem::replace(&mut self.pending, held),
            stopped: false,
        }
    }

    /// The generation ended without a stop match: the held-back tail, to send as the last text. Empty after
    /// a match.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// The text held back now: always shorter than the longest stop string.
    pub fn held_back(&self) -> &str {
        &self.pending
    }

    /// Whether a stop string has matched.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Where in `pending` the first match starts: the earliest-ending occurrence, the longest on a tie.
    /// No occurrence can lie wholly in the text held before this push, or the previous push would have found it.
    fn first_match(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|stop| {
                let start = self.pending.find(stop.as_str())?;
                Some((start + stop.len(), start))
            })
            .min()
            .map(|(_, start)| start)
    }

    /// The start of the longest tail of `pending` that is a prefix of some stop string (`pending.len()` when
    /// none is). Only character boundaries are tried, so the split is always valid UTF-8.
    fn held_start(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let earliest = self.pending.len().saturating_sub(longest);
        self.pending
            .char_indices()
            .map(|(index, _)| index)
            .filter(|&index| index >= earliest)
            .find(|&index| {
                let tail = &self.pending.as_bytes()[index..];
                self.stops
                    .iter()
                    .any(|stop| stop.len() > tail.len() && stop.as_bytes().starts_with(tail))
            })
            .unwrap_or(self.pending.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        let stops: Vec<String> = stops.iter().map(|&stop| stop.to_owned()).collect();
        StopMatcher::new(&stops)
    }

    fn release(text: &str, stopped: bool) -> StopRelease {
        StopRelease {
            text: text.to_owned(),
            stopped,
        }
    }

    #[test]
    fn without_stops_text_passes_through() {
        let mut stops = matcher(&[]);
        assert_eq!(stops.push("hello"), release("hello", false));
        assert_eq!(stops.finish(), "");
    }

    #[test]
    fn a_possible_start_is_held_until_it_resolves() {
        let mut stops = matcher(&["\nUser:"]);
        assert_eq!(stops.push("Hi\nUs"), release("Hi", false));
        assert_eq!(stops.held_back(), "\nUs");
        assert_eq!(stops.push("e"), release("", false));
        assert_eq!(
            stops.push("d"),
            release("\nUsed", false),
            "a dead end was not released"
        );
        assert_eq!(stops.finish(), "");
    }

    #[test]
    fn a_match_across_pieces_cuts_before_it_and_ends_the_stream() {
        let mut stops = matcher(&["\nUser:"]);
        assert_eq!(stops.push("Done.\nUs"), release("Done.", false));
        assert_eq!(stops.push("er: more"), release("", true));
        assert_eq!(
            stops.push("later"),
            release("", true),
            "text came after the stop"
        );
        assert_eq!(stops.finish(), "", "finish returned text after the stop");
        assert!(stops.stopped());
    }

    #[test]
    fn the_first_stop_to_complete_wins() {
        // "b" is complete while "abc" is not yet: cut at "b", however the text goes on.
        let mut stops = matcher(&["abc", "b"]);
        assert_eq!(stops.push("xab"), release("xa", true));
        // Both end at the same byte: the longer one starts earlier and wins.
        let mut stops = matcher(&["c", "bc"]);
        assert_eq!(stops.push("abc"), release("a", true));
    }

    #[test]
    fn the_held_tail_is_the_longest_possible_start() {
        let mut stops = matcher(&["aab"]);
        assert_eq!(stops.push("xaa"), release("x", false));
        assert_eq!(
            stops.push("a"),
            release("a", false),
            "held an impossible start"
        );
        assert_eq!(stops.held_back(), "aa");
    }

    #[test]
    fn multi_byte_characters_are_never_split() {
        let mut stops = matcher(&["é!"]);
        assert_eq!(stops.push("café"), release("caf", false));
        assert_eq!(stops.push("?"), release("é?", false));
        let mut stops = matcher(&["\u{e9}"]);
        // "e" followed by a combining accent is not the precomposed "é".
        assert_eq!(stops.push("e\u{301}"), release("e\u{301}", false));
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        let mut stops = matcher(&["", "z"]);
        assert_eq!(stops.push("abc"), release("abc", false));
    }
}
