//! Deadlines by phase: idle between exchanges, read once a request started and a per-connection idle
//! override for handlers; the write and exchange deadlines a session is asked about with `on_timeout`.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::echo::echo_fours;
use common::{Recorder, SOON, client, round_trip};
use net_io_blocking::{CloseReason, Limits, NetError, Server, ServerBuilder, TcpConnection};

fn server(
    limits: Limits,
    recorder: &Recorder,
    handler: fn(&mut TcpConnection<'_>) -> Result<(), NetError>,
) -> Server {
    common::test_builder(2, limits, recorder)
        .handler_driver(common::handler_driver())
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

#[test]
fn a_listener_s_own_idle_timeout_applies_only_to_its_connections() {
    let recorder = Recorder::default();
    let server = ServerBuilder::new()
        .session_driver(common::session_driver())
        .listener(
            net_io_blocking::ListenerSpec::new("127.0.0.1:0".parse().unwrap())
                .limits(Limits::new().idle_timeout(Duration::from_millis(150))),
        )
        .listen("127.0.0.1:0")
        .workers(2)
        .limits(
            Limits::new()
                .min_rate(None)
                .idle_timeout(Duration::from_secs(10)),
        )
        .events(recorder.clone())
        .handler_driver(common::handler_driver())
        .handler(echo_fours)
        .allow_all()
        .build()
        .unwrap();
    let addresses = server.handle().local_addrs();
    let mut short = client(addresses[0]);
    let mut long = client(addresses[1]);
    assert_eq!(recorder.single_close(SOON), CloseReason::Idle);
    assert!(common::is_closed_by_server(&mut short));
    assert_eq!(
        round_trip(&mut long, b"live"),
        b"live",
        "the other listener's connection used the short idle timeout"
    );
}

#[test]
fn an_injected_manual_clock_drives_the_idle_deadline() {
    let recorder = Recorder::default();
    let clock = std::sync::Arc::new(net_io_blocking::ManualClock::new());
    let server = ServerBuilder::new()
        .session_driver(common::session_driver())
        .listen("127.0.0.1:0")
        .workers(1)
        .limits(
            Limits::new()
                .min_rate(None)
                .idle_timeout(Duration::from_secs(60)),
        )
        .clock(clock.clone())
        .events(recorder.clone())
        .handler_driver(common::handler_driver())
        .handler(echo_fours)
        .allow_all()
        .build()
        .unwrap();
    let mut stream = client(server.local_addr());
    assert_eq!(round_trip(&mut stream, b"tick"), b"tick");
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        recorder.closes().is_empty(),
        "the connection closed before the clock moved"
    );
    let real_start = Instant::now();
    clock.advance(Duration::from_secs(61));
    assert_eq!(recorder.single_close(SOON), CloseReason::Idle);
    assert!(
        real_start.elapsed() < Duration::from_secs(5),
        "the idle deadline followed real time, not the injected clock"
    );
}

/// Sends 512 KiB as soon as the connection opens.
struct Bulk;

impl net_io_blocking::Session for Bulk {
    fn on_open(
        &mut self,
        context: &mut net_io_blocking::SessionContext<'_>,
    ) -> net_io_blocking::Step {
        let _ = context.output().push_static(&[b'b'; 512 * 1024]);
        net_io_blocking::Step::Write
    }

    fn on_data(
        &mut self,
        input: &mut net_io_blocking::Input<'_>,
        _context: &mut net_io_blocking::SessionContext<'_>,
    ) -> net_io_blocking::Step {
        input.consume_all();
        net_io_blocking::Step::Read
    }
}

#[test]
fn a_slow_but_steady_reader_is_not_cut_off_by_the_write_deadline() {
    let recorder = Recorder::default();
    let server = ServerBuilder::new()
        .session_driver(common::session_driver())
        .listener(
            net_io_blocking::ListenerSpec::new("127.0.0.1:0".parse().unwrap())
                .send_buffer(32 * 1024),
        )
        .workers(1)
        .limits(
            Limits::new()
                .min_rate(None)
                // Generous against the reader's 40 ms pace: on a loaded 2-core machine a 300 ms deadline
                // once expired while the reading thread waited for a core, resetting the connection.
                .write_timeout(Duration::from_secs(2)),
        )
        .events(recorder.clone())
        .sessions(|_info: &net_io_blocking::ConnectionInfo| Some(Bulk))
        .allow_all()
        .build()
        .unwrap();
    let mut stream = client(server.local_addr());
    socket2::SockRef::from(&stream)
        .set_recv_buffer_size(16 * 1024)
        .unwrap();
    let started = Instant::now();
    let mut received = 0usize;
    let mut buffer = [0u8; 8 * 1024];
    while received < 512 * 1024 {
        let count =
            std::io::Read::read(&mut stream, &mut buffer).expect("the server cut the reader off");
        assert!(count > 0, "the server closed after {received} bytes");
        received += count;
        std::thread::sleep(Duration::from_millis(40));
    }
    assert!(
        started.elapsed() > Duration::from_secs(2),
        "the transfer was too quick to exercise the write deadline"
    );
    drop(stream);
    assert_eq!(recorder.single_close(SOON), CloseReason::PeerClosed);
}

/// Queues 512 KiB on open for a client that never reads, and answers the write deadline from a script:
/// `Step::Write` (carry on) for the first `carry_on` deadlines, then `Step::Close`.
struct Stubborn {
    carry_on: usize,
    /// An exchange deadline set at open, this long from then.
    exchange: Option<Duration>,
    seen: std::sync::Arc<std::sync::Mutex<Vec<net_io_blocking::TimeoutKind>>>,
    closed_with: std::sync::Arc<std::sync::Mutex<Option<CloseReason>>>,
}

impl net_io_blocking::Session for Stubborn {
    fn on_open(
        &mut self,
        context: &mut net_io_blocking::SessionContext<'_>,
    ) -> net_io_blocking::Step {
        if let Some(exchange) = self.exchange {
            let deadline = context.now() + exchange;
            context.set_exchange_deadline(Some(deadline));
        }
        let _ = context.output().push_static(&[b's'; 512 * 1024]);
        net_io_blocking::Step::Write
    }

    fn on_data(
        &mut self,
        input: &mut net_io_blocking::Input<'_>,
        _context: &mut net_io_blocking::SessionContext<'_>,
    ) -> net_io_blocking::Step {
        input.consume_all();
        net_io_blocking::Step::Read
    }

    fn on_timeout(
        &mut self,
        kind: net_io_blocking::TimeoutKind,
        _context: &mut net_io_blocking::SessionContext<'_>,
    ) -> net_io_blocking::Step {
        let mut seen = self.seen.lock().unwrap();
        seen.push(kind);
        if seen.len() <= self.carry_on {
            net_io_blocking::Step::Write
        } else {
            net_io_blocking::Step::Close
        }
    }

    fn on_close(&mut self, _info: &net_io_blocking::ConnectionInfo, reason: CloseReason) {
        *self.closed_with.lock().unwrap() = Some(reason);
    }
}

/// Runs a `Stubborn` session against a client that never reads; returns the deadlines the session saw, the
/// close reason the recorder saw and the one the session was told.
fn stubborn_run(
    carry_on: usize,
    exchange: Option<Duration>,
) -> (
    Vec<net_io_blocking::TimeoutKind>,
    CloseReason,
    Option<CloseReason>,
    Duration,
) {
    let recorder = Recorder::default();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let closed_with = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (seen_in_factory, closed_in_factory) = (seen.clone(), closed_with.clone());
    let server = ServerBuilder::new()
        .session_driver(common::session_driver())
        .listener(
            net_io_blocking::ListenerSpec::new("127.0.0.1:0".parse().unwrap())
                .send_buffer(16 * 1024),
        )
        .workers(1)
        .limits(
            Limits::new()
                .min_rate(None)
                .write_timeout(Duration::from_millis(200)),
        )
        .events(recorder.clone())
        .sessions(move |_info: &net_io_blocking::ConnectionInfo| {
            Some(Stubborn {
                carry_on,
                exchange,
                seen: seen_in_factory.clone(),
                closed_with: closed_in_factory.clone(),
            })
        })
        .allow_all()
        .build()
        .unwrap();
    let stream = client(server.local_addr());
    socket2::SockRef::from(&stream)
        .set_recv_buffer_size(16 * 1024)
        .unwrap();
    let started = Instant::now();
    let reason = recorder.single_close(SOON);
    let took = started.elapsed();
    drop(stream);
    drop(server);
    let seen = seen.lock().unwrap().clone();
    let closed_with = *closed_with.lock().unwrap();
    (seen, reason, closed_with, took)
}

#[test]
fn a_session_is_asked_at_the_write_deadline_and_its_close_keeps_the_write_timeout_reason() {
    let (seen, reason, closed_with, _) = stubborn_run(0, None);
    assert_eq!(
        seen,
        [net_io_blocking::TimeoutKind::Write],
        "on_timeout was not called exactly once, for the write deadline"
    );
    assert_eq!(
        reason,
        CloseReason::WriteTimeout,
        "Step::Close after a write deadline replaced the deadline's reason"
    );
    assert_eq!(
        closed_with,
        Some(CloseReason::WriteTimeout),
        "the session was not told the write deadline as its close reason"
    );
}

#[test]
fn a_session_that_carries_on_past_a_write_deadline_gets_a_fresh_one() {
    let (seen, reason, _, took) = stubborn_run(2, None);
    assert_eq!(
        seen,
        [net_io_blocking::TimeoutKind::Write; 3],
        "the session was not asked once per write deadline"
    );
    assert_eq!(reason, CloseReason::WriteTimeout);
    // Three 200 ms deadlines in a row; generous lower bound, since each one starts after the last.
    assert!(
        took >= Duration::from_millis(500),
        "three write deadlines passed in {took:?}; carrying on did not restart the deadline"
    );
}

#[test]
fn a_session_is_asked_at_an_exchange_deadline_that_passes_during_a_write() {
    let (seen, reason, closed_with, _) = stubborn_run(0, Some(Duration::from_millis(100)));
    assert_eq!(
        seen,
        [net_io_blocking::TimeoutKind::Exchange],
        "on_timeout was not called exactly once, for the exchange deadline"
    );
    assert_eq!(
        reason,
        CloseReason::ExchangeDeadline,
        "Step::Close after an exchange deadline replaced the deadline's reason"
    );
    assert_eq!(closed_with, Some(CloseReason::ExchangeDeadline));
}
