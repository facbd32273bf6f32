//! Lanes and sessions: independence, trim, reset, chunked prefill and seeded sampling through the public API.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use stage_server::model::testing::{TINY_EOS, TinyModel};
use stage_server::model::{
    GenerateOptions, Logits, Pipeline, Sampler, SamplingParams, Stage, StageInput, StageOptions,
    StageOutput, StageSpec,
};

fn scratch_model(name: &str, model: &TinyModel) -> (PathBuf, PathBuf) {
    let dir =
        std::env::temp_dir().join(format!("stage-server-lanes-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    let path = model
        .write_to_dir(&dir)
        .expect("writing the tiny model failed");
    (dir, path)
}

fn logits(output: StageOutput) -> Vec<f32> {
    match output {
        StageOutput::Logits(values) => values,
        StageOutput::Activations(_) => panic!("a whole-model stage returned activations"),
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|value| value.to_bits()).collect()
}

fn whole(path: &Path, lane_count: usize) -> Stage {
    let config = stage_server::model::ModelFile::open(path)
        .expect("open")
        .config()
        .clone();
    Stage::load(
        path,
        StageSpec::whole(config.block_count),
        StageOptions {
            lane_count,
            context_length: None,
        },
    )
    .expect("load")
}

#[test]
fn a_trimmed_lane_decodes_exactly_like_a_fresh_one() {
    for model in [
        TinyModel::llama(GgmlDType::Q4_1),
        TinyModel::gemma3(GgmlDType::Q5_0),
    ] {
        let (dir, path) = scratch_model("trim", &model);
        let prompt = [1, 40, 41, 42, 43, 44];
        let mut fresh = whole(&path, 1);
        fresh
            .forward(0, 0, StageInput::Tokens(&prompt), Logits::Last)
            .expect("prefill");
        let fresh_a = logits(
            fresh
                .forward(0, 6, StageInput::Tokens(&[100]), Logits::Last)
                .expect("a"),
        );
        let fresh_b = logits(
            fresh
                .forward(0, 7, StageInput::Tokens(&[101]), Logits::Last)
                .expect("b"),
        );

        let mut reused = whole(&path, 1);
        reused
            .forward(0, 0, StageInput::Tokens(&prompt), Logits::Last)
            .expect("prefill");
        for (offset, token) in [300u32, 301, 302, 303, 304].into_iter().enumerate() {
            reused
                .forward(0, 6 + offset, StageInput::Tokens(&[token]), Logits::Last)
                .expect("a detour token");
        }
        reused.trim(0, 6).expect("trim back to the prompt");
        assert_eq!(
            reused.lane_length(0).expect("lane"),
            6,
            "trim must set the lane length"
        );
        let again_a = logits(
            reused
                .forward(0, 6, StageInput::Tokens(&[100]), Logits::Last)
                .expect("a"),
        );
        let again_b = logits(
            reused
                .forward(0, 7, StageInput::Tokens(&[101]), Logits::Last)
                .expect("b"),
        );
        assert_eq!(
            bits(&fresh_a),
            bits(&again_a),
            "{}: first step after trim differs",
            model.file_name()
        );
        assert_eq!(
            bits(&fresh_b),
            bits(&again_b),
            "{}: second step after trim differs",
            model.file_name()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn lanes_do_not_see_each_others_tokens_and_reset_starts_over() {
    let (dir, path) = scratch_model("lanes", &TinyModel::llama(GgmlDType::Q8_0));
    let first_prompt = [1, 50, 51, 52];
    let second_prompt = [1, 60, 61, 62, 63, 64, 65];
    let solo = |prompt: &[u32]| {
        let mut stage = whole(&path, 1);
        let prefill = logits(
            stage
                .forward(0, 0, StageInput::Tokens(prompt), Logits::Last)
                .expect("prefill"),
        );
        let step = logits(
            stage
                .forward(0, prompt.len(), StageInput::Tokens(&[7]), Logits::Last)
                .expect("step"),
        );
        (prefill, step)
    };
    let (first_prefill, first_step) = solo(&first_prompt);
    let (second_prefill, second_step) = solo(&second_prompt);

    let mut shared = whole(&path, 3);
    let a = logits(
        shared
            .forward(0, 0, StageInput::Tokens(&first_prompt), Logits::Last)
            .expect("a"),
    );
    let b = logits(
        shared
            .forward(2, 0, StageInput::Tokens(&second_prompt), Logits::Last)
            .expect("b"),
    );
    let a_step = logits(
        shared
            .forward(0, 4, StageInput::Tokens(&[7]), Logits::Last)
            .expect("a step"),
    );
    let b_step = logits(
        shared
            .forward(2, 7, StageInput::Tokens(&[7]), Logits::Last)
            .expect("b step"),
    );
    assert_eq!(
        bits(&a),
        bits(&first_prefill),
        "lane 0's prefill depends on other lanes"
    );
    assert_eq!(
        bits(&b),
        bits(&second_prefill),
        "lane 2's prefill depends on other lanes"
    );
    assert_eq!(
        bits(&a_step),
        bits(&first_step),
        "lane 0's decode depends on other lanes"
    );
    assert_eq!(
        bits(&b_step),
        bits(&second_step),
        "lane 2's decode depends on other lanes"
    );

    shared.reset(0).expect("reset lane 0");
    assert_eq!(
        shared.lane_length(0).expect("lane"),
        0,
        "reset must empty the lane"
    );
    let again = logits(
        shared
            .forward(0, 0, StageInput::Tokens(&first_prompt), Logits::Last)
            .expect("again"),
    );
    assert_eq!(
        bits(&again),
        bits(&first_prefill),
        "a reset lane must behave like a new one"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_prompt_prefilled_in_chunks_gives_bit_identical_logits_to_one_chunk() {
    for model in [
        TinyModel::llama(GgmlDType::Q8_0),
        TinyModel::gemma3(GgmlDType::Q8_0),
    ] {
        let (dir, path) = scratch_model("chunks", &model);
        let prompt: Vec<u32> = (1..12).map(|index| 20 + index * 7).collect();
        let mut one = whole(&path, 1);
        let reference = logits(
            one.forward(0, 0, StageInput::Tokens(&prompt), Logits::All)
                .expect("one chunk"),
        );
        let mut chunked = whole(&path, 1);
        let mut rows = Vec::new();
        for (start, chunk) in [
            (0usize, &prompt[..3]),
            (3, &prompt[3..8]),
            (8, &prompt[8..]),
        ] {
            rows.extend(logits(
                chunked
                    .forward(0, start, StageInput::Tokens(chunk), Logits::All)
                    .expect("a chunk"),
            ));
        }
        assert_eq!(
            rows.len(),
            reference.len(),
            "one row per prompt token either way"
        );
        let worst = reference
            .iter()
            .zip(&rows)
            .fold(0f32, |max, (a, b)| max.max((a - b).abs()));
        let differing = reference
            .iter()
            .zip(&rows)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        // The kernels are batch-invariant and attention computes each query row on its own, so chunking must
        // not change a single bit; any difference means a wrong position or mask, or a batch-dependent kernel.
        assert_eq!(
            differing,
            0,
            "{}: chunked prefill changes {differing} logits (largest change {worst}); positions, the mask or a \
             batch-dependent kernel are wrong",
            model.file_name()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn sampling_with_a_seed_is_repeatable_and_the_seed_matters() {
    let (dir, path) = scratch_model("seed", &TinyModel::gemma3(GgmlDType::Q4K));
    let mut pipeline = Pipeline::load(&path, &[3], StageOptions::default()).expect("load");
    let options = GenerateOptions {
        max_tokens: 24,
        stop_tokens: vec![TINY_EOS],
        keep_logits: false,
    };
    let mut run = |seed: u64| {
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed,
            ..SamplingParams::default()
        });
        pipeline
            .generate(0, &[1, 300, 301], &mut sampler, &options, |_| {})
            .expect("generate")
            .tokens
    };
    let first = run(11);
    assert_eq!(first, run(11), "the same seed gave different tokens");
    assert_ne!(
        first,
        run(12),
        "seeds 11 and 12 gave the same 24 tokens at temperature 1.5"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stages_and_pipelines_can_move_to_another_thread() {
    fn movable<T: Send>() {}
    movable::<Stage>();
    movable::<Pipeline>();
    movable::<Sampler>();
}

#[test]
fn a_prompt_longer_than_one_prefill_chunk_generates_the_same_split_and_unsplit() {
    let model = TinyModel {
        context_length: 2048,
        ..TinyModel::llama(GgmlDType::Q4_0)
    };
    let (dir, path) = scratch_model("long-prompt", &model);
    let prompt: Vec<u32> = (0..stage_server::model::PREFILL_CHUNK as u32 + 90)
        .map(|index| 3 + index * 13 % 300)
        .collect();
    let options = GenerateOptions {
        max_tokens: 4,
        stop_tokens: Vec::new(),
        keep_logits: true,
    };
    let generate = |boundaries: &[usize]| {
        let mut pipeline =
            Pipeline::load(&path, boundaries, StageOptions::default()).expect("load");
        let mut sampler = Sampler::new(SamplingParams::default());
        let generation = pipeline
            .generate(0, &prompt, &mut sampler, &options, |_| {})
            .expect("generate after a two-chunk prefill");
        assert_eq!(
            pipeline.stages()[0].lane_length(0).expect("lane"),
            prompt.len() + 3,
            "the lane should hold the prompt and the decoded tokens but the last"
        );
        generation
    };
    let unsplit = generate(&[]);
    let split = generate(&[2]);
    assert_eq!(unsplit.tokens.len(), 4, "four tokens were asked for");
    assert_eq!(
        unsplit.tokens, split.tokens,
        "split and unsplit chose different tokens"
    );
    assert_eq!(
        bits(&unsplit.logits),
        bits(&split.logits),
        "split and unsplit logits differ"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
