//! A sans-IO parser for server-sent events (the `text/event-stream` format), fed body bytes as they arrive.
//!
//! It follows the WHATWG event-stream rules that matter to a client of a streaming API: lines end in LF,
//! CRLF or CR; `data:` lines accumulate (joined by LF) until a blank line dispatches the event; `event:`
//! names it; lines starting with `:` are comments (keep-alives); one space after the colon is dropped; a
//! leading byte-order mark is ignored. `id:` and `retry:` only matter to a reconnecting browser and are
//! skipped.

use std::fmt;

/// The longest line accepted; the API's chunks are a few hundred bytes, logprobs a few kilobytes.
///
/// Bounding the line bounds what one misbehaving server can make the client hold before a line ends.
const LINE_LIMIT: usize = 1 << 20;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, or `message` when the event had none.
    pub kind: String,
    /// The `data:` lines, joined with LF.
    pub data: String,
}

/// Splits a byte stream into events; bytes may be fed in pieces of any size.
#[derive(Debug, Clone, Default)]
pub struct SseParser {
    /// The bytes of the line being read (its end not yet seen).
    line: Vec<u8>,
    /// A CR ended the previous line, so an LF at the start of the next feed belongs to it.
    after_cr: bool,
    /// Whether the first bytes of the stream (where a byte-order mark may sit) have been looked at.
    started: bool,
    /// The `data:` lines of the event being built, each followed by LF.
    data: String,
    /// The `event:` field of the event being built.
    kind: String,
}

/// An event stream the parser refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SseError {
    /// A line grew past the limit without ending.
    LineTooLong,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses `input`, appending every event it completes to `events`.
    ///
    /// A field value that is not UTF-8 is taken lossily: the API sends JSON, which is UTF-8, and a
    /// replacement character shows the damage better than dropping the event would.
    pub fn feed(&mut self, input: &[u8], events: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let mut input = input;
        if !self.started {
            // The mark may come split over feeds; wait until three bytes (or a line end) can decide.
            self.line.extend_from_slice(input);
            if self.line.len() < 3 && !self.line.iter().any(|&b| b == b'\n' || b == b'\r') {
                return Ok(());
            }
            self.started = true;
            let mut buffered = std::mem::take(&mut self.line);
            if buffered.starts_with("\u{feff}".as_bytes()) {
                buffered.drain(..3);
            }
            return self.feed_lines(&buffered, events);
        }
        if self.after_cr {
            if let Some((&b'\n', rest)) = input.split_first() {
                input = rest;
            }
            self.after_cr = false;
        }
        self.feed_lines(input, events)
    }

    fn feed_lines(&mut self, input: &[u8], events: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let mut rest = input;
        while let Some(end) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            let line_end = rest[end];
            let line = if self.line.is_empty() {
                self.process_line(&rest[..end], events);
                rest = &rest[end + 1..];
                None
            } else {
                self.line.extend_from_slice(&rest[..end]);
                rest = &rest[end + 1..];
                Some(std::mem::take(&mut self.line))
            };
            if let Some(line) = line {
                self.check_length(line.len())?;
                self.process_line(&line, events);
            }
            if line_end == b'\r' {
                match rest.split_first() {
                    Some((&b'\n', after)) => rest = after,
                    Some(_) => {}
                    // The LF of a CRLF may be the first byte of the next feed.
                    None => self.after_cr = true,
                }
            }
        }
        self.line.extend_from_slice(rest);
        self.check_length(self.line.len())
    }

    fn check_length(&self, length: usize) -> Result<(), SseError> {
        if length > LINE_LIMIT {
            return Err(SseError::LineTooLong);
        }
        Ok(())
    }

    fn process_line(&mut self, line: &[u8], events: &mut Vec<SseEvent>) {
        if line.is_empty() {
            self.dispatch(events);
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &[][..]),
        };
        match field {
            b"data" => {
                self.data.push_str(&String::from_utf8_lossy(value));
                self.data.push('\n');
            }
            b"event" => self.kind = String::from_utf8_lossy(value).into_owned(),
            _ => {}
        }
    }

    fn dispatch(&mut self, events: &mut Vec<SseEvent>) {
        let kind = std::mem::take(&mut self.kind);
        // An event with no data line is not dispatched (the spec's rule), which also makes a stray blank
        // line harmless.
        if self.data.is_empty() {
            return;
        }
        let mut data = std::mem::take(&mut self.data);
        data.pop();
        let kind = if kind.is_empty() {
            "message".to_owned()
        } else {
            kind
        };
        events.push(SseEvent { kind, data });
    }
}

impl fmt::Display for SseError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LineTooLong => write!(
                formatter,
                "an event-stream line is longer than {LINE_LIMIT} bytes; the server is not sending events"
            ),
        }
    }
}

impl std::error::Error for SseError {}

#[cfg(test)]
mod tests {
    use super::{SseError, SseEvent, SseParser};

    fn parse_in_pieces(input: &[u8], piece: usize) -> Vec<SseEvent> {
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        for chunk in input.chunks(piece.max(1)) {
            parser.feed(chunk, &mut events).expect("a valid stream");
        }
        events
    }

    fn message(data: &str) -> SseEvent {
        SseEvent {
            kind: "message".to_owned(),
            data: data.to_owned(),
        }
    }

    #[test]
    fn openai_style_data_events_parse_in_order_with_done_last() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        assert_eq!(
            parse_in_pieces(stream, stream.len()),
            vec![
                message("{\"a\":1}"),
                message("{\"b\":2}"),
                message("[DONE]")
            ]
        );
    }

    #[test]
    fn every_piece_size_gives_the_same_events() {
        let stream = "\u{feff}: keep-alive\r\ndata: first\r\ndata:  second\r\n\r\nevent: error\rdata: x\r\rdata\n\n";
        let expected = vec![
            message("first\n second"),
            SseEvent {
                kind: "error".to_owned(),
                data: "x".to_owned(),
            },
            message(""),
        ];
        for piece in 1..=stream.len() {
            assert_eq!(
                parse_in_pieces(stream.as_bytes(), piece),
                expected,
                "pieces of {piece} bytes"
            );
        }
    }

    #[test]
    fn an_unfinished_event_is_not_dispatched() {
        assert_eq!(
            parse_in_pieces(b"data: partial\n", 4),
            Vec::<SseEvent>::new(),
            "no blank line, no event"
        );
        assert_eq!(
            parse_in_pieces(b"\n\nid: 7\nretry: 10\n\n", 3),
            Vec::<SseEvent>::new(),
            "blank lines and fields without data dispatch nothing"
        );
    }

    #[test]
    fn a_line_past_the_limit_is_refused() {
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        let piece = vec![b'x'; 64 * 1024];
        let mut result = Ok(());
        for _ in 0..20 {
            result = parser.feed(&piece, &mut events);
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(SseError::LineTooLong), "an endless line stops");
    }

    #[test]
    fn random_bytes_never_panic() {
        const ALPHABET: &[u8] = b"data:event \r\n\xef\xbb\xbf\xffx";
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        for _ in 0..2000 {
            let mut parser = SseParser::new();
            let mut events = Vec::new();
            let length = (state % 48) as usize;
            let input: Vec<u8> = (0..length)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    ALPHABET[(state % ALPHABET.len() as u64) as usize]
                })
                .collect();
            for piece in input.chunks(1 + (state % 5) as usize) {
                let _ = parser.feed(piece, &mut events);
            }
        }
    }
}
