//! The body of the PROXY fuzz target, shared with its stable-toolchain twin in `net-io-core/tests/proxy_fuzz_twin.rs`.

use net_io_core::proxy::{ProxyMode, ProxyParser, ProxyStatus};

/// Parses `bytes` in every mode and panics unless the parser stays within them and agrees with itself.
///
/// The first byte picks the body limit so that the BodyTooLarge path is explored too. A complete header must
/// claim no more bytes than it was given, its TLVs must iterate, and exactly its bytes must give the same
/// answer again (trailing data is not part of a header).
pub fn check(bytes: &[u8]) {
    let max_body = usize::from(bytes.first().copied().unwrap_or(0)) * 8;
    for mode in [ProxyMode::V1, ProxyMode::V2, ProxyMode::Any] {
        let parser = ProxyParser::new(mode, max_body);
        let result = parser.parse(bytes);
        if let Ok(ProxyStatus::Done { header, consumed }) = result {
            assert!(consumed <= bytes.len(), "consumed past the input");
            let _ = header.tlvs(bytes).count();
            assert_eq!(
                parser.parse(&bytes[..consumed]),
                result,
                "the header depends on bytes after it"
            );
        }
    }
}
