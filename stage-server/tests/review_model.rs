//! Review of the model core after the gemma-agreement changes: model-file and API edge cases, NaN handling,
//! window semantics, batch, lane and thread invariance. Four of them found bugs that are now fixed.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{self, Value};
use stage_server::model::testing::TinyModel;
use stage_server::model::{
    Logits, ModelError, ModelFile, Stage, StageInput, StageOptions, StageOutput, StageSpec,
    TRIM_SLACK,
};

/// A scratch directory for one test, so tests running in parallel never share files.
fn scratch_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("stage-server-review-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    dir
}

fn write_model(name: &str, model: &TinyModel) -> PathBuf {
    model
        .write_to_dir(&scratch_dir(name))
        .expect("writing the tiny model failed")
}

/// Copies the model at `path` to a new file with metadata `key` set to `value` (the tensors unchanged).
fn with_metadata(path: &Path, key: &str, value: Value) -> PathBuf {
    let file = ModelFile::open(path).expect("the tiny model must open");
    let content = file.content();
    let mut metadata: Vec<(String, Value)> = content
        .metadata
        .iter()
        .filter(|(name, _)| name.as_str() != key)
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    metadata.push((key.to_string(), value));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = names
        .into_iter()
        .map(|name| {
            let tensor = file
                .tensor(name)
                .expect("a tensor of the tiny model must read");
            (name.clone(), tensor)
        })
        .collect();
    let edited = path.with_extension("edited.gguf");
    let mut out = std::fs::File::create(&edited).expect("cannot create the edited model file");
    let metadata_refs: Vec<(&str, &Value)> = metadata
        .iter()
        .map(|(name, value)| (name.as_str(), value))
        .collect();
    let tensor_refs: Vec<(&str, &candle_core::quantized::QTensor)> = tensors
        .iter()
        .map(|(name, tensor)| (name.as_str(), tensor))
        .collect();
    gguf_file::write(&mut out, &metadata_refs, &tensor_refs)
        .expect("writing the edited model failed");
    edited
}

fn load(path: &Path, spec: StageSpec, lane_count: usize) -> Result<Stage, ModelError> {
    Stage::load(
        path,
        spec,
        StageOptions {
            lane_count,
            context_length: None,
        },
    )
}

fn whole(path: &Path, lane_count: usize) -> Stage {
    let block_count = ModelFile::open(path)
        .expect("the tiny model must open")
        .config()
        .block_count;
    load(path, StageSpec::whole(block_count), lane_count).expect("the tiny model must load")
}

fn logits(output: StageOutput) -> Vec<f32> {
    match output {
        StageOutput::Logits(values) => values,
        StageOutput::Activations(_) => panic!("a last stage returned activations"),
    }
}

fn activations(output: StageOutput) -> Vec<f32> {
    match output {
        StageOutput::Activations(values) => values,
        StageOutput::Logits(_) => panic!("a middle stage returned logits"),
    }
}

/// A deterministic token stream over the tiny vocabulary (ids 3..320), offset by `seed`.
fn stream(length: usize, seed: u32) -> Vec<u32> {
    (0..length as u32)
        .map(|index| 3 + (index * 37 + index * index * 11 + seed * 101) % 317)
        .collect()
}

/// Logits of every position of `tokens` fed in chunks of the given sizes (cycled) on lane 0 of a fresh stage.
fn logits_in_chunks(path: &Path, tokens: &[u32], chunk_sizes: &[usize]) -> Vec<f32> {
    let mut stage = whole(path, 1);
    let mut values = Vec::new();
    let mut position = 0;
    let mut sizes = chunk_sizes.iter().cycle();
    while position < tokens.len() {
        let size = (*sizes.next().expect("cycle never ends")).min(tokens.len() - position);
        let chunk = &tokens[position..position + size];
        values.extend(logits(
            stage
                .forward(0, position, StageInput::Tokens(chunk), Logits::All)
                .unwrap_or_else(|error| panic!("chunk at {position} of {size} failed: {error}")),
        ));
        position += size;
    }
    values
}

/// The first index whose bits differ, with both values.
fn first_bit_difference(expected: &[f32], actual: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(
        expected.len(),
        actual.len(),
        "the two runs returned different numbers of logits"
    );
    expected
        .iter()
        .zip(actual)
        .enumerate()
        .find(|(_, (a, b))| a.to_bits() != b.to_bits())
        .map(|(index, (a, b))| (index, *a, *b))
}

const FLOAT_TYPES: [GgmlDType; 3] = [GgmlDType::F32, GgmlDType::F16, GgmlDType::BF16];

const QUANTISED_TYPES: [GgmlDType; 8] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

#[test]
fn a_sliding_window_near_the_largest_integer_is_an_error_or_works_but_never_panics() {
    let path = write_model("huge-window", &TinyModel::gemma3(GgmlDType::Q8_0));
    let edited = with_metadata(
        &path,
        "gemma3.attention.sliding_window",
        Value::U64(u64::MAX - 8),
    );
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let mut stage = load(&edited, StageSpec::whole(6), 1)?;
        stage.forward(0, 0, StageInput::Tokens(&[1, 40, 41]), Logits::Last)
    }));
    assert!(
        outcome.is_ok(),
        "a sliding window of u64::MAX - 8 in the model file panicked instead of loading (as a window wider \
         than any context) or failing with an error naming the metadata key"
    );
}

#[test]
fn a_zero_sliding_window_is_refused_at_load_rather_than_run_without_attention() {
    let path = write_model(
        "zero-window",
        &TinyModel {
            sliding_window: 0,
            ..TinyModel::gemma3(GgmlDType::Q8_0)
        },
    );
    let window = ModelFile::open(&path)
        .expect("the tiny model must open")
        .config()
        .sliding_window;
    assert_eq!(
        window,
        Some(0),
        "the test model must carry a zero sliding window"
    );
    // A query that sees no key has no attention output. The division by a zero softmax sum makes NaN, which
    // the next product's activation quantisation turns into zeros, so the model runs as if it had no attention.
    match load(&path, StageSpec::whole(6), 1) {
        Err(error) => {
            let text = error.to_string();
            assert!(
                text.contains("window"),
                "the load error for a zero sliding window should name the window, said: {text}"
            );
        }
        Ok(mut stage) => {
            let result = stage.forward(0, 0, StageInput::Tokens(&[1, 40, 41]), Logits::Last);
            panic!(
                "a model whose sliding window is 0 (no position visible, not even the query's own) loaded and \
                 its forward gave {:?}: attention was silently dropped instead of the file being refused",
                result.map(|_| "logits")
            );
        }
    }
}

/// A 5-layer gemma3: all five layers slide (window 4), none is global.
fn sliding_only_gemma() -> TinyModel {
    TinyModel {
        block_count: 5,
        ..TinyModel::gemma3(GgmlDType::Q8_0)
    }
}

/// Activation rows of `tokens` after layers 0..2 of `path`, as a first stage would send them.
fn first_stage_rows(path: &Path, tokens: &[u32]) -> Vec<f32> {
    let block_count = ModelFile::open(path)
        .expect("the tiny model must open")
        .config()
        .block_count;
    assert!(block_count >= 3, "the NaN tests split after layer 2");
    let mut first = load(
        path,
        StageSpec {
            layers: 0..2,
            first: true,
            last: false,
        },
        1,
    )
    .expect("the first stage must load");
    activations(
        first
            .forward(0, 0, StageInput::Tokens(tokens), Logits::Last)
            .expect("the first stage forward failed"),
    )
}

fn last_stage(path: &Path) -> Stage {
    let block_count = ModelFile::open(path)
        .expect("the tiny model must open")
        .config()
        .block_count;
    load(
        path,
        StageSpec {
            layers: 2..block_count,
            first: false,
            last: true,
        },
        1,
    )
    .expect("the last stage must load")
}

/// Feeds a last stage (layers 2..) clean activation rows of `tokens`, then the same rows with row 0 set to NaN
/// and to infinity, and returns what each poisoned forward gave, described.
fn poisoned_row_outcomes(path: &Path, tokens: &[u32]) -> Vec<String> {
    let rows = first_stage_rows(path, tokens);
    let width = rows.len() / tokens.len();
    // Control: the clean rows give finite logits, so a failure below is the bad value's doing.
    last_stage(path)
        .forward(0, 0, StageInput::Activations(&rows), Logits::Last)
        .expect("clean activation rows must give logits");
    let mut accepted = Vec::new();
    for bad in [f32::NAN, f32::INFINITY] {
        let mut poisoned = rows.clone();
        poisoned[..width].fill(bad);
        let result =
            last_stage(path).forward(0, 0, StageInput::Activations(&poisoned), Logits::Last);
        if !matches!(result, Err(ModelError::NonFinite { .. })) {
            accepted.push(format!(
                "row 0 of {} set to {bad} gave {:?}",
                tokens.len(),
                result.map(|_| "finite logits")
            ));
        }
    }
    accepted
}

#[test]
fn nan_or_infinite_activations_entering_a_last_stage_are_an_error() {
    // Llama (every layer global): the NaN row is visible to the last row, but the quantised projections read
    // NaN as 0, so nothing non-finite reaches the returned row.
    let llama = write_model("nan-llama", &TinyModel::llama(GgmlDType::Q4_1));
    let mut accepted = poisoned_row_outcomes(&llama, &stream(4, 0));
    // Gemma with only sliding layers: the last row of 16 cannot even see row 0 through three window-4 layers.
    let gemma = write_model("nan-gemma", &sliding_only_gemma());
    accepted.extend(poisoned_row_outcomes(&gemma, &stream(16, 0)));
    assert!(
        accepted.is_empty(),
        "bad activation rows entering a last stage must fail with NonFinite, not become text:\n{}",
        accepted.join("\n")
    );
}

#[test]
fn a_sliding_layer_sees_exactly_its_window_and_nothing_older() {
    // One layer (layer 0 slides, window 4): position p sees p-3..=p, so the token at p-4 cannot matter and the
    // token at p-3 must. The other window tests compare the bounded cache with itself, so an off-by-one in the
    // window would pass them; this one pins the window to llama.cpp's rule (masked when p - k >= window).
    let path = write_model(
        "one-layer",
        &TinyModel {
            block_count: 1,
            ..TinyModel::gemma3(GgmlDType::Q8_0)
        },
    );
    let tokens = stream(12, 0);
    let position = 11;
    let vocabulary = TinyModel::vocabulary().len();
    let row = |tokens: &[u32]| {
        let all = logits_in_chunks(&path, tokens, &[tokens.len()]);
        all[position * vocabulary..(position + 1) * vocabulary].to_vec()
    };
    let reference = row(&tokens);

    let mut outside = tokens.clone();
    outside[position - 4] = 300;
    assert_ne!(outside, tokens, "the changed token must differ");
    assert_eq!(
        first_bit_difference(&reference, &row(&outside)),
        None,
        "changing the token 4 positions back changed the logits: a window of 4 saw 5 positions"
    );

    let mut inside = tokens.clone();
    inside[position - 3] = 300;
    assert_ne!(inside, tokens, "the changed token must differ");
    assert!(
        first_bit_difference(&reference, &row(&inside)).is_some(),
        "changing the token 3 positions back left the logits unchanged: a window of 4 saw only 3 positions"
    );
}

/// For each architecture and weight type, a description of the first row whose bits depend on the chunking.
fn chunking_differences(weight_types: &[GgmlDType]) -> Vec<String> {
    let mut failures = Vec::new();
    for architecture in ["llama", "gemma3"] {
        for &weight_type in weight_types {
            let model = match architecture {
                "llama" => TinyModel::llama(weight_type),
                _ => TinyModel::gemma3(weight_type),
            };
            let path = write_model(&format!("chunks-{architecture}"), &model);
            let tokens = stream(40, 1);
            let reference = logits_in_chunks(&path, &tokens, &[40]);
            for sizes in [&[1][..], &[7], &[3, 1, 13, 2]] {
                let chunked = logits_in_chunks(&path, &tokens, sizes);
                if let Some((index, expected, actual)) = first_bit_difference(&reference, &chunked)
                {
                    let vocabulary = TinyModel::vocabulary().len();
                    failures.push(format!(
                        "{architecture} {weight_type:?}: position {} gives {actual} in chunks of {sizes:?} but \
                         {expected} in one chunk (logit {})",
                        index / vocabulary,
                        index % vocabulary
                    ));
                    break;
                }
            }
        }
    }
    failures
}

#[test]
fn every_row_gives_the_same_bits_whatever_chunk_it_came_in_for_quantised_weights() {
    let failures = chunking_differences(&QUANTISED_TYPES);
    assert!(
        failures.is_empty(),
        "rows depend on the chunk they came in:\n{}",
        failures.join("\n")
    );
}

#[test]
fn every_row_gives_the_same_bits_whatever_chunk_it_came_in_for_float_weights() {
    let failures = chunking_differences(&FLOAT_TYPES);
    assert!(
        failures.is_empty(),
        "rows depend on the chunk they came in (a decode step differs from the same position in a prefill, so \
         split and unsplit or decode and prefill disagree):\n{}",
        failures.join("\n")
    );
}

#[test]
fn logits_do_not_depend_on_the_number_of_threads() {
    // 160 rows: attention work passes the parallel threshold, and the matmuls see many rows.
    for model in [
        TinyModel::llama(GgmlDType::Q4_1),
        TinyModel::gemma3(GgmlDType::Q5_0),
        TinyModel::gemma3(GgmlDType::Q4K),
    ] {
        let path = write_model(&format!("threads-{:?}", model.weight_type), &model);
        let tokens = stream(160, 2);
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("cannot build a thread pool")
                .install(|| logits_in_chunks(&path, &tokens, &[160, 1]))
        };
        let one = run(1);
        for threads in [2, 3] {
            if let Some((index, expected, actual)) = first_bit_difference(&one, &run(threads)) {
                panic!(
                    "{} {:?}: logit {index} is {expected} on 1 thread but {actual} on {threads}",
                    model.architecture.name(),
                    model.weight_type
                );
            }
        }
    }
}

#[test]
fn interleaved_lanes_on_sliding_layers_match_each_lane_run_alone() {
    let model = TinyModel {
        context_length: 1024,
        ..TinyModel::gemma3(GgmlDType::Q8_0)
    };
    let path = write_model("lanes", &model);
    let length = 340; // past one cache chunk (256), so the sliding layers drop positions mid-session
    let streams: Vec<Vec<u32>> = (0..3).map(|lane| stream(length, lane + 5)).collect();
    let prompts = [3, 17, 40];

    // Each lane alone, on its own stage.
    let alone: Vec<Vec<f32>> = streams
        .iter()
        .zip(prompts)
        .map(|(tokens, prompt)| {
            let mut sizes = vec![prompt];
            sizes.extend(std::iter::repeat_n(1, length - prompt));
            logits_in_chunks(&path, tokens, &sizes)
        })
        .collect();

    // All three on one stage, one step each in turn.
    let mut stage = whole(&path, 3);
    let mut together: Vec<Vec<f32>> = vec![Vec::new(); 3];
    for lane in 0..3 {
        let prompt = &streams[lane][..prompts[lane]];
        together[lane].extend(logits(
            stage
                .forward(lane, 0, StageInput::Tokens(prompt), Logits::All)
                .expect("a prompt prefill failed"),
        ));
    }
    for position in 3..length {
        for lane in 0..3 {
            if position < prompts[lane] {
                continue;
            }
            let token = &streams[lane][position..position + 1];
            together[lane].extend(logits(
                stage
                    .forward(lane, position, StageInput::Tokens(token), Logits::All)
                    .unwrap_or_else(|error| panic!("lane {lane} at {position} failed: {error}")),
            ));
        }
    }
    for lane in 0..3 {
        if let Some((index, expected, actual)) = first_bit_difference(&alone[lane], &together[lane])
        {
            let vocabulary = TinyModel::vocabulary().len();
            panic!(
                "lane {lane} at position {}: {actual} with other lanes interleaved, {expected} alone; lanes \
                 share cache state",
                index / vocabulary
            );
        }
    }
}

#[test]
fn a_trim_to_exactly_the_earliest_length_then_new_tokens_match_a_fresh_run() {
    let model = TinyModel {
        context_length: 1024,
        ..TinyModel::gemma3(GgmlDType::Q8_0)
    };
    let path = write_model("trim-edge", &model);
    let length = 400;
    let tokens = stream(length, 3);
    let mut stage = whole(&path, 1);
    stage
        .forward(0, 0, StageInput::Tokens(&tokens[..10]), Logits::Last)
        .expect("the prompt prefill failed");
    for position in 10..length {
        stage
            .forward(
                0,
                position,
                StageInput::Tokens(&tokens[position..position + 1]),
                Logits::Last,
            )
            .expect("a decode step failed");
    }
    // Ask for far too much to learn the edge, then trim to it and one short of it.
    let earliest = match stage.trim(0, 20) {
        Err(ModelError::TrimBeyondWindow { earliest, .. }) => earliest,
        other => panic!(
            "trimming a 400-position lane to 20 past a window of 4 must be refused, got {other:?}"
        ),
    };
    assert!(
        earliest > 20 && earliest < length,
        "the earliest trim {earliest} must lie between the refused 20 and the length {length}"
    );
    assert!(
        matches!(
            stage.check_trim(0, earliest - 1),
            Err(ModelError::TrimBeyondWindow { .. })
        ),
        "one position before the earliest trim {earliest} must be refused too"
    );
    stage.trim(0, earliest).unwrap_or_else(|error| {
        panic!("the earliest trim {earliest} it named was refused: {error}")
    });

    // Different tokens from the edge on, in one chunk longer than the window.
    let mut replaced = tokens[..earliest].to_vec();
    replaced.extend(stream(30, 9));
    let after_trim = logits(
        stage
            .forward(
                0,
                earliest,
                StageInput::Tokens(&replaced[earliest..]),
                Logits::All,
            )
            .expect("a chunk at the earliest trim failed"),
    );
    let mut sizes = vec![10];
    sizes.extend(std::iter::repeat_n(1, earliest - 10));
    sizes.push(30);
    let fresh = logits_in_chunks(&path, &replaced, &sizes);
    let vocabulary = TinyModel::vocabulary().len();
    let fresh_tail = &fresh[earliest * vocabulary..];
    if let Some((index, expected, actual)) = first_bit_difference(fresh_tail, &after_trim) {
        panic!(
            "after a trim to the edge {earliest}, position {} gives {actual} but a fresh run gives {expected}; \
             the cache kept stale or too few positions",
            earliest + index / vocabulary
        );
    }
}

#[test]
fn after_a_non_finite_chunk_the_lane_continues_as_if_that_chunk_never_came() {
    let path = write_model(
        "nan-recovery",
        &TinyModel {
            context_length: 1024,
            ..TinyModel::gemma3(GgmlDType::Q8_0)
        },
    );
    let tokens = stream(330, 4);
    let rows = first_stage_rows(&path, &tokens);
    let width = rows.len() / tokens.len();
    let middle = || {
        load(
            &path,
            StageSpec {
                layers: 2..4,
                first: false,
                last: false,
            },
            1,
        )
        .expect("the middle stage must load")
    };
    let feed = |stage: &mut Stage, from: usize, to: usize| {
        activations(
            stage
                .forward(
                    0,
                    from,
                    StageInput::Activations(&rows[from * width..to * width]),
                    Logits::All,
                )
                .unwrap_or_else(|error| panic!("clean rows {from}..{to} failed: {error}")),
        )
    };
    let mut reference = middle();
    feed(&mut reference, 0, 300);
    let expected = feed(&mut reference, 300, 330);

    let mut stage = middle();
    feed(&mut stage, 0, 300);
    // A middle stage returns every row, so a NaN row (carried by the residual) must be refused.
    let mut poisoned = rows[300 * width..330 * width].to_vec();
    poisoned[5 * width..6 * width].fill(f32::NAN);
    let refused = stage.forward(0, 300, StageInput::Activations(&poisoned), Logits::All);
    assert!(
        matches!(refused, Err(ModelError::NonFinite { .. })),
        "a middle stage returned a NaN row without an error: {:?}",
        refused.map(|_| "activations")
    );
    assert_eq!(
        stage.lane_length(0).expect("lane 0 exists"),
        300,
        "after the refused chunk the lane must stand where it started"
    );
    let actual = feed(&mut stage, 300, 330);
    if let Some((index, expected, actual)) = first_bit_difference(&expected, &actual) {
        panic!(
            "after a refused NaN chunk, the clean retry gives {actual} at value {index} where a run that never saw \
             the NaN gives {expected}; the poisoned keys stayed visible"
        );
    }
}

#[test]
fn repeated_trims_and_refills_do_not_grow_the_cache() {
    // Speculative decoding's pattern: go forward a draft, trim it back, go forward again, many times.
    let path = write_model(
        "trim-cycles",
        &TinyModel {
            context_length: 2048,
            ..TinyModel::gemma3(GgmlDType::Q8_0)
        },
    );
    let tokens = stream(400, 6);
    let mut stage = whole(&path, 1);
    stage
        .forward(0, 0, StageInput::Tokens(&tokens), Logits::Last)
        .expect("the prompt prefill failed");
    let mut largest_after_first_cycle: Option<Vec<usize>> = None;
    for cycle in 0..40u32 {
        stage.trim(0, 400 - TRIM_SLACK).unwrap_or_else(|error| {
            panic!("cycle {cycle}: trimming back by the slack failed: {error}")
        });
        let draft = stream(TRIM_SLACK, cycle + 10);
        stage
            .forward(
                0,
                400 - TRIM_SLACK,
                StageInput::Tokens(&draft),
                Logits::Last,
            )
            .unwrap_or_else(|error| panic!("cycle {cycle}: the refill failed: {error}"));
        let capacities = stage.lane_cache_capacity(0).expect("lane 0 exists");
        match &largest_after_first_cycle {
            None => largest_after_first_cycle = Some(capacities),
            Some(first) => assert_eq!(
                &capacities, first,
                "cycle {cycle}: the cache capacities changed from {first:?} to {capacities:?} while the lane \
                 length stayed at 400; trim-and-refill cycles grow the cache"
            ),
        }
    }
}
