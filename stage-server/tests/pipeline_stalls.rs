//! A stage that is alive but stopped (SIGSTOP) fails stage 0's generation within seconds, not at the minute-long
//! reply timeout (a ping down the chain goes unanswered), while a chain that is only slow is never taken for a
//! stopped one.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use stage_server::driver::{Chain, ChainOptions};
use stage_server::model::testing::TinyModel;
use stage_server::model::{GenerateOptions, ModelFile, SamplingParams};

mod support;
use support::{START_TIMEOUT, StageChild, http, serves_four_tokens, tiny};

/// A TCP proxy to `target` on 127.0.0.1 that delivers every byte `delay` after it came, each way: a slow network,
/// on the socket (the in-process `--link-delay` shapes frames, not the hellos a link opens with).
fn delaying_proxy(target: SocketAddr, delay: Duration) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for client in listener.incoming().map_while(Result::ok) {
            let Ok(server) = TcpStream::connect(target) else {
                continue;
            };
            for (from, to) in [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ] {
                forward_late(from, to, delay);
            }
        }
    });
    address
}

/// Copies `from` to `to`, each chunk `delay` after it was read (two threads: one reads, one writes on time).
fn forward_late(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (chunks, late) = channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buffer = [0u8; 64 * 1024];
        while let Ok(count) = from.read(&mut buffer) {
            if count == 0
                || chunks
                    .send((Instant::now() + delay, buffer[..count].to_vec()))
                    .is_err()
            {
                break;
            }
        }
    });
    std::thread::spawn(move || {
        for (due, bytes) in late {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

#[test]
fn a_stopped_middle_stage_fails_the_generation_within_seconds_and_serves_again_once_continued() {
    let llama = tiny("stalls-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let last = StageChild::start(&llama, "3..4", None, &[]);
    let middle = StageChild::start(&llama, "1..3", Some(last.address), &[]);
    let options = ChainOptions::default();
    let mut chain = Chain::connect(&file, 1, middle.address, options.clone()).unwrap();
    let generate = GenerateOptions {
        max_tokens: 200,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let mut stopped_at = None;
    let result = chain.generate(&[1, 300, 301], SamplingParams::default(), &generate, |_| {
        if stopped_at.is_none() {
            middle.signal("STOP");
            stopped_at = Some(Instant::now());
        }
    });
    let failed_after = stopped_at.expect("a token came before the stop").elapsed();
    // Continue it before any assertion, so a failing one leaves no stopped process behind.
    middle.signal("CONT");
    let error = result.expect_err("a generation whose middle stage stopped must fail");
    // One silence before the ping, the ping's deadline (opening a link on loopback takes far less than a
    // quarter of it), and slack for a loaded machine.
    let bound = options.silence_probe + options.probe_timeout + Duration::from_secs(3);
    assert!(
        failed_after < bound,
        "the error took {failed_after:?} after the stop (bound {bound:?}): {error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("stage 1") && message.contains("stopped answering"),
        "the error should name the stage the chain stopped at: {message}"
    );
    // Continued, the same processes serve a new generation.
    let mut chain = Chain::connect(&file, 1, middle.address, options).unwrap();
    serves_four_tokens(&mut chain, "the continued chain should serve");
}

#[test]
fn opening_a_chain_whose_stage_is_stopped_fails_within_the_connect_deadline_naming_it() {
    let llama = tiny("stalls-open-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let last = StageChild::start(&llama, "3..4", None, &[]);
    let middle = StageChild::start(&llama, "1..3", Some(last.address), &[]);
    // Stopped, the stage's kernel still accepts the connection; only the hello goes unanswered.
    middle.signal("STOP");
    let options = ChainOptions {
        connect_timeout: Duration::from_secs(1),
        reply_timeout: Duration::from_secs(30),
        ..ChainOptions::default()
    };
    let started = Instant::now();
    let opened = Chain::connect(&file, 1, middle.address, options.clone());
    let took = started.elapsed();
    middle.signal("CONT");
    let Err(error) = opened else {
        panic!("a stopped stage cannot open a chain");
    };
    // The hello's answer gets twice the connect deadline; then slack for a loaded machine.
    let bound = options.connect_timeout * 2 + Duration::from_secs(3);
    assert!(
        took < bound,
        "opening took {took:?} (bound {bound:?}, the reply timeout is {:?}): {error}",
        options.reply_timeout
    );
    let message = error.to_string();
    assert!(
        message.contains("stage 1") && message.contains("did not answer its hello"),
        "the error should name the stage and what it did not do: {message}"
    );
    // Continued, it answers.
    Chain::connect(&file, 1, middle.address, options).expect("the continued stage should answer");
}

#[test]
fn a_chain_slower_than_the_silence_check_still_completes_its_generation() {
    let llama = tiny("stalls-slow-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let last = StageChild::start(&llama, "3..4", None, &[]);
    let middle = StageChild::start(&llama, "1..3", Some(last.address), &[]);
    let generate = GenerateOptions {
        max_tokens: 2,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    // Tokens relayed up the chain, so that every answer crosses the slow link below.
    let options = ChainOptions {
        direct_return: false,
        ..ChainOptions::default()
    };
    let direct = Chain::connect(&file, 1, middle.address, options.clone())
        .unwrap()
        .generate(&[1, 300, 301], SamplingParams::default(), &generate, |_| {})
        .unwrap();
    // A proxy in front of the middle stage holds every byte back 2.2 s each way: a step takes 4.4 s, longer than
    // the silence before a ping and the ping's 3 s floor together, so only a deadline grown with what opening
    // the link took (as long as a step) keeps the check from taking the slow chain for a stopped one.
    let delay = Duration::from_millis(2200);
    let proxy = delaying_proxy(middle.address, delay);
    assert!(options.silence_probe + options.probe_timeout < delay * 2);
    let slow = Chain::connect(&file, 1, proxy, options)
        .unwrap()
        .generate(&[1, 300, 301], SamplingParams::default(), &generate, |_| {})
        .expect("a slow chain is alive and must complete");
    assert_eq!(slow.tokens, direct.tokens);
}

#[test]
fn the_api_answers_a_request_to_a_stopped_stage_with_a_503_in_seconds_and_serves_once_it_continues()
{
    use stage_server::frontend::{ApiConfig, ApiServer, Backend};
    let llama = tiny("stalls-api", &TinyModel::llama(GgmlDType::Q4_1));
    let last = StageChild::start(&llama, "2..4", None, &[]);
    let mut config = ApiConfig::new("127.0.0.1:0".parse().unwrap());
    config.lanes = 1;
    let options = ChainOptions::default();
    let backend = Backend::Chain {
        layers_end: 2,
        next: last.address,
        options: options.clone(),
    };
    let api = ApiServer::start(&llama, backend, config).unwrap();
    api.wait_ready(START_TIMEOUT).unwrap();
    let address = api.local_addr();
    let request = r#"{"prompt":[1,300,301],"max_tokens":4,"temperature":0}"#;
    let (status, body) = http(address, "POST", "/v1/completions", request);
    assert_eq!(status, 200, "{body}");
    // Stopped, the stage keeps the lane's link open and says nothing: the request the API accepted fails in
    // words once the check finds the chain silent, not at the minute-long reply timeout.
    last.signal("STOP");
    let started = Instant::now();
    let (status, body) = http(address, "POST", "/v1/completions", request);
    let took = started.elapsed();
    // A stream that fails before its first token is answered with the failure's status, like the request
    // above: not a 200 whose stream holds nothing but the error.
    let streamed = r#"{"prompt":[1,300,301],"max_tokens":4,"temperature":0,"stream":true}"#;
    let (stream_status, stream_body) = http(address, "POST", "/v1/completions", streamed);
    last.signal("CONT");
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        stream_status, 503,
        "a stream that failed before any output: {stream_body}"
    );
    assert!(
        stream_body.contains("stage 1"),
        "the stream's refusal should say why: {stream_body}"
    );
    assert!(
        body.contains("stage 1"),
        "the error should name the stage: {body}"
    );
    let bound = options.silence_probe + options.probe_timeout + Duration::from_secs(3);
    assert!(
        took < bound,
        "a stopped stage took {took:?} to answer (bound {bound:?}): {body}"
    );
    // Continued, the chain serves again without restarting anything.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, body) = http(address, "POST", "/v1/completions", request);
        if status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the chain never served again: {status} {body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The link the lane opened after the outage is its link from now on: the same prompt twice reuses the
    // prefix the first left down the chain (a lane that took every link for stale since the outage reopened
    // one, and lost its prefix, at every request).
    let repeated = r#"{"prompt":[1,300,301,302,303,304,305],"max_tokens":2,"temperature":0}"#;
    let cached = || {
        let (status, body) = http(address, "POST", "/v1/completions", repeated);
        assert_eq!(status, 200, "{body}");
        let value: serde_json::Value = serde_json::from_str(&body).unwrap();
        value["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached_tokens in {body}"))
    };
    cached();
    assert!(
        cached() > 0,
        "the repeated prompt reused nothing after the outage"
    );
    let _ = api.shutdown(Instant::now() + Duration::from_secs(5));
}

#[test]
fn a_drain_deadline_fails_a_request_still_waiting_on_a_stopped_chain_in_words() {
    use stage_server::frontend::{ApiConfig, ApiServer, Backend};
    let llama = tiny("stalls-drain", &TinyModel::llama(GgmlDType::Q4_1));
    let last = StageChild::start(&llama, "2..4", None, &[]);
    let mut config = ApiConfig::new("127.0.0.1:0".parse().unwrap());
    config.lanes = 1;
    let backend = Backend::Chain {
        layers_end: 2,
        next: last.address,
        options: ChainOptions::default(),
    };
    let api = ApiServer::start(&llama, backend, config).unwrap();
    api.wait_ready(START_TIMEOUT).unwrap();
    let address = api.local_addr();
    let request = r#"{"prompt":[1,300,301],"max_tokens":4,"temperature":0,"stream":true}"#;
    assert_eq!(http(address, "POST", "/v1/completions", request).0, 200);
    // The request waits on a chain that says nothing; the drain's deadline comes long before the chain's
    // silence check would fail it.
    last.signal("STOP");
    let waiting = std::thread::spawn(move || http(address, "POST", "/v1/completions", request));
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let report = api.shutdown(Instant::now() + Duration::from_millis(200));
    let took = started.elapsed();
    let (status, body) = waiting.join().unwrap();
    last.signal("CONT");
    assert_eq!(
        status, 503,
        "the request should end in words, not a reset: {body}"
    );
    assert!(body.contains("drain deadline"), "{body}");
    assert_eq!(report.killed, 0, "no connection was reset: {report:?}");
    assert!(
        took < Duration::from_secs(2),
        "the drain took {took:?} with a 200 ms deadline"
    );
}
