//! Addresses: peer normalisation, strict CIDR blocks, per-source prefix keys and the trusted-proxy set.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

/// The most blocks a [`TrustedProxies`] set holds.
pub const TRUSTED_PROXIES_MAX: usize = 1024;

/// Turns an IPv4-mapped IPv6 peer (`::ffff:a.b.c.d`) into plain IPv4, so caps and gates see one form.
///
/// The port is kept; an IPv6 scope id is kept on IPv6 addresses (prefix keys ignore it).
pub fn normalize(address: SocketAddr) -> SocketAddr {
    match address {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => address,
        },
        SocketAddr::V4(_) => address,
    }
}

/// An IP block such as `10.0.0.0/8` or `2001:db8::/32`, parsed strictly: host bits set is an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

/// Why a CIDR block did not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CidrError {
    /// The text is not `address/prefix` or a bare address.
    #[error("{text:?} is not an IP block; write it as 10.0.0.0/8 or 2001:db8::/32")]
    Malformed {
        /// The text as given.
        text: String,
    },
    /// The prefix length is longer than the address.
    #[error("prefix /{prefix} is too long; IPv4 allows at most /32 and IPv6 at most /128")]
    PrefixTooLong {
        /// The prefix length as given.
        prefix: u8,
    },
    /// Bits below the prefix are set, which usually means a typo.
    #[error("{text:?} has host bits set below the prefix; did you mean {network}?")]
    HostBitsSet {
        /// The text as given.
        text: String,
        /// The block with the host bits cleared.
        network: Cidr,
    },
    /// A trusted-proxy set would exceed its block limit.
    #[error("{count} trusted-proxy blocks exceed the limit of {max}; merge them into wider blocks")]
    TooManyBlocks {
        /// How many were given.
        count: usize,
        /// The limit.
        max: usize,
    },
}

/// How wide a per-source key is: the prefix lengths for IPv4 and IPv6 sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrefixPolicy {
    /// Prefix length for IPv4 sources, 0 to 32 (default 32: each address is its own source).
    pub v4: u8,
    /// Prefix length for IPv6 sources, 0 to 128 (default 64: one subnet is one source).
    pub v6: u8,
}

/// A fixed-size key that identifies a source prefix, for per-source caps. `Copy`, hashable, no allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PrefixKey {
    bits: u128,
    // 4 or 6 in the high nibble would be clever; a separate byte is clearer and the key stays 32 bytes.
    family: u8,
    prefix: u8,
}

/// A sorted set of trusted IP blocks (for PROXY headers), searched by binary search.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    // Disjoint, sorted, merged ranges of 128-bit keys; IPv4 lives in the mapped range so one search serves both.
    ranges: Vec<(u128, u128)>,
}

impl Cidr {
    /// A block from a network and prefix, rejecting host bits and over-long prefixes.
    pub fn new(network: IpAddr, prefix: u8) -> Result<Cidr, CidrError> {
        let width = address_width(network);
        if prefix > width {
            return Err(CidrError::PrefixTooLong { prefix });
        }
        let masked = mask_address(network, prefix);
        if masked != network {
            return Err(CidrError::HostBitsSet {
                text: format!("{network}/{prefix}"),
                network: Cidr {
                    network: masked,
                    prefix,
                },
            });
        }
        Ok(Cidr { network, prefix })
    }

    /// The network address.
    pub fn network(&self) -> IpAddr {
        self.network
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// True when `address` (normalised first) lies in this block. IPv4 never matches an IPv6 block.
    pub fn contains(&self, address: IpAddr) -> bool {
        let address = normalize_ip(address);
        if address.is_ipv4() != self.network.is_ipv4() {
            return false;
        }
        mask_address(address, self.prefix) == self.network
    }

    /// The first and last 128-bit key the block covers (IPv4 in the mapped range).
    fn range(&self) -> (u128, u128) {
        let start = unified_bits(self.network);
        let host_bits = u32::from(address_width(self.network) - self.prefix);
        let span = if host_bits >= 128 {
            u128::MAX
        } else {
            (1u128 << host_bits) - 1
        };
        (start, start | span)
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(text: &str) -> Result<Cidr, CidrError> {
        let malformed = || CidrError::Malformed {
            text: text.to_owned(),
        };
        let (address, prefix) = match text.split_once('/') {
            Some((address, prefix)) => {
                // u8 parsing accepts "+8"; a prefix is plain digits only.
                if prefix.is_empty()
                    || prefix.len() > 3
                    || !prefix.bytes().all(|b| b.is_ascii_digit())
                {
                    return Err(malformed());
                }
                let prefix: u16 = prefix.parse().map_err(|_| malformed())?;
                let prefix = u8::try_from(prefix)
                    .map_err(|_| CidrError::PrefixTooLong { prefix: u8::MAX })?;
                (address, Some(prefix))
            }
            None => (text, None),
        };
        let address: IpAddr = address.parse().map_err(|_| malformed())?;
        let prefix = prefix.unwrap_or(address_width(address));
        Cidr::new(address, prefix).map_err(|error| match error {
            CidrError::HostBitsSet { network, .. } => CidrError::HostBitsSet {
                text: text.to_owned(),
                network,
            },
            other => other,
        })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}/{}", self.network, self.prefix)
    }
}

impl PrefixPolicy {
    /// The default: every IPv4 address alone, every IPv6 /64 together.
    pub const DEFAULT: PrefixPolicy = PrefixPolicy { v4: 32, v6: 64 };

    /// The key of `address` under this policy (normalised first; an IPv6 scope id is ignored).
    pub fn key(&self, address: IpAddr) -> PrefixKey {
        PrefixKey::new(address, *self)
    }
}

impl Default for PrefixPolicy {
    fn default() -> PrefixPolicy {
        PrefixPolicy::DEFAULT
    }
}

impl PrefixKey {
    /// The key of `address` under `policy`. Prefix lengths above the address width are clamped.
    pub fn new(address: IpAddr, policy: PrefixPolicy) -> PrefixKey {
        let address = normalize_ip(address);
        let (family, prefix) = match address {
            IpAddr::V4(_) => (4, policy.v4.min(32)),
            IpAddr::V6(_) => (6, policy.v6.min(128)),
        };
        let masked = mask_address(address, prefix);
        let bits = match masked {
            IpAddr::V4(v4) => u128::from(u32::from(v4)),
            IpAddr::V6(v6) => u128::from(v6),
        };
        PrefixKey {
            bits,
            family,
            prefix,
        }
    }

    /// The network address of the prefix.
    pub fn network(&self) -> IpAddr {
        if self.family == 4 {
            // The low 32 bits hold the IPv4 address by construction.
            IpAddr::V4(Ipv4Addr::from(self.bits as u32))
        } else {
            IpAddr::V6(Ipv6Addr::from(self.bits))
        }
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }
}

impl fmt::Display for PrefixKey {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}/{}", self.network(), self.prefix)
    }
}

impl TrustedProxies {
    /// An empty set: nobody is trusted.
    pub fn new() -> TrustedProxies {
        TrustedProxies::default()
    }

    /// A set from blocks, merged and sorted. More than [`TRUSTED_PROXIES_MAX`] blocks is an error.
    pub fn from_blocks(blocks: &[Cidr]) -> Result<TrustedProxies, CidrError> {
        if blocks.len() > TRUSTED_PROXIES_MAX {
            return Err(CidrError::TooManyBlocks {
                count: blocks.len(),
                max: TRUSTED_PROXIES_MAX,
            });
        }
        let mut ranges: Vec<(u128, u128)> = blocks.iter().map(Cidr::range).collect();
        ranges.sort_unstable();
        let mut merged: Vec<(u128, u128)> = Vec::with_capacity(ranges.len());
        for (start, end) in ranges {
            match merged.last_mut() {
                Some(last) if start <= last.1.saturating_add(1) => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        Ok(TrustedProxies { ranges: merged })
    }

    /// Parses a list of blocks such as `["10.0.0.0/8", "::1"]`.
    pub fn parse<S: AsRef<str>>(texts: &[S]) -> Result<TrustedProxies, CidrError> {
        let blocks = texts
            .iter()
            .map(|text| text.as_ref().trim().parse())
            .collect::<Result<Vec<Cidr>, _>>()?;
        TrustedProxies::from_blocks(&blocks)
    }

    /// True when `address` (normalised first) lies in a trusted block. O(log n), no allocation.
    pub fn contains(&self, address: IpAddr) -> bool {
        let key = unified_bits(normalize_ip(address));
        // The first range starting after the key; the one before it is the only candidate.
        let after = self.ranges.partition_point(|&(start, _)| start <= key);
        after > 0 && key <= self.ranges[after - 1].1
    }

    /// True when no block is trusted.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

/// `::ffff:a.b.c.d` becomes `a.b.c.d`; everything else is unchanged.
fn normalize_ip(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        IpAddr::V4(_) => address,
    }
}

fn address_width(address: IpAddr) -> u8 {
    if address.is_ipv4() { 32 } else { 128 }
}

/// Clears every bit below `prefix`.
fn mask_address(address: IpAddr, prefix: u8) -> IpAddr {
    match address {
        IpAddr::V4(v4) => {
            let mask = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(prefix.min(32)))
            };
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask))
        }
        IpAddr::V6(v6) => {
            let mask = if prefix == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(prefix.min(128)))
            };
            IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
        }
    }
}

/// One 128-bit space for both families: IPv4 goes into the IPv4-mapped range.
fn unified_bits(address: IpAddr) -> u128 {
    match address {
        IpAddr::V4(v4) => u128::from(v4.to_ipv6_mapped()),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_bits_are_rejected_with_the_corrected_block() {
        let error = "10.0.0.1/8".parse::<Cidr>().unwrap_err();
        assert_eq!(
            error.to_string(),
            "\"10.0.0.1/8\" has host bits set below the prefix; did you mean 10.0.0.0/8?"
        );
    }

    #[test]
    fn over_long_and_malformed_prefixes_are_rejected() {
        assert!(matches!(
            "10.0.0.0/33".parse::<Cidr>(),
            Err(CidrError::PrefixTooLong { prefix: 33 })
        ));
        assert!(matches!(
            "::/129".parse::<Cidr>(),
            Err(CidrError::PrefixTooLong { .. })
        ));
        for text in [
            "10.0.0.0/",
            "10.0.0.0/+8",
            "10.0.0/8",
            "",
            "/8",
            "10.0.0.0/8/8",
        ] {
            assert!(text.parse::<Cidr>().is_err(), "{text:?} should not parse");
        }
    }

    #[test]
    fn a_mapped_peer_becomes_ipv4() {
        let mapped: SocketAddr = "[::ffff:192.0.2.7]:4000".parse().unwrap();
        assert_eq!(normalize(mapped), "192.0.2.7:4000".parse().unwrap());
    }

    #[test]
    fn prefix_keys_group_an_ipv6_subnet_and_separate_ipv4_hosts() {
        let policy = PrefixPolicy::DEFAULT;
        let a = policy.key("2001:db8:1:2::1".parse().unwrap());
        let b = policy.key("2001:db8:1:2:ffff::9".parse().unwrap());
        let c = policy.key("2001:db8:1:3::1".parse().unwrap());
        assert_eq!(a, b, "one /64 must be one source");
        assert_ne!(a, c);
        assert_ne!(
            policy.key("192.0.2.1".parse().unwrap()),
            policy.key("192.0.2.2".parse().unwrap())
        );
        assert_eq!(
            policy.key("::ffff:192.0.2.1".parse().unwrap()),
            policy.key("192.0.2.1".parse().unwrap()),
            "a mapped address must share its IPv4 key"
        );
    }

    #[test]
    fn trusted_proxies_match_merged_blocks_and_nothing_else() {
        let trusted =
            TrustedProxies::parse(&["10.0.0.0/8", "10.1.0.0/16", "192.0.2.0/24", "::1"]).unwrap();
        for inside in ["10.200.3.4", "192.0.2.255", "::1", "::ffff:10.0.0.1"] {
            assert!(
                trusted.contains(inside.parse().unwrap()),
                "{inside} should be trusted"
            );
        }
        for outside in ["11.0.0.0", "192.0.3.0", "::2", "9.255.255.255"] {
            assert!(
                !trusted.contains(outside.parse().unwrap()),
                "{outside} should not be trusted"
            );
        }
        assert!(!TrustedProxies::new().contains("127.0.0.1".parse().unwrap()));
    }

    #[test]
    fn more_than_1024_blocks_is_an_error() {
        let blocks: Vec<Cidr> = (0..1025u32)
            .map(|n| Cidr::new(IpAddr::V4(Ipv4Addr::from(n << 8)), 24).unwrap())
            .collect();
        assert!(matches!(
            TrustedProxies::from_blocks(&blocks),
            Err(CidrError::TooManyBlocks { count: 1025, .. })
        ));
    }
}
