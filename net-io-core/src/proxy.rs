//! A sans-IO PROXY protocol v1/v2 parser: fed every byte received so far, it answers need-more, done or an error.

/// Why a PROXY header was rejected. Every variant closes the connection with `ProxyInvalid`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// The bytes do not start with a PROXY signature the listener accepts.
    #[error(
        "the connection did not start with a PROXY header; the listener requires one from its proxy"
    )]
    NotProxy,
    /// A v1 line ran past 107 bytes without its CRLF.
    #[error("the PROXY v1 line is longer than 107 bytes; the proxy is broken or hostile")]
    V1TooLong,
    /// A v1 line did not follow the grammar.
    #[error("the PROXY v1 line is malformed: {0}")]
    V1Malformed(&'static str),
    /// A v2 header had a version other than 2.
    #[error("PROXY v2 header has version {0}, only 2 is supported")]
    UnsupportedVersion(u8),
    /// A v2 header had a command other than LOCAL or PROXY.
    #[error("PROXY v2 header has command {0}, only LOCAL (0) and PROXY (1) exist")]
    UnsupportedCommand(u8),
    /// A v2 header had an unknown address family or protocol byte.
    #[error("PROXY v2 header has address family byte {0:#04x}, which is not defined")]
    UnsupportedFamily(u8),
    /// A v2 body was longer than `proxy_header_max`.
    #[error(
        "PROXY v2 body of {length} bytes exceeds proxy_header_max of {max}; raise the limit if the proxy sends many TLVs"
    )]
    BodyTooLarge {
        /// The announced body length.
        length: usize,
        /// The configured maximum.
        max: usize,
    },
    /// A v2 body was too short for its address family.
    #[error("PROXY v2 body of {length} bytes is too short for its addresses ({need} bytes)")]
    AddressTooShort {
        /// The announced body length.
        length: usize,
        /// The bytes the address block needs.
        need: usize,
    },
    /// A v2 TLV ran past the end of the body.
    #[error("a PROXY v2 TLV runs past the end of the header")]
    TlvMalformed,
    /// The CRC32C TLV did not match the header.
    #[error("the PROXY v2 CRC32C checksum does not match; the header was corrupted")]
    ChecksumMismatch,
}
