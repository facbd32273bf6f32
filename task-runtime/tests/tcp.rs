//! TCP: connect, accept, send and the three receives park on epoll; a reader and a writer share a socket.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use task_runtime::{Runtime, RuntimeError, Tcp, TcpConnection};

use common::{JOIN_PATIENCE, becomes_running, init, join, take};

#[test]
fn an_echo_round_trip_works_through_parked_tasks() {
    init();
    let listener = Tcp::listen("127.0.0.1:0").expect("listen");
    let address = listener.local_addr().expect("address");
    let accepted = Runtime::task(listener.accept()).spawn();
    let client: TcpConnection = take(
        Runtime::task(Tcp::connect(address)).spawn(),
        "a connect to the local listener",
    )
    .expect("connect");
    let server = take(accepted, "the accept of that connect").expect("accept");
    let received = Runtime::task(server.recv_exact(5)).spawn();
    assert!(
        becomes_running(&received),
        "the receive should park while no bytes came"
    );
    join(
        &Runtime::task(client.send(b"hello".to_vec())).spawn(),
        "a send of 5 bytes",
    )
    .expect("send");
    assert_eq!(
        take(received, "the parked receive of 5 bytes"),
        Ok(b"hello".to_vec()),
        "the parked receive wakes with the bytes"
    );

    join(
        &Runtime::task(client.send(b"line one\nline two\n".to_vec())).spawn(),
        "a send of two lines",
    )
    .expect("send");
    let first = take(
        Runtime::task(server.recv_until(b'\n', 100)).spawn(),
        "the receive of the first line",
    );
    let second = take(
        Runtime::task(server.recv_until(b'\n', 100)).spawn(),
        "the receive of the second line",
    );
    assert_eq!(first, Ok(b"line one\n".to_vec()));
    assert_eq!(
        second,
        Ok(b"line two\n".to_vec()),
        "bytes past a delimiter are kept"
    );

    join(
        &Runtime::task(client.send(vec![b'x'; 50])).spawn(),
        "a send of 50 bytes without a newline",
    )
    .expect("send");
    assert_eq!(
        take(
            Runtime::task(server.recv_until(b'\n', 10)).spawn(),
            "a line receive past its limit"
        ),
        Err(RuntimeError::TooLong),
        "a line past the limit reads TooLong"
    );
    client.finish().expect("finish");
    let mut rest = Vec::new();
    loop {
        let chunk = take(
            Runtime::task(server.recv(1024)).spawn(),
            "a receive of what is left",
        )
        .expect("recv");
        if chunk.is_empty() {
            break;
        }
        rest.extend(chunk);
    }
    assert_eq!(
        rest.len(),
        50,
        "a TooLong loses nothing: all 50 bytes arrive, then end of stream reads as empty"
    );
}

#[test]
fn a_reader_and_a_writer_park_on_one_socket() {
    init();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    let connection = take(
        Runtime::task(Tcp::connect(address)).spawn(),
        "a connect to the local listener",
    )
    .expect("connect");
    let (mut peer, _) = listener.accept().expect("accept");
    // Fill the send buffer so the writer parks too.
    let big = vec![7u8; 8 << 20];
    let writer = Runtime::task(connection.send(big.clone())).spawn();
    let reader = Runtime::task(connection.recv_exact(3)).spawn();
    assert!(
        becomes_running(&writer) && becomes_running(&reader),
        "both should be parked"
    );
    peer.write_all(b"abc").expect("peer write");
    assert_eq!(
        take(reader, "the parked reader"),
        Ok(b"abc".to_vec()),
        "the reader wakes on its own event"
    );
    assert!(writer.is_running(), "the writer stays parked");
    let mut drained = vec![0u8; big.len()];
    // A writer that never sends fails the read at the deadline instead of hanging the test.
    peer.set_read_timeout(Some(JOIN_PATIENCE)).expect("timeout");
    peer.read_exact(&mut drained)
        .expect("the peer should read all 8 MiB the parked writer sends");
    assert_eq!(
        take(writer, "the parked writer of 8 MiB"),
        Ok(big.len()),
        "the writer wakes once the peer drains"
    );
}

#[test]
fn a_refused_connect_reads_an_address_error_and_a_cancelled_receive_frees_its_slot() {
    init();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    drop(listener);
    assert_eq!(
        take(
            Runtime::task(Tcp::connect(address)).spawn(),
            "a connect to a closed port"
        )
        .map(|_| ()),
        Err(RuntimeError::BadAddress),
        "a refused connect reads BadAddress"
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let connection = take(
        Runtime::task(Tcp::connect(listener.local_addr().expect("address"))).spawn(),
        "a connect to the second listener",
    )
    .expect("connect");
    let (mut peer, _) = listener.accept().expect("accept");
    let receive = Runtime::task(connection.recv(10)).spawn();
    drop(connection);
    std::thread::sleep(Duration::from_millis(20));
    receive.cancel();
    assert_eq!(
        join(&receive, "the cancelled receive"),
        Err(RuntimeError::Cancelled)
    );
    drop(receive);
    // With the task and every handle gone the socket closes: the peer reads end of stream.
    peer.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buffer = [0u8; 1];
    assert_eq!(
        peer.read(&mut buffer).expect("peer read"),
        0,
        "the socket should be closed"
    );
}
