//! `cargo xtask bench runtime`: task-runtime side by side with tokio, rayon, std threads and a crossbeam pool.

use anyhow::{Result, bail};

/// Runs the runtime benchmarks with the given extra arguments.
pub fn run(_arguments: &[String]) -> Result<()> {
    bail!("`cargo xtask bench runtime` is not built yet")
}
