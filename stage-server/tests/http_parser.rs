//! Properties and pinned texts of the HTTP/1.1 layer: read boundaries and pipelining do not change requests, random bytes never panic, every error text and response head is a snapshot.

use proptest::collection::vec;
use proptest::prelude::*;
use stage_server::http::{
    CONTINUE_RESPONSE, Framing, HttpError, HttpLimits, Parsed, Request, RequestParser, write_chunk,
    write_head, write_last_chunk, write_response, write_sse_data,
};

/// Small limits for the garbage properties, so random bytes reach them often.
const SMALL_LIMITS: HttpLimits = HttpLimits {
    max_head_bytes: 512,
    max_headers: 8,
    max_body_bytes: 1024,
};

/// A request as bytes on the wire, with the request the parser must make of them.
#[derive(Debug, Clone)]
struct Sent {
    bytes: Vec<u8>,
    expected: Request,
    /// Whether the parser must return one `Continue` before the request.
    expects_continue: bool,
}

/// How a generated request frames its body.
#[derive(Debug, Clone)]
enum BodyFraming {
    /// No framing header: no body.
    Nothing,
    /// `Content-Length`.
    Length,
    /// Chunked, cut at these sizes (cycled), each size line maybe with an extension, then maybe trailers.
    Chunked {
        sizes: Vec<usize>,
        extensions: bool,
        trailers: Vec<String>,
    },
}

/// What everything the feeder saw added up to.
#[derive(Debug, Default)]
struct Fed {
    requests: Vec<Request>,
    continues: usize,
    error: Option<HttpError>,
    /// Bytes the parser left unconsumed at the end.
    left: usize,
}

/// Feeds `bytes` to a parser as a session would: in pieces ending at `cuts` (sorted, any values), dropping
/// what each call consumed and calling again until the parser wants more.
fn feed(bytes: &[u8], cuts: &[usize], limits: HttpLimits) -> Fed {
    let mut parser = RequestParser::new(limits);
    let mut fed = Fed::default();
    let mut pending: Vec<u8> = Vec::new();
    let mut offset = 0;
    let mut ends: Vec<usize> = cuts.iter().map(|&cut| cut.min(bytes.len())).collect();
    ends.sort_unstable();
    ends.push(bytes.len());
    for end in ends {
        if end <= offset {
            continue;
        }
        pending.extend_from_slice(&bytes[offset..end]);
        offset = end;
        loop {
            let outcome = parser.parse(&pending);
            let (consumed, parsed) = match outcome {
                Ok(outcome) => outcome,
                Err(error) => {
                    assert!(
                        (400..600).contains(&error.status),
                        "an error with status {} is not a 4xx or 5xx: {error}",
                        error.status
                    );
                    assert!(!error.message.is_empty(), "an error without a message");
                    fed.error = Some(error);
                    fed.left = pending.len();
                    return fed;
                }
            };
            assert!(
                consumed <= pending.len(),
                "the parser consumed {consumed} bytes of {}",
                pending.len()
            );
            pending.drain(..consumed);
            match parsed {
                Parsed::NeedMore => {
                    assert!(
                        pending.len() <= 1,
                        "the parser asked for more but left {} bytes unconsumed",
                        pending.len()
                    );
                    break;
                }
                Parsed::Continue => fed.continues += 1,
                Parsed::Request(request) => {
                    assert!(
                        request.body.len() <= limits.max_body_bytes,
                        "a body of {} bytes passed a limit of {}",
                        request.body.len(),
                        limits.max_body_bytes
                    );
                    fed.requests.push(request);
                }
            }
        }
    }
    fed.left = pending.len();
    fed
}

/// Whether `name` (any case) is a header whose value changes how the request is read.
fn is_framing_name(name: &str) -> bool {
    [
        "content-length",
        "transfer-encoding",
        "expect",
        "connection",
    ]
    .iter()
    .any(|framing| framing.eq_ignore_ascii_case(name))
}

fn method() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("GET".to_owned()),
        Just("POST".to_owned()),
        "[A-Z]{1,10}",
        "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,12}",
    ]
}

fn target() -> impl Strategy<Value = String> {
    (
        "/[A-Za-z0-9._~/%-]{0,30}",
        "(\\?[A-Za-z0-9=&%._?/-]{0,20})?",
    )
        .prop_map(|(path, query)| path + &query)
}

/// A header that does not frame the body: a name in any case, a value with optional spaces and tabs around it
/// on the wire.
fn plain_header() -> impl Strategy<Value = (String, String, String, String)> {
    (
        "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,16}"
            .prop_filter("a framing header", |name| !is_framing_name(name)),
        prop_oneof![Just(String::new()), "[!-~]([ -~]{0,30}[!-~])?"],
        "[ \t]{0,2}",
        "[ \t]{0,2}",
    )
}

prop_compose! {
    /// A valid request, its bytes on the wire and what the parser must make of them.
    fn sent_request()(
        method in method(),
        target in target(),
        version in 0u8..=1,
        plain in vec(plain_header(), 0..6),
        body in vec(any::<u8>(), 0..300),
        framing_choice in 0u8..3,
        sizes in vec(1usize..80, 1..8),
        extensions in any::<bool>(),
        trailers in vec("[A-Za-z]{1,8}: [a-z]{0,8}", 0..3),
        connection in prop_oneof![Just(None), Just(Some("close")), Just(Some("keep-alive")), Just(Some("Upgrade, Keep-Alive"))],
        expect in any::<bool>(),
        framing_at in any::<prop::sample::Index>(),
        blank_lines in 0usize..3,
    ) -> Sent {
        let framing = match (framing_choice, version) {
            (0, _) => BodyFraming::Nothing,
            (1, _) | (_, 0) => BodyFraming::Length,
            _ => BodyFraming::Chunked { sizes, extensions, trailers },
        };
        let body = if matches!(framing, BodyFraming::Nothing) { Vec::new() } else { body };
        // (name as sent, value as sent with padding, value as parsed)
        let mut headers: Vec<(String, String, String)> = plain
            .into_iter()
            .map(|(name, value, before, after)| (name, format!("{before}{value}{after}"), value))
            .collect();
        let mut framing_headers: Vec<(String, String, String)> = Vec::new();
        match &framing {
            BodyFraming::Nothing => {}
            BodyFraming::Length => {
                let length = body.len().to_string();
                framing_headers.push(("Content-Length".into(), length.clone(), length));
            }
            BodyFraming::Chunked { .. } => {
                framing_headers.push(("Transfer-Encoding".into(), "chunked".into(), "chunked".into()));
            }
        }
        if let Some(connection) = connection {
            framing_headers.push(("Connection".into(), connection.into(), connection.into()));
        }
        let with_body = match &framing {
            BodyFraming::Nothing => false,
            BodyFraming::Length => !body.is_empty(),
            BodyFraming::Chunked { .. } => true,
        };
        if expect {
            framing_headers.push(("Expect".into(), "100-continue".into(), "100-continue".into()));
        }
        let at = framing_at.index(headers.len() + 1);
        headers.splice(at..at, framing_headers);

        let mut bytes = b"\r\n".repeat(blank_lines);
        bytes.extend_from_slice(format!("{method} {target} HTTP/1.{version}\r\n").as_bytes());
        for (name, sent, _) in &headers {
            bytes.extend_from_slice(format!("{name}:{sent}\r\n").as_bytes());
        }
        bytes.extend_from_slice(b"\r\n");
        match &framing {
            BodyFraming::Nothing => {}
            BodyFraming::Length => bytes.extend_from_slice(&body),
            BodyFraming::Chunked { sizes, extensions, trailers } => {
                let mut rest = body.as_slice();
                for &size in sizes.iter().cycle() {
                    if rest.is_empty() {
                        break;
                    }
                    let (chunk, after) = rest.split_at(size.min(rest.len()));
                    let extension = if *extensions { ";name=\"value\"" } else { "" };
                    bytes.extend_from_slice(format!("{:X}{extension}\r\n", chunk.len()).as_bytes());
                    bytes.extend_from_slice(chunk);
                    bytes.extend_from_slice(b"\r\n");
                    rest = after;
                }
                bytes.extend_from_slice(b"0\r\n");
                for trailer in trailers {
                    bytes.extend_from_slice(format!("{trailer}\r\n").as_bytes());
                }
                bytes.extend_from_slice(b"\r\n");
            }
        }
        let keep_alive = match (version, connection) {
            (_, Some("close")) => false,
            (1, _) => true,
            (_, Some(connection)) => connection.to_ascii_lowercase().contains("keep-alive"),
            (_, None) => false,
        };
        let path = target.split('?').next().unwrap_or_default().to_owned();
        let expected = Request {
            method,
            target,
            path,
            version,
            headers: headers
                .into_iter()
                .map(|(name, _, value)| (name.to_ascii_lowercase(), value))
                .collect(),
            body,
            keep_alive,
        };
        Sent { bytes, expected, expects_continue: expect && version == 1 && with_body }
    }
}

/// Random cut points into a stream of `length` bytes.
fn cuts() -> impl Strategy<Value = Vec<usize>> {
    vec(any::<usize>(), 0..12)
}

/// Turns random numbers into cut points inside `length` bytes.
fn cut_points(random: &[usize], length: usize) -> Vec<usize> {
    random.iter().map(|&value| value % (length + 1)).collect()
}

/// Asserts that feeding `sent` gave exactly its request, with a Continue when it expected one.
fn assert_one_request(fed: &Fed, sent: &Sent, how: &str) {
    assert_eq!(fed.error, None, "fed {how}, the request was refused");
    assert_eq!(
        fed.requests,
        std::slice::from_ref(&sent.expected),
        "fed {how}, the request came out different"
    );
    assert_eq!(
        fed.continues,
        usize::from(sent.expects_continue),
        "fed {how}, the wrong number of Continues"
    );
    assert_eq!(fed.left, 0, "fed {how}, bytes were left unconsumed");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_request_parses_the_same_whole_byte_by_byte_and_split_anywhere(sent in sent_request(), random in cuts()) {
        let limits = HttpLimits::default();
        assert_one_request(&feed(&sent.bytes, &[], limits), &sent, "whole");
        let every_byte: Vec<usize> = (1..sent.bytes.len()).collect();
        assert_one_request(&feed(&sent.bytes, &every_byte, limits), &sent, "byte by byte");
        let cuts = cut_points(&random, sent.bytes.len());
        assert_one_request(&feed(&sent.bytes, &cuts, limits), &sent, &format!("cut at {cuts:?}"));
    }

    #[test]
    fn pipelined_requests_come_out_in_order(sent in vec(sent_request(), 1..5), random in cuts()) {
        let bytes: Vec<u8> = sent.iter().flat_map(|sent| sent.bytes.iter().copied()).collect();
        let cuts = cut_points(&random, bytes.len());
        let fed = feed(&bytes, &cuts, HttpLimits::default());
        let expected: Vec<Request> = sent.iter().map(|sent| sent.expected.clone()).collect();
        prop_assert_eq!(fed.error, None);
        prop_assert_eq!(fed.requests, expected, "cut at {:?}", cuts);
        prop_assert_eq!(fed.continues, sent.iter().filter(|sent| sent.expects_continue).count());
        prop_assert_eq!(fed.left, 0);
    }

    #[test]
    fn a_request_cut_short_asks_for_more_and_is_in_progress(sent in sent_request(), cut in any::<prop::sample::Index>()) {
        let start = sent.bytes.iter().take_while(|&&byte| byte == b'\r' || byte == b'\n').count();
        // At least one byte of the request itself, and not all of it.
        let length = start + 1 + cut.index(sent.bytes.len() - start - 1);
        prop_assume!(length < sent.bytes.len());
        let mut parser = RequestParser::new(HttpLimits::default());
        let mut rest = &sent.bytes[..length];
        loop {
            let (consumed, parsed) = parser.parse(rest).expect("a valid request's prefix is not an error");
            rest = &rest[consumed..];
            match parsed {
                Parsed::NeedMore => break,
                Parsed::Continue => continue,
                Parsed::Request(request) => panic!("a prefix of {length} bytes gave a request: {request:?}"),
            }
        }
        prop_assert!(rest.is_empty(), "{} bytes were left unconsumed", rest.len());
        prop_assert!(parser.in_progress(), "a started request is not in progress");
    }

    #[test]
    fn random_bytes_never_panic_and_give_requests_more_or_errors(bytes in vec(any::<u8>(), 0..1200), random in cuts()) {
        let cuts = cut_points(&random, bytes.len());
        // `feed` checks every outcome: consumed within the input, errors 4xx or 5xx, bodies within the limit.
        feed(&bytes, &[], SMALL_LIMITS);
        feed(&bytes, &cuts, SMALL_LIMITS);
    }

    #[test]
    fn a_valid_request_with_garbage_spliced_in_never_panics(
        sent in sent_request(),
        garbage in vec(prop_oneof![any::<u8>(), Just(b'\r'), Just(b'\n'), Just(b':'), Just(b' ')], 0..40),
        at in any::<prop::sample::Index>(),
        random in cuts(),
    ) {
        let mut bytes = sent.bytes.clone();
        let at = at.index(bytes.len() + 1);
        bytes.splice(at..at, garbage);
        let cuts = cut_points(&random, bytes.len());
        let whole = feed(&bytes, &[], SMALL_LIMITS);
        let split = feed(&bytes, &cuts, SMALL_LIMITS);
        // Read boundaries can decide only whether trailing bytes already show an error, never what came before.
        prop_assert_eq!(whole.requests, split.requests);
        if let (Some(whole), Some(split)) = (whole.error, split.error) {
            prop_assert_eq!(whole, split);
        }
    }
}

/// Parses `input` whole with `limits`, answering Continues, and returns the error it ends in.
fn error_of(input: &[u8], limits: HttpLimits) -> HttpError {
    let fed = feed(input, &[], limits);
    fed.error.unwrap_or_else(|| {
        panic!(
            "{:?} was not refused: {:?}",
            String::from_utf8_lossy(input),
            fed.requests
        )
    })
}

#[test]
fn every_error_text() {
    let limits = HttpLimits::default();
    let long_value = "a".repeat(limits.max_head_bytes);
    let many_headers: String = (0..=limits.max_headers)
        .map(|index| format!("X-{index}: v\r\n"))
        .collect();
    let big_chunk = format!("{:x}\r\n", limits.max_body_bytes + 1);
    let long_trailer = format!("0\r\nT: {long_value}\r\n\r\n");
    let long_extension = format!("1;{}\r\n", "e".repeat(5000));
    let post =
        |headers: &str, body: &str| format!("POST /v1/completions HTTP/1.1\r\n{headers}\r\n{body}");
    let chunked = |body: &str| post("Transfer-Encoding: chunked\r\n", body);
    let cases: Vec<(&str, String)> = vec![
        (
            "head too large",
            format!("GET / HTTP/1.1\r\nX-Long: {long_value}\r\n\r\n"),
        ),
        (
            "too many headers",
            format!("GET / HTTP/1.1\r\n{many_headers}\r\n"),
        ),
        ("bad request line", "GET  / HTTP/1.1\r\n\r\n".into()),
        ("bad method", "G{T / HTTP/1.1\r\n\r\n".into()),
        ("bad line ending", "GET / HTTP/1.1 \r\n\r\n".into()),
        (
            "bad header name",
            "GET / HTTP/1.1\r\nBad Name: v\r\n\r\n".into(),
        ),
        (
            "bad header value",
            "GET / HTTP/1.1\r\nName: a\u{7}b\r\n\r\n".into(),
        ),
        ("not an HTTP version", "GET / SPDY/3.1\r\n\r\n".into()),
        ("HTTP/1.2", "GET / HTTP/1.2\r\n\r\n".into()),
        ("HTTP/2 preface", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".into()),
        (
            "length not a number",
            post("Content-Length: twelve\r\n", ""),
        ),
        (
            "differing lengths",
            post("Content-Length: 2\r\nContent-Length: 3\r\n", "abc"),
        ),
        (
            "length over the limit",
            post("Content-Length: 4194305\r\n", ""),
        ),
        (
            "smuggling",
            post(
                "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
                "0\r\n\r\n",
            ),
        ),
        (
            "unknown transfer-coding",
            post("Transfer-Encoding: gzip, chunked\r\n", ""),
        ),
        (
            "chunked twice",
            post("Transfer-Encoding: chunked, chunked\r\n", ""),
        ),
        (
            "empty transfer-encoding",
            post("Transfer-Encoding: ,\r\n", ""),
        ),
        (
            "chunked on HTTP/1.0",
            "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".into(),
        ),
        (
            "unknown expectation",
            post("Expect: 200-ok\r\nContent-Length: 1\r\n", "x"),
        ),
        (
            "continue over the limit",
            post("Expect: 100-continue\r\nContent-Length: 9999999\r\n", ""),
        ),
        ("chunk size not hex", chunked("zz\r\n")),
        ("chunk size trailing junk", chunked("5 x\r\n")),
        ("chunk size line bare LF", chunked("5\nhello\r\n")),
        ("chunk data too long", chunked("2\r\nabc\r\n")),
        ("chunk extension too long", chunked(&long_extension)),
        ("chunked body over the limit", chunked(&big_chunk)),
        ("trailer bare LF", chunked("0\r\nT: v\n\r\n")),
        ("trailers too large", chunked(&long_trailer)),
        ("final line not CRLF", chunked("0\r\n\rx")),
    ];
    let mut text = String::new();
    for (label, input) in &cases {
        let error = error_of(input.as_bytes(), limits);
        text.push_str(&format!("{label}: {error}\n"));
    }
    insta::assert_snapshot!(text);
}

#[test]
fn response_heads_with_each_framing() {
    let headers = [
        ("Content-Type", "text/event-stream"),
        ("X-Request-Id", "req-1"),
    ];
    let mut text = String::new();
    let mut show = |label: &str, write: &dyn Fn(&mut Vec<u8>)| {
        let mut out = Vec::new();
        write(&mut out);
        text.push_str(&format!("{label}: {:?}\n", String::from_utf8_lossy(&out)));
    };
    show("length", &|out| {
        write_head(out, 200, &headers, Framing::Length(42), true)
    });
    show("chunked", &|out| {
        write_head(out, 200, &headers, Framing::Chunked, true)
    });
    show("empty", &|out| {
        write_head(out, 204, &[], Framing::Empty, true)
    });
    show("closing", &|out| {
        write_head(out, 503, &[("Retry-After", "1")], Framing::Length(0), false)
    });
    show("response", &|out| {
        write_response(
            out,
            404,
            &[("Content-Type", "application/json")],
            br#"{"error":"not found"}"#,
            true,
        )
    });
    show("stream", &|out| {
        write_sse_data(out, r#"{"choices":[]}"#);
        write_chunk(out, b"data: [DONE]\n\n");
        write_last_chunk(out);
    });
    show("continue", &|out| out.extend_from_slice(CONTINUE_RESPONSE));
    insta::assert_snapshot!(text);
}

#[test]
fn a_streamed_response_reads_back_through_the_chunked_framing_of_the_parser() {
    // The parser's chunked decoder and the writer's chunks must agree, or a client of ours would not read us.
    let mut bytes = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    write_sse_data(&mut bytes, "{\"token\":\"a\"}");
    write_sse_data(&mut bytes, "two\nlines");
    write_chunk(&mut bytes, b"");
    write_last_chunk(&mut bytes);
    let fed = feed(&bytes, &[], HttpLimits::default());
    assert_eq!(fed.error, None);
    assert_eq!(
        String::from_utf8_lossy(&fed.requests[0].body),
        "data: {\"token\":\"a\"}\n\ndata: two\ndata: lines\n\n"
    );
}
