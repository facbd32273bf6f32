//! PROXY header parse times: our sans-IO parser against the `ppp` crate, same inputs, same run.
//!
//! Run: `cargo bench -p net-io-core --bench proxy`. Reference targets (net-io B-9): v1 under 100 ns,
//! v2 under 50 ns, v2 with 5 TLVs and CRC32C under 300 ns.

use std::hint::black_box;
use std::net::SocketAddr;

use criterion::{Criterion, criterion_group, criterion_main};
use net_io_core::checksum::crc32c;
use net_io_core::proxy::{self, ProxyMode, ProxyParser, ProxyStatus};

fn inputs() -> Vec<(&'static str, Vec<u8>)> {
    let v4: (SocketAddr, SocketAddr) = (
        "192.0.2.123:56324".parse().unwrap(),
        "198.51.100.2:443".parse().unwrap(),
    );
    let v6: (SocketAddr, SocketAddr) = (
        "[2001:db8:85a3::8a2e:370:7334]:56324".parse().unwrap(),
        "[2001:db8::2]:443".parse().unwrap(),
    );
    let five_tlvs: [(u8, &[u8]); 5] = [
        (proxy::TLV_ALPN, b"h2"),
        (proxy::TLV_AUTHORITY, b"api.example.com"),
        (proxy::TLV_UNIQUE_ID, b"0123456789abcdef0123456789abcdef"),
        (proxy::TLV_NOOP, &[0; 8]),
        (proxy::TLV_NETNS, b"blue"),
    ];
    vec![
        ("v1_tcp4", proxy::encode_v1(v4.0, v4.1).into_bytes()),
        ("v1_tcp6", proxy::encode_v1(v6.0, v6.1).into_bytes()),
        ("v2_tcp4", proxy::encode_v2(Some(v4), &[], false)),
        ("v2_tcp6", proxy::encode_v2(Some(v6), &[], false)),
        (
            "v2_tcp4_5_tlvs",
            proxy::encode_v2(Some(v4), &five_tlvs, false),
        ),
        (
            "v2_tcp4_5_tlvs_crc",
            proxy::encode_v2(Some(v4), &five_tlvs, true),
        ),
    ]
}

fn parse_times(criterion: &mut Criterion) {
    let parser = ProxyParser::new(ProxyMode::Any, 1024);
    for (name, bytes) in inputs() {
        assert!(
            matches!(parser.parse(&bytes), Ok(ProxyStatus::Done { .. })),
            "{name} does not parse"
        );
        let mut group = criterion.benchmark_group(name);
        group.bench_function("net-io-core", |bencher| {
            bencher.iter(|| parser.parse(black_box(&bytes)))
        });
        group.bench_function("ppp", |bencher| {
            bencher.iter(|| {
                let result = ppp::HeaderResult::parse(black_box(&bytes));
                black_box(&result);
            })
        });
        group.finish();
    }
    let header = proxy::encode_v2(None, &[(proxy::TLV_NOOP, &[7; 100])], false);
    criterion.bench_function("crc32c_116_bytes", |bencher| {
        bencher.iter(|| crc32c(black_box(&header)))
    });
}

criterion_group!(benches, parse_times);
criterion_main!(benches);
