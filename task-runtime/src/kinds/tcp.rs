//! `Tcp`: non-blocking sockets whose connect, accept, send and receive park on the manager's epoll.
//!
//! Each socket has one waiter record with a reader and a writer slot, so one task can park on reading
//! while another parks on writing the same socket. The socket is registered once, edge-triggered for
//! both directions; an edge sets a ready flag that a task about to park checks first, so an edge that
//! lands between a `WouldBlock` and the park is never lost.

use std::io;
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};

use net_io_sys::epoll::Interest;
use net_io_sys::socket::{self, ConnectProgress, ListenOptions, Listener};

use crate::error::RuntimeError;
use crate::manager::{Dispatch, Reactor};
use crate::pool::global_pool;
use crate::task::{Source, Step, Task, Wait, Waker, sealed};

const READ: u8 = 0;
const WRITE: u8 = 1;
/// Most bytes one step moves before it lets other tasks run.
const STEP_BUDGET: usize = 1 << 20;

#[derive(Default)]
struct Waiters {
    read_ready: bool,
    write_ready: bool,
    reader: Option<Waker>,
    writer: Option<Waker>,
}

/// The per-socket waiter record the manager dispatches readiness to.
struct Record {
    waiters: Mutex<Waiters>,
    registration: Mutex<Option<(Weak<Reactor>, u64)>>,
}

impl Dispatch for Record {
    fn dispatch(&self, readiness: Interest) {
        let (reader, writer) = {
            let mut waiters = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
            let failed = readiness.intersects(Interest::HANG_UP | Interest::ERROR);
            let mut reader = None;
            let mut writer = None;
            if failed || readiness.intersects(Interest::READABLE | Interest::READ_CLOSED) {
                waiters.read_ready = true;
                reader = waiters.reader.take();
            }
            if failed || readiness.intersects(Interest::WRITABLE) {
                waiters.write_ready = true;
                writer = waiters.writer.take();
            }
            (reader, writer)
        };
        if let Some(reader) = reader {
            reader.wake();
        }
        if let Some(writer) = writer {
            writer.wake();
        }
    }

    fn abandon(&self) {
        self.dispatch(Interest::ERROR);
    }
}

/// The descriptor a task parks on: a listener (which accepts) or a connected socket (which moves bytes).
enum Endpoint {
    Listening(Listener),
    Connected(OwnedFd),
}

impl AsFd for Endpoint {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Endpoint::Listening(listener) => listener.as_fd(),
            Endpoint::Connected(socket) => socket.as_fd(),
        }
    }
}

struct Inner {
    socket: Endpoint,
    record: Arc<Record>,
    /// Bytes read past a delimiter by `recv_until`, served first by later receives.
    pending: Mutex<Vec<u8>>,
}

/// The parking side of a socket: registers lazily with the current runtime's manager.
struct SocketSource {
    inner: Arc<Inner>,
}

impl Source for SocketSource {
    fn register(&self, direction: u8, waker: Waker) -> bool {
        ensure_registered(&self.inner);
        let mut waiters = self
            .inner
            .record
            .waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let ready = if direction == READ {
            &mut waiters.read_ready
        } else {
            &mut waiters.write_ready
        };
        if *ready {
            // An edge arrived since the last attempt: try again instead of parking.
            *ready = false;
            return false;
        }
        if direction == READ {
            waiters.reader = Some(waker);
        } else {
            waiters.writer = Some(waker);
        }
        true
    }
}

fn ensure_registered(inner: &Arc<Inner>) {
    let Some(pool) = global_pool() else {
        return;
    };
    let mut registration = inner
        .record
        .registration
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some((reactor, _)) = registration.as_ref()
        && reactor
            .upgrade()
            .is_some_and(|reactor| Arc::ptr_eq(&reactor, &pool.reactor))
    {
        return;
    }
    let record: Arc<dyn Dispatch> = inner.record.clone();
    let interest = Interest::READABLE | Interest::WRITABLE | Interest::READ_CLOSED | Interest::EDGE;
    if let Ok(token) =
        pool.reactor
            .register(inner.socket.as_fd(), Arc::downgrade(&record), interest)
    {
        *registration = Some((Arc::downgrade(&pool.reactor), token));
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Deregister before the descriptor closes (a duplicate would keep the registration alive).
        let registration = self
            .record
            .registration
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((reactor, token)) = registration
            && let Some(reactor) = reactor.upgrade()
        {
            reactor.deregister(self.socket.as_fd(), token);
        }
    }
}

fn new_inner(socket: Endpoint) -> Arc<Inner> {
    Arc::new(Inner {
        socket,
        record: Arc::new(Record {
            waiters: Mutex::new(Waiters::default()),
            registration: Mutex::new(None),
        }),
        pending: Mutex::new(Vec::new()),
    })
}

fn park(inner: &Arc<Inner>, direction: u8) -> Wait {
    Wait::on(
        Arc::new(SocketSource {
            inner: Arc::clone(inner),
        }),
        direction,
        None,
    )
}

/// An address the socket reported; `BadAddress` when it is not an IP address (net-io-sys reports that as
/// `InvalidData`).
fn ip_address(address: io::Result<SocketAddr>) -> Result<SocketAddr, RuntimeError> {
    address.map_err(|error| match error.kind() {
        io::ErrorKind::InvalidData => RuntimeError::BadAddress,
        _ => error.into(),
    })
}

fn resolve(address: impl ToSocketAddrs) -> Result<SocketAddr, RuntimeError> {
    address
        .to_socket_addrs()
        .map_err(|_| RuntimeError::BadAddress)?
        .next()
        .ok_or(RuntimeError::BadAddress)
}

/// TCP constructors.
///
/// Connect, accept, send and receive are tasks; each parks on the manager's epoll while the socket is not
/// ready, holding no thread:
///
/// ```
/// use task_runtime::{Runtime, Tcp};
///
/// let _ = Runtime::init();
/// let listener = Tcp::listen("127.0.0.1:0")?;
/// let accepted = Runtime::task(listener.accept()).spawn();
/// let client = Runtime::task(Tcp::connect(listener.local_addr()?)).spawn().take()?;
/// let server = accepted.take()?;
/// let received = Runtime::task(server.recv_until(b'\n', 1024)).spawn();
/// Runtime::task(client.send(b"hello\n".to_vec())).spawn().take()?;
/// assert_eq!(received.take()?, b"hello\n");
/// # Ok::<(), task_runtime::RuntimeError>(())
/// ```
#[derive(Debug)]
pub struct Tcp;

impl Tcp {
    /// A task that connects to `address` (no delay on), parking until the connect finishes.
    pub fn connect(address: impl ToSocketAddrs) -> TcpConnect {
        TcpConnect {
            address: resolve(address),
            socket: None,
        }
    }

    /// Binds and listens on `address` now with net-io-sys's defaults: address reuse on, IPv6 only for an
    /// IPv6 address, backlog 1024 capped at the kernel's `somaxconn`.
    pub fn listen(address: impl ToSocketAddrs) -> Result<TcpListener, RuntimeError> {
        let address = resolve(address)?;
        let listener = socket::listen(address, &ListenOptions::default())?;
        Ok(TcpListener {
            inner: new_inner(Endpoint::Listening(listener)),
        })
    }
}

/// A listening socket; clones share it. Two tasks may accept at once.
#[derive(Clone)]
pub struct TcpListener {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TcpListener {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("TcpListener")
            .field("local", &self.local_addr().ok())
            .finish()
    }
}

impl TcpListener {
    /// The bound address (useful after binding port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, RuntimeError> {
        ip_address(socket::local_addr(self.inner.socket.as_fd()))
    }

    /// A task that accepts one connection, parking until a peer arrives.
    pub fn accept(&self) -> TcpAccept {
        TcpAccept {
            inner: Arc::clone(&self.inner),
        }
    }
}

/// A connected socket; clones share it (one may receive while another sends).
#[derive(Clone)]
pub struct TcpConnection {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TcpConnection {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("TcpConnection")
            .field("peer", &self.peer_addr().ok())
            .finish()
    }
}

impl TcpConnection {
    /// Wraps an accepted (blocking) socket: non-blocking, since tasks park on the manager's epoll instead.
    fn from_accepted(socket: OwnedFd) -> Result<Self, RuntimeError> {
        socket::set_nonblocking(socket.as_fd(), true)?;
        socket::set_nodelay(socket.as_fd(), true)?;
        Ok(TcpConnection {
            inner: new_inner(Endpoint::Connected(socket)),
        })
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Result<SocketAddr, RuntimeError> {
        ip_address(socket::peer_addr(self.inner.socket.as_fd()))
    }

    /// The local address.
    pub fn local_addr(&self) -> Result<SocketAddr, RuntimeError> {
        ip_address(socket::local_addr(self.inner.socket.as_fd()))
    }

    /// Shuts the writing half: the peer reads end of stream. A second call is a no-op.
    pub fn finish(&self) -> Result<(), RuntimeError> {
        socket::shutdown(self.inner.socket.as_fd(), Shutdown::Write)?;
        Ok(())
    }

    /// A task that sends all of `bytes` and returns how many were sent.
    pub fn send(&self, bytes: impl Into<Vec<u8>>) -> TcpSend {
        TcpSend {
            inner: Arc::clone(&self.inner),
            bytes: bytes.into(),
            sent: 0,
        }
    }

    /// A task that receives up to `limit` bytes (an empty result is end of stream).
    pub fn recv(&self, limit: usize) -> TcpRecv {
        TcpRecv {
            inner: Arc::clone(&self.inner),
            until: Until::Any(limit.max(1)),
            received: Vec::new(),
        }
    }

    /// A task that receives exactly `length` bytes (end of stream first reads `Closed`).
    pub fn recv_exact(&self, length: usize) -> TcpRecv {
        TcpRecv {
            inner: Arc::clone(&self.inner),
            until: Until::Exact(length),
            received: Vec::new(),
        }
    }

    /// A task that receives up to and including `delimiter`; more than `limit` bytes reads `TooLong`.
    pub fn recv_until(&self, delimiter: u8, limit: usize) -> TcpRecv {
        TcpRecv {
            inner: Arc::clone(&self.inner),
            until: Until::Delimiter(delimiter, limit),
            received: Vec::new(),
        }
    }
}

/// The connect task.
pub struct TcpConnect {
    address: Result<SocketAddr, RuntimeError>,
    socket: Option<Arc<Inner>>,
}

impl std::fmt::Debug for TcpConnect {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("TcpConnect")
            .field("address", &self.address)
            .finish()
    }
}

impl sealed::Sealed for TcpConnect {}

impl Task for TcpConnect {
    type Input = ();
    type Output = TcpConnection;

    fn start(&mut self, _input: ()) {}

    fn step(&mut self) -> Step<TcpConnection> {
        let address = match &self.address {
            Ok(address) => *address,
            Err(error) => return Step::Done(Err(error.clone())),
        };
        if let Some(inner) = self.socket.take() {
            return match socket::take_error(inner.socket.as_fd()) {
                Ok(Some(error)) | Err(error) => Step::Done(Err(error.into())),
                Ok(None) => match socket::peer_addr(inner.socket.as_fd()) {
                    Ok(_) => Step::Done(Ok(TcpConnection { inner })),
                    Err(error) if error.raw_os_error() == Some(libc::ENOTCONN) => {
                        let wait = park(&inner, WRITE);
                        self.socket = Some(inner);
                        Step::Park(wait)
                    }
                    Err(error) => Step::Done(Err(error.into())),
                },
            };
        }
        let (socket, progress) = match socket::connect_nonblocking(address) {
            Ok(started) => started,
            Err(error) => return Step::Done(Err(error.into())),
        };
        if let Err(error) = socket::set_nodelay(socket.as_fd(), true) {
            return Step::Done(Err(error.into()));
        }
        let inner = new_inner(Endpoint::Connected(socket));
        match progress {
            ConnectProgress::Connected => Step::Done(Ok(TcpConnection { inner })),
            ConnectProgress::InProgress => {
                let wait = park(&inner, WRITE);
                self.socket = Some(inner);
                Step::Park(wait)
            }
        }
    }
}

/// The accept task.
pub struct TcpAccept {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TcpAccept {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("TcpAccept").finish_non_exhaustive()
    }
}

impl Clone for TcpAccept {
    fn clone(&self) -> Self {
        TcpAccept {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl sealed::Sealed for TcpAccept {}

impl Task for TcpAccept {
    type Input = ();
    type Output = TcpConnection;

    fn start(&mut self, _input: ()) {}

    fn step(&mut self) -> Step<TcpConnection> {
        let Endpoint::Listening(listener) = &self.inner.socket else {
            unreachable!("a TcpAccept is made only from a TcpListener");
        };
        // accept4 is retried on EINTR inside net-io-sys.
        match listener.accept() {
            Ok(accepted) => Step::Done(TcpConnection::from_accepted(accepted.socket)),
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                Step::Park(park(&self.inner, READ))
            }
            Err(error) => Step::Done(Err(error.into())),
        }
    }
}

/// The send task.
pub struct TcpSend {
    inner: Arc<Inner>,
    bytes: Vec<u8>,
    sent: usize,
}

impl std::fmt::Debug for TcpSend {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("TcpSend")
            .field("length", &self.bytes.len())
            .field("sent", &self.sent)
            .finish()
    }
}

impl sealed::Sealed for TcpSend {}

impl Task for TcpSend {
    type Input = ();
    type Output = usize;

    fn start(&mut self, _input: ()) {
        self.sent = 0;
    }

    fn step(&mut self) -> Step<usize> {
        let mut moved = 0;
        while self.sent < self.bytes.len() {
            if moved >= STEP_BUDGET {
                // Let other tasks run; the socket is still writable, so park with an immediate deadline.
                return Step::Park(Wait::until(std::time::Instant::now()));
            }
            // MSG_DONTWAIT | MSG_NOSIGNAL: a closed peer is an EPIPE error here, never a SIGPIPE.
            match socket::send(self.inner.socket.as_fd(), &self.bytes[self.sent..]) {
                Ok(count) => {
                    self.sent += count;
                    moved += count;
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    return Step::Park(park(&self.inner, WRITE));
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Step::Done(Err(error.into())),
            }
        }
        Step::Done(Ok(self.sent))
    }
}

#[derive(Debug, Clone, Copy)]
enum Until {
    Any(usize),
    Exact(usize),
    Delimiter(u8, usize),
}

/// A receive task (`recv`, `recv_exact`, `recv_until`).
pub struct TcpRecv {
    inner: Arc<Inner>,
    until: Until,
    received: Vec<u8>,
}

impl std::fmt::Debug for TcpRecv {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("TcpRecv")
            .field("until", &self.until)
            .field("received", &self.received.len())
            .finish()
    }
}

impl TcpRecv {
    /// Whether the bytes so far complete the receive; splits off any excess into the pending buffer.
    fn complete(&mut self) -> Option<Result<Vec<u8>, RuntimeError>> {
        match self.until {
            Until::Any(_) if !self.received.is_empty() => {
                Some(Ok(std::mem::take(&mut self.received)))
            }
            Until::Exact(length) if self.received.len() >= length => {
                let excess = self.received.split_off(length);
                self.keep(excess);
                Some(Ok(std::mem::take(&mut self.received)))
            }
            Until::Delimiter(delimiter, limit) => {
                if let Some(position) = self.received.iter().position(|&byte| byte == delimiter) {
                    let excess = self.received.split_off(position + 1);
                    self.keep(excess);
                    return Some(Ok(std::mem::take(&mut self.received)));
                }
                if self.received.len() > limit {
                    // Leave the bytes for the next receive: TooLong loses no data.
                    let received = std::mem::take(&mut self.received);
                    self.keep(received);
                    return Some(Err(RuntimeError::TooLong));
                }
                None
            }
            _ => None,
        }
    }

    fn keep(&self, mut excess: Vec<u8>) {
        if excess.is_empty() {
            return;
        }
        let mut pending = self.inner.pending.lock().unwrap_or_else(|p| p.into_inner());
        excess.extend_from_slice(&pending);
        *pending = excess;
    }

    fn want(&self) -> usize {
        match self.until {
            Until::Any(limit) => limit,
            Until::Exact(length) => length - self.received.len().min(length),
            Until::Delimiter(_, limit) => (limit + 1)
                .saturating_sub(self.received.len())
                .clamp(1, 64 << 10),
        }
    }
}

impl sealed::Sealed for TcpRecv {}

impl Task for TcpRecv {
    type Input = ();
    type Output = Vec<u8>;

    fn start(&mut self, _input: ()) {
        self.received.clear();
    }

    fn step(&mut self) -> Step<Vec<u8>> {
        {
            let mut pending = self.inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            if !pending.is_empty() {
                let take = match self.until {
                    Until::Any(limit) => limit.min(pending.len()),
                    _ => pending.len(),
                };
                self.received.extend(pending.drain(..take));
            }
        }
        if let Some(result) = self.complete() {
            return Step::Done(result);
        }
        let mut moved = 0;
        loop {
            if moved >= STEP_BUDGET {
                return Step::Park(Wait::until(std::time::Instant::now()));
            }
            let mut buffer = vec![0u8; self.want().min(256 << 10)];
            match socket::recv_nonblocking(self.inner.socket.as_fd(), &mut buffer) {
                Ok(0) => {
                    return Step::Done(match self.until {
                        Until::Any(_) => Ok(Vec::new()),
                        _ => Err(RuntimeError::Closed),
                    });
                }
                Ok(count) => {
                    moved += count;
                    self.received.extend_from_slice(&buffer[..count]);
                    if let Some(result) = self.complete() {
                        return Step::Done(result);
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    return Step::Park(park(&self.inner, READ));
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Step::Done(Err(error.into())),
            }
        }
    }
}
