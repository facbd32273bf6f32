//! `cargo xtask run`: the main job on a fresh machine: fetch the default model, then run the stage pipeline.

use anyhow::Result;

use crate::{cargo, models};

/// The pipeline the README promises when no arguments are given: SmolLM2 split into three in-process stages.
const DEFAULT_GENERATE: &[&str] = &[
    "generate",
    "--chat",
    "--prompt",
    "What is the capital of France? Answer in one sentence.",
    "--split",
    "10,20",
    "--max-tokens",
    "48",
];

/// Fetches the default model when it is missing, then runs `stage-server` in release mode.
///
/// Arguments after `run` go to `stage-server` unchanged (for example `generate --model FILE --prompt TEXT`);
/// with none, it runs [`DEFAULT_GENERATE`].
pub fn run(arguments: &[String]) -> Result<()> {
    models::fetch(&["smollm2".to_owned()])?;
    let mut command = vec![
        "run",
        "--release",
        "--quiet",
        "--package",
        "stage-server",
        "--",
    ];
    if arguments.is_empty() {
        command.extend_from_slice(DEFAULT_GENERATE);
    } else {
        command.extend(arguments.iter().map(String::as_str));
    }
    cargo(&command)
}
