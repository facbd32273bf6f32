//! No descriptor left behind: thousands of RST-closed connections through a handler (on worker threads and on
//! coroutines over event loops), a sessions server and an event-loop sessions server.
//!
//! Its own test binary because it counts `/proc/self/fd`, which every test in a process would disturb.

#![deny(unsafe_code)]

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use net_io_blocking::Server;

use common::echo::{EchoDriver, plain_echo_server};
use common::{client, descriptor_links, eventually, open_descriptors, reset};

/// One connection: send an 8-byte index, read the echo, close with RST (`SO_LINGER` 0, so no TIME_WAIT).
fn round_trip_and_reset(address: SocketAddr, index: u64) {
    let mut stream = client(address);
    let message = index.to_le_bytes();
    stream
        .write_all(&message)
        .expect("could not send the index");
    let mut echo = [0_u8; 8];
    stream
        .read_exact(&mut echo)
        .unwrap_or_else(|error| panic!("connection {index} got no echo: {error}"));
    assert_eq!(echo, message, "connection {index} got a different echo");
    reset(stream);
}

fn start_servers() -> (Server, Server, Server, Server) {
    let handler = plain_echo_server(EchoDriver::Handler { workers: 16 });
    let sessions = plain_echo_server(EchoDriver::Sessions { workers: 16 });
    let event_loop = plain_echo_server(EchoDriver::EventLoop { loops: 2 });
    let coroutines = plain_echo_server(EchoDriver::Coroutines { loops: 2 });
    (handler, sessions, event_loop, coroutines)
}

fn connections_leave_no_descriptor_behind(connections: u64) {
    // Any lazily opened process-wide descriptor (std's, the test harness's) opens before the baseline.
    let warm = start_servers();
    round_trip_and_reset(warm.0.local_addr(), 0);
    round_trip_and_reset(warm.2.local_addr(), 0);
    round_trip_and_reset(warm.3.local_addr(), 0);
    drop(warm);
    let baseline = open_descriptors();

    let (handler, sessions, event_loop, coroutines) = start_servers();
    round_trip_and_reset(handler.local_addr(), 0);
    round_trip_and_reset(sessions.local_addr(), 0);
    round_trip_and_reset(event_loop.local_addr(), 0);
    round_trip_and_reset(coroutines.local_addr(), 0);
    assert!(
        eventually(Duration::from_secs(5), || {
            handler.stats().closed == 1
                && sessions.stats().closed == 1
                && event_loop.stats().closed == 1
                && coroutines.stats().closed == 1
        }),
        "the four warm-up connections did not close"
    );
    let steady = open_descriptors();
    let steady_links = descriptor_links();

    for index in 0..connections {
        let address = match index % 4 {
            0 => handler.local_addr(),
            1 => sessions.local_addr(),
            2 => event_loop.local_addr(),
            _ => coroutines.local_addr(),
        };
        round_trip_and_reset(address, index);
    }

    let closed = || {
        handler.stats().closed
            + sessions.stats().closed
            + event_loop.stats().closed
            + coroutines.stats().closed
    };
    assert!(
        eventually(Duration::from_secs(30), || closed() == connections + 4),
        "after {connections} connections plus 4 warm-ups only {} closes were counted",
        closed()
    );
    assert!(
        eventually(Duration::from_secs(5), || open_descriptors() == steady),
        "the process holds {} descriptors after {connections} closed connections, {steady} before them; \
         opened since: {:?}; closed since: {:?}",
        open_descriptors(),
        {
            let now = descriptor_links();
            now.into_iter()
                .filter(|(number, link)| steady_links.get(number) != Some(link))
                .collect::<Vec<_>>()
        },
        {
            let now = descriptor_links();
            steady_links
                .iter()
                .filter(|(number, link)| now.get(number) != Some(link))
                .map(|(number, link)| (*number, link.clone()))
                .collect::<Vec<_>>()
        }
    );
    let refused = handler.stats().refused
        + sessions.stats().refused
        + event_loop.stats().refused
        + coroutines.stats().refused;
    assert_eq!(refused, 0, "{refused} connections were refused");

    let deadline = Instant::now() + Duration::from_secs(5);
    let _ = handler.shutdown(deadline);
    let _ = sessions.shutdown(deadline);
    let _ = event_loop.shutdown(deadline);
    let _ = coroutines.shutdown(deadline);
    assert!(
        eventually(Duration::from_secs(5), || open_descriptors() == baseline),
        "the process holds {} descriptors after every server shut down, {baseline} before they started",
        open_descriptors()
    );
}

#[test]
fn ten_thousand_rst_closed_connections_leave_no_descriptor_behind() {
    connections_leave_no_descriptor_behind(10_000);
}

/// Run with `cargo test --release -p net-io-blocking --test descriptors -- --ignored`.
#[test]
#[ignore = "100,000 connections; run in release with --ignored"]
fn a_hundred_thousand_rst_closed_connections_leave_no_descriptor_behind() {
    connections_leave_no_descriptor_behind(100_000);
}
