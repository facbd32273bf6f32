//! Timeouts too long to add to a clock reading (`Duration::MAX` from the limits or from a session) must mean
//! "practically never", not a panic in the driver that strands the connection without its close.

mod common;

use std::io::Write;
use std::net::Shutdown;
use std::time::Duration;

use common::{Recorder, SOON, client, round_trip};
use net_io_blocking::{
    CloseReason, ConnectionInfo, Input, Limits, ServerBuilder, Session, SessionContext, Step,
};

/// Echoes; on open it asks for an idle timeout of `Duration::MAX`.
struct PatientEcho;

impl Session for PatientEcho {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        context.set_idle_timeout(Duration::MAX);
        Step::Read
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let taken = context.output().push_partial(input.bytes());
        input.consume(taken);
        Step::Write
    }
}

/// Echoes, but parks until `Duration::MAX` from now before it reads anything.
struct ParksForever;

impl Session for ParksForever {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        // `Instant + Duration::MAX` overflows; the latest instant a session can name is what it gets.
        let until = context
            .now()
            .checked_add(Duration::from_secs(u64::from(u32::MAX)))
            .unwrap_or(context.now());
        Step::Park { until }
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let taken = context.output().push_partial(input.bytes());
        input.consume(taken);
        Step::Write
    }
}

fn unbounded_limits() -> Limits {
    Limits::new()
        .min_rate(None)
        .idle_timeout(Duration::MAX)
        .read_timeout(Duration::MAX)
        .write_timeout(Duration::MAX)
        .park_timeout(Duration::MAX)
        .linger_timeout(Duration::MAX)
}

/// A server of [`PatientEcho`] sessions under `limits`, reporting to `recorder`.
fn patient_echo_server(limits: Limits, recorder: &Recorder) -> net_io_blocking::Server {
    ServerBuilder::new()
        .session_driver(common::session_driver())
        .listen("127.0.0.1:0")
        .workers(2)
        .limits(limits)
        .events(recorder.clone())
        .sessions(|_: &ConnectionInfo| Some(PatientEcho))
        .allow_all()
        .build()
        .expect("a server with far deadlines should start")
}

/// Sends FIN and checks the server closes the connection exactly once, for that FIN.
fn closes_once_after_the_peer_fin(stream: &mut std::net::TcpStream, recorder: &Recorder) {
    stream.shutdown(Shutdown::Write).unwrap();
    assert!(
        common::is_closed_by_server(stream),
        "the server did not close after the peer's FIN"
    );
    assert_eq!(
        recorder.single_close(SOON),
        CloseReason::PeerClosed,
        "the connection was not closed once with the peer's FIN as its reason"
    );
}

#[test]
fn a_session_that_asks_for_an_unbounded_idle_timeout_is_served_and_closed_once() {
    let recorder = Recorder::default();
    let server = patient_echo_server(Limits::new().min_rate(None), &recorder);
    let mut stream = client(server.local_addr());
    assert_eq!(
        round_trip(&mut stream, b"still there?\n"),
        b"still there?\n",
        "a session with an unbounded idle timeout was not served"
    );
    closes_once_after_the_peer_fin(&mut stream, &recorder);
}

#[test]
fn limits_of_duration_max_are_accepted_and_never_strand_a_connection() {
    let recorder = Recorder::default();
    let server = patient_echo_server(unbounded_limits(), &recorder);
    let mut stream = client(server.local_addr());
    for round in 0..3 {
        assert_eq!(
            round_trip(&mut stream, b"ping\n"),
            b"ping\n",
            "round {round} was not echoed under Duration::MAX timeouts"
        );
    }
    closes_once_after_the_peer_fin(&mut stream, &recorder);
}

#[test]
fn a_park_until_the_far_future_is_cut_by_the_park_timeout_and_then_served() {
    let recorder = Recorder::default();
    let server = common::test_builder(
        2,
        Limits::new().park_timeout(Duration::from_millis(200)),
        &recorder,
    )
    .sessions(|_: &ConnectionInfo| Some(ParksForever))
    .allow_all()
    .build()
    .expect("the server should start");
    let mut stream = client(server.local_addr());
    stream.write_all(b"x").unwrap();
    // The default on_timeout of a park closes with ParkDeadline: what matters is that the park ended.
    assert!(
        common::is_closed_by_server(&mut stream),
        "a park into the far future was not ended by the park timeout"
    );
    assert_eq!(
        recorder.single_close(SOON),
        CloseReason::ParkDeadline,
        "the far-future park did not close once at the park deadline"
    );
}
