//! `cargo xtask run`: the main job on a fresh machine: fetch the default model, then run the stage pipeline.

use anyhow::Result;

use crate::{cargo, models};

/// The pipeline the README promises when no arguments are given: SmolLM2 as three stage processes on
/// loopback with the OpenAI-compatible API on stage 0 (`stage-server run` prints the URL and a curl line;
/// Ctrl-C stops every stage).
const DEFAULT_RUN: &[&str] = &["run", "--stages", "3"];

/// Fetches the default model when it is missing, then runs `stage-server` in release mode.
///
/// Arguments after `run` go to `stage-server` unchanged (for example `run --stages 1 --model FILE`, or `generate --prompt TEXT`);
/// with none, it runs [`DEFAULT_RUN`].
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
        command.extend_from_slice(DEFAULT_RUN);
    } else {
        command.extend(arguments.iter().map(String::as_str));
    }
    cargo(&command)
}
