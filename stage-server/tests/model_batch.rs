//! Batched forward passes: every lane's output in a batch is bit-identical to running that lane alone, for
//! every weight type on the tiny models, on both real models and through a split, and a bad entry fails alone.

use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::quantized::GgmlDType;
use stage_server::model::testing::{TinyModel, real_model};
use stage_server::model::{
    BatchEntry, GEMMA3_FILE, Logits, ModelError, ModelFile, SMOLLM2_FILE, SharedStage, Stage,
    StageInput, StageOptions, StageOutput, StageSpec, StepPolicy,
};

fn scratch_model(model: &TinyModel) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "stage-server-batch-{}-{}",
        std::process::id(),
        model.file_name()
    ));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    let path = model
        .write_to_dir(&dir)
        .expect("writing the tiny model failed");
    (dir, path)
}

fn load(path: &Path, spec: StageSpec, lane_count: usize) -> Stage {
    Stage::load(
        path,
        spec,
        StageOptions {
            lane_count,
            context_length: None,
        },
    )
    .expect("load the stage")
}

fn whole_spec(path: &Path) -> StageSpec {
    StageSpec::whole(
        ModelFile::open(path)
            .expect("open the model")
            .config()
            .block_count,
    )
}

fn bits(output: &StageOutput) -> Vec<u32> {
    match output {
        StageOutput::Logits(values) | StageOutput::Activations(values) => {
            values.iter().map(|value| value.to_bits()).collect()
        }
    }
}

/// One lane's chunk at one step of a schedule.
#[derive(Clone, Debug)]
struct Chunk {
    lane: usize,
    position: usize,
    tokens: Vec<u32>,
    logits: Logits,
}

/// A schedule of batches over `lanes` lanes: a first batch of prompts of mixed lengths (some asking for every
/// row's logits), then `steps` batches where each lane decodes one token, sends a short chunk instead, or sits
/// the step out (so lanes leave and join batches), positions following each lane's length.
fn schedule(lanes: usize, steps: usize, vocab: u32, seed: usize) -> Vec<Vec<Chunk>> {
    let token = |lane: usize, index: usize| ((lane * 131 + index * 17 + seed * 7) as u32) % vocab;
    let mut lengths = vec![0usize; lanes];
    let mut batches = Vec::new();
    let mut first = Vec::new();
    for (lane, length) in lengths.iter_mut().enumerate() {
        let rows = 1 + (lane * 5 + seed) % 11;
        first.push(Chunk {
            lane,
            position: 0,
            tokens: (0..rows).map(|index| token(lane, index)).collect(),
            logits: if lane % 2 == 0 {
                Logits::All
            } else {
                Logits::Last
            },
        });
        *length = rows;
    }
    batches.push(first);
    for step in 0..steps {
        let mut batch = Vec::new();
        for (lane, length) in lengths.iter_mut().enumerate() {
            let rows = match (lane + step + seed) % 4 {
                0 if lanes > 1 => continue,
                1 => 3,
                _ => 1,
            };
            batch.push(Chunk {
                lane,
                position: *length,
                tokens: (0..rows)
                    .map(|index| token(lane, *length + index))
                    .collect(),
                logits: Logits::Last,
            });
            *length += rows;
        }
        // Lanes in a rotated order: a batch's order must not matter either.
        let turn = step % batch.len().max(1);
        batch.rotate_left(turn);
        batches.push(batch);
    }
    batches
}

/// Runs `batches` on one stage of `lanes` lanes, batch by batch, and every lane's chunks alone on a one-lane
/// stage of the same file, and asserts the outputs are bit-identical.
fn check_batched_equals_alone(path: &Path, spec: &StageSpec, batches: &[Vec<Chunk>], what: &str) {
    let lanes = batches
        .iter()
        .flatten()
        .map(|chunk| chunk.lane)
        .max()
        .unwrap_or(0)
        + 1;
    let mut batched = load(path, spec.clone(), lanes);
    let mut outputs: Vec<Vec<(Chunk, StageOutput)>> = vec![Vec::new(); lanes];
    for (step, batch) in batches.iter().enumerate() {
        let entries: Vec<BatchEntry> = batch
            .iter()
            .map(|chunk| BatchEntry {
                lane: chunk.lane,
                position: chunk.position,
                input: StageInput::Tokens(&chunk.tokens),
                logits: chunk.logits,
            })
            .collect();
        let results = batched.forward_batch(&entries);
        assert_eq!(results.len(), batch.len(), "{what}: one result per entry");
        for (chunk, result) in batch.iter().zip(results) {
            let output = result.unwrap_or_else(|error| {
                panic!("{what}: step {step}, lane {}: {error}", chunk.lane)
            });
            outputs[chunk.lane].push((chunk.clone(), output));
        }
    }
    let mut alone = load(path, spec.clone(), 1);
    for (lane, chunks) in outputs.iter().enumerate() {
        alone.reset(0).expect("reset");
        for (index, (chunk, batched_output)) in chunks.iter().enumerate() {
            let output = alone
                .forward(
                    0,
                    chunk.position,
                    StageInput::Tokens(&chunk.tokens),
                    chunk.logits,
                )
                .expect("the lane alone");
            assert!(
                bits(&output) == bits(batched_output),
                "{what}: lane {lane}'s chunk {index} (position {}, {} rows) differs batched from alone",
                chunk.position,
                chunk.tokens.len()
            );
        }
    }
}

fn check_tiny(model: TinyModel) {
    let (dir, path) = scratch_model(&model);
    let spec = whole_spec(&path);
    for lanes in 1..=8 {
        let batches = schedule(lanes, 6, 300, lanes);
        check_batched_equals_alone(
            &path,
            &spec,
            &batches,
            &format!("{} with {lanes} lanes", model.file_name()),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tiny_llama_batches_equal_each_lane_alone_for_every_weight_type() {
    for weight_type in [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
        GgmlDType::F16,
        GgmlDType::F32,
    ] {
        check_tiny(TinyModel::llama(weight_type));
    }
}

#[test]
fn tiny_gemma3_batches_equal_each_lane_alone_for_every_weight_type() {
    // Window 4 and longer sessions: the sliding-window caches slide inside batches too.
    for weight_type in [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::F16,
    ] {
        check_tiny(TinyModel::gemma3(weight_type));
    }
}

#[test]
fn a_batch_through_a_split_equals_each_lane_alone_through_the_whole_model() {
    let model = TinyModel::gemma3(GgmlDType::Q5_0);
    let (dir, path) = scratch_model(&model);
    let block_count = model.block_count;
    let specs = StageSpec::split(block_count, &[2, 4]).expect("split");
    let batches = schedule(5, 6, 300, 3);
    let mut stages: Vec<Stage> = specs
        .iter()
        .map(|spec| load(&path, spec.clone(), 5))
        .collect();
    let mut whole = load(&path, StageSpec::whole(block_count), 5);
    for (step, batch) in batches.iter().enumerate() {
        let mut inputs: Vec<Vec<f32>> = Vec::new();
        let mut outputs: Vec<StageOutput> = Vec::new();
        for (index, stage) in stages.iter_mut().enumerate() {
            let entries: Vec<BatchEntry> = batch
                .iter()
                .enumerate()
                .map(|(entry, chunk)| BatchEntry {
                    lane: chunk.lane,
                    position: chunk.position,
                    input: if index == 0 {
                        StageInput::Tokens(&chunk.tokens)
                    } else {
                        StageInput::Activations(&inputs[entry])
                    },
                    logits: chunk.logits,
                })
                .collect();
            outputs = stage
                .forward_batch(&entries)
                .into_iter()
                .map(|result| result.expect("a split stage's batch"))
                .collect();
            inputs = outputs
                .iter()
                .map(|output| match output {
                    StageOutput::Activations(values) => values.clone(),
                    StageOutput::Logits(values) => values.clone(),
                })
                .collect();
        }
        // The whole model, one lane at a time, must give the last stage's logits bit for bit.
        for (chunk, output) in batch.iter().zip(&outputs) {
            let alone = whole
                .forward(
                    chunk.lane,
                    chunk.position,
                    StageInput::Tokens(&chunk.tokens),
                    chunk.logits,
                )
                .expect("the whole model alone");
            assert!(
                bits(&alone) == bits(output),
                "step {step}, lane {}: the split batch differs from the whole model alone",
                chunk.lane
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_entry_fails_alone_and_the_rest_of_its_batch_runs_unchanged() {
    let model = TinyModel::llama(GgmlDType::Q4_1);
    let (dir, path) = scratch_model(&model);
    let spec = whole_spec(&path);
    let context = ModelFile::open(&path)
        .expect("open")
        .config()
        .context_length;
    let mut batched = load(&path, spec.clone(), 4);
    let mut alone = load(&path, spec.clone(), 1);
    let good: [u32; 3] = [5, 6, 7];
    let too_long: Vec<u32> = vec![9; context + 1];
    let out_of_range = [u32::MAX];
    let entries = [
        BatchEntry {
            lane: 0,
            position: 0,
            input: StageInput::Tokens(&good),
            logits: Logits::All,
        },
        // Position 3 on an empty lane.
        BatchEntry {
            lane: 1,
            position: 3,
            input: StageInput::Tokens(&good),
            logits: Logits::Last,
        },
        // Lane 0 again in the same batch.
        BatchEntry {
            lane: 0,
            position: 0,
            input: StageInput::Tokens(&good),
            logits: Logits::Last,
        },
        BatchEntry {
            lane: 2,
            position: 0,
            input: StageInput::Tokens(&too_long),
            logits: Logits::Last,
        },
        BatchEntry {
            lane: 3,
            position: 0,
            input: StageInput::Tokens(&out_of_range),
            logits: Logits::Last,
        },
        BatchEntry {
            lane: 9,
            position: 0,
            input: StageInput::Tokens(&good),
            logits: Logits::Last,
        },
        BatchEntry {
            lane: 3,
            position: 0,
            input: StageInput::Activations(&[0.0; 64]),
            logits: Logits::Last,
        },
    ];
    let results = batched.forward_batch(&entries);
    let reference = alone
        .forward(0, 0, StageInput::Tokens(&good), Logits::All)
        .expect("alone");
    let first = results[0].as_ref().expect("the good entry ran");
    assert!(bits(first) == bits(&reference), "the good entry changed");
    let message = |index: usize| match &results[index] {
        Ok(_) => panic!("entry {index} should have failed"),
        Err(error) => error.to_string(),
    };
    assert!(
        matches!(
            results[1],
            Err(ModelError::PositionMismatch {
                lane: 1,
                length: 0,
                position: 3
            })
        ),
        "{}",
        message(1)
    );
    assert!(
        message(2).contains("lane 0 appears twice in one batch"),
        "{}",
        message(2)
    );
    assert!(
        matches!(results[3], Err(ModelError::ContextOverflow { lane: 2, .. })),
        "{}",
        message(3)
    );
    assert!(
        matches!(results[4], Err(ModelError::TokenOutOfRange { .. })),
        "{}",
        message(4)
    );
    assert!(
        matches!(results[5], Err(ModelError::LaneOutOfRange { lane: 9, .. })),
        "{}",
        message(5)
    );
    assert!(
        matches!(results[6], Err(ModelError::WrongInput { .. })),
        "{}",
        message(6)
    );
    // Only the good entry's lane advanced; the others still take a chunk at 0.
    assert_eq!(batched.lane_length(0).expect("lane 0"), 3);
    for lane in 1..4 {
        assert_eq!(batched.lane_length(lane).expect("lane"), 0, "lane {lane}");
    }
    // The next decode of lane 0, batched with a fresh lane 1, is still what lane 0 alone gives.
    let results = batched.forward_batch(&[
        BatchEntry {
            lane: 1,
            position: 0,
            input: StageInput::Tokens(&good),
            logits: Logits::Last,
        },
        BatchEntry {
            lane: 0,
            position: 3,
            input: StageInput::Tokens(&[8]),
            logits: Logits::Last,
        },
    ]);
    let reference = alone
        .forward(0, 3, StageInput::Tokens(&[8]), Logits::Last)
        .expect("alone");
    assert!(bits(results[1].as_ref().expect("lane 0")) == bits(&reference));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_non_finite_row_fails_its_own_entry_in_a_later_stage_batch() {
    let model = TinyModel::llama(GgmlDType::Q8_0);
    let (dir, path) = scratch_model(&model);
    let specs = StageSpec::split(model.block_count, &[2]).expect("split");
    let mut later = load(&path, specs[1].clone(), 2);
    let mut alone = load(&path, specs[1].clone(), 1);
    let width = model.embedding_length;
    let finite: Vec<f32> = (0..width).map(|index| index as f32 / 64.0).collect();
    let mut poisoned = finite.clone();
    poisoned[5] = f32::NAN;
    let results = later.forward_batch(&[
        BatchEntry {
            lane: 0,
            position: 0,
            input: StageInput::Activations(&poisoned),
            logits: Logits::Last,
        },
        BatchEntry {
            lane: 1,
            position: 0,
            input: StageInput::Activations(&finite),
            logits: Logits::Last,
        },
    ]);
    assert!(matches!(
        results[0],
        Err(ModelError::NonFinite { lane: 0, .. })
    ));
    let reference = alone
        .forward(0, 0, StageInput::Activations(&finite), Logits::Last)
        .expect("alone");
    assert!(bits(results[1].as_ref().expect("the finite entry")) == bits(&reference));
    assert_eq!(later.lane_length(0).expect("lane 0"), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

fn check_real(file_name: &str) {
    let Some(path) = real_model(file_name) else {
        return;
    };
    let spec = whole_spec(&path);
    let vocab = ModelFile::open(&path).expect("open").config().vocab_size as u32;
    for lanes in [1, 2, 5, 8] {
        let batches = schedule(lanes, 3, vocab.min(20_000), lanes);
        check_batched_equals_alone(
            &path,
            &spec,
            &batches,
            &format!("{file_name} with {lanes} lanes"),
        );
    }
}

#[test]
fn smollm2_batches_of_one_to_eight_lanes_equal_each_lane_alone() {
    check_real(SMOLLM2_FILE);
}

#[test]
fn gemma3_batches_of_one_to_eight_lanes_equal_each_lane_alone() {
    check_real(GEMMA3_FILE);
}

/// Forward passes counted in the process's batch-size histogram: (all, those of one entry).
fn passes() -> (u64, u64) {
    use stage_server::telemetry::registry::{Value, process_samples};
    let sample = process_samples()
        .into_iter()
        .find(|sample| sample.name == "stage_server_batch_entries")
        .expect("the batch-size histogram");
    match sample.value {
        Value::Histogram {
            cumulative, count, ..
        } => (count, cumulative[0]),
        Value::Number(_) => panic!("the batch-size histogram is a number"),
    }
}

#[test]
fn a_generation_announced_before_its_prompt_is_ready_joins_the_pass_an_earlier_one_waits_in() {
    // The only test here that runs a SharedStage, so the process-wide histogram counts only its passes. The
    // gather time is long so that nothing here depends on how fast a thread is scheduled: a pass waits for an
    // announced arrival (up to the gather time) and never for a lane nobody announced.
    let model = TinyModel::llama(GgmlDType::Q4_1);
    let (dir, path) = scratch_model(&model);
    let gather = Duration::from_secs(30);
    let shared = SharedStage::start(
        load(&path, whole_spec(&path), 2),
        StepPolicy::new(512, gather),
    )
    .expect("start the compute thread");
    let prompts: [Vec<u32>; 2] = [vec![5, 6, 7], vec![8, 9, 10, 11]];
    let prefill = |lane: usize| {
        shared.activate(lane, true);
        shared
            .forward(lane, 0, StageInput::Tokens(&prompts[lane]), Logits::Last)
            .expect("prefill");
        shared.activate(lane, false);
    };
    let reset_lanes = || {
        for lane in 0..2 {
            shared.with_stage(|stage| stage.reset(lane)).expect("reset");
        }
    };
    let before = passes();
    let arrival = shared.expect_arrival();
    std::thread::scope(|scope| {
        scope.spawn(|| prefill(0));
        // Lane 0's chunk waits for the announced generation, however long its prompt takes.
        std::thread::sleep(Duration::from_millis(50));
        shared.activate(1, true);
        drop(arrival);
        prefill(1);
    });
    let after = passes();
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (1, 0),
        "an announced generation: one pass of both prompts"
    );
    reset_lanes();
    let started = std::time::Instant::now();
    prefill(0);
    prefill(1);
    let done = passes();
    assert_eq!(
        (done.0 - after.0, done.1 - after.1),
        (2, 2),
        "unannounced generations run alone"
    );
    assert!(
        started.elapsed() < gather,
        "a pass waited for a generation nobody announced"
    );
    // A request queued while lane 1 is free: lane 0's pass waits for it to take the lane and hand in its
    // prompt, as a server's lane worker does (it announces the arrival before the queue says it is empty).
    reset_lanes();
    let backlog = shared.backlog();
    backlog.set(1);
    let queued = passes();
    std::thread::scope(|scope| {
        scope.spawn(|| prefill(0));
        std::thread::sleep(Duration::from_millis(50));
        let arrival = shared.expect_arrival();
        backlog.set(0);
        std::thread::sleep(Duration::from_millis(20));
        shared.activate(1, true);
        drop(arrival);
        prefill(1);
    });
    let taken = passes();
    assert_eq!(
        (taken.0 - queued.0, taken.1 - queued.1),
        (1, 0),
        "a queued request and a free lane: one pass of both prompts"
    );
    // The queued request leaves the queue without taking the lane (its client went away): the waiting pass
    // runs at once, alone.
    reset_lanes();
    backlog.set(1);
    let started = std::time::Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| prefill(0));
        std::thread::sleep(Duration::from_millis(50));
        backlog.set(0);
    });
    let left = passes();
    assert_eq!(
        (left.0 - taken.0, left.1 - taken.1),
        (1, 1),
        "the request that left: lane 0 ran alone"
    );
    assert!(
        started.elapsed() < gather,
        "a pass went on waiting for a request that left the queue"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
