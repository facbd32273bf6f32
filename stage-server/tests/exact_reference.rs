//! The exact f64 forward (`stage_server::model::reference`) as an oracle: our stage against it on the tiny models,
//! and both engines (ours and llama.cpp's committed fixtures) against it on every agreement prompt of both real
//! models.
//!
//! Why this yardstick: the KL between two engines that each sit at the noise floor of 8-bit activations and an
//! f16 KV cache measures the sum of their errors, not either one's (`shared/reference/models.md` section 6). The
//! question that matters is which engine is closer to the model the file describes; issue 13 item 6 sets the
//! target that ours is no further from it than llama.cpp on every prompt.
//!
//! How the KL is taken: the fixtures (`tests/fixtures/llama_cpp/<model>.json`, see `tests/agreement.rs`) keep, for
//! every position of llama.cpp's teacher-forced stream, its 32 largest (id, logit) pairs and the log-sum-exp over
//! the whole vocabulary, not full rows. So llama.cpp's distribution is known exactly on its top 32 ids, and the
//! rest of its mass only as one lumped "tail" outcome. Both KLs, KL(exact || llama.cpp) and KL(exact || ours), are
//! therefore taken over the same 33 outcomes at each position: llama.cpp's top 32 ids, and everything else lumped.
//! Lumping can only lower a KL (log-sum inequality), so both are lower bounds of their full-vocabulary values, on
//! the same partition, which is what makes them comparable. Our full-vocabulary KL is printed beside them. The
//! fixture rounds logits to 4 decimals; a normalised perturbation of 1e-4 in the log-probabilities moves a KL
//! near 1e-3 by about sqrt(1e-3) x 1e-4 = 3e-6, far below the differences compared.
//!
//! Where the distance comes from (measured once by imitating each of the engines' approximations inside the
//! exact forward, full-vocabulary KL to the exact forward per prompt): ggml's 8-bit activation quantisation is
//! all of it, 2.0e-3 to 3.7e-3, the size of both engines' figures; the f16 KV cache adds 1e-7 to 7e-7 and gemma-3's
//! f16 GELU table 2e-7 to 7e-7. By product: on SmolLM2 the Q/K/V, gate/up, down and head products each give 3e-4
//! to 1.3e-3; on gemma-3 the feed-forward down product (Q4_K/Q6_K weights, so Q8_K activations, one scale per
//! 256 values) gives 1.4e-3 to 2.1e-3, about 60 %, and every other product 1.5e-4 to 4.6e-4. An engine that
//! quantises activations as ggml does lands within about a third either way of llama.cpp on a given prompt, by the
//! luck of its roundings (a straight imitation of ggml's quantisation did), so "no further than llama.cpp on every
//! prompt" holds reliably only for an engine that quantises less than llama.cpp somewhere.
//!
//! Ours does, in the output head: its activations carry a residual byte (about 15 bits, `kernels/activation.rs`).
//! Measured by replacing one kind of product at a time with an exact one, the head was the one whose exactness
//! brought every SmolLM2 prompt under llama.cpp's distance (0.73x to 0.95x) and every gemma-3 prompt closer
//! (1.07x at worst, from 1.22x); making gemma-3's Q8_0 value products exact as well moved one prompt from 0.98x
//! to 2.2x, so on gemma-3 the per-prompt ratio was at the mercy of which roundings cancel while its K-quant
//! products ran on candle with Q8_K activations (one scale per 256 values). Since session 25 they run on our
//! kernels, and every gemma-3 product takes wide activations (`model::stage::block_precision`): its distance to
//! the exact forward fell to 2e-7 to 2e-6 (what the f16 KV cache and GELU table leave), a thousandth of
//! llama.cpp's, which [`gemma3_stays_within_the_f16_caches_noise_of_the_exact_forward`] holds it to.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use serde::Deserialize;
use stage_server::model::testing::{TinyModel, real_model};
use stage_server::model::{
    ExactModel, Logits, ModelError, ModelFile, Pipeline, Stage, StageInput, StageOptions,
    StageOutput, StageSpec,
};

/// A fixture file, with only the fields this test reads.
#[derive(Debug, Deserialize)]
struct Fixture {
    model: String,
    cpu_variant: String,
    vocabulary: usize,
    cases: Vec<Case>,
}

/// One agreement prompt: its ids, llama.cpp's generated continuation, and llama.cpp's logits summaries.
#[derive(Debug, Deserialize)]
struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    positions: Vec<Position>,
}

/// llama.cpp's logits at one stream position: its top entries and the log-sum-exp over the whole vocabulary.
#[derive(Debug, Deserialize)]
struct Position {
    argmax: u32,
    margin: f32,
    logsumexp: f64,
    top: Vec<(u32, f32)>,
}

/// One prompt's figures: mean KLs over its stream positions, and how the exact argmax sits with llama.cpp's.
#[derive(Debug)]
struct PromptFigures {
    prompt: String,
    positions: usize,
    /// Mean lumped KL(exact || llama.cpp).
    llama_cpp: f64,
    /// Mean lumped KL(exact || ours), on llama.cpp's top-32 partition.
    ours: f64,
    /// Mean full-vocabulary KL(exact || ours).
    ours_full: f64,
    /// Mean lumped KL(llama.cpp || ours), the engine-to-engine figure `tests/agreement.rs` bounds.
    llama_cpp_to_ours: f64,
    /// Positions where llama.cpp's top-2 margin exceeds [`CONFIDENT_MARGIN`].
    confident: usize,
    /// Of those, positions where the exact argmax differs from llama.cpp's.
    exact_argmax_misses: usize,
    /// Time of the exact forward over the stream.
    exact_time: Duration,
}

/// Both engines against the exact forward, every prompt of one model.
#[derive(Debug)]
struct Measurement {
    short_name: &'static str,
    cpu_variant: String,
    prompts: Vec<PromptFigures>,
}

/// Whose distribution a lumped KL is taken against.
#[derive(Clone, Copy)]
enum Engine<'a> {
    /// Our full row of logits.
    Ours(&'a [f32]),
    /// llama.cpp's top entries and log-sum-exp from the fixture.
    LlamaCpp,
}

/// Margins above this are ones no noise-floor engine should flip (four times the agreement tests' 0.25).
const CONFIDENT_MARGIN: f32 = 1.0;

/// The largest mean KL(exact || llama.cpp) a correct exact forward can show on a prompt: models.md section 6
/// measured 1.6e-3 to 3.5e-3 on SmolLM2 (these fixtures give 1.5e-3 to 3.2e-3 on both models), and issue 13
/// names 3.5e-3 as the largest on a hidden set.
const LLAMA_CPP_NOISE_FLOOR: f64 = 1e-2;

/// KL(exact || engine) at one position over llama.cpp's top ids and one lumped tail (see the module docs);
/// `exact` is the exact forward's full row.
fn lumped_kl(exact: &[f64], position: &Position, engine: Engine<'_>) -> f64 {
    let exact_logsumexp = logsumexp(exact.iter().copied());
    let mut kl = 0.0;
    let (mut exact_head, mut engine_head) = (0.0, 0.0);
    let engine_logsumexp = match engine {
        Engine::Ours(row) => logsumexp(row.iter().map(|&logit| f64::from(logit))),
        Engine::LlamaCpp => position.logsumexp,
    };
    for &(id, llama_logit) in &position.top {
        let p = (exact[id as usize] - exact_logsumexp).exp();
        let q = match engine {
            Engine::Ours(row) => (f64::from(row[id as usize]) - engine_logsumexp).exp(),
            Engine::LlamaCpp => (f64::from(llama_logit) - engine_logsumexp).exp(),
        };
        exact_head += p;
        engine_head += q;
        if p > 0.0 {
            kl += p * (p / q).ln();
        }
    }
    // The fixture's 4-decimal rounding can push llama.cpp's head a hair over 1; clamp so the tail stays defined.
    let exact_tail = (1.0 - exact_head).max(0.0);
    let engine_tail = (1.0 - engine_head).max(f64::MIN_POSITIVE);
    if exact_tail > 0.0 {
        kl += exact_tail * (exact_tail / engine_tail).ln();
    }
    kl.max(0.0)
}

/// Full-vocabulary KL(exact || ours).
fn full_kl(exact: &[f64], ours: &[f32]) -> f64 {
    let exact_logsumexp = logsumexp(exact.iter().copied());
    let our_logsumexp = logsumexp(ours.iter().map(|&logit| f64::from(logit)));
    exact
        .iter()
        .zip(ours)
        .map(|(&e, &o)| {
            let log_p = e - exact_logsumexp;
            log_p.exp() * (log_p - (f64::from(o) - our_logsumexp))
        })
        .sum::<f64>()
        .max(0.0)
}

/// KL(llama.cpp || ours) lumped as `tests/agreement.rs` lumps it.
fn llama_cpp_to_ours(position: &Position, ours: &[f32]) -> f64 {
    let our_logsumexp = logsumexp(ours.iter().map(|&logit| f64::from(logit)));
    let mut kl = 0.0;
    let (mut reference_head, mut our_head) = (0.0, 0.0);
    for &(id, logit) in &position.top {
        let p = (f64::from(logit) - position.logsumexp).exp();
        let q = (f64::from(ours[id as usize]) - our_logsumexp).exp();
        reference_head += p;
        our_head += q;
        kl += p * (p / q).ln();
    }
    let reference_tail = (1.0 - reference_head).max(0.0);
    let our_tail = (1.0 - our_head).max(f64::MIN_POSITIVE);
    if reference_tail > 0.0 {
        kl += reference_tail * (reference_tail / our_tail).ln();
    }
    kl.max(0.0)
}

/// `ln(sum(e^x))`, shifted by the maximum so no term overflows.
fn logsumexp(values: impl Iterator<Item = f64> + Clone) -> f64 {
    let maximum = values.clone().fold(f64::NEG_INFINITY, f64::max);
    maximum
        + values
            .map(|value| (value - maximum).exp())
            .sum::<f64>()
            .ln()
}

/// The index of the largest logit, the lower id on a tie.
fn argmax(row: &[f64]) -> u32 {
    let mut best = 0;
    for (index, &logit) in row.iter().enumerate() {
        if logit > row[best] {
            best = index;
        }
    }
    best as u32
}

/// Reads a committed llama.cpp fixture by model short name.
fn load_fixture(short_name: &str) -> Fixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama_cpp")
        .join(format!("{short_name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("could not read the fixture {}: {error}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|error| panic!("the fixture {} does not parse: {error}", path.display()))
}

/// Measures both engines against the exact forward on every prompt of `short_name`'s fixture; `None` when the
/// model is absent and this run skips real models.
fn measure(short_name: &'static str) -> Option<Measurement> {
    let fixture = load_fixture(short_name);
    let path = real_model(&fixture.model)?;
    let exact = ExactModel::load(&path).unwrap_or_else(|error| {
        panic!("the exact forward cannot open {}: {error}", path.display())
    });
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
    let mut pipeline = Pipeline::load(&path, &[], options)
        .unwrap_or_else(|error| panic!("our model could not load {}: {error}", path.display()));
    let mut prompts = Vec::new();
    for case in &fixture.cases {
        let stream: Vec<u32> = case
            .prompt_ids
            .iter()
            .chain(&case.generated_ids)
            .copied()
            .collect();
        let started = Instant::now();
        let exact_logits = exact.forward(&stream).unwrap_or_else(|error| {
            panic!("the exact forward failed on {:?}: {error}", case.prompt)
        });
        let exact_time = started.elapsed();
        pipeline.reset(0).expect("resetting lane 0 must work");
        let ours = pipeline
            .forward(0, 0, &stream, Logits::All)
            .expect("our teacher-forced forward pass failed");
        assert_eq!(
            exact_logits.positions(),
            case.positions.len(),
            "the exact forward returned a row count other than the fixture's positions"
        );
        assert_eq!(
            exact_logits.vocab_size(),
            fixture.vocabulary,
            "the exact forward's vocabulary differs from the fixture's"
        );
        let mut figures = PromptFigures {
            prompt: case.prompt.clone(),
            positions: case.positions.len(),
            llama_cpp: 0.0,
            ours: 0.0,
            ours_full: 0.0,
            llama_cpp_to_ours: 0.0,
            confident: 0,
            exact_argmax_misses: 0,
            exact_time,
        };
        for ((position, exact_row), our_row) in case
            .positions
            .iter()
            .zip(exact_logits.rows())
            .zip(ours.chunks_exact(fixture.vocabulary))
        {
            figures.llama_cpp += lumped_kl(exact_row, position, Engine::LlamaCpp);
            figures.ours += lumped_kl(exact_row, position, Engine::Ours(our_row));
            figures.ours_full += full_kl(exact_row, our_row);
            figures.llama_cpp_to_ours += llama_cpp_to_ours(position, our_row);
            if position.margin > CONFIDENT_MARGIN {
                figures.confident += 1;
                if argmax(exact_row) != position.argmax {
                    figures.exact_argmax_misses += 1;
                }
            }
        }
        let count = figures.positions.max(1) as f64;
        figures.llama_cpp /= count;
        figures.ours /= count;
        figures.ours_full /= count;
        figures.llama_cpp_to_ours /= count;
        prompts.push(figures);
    }
    let measurement = Measurement {
        short_name,
        cpu_variant: fixture.cpu_variant,
        prompts,
    };
    print_table(&measurement);
    Some(measurement)
}

fn print_table(measurement: &Measurement) {
    let total: Duration = measurement
        .prompts
        .iter()
        .map(|figures| figures.exact_time)
        .sum();
    eprintln!(
        "{}: mean KL per prompt to the exact f64 forward, lumped on llama.cpp's ({}) top 32 + tail; exact forward \
         {:.1} s in all",
        measurement.short_name,
        measurement.cpu_variant,
        total.as_secs_f64()
    );
    eprintln!(
        "  {:<44} {:>4} {:>10} {:>10} {:>6} {:>10} {:>10} {:>9} {:>6}",
        "prompt", "pos", "llama.cpp", "ours", "ratio", "ours full", "ours-llama", "argmax", "time"
    );
    for figures in &measurement.prompts {
        let mut prompt: String = figures.prompt.escape_debug().collect();
        if prompt.len() > 42 {
            prompt.truncate(41);
            prompt.push('~');
        }
        eprintln!(
            "  {:<44} {:>4} {:>10.3e} {:>10.3e} {:>6.2} {:>10.3e} {:>10.3e} {:>4}/{:<4} {:>5.1}s",
            prompt,
            figures.positions,
            figures.llama_cpp,
            figures.ours,
            figures.ours / figures.llama_cpp,
            figures.ours_full,
            figures.llama_cpp_to_ours,
            figures.confident - figures.exact_argmax_misses,
            figures.confident,
            figures.exact_time.as_secs_f64()
        );
    }
}

/// The measurement of `short_name`, computed once per test process and shared by its tests.
fn measurement(short_name: &'static str) -> Option<&'static Measurement> {
    static SMOLLM2: OnceLock<Option<Measurement>> = OnceLock::new();
    static GEMMA3: OnceLock<Option<Measurement>> = OnceLock::new();
    let cell = match short_name {
        "smollm2" => &SMOLLM2,
        "gemma3" => &GEMMA3,
        other => panic!("no fixture for model {other}"),
    };
    cell.get_or_init(|| measure(short_name)).as_ref()
}

/// The exact forward is a credible oracle: on every prompt llama.cpp, an engine written independently of it, sits
/// at its noise floor from it and agrees with its argmax wherever llama.cpp is confident. A semantic slip in the
/// oracle (a wrong RoPE pairing, a missing norm, a window off by one) shows up here as a KL of tenths.
fn the_exact_forward_agrees_with_llama_cpp(short_name: &'static str) {
    let Some(measurement) = measurement(short_name) else {
        return;
    };
    for figures in &measurement.prompts {
        assert!(
            figures.llama_cpp < LLAMA_CPP_NOISE_FLOOR,
            "{short_name} {:?}: KL(exact || llama.cpp) is {:.2e}, above the noise floor {LLAMA_CPP_NOISE_FLOOR:.0e}; \
             the exact forward computes another model than llama.cpp does",
            figures.prompt,
            figures.llama_cpp
        );
        assert_eq!(
            figures.exact_argmax_misses, 0,
            "{short_name} {:?}: the exact forward's argmax differs from llama.cpp's at {} of {} positions where \
             llama.cpp's margin exceeds {CONFIDENT_MARGIN}",
            figures.prompt, figures.exact_argmax_misses, figures.confident
        );
    }
}

/// Issue 13 item 6: on every agreement prompt, our mean KL to the exact forward is no larger than llama.cpp's.
fn ours_is_no_further_from_the_exact_forward_than_llama_cpp(short_name: &'static str) {
    let Some(measurement) = measurement(short_name) else {
        return;
    };
    let further: Vec<String> = measurement
        .prompts
        .iter()
        .filter(|figures| figures.ours > figures.llama_cpp)
        .map(|figures| {
            format!(
                "{:?}: KL(exact || ours) {:.3e} against KL(exact || llama.cpp) {:.3e}, {:.2}x",
                figures.prompt,
                figures.ours,
                figures.llama_cpp,
                figures.ours / figures.llama_cpp
            )
        })
        .collect();
    assert!(
        further.is_empty(),
        "{short_name}: target of issue 13 item 6 missed: our logits are further from the exact f64 forward than \
         llama.cpp's ({}) on {} of {} prompts:\n{}",
        measurement.cpu_variant,
        further.len(),
        measurement.prompts.len(),
        further.join("\n")
    );
}

#[test]
fn the_exact_forward_agrees_with_llama_cpp_on_every_smollm2_prompt() {
    the_exact_forward_agrees_with_llama_cpp("smollm2");
}

#[test]
fn the_exact_forward_agrees_with_llama_cpp_on_every_gemma3_prompt() {
    the_exact_forward_agrees_with_llama_cpp("gemma3");
}

#[test]
fn smollm2_is_no_further_from_the_exact_forward_than_llama_cpp_on_every_prompt() {
    ours_is_no_further_from_the_exact_forward_than_llama_cpp("smollm2");
}

#[test]
fn gemma3_is_no_further_from_the_exact_forward_than_llama_cpp_on_every_prompt() {
    ours_is_no_further_from_the_exact_forward_than_llama_cpp("gemma3");
}

/// With every product's activations wide, gemma-3's logits differ from the exact forward by what the f16 KV cache
/// and the f16 GELU table leave (2e-7 to 2e-6 per prompt, measured; ggml's 8-bit activations give 2e-3): a bound
/// of 1e-5 fails if any product falls back to 8-bit activations (one was enough for 1e-4 and more) or to a
/// quantisation coarser than the model's.
#[test]
fn gemma3_stays_within_the_f16_caches_noise_of_the_exact_forward() {
    const BOUND: f64 = 1e-5;
    let Some(measurement) = measurement("gemma3") else {
        return;
    };
    for figures in &measurement.prompts {
        assert!(
            figures.ours_full <= BOUND,
            "gemma3 {:?}: KL(exact || ours) over the whole vocabulary is {:.3e}, above {BOUND:.0e}: a product no \
             longer takes wide activations, or computes something else",
            figures.prompt,
            figures.ours_full
        );
    }
}

/// Writes a tiny model into a per-process scratch directory and returns its path.
fn scratch_model(model: &TinyModel) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "stage-server-exact-{}-{}",
        std::process::id(),
        model.file_name()
    ));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    model
        .write_to_dir(&dir)
        .expect("writing the tiny model failed")
}

/// Rewrites the model at `path` with its token embeddings in F32 (everything else as it was) and returns the new
/// file's path.
///
/// The tiny models store their embeddings as Q8_0, which costs nothing in a lookup (a dequantised row is exact)
/// but not in a tied output head: gemma3 multiplies by the embedding matrix, and our stage's Q8_0 product
/// quantises its input rows (to about 15 bits in the head, still an error above the f16 rounding this test
/// allows). With F32 embeddings no product in our stage quantises anything.
fn with_float_embeddings(path: &Path) -> PathBuf {
    let mut reader = std::fs::File::open(path).expect("open the tiny model");
    let content = gguf_file::Content::read(&mut reader).expect("read the tiny model's header");
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (name, info) in &content.tensor_infos {
        let tensor = info
            .read(&mut reader, content.tensor_data_offset, &Device::Cpu)
            .expect("read a tensor of the tiny model");
        let tensor = if name == "token_embd.weight" {
            let values = tensor
                .dequantize(&Device::Cpu)
                .expect("dequantise the embeddings");
            QTensor::quantize(&values, GgmlDType::F32).expect("store the embeddings as F32")
        } else {
            tensor
        };
        tensors.push((name.clone(), tensor));
    }
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(key, value)| (key.as_str(), value))
        .collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors
        .iter()
        .map(|(name, tensor)| (name.as_str(), tensor))
        .collect();
    let float_path = path.with_extension("float-embeddings.gguf");
    let mut writer = std::io::BufWriter::new(
        std::fs::File::create(&float_path).expect("create the float-embedding model"),
    );
    gguf_file::write(&mut writer, &metadata, &tensor_refs)
        .expect("write the float-embedding model");
    std::io::Write::flush(&mut writer).expect("write the float-embedding model");
    float_path
}

/// A tiny float model's logits from our stage and from the exact forward, over a stream longer than gemma3's
/// window of 4, so sliding-window and global layers both matter.
fn tiny_logits(model: &TinyModel) -> (Vec<f32>, Vec<f64>, usize) {
    let quantised_embeddings = scratch_model(model);
    let path = with_float_embeddings(&quantised_embeddings);
    let file = ModelFile::open(&path).expect("open the tiny model");
    let vocab = file.config().vocab_size;
    let tokens: Vec<u32> = (0..40)
        .map(|index| (index * 37 + 11) % vocab as u32)
        .collect();
    let mut stage = Stage::from_file(
        &file,
        StageSpec::whole(file.config().block_count),
        StageOptions::default(),
    )
    .expect("load the tiny stage");
    let StageOutput::Logits(ours) = stage
        .forward(0, 0, StageInput::Tokens(&tokens), Logits::All)
        .expect("our forward pass over the tiny model")
    else {
        panic!("a whole-model stage returned activations instead of logits");
    };
    let exact = ExactModel::from_file(file)
        .expect("open the tiny model for the exact forward")
        .forward(&tokens)
        .expect("the exact forward over the tiny model");
    assert_eq!(
        exact.values().len(),
        ours.len(),
        "the exact forward and our stage return different numbers of logits"
    );
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&quantised_embeddings);
    (ours, exact.values().to_vec(), vocab)
}

/// With F32 weights (and F32 embeddings, see [`with_float_embeddings`]) our stage quantises no activation, so
/// what separates it from the exact forward is its f16 rounding: keys and values in the cache, and for gemma3
/// the GELU table's f16 input and output, each carry a relative error of up to 2^-11 = 4.9e-4; everything else
/// is f32 (6e-8). Measured: at most 1.0e-3 (llama) and 3.6e-3 (gemma3) on logits of magnitude up to 4.2; with
/// those roundings imitated in the exact forward the gap fell to 3e-5 (llama) and 8e-4 (gemma3, where an
/// imitated rounding can still land on the other side of a tie). The bound of 1e-2 is three times the worst
/// measured and far below what a semantic slip does: leaving RoPE out moved these logits by 1.8 and 3.2.
fn tiny_float_model_matches_the_exact_forward(model: TinyModel) {
    const LOGIT_TOLERANCE: f64 = 1e-2;
    let (ours, exact, vocab) = tiny_logits(&model);
    let mut worst = (0.0f64, 0usize);
    for (index, (&our, &exact)) in ours.iter().zip(&exact).enumerate() {
        let difference = (f64::from(our) - exact).abs();
        if difference > worst.0 {
            worst = (difference, index);
        }
    }
    let spread = exact
        .iter()
        .copied()
        .fold(0.0f64, |most, x| most.max(x.abs()));
    eprintln!(
        "{}: largest |ours - exact| {:.2e} (position {}, token {}), largest |exact logit| {spread:.2}",
        model.file_name(),
        worst.0,
        worst.1 / vocab,
        worst.1 % vocab
    );
    assert!(
        worst.0 <= LOGIT_TOLERANCE,
        "{}: our stage's logit at position {} token {} is {:.2e} from the exact forward's, more than f16 \
         rounding explains ({LOGIT_TOLERANCE:.0e}); the two compute different models",
        model.file_name(),
        worst.1 / vocab,
        worst.1 % vocab,
        worst.0
    );
}

#[test]
fn a_tiny_float_llama_matches_the_exact_forward_within_f16_rounding() {
    tiny_float_model_matches_the_exact_forward(TinyModel::llama(GgmlDType::F32));
}

#[test]
fn a_tiny_float_gemma3_matches_the_exact_forward_within_f16_rounding() {
    tiny_float_model_matches_the_exact_forward(TinyModel::gemma3(GgmlDType::F32));
}

#[test]
fn the_exact_forward_refuses_bad_tokens_with_errors() {
    let path = scratch_model(&TinyModel::llama(GgmlDType::Q8_0));
    let exact = ExactModel::load(&path).expect("open the tiny model for the exact forward");
    let vocab = exact.config().vocab_size as u32;
    assert!(
        matches!(
            exact.forward(&[1, vocab]),
            Err(ModelError::TokenOutOfRange { token, .. }) if token == vocab
        ),
        "a token outside the vocabulary must be refused by name"
    );
    assert!(
        matches!(exact.forward(&[]), Err(ModelError::EmptyChunk)),
        "an empty sequence must be refused"
    );
    let _ = std::fs::remove_file(&path);
}
