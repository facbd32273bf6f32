//! Properties of the stage protocol: every frame round-trips, read boundaries do not matter, random bytes never panic, codecs.

use proptest::collection::vec;
use proptest::prelude::*;
use stage_server::wire::{
    Activations, Batch, Codec, CodecPolicy, CodecSet, Decoder, ErrorCode, Frame, Hello,
    PROTOCOL_VERSION, Role, Sampling, StageTiming, WireError, WireLimits, encode_to_vec,
};

/// Any f32 bit pattern, NaNs with payloads included: the wire must carry them all unchanged.
fn any_f32() -> impl Strategy<Value = f32> {
    any::<u32>().prop_map(f32::from_bits)
}

fn codec() -> impl Strategy<Value = Codec> {
    prop_oneof![Just(Codec::F32), Just(Codec::F16), Just(Codec::Bf16)]
}

fn policy() -> impl Strategy<Value = CodecPolicy> {
    prop_oneof![
        Just(CodecPolicy::F32),
        Just(CodecPolicy::F16),
        Just(CodecPolicy::Bf16),
        Just(CodecPolicy::AutoLossless),
    ]
}

/// Activations encoded from values under a policy, or raw bytes in a codec (bit patterns no encode makes).
/// Any batch a sender can name: any id, one frame or more, at least as many rows as frames (and as the rows of
/// any frame [`activations`] makes).
fn batch() -> impl Strategy<Value = Batch> {
    (any::<u32>(), 1u16.., any::<u32>()).prop_map(|(id, frames, rows)| Batch {
        id,
        frames,
        rows: rows.max(u32::from(frames)).max(4),
    })
}

fn activations() -> impl Strategy<Value = Activations> {
    let encoded = (1u32..6, 0usize..5, policy()).prop_flat_map(|(width, rows, policy)| {
        vec(any_f32(), rows * width as usize)
            .prop_map(move |values| Activations::encode(&values, width, policy))
    });
    let raw = (1u32..6, 0u32..5, codec()).prop_flat_map(|(width, rows, codec)| {
        vec(any::<u8>(), (rows * width) as usize * codec.value_bytes()).prop_map(move |bytes| {
            Activations {
                rows,
                width,
                codec,
                bytes,
            }
        })
    });
    prop_oneof![encoded, raw]
}

fn sampling() -> impl Strategy<Value = Sampling> {
    (
        (any_f32(), any::<u32>(), any_f32(), any_f32(), any::<u64>()),
        (any_f32(), any_f32(), any_f32(), any::<u32>()),
    )
        .prop_map(
            |(
                (temperature, top_k, top_p, min_p, seed),
                (repeat_penalty, presence_penalty, frequency_penalty, penalty_last_n),
            )| Sampling {
                temperature,
                top_k,
                top_p,
                min_p,
                seed,
                repeat_penalty,
                presence_penalty,
                frequency_penalty,
                penalty_last_n,
            },
        )
}

fn hello() -> impl Strategy<Value = Hello> {
    (
        (
            any::<bool>(),
            any::<[u8; 32]>(),
            any::<u16>(),
            any::<u32>(),
            any::<u32>(),
        ),
        (
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<u16>(),
            0u8..8,
        ),
        (
            any::<[u8; 16]>(),
            proptest::option::of(any::<[u8; 32]>()),
            return_address(),
            any::<u32>(),
        ),
    )
        .prop_map(
            |(
                (prediction, fingerprint, stage_index, layer_start, layer_end),
                (block_count, width, vocab_size, lanes, codec_bits),
                (nonce, proof, return_address, context_length),
            )| {
                let mut codecs = CodecSet::default();
                for (bit, codec) in Codec::ALL.into_iter().enumerate() {
                    if codec_bits & (1 << bit) != 0 {
                        codecs.insert(codec);
                    }
                }
                Hello {
                    version: PROTOCOL_VERSION,
                    role: if prediction {
                        Role::PredictionReturn
                    } else {
                        Role::StageLink
                    },
                    fingerprint,
                    stage_index,
                    layer_start,
                    layer_end,
                    block_count,
                    width,
                    vocab_size,
                    lanes,
                    context_length,
                    codecs,
                    nonce,
                    proof,
                    return_address,
                }
            },
        )
}

/// No address, or an IPv4 or IPv6 one as the wire carries it (no IPv6 flow label or scope).
fn return_address() -> impl Strategy<Value = Option<std::net::SocketAddr>> {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
    prop_oneof![
        Just(None),
        (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, port)| Some(SocketAddr::V4(
            SocketAddrV4::new(Ipv4Addr::from(ip), port)
        ))),
        (any::<[u8; 16]>(), any::<u16>()).prop_map(|(ip, port)| Some(SocketAddr::V6(
            SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, 0)
        ))),
    ]
}

fn error_code() -> impl Strategy<Value = ErrorCode> {
    proptest::sample::select(ErrorCode::ALL.to_vec())
}

/// Every frame kind, with lists up to the default limits.
fn frame() -> impl Strategy<Value = Frame> {
    let limits = WireLimits::default();
    prop_oneof![
        hello().prop_map(Frame::Hello),
        any::<[u8; 32]>().prop_map(|proof| Frame::Proof { proof }),
        (
            any::<u64>(),
            sampling(),
            vec(any::<u32>(), 0..=limits.max_stop_tokens as usize),
            vec((any::<u32>(), any_f32()), 0..40),
            vec(any::<u32>(), 0..80),
            0..=limits.max_top_logprobs,
            (any::<bool>(), any::<bool>()),
            proptest::option::of(any::<[u8; 25]>()),
        )
            .prop_map(
                |(
                    session,
                    sampling,
                    stop_tokens,
                    logit_bias,
                    history,
                    top_logprobs,
                    (logprob, resume),
                    trace,
                )| {
                    Frame::Configure {
                        session,
                        sampling,
                        stop_tokens,
                        logit_bias,
                        history,
                        top_logprobs,
                        logprob,
                        resume,
                        trace,
                    }
                }
            ),
        (
            any::<u64>(),
            any::<u32>(),
            any::<bool>(),
            batch(),
            activations()
        )
            .prop_map(|(session, position, last, batch, rows)| Frame::Prefill {
                session,
                position,
                last,
                batch,
                rows,
            }),
        (any::<u64>(), any::<u32>(), batch(), activations()).prop_map(
            |(session, position, batch, rows)| Frame::Decode {
                session,
                position,
                batch,
                rows,
            }
        ),
        (any::<u64>(), any::<u32>()).prop_map(|(session, length)| Frame::Trim { session, length }),
        any::<u64>().prop_map(|session| Frame::Stop { session }),
        any::<u64>().prop_map(|session| Frame::OpenReturn { session }),
        any::<u64>().prop_map(|session| Frame::Keep { session }),
        any::<u64>().prop_map(|nonce| Frame::Ping { nonce }),
        any::<u64>().prop_map(|nonce| Frame::Pong { nonce }),
        (
            any::<u64>(),
            any::<u32>(),
            vec(
                (any::<u16>(), any::<u32>(), any::<u32>()).prop_map(
                    |(stage_index, compute_micros, wait_micros)| StageTiming {
                        stage_index,
                        compute_micros,
                        wait_micros,
                    }
                ),
                0..8
            )
        )
            .prop_map(|(session, position, timings)| Frame::Ack {
                session,
                position,
                timings,
            }),
        (
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any_f32(),
            vec(
                (any::<u32>(), any_f32()),
                0..=limits.max_top_logprobs as usize
            )
        )
            .prop_map(|(session, position, token, logprob, top)| Frame::Token {
                session,
                position,
                token,
                logprob,
                top,
            }),
        (any::<u64>(), error_code(), "\\PC{0,60}").prop_map(|(session, code, message)| {
            Frame::Error {
                session,
                code,
                message,
            }
        }),
    ]
}

/// Feeds `bytes` to a fresh decoder in pieces of the given sizes (cycled; a 0 counts as 1); returns the frames
/// and the error, if one ended the stream.
fn decode_in_pieces(
    bytes: &[u8],
    pieces: &[usize],
    limits: WireLimits,
) -> (Vec<Frame>, Option<WireError>) {
    let mut decoder = Decoder::new(limits);
    let mut frames = Vec::new();
    let mut offset = 0;
    let mut piece = 0;
    while offset < bytes.len() {
        let size = pieces
            .get(piece % pieces.len().max(1))
            .copied()
            .unwrap_or(usize::MAX)
            .max(1);
        piece += 1;
        let end = offset.saturating_add(size).min(bytes.len());
        let mut chunk = &bytes[offset..end];
        while !chunk.is_empty() {
            match decoder.decode(chunk) {
                Ok((taken, frame)) => {
                    assert!(taken > 0, "the decoder took nothing from a non-empty input");
                    assert!(
                        decoder.held_bytes() <= limits.max_frame_bytes + 5,
                        "the decoder holds {} bytes, over the frame limit {}",
                        decoder.held_bytes(),
                        limits.max_frame_bytes
                    );
                    assert!(
                        decoder.held_bytes() <= (2 * decoder.buffered() + 64).max(4096) + 5,
                        "the decoder holds {} bytes for {} buffered: it reserved ahead of the input",
                        decoder.held_bytes(),
                        decoder.buffered()
                    );
                    chunk = &chunk[taken..];
                    offset += taken;
                    frames.extend(frame);
                }
                Err(error) => return (frames, Some(error)),
            }
        }
    }
    (frames, None)
}

/// Small limits, so random bytes hit them often.
fn small_limits() -> WireLimits {
    WireLimits {
        max_frame_bytes: 512,
        max_rows: 8,
        max_width: 16,
        max_top_logprobs: 4,
        max_stop_tokens: 4,
        max_history: 4,
        max_logit_bias: 4,
        max_message_bytes: 32,
        max_timings: 4,
    }
}

proptest! {
    // Each case is microseconds (the crate builds at opt-level 2), so many cases cost little.
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn every_frame_decodes_to_itself_and_encodes_back_to_the_same_bytes(frame in frame()) {
        let bytes = encode_to_vec(&frame);
        let (frames, error) = decode_in_pieces(&bytes, &[], WireLimits::default());
        prop_assert_eq!(error, None, "a valid {} frame was refused", frame.kind_name());
        prop_assert_eq!(frames.len(), 1, "one frame's bytes did not give one frame");
        prop_assert_eq!(
            encode_to_vec(&frames[0]),
            bytes,
            "the decoded {} frame encodes to other bytes: a value changed on the way",
            frame.kind_name()
        );
        // A frame without NaNs equals itself; for those, compare the values too (NaN != NaN otherwise).
        #[allow(clippy::eq_op)]
        if frame == frame {
            prop_assert_eq!(&frames[0], &frame, "the decoded frame differs from the sent one");
        }
    }

    #[test]
    fn frames_split_at_any_boundaries_decode_the_same(
        frames in vec(frame(), 1..5),
        pieces in vec(1usize..40, 1..8),
    ) {
        let mut bytes = Vec::new();
        for frame in &frames {
            stage_server::wire::encode(frame, &mut bytes);
        }
        let (whole, error) = decode_in_pieces(&bytes, &[], WireLimits::default());
        prop_assert_eq!(error, None, "valid frames were refused");
        let (split, error) = decode_in_pieces(&bytes, &pieces, WireLimits::default());
        prop_assert_eq!(error, None, "valid frames fed in pieces {:?} were refused", pieces);
        let encoded = |frames: &[Frame]| frames.iter().map(encode_to_vec).collect::<Vec<_>>();
        prop_assert_eq!(encoded(&whole), encoded(&frames), "decoding the whole stream changed the frames");
        prop_assert_eq!(encoded(&split), encoded(&frames), "decoding in pieces {:?} changed the frames", pieces);
    }

    #[test]
    fn random_bytes_never_panic_and_give_the_same_outcome_in_any_pieces(
        bytes in vec(any::<u8>(), 0..1024),
        pieces in vec(1usize..64, 1..8),
    ) {
        let (whole, whole_error) = decode_in_pieces(&bytes, &[], small_limits());
        let (split, split_error) = decode_in_pieces(&bytes, &pieces, small_limits());
        prop_assert_eq!(whole_error, split_error, "the read boundaries changed the error");
        let encoded = |frames: &[Frame]| frames.iter().map(encode_to_vec).collect::<Vec<_>>();
        prop_assert_eq!(encoded(&whole), encoded(&split), "the read boundaries changed the frames");
    }

    #[test]
    fn a_frame_with_one_byte_changed_never_panics_and_reads_the_same_in_any_pieces(
        frame in frame(),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
        pieces in vec(1usize..64, 1..4),
    ) {
        let mut bytes = encode_to_vec(&frame);
        let at = at.index(bytes.len());
        bytes[at] ^= flip;
        // A second frame after the broken one, so a wrong length runs into it.
        stage_server::wire::encode(&frame, &mut bytes);
        let (frames, error) = decode_in_pieces(&bytes, &pieces, WireLimits::default());
        let (whole_frames, whole_error) = decode_in_pieces(&bytes, &[], WireLimits::default());
        prop_assert_eq!(&error, &whole_error, "reading in pieces {:?} changed the error", pieces);
        prop_assert_eq!(frames.len(), whole_frames.len(), "reading in pieces {:?} changed the frame count", pieces);
        // Whatever came out must be a frame the encoder makes from exactly the bytes it came from.
        let mut offset = 0;
        for decoded in &frames {
            let encoded = encode_to_vec(decoded);
            prop_assert_eq!(
                &bytes[offset..offset + encoded.len()],
                &encoded[..],
                "a decoded frame does not encode back to its bytes"
            );
            offset += encoded.len();
        }
    }

    #[test]
    fn a_frame_cut_short_yields_nothing_and_no_error(frame in frame(), cut in any::<prop::sample::Index>()) {
        let bytes = encode_to_vec(&frame);
        let cut = cut.index(bytes.len());
        let (frames, error) = decode_in_pieces(&bytes[..cut], &[7], WireLimits::default());
        prop_assert!(frames.is_empty(), "a frame came out of {} of its {} bytes", cut, bytes.len());
        prop_assert_eq!(error, None, "a valid prefix of a frame was refused");
    }

    #[test]
    fn auto_lossless_is_16_bit_exactly_when_that_is_exact_and_never_changes_a_value(
        values in prop_oneof![
            // Values that fit bf16, f16, both or neither, so every branch is taken.
            vec(any::<u16>().prop_map(|bits| f32::from_bits(u32::from(bits) << 16)), 1..24),
            vec(any::<u16>().prop_map(|bits| half::f16::from_bits(bits).to_f32()), 1..24),
            vec(any_f32(), 1..24),
        ],
    ) {
        let encoded = Activations::encode(&values, 1, CodecPolicy::AutoLossless);
        let exact_in = |round_trip: fn(f32) -> f32| {
            values.iter().all(|value| round_trip(*value).to_bits() == value.to_bits())
        };
        let bf16_exact = exact_in(|value| half::bf16::from_f32(value).to_f32());
        let f16_exact = exact_in(|value| half::f16::from_f32(value).to_f32());
        let expected = if bf16_exact {
            Codec::Bf16
        } else if f16_exact {
            Codec::F16
        } else {
            Codec::F32
        };
        prop_assert_eq!(encoded.codec, expected, "auto-lossless picked the wrong codec for {:?}", values);
        for policy in [CodecPolicy::AutoLossless, CodecPolicy::F32] {
            let decoded = Activations::encode(&values, 1, policy).decode();
            let bits = |values: &[f32]| values.iter().map(|value| value.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&decoded), bits(&values), "{} changed a value", policy);
        }
    }
}

#[test]
fn a_count_over_its_limit_is_refused_with_the_field_named() {
    let limits = WireLimits::default();
    let cases: Vec<(&str, Frame, &str)> = vec![
        (
            "stop tokens",
            Frame::Configure {
                session: 1,
                sampling: Sampling::from(&stage_server::model::SamplingParams::default()),
                stop_tokens: vec![1; 65],
                logit_bias: Vec::new(),
                history: Vec::new(),
                top_logprobs: 0,
                logprob: false,
                resume: false,
                trace: None,
            },
            "stop tokens",
        ),
        (
            "logit bias",
            Frame::Configure {
                session: 1,
                sampling: Sampling::from(&stage_server::model::SamplingParams::default()),
                stop_tokens: Vec::new(),
                logit_bias: vec![(1, 0.5); 1025],
                history: Vec::new(),
                top_logprobs: 0,
                logprob: false,
                resume: false,
                trace: None,
            },
            "logit-bias entries",
        ),
        (
            "top log-probabilities",
            Frame::Configure {
                session: 1,
                sampling: Sampling::from(&stage_server::model::SamplingParams::default()),
                stop_tokens: Vec::new(),
                logit_bias: Vec::new(),
                history: Vec::new(),
                top_logprobs: 21,
                logprob: false,
                resume: false,
                trace: None,
            },
            "top log-probabilities",
        ),
        (
            "alternatives",
            Frame::Token {
                session: 1,
                position: 0,
                token: 0,
                logprob: 0.0,
                top: vec![(0, 0.0); 21],
            },
            "alternatives",
        ),
        (
            "message",
            Frame::Error {
                session: 1,
                code: ErrorCode::Internal,
                message: "x".repeat(4097),
            },
            "message bytes",
        ),
        (
            "timings",
            Frame::Ack {
                session: 1,
                position: 0,
                timings: vec![
                    StageTiming {
                        stage_index: 0,
                        compute_micros: 0,
                        wait_micros: 0
                    };
                    257
                ],
            },
            "stage timings",
        ),
        (
            "rows",
            Frame::Decode {
                session: 1,
                position: 0,
                batch: Batch::alone(1, 4097),
                rows: Activations::encode(&[0.0; 4097], 1, CodecPolicy::F32),
            },
            "rows",
        ),
        (
            "width",
            Frame::Decode {
                session: 1,
                position: 0,
                batch: Batch::alone(1, 1),
                rows: Activations::encode(&vec![0.0; 65537], 65537, CodecPolicy::F32),
            },
            "values per row",
        ),
    ];
    for (name, frame, field) in cases {
        let (_, error) = decode_in_pieces(&encode_to_vec(&frame), &[], limits);
        assert!(
            matches!(error, Some(WireError::TooMany { field: found, .. }) if found == field),
            "{name}: over the limit gave {error:?} instead of TooMany for `{field}`"
        );
    }
}

#[test]
fn a_huge_count_in_a_short_frame_is_refused_as_truncated_not_allocated() {
    // An Ack claiming 200 timings (within the limit) in a frame with room for none.
    let mut bytes = encode_to_vec(&Frame::Ack {
        session: 1,
        position: 2,
        timings: Vec::new(),
    });
    let count_at = bytes.len() - 4;
    bytes[count_at..].copy_from_slice(&200u32.to_le_bytes());
    let (_, error) = decode_in_pieces(&bytes, &[], WireLimits::default());
    assert_eq!(
        error,
        Some(WireError::Truncated {
            kind: "ack",
            field: "stage timings",
            length: 17
        }),
        "a count larger than its frame was not refused as a truncation"
    );
}

#[test]
fn an_activation_byte_count_that_does_not_match_the_shape_is_refused() {
    let frame = encode_to_vec(&Frame::Decode {
        session: 1,
        position: 0,
        batch: Batch::alone(1, 1),
        rows: Activations::encode(&[1.0, 2.0], 2, CodecPolicy::F32),
    });
    // Layout: 5 header bytes, session 8, position 4, batch 10, rows 4, width 4, codec 1, then the byte count.
    let count_at = 5 + 8 + 4 + 10 + 4 + 4 + 1;
    for declared in [4u32, 12] {
        let mut bytes = frame.clone();
        bytes[count_at..count_at + 4].copy_from_slice(&declared.to_le_bytes());
        let (_, error) = decode_in_pieces(&bytes, &[], WireLimits::default());
        assert_eq!(
            error,
            Some(WireError::RowsMismatch {
                rows: 1,
                width: 2,
                codec: Codec::F32,
                expected: 8,
                bytes: declared
            }),
            "a byte count of {declared} for 1 x 2 f32 values was accepted"
        );
    }
}

#[test]
fn a_hello_of_another_version_is_refused_as_a_version_error() {
    let mut bytes = encode_to_vec(&Frame::Hello(Hello {
        version: PROTOCOL_VERSION,
        role: Role::StageLink,
        fingerprint: [0; 32],
        stage_index: 0,
        layer_start: 0,
        layer_end: 1,
        block_count: 1,
        width: 1,
        vocab_size: 1,
        lanes: 1,
        context_length: 4096,
        codecs: CodecSet::all(),
        nonce: [0; 16],
        proof: None,
        return_address: None,
    }));
    bytes[9..11].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    // Another version may lay out the rest differently: only magic and version may be read.
    bytes.truncate(11);
    let (_, error) = decode_in_pieces(&bytes, &[1], WireLimits::default());
    let error = error.expect("a hello of another version was not refused");
    assert_eq!(
        error,
        WireError::Version {
            found: PROTOCOL_VERSION + 1,
            supported: PROTOCOL_VERSION
        },
        "another version was refused for another reason"
    );
    assert_eq!(
        error.code(),
        ErrorCode::Version,
        "a version error must answer with the version code"
    );
}

#[test]
fn a_frame_that_declares_the_largest_length_and_sends_little_holds_little() {
    let limits = WireLimits::default();
    let mut decoder = Decoder::new(limits);
    let mut bytes = encode_to_vec(&Frame::Decode {
        session: 1,
        position: 0,
        batch: Batch::alone(1, 4000),
        rows: Activations::encode(&vec![0.5; 4000 * 4096], 4096, CodecPolicy::F32),
    });
    bytes.truncate(1000);
    let (taken, frame) = decoder.decode(&bytes).expect("a valid prefix was refused");
    assert_eq!(
        (taken, frame),
        (1000, None),
        "the prefix was not all taken, or gave a frame"
    );
    assert!(
        decoder.held_bytes() <= 2 * 1000 + 64,
        "a 62 MiB frame of which 1000 bytes arrived holds {} bytes",
        decoder.held_bytes()
    );
}

#[test]
fn a_frame_longer_than_its_fields_is_refused_at_its_last_count_whatever_the_pieces() {
    // An Ack with one timing whose length claims 2048 more bytes; only its fields arrive.
    let mut bytes = encode_to_vec(&Frame::Ack {
        session: 4,
        position: 3,
        timings: vec![StageTiming {
            stage_index: 1,
            compute_micros: 10,
            wait_micros: 2,
        }],
    });
    let length = u32::from_le_bytes(bytes[..4].try_into().unwrap()) + 2048;
    bytes[..4].copy_from_slice(&length.to_le_bytes());
    let expected = Some(WireError::TrailingBytes {
        kind: "ack",
        length,
        extra: 2048,
    });
    for pieces in [vec![], vec![1], vec![9, 8], vec![20]] {
        let (_, error) = decode_in_pieces(&bytes, &pieces, WireLimits::default());
        assert_eq!(
            error, expected,
            "in pieces {pieces:?} the overlong frame was not refused at its count"
        );
    }
}
