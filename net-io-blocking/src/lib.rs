//! A bounded blocking TCP server driver: accept threads, a bounded worker pool, caps, deadlines, kill and drain.
//!
//! ```text
//!                       door (open/closed)
//!   listener ──poll(listener, wake)──▶ accept thread (one per listener)
//!                                        │ accept4 up to accept_batch per wake
//!                                        │ caps: global, listener, source  ── full ──▶ RST (nothing read)
//!                                        │ Gate::admit                       ── no  ──▶ RST
//!                                        ▼
//!                        hand-over queue (bounded: queued + busy < workers, else Busy ──▶ RST)
//!                                        │
//!                                        ▼
//!   worker 0..N (one connection each) ── PROXY header ── handler(&mut TcpConnection) or Session
//!     recv under SO_RCVTIMEO, send with MSG_DONTWAIT; poll(socket, wake) only on EAGAIN
//!     deadlines by phase, minimum rate, kill slot ◀── ServerHandle::kill / drain (any thread)
//!        ▲
//!        │ wake (eventfd)
//!   completion ring (per worker) ◀── Completer::post(token, value) from offload threads
//!                                     ──▶ Session::on_wake while the session is parked
//! ```
//!
//! Sessions run on event loops by default ([`SessionDriver::EventLoop`], one loop thread per core, each with
//! its own edge-triggered epoll and timer heap; see the `evloop` module): a connection, parked or idle, holds
//! no thread, the Busy rule does not apply (the connection caps do), and a round trip under load costs a
//! `recv` and a `send` with one `epoll_wait` shared by the ready batch (a loop holding a single busy
//! connection waits for its next input in that `recv`: a solo read). [`SessionDriver::Threads`] keeps
//! the worker-per-connection design drawn above, which handlers use by default ([`HandlerDriver::Threads`]).
//!
//! Handlers can run on the event loops too ([`HandlerDriver::Coroutines`], chosen with
//! [`ServerBuilder::handler_driver`]): each runs on a stackful coroutine (an `mmap`ed stack with a guard page,
//! see `net_io_sys::coroutine`) owned by a session on a loop, and its [`TcpConnection`] suspends where a
//! worker would block: `read` until the loop has input (or a deadline, the FIN or the close), `write_all`
//! until the loop has flushed what it queued. Every guarantee the loop gives sessions holds for such a
//! handler (admission, the gate, PROXY, deadlines by phase, the minimum rate, kill, drain, panic containment,
//! one close with one reason); a connection closed while its handler waits (a kill, a drain, a slow peer)
//! resumes the handler with `Err(Closed(reason))`, and every later call fails at once, so the handler returns
//! and its destructors run. An idle handler holds its stack's touched pages (a few KiB) and no thread.
//! **The hazard: such a handler must block on nothing but its `TcpConnection`.** Any other blocking call
//! (another socket, a file, a lock, a channel, `thread::sleep`, a long computation) runs on the loop thread
//! and stalls every connection of that loop. Overflowing the coroutine's stack
//! ([`ServerBuilder::handler_stack_size`], 256 KiB by default) kills the process, as a thread's overflow does.
//!
//! A handler half closes with [`TcpConnection::shutdown_write`] and a session with
//! [`SessionContext::shutdown_write`], on every driver: FIN after every queued byte, reading on under the
//! usual deadlines until the peer's FIN (then `PeerClosed`), and a write after it fails with `SessionError`.
//!
//! Every connection closes exactly once, with one [`CloseReason`] that the session's `on_close`, the gate's
//! `closed` and the [`Event::Closed`] event all see. Only the worker that owns a connection closes its
//! socket; other threads kill through the connection's kill slot, and one of them wins.
//!
//! # Behaviour and costs
//!
//! - **Admission** happens on the accept thread before any byte is read: the global, per-listener and
//!   per-source caps, then (on worker threads only) the Busy rule (queued plus busy workers must stay below
//!   the worker count, checked before the gate is asked), then [`Gate::admit`]. Every refusal is an RST.
//!   Event loops take the admitted connection from the accept thread through the inbox of the loop that
//!   holds the fewest connections; their default connection cap is the descriptor budget (`RLIMIT_NOFILE`
//!   less 2 per worker and 32, at most [`EVENT_LOOP_CONNECTIONS_DEFAULT_MAX`]), not the worker count.
//! - **Deadlines by phase.** Between exchanges the idle timeout applies (5 s by default, short because an
//!   idle blocking connection holds a worker); once a request has started, the read timeout; while output is
//!   pending, the write timeout; a session may add an exchange deadline and park with a park deadline; a
//!   PROXY header must arrive within the handshake timeout. The minimum transfer rate judges a direction only
//!   while it waits on the peer (a request that arrives in one read or a reply that leaves in one send is
//!   never judged), counting what it moved before; the same rule on every driver (`net_io_core::TransferRates`).
//! - **Two system calls per keep-alive round trip**: a blocking `recv` under `SO_RCVTIMEO` (re-armed only
//!   when the wanted timeout moves by more than a tick) and a `send` with `MSG_DONTWAIT`; `poll` runs only
//!   when the send buffer is full. A warmed-up worker serves round trips without allocating. An event loop
//!   reads with `recv(MSG_DONTWAIT)` until a short read and sends until `EAGAIN`; with many connections one
//!   `epoll_wait` is shared by the ready batch (0.03 to 0.08 per round trip at 32 busy connections), and a
//!   loop holding a single busy connection waits for its next input in a blocking `recv` under
//!   `SO_RCVTIMEO` instead of `epoll_wait` (a solo read: 2 calls per round trip; what else the loop must do
//!   waits at most one slice, [`ServerBuilder::solo_read_slice`], rounded up by the kernel to 4 to 12 ms at
//!   `HZ=250`; a kill or a drain ends it at once). It does not allocate per round trip either. An idle
//!   event-loop connection holds no read buffer, and its output queue's memory only if that never held more
//!   than 4 KiB at once (a larger one gives its memory back when it idles; [`Output::written_total`] and the
//!   other counters carry on).
//! - **Close styles.** `PeerClosed`, `Idle`, `Drained` and `SessionClosed` close gracefully: FIN, then up to
//!   64 KiB / 2 s of unread input is read and discarded so our last reply is not destroyed by an RST. Every
//!   other reason resets (linger 0). A kill (or the drain deadline) during that linger ends it at once with
//!   an RST; the close keeps its reason and the kill returns `false`.
//! - **Drain** closes the door, stops the listening sockets listening (a connect during the drain is refused
//!   at once, not left in the backlog until the drain ends), closes idle connections at once (`Drained`),
//!   lets busy ones finish (their queued output is flushed) and kills what is left at the deadline
//!   (`DrainDeadline`).
//!   `Server::shutdown` drains the same way, except that its idle closes carry `Shutdown` (abortive like
//!   every reason outside the four graceful ones: the server is going away, and an idle connection has
//!   nothing left to flush).
//! - **Panics** in a handler (on a worker or a coroutine), a session hook or the gate close only that connection (`SessionPanicked`, or a
//!   refusal or denial for the gate); the worker (or the loop) serves on.
//! - **Injected clocks** ([`ServerBuilder::clock`]) drive every deadline; since the kernel's timeouts run on
//!   real time, waits (and event loops' `epoll_wait`) are then cut to one tick so a test that moves the
//!   clock is noticed within a tick.
//! - **Timeouts of `Duration::MAX`** (in the limits or from a session) mean "never": deadlines saturate about
//!   136 years ahead instead of overflowing.
//! - **Kill by id** costs a scan of the workers' slots on worker threads and one map lookup per loop with
//!   event loops; a drain tick or a shed visits every slot either way.
//! - **PROXY and the gate.** On a PROXY listener `Gate::admit` sees the proxy's address. Once a trusted
//!   header names the real client, the per-source cap moves to it, then [`Gate::readmit`] is asked once with
//!   the ticket and the updated [`ConnectionInfo`] (it may keep or replace the ticket, or refuse: the
//!   connection then closes with `Refused(Gate(code))` before any application byte is read; a panic refuses
//!   too), then `ProxyResolved` and `HandshakeDone` are reported. `closed` gets the current ticket once. The
//!   default `readmit` keeps the connection, so a gate that decides on addresses must override it. Same on
//!   every driver.
//! - **systemd socket activation.** [`ServerBuilder::systemd`] (or [`systemd::listeners`] with
//!   [`ServerBuilder::adopt_with`] for per-listener settings) serves on the listeners systemd passed: only if
//!   `LISTEN_PID` (and `LISTEN_PIDFDID`, when set) names this process; at most 64 (`LISTEN_FDS`), named by
//!   `LISTEN_FDNAMES`; each fd checked (open, `SO_TYPE` stream, `SO_ACCEPTCONN`, an IP address) before any is
//!   taken, each taken once, made close-on-exec, and the variables removed so children do not take them.
//!   A wrong variable or fd is a [`systemd::SystemdError`] naming it.
//! - **Listeners at run time.** [`ServerHandle::add_listener`] validates and binds a [`ListenerSpec`] as
//!   the builder does (its limits over the server's, its cap under the global one, PROXY with trusted
//!   proxies; an address in use is named) and starts its accept thread; its connections go to the same
//!   workers or loops. It stays closed, even with the server's door open, until the next
//!   [`ServerHandle::open_door`], so the caller can finish its set-up first. [`ServerHandle::remove_listener`]
//!   closes its socket at once (the port refuses, its backlog is reset), joins its accept thread and drains
//!   only its connections (idle ones close at once as `Drained`, busy ones finish, the rest are killed at the
//!   deadline as `DrainDeadline`), returning a [`DrainReport`]; every other listener and connection, the
//!   server's door and its drain state stay as they were. Ids ([`ListenerId`]) are never reused; an unknown
//!   or removed id is an error. At most [`LISTENERS_MAX`] are live at once. Each connection keeps a share of
//!   its listener's settings, so they outlive a removal; each admission and close takes its listener's
//!   member lock once (the ids a removal drains). If the listener watching the control line is removed, the
//!   next live one takes the line over; with no listener left, the line waits for the next one added.
//! - **Not here**: Unix sockets, TLS, listener hand-off, FastCGI on fd 0, adopting an inherited listener
//!   after build (adopt in the builder). An event loop's slab of connection slots grows to the
//!   most connections it held at once; once at most a quarter is in use, its free top is cut back to twice the
//!   live connections (64 slots at least).
//! - **Handlers must do IO to be killable**: a kill shuts the socket's read side and wakes the worker, so a
//!   handler stuck in pure computation is ended only when it next reads or writes; shutdown waits for it.
//!   On coroutines such a handler also holds its loop (and every connection on it) until it suspends.
//!
//! ```no_run
//! use net_io_blocking::{NetError, TcpConnection, serve};
//!
//! let server = serve("127.0.0.1:7000", |connection: &mut TcpConnection<'_>| {
//!     let mut buffer = [0u8; 4096];
//!     loop {
//!         let count = connection.read(&mut buffer)?;
//!         if count == 0 {
//!             return Ok::<(), NetError>(());
//!         }
//!         connection.write_all(&buffer[..count])?;
//!     }
//! })?;
//! println!("listening on {}", server.local_addr());
//! server.handle().wait_for_stop();
//! # Ok::<(), NetError>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]
// The README example runs as a doctest, so the crate's front page cannot drift from its API.
#![cfg_attr(doctest, doc = include_str!("../README.md"))]

// The house, from the bottom up: a module uses only modules before it on these lines (xtask's tidy test
// checks every `crate::` path against them; rustfmt sorts the declarations below, so the order lives here).
// layers: backoff caps clock codes handover systemd outbound listener link loop_shared shared
// layers: handle handshake handler_io connection coroutines runtime sessions evloop server builder
mod backoff;
mod builder;
mod caps;
mod clock;
mod codes;
mod connection;
mod coroutines;
mod evloop;
mod handle;
mod handler_io;
mod handover;
mod handshake;
mod link;
mod listener;
mod loop_shared;
mod outbound;
mod runtime;
mod server;
mod sessions;
mod shared;
pub mod systemd;

use std::net::ToSocketAddrs;

pub use builder::{
    DEFAULT_WORKER_STACK, DEFAULT_WORKERS, EVENT_LOOP_CONNECTIONS_DEFAULT_MAX, Handler, NoGate,
    NoWorkload, ServerBuilder, Sessions,
};
pub use connection::{TcpConnection, WAIT_ANY_CONNECTIONS_MAX, connect, wait_any_readable};
pub use coroutines::HandlerDriver;
pub use evloop::SessionDriver;
pub use handle::{DrainReport, ServerHandle};
pub use listener::{LISTENERS_MAX, ListenerSpec};
pub use outbound::ConnectOptions;
pub use server::Server;
pub use shared::KillHandle;

pub use net_io_core::proxy::ProxyMode;
pub use net_io_core::{
    Admission, AllowAll, CloseReason, CoalescedKind, Completer, ConnectionId, ConnectionInfo,
    ControlLine, ControlState, Direction, Event, EventSink, Gate, Input, Lane, LimitKind, Limits,
    ListenerId, MinRateRule, NetError, Origin, OsErrorClass, Output, Phase, Refusal, RefusalCause,
    Session, SessionContext, SessionFactory, Stats, Step, TimeoutKind, Verdict, WorkerId,
    WriteFacts,
};
pub use net_io_core::{ManualClock, TrustedProxies};
pub use net_io_sys::socket::Keepalive;

/// Starts a server on `address` that runs `handler` for each connection, with default limits and no
/// admission policy ([`AllowAll`]). The door is open when this returns.
pub fn serve<H>(address: impl ToSocketAddrs, handler: H) -> Result<Server, NetError>
where
    H: Fn(&mut TcpConnection<'_>) -> Result<(), NetError> + Send + Sync + 'static,
{
    ServerBuilder::new()
        .listen(address)
        .handler(handler)
        .allow_all()
        .build()
}

/// Starts a server on `address` that drives a session made by `factory` for each connection, with default
/// limits and no admission policy ([`AllowAll`]).
pub fn serve_sessions<F: SessionFactory>(
    address: impl ToSocketAddrs,
    factory: F,
) -> Result<Server, NetError> {
    ServerBuilder::new()
        .listen(address)
        .sessions(factory)
        .allow_all()
        .build()
}
