//! Outbound sessions (`ServerHandle::connect`): a server opens connections itself and drives them with the
//! guarantees of accepted ones: one close with one reason, the connect deadline, kill, drain, no leaks.

mod common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use common::{Recorder, SOON, eventually, open_descriptors, test_builder};
use net_io_blocking::{
    CloseReason, ConnectOptions, ConnectionInfo, Event, Input, Limits, ListenerId, NetError,
    Origin, OsErrorClass, Server, Session, SessionContext, Step,
};

/// What an endpoint saw, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Note {
    Opened(ConnectionInfo),
    Received(Vec<u8>),
    Closed(CloseReason),
}

/// What an endpoint does.
#[derive(Debug)]
enum Role {
    /// Echoes what arrives (the sessions the servers' factories make for accepted connections).
    Echo,
    /// Sends `greeting`, waits for as many bytes back, reports them and closes.
    Client {
        greeting: Vec<u8>,
        received: Vec<u8>,
    },
    /// Opens and then only reads, until something closes it.
    Idle,
}

/// The one session type of these servers: accepted connections echo; outbound ones play a client.
#[derive(Debug)]
struct Endpoint {
    role: Role,
    notes: Option<Sender<Note>>,
}

impl Endpoint {
    fn echo() -> Endpoint {
        Endpoint {
            role: Role::Echo,
            notes: None,
        }
    }

    fn client(greeting: &[u8]) -> (Endpoint, Receiver<Note>) {
        let (sender, receiver) = channel();
        let endpoint = Endpoint {
            role: Role::Client {
                greeting: greeting.to_vec(),
                received: Vec::new(),
            },
            notes: Some(sender),
        };
        (endpoint, receiver)
    }

    fn idle() -> (Endpoint, Receiver<Note>) {
        let (sender, receiver) = channel();
        let endpoint = Endpoint {
            role: Role::Idle,
            notes: Some(sender),
        };
        (endpoint, receiver)
    }

    fn note(&self, note: Note) {
        if let Some(notes) = &self.notes {
            let _ = notes.send(note);
        }
    }
}

impl Session for Endpoint {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        self.note(Note::Opened(*context.info()));
        match &self.role {
            Role::Client { greeting, .. } => {
                context
                    .output()
                    .push(greeting)
                    .expect("a short greeting fits the output budget");
                Step::Write
            }
            Role::Echo | Role::Idle => Step::Read,
        }
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        match &mut self.role {
            Role::Echo => {
                let taken = context.output().push_partial(input.bytes());
                input.consume(taken);
                Step::Write
            }
            Role::Client { greeting, received } => {
                received.extend_from_slice(input.bytes());
                input.consume_all();
                if received.len() < greeting.len() {
                    return Step::Read;
                }
                let received = received.clone();
                self.note(Note::Received(received));
                Step::Close
            }
            Role::Idle => {
                input.consume_all();
                Step::Read
            }
        }
    }

    fn on_close(&mut self, _info: &ConnectionInfo, reason: CloseReason) {
        self.note(Note::Closed(reason));
    }
}

/// A server of [`Endpoint`]s on this binary's session driver, with `workers` workers (the worker-thread
/// driver needs one per connection, both ends of a loopback exchange included).
fn endpoint_server(workers: usize, recorder: &Recorder) -> Server {
    // Every accepted end comes from 127.0.0.1: the per-source cap (16 by default) must not refuse the
    // server's own connects, whose closing ends still count for a moment on a loaded machine. As many per
    // source as there are workers is as many as the worker-thread driver can serve at all.
    let limits = Limits::new().max_per_source(workers);
    test_builder(workers, limits, recorder)
        .sessions(|_: &ConnectionInfo| Some(Endpoint::echo()))
        .allow_all()
        .build()
        .expect("the endpoint server should start")
}

/// The next note, or a panic naming what was awaited.
fn next_note(notes: &Receiver<Note>, awaited: &str) -> Note {
    notes
        .recv_timeout(SOON)
        .unwrap_or_else(|_| panic!("no note within {SOON:?} while waiting for {awaited}"))
}

/// Asserts the session heard nothing more: a second close (or anything after the close) is a bug.
fn assert_silent(notes: &Receiver<Note>) {
    if let Ok(note) = notes.recv_timeout(Duration::from_millis(200)) {
        panic!("the session heard {note:?} after its close; a close must be its last hook");
    }
}

/// An address on this host where nothing listens: bound once to learn a free port, then closed.
fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a scratch port");
    let address = listener.local_addr().expect("its address");
    drop(listener);
    address
}

/// A listener that never accepts, with its accept queue filled, so a further SYN is dropped and a connect
/// to it hangs in `SYN_SENT` until the connect deadline. Returns the listener (keep it alive), the fillers
/// and its address.
fn black_hole() -> (socket2::Socket, Vec<TcpStream>, SocketAddr) {
    let listener = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
        .expect("a listener socket");
    let address: SocketAddr = "127.0.0.1:0".parse().unwrap();
    listener.bind(&address.into()).expect("bind the black hole");
    // A backlog of 0 still queues one connection on Linux; the SYNs after the queue fills are dropped.
    listener
        .listen(0)
        .expect("listen with the smallest backlog");
    let address = listener
        .local_addr()
        .expect("its address")
        .as_socket()
        .expect("an inet address");
    let mut fillers = Vec::new();
    for _ in 0..8 {
        match TcpStream::connect_timeout(&address, Duration::from_millis(300)) {
            Ok(stream) => fillers.push(stream),
            Err(_) => return (listener, fillers, address),
        }
    }
    panic!(
        "a listener with backlog 0 that never accepts took 8 connections; the black hole needs a full queue"
    );
}

#[test]
fn an_outbound_session_exchanges_bytes_with_a_listener_of_the_same_server() {
    let recorder = Recorder::default();
    let server = endpoint_server(8, &recorder);
    let (client, notes) = Endpoint::client(b"ping through our own listener");
    let id = server
        .handle()
        .connect(server.local_addr(), client, ConnectOptions::new())
        .expect("connect should start");
    let Note::Opened(info) = next_note(&notes, "the outbound session's open") else {
        panic!("the first hook of an outbound session should be on_open");
    };
    assert_eq!(info.id, id, "on_open should see the id connect returned");
    assert!(
        info.is_outbound(),
        "the info should say the server opened it"
    );
    assert_eq!(info.origin, Origin::Connected);
    assert_eq!(
        info.listener,
        ListenerId::OUTBOUND,
        "an outbound connection has no listener of ours"
    );
    assert_eq!(
        info.peer,
        server.local_addr(),
        "the peer is where we connected"
    );
    assert_eq!(
        next_note(&notes, "the echo"),
        Note::Received(b"ping through our own listener".to_vec()),
        "the server's own listener should echo what the outbound session sent"
    );
    assert_eq!(
        next_note(&notes, "the close"),
        Note::Closed(CloseReason::SessionClosed)
    );
    assert_silent(&notes);
    assert!(
        eventually(SOON, || recorder.events().iter().any(
            |event| matches!(event, Event::Connected { id: connected, .. } if *connected == id)
        )),
        "a finished connect should be reported as Connected"
    );
    assert!(
        eventually(SOON, || recorder.closes().len() == 2),
        "both ends should close: {:?}",
        recorder.closes()
    );
}

#[test]
fn an_outbound_session_exchanges_bytes_with_another_server() {
    let near = Recorder::default();
    let far = Recorder::default();
    let client_server = endpoint_server(4, &near);
    let echo_server = endpoint_server(4, &far);
    let (client, notes) = Endpoint::client(b"hello, far server");
    client_server
        .handle()
        .connect(echo_server.local_addr(), client, ConnectOptions::new())
        .expect("connect should start");
    assert!(matches!(next_note(&notes, "the open"), Note::Opened(_)));
    assert_eq!(
        next_note(&notes, "the echo"),
        Note::Received(b"hello, far server".to_vec())
    );
    assert_eq!(
        next_note(&notes, "the close"),
        Note::Closed(CloseReason::SessionClosed)
    );
    assert!(
        eventually(SOON, || far.closes().len() == 1),
        "the far server should see its accepted connection close"
    );
    assert!(
        eventually(SOON, || client_server.stats().closed == 1),
        "the outbound close should count in the stats of the server that opened it"
    );
    let stats = client_server.stats();
    assert_eq!(
        (stats.accepted, stats.connected, stats.open),
        (0, 1, 0),
        "{stats:?}"
    );
}

#[test]
fn a_refused_connect_reaches_on_close_once_with_connection_refused() {
    let recorder = Recorder::default();
    let server = endpoint_server(4, &recorder);
    let (client, notes) = Endpoint::client(b"anyone there?");
    let id = server
        .handle()
        .connect(closed_port(), client, ConnectOptions::new())
        .expect("connect should start even if the port is closed");
    assert_eq!(
        next_note(&notes, "the refusal"),
        Note::Closed(CloseReason::Io(OsErrorClass::ConnectionRefused)),
        "a refused connect should close the session without opening it"
    );
    assert_silent(&notes);
    assert!(
        eventually(SOON, || recorder.closes()
            == vec![(id, CloseReason::Io(OsErrorClass::ConnectionRefused))]),
        "the Closed event should carry the refusal once: {:?}",
        recorder.closes()
    );
    assert!(
        eventually(SOON, || server.handle().open_connections() == 0),
        "the refused connection should give its cap back"
    );
}

#[test]
fn a_connect_to_a_black_hole_ends_at_the_connect_deadline() {
    let recorder = Recorder::default();
    let server = endpoint_server(4, &recorder);
    let (_listener, _fillers, address) = black_hole();
    let (client, notes) = Endpoint::client(b"lost");
    let started = Instant::now();
    server
        .handle()
        .connect(
            address,
            client,
            ConnectOptions::new().connect_timeout(Duration::from_millis(300)),
        )
        .expect("connect should start");
    assert_eq!(
        next_note(&notes, "the connect deadline"),
        Note::Closed(CloseReason::ConnectTimeout),
        "a connect the peer never answers should end at its deadline"
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300),
        "the connect deadline fired early, after {took:?}"
    );
    assert_silent(&notes);
    assert!(
        eventually(SOON, || server.stats().timeouts == 1),
        "a connect timeout should count among the timeouts: {:?}",
        server.stats()
    );
}

#[test]
fn a_kill_ends_an_outbound_session_while_it_connects_and_once_it_is_open() {
    let recorder = Recorder::default();
    let server = endpoint_server(8, &recorder);
    let (_listener, _fillers, address) = black_hole();
    let (connecting, connecting_notes) = Endpoint::idle();
    let stuck = server
        .handle()
        .connect(address, connecting, ConnectOptions::new())
        .expect("connect should start");
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        server.handle().kill(stuck, 7),
        "a connecting outbound session should be killable by id"
    );
    assert_eq!(
        next_note(&connecting_notes, "the kill while connecting"),
        Note::Closed(CloseReason::Killed(7))
    );
    assert_silent(&connecting_notes);

    let (open, open_notes) = Endpoint::idle();
    let id = server
        .handle()
        .connect(server.local_addr(), open, ConnectOptions::new())
        .expect("connect should start");
    assert!(matches!(
        next_note(&open_notes, "the open"),
        Note::Opened(_)
    ));
    assert!(
        server.handle().kill(id, 9),
        "an open outbound session should be killable by id"
    );
    assert_eq!(
        next_note(&open_notes, "the kill once open"),
        Note::Closed(CloseReason::Killed(9))
    );
    assert_silent(&open_notes);
}

#[test]
fn a_drain_closes_an_idle_outbound_session_and_then_refuses_new_connects() {
    let recorder = Recorder::default();
    let server = endpoint_server(8, &recorder);
    // The peer is another server, so that the drain meets our end idle, not already closing after the
    // drained peer's FIN.
    let far = Recorder::default();
    let peer = endpoint_server(4, &far);
    let (idle, notes) = Endpoint::idle();
    server
        .handle()
        .connect(peer.local_addr(), idle, ConnectOptions::new())
        .expect("connect should start");
    assert!(matches!(next_note(&notes, "the open"), Note::Opened(_)));
    let stats = server.stats();
    assert_eq!(
        (stats.connected, stats.open),
        (1, 1),
        "an open outbound session counts as open in the stats of the server that opened it: {stats:?}"
    );
    let report = server.handle().drain(Instant::now() + SOON);
    assert_eq!(
        next_note(&notes, "the drain"),
        Note::Closed(CloseReason::Drained),
        "a drain should close an idle outbound session like an idle accepted one"
    );
    assert_eq!(
        (report.graceful, report.killed),
        (1, 0),
        "the drain should report the outbound session as closed gracefully: {report:?}"
    );
    assert!(
        eventually(SOON, || far.closes()
            == vec![(far.admitted()[0], CloseReason::PeerClosed)]),
        "the peer should see a graceful close: {:?}",
        far.closes()
    );
    let (late, _late_notes) = Endpoint::idle();
    let refused = server
        .handle()
        .connect(peer.local_addr(), late, ConnectOptions::new());
    assert!(
        matches!(refused, Err(NetError::ShuttingDown)),
        "a drained server should refuse to connect out, got {refused:?}"
    );
}

#[test]
fn connect_refuses_a_session_of_another_type_naming_both() {
    let recorder = Recorder::default();
    let server = endpoint_server(2, &recorder);
    let refused = server.handle().connect(
        server.local_addr(),
        common::echo::Echo,
        ConnectOptions::new(),
    );
    let Err(error @ NetError::WrongSessionType { .. }) = refused else {
        panic!("a session of another type should be refused, got {refused:?}");
    };
    let text = error.to_string();
    assert!(
        text.contains("Endpoint") && text.contains("Echo"),
        "the error should name the server's type and the one given: {text}"
    );
}

#[test]
fn a_thousand_outbound_connections_open_and_close_with_no_descriptor_left() {
    let recorder = Recorder::default();
    let server = endpoint_server(32, &recorder);
    // Warm up once, so lazily made descriptors (epoll, eventfds, the listener's reserve) are counted before.
    let (warm, warm_notes) = Endpoint::client(b"warm");
    server
        .handle()
        .connect(server.local_addr(), warm, ConnectOptions::new())
        .unwrap();
    while !matches!(next_note(&warm_notes, "the warm-up close"), Note::Closed(_)) {}
    assert!(eventually(SOON, || server.handle().open_connections() == 0));
    let before = open_descriptors();
    const TOTAL: usize = 1_000;
    // At most this many in flight, so the worker-thread driver (one worker per end) always has room.
    const WINDOW: usize = 8;
    let mut in_flight: Vec<Receiver<Note>> = Vec::new();
    let mut finished = 0;
    let mut started = 0;
    while finished < TOTAL {
        while started < TOTAL && in_flight.len() < WINDOW {
            let (client, notes) = Endpoint::client(format!("message {started}").as_bytes());
            server
                .handle()
                .connect(server.local_addr(), client, ConnectOptions::new())
                .expect("connect should start");
            in_flight.push(notes);
            started += 1;
        }
        let notes = in_flight.remove(0);
        let mut closes = 0;
        let mut echoed = false;
        while closes == 0 {
            match next_note(&notes, "a churned connection's end") {
                Note::Opened(_) => {}
                Note::Received(_) => echoed = true,
                Note::Closed(reason) => {
                    assert_eq!(
                        reason,
                        CloseReason::SessionClosed,
                        "every churned connection should close as its session asked"
                    );
                    closes += 1;
                }
            }
        }
        assert!(echoed, "every churned connection should get its echo");
        finished += 1;
    }
    assert!(
        eventually(SOON, || server.handle().open_connections() == 0),
        "every connection should be closed, {} still open",
        server.handle().open_connections()
    );
    assert!(
        eventually(SOON, || open_descriptors() <= before),
        "descriptors leaked: {} before, {} after {TOTAL} outbound connections",
        before,
        open_descriptors()
    );
    let stats = server.stats();
    assert_eq!(
        stats.closed,
        2 * (TOTAL as u64 + 1),
        "both ends of every exchange should be counted closed once: {stats:?}"
    );
}
