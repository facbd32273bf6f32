//! Fuzz target: the GGUF pre-check never panics, and whatever it accepts candle reads without panicking and agrees with.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The body is shared with the stable-toolchain twin in stage-server/tests/fuzz_twins.rs.
fuzz_target!(|bytes: &[u8]| stage_server::fuzzing::gguf_check(bytes));
