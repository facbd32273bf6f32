//! Truncated and corrupt GGUF files give a clear error from `gguf_check::validate`, never a panic or a huge allocation.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{self, Value};
use proptest::prelude::*;
use stage_server::model::gguf_check::{GgufError, Summary, validate};
use stage_server::model::testing::{TinyModel, real_model};
use stage_server::model::{
    GEMMA3_FILE, Logits, ModelError, ModelFile, Pipeline, SMOLLM2_FILE, Stage, StageInput,
    StageOptions, StageSpec,
};

/// A scratch directory for one test; error texts show it as `[dir]`.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stage-server-gguf-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    dir
}

/// The error's text with the scratch directory replaced, so snapshots do not depend on it.
fn text(error: &GgufError, dir: &Path) -> String {
    error
        .to_string()
        .replace(&dir.display().to_string(), "[dir]")
}

/// The bytes of the tiny llama (Q8_0 weights) and what `validate` says about them.
fn tiny_llama_bytes(dir: &Path) -> (Vec<u8>, Summary) {
    let path = TinyModel::llama(GgmlDType::Q8_0)
        .write_to_dir(dir)
        .expect("writing the tiny model failed");
    let summary = validate(&path).expect("the freshly written tiny llama does not validate");
    (
        std::fs::read(&path).expect("reading the tiny model"),
        summary,
    )
}

/// Writes `bytes` to `dir/name` and validates that file.
fn validate_bytes(dir: &Path, name: &str, bytes: &[u8]) -> Result<Summary, GgufError> {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("writing a corrupted copy");
    validate(&path)
}

/// Where `needle` first occurs in `bytes`.
fn find(bytes: &[u8], needle: &[u8]) -> usize {
    bytes
        .windows(needle.len())
        .position(|window| window == needle)
        .unwrap_or_else(|| panic!("{:?} is not in the file", String::from_utf8_lossy(needle)))
}

/// Overwrites the bytes at `at` with `value`.
fn put(bytes: &mut [u8], at: usize, value: &[u8]) {
    bytes[at..at + value.len()].copy_from_slice(value);
}

/// Where the type id of tensor `name`'s directory entry is.
fn tensor_type_offset(bytes: &[u8], name: &str) -> usize {
    let at = find(bytes, name.as_bytes()) + name.len();
    let dimensions = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
    at + 4 + 8 * dimensions
}

/// A minimal GGUF file with `metadata` and one small F32 tensor, written by candle's writer.
fn small_gguf(path: &Path, metadata: &[(&str, &Value)]) {
    let tensor = candle_core::quantized::QTensor::quantize(
        &candle_core::Tensor::zeros((2, 32), candle_core::DType::F32, &candle_core::Device::Cpu)
            .expect("zeros"),
        GgmlDType::F32,
    )
    .expect("quantize");
    let mut file = std::fs::File::create(path).expect("create");
    gguf_file::write(&mut file, metadata, &[("token_embd.weight", &tensor)]).expect("write gguf");
}

/// Small files whose `general.alignment` candle would divide by, written as `dir/NAME.gguf`.
fn bad_alignment_files(dir: &Path) -> Vec<(&'static str, PathBuf)> {
    let architecture = Value::String("llama".to_string());
    [
        ("alignment_zero", 0u32),
        ("alignment_not_a_power_of_two", 48),
    ]
    .into_iter()
    .map(|(name, alignment)| {
        let path = dir.join(format!("{name}.gguf"));
        small_gguf(
            &path,
            &[
                ("general.architecture", &architecture),
                ("general.alignment", &Value::U32(alignment)),
            ],
        );
        (name, path)
    })
    .collect()
}

#[test]
fn the_tiny_models_pass_and_their_summary_matches_the_file() {
    let dir = scratch_dir("valid");
    for model in [
        TinyModel::llama(GgmlDType::Q8_0),
        TinyModel::llama(GgmlDType::Q4_1),
        TinyModel::gemma3(GgmlDType::Q4K),
        TinyModel::gemma3(GgmlDType::F16),
    ] {
        let path = model.write_to_dir(&dir).expect("writing a tiny model");
        let summary = validate(&path)
            .unwrap_or_else(|error| panic!("{} does not validate: {error}", path.display()));
        let file_size = std::fs::metadata(&path).expect("stat").len();
        assert_eq!(
            summary.file_size, file_size,
            "the summary's file size is wrong"
        );
        assert_eq!(summary.version, 2, "candle's writer writes version 2");
        assert_eq!(
            summary.architecture.as_deref(),
            Some(model.architecture.name()),
            "the architecture was not read"
        );
        assert_eq!(summary.alignment, 32, "the default alignment was not used");
        assert_eq!(
            summary.tensor_data_offset % 32,
            0,
            "the data section is not aligned"
        );
        assert!(
            summary.tensor_data_end <= file_size
                && summary.tensor_data_end > summary.tensor_data_offset,
            "the tensor data end {} is not inside the file of {file_size} bytes",
            summary.tensor_data_end
        );
        let content = gguf_file::Content::read(&mut std::fs::File::open(&path).expect("open"))
            .expect("candle reads the tiny model");
        assert_eq!(
            summary.tensor_count as usize,
            content.tensor_infos.len(),
            "tensor count"
        );
        assert_eq!(
            summary.metadata_count as usize,
            content.metadata.len(),
            "metadata count"
        );
        assert_eq!(
            summary.tensor_data_offset, content.tensor_data_offset,
            "the data section starts where candle puts it"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_real_models_pass_when_present() {
    for name in [SMOLLM2_FILE, GEMMA3_FILE] {
        let Some(path) = real_model(name) else {
            continue;
        };
        let summary = validate(&path)
            .unwrap_or_else(|error| panic!("{} does not validate: {error}", path.display()));
        let content = gguf_file::Content::read(&mut std::fs::File::open(&path).expect("open"))
            .expect("candle reads the real model");
        assert_eq!(
            summary.tensor_count as usize,
            content.tensor_infos.len(),
            "{name}: tensor count"
        );
        assert_eq!(
            summary.tensor_data_offset, content.tensor_data_offset,
            "{name}: data offset"
        );
        assert!(
            summary.architecture.is_some(),
            "{name}: no architecture found"
        );
    }
}

#[test]
fn truncation_anywhere_in_the_header_sections_is_an_error() {
    let dir = scratch_dir("truncate-header");
    let (bytes, summary) = tiny_llama_bytes(&dir);
    let header_end = summary.tensor_data_offset;
    let path = dir.join("cut.gguf");
    std::fs::write(&path, &bytes[..header_end as usize]).expect("writing the header");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("opening the copy");
    // Shortening one file from the end visits every cut without rewriting the header each time.
    for length in (0..header_end).rev() {
        file.set_len(length).expect("truncating the copy");
        let result = validate(&path);
        assert!(
            result.is_err(),
            "a file cut to {length} of {header_end} header bytes validated"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn truncation_inside_the_tensor_data_names_a_tensor_it_cuts() {
    let dir = scratch_dir("truncate-data");
    let (bytes, summary) = tiny_llama_bytes(&dir);
    let start = summary.tensor_data_offset as usize;
    let end = summary.tensor_data_end as usize;
    let step = ((end - start) / 97).max(1);
    for length in (start..end).step_by(step).chain([end - 1]) {
        match validate_bytes(&dir, "cut.gguf", &bytes[..length]) {
            Err(GgufError::TensorOutOfFile {
                file_size,
                end: tensor_end,
                ..
            }) => {
                assert_eq!(
                    file_size, length as u64,
                    "the error reports the wrong file size"
                );
                assert!(
                    tensor_end > u128::from(file_size),
                    "the named tensor fits the file"
                );
            }
            other => panic!("a file cut to {length} bytes inside the data gave {other:?}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Named corruptions of the tiny llama's `bytes`, each aimed at one field of the header sections.
fn corruptions(bytes: &[u8], summary: &Summary) -> Vec<(&'static str, Vec<u8>)> {
    let bytes = bytes.to_vec();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();

    cases.push((
        "not_gguf",
        b"this is a text file and no model at all".to_vec(),
    ));
    let mut version = bytes.clone();
    put(&mut version, 4, &7u32.to_le_bytes());
    cases.push(("unsupported_version", version));
    cases.push(("truncated_header", bytes[..100].to_vec()));
    let cut = (summary.tensor_data_offset + summary.tensor_data_end) / 2;
    cases.push(("truncated_data", bytes[..cut as usize].to_vec()));

    let mut tensor_count = bytes.clone();
    put(&mut tensor_count, 8, &u64::MAX.to_le_bytes());
    cases.push(("huge_tensor_count", tensor_count));
    let mut metadata_count = bytes.clone();
    put(&mut metadata_count, 16, &(1u64 << 40).to_le_bytes());
    cases.push(("huge_metadata_count", metadata_count));

    // The first metadata entry starts at byte 24 with its key's length.
    let mut key_length = bytes.clone();
    put(&mut key_length, 24, &u64::MAX.to_le_bytes());
    cases.push(("huge_key_length", key_length));

    // `general.architecture`'s value: u32 type 8, then the string length.
    let mut value_length = bytes.clone();
    let at = find(&bytes, b"general.architecture") + "general.architecture".len() + 4;
    put(&mut value_length, at, &(1u64 << 62).to_le_bytes());
    cases.push(("huge_string_length", value_length));

    // `tokenizer.ggml.tokens`: u32 type 9, u32 element type 8, then the array length.
    let tokens_at = find(&bytes, b"tokenizer.ggml.tokens") + "tokenizer.ggml.tokens".len();
    let mut array_length = bytes.clone();
    put(
        &mut array_length,
        tokens_at + 8,
        &(1u64 << 61).to_le_bytes(),
    );
    cases.push(("huge_array_length", array_length));
    let mut element_type = bytes.clone();
    put(&mut element_type, tokens_at + 4, &77u32.to_le_bytes());
    cases.push(("unknown_value_type", element_type));

    // `tokenizer.ggml.add_bos_token`: u32 type 7, then the byte.
    let mut boolean = bytes.clone();
    let at =
        find(&bytes, b"tokenizer.ggml.add_bos_token") + "tokenizer.ggml.add_bos_token".len() + 4;
    boolean[at] = 7;
    cases.push(("invalid_bool", boolean));

    let mut duplicate = bytes.clone();
    let at = find(&bytes, b"blk.1.attn_q.weight");
    put(&mut duplicate, at, b"blk.0.attn_q.weight");
    cases.push(("duplicate_tensor", duplicate));

    let type_at = tensor_type_offset(&bytes, "blk.0.attn_q.weight");
    let mut tensor_type = bytes.clone();
    put(&mut tensor_type, type_at, &99u32.to_le_bytes());
    cases.push(("unknown_tensor_type", tensor_type));

    // The dimension count and dimensions sit just before the type id (two dimensions here).
    let dims_at = type_at - 16;
    let mut dimension_count = bytes.clone();
    put(&mut dimension_count, dims_at - 4, &5u32.to_le_bytes());
    cases.push(("too_many_dimensions", dimension_count));
    let mut overflow = bytes.clone();
    put(&mut overflow, dims_at, &(1u64 << 32).to_le_bytes());
    put(&mut overflow, dims_at + 8, &(1u64 << 33).to_le_bytes());
    cases.push(("element_count_overflow", overflow));
    let mut partial = bytes.clone();
    put(&mut partial, dims_at, &33u64.to_le_bytes());
    cases.push(("partial_block", partial));
    // A zero dimension: candle would build the empty tensor from an unaligned dangling pointer and abort.
    let mut empty = bytes.clone();
    put(&mut empty, dims_at + 8, &0u64.to_le_bytes());
    cases.push(("empty_tensor", empty));
    let mut huge_tensor = bytes.clone();
    put(&mut huge_tensor, dims_at + 8, &(1u64 << 40).to_le_bytes());
    cases.push(("huge_tensor", huge_tensor));

    // The data offset follows the type id.
    let mut misaligned = bytes.clone();
    put(&mut misaligned, type_at + 4, &17u64.to_le_bytes());
    cases.push(("misaligned_tensor", misaligned));
    let mut far = bytes.clone();
    put(&mut far, type_at + 4, &(u64::MAX - 31).to_le_bytes());
    cases.push(("offset_past_the_end", far));

    cases
}

#[test]
fn each_corruption_has_a_clear_error_text() {
    let dir = scratch_dir("texts");
    let (bytes, summary) = tiny_llama_bytes(&dir);
    for (name, corrupted) in &corruptions(&bytes, &summary) {
        let error = validate_bytes(&dir, &format!("{name}.gguf"), corrupted)
            .expect_err(&format!("the `{name}` corruption validated"));
        insta::assert_snapshot!(*name, text(&error, &dir));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_alignment_candle_would_divide_by_is_refused() {
    let dir = scratch_dir("alignment");
    for (name, path) in bad_alignment_files(&dir) {
        let error = validate(&path).expect_err("a file with a bad alignment validated");
        assert!(
            matches!(error, GgufError::InvalidAlignment { .. }),
            "got {error:?}"
        );
        insta::assert_snapshot!(name, text(&error, &dir));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn arrays_nested_too_deep_are_refused() {
    let dir = scratch_dir("nested");
    let path = dir.join("nested.gguf");
    let mut value = Value::Array(vec![Value::U8(1)]);
    for _ in 0..20 {
        value = Value::Array(vec![value]);
    }
    small_gguf(&path, &[("nested", &value)]);
    let error = validate(&path).expect_err("deeply nested arrays validated");
    insta::assert_snapshot!("array_too_deep", text(&error, &dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_file_is_an_io_error_naming_it() {
    let dir = scratch_dir("missing");
    let error = validate(&dir.join("absent.gguf")).expect_err("a missing file validated");
    assert!(matches!(error, GgufError::Io { .. }), "got {error:?}");
    assert!(
        text(&error, &dir).contains("[dir]/absent.gguf"),
        "the path is not named: {error}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// One byte flip: which byte (picked in the header sections when the flag is set, else anywhere in the
/// file) and the non-zero mask to xor into it.
type Flip = (prop::sample::Index, u8, bool);

/// One to seven byte flips.
fn byte_flips() -> impl Strategy<Value = Vec<Flip>> {
    proptest::collection::vec(
        (any::<prop::sample::Index>(), 1u8..=255, any::<bool>()),
        1..8,
    )
}

/// The tiny llama's bytes (the file is written into `dir` on first use) with `flips` applied.
fn flipped_tiny_llama(dir: &Path, flips: Vec<Flip>) -> Vec<u8> {
    let path = dir.join("tiny-llama-Q8_0.gguf");
    if !path.exists() {
        TinyModel::llama(GgmlDType::Q8_0)
            .write(&path)
            .expect("writing the tiny model failed");
    }
    let mut bytes = std::fs::read(&path).expect("reading the tiny model");
    let header_end = validate(&path)
        .expect("the tiny model validates")
        .tensor_data_offset as usize;
    for (index, mask, in_header) in flips {
        let at = if in_header {
            index.index(header_end)
        } else {
            index.index(bytes.len())
        };
        bytes[at] ^= mask;
    }
    bytes
}

/// Whether candle's reader, given the same bytes, panics (run under `catch_unwind`).
fn candle_panics(bytes: &[u8]) -> bool {
    std::panic::catch_unwind(|| {
        let _ = gguf_file::Content::read(&mut std::io::Cursor::new(bytes));
    })
    .is_err()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Flips in the header sections (where lengths, counts and types live) and anywhere in the file.
    #[test]
    fn random_byte_flips_never_panic_and_what_validates_candle_reads(
        flips in byte_flips(),
    ) {
        let dir = scratch_dir("flips");
        let bytes = flipped_tiny_llama(&dir, flips);
        let name = format!("flipped-{:?}.gguf", std::thread::current().id());
        if validate_bytes(&dir, &name, &bytes).is_ok() {
            prop_assert!(
                !candle_panics(&bytes),
                "candle's reader panicked on a file that validated"
            );
        }
    }
}

/// What the model loader did with a file: opened it, refused it, or panicked (with the message).
fn open_outcome(path: &Path) -> Result<Result<ModelFile, ModelError>, String> {
    std::panic::catch_unwind(|| ModelFile::open(path)).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|text| text.to_string()))
            .unwrap_or_default()
    })
}

/// The loader's error text for `path` (the scratch directory shown as `[dir]`), or what went wrong instead.
fn loader_error(path: &Path, dir: &Path, what: &str) -> Result<String, String> {
    match open_outcome(path) {
        Ok(Err(error)) => Ok(error
            .to_string()
            .replace(&dir.display().to_string(), "[dir]")),
        Ok(Ok(_)) => Err(format!("the model loader opened the `{what}` corruption")),
        Err(message) => Err(format!(
            "the model loader panicked on the `{what}` corruption: {message}"
        )),
    }
}

#[test]
fn the_model_loader_refuses_every_corruption_with_an_error() {
    let dir = scratch_dir("loader-texts");
    let (bytes, summary) = tiny_llama_bytes(&dir);
    let mut cases = corruptions(&bytes, &summary);
    for (name, path) in bad_alignment_files(&dir) {
        cases.push((
            name,
            std::fs::read(&path).expect("reading the alignment file"),
        ));
    }
    let mut texts = Vec::new();
    let mut failures = Vec::new();
    for (name, corrupted) in &cases {
        let path = dir.join(format!("{name}.gguf"));
        std::fs::write(&path, corrupted).expect("writing a corrupted copy");
        match loader_error(&path, &dir, name) {
            Ok(text) => texts.push(format!("{name}: {text}")),
            Err(failure) => failures.push(failure),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    insta::assert_snapshot!("loader_errors", texts.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_model_loader_refuses_a_file_cut_anywhere_before_its_last_tensor_ends() {
    let dir = scratch_dir("loader-truncate");
    let (bytes, summary) = tiny_llama_bytes(&dir);
    let path = dir.join("cut.gguf");
    std::fs::write(&path, &bytes[..summary.tensor_data_end as usize]).expect("writing the copy");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("opening the copy");
    // Every cut in the header sections, then a sample of cuts inside the tensor data.
    let data_step = ((summary.tensor_data_end - summary.tensor_data_offset) / 61).max(1);
    let data_cuts =
        (summary.tensor_data_offset..summary.tensor_data_end).step_by(data_step as usize);
    let mut cuts: Vec<u64> = (0..summary.tensor_data_offset).chain(data_cuts).collect();
    cuts.sort_unstable_by(|a, b| b.cmp(a));
    for length in cuts {
        file.set_len(length).expect("truncating the copy");
        match open_outcome(&path) {
            Ok(Err(_)) => {}
            Ok(Ok(_)) => panic!("the model loader opened a file cut to {length} bytes"),
            Err(message) => {
                panic!("the model loader panicked on a file cut to {length} bytes: {message}")
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    /// The whole load path (header, config, every tensor of a two-stage split) under random flips.
    #[test]
    fn random_byte_flips_never_panic_the_model_loader(
        flips in byte_flips(),
    ) {
        let dir = scratch_dir("loader-flips");
        let bytes = flipped_tiny_llama(&dir, flips);
        let flipped = dir.join(format!("flipped-{:?}.gguf", std::thread::current().id()));
        std::fs::write(&flipped, &bytes).expect("writing the flipped copy");
        let outcome = std::panic::catch_unwind(|| {
            let _ = Pipeline::load(&flipped, &[2], StageOptions::default());
        });
        prop_assert!(outcome.is_ok(), "the model loader panicked on a file with flipped bytes");
    }
}

#[test]
fn extreme_hyper_parameters_give_errors_or_run_but_never_panic() {
    let dir = scratch_dir("hyper");
    let mut panics = Vec::new();
    for model in [
        TinyModel::llama(GgmlDType::Q8_0),
        TinyModel::gemma3(GgmlDType::Q8_0),
    ] {
        let bytes = std::fs::read(model.write_to_dir(&dir).expect("writing a tiny model"))
            .expect("reading the tiny model");
        let architecture = model.architecture.name();
        for key in [
            "block_count",
            "context_length",
            "embedding_length",
            "feed_forward_length",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.key_length",
            "attention.value_length",
            "rope.dimension_count",
            "attention.sliding_window",
        ] {
            let full_key = format!("{architecture}.{key}");
            if !bytes
                .windows(full_key.len())
                .any(|window| window == full_key.as_bytes())
            {
                continue;
            }
            // The key is followed by its u32 type id and the u32 value.
            let value_at = find(&bytes, full_key.as_bytes()) + full_key.len() + 4;
            for value in [0u32, 1, 3, 1000, 1 << 20, u32::MAX] {
                let mut corrupted = bytes.clone();
                put(&mut corrupted, value_at, &value.to_le_bytes());
                let path = dir.join("hyper.gguf");
                std::fs::write(&path, &corrupted).expect("writing the changed copy");
                let outcome = std::panic::catch_unwind(|| {
                    let block_count = ModelFile::open(&path)?.config().block_count;
                    let mut stage = Stage::load(
                        &path,
                        StageSpec::whole(block_count),
                        StageOptions::default(),
                    )?;
                    stage.forward(
                        0,
                        0,
                        StageInput::Tokens(&[1, 5, 7, 9, 11, 13]),
                        Logits::Last,
                    )?;
                    Ok::<(), ModelError>(())
                });
                if outcome.is_err() {
                    panics.push(format!("{full_key} = {value}"));
                }
            }
        }
    }
    assert!(
        panics.is_empty(),
        "the model core panicked with {}",
        panics.join(", ")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_metadata_array_candle_would_blow_up_in_memory_is_refused() {
    let dir = scratch_dir("big-array");
    let path = dir.join("big-array.gguf");
    // A well-formed file whose one key holds 2^24 + 1 bytes: 16 MB on disk, over 512 MB as candle's
    // `Value`s.
    let elements = (1u64 << 24) + 1;
    let mut bytes = Vec::new();
    bytes.extend_from_slice(b"GGUF");
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes());
    bytes.extend_from_slice(&1u64.to_le_bytes());
    bytes.extend_from_slice(&(b"big".len() as u64).to_le_bytes());
    bytes.extend_from_slice(b"big");
    bytes.extend_from_slice(&9u32.to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes());
    bytes.extend_from_slice(&elements.to_le_bytes());
    bytes.resize(bytes.len() + elements as usize, 0);
    std::fs::write(&path, &bytes).expect("writing the file");
    let error = validate(&path).expect_err("a 16-million-element array validated");
    assert!(
        matches!(error, GgufError::MetadataTooLarge { .. }),
        "got {error:?}"
    );
    insta::assert_snapshot!("metadata_too_large", text(&error, &dir));
    let _ = std::fs::remove_dir_all(&dir);
}
