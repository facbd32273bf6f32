//! Solo reads (a loop holding one busy connection waits for it in `recv` under `SO_RCVTIMEO`): the receive
//! timeout a solo read really waits under, whatever the socket inherited, and solo reads beside the handler
//! coroutines, PROXY headers and a manual clock.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::echo::{echo, who_am_i};
use common::{Recorder, SOON, client, read_line, round_trip, test_builder};
use net_io_blocking::{
    CloseReason, Completer, ConnectionInfo, DEFAULT_WORKERS, HandlerDriver, Input, Limits,
    ListenerSpec, ProxyMode, Server, ServerBuilder, Session, SessionContext, SessionDriver, Step,
    TrustedProxies,
};
use net_io_core::ManualClock;
use net_io_core::proxy::encode_v1;

/// A one-loop echo server with handlers on coroutines and the default solo slice (1 ms):
/// [`common::test_builder`]'s settings with the default worker count (it only enters the descriptor budget).
fn one_loop_server(limits: Limits, recorder: &Recorder) -> Server {
    test_builder(DEFAULT_WORKERS, limits, recorder)
        .handler_driver(HandlerDriver::Coroutines { loops: 1 })
        .handler(echo)
        .allow_all()
        .build()
        .expect("the one-loop coroutine server did not start")
}

#[test]
fn a_solo_read_waits_one_slice_even_when_the_inherited_receive_timeout_is_within_a_tick_of_it() {
    // The listener arms every accepted socket's SO_RCVTIMEO with the idle timeout. With a long tick, an idle
    // timeout of one tick is "within a tick" of the 1 ms slice; a solo read that trusted that closeness
    // would block the loop for the whole idle timeout instead of one slice.
    let tick = Duration::from_secs(3);
    let limits = Limits::new()
        .tick(tick)
        .idle_timeout(tick)
        .read_timeout(tick)
        .write_timeout(tick)
        .handshake_timeout(tick)
        .linger_timeout(tick)
        .park_timeout(tick);
    let recorder = Recorder::default();
    let server = one_loop_server(limits, &recorder);
    let mut first = client(server.local_addr());
    assert_eq!(round_trip(&mut first, b"busy"), b"busy");
    // The loop now reads `first` alone; a newcomer on the same loop waits for the end of that read.
    std::thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    let mut second = client(server.local_addr());
    assert_eq!(round_trip(&mut second, b"new"), b"new");
    let waited = started.elapsed();
    println!("newcomer beside a solo read on a socket armed with a {tick:?} timeout: {waited:?}");
    assert!(
        waited < Duration::from_secs(1),
        "a new connection waited {waited:?} beside a 1 ms solo read: the read blocked under the socket's \
         inherited {tick:?} receive timeout instead of the slice"
    );
    drop((first, second));
    assert!(
        common::eventually(SOON, || recorder.closes().len() == 2),
        "both connections should close"
    );
}

#[test]
fn under_a_manual_clock_the_idle_deadline_fires_while_the_loop_reads_one_connection_alone() {
    let clock = Arc::new(ManualClock::new());
    let recorder = Recorder::default();
    let server = test_builder(
        DEFAULT_WORKERS,
        Limits::new().idle_timeout(Duration::from_secs(600)),
        &recorder,
    )
    .handler_driver(HandlerDriver::Coroutines { loops: 1 })
    .clock(clock.clone())
    .handler(echo)
    .allow_all()
    .build()
    .expect("the manual-clock server did not start");
    let mut stream = client(server.local_addr());
    for _ in 0..20 {
        assert_eq!(round_trip(&mut stream, b"solo"), b"solo");
    }
    std::thread::sleep(Duration::from_millis(20));
    assert!(recorder.closes().is_empty(), "nothing should close yet");
    let advanced = Instant::now();
    clock.advance(Duration::from_secs(601));
    assert_eq!(
        recorder
            .wait_for_closes(1, SOON)
            .first()
            .map(|(_, reason)| *reason),
        Some(CloseReason::Idle),
        "the idle deadline on the manual clock should close the connection"
    );
    assert!(
        advanced.elapsed() < Duration::from_secs(2),
        "the idle deadline fired {:?} after the clock passed it: a solo read held the loop",
        advanced.elapsed()
    );
}

#[test]
fn a_connection_behind_a_proxy_header_is_read_alone_after_its_header_and_keeps_its_real_client() {
    let recorder = Recorder::default();
    let server = ServerBuilder::new()
        .listener(ListenerSpec::new("127.0.0.1:0".parse().unwrap()).proxy(
            ProxyMode::Any,
            TrustedProxies::parse(&["127.0.0.0/8"]).unwrap(),
        ))
        .handler_driver(HandlerDriver::Coroutines { loops: 1 })
        .limits(Limits::new().min_rate(None))
        .events(recorder.clone())
        .handler(who_am_i)
        .allow_all()
        .build()
        .expect("the proxied server did not start");
    let real: SocketAddr = "203.0.113.9:4343".parse().unwrap();
    let mut stream = client(server.local_addr());
    // The header alone first, then the data in its own segments: the loop waits for the header without a
    // solo read (it is not a session's read), then reads the one connection alone.
    stream
        .write_all(encode_v1(real, server.local_addr()).as_bytes())
        .unwrap();
    assert_eq!(
        read_line(&mut stream),
        real.to_string(),
        "the handler should see the client the header named"
    );
    for round in 0..20_u8 {
        assert_eq!(
            round_trip(&mut stream, &[b'a' + round]),
            [b'a' + round],
            "round trip {round} after the header"
        );
    }
    drop(stream);
    assert_eq!(recorder.single_close(SOON), CloseReason::PeerClosed);
}

/// Echoes, except that `park` parks the session until a completion (posted by the test) says `woke`.
struct ParkOnRequest {
    completers: std::sync::mpsc::Sender<Completer>,
}

impl Session for ParkOnRequest {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let bytes = input.bytes().to_vec();
        input.consume(bytes.len());
        if bytes == b"park" {
            if let Some(completer) = context.completer() {
                let _ = self.completers.send(completer);
            }
            return Step::Park {
                until: context.now() + Duration::from_secs(30),
            };
        }
        if context.output().push(&bytes).is_err() {
            return Step::Abort;
        }
        Step::Write
    }

    fn on_writable(&mut self, _context: &mut SessionContext<'_>) -> Step {
        Step::Read
    }

    fn on_wake(&mut self, _token: u64, _value: u64, context: &mut SessionContext<'_>) -> Step {
        if context.output().push(b"woke").is_err() {
            return Step::Abort;
        }
        Step::Write
    }
}

#[test]
fn a_session_that_parks_between_solo_reads_gets_its_completion_at_once() {
    let recorder = Recorder::default();
    let (completers, completer_receiver) = std::sync::mpsc::channel::<Completer>();
    let completers = std::sync::Mutex::new(completers);
    let server = test_builder(DEFAULT_WORKERS, Limits::new(), &recorder)
        .session_driver(SessionDriver::EventLoop { loops: 1 })
        // A long slice: a completion that waited for a solo read to end would take a second.
        .solo_read_slice(Duration::from_secs(1))
        .sessions(move |_: &ConnectionInfo| {
            Some(ParkOnRequest {
                completers: completers.lock().unwrap().clone(),
            })
        })
        .allow_all()
        .build()
        .expect("the one-loop session server did not start");
    let mut stream = client(server.local_addr());
    for round in 0..5 {
        assert_eq!(round_trip(&mut stream, b"solo"), b"solo", "round {round}");
        stream.write_all(b"park").unwrap();
        let completer = completer_receiver
            .recv_timeout(SOON)
            .expect("the session should park and hand over its completer");
        std::thread::sleep(Duration::from_millis(20));
        let posted = Instant::now();
        completer.post(1, 2).expect("the post should be taken");
        let mut reply = [0_u8; 4];
        stream.read_exact(&mut reply).unwrap();
        assert_eq!(&reply, b"woke");
        assert!(
            posted.elapsed() < Duration::from_millis(500),
            "round {round}: the completion took {:?} to reach a parked session (the slice is 1 s): the \
             loop must not be in a solo read while its one connection is parked",
            posted.elapsed()
        );
    }
    drop(stream);
    assert_eq!(recorder.single_close(SOON), CloseReason::PeerClosed);
}
