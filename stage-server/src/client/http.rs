//! A small blocking HTTP/1.1 client over `std::net::TcpStream`: one request per connection, bodies read in pieces.
//!
//! It does what the chat client needs and no more: `POST` a JSON body, read the status and headers
//! (parsed with `httparse`), then hand out the body as it arrives, de-framed by `Content-Length`, chunked
//! coding or the connection's close. Every request sends `Connection: close` and opens its own connection:
//! a chat turn takes seconds, so a handshake on loopback costs nothing, and a reply stopped halfway is
//! ended by simply dropping the connection, which tells the server to free the lane.
//!
//! Reads wait at most [`ClientOptions::poll_interval`] at a time and ask the caller's `stop` check between
//! waits. That is how Ctrl-C reaches a blocked read: the signal handler is installed with `SA_RESTART`, so
//! the kernel restarts the read instead of failing it with `EINTR`, and only a timeout gives control back.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use super::chunked::{ChunkedDecoder, ChunkedError, Progress};

/// The most bytes a response head may take; real heads are a few hundred.
const HEAD_LIMIT: usize = 64 * 1024;
/// The most headers a response head may carry.
const HEADER_COUNT_LIMIT: usize = 64;
/// How much is read from the socket at a time.
const READ_SIZE: usize = 16 * 1024;

/// Where the server is: `http://HOST[:PORT][/PREFIX]`, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    host: String,
    port: u16,
    /// The path prefix every request path is put under, without a trailing slash (often empty).
    prefix: String,
}

/// Timeouts of a [`Client`].
#[derive(Debug, Clone, Copy)]
pub struct ClientOptions {
    /// How long connecting may take.
    pub connect_timeout: Duration,
    /// How long sending the request may stall.
    pub write_timeout: Duration,
    /// The longest a read blocks before the caller's stop check runs again.
    pub poll_interval: Duration,
}

/// A client for one server; cheap to keep, it holds no connection between requests.
#[derive(Debug, Clone)]
pub struct Client {
    endpoint: Endpoint,
    options: ClientOptions,
}

/// A response whose head has been read; the body is read on demand.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    headers: Vec<(String, String)>,
    body: Body,
}

/// One step of reading a body.
#[derive(Debug, PartialEq, Eq)]
pub enum BodyRead {
    /// Some body bytes (never empty).
    Data(Vec<u8>),
    /// The body is complete.
    End,
    /// The caller's stop check said to stop; the response is left unfinished.
    Stopped,
}

/// Why a request failed before a response was complete.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The URL is not `http://HOST[:PORT][/PREFIX]`.
    #[error("`{url}` is not a server URL: {reason}; give one like http://127.0.0.1:8080")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// No connection could be made.
    #[error(
        "could not connect to {authority}: {source}; is `stage-server run` up and listening there?"
    )]
    Connect {
        /// `host:port`.
        authority: String,
        /// The last address's error.
        source: io::Error,
    },
    /// Sending or receiving failed.
    #[error("the connection to the server failed: {0}")]
    Io(#[from] io::Error),
    /// The server closed the connection before the head or body was complete.
    #[error("the server closed the connection {0}")]
    Closed(&'static str),
    /// The response head is not HTTP/1.1 or too large.
    #[error("the server's response head is malformed: {0}")]
    MalformedHead(String),
    /// The chunked body is malformed.
    #[error(transparent)]
    Chunked(#[from] ChunkedError),
    /// A body read whole was larger than the caller allows.
    #[error("the server's response body is over {limit} bytes")]
    BodyTooLarge {
        /// The caller's limit.
        limit: usize,
    },
}

#[derive(Debug)]
struct Body {
    stream: TcpStream,
    framing: Framing,
    /// Bytes read from the socket but not yet de-framed (the part of the first read past the head).
    pending: Vec<u8>,
}

#[derive(Debug)]
enum Framing {
    /// `Content-Length`: this many bytes remain.
    Length(u64),
    Chunked(ChunkedDecoder),
    /// Neither header: the body runs until the server closes.
    UntilClose,
    Finished,
}

/// What one socket read gave.
enum Filled {
    Bytes(usize),
    Closed,
    Stopped,
}

impl Endpoint {
    /// Parses `http://HOST[:PORT][/PREFIX]`; the port defaults to 80, a trailing slash is dropped.
    ///
    /// `https` is refused with a reason rather than tried: the server speaks plain HTTP, and a TLS
    /// terminator in front of it is out of this client's scope.
    pub fn parse(url: &str) -> Result<Self, ClientError> {
        let bad = |reason| ClientError::BadUrl {
            url: url.to_owned(),
            reason,
        };
        let Some(rest) = url.strip_prefix("http://") else {
            if url.starts_with("https://") {
                return Err(bad("https is not supported"));
            }
            return Err(bad("it does not start with http://"));
        };
        let (authority, path) = match rest.find('/') {
            Some(slash) => rest.split_at(slash),
            None => (rest, ""),
        };
        if authority.contains('@') {
            return Err(bad("user names in URLs are not supported; use --api-key"));
        }
        let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
            // An IPv6 literal: [::1] or [::1]:8080.
            let Some((host, after)) = bracketed.split_once(']') else {
                return Err(bad("an IPv6 address lacks its closing bracket"));
            };
            let port = match after.strip_prefix(':') {
                Some(port) => Some(port),
                None if after.is_empty() => None,
                None => return Err(bad("unexpected text after the IPv6 address")),
            };
            (host, port)
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(bad("it has no host"));
        }
        let port = match port {
            Some(port) => port.parse().map_err(|_| bad("the port is not a number"))?,
            None => 80,
        };
        if path.contains(['?', '#']) {
            return Err(bad("a query or fragment makes no sense in a server URL"));
        }
        Ok(Self {
            host: host.to_owned(),
            port,
            prefix: path.trim_end_matches('/').to_owned(),
        })
    }

    /// `host:port` as the `Host` header wants it (IPv6 literals in brackets).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The request target for `path` (which starts with `/`) under the prefix.
    pub fn target(&self, path: &str) -> String {
        format!("{}{path}", self.prefix)
    }
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(30),
            poll_interval: Duration::from_millis(50),
        }
    }
}

impl Client {
    /// A client for `endpoint`.
    pub fn new(endpoint: Endpoint, options: ClientOptions) -> Self {
        Self { endpoint, options }
    }

    /// The server this client talks to.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Sends `POST path` with a JSON body and reads the response head.
    ///
    /// `stop` is asked between waits while the head has not come (a long prompt's prefill); when it says
    /// stop, `Ok(None)` is returned and the connection is closed.
    pub fn post_json(
        &self,
        path: &str,
        bearer: Option<&str>,
        body: &serde_json::Value,
        stop: &mut dyn FnMut() -> bool,
    ) -> Result<Option<Response>, ClientError> {
        let body = serde_json::to_vec(body).map_err(io::Error::other)?;
        let mut head = format!(
            "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Accept: application/json, text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.endpoint.target(path),
            self.endpoint.authority(),
            body.len()
        );
        if let Some(key) = bearer {
            head.push_str(&format!("Authorization: Bearer {key}\r\n"));
        }
        head.push_str("\r\n");
        let mut stream = self.connect()?;
        stream.set_write_timeout(Some(self.options.write_timeout))?;
        stream.set_read_timeout(Some(self.options.poll_interval))?;
        stream.set_nodelay(true)?;
        let mut request = head.into_bytes();
        request.extend_from_slice(&body);
        stream.write_all(&request)?;
        read_response(stream, stop)
    }

    fn connect(&self) -> Result<TcpStream, ClientError> {
        let authority = self.endpoint.authority();
        let connect_error = |source| ClientError::Connect {
            authority: authority.clone(),
            source,
        };
        let addresses: Vec<SocketAddr> = (self.endpoint.host.as_str(), self.endpoint.port)
            .to_socket_addrs()
            .map_err(connect_error)?
            .collect();
        let mut last_error = io::Error::new(io::ErrorKind::NotFound, "the host has no address");
        for address in addresses {
            match TcpStream::connect_timeout(&address, self.options.connect_timeout) {
                Ok(stream) => return Ok(stream),
                Err(error) => last_error = error,
            }
        }
        Err(connect_error(last_error))
    }
}

impl Response {
    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    /// Reads the next piece of the body, asking `stop` between waits.
    pub fn read_body(&mut self, stop: &mut dyn FnMut() -> bool) -> Result<BodyRead, ClientError> {
        self.body.read(stop)
    }

    /// Reads the rest of the body, up to `limit` bytes (for error envelopes and other small bodies).
    pub fn read_to_end(&mut self, limit: usize) -> Result<Vec<u8>, ClientError> {
        let mut all = Vec::new();
        loop {
            match self.body.read(&mut || false)? {
                BodyRead::Data(bytes) => {
                    all.extend_from_slice(&bytes);
                    if all.len() > limit {
                        return Err(ClientError::BodyTooLarge { limit });
                    }
                }
                BodyRead::End | BodyRead::Stopped => return Ok(all),
            }
        }
    }
}

impl Body {
    fn read(&mut self, stop: &mut dyn FnMut() -> bool) -> Result<BodyRead, ClientError> {
        loop {
            let ready = !self.pending.is_empty() || matches!(self.framing, Framing::Finished);
            if ready && let Some(read) = self.deframe()? {
                return Ok(read);
            }
            let mut buffer = vec![0; READ_SIZE];
            match fill(&mut self.stream, &mut buffer, stop)? {
                Filled::Bytes(count) => self.pending.extend_from_slice(&buffer[..count]),
                Filled::Stopped => return Ok(BodyRead::Stopped),
                Filled::Closed => {
                    return match self.framing {
                        Framing::UntilClose | Framing::Finished => {
                            self.framing = Framing::Finished;
                            Ok(BodyRead::End)
                        }
                        _ => Err(ClientError::Closed("in the middle of the response body")),
                    };
                }
            }
        }
    }

    /// Turns pending socket bytes into body bytes; `None` when more must be read first.
    fn deframe(&mut self) -> Result<Option<BodyRead>, ClientError> {
        let pending = std::mem::take(&mut self.pending);
        match &mut self.framing {
            Framing::Finished => Ok(Some(BodyRead::End)),
            Framing::UntilClose => Ok(Some(BodyRead::Data(pending))),
            Framing::Length(remaining) => {
                let taken = (*remaining).min(pending.len() as u64) as usize;
                *remaining -= taken as u64;
                if *remaining == 0 {
                    self.framing = Framing::Finished;
                }
                let data = pending[..taken].to_vec();
                Ok(Some(if data.is_empty() {
                    BodyRead::End
                } else {
                    BodyRead::Data(data)
                }))
            }
            Framing::Chunked(decoder) => {
                let mut data = Vec::new();
                let progress = decoder.feed(&pending, &mut data)?;
                if matches!(progress, Progress::Done(_)) {
                    self.framing = Framing::Finished;
                }
                if !data.is_empty() {
                    return Ok(Some(BodyRead::Data(data)));
                }
                if matches!(self.framing, Framing::Finished) {
                    return Ok(Some(BodyRead::End));
                }
                Ok(None)
            }
        }
    }
}

/// Reads the head (skipping interim 1xx responses) and sets up the body's framing.
fn read_response(
    mut stream: TcpStream,
    stop: &mut dyn FnMut() -> bool,
) -> Result<Option<Response>, ClientError> {
    let mut buffer: Vec<u8> = Vec::new();
    loop {
        let head_length = loop {
            if let Some(end) = find_head_end(&buffer) {
                break end;
            }
            if buffer.len() > HEAD_LIMIT {
                return Err(ClientError::MalformedHead(format!(
                    "no end of head within {HEAD_LIMIT} bytes"
                )));
            }
            let mut piece = vec![0; READ_SIZE];
            match fill(&mut stream, &mut piece, stop)? {
                Filled::Bytes(count) => buffer.extend_from_slice(&piece[..count]),
                Filled::Stopped => return Ok(None),
                Filled::Closed => return Err(ClientError::Closed("before sending a response")),
            }
        };
        let (status, headers) = parse_head(&buffer[..head_length])?;
        let rest = buffer.split_off(head_length);
        if (100..200).contains(&status) {
            buffer = rest;
            continue;
        }
        let framing = framing_of(status, &headers)?;
        return Ok(Some(Response {
            status,
            headers,
            body: Body {
                stream,
                framing,
                pending: rest,
            },
        }));
    }
}

fn parse_head(head: &[u8]) -> Result<(u16, Vec<(String, String)>), ClientError> {
    let mut slots = [httparse::EMPTY_HEADER; HEADER_COUNT_LIMIT];
    let mut parsed = httparse::Response::new(&mut slots);
    match parsed.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => {
            return Err(ClientError::MalformedHead("the head is incomplete".into()));
        }
        Err(error) => return Err(ClientError::MalformedHead(error.to_string())),
    }
    let status = parsed
        .code
        .ok_or_else(|| ClientError::MalformedHead("no status code".into()))?;
    let headers = parsed
        .headers
        .iter()
        .map(|header| {
            (
                header.name.to_owned(),
                String::from_utf8_lossy(header.value).trim().to_owned(),
            )
        })
        .collect();
    Ok((status, headers))
}

/// How the body of a response with this status and these headers is delimited (RFC 9112 section 6.3).
fn framing_of(status: u16, headers: &[(String, String)]) -> Result<Framing, ClientError> {
    if status == 204 || status == 304 {
        return Ok(Framing::Finished);
    }
    let header = |name: &str| {
        headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    };
    if let Some(coding) = header("transfer-encoding") {
        let last = coding.rsplit(',').next().unwrap_or("").trim();
        if last.eq_ignore_ascii_case("chunked") {
            return Ok(Framing::Chunked(ChunkedDecoder::new()));
        }
        return Ok(Framing::UntilClose);
    }
    if let Some(length) = header("content-length") {
        let length: u64 = length.parse().map_err(|_| {
            ClientError::MalformedHead(format!("Content-Length `{length}` is not a number"))
        })?;
        return Ok(if length == 0 {
            Framing::Finished
        } else {
            Framing::Length(length)
        });
    }
    Ok(Framing::UntilClose)
}

fn find_head_end(buffer: &[u8]) -> Option<usize> {
    buffer
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .map(|start| start + 4)
}

/// One read that gives up its wait every poll interval to ask `stop`.
fn fill(
    stream: &mut TcpStream,
    buffer: &mut [u8],
    stop: &mut dyn FnMut() -> bool,
) -> Result<Filled, ClientError> {
    loop {
        if stop() {
            return Ok(Filled::Stopped);
        }
        match stream.read(buffer) {
            Ok(0) => return Ok(Filled::Closed),
            Ok(count) => return Ok(Filled::Bytes(count)),
            Err(error)
                if matches!(
                    error.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(error) => return Err(error.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{BodyRead, Client, ClientError, ClientOptions, Endpoint};
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::thread;

    #[test]
    fn server_urls_parse_into_host_port_and_prefix() {
        let endpoint = Endpoint::parse("http://127.0.0.1:8080").expect("valid");
        assert_eq!(endpoint.authority(), "127.0.0.1:8080");
        assert_eq!(
            endpoint.target("/v1/chat/completions"),
            "/v1/chat/completions"
        );
        let prefixed = Endpoint::parse("http://example.test/llm/").expect("valid");
        assert_eq!(
            prefixed.authority(),
            "example.test:80",
            "port 80 by default"
        );
        assert_eq!(prefixed.target("/health"), "/llm/health");
        let six = Endpoint::parse("http://[::1]:9000").expect("valid");
        assert_eq!(six.authority(), "[::1]:9000");
        for (url, reason) in [
            ("https://host", "https is not supported"),
            ("host:8080", "it does not start with http://"),
            ("http://:8080", "it has no host"),
            ("http://host:port", "the port is not a number"),
            ("http://host:99999", "the port is not a number"),
            ("http://[::1", "an IPv6 address lacks its closing bracket"),
        ] {
            let Err(ClientError::BadUrl { reason: got, .. }) = Endpoint::parse(url) else {
                panic!("`{url}` should be refused");
            };
            assert_eq!(got, reason, "the reason for `{url}`");
        }
    }

    /// Serves one connection with `response` after reading the request head and body; returns the request.
    fn serve_once(response: &'static [u8]) -> (String, thread::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let server = thread::spawn(move || {
            let (mut connection, _) = listener.accept().expect("accept");
            let mut request = Vec::new();
            let mut piece = [0; 4096];
            // Read until the body announced by Content-Length is in.
            loop {
                let count = connection.read(&mut piece).expect("read");
                request.extend_from_slice(&piece[..count]);
                let text = String::from_utf8_lossy(&request).into_owned();
                if let Some(end) = text.find("\r\n\r\n") {
                    let length: usize = text
                        .lines()
                        .find_map(|line| line.strip_prefix("Content-Length: "))
                        .and_then(|value| value.trim().parse().ok())
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length {
                        break;
                    }
                }
            }
            // Written in small pieces so the client sees the framing split anywhere.
            for piece in response.chunks(7) {
                connection.write_all(piece).expect("write");
            }
            request
        });
        (url, server)
    }

    fn collect_body(response: &mut super::Response) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            match response.read_body(&mut || false).expect("body") {
                BodyRead::Data(bytes) => body.extend_from_slice(&bytes),
                BodyRead::End => return body,
                BodyRead::Stopped => panic!("nothing asked to stop"),
            }
        }
    }

    #[test]
    fn a_chunked_response_after_an_interim_one_reads_whole_over_a_real_socket() {
        let (url, server) = serve_once(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
              Transfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n8\r\n[DONE]\n\n\r\n0\r\n\r\n",
        );
        let client = Client::new(Endpoint::parse(&url).unwrap(), ClientOptions::default());
        let mut response = client
            .post_json(
                "/v1/chat/completions",
                Some("secret"),
                &serde_json::json!({"stream": true}),
                &mut || false,
            )
            .expect("request")
            .expect("not stopped");
        assert_eq!(response.status, 200);
        assert_eq!(response.header("content-type"), Some("text/event-stream"));
        assert_eq!(collect_body(&mut response), b"data: [DONE]\n\n");
        let request = String::from_utf8(server.join().expect("server")).expect("utf-8");
        assert!(
            request.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"),
            "request line: {request}"
        );
        assert!(
            request.contains("\r\nAuthorization: Bearer secret\r\n"),
            "the key is sent as a bearer token: {request}"
        );
        assert!(
            request.ends_with("\r\n\r\n{\"stream\":true}"),
            "the JSON body follows the head: {request}"
        );
    }

    #[test]
    fn a_content_length_body_stops_at_its_length_and_a_short_one_is_an_error() {
        let (url, _server) = serve_once(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 11\r\n\r\n{\"error\":1}trailing junk",
        );
        let client = Client::new(Endpoint::parse(&url).unwrap(), ClientOptions::default());
        let mut response = client
            .post_json("/x", None, &serde_json::json!({}), &mut || false)
            .unwrap()
            .unwrap();
        assert_eq!(response.status, 404);
        assert_eq!(response.read_to_end(1024).unwrap(), b"{\"error\":1}");

        let (url, _server) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort");
        let client = Client::new(Endpoint::parse(&url).unwrap(), ClientOptions::default());
        let mut response = client
            .post_json("/x", None, &serde_json::json!({}), &mut || false)
            .unwrap()
            .unwrap();
        assert!(
            matches!(response.read_to_end(1024), Err(ClientError::Closed(_))),
            "a body cut short by a close is an error, not a short success"
        );
    }

    #[test]
    fn a_stop_while_waiting_for_the_head_returns_none() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let client = Client::new(Endpoint::parse(&url).unwrap(), ClientOptions::default());
        let mut asked = 0;
        // The listener's backlog accepts the connection; nothing ever answers.
        let response = client
            .post_json("/x", None, &serde_json::json!({}), &mut || {
                asked += 1;
                asked > 3
            })
            .expect("no error");
        assert!(response.is_none(), "a stop gives no response");
        drop(listener);
    }
}
