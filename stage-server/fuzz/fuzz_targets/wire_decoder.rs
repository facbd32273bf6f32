//! Fuzz target: any bytes through the stage protocol's decoder, whole and in pieces, give the same canonical frames and never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The body is shared with the stable-toolchain twin in stage-server/tests/fuzz_twins.rs.
fuzz_target!(|bytes: &[u8]| stage_server::fuzzing::wire_decoder(bytes));
