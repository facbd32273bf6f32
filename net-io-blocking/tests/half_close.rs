//! Half close on every driver: a session's `SessionContext::shutdown_write` on event loops and on worker
//! threads, and a handler's `TcpConnection::shutdown_write` on worker threads and on coroutines.
//!
//! Each test runs its case on every driver in turn; an assertion message names the driver.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Recorder, SOON, client, eventually, test_builder};
use net_io_blocking::{
    CloseReason, ConnectionInfo, DEFAULT_WORKERS, HandlerDriver, Input, Limits, ListenerSpec,
    NetError, Server, ServerBuilder, Session, SessionContext, SessionDriver, Step, TcpConnection,
    TimeoutKind,
};

/// The reply sent before the FIN: larger than one loopback segment, within the default output budget.
const REPLY_BYTES: usize = 48 * 1024;

const SESSION_DRIVERS: [SessionDriver; 2] = [
    SessionDriver::EventLoop { loops: 2 },
    SessionDriver::Threads,
];

const HANDLER_DRIVERS: [HandlerDriver; 2] = [
    HandlerDriver::Threads,
    HandlerDriver::Coroutines { loops: 2 },
];

/// A reply larger than the server's send buffer and the client's receive buffer together, so the flush
/// before the FIN has to wait for the client to read.
const LARGE_REPLY_BYTES: usize = 1024 * 1024;

/// The server's socket send buffer in the large-reply case (the kernel doubles it).
const SMALL_SEND_BUFFER: usize = 4096;

/// The reply's bytes: a pattern, so a lost or reordered byte shows.
fn reply(length: usize) -> Vec<u8> {
    (0..length).map(|index| (index % 251) as u8).collect()
}

/// What the server saw, shared with the test.
#[derive(Clone, Default)]
struct Seen {
    /// Bytes that arrived after the half close.
    after: Arc<Mutex<Vec<u8>>>,
    /// Whether the context said the write side was shut when a hook queued after the half close.
    write_shut: Arc<Mutex<Option<bool>>>,
    /// What a handler's call after the half close returned.
    outcome: Arc<Mutex<Option<String>>>,
}

impl Seen {
    fn after(&self) -> Vec<u8> {
        self.after.lock().unwrap().clone()
    }

    /// Keeps what a handler's call after the half close returned (see [`describe`]) and passes it on.
    fn report(&self, result: Result<usize, NetError>) -> Result<(), NetError> {
        *self.outcome.lock().unwrap() = Some(describe(&result));
        result.map(|_| ())
    }
}

/// On its first line: queues the reply, half closes, and flushes. Then records everything that arrives.
struct ReplyThenListen {
    seen: Seen,
    reply_bytes: usize,
    half_closed: bool,
}

impl Session for ReplyThenListen {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        if self.half_closed {
            self.seen
                .after
                .lock()
                .unwrap()
                .extend_from_slice(input.bytes());
            input.consume_all();
            return Step::Read;
        }
        let Some(end) = input.bytes().iter().position(|&byte| byte == b'\n') else {
            return Step::Read;
        };
        input.consume(end + 1);
        if context.output().push(&reply(self.reply_bytes)).is_err() {
            return Step::Abort;
        }
        context.shutdown_write();
        self.half_closed = true;
        Step::Write
    }
}

/// Half closes at once and waits for input; queues a reply to whatever arrives (which must fail).
struct ShutAtOpen {
    seen: Seen,
}

impl Session for ShutAtOpen {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        context.shutdown_write();
        Step::Read
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        input.consume_all();
        *self.seen.write_shut.lock().unwrap() = Some(context.is_write_shut());
        let _ = context.output().push(b"too late\n");
        Step::Write
    }
}

/// A builder listening on 127.0.0.1, with a small socket send buffer if asked.
fn builder(send_buffer: Option<usize>) -> ServerBuilder {
    let mut spec = ListenerSpec::new("127.0.0.1:0".parse().expect("a socket address"));
    if let Some(bytes) = send_buffer {
        spec = spec.send_buffer(bytes);
    }
    ServerBuilder::new().listener(spec)
}

/// A sessions server on `driver` from [`common::test_builder`] (default worker count), with `limits` as given:
/// the minimum rate stays on unless the caller turns it off, so a half-closed connection is judged by it too.
fn session_server<S: Session>(
    driver: SessionDriver,
    limits: Limits,
    recorder: &Recorder,
    make: impl Fn() -> S + Send + Sync + 'static,
) -> Server {
    test_builder(DEFAULT_WORKERS, limits, recorder)
        .limits(limits)
        .session_driver(driver)
        .sessions(move |_: &ConnectionInfo| Some(make()))
        .allow_all()
        .build()
        .expect("the session server should start")
}

/// A handler server on `driver` from [`common::test_builder`] (default worker count), with `limits` as given
/// (minimum rate included).
fn handler_server<H>(
    driver: HandlerDriver,
    limits: Limits,
    recorder: &Recorder,
    handler: H,
) -> Server
where
    H: Fn(&mut TcpConnection<'_>) -> Result<(), NetError> + Send + Sync + 'static,
{
    test_builder(DEFAULT_WORKERS, limits, recorder)
        .limits(limits)
        .handler_driver(driver)
        .handler(handler)
        .allow_all()
        .build()
        .expect("the handler server should start")
}

/// Reads until EOF; fails the test on a reset or a read timeout.
fn read_to_eof(stream: &mut TcpStream, driver: &str) -> Vec<u8> {
    let mut received = Vec::new();
    stream
        .read_to_end(&mut received)
        .unwrap_or_else(|error| panic!("{driver}: reading up to the server's FIN failed: {error}"));
    received
}

/// The client side of the main case: ask for the reply (and wait `pause` before reading it), read all of
/// it and the FIN, then send more (which must still reach the server) and close our side.
fn ask_read_all_then_write(
    server: &Server,
    reply_bytes: usize,
    pause: Duration,
    later: &[u8],
    driver: &str,
) {
    let mut stream = client(server.local_addr());
    stream.write_all(b"go\n").unwrap();
    std::thread::sleep(pause);
    let received = read_to_eof(&mut stream, driver);
    assert_eq!(
        received.len(),
        reply_bytes,
        "{driver}: the client should read every byte of the reply before the FIN"
    );
    assert!(
        received == reply(reply_bytes),
        "{driver}: the reply arrived changed or out of order"
    );
    stream
        .write_all(later)
        .unwrap_or_else(|error| panic!("{driver}: writing after the server's FIN failed: {error}"));
    stream.shutdown(Shutdown::Write).unwrap();
}

/// The main case's checks on one server: the client asks for the reply (`reply_bytes` after `pause`), reads
/// it and the FIN and writes more; the close is PeerClosed and the later bytes reach the server side.
/// `(fin_of, side)` name the one that sent the FIN and the one that should read on, in the messages.
fn expect_reply_then_listen(
    server: &Server,
    recorder: &Recorder,
    seen: &Seen,
    (reply_bytes, pause): (usize, Duration),
    name: &str,
    (fin_of, side): (&str, &str),
) {
    let later = b"still listening?\nyes\n";
    ask_read_all_then_write(server, reply_bytes, pause, later, name);
    assert_eq!(
        recorder.single_close(SOON),
        CloseReason::PeerClosed,
        "{name}: a half close followed by the peer's FIN should close gracefully as PeerClosed"
    );
    assert_eq!(
        seen.after(),
        later,
        "{name}: the bytes the client sent after the {fin_of} FIN should reach {side}"
    );
}

/// Kills the one connection `recorder` saw admitted to `server` (already half closed) and checks that the
/// kill wins and the close is `Killed(7)`; `side` names the session or handler in the message.
fn kill_the_half_closed(server: &Server, recorder: &Recorder, name: &str, side: &str) {
    let id = *recorder.admitted().last().expect("an admitted id");
    assert!(
        server.handle().kill(id, 7),
        "{name}: the kill of a half-closed connection should win"
    );
    assert_eq!(
        recorder.single_close(SOON),
        CloseReason::Killed(7),
        "{name}: a killed half-closed {side} closes with the kill"
    );
}

/// Connects to `server` and expects its FIN with nothing before it (`fin_expected` says why, in the message),
/// then a close at the idle deadline `idle`, not before it; `(name, side)` name the driver and the session or
/// handler in the messages.
fn expect_fin_then_idle_close(
    server: &Server,
    recorder: &Recorder,
    (name, side): (&str, &str),
    idle: Duration,
    fin_expected: &str,
) {
    let started = Instant::now();
    let mut stream = client(server.local_addr());
    assert!(
        read_to_eof(&mut stream, name).is_empty(),
        "{name}: {fin_expected}"
    );
    assert_eq!(
        recorder.single_close(SOON),
        CloseReason::Idle,
        "{name}: a half-closed {side} that hears nothing should close at the idle deadline"
    );
    // Generous: the deadline must not be skipped (the lower bound) nor lost (SOON caps the wait).
    assert!(
        started.elapsed() >= idle,
        "{name}: the idle close came before the idle timeout"
    );
}

/// Runs `case` on each of `drivers` in turn, with the driver's name (for the messages), a fresh recorder and
/// a fresh [`Seen`].
fn on_each_driver<D: std::fmt::Debug + Copy>(
    drivers: [D; 2],
    case: impl Fn(D, String, Recorder, Seen),
) {
    for driver in drivers {
        case(
            driver,
            format!("{driver:?}"),
            Recorder::default(),
            Seen::default(),
        );
    }
}

// ----- sessions -----

#[test]
fn a_half_closed_session_sends_every_byte_then_fin_and_still_reads_until_the_peer_closes() {
    session_reply_then_listen(REPLY_BYTES, Limits::new(), None, Duration::ZERO);
}

#[test]
fn a_session_fin_waits_for_a_reply_larger_than_the_socket_buffers() {
    session_reply_then_listen(
        LARGE_REPLY_BYTES,
        Limits::new().output_budget(LARGE_REPLY_BYTES),
        Some(SMALL_SEND_BUFFER),
        Duration::from_millis(300),
    );
}

fn session_reply_then_listen(
    reply_bytes: usize,
    limits: Limits,
    send_buffer: Option<usize>,
    pause: Duration,
) {
    on_each_driver(SESSION_DRIVERS, |driver, name, recorder, seen| {
        let shared = seen.clone();
        let server = builder(send_buffer)
            .session_driver(driver)
            .limits(limits)
            .events(recorder.clone())
            .sessions(move |_: &ConnectionInfo| {
                Some(ReplyThenListen {
                    seen: shared.clone(),
                    reply_bytes,
                    half_closed: false,
                })
            })
            .allow_all()
            .build()
            .expect("the session server should start");
        expect_reply_then_listen(
            &server,
            &recorder,
            &seen,
            (reply_bytes, pause),
            &name,
            ("server's", "the session"),
        );
    });
}

#[test]
fn the_idle_deadline_still_applies_to_a_half_closed_session() {
    on_each_driver(SESSION_DRIVERS, |driver, name, recorder, seen| {
        let idle = Duration::from_millis(300);
        let server = session_server(
            driver,
            Limits::new().idle_timeout(idle),
            &recorder,
            move || ShutAtOpen { seen: seen.clone() },
        );
        expect_fin_then_idle_close(
            &server,
            &recorder,
            (&name, "session"),
            idle,
            "a session that half closes at once sends nothing before its FIN",
        );
    });
}

#[test]
fn a_kill_while_a_session_is_half_closed_closes_it_with_the_kill() {
    on_each_driver(SESSION_DRIVERS, |driver, name, recorder, seen| {
        let server = session_server(driver, Limits::new(), &recorder, move || ShutAtOpen {
            seen: seen.clone(),
        });
        let mut stream = client(server.local_addr());
        assert!(
            read_to_eof(&mut stream, &name).is_empty(),
            "{name}: the half close should reach the client"
        );
        kill_the_half_closed(&server, &recorder, &name, "session");
    });
}

#[test]
fn a_write_queued_after_a_session_half_closed_closes_it_with_session_error() {
    on_each_driver(SESSION_DRIVERS, |driver, name, recorder, seen| {
        let shared = seen.clone();
        let server = session_server(driver, Limits::new(), &recorder, move || ShutAtOpen {
            seen: shared.clone(),
        });
        let mut stream = client(server.local_addr());
        assert!(
            read_to_eof(&mut stream, &name).is_empty(),
            "{name}: the half close should reach the client"
        );
        stream.write_all(b"hello\n").unwrap();
        assert_eq!(
            recorder.single_close(SOON),
            CloseReason::SessionError,
            "{name}: bytes queued after the FIN must not be dropped silently"
        );
        assert_eq!(
            *seen.write_shut.lock().unwrap(),
            Some(true),
            "{name}: the context should say the write side is shut once the FIN went out"
        );
    });
}

// ----- handlers -----

/// Reads the request line, replies, half closes, then records everything until the peer's FIN.
fn reply_then_listen(
    connection: &mut TcpConnection<'_>,
    seen: &Seen,
    reply_bytes: usize,
) -> Result<(), NetError> {
    let mut buffer = [0u8; 1024];
    let mut request = Vec::new();
    while !request.contains(&b'\n') {
        let count = connection.read(&mut buffer)?;
        if count == 0 {
            return Ok(());
        }
        request.extend_from_slice(&buffer[..count]);
    }
    connection.write_all(&reply(reply_bytes))?;
    connection.shutdown_write()?;
    loop {
        let count = connection.read(&mut buffer)?;
        if count == 0 {
            return Ok(());
        }
        seen.after
            .lock()
            .unwrap()
            .extend_from_slice(&buffer[..count]);
    }
}

/// Half closes, then reads once and reports what the read returned to `seen`.
fn shut_then_read_once(connection: &mut TcpConnection<'_>, seen: &Seen) -> Result<(), NetError> {
    connection.shutdown_write()?;
    let mut buffer = [0u8; 64];
    seen.report(connection.read(&mut buffer))
}

fn describe(result: &Result<usize, NetError>) -> String {
    match result {
        Ok(count) => format!("Ok({count})"),
        Err(NetError::Closed(reason)) => format!("Closed({reason:?})"),
        Err(NetError::Timeout(kind)) => format!("Timeout({kind:?})"),
        Err(other) => format!("{other:?}"),
    }
}

#[test]
fn a_half_closed_handler_sends_every_byte_then_fin_and_still_reads_until_the_peer_closes() {
    handler_reply_then_listen(REPLY_BYTES, Limits::new(), None, Duration::ZERO);
}

#[test]
fn a_handler_fin_waits_for_a_reply_larger_than_the_socket_buffers() {
    handler_reply_then_listen(
        LARGE_REPLY_BYTES,
        Limits::new(),
        Some(SMALL_SEND_BUFFER),
        Duration::from_millis(300),
    );
}

fn handler_reply_then_listen(
    reply_bytes: usize,
    limits: Limits,
    send_buffer: Option<usize>,
    pause: Duration,
) {
    on_each_driver(HANDLER_DRIVERS, |driver, name, recorder, seen| {
        let shared = seen.clone();
        let server = builder(send_buffer)
            .handler_driver(driver)
            .limits(limits)
            .events(recorder.clone())
            .handler(move |connection: &mut TcpConnection<'_>| {
                reply_then_listen(connection, &shared, reply_bytes)
            })
            .allow_all()
            .build()
            .expect("the handler server should start");
        expect_reply_then_listen(
            &server,
            &recorder,
            &seen,
            (reply_bytes, pause),
            &name,
            ("handler's", "the handler"),
        );
    });
}

#[test]
fn the_idle_deadline_still_applies_to_a_half_closed_handler() {
    on_each_driver(HANDLER_DRIVERS, |driver, name, recorder, seen| {
        let shared = seen.clone();
        let idle = Duration::from_millis(300);
        let server = handler_server(
            driver,
            Limits::new().idle_timeout(idle),
            &recorder,
            move |connection| shut_then_read_once(connection, &shared),
        );
        expect_fin_then_idle_close(
            &server,
            &recorder,
            (&name, "handler"),
            idle,
            "the handler's half close should reach the client",
        );
        assert_eq!(
            seen.outcome.lock().unwrap().as_deref(),
            Some("Timeout(Idle)"),
            "{name}: the handler's read should report the idle deadline"
        );
    });
}

#[test]
fn a_kill_while_a_handler_is_half_closed_ends_its_read_with_the_kill() {
    on_each_driver(HANDLER_DRIVERS, |driver, name, recorder, seen| {
        let shared = seen.clone();
        let server = handler_server(driver, Limits::new(), &recorder, move |connection| {
            shut_then_read_once(connection, &shared)
        });
        let mut stream = client(server.local_addr());
        assert!(
            read_to_eof(&mut stream, &name).is_empty(),
            "{name}: the handler's half close should reach the client"
        );
        kill_the_half_closed(&server, &recorder, &name, "handler");
        assert!(
            eventually(SOON, || seen.outcome.lock().unwrap().is_some()),
            "{name}: the handler's read did not return after the kill"
        );
        assert_eq!(
            seen.outcome.lock().unwrap().as_deref(),
            Some("Closed(Killed(7))"),
            "{name}: the handler's waiting read should end with the kill"
        );
    });
}

#[test]
fn a_handler_write_after_its_half_close_fails_with_session_error() {
    on_each_driver(HANDLER_DRIVERS, |driver, name, recorder, seen| {
        let shared = seen.clone();
        let server = handler_server(driver, Limits::new(), &recorder, move |connection| {
            connection.write_all(b"before\n")?;
            connection.shutdown_write()?;
            // A second call changes nothing.
            connection.shutdown_write()?;
            shared.report(connection.write_all(b"after\n").map(|()| 0))
        });
        let mut stream = client(server.local_addr());
        assert_eq!(
            read_to_eof(&mut stream, &name),
            b"before\n",
            "{name}: what was written before the half close arrives, nothing after it"
        );
        assert_eq!(
            recorder.single_close(SOON),
            CloseReason::SessionError,
            "{name}: a write after the half close closes with SessionError"
        );
        assert_eq!(
            seen.outcome.lock().unwrap().as_deref(),
            Some("Closed(SessionError)"),
            "{name}: the write after the half close should fail"
        );
    });
}

// ----- deadlines and drain while half closed -----

/// Half closes at once, then waits for a whole line (never consuming a partial one).
struct ShutThenWaitForLine;

impl Session for ShutThenWaitForLine {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        context.shutdown_write();
        Step::Read
    }

    fn on_data(&mut self, input: &mut Input<'_>, _context: &mut SessionContext<'_>) -> Step {
        if input.bytes().contains(&b'\n') {
            input.consume_all();
        }
        Step::Read
    }
}

#[test]
fn the_read_deadline_still_applies_to_a_half_closed_session_once_a_request_started() {
    on_each_driver(SESSION_DRIVERS, |driver, name, recorder, _seen| {
        let read = Duration::from_millis(300);
        let server = session_server(
            driver,
            Limits::new()
                .read_timeout(read)
                .idle_timeout(Duration::from_secs(30)),
            &recorder,
            || ShutThenWaitForLine,
        );
        let mut stream = client(server.local_addr());
        assert!(
            read_to_eof(&mut stream, &name).is_empty(),
            "{name}: the half close should reach the client"
        );
        let started = Instant::now();
        stream.write_all(b"half a li").unwrap();
        assert_eq!(
            recorder.single_close(SOON),
            TimeoutKind::Read.close_reason(),
            "{name}: a partial request to a half-closed session should close at the read deadline"
        );
        assert!(
            started.elapsed() >= read,
            "{name}: the read-deadline close came before the read timeout"
        );
    });
}

#[test]
fn a_drain_closes_an_idle_half_closed_connection_at_once() {
    let handler = |connection: &mut TcpConnection<'_>| {
        connection.shutdown_write()?;
        let mut buffer = [0u8; 64];
        while connection.read(&mut buffer)? > 0 {}
        Ok(())
    };
    let servers: Vec<(String, Recorder, Server)> = SESSION_DRIVERS
        .iter()
        .map(|&driver| {
            let recorder = Recorder::default();
            let server = session_server(driver, Limits::new(), &recorder, || ShutThenWaitForLine);
            (format!("{driver:?}"), recorder, server)
        })
        .chain(HANDLER_DRIVERS.iter().map(|&driver| {
            let recorder = Recorder::default();
            let server = handler_server(driver, Limits::new(), &recorder, handler);
            (format!("{driver:?} handler"), recorder, server)
        }))
        .collect();
    for (name, recorder, server) in servers {
        let mut stream = client(server.local_addr());
        assert!(
            read_to_eof(&mut stream, &name).is_empty(),
            "{name}: the half close should reach the client"
        );
        let started = Instant::now();
        let report = server
            .handle()
            .drain(Instant::now() + Duration::from_secs(30));
        assert_eq!(
            recorder.single_close(SOON),
            CloseReason::Drained,
            "{name}: an idle half-closed connection should close at once on a drain ({report:?})"
        );
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{name}: the drain waited for the idle half-closed connection"
        );
    }
}
