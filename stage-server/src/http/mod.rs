//! Sans-IO HTTP/1.1 for stage 0's API: request parsing (heads, bodies, limits) and response framing.
//!
//! Nothing here touches a socket. The session that owns the connection reads bytes, hands them to a
//! [`RequestParser`] and acts on what comes back; it writes what the `write_*` functions put in its output
//! buffer. Keeping the protocol here, below every driver, lets it run under property tests and fuzzing, and
//! keeps two drivers from growing two HTTPs.
//!
//! ```text
//!  socket ──read──▶ session buffer ──parse(&buffer)──▶ RequestParser ──▶ (consumed, Parsed)
//!                        ▲                                                   │
//!                        └──────── session drops `consumed` bytes ◀──────────┘
//!   NeedMore: read more (in_progress() picks the read deadline)
//!   Continue: write CONTINUE_RESPONSE, parse again
//!   Request:  answer it; parse the rest (a pipelined request may already be there)
//!   Err:      write the error's status, then close
//! ```
//!
//! The parser holds at most `max_head_bytes` of a head and `max_body_bytes` of a body; a session's own buffer
//! never needs to hold more than one read, because the parser consumes everything it is given except the bytes
//! after a complete request (and a lone CR between requests, until its LF arrives).

mod chunked;
mod request;
mod response;

pub use request::RequestParser;
pub use response::{
    Framing, reason_phrase, write_chunk, write_head, write_last_chunk, write_response,
    write_sse_data, write_sse_event,
};

/// The interim response a session writes when the parser returns [`Parsed::Continue`].
pub const CONTINUE_RESPONSE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// How much of a request the parser accepts before it refuses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Most bytes of a request head (request line and headers, blank line included); also the bound on a
    /// chunked body's trailer section. Over it: 431.
    pub max_head_bytes: usize,
    /// Most header fields in a head. Over it: 431.
    pub max_headers: usize,
    /// Most bytes of a body, after de-chunking. Over it: 413, decided as soon as a length says so.
    pub max_body_bytes: usize,
}

impl Default for HttpLimits {
    /// 16 KiB of head, 64 headers and 4 MiB of body: room for any chat request with a long prompt, while one
    /// connection can pin only a few megabytes.
    fn default() -> Self {
        Self {
            max_head_bytes: 16 * 1024,
            max_headers: 64,
            max_body_bytes: 4 * 1024 * 1024,
        }
    }
}

/// One complete request: its head as sent and its body with any chunked framing removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The method as sent, e.g. `"GET"` (methods are case-sensitive).
    pub method: String,
    /// The request target as sent, query included (`"/v1/models?x=1"`).
    pub target: String,
    /// The target before any `?`.
    pub path: String,
    /// The minor version: 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub version: u8,
    /// The header fields in the order sent: names lower-cased, values with surrounding spaces and tabs
    /// trimmed (bytes that are not UTF-8 replaced by U+FFFD).
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked; empty when the request has none.
    pub body: Vec<u8>,
    /// Whether the connection may carry another request after the response: on HTTP/1.1 unless the client
    /// sent `Connection: close`, on HTTP/1.0 only when it sent `Connection: keep-alive`.
    pub keep_alive: bool,
}

impl Request {
    /// The value of the first header named `name` (compared without regard to ASCII case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(header, _)| header.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// What one call of [`RequestParser::parse`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// The input holds no complete request yet: read more, then call again with what is left.
    NeedMore,
    /// The head asked for `Expect: 100-continue`: write [`CONTINUE_RESPONSE`], then call again for the body.
    /// Comes at most once per request, after every check the head alone can fail.
    Continue,
    /// A complete request.
    Request(Request),
}

/// Why a request was refused: the status to answer with and a sentence saying what was wrong. After one, the
/// session writes the response and closes the connection (the parser repeats the error if called again).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} {}: {}", .status, reason_phrase(*.status), .message)]
pub struct HttpError {
    /// The response status: 400, 413, 417, 431, 501 or 505.
    pub status: u16,
    /// What was wrong with the request and, where it helps, what to send instead.
    pub message: String,
}

impl HttpError {
    /// An error with `status` and `message`.
    pub(crate) fn new(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_limits_are_16_kib_of_head_64_headers_and_4_mib_of_body() {
        let limits = HttpLimits::default();
        assert_eq!(limits.max_head_bytes, 16 * 1024);
        assert_eq!(limits.max_headers, 64);
        assert_eq!(limits.max_body_bytes, 4 * 1024 * 1024);
    }

    #[test]
    fn a_header_is_found_whatever_the_case_and_the_first_one_wins() {
        let request = Request {
            method: "GET".into(),
            target: "/".into(),
            path: "/".into(),
            version: 1,
            headers: vec![
                ("accept".into(), "first".into()),
                ("accept".into(), "second".into()),
            ],
            body: Vec::new(),
            keep_alive: true,
        };
        assert_eq!(request.header("Accept"), Some("first"));
        assert_eq!(request.header("ACCEPT"), Some("first"));
        assert_eq!(request.header("host"), None);
    }

    #[test]
    fn an_error_displays_its_status_reason_and_message() {
        let error = HttpError::new(413, "too big");
        assert_eq!(error.to_string(), "413 Content Too Large: too big");
    }
}
