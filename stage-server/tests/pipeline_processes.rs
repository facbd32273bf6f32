//! A model split across stage processes on 127.0.0.1: the same tokens as the unsplit model, refusals in words on
//! both sides, a dead stage reported at once (also by the API, which reconnects when it is back), a drain on
//! SIGTERM, garbage on a stage port kept to its link, and the chain's shortest lane bounding a prompt before it
//! is sent. (Frame-by-frame exchanges with one stage port are in `stage_port.rs`.)

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use stage_server::driver::{Chain, ChainOptions, DriverError};
use stage_server::model::testing::{TinyModel, real_model};
use stage_server::model::{GEMMA3_FILE, GenerateOptions, ModelFile, SMOLLM2_FILE, SamplingParams};
use stage_server::wire::{CodecPolicy, Decoder, ErrorCode, Frame, WireLimits};

mod support;
use support::{BINARY, START_TIMEOUT, StageChild, http, scratch_dir, tiny};

/// `stage-server generate --json` with `args`; the parsed object.
fn generate(model: &Path, args: &[&str]) -> serde_json::Value {
    let output = Command::new(BINARY)
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--json", "--threads", "1"])
        .args(args)
        .output()
        .expect("running stage-server generate");
    assert!(
        output.status.success(),
        "stage-server generate {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("--json prints one object")
}

/// The error text of a `generate` that must fail.
fn generate_error(model: &Path, args: &[&str]) -> String {
    let output = Command::new(BINARY)
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--threads", "1"])
        .args(args)
        .output()
        .expect("running stage-server generate");
    assert!(
        !output.status.success(),
        "stage-server generate {args:?} should have failed"
    );
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Stages for `boundaries` of a `block_count`-layer model, last first; returns them with stage 1's address.
fn chain_of(
    model: &Path,
    block_count: usize,
    boundaries: &[usize],
    extra: &[&str],
) -> (Vec<StageChild>, SocketAddr) {
    let mut edges = boundaries.to_vec();
    edges.push(block_count);
    let mut stages = Vec::new();
    let mut next = None;
    for window in edges.windows(2).rev() {
        let layers = format!("{}..{}", window[0], window[1]);
        let stage = StageChild::start(model, &layers, next, extra);
        next = Some(stage.address);
        stages.push(stage);
    }
    (stages, next.expect("at least one stage"))
}

/// Runs the prompt `300, 301, ..., 319, 300, ...` of `length` tokens on `chain` for at most `max_tokens`, asking `cancelled`
/// before each prompt chunk; a token is a failure (`panic`) when `tokens_fail` says so.
fn prompt_asking(
    chain: &mut Chain,
    length: u32,
    max_tokens: usize,
    cancelled: &dyn Fn() -> bool,
    tokens_fail: Option<&str>,
) -> Result<stage_server::model::Generation, DriverError> {
    // Ids 300 to 319, repeated: inside the tiny models' 320-token vocabulary however long the prompt, so stage 0
    // never refuses a chunk of its own before the fault a test makes is noticed (ids counting up past 319 once
    // did, on a loaded CI host where stage 1 took longer than the test's pause to close its link).
    let prompt: Vec<u32> = (0..length).map(|index| 300 + index % 20).collect();
    let generate = GenerateOptions {
        max_tokens,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    chain.generate_cancellable(
        &prompt,
        SamplingParams::default(),
        &stage_server::driver::SamplerExtras::default(),
        &generate,
        cancelled,
        |_| match tokens_fail {
            Some(why) => panic!("{why}"),
            None => std::ops::ControlFlow::Continue(()),
        },
    )
}

/// `error` is the chain's word that stage 2 is down.
fn assert_names_stage_2_down(error: &DriverError) {
    match error {
        DriverError::Stage { code, message } => {
            assert_eq!(*code, ErrorCode::StageDown, "{message}");
            assert!(
                message.contains("stage 2"),
                "the error should name stage 2: {message}"
            );
        }
        other => panic!("expected a stage-down error naming stage 2, got {other}"),
    }
}

fn tokens_of(value: &serde_json::Value) -> Vec<u64> {
    value["tokens"]
        .as_array()
        .expect("a tokens array")
        .iter()
        .map(|token| token.as_u64().expect("a token id"))
        .collect()
}

fn assert_chain_matches_unsplit(
    model: &Path,
    block_count: usize,
    boundaries: &[usize],
    codec: &str,
) {
    let prompt = [
        "--prompt-ids",
        "1,300,301,302,303,304",
        "--max-tokens",
        "12",
    ];
    let unsplit = generate(model, &prompt);
    let (_stages, first) = chain_of(model, block_count, &boundaries[1..], &["--codec", codec]);
    let layers = format!("0..{}", boundaries[1]);
    let first = first.to_string();
    let mut args = prompt.to_vec();
    args.extend(["--layers", &layers, "--next", &first, "--codec", codec]);
    let chained = generate(model, &args);
    assert_eq!(
        tokens_of(&chained),
        tokens_of(&unsplit),
        "{} split at {boundaries:?} over processes ({codec}) should give the unsplit tokens",
        model.display()
    );
    assert!(
        !tokens_of(&unsplit).is_empty(),
        "the test should generate tokens"
    );
}

#[test]
fn two_and_three_processes_give_the_unsplit_tokens_of_the_tiny_models() {
    let llama = tiny("agreement-llama", &TinyModel::llama(GgmlDType::Q4_1));
    assert_chain_matches_unsplit(&llama, 4, &[0, 2], "f32");
    assert_chain_matches_unsplit(&llama, 4, &[0, 1, 3], "f32");
    assert_chain_matches_unsplit(&llama, 4, &[0, 1, 3], "auto-lossless");
    let gemma = tiny("agreement-gemma", &TinyModel::gemma3(GgmlDType::Q8_0));
    assert_chain_matches_unsplit(&gemma, 6, &[0, 2, 4], "f32");
    assert_chain_matches_unsplit(&gemma, 6, &[0, 3], "auto-lossless");
}

#[test]
fn both_real_models_give_the_unsplit_tokens_over_three_processes() {
    for (file, block_count) in [(SMOLLM2_FILE, 30), (GEMMA3_FILE, 18)] {
        let Some(model) = real_model(file) else {
            continue;
        };
        let third = block_count / 3;
        let prompt = ["--prompt", "The capital of France is", "--max-tokens", "16"];
        let unsplit = generate(&model, &prompt);
        let (_stages, first) = chain_of(&model, block_count, &[third, 2 * third], &[]);
        let layers = format!("0..{third}");
        let first = first.to_string();
        let mut args = prompt.to_vec();
        args.extend(["--layers", &layers, "--next", &first]);
        let chained = generate(&model, &args);
        assert_eq!(
            tokens_of(&chained),
            tokens_of(&unsplit),
            "{file} over three processes should give the unsplit tokens"
        );
        assert_eq!(chained["text"], unsplit["text"]);
    }
}

#[test]
fn a_gap_an_overlap_and_another_model_are_refused_naming_both_sides() {
    let llama = tiny("refusals-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let other = tiny("refusals-other", &TinyModel::llama(GgmlDType::Q8_0));
    let stage = StageChild::start(&llama, "2..4", None, &[]);
    let address = stage.address.to_string();
    let prompt = ["--prompt-ids", "1,300", "--max-tokens", "2"];
    let mut gap = prompt.to_vec();
    gap.extend(["--layers", "0..1", "--next", &address]);
    let text = generate_error(&llama, &gap);
    assert!(
        text.contains("stage 1 serves layers 2..4 but stage 0 ends at layer 1"),
        "a gap should be refused naming both ranges: {text}"
    );
    // The stage says so too, in its own log.
    let wait = Duration::from_secs(10);
    assert!(
        stage
            .logged(&["refused a link", "but stage 0 ends at layer 1"], wait)
            .is_some(),
        "the stage should log the gap it refused"
    );
    let mut overlap = prompt.to_vec();
    overlap.extend(["--layers", "0..3", "--next", &address]);
    let text = generate_error(&llama, &overlap);
    assert!(
        text.contains("stage 1 serves layers 2..4 but stage 0 ends at layer 3"),
        "an overlap should be refused naming both ranges: {text}"
    );
    assert!(
        stage
            .logged(&["refused a link", "but stage 0 ends at layer 3"], wait)
            .is_some(),
        "the stage should log the overlap it refused"
    );
    let mut model = prompt.to_vec();
    model.extend(["--layers", "0..2", "--next", &address]);
    let text = generate_error(&other, &model);
    assert!(
        text.contains("model"),
        "another model should be refused naming the model: {text}"
    );
    assert!(
        stage
            .logged(&["refused a link", "serves model"], wait)
            .is_some(),
        "the stage should log the other model it refused"
    );
    // The stage itself serves on after refusing three links.
    let mut good = prompt.to_vec();
    good.extend(["--layers", "0..2", "--next", &address]);
    let served = generate(&llama, &good);
    assert_eq!(tokens_of(&served).len(), 2);
}

#[test]
fn a_wrong_cluster_key_and_an_address_outside_allow_from_are_refused_in_words() {
    let llama = tiny("keys-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let dir = scratch_dir("keys");
    let key = dir.join("cluster.key");
    let wrong = dir.join("wrong.key");
    std::fs::write(&key, b"a cluster key of at least sixteen bytes").unwrap();
    std::fs::write(&wrong, b"another key, also long enough to use").unwrap();
    let key_text = key.to_str().unwrap();
    let stage = StageChild::start(&llama, "2..4", None, &["--cluster-key", key_text]);
    let address = stage.address.to_string();
    let base = [
        "--prompt-ids",
        "1,300",
        "--max-tokens",
        "2",
        "--layers",
        "0..2",
        "--next",
        &address,
    ];
    let mut with_wrong = base.to_vec();
    with_wrong.extend(["--cluster-key", wrong.to_str().unwrap()]);
    let text = generate_error(&llama, &with_wrong);
    assert!(
        text.contains("cluster key"),
        "a wrong key should be refused naming the key: {text}"
    );
    let text = generate_error(&llama, &base);
    assert!(
        text.contains("--cluster-key"),
        "a missing key should be refused naming the flag: {text}"
    );
    let mut with_key = base.to_vec();
    with_key.extend(["--cluster-key", key_text]);
    assert_eq!(
        tokens_of(&generate(&llama, &with_key)).len(),
        2,
        "the right key is served"
    );

    let fenced = StageChild::start(&llama, "2..4", None, &["--allow-from", "10.0.0.0/8"]);
    let fenced_address = fenced.address.to_string();
    let args = [
        "--prompt-ids",
        "1,300",
        "--max-tokens",
        "2",
        "--layers",
        "0..2",
        "--next",
        &fenced_address,
    ];
    let text = generate_error(&llama, &args);
    assert!(
        text.contains("--allow-from"),
        "an address outside --allow-from should be refused naming the flag: {text}"
    );
    // The stage says so too, on its side.
    let logged = std::iter::from_fn(|| fenced.stderr.recv_timeout(Duration::from_secs(5)).ok())
        .any(|line| line.contains("refused a link") && line.contains("--allow-from"));
    assert!(logged, "the stage should log the refusal with its cause");
}

#[test]
fn killing_the_middle_stage_fails_the_generation_within_a_second_and_a_restart_serves_again() {
    let llama = tiny("faults-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let last = StageChild::start(&llama, "3..4", None, &[]);
    let mut middle = StageChild::start(&llama, "1..3", Some(last.address), &[]);
    let middle_address = middle.address;
    let mut chain = Chain::connect(&file, 1, middle_address, ChainOptions::default()).unwrap();
    let options = GenerateOptions {
        max_tokens: 200,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let mut killed_at = None;
    let result = chain.generate(&[1, 300, 301], SamplingParams::default(), &options, |_| {
        if killed_at.is_none() {
            middle.kill();
            killed_at = Some(Instant::now());
        }
    });
    let failed_after = killed_at.expect("a token came before the kill").elapsed();
    let error = result.expect_err("a generation whose middle stage died must fail");
    assert!(
        failed_after < Duration::from_secs(1),
        "the error took {failed_after:?} after the kill"
    );
    assert!(
        error.to_string().contains("stage 1"),
        "the error should name the stage: {error}"
    );
    // A new generation fails fast while the stage is down.
    let started = Instant::now();
    let down = Chain::connect(&file, 1, middle_address, ChainOptions::default());
    assert!(down.is_err(), "connecting to a dead stage should fail");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "it should fail fast"
    );
    // Back on the same address, the chain serves again without restarting anything else.
    let _restarted = StageChild::start_on(
        &llama,
        "1..3",
        &middle_address.to_string(),
        Some(last.address),
        &[],
    );
    let mut chain = Chain::connect(&file, 1, middle_address, ChainOptions::default()).unwrap();
    let options = GenerateOptions {
        max_tokens: 4,
        ..options
    };
    let generation = chain
        .generate(&[1, 300, 301], SamplingParams::default(), &options, |_| {})
        .expect("the restarted chain should serve");
    assert_eq!(generation.tokens.len(), 4);
}

#[test]
fn killing_the_last_stage_fails_the_generation_within_a_second_naming_it() {
    let llama = tiny("faults-last-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let mut last = StageChild::start(&llama, "3..4", None, &[]);
    let middle = StageChild::start(&llama, "1..3", Some(last.address), &[]);
    let mut chain = Chain::connect(&file, 1, middle.address, ChainOptions::default()).unwrap();
    let options = GenerateOptions {
        max_tokens: 200,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let mut killed_at = None;
    let result = chain.generate(&[1, 300], SamplingParams::default(), &options, |_| {
        if killed_at.is_none() {
            last.kill();
            killed_at = Some(Instant::now());
        }
    });
    let failed_after = killed_at.expect("a token came before the kill").elapsed();
    let error = result.expect_err("a generation whose last stage died must fail");
    assert!(
        failed_after < Duration::from_secs(1),
        "the error took {failed_after:?}"
    );
    assert_names_stage_2_down(&error);
}

#[test]
fn losing_the_last_stage_during_a_prompt_names_it_though_stage_0_was_writing() {
    let llama = tiny("faults-last-prompt", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let last = std::cell::RefCell::new(StageChild::start(&llama, "3..4", None, &[]));
    let middle = StageChild::start(&llama, "1..3", Some(last.borrow().address), &[]);
    // Chunks go down unacknowledged, so stage 0 is writing, not reading, when stage 1 closes its link.
    let options = ChainOptions {
        prefill_chunk: 4,
        credits: 16,
        ..ChainOptions::default()
    };
    let mut chain = Chain::connect(&file, 1, middle.address, options).unwrap();
    // Before the prompt's third chunk the last stage dies, and stage 1 has time to say so and close.
    let asked = std::cell::Cell::new(0);
    let cancelled = || {
        asked.set(asked.get() + 1);
        if asked.get() == 3 {
            last.borrow_mut().kill();
            std::thread::sleep(Duration::from_millis(500));
        }
        false
    };
    let error = prompt_asking(&mut chain, 160, 4, &cancelled, None)
        .expect_err("a prompt whose last stage died must fail");
    assert_names_stage_2_down(&error);
    // Noticed while the prompt was still going down (at the latest when its 16 credits ran out), not only
    // after all 40 chunks were written.
    assert!(
        asked.get() < 40,
        "stage 0 wrote the whole prompt ({} chunks asked about) before it noticed the dead stage",
        asked.get()
    );
}

#[test]
fn tokens_come_straight_back_from_the_last_stage_and_relayed_ones_are_the_same() {
    let llama = tiny("direct-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let last = StageChild::start(&llama, "3..4", None, &[]);
    let middle = StageChild::start(&llama, "1..3", Some(last.address), &[]);
    let options = GenerateOptions {
        max_tokens: 12,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let prompt = [1, 300, 301, 302];
    let mut direct = Chain::connect(&file, 1, middle.address, ChainOptions::default()).unwrap();
    assert_eq!(
        direct.next_stage().return_address,
        Some(last.address),
        "stage 1's hello should pass on the last stage's address"
    );
    assert_eq!(
        direct.direct_return(),
        Some(last.address),
        "the chain should open its prediction return to the last stage"
    );
    let relayed_options = ChainOptions {
        direct_return: false,
        ..ChainOptions::default()
    };
    let mut relayed = Chain::connect(&file, 1, middle.address, relayed_options).unwrap();
    assert_eq!(
        relayed.direct_return(),
        None,
        "relaying opens no return link"
    );
    for round in 0..2 {
        let straight = direct
            .generate(&prompt, SamplingParams::default(), &options, |_| {})
            .unwrap();
        let up_the_chain = relayed
            .generate(&prompt, SamplingParams::default(), &options, |_| {})
            .unwrap();
        assert_eq!(
            straight.tokens, up_the_chain.tokens,
            "round {round}: the return path must not change a token"
        );
        assert_eq!(straight.tokens.len(), 12, "round {round}: every token came");
        assert_eq!(
            direct.direct_tokens(),
            12 * (round + 1),
            "round {round}: every token should have come straight from the last stage, the first too"
        );
        assert_eq!(
            relayed.direct_tokens(),
            0,
            "relayed tokens come up the chain"
        );
    }
    // The binary says where its tokens came from.
    let layers = "0..1";
    let next = middle.address.to_string();
    let printed = generate(
        &llama,
        &[
            "--prompt-ids",
            "1,300,301,302",
            "--max-tokens",
            "12",
            "--layers",
            layers,
            "--next",
            &next,
        ],
    );
    assert_eq!(
        printed["prediction_return"].as_str(),
        Some(last.address.to_string().as_str()),
        "generate --json should name the last stage: {printed}"
    );
    let returned = printed["tokens_returned_directly"]
        .as_u64()
        .expect("a count of tokens returned directly");
    let printed_count = tokens_of(&printed).len() as u64;
    // A stop token comes back too but ends the generation unprinted.
    assert!(
        printed_count > 0 && (returned == printed_count || returned == printed_count + 1),
        "every token should have come back directly ({returned} of {printed_count}): {printed}"
    );
    let printed = generate(
        &llama,
        &[
            "--prompt-ids",
            "1,300,301,302",
            "--max-tokens",
            "12",
            "--layers",
            layers,
            "--next",
            &next,
            "--prediction-return",
            "relayed",
        ],
    );
    assert!(
        printed["prediction_return"].is_null(),
        "a relayed generation names no return: {printed}"
    );
    assert_eq!(
        printed["tokens_returned_directly"].as_u64(),
        Some(0),
        "{printed}"
    );
}

#[test]
fn a_last_stage_that_advertises_an_unreachable_return_address_still_serves_through_the_relay() {
    let llama = tiny("advertise-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let nowhere = unused_address();
    let last = StageChild::start(&llama, "3..4", None, &["--advertise", &nowhere.to_string()]);
    let middle = StageChild::start(&llama, "1..3", Some(last.address), &[]);
    let mut chain = Chain::connect(&file, 1, middle.address, ChainOptions::default()).unwrap();
    assert_eq!(
        chain.next_stage().return_address,
        Some(nowhere),
        "the hellos should carry the advertised address"
    );
    assert_eq!(
        chain.direct_return(),
        None,
        "nothing listens there, so the chain should fall back to the relay"
    );
    let options = GenerateOptions {
        max_tokens: 6,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let generation = chain
        .generate(&[1, 300, 301], SamplingParams::default(), &options, |_| {})
        .expect("the relay should still serve");
    assert_eq!(generation.tokens.len(), 6);
    assert_eq!(chain.direct_tokens(), 0);
}

/// An address on 127.0.0.1 nothing listens on right now (a port the kernel just handed out and got back).
fn unused_address() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("binding a scratch port")
}

/// The message of a chain connect that a stage refused with `StageDown`, or a panic saying what came instead.
fn stage_down_message(result: Result<Chain, DriverError>) -> String {
    match result {
        Ok(_) => panic!("the chain should have been refused"),
        Err(DriverError::Stage { code, message }) => {
            assert_eq!(code, ErrorCode::StageDown, "{message}");
            message
        }
        Err(other) => panic!("expected the middle stage's StageDown, got {other}"),
    }
}

#[test]
fn a_stage_retries_its_next_stage_until_it_is_up_and_refuses_once_the_budget_is_spent() {
    let llama = tiny("retry-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    // The last stage's address is free: the middle stage's connects are refused until it starts. A budget far
    // above a stage's start-up keeps the test independent of how loaded the machine is.
    let last_address = unused_address();
    let middle = StageChild::start(
        &llama,
        "1..3",
        Some(last_address),
        &["--connect-retry-timeout", "30000"],
    );
    let model = llama.clone();
    let starter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        StageChild::start_on(&model, "3..4", &last_address.to_string(), None, &[])
    });
    let mut chain = Chain::connect(&file, 1, middle.address, ChainOptions::default())
        .expect("the middle stage should keep trying until the last stage listens");
    let _last = starter.join().expect("the last stage started");
    let options = GenerateOptions {
        max_tokens: 3,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let generation = chain
        .generate(&[1, 300], SamplingParams::default(), &options, |_| {})
        .expect("the chain found after retries should serve");
    assert_eq!(generation.tokens.len(), 3);

    // Nothing ever listens: refused with StageDown once 300 ms of attempts are spent (25, 50 and 100 ms apart).
    let dead = unused_address();
    let budgeted = StageChild::start(
        &llama,
        "1..3",
        Some(dead),
        &["--connect-retry-timeout", "300"],
    );
    let started = Instant::now();
    let message = stage_down_message(Chain::connect(
        &file,
        1,
        budgeted.address,
        ChainOptions::default(),
    ));
    let took = started.elapsed();
    assert!(
        message.contains(&dead.to_string()) || message.contains("stage 2"),
        "the refusal should name the unreachable stage: {message}"
    );
    assert!(
        message.contains("after 4 attempts"),
        "the refusal should say it tried four times: {message}"
    );
    assert!(
        took >= Duration::from_millis(175),
        "three waits of 25, 50 and 100 ms cannot be over in {took:?}"
    );
    assert!(took < Duration::from_secs(3), "the refusal took {took:?}");

    // No budget: one attempt, refused at once.
    let single = StageChild::start(
        &llama,
        "1..3",
        Some(dead),
        &["--connect-retry-timeout", "0"],
    );
    let message = stage_down_message(Chain::connect(
        &file,
        1,
        single.address,
        ChainOptions::default(),
    ));
    assert!(
        !message.contains("attempts"),
        "a single attempt should not count attempts: {message}"
    );

    // A next stage that answers and refuses (an overlap) is final: no retries, whatever the budget.
    let overlapping = StageChild::start(&llama, "2..4", None, &[]);
    let refusing = StageChild::start(
        &llama,
        "1..3",
        Some(overlapping.address),
        &["--connect-retry-timeout", "30000"],
    );
    let started = Instant::now();
    let result = Chain::connect(&file, 1, refusing.address, ChainOptions::default());
    let took = started.elapsed();
    let Err(DriverError::Stage { message, .. }) = result else {
        panic!("an overlap down the chain should be refused");
    };
    assert!(
        message.contains("2..4") && !message.contains("attempts"),
        "the overlap should be refused once, naming the ranges: {message}"
    );
    assert!(
        took < Duration::from_secs(5),
        "a refusal is not retried for the 30 s budget: it took {took:?}"
    );
}

#[test]
fn four_chains_at_once_on_four_lanes_each_give_their_solo_tokens() {
    let llama = tiny("lanes-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let last = StageChild::start(&llama, "3..4", None, &["--lanes", "4"]);
    let middle = StageChild::start(&llama, "1..3", Some(last.address), &["--lanes", "4"]);
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|index| vec![1, 300 + index, 310 + index])
        .collect();
    let options = GenerateOptions {
        max_tokens: 10,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .map(|prompt| {
            let mut chain =
                Chain::connect(&file, 1, middle.address, ChainOptions::default()).unwrap();
            chain
                .generate(prompt, SamplingParams::default(), &options, |_| {})
                .unwrap()
                .tokens
        })
        .collect();
    let together: Vec<Vec<u32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|prompt| {
                let file = &file;
                let options = &options;
                let address = middle.address;
                scope.spawn(move || {
                    let mut chain =
                        Chain::connect(file, 1, address, ChainOptions::default()).unwrap();
                    chain
                        .generate(prompt, SamplingParams::default(), options, |_| {})
                        .unwrap()
                        .tokens
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap())
            .collect()
    });
    assert_eq!(
        together, solo,
        "each concurrent generation should equal its solo run"
    );
}

#[test]
fn a_chain_reuses_the_prefix_its_last_generation_left_at_every_stage_and_answers_as_a_cold_run() {
    for (name, model, middle, last) in [
        (
            "reuse-llama",
            TinyModel::llama(GgmlDType::Q4_1),
            "1..3",
            "3..4",
        ),
        (
            "reuse-gemma3",
            TinyModel::gemma3(GgmlDType::Q8_0),
            "1..4",
            "4..6",
        ),
    ] {
        let path = tiny(name, &model);
        let file = ModelFile::open(&path).unwrap();
        let last = StageChild::start(&path, last, None, &[]);
        let middle = StageChild::start(&path, middle, Some(last.address), &[]);
        let options = ChainOptions {
            logprobs: true,
            top_logprobs: 3,
            ..ChainOptions::default()
        };
        let generate = GenerateOptions {
            max_tokens: 8,
            stop_tokens: Vec::new(),
            keep_logits: false,
        };
        // Tokens with their log-probabilities and alternatives, bit for bit, and the prefix reused.
        let run = |chain: &mut Chain, prompt: &[u32]| {
            let mut answers = Vec::new();
            let generation = chain
                .generate(prompt, SamplingParams::default(), &generate, |predicted| {
                    answers.push((
                        predicted.token,
                        predicted.logprob.to_bits(),
                        predicted
                            .top
                            .iter()
                            .map(|(token, logprob)| (*token, logprob.to_bits()))
                            .collect::<Vec<_>>(),
                    ))
                })
                .unwrap();
            (answers, generation.cached_tokens)
        };
        let cold = |prompt: &[u32]| {
            let mut chain = Chain::connect(&file, 1, middle.address, options.clone()).unwrap();
            run(&mut chain, prompt).0
        };
        let first: Vec<u32> = vec![1, 300, 301, 302, 303, 304];
        let mut chain = Chain::connect(&file, 1, middle.address, options.clone()).unwrap();
        let (answers, cached) = run(&mut chain, &first);
        assert_eq!(cached, 0, "{name}: nothing to reuse on a new chain");
        // Every stage's lane holds the prompt and the tokens fed back (all but the last one predicted).
        let fed: Vec<u32> = answers[..answers.len() - 1]
            .iter()
            .map(|(token, _, _)| *token)
            .collect();
        assert_eq!(
            chain.held(),
            [first.clone(), fed.clone()].concat(),
            "{name}"
        );
        // The conversation goes on: the last prompt, three of its answer's tokens, and a new turn.
        let second: Vec<u32> = [first.clone(), fed[..3].to_vec(), vec![310, 311]].concat();
        let (answers, cached) = run(&mut chain, &second);
        assert_eq!(
            cached,
            first.len() + 3,
            "{name}: the shared prefix was not reused"
        );
        assert_eq!(
            answers,
            cold(&second),
            "{name}: a reused prefix answered differently from a cold run"
        );
        // A prompt that shares only its first token, then one that shares nothing.
        for prompt in [vec![1, 200, 201, 202], vec![7, 8, 9]] {
            let (answers, cached) = run(&mut chain, &prompt);
            assert_eq!(cached, usize::from(prompt[0] == 1), "{name}: {prompt:?}");
            assert_eq!(answers, cold(&prompt), "{name}: {prompt:?}");
        }
    }
}

#[test]
fn a_draining_stage_does_not_wait_for_sessions_kept_between_generations() {
    let llama = tiny("keep-drain-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let stage = StageChild::start(&llama, "2..4", None, &[]);
    let mut chain = Chain::connect(&file, 2, stage.address, ChainOptions::default()).unwrap();
    let options = GenerateOptions {
        max_tokens: 4,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    chain
        .generate(&[1, 300, 301], SamplingParams::default(), &options, |_| {})
        .unwrap();
    assert!(!chain.held().is_empty(), "the session was not kept");
    // The kept session is idle: the drain closes its link at once instead of waiting 30 s for it to end.
    let started = Instant::now();
    let status = stage.signal_and_wait(libc::SIGTERM);
    assert!(
        status.success(),
        "a drained stage should exit 0, got {status}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the drain waited {:?} for a session kept between generations",
        started.elapsed()
    );
}

#[test]
fn sigterm_drains_a_stage_and_it_exits_zero() {
    let llama = tiny("sigterm-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let stage = StageChild::start(&llama, "2..4", None, &[]);
    let address = stage.address.to_string();
    let served = generate(
        &llama,
        &[
            "--prompt-ids",
            "1,300",
            "--max-tokens",
            "3",
            "--layers",
            "0..2",
            "--next",
            &address,
        ],
    );
    assert_eq!(tokens_of(&served).len(), 3);
    let status = stage.signal_and_wait(libc::SIGTERM);
    assert!(
        status.success(),
        "a drained stage should exit 0, got {status}"
    );
}

#[test]
fn garbage_on_a_stage_port_closes_that_link_with_its_reason_and_the_stage_serves_on() {
    let llama = tiny("garbage-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let stage = StageChild::start(&llama, "2..4", None, &[]);
    let inputs: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        vec![0xff; 64],
        // A frame claiming 4 GiB.
        vec![0xff, 0xff, 0xff, 0xff, 1],
        // A hello cut short.
        vec![40, 0, 0, 0, 1, b'S', b'S'],
    ];
    for bytes in inputs {
        let mut stream = TcpStream::connect(stage.address).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.write_all(&bytes).unwrap();
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        if !answer.is_empty() {
            let mut decoder = Decoder::new(WireLimits::default());
            let (_, frame) = decoder
                .decode(&answer)
                .expect("the stage answers in frames");
            assert!(
                matches!(frame, Some(Frame::Error { .. })),
                "the stage should answer garbage with an Error frame, got {frame:?}"
            );
        }
    }
    let address = stage.address.to_string();
    let served = generate(
        &llama,
        &[
            "--prompt-ids",
            "1,300",
            "--max-tokens",
            "2",
            "--layers",
            "0..2",
            "--next",
            &address,
        ],
    );
    assert_eq!(
        tokens_of(&served).len(),
        2,
        "the stage should serve on after the garbage"
    );
    let _ = stage.stderr.try_iter().count();
}

#[test]
fn the_shortest_lane_down_the_chain_bounds_a_prompt_before_it_is_sent_and_ends_a_generation_by_length()
 {
    use stage_server::model::Finish;
    let llama = tiny("chain-context-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    // The last stage's lanes are the shortest; the middle one passes its limit on in its own hello.
    let last = StageChild::start(&llama, "3..4", None, &["--context-length", "24"]);
    let middle = StageChild::start(&llama, "2..3", Some(last.address), &[]);
    let mut chain = Chain::connect(&file, 2, middle.address, ChainOptions::default()).unwrap();
    assert_eq!(
        chain.next_stage().context_length,
        24,
        "the middle stage's hello"
    );
    assert_eq!(chain.context_length(), 24);
    let options = GenerateOptions {
        max_tokens: 100,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let long: Vec<u32> = (0..30).map(|index| 300 + index).collect();
    let error = chain
        .generate(&long, SamplingParams::default(), &options, |_| {})
        .expect_err("a prompt longer than the last stage's lanes should be refused");
    assert!(
        matches!(
            error,
            DriverError::Context {
                prompt_tokens: 30,
                context: 24
            }
        ),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("24 tokens") && message.contains("--context-length"),
        "{message}"
    );
    // A prompt that fits generates up to the shortest lane's end and stops there by length, no stage failing.
    let generation = chain
        .generate(
            &[1, 300, 301, 302],
            SamplingParams::default(),
            &options,
            |_| {},
        )
        .expect("a prompt that fits should generate");
    assert_eq!(generation.tokens.len(), 20, "{generation:?}");
    assert_eq!(generation.finish, Finish::Length);
    // And the link serves on.
    let again = chain
        .generate(&[1, 300], SamplingParams::default(), &options, |_| {})
        .expect("the link should serve after the refusal");
    assert_eq!(again.tokens.len(), 22);
}

#[test]
fn auto_lossless_and_f32_links_give_the_same_tokens_through_the_library() {
    let llama = tiny("codecs-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let last = StageChild::start(&llama, "2..4", None, &[]);
    let options = GenerateOptions {
        max_tokens: 8,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let mut runs = Vec::new();
    for codec in [CodecPolicy::F32, CodecPolicy::AutoLossless] {
        let chain_options = ChainOptions {
            codec,
            top_logprobs: 5,
            ..ChainOptions::default()
        };
        let mut chain = Chain::connect(&file, 2, last.address, chain_options).unwrap();
        let mut predicted = Vec::new();
        chain
            .generate(
                &[1, 300, 301],
                SamplingParams::default(),
                &options,
                |token| predicted.push(token.clone()),
            )
            .unwrap();
        assert!(predicted.iter().all(|token| token.top.len() == 5));
        runs.push(predicted);
    }
    assert_eq!(
        runs[0], runs[1],
        "a lossless codec must change nothing, not even a log-probability"
    );
}

#[test]
fn sigterm_during_a_generation_lets_it_finish_and_the_stage_exits_zero() {
    let llama = tiny("sigterm-busy-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let last = StageChild::start(&llama, "3..4", None, &[]);
    let middle = StageChild::start(&llama, "1..3", Some(last.address), &[]);
    let mut chain = Chain::connect(&file, 1, middle.address, ChainOptions::default()).unwrap();
    let options = GenerateOptions {
        max_tokens: 150,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let mut signalled = false;
    let generation = chain
        .generate(&[1, 300, 301], SamplingParams::default(), &options, |_| {
            if !signalled {
                signalled = true;
                middle.signal("TERM");
            }
        })
        .expect("a generation in flight when its stage drains should finish");
    assert_eq!(
        generation.tokens.len(),
        150,
        "every token of the generation should arrive"
    );
    drop(chain);
    let status = middle.signal_and_wait(0);
    assert!(
        status.success(),
        "the drained stage should exit 0, got {status}"
    );
}

#[test]
fn a_generation_still_running_at_the_drain_deadline_is_stopped_with_an_error_frame_and_the_stage_exits_zero()
 {
    let mut model = TinyModel::llama(GgmlDType::Q4_1);
    model.context_length = 8192;
    let llama = tiny("drain-deadline-llama", &model);
    let file = ModelFile::open(&llama).unwrap();
    let last = StageChild::start(&llama, "3..4", None, &[]);
    let middle = StageChild::start(
        &llama,
        "1..3",
        Some(last.address),
        &["--drain-timeout", "1"],
    );
    let mut chain = Chain::connect(&file, 1, middle.address, ChainOptions::default()).unwrap();
    // Far more tokens than a debug build decodes in the one second the drain allows.
    let options = GenerateOptions {
        max_tokens: 8000,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let mut signalled: Option<Instant> = None;
    let result = chain.generate(&[1, 300, 301], SamplingParams::default(), &options, |_| {
        if signalled.is_none() {
            middle.signal("TERM");
            signalled = Some(Instant::now());
        }
    });
    let stopped_after = signalled.expect("a token came before the signal").elapsed();
    match result {
        Err(DriverError::Stage {
            code: ErrorCode::Draining,
            message,
        }) => assert!(
            message.contains("drain deadline"),
            "the error should say why: {message}"
        ),
        other => panic!("expected the stage's draining error frame, got {other:?}"),
    }
    assert!(
        stopped_after < Duration::from_secs(5),
        "the generation was stopped {stopped_after:?} after SIGTERM with a 1 s drain timeout"
    );
    drop(chain);
    let status = middle.signal_and_wait(0);
    assert!(
        status.success(),
        "the drained stage should exit 0, got {status}"
    );
}

#[test]
fn a_slow_link_changes_no_token_and_every_hop_costs_its_delay() {
    let llama = tiny("shaped-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    let shaped = ["--link-delay", "20", "--link-rate", "100"];
    let last = StageChild::start(&llama, "3..4", None, &[]);
    let middle = StageChild::start(&llama, "1..3", Some(last.address), &shaped);
    let options = GenerateOptions {
        max_tokens: 10,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let prompt = [1, 300, 301, 302];
    let mut plain = Chain::connect(&file, 1, middle.address, ChainOptions::default()).unwrap();
    let fast = plain
        .generate(&prompt, SamplingParams::default(), &options, |_| {})
        .unwrap();
    let slow_options = ChainOptions {
        shape: stage_server::serve::LinkShape {
            delay: Duration::from_millis(20),
            rate_bits_per_second: Some(100_000_000),
        },
        ..ChainOptions::default()
    };
    let mut slow = Chain::connect(&file, 1, middle.address, slow_options.clone()).unwrap();
    let started = Instant::now();
    let shaped_run = slow
        .generate(&prompt, SamplingParams::default(), &options, |_| {})
        .unwrap();
    let took = started.elapsed();
    assert_eq!(
        shaped_run.tokens, fast.tokens,
        "shaping must not change a token"
    );
    // Two shaped hops (stage 0 to 1, 1 to 2) of 20 ms each, for the prefill and each of the 9 decode steps;
    // the token comes straight back from the unshaped last stage.
    let floor = Duration::from_millis(40 * 10);
    assert!(
        took >= floor,
        "ten steps over two 20 ms hops took only {took:?}; the shaping is not applied"
    );
    // Relayed, each token also crosses both shaped links on its way back up: a shaped link is slow both ways.
    let mut relayed = Chain::connect(
        &file,
        1,
        middle.address,
        ChainOptions {
            direct_return: false,
            ..slow_options
        },
    )
    .unwrap();
    let started = Instant::now();
    let relayed_run = relayed
        .generate(&prompt, SamplingParams::default(), &options, |_| {})
        .unwrap();
    let took = started.elapsed();
    assert_eq!(
        relayed_run.tokens, fast.tokens,
        "relaying must not change a token"
    );
    let floor = Duration::from_millis(80 * 10);
    assert!(
        took >= floor,
        "ten relayed steps over two 20 ms links, down and back up, took only {took:?}; the answers are not shaped"
    );
}

#[test]
fn a_link_buffer_outside_what_a_stage_can_keep_to_is_refused_naming_the_flag() {
    let llama = tiny("buffer-llama", &TinyModel::llama(GgmlDType::Q4_1));
    for mib in ["0", "1048577"] {
        let output = Command::new(BINARY)
            .arg("serve")
            .arg("--model")
            .arg(&llama)
            .args(["--layers", "2..4", "--link-buffer-mib", mib])
            .output()
            .expect("running stage-server serve");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success(),
            "serve --link-buffer-mib {mib} should have failed; stderr: {stderr}"
        );
        assert!(
            stderr.contains(&format!("--link-buffer-mib {mib} is not a buffer"))
                && stderr.contains("give 1 to 1048576 MiB"),
            "the refusal of --link-buffer-mib {mib} should name the flag and what it takes: {stderr}"
        );
    }
}

#[test]
fn one_topology_file_starts_every_stage_and_drives_the_chain() {
    let llama = tiny("topology-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let free = || {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let (one, two) = (free(), free());
    let topology = scratch_dir("topology").join("chain.json");
    std::fs::write(
        &topology,
        format!(
            r#"{{"stages": [{{"address": "127.0.0.1:0", "layers": "0..1"}},
                {{"address": "{one}", "layers": "1..3"}},
                {{"address": "{two}", "layers": "3..4"}}]}}"#
        ),
    )
    .unwrap();
    let file = topology.to_str().unwrap();
    // The last stage first: stage 1 connects to it when stage 0's link arrives.
    let mut stages = Vec::new();
    for index in ["2", "1"] {
        let mut command = Command::new(BINARY);
        command
            .args(["serve", "--model"])
            .arg(&llama)
            .args(["--topology", file, "--stage", index, "--threads", "1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = command.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.starts_with(&format!("stage {index} serving layers")),
            "{line:?}"
        );
        stages.push(StageChild::adopt(child, one));
    }
    let prompt = ["--prompt-ids", "1,300,301", "--max-tokens", "5"];
    let unsplit = generate(&llama, &prompt);
    let mut args = prompt.to_vec();
    args.extend(["--topology", file]);
    assert_eq!(tokens_of(&generate(&llama, &args)), tokens_of(&unsplit));
}

#[test]
fn penalties_look_back_on_the_prompt_over_processes_as_they_do_unsplit() {
    let llama = tiny("penalties-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let penalties = [
        "--repeat-penalty",
        "4",
        "--presence-penalty",
        "4",
        "--frequency-penalty",
        "2",
    ];
    // The tiny model goes on with token 194 after this prompt, which already holds it. Before any token is
    // generated only the prompt can be what the penalties look back on, so a last stage that never saw the
    // prompt would pick 194 again where the unsplit sampler turns away from it.
    let prompt = "1,300,28,266,160,194";
    let first = |extra: &[&str]| {
        let mut args = vec!["--prompt-ids", prompt, "--max-tokens", "1"];
        args.extend_from_slice(extra);
        tokens_of(&generate(&llama, &args))
    };
    assert_ne!(
        first(&penalties),
        first(&[]),
        "the penalties should change this prompt's first token, or the test shows nothing"
    );
    let mut args = vec!["--prompt-ids", prompt, "--max-tokens", "8"];
    args.extend_from_slice(&penalties);
    let unsplit = generate(&llama, &args);
    let (_stages, next) = chain_of(&llama, 4, &[2], &[]);
    let next = next.to_string();
    args.extend(["--layers", "0..2", "--next", &next]);
    assert_eq!(
        tokens_of(&generate(&llama, &args)),
        tokens_of(&unsplit),
        "the last stage's penalties should see the prompt, as the unsplit sampler does"
    );
}

#[test]
fn the_api_reports_a_dead_chain_at_once_and_serves_again_when_its_stage_is_back() {
    use stage_server::frontend::{ApiConfig, ApiServer, Backend};
    let llama = tiny("api-chain", &TinyModel::llama(GgmlDType::Q4_1));
    let mut last = StageChild::start(&llama, "2..4", None, &[]);
    let last_address = last.address;
    let mut config = ApiConfig::new("127.0.0.1:0".parse().unwrap());
    config.lanes = 2;
    let backend = Backend::Chain {
        layers_end: 2,
        next: last_address,
        options: ChainOptions::default(),
    };
    let api = ApiServer::start(&llama, backend, config).unwrap();
    api.wait_ready(START_TIMEOUT).unwrap();
    let address = api.local_addr();
    let request = r#"{"prompt":[1,300,301],"max_tokens":4,"temperature":0}"#;
    let (status, body) = http(address, "POST", "/v1/completions", request);
    assert_eq!(status, 200, "{body}");
    assert_eq!(http(address, "GET", "/health", "").0, 200);
    last.kill();
    // The lane whose link broke answers 503 in words at once, and the probe makes /health say so.
    let started = Instant::now();
    let (status, body) = http(address, "POST", "/v1/completions", request);
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("stage 1"),
        "the error should name the stage: {body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a dead chain took {:?} to answer",
        started.elapsed()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while http(address, "GET", "/health", "").0 != 503 {
        assert!(
            Instant::now() < deadline,
            "/health never said the chain is down"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, body) = http(address, "POST", "/v1/completions", request);
    assert_eq!(status, 503, "while the chain is down: {body}");
    // The stage comes back on its address: the probe sees it and both lanes reconnect on their own.
    let _restarted = StageChild::start_on(&llama, "2..4", &last_address.to_string(), None, &[]);
    let deadline = Instant::now() + Duration::from_secs(15);
    while http(address, "GET", "/health", "").0 != 200 {
        assert!(
            Instant::now() < deadline,
            "/health never saw the chain come back"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..3 {
        let (status, body) = http(address, "POST", "/v1/completions", request);
        assert_eq!(status, 200, "after the restart: {body}");
    }
    let _ = api.shutdown(Instant::now() + Duration::from_secs(5));
}

#[test]
fn a_generation_cancelled_during_its_prompt_stops_before_its_next_chunk_and_frees_its_lanes() {
    use stage_server::model::Finish;
    let llama = tiny("cancel-prefill", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    // One lane at every stage: a session left open down the chain would refuse the next generation.
    let (_stages, first) = chain_of(&llama, 4, &[1, 3], &["--lanes", "1"]);
    let options = ChainOptions {
        prefill_chunk: 4,
        ..ChainOptions::default()
    };
    let mut chain = Chain::connect(&file, 1, first, options).unwrap();
    // Cancelled once two of the prompt's ten chunks went down.
    let asked = std::cell::Cell::new(0);
    let cancelled = || {
        asked.set(asked.get() + 1);
        asked.get() > 2
    };
    let generation = prompt_asking(
        &mut chain,
        40,
        8,
        &cancelled,
        Some("a generation cancelled during its prompt delivers no token"),
    )
    .expect("a cancelled generation ends cleanly");
    assert!(generation.tokens.is_empty());
    assert_eq!(generation.finish, Finish::Stop);
    assert_eq!(
        asked.get(),
        3,
        "asked before each chunk, and no chunk went down after the yes"
    );
    // Its lanes are free at every stage: the next generation runs.
    support::serves_four_tokens(&mut chain, "the chain serves the next generation");
}
