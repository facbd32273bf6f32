//! The API on real sockets over a tiny model: admission (429 when full, the queue timeout), cancellation when
//! a client goes away, keep-alive and pipelining, limits, auth, and garbage that stalls nobody else.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use stage_server::frontend::{ApiConfig, ApiServer, Backend};
use stage_server::http::HttpLimits;
use stage_server::model::testing::{TINY_EOS, TinyModel};

/// A tiny llama with room for long generations, written once per test into its own directory.
fn tiny_model(name: &str) -> PathBuf {
    let directory =
        std::env::temp_dir().join(format!("stage-server-api-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();
    let mut model = TinyModel::llama(GgmlDType::Q8_0);
    model.context_length = 8192;
    model.write_to_dir(&directory).unwrap()
}

fn start(name: &str, configure: impl FnOnce(&mut ApiConfig)) -> Started {
    start_in_turn(name, configure, Turn::take(false))
}

/// [`start`] for a test that counts forward passes on `/metrics`: the stage metrics are one registry per
/// process, so it waits until no other test's server lives, and holds them off until its own ends.
fn start_alone(name: &str, configure: impl FnOnce(&mut ApiConfig)) -> Started {
    start_in_turn(name, configure, Turn::take(true))
}

fn start_in_turn(name: &str, configure: impl FnOnce(&mut ApiConfig), turn: Turn) -> Started {
    let mut config = ApiConfig::new("127.0.0.1:0".parse().unwrap());
    config.lanes = 1;
    configure(&mut config);
    let server = ApiServer::start(&tiny_model(name), Backend::Whole, config).unwrap();
    server.wait_ready(Duration::from_secs(60)).unwrap();
    Started {
        server,
        _turn: turn,
    }
}

/// How many test servers live (`.0`), and whether one that counts the process-wide forward passes does (`.1`,
/// [`start_alone`]): it waits for the others to end, and they for it.
static TURNS: Mutex<(usize, bool)> = Mutex::new((0, false));
static TURN_ENDED: Condvar = Condvar::new();

/// A test server's turn in [`TURNS`], given back when it drops.
struct Turn {
    alone: bool,
}

impl Turn {
    fn take(alone: bool) -> Turn {
        let mut turns = TURNS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while turns.1 || (alone && turns.0 > 0) {
            turns = TURN_ENDED
                .wait(turns)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        if alone {
            turns.1 = true;
        } else {
            turns.0 += 1;
        }
        Turn { alone }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut turns = TURNS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if self.alone {
            turns.1 = false;
        } else {
            turns.0 -= 1;
        }
        TURN_ENDED.notify_all();
    }
}

/// A started server and its turn, released with it.
struct Started {
    server: ApiServer,
    _turn: Turn,
}

impl std::ops::Deref for Started {
    type Target = ApiServer;
    fn deref(&self) -> &ApiServer {
        &self.server
    }
}

impl Started {
    fn shutdown(self, deadline: Instant) -> net_io_blocking::DrainReport {
        self.server.shutdown(deadline)
    }
}

/// One response, read whole.
#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

fn connect(address: SocketAddr) -> BufReader<TcpStream> {
    let stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    BufReader::new(stream)
}

fn post(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n")
}

/// Reads a status line and headers.
fn read_head(reader: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':').unwrap();
        headers.push((name.trim().to_owned(), value.trim().to_owned()));
    }
    (status, headers)
}

/// Reads one chunk of a chunked body (`None` at its end).
fn read_chunk(reader: &mut BufReader<TcpStream>) -> Option<String> {
    let mut size = String::new();
    reader.read_line(&mut size).unwrap();
    let size = usize::from_str_radix(size.trim(), 16).unwrap();
    let mut data = vec![0u8; size + 2];
    reader.read_exact(&mut data).unwrap();
    data.truncate(size);
    (size > 0).then(|| String::from_utf8(data).unwrap())
}

fn read_response(reader: &mut BufReader<TcpStream>) -> Response {
    let (status, headers) = read_head(reader);
    let response = Response {
        status,
        headers,
        body: String::new(),
    };
    let mut body = String::new();
    if response
        .header("transfer-encoding")
        .is_some_and(|value| value.eq_ignore_ascii_case("chunked"))
    {
        while let Some(chunk) = read_chunk(reader) {
            body.push_str(&chunk);
        }
    } else {
        let length: usize = response
            .header("content-length")
            .map_or(0, |value| value.parse().unwrap());
        let mut bytes = vec![0u8; length];
        reader.read_exact(&mut bytes).unwrap();
        body = String::from_utf8(bytes).unwrap();
    }
    Response { body, ..response }
}

fn exchange(address: SocketAddr, request: &str) -> Response {
    let mut reader = connect(address);
    reader.get_mut().write_all(request.as_bytes()).unwrap();
    read_response(&mut reader)
}

/// A streaming completion that would run for thousands of tokens (the end-of-sequence token is biased away).
fn long_stream() -> String {
    post(
        "/v1/completions",
        &format!(
            r#"{{"prompt":[1,300,301],"max_tokens":8000,"temperature":0,"stream":true,"logit_bias":{{"{TINY_EOS}":-100}}}}"#
        ),
    )
}

/// Starts a long stream and returns once its first token arrived (a lane is busy with it).
fn occupy_lane(address: SocketAddr) -> BufReader<TcpStream> {
    let mut reader = connect(address);
    reader
        .get_mut()
        .write_all(long_stream().as_bytes())
        .unwrap();
    let (status, _) = read_head(&mut reader);
    assert_eq!(status, 200);
    let first = read_chunk(&mut reader).expect("a first event");
    assert!(first.starts_with("data: "), "{first}");
    reader
}

fn metric(address: SocketAddr, name: &str) -> f64 {
    let response = exchange(address, &get("/metrics"));
    response
        .body
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{}", response.body))
}

fn eventually(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    condition()
}

#[test]
fn a_client_that_goes_away_mid_stream_frees_its_lane_and_stops_its_generation() {
    let server = start("cancel", |_| {});
    let address = server.local_addr();
    let stream = occupy_lane(address);
    assert_eq!(metric(address, "stage_server_lanes_busy"), 1.0);
    drop(stream);
    assert!(
        eventually(Duration::from_secs(5), || metric(
            address,
            "stage_server_lanes_busy"
        ) == 0.0),
        "the lane stayed busy after its client went away"
    );
    let generated = metric(address, "stage_server_generated_tokens_total");
    assert!(
        generated < 8000.0,
        "the generation ran to its end ({generated} tokens) instead of stopping"
    );
    // The lane serves the next request.
    let response = exchange(
        address,
        &post(
            "/v1/completions",
            r#"{"prompt":[1,300],"max_tokens":3,"temperature":0}"#,
        ),
    );
    assert_eq!(response.status, 200, "{}", response.body);
}

#[test]
fn a_client_that_goes_away_during_a_long_prompt_frees_its_lane_within_a_prompt_chunk() {
    // A real model, so that the prompt takes seconds: SmolLM2 prefills 7,000 tokens in about 10 s on the
    // 2-core hosts, a 512-token chunk in under one.
    let Some(model) = stage_server::model::testing::real_model(stage_server::model::SMOLLM2_FILE)
    else {
        return;
    };
    let mut config = ApiConfig::new("127.0.0.1:0".parse().unwrap());
    config.lanes = 1;
    let server = ApiServer::start(&model, Backend::Whole, config).unwrap();
    server.wait_ready(Duration::from_secs(120)).unwrap();
    let address = server.local_addr();
    let prompt: Vec<String> = (0..7000)
        .map(|index| (100 + index % 3000).to_string())
        .collect();
    let body = format!(
        r#"{{"prompt":[{}],"max_tokens":1,"stream":true,"temperature":0}}"#,
        prompt.join(",")
    );
    let mut client = connect(address);
    client
        .get_mut()
        .write_all(post("/v1/completions", &body).as_bytes())
        .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || metric(
            address,
            "stage_server_lanes_busy"
        ) == 1.0),
        "the request never took the lane"
    );
    std::thread::sleep(Duration::from_millis(500));
    drop(client);
    let left = Instant::now();
    assert!(
        eventually(Duration::from_secs(30), || metric(
            address,
            "stage_server_lanes_busy"
        ) == 0.0),
        "the lane stayed busy after its client went away"
    );
    let freed = left.elapsed();
    assert!(
        freed < Duration::from_secs(4),
        "the lane was freed {freed:?} after its client went away: the whole prompt ran instead of stopping \
         at its next chunk"
    );
    assert_eq!(metric(address, "stage_server_generated_tokens_total"), 0.0);
    let _ = server.shutdown(Instant::now() + Duration::from_secs(5));
}

#[test]
fn a_stream_to_an_http_1_0_client_is_sent_bare_and_ends_with_the_connection() {
    let server = start("http10", |_| {});
    let address = server.local_addr();
    let body = r#"{"prompt":[1,300],"max_tokens":3,"temperature":0,"stream":true}"#;
    let request = format!(
        "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut reader = connect(address);
    reader.get_mut().write_all(request.as_bytes()).unwrap();
    let (status, headers) = read_head(&mut reader);
    assert_eq!(status, 200);
    let header = |name: &str| {
        headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    };
    // RFC 9112, section 6.1: no chunked coding to an HTTP/1.0 client; the close ends the body.
    assert_eq!(header("transfer-encoding"), None, "{headers:?}");
    assert_eq!(header("content-length"), None, "{headers:?}");
    assert_eq!(header("connection"), Some("close"), "{headers:?}");
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    assert!(
        rest.starts_with("data: {") && rest.ends_with("data: [DONE]\n\n"),
        "the body should be the bare events up to the close: {rest:?}"
    );
    assert!(
        rest.split('\n')
            .all(|line| line.is_empty() || line.starts_with("data: ")),
        "only event lines, no chunk sizes between them: {rest:?}"
    );
}

#[test]
fn a_full_queue_is_refused_with_429_and_retry_after_and_the_queued_request_completes_later() {
    let server = start("full", |config| config.queue = Some(1));
    let address = server.local_addr();
    let busy = occupy_lane(address);
    // Queued behind the busy lane.
    let mut queued = connect(address);
    queued
        .get_mut()
        .write_all(
            post(
                "/v1/completions",
                r#"{"prompt":[1,300],"max_tokens":2,"temperature":0}"#,
            )
            .as_bytes(),
        )
        .unwrap();
    assert!(eventually(Duration::from_secs(5), || metric(
        address,
        "stage_server_queue_depth"
    ) == 1.0));
    let refused = exchange(
        address,
        &post(
            "/v1/completions",
            r#"{"prompt":[1,300],"max_tokens":2,"temperature":0}"#,
        ),
    );
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.header("retry-after"), Some("1"));
    let envelope: serde_json::Value = serde_json::from_str(&refused.body).unwrap();
    assert!(
        envelope["error"]["message"]
            .as_str()
            .unwrap()
            .contains("busy")
    );
    drop(busy);
    let response = read_response(&mut queued);
    assert_eq!(response.status, 200, "{}", response.body);
}

#[test]
fn a_request_that_waits_longer_than_the_queue_timeout_gets_429() {
    let server = start("timeout", |config| {
        config.queue_timeout = Duration::from_millis(300)
    });
    let address = server.local_addr();
    let _busy = occupy_lane(address);
    let started = Instant::now();
    let response = exchange(
        address,
        &post(
            "/v1/completions",
            r#"{"prompt":[1,300],"max_tokens":2,"temperature":0}"#,
        ),
    );
    let waited = started.elapsed();
    assert_eq!(response.status, 429, "{}", response.body);
    assert!(response.body.contains("queue timeout"), "{}", response.body);
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(10),
        "refused after {waited:?}"
    );
    assert_eq!(metric(address, "stage_server_queue_depth"), 0.0);
}

#[test]
fn one_connection_serves_requests_kept_alive_and_pipelined_in_order() {
    let server = start("keepalive", |_| {});
    let address = server.local_addr();
    let mut reader = connect(address);
    let pipelined = format!(
        "{}{}{}",
        get("/v1/models"),
        post(
            "/v1/completions",
            r#"{"prompt":[1,300],"max_tokens":2,"temperature":0}"#
        ),
        post("/tokenize", r#"{"content":"a"}"#)
    );
    reader.get_mut().write_all(pipelined.as_bytes()).unwrap();
    let models = read_response(&mut reader);
    assert_eq!(models.status, 200);
    assert!(
        models.body.contains("\"object\":\"list\""),
        "{}",
        models.body
    );
    let completion = read_response(&mut reader);
    assert_eq!(completion.status, 200, "{}", completion.body);
    assert!(
        completion.body.contains("text_completion"),
        "{}",
        completion.body
    );
    let tokens = read_response(&mut reader);
    assert_eq!(tokens.status, 200, "{}", tokens.body);
    assert!(tokens.body.contains("\"tokens\""), "{}", tokens.body);
}

#[test]
fn garbage_gets_400_and_a_close_while_other_connections_are_served() {
    let server = start("garbage", |_| {});
    let address = server.local_addr();
    // A slow client holding a half-sent head does not hold anyone else up either.
    let mut slow = connect(address);
    slow.get_mut().write_all(b"POST /v1/compl").unwrap();
    let mut reader = connect(address);
    reader
        .get_mut()
        .write_all(b"\x16\x03\x01 this is not http\r\n\r\n")
        .unwrap();
    let response = read_response(&mut reader);
    assert_eq!(response.status, 400, "{}", response.body);
    assert!(response.body.contains("\"error\""), "{}", response.body);
    let mut rest = Vec::new();
    let _ = reader.read_to_end(&mut rest);
    assert!(rest.is_empty(), "the connection stayed open after garbage");
    let health = exchange(address, &get("/health"));
    assert_eq!(health.status, 200, "{}", health.body);
}

#[test]
fn a_body_over_the_limit_is_413_and_a_prompt_over_the_context_is_400_with_both_numbers() {
    let server = start("limits", |config| {
        config.http_limits = HttpLimits {
            max_body_bytes: 1024,
            ..HttpLimits::default()
        };
        config.context_length = Some(16);
    });
    let address = server.local_addr();
    let big = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(4096));
    let response = exchange(address, &post("/v1/completions", &big));
    assert_eq!(response.status, 413, "{}", response.body);
    let ids: Vec<String> = (0..20).map(|index| (300 + index).to_string()).collect();
    let long = format!(r#"{{"prompt":[{}],"max_tokens":2}}"#, ids.join(","));
    let response = exchange(address, &post("/v1/completions", &long));
    assert_eq!(response.status, 400, "{}", response.body);
    assert!(
        response.body.contains("20") && response.body.contains("16"),
        "{}",
        response.body
    );
}

#[test]
fn every_route_but_health_needs_the_api_key_when_one_is_set() {
    let server = start("key", |config| config.api_key = Some("sesame".into()));
    let address = server.local_addr();
    let refused = exchange(address, &get("/v1/models"));
    assert_eq!(refused.status, 401, "{}", refused.body);
    let allowed = exchange(
        address,
        "GET /v1/models HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer sesame\r\n\r\n",
    );
    assert_eq!(allowed.status, 200, "{}", allowed.body);
    // Every other route needs it too, the unprefixed aliases of the /v1 routes included (a check by the
    // path's prefix once let them through), whatever the body.
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"prompt":"hi","max_tokens":1,"content":"hi","tokens":[1]}"#;
    for (method, path) in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/completions"),
        ("GET", "/models"),
        ("GET", "/metrics"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ] {
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let refused = exchange(address, &request);
        assert_eq!(refused.status, 401, "{method} {path}: {}", refused.body);
        let wrong = exchange(
            address,
            &request.replace("Host: test", "Host: test\r\nAuthorization: Bearer sesamf"),
        );
        assert_eq!(
            wrong.status, 401,
            "{method} {path} with a wrong key: {}",
            wrong.body
        );
    }
    let content = r#"{"content":"hi"}"#;
    let tokenized = exchange(
        address,
        &format!(
            "POST /tokenize HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer sesame\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{content}",
            content.len()
        ),
    );
    assert_eq!(tokenized.status, 200, "{}", tokenized.body);
    // Health stays open to probes, under either path.
    assert_eq!(exchange(address, &get("/health")).status, 200);
    assert_eq!(exchange(address, &get("/v1/health")).status, 200);
}

#[test]
fn unknown_routes_are_404_and_wrong_methods_405_in_the_error_envelope() {
    let server = start("routes", |_| {});
    let address = server.local_addr();
    let missing = exchange(address, &get("/v2/nothing"));
    assert_eq!(missing.status, 404, "{}", missing.body);
    let envelope: serde_json::Value = serde_json::from_str(&missing.body).unwrap();
    assert!(envelope["error"]["message"].is_string());
    let wrong = exchange(address, &get("/v1/chat/completions"));
    assert_eq!(wrong.status, 405, "{}", wrong.body);
}

#[test]
fn the_streamed_text_and_logprobs_equal_the_whole_reply_for_the_same_greedy_request() {
    let server = start("stream", |_| {});
    let address = server.local_addr();
    let body = r#"{"prompt":[1,300,301,302],"max_tokens":24,"temperature":0,"logprobs":1}"#;
    let whole = exchange(address, &post("/v1/completions", body));
    assert_eq!(whole.status, 200, "{}", whole.body);
    let whole: serde_json::Value = serde_json::from_str(&whole.body).unwrap();
    let streamed_body = body.replace('}', r#","stream":true}"#);
    let streamed = exchange(address, &post("/v1/completions", &streamed_body));
    assert_eq!(streamed.status, 200);
    let mut text = String::new();
    let (mut tokens, mut offsets) = (Vec::new(), Vec::new());
    let mut done = false;
    for event in streamed
        .body
        .split("\n\n")
        .filter(|event| !event.is_empty())
    {
        let data = event.strip_prefix("data: ").expect("an SSE data event");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: serde_json::Value = serde_json::from_str(data).unwrap();
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
        let logprobs = &chunk["choices"][0]["logprobs"];
        if !logprobs.is_null() {
            tokens.extend(logprobs["tokens"].as_array().unwrap().iter().cloned());
            offsets.extend(logprobs["text_offset"].as_array().unwrap().iter().cloned());
        }
    }
    assert!(done, "the stream did not end with [DONE]");
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    // The chunks' text offsets count from the completion's start, as the whole reply's do (each chunk's
    // counted from its own start before).
    let whole_logprobs = &whole["choices"][0]["logprobs"];
    assert_eq!(serde_json::Value::Array(tokens), whole_logprobs["tokens"]);
    assert_eq!(
        serde_json::Value::Array(offsets),
        whole_logprobs["text_offset"]
    );
    // Each offset is where its token's text starts: the characters from there begin with it (for tokens that
    // are whole characters; a character split over tokens puts both at its start, so none lands one further).
    let whole_text: Vec<char> = whole["choices"][0]["text"]
        .as_str()
        .unwrap()
        .chars()
        .collect();
    let whole_tokens = whole_logprobs["tokens"].as_array().unwrap();
    let whole_offsets = whole_logprobs["text_offset"].as_array().unwrap();
    for (token, offset) in whole_tokens.iter().zip(whole_offsets) {
        let token = token.as_str().unwrap();
        if token.contains('\u{fffd}') {
            continue;
        }
        let from: String = whole_text[offset.as_u64().unwrap() as usize..]
            .iter()
            .collect();
        assert!(
            from.starts_with(token),
            "token {token:?} at offset {offset} but the text there is {from:?}"
        );
    }
}

#[test]
fn a_queue_deadline_belongs_to_its_own_request_not_to_a_later_one_on_the_same_connection() {
    let server = start("stale-deadline", |config| {
        config.queue_timeout = Duration::from_secs(1)
    });
    let address = server.local_addr();
    let mut reader = connect(address);
    let quick = post(
        "/v1/completions",
        r#"{"prompt":[1,300],"max_tokens":2,"temperature":0}"#,
    );
    // The first request's deadline would fall 1 s from now; it is served at once.
    reader.get_mut().write_all(quick.as_bytes()).unwrap();
    assert_eq!(read_response(&mut reader).status, 200);
    std::thread::sleep(Duration::from_millis(700));
    let _busy = occupy_lane(address);
    // The second request, on the same connection, waits behind the busy lane: its own full second.
    let started = Instant::now();
    reader.get_mut().write_all(quick.as_bytes()).unwrap();
    let response = read_response(&mut reader);
    let waited = started.elapsed();
    assert_eq!(response.status, 429, "{}", response.body);
    assert!(
        waited >= Duration::from_secs(1),
        "refused after {waited:?}: an earlier request's queue deadline cut this one short"
    );
}

/// A greedy completion of `prompt` with every token's log-probability, as (text, logprobs as written, usage).
fn greedy(
    address: SocketAddr,
    prompt: &[u32],
    max_tokens: usize,
) -> (String, String, serde_json::Value) {
    let body = serde_json::json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 2,
        "logit_bias": {TINY_EOS.to_string(): -100},
    })
    .to_string();
    let response = exchange(address, &post("/v1/completions", &body));
    assert_eq!(response.status, 200, "{}", response.body);
    let value: serde_json::Value = serde_json::from_str(&response.body).unwrap();
    let choice = &value["choices"][0];
    (
        choice["text"].as_str().unwrap().to_owned(),
        // The numbers as the server wrote them: equal text means equal f32 values.
        choice["logprobs"].to_string(),
        value["usage"].clone(),
    )
}

/// Prompts of mixed lengths that share nothing but the first token.
fn mixed_prompts() -> Vec<Vec<u32>> {
    (0..4u32)
        .map(|index| {
            (0..3 + 7 * index)
                .map(|offset| 40 + index * 50 + offset)
                .collect()
        })
        .collect()
}

#[test]
fn concurrent_generations_batched_together_each_equal_the_same_request_alone() {
    let server = start_alone("batched", |config| config.lanes = 4);
    let address = server.local_addr();
    let prompts = mixed_prompts();
    let alone: Vec<_> = prompts
        .iter()
        .map(|prompt| greedy(address, prompt, 40))
        .collect();
    let steps_before = metric(address, "stage_server_stage_steps_total");
    let together: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|prompt| scope.spawn(move || greedy(address, prompt, 40)))
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap())
            .collect()
    });
    for (index, ((text, logprobs, _), (alone_text, alone_logprobs, _))) in
        together.iter().zip(&alone).enumerate()
    {
        assert_eq!(
            text, alone_text,
            "request {index}'s text changed when batched"
        );
        assert_eq!(
            logprobs, alone_logprobs,
            "request {index}'s log-probabilities changed when batched"
        );
    }
    // The four ran in shared passes: fewer steps than the 4 x (1 prefill + 39 decodes) they would take one
    // at a time.
    let steps = metric(address, "stage_server_stage_steps_total") - steps_before;
    assert!(
        steps < 4.0 * 40.0,
        "{steps} forward passes for four concurrent requests: they were not batched"
    );
}

#[test]
fn cancelling_one_stream_mid_batch_leaves_the_others_tokens_unchanged() {
    let server = start("batched-cancel", |config| config.lanes = 3);
    let address = server.local_addr();
    let prompts = &mixed_prompts()[..2];
    let alone: Vec<_> = prompts
        .iter()
        .map(|prompt| greedy(address, prompt, 60))
        .collect();
    let together: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|prompt| scope.spawn(move || greedy(address, prompt, 60)))
            .collect();
        // A third stream that joins the batch and goes away after a few tokens.
        let mut doomed = occupy_lane(address);
        for _ in 0..3 {
            read_chunk(&mut doomed).expect("an event of the doomed stream");
        }
        drop(doomed);
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap())
            .collect()
    });
    for (index, (together, alone)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(together.0, alone.0, "request {index}'s text changed");
        assert_eq!(
            together.1, alone.1,
            "request {index}'s log-probabilities changed"
        );
    }
}

#[test]
fn a_prompt_that_shares_a_cached_prefix_reuses_it_and_answers_as_a_cold_run_does() {
    let shared: Vec<u32> = (0..40).map(|offset| 60 + offset).collect();
    let first: Vec<u32> = shared.iter().copied().chain([200, 201]).collect();
    let second: Vec<u32> = shared.iter().copied().chain([210, 211, 212]).collect();
    let warm = start("prefix-warm", |_| {});
    let address = warm.local_addr();
    let (_, _, usage) = greedy(address, &first, 8);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "{usage}"
    );
    let (text, logprobs, usage) = greedy(address, &second, 8);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        shared.len(),
        "the shared prefix was not reused: {usage}"
    );
    assert_eq!(usage["prompt_tokens"], second.len());
    // The same prompt again reuses all but its last token.
    let (again_text, again_logprobs, usage) = greedy(address, &second, 8);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        second.len() - 1,
        "{usage}"
    );
    let cold = start("prefix-cold", |_| {});
    let (cold_text, cold_logprobs, usage) = greedy(cold.local_addr(), &second, 8);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    for (what, reused_text, reused_logprobs) in [
        ("a reused prefix", &text, &logprobs),
        ("a reused whole prompt", &again_text, &again_logprobs),
    ] {
        assert_eq!(reused_text, &cold_text, "{what} changed the text");
        assert_eq!(
            reused_logprobs, &cold_logprobs,
            "{what} changed the log-probabilities"
        );
    }
}

#[test]
fn a_drain_deadline_ends_a_running_stream_with_an_error_event_and_fails_the_queued_request_in_words()
 {
    let server = start("drain-deadline", |_| {});
    let address = server.local_addr();
    let mut stream = occupy_lane(address);
    let queued = std::thread::spawn(move || {
        exchange(
            address,
            &post(
                "/v1/completions",
                r#"{"prompt":[1,300],"max_tokens":4,"temperature":0}"#,
            ),
        )
    });
    assert!(
        eventually(Duration::from_secs(5), || metric(
            address,
            "stage_server_queue_depth"
        ) == 1.0),
        "the second request never queued"
    );
    // The stream runs for thousands of tokens: far past the drain's half second.
    let draining =
        std::thread::spawn(move || server.shutdown(Instant::now() + Duration::from_millis(500)));
    let mut events = Vec::new();
    // `read_chunk` fails the test on a reset or a cut chunk: the stream must end with its last chunk.
    while let Some(chunk) = read_chunk(&mut stream) {
        events.push(chunk);
    }
    let last_events: Vec<&str> = events
        .iter()
        .rev()
        .take(2)
        .rev()
        .map(String::as_str)
        .collect();
    assert_eq!(last_events.len(), 2, "{events:?}");
    assert!(
        last_events[0].contains("drain deadline") && last_events[0].contains("\"error\""),
        "the stream's last event should say the drain stopped it: {last_events:?}"
    );
    assert_eq!(last_events[1], "data: [DONE]\n\n");
    let refused = queued.join().unwrap();
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(refused.body.contains("drain deadline"), "{}", refused.body);
    let report = draining.join().unwrap();
    assert_eq!(
        report.killed, 0,
        "every connection ended in words: {report:?}"
    );
}
