//! `cargo xtask bench model`: stage-server prompt and decode speed side by side with llama.cpp.

use anyhow::{Result, bail};

/// Runs the model benchmarks with the given extra arguments.
pub fn run(_arguments: &[String]) -> Result<()> {
    bail!("`cargo xtask bench model` is not built yet")
}
