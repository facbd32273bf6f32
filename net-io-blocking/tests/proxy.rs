//! PROXY v1/v2 headers from trusted proxies: the real client address, data after the header, and a malformed,
//! missing, slow or untrusted header closing only its own connection with its reason.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use common::echo::who_am_i;
use common::{Recorder, SOON, client, read_line, round_trip};
use net_io_blocking::{
    CloseReason, Limits, ListenerSpec, ProxyMode, Server, ServerBuilder, TrustedProxies,
};
use net_io_core::proxy::{encode_v1, encode_v2};

/// The handshake deadline of most tests here: short, so the slow-header test ends quickly.
const SHORT_HANDSHAKE: Duration = Duration::from_millis(300);

fn proxied_server(mode: ProxyMode, trusted: &[&str], recorder: &Recorder) -> Server {
    proxied_server_with_handshake(mode, trusted, recorder, SHORT_HANDSHAKE)
}

fn proxied_server_with_handshake(
    mode: ProxyMode,
    trusted: &[&str],
    recorder: &Recorder,
    handshake_timeout: Duration,
) -> Server {
    ServerBuilder::new()
        .session_driver(common::session_driver())
        .listener(
            ListenerSpec::new("127.0.0.1:0".parse().unwrap())
                .proxy(mode, TrustedProxies::parse(trusted).unwrap()),
        )
        .workers(2)
        .limits(
            Limits::new()
                .min_rate(None)
                .handshake_timeout(handshake_timeout),
        )
        .events(recorder.clone())
        .handler_driver(common::handler_driver())
        .handler(who_am_i)
        .allow_all()
        .build()
        .unwrap()
}

#[test]
fn a_v1_header_from_a_trusted_proxy_names_the_client_and_the_bytes_after_it_are_data() {
    let recorder = Recorder::default();
    let server = proxied_server(ProxyMode::Any, &["127.0.0.0/8"], &recorder);
    let real: SocketAddr = "203.0.113.7:4242".parse().unwrap();
    let mut stream = client(server.local_addr());
    let mut bytes = encode_v1(real, server.local_addr()).into_bytes();
    bytes.extend_from_slice(b"hello");
    stream.write_all(&bytes).unwrap();
    assert_eq!(
        read_line(&mut stream),
        real.to_string(),
        "the real client was not used"
    );
    let mut echoed = [0u8; 5];
    stream.read_exact(&mut echoed).unwrap();
    assert_eq!(&echoed, b"hello", "the bytes after the header were lost");
}

#[test]
fn a_v2_header_split_over_many_segments_is_parsed() {
    let recorder = Recorder::default();
    // One byte per write with a 1 ms pause: on a loaded 2-core machine the ~60 writes can take longer than
    // the short deadline, so this test gives the handshake a generous one; it is about framing, not time.
    let server = proxied_server_with_handshake(
        ProxyMode::V2,
        &["127.0.0.1/32"],
        &recorder,
        Duration::from_secs(10),
    );
    let real: SocketAddr = "[2001:db8::9]:443".parse().unwrap();
    let header = encode_v2(Some((real, "[2001:db8::1]:80".parse().unwrap())), &[], true);
    let mut stream = client(server.local_addr());
    for byte in &header {
        stream.write_all(std::slice::from_ref(byte)).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(read_line(&mut stream), real.to_string());
    assert_eq!(round_trip(&mut stream, b"after"), b"after");
}

#[test]
fn a_malformed_header_closes_only_that_connection_with_proxy_invalid() {
    let recorder = Recorder::default();
    let server = proxied_server(ProxyMode::Any, &["127.0.0.0/8"], &recorder);
    let mut good = client(server.local_addr());
    good.write_all(encode_v1("198.51.100.1:1".parse().unwrap(), server.local_addr()).as_bytes())
        .unwrap();
    assert_eq!(read_line(&mut good), "198.51.100.1:1");
    let mut bad = client(server.local_addr());
    bad.write_all(b"PROXY TCP4 not-an-address 1.2.3.4 1 2\r\n")
        .unwrap();
    assert!(common::is_closed_by_server(&mut bad));
    assert_eq!(recorder.single_close(SOON), CloseReason::ProxyInvalid);
    assert_eq!(
        round_trip(&mut good, b"still here"),
        b"still here",
        "the other connection suffered"
    );
}

#[test]
fn a_header_that_stops_halfway_closes_at_the_handshake_deadline() {
    let recorder = Recorder::default();
    let server = proxied_server(ProxyMode::Any, &["127.0.0.0/8"], &recorder);
    let mut stream = client(server.local_addr());
    stream.write_all(b"PROXY TCP4 192.0").unwrap();
    assert_eq!(recorder.single_close(SOON), CloseReason::HandshakeTimeout);
    assert!(common::is_closed_by_server(&mut stream));
}

#[test]
fn plain_data_where_a_header_is_required_closes_with_proxy_missing() {
    let recorder = Recorder::default();
    let server = proxied_server(ProxyMode::Any, &["127.0.0.0/8"], &recorder);
    let mut stream = client(server.local_addr());
    stream.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(recorder.single_close(SOON), CloseReason::ProxyMissing);
    assert!(common::is_closed_by_server(&mut stream));
}

#[test]
fn a_peer_outside_the_trusted_set_closes_with_proxy_untrusted_before_any_read() {
    let recorder = Recorder::default();
    let server = proxied_server(ProxyMode::Any, &["10.0.0.0/8"], &recorder);
    let mut stream = common::UnwantedClient::connect(server.local_addr());
    assert_eq!(recorder.single_close(SOON), CloseReason::ProxyUntrusted);
    assert!(
        stream.is_closed_by_server(),
        "the connection from outside the trusted set was served"
    );
    let closes = recorder.events();
    let bytes_in = closes.iter().find_map(|event| match event {
        net_io_blocking::Event::Closed { bytes_in, .. } => Some(*bytes_in),
        _ => None,
    });
    assert_eq!(bytes_in, Some(0), "an untrusted peer's bytes were read");
}

#[test]
fn requiring_proxy_headers_without_trusted_proxies_is_rejected_at_build() {
    let error = ServerBuilder::new()
        .session_driver(common::session_driver())
        .listener(
            ListenerSpec::new("127.0.0.1:0".parse().unwrap())
                .proxy(ProxyMode::Any, TrustedProxies::new()),
        )
        .workers(1)
        .handler_driver(common::handler_driver())
        .handler(who_am_i)
        .allow_all()
        .build()
        .expect_err("PROXY without trusted proxies must fail");
    insta::assert_snapshot!("proxy_without_trusted", error.to_string());
}
