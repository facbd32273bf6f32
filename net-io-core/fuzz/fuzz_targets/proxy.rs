//! Fuzz target: the PROXY parser never panics, never claims more bytes than it was given, and agrees with itself.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The body is shared with the stable-toolchain twin in net-io-core/tests/proxy_fuzz_twin.rs.
#[path = "../checks/proxy.rs"]
mod checks;

fuzz_target!(|bytes: &[u8]| checks::check(bytes));
