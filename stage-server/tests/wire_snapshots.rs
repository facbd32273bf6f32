//! Pinned wire format and texts of the stage protocol: one frame of each kind in hex, every decode error, mismatch and code name.

use std::fmt::Write;

use stage_server::wire::{
    Activations, Batch, ClusterKey, Codec, CodecPolicy, CodecSet, Decoder, ErrorCode, Frame, Hello,
    PROTOCOL_VERSION, Role, Sampling, StageTiming, WireLimits, check_adjacent, check_codec,
    encode_to_vec,
};

/// The hello stage 0 of a 24-block model split at layer 10 sends.
fn stage_zero() -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        role: Role::StageLink,
        fingerprint: std::array::from_fn(|index| index as u8),
        stage_index: 0,
        layer_start: 0,
        layer_end: 10,
        block_count: 24,
        width: 576,
        vocab_size: 49152,
        lanes: 4,
        context_length: 4096,
        codecs: CodecSet::all(),
        nonce: [0x11; 16],
        proof: None,
        return_address: None,
    }
}

/// The hello of stage 1, serving the layers after stage 0's.
fn stage_one() -> Hello {
    Hello {
        stage_index: 1,
        layer_start: 10,
        layer_end: 24,
        nonce: [0x22; 16],
        proof: Some([0x33; 32]),
        // The last stage names itself for prediction returns.
        return_address: Some("127.0.0.1:7003".parse().unwrap()),
        ..stage_zero()
    }
}

/// One example of every frame kind.
fn examples() -> Vec<Frame> {
    vec![
        Frame::Hello(stage_one()),
        Frame::Proof { proof: [0x44; 32] },
        Frame::Configure {
            session: 0x0102_0304_0506_0708,
            sampling: Sampling {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                seed: 42,
                repeat_penalty: 1.1,
                presence_penalty: 0.0,
                frequency_penalty: 0.5,
                penalty_last_n: 64,
            },
            stop_tokens: vec![2, 49152],
            logit_bias: vec![(7, -1.5)],
            history: vec![9, 10],
            top_logprobs: 3,
            logprob: true,
            resume: false,
            trace: Some(std::array::from_fn(|index| index as u8)),
        },
        Frame::Prefill {
            session: 5,
            position: 0,
            last: false,
            batch: Batch {
                id: 3,
                frames: 2,
                rows: 3,
            },
            rows: Activations::encode(&[1.0, -2.0, 0.5, 3.0], 2, CodecPolicy::F32),
        },
        Frame::Decode {
            session: 5,
            position: 12,
            batch: Batch::alone(4, 1),
            rows: Activations::encode(&[1.0, -2.0, 0.5, 3.0], 4, CodecPolicy::AutoLossless),
        },
        Frame::Trim {
            session: 5,
            length: 9,
        },
        Frame::Stop { session: 5 },
        Frame::OpenReturn { session: 5 },
        Frame::Keep { session: 5 },
        Frame::Ping { nonce: 0x0a0b },
        Frame::Pong { nonce: 0x0a0b },
        Frame::Ack {
            session: 5,
            position: 13,
            timings: vec![
                StageTiming {
                    stage_index: 1,
                    compute_micros: 850,
                    wait_micros: 120,
                },
                StageTiming {
                    stage_index: 2,
                    compute_micros: 910,
                    wait_micros: 0,
                },
            ],
        },
        Frame::Token {
            session: 5,
            position: 13,
            token: 4095,
            logprob: -0.25,
            top: vec![(4095, -0.25), (17, -1.75)],
        },
        Frame::Error {
            session: 0,
            code: ErrorCode::Layers,
            message: "gap".to_string(),
        },
    ]
}

/// The frame as hex: the 5 header bytes on the first line, then the body 16 bytes a line.
fn hex(bytes: &[u8]) -> String {
    let line = |bytes: &[u8]| {
        bytes
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut text = format!("{}\n", line(&bytes[..5]));
    for chunk in bytes[5..].chunks(16) {
        writeln!(text, "{}", line(chunk)).unwrap();
    }
    text
}

/// The error the decoder gives for `bytes`, as text.
fn decode_error(bytes: &[u8]) -> String {
    let mut decoder = Decoder::new(WireLimits::default());
    let mut input = bytes;
    loop {
        match decoder.decode(input) {
            Ok((taken, _)) if taken > 0 && taken < input.len() => input = &input[taken..],
            Ok(_) => panic!("the bytes {bytes:02x?} decoded without an error"),
            Err(error) => return error.to_string(),
        }
    }
}

#[test]
fn one_frame_of_each_kind_has_the_pinned_bytes() {
    for frame in examples() {
        insta::assert_snapshot!(
            format!("frame_{}", frame.kind_name()),
            hex(&encode_to_vec(&frame))
        );
    }
}

#[test]
fn the_examples_cover_every_frame_kind() {
    let mut kinds: Vec<&str> = examples().iter().map(Frame::kind_name).collect();
    kinds.dedup();
    assert_eq!(
        kinds.len(),
        14,
        "an example is missing or doubled: {kinds:?}"
    );
}

#[test]
fn every_decode_error_names_its_field_and_limit() {
    let hello = encode_to_vec(&Frame::Hello(stage_zero()));
    let decode = encode_to_vec(&Frame::Decode {
        session: 1,
        position: 0,
        batch: Batch::alone(1, 1),
        rows: Activations::encode(&[1.0, 2.0], 2, CodecPolicy::F32),
    });
    let with = |bytes: &[u8], at: usize, patch: &[u8]| {
        let mut bytes = bytes.to_vec();
        bytes[at..at + patch.len()].copy_from_slice(patch);
        bytes
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("frame too large", (64u32 << 20 | 1).to_le_bytes().to_vec()),
        ("empty frame", vec![0, 0, 0, 0]),
        ("unknown kind", vec![1, 0, 0, 0, 99]),
        ("truncated", vec![3, 0, 0, 0, 7, 1, 2]),
        ("trailing bytes", {
            let mut bytes = encode_to_vec(&Frame::Stop { session: 1 });
            bytes[0] = 10;
            bytes.push(0);
            bytes
        }),
        (
            "too many",
            encode_to_vec(&Frame::Token {
                session: 1,
                position: 0,
                token: 0,
                logprob: 0.0,
                top: vec![(0, 0.0); 21],
            }),
        ),
        ("bad magic", with(&hello, 5, b"SRDY")),
        (
            "version",
            with(&hello, 9, &(PROTOCOL_VERSION + 1).to_le_bytes()),
        ),
        ("bad role", with(&hello, 11, &[9])),
        // Hello: header 5, magic 4, version 2, role 1, fingerprint 32, stage index 2, four u32s 16 and vocabulary
        // size 4, lanes 2, context length 4, codecs 1, nonce 16.
        (
            "bad codec set",
            with(&hello, 5 + 4 + 2 + 1 + 32 + 2 + 20 + 2 + 4, &[0x80]),
        ),
        (
            "bad proof flag",
            with(&hello, 5 + 4 + 2 + 1 + 32 + 2 + 20 + 2 + 4 + 1 + 16, &[2]),
        ),
        // Decode: header 5, session 8, position 4, batch id 4, frame count 2 and row count 4, rows 4, width 4,
        // codec 1.
        ("bad codec", with(&decode, 5 + 8 + 4 + 10 + 8, &[0])),
        (
            "no frames in the batch",
            with(&decode, 5 + 8 + 4 + 4, &[0, 0]),
        ),
        (
            "fewer rows in the batch than frames",
            with(&decode, 5 + 8 + 4 + 6, &0u32.to_le_bytes()),
        ),
        (
            "more rows in the frame than in its batch",
            encode_to_vec(&Frame::Decode {
                session: 1,
                position: 0,
                batch: Batch::alone(1, 1),
                rows: Activations::encode(&[1.0, 2.0, 3.0, 4.0], 2, CodecPolicy::F32),
            }),
        ),
        ("bad log-probability flag", {
            let configure = encode_to_vec(&Frame::Configure {
                session: 1,
                sampling: Sampling::from(&stage_server::model::SamplingParams::default()),
                stop_tokens: Vec::new(),
                logit_bias: Vec::new(),
                history: Vec::new(),
                top_logprobs: 0,
                logprob: false,
                resume: false,
                trace: None,
            });
            // After the header, the session and the 40 bytes of sampling settings, the alternatives count.
            with(&configure, 5 + 8 + 40 + 1, &[2])
        }),
        ("bad error code", {
            let bytes = encode_to_vec(&Frame::Error {
                session: 0,
                code: ErrorCode::Protocol,
                message: String::new(),
            });
            with(&bytes, 13, &500u16.to_le_bytes())
        }),
        ("bad text", {
            let bytes = encode_to_vec(&Frame::Error {
                session: 0,
                code: ErrorCode::Protocol,
                message: "ab".to_string(),
            });
            with(&bytes, 19, &[0xff])
        }),
        (
            "rows mismatch",
            with(&decode, 5 + 8 + 4 + 10 + 9, &12u32.to_le_bytes()),
        ),
    ];
    let mut text = String::new();
    for (name, bytes) in cases {
        writeln!(text, "{name}: {}", decode_error(&bytes)).unwrap();
    }
    insta::assert_snapshot!("wire_errors", text);
}

#[test]
fn every_mismatch_text_names_both_stages_and_values() {
    let zero = stage_zero();
    let one = stage_one();
    let cases: Vec<(&str, Hello)> = vec![
        (
            "version",
            Hello {
                version: PROTOCOL_VERSION + 1,
                ..one.clone()
            },
        ),
        (
            "role",
            Hello {
                role: Role::PredictionReturn,
                ..one.clone()
            },
        ),
        (
            "model",
            Hello {
                fingerprint: [0xfe; 32],
                ..one.clone()
            },
        ),
        (
            "block count",
            Hello {
                block_count: 30,
                ..one.clone()
            },
        ),
        (
            "width",
            Hello {
                width: 960,
                ..one.clone()
            },
        ),
        (
            "vocabulary",
            Hello {
                vocab_size: 32000,
                ..one.clone()
            },
        ),
        (
            "range",
            Hello {
                layer_end: 30,
                ..one.clone()
            },
        ),
        (
            "gap",
            Hello {
                layer_start: 12,
                ..one.clone()
            },
        ),
        (
            "overlap",
            Hello {
                layer_start: 8,
                ..one.clone()
            },
        ),
    ];
    let mut text = String::new();
    for (name, downstream) in cases {
        let mismatch = check_adjacent(&zero, &downstream)
            .expect_err("a hello that differs from its neighbour passed the adjacency check");
        writeln!(text, "{name} [{}]: {mismatch}", mismatch.code()).unwrap();
    }
    let mut only_f32 = CodecSet::default();
    only_f32.insert(Codec::F32);
    let mismatch = check_codec(
        CodecPolicy::Bf16,
        &Hello {
            codecs: only_f32,
            ..one
        },
    )
    .expect_err("a stage without bf16 passed for a bf16 sender");
    writeln!(text, "codec [{}]: {mismatch}", mismatch.code()).unwrap();
    insta::assert_snapshot!("mismatches", text);
}

#[test]
fn error_code_names_and_wire_values_are_pinned() {
    let mut text = String::new();
    for code in ErrorCode::ALL {
        writeln!(text, "{} {}", code.to_wire(), code.as_str()).unwrap();
    }
    insta::assert_snapshot!("error_codes", text);
}

#[test]
fn cluster_key_errors_name_the_file_and_the_length() {
    let dir = std::env::temp_dir().join(format!("stage-server-wire-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating a scratch directory");
    let short = dir.join("short.key");
    std::fs::write(&short, "0123456789\n").expect("writing a short key");
    let missing = dir.join("missing.key");
    let texts = [
        ClusterKey::load(&missing).unwrap_err().to_string(),
        ClusterKey::load(&short).unwrap_err().to_string(),
        ClusterKey::from_bytes(b"short").unwrap_err().to_string(),
    ];
    let _ = std::fs::remove_dir_all(&dir);
    let text = texts
        .join("\n")
        .replace(&dir.display().to_string(), "[dir]");
    insta::assert_snapshot!("key_errors", text);
}
