//! Fuzz target: the PROXY parser never panics, never claims more bytes than it was given, and agrees with itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use net_io_core::proxy::{ProxyMode, ProxyParser, ProxyStatus};

fuzz_target!(|bytes: &[u8]| {
    // The first byte picks the body limit so that the BodyTooLarge path is explored too.
    let max_body = usize::from(bytes.first().copied().unwrap_or(0)) * 8;
    for mode in [ProxyMode::V1, ProxyMode::V2, ProxyMode::Any] {
        let parser = ProxyParser::new(mode, max_body);
        let result = parser.parse(bytes);
        if let Ok(ProxyStatus::Done { header, consumed }) = result {
            assert!(consumed <= bytes.len(), "consumed past the input");
            let _ = header.tlvs(bytes).count();
            // Exactly the header's bytes must give the same answer: trailing data is not part of it.
            assert_eq!(parser.parse(&bytes[..consumed]), result, "the header depends on bytes after it");
        }
    }
});
