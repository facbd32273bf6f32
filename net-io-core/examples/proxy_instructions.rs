//! Instruction counts for PROXY parsing, steadier than wall time on a shared machine.
//!
//! Run one case under callgrind, counting only inside the measured loop:
//! `valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*measure*' \
//!   target/release/examples/proxy_instructions v2_tcp4 net-io-core 1000`
//! and divide the collected instructions by the iteration count. `docs/performance/netcore.md` has the
//! script that runs every case.

use std::hint::black_box;
use std::net::SocketAddr;

use net_io_core::proxy::{self, ProxyMode, ProxyParser};

fn input(case: &str) -> Vec<u8> {
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
    match case {
        "v1_tcp4" => proxy::encode_v1(v4.0, v4.1).into_bytes(),
        "v1_tcp6" => proxy::encode_v1(v6.0, v6.1).into_bytes(),
        "v2_tcp4" => proxy::encode_v2(Some(v4), &[], false),
        "v2_tcp6" => proxy::encode_v2(Some(v6), &[], false),
        "v2_tcp4_5_tlvs" => proxy::encode_v2(Some(v4), &five_tlvs, false),
        "v2_tcp4_5_tlvs_crc" => proxy::encode_v2(Some(v4), &five_tlvs, true),
        other => panic!("unknown case {other}"),
    }
}

#[inline(never)]
fn measure_ours(bytes: &[u8], iterations: u64) {
    let parser = ProxyParser::new(ProxyMode::Any, 1024);
    for _ in 0..iterations {
        let _ = black_box(parser.parse(black_box(bytes)));
    }
}

#[inline(never)]
fn measure_ppp(bytes: &[u8], iterations: u64) {
    for _ in 0..iterations {
        let result = ppp::HeaderResult::parse(black_box(bytes));
        black_box(&result);
    }
}

fn main() {
    let arguments: Vec<String> = std::env::args().collect();
    let [_, case, parser, iterations] = &arguments[..] else {
        eprintln!("usage: proxy_instructions CASE (net-io-core|ppp) ITERATIONS");
        std::process::exit(2);
    };
    let bytes = input(case);
    let iterations: u64 = iterations.parse().expect("ITERATIONS is a number");
    match parser.as_str() {
        "net-io-core" => measure_ours(&bytes, iterations),
        "ppp" => measure_ppp(&bytes, iterations),
        other => panic!("unknown parser {other}"),
    }
}
