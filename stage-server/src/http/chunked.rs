//! The chunked transfer-coding of request bodies, decoded a byte at a time so any read boundary works.
//!
//! The framing is strict where leniency has let requests be smuggled past proxies: every line ends in CRLF
//! (a bare LF is refused), whitespace may stand only between a chunk size and its `;`, and a chunk's data must
//! be followed by CRLF. Chunk extensions and trailer fields are read and thrown away; their bytes are counted
//! so that neither can run on without bound.

use super::{HttpError, HttpLimits};

/// Longest chunk-size line (size, extensions, CRLF) accepted: far past any real client's, short enough that a
/// line of extensions cannot keep a connection busy for ever.
const MAX_SIZE_LINE_BYTES: usize = 4096;

/// Where the decoder is inside the chunked framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Reading the hex digits of a chunk size (`digits` of them so far, value `size`).
    Size { size: usize, digits: usize },
    /// After a size, in whitespace before a `;`.
    SizeWhitespace { size: usize },
    /// In a chunk extension, skipping to the CR.
    Extension { size: usize },
    /// After the CR of a chunk-size line.
    SizeLineFeed { size: usize },
    /// Inside a chunk's data, with `remaining` bytes to go.
    Data { remaining: usize },
    /// After a chunk's data, expecting its CR.
    DataCarriageReturn,
    /// After a chunk's data and CR, expecting the LF.
    DataLineFeed,
    /// At the start of a trailer line, or of the blank line that ends the body.
    TrailerStart,
    /// Inside a trailer field, skipping to the CR.
    Trailer,
    /// After the CR of a trailer line.
    TrailerLineFeed,
    /// After the CR of the final blank line.
    EndLineFeed,
    /// The body is complete.
    Done,
}

/// Decodes one chunked body into a caller's buffer.
#[derive(Debug, Clone)]
pub(crate) struct ChunkedDecoder {
    place: Place,
    /// Bytes of the current chunk-size line so far.
    size_line_bytes: usize,
    /// Bytes of the trailer section so far.
    trailer_bytes: usize,
    limits: HttpLimits,
}

impl ChunkedDecoder {
    /// A decoder at the start of a chunked body, holding the body to `limits.max_body_bytes` and the trailer
    /// section to `limits.max_head_bytes`.
    pub(crate) fn new(limits: HttpLimits) -> Self {
        Self {
            place: Place::Size { size: 0, digits: 0 },
            size_line_bytes: 0,
            trailer_bytes: 0,
            limits,
        }
    }

    /// Decodes a prefix of `input`, appending chunk data to `body`; returns the bytes consumed and whether the
    /// body is complete. When it is, the bytes after it (a pipelined request) are left unconsumed.
    ///
    /// Costs one branch per framing byte and one copy of the data.
    pub(crate) fn decode(
        &mut self,
        input: &[u8],
        body: &mut Vec<u8>,
    ) -> Result<(usize, bool), HttpError> {
        let mut offset = 0;
        while offset < input.len() && self.place != Place::Done {
            if let Place::Data { remaining } = self.place {
                let taken = remaining.min(input.len() - offset);
                body.extend_from_slice(&input[offset..offset + taken]);
                offset += taken;
                self.place = match remaining - taken {
                    0 => Place::DataCarriageReturn,
                    remaining => Place::Data { remaining },
                };
                continue;
            }
            let byte = input[offset];
            offset += 1;
            self.place = self.step(byte, body.len())?;
        }
        Ok((offset, self.place == Place::Done))
    }

    /// The place after one framing byte; `body_length` is what the body holds so far.
    fn step(&mut self, byte: u8, body_length: usize) -> Result<Place, HttpError> {
        if matches!(
            self.place,
            Place::Size { .. }
                | Place::SizeWhitespace { .. }
                | Place::Extension { .. }
                | Place::SizeLineFeed { .. }
        ) {
            self.size_line_bytes += 1;
            if self.size_line_bytes > MAX_SIZE_LINE_BYTES {
                return Err(HttpError::new(
                    400,
                    format!(
                        "a chunk-size line (size and extensions) is over {MAX_SIZE_LINE_BYTES} bytes"
                    ),
                ));
            }
        }
        if matches!(
            self.place,
            Place::TrailerStart | Place::Trailer | Place::TrailerLineFeed | Place::EndLineFeed
        ) {
            self.trailer_bytes += 1;
            if self.trailer_bytes > self.limits.max_head_bytes {
                return Err(HttpError::new(
                    431,
                    format!(
                        "the chunked body's trailer section is over the {}-byte limit",
                        self.limits.max_head_bytes
                    ),
                ));
            }
        }
        let place = match (self.place, byte) {
            (Place::Size { size, digits }, byte) if byte.is_ascii_hexdigit() => {
                // Saturating, so that a long run of digits reads as "too large" rather than wrapping; the
                // check below refuses it as soon as the digits so far are over the limit.
                let digit = usize::from(hex_value(byte));
                let size = size.saturating_mul(16).saturating_add(digit);
                if size > self.limits.max_body_bytes.saturating_sub(body_length) {
                    return Err(HttpError::new(
                        413,
                        format!(
                            "the chunked body is over the {}-byte limit",
                            self.limits.max_body_bytes
                        ),
                    ));
                }
                Place::Size {
                    size,
                    digits: digits + 1,
                }
            }
            (Place::Size { digits: 0, .. }, byte) => {
                return Err(HttpError::new(
                    400,
                    format!(
                        "a chunk size must start with a hexadecimal digit, not {}",
                        describe_byte(byte)
                    ),
                ));
            }
            (Place::Size { size, .. } | Place::SizeWhitespace { size }, b' ' | b'\t') => {
                Place::SizeWhitespace { size }
            }
            (Place::Size { size, .. } | Place::SizeWhitespace { size }, b';') => {
                Place::Extension { size }
            }
            (Place::Size { size, .. } | Place::Extension { size }, b'\r') => {
                Place::SizeLineFeed { size }
            }
            (Place::Size { .. } | Place::SizeWhitespace { .. }, b'\n') => {
                return Err(line_error("a chunk-size line"));
            }
            (Place::Size { .. } | Place::SizeWhitespace { .. }, byte) => {
                return Err(HttpError::new(
                    400,
                    format!(
                        "a chunk size is followed by {} instead of `;` or CRLF",
                        describe_byte(byte)
                    ),
                ));
            }
            (Place::Extension { .. }, b'\n') => {
                return Err(line_error("a chunk-size line"));
            }
            (Place::Extension { size }, _) => Place::Extension { size },
            (Place::SizeLineFeed { size }, b'\n') => {
                self.size_line_bytes = 0;
                match size {
                    0 => Place::TrailerStart,
                    remaining => Place::Data { remaining },
                }
            }
            (Place::SizeLineFeed { .. }, _) => return Err(line_error("a chunk-size line")),
            (Place::DataCarriageReturn, b'\r') => Place::DataLineFeed,
            (Place::DataLineFeed, b'\n') => Place::Size { size: 0, digits: 0 },
            (Place::DataCarriageReturn | Place::DataLineFeed, _) => {
                return Err(HttpError::new(
                    400,
                    "a chunk's data is not followed by CRLF; its size line may be wrong",
                ));
            }
            (Place::TrailerStart, b'\r') => Place::EndLineFeed,
            (Place::TrailerStart | Place::Trailer, b'\n') => {
                return Err(line_error("a trailer line"));
            }
            (Place::Trailer, b'\r') => Place::TrailerLineFeed,
            (Place::TrailerStart | Place::Trailer, _) => Place::Trailer,
            (Place::TrailerLineFeed, b'\n') => Place::TrailerStart,
            (Place::TrailerLineFeed, _) => return Err(line_error("a trailer line")),
            (Place::EndLineFeed, b'\n') => Place::Done,
            (Place::EndLineFeed, _) => {
                return Err(line_error("the blank line after the last chunk"));
            }
            // `decode` copies data itself and stops at the end; neither reaches here, but a wrong turn must
            // not panic on a client's bytes.
            (Place::Data { remaining }, _) => Place::Data { remaining },
            (Place::Done, _) => Place::Done,
        };
        Ok(place)
    }
}

/// The value of an ASCII hex digit (0 for anything else; callers check first).
fn hex_value(byte: u8) -> u8 {
    match byte {
        b'0'..=b'9' => byte - b'0',
        b'a'..=b'f' => byte - b'a' + 10,
        b'A'..=b'F' => byte - b'A' + 10,
        _ => 0,
    }
}

/// A byte for an error message: printable ASCII quoted, anything else in hex.
fn describe_byte(byte: u8) -> String {
    if byte.is_ascii_graphic() {
        format!("`{}`", char::from(byte))
    } else {
        format!("byte 0x{byte:02x}")
    }
}

/// The error for a line of the chunked framing that does not end in CRLF.
fn line_error(line: &str) -> HttpError {
    HttpError::new(
        400,
        format!("{line} of the chunked body does not end in CRLF"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_body_bytes: usize) -> HttpLimits {
        HttpLimits {
            max_body_bytes,
            ..HttpLimits::default()
        }
    }

    /// Decodes `input` whole; returns the body, the bytes consumed and whether it was complete.
    fn decode_whole(input: &[u8]) -> Result<(Vec<u8>, usize, bool), HttpError> {
        let mut decoder = ChunkedDecoder::new(limits(1024));
        let mut body = Vec::new();
        let (consumed, done) = decoder.decode(input, &mut body)?;
        Ok((body, consumed, done))
    }

    fn error_of(input: &[u8]) -> HttpError {
        match decode_whole(input) {
            Err(error) => error,
            Ok(outcome) => panic!("{input:?} decoded to {outcome:?} instead of failing"),
        }
    }

    #[test]
    fn chunks_of_hex_sizes_are_joined_and_the_bytes_after_the_body_are_left() {
        let input = b"5\r\nhello\r\nA\r\n, world!!!\r\n0\r\n\r\nGET";
        let (body, consumed, done) = decode_whole(input).unwrap();
        assert_eq!(body, b"hello, world!!!");
        assert!(done, "the body ended at the last chunk and blank line");
        assert_eq!(
            consumed,
            input.len() - 3,
            "the pipelined bytes must stay unconsumed"
        );
    }

    #[test]
    fn sizes_take_upper_and_lower_case_hex_and_leading_zeros() {
        let (body, _, done) = decode_whole(b"00000b\r\nhello world\r\n0\r\n\r\n").unwrap();
        assert_eq!(body, b"hello world");
        assert!(done);
        let (body, _, _) =
            decode_whole(&[b"1F\r\n".as_slice(), &[b'x'; 31], b"\r\n0\r\n\r\n"].concat()).unwrap();
        assert_eq!(body.len(), 31);
    }

    #[test]
    fn extensions_and_trailers_are_ignored() {
        let input = b"3;name=value;other\r\nabc\r\n3 ; x\r\ndef\r\n0;last\r\nTrailer: one\r\nMore: two\r\n\r\n";
        let (body, consumed, done) = decode_whole(input).unwrap();
        assert_eq!(body, b"abcdef");
        assert!(done);
        assert_eq!(consumed, input.len());
    }

    #[test]
    fn a_body_cut_anywhere_decodes_the_same_byte_by_byte() {
        let input = b"3;e=1\r\nabc\r\n2\r\nde\r\n0\r\nT: v\r\n\r\n";
        let mut decoder = ChunkedDecoder::new(limits(1024));
        let mut body = Vec::new();
        for (index, byte) in input.iter().enumerate() {
            let (consumed, done) = decoder
                .decode(std::slice::from_ref(byte), &mut body)
                .unwrap();
            assert_eq!(consumed, 1, "byte {index} was not consumed");
            assert_eq!(
                done,
                index == input.len() - 1,
                "done at the wrong byte {index}"
            );
        }
        assert_eq!(body, b"abcde");
    }

    #[test]
    fn a_size_that_is_not_hex_is_refused() {
        let error = error_of(b"xyz\r\n");
        assert_eq!(error.status, 400);
        assert!(error.message.contains("`x`"), "{}", error.message);
        assert_eq!(error_of(b"\r\n").status, 400, "an empty size line");
        assert_eq!(error_of(b"5x\r\n").status, 400, "a size with trailing junk");
        assert_eq!(error_of(b"5 \r\n").status, 400, "whitespace not before `;`");
    }

    #[test]
    fn a_bare_line_feed_is_refused_in_every_line() {
        assert_eq!(error_of(b"5\nhello\r\n").status, 400);
        assert_eq!(error_of(b"5;ext\nhello\r\n").status, 400);
        assert_eq!(error_of(b"5\r\nhello\n").status, 400);
        assert_eq!(error_of(b"0\r\nTrailer: x\n").status, 400);
        assert_eq!(error_of(b"0\r\n\n").status, 400);
        assert_eq!(error_of(b"0\r\n\rx").status, 400);
    }

    #[test]
    fn data_longer_than_its_size_is_refused() {
        let error = error_of(b"3\r\nhello\r\n0\r\n\r\n");
        assert_eq!(error.status, 400);
        assert!(
            error.message.contains("not followed by CRLF"),
            "{}",
            error.message
        );
    }

    #[test]
    fn a_body_over_the_limit_is_refused_as_soon_as_a_size_says_so() {
        let mut decoder = ChunkedDecoder::new(limits(10));
        let mut body = Vec::new();
        decoder.decode(b"6\r\nabcdef\r\n", &mut body).unwrap();
        // 6 + 5 > 10, refused at the size digit, before any of the chunk's data.
        let error = decoder.decode(b"5", &mut body).unwrap_err();
        assert_eq!(error.status, 413);
        assert!(error.message.contains("10-byte limit"), "{}", error.message);
    }

    #[test]
    fn a_huge_size_is_refused_without_overflowing() {
        let error = error_of(b"ffffffffffffffffffffffffffffffff\r\n");
        assert_eq!(error.status, 413);
        let mut decoder = ChunkedDecoder::new(limits(usize::MAX));
        let mut body = Vec::new();
        // With no limit the size saturates instead of wrapping; the framing stays consistent.
        let (_, done) = decoder
            .decode(b"ffffffffffffffffffffffffffffffff\r\nab", &mut body)
            .unwrap();
        assert!(!done);
        assert_eq!(body, b"ab");
    }

    #[test]
    fn an_endless_extension_or_trailer_is_refused() {
        let mut line = b"1;".to_vec();
        line.resize(MAX_SIZE_LINE_BYTES + 1, b'x');
        let error = error_of(&line);
        assert_eq!(error.status, 400);
        assert!(
            error.message.contains("over 4096 bytes"),
            "{}",
            error.message
        );
        let mut decoder = ChunkedDecoder::new(HttpLimits {
            max_head_bytes: 16,
            ..limits(1024)
        });
        let mut body = Vec::new();
        let error = decoder
            .decode(b"0\r\nTrailer: long enough to pass\r\n\r\n", &mut body)
            .unwrap_err();
        assert_eq!(error.status, 431);
    }
}
