//! Fuzz target: any bytes through the HTTP/1.1 request parser, whole and in pieces, give the same requests and never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The body is shared with the stable-toolchain twin in stage-server/tests/fuzz_twins.rs.
fuzz_target!(|bytes: &[u8]| stage_server::fuzzing::http_request(bytes));
