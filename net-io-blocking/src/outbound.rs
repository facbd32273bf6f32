//! Outbound sessions: a running server opens a TCP connection itself and drives a session on it with the
//! same guarantees as an accepted one.
//!
//! ```text
//!   ServerHandle::connect(addr, session, options)
//!     │ type check, caps (the global cap), socket(SOCK_NONBLOCK) + connect(2) → EINPROGRESS
//!     ▼
//!   Job { outbound: Some(Outbound { session, deadline }) } ──inbox / hand-over──▶ loop or worker
//!     loop:   registered at once; EPOLLOUT ends the handshake → SO_ERROR → blocking again → on_open
//!     worker: poll(socket writable, wake) until the deadline → SO_ERROR → on_open
//!     either: a refusal, the connect deadline (ConnectTimeout), a kill or a drain deadline
//!             closes it with its one reason, which on_close sees exactly once
//! ```
//!
//! From the handshake on, an outbound connection is an ordinary one: the same phases and deadlines, park
//! and the completion ring, kill by id, drain, stats and events. What differs: no listener (its
//! [`ConnectionInfo::listener`](net_io_core::ConnectionInfo) is [`ListenerId::OUTBOUND`] and its origin
//! `Connected`), no gate (the gate admits peers that come to us; a connection we open has no ticket and
//! its writes are not checked), no PROXY header, and its `TCP_NODELAY` is set here rather than inherited
//! from a listener.

use std::any::Any;
use std::time::{Duration, Instant};

use net_io_core::CloseReason;

/// How [`ServerHandle::connect`](crate::ServerHandle::connect) opens a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// How long the TCP handshake may take; past it the connection closes as
    /// [`CloseReason::ConnectTimeout`]. 5 s by default.
    pub connect_timeout: Duration,
    /// `TCP_NODELAY` on the new socket (on by default, as on the server's listeners).
    pub nodelay: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            connect_timeout: CONNECT_TIMEOUT_DEFAULT,
            nodelay: true,
        }
    }
}

impl ConnectOptions {
    /// The defaults: a 5 s connect deadline and `TCP_NODELAY`.
    pub fn new() -> ConnectOptions {
        ConnectOptions::default()
    }

    /// Sets the connect deadline.
    pub fn connect_timeout(mut self, timeout: Duration) -> ConnectOptions {
        self.connect_timeout = timeout;
        self
    }

    /// Sets `TCP_NODELAY`.
    pub fn nodelay(mut self, nodelay: bool) -> ConnectOptions {
        self.nodelay = nodelay;
        self
    }
}

/// The connect deadline by default.
const CONNECT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);

/// What a job carries when the server opened the connection itself.
pub(crate) struct Outbound {
    /// The session, of the workload's session type (checked before the job was made).
    pub(crate) session: Box<dyn Any + Send>,
    /// When the handshake must be done.
    pub(crate) deadline: Instant,
    pub(crate) nodelay: bool,
    /// The connect failed at once (`connect(2)` said so): the connection closes with this reason as soon
    /// as a loop or worker takes it, so the session's `on_close` still sees it, once.
    pub(crate) failed: Option<CloseReason>,
    /// When the connect started, for [`Event::Connected`](net_io_core::Event::Connected)'s `took`.
    pub(crate) started: Instant,
}
