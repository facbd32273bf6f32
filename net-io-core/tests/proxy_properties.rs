//! Property tests for the PROXY parser: random bytes never panic it, and a valid header parses the same at every split.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use net_io_core::proxy::{self, ProxyError, ProxyMode, ProxyParser, ProxyStatus, V2_SIGNATURE};
use proptest::prelude::*;

const MODES: [ProxyMode; 3] = [ProxyMode::V1, ProxyMode::V2, ProxyMode::Any];

fn socket_pair() -> impl Strategy<Value = (SocketAddr, SocketAddr)> {
    prop_oneof![
        (any::<u32>(), any::<u32>(), any::<u16>(), any::<u16>()).prop_map(|(s, d, sp, dp)| {
            (
                SocketAddr::new(IpAddr::V4(Ipv4Addr::from(s)), sp),
                SocketAddr::new(IpAddr::V4(Ipv4Addr::from(d)), dp),
            )
        }),
        (any::<u128>(), any::<u128>(), any::<u16>(), any::<u16>()).prop_map(|(s, d, sp, dp)| {
            (
                SocketAddr::new(IpAddr::V6(Ipv6Addr::from(s)), sp),
                SocketAddr::new(IpAddr::V6(Ipv6Addr::from(d)), dp),
            )
        }),
    ]
}

fn tlv_list() -> impl Strategy<Value = Vec<(u8, Vec<u8>)>> {
    // Type 0x03 is the checksum, which the encoder adds itself.
    prop::collection::vec(
        (
            any::<u8>().prop_filter("not the CRC type", |kind| *kind != 0x03),
            prop::collection::vec(any::<u8>(), 0..40),
        ),
        0..6,
    )
}

/// A valid header of either version, with its expected source address.
fn valid_header() -> impl Strategy<Value = (Vec<u8>, Option<SocketAddr>)> {
    prop_oneof![
        socket_pair().prop_map(|(source, destination)| {
            (
                proxy::encode_v1(source, destination).into_bytes(),
                Some(source),
            )
        }),
        (socket_pair(), tlv_list(), any::<bool>(), any::<bool>()).prop_map(
            |((source, destination), tlvs, checksum, local)| {
                let borrowed: Vec<(u8, &[u8])> = tlvs
                    .iter()
                    .map(|(kind, value)| (*kind, &value[..]))
                    .collect();
                let addresses = (!local).then_some((source, destination));
                (
                    proxy::encode_v2(addresses, &borrowed, checksum),
                    addresses.map(|(source, _)| source),
                )
            }
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn random_bytes_never_panic_the_parser(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        for mode in MODES {
            let _ = ProxyParser::new(mode, 1024).parse(&bytes);
        }
    }

    #[test]
    fn random_bytes_after_a_v2_signature_never_panic_the_parser(
        tail in prop::collection::vec(any::<u8>(), 0..300),
        max in 0usize..400,
    ) {
        let mut bytes = V2_SIGNATURE.to_vec();
        bytes.extend_from_slice(&tail);
        if let Ok(ProxyStatus::Done { consumed, header }) = ProxyParser::new(ProxyMode::Any, max).parse(&bytes) {
            prop_assert!(consumed <= bytes.len(), "consumed more than was given");
            prop_assert!(consumed - 16 <= max, "a body over the maximum was accepted");
            // Walking the TLVs of whatever parsed must not panic either.
            let _ = header.tlvs(&bytes).count();
        }
    }

    #[test]
    fn random_bytes_after_a_v1_prefix_never_panic_the_parser(
        tail in prop::collection::vec(prop_oneof![Just(b' '), Just(b'\r'), Just(b'\n'), b'0'..=b':', any::<u8>()], 0..120),
    ) {
        let mut bytes = b"PROXY TCP4 ".to_vec();
        bytes.extend_from_slice(&tail);
        if let Ok(ProxyStatus::Done { consumed, .. }) = ProxyParser::new(ProxyMode::Any, 1024).parse(&bytes) {
            prop_assert!(consumed <= 107, "a v1 line over 107 bytes was accepted");
        }
    }

    #[test]
    fn a_valid_header_split_at_every_byte_gives_the_same_result(
        (header, source) in valid_header(),
        data in prop::collection::vec(any::<u8>(), 0..20),
    ) {
        let parser = ProxyParser::new(ProxyMode::Any, 1024);
        let mut bytes = header.clone();
        bytes.extend_from_slice(&data);
        let whole = parser.parse(&bytes);
        let Ok(ProxyStatus::Done { header: parsed, consumed }) = whole else {
            return Err(TestCaseError::fail(format!("a valid header did not parse: {whole:?}")));
        };
        prop_assert_eq!(consumed, header.len(), "the header length is wrong");
        prop_assert_eq!(parsed.source, source, "the source address is wrong");
        for split in 0..header.len() {
            prop_assert_eq!(
                parser.parse(&bytes[..split]),
                Ok(ProxyStatus::NeedMore),
                "a valid prefix of {} bytes was not NeedMore", split
            );
        }
        for extra in header.len()..=bytes.len() {
            prop_assert_eq!(parser.parse(&bytes[..extra]), whole, "trailing data changed the result");
        }
    }

    #[test]
    fn a_flipped_byte_in_a_checksummed_v2_header_is_caught(
        ((source, destination), tlvs) in (socket_pair(), tlv_list()),
        flip_at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let borrowed: Vec<(u8, &[u8])> = tlvs.iter().map(|(kind, value)| (*kind, &value[..])).collect();
        let mut bytes = proxy::encode_v2(Some((source, destination)), &borrowed, true);
        // Flip a byte of the addresses, a TLV value or the checksum itself. Flips in TLV framing (types and
        // lengths) can legally hide the optional checksum TLV inside another TLV, so they are not covered.
        let address_length = if source.is_ipv4() { 12 } else { 36 };
        let mut eligible: Vec<usize> = (16..16 + address_length).collect();
        let mut at = 16 + address_length;
        for (_, value) in &tlvs {
            eligible.extend(at + 3..at + 3 + value.len());
            at += 3 + value.len();
        }
        eligible.extend(bytes.len() - 4..bytes.len());
        let position = eligible[flip_at.index(eligible.len())];
        bytes[position] ^= flip;
        let result = ProxyParser::new(ProxyMode::Any, 1024).parse(&bytes);
        prop_assert!(
            matches!(result, Err(ProxyError::ChecksumMismatch) | Err(ProxyError::TlvMalformed)),
            "a corrupted header was accepted: {:?}", result
        );
    }
}

#[test]
fn every_fuzz_seed_is_a_complete_header() {
    let directory = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/proxy");
    let mut seeds = 0;
    for entry in std::fs::read_dir(&directory).expect("the fuzz seed corpus is missing") {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let result = ProxyParser::new(ProxyMode::Any, 1024).parse(&bytes);
        assert!(
            matches!(result, Ok(ProxyStatus::Done { .. })),
            "seed {} does not parse: {result:?}",
            path.display()
        );
        seeds += 1;
    }
    assert!(seeds >= 5, "only {seeds} seeds found");
}
