//! One test per close reason the blocking driver can produce: a real socket produces it, and the `Closed`
//! event, the gate's `closed` and the session's `on_close` each see it exactly once.

mod common;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::echo::echo;
use common::gates::CountingGate;
use common::{Recorder, SOON, client, eventually};
use net_io_blocking::{
    CloseReason, ConnectionInfo, ControlLine, ControlState, Direction, Input, LimitKind, Limits,
    MinRateRule, NetError, RefusalCause, Server, ServerBuilder, Session, SessionContext, Step,
    TcpConnection,
};
use net_io_core::Lane;

/// What one session does; each test picks a behaviour.
#[derive(Clone, Copy, PartialEq)]
enum Behaviour {
    EchoLines,
    NeverConsume,
    ReplyThenClose,
    Abort,
    Panic,
    ExchangeDeadline,
    Park,
    Flood,
}

struct Scripted {
    behaviour: Behaviour,
    on_close: Arc<Mutex<Vec<CloseReason>>>,
}

impl Session for Scripted {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        match self.behaviour {
            Behaviour::ExchangeDeadline => {
                context.set_exchange_deadline(Some(context.now() + Duration::from_millis(200)));
                Step::Read
            }
            Behaviour::Park => Step::Park {
                until: context.now() + Duration::from_millis(200),
            },
            Behaviour::Flood => {
                context
                    .output()
                    .push_static(&[b'x'; 1 << 20])
                    .expect("a static slice does not count against the budget");
                Step::Write
            }
            _ => Step::Read,
        }
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        match self.behaviour {
            Behaviour::NeverConsume => Step::Read,
            Behaviour::Abort => Step::Abort,
            Behaviour::Panic => panic!("session bug on purpose"),
            Behaviour::ReplyThenClose => {
                let taken = context.output().push_partial(input.bytes());
                input.consume(taken);
                Step::Close
            }
            _ => {
                let bytes = input.bytes();
                let Some(end) = bytes.iter().position(|&byte| byte == b'\n') else {
                    return Step::Read;
                };
                context
                    .output()
                    .push(&bytes[..=end])
                    .expect("a line fits the output budget");
                input.consume(end + 1);
                Step::Write
            }
        }
    }

    fn on_close(&mut self, _info: &ConnectionInfo, reason: CloseReason) {
        self.on_close.lock().unwrap().push(reason);
    }
}

struct Witnesses {
    recorder: Recorder,
    gate: CountingGate,
    on_close: Arc<Mutex<Vec<CloseReason>>>,
}

impl Witnesses {
    fn new() -> Self {
        Self {
            recorder: Recorder::default(),
            gate: CountingGate::allow_all(),
            on_close: Arc::default(),
        }
    }

    /// Waits for the one close and checks that the event, the gate and (for sessions) `on_close` agree.
    fn expect(&self, expected: CloseReason, sessions: bool) {
        let reason = self.recorder.single_close(SOON);
        assert_eq!(
            reason, expected,
            "the Closed event carried the wrong reason"
        );
        assert!(
            eventually(SOON, || self.gate.closes().len() == 1),
            "the gate's ticket did not come back exactly once"
        );
        assert_eq!(
            self.gate.closes(),
            vec![expected],
            "the gate saw a different reason"
        );
        if sessions {
            assert_eq!(
                *self.on_close.lock().unwrap(),
                vec![expected],
                "on_close saw a different reason or ran more than once"
            );
        }
    }
}

fn quick_limits() -> Limits {
    Limits::new()
        .min_rate(None)
        .idle_timeout(Duration::from_secs(5))
        .drain_timeout(Duration::from_secs(2))
}

fn sessions_server(witnesses: &Witnesses, limits: Limits, behaviour: Behaviour) -> Server {
    let on_close = Arc::clone(&witnesses.on_close);
    sessions_server_with(
        witnesses,
        limits,
        behaviour,
        ServerBuilder::new().session_driver(common::session_driver()),
        on_close,
    )
}

fn sessions_server_with(
    witnesses: &Witnesses,
    limits: Limits,
    behaviour: Behaviour,
    builder: ServerBuilder,
    on_close: Arc<Mutex<Vec<CloseReason>>>,
) -> Server {
    builder
        .listen("127.0.0.1:0")
        .workers(2)
        .limits(limits)
        .events(witnesses.recorder.clone())
        .sessions(move |_info: &ConnectionInfo| {
            Some(Scripted {
                behaviour,
                on_close: Arc::clone(&on_close),
            })
        })
        .gate(witnesses.gate.clone())
        .build()
        .expect("the test server should start")
}

fn handler_server(
    witnesses: &Witnesses,
    limits: Limits,
    handler: fn(&mut TcpConnection<'_>) -> Result<(), NetError>,
) -> Server {
    ServerBuilder::new()
        .session_driver(common::session_driver())
        .listen("127.0.0.1:0")
        .workers(2)
        .limits(limits)
        .events(witnesses.recorder.clone())
        .handler_driver(common::handler_driver())
        .handler(handler)
        .gate(witnesses.gate.clone())
        .build()
        .expect("the test server should start")
}

#[test]
fn a_peer_that_sends_fin_closes_with_peer_closed() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::EchoLines);
    let mut stream = client(server.local_addr());
    assert_eq!(common::round_trip(&mut stream, b"ping\n"), b"ping\n");
    stream.shutdown(Shutdown::Write).unwrap();
    witnesses.expect(CloseReason::PeerClosed, true);
}

#[test]
fn a_peer_that_resets_mid_request_closes_with_peer_reset() {
    let witnesses = Witnesses::new();
    let server = handler_server(&witnesses, quick_limits(), echo);
    let mut stream = client(server.local_addr());
    assert_eq!(common::round_trip(&mut stream, b"ping"), b"ping");
    common::reset(stream);
    witnesses.expect(CloseReason::PeerReset, false);
}

#[test]
fn a_silent_connection_closes_at_the_idle_deadline() {
    let witnesses = Witnesses::new();
    let limits = quick_limits().idle_timeout(Duration::from_millis(200));
    let server = sessions_server(&witnesses, limits, Behaviour::EchoLines);
    let started = Instant::now();
    let mut stream = client(server.local_addr());
    witnesses.expect(CloseReason::Idle, true);
    assert!(
        started.elapsed() >= Duration::from_millis(180),
        "closed before the idle deadline"
    );
    assert!(common::is_closed_by_server(&mut stream));
}

#[test]
fn a_request_that_stops_halfway_closes_at_the_read_deadline() {
    let witnesses = Witnesses::new();
    let limits = quick_limits().read_timeout(Duration::from_millis(200));
    let server = sessions_server(&witnesses, limits, Behaviour::EchoLines);
    let mut stream = client(server.local_addr());
    stream.write_all(b"no newline yet").unwrap();
    witnesses.expect(CloseReason::ReadTimeout, true);
}

#[test]
fn a_slow_reader_is_closed_at_the_write_deadline() {
    let witnesses = Witnesses::new();
    let limits = quick_limits().write_timeout(Duration::from_millis(300));
    let builder = ServerBuilder::new().session_driver(common::session_driver());
    let on_close = Arc::clone(&witnesses.on_close);
    let server = sessions_server_with(
        &witnesses,
        limits,
        Behaviour::Flood,
        builder.listener(
            net_io_blocking::ListenerSpec::new("127.0.0.1:0".parse().unwrap())
                .send_buffer(64 * 1024),
        ),
        on_close,
    );
    let stream = client(server.local_addr());
    socket2::SockRef::from(&stream)
        .set_recv_buffer_size(4096)
        .unwrap();
    witnesses.expect(CloseReason::WriteTimeout, true);
    drop(stream);
}

#[test]
fn a_session_exchange_deadline_closes_with_exchange_deadline() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::ExchangeDeadline);
    let _stream = client(server.local_addr());
    witnesses.expect(CloseReason::ExchangeDeadline, true);
}

#[test]
fn a_parked_session_nobody_wakes_closes_with_park_deadline() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::Park);
    let _stream = client(server.local_addr());
    witnesses.expect(CloseReason::ParkDeadline, true);
}

#[test]
fn a_slowloris_trickle_closes_with_slow_peer_in() {
    let witnesses = Witnesses::new();
    let limits = quick_limits().min_rate(Some(MinRateRule {
        bytes_per_second: 1000,
        window: Duration::from_millis(500),
        grace: Duration::from_millis(300),
        check: Duration::from_millis(100),
    }));
    let server = sessions_server(&witnesses, limits, Behaviour::EchoLines);
    let mut stream = client(server.local_addr());
    let started = Instant::now();
    // One byte every 40 ms: 25 B/s, far below 1,000 B/s; stop once the server gave up.
    while started.elapsed() < Duration::from_secs(5) {
        if stream.write_all(b"a").is_err() || !witnesses.recorder.closes().is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(40));
    }
    witnesses.expect(
        CloseReason::SlowPeer {
            direction: Direction::In,
        },
        true,
    );
    assert_eq!(
        server.stats().slow_peers,
        1,
        "stats should count one slow peer"
    );
}

#[test]
fn a_reader_below_the_minimum_rate_closes_with_slow_peer_out() {
    let witnesses = Witnesses::new();
    let limits = quick_limits().min_rate(Some(MinRateRule {
        bytes_per_second: 100_000,
        window: Duration::from_millis(500),
        grace: Duration::from_millis(300),
        check: Duration::from_millis(100),
    }));
    let on_close = Arc::clone(&witnesses.on_close);
    let server = sessions_server_with(
        &witnesses,
        limits,
        Behaviour::Flood,
        ServerBuilder::new()
            .session_driver(common::session_driver())
            .listener(
                net_io_blocking::ListenerSpec::new("127.0.0.1:0".parse().unwrap())
                    .send_buffer(64 * 1024),
            ),
        on_close,
    );
    let stream = client(server.local_addr());
    witnesses.expect(
        CloseReason::SlowPeer {
            direction: Direction::Out,
        },
        true,
    );
    drop(stream);
}

#[test]
fn a_factory_that_declines_closes_with_refused_session() {
    let witnesses = Witnesses::new();
    let server = ServerBuilder::new()
        .session_driver(common::session_driver())
        .listen("127.0.0.1:0")
        .workers(2)
        .limits(quick_limits())
        .events(witnesses.recorder.clone())
        .sessions(|_info: &ConnectionInfo| None::<Scripted>)
        .gate(witnesses.gate.clone())
        .build()
        .unwrap();
    let mut stream = common::UnwantedClient::connect(server.local_addr());
    witnesses.expect(CloseReason::Refused(RefusalCause::Session), false);
    assert!(
        stream.is_closed_by_server(),
        "the connection whose session the factory declined was served"
    );
    let stats = server.stats();
    assert_eq!(
        (
            stats.refused_by(RefusalCause::Session),
            stats.refused_after_admission
        ),
        (1, 1),
        "a declined connection counts as a refusal after admission: {stats:?}"
    );
}

#[test]
fn a_kill_ends_a_blocked_handler_with_killed_and_its_code() {
    let witnesses = Witnesses::new();
    let server = handler_server(&witnesses, quick_limits(), echo);
    let mut stream = client(server.local_addr());
    assert_eq!(common::round_trip(&mut stream, b"x"), b"x");
    let handle = server.handle();
    assert!(eventually(SOON, || !handle.connections().is_empty()));
    let id = handle.connections()[0];
    assert!(handle.kill(id, 7), "the first kill should win");
    witnesses.expect(CloseReason::Killed(7), false);
    assert!(!handle.kill(id, 8), "a kill after the close should lose");
}

#[test]
fn a_write_the_gate_denies_closes_with_egress_denied() {
    let mut witnesses = Witnesses::new();
    witnesses.gate = CountingGate::deny_all(42);
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::EchoLines);
    let mut stream = client(server.local_addr());
    stream.write_all(b"let me out\n").unwrap();
    witnesses.expect(CloseReason::EgressDenied(42), true);
    let mut received = Vec::new();
    let _ = stream.read_to_end(&mut received);
    assert!(
        received.is_empty(),
        "denied bytes reached the peer: {received:?}"
    );
}

#[test]
fn an_idle_connection_is_closed_by_a_drain_with_drained() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::EchoLines);
    let mut stream = client(server.local_addr());
    assert_eq!(common::round_trip(&mut stream, b"hi\n"), b"hi\n");
    let report = server
        .handle()
        .drain(Instant::now() + Duration::from_secs(3));
    assert_eq!(
        report.killed, 0,
        "an idle connection should not need a kill"
    );
    witnesses.expect(CloseReason::Drained, true);
    assert!(common::is_closed_by_server(&mut stream));
}

#[test]
fn an_idle_session_connection_is_closed_by_a_shutdown_with_shutdown() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::EchoLines);
    let mut stream = client(server.local_addr());
    assert_eq!(common::round_trip(&mut stream, b"hi\n"), b"hi\n");
    let report = server.shutdown(Instant::now() + Duration::from_secs(3));
    assert_eq!(
        (report.graceful, report.killed),
        (1, 0),
        "an idle connection should close at once in a shutdown, not at its deadline"
    );
    witnesses.expect(CloseReason::Shutdown, true);
    assert!(
        common::is_closed_by_server(&mut stream),
        "the client still had an open connection after the shutdown"
    );
}

#[test]
fn an_idle_handler_connection_is_closed_by_a_shutdown_with_shutdown() {
    let witnesses = Witnesses::new();
    let server = handler_server(&witnesses, quick_limits(), echo);
    let mut stream = client(server.local_addr());
    assert_eq!(common::round_trip(&mut stream, b"hi"), b"hi");
    let report = server.shutdown(Instant::now() + Duration::from_secs(3));
    assert_eq!(
        report.killed, 0,
        "an idle handler connection should close at once in a shutdown, not at its deadline"
    );
    witnesses.expect(CloseReason::Shutdown, false);
    assert!(
        common::is_closed_by_server(&mut stream),
        "the client still had an open connection after the shutdown"
    );
}

#[test]
fn a_connection_busy_at_the_shutdown_deadline_closes_with_drain_deadline_not_shutdown() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::EchoLines);
    let mut stream = client(server.local_addr());
    stream.write_all(b"half a line").unwrap();
    assert!(
        eventually(SOON, || server.handle().connections().len() == 1),
        "no worker took the connection"
    );
    std::thread::sleep(Duration::from_millis(50));
    let report = server.shutdown(Instant::now() + Duration::from_millis(300));
    assert_eq!(report.killed, 1, "the busy connection should be killed");
    witnesses.expect(CloseReason::DrainDeadline, true);
}

#[test]
fn a_busy_connection_is_killed_at_the_drain_deadline() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::EchoLines);
    let mut stream = client(server.local_addr());
    stream.write_all(b"half a line").unwrap();
    assert!(eventually(SOON, || server.handle().connections().len() == 1));
    std::thread::sleep(Duration::from_millis(50));
    let report = server
        .handle()
        .drain(Instant::now() + Duration::from_millis(300));
    assert_eq!(report.killed, 1, "the busy connection should be killed");
    witnesses.expect(CloseReason::DrainDeadline, true);
}

#[test]
fn shedding_lane_zero_closes_an_idle_connection_with_shed() {
    let witnesses = Witnesses::new();
    let control = Arc::new(ControlLine::new());
    let on_close = Arc::clone(&witnesses.on_close);
    let server = sessions_server_with(
        &witnesses,
        quick_limits(),
        Behaviour::EchoLines,
        ServerBuilder::new()
            .session_driver(common::session_driver())
            .control(Arc::clone(&control)),
        on_close,
    );
    let mut stream = client(server.local_addr());
    assert_eq!(common::round_trip(&mut stream, b"hi\n"), b"hi\n");
    control.set(ControlState::Shed { lane: Lane(0) });
    witnesses.expect(CloseReason::Shed, true);
}

#[test]
fn a_session_that_answers_close_closes_with_session_closed_after_flushing() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::ReplyThenClose);
    let mut stream = client(server.local_addr());
    stream.write_all(b"last words").unwrap();
    let mut received = Vec::new();
    stream.read_to_end(&mut received).unwrap();
    assert_eq!(
        received, b"last words",
        "the reply queued before Close was not flushed"
    );
    witnesses.expect(CloseReason::SessionClosed, true);
}

#[test]
fn a_session_that_answers_abort_closes_with_session_error() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::Abort);
    let mut stream = client(server.local_addr());
    stream.write_all(b"x").unwrap();
    witnesses.expect(CloseReason::SessionError, true);
}

#[test]
fn a_panicking_session_closes_with_session_panicked() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::Panic);
    let mut stream = client(server.local_addr());
    stream.write_all(b"boom\n").unwrap();
    witnesses.expect(CloseReason::SessionPanicked, true);
    assert_eq!(server.stats().session_panics, 1);
}

#[test]
fn input_a_session_never_consumes_closes_with_the_read_buffer_limit() {
    let witnesses = Witnesses::new();
    let server = sessions_server(&witnesses, quick_limits(), Behaviour::NeverConsume);
    let mut stream = client(server.local_addr());
    let chunk = [b'y'; 16 * 1024];
    let written = AtomicUsize::new(0);
    for _ in 0..8 {
        if stream.write_all(&chunk).is_err() {
            break;
        }
        written.fetch_add(chunk.len(), Ordering::Relaxed);
    }
    witnesses.expect(CloseReason::Limit(LimitKind::ReadBuffer), true);
}
