//! Stable-toolchain twins of the fuzz targets in `stage-server/fuzz`: the same bodies over seeded random inputs, for a bounded time.
//!
//! cargo-fuzz needs nightly, which CI does not have, so each target's body (`stage_server::fuzzing`) also runs
//! here on inputs from a fixed seed: mutations of small valid files for the GGUF pre-check, and texts mixing
//! random bytes with the characters tokenizers find hard for the tokenizer. Each twin stops after its case
//! count or its time budget, whichever comes first, so a loaded machine runs fewer cases instead of a longer
//! test. A failure prints the seed and case; `stage-server/fuzz/README.md` says how to run the real fuzzers.

use std::io::Cursor;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use stage_server::fuzzing::{TokenizerTargets, gguf_check, http_request, wire_decoder};
use stage_server::model::gguf_check::validate_bytes;
use stage_server::wire::{
    Activations, Batch, CodecPolicy, CodecSet, ErrorCode, Frame, Hello, PROTOCOL_VERSION, Role,
    Sampling, StageTiming, encode_to_vec,
};

/// Wall-clock budget of one twin: long enough for thousands of cases, short enough for every `cargo test`.
const BUDGET: Duration = Duration::from_secs(3);
/// Most cases one twin runs (reached in well under the budget on an idle machine).
const MAXIMUM_CASES: usize = 100_000;

/// The committed seed corpus of the GGUF target.
fn gguf_corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/gguf_check")
}

/// The committed seed corpus of the wire target.
fn wire_corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/wire_decoder")
}

/// One valid frame of every kind, encoded, each with the wire target's selector byte (pieces of 3 and 5) in
/// front; activations in each codec.
fn wire_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let hello = Hello {
        version: PROTOCOL_VERSION,
        role: Role::StageLink,
        fingerprint: [7; 32],
        stage_index: 1,
        layer_start: 10,
        layer_end: 24,
        block_count: 24,
        width: 8,
        vocab_size: 300,
        lanes: 2,
        context_length: 4096,
        codecs: CodecSet::all(),
        nonce: [9; 16],
        proof: Some([5; 32]),
        return_address: Some("[::1]:7004".parse().unwrap()),
    };
    let values: Vec<f32> = (0..16).map(|index| index as f32 / 4.0 - 1.5).collect();
    let frames = [
        ("hello", Frame::Hello(hello)),
        ("proof", Frame::Proof { proof: [3; 32] }),
        (
            "configure",
            Frame::Configure {
                session: 4,
                sampling: Sampling::from(&stage_server::model::SamplingParams::default()),
                stop_tokens: vec![2, 3],
                logit_bias: vec![(5, -1.0)],
                history: vec![11, 12, 13],
                top_logprobs: 2,
                logprob: true,
                resume: false,
                trace: Some([1; 25]),
            },
        ),
        (
            "prefill",
            Frame::Prefill {
                session: 4,
                position: 0,
                last: true,
                batch: Batch {
                    id: 7,
                    frames: 3,
                    rows: 40,
                },
                rows: Activations::encode(&values, 8, CodecPolicy::F32),
            },
        ),
        (
            "decode-bf16",
            Frame::Decode {
                session: 4,
                position: 2,
                batch: Batch::alone(8, 1),
                rows: Activations::encode(&values[..8], 8, CodecPolicy::AutoLossless),
            },
        ),
        (
            "decode-f16",
            Frame::Decode {
                session: 4,
                position: 3,
                batch: Batch::alone(9, 1),
                rows: Activations::encode(&values[..8], 8, CodecPolicy::F16),
            },
        ),
        (
            "trim",
            Frame::Trim {
                session: 4,
                length: 2,
            },
        ),
        ("stop", Frame::Stop { session: 4 }),
        ("open-return", Frame::OpenReturn { session: 4 }),
        ("keep", Frame::Keep { session: 4 }),
        ("ping", Frame::Ping { nonce: 0x0102 }),
        ("pong", Frame::Pong { nonce: 0x0102 }),
        (
            "ack",
            Frame::Ack {
                session: 4,
                position: 3,
                timings: vec![StageTiming {
                    stage_index: 1,
                    compute_micros: 10,
                    wait_micros: 2,
                }],
            },
        ),
        (
            "token",
            Frame::Token {
                session: 4,
                position: 3,
                token: 77,
                logprob: -0.5,
                top: vec![(77, -0.5), (12, -2.0)],
            },
        ),
        (
            "error",
            Frame::Error {
                session: 4,
                code: ErrorCode::SessionBusy,
                message: "session 4 is busy".to_string(),
            },
        ),
    ];
    frames
        .into_iter()
        .map(|(name, frame)| {
            let mut bytes = vec![0x42];
            bytes.extend(encode_to_vec(&frame));
            (name, bytes)
        })
        .collect()
}

/// Small valid GGUF files: metadata of every value type with an alignment, and a few tensors of several types.
fn gguf_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let metadata = [
        ("general.architecture", Value::String("llama".into())),
        ("general.alignment", Value::U32(64)),
        ("llama.block_count", Value::U32(2)),
        ("flag", Value::Bool(true)),
        ("small", Value::I8(-3)),
        ("wide", Value::U64(1 << 40)),
        ("ratio", Value::F32(0.5)),
        (
            "list",
            Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]),
        ),
        (
            "nested",
            Value::Array(vec![Value::Array(vec![Value::U16(1), Value::U16(2)])]),
        ),
    ];
    let pairs: Vec<(&str, &Value)> = metadata.iter().map(|(key, value)| (*key, value)).collect();
    let values: Vec<f32> = (0..64).map(|index| index as f32 / 8.0 - 4.0).collect();
    let dense = Tensor::from_vec(values, (2, 32), &Device::Cpu).expect("a 2x32 tensor");
    let tensors: Vec<(&str, QTensor)> = [
        ("dense.weight", GgmlDType::F32),
        ("q8.weight", GgmlDType::Q8_0),
        ("q4.weight", GgmlDType::Q4_1),
    ]
    .into_iter()
    .map(|(name, dtype)| {
        (
            name,
            QTensor::quantize(&dense, dtype).expect("quantising a seed tensor"),
        )
    })
    .collect();
    let tensor_pairs: Vec<(&str, &QTensor)> = tensors
        .iter()
        .map(|(name, tensor)| (*name, tensor))
        .collect();
    let write = |metadata: &[(&str, &Value)], tensors: &[(&str, &QTensor)]| {
        let mut bytes = Cursor::new(Vec::new());
        gguf_file::write(&mut bytes, metadata, tensors).expect("writing a seed GGUF file");
        bytes.into_inner()
    };
    vec![
        ("metadata.gguf", write(&pairs, &[])),
        // candle's writer aligns tensor data to 32 bytes whatever `general.alignment` says, so the tensor seed
        // leaves that key out (the pre-check rightly rejects offsets that miss the declared alignment).
        ("tensors.gguf", write(&[pairs[0], pairs[2]], &tensor_pairs)),
    ]
}

/// One mutation of `seed`: flipped bytes, a truncation, an extreme length or count written over a field, or
/// random bytes after the magic.
fn mutate(seed: &[u8], random: &mut StdRng) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    match random.random_range(0..5) {
        0 => {
            for _ in 0..random.random_range(1..=8) {
                let at = random.random_range(0..bytes.len());
                bytes[at] ^= 1 << random.random_range(0..8);
            }
        }
        1 => bytes.truncate(random.random_range(0..bytes.len())),
        2 => {
            let extreme: u64 = match random.random_range(0..4) {
                0 => u64::MAX,
                1 => 1 << random.random_range(0..64),
                2 => random.random_range(0..1 << 20),
                _ => random.random(),
            };
            let at = random.random_range(0..bytes.len().saturating_sub(8).max(1));
            let end = (at + 8).min(bytes.len());
            bytes[at..end].copy_from_slice(&extreme.to_le_bytes()[..end - at]);
        }
        3 => {
            let at = random.random_range(0..bytes.len());
            let value = random.random();
            bytes[at] = value;
        }
        _ => {
            bytes.truncate(8);
            let length = random.random_range(0..256);
            bytes.extend((0..length).map(|_| random.random::<u8>()));
        }
    }
    bytes
}

/// Characters and pieces that stress tokenizers: spaces of several kinds, digits, contractions, control-token
/// text, SentencePiece's space mark, combining marks, emoji sequences and scripts without spaces.
const PIECES: [&str; 24] = [
    " ",
    "  ",
    "\n",
    "\r\n",
    "\t",
    "\u{a0}",
    "\u{3000}",
    "123",
    "4567",
    "'s",
    "'LL",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
    "\u{2581}",
    "e\u{301}",
    "😀",
    "👨‍👩‍👧",
    "日本語",
    "한국어",
    "the",
    "sing",
    "\u{fffd}",
];

/// A random tokenizer input: the selector byte, then random bytes or a text of random pieces and letters.
fn tokenizer_input(random: &mut StdRng) -> Vec<u8> {
    let mut bytes = vec![random.random::<u8>()];
    if random.random_bool(0.25) {
        let length = random.random_range(0..64);
        bytes.extend((0..length).map(|_| random.random::<u8>()));
        return bytes;
    }
    for _ in 0..random.random_range(0..24) {
        if random.random_bool(0.5) {
            bytes.extend_from_slice(PIECES[random.random_range(0..PIECES.len())].as_bytes());
        } else {
            let letter = char::from(random.random_range(b'a'..=b'z'));
            bytes.extend_from_slice(letter.to_string().as_bytes());
        }
    }
    bytes
}

/// Runs `body` on inputs from `input` until the case count or the time budget runs out; returns the count.
fn run_for_budget(
    seed: u64,
    mut input: impl FnMut(&mut StdRng) -> Vec<u8>,
    body: impl Fn(&[u8]),
) -> usize {
    let started = Instant::now();
    let mut random = StdRng::seed_from_u64(seed);
    let mut cases = 0;
    while cases < MAXIMUM_CASES && started.elapsed() < BUDGET {
        let bytes = input(&mut random);
        // The body only reads shared state, so a panic cannot leave it half-updated for the next case.
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| body(&bytes)));
        if let Err(payload) = outcome {
            eprintln!("seed {seed:#x}, case {cases}: the body panicked on the input {bytes:02x?}");
            std::panic::resume_unwind(payload);
        }
        cases += 1;
    }
    cases
}

#[test]
fn the_gguf_pre_check_target_holds_on_mutated_small_files() {
    let seeds = gguf_seeds();
    for (name, bytes) in &seeds {
        validate_bytes(bytes, Path::new(name))
            .unwrap_or_else(|error| panic!("the unmutated seed {name} must validate: {error}"));
        gguf_check(bytes);
    }
    let cases = run_for_budget(
        0x6775_6666,
        |random| {
            let (_, seed) = &seeds[random.random_range(0..seeds.len())];
            mutate(seed, random)
        },
        gguf_check,
    );
    eprintln!("gguf_check twin: {cases} mutated files");
}

#[test]
fn the_tokenizer_target_holds_on_random_texts() {
    let targets = TokenizerTargets::new();
    let cases = run_for_budget(0x746f_6b65, tokenizer_input, |bytes| targets.encode(bytes));
    eprintln!("tokenizer twin: {cases} texts");
}

#[test]
fn the_wire_decoder_target_holds_on_mutated_frame_streams() {
    let seeds = wire_seeds();
    for (_, bytes) in &seeds {
        wire_decoder(bytes);
    }
    let cases = run_for_budget(
        0x7769_7265,
        |random| {
            // A selector byte, then one to three seed frames, then one mutation of the whole stream (so a
            // broken frame may sit after good ones), or random bytes.
            let mut stream = vec![random.random::<u8>()];
            if random.random_bool(0.1) {
                let length = random.random_range(0..256);
                stream.extend((0..length).map(|_| random.random::<u8>()));
                return stream;
            }
            for _ in 0..random.random_range(1..=3) {
                let (_, seed) = &seeds[random.random_range(0..seeds.len())];
                stream.extend_from_slice(&seed[1..]);
            }
            let mut mutated = mutate(&stream[1..], random);
            mutated.insert(0, stream[0]);
            mutated
        },
        wire_decoder,
    );
    eprintln!("wire_decoder twin: {cases} streams");
}

#[test]
fn every_committed_wire_seed_decodes_to_one_frame() {
    let mut seen = 0;
    for entry in std::fs::read_dir(wire_corpus_dir()).expect("the wire seed corpus is committed") {
        let path = entry.expect("a corpus entry").path();
        let bytes = std::fs::read(&path).expect("a corpus file is readable");
        let mut decoder = stage_server::wire::Decoder::new(stage_server::fuzzing::WIRE_FUZZ_LIMITS);
        let outcome = decoder.decode(&bytes[1..]);
        assert!(
            matches!(outcome, Ok((taken, Some(_))) if taken == bytes.len() - 1),
            "the seed {} is not one valid frame: {outcome:?}",
            path.display()
        );
        seen += 1;
    }
    assert!(
        seen >= wire_seeds().len(),
        "the wire seed corpus holds {seen} files, fewer than the {} seeds",
        wire_seeds().len()
    );
}

#[test]
#[ignore = "writes the seed corpus of stage-server/fuzz; run by hand after changing wire_seeds"]
fn write_the_wire_seed_corpus() {
    let directory = wire_corpus_dir();
    std::fs::create_dir_all(&directory).expect("creating the corpus directory");
    for (name, bytes) in wire_seeds() {
        std::fs::write(directory.join(name), bytes).expect("writing a seed");
    }
}

#[test]
fn every_committed_gguf_seed_is_accepted_by_the_pre_check() {
    // A seed the pre-check rejects would start the fuzzer outside the code it is meant to explore.
    let mut seen = 0;
    for entry in std::fs::read_dir(gguf_corpus_dir()).expect("the GGUF seed corpus is committed") {
        let path = entry.expect("a corpus entry").path();
        let bytes = std::fs::read(&path).expect("a corpus file is readable");
        validate_bytes(&bytes, &path).unwrap_or_else(|error| {
            panic!(
                "the seed {} is not a valid GGUF file: {error}",
                path.display()
            )
        });
        seen += 1;
    }
    assert!(
        seen >= 2,
        "the GGUF seed corpus holds {seen} files, fewer than the two seeds"
    );
}

#[test]
#[ignore = "writes the seed corpus of stage-server/fuzz; run by hand after changing gguf_seeds"]
fn write_the_gguf_seed_corpus() {
    let directory = gguf_corpus_dir();
    std::fs::create_dir_all(&directory).expect("creating the corpus directory");
    for (name, bytes) in gguf_seeds() {
        std::fs::write(directory.join(name), bytes).expect("writing a seed");
    }
}

/// The committed seed corpus of the HTTP target.
fn http_corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/http_request")
}

/// Valid request streams for stage 0's API, each after the HTTP target's selector byte: a GET, a chat request
/// by Content-Length, a completion request chunked with an extension and a trailer, one behind `Expect:
/// 100-continue`, and three pipelined requests (HTTP/1.0 among them) with a blank line between two.
fn http_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let chat = br#"{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":true,"max_tokens":8}"#;
    let completion = br#"{"model":"m","prompt":"Once","max_tokens":4,"temperature":0.5}"#;
    let with_length = |target: &str, body: &[u8]| {
        let mut bytes = format!(
            "POST {target} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        bytes.extend_from_slice(body);
        bytes
    };
    let mut chunked =
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    let (first, second) = completion.split_at(20);
    chunked.extend_from_slice(format!("{:x};piece=1\r\n", first.len()).as_bytes());
    chunked.extend_from_slice(first);
    chunked.extend_from_slice(format!("\r\n{:X}\r\n", second.len()).as_bytes());
    chunked.extend_from_slice(second);
    chunked.extend_from_slice(b"\r\n0\r\nX-Trailer: done\r\n\r\n");
    let mut continued = with_length("/v1/chat/completions", chat);
    let at = continued
        .windows(2)
        .position(|pair| pair == b"\r\n")
        .unwrap_or(0)
        + 2;
    continued.splice(at..at, b"Expect: 100-continue\r\n".iter().copied());
    let mut pipelined = b"GET /v1/models?x=1 HTTP/1.1\r\nHost: localhost\r\n\r\n\r\n".to_vec();
    pipelined.extend_from_slice(&with_length("/v1/completions", completion));
    pipelined.extend_from_slice(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    let with_selector = |selector: u8, stream: Vec<u8>| {
        let mut bytes = vec![selector];
        bytes.extend(stream);
        bytes
    };
    vec![
        (
            "get",
            with_selector(
                0x00,
                b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n".to_vec(),
            ),
        ),
        (
            "chat",
            with_selector(0x3f, with_length("/v1/chat/completions", chat)),
        ),
        ("completion-chunked", with_selector(0x52, chunked)),
        ("continue", with_selector(0x17, continued)),
        ("pipelined", with_selector(0xe4, pipelined)),
    ]
}

/// Pieces of HTTP framing that an HTTP mutation splices into a stream, where a random byte would rarely reach.
const HTTP_PIECES: [&str; 18] = [
    "\r\n",
    "\n",
    "\r",
    "\r\n\r\n",
    " ",
    ":",
    ";",
    "Content-Length: 5\r\n",
    "Content-Length: 99999999999\r\n",
    "Transfer-Encoding: chunked\r\n",
    "Transfer-Encoding: gzip\r\n",
    "Expect: 100-continue\r\n",
    "Connection: close\r\n",
    "0\r\n\r\n",
    "fffffff\r\n",
    "HTTP/2.0",
    "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "{\"messages\":[{\"role\":\"user\",\"content\":",
];

/// A stream for the HTTP target: a selector byte, one to three seed streams, then a byte mutation or a
/// spliced framing piece (so a broken request may sit after good ones), or random bytes.
fn http_input(seeds: &[(&str, Vec<u8>)], random: &mut StdRng) -> Vec<u8> {
    let mut stream = vec![random.random::<u8>()];
    if random.random_bool(0.1) {
        let length = random.random_range(0..512);
        stream.extend((0..length).map(|_| random.random::<u8>()));
        return stream;
    }
    let mut requests = Vec::new();
    for _ in 0..random.random_range(1..=3) {
        let (_, seed) = &seeds[random.random_range(0..seeds.len())];
        requests.extend_from_slice(&seed[1..]);
    }
    if random.random_bool(0.5) {
        for _ in 0..random.random_range(1..=3) {
            let at = random.random_range(0..=requests.len());
            let piece = HTTP_PIECES[random.random_range(0..HTTP_PIECES.len())];
            requests.splice(at..at, piece.bytes());
        }
    } else {
        requests = mutate(&requests, random);
    }
    stream.extend(requests);
    stream
}

#[test]
fn the_http_request_target_holds_on_mutated_request_streams() {
    let seeds = http_seeds();
    for (_, bytes) in &seeds {
        http_request(bytes);
    }
    let cases = run_for_budget(
        0x6874_7470,
        |random| http_input(&seeds, random),
        http_request,
    );
    eprintln!("http_request twin: {cases} streams");
}

#[test]
fn every_committed_http_seed_parses_to_whole_requests() {
    use stage_server::http::{Parsed, RequestParser};
    let mut seen = 0;
    for entry in std::fs::read_dir(http_corpus_dir()).expect("the HTTP seed corpus is committed") {
        let path = entry.expect("a corpus entry").path();
        let bytes = std::fs::read(&path).expect("a corpus file is readable");
        let mut parser = RequestParser::new(stage_server::fuzzing::HTTP_FUZZ_LIMITS);
        let mut rest = &bytes[1..];
        let mut requests = 0;
        while !rest.is_empty() {
            let outcome = parser.parse(rest);
            let Ok((consumed, parsed)) = outcome else {
                panic!("the seed {} is refused: {outcome:?}", path.display());
            };
            rest = &rest[consumed..];
            match parsed {
                Parsed::NeedMore => panic!("the seed {} ends inside a request", path.display()),
                Parsed::Continue => {}
                Parsed::Request(_) => requests += 1,
            }
        }
        assert!(requests > 0, "the seed {} holds no request", path.display());
        seen += 1;
    }
    assert!(
        seen >= http_seeds().len(),
        "the HTTP seed corpus holds {seen} files, fewer than the {} seeds",
        http_seeds().len()
    );
}

#[test]
#[ignore = "writes the seed corpus of stage-server/fuzz; run by hand after changing http_seeds"]
fn write_the_http_seed_corpus() {
    let directory = http_corpus_dir();
    std::fs::create_dir_all(&directory).expect("creating the corpus directory");
    for (name, bytes) in http_seeds() {
        std::fs::write(directory.join(name), bytes).expect("writing a seed");
    }
}
