//! Client connections: `wait_any_readable` (one thread waits on several and learns which one a read would
//! answer at once: input, the peer's close, a kill, or nothing before the timeout), and `read_left` (what a
//! peer said before it reset the connection, read after a write met the reset).

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use net_io_blocking::{
    CloseReason, Limits, NetError, TcpConnection, WAIT_ANY_CONNECTIONS_MAX, connect,
    wait_any_readable,
};

/// A client connection to a fresh listener on 127.0.0.1, and the listener's end of it.
fn pair() -> (TcpConnection<'static>, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("could not bind a listener");
    let client =
        connect(listener.local_addr().unwrap(), &Limits::new()).expect("could not connect");
    let (accepted, _) = listener.accept().expect("could not accept");
    (client, accepted)
}

#[test]
fn a_wait_on_silent_connections_times_out() {
    let (first, _first_peer) = pair();
    let (second, _second_peer) = pair();
    let started = Instant::now();
    let ready = wait_any_readable(&[&first, &second], Some(Duration::from_millis(30))).unwrap();
    assert_eq!(
        ready, None,
        "nothing was sent, so nothing should be readable"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(30),
        "the wait returned before its timeout"
    );
}

#[test]
fn the_connection_with_input_is_named_and_its_read_answers_without_waiting() {
    let (mut first, _first_peer) = pair();
    let (mut second, mut second_peer) = pair();
    second_peer.write_all(b"token").unwrap();
    let ready = wait_any_readable(&[&first, &second], Some(Duration::from_secs(5))).unwrap();
    assert_eq!(ready, Some(1), "only the second connection has input");
    let mut buffer = [0u8; 16];
    let count = second.read(&mut buffer).unwrap();
    assert_eq!(
        &buffer[..count],
        b"token",
        "the read should return what was sent"
    );
    let ready = wait_any_readable(&[&first, &second], Some(Duration::from_millis(20))).unwrap();
    assert_eq!(ready, None, "the input was read, so nothing is left");
    // The same holds the other way round.
    drop(_first_peer);
    let ready = wait_any_readable(&[&first, &second], Some(Duration::from_secs(5))).unwrap();
    assert_eq!(
        ready,
        Some(0),
        "the first peer closed: its end is ready to read"
    );
    assert_eq!(
        first.read(&mut buffer).unwrap(),
        0,
        "the read reports the close"
    );
    let ready = wait_any_readable(&[&first, &second], Some(Duration::from_secs(5))).unwrap();
    assert_eq!(
        ready,
        Some(0),
        "a connection whose peer closed stays ready: its read keeps answering 0"
    );
}

#[test]
fn a_kill_from_another_thread_ends_the_wait_and_the_read_reports_it() {
    let (first, _first_peer) = pair();
    let (mut second, _second_peer) = pair();
    let kill = second.kill_handle();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        kill.kill(7);
    });
    let ready = wait_any_readable(&[&first, &second], Some(Duration::from_secs(10))).unwrap();
    killer.join().unwrap();
    assert_eq!(ready, Some(1), "the killed connection should end the wait");
    let mut buffer = [0u8; 16];
    match second.read(&mut buffer) {
        Err(NetError::Closed(CloseReason::Killed(7))) => {}
        other => panic!("the read after a kill should report it, not {other:?}"),
    }
}

#[test]
fn too_many_connections_are_refused_in_words() {
    let pairs: Vec<_> = (0..=WAIT_ANY_CONNECTIONS_MAX).map(|_| pair()).collect();
    let connections: Vec<&TcpConnection<'static>> =
        pairs.iter().map(|(client, _)| client).collect();
    let error = wait_any_readable(&connections, None).unwrap_err();
    assert!(
        error
            .to_string()
            .contains(&format!("at most {WAIT_ANY_CONNECTIONS_MAX} connections")),
        "the error should name the limit: {error}"
    );
}

#[test]
fn the_peers_last_words_before_a_reset_can_be_read_after_the_write_that_met_it_failed() {
    let (mut client, mut peer) = pair();
    client.write_all(b"a request the peer never reads").unwrap();
    // The peer answers, then closes with the request unread: the kernel resets the connection.
    peer.write_all(b"refused: bad request").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(peer);
    std::thread::sleep(Duration::from_millis(50));
    let mut failed = None;
    for _ in 0..10 {
        if let Err(error) = client.write_all(b"more") {
            failed = Some(error);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let failed = failed.expect("a write to a reset connection should fail");
    let mut buffer = [0u8; 64];
    assert!(
        client.read(&mut buffer).is_err(),
        "after the failed write ({failed}), read reports the failure"
    );
    let mut said = Vec::new();
    loop {
        match client.read_left(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(count) => said.extend_from_slice(&buffer[..count]),
        }
    }
    assert_eq!(
        said, b"refused: bad request",
        "the answer the peer sent before its reset is still there"
    );
}
