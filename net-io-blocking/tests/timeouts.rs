//! Deadlines by phase for blocking handlers: idle between exchanges, read once a request started, and a
//! per-connection idle override.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::{Recorder, SOON, client, round_trip};
use net_io_blocking::{CloseReason, Limits, NetError, Server, ServerBuilder, TcpConnection};

/// Echoes once four bytes arrived, so a request of fewer bytes keeps the handler reading.
fn echo_fours(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let mut buffer = [0u8; 4];
    loop {
        let mut got = 0;
        while got < 4 {
            let count = connection.read(&mut buffer[got..])?;
            if count == 0 {
                return Ok(());
            }
            got += count;
        }
        connection.write_all(&buffer)?;
    }
}

fn server(
    limits: Limits,
    recorder: &Recorder,
    handler: fn(&mut TcpConnection<'_>) -> Result<(), NetError>,
) -> Server {
    ServerBuilder::new()
        .listen("127.0.0.1:0")
        .workers(2)
        .limits(limits.min_rate(None))
        .events(recorder.clone())
        .handler(handler)
        .allow_all()
        .build()
        .unwrap()
}

#[test]
fn a_handler_connection_idle_after_an_exchange_closes_at_the_idle_deadline() {
    let recorder = Recorder::default();
    let server = server(
        Limits::new().idle_timeout(Duration::from_millis(200)),
        &recorder,
        echo_fours,
    );
    let mut stream = client(server.local_addr());
    assert_eq!(round_trip(&mut stream, b"abcd"), b"abcd");
    let quiet_from = Instant::now();
    assert_eq!(recorder.single_close(SOON), CloseReason::Idle);
    assert!(quiet_from.elapsed() >= Duration::from_millis(150));
}

#[test]
fn a_handler_request_that_stalls_closes_at_the_read_deadline_not_the_idle_one() {
    let recorder = Recorder::default();
    let server = server(
        Limits::new()
            .idle_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_millis(200)),
        &recorder,
        echo_fours,
    );
    let mut stream = client(server.local_addr());
    stream.write_all(b"ab").unwrap();
    let started = Instant::now();
    assert_eq!(recorder.single_close(SOON), CloseReason::ReadTimeout);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the idle deadline was applied mid-request"
    );
}

#[test]
fn a_per_connection_idle_timeout_overrides_the_server_one() {
    let recorder = Recorder::default();
    let server = server(
        Limits::new().idle_timeout(Duration::from_secs(10)),
        &recorder,
        |connection| {
            connection.set_idle_timeout(Duration::from_millis(100));
            echo_fours(connection)
        },
    );
    let _stream = client(server.local_addr());
    let started = Instant::now();
    assert_eq!(recorder.single_close(SOON), CloseReason::Idle);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the override was ignored"
    );
}
