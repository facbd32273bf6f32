//! Stable-toolchain twins of the fuzz targets in `stage-server/fuzz`: the same bodies over seeded random inputs, for a bounded time.
//!
//! cargo-fuzz needs nightly, which CI does not have, so each target's body (`stage_server::fuzzing`) also runs
//! here on inputs from a fixed seed: mutations of small valid files for the GGUF pre-check, and texts mixing
//! random bytes with the characters tokenizers find hard for the tokenizer. Each twin stops after its case
//! count or its time budget, whichever comes first, so a loaded machine runs fewer cases instead of a longer
//! test. A failure prints the seed and case; `stage-server/fuzz/README.md` says how to run the real fuzzers.

use std::io::Cursor;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use stage_server::fuzzing::{TokenizerTargets, gguf_check};
use stage_server::gguf_check::validate_bytes;

/// Wall-clock budget of one twin: long enough for thousands of cases, short enough for every `cargo test`.
const BUDGET: Duration = Duration::from_secs(3);
/// Most cases one twin runs (reached in well under the budget on an idle machine).
const MAXIMUM_CASES: usize = 100_000;

/// The committed seed corpus of the GGUF target.
fn gguf_corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/gguf_check")
}

/// Small valid GGUF files: metadata of every value type with an alignment, and a few tensors of several types.
fn gguf_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let metadata = [
        ("general.architecture", Value::String("llama".into())),
        ("general.alignment", Value::U32(64)),
        ("llama.block_count", Value::U32(2)),
        ("flag", Value::Bool(true)),
        ("small", Value::I8(-3)),
        ("wide", Value::U64(1 << 40)),
        ("ratio", Value::F32(0.5)),
        (
            "list",
            Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]),
        ),
        (
            "nested",
            Value::Array(vec![Value::Array(vec![Value::U16(1), Value::U16(2)])]),
        ),
    ];
    let pairs: Vec<(&str, &Value)> = metadata.iter().map(|(key, value)| (*key, value)).collect();
    let values: Vec<f32> = (0..64).map(|index| index as f32 / 8.0 - 4.0).collect();
    let dense = Tensor::from_vec(values, (2, 32), &Device::Cpu).expect("a 2x32 tensor");
    let tensors: Vec<(&str, QTensor)> = [
        ("dense.weight", GgmlDType::F32),
        ("q8.weight", GgmlDType::Q8_0),
        ("q4.weight", GgmlDType::Q4_1),
    ]
    .into_iter()
    .map(|(name, dtype)| {
        (
            name,
            QTensor::quantize(&dense, dtype).expect("quantising a seed tensor"),
        )
    })
    .collect();
    let tensor_pairs: Vec<(&str, &QTensor)> = tensors
        .iter()
        .map(|(name, tensor)| (*name, tensor))
        .collect();
    let write = |metadata: &[(&str, &Value)], tensors: &[(&str, &QTensor)]| {
        let mut bytes = Cursor::new(Vec::new());
        gguf_file::write(&mut bytes, metadata, tensors).expect("writing a seed GGUF file");
        bytes.into_inner()
    };
    vec![
        ("metadata.gguf", write(&pairs, &[])),
        // candle's writer aligns tensor data to 32 bytes whatever `general.alignment` says, so the tensor seed
        // leaves that key out (the pre-check rightly rejects offsets that miss the declared alignment).
        ("tensors.gguf", write(&[pairs[0], pairs[2]], &tensor_pairs)),
    ]
}

/// One mutation of `seed`: flipped bytes, a truncation, an extreme length or count written over a field, or
/// random bytes after the magic.
fn mutate(seed: &[u8], random: &mut StdRng) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    match random.random_range(0..5) {
        0 => {
            for _ in 0..random.random_range(1..=8) {
                let at = random.random_range(0..bytes.len());
                bytes[at] ^= 1 << random.random_range(0..8);
            }
        }
        1 => bytes.truncate(random.random_range(0..bytes.len())),
        2 => {
            let extreme: u64 = match random.random_range(0..4) {
                0 => u64::MAX,
                1 => 1 << random.random_range(0..64),
                2 => random.random_range(0..1 << 20),
                _ => random.random(),
            };
            let at = random.random_range(0..bytes.len().saturating_sub(8).max(1));
            let end = (at + 8).min(bytes.len());
            bytes[at..end].copy_from_slice(&extreme.to_le_bytes()[..end - at]);
        }
        3 => {
            let at = random.random_range(0..bytes.len());
            let value = random.random();
            bytes[at] = value;
        }
        _ => {
            bytes.truncate(8);
            let length = random.random_range(0..256);
            bytes.extend((0..length).map(|_| random.random::<u8>()));
        }
    }
    bytes
}

/// Characters and pieces that stress tokenizers: spaces of several kinds, digits, contractions, control-token
/// text, SentencePiece's space mark, combining marks, emoji sequences and scripts without spaces.
const PIECES: [&str; 24] = [
    " ",
    "  ",
    "\n",
    "\r\n",
    "\t",
    "\u{a0}",
    "\u{3000}",
    "123",
    "4567",
    "'s",
    "'LL",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
    "\u{2581}",
    "e\u{301}",
    "😀",
    "👨‍👩‍👧",
    "日本語",
    "한국어",
    "the",
    "sing",
    "\u{fffd}",
];

/// A random tokenizer input: the selector byte, then random bytes or a text of random pieces and letters.
fn tokenizer_input(random: &mut StdRng) -> Vec<u8> {
    let mut bytes = vec![random.random::<u8>()];
    if random.random_bool(0.25) {
        let length = random.random_range(0..64);
        bytes.extend((0..length).map(|_| random.random::<u8>()));
        return bytes;
    }
    for _ in 0..random.random_range(0..24) {
        if random.random_bool(0.5) {
            bytes.extend_from_slice(PIECES[random.random_range(0..PIECES.len())].as_bytes());
        } else {
            let letter = char::from(random.random_range(b'a'..=b'z'));
            bytes.extend_from_slice(letter.to_string().as_bytes());
        }
    }
    bytes
}

/// Runs `body` on inputs from `input` until the case count or the time budget runs out; returns the count.
fn run_for_budget(
    seed: u64,
    mut input: impl FnMut(&mut StdRng) -> Vec<u8>,
    body: impl Fn(&[u8]),
) -> usize {
    let started = Instant::now();
    let mut random = StdRng::seed_from_u64(seed);
    let mut cases = 0;
    while cases < MAXIMUM_CASES && started.elapsed() < BUDGET {
        let bytes = input(&mut random);
        // The body only reads shared state, so a panic cannot leave it half-updated for the next case.
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| body(&bytes)));
        if let Err(payload) = outcome {
            eprintln!("seed {seed:#x}, case {cases}: the body panicked on the input {bytes:02x?}");
            std::panic::resume_unwind(payload);
        }
        cases += 1;
    }
    cases
}

#[test]
fn the_gguf_pre_check_target_holds_on_mutated_small_files() {
    let seeds = gguf_seeds();
    for (name, bytes) in &seeds {
        validate_bytes(bytes, Path::new(name))
            .unwrap_or_else(|error| panic!("the unmutated seed {name} must validate: {error}"));
        gguf_check(bytes);
    }
    let cases = run_for_budget(
        0x6775_6666,
        |random| {
            let (_, seed) = &seeds[random.random_range(0..seeds.len())];
            mutate(seed, random)
        },
        gguf_check,
    );
    eprintln!("gguf_check twin: {cases} mutated files");
}

#[test]
fn the_tokenizer_target_holds_on_random_texts() {
    let targets = TokenizerTargets::new();
    let cases = run_for_budget(0x746f_6b65, tokenizer_input, |bytes| targets.encode(bytes));
    eprintln!("tokenizer twin: {cases} texts");
}

#[test]
fn every_committed_gguf_seed_is_accepted_by_the_pre_check() {
    // A seed the pre-check rejects would start the fuzzer outside the code it is meant to explore.
    let mut seen = 0;
    for entry in std::fs::read_dir(gguf_corpus_dir()).expect("the GGUF seed corpus is committed") {
        let path = entry.expect("a corpus entry").path();
        let bytes = std::fs::read(&path).expect("a corpus file is readable");
        validate_bytes(&bytes, &path).unwrap_or_else(|error| {
            panic!(
                "the seed {} is not a valid GGUF file: {error}",
                path.display()
            )
        });
        seen += 1;
    }
    assert!(
        seen >= 2,
        "the GGUF seed corpus holds {seen} files, fewer than the two seeds"
    );
}

#[test]
#[ignore = "writes the seed corpus of stage-server/fuzz; run by hand after changing gguf_seeds"]
fn write_the_gguf_seed_corpus() {
    let directory = gguf_corpus_dir();
    std::fs::create_dir_all(&directory).expect("creating the corpus directory");
    for (name, bytes) in gguf_seeds() {
        std::fs::write(directory.join(name), bytes).expect("writing a seed");
    }
}
