//! A stage port spoken to frame by frame, as a peer that is not stage-server could: the return link taken only
//! by the last stage, frames sent far ahead of their answers, a link's sessions bounded by the stage's lanes, and
//! pings passed down the chain.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use candle_core::quantized::GgmlDType;
use stage_server::model::SamplingParams;
use stage_server::model::testing::TinyModel;
use stage_server::wire::{Batch, CodecPolicy, Decoder, ErrorCode, Frame, WireLimits};

mod support;
use support::{StageChild, tiny};

/// Stage 0's hello over layers `0..layer_end` of the tiny llama at `model`, as a chain link.
fn stage_zero_hello(model: &std::path::Path, layer_end: u32) -> stage_server::wire::Hello {
    use stage_server::wire::{CodecSet, Hello, PROTOCOL_VERSION, Role};
    Hello {
        version: PROTOCOL_VERSION,
        role: Role::StageLink,
        fingerprint: stage_server::model::fingerprint(model).unwrap(),
        stage_index: 0,
        layer_start: 0,
        layer_end,
        block_count: 4,
        width: 64,
        vocab_size: TinyModel::vocabulary().len() as u32,
        lanes: 1,
        context_length: 4096,
        codecs: CodecSet::all(),
        nonce: [0; 16],
        proof: None,
        return_address: None,
    }
}

/// A link to the stage at `address` that waits at most 20 s for each read.
fn connect(address: std::net::SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream
}

/// The last (and only) prefill chunk of `session` at position 0, one row of 64 values, encoded.
fn one_row_prompt(session: u64) -> Vec<u8> {
    use stage_server::wire::{Activations, encode_to_vec};
    let row: Vec<f32> = (0..64).map(|index| (index as f32 * 0.03).sin()).collect();
    encode_to_vec(&Frame::Prefill {
        session,
        position: 0,
        last: true,
        batch: Batch::alone(1, 1),
        rows: Activations::encode(&row, 64, CodecPolicy::F32),
    })
}

/// Chunk `position` of a prompt of `chunks` one-row chunks of `session` (the last one final), encoded.
fn prompt_row(session: u64, position: u32, chunks: u32) -> Vec<u8> {
    use stage_server::wire::{Activations, encode_to_vec};
    let row: Vec<f32> = (0..64)
        .map(|index| ((index + position) as f32 * 0.01).sin())
        .collect();
    encode_to_vec(&Frame::Prefill {
        session,
        position,
        last: position + 1 == chunks,
        batch: Batch::alone(position, 1),
        rows: Activations::encode(&row, 64, CodecPolicy::F32),
    })
}

/// A `Configure` opening `session` with default sampling, encoded.
fn configure(session: u64) -> Vec<u8> {
    use stage_server::wire::{Sampling, encode_to_vec};
    encode_to_vec(&Frame::Configure {
        session,
        sampling: Sampling::from(&SamplingParams::default()),
        stop_tokens: Vec::new(),
        logit_bias: Vec::new(),
        history: Vec::new(),
        top_logprobs: 0,
        logprob: false,
        resume: false,
        trace: None,
    })
}

/// Reads frames from `stream` until one passes `last` (the stage closing the link first fails the test).
fn read_until(stream: &mut TcpStream, last: impl Fn(&Frame) -> bool) -> Vec<Frame> {
    let mut decoder = Decoder::new(WireLimits::default());
    let mut frames: Vec<Frame> = Vec::new();
    let mut buffer = vec![0u8; 64 * 1024];
    while !frames.iter().any(&last) {
        let read = stream.read(&mut buffer).expect("the stage should answer");
        assert!(
            read > 0,
            "the stage closed the link after {} frames: {frames:?}",
            frames.len()
        );
        let mut offset = 0;
        while offset < read {
            let (taken, frame) = decoder.decode(&buffer[offset..read]).unwrap();
            offset += taken;
            frames.extend(frame);
        }
    }
    frames
}

/// Writes `bytes` to `stream` and reads frames until `count` have come (or the stage closes the link).
fn exchange(stream: &mut TcpStream, bytes: &[u8], count: usize) -> Vec<Frame> {
    stream.write_all(bytes).unwrap();
    let mut decoder = Decoder::new(WireLimits::default());
    let mut frames = Vec::new();
    let mut buffer = vec![0u8; 64 * 1024];
    while frames.len() < count {
        let read = stream.read(&mut buffer).expect("the stage should answer");
        if read == 0 {
            break;
        }
        let mut offset = 0;
        while offset < read {
            let (taken, frame) = decoder.decode(&buffer[offset..read]).unwrap();
            offset += taken;
            frames.extend(frame);
        }
    }
    frames
}

#[test]
fn a_prediction_return_is_taken_only_by_the_last_stage_and_carries_only_its_own_frames() {
    use stage_server::wire::{Hello, Role};
    let llama = tiny("return-refusals-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let last = StageChild::start(&llama, "3..4", None, &[]);
    let middle = StageChild::start(&llama, "1..3", Some(last.address), &[]);
    let opener = Hello {
        role: Role::PredictionReturn,
        ..stage_zero_hello(&llama, 1)
    };
    let hello = stage_server::wire::encode_to_vec(&Frame::Hello(opener.clone()));
    // A middle stage refuses, naming where returns go.
    let mut stream = connect(middle.address);
    let frames = exchange(&mut stream, &hello, 1);
    match frames.first() {
        Some(Frame::Error { code, message, .. }) => {
            assert_eq!(*code, ErrorCode::Protocol, "{message}");
            assert!(
                message.contains("serves layers 1..3") && message.contains("last stage"),
                "the refusal should say this stage is not the last: {message}"
            );
        }
        other => panic!("a middle stage should refuse a prediction return, not answer {other:?}"),
    }
    // The last stage takes it, acknowledges an OpenReturn, and answers a frame that belongs down the
    // chain with an error, keeping the link.
    let mut stream = connect(last.address);
    let mut bytes = hello.clone();
    bytes.extend(stage_server::wire::encode_to_vec(&Frame::OpenReturn {
        session: 9,
    }));
    bytes.extend(stage_server::wire::encode_to_vec(&Frame::Trim {
        session: 9,
        length: 0,
    }));
    bytes.extend(stage_server::wire::encode_to_vec(&Frame::OpenReturn {
        session: 10,
    }));
    let frames = exchange(&mut stream, &bytes, 4);
    assert!(
        matches!(&frames[0], Frame::Hello(theirs) if theirs.role == Role::PredictionReturn && theirs.layer_end == 4),
        "the last stage should answer as a prediction return: {frames:?}"
    );
    assert!(
        matches!(
            frames[1],
            Frame::Ack {
                session: 9,
                position: 0,
                ..
            }
        ),
        "the OpenReturn should be acknowledged: {frames:?}"
    );
    assert!(
        matches!(&frames[2], Frame::Error { session: 9, code: ErrorCode::Protocol, message } if message.contains("prediction-return link")),
        "a Trim does not belong on a return link: {frames:?}"
    );
    assert!(
        matches!(frames[3], Frame::Ack { session: 10, .. }),
        "the link goes on after the error: {frames:?}"
    );
    // Another model's stage 0 is refused.
    let mut stream = connect(last.address);
    let other = Hello {
        fingerprint: [0x5a; 32],
        ..opener
    };
    let frames = exchange(
        &mut stream,
        &stage_server::wire::encode_to_vec(&Frame::Hello(other)),
        1,
    );
    assert!(
        matches!(&frames[..], [Frame::Error { code: ErrorCode::Model, message, .. }] if message.contains("serves model")),
        "another model's return link should be refused in words: {frames:?}"
    );
}

#[test]
fn frames_sent_ahead_of_the_answers_are_all_answered_in_order() {
    use stage_server::wire::encode;
    let llama = tiny("ahead-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let stage = StageChild::start(&llama, "2..4", None, &[]);
    let mut stream = connect(stage.address);
    let mut bytes = Vec::new();
    encode(&Frame::Hello(stage_zero_hello(&llama, 2)), &mut bytes);
    let session = 7;
    bytes.extend(configure(session));
    // Two hundred one-row chunks in one write: more than the stage computes at once, and more than the 64
    // frames a link holds read ahead, past which it stops reading its socket (back-pressure) rather than refuse
    // a stream it cannot tell from one that keeps to its credits.
    let chunks = 200u32;
    for position in 0..chunks {
        bytes.extend(prompt_row(session, position, chunks));
    }
    stream.write_all(&bytes).unwrap();
    let frames = read_until(&mut stream, |frame| matches!(frame, Frame::Token { .. }));
    assert!(
        matches!(frames[0], Frame::Hello(_)),
        "first the hello: {:?}",
        frames[0]
    );
    let acks: Vec<u32> = frames
        .iter()
        .filter_map(|frame| match frame {
            Frame::Ack { position, .. } => Some(*position),
            _ => None,
        })
        .collect();
    assert_eq!(
        acks,
        (1..chunks).collect::<Vec<_>>(),
        "one acknowledgement per non-final chunk, in order"
    );
    let Some(Frame::Token { position, .. }) = frames.last() else {
        panic!("the last answer should be the token: {frames:?}");
    };
    assert_eq!(
        *position, chunks,
        "the token goes to the position after the prompt"
    );
}

#[test]
fn a_link_holds_no_more_sessions_than_the_stage_has_lanes_and_keeps_only_what_it_opened() {
    use stage_server::wire::{Activations, encode, encode_to_vec};
    let llama = tiny("session-bounds-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let stage = StageChild::start(&llama, "2..4", None, &["--lanes", "2"]);
    let hello = stage_zero_hello(&llama, 2);
    // Link A opens two sessions, the stage's two lanes; a third id on it is refused by the link, and a Keep of
    // an id it never opened is refused too. The link goes on.
    let mut first = connect(stage.address);
    let mut bytes = encode_to_vec(&Frame::Hello(hello.clone()));
    for session in [1, 2, 3] {
        bytes.extend(configure(session));
    }
    bytes.extend(encode_to_vec(&Frame::Keep { session: 77 }));
    let frames = exchange(&mut first, &bytes, 3);
    assert!(matches!(frames[0], Frame::Hello(_)), "{frames:?}");
    assert!(
        matches!(&frames[1], Frame::Error { session: 3, code: ErrorCode::NoFreeLane, message }
            if message.contains("already holds 2 sessions") && message.contains("(2)")),
        "a third session on a link of a 2-lane stage should be refused in words: {frames:?}"
    );
    assert!(
        matches!(&frames[2], Frame::Error { session: 77, code: ErrorCode::UnknownSession, message }
            if message.contains("not open on this link")),
        "a Keep of a session the link never opened should be refused: {frames:?}"
    );
    // Link B finds no free lane at the stage: the refused open leaves nothing on the link, so keeping it is
    // refused as unknown (it counted as open, holding the link busy, before).
    let mut second = connect(stage.address);
    let mut bytes = encode_to_vec(&Frame::Hello(hello));
    bytes.extend(configure(5));
    let frames = exchange(&mut second, &bytes, 2);
    assert!(
        matches!(
            frames[1],
            Frame::Error {
                session: 5,
                code: ErrorCode::NoFreeLane,
                ..
            }
        ),
        "{frames:?}"
    );
    let frames = exchange(&mut second, &encode_to_vec(&Frame::Keep { session: 5 }), 1);
    assert!(
        matches!(
            frames[..],
            [Frame::Error {
                session: 5,
                code: ErrorCode::UnknownSession,
                ..
            }]
        ),
        "a session whose open was refused should not stay open on the link: {frames:?}"
    );
    // On link A, stopping a session makes room for the third, which computes.
    let mut bytes = encode_to_vec(&Frame::Stop { session: 1 });
    bytes.extend(configure(3));
    let row: Vec<f32> = (0..64).map(|index| (index as f32 * 0.05).cos()).collect();
    encode(
        &Frame::Prefill {
            session: 3,
            position: 0,
            last: true,
            batch: Batch::alone(1, 1),
            rows: Activations::encode(&row, 64, CodecPolicy::F32),
        },
        &mut bytes,
    );
    let frames = exchange(&mut first, &bytes, 1);
    assert!(
        matches!(
            frames[..],
            [Frame::Token {
                session: 3,
                position: 1,
                ..
            }]
        ),
        "the session opened after a stop should compute: {frames:?}"
    );
}

#[test]
fn rows_of_the_wrong_width_and_frames_for_an_unknown_session_are_answered_in_words_and_the_link_goes_on()
 {
    use stage_server::wire::{Activations, encode, encode_to_vec};
    let llama = tiny("wrong-rows-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let stage = StageChild::start(&llama, "2..4", None, &[]);
    let mut stream = connect(stage.address);
    let row = |width: usize| -> Vec<f32> { (0..width).map(|index| index as f32 * 0.01).collect() };
    let mut bytes = encode_to_vec(&Frame::Hello(stage_zero_hello(&llama, 2)));
    // A decode step for a session nobody opened.
    encode(
        &Frame::Decode {
            session: 42,
            position: 0,
            batch: Batch::alone(1, 1),
            rows: Activations::encode(&row(64), 64, CodecPolicy::F32),
        },
        &mut bytes,
    );
    // An open session sent rows half the model's width, then its rows as they should be.
    bytes.extend(configure(7));
    for width in [32, 64] {
        encode(
            &Frame::Prefill {
                session: 7,
                position: 0,
                last: true,
                batch: Batch::alone(2, 1),
                rows: Activations::encode(&row(width), width as u32, CodecPolicy::F32),
            },
            &mut bytes,
        );
    }
    let frames = exchange(&mut stream, &bytes, 4);
    assert!(matches!(frames[0], Frame::Hello(_)), "{frames:?}");
    // The width is checked as the frame is read, the session where it computes: their answers may cross.
    let unknown = |frame: &Frame| {
        matches!(frame, Frame::Error { session: 42, code: ErrorCode::UnknownSession, message }
            if message.contains("session 42"))
    };
    let too_narrow = |frame: &Frame| {
        matches!(frame, Frame::Error { session: 7, code: ErrorCode::Protocol, message }
            if message.contains("32 wide") && message.contains("width is 64"))
    };
    assert!(
        frames[1..3].iter().any(unknown),
        "a step for an unknown session should be refused naming it: {frames:?}"
    );
    assert!(
        frames[1..3].iter().any(too_narrow),
        "rows of the wrong width should be refused naming both widths: {frames:?}"
    );
    assert!(
        matches!(
            frames[3],
            Frame::Token {
                session: 7,
                position: 1,
                ..
            }
        ),
        "the session's good rows should compute after both errors: {frames:?}"
    );
}

#[test]
fn a_refused_open_does_not_forget_a_later_open_of_the_same_session_so_its_lane_is_freed_with_the_link()
 {
    use stage_server::wire::encode_to_vec;
    let llama = tiny("reopen-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let stage = StageChild::start(&llama, "2..4", None, &["--lanes", "2"]);
    let hello = encode_to_vec(&Frame::Hello(stage_zero_hello(&llama, 2)));
    // Link A holds one lane, link B the other.
    let mut first = connect(stage.address);
    let frames = exchange(
        &mut first,
        &[hello.clone(), configure(1), one_row_prompt(1)].concat(),
        2,
    );
    assert!(
        matches!(frames[1], Frame::Token { session: 1, .. }),
        "{frames:?}"
    );
    let mut second = connect(stage.address);
    let frames = exchange(
        &mut second,
        &[hello.clone(), configure(10), one_row_prompt(10)].concat(),
        2,
    );
    assert!(
        matches!(frames[1], Frame::Token { session: 10, .. }),
        "{frames:?}"
    );
    // On B, in one write: open 20 (no lane free: refused), stop 10, open 20 again (now it gets 10's lane), and
    // compute on it. The refusal comes back after the second open was read; it must not make B forget 20.
    let bytes = [
        configure(20),
        encode_to_vec(&Frame::Stop { session: 10 }),
        configure(20),
        one_row_prompt(20),
    ]
    .concat();
    let frames = exchange(&mut second, &bytes, 2);
    assert!(
        matches!(
            frames[0],
            Frame::Error {
                session: 20,
                code: ErrorCode::NoFreeLane,
                ..
            }
        ),
        "{frames:?}"
    );
    assert!(
        matches!(frames[1], Frame::Token { session: 20, .. }),
        "{frames:?}"
    );
    // B closes: its sessions' lanes are freed, 20's included, so a new link finds one.
    drop(second);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut third = connect(stage.address);
        let frames = exchange(
            &mut third,
            &[hello.clone(), configure(30), one_row_prompt(30)].concat(),
            2,
        );
        match &frames[1] {
            Frame::Token { session: 30, .. } => break,
            Frame::Error {
                code: ErrorCode::NoFreeLane,
                ..
            } if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            other => panic!(
                "the lane of the session reopened on the closed link was not freed: {other:?}"
            ),
        }
    }
}

#[test]
fn an_open_that_finds_no_free_lane_takes_the_lane_of_a_session_kept_between_generations() {
    use stage_server::wire::encode_to_vec;
    let llama = tiny("take-kept-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let stage = StageChild::start(&llama, "2..4", None, &["--lanes", "1"]);
    let hello = encode_to_vec(&Frame::Hello(stage_zero_hello(&llama, 2)));
    // Link A's session 1 computes, then is kept for a later prompt to reuse; a Trim of a session A never opened
    // comes back from the compute thread after the keep, so the keep is in before link B asks.
    let mut first = connect(stage.address);
    let bytes = [
        hello.clone(),
        configure(1),
        one_row_prompt(1),
        encode_to_vec(&Frame::Keep { session: 1 }),
        encode_to_vec(&Frame::Trim {
            session: 99,
            length: 0,
        }),
    ]
    .concat();
    let frames = exchange(&mut first, &bytes, 3);
    assert!(
        matches!(frames[1], Frame::Token { session: 1, .. }),
        "{frames:?}"
    );
    assert!(
        matches!(
            frames[2],
            Frame::Error {
                session: 99,
                code: ErrorCode::UnknownSession,
                ..
            }
        ),
        "{frames:?}"
    );
    // Link B finds the stage's one lane held only by a kept session: it takes it rather than being refused.
    let mut second = connect(stage.address);
    let frames = exchange(
        &mut second,
        &[hello, configure(2), one_row_prompt(2)].concat(),
        2,
    );
    assert!(
        matches!(frames[1], Frame::Token { session: 2, .. }),
        "an open should take a kept session's lane: {frames:?}"
    );
    // Session 1 then cannot resume: its link hears it is unknown, as after a restart, and starts afresh.
    let resume = encode_to_vec(&Frame::Configure {
        session: 1,
        sampling: stage_server::wire::Sampling::from(&SamplingParams::default()),
        stop_tokens: Vec::new(),
        logit_bias: Vec::new(),
        history: Vec::new(),
        top_logprobs: 0,
        logprob: false,
        resume: true,
        trace: None,
    });
    let frames = exchange(&mut first, &resume, 1);
    assert!(
        matches!(
            &frames[..],
            [Frame::Error {
                session: 1,
                code: ErrorCode::UnknownSession,
                ..
            }]
        ),
        "{frames:?}"
    );
}

#[test]
fn a_ping_goes_down_the_chain_and_its_pong_comes_back_before_the_rows_sent_after_it_are_answered() {
    use stage_server::wire::encode;
    let llama = tiny("ping-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let last = StageChild::start(&llama, "2..4", None, &[]);
    let middle = StageChild::start(&llama, "1..2", Some(last.address), &[]);
    let mut stream = connect(middle.address);
    // A middle stage answers the hello once the next stage answered its own; frames wait for that answer.
    let hello = stage_server::wire::encode_to_vec(&Frame::Hello(stage_zero_hello(&llama, 1)));
    let answer = exchange(&mut stream, &hello, 1);
    assert!(matches!(&answer[..], [Frame::Hello(_)]), "{answer:?}");
    let session = 3;
    let mut bytes = configure(session);
    // A ping between two hundred one-row chunks: it is read (and passed on) before the second hundred, so its
    // pong, from the last stage, comes back before the token of the last chunk, however slowly they compute.
    let chunks = 200u32;
    for position in 0..chunks {
        if position == chunks / 2 {
            encode(&Frame::Ping { nonce: 0xfeed }, &mut bytes);
        }
        bytes.extend(prompt_row(session, position, chunks));
    }
    stream.write_all(&bytes).unwrap();
    let frames = read_until(&mut stream, |frame| {
        matches!(frame, Frame::Token { .. } | Frame::Error { .. })
    });
    let pong = frames
        .iter()
        .position(|frame| matches!(frame, Frame::Pong { nonce: 0xfeed }));
    let token = frames
        .iter()
        .position(|frame| matches!(frame, Frame::Token { .. }));
    assert!(
        matches!((pong, token), (Some(pong), Some(token)) if pong < token),
        "the pong should come back before the token: {frames:?}"
    );
    // A pong is the last stage's answer, not something a stage is sent: refused in words, the link goes on.
    let frames = exchange(
        &mut stream,
        &stage_server::wire::encode_to_vec(&Frame::Pong { nonce: 1 }),
        1,
    );
    assert!(
        matches!(&frames[..], [Frame::Error { code: ErrorCode::Protocol, message, .. }] if message.contains("pong")),
        "{frames:?}"
    );
    let frames = exchange(
        &mut stream,
        &stage_server::wire::encode_to_vec(&Frame::Ping { nonce: 2 }),
        1,
    );
    assert!(
        matches!(&frames[..], [Frame::Pong { nonce: 2 }]),
        "{frames:?}"
    );
}

#[test]
fn a_session_whose_rows_are_not_finite_fails_alone_and_the_other_session_of_its_step_computes_as_alone()
 {
    use stage_server::wire::{Activations, Sampling, encode, encode_to_vec};
    let llama = tiny("nan-rows-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let stage = StageChild::start(&llama, "2..4", None, &[]);
    let row: Vec<f32> = (0..64).map(|index| (index as f32 * 0.05).sin()).collect();
    let mut poisoned = row.clone();
    poisoned[9] = f32::NAN;
    // With the token's log-probability, so that "as alone" compares the logits' bits, not only the argmax.
    let open = |session: u64| {
        encode_to_vec(&Frame::Configure {
            session,
            sampling: Sampling::from(&SamplingParams::default()),
            stop_tokens: Vec::new(),
            logit_bias: Vec::new(),
            history: Vec::new(),
            top_logprobs: 0,
            logprob: true,
            resume: false,
            trace: None,
        })
    };
    let prompt = |session: u64, rows: &[f32], batch: Batch, bytes: &mut Vec<u8>| {
        encode(
            &Frame::Prefill {
                session,
                position: 0,
                last: true,
                batch,
                rows: Activations::encode(rows, 64, CodecPolicy::F32),
            },
            bytes,
        );
    };
    // Alone first, on a link of its own.
    let mut alone = connect(stage.address);
    let mut bytes = encode_to_vec(&Frame::Hello(stage_zero_hello(&llama, 2)));
    bytes.extend(open(1));
    prompt(1, &row, Batch::alone(1, 1), &mut bytes);
    let frames = exchange(&mut alone, &bytes, 2);
    let Frame::Token {
        token: alone_token,
        logprob: alone_logprob,
        ..
    } = frames[1]
    else {
        panic!("the session alone should compute: {frames:?}");
    };
    // Then in one step with a session whose row holds a NaN (a peer's activations are input like any other).
    let mut stream = connect(stage.address);
    let mut bytes = encode_to_vec(&Frame::Hello(stage_zero_hello(&llama, 2)));
    bytes.extend(open(7));
    bytes.extend(open(8));
    let step = Batch {
        id: 5,
        frames: 2,
        rows: 2,
    };
    prompt(7, &poisoned, step, &mut bytes);
    prompt(8, &row, step, &mut bytes);
    let frames = exchange(&mut stream, &bytes, 3);
    let failed = frames[1..].iter().any(|frame| {
        matches!(frame, Frame::Error { session: 7, message, .. } if message.contains("NaN"))
    });
    assert!(
        failed,
        "the poisoned session should fail in words: {frames:?}"
    );
    let computed = frames[1..].iter().find_map(|frame| match frame {
        Frame::Token {
            session: 8,
            token,
            logprob,
            ..
        } => Some((*token, logprob.to_bits())),
        _ => None,
    });
    assert_eq!(
        computed,
        Some((alone_token, alone_logprob.to_bits())),
        "the other session of the step should compute as it does alone: {frames:?}"
    );
    // The link and the good session go on.
    let mut bytes = Vec::new();
    encode(
        &Frame::Decode {
            session: 8,
            position: 1,
            batch: Batch::alone(6, 1),
            rows: Activations::encode(&row, 64, CodecPolicy::F32),
        },
        &mut bytes,
    );
    let frames = exchange(&mut stream, &bytes, 1);
    assert!(
        matches!(
            frames[..],
            [Frame::Token {
                session: 8,
                position: 2,
                ..
            }]
        ),
        "{frames:?}"
    );
}

#[test]
fn a_connection_that_never_says_its_hello_is_closed_within_the_opening_deadline() {
    let llama = tiny("port-silent", &TinyModel::llama(GgmlDType::Q4_1));
    let last = StageChild::start(&llama, "1..4", None, &[]);
    let mut silent = connect(last.address);
    let started = std::time::Instant::now();
    // The stage closes it (10 s, plus the 1 s it gives its own connect to a next stage); a read ends then, with
    // the end of the stream or a reset.
    let mut buffer = [0u8; 64];
    let outcome = silent.read(&mut buffer);
    let took = started.elapsed();
    assert!(
        matches!(outcome, Ok(0) | Err(_)) && took < Duration::from_secs(16),
        "a silent connection was still open after {took:?} ({outcome:?})"
    );
    assert!(
        took >= Duration::from_secs(9),
        "the stage closed a silent connection after only {took:?}; it has 10 s to say its hello"
    );
    // The stage goes on serving.
    let mut link = connect(last.address);
    let hello = stage_zero_hello(&llama, 1);
    let answer = exchange(
        &mut link,
        &stage_server::wire::encode_to_vec(&Frame::Hello(hello)),
        1,
    );
    assert!(
        matches!(answer[0], Frame::Hello(_)),
        "the stage should answer a hello after closing a silent link: {answer:?}"
    );
}

#[test]
fn a_link_to_the_next_stage_opened_for_an_upstream_that_has_gone_is_closed_not_kept() {
    use std::net::TcpListener;
    let llama = tiny("port-gone-upstream", &TinyModel::llama(GgmlDType::Q4_1));
    // The "next stage" is this test: it sees what the middle stage does with the link it opens.
    let next = TcpListener::bind("127.0.0.1:0").unwrap();
    let middle = StageChild::start(&llama, "1..3", Some(next.local_addr().unwrap()), &[]);
    // Stopped, the stage cannot read the hello before its sender has gone: as when stage 0 gives up on a stage
    // that is stopped and the stage continues later.
    middle.signal("STOP");
    {
        let mut upstream = TcpStream::connect(middle.address).unwrap();
        upstream
            .write_all(&stage_server::wire::encode_to_vec(&Frame::Hello(
                stage_zero_hello(&llama, 1),
            )))
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    middle.signal("CONT");
    next.set_nonblocking(false).unwrap();
    let (mut opened, _) = next
        .accept()
        .expect("the middle stage connects to its next stage");
    opened
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    // Whatever it said first (its hello, if it got that far), the link must end: nothing upstream is left to
    // use it, and a link kept open holds a slot of the next stage's caps for good.
    let mut buffer = [0u8; 4096];
    loop {
        match opened.read(&mut buffer) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(error) => panic!(
                "the link to the next stage stayed open after its upstream had gone ({error})"
            ),
        }
    }
}
