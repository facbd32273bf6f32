//! Edge cases from the reference list: denial text on a clean boundary, an exchange deadline that answers
//! before closing, and a connection burst that does not stall an established connection.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{Recorder, SOON, client, round_trip};
use net_io_blocking::{
    CloseReason, ConnectionInfo, Gate, Input, Limits, Output, ServerBuilder, Session,
    SessionContext, Step, TimeoutKind,
};
use net_io_core::{Admission, Lane, Refusal, Verdict, WriteFacts};

struct DenyAll;

impl Gate for DenyAll {
    type Ticket = ();

    fn admit(&self, _info: &ConnectionInfo) -> Result<Admission<()>, Refusal> {
        Ok(Admission {
            ticket: (),
            lane: Lane::DEFAULT,
        })
    }

    fn check(&self, _ticket: &(), _write: &WriteFacts) -> Verdict {
        Verdict::Deny(403)
    }
}

/// Replies to each line, explains a denial, and answers an exchange timeout before closing.
struct Polite;

impl Session for Polite {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        context.set_exchange_deadline(Some(context.now() + Duration::from_millis(200)));
        Step::Read
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let taken = context.output().push_partial(input.bytes());
        input.consume(taken);
        Step::Write
    }

    fn on_timeout(&mut self, kind: TimeoutKind, context: &mut SessionContext<'_>) -> Step {
        if kind == TimeoutKind::Exchange {
            let _ = context.output().push_static(b"too slow, goodbye\n");
        }
        Step::Close
    }

    fn on_denied(&mut self, code: u16, output: &mut Output) {
        let _ = output.push(format!("denied {code}\n").as_bytes());
    }
}

#[test]
fn a_denial_before_any_byte_of_the_response_sends_the_denial_text_once_then_resets() {
    let recorder = Recorder::default();
    let server = ServerBuilder::new()
        .listen("127.0.0.1:0")
        .workers(1)
        .limits(Limits::new().min_rate(None))
        .events(recorder.clone())
        .sessions(|_info: &ConnectionInfo| Some(Polite))
        .gate(DenyAll)
        .build()
        .unwrap();
    let mut stream = client(server.local_addr());
    stream.write_all(b"secret please").unwrap();
    let mut received = Vec::new();
    let _ = stream.read_to_end(&mut received);
    assert_eq!(
        received, b"denied 403\n",
        "the peer should see the denial text and nothing of the response"
    );
    assert_eq!(recorder.single_close(SOON), CloseReason::EgressDenied(403));
}

#[test]
fn an_exchange_deadline_can_answer_before_the_connection_closes() {
    let recorder = Recorder::default();
    let server = ServerBuilder::new()
        .listen("127.0.0.1:0")
        .workers(1)
        .limits(Limits::new().min_rate(None))
        .events(recorder.clone())
        .sessions(|_info: &ConnectionInfo| Some(Polite))
        .allow_all()
        .build()
        .unwrap();
    let mut stream = client(server.local_addr());
    // The deadline's close is abortive, so the answer is followed by an RST rather than a FIN.
    let mut received = Vec::new();
    let _ = stream.read_to_end(&mut received);
    assert_eq!(
        received, b"too slow, goodbye\n",
        "the answer to the timeout was lost"
    );
    assert_eq!(recorder.single_close(SOON), CloseReason::ExchangeDeadline);
}

struct Echo;

impl Session for Echo {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let taken = context.output().push_partial(input.bytes());
        input.consume(taken);
        Step::Write
    }
}

#[test]
fn a_burst_of_new_connections_does_not_stall_an_established_one() {
    let recorder = Recorder::default();
    let server = ServerBuilder::new()
        .listen("127.0.0.1:0")
        .workers(2)
        .limits(
            Limits::new()
                .min_rate(None)
                .max_connections(2)
                .max_per_source(2),
        )
        .events(recorder.clone())
        .sessions(|_info: &ConnectionInfo| Some(Echo))
        .allow_all()
        .build()
        .unwrap();
    let address = server.local_addr();
    let mut established = client(address);
    assert_eq!(round_trip(&mut established, b"warm"), b"warm");
    let burst = std::thread::spawn(move || {
        let mut streams = Vec::new();
        for _ in 0..300 {
            if let Ok(stream) = std::net::TcpStream::connect(address) {
                streams.push(stream);
            }
        }
        streams.len()
    });
    let mut slowest = Duration::ZERO;
    for round in 0..200u32 {
        let started = Instant::now();
        let message = round.to_be_bytes();
        assert_eq!(round_trip(&mut established, &message), message);
        slowest = slowest.max(started.elapsed());
    }
    let connected = burst.join().unwrap();
    assert!(connected > 0);
    // Generous: on a loaded 2-core machine a round trip can take milliseconds, but never a second.
    assert!(
        slowest < Duration::from_secs(1),
        "an established connection stalled for {slowest:?} during the burst"
    );
}
