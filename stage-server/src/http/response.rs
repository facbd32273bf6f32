//! Response framing: status lines and heads, Content-Length and chunked bodies, and server-sent events.
//!
//! Every function appends to the caller's output buffer and never fails; numbers are written without
//! allocating. CR and LF in header names and values are written as spaces, so a value built from request data
//! cannot split the head into a second response.

/// How a response's body is framed, which decides the framing header `write_head` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// A body of exactly this many bytes: `Content-Length: n`.
    Length(usize),
    /// A body of chunks ended by an empty one: `Transfer-Encoding: chunked` (for streams).
    Chunked,
    /// No framing header, for responses that never have a body: 1xx, 204 and 304 (and answers to HEAD, with
    /// care). Any other response needs a length or chunks, or the client cannot tell where it ends.
    Empty,
    /// No framing header: the body ends where the connection does. For a stream to an HTTP/1.0 client, which
    /// cannot take chunks (RFC 9112, section 6.1); the head must close the connection (`keep_alive` false).
    UntilClose,
}

/// The reason phrase of `status` as RFC 9110 names it, or `""` for a status it does not name (a status line
/// may carry an empty reason).
pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        203 => "Non-Authoritative Information",
        204 => "No Content",
        205 => "Reset Content",
        206 => "Partial Content",
        300 => "Multiple Choices",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        402 => "Payment Required",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        407 => "Proxy Authentication Required",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        412 => "Precondition Failed",
        413 => "Content Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        416 => "Range Not Satisfiable",
        417 => "Expectation Failed",
        421 => "Misdirected Request",
        422 => "Unprocessable Content",
        426 => "Upgrade Required",
        428 => "Precondition Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

/// Writes a response head: the status line, the given headers, `Content-Length` or `Transfer-Encoding:
/// chunked` per `framing`, `Connection: close` when `!keep_alive`, and the blank line.
///
/// `headers` must not hold the framing or `Connection` headers themselves; this function owns them so that
/// they always agree with the body that follows.
pub fn write_head(
    out: &mut Vec<u8>,
    status: u16,
    headers: &[(&str, &str)],
    framing: Framing,
    keep_alive: bool,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    write_decimal(out, u64::from(status));
    out.push(b' ');
    out.extend_from_slice(reason_phrase(status).as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        write_field_text(out, name);
        out.extend_from_slice(b": ");
        write_field_text(out, value);
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        Framing::Length(length) => {
            out.extend_from_slice(b"Content-Length: ");
            write_decimal(out, length as u64);
            out.extend_from_slice(b"\r\n");
        }
        Framing::Chunked => out.extend_from_slice(b"Transfer-Encoding: chunked\r\n"),
        Framing::Empty | Framing::UntilClose => {}
    }
    if !keep_alive {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Writes a whole response whose body is `body`, framed by its Content-Length.
pub fn write_response(
    out: &mut Vec<u8>,
    status: u16,
    headers: &[(&str, &str)],
    body: &[u8],
    keep_alive: bool,
) {
    write_head(
        out,
        status,
        headers,
        Framing::Length(body.len()),
        keep_alive,
    );
    out.extend_from_slice(body);
}

/// Writes `data` as one chunk of a chunked body; writes nothing for empty data, since an empty chunk would end
/// the body.
pub fn write_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    write_chunk_size(out, data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// Writes the empty last chunk that ends a chunked body (with no trailers).
pub fn write_last_chunk(out: &mut Vec<u8>) {
    out.extend_from_slice(b"0\r\n\r\n");
}

/// Writes one server-sent event `data: {payload}\n\n` as one chunk of a chunked body. A payload with line
/// breaks becomes one `data:` line per line, which a client's event parser joins back with `\n`.
pub fn write_sse_data(out: &mut Vec<u8>, payload: &str) {
    write_sse_event(out, payload, true);
}

/// [`write_sse_data`], as one chunk when `chunked`, else bare (a body that ends with the connection,
/// [`Framing::UntilClose`]).
pub fn write_sse_event(out: &mut Vec<u8>, payload: &str, chunked: bool) {
    const PREFIX: &[u8] = b"data: ";
    let lines = || {
        payload
            .split('\n')
            .map(|line| line.strip_suffix('\r').unwrap_or(line))
    };
    // Sized first, so the event is written straight into `out` behind its chunk size.
    let length: usize = lines()
        .map(|line| PREFIX.len() + line.len() + 1)
        .sum::<usize>()
        + 1;
    if chunked {
        write_chunk_size(out, length);
    }
    for line in lines() {
        out.extend_from_slice(PREFIX);
        // A lone CR also ends a line in an event stream; written as a space it cannot cut the payload.
        write_replacing(out, line.as_bytes(), b"\r", b' ');
        out.push(b'\n');
    }
    out.push(b'\n');
    if chunked {
        out.extend_from_slice(b"\r\n");
    }
}

/// Writes a chunk's size line.
fn write_chunk_size(out: &mut Vec<u8>, length: usize) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    let mut start = digits.len();
    let mut rest = length as u64;
    loop {
        start -= 1;
        digits[start] = DIGITS[(rest % 16) as usize];
        rest /= 16;
        if rest == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[start..]);
    out.extend_from_slice(b"\r\n");
}

/// Writes `value` in decimal.
fn write_decimal(out: &mut Vec<u8>, value: u64) {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    let mut rest = value;
    loop {
        start -= 1;
        digits[start] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[start..]);
}

/// Writes a header name or value with CR, LF and NUL as spaces.
fn write_field_text(out: &mut Vec<u8>, text: &str) {
    write_replacing(out, text.as_bytes(), b"\r\n\0", b' ');
}

/// Writes `bytes` with each byte in `forbidden` replaced by `replacement`.
fn write_replacing(out: &mut Vec<u8>, bytes: &[u8], forbidden: &[u8], replacement: u8) {
    out.extend(bytes.iter().map(|byte| {
        if forbidden.contains(byte) {
            replacement
        } else {
            *byte
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(bytes: &[u8]) -> &str {
        std::str::from_utf8(bytes).unwrap()
    }

    #[test]
    fn a_head_has_the_status_line_headers_framing_and_blank_line() {
        let mut out = Vec::new();
        write_head(
            &mut out,
            200,
            &[("Content-Type", "application/json")],
            Framing::Length(12),
            true,
        );
        assert_eq!(
            text(&out),
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n"
        );
    }

    #[test]
    fn a_chunked_head_says_so_and_an_empty_one_has_no_framing_header() {
        let mut out = Vec::new();
        write_head(&mut out, 200, &[], Framing::Chunked, true);
        assert_eq!(
            text(&out),
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        );
        out.clear();
        write_head(&mut out, 204, &[], Framing::Empty, true);
        assert_eq!(text(&out), "HTTP/1.1 204 No Content\r\n\r\n");
    }

    #[test]
    fn a_head_that_closes_says_connection_close() {
        let mut out = Vec::new();
        write_head(&mut out, 400, &[], Framing::Length(0), false);
        assert_eq!(
            text(&out),
            "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn line_breaks_in_header_text_cannot_split_the_head() {
        let mut out = Vec::new();
        write_head(
            &mut out,
            200,
            &[("X-Id", "a\r\nSet-Cookie: b")],
            Framing::Empty,
            true,
        );
        assert_eq!(
            text(&out),
            "HTTP/1.1 200 OK\r\nX-Id: a  Set-Cookie: b\r\n\r\n"
        );
    }

    #[test]
    fn an_unknown_status_has_an_empty_reason() {
        assert_eq!(reason_phrase(299), "");
        let mut out = Vec::new();
        write_head(&mut out, 299, &[], Framing::Empty, true);
        assert!(out.starts_with(b"HTTP/1.1 299 \r\n"));
    }

    #[test]
    fn the_errors_the_parser_returns_have_reason_phrases() {
        for status in [400, 413, 417, 431, 501, 505] {
            assert!(
                !reason_phrase(status).is_empty(),
                "status {status} has no reason phrase"
            );
        }
    }

    #[test]
    fn a_response_carries_its_body_after_a_content_length() {
        let mut out = Vec::new();
        write_response(&mut out, 404, &[], b"missing", true);
        assert_eq!(
            text(&out),
            "HTTP/1.1 404 Not Found\r\nContent-Length: 7\r\n\r\nmissing"
        );
    }

    #[test]
    fn chunks_have_hex_sizes_and_an_empty_chunk_is_not_written() {
        let mut out = Vec::new();
        write_chunk(&mut out, &[b'x'; 26]);
        write_chunk(&mut out, b"");
        write_last_chunk(&mut out);
        let expected = format!("1a\r\n{}\r\n0\r\n\r\n", "x".repeat(26));
        assert_eq!(text(&out), expected);
    }

    #[test]
    fn an_event_is_one_chunk_of_data_lines() {
        let mut out = Vec::new();
        write_sse_data(&mut out, "{\"a\":1}");
        assert_eq!(text(&out), "f\r\ndata: {\"a\":1}\n\n\r\n");
        out.clear();
        write_sse_data(&mut out, "one\r\ntwo\nthree\rfour");
        let event = "data: one\ndata: two\ndata: three four\n\n";
        assert_eq!(text(&out), format!("{:x}\r\n{event}\r\n", event.len()));
        out.clear();
        write_sse_data(&mut out, "");
        assert_eq!(text(&out), "8\r\ndata: \n\n\r\n");
    }

    #[test]
    fn numbers_are_written_whole() {
        let mut out = Vec::new();
        write_decimal(&mut out, u64::MAX);
        assert_eq!(text(&out), u64::MAX.to_string());
        out.clear();
        write_chunk_size(&mut out, usize::MAX);
        assert_eq!(text(&out), format!("{:x}\r\n", usize::MAX));
    }
}
