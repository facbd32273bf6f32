//! The model fingerprint stages compare in their hellos: equal for one model, different for different ones, blind to weights.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use sha2::{Digest, Sha256};
use stage_server::model::testing::{TinyModel, real_model};
use stage_server::model::{GEMMA3_FILE, ModelError, SMOLLM2_FILE, fingerprint};

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "stage-server-fingerprint-{}-{name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    dir
}

fn written(dir: &Path, name: &str, model: &TinyModel) -> PathBuf {
    let path = dir.join(name);
    model.write(&path).expect("writing a tiny model");
    path
}

fn short(digest: &[u8; 32]) -> String {
    digest[..8]
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

#[test]
fn one_file_and_its_rewrite_have_one_fingerprint() {
    let dir = scratch_dir("same");
    let model = TinyModel::llama(GgmlDType::Q8_0);
    let first = written(&dir, "first.gguf", &model);
    let second = written(&dir, "second.gguf", &model);
    let digest = fingerprint(&first).expect("fingerprinting a tiny model");
    assert_eq!(
        fingerprint(&first).unwrap(),
        digest,
        "the same file gave two fingerprints"
    );
    assert_eq!(
        fingerprint(&second).unwrap(),
        digest,
        "the same model written twice gave two fingerprints"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn different_models_have_different_fingerprints() {
    let dir = scratch_dir("different");
    let deeper = TinyModel {
        block_count: 5,
        ..TinyModel::llama(GgmlDType::Q8_0)
    };
    let models = [
        ("llama Q8_0", TinyModel::llama(GgmlDType::Q8_0)),
        ("llama Q4_1", TinyModel::llama(GgmlDType::Q4_1)),
        ("llama with 5 blocks", deeper),
        ("gemma3 Q8_0", TinyModel::gemma3(GgmlDType::Q8_0)),
    ];
    let digests: Vec<(&str, [u8; 32])> = models
        .iter()
        .enumerate()
        .map(|(index, (name, model))| {
            let path = written(&dir, &format!("{index}.gguf"), model);
            (
                *name,
                fingerprint(&path).expect("fingerprinting a tiny model"),
            )
        })
        .collect();
    for (index, (name, digest)) in digests.iter().enumerate() {
        for (other, other_digest) in &digests[index + 1..] {
            assert_ne!(
                digest,
                other_digest,
                "{name} and {other} share the fingerprint {}",
                short(digest)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_fingerprint_is_the_sha256_of_the_bytes_before_the_tensor_data() {
    let dir = scratch_dir("definition");
    let path = written(&dir, "model.gguf", &TinyModel::gemma3(GgmlDType::Q4_1));
    let bytes = std::fs::read(&path).unwrap();
    let summary = stage_server::model::gguf_check::validate(&path).unwrap();
    let header = &bytes[..summary.tensor_data_offset as usize];
    let expected: [u8; 32] = Sha256::digest(header).into();
    assert_eq!(
        fingerprint(&path).unwrap(),
        expected,
        "the fingerprint is not the sha256 of the header, metadata and tensor table"
    );
    assert!(
        (summary.tensor_data_offset as usize) < bytes.len() / 2,
        "the tiny model is mostly header, so this test would not notice weights being hashed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_changed_weight_keeps_the_fingerprint_and_a_changed_token_changes_it() {
    let dir = scratch_dir("changes");
    let path = written(&dir, "model.gguf", &TinyModel::llama(GgmlDType::Q8_0));
    let digest = fingerprint(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let offset = stage_server::model::gguf_check::validate(&path)
        .unwrap()
        .tensor_data_offset as usize;

    let mut weights = bytes.clone();
    let last = weights.len() - 1;
    weights[last] ^= 0x01;
    let changed_weights = dir.join("weights.gguf");
    std::fs::write(&changed_weights, &weights).unwrap();
    assert_eq!(
        fingerprint(&changed_weights).unwrap(),
        digest,
        "a change in the tensor data changed the fingerprint: the weights are hashed"
    );

    let mut token = bytes.clone();
    let at = token
        .windows(7)
        .position(|window| window == b"capital")
        .expect("the tiny vocabulary holds `capital`");
    assert!(at < offset, "the vocabulary lies in the metadata");
    token[at + 5] = b'o';
    let changed_token = dir.join("token.gguf");
    std::fs::write(&changed_token, &token).unwrap();
    assert_ne!(
        fingerprint(&changed_token).unwrap(),
        digest,
        "a change in the vocabulary left the fingerprint as it was"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_that_is_not_gguf_is_refused_with_its_path() {
    let dir = scratch_dir("broken");
    let path = dir.join("broken.gguf");
    std::fs::write(&path, b"GGUF but not really").unwrap();
    let error = fingerprint(&path).expect_err("a broken file was fingerprinted");
    assert!(
        matches!(error, ModelError::Gguf(_)),
        "a malformed header gave {error:?} instead of the GGUF pre-check's error"
    );
    assert!(
        error.to_string().contains("broken.gguf"),
        "the error does not name the file: {error}"
    );
    let missing =
        fingerprint(&dir.join("missing.gguf")).expect_err("a missing file was fingerprinted");
    assert!(
        missing.to_string().contains("missing.gguf"),
        "the error does not name the missing file: {missing}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_real_models_have_distinct_stable_fingerprints() {
    let (Some(smollm2), Some(gemma3)) = (real_model(SMOLLM2_FILE), real_model(GEMMA3_FILE)) else {
        return;
    };
    let first = fingerprint(&smollm2).expect("fingerprinting SmolLM2");
    assert_eq!(
        fingerprint(&smollm2).unwrap(),
        first,
        "SmolLM2 gave two fingerprints"
    );
    let second = fingerprint(&gemma3).expect("fingerprinting gemma 3");
    assert_ne!(first, second, "SmolLM2 and gemma 3 share a fingerprint");
    // The files are pinned by their sha256 (KNOWN_MODELS), so their fingerprints are fixed too: a change here
    // means the fingerprint's definition changed, and stages of two releases would refuse each other's model.
    assert_eq!(
        short(&first),
        "cd2d87a25589b59f",
        "SmolLM2's fingerprint changed"
    );
    assert_eq!(
        short(&second),
        "1a14527e038860b1",
        "gemma 3's fingerprint changed"
    );
    eprintln!(
        "fingerprints: SmolLM2 {}, gemma 3 {}",
        short(&first),
        short(&second)
    );
}
