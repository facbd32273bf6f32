//! The `stage-server` binary: `generate` split and unsplit on a tiny model, `--logits-out`, `inspect`, flag refusals.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::quantized::GgmlDType;
use stage_server::model::testing::TinyModel;

fn scratch_model(name: &str, model: &TinyModel) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("stage-server-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    let path = model
        .write_to_dir(&dir)
        .expect("writing the tiny model failed");
    (dir, path)
}

fn run(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_stage-server"))
        .args(args)
        .output()
        .expect("running stage-server");
    assert!(
        output.status.success(),
        "stage-server {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("stdout is UTF-8")
}

fn generate_json(model: &Path, split: Option<&str>, logits_out: &Path) -> serde_json::Value {
    let model = model.to_str().expect("a UTF-8 temp path");
    let logits = logits_out.to_str().expect("a UTF-8 temp path");
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--prompt-ids",
        "1,300,301,302",
        "--max-tokens",
        "6",
        "--json",
        "--threads",
        "1",
        "--logits-out",
        logits,
    ];
    if let Some(split) = split {
        args.extend(["--split", split]);
    }
    serde_json::from_str(run(&args).trim()).expect("--json prints one JSON object")
}

#[test]
fn generate_gives_the_same_tokens_and_logit_bytes_split_and_unsplit() {
    let (dir, path) = scratch_model("generate", &TinyModel::llama(GgmlDType::Q4_1));
    let unsplit = generate_json(&path, None, &dir.join("unsplit.f32"));
    let split = generate_json(&path, Some("1,3"), &dir.join("split.f32"));
    assert_eq!(
        unsplit["prompt_tokens"],
        serde_json::json!([1, 300, 301, 302])
    );
    let tokens = unsplit["tokens"].as_array().expect("tokens is an array");
    assert!(!tokens.is_empty(), "no tokens generated: {unsplit}");
    assert_eq!(
        unsplit["tokens"], split["tokens"],
        "split and unsplit generated different tokens"
    );
    assert!(unsplit["text"].is_string(), "text missing: {unsplit}");
    assert!(
        unsplit["prompt_tokens_per_second"]
            .as_f64()
            .is_some_and(|rate| rate > 0.0)
    );

    let unsplit_bytes = std::fs::read(dir.join("unsplit.f32")).expect("unsplit logits");
    let split_bytes = std::fs::read(dir.join("split.f32")).expect("split logits");
    let vocab = TinyModel::vocabulary().len();
    assert_eq!(
        unsplit_bytes.len() % (vocab * 4),
        0,
        "--logits-out must hold whole rows of {vocab} f32 values"
    );
    assert!(
        unsplit_bytes.len() / (vocab * 4) >= tokens.len(),
        "one logit row per generated step"
    );
    assert!(
        unsplit_bytes == split_bytes,
        "split and unsplit logit files differ"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn inspect_describes_a_tiny_gemma3() {
    let (dir, path) = scratch_model("inspect", &TinyModel::gemma3(GgmlDType::Q4K));
    let text = run(&["inspect", path.to_str().expect("a UTF-8 temp path")])
        .replace(&dir.display().to_string(), "[dir]");
    insta::assert_snapshot!("inspect_tiny_gemma3", text);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_split_outside_the_model_is_a_clear_error() {
    let (dir, path) = scratch_model("bad-split", &TinyModel::llama(GgmlDType::Q8_0));
    let output = Command::new(env!("CARGO_BIN_EXE_stage-server"))
        .args([
            "generate",
            "--model",
            path.to_str().expect("utf-8"),
            "--prompt-ids",
            "1,2",
        ])
        .args(["--split", "2,9"])
        .output()
        .expect("running stage-server");
    assert!(
        !output.status.success(),
        "a split at layer 9 of 4 succeeded"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("layer") && stderr.contains("4 layers"),
        "the error should name the layer limit: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_decode_stretch_below_one_is_refused_before_anything_loads() {
    for (value, expected) in [
        ("0.5", "a decode stretch of 0.5 cannot hold"),
        ("fast", "`fast` is not a number"),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_stage-server"))
            .args([
                "run",
                "--model",
                "/nonexistent/model.gguf",
                "--decode-stretch",
                value,
            ])
            .output()
            .expect("running stage-server");
        assert!(
            !output.status.success(),
            "--decode-stretch {value} was accepted"
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(expected) && stderr.contains("--decode-stretch"),
            "the error should name the flag and say why: {stderr}"
        );
    }
}

#[test]
fn a_prefill_chunk_of_zero_or_above_512_is_refused_naming_the_flag() {
    for (value, expected) in [
        ("0", "a prefill chunk of 0 tokens cannot be sent"),
        ("513", "a prefill chunk of 513 tokens cannot be sent"),
        ("many", "`many` is not a number of tokens"),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_stage-server"))
            .args([
                "generate",
                "--model",
                "/nonexistent/model.gguf",
                "--prompt-ids",
                "1,2",
                "--prefill-chunk",
                value,
            ])
            .output()
            .expect("running stage-server");
        assert!(
            !output.status.success(),
            "--prefill-chunk {value} was accepted"
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(expected) && stderr.contains("--prefill-chunk"),
            "the error should name the flag and say why: {stderr}"
        );
    }
}
