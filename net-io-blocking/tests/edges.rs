//! Edge cases from the reference list: denial text on a clean boundary, an exchange deadline that answers
//! before closing, and a connection burst that does not stall an established connection.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::echo::echo_server;
use common::gates::CountingGate;
use common::{Recorder, SOON, client, round_trip};
use net_io_blocking::{
    CloseReason, ConnectionInfo, Input, Limits, Output, Session, SessionContext, Step, TimeoutKind,
};

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
    let server = common::test_builder(1, Limits::new(), &recorder)
        .sessions(|_info: &ConnectionInfo| Some(Polite))
        .gate(CountingGate::deny_all(403))
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
    let server = common::test_builder(1, Limits::new(), &recorder)
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

#[test]
fn a_burst_of_new_connections_does_not_stall_an_established_one() {
    let recorder = Recorder::default();
    let server = echo_server(
        2,
        Limits::new().max_connections(2).max_per_source(2),
        &recorder,
    );
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

/// Answers any input with 130 separate static chunks of 100 bytes, each filled with its index.
struct Chunks;

static CHUNK_BYTES: [[u8; 100]; 130] = {
    let mut chunks = [[0u8; 100]; 130];
    let mut index = 0;
    while index < 130 {
        chunks[index] = [index as u8; 100];
        index += 1;
    }
    chunks
};

impl Session for Chunks {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        input.consume_all();
        for chunk in &CHUNK_BYTES {
            if context.output().push_static(chunk).is_err() {
                return Step::Abort;
            }
        }
        Step::Write
    }

    fn on_denied(&mut self, _code: u16, output: &mut Output) {
        let _ = output.push(b"denied\n");
    }
}

fn chunk_server(recorder: &Recorder, gate: CountingGate) -> net_io_blocking::Server {
    common::test_builder(1, Limits::new(), recorder)
        .sessions(|_info: &ConnectionInfo| Some(Chunks))
        .gate(gate)
        .build()
        .unwrap()
}

#[test]
fn more_than_64_chunks_go_out_in_order_over_several_gate_checked_writes() {
    let recorder = Recorder::default();
    let gate = CountingGate::allow_all();
    let server = chunk_server(&recorder, gate.clone());
    let mut stream = client(server.local_addr());
    stream.write_all(b"go").unwrap();
    let mut received = vec![0u8; 130 * 100];
    stream.read_exact(&mut received).unwrap();
    for (index, chunk) in received.chunks(100).enumerate() {
        assert!(
            chunk.iter().all(|&byte| byte == index as u8),
            "chunk {index} arrived out of order or torn"
        );
    }
    assert!(
        gate.checks() >= 3,
        "130 chunks need at least three write calls, each checked by the gate"
    );
}

#[test]
fn a_denial_in_the_middle_of_a_response_resets_without_denial_text() {
    let recorder = Recorder::default();
    let server = chunk_server(&recorder, CountingGate::deny_after(1, 9));
    let mut stream = client(server.local_addr());
    stream.write_all(b"go").unwrap();
    let mut received = Vec::new();
    let _ = stream.read_to_end(&mut received);
    assert!(
        !received.windows(6).any(|window| window == b"denied"),
        "denial text was sent after part of the response"
    );
    assert!(
        received.len() < 130 * 100,
        "the denied rest of the response reached the peer"
    );
    assert_eq!(recorder.single_close(SOON), CloseReason::EgressDenied(9));
}

#[test]
fn a_kill_during_a_graceful_linger_resets_the_connection_at_once() {
    if common::handlers_on_coroutines() {
        // On an event loop the unread half of the request is already in the loop's read buffer, not in the
        // socket, so the close has nothing to linger for (event_loop.rs tests the loop's linger and its kill).
        return;
    }
    let recorder = Recorder::default();
    let (handles, handle_receiver) = std::sync::mpsc::channel();
    let handles = std::sync::Mutex::new(handles);
    let server = common::test_builder(
        1,
        Limits::new().linger_timeout(Duration::from_secs(30)),
        &recorder,
    )
    .handler_driver(common::handler_driver())
    .handler(move |connection: &mut net_io_blocking::TcpConnection<'_>| {
        // Reads half of what the client sent, answers and returns: a graceful close with unread input,
        // which lingers.
        let mut request = [0u8; 4];
        let mut got = 0;
        while got < request.len() {
            let count = connection.read(&mut request[got..])?;
            if count == 0 {
                return Ok(());
            }
            got += count;
        }
        let _ = handles.lock().unwrap().send(connection.kill_handle());
        connection.write_all(b"done")
    })
    .allow_all()
    .build()
    .unwrap();
    let mut stream = client(server.local_addr());
    stream.write_all(b"askmore!").unwrap();
    let mut reply = [0u8; 4];
    stream.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b"done");
    let mut byte = [0u8; 1];
    assert_eq!(
        stream.read(&mut byte).unwrap(),
        0,
        "the graceful close sent no FIN"
    );
    let handle = handle_receiver.recv_timeout(SOON).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        recorder.closes().is_empty(),
        "the close did not linger, so this test cannot show a kill cutting the linger short"
    );
    let started = Instant::now();
    // The first attempt can come before the worker starts lingering; later ones cannot miss it.
    let closed = common::eventually(SOON, || {
        assert!(
            !handle.kill(9),
            "a kill won a connection whose close was already decided"
        );
        !recorder.closes().is_empty()
    });
    assert!(
        closed,
        "the kill did not end the 30 s linger within {SOON:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the linger ended only after {:?}",
        started.elapsed()
    );
    assert_eq!(
        recorder.single_close(SOON),
        CloseReason::SessionClosed,
        "cutting the linger short changed the close reason"
    );
    // The client already read our FIN, so its reads say 0 either way; a write shows the RST: it fails at
    // once, where a connection still lingering (or closed with FIN) would take the bytes.
    let after = stream.write(b"more");
    assert!(
        matches!(&after, Err(error) if matches!(
            error.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        )),
        "the client did not see an RST after the kill: its write gave {after:?}"
    );
}
