//! The close vocabulary: why a connection ended, why one was refused, which limit or deadline was hit.
//!
//! Every connection ends with exactly one [`CloseReason`]. The same value reaches `Session::on_close`,
//! `Gate::closed` and the `Closed` event, and its [`CloseReason::as_str`] name is stable so that logs,
//! metrics and tests can match on it.

use std::fmt;

/// A direction of transfer on a connection, seen from the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Bytes from the peer to us.
    In,
    /// Bytes from us to the peer.
    Out,
}

impl Direction {
    /// A stable lower-case name: `in` or `out`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Direction::In => "in",
            Direction::Out => "out",
        }
    }
}

/// Why a connection was refused before any application byte was read from it (at accept, or by
/// [`Gate::readmit`](crate::Gate::readmit) once a trusted PROXY header named the real client).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RefusalCause {
    /// The server-wide `max_connections` cap was reached.
    GlobalCap,
    /// The listener's `max_per_listener` cap was reached.
    ListenerCap,
    /// The source prefix's `max_per_source` cap was reached on this listener.
    SourceCap,
    /// The gate refused the connection with this code.
    Gate(u16),
    /// The session factory declined to create a session.
    Session,
    /// Every worker was busy and the hand-over queue was full.
    Busy,
    /// The door was closed (the server is draining or has not opened yet).
    DoorClosed,
    /// The control line is shedding this connection's lane.
    Shed,
    /// The control line is in lockdown and refuses every new connection.
    Lockdown,
}

impl RefusalCause {
    /// Number of distinct causes, for per-cause counter arrays.
    pub const COUNT: usize = 9;

    /// Every cause once, in [`RefusalCause::index`] order (the gate code is zero).
    pub const ALL: [RefusalCause; Self::COUNT] = [
        RefusalCause::GlobalCap,
        RefusalCause::ListenerCap,
        RefusalCause::SourceCap,
        RefusalCause::Gate(0),
        RefusalCause::Session,
        RefusalCause::Busy,
        RefusalCause::DoorClosed,
        RefusalCause::Shed,
        RefusalCause::Lockdown,
    ];

    /// A stable snake_case name that ignores any code.
    pub const fn as_str(self) -> &'static str {
        match self {
            RefusalCause::GlobalCap => "global_cap",
            RefusalCause::ListenerCap => "listener_cap",
            RefusalCause::SourceCap => "source_cap",
            RefusalCause::Gate(_) => "gate",
            RefusalCause::Session => "session",
            RefusalCause::Busy => "busy",
            RefusalCause::DoorClosed => "door_closed",
            RefusalCause::Shed => "shed",
            RefusalCause::Lockdown => "lockdown",
        }
    }

    /// A dense index in `0..COUNT`, the same for every code of `Gate`.
    pub const fn index(self) -> usize {
        match self {
            RefusalCause::GlobalCap => 0,
            RefusalCause::ListenerCap => 1,
            RefusalCause::SourceCap => 2,
            RefusalCause::Gate(_) => 3,
            RefusalCause::Session => 4,
            RefusalCause::Busy => 5,
            RefusalCause::DoorClosed => 6,
            RefusalCause::Shed => 7,
            RefusalCause::Lockdown => 8,
        }
    }
}

/// A resource limit that a connection or the server ran into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LimitKind {
    /// The server-wide connection cap.
    Connections,
    /// A listener's connection cap.
    PerListener,
    /// A source prefix's connection cap.
    PerSource,
    /// The global buffer budget had no room for another buffer.
    BufferBudget,
    /// A connection's output budget was full.
    OutputBudget,
    /// The completion ring of a worker was full.
    CompletionQueue,
    /// A PROXY header was longer than `proxy_header_max`.
    ProxyHeader,
    /// An accept batch ended because it reached `accept_batch`.
    AcceptBatch,
    /// The read buffer was full at its largest size and the session consumed nothing.
    ReadBuffer,
    /// The process ran out of file descriptors.
    Descriptors,
    /// The kernel would not map another handler stack for a coroutine handler (`ENOMEM`: usually
    /// `vm.max_map_count`, two mappings a stack; else memory or `RLIMIT_AS`).
    HandlerStack,
}

impl LimitKind {
    /// Every limit once.
    pub const ALL: [LimitKind; 11] = [
        LimitKind::Connections,
        LimitKind::PerListener,
        LimitKind::PerSource,
        LimitKind::BufferBudget,
        LimitKind::OutputBudget,
        LimitKind::CompletionQueue,
        LimitKind::ProxyHeader,
        LimitKind::AcceptBatch,
        LimitKind::ReadBuffer,
        LimitKind::Descriptors,
        LimitKind::HandlerStack,
    ];

    /// A stable snake_case name.
    pub const fn as_str(self) -> &'static str {
        match self {
            LimitKind::Connections => "connections",
            LimitKind::PerListener => "per_listener",
            LimitKind::PerSource => "per_source",
            LimitKind::BufferBudget => "buffer_budget",
            LimitKind::OutputBudget => "output_budget",
            LimitKind::CompletionQueue => "completion_queue",
            LimitKind::ProxyHeader => "proxy_header",
            LimitKind::AcceptBatch => "accept_batch",
            LimitKind::ReadBuffer => "read_buffer",
            LimitKind::Descriptors => "descriptors",
            LimitKind::HandlerStack => "handler_stack",
        }
    }
}

/// Which deadline fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TimeoutKind {
    /// The handshake (PROXY header, admission) took too long.
    Handshake,
    /// No request started within the idle timeout.
    Idle,
    /// A request stalled mid-way for longer than the read timeout.
    Read,
    /// The peer did not take our output within the write timeout.
    Write,
    /// The deadline a session set for the whole exchange passed.
    Exchange,
    /// A parked session was not woken before its park deadline.
    Park,
    /// An outgoing connect did not complete in time.
    Connect,
    /// A drain did not finish before its deadline.
    Drain,
}

impl TimeoutKind {
    /// Every deadline once.
    pub const ALL: [TimeoutKind; 8] = [
        TimeoutKind::Handshake,
        TimeoutKind::Idle,
        TimeoutKind::Read,
        TimeoutKind::Write,
        TimeoutKind::Exchange,
        TimeoutKind::Park,
        TimeoutKind::Connect,
        TimeoutKind::Drain,
    ];

    /// A stable snake_case name.
    pub const fn as_str(self) -> &'static str {
        match self {
            TimeoutKind::Handshake => "handshake",
            TimeoutKind::Idle => "idle",
            TimeoutKind::Read => "read",
            TimeoutKind::Write => "write",
            TimeoutKind::Exchange => "exchange",
            TimeoutKind::Park => "park",
            TimeoutKind::Connect => "connect",
            TimeoutKind::Drain => "drain",
        }
    }

    /// The close reason a connection gets when this deadline fires and the session does not override it.
    pub const fn close_reason(self) -> CloseReason {
        match self {
            TimeoutKind::Handshake => CloseReason::HandshakeTimeout,
            TimeoutKind::Idle => CloseReason::Idle,
            TimeoutKind::Read => CloseReason::ReadTimeout,
            TimeoutKind::Write => CloseReason::WriteTimeout,
            TimeoutKind::Exchange => CloseReason::ExchangeDeadline,
            TimeoutKind::Park => CloseReason::ParkDeadline,
            TimeoutKind::Connect => CloseReason::ConnectTimeout,
            TimeoutKind::Drain => CloseReason::DrainDeadline,
        }
    }
}

/// A coarse class of an operating-system error, small enough to travel in a [`CloseReason`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OsErrorClass {
    /// `EAGAIN`/`EWOULDBLOCK`: try again when ready.
    WouldBlock,
    /// `EINTR`: a signal interrupted the call.
    Interrupted,
    /// `ECONNRESET`: the peer reset the connection.
    ConnectionReset,
    /// `ECONNABORTED`: the connection was aborted before or during accept.
    ConnectionAborted,
    /// `EPIPE`: the peer is gone and the write side is closed.
    BrokenPipe,
    /// `ETIMEDOUT`: the kernel gave up (for example keepalive), not one of our deadlines.
    TimedOut,
    /// `ENOTCONN`: the socket is not connected.
    NotConnected,
    /// `ECONNREFUSED`: nobody listens at the other end.
    ConnectionRefused,
    /// `ENETUNREACH`/`ENETDOWN`.
    NetworkUnreachable,
    /// `EHOSTUNREACH`/`EHOSTDOWN`.
    HostUnreachable,
    /// `EMFILE`/`ENFILE`: out of file descriptors.
    DescriptorsExhausted,
    /// `ENOBUFS`/`ENOMEM`: the kernel is short of memory.
    NoBuffers,
    /// `EADDRINUSE`.
    AddressInUse,
    /// `EADDRNOTAVAIL`.
    AddressNotAvailable,
    /// `EACCES`/`EPERM`.
    PermissionDenied,
    /// `EBADF`/`EINVAL`/`ENOTSOCK`: the descriptor is unusable.
    InvalidDescriptor,
    /// Any other error.
    Other,
}

impl OsErrorClass {
    /// Every class once.
    pub const ALL: [OsErrorClass; 17] = [
        OsErrorClass::WouldBlock,
        OsErrorClass::Interrupted,
        OsErrorClass::ConnectionReset,
        OsErrorClass::ConnectionAborted,
        OsErrorClass::BrokenPipe,
        OsErrorClass::TimedOut,
        OsErrorClass::NotConnected,
        OsErrorClass::ConnectionRefused,
        OsErrorClass::NetworkUnreachable,
        OsErrorClass::HostUnreachable,
        OsErrorClass::DescriptorsExhausted,
        OsErrorClass::NoBuffers,
        OsErrorClass::AddressInUse,
        OsErrorClass::AddressNotAvailable,
        OsErrorClass::PermissionDenied,
        OsErrorClass::InvalidDescriptor,
        OsErrorClass::Other,
    ];

    /// Classifies an [`std::io::Error`] by its OS code when it has one, else by its kind.
    pub fn of(error: &std::io::Error) -> OsErrorClass {
        if let Some(code) = error.raw_os_error() {
            return OsErrorClass::from_errno(code);
        }
        use std::io::ErrorKind;
        match error.kind() {
            ErrorKind::WouldBlock => OsErrorClass::WouldBlock,
            ErrorKind::Interrupted => OsErrorClass::Interrupted,
            ErrorKind::ConnectionReset => OsErrorClass::ConnectionReset,
            ErrorKind::ConnectionAborted => OsErrorClass::ConnectionAborted,
            ErrorKind::BrokenPipe => OsErrorClass::BrokenPipe,
            ErrorKind::TimedOut => OsErrorClass::TimedOut,
            ErrorKind::NotConnected => OsErrorClass::NotConnected,
            ErrorKind::ConnectionRefused => OsErrorClass::ConnectionRefused,
            ErrorKind::NetworkUnreachable | ErrorKind::NetworkDown => {
                OsErrorClass::NetworkUnreachable
            }
            ErrorKind::HostUnreachable => OsErrorClass::HostUnreachable,
            ErrorKind::OutOfMemory => OsErrorClass::NoBuffers,
            ErrorKind::AddrInUse => OsErrorClass::AddressInUse,
            ErrorKind::AddrNotAvailable => OsErrorClass::AddressNotAvailable,
            ErrorKind::PermissionDenied => OsErrorClass::PermissionDenied,
            _ => OsErrorClass::Other,
        }
    }

    /// Classifies a raw `errno` value.
    pub fn from_errno(code: i32) -> OsErrorClass {
        match code {
            libc::EAGAIN => OsErrorClass::WouldBlock,
            libc::EINTR => OsErrorClass::Interrupted,
            libc::ECONNRESET => OsErrorClass::ConnectionReset,
            libc::ECONNABORTED => OsErrorClass::ConnectionAborted,
            libc::EPIPE => OsErrorClass::BrokenPipe,
            libc::ETIMEDOUT => OsErrorClass::TimedOut,
            libc::ENOTCONN => OsErrorClass::NotConnected,
            libc::ECONNREFUSED => OsErrorClass::ConnectionRefused,
            libc::ENETUNREACH | libc::ENETDOWN => OsErrorClass::NetworkUnreachable,
            libc::EHOSTUNREACH | libc::EHOSTDOWN => OsErrorClass::HostUnreachable,
            libc::EMFILE | libc::ENFILE => OsErrorClass::DescriptorsExhausted,
            libc::ENOBUFS | libc::ENOMEM => OsErrorClass::NoBuffers,
            libc::EADDRINUSE => OsErrorClass::AddressInUse,
            libc::EADDRNOTAVAIL => OsErrorClass::AddressNotAvailable,
            libc::EACCES | libc::EPERM => OsErrorClass::PermissionDenied,
            libc::EBADF | libc::EINVAL | libc::ENOTSOCK => OsErrorClass::InvalidDescriptor,
            _ => OsErrorClass::Other,
        }
    }

    /// A stable snake_case name.
    pub const fn as_str(self) -> &'static str {
        match self {
            OsErrorClass::WouldBlock => "would_block",
            OsErrorClass::Interrupted => "interrupted",
            OsErrorClass::ConnectionReset => "connection_reset",
            OsErrorClass::ConnectionAborted => "connection_aborted",
            OsErrorClass::BrokenPipe => "broken_pipe",
            OsErrorClass::TimedOut => "timed_out",
            OsErrorClass::NotConnected => "not_connected",
            OsErrorClass::ConnectionRefused => "connection_refused",
            OsErrorClass::NetworkUnreachable => "network_unreachable",
            OsErrorClass::HostUnreachable => "host_unreachable",
            OsErrorClass::DescriptorsExhausted => "descriptors_exhausted",
            OsErrorClass::NoBuffers => "no_buffers",
            OsErrorClass::AddressInUse => "address_in_use",
            OsErrorClass::AddressNotAvailable => "address_not_available",
            OsErrorClass::PermissionDenied => "permission_denied",
            OsErrorClass::InvalidDescriptor => "invalid_descriptor",
            OsErrorClass::Other => "other",
        }
    }

    /// The [`std::io::ErrorKind`] closest to this class.
    pub fn io_kind(self) -> std::io::ErrorKind {
        use std::io::ErrorKind;
        match self {
            OsErrorClass::WouldBlock => ErrorKind::WouldBlock,
            OsErrorClass::Interrupted => ErrorKind::Interrupted,
            OsErrorClass::ConnectionReset => ErrorKind::ConnectionReset,
            OsErrorClass::ConnectionAborted => ErrorKind::ConnectionAborted,
            OsErrorClass::BrokenPipe => ErrorKind::BrokenPipe,
            OsErrorClass::TimedOut => ErrorKind::TimedOut,
            OsErrorClass::NotConnected => ErrorKind::NotConnected,
            OsErrorClass::ConnectionRefused => ErrorKind::ConnectionRefused,
            OsErrorClass::NetworkUnreachable => ErrorKind::NetworkUnreachable,
            OsErrorClass::HostUnreachable => ErrorKind::HostUnreachable,
            OsErrorClass::DescriptorsExhausted | OsErrorClass::NoBuffers => ErrorKind::OutOfMemory,
            OsErrorClass::AddressInUse => ErrorKind::AddrInUse,
            OsErrorClass::AddressNotAvailable => ErrorKind::AddrNotAvailable,
            OsErrorClass::PermissionDenied => ErrorKind::PermissionDenied,
            OsErrorClass::InvalidDescriptor => ErrorKind::InvalidInput,
            OsErrorClass::Other => ErrorKind::Other,
        }
    }
}

impl fmt::Display for OsErrorClass {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

/// Why a connection ended. Exactly one per connection.
///
/// Graceful reasons ([`CloseReason::is_abortive`] false) close with FIN and a short linger; every other
/// reason closes abortively with RST (linger 0), because the connection is in an unknown or hostile state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CloseReason {
    /// The peer sent FIN while the connection was idle.
    PeerClosed,
    /// The peer reset the connection.
    PeerReset,
    /// No request started within the idle timeout.
    Idle,
    /// The handshake did not complete in time.
    HandshakeTimeout,
    /// A request stalled for longer than the read timeout.
    ReadTimeout,
    /// The peer did not take our output within the write timeout.
    WriteTimeout,
    /// The session's exchange deadline passed.
    ExchangeDeadline,
    /// A parked session was not woken in time.
    ParkDeadline,
    /// The peer moved bytes slower than the minimum rate in this direction.
    SlowPeer {
        /// The direction that was too slow.
        direction: Direction,
    },
    /// The connection was refused before any application byte was read (at accept, or at readmit after a
    /// PROXY header).
    Refused(RefusalCause),
    /// The peer sent a PROXY header but is not in the trusted set.
    ProxyUntrusted,
    /// The listener requires a PROXY header and none came.
    ProxyMissing,
    /// The PROXY header was malformed or too long.
    ProxyInvalid,
    /// Killed from another thread, with the killer's code.
    Killed(u16),
    /// The gate denied a write, with the gate's code.
    EgressDenied(u16),
    /// Closed while idle because the server is draining.
    Drained,
    /// Still busy when the drain deadline passed.
    DrainDeadline,
    /// Closed because the control line shed its lane.
    Shed,
    /// Closed because the server shut down.
    Shutdown,
    /// The session returned `Step::Close`.
    SessionClosed,
    /// The session returned `Step::Abort`.
    SessionError,
    /// The session panicked; only its connection was closed.
    SessionPanicked,
    /// A resource limit was hit.
    Limit(LimitKind),
    /// An operating-system error ended the connection (a refused outbound connect is
    /// `Io(ConnectionRefused)`).
    Io(OsErrorClass),
    /// An outbound connection (`ServerHandle::connect`) did not finish its TCP handshake before its
    /// connect deadline.
    ConnectTimeout,
}

impl CloseReason {
    /// Number of distinct reasons ignoring their payload, for per-reason counter arrays.
    pub const COUNT: usize = 25;

    /// One representative of every reason, in [`CloseReason::index`] order.
    pub const ALL: [CloseReason; Self::COUNT] = [
        CloseReason::PeerClosed,
        CloseReason::PeerReset,
        CloseReason::Idle,
        CloseReason::HandshakeTimeout,
        CloseReason::ReadTimeout,
        CloseReason::WriteTimeout,
        CloseReason::ExchangeDeadline,
        CloseReason::ParkDeadline,
        CloseReason::SlowPeer {
            direction: Direction::In,
        },
        CloseReason::Refused(RefusalCause::Busy),
        CloseReason::ProxyUntrusted,
        CloseReason::ProxyMissing,
        CloseReason::ProxyInvalid,
        CloseReason::Killed(0),
        CloseReason::EgressDenied(0),
        CloseReason::Drained,
        CloseReason::DrainDeadline,
        CloseReason::Shed,
        CloseReason::Shutdown,
        CloseReason::SessionClosed,
        CloseReason::SessionError,
        CloseReason::SessionPanicked,
        CloseReason::Limit(LimitKind::ReadBuffer),
        CloseReason::Io(OsErrorClass::Other),
        CloseReason::ConnectTimeout,
    ];

    /// True when the connection closes with RST; false for the graceful reasons
    /// (`PeerClosed`, `Idle`, `Drained`, `SessionClosed`), which close with FIN and a linger.
    pub const fn is_abortive(self) -> bool {
        !matches!(
            self,
            CloseReason::PeerClosed
                | CloseReason::Idle
                | CloseReason::Drained
                | CloseReason::SessionClosed
        )
    }

    /// True for reasons caused by one of our deadlines (including the minimum rate).
    pub const fn is_timeout(self) -> bool {
        matches!(
            self,
            CloseReason::Idle
                | CloseReason::HandshakeTimeout
                | CloseReason::ReadTimeout
                | CloseReason::WriteTimeout
                | CloseReason::ExchangeDeadline
                | CloseReason::ParkDeadline
                | CloseReason::DrainDeadline
                | CloseReason::ConnectTimeout
        )
    }

    /// A stable snake_case name. Payloads are spelled out for the small enums
    /// (`slow_peer_in`, `refused_busy`, `limit_read_buffer`, `io_connection_reset`) and left out for codes.
    pub const fn as_str(self) -> &'static str {
        match self {
            CloseReason::PeerClosed => "peer_closed",
            CloseReason::PeerReset => "peer_reset",
            CloseReason::Idle => "idle",
            CloseReason::HandshakeTimeout => "handshake_timeout",
            CloseReason::ReadTimeout => "read_timeout",
            CloseReason::WriteTimeout => "write_timeout",
            CloseReason::ExchangeDeadline => "exchange_deadline",
            CloseReason::ParkDeadline => "park_deadline",
            CloseReason::SlowPeer {
                direction: Direction::In,
            } => "slow_peer_in",
            CloseReason::SlowPeer {
                direction: Direction::Out,
            } => "slow_peer_out",
            CloseReason::Refused(cause) => match cause {
                RefusalCause::GlobalCap => "refused_global_cap",
                RefusalCause::ListenerCap => "refused_listener_cap",
                RefusalCause::SourceCap => "refused_source_cap",
                RefusalCause::Gate(_) => "refused_gate",
                RefusalCause::Session => "refused_session",
                RefusalCause::Busy => "refused_busy",
                RefusalCause::DoorClosed => "refused_door_closed",
                RefusalCause::Shed => "refused_shed",
                RefusalCause::Lockdown => "refused_lockdown",
            },
            CloseReason::ProxyUntrusted => "proxy_untrusted",
            CloseReason::ProxyMissing => "proxy_missing",
            CloseReason::ProxyInvalid => "proxy_invalid",
            CloseReason::Killed(_) => "killed",
            CloseReason::EgressDenied(_) => "egress_denied",
            CloseReason::Drained => "drained",
            CloseReason::DrainDeadline => "drain_deadline",
            CloseReason::Shed => "shed",
            CloseReason::Shutdown => "shutdown",
            CloseReason::SessionClosed => "session_closed",
            CloseReason::SessionError => "session_error",
            CloseReason::SessionPanicked => "session_panicked",
            CloseReason::Limit(kind) => match kind {
                LimitKind::Connections => "limit_connections",
                LimitKind::PerListener => "limit_per_listener",
                LimitKind::PerSource => "limit_per_source",
                LimitKind::BufferBudget => "limit_buffer_budget",
                LimitKind::OutputBudget => "limit_output_budget",
                LimitKind::CompletionQueue => "limit_completion_queue",
                LimitKind::ProxyHeader => "limit_proxy_header",
                LimitKind::AcceptBatch => "limit_accept_batch",
                LimitKind::ReadBuffer => "limit_read_buffer",
                LimitKind::Descriptors => "limit_descriptors",
                LimitKind::HandlerStack => "limit_handler_stack",
            },
            CloseReason::Io(class) => match class {
                OsErrorClass::WouldBlock => "io_would_block",
                OsErrorClass::Interrupted => "io_interrupted",
                OsErrorClass::ConnectionReset => "io_connection_reset",
                OsErrorClass::ConnectionAborted => "io_connection_aborted",
                OsErrorClass::BrokenPipe => "io_broken_pipe",
                OsErrorClass::TimedOut => "io_timed_out",
                OsErrorClass::NotConnected => "io_not_connected",
                OsErrorClass::ConnectionRefused => "io_connection_refused",
                OsErrorClass::NetworkUnreachable => "io_network_unreachable",
                OsErrorClass::HostUnreachable => "io_host_unreachable",
                OsErrorClass::DescriptorsExhausted => "io_descriptors_exhausted",
                OsErrorClass::NoBuffers => "io_no_buffers",
                OsErrorClass::AddressInUse => "io_address_in_use",
                OsErrorClass::AddressNotAvailable => "io_address_not_available",
                OsErrorClass::PermissionDenied => "io_permission_denied",
                OsErrorClass::InvalidDescriptor => "io_invalid_descriptor",
                OsErrorClass::Other => "io_other",
            },
            CloseReason::ConnectTimeout => "connect_timeout",
        }
    }

    /// A dense index in `0..COUNT` that ignores the payload, for per-reason counters.
    pub const fn index(self) -> usize {
        match self {
            CloseReason::PeerClosed => 0,
            CloseReason::PeerReset => 1,
            CloseReason::Idle => 2,
            CloseReason::HandshakeTimeout => 3,
            CloseReason::ReadTimeout => 4,
            CloseReason::WriteTimeout => 5,
            CloseReason::ExchangeDeadline => 6,
            CloseReason::ParkDeadline => 7,
            CloseReason::SlowPeer { .. } => 8,
            CloseReason::Refused(_) => 9,
            CloseReason::ProxyUntrusted => 10,
            CloseReason::ProxyMissing => 11,
            CloseReason::ProxyInvalid => 12,
            CloseReason::Killed(_) => 13,
            CloseReason::EgressDenied(_) => 14,
            CloseReason::Drained => 15,
            CloseReason::DrainDeadline => 16,
            CloseReason::Shed => 17,
            CloseReason::Shutdown => 18,
            CloseReason::SessionClosed => 19,
            CloseReason::SessionError => 20,
            CloseReason::SessionPanicked => 21,
            CloseReason::Limit(_) => 22,
            CloseReason::Io(_) => 23,
            CloseReason::ConnectTimeout => 24,
        }
    }

    /// The reason an operating-system error on an established connection closes it with:
    /// `ECONNRESET` and `EPIPE` are [`CloseReason::PeerReset`], anything else is [`CloseReason::Io`].
    pub fn from_io(error: &std::io::Error) -> CloseReason {
        match OsErrorClass::of(error) {
            OsErrorClass::ConnectionReset | OsErrorClass::BrokenPipe => CloseReason::PeerReset,
            class => CloseReason::Io(class),
        }
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseReason::Killed(code) | CloseReason::EgressDenied(code) => {
                write!(formatter, "{} (code {code})", self.as_str())
            }
            CloseReason::Refused(RefusalCause::Gate(code)) => {
                write!(formatter, "{} (code {code})", self.as_str())
            }
            _ => formatter.write_str(self.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_own_index_in_order() {
        for (position, reason) in CloseReason::ALL.iter().enumerate() {
            assert_eq!(
                reason.index(),
                position,
                "{reason:?} is out of order in ALL"
            );
        }
        for (position, cause) in RefusalCause::ALL.iter().enumerate() {
            assert_eq!(cause.index(), position, "{cause:?} is out of order in ALL");
        }
    }

    #[test]
    fn only_the_four_graceful_reasons_are_not_abortive() {
        let graceful: Vec<_> = CloseReason::ALL
            .iter()
            .filter(|reason| !reason.is_abortive())
            .map(|reason| reason.as_str())
            .collect();
        assert_eq!(
            graceful,
            ["peer_closed", "idle", "drained", "session_closed"]
        );
    }

    #[test]
    fn a_close_reason_fits_in_eight_bytes() {
        assert!(
            std::mem::size_of::<CloseReason>() <= 8,
            "CloseReason grew past 8 bytes"
        );
    }

    #[test]
    fn reset_and_broken_pipe_map_to_peer_reset() {
        let reset = std::io::Error::from_raw_os_error(libc::ECONNRESET);
        let pipe = std::io::Error::from_raw_os_error(libc::EPIPE);
        let keepalive = std::io::Error::from_raw_os_error(libc::ETIMEDOUT);
        assert_eq!(CloseReason::from_io(&reset), CloseReason::PeerReset);
        assert_eq!(CloseReason::from_io(&pipe), CloseReason::PeerReset);
        assert_eq!(
            CloseReason::from_io(&keepalive),
            CloseReason::Io(OsErrorClass::TimedOut),
            "a kernel ETIMEDOUT is not one of our deadlines"
        );
    }
}
