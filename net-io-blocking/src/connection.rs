//! [`TcpConnection`]: the blocking handler's view of one connection, and the client made by [`connect`].
//!
//! Reads wait under the idle deadline between exchanges and under the read deadline once bytes of a request
//! have arrived; writes wait under the write deadline. The first deadline, kill, reset or gate denial becomes
//! the connection's close reason and every later call reports it.
//!
//! A connection served by [`HandlerDriver::Coroutines`](crate::HandlerDriver::Coroutines) does not wait
//! itself: its calls suspend the handler's coroutine and the event loop does the waiting (see the
//! `coroutines` module); the deadlines and reasons are the same.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use net_io_core::{
    CloseReason, ConnectionId, ConnectionInfo, Direction, LimitKind, Limits, ListenerId, NetError,
    Output, ResolvedLimits, Step, TimeoutKind, Verdict, phase_wait,
};
use net_io_sys::eventfd::EventFd;
use net_io_sys::kill::{KillSlot, SlotOwner};
use net_io_sys::socket::{self, ConnectionOptions};

use crate::codes::reason_for_code;
use crate::handler_io::{Requests, Suspend, Wakeup, Yielder, take_staged};
use crate::link::{Link, Received, Sent};
use crate::shared::{Core, KillHandle};

/// Ids for client connections, counted from the top half so they never look like a server's ids.
static CLIENT_IDS: AtomicU64 = AtomicU64::new(1 << 63);

/// One TCP connection with deadlines, rate checks and a kill handle.
///
/// A handler gets `&mut TcpConnection` for the connection it serves; [`connect`] makes a standalone one
/// that closes gracefully when dropped. Implements [`io::Read`] and [`io::Write`] as well.
pub struct TcpConnection<'a> {
    link: Holder<'a>,
    info: ConnectionInfo,
    limits: ResolvedLimits,
    check: Option<&'a mut dyn FnMut(usize, bool) -> Verdict>,
    core: Option<&'a Core>,
    kill: KillHandle,
    prefix: &'a [u8],
    receiving: bool,
    terminal: Option<CloseReason>,
    peer_closed: bool,
    /// `shutdown_write` sent our FIN: a later write fails with `SessionError`.
    write_shut: bool,
    exchange_deadline: Option<Instant>,
    idle_timeout: Duration,
}

enum Holder<'a> {
    Served(&'a mut Link),
    Owned(Box<Link>),
    /// Served by an event loop through the handler's coroutine.
    Loop(LoopSide<'a>),
}

/// The coroutine side of a connection an event loop serves.
struct LoopSide<'a> {
    yielder: &'a Yielder,
    /// The connection's output queue while the handler runs; handed to the loop at each suspend.
    output: Option<Output>,
    /// Deadline changes for the loop, delivered with the next suspend.
    requests: Requests,
}

impl<'a> TcpConnection<'a> {
    pub(crate) fn served(
        link: &'a mut Link,
        info: ConnectionInfo,
        core: &'a Core,
        limits: &ResolvedLimits,
        check: &'a mut dyn FnMut(usize, bool) -> Verdict,
        kill: KillHandle,
        prefix: &'a [u8],
    ) -> Self {
        Self::fresh(
            Holder::Served(link),
            info,
            *limits,
            Some(check),
            Some(core),
            kill,
            prefix,
        )
    }

    /// A connection served on an event loop, inside the handler's coroutine.
    pub(crate) fn on_loop(
        yielder: &'a Yielder,
        output: Output,
        info: ConnectionInfo,
        core: &'a Core,
        kill: KillHandle,
    ) -> Self {
        let side = LoopSide {
            yielder,
            output: Some(output),
            requests: Requests::default(),
        };
        Self::fresh(
            Holder::Loop(side),
            info,
            core.limits,
            None,
            Some(core),
            kill,
            &[],
        )
    }

    /// A connection in its opening state: nothing read or written yet, no close reason, the idle timeout of
    /// `limits`. Every constructor goes through here, so a new field gets its opening value in one place.
    fn fresh(
        link: Holder<'a>,
        info: ConnectionInfo,
        limits: ResolvedLimits,
        check: Option<&'a mut dyn FnMut(usize, bool) -> Verdict>,
        core: Option<&'a Core>,
        kill: KillHandle,
        prefix: &'a [u8],
    ) -> Self {
        Self {
            link,
            info,
            limits,
            check,
            core,
            kill,
            prefix,
            receiving: false,
            terminal: None,
            peer_closed: false,
            write_shut: false,
            exchange_deadline: None,
            idle_timeout: limits.idle_timeout,
        }
    }

    /// The output queue and pending deadline changes of a loop-served connection, for the loop.
    pub(crate) fn into_loop_parts(mut self) -> (Option<Output>, Requests) {
        match &mut self.link {
            Holder::Loop(side) => (side.output.take(), std::mem::take(&mut side.requests)),
            _ => (None, Requests::default()),
        }
    }

    fn link(&mut self) -> &mut Link {
        match &mut self.link {
            Holder::Served(link) => link,
            Holder::Owned(link) => link,
            Holder::Loop(_) => unreachable!("a loop-served connection never uses the worker link"),
        }
    }

    fn on_event_loop(&self) -> bool {
        matches!(self.link, Holder::Loop(_))
    }

    /// The connection's facts.
    pub fn info(&self) -> &ConnectionInfo {
        &self.info
    }

    /// The connection's id.
    pub fn id(&self) -> ConnectionId {
        self.info.id
    }

    /// The client's address (the real client behind a trusted PROXY header).
    pub fn peer_addr(&self) -> SocketAddr {
        self.info.client_addr()
    }

    /// A handle that ends this connection from any thread.
    pub fn kill_handle(&self) -> KillHandle {
        self.kill.clone()
    }

    /// Whether the server is draining: finish the current exchange and return.
    pub fn is_draining(&self) -> bool {
        self.core
            .is_some_and(|core| core.draining.load(Ordering::Acquire))
    }

    /// The close reason once one is fixed (a deadline, kill, reset or denial), else `None`.
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.terminal
    }

    /// Sets a deadline for the whole exchange (`ExchangeDeadline`), or clears it.
    pub fn set_exchange_deadline(&mut self, deadline: Option<Instant>) {
        self.exchange_deadline = deadline;
        if let Holder::Loop(side) = &mut self.link {
            side.requests.exchange_deadline = Some(deadline);
        }
    }

    /// Sets this connection's idle timeout (between exchanges).
    pub fn set_idle_timeout(&mut self, timeout: Duration) {
        self.idle_timeout = timeout;
        if let Holder::Loop(side) = &mut self.link {
            side.requests.idle_timeout = Some(timeout);
        }
    }

    /// Reads what has arrived, waiting under the idle or read deadline. `Ok(0)` means the peer closed.
    pub fn read(&mut self, buffer: &mut [u8]) -> Result<usize, NetError> {
        if let Some(reason) = self.terminal {
            return Err(NetError::Closed(reason));
        }
        if buffer.is_empty() {
            return Ok(0);
        }
        if self.on_event_loop() {
            return self.read_on_loop(buffer);
        }
        if !self.prefix.is_empty() {
            let count = self.prefix.len().min(buffer.len());
            buffer[..count].copy_from_slice(&self.prefix[..count]);
            self.prefix = &self.prefix[count..];
            self.receiving = true;
            return Ok(count);
        }
        if self.peer_closed {
            return Ok(0);
        }
        let idle = !self.receiving;
        if idle
            && let Some(reason) = self
                .core
                .and_then(|core| core.close_when_idle(self.info.lane))
        {
            return Err(self.fail(reason));
        }
        let now = self.link().now();
        let (deadline, deadline_kind) = phase_wait(
            idle,
            now,
            self.idle_timeout,
            self.limits.read_timeout,
            self.exchange_deadline,
        );
        if idle {
            self.link().owner().set_idle(true);
            self.link().input_idle();
        } else {
            // The request waits for more input: its rate is judged from here, counting what it brought.
            self.link().awaiting_input(now);
        }
        let received = self.link().receive(buffer, Some(deadline), now);
        if idle {
            self.link().owner().set_idle(false);
        }
        match received {
            Received::Data(count) => {
                if idle {
                    self.receiving = true;
                }
                Ok(count)
            }
            Received::Eof => {
                self.peer_closed = true;
                Ok(0)
            }
            Received::Deadline => {
                self.terminal = Some(deadline_kind.close_reason());
                Err(NetError::Timeout(deadline_kind))
            }
            Received::Slow => Err(self.fail(CloseReason::SlowPeer {
                direction: Direction::In,
            })),
            Received::Killed(code) => Err(self.fail(reason_for_code(code))),
            Received::Failed(error) => {
                self.terminal = Some(CloseReason::from_io(&error));
                Err(NetError::from(error))
            }
        }
    }

    /// What the peer sent that the kernel still holds, read without waiting, whatever became of the connection.
    ///
    /// After a write failed because the peer closed or reset the connection, `read` reports that failure;
    /// the peer's last words (an error message it sent just before it closed) may still be waiting, and this
    /// reads them. `Ok(0)`: nothing is waiting (or the peer's FIN is next). A connection on an event loop (a
    /// coroutine handler's) reads nothing here.
    pub fn read_left(&mut self, buffer: &mut [u8]) -> Result<usize, NetError> {
        if buffer.is_empty() || self.on_event_loop() {
            return Ok(0);
        }
        if !self.prefix.is_empty() {
            let count = self.prefix.len().min(buffer.len());
            buffer[..count].copy_from_slice(&self.prefix[..count]);
            self.prefix = &self.prefix[count..];
            return Ok(count);
        }
        let Some(socket) = self.link().owner().socket() else {
            return Ok(0);
        };
        match socket::recv_nonblocking(socket, buffer) {
            Ok(count) => Ok(count),
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
            Err(error) => Err(NetError::from(error)),
        }
    }

    /// Writes all of `bytes` under the write deadline; the gate checks the write first.
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<(), NetError> {
        if let Some(reason) = self.terminal {
            return Err(NetError::Closed(reason));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        if self.write_shut {
            // Our FIN went out: the bytes could never arrive, so the handler hears of it (as a session that
            // queues after its half close does) instead of a broken pipe blamed on the peer.
            return Err(self.fail(CloseReason::SessionError));
        }
        if self.on_event_loop() {
            return self.write_on_loop(bytes);
        }
        if let Some(check) = self.check.as_mut()
            && let Verdict::Deny(code) = check(bytes.len(), false)
        {
            return Err(self.fail(CloseReason::EgressDenied(code)));
        }
        let write_timeout = self.limits.write_timeout;
        let exchange = self.exchange_deadline;
        let now = self.link().now();
        // A reply ends the request: its input is no longer judged, and the send judges its own output.
        self.link().input_idle();
        let sent = self.link().send_all(bytes, write_timeout, exchange, now);
        self.receiving = false;
        let exchange_passed = exchange.is_some_and(|exchange| self.link().now() >= exchange);
        match sent {
            Sent::Done => Ok(()),
            Sent::Deadline => {
                let kind = if exchange_passed {
                    TimeoutKind::Exchange
                } else {
                    TimeoutKind::Write
                };
                self.terminal = Some(kind.close_reason());
                Err(NetError::Timeout(kind))
            }
            Sent::Slow => Err(self.fail(CloseReason::SlowPeer {
                direction: Direction::Out,
            })),
            Sent::Killed(code) => Err(self.fail(reason_for_code(code))),
            Sent::Denied(code) => Err(self.fail(CloseReason::EgressDenied(code))),
            Sent::Failed(error) => {
                self.terminal = Some(CloseReason::from_io(&error));
                Err(NetError::from(error))
            }
        }
    }

    /// Sends FIN (half close): the peer sees the end of our stream and we can still read its reply.
    ///
    /// Every byte written before goes out first; reads carry on under the idle and read deadlines until the
    /// peer's FIN (`Ok(0)`, and the close is then `PeerClosed`). A `write_all` afterwards fails with
    /// `Closed(SessionError)`, the close reason the connection then gets. Calling it again does nothing.
    /// On [`HandlerDriver::Coroutines`](crate::HandlerDriver::Coroutines) the loop sends the FIN (a session
    /// half close) and the call suspends until it went out.
    pub fn shutdown_write(&mut self) -> Result<(), NetError> {
        if let Some(reason) = self.terminal {
            return Err(NetError::Closed(reason));
        }
        if self.write_shut {
            return Ok(());
        }
        if self.on_event_loop() {
            self.shutdown_write_on_loop()?;
            self.write_shut = true;
            return Ok(());
        }
        let Some(socket) = self.link().owner().socket() else {
            return Err(NetError::Closed(CloseReason::SessionClosed));
        };
        socket::shutdown(socket, std::net::Shutdown::Write)?;
        self.write_shut = true;
        Ok(())
    }

    /// The close reason a handler's return value leads to.
    pub(crate) fn final_reason(&self, result: &Result<(), NetError>) -> CloseReason {
        if let Some(reason) = self.terminal {
            return reason;
        }
        if self.peer_closed {
            return CloseReason::PeerClosed;
        }
        match result {
            Ok(()) => CloseReason::SessionClosed,
            Err(_) => CloseReason::SessionError,
        }
    }

    fn fail(&mut self, reason: CloseReason) -> NetError {
        self.terminal = Some(reason);
        NetError::Closed(reason)
    }

    /// `read` on an event loop: suspend until the loop has input, the FIN, a deadline or the close.
    fn read_on_loop(&mut self, buffer: &mut [u8]) -> Result<usize, NetError> {
        if self.peer_closed {
            return Ok(0);
        }
        loop {
            match self.suspend(Step::Read, buffer.len())? {
                Wakeup::Data(count) => {
                    let count = take_staged(buffer, count);
                    if count > 0 {
                        self.receiving = true;
                        return Ok(count);
                    }
                }
                Wakeup::PeerClosed => {
                    self.peer_closed = true;
                    return Ok(0);
                }
                Wakeup::Timeout(kind) => {
                    self.terminal = Some(kind.close_reason());
                    return Err(NetError::Timeout(kind));
                }
                Wakeup::Closed(reason) => return Err(self.fail(reason)),
                // Nothing for a read: wait again.
                Wakeup::Start | Wakeup::Writable => {}
            }
        }
    }

    /// `write_all` on an event loop: queue what fits the output budget, suspend until the loop flushed it,
    /// repeat. The loop asks the gate before each write call and applies the write deadline and minimum rate.
    fn write_on_loop(&mut self, bytes: &[u8]) -> Result<(), NetError> {
        let mut rest = bytes;
        while !rest.is_empty() {
            let Holder::Loop(side) = &mut self.link else {
                return Err(self.fail(CloseReason::SessionError));
            };
            let Some(output) = side.output.as_mut() else {
                return Err(self.fail(CloseReason::SessionError));
            };
            let queued = output.push_partial(rest);
            if queued == 0 && output.is_empty() {
                // Nothing fits even an empty queue: the budget is too small to ever send this.
                return Err(self.fail(CloseReason::Limit(LimitKind::OutputBudget)));
            }
            rest = &rest[queued..];
            loop {
                match self.suspend(Step::Write, 0)? {
                    Wakeup::Writable => break,
                    Wakeup::Timeout(kind) => {
                        self.terminal = Some(kind.close_reason());
                        return Err(NetError::Timeout(kind));
                    }
                    Wakeup::Closed(reason) => return Err(self.fail(reason)),
                    Wakeup::Start | Wakeup::Data(_) | Wakeup::PeerClosed => {}
                }
            }
        }
        self.receiving = false;
        Ok(())
    }

    /// `shutdown_write` on an event loop: ask the loop for a session half close and suspend until its FIN
    /// went out (the loop sends it after every queued byte, then resumes with `Writable`).
    fn shutdown_write_on_loop(&mut self) -> Result<(), NetError> {
        let Holder::Loop(side) = &mut self.link else {
            return Err(self.fail(CloseReason::SessionError));
        };
        side.requests.shutdown_write = true;
        loop {
            match self.suspend(Step::Write, 0)? {
                Wakeup::Writable => return Ok(()),
                Wakeup::Timeout(kind) => {
                    self.terminal = Some(kind.close_reason());
                    return Err(NetError::Timeout(kind));
                }
                Wakeup::Closed(reason) => return Err(self.fail(reason)),
                Wakeup::Start | Wakeup::Data(_) | Wakeup::PeerClosed => {}
            }
        }
    }

    /// Hands the output queue to the loop with `step` and waits for the loop to resume the handler.
    ///
    /// During an unwind (a panic, or the forced unwind of a dropped coroutine) it does not suspend: a
    /// destructor that reads or writes gets the close reason instead.
    fn suspend(&mut self, step: Step, want: usize) -> Result<Wakeup, NetError> {
        if std::thread::panicking() {
            let reason = self.terminal.unwrap_or(CloseReason::SessionError);
            return Err(self.fail(reason));
        }
        let Holder::Loop(side) = &mut self.link else {
            return Err(self.fail(CloseReason::SessionError));
        };
        let output = side.output.take().unwrap_or_else(|| Output::new(0));
        let requests = std::mem::take(&mut side.requests);
        let resumed = side.yielder.suspend(Suspend {
            step,
            want,
            output,
            requests,
        });
        side.output = Some(resumed.output);
        Ok(resumed.wakeup)
    }
}

impl TcpConnection<'static> {
    /// Closes a standalone connection now: FIN and a short linger, or RST if it already failed.
    pub fn close(mut self) -> CloseReason {
        self.close_owned()
    }

    fn close_owned(&mut self) -> CloseReason {
        let reason = self.final_reason(&Ok(()));
        let Holder::Owned(link) = &mut self.link else {
            return reason;
        };
        if link.owner().socket().is_none() {
            return reason;
        }
        link.close_as(
            self.info.id.get(),
            reason,
            self.limits.linger_timeout,
            self.limits.linger_bytes,
        )
    }
}

/// Connects to `address` within the handshake timeout of `limits` and returns a connection that applies
/// the same deadlines, rate checks and kill handle as a served one.
pub fn connect(address: SocketAddr, limits: &Limits) -> Result<TcpConnection<'static>, NetError> {
    let resolved = limits.resolve(1);
    let socket = socket::connect(address, Some(resolved.handshake_timeout)).map_err(|error| {
        if error.kind() == io::ErrorKind::TimedOut || error.kind() == io::ErrorKind::WouldBlock {
            NetError::Timeout(TimeoutKind::Connect)
        } else {
            NetError::from(error)
        }
    })?;
    socket::apply_connection_options(
        std::os::fd::AsFd::as_fd(&socket),
        &ConnectionOptions {
            nodelay: true,
            ..ConnectionOptions::default()
        },
    )?;
    let local = socket::local_addr(std::os::fd::AsFd::as_fd(&socket))?;
    let raw_id = CLIENT_IDS.fetch_add(1, Ordering::Relaxed);
    let id = ConnectionId::new(raw_id).ok_or(NetError::ServerStopped)?;
    let slot = Arc::new(KillSlot::new());
    let wake = Arc::new(EventFd::new()?);
    let linger = Arc::new(AtomicU64::new(0));
    let mut owner = SlotOwner::claim(Arc::clone(&slot)).ok_or(NetError::ServerStopped)?;
    owner.occupy(raw_id, socket);
    let link = Link::new(
        owner,
        Arc::clone(&wake),
        Arc::clone(&linger),
        crate::clock::system(),
        resolved.tick,
        resolved.min_rate,
        false,
    );
    let info = ConnectionInfo::new(id, ListenerId(u32::MAX), local, address, Instant::now());
    let kill = KillHandle {
        slot,
        wake,
        linger,
        id,
    };
    Ok(TcpConnection::fresh(
        Holder::Owned(Box::new(link)),
        info,
        resolved,
        None,
        None,
        kill,
        &[],
    ))
}

/// Most connections one [`wait_any_readable`] watches.
pub const WAIT_ANY_CONNECTIONS_MAX: usize = net_io_sys::wait::WAIT_ANY_MAX / 2;

/// Waits until one of `connections` has something for [`TcpConnection::read`] (input, its end, a failure, a
/// kill, or a close reason already fixed), or `timeout` passes (`None`: no limit); returns the index of the
/// first such connection, `None` at the timeout. Reads nothing: the caller reads the one named, which then
/// does not wait.
///
/// For one thread that serves several connections in turn (stage 0 of a pipeline reads answers on its link
/// down the chain and tokens on the link they come back on). The connections' own idle and read deadlines do
/// not run here; `timeout` is the caller's. Connections served on an event loop cannot be waited on this way
/// (their coroutine does not own the socket): that, or more than [`WAIT_ANY_CONNECTIONS_MAX`] connections,
/// is an `InvalidInput` error.
pub fn wait_any_readable(
    connections: &[&TcpConnection<'_>],
    timeout: Option<Duration>,
) -> Result<Option<usize>, NetError> {
    if connections.len() > WAIT_ANY_CONNECTIONS_MAX {
        return Err(NetError::from(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a wait watches at most {WAIT_ANY_CONNECTIONS_MAX} connections, not {}",
                connections.len()
            ),
        )));
    }
    let mut descriptors = Vec::with_capacity(connections.len() * 2);
    for (index, connection) in connections.iter().enumerate() {
        // Whatever a read would report without waiting is ready now.
        if connection.terminal.is_some() || connection.peer_closed || !connection.prefix.is_empty()
        {
            return Ok(Some(index));
        }
        let link: &Link = match &connection.link {
            Holder::Served(link) => link,
            Holder::Owned(link) => link,
            Holder::Loop(_) => {
                return Err(NetError::from(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a connection served on an event loop cannot be waited on with wait_any_readable",
                )));
            }
        };
        if link.owner().closing().is_some() {
            return Ok(Some(index));
        }
        let Ok(socket) = link.socket() else {
            return Ok(Some(index));
        };
        // The socket, then the wake a kill signals: a read of either's connection reports what happened.
        descriptors.push(socket);
        descriptors.push(link.wake_fd());
    }
    let ready = net_io_sys::wait::wait_any_readable(&descriptors, timeout)?;
    Ok(ready.map(|descriptor| descriptor / 2))
}

impl Drop for TcpConnection<'_> {
    fn drop(&mut self) {
        if let Holder::Owned(link) = &mut self.link
            && link.owner().socket().is_some()
        {
            let reason = self.terminal.unwrap_or(CloseReason::SessionClosed);
            link.close_as(
                self.info.id.get(),
                reason,
                self.limits.linger_timeout,
                self.limits.linger_bytes,
            );
        }
    }
}

impl io::Read for TcpConnection<'_> {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        TcpConnection::read(self, buffer).map_err(io::Error::from)
    }
}

impl io::Write for TcpConnection<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.write_all(bytes).map_err(io::Error::from)?;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl std::fmt::Debug for TcpConnection<'_> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("TcpConnection")
            .field("info", &self.info)
            .field("receiving", &self.receiving)
            .field("terminal", &self.terminal)
            .field("peer_closed", &self.peer_closed)
            .finish_non_exhaustive()
    }
}
