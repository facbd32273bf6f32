//! Agreement with llama.cpp: our model, teacher-forced on llama.cpp's token streams, against committed fixtures.
//!
//! The fixtures in `tests/fixtures/llama_cpp/<model>.json` come from `cargo xtask llama-ref fixtures`: llama.cpp
//! (prebuilt libraries from npm `node-llama-cpp` 3.21.1, the best CPU variant, named in the fixture, 2 threads)
//! greedily generated 64 tokens after each prompt, ignoring end-of-generation, and then evaluated the whole stream
//! (prompt + generated) in one batch. For every position of that stream the fixture keeps the argmax, the top-2
//! margin, the log-sum-exp over the whole vocabulary and the 32 largest (id, logit) pairs. It also keeps the top-2
//! margin of every incremental greedy step, because llama.cpp's own batch and one-token evaluations differ by up
//! to about 0.3 logits: the fixtures show its greedy stream and its teacher-forced argmax disagreeing at margins of
//! 0.26.
//!
//! The checks, with the tolerances of `shared/reference/models.md` section 6:
//! - (a) at every position where the reference's top-2 margin exceeds 0.25, our argmax equals llama.cpp's;
//! - (b) the mean over positions of KL(reference || ours) is below 5e-3;
//! - (c) our free-running greedy tokens equal llama.cpp's up to the first step where its margin (in the batch or
//!   the incremental evaluation) is at most 0.25; after a near-tie the two streams may rightly part.
//!
//! How the KL handles the tail: the reference distribution is known exactly on its top 32 tokens,
//! `p_i = exp(logit_i - logsumexp)`, and its remaining mass `1 - sum(p_top)` is kept as one lumped "tail" outcome.
//! Our full softmax is lumped the same way (our mass on those 32 ids, and everything else as the tail), and the KL
//! is taken over those 33 outcomes. Lumping outcomes can only lower a KL divergence (log-sum inequality), so this
//! is a lower bound on the full-vocabulary KL, exact when the tail mass is small; the fixtures' tail mass has a
//! median of 1 to 2 %, but reaches 50 to 70 % at a few high-entropy positions, where only the head is compared
//! token by token.
//!
//! How close that is: gemma-3 once missed confident positions here. Comparing every intermediate tensor of
//! llama.cpp's evaluation (`llama_ref --dump-dir`) with ours, layer by layer with llama.cpp's own input fed to
//! each of our layers, found real differences (activation scales not rounded to f16 as ggml stores them, Q5_0
//! zero points applied as a cancelling float term, RMS norm, RoPE and GELU arithmetic, f16-rounded attention
//! queries and weights where its flash attention keeps f32, a batch-dependent candle path for one-row Q6_K
//! products). With those fixed, gemma-3's Q/K/V projections, RoPE, GELU and output head equalled llama.cpp's bit
//! for bit; what remained was summation order in attention and candle's K-quant products, which 8-bit activation
//! quantisation amplifies by one to two orders of magnitude per layer.
//!
//! Since session 25 gemma-3 no longer imitates ggml's 8-bit activations: its K-quant products run on our kernels
//! and every one of its products quantises activations to about 15 bits, which puts its logits within 2e-6 KL of
//! the exact f64 forward (`tests/exact_reference.rs`). With 8-bit activations in blocks of 32 for the K-quants
//! (where ggml uses one scale per 256), one confident position missed: "After the long winter", position 28,
//! where llama.cpp's margin is 0.26 but the exact forward's only 0.025. Agreeing with llama.cpp there takes either
//! its exact roundings or the exact model; ours now computes the latter.

use std::io::Read;
use std::path::Path;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use stage_server::model::testing::{MissingModel, real_model, real_model_in};
use stage_server::model::{KNOWN_MODELS, Logits, Pipeline, StageOptions, default_model_dir};

/// Positions whose reference top-2 margin is at most this are near-ties: argmax may rightly differ there.
const MARGIN_THRESHOLD: f32 = 0.25;
/// The largest acceptable mean KL(reference || ours) per position.
const MEAN_KL_LIMIT: f64 = 5e-3;

/// One fixture file: a model and its reference cases.
#[derive(Debug, Deserialize)]
struct Fixture {
    model: String,
    model_sha256: String,
    cpu_variant: String,
    vocabulary: usize,
    top_count: usize,
    cases: Vec<Case>,
}

/// One prompt with llama.cpp's stream and the per-position summaries.
#[derive(Debug, Deserialize)]
struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    generated_margins: Vec<f32>,
    positions: Vec<Position>,
}

/// llama.cpp's logits at one stream position, summarised.
#[derive(Debug, Deserialize)]
struct Position {
    argmax: u32,
    margin: f32,
    logsumexp: f64,
    top: Vec<(u32, f32)>,
}

/// How our logits for one case compare with the reference.
#[derive(Debug)]
struct Comparison {
    /// Positions compared.
    positions: usize,
    /// Positions whose reference margin exceeds the threshold.
    confident: usize,
    /// Confident positions where our argmax differs: (position, reference id, our id, reference margin, how far
    /// our logit for our choice is above our logit for the reference's choice).
    argmax_misses: Vec<(usize, u32, u32, f32, f32)>,
    mean_kl: f64,
    max_kl: f64,
}

impl Case {
    /// The whole stream llama.cpp evaluated: prompt then generated tokens.
    fn stream(&self) -> Vec<u32> {
        self.prompt_ids
            .iter()
            .chain(&self.generated_ids)
            .copied()
            .collect()
    }

    /// How many leading greedy steps must agree: those before the first step that was a near-tie in either of
    /// llama.cpp's evaluations.
    fn confident_greedy_steps(&self) -> usize {
        let first_generated = self.prompt_ids.len() - 1;
        (0..self.generated_ids.len())
            .find(|&step| {
                self.generated_margins[step] <= MARGIN_THRESHOLD
                    || self.positions[first_generated + step].margin <= MARGIN_THRESHOLD
            })
            .unwrap_or(self.generated_ids.len())
    }
}

/// KL(reference || ours) at one position, with the reference tail beyond its top entries lumped into one outcome
/// (see the module docs). `ours` is our full row of logits.
fn kl_reference_to_ours(position: &Position, ours: &[f32]) -> f64 {
    let our_maximum = ours.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let our_logsumexp = f64::from(our_maximum)
        + ours
            .iter()
            .map(|&logit| (f64::from(logit) - f64::from(our_maximum)).exp())
            .sum::<f64>()
            .ln();
    let mut kl = 0.0;
    let mut reference_head = 0.0;
    let mut our_head = 0.0;
    for &(id, logit) in &position.top {
        let p = (f64::from(logit) - position.logsumexp).exp();
        let q = (f64::from(ours[id as usize]) - our_logsumexp).exp();
        reference_head += p;
        our_head += q;
        if p > 0.0 {
            kl += p * (p / q).ln();
        }
    }
    // Rounding in the fixture can push the head a hair over 1; clamp so the tail term stays defined.
    let reference_tail = (1.0 - reference_head).max(0.0);
    let our_tail = (1.0 - our_head).max(f64::MIN_POSITIVE);
    if reference_tail > 0.0 {
        kl += reference_tail * (reference_tail / our_tail).ln();
    }
    kl.max(0.0)
}

/// The index of the largest logit, the lower id on a tie.
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (index, &logit) in row.iter().enumerate() {
        if logit > row[best] {
            best = index;
        }
    }
    best as u32
}

/// Compares our logits for every stream position (`rows[i]` predicts stream token `i + 1`) with the case.
fn compare(case: &Case, rows: &[Vec<f32>]) -> Comparison {
    assert_eq!(
        rows.len(),
        case.positions.len(),
        "our model returned {} rows of logits for a stream of {} tokens",
        rows.len(),
        case.positions.len()
    );
    let mut argmax_misses = Vec::new();
    let mut confident = 0;
    let mut kl_sum = 0.0;
    let mut max_kl: f64 = 0.0;
    for (index, (position, row)) in case.positions.iter().zip(rows).enumerate() {
        if position.margin > MARGIN_THRESHOLD {
            confident += 1;
            let ours = argmax(row);
            if ours != position.argmax {
                let our_gap = row[ours as usize] - row[position.argmax as usize];
                argmax_misses.push((index, position.argmax, ours, position.margin, our_gap));
            }
        }
        let kl = kl_reference_to_ours(position, row);
        kl_sum += kl;
        max_kl = max_kl.max(kl);
    }
    Comparison {
        positions: rows.len(),
        confident,
        argmax_misses,
        mean_kl: kl_sum / rows.len().max(1) as f64,
        max_kl,
    }
}

/// Reads a committed fixture by model short name.
fn load_fixture(short_name: &str) -> Fixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama_cpp")
        .join(format!("{short_name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("could not read the fixture {}: {error}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|error| panic!("the fixture {} does not parse: {error}", path.display()))
}

/// Loads our model for one case's stream: one stage, one lane, a context just long enough.
fn load_pipeline(path: &Path, fixture: &Fixture) -> Pipeline {
    let longest = fixture
        .cases
        .iter()
        .map(|case| case.positions.len())
        .max()
        .unwrap_or(0);
    let options = StageOptions {
        lane_count: 1,
        context_length: Some(longest + 8),
    };
    Pipeline::load(path, &[], options)
        .unwrap_or_else(|error| panic!("our model could not load {}: {error}", path.display()))
}

/// Our logits at every position of `stream`, evaluated as one chunk from an empty lane.
fn teacher_forced_rows(
    pipeline: &mut Pipeline,
    stream: &[u32],
    vocabulary: usize,
) -> Vec<Vec<f32>> {
    pipeline.reset(0).expect("resetting lane 0 must work");
    let flat = pipeline
        .forward(0, 0, stream, Logits::All)
        .expect("our teacher-forced forward pass failed");
    assert_eq!(
        flat.len(),
        stream.len() * vocabulary,
        "our logits are not {} rows of the fixture's vocabulary {vocabulary}",
        stream.len()
    );
    flat.chunks_exact(vocabulary).map(<[f32]>::to_vec).collect()
}

/// Our free-running greedy tokens: the prompt as one chunk, then one token at a time, argmax each step.
fn greedy_tokens(pipeline: &mut Pipeline, prompt: &[u32], count: usize) -> Vec<u32> {
    pipeline.reset(0).expect("resetting lane 0 must work");
    let mut row = pipeline
        .forward(0, 0, prompt, Logits::Last)
        .expect("our prompt prefill failed");
    let mut tokens = Vec::with_capacity(count);
    for step in 0..count {
        let token = argmax(&row);
        tokens.push(token);
        if step + 1 < count {
            row = pipeline
                .forward(0, prompt.len() + step, &[token], Logits::Last)
                .expect("our decode step failed");
        }
    }
    tokens
}

/// Runs all three checks for one model against its fixture, printing the figures.
fn agree_with_llama_cpp(short_name: &str) {
    let fixture = load_fixture(short_name);
    let Some(path) = real_model(&fixture.model) else {
        return;
    };
    let mut pipeline = load_pipeline(&path, &fixture);
    let mut failures = Vec::new();
    let mut kl_sum = 0.0;
    let mut position_count = 0;
    for case in &fixture.cases {
        let rows = teacher_forced_rows(&mut pipeline, &case.stream(), fixture.vocabulary);
        let comparison = compare(case, &rows);
        let confident_steps = case.confident_greedy_steps();
        let ours = greedy_tokens(&mut pipeline, &case.prompt_ids, confident_steps);
        let agreeing_steps = ours
            .iter()
            .zip(&case.generated_ids)
            .take_while(|(ours, reference)| ours == reference)
            .count();
        eprintln!(
            "{short_name} {:?} (llama.cpp {}): argmax misses {}/{} confident positions {:?}, KL mean {:.2e} \
             max {:.2e}, greedy agrees {agreeing_steps}/{confident_steps} confident steps",
            case.prompt,
            fixture.cpu_variant,
            comparison.argmax_misses.len(),
            comparison.confident,
            comparison.argmax_misses,
            comparison.mean_kl,
            comparison.max_kl,
        );
        if !comparison.argmax_misses.is_empty() {
            failures.push(format!(
                "{:?}: argmax differs at confident positions (position, llama.cpp id, our id, llama.cpp margin, our \
                 margin for our id) {:?}",
                case.prompt, comparison.argmax_misses
            ));
        }
        if agreeing_steps < confident_steps {
            failures.push(format!(
                "{:?}: our greedy tokens leave llama.cpp's at step {agreeing_steps}, before its first near-tie at \
                 step {confident_steps} (ours {:?}, llama.cpp {:?})",
                case.prompt,
                &ours[..confident_steps],
                &case.generated_ids[..confident_steps]
            ));
        }
        kl_sum += comparison.mean_kl * comparison.positions as f64;
        position_count += comparison.positions;
    }
    let mean_kl = kl_sum / position_count.max(1) as f64;
    eprintln!(
        "{short_name}: mean KL(llama.cpp || ours) over {position_count} positions {mean_kl:.2e}"
    );
    if mean_kl >= MEAN_KL_LIMIT {
        failures.push(format!(
            "mean KL(llama.cpp || ours) over {position_count} positions is {mean_kl:.2e}, limit {MEAN_KL_LIMIT:.0e}"
        ));
    }
    assert!(
        failures.is_empty(),
        "{short_name} disagrees with llama.cpp ({}):\n{}",
        fixture.cpu_variant,
        failures.join("\n")
    );
}

#[test]
fn smollm2_agrees_with_llama_cpp_teacher_forced_and_greedy() {
    agree_with_llama_cpp("smollm2");
}

#[test]
fn gemma3_agrees_with_llama_cpp_teacher_forced_and_greedy() {
    agree_with_llama_cpp("gemma3");
}

/// Our logits for the first case's stream computed two ways, which must agree bit for bit: as one chunk, and as
/// the prompt followed by one token at a time. The greedy check (c) rests on this: where our batch argmax equals
/// llama.cpp's, our own decoding then produces the same token.
fn decode_equals_one_chunk(short_name: &str) {
    let fixture = load_fixture(short_name);
    let Some(path) = real_model(&fixture.model) else {
        return;
    };
    let mut pipeline = load_pipeline(&path, &fixture);
    let case = &fixture.cases[0];
    let stream = case.stream();
    let steps = 24.min(case.generated_ids.len());
    let stream = &stream[..case.prompt_ids.len() + steps];
    let reference = teacher_forced_rows(&mut pipeline, stream, fixture.vocabulary);
    pipeline.reset(0).expect("resetting lane 0 must work");
    let prompt = case.prompt_ids.len();
    let mut rows: Vec<Vec<f32>> = pipeline
        .forward(0, 0, &stream[..prompt], Logits::All)
        .expect("our prompt prefill failed")
        .chunks_exact(fixture.vocabulary)
        .map(<[f32]>::to_vec)
        .collect();
    for position in prompt..stream.len() {
        rows.push(
            pipeline
                .forward(0, position, &stream[position..position + 1], Logits::Last)
                .expect("our decode step failed"),
        );
    }
    for (position, (one_chunk, stepwise)) in reference.iter().zip(&rows).enumerate() {
        let differing = one_chunk
            .iter()
            .zip(stepwise)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differing, 0,
            "{short_name}: at position {position}, decoding token by token changes {differing} logits against \
             evaluating the stream as one chunk; some product or the attention depends on the chunk size"
        );
    }
}

#[test]
fn gemma3_decodes_bit_identically_to_one_chunk() {
    decode_equals_one_chunk("gemma3");
}

#[test]
fn smollm2_decodes_bit_identically_to_one_chunk() {
    decode_equals_one_chunk("smollm2");
}

#[test]
fn every_fixture_is_internally_consistent() {
    for short_name in ["smollm2", "gemma3"] {
        let fixture = load_fixture(short_name);
        let Some(known) = KNOWN_MODELS
            .iter()
            .find(|known| known.short_name == short_name)
        else {
            panic!("{short_name} has a fixture but is not in stage_server::model::KNOWN_MODELS");
        };
        assert_eq!(
            fixture.model, known.file_name,
            "{short_name}: the fixture was made from another file than the one the tests load"
        );
        assert_eq!(
            fixture.model_sha256, known.sha256,
            "{short_name}: the fixture was made from a model whose sha256 differs from the one xtask pins and \
             fetches; regenerate the fixture with `cargo xtask llama-ref fixtures` or fix the pinned digest"
        );
        // Only the digest check waits for the file: the rest of this test needs no model, and the tests that
        // load it fail under CI when it is missing.
        let model_dir = default_model_dir();
        if let Some(path) = real_model_in(&model_dir, &fixture.model, MissingModel::Skip) {
            assert_eq!(
                sha256_file(&path),
                fixture.model_sha256,
                "{short_name}: {} is not the file the fixture was made from; run `cargo xtask fetch-models`, \
                 which replaces a file whose digest differs",
                path.display()
            );
        }
        assert!(
            !fixture.cpu_variant.is_empty(),
            "{short_name}: the fixture does not name llama.cpp's CPU variant"
        );
        assert!(
            fixture.cases.len() >= 3,
            "{short_name}: fewer than three prompts"
        );
        for case in &fixture.cases {
            let stream = case.stream();
            assert_eq!(
                case.generated_ids.len(),
                64,
                "{short_name} {:?}: not 64 generated tokens",
                case.prompt
            );
            assert_eq!(
                case.generated_margins.len(),
                64,
                "{short_name} {:?}: not 64 greedy margins",
                case.prompt
            );
            assert_eq!(
                case.positions.len(),
                stream.len(),
                "{short_name} {:?}: one summary per stream token expected",
                case.prompt
            );
            for (index, position) in case.positions.iter().enumerate() {
                let at = format!("{short_name} {:?} position {index}", case.prompt);
                assert_eq!(
                    position.top.len(),
                    fixture.top_count,
                    "{at}: wrong top count"
                );
                assert_eq!(
                    position.top[0].0, position.argmax,
                    "{at}: the argmax is not the top entry"
                );
                assert!(
                    position.top.windows(2).all(|pair| pair[0].1 >= pair[1].1),
                    "{at}: the top entries are not sorted"
                );
                assert!(
                    (position.top[0].1 - position.top[1].1 - position.margin).abs() < 2e-3,
                    "{at}: the margin does not match the top two logits"
                );
                assert!(
                    position.logsumexp + 1e-3 >= f64::from(position.top[0].1),
                    "{at}: logsumexp is below the largest logit"
                );
                assert!(
                    position
                        .top
                        .iter()
                        .all(|&(id, _)| (id as usize) < fixture.vocabulary),
                    "{at}: a top id is outside the vocabulary"
                );
            }
        }
    }
}

#[test]
fn llama_cpp_greedy_agrees_with_its_own_teacher_forced_argmax_away_from_near_ties() {
    // The same rule we hold our model to, applied to llama.cpp against itself: its incremental greedy choice and
    // its batch argmax may differ only where one of the two evaluations saw a near-tie.
    for short_name in ["smollm2", "gemma3"] {
        let fixture = load_fixture(short_name);
        for case in &fixture.cases {
            let first_generated = case.prompt_ids.len() - 1;
            for (step, &token) in case.generated_ids.iter().enumerate() {
                let position = &case.positions[first_generated + step];
                let near_tie = position.margin <= MARGIN_THRESHOLD
                    || case.generated_margins[step] <= MARGIN_THRESHOLD;
                assert!(
                    near_tie || position.argmax == token,
                    "{short_name} {:?} step {step}: llama.cpp generated {token} but its batch argmax is {} \
                     with margins {} (batch) and {} (greedy)",
                    case.prompt,
                    position.argmax,
                    position.margin,
                    case.generated_margins[step]
                );
            }
        }
    }
}

#[test]
fn the_kl_of_a_distribution_with_itself_is_zero() {
    let row = vec![2.0_f32, 1.0, 0.5, -1.0, -3.0];
    let position = summary_of(&row, 3);
    let kl = kl_reference_to_ours(&position, &row);
    assert!(
        kl.abs() < 1e-12,
        "KL of identical logits should be 0, got {kl}"
    );
}

#[test]
fn the_kl_lumps_the_reference_tail_into_one_outcome() {
    // Reference over 4 tokens, top 2 kept; ours moves mass inside the tail only, which the lumped KL cannot see,
    // and then moves mass out of the head, which it must see.
    let reference = vec![3.0_f32, 2.0, 0.0, 0.0];
    let position = summary_of(&reference, 2);
    // Same head, tail mass 2 = e^0.5 + (2 - e^0.5) split differently from the reference's 1 + 1.
    let equal_tail = vec![3.0_f32, 2.0, 0.5, (2.0 - 0.5_f64.exp()).ln() as f32];
    let tail_mass = f64::from(equal_tail[2]).exp() + f64::from(equal_tail[3]).exp();
    assert!(
        (tail_mass - 2.0).abs() < 1e-6,
        "test setup: the tail mass must be unchanged"
    );
    let kl_equal_tail = kl_reference_to_ours(&position, &equal_tail);
    assert!(
        kl_equal_tail.abs() < 1e-6,
        "a reshuffled tail should give KL 0 when lumped, got {kl_equal_tail}"
    );

    let moved = vec![2.0_f32, 3.0, 0.0, 0.0];
    let p: Vec<f64> = softmax(&reference);
    let q: Vec<f64> = softmax(&moved);
    let expected = p[0] * (p[0] / q[0]).ln()
        + p[1] * (p[1] / q[1]).ln()
        + (p[2] + p[3]) * ((p[2] + p[3]) / (q[2] + q[3])).ln();
    let kl = kl_reference_to_ours(&position, &moved);
    assert!(
        (kl - expected).abs() < 1e-9,
        "lumped KL {kl} differs from the hand computation {expected}"
    );
    assert!(
        kl > 0.1,
        "swapping the top two tokens must give a clearly positive KL, got {kl}"
    );
}

#[test]
fn argmax_misses_count_only_where_the_reference_is_confident() {
    let confident = summary_of(&[5.0, 1.0, 0.0], 2);
    let near_tie = summary_of(&[5.0, 4.9, 0.0], 2);
    let case = Case {
        prompt: String::new(),
        prompt_ids: vec![0, 1],
        generated_ids: vec![],
        generated_margins: vec![],
        positions: vec![confident, near_tie],
    };
    let ours = vec![vec![0.0, 9.0, 0.0], vec![4.9, 5.0, 0.0]];
    let comparison = compare(&case, &ours);
    assert_eq!(comparison.positions, 2, "two positions were compared");
    assert_eq!(
        comparison.confident, 1,
        "only the first position has a margin above 0.25"
    );
    assert_eq!(
        comparison.argmax_misses,
        vec![(0, 0, 1, 4.0, 9.0)],
        "the miss at the confident position must be reported and the near-tie ignored"
    );
    assert!(
        comparison.max_kl >= comparison.mean_kl,
        "the maximum KL is at least the mean"
    );
}

#[test]
fn greedy_agreement_stops_at_the_first_near_tie() {
    let row = |margin: f32| summary_of(&[1.0 + margin, 1.0, 0.0], 2);
    let case = Case {
        prompt: String::new(),
        prompt_ids: vec![7, 8],
        generated_ids: vec![0, 0, 0],
        generated_margins: vec![1.0, 1.0, 0.1],
        positions: vec![row(1.0), row(1.0), row(0.2), row(1.0), row(1.0)],
    };
    // Step 0 is position 1 (margin 1.0), step 1 is position 2 (margin 0.2): one confident step.
    assert_eq!(
        case.confident_greedy_steps(),
        1,
        "the batch near-tie at step 1 ends the compared prefix"
    );
    let case = Case {
        positions: vec![row(1.0), row(1.0), row(1.0), row(1.0), row(1.0)],
        ..case
    };
    assert_eq!(
        case.confident_greedy_steps(),
        2,
        "the greedy near-tie at step 2 ends the compared prefix"
    );
}

/// The sha256 of a file as lower-case hex, read in 1 MiB pieces (test helper).
fn sha256_file(path: &Path) -> String {
    let mut file = std::fs::File::open(path)
        .unwrap_or_else(|error| panic!("could not open {}: {error}", path.display()));
    let mut hasher = Sha256::new();
    let mut buffer = vec![0_u8; 1 << 20];
    loop {
        let read = file
            .read(&mut buffer)
            .unwrap_or_else(|error| panic!("could not read {}: {error}", path.display()));
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
    }
    hasher
        .finalize()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Builds a fixture-style summary from a full row (test helper).
fn summary_of(row: &[f32], top_count: usize) -> Position {
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    let top: Vec<(u32, f32)> = order[..top_count]
        .iter()
        .map(|&id| (id, row[id as usize]))
        .collect();
    let maximum = f64::from(top[0].1);
    let logsumexp = maximum
        + row
            .iter()
            .map(|&x| (f64::from(x) - maximum).exp())
            .sum::<f64>()
            .ln();
    Position {
        argmax: top[0].0,
        margin: top[0].1 - top[1].1,
        logsumexp,
        top,
    }
}

/// A softmax in f64 (test helper).
fn softmax(row: &[f32]) -> Vec<f64> {
    let exponentials: Vec<f64> = row.iter().map(|&x| f64::from(x).exp()).collect();
    let sum: f64 = exponentials.iter().sum();
    exponentials.iter().map(|x| x / sum).collect()
}
