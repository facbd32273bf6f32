//! The request parser: a head through `httparse`, its framing and expectations checked, then the body.
//!
//! The parser consumes what it is given and keeps what it needs, so a session never holds more than one read
//! of unparsed bytes. A head is buffered until its blank line (at most `max_head_bytes` of it); `httparse` runs
//! only when a new line feed has arrived or the buffer is full, so a head fed a byte at a time costs one parse
//! per line (at most `max_headers + 2` before it completes or fails), not one per byte.

use super::chunked::ChunkedDecoder;
use super::{HttpError, HttpLimits, Parsed, Request};

/// Reads requests from a connection's byte stream, one after another.
#[derive(Debug)]
pub struct RequestParser {
    limits: HttpLimits,
    /// The bytes of a head received so far, when they did not hold all of it.
    head: Vec<u8>,
    stage: Stage,
}

/// Where the parser is in the current request.
#[derive(Debug)]
enum Stage {
    /// Reading a head (possibly nothing yet).
    Head,
    /// The head is complete; reading the body of `request` as `body` frames it.
    Body { request: Request, body: BodyReader },
    /// A request was refused; the connection is done and the same error comes back on every call.
    Failed(HttpError),
}

/// How the rest of a body is read.
#[derive(Debug)]
enum BodyReader {
    /// `remaining` more bytes, by Content-Length.
    Length { remaining: usize },
    /// Chunked, to its last chunk and trailers.
    Chunked(ChunkedDecoder),
}

/// How a head says its body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyFraming {
    /// No body (no Content-Length nor Transfer-Encoding, or a Content-Length of 0).
    None,
    /// Exactly this many bytes.
    Length(usize),
    /// The chunked transfer-coding.
    Chunked,
}

impl RequestParser {
    /// A parser at the start of a connection, refusing what is over `limits`.
    pub fn new(limits: HttpLimits) -> Self {
        Self {
            limits,
            head: Vec::new(),
            stage: Stage::Head,
        }
    }

    /// Consumes a prefix of `input`; the caller drops the consumed bytes and calls again with the rest (and
    /// with more input once it arrives). Pipelined requests: bytes after a request are left unconsumed.
    ///
    /// Returns [`Parsed::NeedMore`] only when `input` holds no complete request; it has then consumed all of
    /// `input` but for a lone CR between requests. Blank lines before a request are skipped. After an error
    /// the caller answers with its status and closes; later calls return the same error.
    pub fn parse(&mut self, input: &[u8]) -> Result<(usize, Parsed), HttpError> {
        if let Stage::Failed(error) = &self.stage {
            return Err(error.clone());
        }
        let outcome = self.advance(input);
        if let Err(error) = &outcome {
            self.head = Vec::new();
            self.stage = Stage::Failed(error.clone());
        }
        outcome
    }

    /// Whether part of a request has been received (the caller picks its read deadline with it: a short one
    /// mid-request, an idle one between requests).
    pub fn in_progress(&self) -> bool {
        !self.head.is_empty() || matches!(self.stage, Stage::Body { .. })
    }

    /// One call of `parse`, before errors are made to stick.
    fn advance(&mut self, input: &[u8]) -> Result<(usize, Parsed), HttpError> {
        let mut consumed = 0;
        if let Stage::Head = self.stage {
            let (taken, head) = self.read_head(input)?;
            consumed = taken;
            let Some(head) = head else {
                return Ok((consumed, Parsed::NeedMore));
            };
            let framing = body_framing(&head, self.limits)?;
            let expects_continue = expects_continue(&head, framing)?;
            let body = match framing {
                BodyFraming::None => return Ok((consumed, Parsed::Request(head))),
                BodyFraming::Length(length) => BodyReader::Length { remaining: length },
                BodyFraming::Chunked => BodyReader::Chunked(ChunkedDecoder::new(self.limits)),
            };
            self.stage = Stage::Body {
                request: head,
                body,
            };
            if expects_continue {
                return Ok((consumed, Parsed::Continue));
            }
        }
        let Stage::Body { request, body } = &mut self.stage else {
            return Ok((consumed, Parsed::NeedMore));
        };
        let rest = &input[consumed..];
        let (taken, done) = match body {
            BodyReader::Length { remaining } => {
                let taken = (*remaining).min(rest.len());
                request.body.extend_from_slice(&rest[..taken]);
                *remaining -= taken;
                (taken, *remaining == 0)
            }
            BodyReader::Chunked(decoder) => decoder.decode(rest, &mut request.body)?,
        };
        consumed += taken;
        if !done {
            return Ok((consumed, Parsed::NeedMore));
        }
        let Stage::Body { request, .. } = std::mem::replace(&mut self.stage, Stage::Head) else {
            return Ok((consumed, Parsed::NeedMore));
        };
        Ok((consumed, Parsed::Request(request)))
    }

    /// Takes head bytes from `input`; returns how many it consumed and, once the head is complete, the request
    /// it starts (with an empty body). The bytes after the head are left in `input`.
    fn read_head(&mut self, input: &[u8]) -> Result<(usize, Option<Request>), HttpError> {
        let mut skipped = 0;
        let mut input = input;
        if self.head.is_empty() {
            // Blank lines between pipelined requests are tolerated (RFC 9112 section 2.2), and skipped here rather
            // than buffered, so that a stream of them cannot grow into a 431.
            skipped = blank_line_bytes(input);
            input = &input[skipped..];
            if input.is_empty() || input == b"\r" {
                return Ok((skipped, None));
            }
        }
        let limit = self.limits.max_head_bytes;
        let room = limit.saturating_sub(self.head.len());
        let new = &input[..input.len().min(room)];
        let full = self.head.len() + new.len() >= limit;
        if !full && !new.contains(&b'\n') {
            // Without a new line feed the head cannot have ended; parsing would only repeat the last parse.
            self.head.extend_from_slice(new);
            return Ok((skipped + new.len(), None));
        }
        let earlier = self.head.len();
        let parsed = if earlier == 0 {
            // The common case, a head that arrives in one read: parsed in place, never copied.
            parse_head(new, self.limits)?
        } else {
            self.head.extend_from_slice(new);
            parse_head(&self.head, self.limits)?
        };
        match parsed {
            Some((request, length)) => {
                self.head = Vec::new();
                Ok((skipped + length - earlier, Some(request)))
            }
            None if full => Err(HttpError::new(
                431,
                format!(
                    "the request head is over the {limit}-byte limit; send fewer or shorter headers"
                ),
            )),
            None => {
                if earlier == 0 {
                    self.head.extend_from_slice(new);
                }
                Ok((skipped + new.len(), None))
            }
        }
    }
}

/// Parses `buffer` as a head; returns the request it starts and the head's length once it is complete.
fn parse_head(buffer: &[u8], limits: HttpLimits) -> Result<Option<(Request, usize)>, HttpError> {
    let mut headers = vec![httparse::EMPTY_HEADER; limits.max_headers];
    let mut head = httparse::Request::new(&mut headers);
    let length = match head.parse(buffer) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(error) => return Err(head_error(error, buffer, limits)),
    };
    let target = head.path.unwrap_or_default().to_owned();
    let path = match target.split_once('?') {
        Some((path, _)) => path.to_owned(),
        None => target.clone(),
    };
    let headers: Vec<(String, String)> = head
        .headers
        .iter()
        .map(|header| {
            let value = String::from_utf8_lossy(header.value);
            (
                header.name.to_ascii_lowercase(),
                value.trim_matches([' ', '\t']).to_owned(),
            )
        })
        .collect();
    let version = head.version.unwrap_or(1);
    let keep_alive = keep_alive(version, &headers);
    let request = Request {
        method: head.method.unwrap_or_default().to_owned(),
        target,
        path,
        version,
        headers,
        body: Vec::new(),
        keep_alive,
    };
    Ok(Some((request, length)))
}

/// The error for a head `httparse` refused.
fn head_error(error: httparse::Error, buffer: &[u8], limits: HttpLimits) -> HttpError {
    let message = match error {
        httparse::Error::TooManyHeaders => {
            return HttpError::new(
                431,
                format!("the request has more than {} headers", limits.max_headers),
            );
        }
        httparse::Error::Version => return version_error(buffer),
        httparse::Error::Token => {
            "the request line is malformed: it must be a method token, one space, a target without spaces \
             or control bytes, one space and the HTTP version"
        }
        httparse::Error::NewLine => "a line of the request head does not end in CRLF",
        httparse::Error::HeaderName => {
            "a header name holds a byte that is not allowed in a token, or a header line has no colon right \
             after its name"
        }
        httparse::Error::HeaderValue => "a header value holds a control byte",
        httparse::Error::Status => "the request head is malformed",
    };
    HttpError::new(400, message)
}

/// The error for a request line whose version `httparse` refused: 505 for an HTTP version other than 1.0 and
/// 1.1, 400 when the line does not end in an HTTP version at all.
fn version_error(buffer: &[u8]) -> HttpError {
    if buffer.starts_with(b"PRI * HTTP/2.0") {
        return HttpError::new(
            505,
            "this is an HTTP/2 connection preface; the server speaks HTTP/1.1 and 1.0 only, so connect \
             without HTTP/2 prior knowledge",
        );
    }
    let line = buffer
        .split(|&byte| byte == b'\n')
        .next()
        .unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let version = line.rsplit(|&byte| byte == b' ').next().unwrap_or_default();
    let shown = quote(version);
    if version.starts_with(b"HTTP/") {
        HttpError::new(
            505,
            format!("HTTP version {shown} is not supported; send HTTP/1.1 or HTTP/1.0"),
        )
    } else {
        HttpError::new(
            400,
            format!(
                "the request line ends in {shown} instead of an HTTP version such as `HTTP/1.1`"
            ),
        )
    }
}

/// How the body of `request` is framed, refusing framings that are ambiguous, unsupported or over the limit.
fn body_framing(request: &Request, limits: HttpLimits) -> Result<BodyFraming, HttpError> {
    let transfer_codings = list_values(request, "transfer-encoding");
    let lengths = list_values(request, "content-length");
    let has_transfer_encoding = request.header("transfer-encoding").is_some();
    let has_length = request.header("content-length").is_some();
    if has_transfer_encoding && has_length {
        // A proxy that believes one and a server that believes the other see different requests.
        return Err(HttpError::new(
            400,
            "the request has both Transfer-Encoding and Content-Length, which lets a request be smuggled \
             past a proxy; send one of them",
        ));
    }
    if has_transfer_encoding {
        if request.version == 0 {
            // RFC 9112 section 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing.
            return Err(HttpError::new(
                400,
                "an HTTP/1.0 request cannot use Transfer-Encoding; send Content-Length",
            ));
        }
        if let Some(coding) = transfer_codings
            .iter()
            .find(|coding| !coding.eq_ignore_ascii_case("chunked"))
        {
            return Err(HttpError::new(
                501,
                format!(
                    "transfer-coding {} is not implemented; send the body with Content-Length or with \
                     `Transfer-Encoding: chunked` alone",
                    quote(coding.as_bytes())
                ),
            ));
        }
        return match transfer_codings.len() {
            0 => Err(HttpError::new(
                400,
                "the Transfer-Encoding header is empty; send `Transfer-Encoding: chunked` or Content-Length",
            )),
            1 => Ok(BodyFraming::Chunked),
            _ => Err(HttpError::new(
                400,
                "Transfer-Encoding applies chunked more than once",
            )),
        };
    }
    let Some((first, others)) = lengths.split_first() else {
        return Ok(BodyFraming::None);
    };
    let mut length = content_length(first)?;
    for other in others {
        let value = content_length(other)?;
        if value != length {
            return Err(HttpError::new(
                400,
                format!(
                    "the request has differing Content-Length values ({} and {}); send one",
                    quote(first.as_bytes()),
                    quote(other.as_bytes())
                ),
            ));
        }
        length = value;
    }
    if length > limits.max_body_bytes as u64 {
        return Err(HttpError::new(
            413,
            format!(
                "the body's Content-Length of {length} bytes is over the {}-byte limit",
                limits.max_body_bytes
            ),
        ));
    }
    match length {
        0 => Ok(BodyFraming::None),
        // Not over max_body_bytes, so it fits a usize.
        length => Ok(BodyFraming::Length(
            usize::try_from(length).unwrap_or(usize::MAX),
        )),
    }
}

/// Whether the parser returns [`Parsed::Continue`] before the body: an HTTP/1.1 request with a body that sent
/// `Expect: 100-continue`. Refuses any other expectation with 417.
fn expects_continue(request: &Request, framing: BodyFraming) -> Result<bool, HttpError> {
    let expectations = list_values(request, "expect");
    if let Some(other) = expectations
        .iter()
        .find(|expectation| !expectation.eq_ignore_ascii_case("100-continue"))
    {
        return Err(HttpError::new(
            417,
            format!(
                "the expectation {} is not supported; only `100-continue` is",
                quote(other.as_bytes())
            ),
        ));
    }
    // RFC 9110 section 10.1.1: a 100-continue expectation in an HTTP/1.0 request is ignored, and a request
    // without a body has nothing to wait for.
    Ok(!expectations.is_empty() && request.version == 1 && framing != BodyFraming::None)
}

/// A Content-Length value as a number (saturating: a number past u64 is over any limit anyway).
fn content_length(value: &str) -> Result<u64, HttpError> {
    if value.is_empty() || !value.bytes().all(|byte| byte.is_ascii_digit()) {
        return Err(HttpError::new(
            400,
            format!(
                "Content-Length {} is not a number of bytes",
                quote(value.as_bytes())
            ),
        ));
    }
    Ok(value.bytes().fold(0u64, |length, digit| {
        length
            .saturating_mul(10)
            .saturating_add(u64::from(digit - b'0'))
    }))
}

/// The comma-separated elements of every header named `name`, trimmed, empty ones dropped.
fn list_values<'r>(request: &'r Request, name: &str) -> Vec<&'r str> {
    request
        .headers
        .iter()
        .filter(|(header, _)| header == name)
        .flat_map(|(_, value)| value.split(','))
        .map(|element| element.trim_matches([' ', '\t']))
        .filter(|element| !element.is_empty())
        .collect()
}

/// Whether the connection stays open after this request: HTTP/1.1 unless `Connection: close`, HTTP/1.0 only
/// with `Connection: keep-alive` (and no `close`).
fn keep_alive(version: u8, headers: &[(String, String)]) -> bool {
    let options = headers
        .iter()
        .filter(|(name, _)| name == "connection")
        .flat_map(|(_, value)| value.split(','))
        .map(|option| option.trim_matches([' ', '\t']));
    let mut close = false;
    let mut keep = false;
    for option in options {
        close |= option.eq_ignore_ascii_case("close");
        keep |= option.eq_ignore_ascii_case("keep-alive");
    }
    !close && (version == 1 || keep)
}

/// How many bytes of blank lines (CRLF or a bare LF) `input` starts with.
fn blank_line_bytes(input: &[u8]) -> usize {
    let mut offset = 0;
    loop {
        match input[offset..] {
            [b'\r', b'\n', ..] => offset += 2,
            [b'\n', ..] => offset += 1,
            _ => return offset,
        }
    }
}

/// Client bytes for an error message: at most 40 of them, escaped, in backticks.
fn quote(bytes: &[u8]) -> String {
    const SHOWN: usize = 40;
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(SHOWN)]);
    let ellipsis = if bytes.len() > SHOWN { "…" } else { "" };
    format!("`{}{ellipsis}`", text.escape_debug())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> HttpLimits {
        HttpLimits {
            max_head_bytes: 256,
            max_headers: 8,
            max_body_bytes: 64,
        }
    }

    /// Parses `input` whole with `limits`, expecting one request that uses all of it.
    fn request_with(input: &[u8], limits: HttpLimits) -> Request {
        let mut parser = RequestParser::new(limits);
        match parser.parse(input) {
            Ok((consumed, Parsed::Request(request))) => {
                assert_eq!(
                    consumed,
                    input.len(),
                    "the request did not use all its bytes"
                );
                request
            }
            other => panic!(
                "{:?} gave {other:?} instead of a request",
                String::from_utf8_lossy(input)
            ),
        }
    }

    fn request(input: &[u8]) -> Request {
        request_with(input, limits())
    }

    /// Parses `input` whole (answering a Continue) and returns the error it must end in.
    fn error_with(input: &[u8], limits: HttpLimits) -> HttpError {
        let mut parser = RequestParser::new(limits);
        let mut rest = input;
        loop {
            match parser.parse(rest) {
                Err(error) => return error,
                Ok((consumed, Parsed::Continue)) => rest = &rest[consumed..],
                other => panic!(
                    "{:?} gave {other:?} instead of an error",
                    String::from_utf8_lossy(input)
                ),
            }
        }
    }

    fn refusal(input: &[u8]) -> HttpError {
        error_with(input, limits())
    }

    #[test]
    fn a_get_gives_its_method_target_path_version_and_headers() {
        let request = request(
            b"GET /v1/models?x=1 HTTP/1.1\r\nHost: Example\r\nX-Thing:   spaced \t\r\n\r\n",
        );
        assert_eq!(request.method, "GET");
        assert_eq!(request.target, "/v1/models?x=1");
        assert_eq!(request.path, "/v1/models");
        assert_eq!(request.version, 1);
        assert_eq!(
            request.headers,
            [
                ("host".to_owned(), "Example".to_owned()),
                ("x-thing".to_owned(), "spaced".to_owned())
            ]
        );
        assert!(request.body.is_empty());
        assert!(request.keep_alive);
    }

    #[test]
    fn a_header_value_that_is_not_utf8_is_replaced_lossily() {
        let request = request(b"GET / HTTP/1.1\r\nX-Bytes: a\xffb\r\n\r\n");
        assert_eq!(request.header("x-bytes"), Some("a\u{fffd}b"));
    }

    #[test]
    fn keep_alive_follows_the_version_and_the_connection_header() {
        let cases: [(&[u8], bool); 6] = [
            (b"GET / HTTP/1.1\r\n\r\n", true),
            (b"GET / HTTP/1.1\r\nConnection: Close\r\n\r\n", false),
            (
                b"GET / HTTP/1.1\r\nConnection: upgrade, close\r\n\r\n",
                false,
            ),
            (b"GET / HTTP/1.0\r\n\r\n", false),
            (b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", true),
            (
                b"GET / HTTP/1.0\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n",
                false,
            ),
        ];
        for (input, expected) in cases {
            assert_eq!(
                request(input).keep_alive,
                expected,
                "keep-alive of {:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn a_content_length_body_is_read_and_the_next_request_left_unconsumed() {
        let input = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloGET / HTTP/1.1\r\n\r\n";
        let mut parser = RequestParser::new(limits());
        let (consumed, parsed) = parser.parse(input).unwrap();
        let Parsed::Request(first) = parsed else {
            panic!("the first request was not complete: {parsed:?}");
        };
        assert_eq!(first.body, b"hello");
        assert_eq!(&input[consumed..], b"GET / HTTP/1.1\r\n\r\n");
        let (rest, parsed) = parser.parse(&input[consumed..]).unwrap();
        assert_eq!(rest, input.len() - consumed);
        assert!(matches!(parsed, Parsed::Request(second) if second.method == "GET"));
    }

    #[test]
    fn equal_content_lengths_are_accepted_and_zero_means_no_body() {
        let request =
            request(b"POST / HTTP/1.1\r\nContent-Length: 3, 3\r\nContent-Length: 3\r\n\r\nabc");
        assert_eq!(request.body, b"abc");
        let empty = super::tests::request(b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
        assert!(empty.body.is_empty());
    }

    #[test]
    fn a_content_length_that_is_not_a_number_is_refused() {
        for value in ["abc", "-1", "+5", "5 5", "0x10", "1.0"] {
            let input = format!("POST / HTTP/1.1\r\nContent-Length: {value}\r\n\r\n");
            let error = refusal(input.as_bytes());
            assert_eq!(error.status, 400, "Content-Length {value}");
            assert!(error.message.contains("not a number"), "{}", error.message);
        }
    }

    #[test]
    fn differing_content_lengths_are_refused() {
        let error =
            refusal(b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd");
        assert_eq!(error.status, 400);
        assert!(error.message.contains("differing"), "{}", error.message);
        assert_eq!(
            refusal(b"POST / HTTP/1.1\r\nContent-Length: 3, 4\r\n\r\nabcd").status,
            400
        );
    }

    #[test]
    fn a_content_length_over_the_limit_is_refused_from_the_head_alone() {
        let mut parser = RequestParser::new(limits());
        let error = parser
            .parse(b"POST / HTTP/1.1\r\nContent-Length: 65\r\n\r\n")
            .unwrap_err();
        assert_eq!(error.status, 413);
        let huge =
            refusal(b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999999\r\n\r\n");
        assert_eq!(
            huge.status, 413,
            "a length past u64 is over the limit, not malformed"
        );
        let exact = request(
            &[
                b"POST / HTTP/1.1\r\nContent-Length: 64\r\n\r\n".as_slice(),
                &[b'x'; 64],
            ]
            .concat(),
        );
        assert_eq!(
            exact.body.len(),
            64,
            "a body of exactly the limit is accepted"
        );
    }

    #[test]
    fn a_chunked_body_is_de_chunked() {
        let request = request(b"POST / HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nT: 1\r\n\r\n");
        assert_eq!(request.body, b"abc");
    }

    #[test]
    fn a_chunked_body_over_the_limit_is_refused() {
        let error = refusal(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n41\r\n");
        assert_eq!(error.status, 413);
    }

    #[test]
    fn a_transfer_coding_other_than_chunked_is_not_implemented() {
        for value in ["gzip", "gzip, chunked", "chunked, identity"] {
            let input = format!("POST / HTTP/1.1\r\nTransfer-Encoding: {value}\r\n\r\n");
            assert_eq!(
                refusal(input.as_bytes()).status,
                501,
                "Transfer-Encoding: {value}"
            );
        }
    }

    #[test]
    fn chunked_twice_or_an_empty_transfer_encoding_is_refused() {
        assert_eq!(
            refusal(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, chunked\r\n\r\n").status,
            400
        );
        assert_eq!(
            refusal(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n").status,
            400
        );
        assert_eq!(
            refusal(b"POST / HTTP/1.1\r\nTransfer-Encoding: ,\r\n\r\n").status,
            400
        );
    }

    #[test]
    fn transfer_encoding_with_content_length_is_refused_as_smuggling() {
        let error = refusal(
            b"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        );
        assert_eq!(error.status, 400);
        assert!(error.message.contains("smuggled"), "{}", error.message);
    }

    #[test]
    fn transfer_encoding_on_http_1_0_is_refused() {
        assert_eq!(
            refusal(b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n").status,
            400
        );
    }

    #[test]
    fn expect_100_continue_gives_one_continue_then_the_body() {
        let head = b"POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 3\r\n\r\n";
        let input = [head.as_slice(), b"abc"].concat();
        let mut parser = RequestParser::new(limits());
        assert_eq!(
            parser.parse(&input).unwrap(),
            (head.len(), Parsed::Continue)
        );
        assert!(parser.in_progress(), "the body is still to come");
        let (consumed, parsed) = parser.parse(&input[head.len()..]).unwrap();
        assert_eq!(consumed, 3);
        assert!(matches!(parsed, Parsed::Request(request) if request.body == b"abc"));
        assert!(!parser.in_progress());
    }

    #[test]
    fn expect_100_continue_with_a_length_over_the_limit_is_a_413_not_a_continue() {
        let error =
            refusal(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 100\r\n\r\n");
        assert_eq!(error.status, 413);
    }

    #[test]
    fn expect_100_continue_without_a_body_or_on_http_1_0_gives_no_continue() {
        request(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n");
        request(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n");
        request(b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nab");
    }

    #[test]
    fn an_unknown_expectation_is_refused_with_417() {
        assert_eq!(
            refusal(b"POST / HTTP/1.1\r\nExpect: teapot\r\n\r\n").status,
            417
        );
    }

    #[test]
    fn a_head_over_the_limit_is_refused_with_431_whole_or_in_pieces() {
        let mut input = b"GET / HTTP/1.1\r\nX-Long: ".to_vec();
        input.resize(300, b'a');
        let error = refusal(&input);
        assert_eq!(error.status, 431);
        assert!(
            error.message.contains("256-byte limit"),
            "{}",
            error.message
        );
        let mut parser = RequestParser::new(limits());
        let mut outcome = Ok((0, Parsed::NeedMore));
        for byte in &input {
            outcome = parser.parse(std::slice::from_ref(byte));
            if outcome.is_err() {
                break;
            }
        }
        assert_eq!(outcome.unwrap_err().status, 431);
    }

    #[test]
    fn a_head_of_exactly_the_limit_is_accepted() {
        let mut input = b"GET / HTTP/1.1\r\nX-Long: ".to_vec();
        input.resize(256 - 4, b'a');
        input.extend_from_slice(b"\r\n\r\n");
        assert_eq!(
            request(&input).header("x-long").map(str::len),
            Some(256 - 4 - 24)
        );
    }

    #[test]
    fn too_many_headers_are_refused_with_431() {
        let mut input = b"GET / HTTP/1.1\r\n".to_vec();
        for index in 0..9 {
            input.extend_from_slice(format!("X-{index}: v\r\n").as_bytes());
        }
        input.extend_from_slice(b"\r\n");
        let error = refusal(&input);
        assert_eq!(error.status, 431);
        assert!(
            error.message.contains("more than 8 headers"),
            "{}",
            error.message
        );
    }

    #[test]
    fn malformed_heads_are_refused_with_400() {
        let cases: [&[u8]; 6] = [
            b"GET  / HTTP/1.1\r\n\r\n",
            b"G(T / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1x\r\n\r\n",
            b"GET / HTTP/1.1\r\nBad Name: v\r\n\r\n",
            b"GET / HTTP/1.1\r\nName: a\x01b\r\n\r\n",
            b"GET / FTP/1.1\r\n\r\n",
        ];
        for input in cases {
            assert_eq!(
                refusal(input).status,
                400,
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn http_versions_other_than_1_0_and_1_1_are_refused_with_505() {
        let preface = refusal(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        assert_eq!(preface.status, 505);
        assert!(
            preface.message.contains("HTTP/2 connection preface"),
            "{}",
            preface.message
        );
        for input in [
            b"GET / HTTP/1.2\r\n\r\n".as_slice(),
            b"GET / HTTP/3.0\r\n\r\n",
            b"GET / HTTP/0.9\r\n\r\n",
        ] {
            assert_eq!(
                refusal(input).status,
                505,
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn blank_lines_before_a_request_are_skipped_even_one_byte_at_a_time() {
        let request = request(b"\r\n\n\r\nGET / HTTP/1.1\r\n\r\n");
        assert_eq!(request.method, "GET");
        let mut parser = RequestParser::new(limits());
        // A thousand blank lines must not fill the 256-byte head buffer.
        for _ in 0..1000 {
            assert_eq!(
                parser.parse(b"\r").unwrap(),
                (0, Parsed::NeedMore),
                "a lone CR waits for its LF"
            );
            assert_eq!(parser.parse(b"\r\n").unwrap(), (2, Parsed::NeedMore));
            assert!(
                !parser.in_progress(),
                "blank lines are not part of a request"
            );
        }
    }

    #[test]
    fn a_head_in_pieces_is_consumed_and_completes_at_its_blank_line() {
        let input = b"GET / HTTP/1.1\r\nHost: x\r\n\r\nnext";
        let mut parser = RequestParser::new(limits());
        assert_eq!(parser.parse(&input[..10]).unwrap(), (10, Parsed::NeedMore));
        assert!(parser.in_progress(), "a started head is in progress");
        assert_eq!(
            parser.parse(&input[10..20]).unwrap(),
            (10, Parsed::NeedMore)
        );
        let (consumed, parsed) = parser.parse(&input[20..]).unwrap();
        assert_eq!(
            consumed,
            input.len() - 4 - 20,
            "the bytes after the head stay unconsumed"
        );
        assert!(matches!(parsed, Parsed::Request(_)));
        assert!(!parser.in_progress());
    }

    #[test]
    fn an_error_sticks() {
        let mut parser = RequestParser::new(limits());
        let first = parser.parse(b"GET / HTTP/9.9\r\n\r\n").unwrap_err();
        let again = parser.parse(b"GET / HTTP/1.1\r\n\r\n").unwrap_err();
        assert_eq!(first, again, "a refused connection stays refused");
        assert!(!parser.in_progress());
    }

    #[test]
    fn zero_limits_refuse_instead_of_looping() {
        let zero = HttpLimits {
            max_head_bytes: 0,
            max_headers: 0,
            max_body_bytes: 0,
        };
        assert_eq!(error_with(b"GET / HTTP/1.1\r\n\r\n", zero).status, 431);
        let no_headers = HttpLimits {
            max_headers: 0,
            ..limits()
        };
        assert_eq!(
            request_with(b"GET / HTTP/1.1\r\n\r\n", no_headers).method,
            "GET"
        );
        assert_eq!(
            error_with(b"GET / HTTP/1.1\r\nA: b\r\n\r\n", no_headers).status,
            431
        );
    }

    #[test]
    fn error_messages_quote_at_most_40_bytes_of_the_client() {
        let value = "9".repeat(30) + &"x".repeat(30);
        let input = format!("POST / HTTP/1.1\r\nContent-Length: {value}\r\n\r\n");
        let error = refusal(input.as_bytes());
        assert!(error.message.contains('…'), "{}", error.message);
        assert!(error.message.len() < 120, "{}", error.message);
    }
}
