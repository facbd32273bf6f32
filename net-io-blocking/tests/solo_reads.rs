//! Solo reads (a loop holding one busy connection waits for it in `recv` under `SO_RCVTIMEO`): the receive
//! timeout a solo read really waits under, whatever the socket inherited, and solo reads beside the handler
//! coroutines, PROXY headers and a manual clock.

mod common;

use std::time::{Duration, Instant};

use common::{Recorder, SOON, client, round_trip};
use net_io_blocking::{HandlerDriver, Limits, NetError, Server, ServerBuilder, TcpConnection};

/// Echoes each read until the peer closes.
fn echo(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let mut buffer = [0_u8; 4096];
    loop {
        let count = connection.read(&mut buffer)?;
        if count == 0 {
            return Ok(());
        }
        connection.write_all(&buffer[..count])?;
    }
}

/// A one-loop echo server with handlers on coroutines and the default solo slice (1 ms).
fn one_loop_server(limits: Limits, recorder: &Recorder) -> Server {
    ServerBuilder::new()
        .listen("127.0.0.1:0")
        .handler_driver(HandlerDriver::Coroutines { loops: 1 })
        .limits(limits.or(Limits::new().min_rate(None)))
        .events(recorder.clone())
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
