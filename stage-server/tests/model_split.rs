//! Split versus unsplit runs of tiny generated models (and the real ones when present): logits must be bit-identical.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use stage_server::model::testing::TinyModel;
use stage_server::model::{Logits, Pipeline, StageOptions};

/// A fresh scratch directory for one test.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stage-server-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    dir
}

/// Prefill `prompt` (all rows of logits), then decode `steps` greedy tokens; every logit row, in order.
fn logit_rows(path: &Path, boundaries: &[usize], prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut pipeline =
        Pipeline::load(path, boundaries, StageOptions::default()).unwrap_or_else(|error| {
            panic!(
                "loading {} split at {boundaries:?}: {error}",
                path.display()
            )
        });
    let vocab = pipeline.config().vocab_size;
    let prefill = pipeline
        .forward(0, 0, prompt, Logits::All)
        .expect("the prompt prefill failed");
    assert_eq!(
        prefill.len(),
        prompt.len() * vocab,
        "Logits::All must give one row per prompt token"
    );
    let mut rows: Vec<Vec<f32>> = prefill.chunks(vocab).map(<[f32]>::to_vec).collect();
    for position in prompt.len()..prompt.len() + steps {
        let last = rows.last().expect("at least one row");
        let token = argmax(last);
        let row = pipeline
            .forward(0, position, &[token], Logits::Last)
            .expect("a decode step failed");
        assert_eq!(row.len(), vocab, "Logits::Last must give one row");
        rows.push(row);
    }
    rows
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (index, value) in row.iter().enumerate() {
        if *value > row[best] {
            best = index;
        }
    }
    best as u32
}

/// Asserts two runs gave the same logits bit for bit, naming the first step and index that differ.
fn assert_bit_identical(reference: &[Vec<f32>], other: &[Vec<f32>], what: &str) {
    assert_eq!(
        reference.len(),
        other.len(),
        "{what}: a different number of steps"
    );
    for (step, (a, b)) in reference.iter().zip(other).enumerate() {
        if let Some(index) = a
            .iter()
            .zip(b)
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            panic!(
                "{what}: step {step} logit {index} differs: unsplit {} split {}",
                a[index], b[index]
            );
        }
    }
}

fn check_splits(model: &TinyModel, splits: &[&[usize]]) {
    let dir = scratch_dir(&model.file_name());
    let path = model
        .write_to_dir(&dir)
        .expect("writing the tiny model failed");
    // Nine prompt tokens and eight decode steps: longer than gemma3's window of four.
    let prompt = [1, 300, 301, 302, 290, 17, 100, 200, 310];
    let unsplit = logit_rows(&path, &[], &prompt, 8);
    assert!(
        unsplit.iter().flatten().all(|value| value.is_finite()),
        "the tiny model produced non-finite logits"
    );
    for boundaries in splits {
        let split = logit_rows(&path, boundaries, &prompt, 8);
        assert_bit_identical(
            &unsplit,
            &split,
            &format!("{} split at {boundaries:?}", model.file_name()),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tiny_llama_models_give_bit_identical_logits_split_in_two_and_three() {
    for weight_type in [
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::F16,
    ] {
        check_splits(&TinyModel::llama(weight_type), &[&[2], &[1, 3]]);
    }
}

#[test]
fn tiny_gemma3_models_give_bit_identical_logits_split_in_two_and_three() {
    for weight_type in [
        GgmlDType::Q5_0,
        GgmlDType::Q4K,
        GgmlDType::Q8_0,
        GgmlDType::Q6K,
    ] {
        check_splits(&TinyModel::gemma3(weight_type), &[&[3], &[2, 4]]);
    }
}

#[test]
fn real_models_give_bit_identical_logits_split_in_two_and_three() {
    type Case<'a> = (&'a str, &'a [u32], &'a [&'a [usize]]);
    let cases: [Case; 2] = [
        (
            stage_server::model::SMOLLM2_FILE,
            &[504, 3575, 282, 4649, 314],
            &[&[15], &[10, 20]],
        ),
        (
            stage_server::model::GEMMA3_FILE,
            &[2, 818, 5279, 529, 7001, 563],
            &[&[9], &[6, 12]],
        ),
    ];
    for (name, prompt, splits) in cases {
        let Some(path) = stage_server::model::testing::real_model(name) else {
            continue;
        };
        let unsplit = logit_rows(&path, &[], prompt, 6);
        for boundaries in splits {
            let split = logit_rows(&path, boundaries, prompt, 6);
            assert_bit_identical(&unsplit, &split, &format!("{name} split at {boundaries:?}"));
        }
    }
}
