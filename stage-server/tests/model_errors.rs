//! Bad input to the compute core: broken files, impossible ranges and chunks give clear errors, never panics.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{self, Value};
use stage_server::model::testing::TinyModel;
use stage_server::model::{
    Logits, ModelError, ModelFile, Pipeline, Stage, StageInput, StageOptions, StageSpec,
};

/// A scratch directory for one test; error texts show it as `[dir]`.
fn scratch_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("stage-server-errors-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    dir
}

/// The error's text with the scratch directory replaced, so snapshots do not depend on it.
fn text(error: &ModelError, dir: &Path) -> String {
    error
        .to_string()
        .replace(&dir.display().to_string(), "[dir]")
}

fn tiny_llama(dir: &Path) -> PathBuf {
    TinyModel::llama(GgmlDType::Q8_0)
        .write_to_dir(dir)
        .expect("writing the tiny model failed")
}

/// Replaces the first occurrence of `from` in the file with `to` (same length).
fn patch(path: &Path, from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len(), "a patch must keep the length");
    let mut bytes = std::fs::read(path).expect("reading the model to patch");
    let at = bytes
        .windows(from.len())
        .position(|window| window == from)
        .expect("the bytes to patch are not in the file");
    bytes[at..at + to.len()].copy_from_slice(to);
    std::fs::write(path, bytes).expect("writing the patched model");
}

fn open_error(path: &Path) -> ModelError {
    match ModelFile::open(path) {
        Ok(_) => panic!("{} opened although it is broken", path.display()),
        Err(error) => error,
    }
}

#[test]
fn a_truncated_file_names_the_first_tensor_it_cuts() {
    let dir = scratch_dir("truncated");
    let path = tiny_llama(&dir);
    let length = std::fs::metadata(&path).expect("stat").len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    file.set_len(length * 6 / 10).expect("truncate");
    let error = open_error(&path);
    assert!(matches!(error, ModelError::Gguf(_)), "got {error:?}");
    insta::assert_snapshot!("truncated_data", text(&error, &dir));

    file.set_len(100).expect("truncate the header");
    let error = open_error(&path);
    insta::assert_snapshot!("truncated_header", text(&error, &dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_that_is_not_gguf_is_refused() {
    let dir = scratch_dir("not-gguf");
    let path = dir.join("notes.gguf");
    std::fs::write(&path, b"this is a text file and no model at all").expect("write");
    insta::assert_snapshot!("not_gguf", text(&open_error(&path), &dir));
    let missing = dir.join("absent.gguf");
    let error = open_error(&missing);
    assert!(matches!(error, ModelError::Io { .. }), "got {error:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_architecture_is_named() {
    let dir = scratch_dir("arch");
    let path = dir.join("mamba.gguf");
    let architecture = Value::String("mamba".to_string());
    let tensor = candle_core::quantized::QTensor::quantize(
        &candle_core::Tensor::zeros((4, 32), candle_core::DType::F32, &candle_core::Device::Cpu)
            .expect("zeros"),
        GgmlDType::F32,
    )
    .expect("quantize");
    let mut file = std::fs::File::create(&path).expect("create");
    gguf_file::write(
        &mut file,
        &[("general.architecture", &architecture)],
        &[("token_embd.weight", &tensor)],
    )
    .expect("write gguf");
    drop(file);
    let error = open_error(&path);
    assert!(
        matches!(error, ModelError::UnsupportedArchitecture { .. }),
        "got {error:?}"
    );
    insta::assert_snapshot!("unknown_architecture", text(&error, &dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_tensor_type_is_refused() {
    let dir = scratch_dir("dtype");
    let path = tiny_llama(&dir);
    // The tensor directory entry: name, u32 dimension count, u64 dimensions, then the u32 type id.
    let name = b"blk.0.attn_q.weight";
    let mut bytes = std::fs::read(&path).expect("read");
    let at = bytes
        .windows(name.len())
        .position(|window| window == name)
        .expect("the tensor name is in the directory")
        + name.len();
    let dimensions = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
    let type_at = at + 4 + 8 * dimensions;
    bytes[type_at..type_at + 4].copy_from_slice(&20u32.to_le_bytes());
    std::fs::write(&path, bytes).expect("write");
    let error = open_error(&path);
    assert!(
        matches!(error, ModelError::UnsupportedTensorType { .. }),
        "got {error:?}"
    );
    insta::assert_snapshot!("unknown_tensor_type", text(&error, &dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_tensor_is_named_and_only_stages_that_need_it_fail() {
    let dir = scratch_dir("missing-tensor");
    let path = tiny_llama(&dir);
    patch(&path, b"blk.1.ffn_up.weight", b"blk.1.ffn_uq.weight");
    let error = Stage::load(&path, StageSpec::whole(4), StageOptions::default())
        .expect_err("a stage over layer 1 loaded without blk.1.ffn_up");
    insta::assert_snapshot!("missing_tensor", text(&error, &dir));
    let tail = StageSpec {
        layers: 2..4,
        first: false,
        last: true,
    };
    Stage::load(&path, tail, StageOptions::default())
        .expect("a stage over layers 2..4 needs nothing from layer 1");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn layer_ranges_outside_the_model_are_refused() {
    let dir = scratch_dir("range");
    let path = tiny_llama(&dir);
    for (name, layers) in [("range_past_end", 2..9), ("range_empty", 3..3)] {
        let spec = StageSpec {
            layers,
            first: false,
            last: false,
        };
        let error = Stage::load(&path, spec, StageOptions::default())
            .expect_err("an impossible layer range loaded");
        insta::assert_snapshot!(name, text(&error, &dir));
    }
    let error = Pipeline::load(&path, &[3, 2], StageOptions::default())
        .expect_err("a falling split loaded");
    assert!(matches!(error, ModelError::Split { .. }), "got {error:?}");
    insta::assert_snapshot!("split_falling", text(&error, &dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_first_stage_not_at_layer_zero_or_a_last_stage_short_of_the_end_is_refused() {
    let dir = scratch_dir("ends");
    let path = tiny_llama(&dir);
    let cases = [
        (
            "first_stage_not_at_zero",
            StageSpec {
                layers: 1..4,
                first: true,
                last: true,
            },
        ),
        (
            "last_stage_short_of_the_end",
            StageSpec {
                layers: 0..3,
                first: true,
                last: true,
            },
        ),
    ];
    for (name, spec) in cases {
        let error = Stage::load(&path, spec, StageOptions::default())
            .expect_err("a stage whose ends do not match its role loaded");
        assert!(
            matches!(error, ModelError::StageEnds { .. }),
            "{name}: expected StageEnds, got {error:?}"
        );
        insta::assert_snapshot!(name, text(&error, &dir));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lanes_whose_full_caches_cannot_fit_the_machine_are_refused_at_load_naming_the_flags() {
    let dir = scratch_dir("cache-memory");
    let path = tiny_llama(&dir);
    let options = StageOptions {
        lane_count: 1 << 40,
        context_length: None,
    };
    let error =
        Stage::load(&path, StageSpec::whole(4), options).expect_err("2^40 lanes were accepted");
    assert!(
        matches!(error, ModelError::CacheMemory { lanes, start: 0, end: 4, .. } if lanes == 1 << 40),
        "{error:?}"
    );
    // The machine's available memory differs from host to host.
    let ModelError::CacheMemory { available_mib, .. } = error else {
        unreachable!()
    };
    insta::assert_snapshot!(
        "cache_memory",
        text(&error, &dir).replace(&format!("the {available_mib} MiB"), "the [available] MiB")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stand-in output so `trim`'s result fits the same check as `forward`'s.
fn whole_output() -> stage_server::model::StageOutput {
    stage_server::model::StageOutput::Activations(Vec::new())
}

#[test]
fn chunks_the_stage_cannot_run_are_refused() {
    let dir = scratch_dir("chunks");
    let path = tiny_llama(&dir);
    let options = StageOptions {
        lane_count: 2,
        context_length: Some(8),
    };
    let mut whole = Stage::load(&path, StageSpec::whole(4), options.clone()).expect("load");
    let mut texts = Vec::new();
    let mut expect_error = |what: &str, result: Result<_, ModelError>| match result {
        Ok(_) => panic!("{what} was accepted"),
        Err(error) => texts.push(format!("{what}: {error}")),
    };
    let long_prompt: Vec<u32> = (10..19).collect();
    expect_error(
        "over-long prompt",
        whole.forward(0, 0, StageInput::Tokens(&long_prompt), Logits::Last),
    );
    expect_error(
        "token outside the vocabulary",
        whole.forward(0, 0, StageInput::Tokens(&[5, 100_000]), Logits::Last),
    );
    expect_error(
        "lane out of range",
        whole.forward(2, 0, StageInput::Tokens(&[5]), Logits::Last),
    );
    expect_error(
        "empty chunk",
        whole.forward(0, 0, StageInput::Tokens(&[]), Logits::Last),
    );
    expect_error(
        "activations to the first stage",
        whole.forward(0, 0, StageInput::Activations(&[0.0; 64]), Logits::Last),
    );
    whole
        .forward(1, 0, StageInput::Tokens(&[1, 2, 3]), Logits::Last)
        .expect("a valid chunk");
    expect_error(
        "a chunk at the wrong position",
        whole.forward(1, 5, StageInput::Tokens(&[4]), Logits::Last),
    );
    expect_error(
        "trim beyond the end",
        whole.trim(1, 4).map(|()| whole_output()),
    );

    let mut middle = Stage::load(
        &path,
        StageSpec {
            layers: 1..3,
            first: false,
            last: false,
        },
        options,
    )
    .expect("load the middle stage");
    expect_error(
        "a partial activation row",
        middle.forward(0, 0, StageInput::Activations(&[0.5; 100]), Logits::Last),
    );
    expect_error(
        "tokens to a middle stage",
        middle.forward(0, 0, StageInput::Tokens(&[1]), Logits::Last),
    );
    let mut poisoned = vec![0.5f32; 128];
    poisoned[70] = f32::NAN;
    expect_error(
        "NaN activations",
        middle.forward(0, 0, StageInput::Activations(&poisoned), Logits::Last),
    );
    assert_eq!(
        middle.lane_length(0).expect("lane 0"),
        0,
        "a chunk that produced NaN must not stay in the cache"
    );
    insta::assert_snapshot!("chunk_errors", texts.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}
