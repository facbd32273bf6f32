//! Helpers shared by the integration tests: an event recorder, `eventually`, small std clients, and (in the
//! submodules) the echo session and handlers, gates, child processes and other shared sessions.
#![allow(dead_code)]

pub mod child;
pub mod echo;
pub mod gates;
pub mod sessions;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use net_io_blocking::{
    CloseReason, ConnectionId, Event, EventSink, HandlerDriver, Limits, ServerBuilder,
    SessionDriver,
};

/// Records every event, for assertions about closes.
#[derive(Clone, Default)]
pub struct Recorder {
    events: Arc<Mutex<Vec<Event>>>,
}

impl EventSink for Recorder {
    fn emit(&self, event: Event) {
        self.events.lock().unwrap().push(event);
    }
}

impl Recorder {
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }

    /// Every (id, reason) of a `Closed` event, in order.
    pub fn closes(&self) -> Vec<(ConnectionId, CloseReason)> {
        self.events()
            .into_iter()
            .filter_map(|event| match event {
                Event::Closed { id, reason, .. } => Some((id, reason)),
                _ => None,
            })
            .collect()
    }

    /// Every id of an `Admitted` event.
    pub fn admitted(&self) -> Vec<ConnectionId> {
        self.events()
            .into_iter()
            .filter_map(|event| match event {
                Event::Admitted { id, .. } => Some(id),
                _ => None,
            })
            .collect()
    }

    /// Waits until `count` closes were recorded and returns them.
    pub fn wait_for_closes(
        &self,
        count: usize,
        timeout: Duration,
    ) -> Vec<(ConnectionId, CloseReason)> {
        eventually(timeout, || self.closes().len() >= count);
        self.closes()
    }

    /// Waits for exactly one close and returns its reason; fails the test if none or several happen.
    pub fn single_close(&self, timeout: Duration) -> CloseReason {
        let closes = self.wait_for_closes(1, timeout);
        // A second close would show up quickly if the driver closed twice.
        std::thread::sleep(Duration::from_millis(50));
        let closes_after = self.closes();
        assert_eq!(
            closes_after.len(),
            1,
            "expected exactly one close, saw {closes_after:?}"
        );
        closes[0].1
    }
}

/// A client of a server that is expected to turn the connection away (a cap, a lockdown, a refusing gate or
/// factory). Such a server resets at once, and the reset can reach the client before its `connect` returns,
/// which then fails with a reset (the client thread woke from the handshake but had not run yet; on a 2-core
/// machine about 2 in 1,000 such connects did, more under load). That is the outcome the test wants, so it is
/// kept here as "closed by the server" instead of failing the connect the way [`client`] does.
pub struct UnwantedClient {
    /// The connected stream, or `None` when the connect itself was reset or refused.
    stream: Option<TcpStream>,
}

impl UnwantedClient {
    /// Connects to `address`; a connect that ends in a reset or a refusal is kept as already turned away,
    /// and any other error fails the test.
    pub fn connect(address: SocketAddr) -> Self {
        Self {
            stream: connect_unless_turned_away(address),
        }
    }

    /// Sends `bytes` if the connection is still there; a write the server's reset beat is no error here.
    pub fn send(&mut self, bytes: &[u8]) {
        if let Some(stream) = &mut self.stream {
            let _ = stream.write_all(bytes);
        }
    }

    /// True when the server turned the connection away: the connect was reset or refused, or a read sees EOF
    /// or a reset (see [`is_closed_by_server`]).
    pub fn is_closed_by_server(&mut self) -> bool {
        self.stream.as_mut().is_none_or(is_closed_by_server)
    }
}

/// Polls `condition` every 5 ms until it holds or `timeout` passes; returns whether it held.
pub fn eventually(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A std client with a read timeout so a broken server fails the test instead of hanging it.
pub fn client(address: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(address).expect("connect to the test server");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

/// Sends `bytes` and reads exactly as many back.
pub fn round_trip(stream: &mut TcpStream, bytes: &[u8]) -> Vec<u8> {
    stream.write_all(bytes).expect("write to the server");
    let mut reply = vec![0u8; bytes.len()];
    stream.read_exact(&mut reply).expect("read the echo");
    reply
}

/// Reads one line byte by byte, without its newline; stops early at EOF or an error (a reset, the read
/// timeout), so the caller's assertion on the text says what was missing.
pub fn read_line(stream: &mut TcpStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while stream.read(&mut byte).unwrap_or(0) == 1 && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    String::from_utf8_lossy(&line).into_owned()
}

/// Everything the server still sends until it closes (EOF or reset).
pub fn read_to_close(stream: &mut TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let mut buffer = [0u8; 256];
    while let Ok(count) = stream.read(&mut buffer) {
        if count == 0 {
            break;
        }
        received.extend_from_slice(&buffer[..count]);
    }
    received
}

/// True when the server reset or closed the connection: a read returns EOF or a reset. A read that times out
/// is a connection the server kept open, so it is false (were it true, a server that never closed would pass
/// every assertion built on this, only slower); the stream needs a read timeout, as [`client`] sets.
pub fn is_closed_by_server(stream: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(count) => count == 0,
        Err(error) => !matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
    }
}

/// A client as [`client`] makes it, for a server that may turn the connection away at once: `None` when the
/// connect itself ended in a reset or a refusal (see [`UnwantedClient`] for why that can happen); any other
/// error fails the test.
pub fn connect_unless_turned_away(address: SocketAddr) -> Option<TcpStream> {
    match TcpStream::connect(address) {
        Ok(stream) => {
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            stream.set_nodelay(true).unwrap();
            Some(stream)
        }
        Err(error) if is_turned_away(&error) => None,
        Err(error) => panic!("connect to the test server {address} failed: {error}"),
    }
}

/// Whether a connect error is the server (or the kernel for it) turning the connection away.
fn is_turned_away(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted
    )
}

/// Makes the client's close an RST (linger 0).
pub fn reset(stream: TcpStream) {
    let socket = socket2::SockRef::from(&stream);
    socket.set_linger(Some(Duration::ZERO)).unwrap();
    drop(stream);
}

/// Descriptors this process has open now (the directory handle that lists them is counted every time, so
/// it cancels out of any difference).
pub fn open_descriptors() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .expect("could not list /proc/self/fd")
        .count() as u64
}

/// What each open descriptor of this process is (`/proc/self/fd/N`'s link), by number: a failed descriptor
/// count names what stayed open (a socket, an anonymous inode such as a timerfd, a file).
pub fn descriptor_links() -> std::collections::BTreeMap<u64, String> {
    std::fs::read_dir("/proc/self/fd")
        .expect("could not list /proc/self/fd")
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let number = entry.file_name().to_str()?.parse().ok()?;
            let link = std::fs::read_link(entry.path()).ok()?;
            Some((number, link.display().to_string()))
        })
        .collect()
}

/// The builder most tests start from: this binary's session driver (see [`session_driver`]), a listener on
/// 127.0.0.1, `workers` workers, `limits` without the minimum rate (a loaded machine must not trip it), and
/// every event to `recorder`. Later calls on the builder override any of these.
pub fn test_builder(workers: usize, limits: Limits, recorder: &Recorder) -> ServerBuilder {
    ServerBuilder::new()
        .session_driver(session_driver())
        .listen("127.0.0.1:0")
        .workers(workers)
        .limits(limits.min_rate(None))
        .events(recorder.clone())
}

/// Generous upper bound for anything that should happen "at once" on a loaded 2-core machine.
pub const SOON: Duration = Duration::from_secs(5);

/// The session driver the sessions-facing tests run on: event loops (two loop threads, the default kind),
/// except in the `threaded_sessions` binary, which runs the same tests on worker threads.
/// `NET_IO_TEST_SESSION_DRIVER=threads` or `=event-loop` forces one driver everywhere.
pub fn session_driver() -> SessionDriver {
    let threaded_binary = std::env::current_exe().ok().is_some_and(|path| {
        path.file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name.starts_with("threaded_sessions"))
    });
    match std::env::var("NET_IO_TEST_SESSION_DRIVER").as_deref() {
        Ok("threads") => SessionDriver::Threads,
        Ok("event-loop") => SessionDriver::EventLoop { loops: 2 },
        _ if threaded_binary => SessionDriver::Threads,
        _ => SessionDriver::EventLoop { loops: 2 },
    }
}

/// The handler driver the handler-facing tests run on: worker threads (the default kind), except in the
/// `coroutine_suites` binary, which runs the same tests with each handler on a coroutine over two loops.
/// `NET_IO_TEST_HANDLER_DRIVER=threads` or `=coroutines` forces one driver everywhere.
pub fn handler_driver() -> HandlerDriver {
    let coroutine_binary = std::env::current_exe().ok().is_some_and(|path| {
        path.file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name.starts_with("coroutine_suites"))
    });
    match std::env::var("NET_IO_TEST_HANDLER_DRIVER").as_deref() {
        Ok("threads") => HandlerDriver::Threads,
        Ok("coroutines") => HandlerDriver::Coroutines { loops: 2 },
        _ if coroutine_binary => HandlerDriver::Coroutines { loops: 2 },
        _ => HandlerDriver::Threads,
    }
}

/// Whether the handler-facing tests run on coroutines (some behaviour, such as the Busy rule, belongs to
/// worker threads only).
pub fn handlers_on_coroutines() -> bool {
    matches!(handler_driver(), HandlerDriver::Coroutines { .. })
}
