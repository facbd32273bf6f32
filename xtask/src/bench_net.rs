//! `cargo xtask bench net`: side-by-side echo, idle-memory and churn benchmarks of the net-io stack and its peers.

use anyhow::{Result, bail};

/// Runs the networking benchmarks with the given extra arguments.
pub fn run(_arguments: &[String]) -> Result<()> {
    bail!("`cargo xtask bench net` is not built yet")
}
