//! A sans-IO decoder for HTTP/1.1 chunked transfer coding (RFC 9112 section 7.1), fed bytes as they arrive.

use std::fmt;

/// The longest chunk-size line (size, extensions and CRLF) or trailer line accepted.
///
/// A server sends a few hex digits; a line this long is garbage or an attack, and bounding it bounds the
/// decoder's memory to this plus nothing (data bytes are passed through, never buffered).
const LINE_LIMIT: usize = 4096;

/// Decodes a chunked body incrementally: every [`feed`](Self::feed) passes the data bytes it can through.
///
/// The decoder keeps no data of its own, only the position within the framing and a bounded line, so a
/// chunk split across reads anywhere (inside the size, the CRLF or the data) decodes the same as whole.
#[derive(Debug, Clone, Default)]
pub struct ChunkedDecoder {
    state: State,
    /// Length of the line being read in the size or trailer state (the bytes themselves are not kept).
    line_length: usize,
    /// The chunk size parsed so far.
    size: u64,
    /// Whether the trailer line being read has anything besides a CR (an empty one ends the body).
    trailer_has_field: bool,
}

/// Whether the body is complete after a [`ChunkedDecoder::feed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// More bytes are needed; everything given was consumed.
    NeedMore,
    /// The last chunk and the trailers have been read; the count is how many input bytes belonged to the
    /// body (any after them are the next response's and were not looked at).
    Done(usize),
}

/// A chunked body that breaks the framing rules.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChunkedError {
    /// A chunk-size line began with something other than a hex digit.
    BadSize,
    /// A chunk size does not fit in 64 bits.
    SizeOverflow,
    /// A size or trailer line is longer than the decoder accepts.
    LineTooLong,
    /// The bytes after a chunk's data were not CRLF.
    MissingCrlf,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum State {
    /// Reading the hex digits of a chunk size.
    #[default]
    Size,
    /// Past the digits: skipping whitespace or a chunk extension up to the line's LF.
    SizeRest,
    /// Passing `remaining` data bytes through.
    Data { remaining: u64 },
    /// Expecting the CR after a chunk's data.
    DataCr,
    /// Expecting the LF after a chunk's data.
    DataLf,
    /// After the last chunk: reading trailer lines until an empty one.
    Trailer,
    /// The body is complete.
    Done,
}

impl ChunkedDecoder {
    /// A decoder at the start of a body.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the last chunk and its trailers have been read.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Decodes `input`, appending the data bytes it carries to `output`.
    ///
    /// Returns [`Progress::Done`] with the number of bytes that belonged to the body once the terminating
    /// empty line has been read; the rest of `input` is left alone.
    pub fn feed(&mut self, input: &[u8], output: &mut Vec<u8>) -> Result<Progress, ChunkedError> {
        let mut position = 0;
        while position < input.len() {
            let byte = input[position];
            match self.state {
                State::Size => {
                    if let Some(digit) = hex_value(byte) {
                        self.size = self
                            .size
                            .checked_mul(16)
                            .and_then(|size| size.checked_add(u64::from(digit)))
                            .ok_or(ChunkedError::SizeOverflow)?;
                        self.count_line_byte()?;
                    } else if self.line_length == 0 {
                        return Err(ChunkedError::BadSize);
                    } else {
                        self.state = State::SizeRest;
                        // The terminating byte itself is judged by the next state.
                        continue;
                    }
                }
                State::SizeRest => {
                    self.count_line_byte()?;
                    if byte == b'\n' {
                        self.line_length = 0;
                        self.state = if self.size == 0 {
                            State::Trailer
                        } else {
                            State::Data {
                                remaining: self.size,
                            }
                        };
                        self.size = 0;
                    }
                }
                State::Data { remaining } => {
                    let available = (input.len() - position) as u64;
                    let taken = available.min(remaining) as usize;
                    output.extend_from_slice(&input[position..position + taken]);
                    position += taken;
                    let remaining = remaining - taken as u64;
                    self.state = if remaining == 0 {
                        State::DataCr
                    } else {
                        State::Data { remaining }
                    };
                    continue;
                }
                State::DataCr => {
                    self.state = match byte {
                        b'\r' => State::DataLf,
                        // A bare LF is tolerated, as most clients do.
                        b'\n' => State::Size,
                        _ => return Err(ChunkedError::MissingCrlf),
                    };
                }
                State::DataLf => {
                    if byte != b'\n' {
                        return Err(ChunkedError::MissingCrlf);
                    }
                    self.state = State::Size;
                }
                State::Trailer => {
                    if byte == b'\n' {
                        // A line with nothing but an optional CR before its LF ends the body; trailer
                        // fields are read past and dropped (the API sends none that matter).
                        let empty = !self.trailer_has_field;
                        self.line_length = 0;
                        self.trailer_has_field = false;
                        if empty {
                            self.state = State::Done;
                            return Ok(Progress::Done(position + 1));
                        }
                    } else {
                        self.trailer_has_field |= byte != b'\r';
                        self.count_line_byte()?;
                    }
                }
                State::Done => return Ok(Progress::Done(position)),
            }
            position += 1;
        }
        if self.state == State::Done {
            return Ok(Progress::Done(position));
        }
        Ok(Progress::NeedMore)
    }

    fn count_line_byte(&mut self) -> Result<(), ChunkedError> {
        self.line_length += 1;
        if self.line_length > LINE_LIMIT {
            return Err(ChunkedError::LineTooLong);
        }
        Ok(())
    }
}

impl fmt::Display for ChunkedError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Self::BadSize => "a chunk-size line does not start with a hex digit",
            Self::SizeOverflow => "a chunk size does not fit in 64 bits",
            Self::LineTooLong => "a chunk-size or trailer line is too long",
            Self::MissingCrlf => "a chunk's data is not followed by CRLF",
        };
        write!(formatter, "malformed chunked response body: {text}")
    }
}

impl std::error::Error for ChunkedError {}

fn hex_value(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{ChunkedDecoder, ChunkedError, Progress};

    const BODY: &[u8] = b"5\r\nhello\r\n7;name=value\r\n, world\r\n0\r\nExpires: never\r\n\r\n";

    fn decode_whole(input: &[u8]) -> Result<(Vec<u8>, Progress), ChunkedError> {
        let mut decoder = ChunkedDecoder::new();
        let mut output = Vec::new();
        let progress = decoder.feed(input, &mut output)?;
        Ok((output, progress))
    }

    #[test]
    fn a_whole_body_decodes_to_its_data_and_reports_where_it_ended() {
        let mut input = BODY.to_vec();
        input.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        let (output, progress) = decode_whole(&input).expect("a valid body");
        assert_eq!(output, b"hello, world", "the data bytes of both chunks");
        assert_eq!(
            progress,
            Progress::Done(BODY.len()),
            "the body ends after the empty trailer line, before the next response"
        );
    }

    #[test]
    fn a_body_fed_one_byte_at_a_time_decodes_the_same_as_whole() {
        let mut decoder = ChunkedDecoder::new();
        let mut output = Vec::new();
        for (index, byte) in BODY.iter().enumerate() {
            let progress = decoder
                .feed(std::slice::from_ref(byte), &mut output)
                .expect("a valid body");
            let last = index == BODY.len() - 1;
            assert_eq!(
                progress == Progress::Done(1),
                last,
                "only the final byte completes the body (byte {index})"
            );
        }
        assert_eq!(output, b"hello, world");
        assert!(decoder.is_done());
    }

    #[test]
    fn every_split_point_decodes_the_same() {
        for split in 0..=BODY.len() {
            let mut decoder = ChunkedDecoder::new();
            let mut output = Vec::new();
            let first = decoder.feed(&BODY[..split], &mut output).expect("valid");
            let second = decoder.feed(&BODY[split..], &mut output).expect("valid");
            assert_eq!(output, b"hello, world", "split at {split}");
            assert!(
                matches!(first, Progress::NeedMore) || split == BODY.len(),
                "split at {split}: incomplete until the last byte"
            );
            assert!(
                matches!(second, Progress::Done(_)),
                "split at {split}: done"
            );
        }
    }

    #[test]
    fn upper_case_hex_and_a_body_without_trailers_decode() {
        let (output, progress) = decode_whole(b"A\r\n0123456789\r\n0\r\n\r\n").expect("valid");
        assert_eq!(output, b"0123456789");
        assert_eq!(progress, Progress::Done(20), "the whole input is the body");
    }

    #[test]
    fn malformed_framing_is_refused_with_its_cause() {
        assert_eq!(
            decode_whole(b"zz\r\n").unwrap_err(),
            ChunkedError::BadSize,
            "a size must start with a hex digit"
        );
        assert_eq!(
            decode_whole(b"11111111111111111\r\n").unwrap_err(),
            ChunkedError::SizeOverflow,
            "seventeen hex digits overflow 64 bits"
        );
        assert_eq!(
            decode_whole(b"3\r\nabcX").unwrap_err(),
            ChunkedError::MissingCrlf,
            "data must end in CRLF"
        );
        let long_extension = [b"1;".as_slice(), &[b'x'; 5000]].concat();
        assert_eq!(
            decode_whole(&long_extension).unwrap_err(),
            ChunkedError::LineTooLong,
            "an endless extension is cut off"
        );
    }

    #[test]
    fn random_bytes_never_panic() {
        // A small deterministic generator: the point is coverage of odd inputs, not statistical quality.
        const ALPHABET: &[u8] = b"0123456789abcdefXYZ;\r\n \t";
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2000 {
            let mut decoder = ChunkedDecoder::new();
            let mut output = Vec::new();
            let length = (state % 64) as usize;
            let input: Vec<u8> = (0..length)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    ALPHABET[(state % ALPHABET.len() as u64) as usize]
                })
                .collect();
            let _ = decoder.feed(&input, &mut output);
            assert!(output.len() <= input.len(), "output never exceeds input");
        }
    }
}
