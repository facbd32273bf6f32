//! Property tests for CIDR blocks, prefix keys and the trusted-proxy set against plain integer masks.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use net_io_core::addr::{Cidr, PrefixPolicy, TrustedProxies};
use proptest::prelude::*;

fn mask_v4(bits: u32, prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        bits & (u32::MAX << (32 - u32::from(prefix)))
    }
}

fn mask_v6(bits: u128, prefix: u8) -> u128 {
    if prefix == 0 {
        0
    } else {
        bits & (u128::MAX << (128 - u32::from(prefix)))
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn ipv4_blocks_agree_with_integer_masks(network in any::<u32>(), prefix in 0u8..=32, probe in any::<u32>()) {
        let text = format!("{}/{}", Ipv4Addr::from(network), prefix);
        let parsed = text.parse::<Cidr>();
        if mask_v4(network, prefix) != network {
            prop_assert!(parsed.is_err(), "{} has host bits but parsed", text);
            return Ok(());
        }
        let block = parsed.unwrap();
        let expected = mask_v4(probe, prefix) == network;
        prop_assert_eq!(block.contains(IpAddr::V4(Ipv4Addr::from(probe))), expected);
        let trusted = TrustedProxies::from_blocks(&[block]).unwrap();
        prop_assert_eq!(trusted.contains(IpAddr::V4(Ipv4Addr::from(probe))), expected);
    }

    #[test]
    fn ipv6_blocks_agree_with_integer_masks(network in any::<u128>(), prefix in 0u8..=128, probe in any::<u128>()) {
        let network = mask_v6(network, prefix);
        let block = Cidr::new(IpAddr::V6(Ipv6Addr::from(network)), prefix).unwrap();
        // Keep the probe IPv6-only: a mapped IPv4 probe is normalised to IPv4 first.
        let probe_address = Ipv6Addr::from(probe);
        prop_assume!(probe_address.to_ipv4_mapped().is_none());
        prop_assert_eq!(block.contains(IpAddr::V6(probe_address)), mask_v6(probe, prefix) == network);
    }

    #[test]
    fn prefix_keys_are_equal_exactly_when_the_masked_addresses_are(
        a in any::<u128>(), b in any::<u128>(), v6 in 0u8..=128, same_prefix in any::<bool>(),
    ) {
        let policy = PrefixPolicy { v4: 32, v6 };
        let b = if same_prefix { mask_v6(a, v6) | (b & !mask_v6(u128::MAX, v6)) } else { b };
        let (a_address, b_address) = (Ipv6Addr::from(a), Ipv6Addr::from(b));
        prop_assume!(a_address.to_ipv4_mapped().is_none() && b_address.to_ipv4_mapped().is_none());
        let equal = policy.key(IpAddr::V6(a_address)) == policy.key(IpAddr::V6(b_address));
        prop_assert_eq!(equal, mask_v6(a, v6) == mask_v6(b, v6));
    }

    #[test]
    fn a_trusted_set_of_many_blocks_matches_a_linear_scan(
        blocks in prop::collection::vec((any::<u32>(), 8u8..=32), 1..40),
        probes in prop::collection::vec(any::<u32>(), 50),
    ) {
        let cidrs: Vec<Cidr> = blocks
            .iter()
            .map(|&(bits, prefix)| Cidr::new(IpAddr::V4(Ipv4Addr::from(mask_v4(bits, prefix))), prefix).unwrap())
            .collect();
        let trusted = TrustedProxies::from_blocks(&cidrs).unwrap();
        for probe in probes {
            let address = IpAddr::V4(Ipv4Addr::from(probe));
            let linear = cidrs.iter().any(|cidr| cidr.contains(address));
            prop_assert_eq!(trusted.contains(address), linear, "binary search disagrees for {}", address);
        }
    }
}
