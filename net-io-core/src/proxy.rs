//! A sans-IO PROXY protocol v1/v2 parser: fed every byte received so far, it answers need-more, done or an error.
//!
//! The driver reads under the handshake deadline, appends to its buffer and calls [`ProxyParser::parse`]
//! with everything so far. The parser keeps no state, allocates nothing and never panics on any input
//! (a property test and a fuzz target hold it to that). v1 lines are strict: one space between fields,
//! canonical addresses, ports without leading zeros, CRLF within 107 bytes. v2 bodies are checked against
//! `proxy_header_max` as soon as the length field arrives, TLVs are walked with bounds checks, and a
//! CRC32C TLV, when present, must match.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::checksum::{Crc32c, crc32c};

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

/// Which PROXY versions a listener accepts. There is no "optional" mode: the protocol forbids guessing
/// whether a header is there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ProxyMode {
    /// Only the text format.
    V1,
    /// Only the binary format.
    V2,
    /// Either format.
    #[default]
    Any,
}

/// The PROXY protocol version of a parsed header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProxyVersion {
    /// The text format.
    V1,
    /// The binary format.
    V2,
}

/// What the header says the proxy did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProxyCommand {
    /// The proxy's own connection (health check): use the real endpoints.
    Local,
    /// A relayed client connection: the addresses name the client.
    Proxy,
}

/// The transport the proxied connection used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProxyTransport {
    /// Not given (`UNKNOWN` in v1, `UNSPEC` in v2).
    Unknown,
    /// TCP (stream over IPv4 or IPv6).
    Tcp,
    /// UDP (datagram over IPv4 or IPv6).
    Udp,
    /// A Unix socket, stream or datagram; its paths are not parsed.
    Unix,
}

/// A parsed PROXY header. Addresses are present only for a `Proxy` command over IPv4 or IPv6.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProxyHeader {
    /// The version.
    pub version: ProxyVersion,
    /// The command.
    pub command: ProxyCommand,
    /// The transport.
    pub transport: ProxyTransport,
    /// The client's address.
    pub source: Option<SocketAddr>,
    /// The address the client connected to.
    pub destination: Option<SocketAddr>,
    /// True when a CRC32C TLV was present and matched.
    pub checksum_verified: bool,
    tlv_start: usize,
    tlv_end: usize,
}

/// The parser's answer for the bytes so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyStatus {
    /// The bytes so far are a valid beginning; feed more (all of them again, from the start).
    NeedMore,
    /// A complete header; bytes after `consumed` are application data.
    Done {
        /// The header.
        header: ProxyHeader,
        /// How many bytes the header took.
        consumed: usize,
    },
}

/// One type-length-value entry of a v2 header, borrowed from the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tlv<'a> {
    /// The type byte (see the `TLV_*` constants).
    pub kind: u8,
    /// The value.
    pub value: &'a [u8],
}

/// An iterator over the TLVs of a v2 header.
#[derive(Clone, Debug)]
pub struct Tlvs<'a> {
    rest: &'a [u8],
}

/// A sans-IO PROXY header parser. `Copy`, no state between calls, no allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProxyParser {
    mode: ProxyMode,
    max_body: usize,
}

/// The v2 signature.
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// The longest v1 line, CRLF included.
pub const V1_MAX: usize = 107;
/// TLV type: application-layer protocol (ALPN).
pub const TLV_ALPN: u8 = 0x01;
/// TLV type: the host name the client asked for (SNI).
pub const TLV_AUTHORITY: u8 = 0x02;
/// TLV type: CRC32C of the whole header.
pub const TLV_CRC32C: u8 = 0x03;
/// TLV type: padding, ignored.
pub const TLV_NOOP: u8 = 0x04;
/// TLV type: an opaque connection id from the proxy.
pub const TLV_UNIQUE_ID: u8 = 0x05;
/// TLV type: TLS facts (with sub-TLVs).
pub const TLV_SSL: u8 = 0x20;
/// TLV type: network namespace name.
pub const TLV_NETNS: u8 = 0x30;

const V1_PREFIX: &[u8] = b"PROXY ";

impl ProxyParser {
    /// A parser for `mode` that accepts v2 bodies up to `max_body` bytes (`proxy_header_max`).
    pub const fn new(mode: ProxyMode, max_body: usize) -> ProxyParser {
        ProxyParser { mode, max_body }
    }

    /// Parses the bytes received so far (always from the first byte).
    ///
    /// Rejects as early as it can: a wrong signature on the first byte that differs, a v1 line past 107
    /// bytes, a v2 body longer than the maximum as soon as its length field arrives.
    pub fn parse(&self, bytes: &[u8]) -> Result<ProxyStatus, ProxyError> {
        let Some(&first) = bytes.first() else {
            return Ok(ProxyStatus::NeedMore);
        };
        let v1 = matches!(self.mode, ProxyMode::V1 | ProxyMode::Any) && first == b'P';
        let v2 = matches!(self.mode, ProxyMode::V2 | ProxyMode::Any) && first == b'\r';
        if v1 {
            parse_v1(bytes)
        } else if v2 {
            parse_v2(bytes, self.max_body)
        } else {
            Err(ProxyError::NotProxy)
        }
    }
}

impl ProxyHeader {
    /// The TLVs of a v2 header, read from the same bytes that were parsed. Empty for v1.
    pub fn tlvs<'a>(&self, bytes: &'a [u8]) -> Tlvs<'a> {
        Tlvs {
            rest: bytes.get(self.tlv_start..self.tlv_end).unwrap_or(&[]),
        }
    }

    /// The first TLV of type `kind`, if any.
    pub fn tlv<'a>(&self, bytes: &'a [u8], kind: u8) -> Option<&'a [u8]> {
        self.tlvs(bytes)
            .find(|tlv| tlv.kind == kind)
            .map(|tlv| tlv.value)
    }
}

impl<'a> Iterator for Tlvs<'a> {
    type Item = Tlv<'a>;

    fn next(&mut self) -> Option<Tlv<'a>> {
        // The range was validated at parse time; a short remainder just ends the walk.
        let [kind, high, low, rest @ ..] = self.rest else {
            return None;
        };
        let length = usize::from(u16::from_be_bytes([*high, *low]));
        let value = rest.get(..length)?;
        self.rest = &rest[length..];
        Some(Tlv { kind: *kind, value })
    }
}

/// A v1 header line for `source` and `destination` (both IPv4 or both IPv6), or `UNKNOWN` if they differ.
pub fn encode_v1(source: SocketAddr, destination: SocketAddr) -> String {
    match (source, destination) {
        (SocketAddr::V4(s), SocketAddr::V4(d)) => format!(
            "PROXY TCP4 {} {} {} {}\r\n",
            s.ip(),
            d.ip(),
            s.port(),
            d.port()
        ),
        (SocketAddr::V6(s), SocketAddr::V6(d)) => format!(
            "PROXY TCP6 {} {} {} {}\r\n",
            s.ip(),
            d.ip(),
            s.port(),
            d.port()
        ),
        _ => "PROXY UNKNOWN\r\n".to_owned(),
    }
}

/// A v2 header. `addresses` `None` makes a LOCAL header; TLVs are appended in order, then a CRC32C TLV
/// when `checksum` is set. Mixed families fall back to UNSPEC.
pub fn encode_v2(
    addresses: Option<(SocketAddr, SocketAddr)>,
    tlvs: &[(u8, &[u8])],
    checksum: bool,
) -> Vec<u8> {
    let mut header = Vec::with_capacity(64);
    header.extend_from_slice(&V2_SIGNATURE);
    let mut body = Vec::new();
    let (command, family) = match addresses {
        None => (0x20, 0x00),
        Some((SocketAddr::V4(s), SocketAddr::V4(d))) => {
            body.extend_from_slice(&s.ip().octets());
            body.extend_from_slice(&d.ip().octets());
            body.extend_from_slice(&s.port().to_be_bytes());
            body.extend_from_slice(&d.port().to_be_bytes());
            (0x21, 0x11)
        }
        Some((SocketAddr::V6(s), SocketAddr::V6(d))) => {
            body.extend_from_slice(&s.ip().octets());
            body.extend_from_slice(&d.ip().octets());
            body.extend_from_slice(&s.port().to_be_bytes());
            body.extend_from_slice(&d.port().to_be_bytes());
            (0x21, 0x21)
        }
        Some(_) => (0x21, 0x00),
    };
    for (kind, value) in tlvs {
        body.push(*kind);
        body.extend_from_slice(&(value.len() as u16).to_be_bytes());
        body.extend_from_slice(value);
    }
    let crc_at = if checksum {
        body.extend_from_slice(&[TLV_CRC32C, 0, 4, 0, 0, 0, 0]);
        Some(16 + body.len() - 4)
    } else {
        None
    };
    header.push(command);
    header.push(family);
    header.extend_from_slice(&(body.len() as u16).to_be_bytes());
    header.extend_from_slice(&body);
    if let Some(at) = crc_at {
        let crc = crc32c(&header);
        header[at..at + 4].copy_from_slice(&crc.to_be_bytes());
    }
    header
}

fn parse_v1(bytes: &[u8]) -> Result<ProxyStatus, ProxyError> {
    let prefix_length = bytes.len().min(V1_PREFIX.len());
    if bytes[..prefix_length] != V1_PREFIX[..prefix_length] {
        return Err(ProxyError::NotProxy);
    }
    let window = &bytes[..bytes.len().min(V1_MAX)];
    // One pass finds the LF and rejects anything but printable ASCII, so garbage is refused at once
    // rather than at the handshake deadline. A CR is allowed only right before the LF (or as the last
    // byte so far, as half a CRLF).
    let mut newline = None;
    for (index, &byte) in window.iter().enumerate().skip(V1_PREFIX.len()) {
        match byte {
            b' '..=b'~' => {}
            b'\n' => {
                newline = Some(index);
                break;
            }
            b'\r' if window.get(index + 1).is_none_or(|&next| next == b'\n') => {}
            _ => return Err(ProxyError::V1Malformed("a byte outside printable ASCII")),
        }
    }
    let Some(newline) = newline else {
        return if bytes.len() >= V1_MAX {
            Err(ProxyError::V1TooLong)
        } else {
            Ok(ProxyStatus::NeedMore)
        };
    };
    if newline < V1_PREFIX.len() + 1 || window[newline - 1] != b'\r' {
        return Err(ProxyError::V1Malformed("the line does not end in CRLF"));
    }
    let line = &window[V1_PREFIX.len()..newline - 1];
    let consumed = newline + 1;
    let mut fields = line.split(|&byte| byte == b' ');
    let protocol = fields.next().unwrap_or(&[]);
    if protocol == b"UNKNOWN" {
        // The protocol says to ignore whatever follows UNKNOWN up to the CRLF.
        return Ok(ProxyStatus::Done {
            header: ProxyHeader {
                version: ProxyVersion::V1,
                command: ProxyCommand::Proxy,
                transport: ProxyTransport::Unknown,
                source: None,
                destination: None,
                checksum_verified: false,
                tlv_start: 0,
                tlv_end: 0,
            },
            consumed,
        });
    }
    let v6 = match protocol {
        b"TCP4" => false,
        b"TCP6" => true,
        _ => {
            return Err(ProxyError::V1Malformed(
                "the protocol is not TCP4, TCP6 or UNKNOWN",
            ));
        }
    };
    let (Some(source), Some(destination), Some(source_port), Some(destination_port), None) = (
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
    ) else {
        return Err(ProxyError::V1Malformed(
            "expected exactly two addresses and two ports separated by single spaces",
        ));
    };
    let source = parse_v1_address(source, v6)?;
    let destination = parse_v1_address(destination, v6)?;
    let source_port = parse_v1_port(source_port)?;
    let destination_port = parse_v1_port(destination_port)?;
    Ok(ProxyStatus::Done {
        header: ProxyHeader {
            version: ProxyVersion::V1,
            command: ProxyCommand::Proxy,
            transport: ProxyTransport::Tcp,
            source: Some(SocketAddr::new(source, source_port)),
            destination: Some(SocketAddr::new(destination, destination_port)),
            checksum_verified: false,
            tlv_start: 0,
            tlv_end: 0,
        },
        consumed,
    })
}

fn parse_v1_address(text: &[u8], v6: bool) -> Result<IpAddr, ProxyError> {
    if v6 {
        // The line was checked to be printable ASCII, so this conversion cannot fail in practice.
        std::str::from_utf8(text)
            .ok()
            .and_then(|text| text.parse::<Ipv6Addr>().ok())
            .map(IpAddr::V6)
            .ok_or(ProxyError::V1Malformed(
                "a TCP6 address is not an IPv6 address",
            ))
    } else {
        parse_ipv4(text)
            .map(IpAddr::V4)
            .ok_or(ProxyError::V1Malformed(
                "a TCP4 address is not a dotted IPv4 address",
            ))
    }
}

/// A strict dotted quad: four decimal octets of 1 to 3 digits, no leading zeros, each at most 255.
/// Hand-rolled because this is the hot part of a v1 line and needs no generality.
fn parse_ipv4(text: &[u8]) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = text.split(|&byte| byte == b'.');
    for octet in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || part.len() > 3 || (part.len() > 1 && part[0] == b'0') {
            return None;
        }
        let mut value: u16 = 0;
        for &byte in part {
            if !byte.is_ascii_digit() {
                return None;
            }
            value = value * 10 + u16::from(byte - b'0');
        }
        *octet = u8::try_from(value).ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(Ipv4Addr::from(octets))
}

fn parse_v1_port(bytes: &[u8]) -> Result<u16, ProxyError> {
    let plain_digits = !bytes.is_empty()
        && bytes.len() <= 5
        && bytes.iter().all(u8::is_ascii_digit)
        && (bytes == b"0" || bytes[0] != b'0');
    if !plain_digits {
        return Err(ProxyError::V1Malformed(
            "a port is not a decimal number without leading zeros",
        ));
    }
    let value = bytes
        .iter()
        .fold(0u32, |value, &byte| value * 10 + u32::from(byte - b'0'));
    u16::try_from(value).map_err(|_| ProxyError::V1Malformed("a port is above 65535"))
}

fn parse_v2(bytes: &[u8], max_body: usize) -> Result<ProxyStatus, ProxyError> {
    let signature_length = bytes.len().min(V2_SIGNATURE.len());
    if bytes[..signature_length] != V2_SIGNATURE[..signature_length] {
        return Err(ProxyError::NotProxy);
    }
    let Some(&version_command) = bytes.get(12) else {
        return Ok(ProxyStatus::NeedMore);
    };
    let version = version_command >> 4;
    if version != 2 {
        return Err(ProxyError::UnsupportedVersion(version));
    }
    let command = match version_command & 0x0f {
        0 => ProxyCommand::Local,
        1 => ProxyCommand::Proxy,
        other => return Err(ProxyError::UnsupportedCommand(other)),
    };
    let Some(&family_protocol) = bytes.get(13) else {
        return Ok(ProxyStatus::NeedMore);
    };
    let (address_length, transport) = match family_protocol {
        0x00 => (0, ProxyTransport::Unknown),
        0x11 => (12, ProxyTransport::Tcp),
        0x12 => (12, ProxyTransport::Udp),
        0x21 => (36, ProxyTransport::Tcp),
        0x22 => (36, ProxyTransport::Udp),
        0x31 | 0x32 => (216, ProxyTransport::Unix),
        other => return Err(ProxyError::UnsupportedFamily(other)),
    };
    let (Some(&high), Some(&low)) = (bytes.get(14), bytes.get(15)) else {
        return Ok(ProxyStatus::NeedMore);
    };
    let length = usize::from(u16::from_be_bytes([high, low]));
    if length > max_body {
        return Err(ProxyError::BodyTooLarge {
            length,
            max: max_body,
        });
    }
    if length < address_length {
        return Err(ProxyError::AddressTooShort {
            length,
            need: address_length,
        });
    }
    let total = 16 + length;
    let Some(header) = bytes.get(..total) else {
        return Ok(ProxyStatus::NeedMore);
    };
    let addresses = &header[16..16 + address_length];
    let (source, destination) = match (command, family_protocol >> 4) {
        (ProxyCommand::Proxy, 1) => {
            let ip = |at: usize| {
                IpAddr::V4(Ipv4Addr::new(
                    addresses[at],
                    addresses[at + 1],
                    addresses[at + 2],
                    addresses[at + 3],
                ))
            };
            let port = |at: usize| u16::from_be_bytes([addresses[at], addresses[at + 1]]);
            (
                Some(SocketAddr::new(ip(0), port(8))),
                Some(SocketAddr::new(ip(4), port(10))),
            )
        }
        (ProxyCommand::Proxy, 2) => {
            let ip = |at: usize| {
                let mut octets = [0u8; 16];
                octets.copy_from_slice(&addresses[at..at + 16]);
                IpAddr::V6(Ipv6Addr::from(octets))
            };
            let port = |at: usize| u16::from_be_bytes([addresses[at], addresses[at + 1]]);
            (
                Some(SocketAddr::new(ip(0), port(32))),
                Some(SocketAddr::new(ip(16), port(34))),
            )
        }
        _ => (None, None),
    };
    let tlv_start = 16 + address_length;
    let crc_at = validate_tlvs(header, tlv_start)?;
    let checksum_verified = match crc_at {
        Some(at) => {
            let expected =
                u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]);
            let mut crc = Crc32c::new();
            crc.update(&header[..at]);
            crc.update(&[0; 4]);
            crc.update(&header[at + 4..]);
            if crc.finish() != expected {
                return Err(ProxyError::ChecksumMismatch);
            }
            true
        }
        None => false,
    };
    Ok(ProxyStatus::Done {
        header: ProxyHeader {
            version: ProxyVersion::V2,
            command,
            transport,
            source,
            destination,
            checksum_verified,
            tlv_start,
            tlv_end: total,
        },
        consumed: total,
    })
}

/// Walks the TLVs with bounds checks and returns where the CRC32C value sits, if there is one.
fn validate_tlvs(header: &[u8], start: usize) -> Result<Option<usize>, ProxyError> {
    let mut at = start;
    let mut crc_at = None;
    while at < header.len() {
        let (Some(&kind), Some(&high), Some(&low)) =
            (header.get(at), header.get(at + 1), header.get(at + 2))
        else {
            return Err(ProxyError::TlvMalformed);
        };
        let length = usize::from(u16::from_be_bytes([high, low]));
        let value_at = at + 3;
        if value_at + length > header.len() {
            return Err(ProxyError::TlvMalformed);
        }
        if kind == TLV_CRC32C {
            if length != 4 || crc_at.is_some() {
                return Err(ProxyError::TlvMalformed);
            }
            crc_at = Some(value_at);
        }
        at = value_at + length;
    }
    Ok(crc_at)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARSER: ProxyParser = ProxyParser::new(ProxyMode::Any, 1024);

    fn done(bytes: &[u8]) -> (ProxyHeader, usize) {
        match PARSER.parse(bytes) {
            Ok(ProxyStatus::Done { header, consumed }) => (header, consumed),
            other => panic!("expected a complete header, got {other:?}"),
        }
    }

    #[test]
    fn a_v1_tcp4_line_parses_and_data_after_it_is_left() {
        let bytes = b"PROXY TCP4 192.0.2.1 198.51.100.2 56324 443\r\nGET / HTTP/1.1\r\n";
        let (header, consumed) = done(bytes);
        assert_eq!(consumed, 45);
        assert_eq!(header.source, Some("192.0.2.1:56324".parse().unwrap()));
        assert_eq!(
            header.destination,
            Some("198.51.100.2:443".parse().unwrap())
        );
        assert_eq!(&bytes[consumed..], b"GET / HTTP/1.1\r\n");
    }

    #[test]
    fn a_v1_tcp6_and_an_unknown_line_parse() {
        let (header, _) = done(b"PROXY TCP6 2001:db8::1 2001:db8::2 1 2\r\n");
        assert_eq!(header.source, Some("[2001:db8::1]:1".parse().unwrap()));
        let (header, consumed) = done(b"PROXY UNKNOWN ffff::1 ffff::2 3 4\r\n");
        assert_eq!(header.transport, ProxyTransport::Unknown);
        assert_eq!(header.source, None);
        assert_eq!(consumed, 35);
    }

    #[test]
    fn malformed_v1_lines_are_rejected() {
        let cases: [&[u8]; 9] = [
            b"PROXY TCP4 192.0.2.1 198.51.100.2 56324 443\n",
            b"PROXY TCP4 192.0.2.1  198.51.100.2 56324 443\r\n",
            b"PROXY TCP4 192.0.2.1 198.51.100.2 56324 0443\r\n",
            b"PROXY TCP4 192.0.2.1 198.51.100.2 56324 65536\r\n",
            b"PROXY TCP4 2001:db8::1 198.51.100.2 1 2\r\n",
            b"PROXY TCP6 192.0.2.1 198.51.100.2 1 2\r\n",
            b"PROXY TCP4 192.0.2.1 198.51.100.2 1 2 3\r\n",
            b"PROXY UDP4 192.0.2.1 198.51.100.2 1 2\r\n",
            b"PROXY TCP4 192.0.2.1 198.51.100.\x002 1 2\r\n",
        ];
        for case in cases {
            assert!(
                PARSER.parse(case).is_err(),
                "{:?} was accepted",
                String::from_utf8_lossy(case)
            );
        }
    }

    #[test]
    fn v1_ipv4_addresses_are_strict_dotted_quads() {
        for good in ["0.0.0.0", "255.255.255.255", "10.0.0.1", "192.0.2.123"] {
            assert_eq!(
                parse_ipv4(good.as_bytes()),
                good.parse().ok(),
                "{good} should parse like std"
            );
        }
        for bad in [
            "256.0.0.1",
            "01.2.3.4",
            "1.2.3",
            "1.2.3.4.5",
            "1..2.3",
            "1.2.3.4 ",
            "",
            "a.b.c.d",
            "1234.1.1.1",
        ] {
            assert_eq!(
                parse_ipv4(bad.as_bytes()),
                None,
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn a_v1_line_without_crlf_in_107_bytes_is_too_long() {
        let mut line = b"PROXY UNKNOWN ".to_vec();
        line.resize(106, b'a');
        assert_eq!(PARSER.parse(&line), Ok(ProxyStatus::NeedMore));
        line.push(b'a');
        assert_eq!(PARSER.parse(&line), Err(ProxyError::V1TooLong));
        let mut longest = b"PROXY UNKNOWN ".to_vec();
        longest.resize(105, b'a');
        longest.extend_from_slice(b"\r\n");
        assert_eq!(done(&longest).1, 107, "a 107-byte line is allowed");
    }

    #[test]
    fn a_v2_header_with_tlvs_and_crc_parses() {
        let source: SocketAddr = "192.0.2.1:1000".parse().unwrap();
        let destination: SocketAddr = "192.0.2.2:443".parse().unwrap();
        let mut bytes = encode_v2(
            Some((source, destination)),
            &[(TLV_AUTHORITY, b"example.com"), (TLV_UNIQUE_ID, b"id-1")],
            true,
        );
        let length = bytes.len();
        bytes.extend_from_slice(b"data");
        let (header, consumed) = done(&bytes);
        assert_eq!(consumed, length);
        assert_eq!(header.source, Some(source));
        assert!(header.checksum_verified);
        assert_eq!(header.tlv(&bytes, TLV_AUTHORITY), Some(&b"example.com"[..]));
        assert_eq!(header.tlvs(&bytes).count(), 3);
    }

    #[test]
    fn a_corrupted_v2_header_fails_its_checksum() {
        let source: SocketAddr = "[2001:db8::1]:1000".parse().unwrap();
        let destination: SocketAddr = "[2001:db8::2]:443".parse().unwrap();
        let mut bytes = encode_v2(Some((source, destination)), &[], true);
        bytes[20] ^= 1;
        assert_eq!(PARSER.parse(&bytes), Err(ProxyError::ChecksumMismatch));
    }

    #[test]
    fn a_v2_body_over_the_limit_is_rejected_before_it_arrives() {
        let mut bytes = V2_SIGNATURE.to_vec();
        bytes.extend_from_slice(&[0x21, 0x11, 0x04, 0x01]);
        assert_eq!(
            PARSER.parse(&bytes),
            Err(ProxyError::BodyTooLarge {
                length: 1025,
                max: 1024
            })
        );
    }

    #[test]
    fn a_v2_local_header_carries_no_addresses() {
        let bytes = encode_v2(None, &[], false);
        let (header, consumed) = done(&bytes);
        assert_eq!(header.command, ProxyCommand::Local);
        assert_eq!(header.source, None);
        assert_eq!(consumed, 16);
    }

    #[test]
    fn the_mode_limits_which_versions_are_accepted() {
        let v1 = b"PROXY UNKNOWN\r\n";
        let v2 = encode_v2(None, &[], false);
        assert_eq!(
            ProxyParser::new(ProxyMode::V2, 1024).parse(v1),
            Err(ProxyError::NotProxy)
        );
        assert_eq!(
            ProxyParser::new(ProxyMode::V1, 1024).parse(&v2),
            Err(ProxyError::NotProxy)
        );
        assert_eq!(PARSER.parse(b"GET / HTTP/1.1"), Err(ProxyError::NotProxy));
        assert_eq!(
            PARSER.parse(b"PROXZ"),
            Err(ProxyError::NotProxy),
            "rejected at the first wrong byte"
        );
    }
}
