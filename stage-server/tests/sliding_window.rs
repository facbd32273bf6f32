//! Sliding-window layers keep a bounded KV cache: long sessions give the same logits as an evaluation that holds
//! every position, their memory stops growing, and trim stays correct within what they keep.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use stage_server::model::testing::TinyModel;
use stage_server::model::{
    Logits, ModelError, ModelFile, Pipeline, Stage, StageInput, StageOptions, StageOutput,
    StageSpec, TRIM_SLACK,
};

/// The tiny gemma3 (window 4, layers 0-4 sliding, layer 5 global) with room for a long session.
fn long_context_gemma() -> TinyModel {
    TinyModel {
        context_length: 2048,
        ..TinyModel::gemma3(GgmlDType::Q8_0)
    }
}

fn scratch_model(name: &str, model: &TinyModel) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "stage-server-sliding-{}-{name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    let path = model
        .write_to_dir(&dir)
        .expect("writing the tiny model failed");
    (dir, path)
}

fn whole(path: &Path) -> Stage {
    let block_count = ModelFile::open(path)
        .expect("the tiny model must open")
        .config()
        .block_count;
    Stage::load(
        path,
        StageSpec::whole(block_count),
        StageOptions {
            lane_count: 1,
            context_length: None,
        },
    )
    .expect("the tiny model must load")
}

fn logits(output: StageOutput) -> Vec<f32> {
    match output {
        StageOutput::Logits(values) => values,
        StageOutput::Activations(_) => panic!("a whole-model stage returned activations"),
    }
}

/// A deterministic token stream over the tiny vocabulary (ids 3..320), varied enough that attention matters.
fn stream(length: usize) -> Vec<u32> {
    (0..length as u32)
        .map(|index| 3 + (index * 37 + index * index * 11) % 317)
        .collect()
}

/// Decodes `tokens[from..]` one at a time after `tokens[..from]` was prefilled, returning one logit row per step
/// and, after each step, each block's cache capacity.
fn decode_rows(stage: &mut Stage, tokens: &[u32], from: usize) -> (Vec<Vec<f32>>, Vec<Vec<usize>>) {
    let mut rows = Vec::new();
    let mut capacities = Vec::new();
    for position in from..tokens.len() {
        let row = logits(
            stage
                .forward(
                    0,
                    position,
                    StageInput::Tokens(&tokens[position..position + 1]),
                    Logits::Last,
                )
                .expect("a decode step failed"),
        );
        rows.push(row);
        capacities.push(stage.lane_cache_capacity(0).expect("lane 0 exists"));
    }
    (rows, capacities)
}

/// The first position whose logits differ in any bit, with the largest difference there.
fn first_difference(
    reference: &[Vec<f32>],
    rows: &[Vec<f32>],
    offset: usize,
) -> Option<(usize, f32)> {
    reference
        .iter()
        .zip(rows)
        .enumerate()
        .find_map(|(index, (a, b))| {
            let differs = a.iter().zip(b).any(|(x, y)| x.to_bits() != y.to_bits());
            differs.then(|| {
                let largest = a
                    .iter()
                    .zip(b)
                    .fold(0f32, |max, (x, y)| max.max((x - y).abs()));
                (index + offset, largest)
            })
        })
}

#[test]
fn a_long_session_decodes_bit_identically_to_one_chunk_while_sliding_layers_stay_bounded() {
    let model = long_context_gemma();
    let (dir, path) = scratch_model("long", &model);
    let length = 1200;
    let tokens = stream(length);
    let vocabulary = TinyModel::vocabulary().len();

    // The reference: the whole stream in one chunk, which holds every position while it attends.
    let mut one_chunk = whole(&path);
    let flat = logits(
        one_chunk
            .forward(0, 0, StageInput::Tokens(&tokens), Logits::All)
            .expect("the one-chunk evaluation failed"),
    );
    let reference: Vec<Vec<f32>> = flat.chunks_exact(vocabulary).map(<[f32]>::to_vec).collect();

    // The session: a short prompt, then one token at a time, the sliding layers dropping old positions.
    let prompt = 7;
    let mut session = whole(&path);
    let prefill = logits(
        session
            .forward(0, 0, StageInput::Tokens(&tokens[..prompt]), Logits::All)
            .expect("the prompt prefill failed"),
    );
    let mut rows: Vec<Vec<f32>> = prefill
        .chunks_exact(vocabulary)
        .map(<[f32]>::to_vec)
        .collect();
    let (decoded, capacities) = decode_rows(&mut session, &tokens, prompt);
    rows.extend(decoded);

    if let Some((position, largest)) = first_difference(&reference, &rows, 0) {
        panic!(
            "decoding with the bounded cache differs from the one-chunk evaluation from position {position} \
             (largest logit change there {largest}); the sliding-window cache dropped or misplaced a position"
        );
    }

    let window = model.sliding_window;
    let global_layer = 5;
    let last = capacities.last().expect("at least one decode step");
    let halfway = &capacities[capacities.len() / 2];
    for (layer, (&at_end, &at_halfway)) in last.iter().zip(halfway).enumerate() {
        if layer == global_layer {
            assert!(
                at_end >= length,
                "the global layer {layer} must hold all {length} positions, it has room for {at_end}"
            );
        } else {
            assert_eq!(
                at_end, at_halfway,
                "sliding layer {layer} (window {window}) kept growing: room for {at_halfway} positions halfway, \
                 {at_end} at the end"
            );
            assert!(
                at_end < length / 2,
                "sliding layer {layer} (window {window}, slack {TRIM_SLACK}) holds room for {at_end} of {length} \
                 positions; it should keep only about a window"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_long_session_trims_back_by_the_slack_exactly_and_refuses_to_trim_past_its_window() {
    let model = long_context_gemma();
    let (dir, path) = scratch_model("trim", &model);
    let length = 700;
    let tokens = stream(length);
    let mut session = whole(&path);
    session
        .forward(0, 0, StageInput::Tokens(&tokens[..5]), Logits::Last)
        .expect("the prompt prefill failed");
    let (first_pass, _) = decode_rows(&mut session, &tokens, 5);

    // Back by the guaranteed slack, then forward again over the same tokens: the same bits.
    let target = length - TRIM_SLACK;
    session.trim(0, target).unwrap_or_else(|error| {
        panic!("trimming back by TRIM_SLACK ({TRIM_SLACK}) must work: {error}")
    });
    let (second_pass, _) = decode_rows(&mut session, &tokens, target);
    let offset = target - 5;
    if let Some((position, largest)) = first_difference(&first_pass[offset..], &second_pass, target)
    {
        panic!(
            "after trimming to {target}, position {position} decodes differently (largest logit change \
             {largest}); the trim left stale or missing keys"
        );
    }

    // Far back: the sliding layers no longer hold what position 100 needs, so the trim is refused and the lane
    // is untouched.
    let error = session
        .trim(0, 100)
        .expect_err("trimming 600 positions back past a window of 4 must be refused");
    let ModelError::TrimBeyondWindow {
        lane,
        target,
        earliest,
    } = error
    else {
        panic!("expected TrimBeyondWindow, got {error}");
    };
    assert_eq!(
        (lane, target),
        (0, 100),
        "the error names the lane and the asked length"
    );
    assert!(
        earliest > 100 && earliest <= length - TRIM_SLACK,
        "the earliest trim {earliest} must lie between the refused 100 and the guaranteed {}",
        length - TRIM_SLACK
    );
    assert_eq!(
        session.lane_length(0).expect("lane 0 exists"),
        length,
        "a refused trim must leave the lane as it was"
    );
    session.trim(0, earliest).unwrap_or_else(|error| {
        panic!("the earliest trim the error names ({earliest}) must work: {error}")
    });

    // Trimming to 0 always works and starts over.
    session.trim(0, 0).expect("trimming to 0 must always work");
    let again = logits(
        session
            .forward(0, 0, StageInput::Tokens(&tokens[..5]), Logits::Last)
            .expect("a prefill after trimming to 0 failed"),
    );
    let mut fresh = whole(&path);
    let expected = logits(
        fresh
            .forward(0, 0, StageInput::Tokens(&tokens[..5]), Logits::Last)
            .expect("a fresh prefill failed"),
    );
    assert!(
        again
            .iter()
            .zip(&expected)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "a lane trimmed to 0 must compute like a fresh one"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_trim_refusal_says_how_far_back_the_lane_can_go() {
    let error = ModelError::TrimBeyondWindow {
        lane: 2,
        target: 100,
        earliest: 640,
    };
    insta::assert_snapshot!(error.to_string());
}

#[test]
fn a_pipeline_trim_that_one_stage_refuses_changes_no_stage() {
    // Twelve layers: 5 and 11 global, the rest sliding.
    let model = TinyModel {
        block_count: 12,
        ..long_context_gemma()
    };
    let (dir, path) = scratch_model("pipeline-trim", &model);
    let options = StageOptions {
        lane_count: 1,
        context_length: None,
    };
    // Stage 1 holds only the global layer 5, which could go back anywhere; the others hold sliding layers.
    let mut pipeline =
        Pipeline::load(&path, &[5, 6], options).expect("the split tiny model must load");
    let tokens = stream(600);
    // One token at a time, as a decode runs: that is when the sliding layers let go of old positions.
    for (position, token) in tokens.iter().enumerate() {
        pipeline
            .forward(0, position, std::slice::from_ref(token), Logits::Last)
            .expect("a decode step failed");
    }
    let before: Vec<usize> = pipeline
        .stages()
        .iter()
        .map(|stage| stage.lane_length(0).expect("lane 0 exists"))
        .collect();
    for stage in pipeline.stages() {
        let alone = stage.check_trim(0, 100);
        let global_only = stage.spec().layers == (5..6);
        assert_eq!(
            alone.is_ok(),
            global_only,
            "stage {:?}: only the global-only stage may go back past the window, got {alone:?}",
            stage.spec()
        );
    }
    let error = pipeline
        .trim(0, 100)
        .expect_err("a trim the sliding-window stages refuse must fail for the pipeline");
    assert!(
        matches!(error, ModelError::TrimBeyondWindow { .. }),
        "expected TrimBeyondWindow, got {error}"
    );
    let after: Vec<usize> = pipeline
        .stages()
        .iter()
        .map(|stage| stage.lane_length(0).expect("lane 0 exists"))
        .collect();
    assert_eq!(
        before, after,
        "a refused pipeline trim must leave every stage's lane as it was"
    );
    std::fs::remove_dir_all(dir).ok();
}
