//! Fuzz target: any bytes, read as text, encode with the tiny tokenizers to ids that decode and stream back sanely.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use stage_server::fuzzing::TokenizerTargets;

/// Built once: building the tokenizers costs more than one encode.
static TARGETS: LazyLock<TokenizerTargets> = LazyLock::new(TokenizerTargets::new);

// The body is shared with the stable-toolchain twin in stage-server/tests/fuzz_twins.rs.
fuzz_target!(|bytes: &[u8]| TARGETS.encode(bytes));
