//! The one error type of the net-io stack, [`NetError`], and its coarse [`ErrorClass`].

use std::io;
use std::net::SocketAddr;

use crate::close::{CloseReason, OsErrorClass, TimeoutKind};
use crate::id::ListenerId;
use crate::limits::ConfigError;
use crate::output::OutputFull;
use crate::proxy::ProxyError;

/// What went wrong, in the terms a caller can act on.
///
/// Converts from and into [`io::Error`]: an OS error keeps its code ([`NetError::os_error_code`]) and
/// converting back gives the same [`io::ErrorKind`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    /// Binding failed because another socket holds the address.
    #[error("address {address} is in use; pick another port or stop the other server")]
    AddressInUse {
        /// The address we tried to bind.
        address: SocketAddr,
    },
    /// Binding failed because the address is not on a local interface.
    #[error(
        "address {address} is not available on this host; bind to an address of a local interface (or enable IPv6)"
    )]
    AddressNotAvailable {
        /// The address we tried to bind.
        address: SocketAddr,
    },
    /// Binding needs privileges this process does not have.
    #[error(
        "binding {address} was denied; use a port above 1023 or grant the process CAP_NET_BIND_SERVICE"
    )]
    PermissionDenied {
        /// The address we tried to bind.
        address: SocketAddr,
    },
    /// The configuration was rejected at build time.
    #[error("invalid configuration: {0}")]
    InvalidConfig(#[from] ConfigError),
    /// One of our deadlines passed.
    #[error("the {} deadline passed; the peer was too slow or the deadline is too short", .0.as_str())]
    Timeout(TimeoutKind),
    /// The connection is already closed, for this reason.
    #[error("the connection is closed ({0}); open a new connection")]
    Closed(CloseReason),
    /// The output budget is full.
    #[error(transparent)]
    OutputFull(#[from] OutputFull),
    /// A PROXY protocol header was malformed.
    #[error("bad PROXY header: {0}")]
    Proxy(#[from] ProxyError),
    /// The server is shutting down and takes no new work.
    #[error("the server is shutting down and takes no new work; retry against another instance")]
    ShuttingDown,
    /// The server has stopped.
    #[error("the server has stopped; build a new one to serve again")]
    ServerStopped,
    /// No live listener of this server has this id (it was never added, or was removed already).
    #[error(
        "listener {listener} is not live on this server (never added, or already removed); list the live ones with ServerHandle::listener_ids"
    )]
    UnknownListener {
        /// The id asked for.
        listener: ListenerId,
    },
    /// An outbound session was offered to a server that drives another session type (or runs handlers).
    #[error(
        "this server drives sessions of type {expected}, not {given}; pass a session of the server's own type to connect (a server whose factory makes Box<dyn Session> takes boxed sessions)"
    )]
    WrongSessionType {
        /// The server's session type (or a note that it runs blocking handlers).
        expected: &'static str,
        /// The type that was offered.
        given: &'static str,
    },
    /// An outbound connection would exceed the server's connection cap.
    #[error(
        "the server already holds its cap of {cap} connections; close some or raise max_connections before connecting out"
    )]
    ConnectionCap {
        /// The server-wide cap (`max_connections`).
        cap: usize,
    },
    /// An operating-system call failed.
    #[error("{}: {source}", os_advice(*class))]
    Os {
        /// The coarse class of the error.
        class: OsErrorClass,
        /// The original error, with its OS code.
        #[source]
        source: io::Error,
    },
}

/// A coarse class of [`NetError`] for deciding what to do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorClass {
    /// The configuration is wrong; fix it and build again.
    Config,
    /// An address could not be used.
    Address,
    /// The process lacks a privilege.
    Permission,
    /// A deadline passed.
    Timeout,
    /// The peer went away (reset, broken pipe, aborted).
    PeerGone,
    /// A resource ran out (descriptors, kernel memory); retry after a pause.
    Resource,
    /// Try again right away or when the socket is ready.
    Transient,
    /// Output is full; flush first.
    Backpressure,
    /// The peer broke a protocol (PROXY header).
    Protocol,
    /// The connection is closed.
    Closed,
    /// The server is shutting down or stopped.
    Shutdown,
    /// Any other operating-system error.
    Os,
}

impl NetError {
    /// The coarse class of this error.
    pub fn class(&self) -> ErrorClass {
        match self {
            NetError::AddressInUse { .. } | NetError::AddressNotAvailable { .. } => {
                ErrorClass::Address
            }
            NetError::PermissionDenied { .. } => ErrorClass::Permission,
            NetError::InvalidConfig(_)
            | NetError::UnknownListener { .. }
            | NetError::WrongSessionType { .. } => ErrorClass::Config,
            NetError::ConnectionCap { .. } => ErrorClass::Resource,
            NetError::Timeout(_) => ErrorClass::Timeout,
            NetError::Closed(_) => ErrorClass::Closed,
            NetError::OutputFull(_) => ErrorClass::Backpressure,
            NetError::Proxy(_) => ErrorClass::Protocol,
            NetError::ShuttingDown | NetError::ServerStopped => ErrorClass::Shutdown,
            NetError::Os { class, .. } => match class {
                OsErrorClass::WouldBlock | OsErrorClass::Interrupted => ErrorClass::Transient,
                OsErrorClass::ConnectionReset
                | OsErrorClass::ConnectionAborted
                | OsErrorClass::BrokenPipe
                | OsErrorClass::NotConnected => ErrorClass::PeerGone,
                OsErrorClass::TimedOut => ErrorClass::Timeout,
                OsErrorClass::DescriptorsExhausted | OsErrorClass::NoBuffers => {
                    ErrorClass::Resource
                }
                OsErrorClass::AddressInUse | OsErrorClass::AddressNotAvailable => {
                    ErrorClass::Address
                }
                OsErrorClass::PermissionDenied => ErrorClass::Permission,
                _ => ErrorClass::Os,
            },
        }
    }

    /// True when the same operation may succeed if tried again (at once, when ready, or after a pause).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.class(),
            ErrorClass::Transient | ErrorClass::Resource | ErrorClass::Backpressure
        )
    }

    /// The raw `errno` when this error came from the operating system.
    pub fn os_error_code(&self) -> Option<i32> {
        match self {
            NetError::Os { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// Wraps an OS error from binding `address`, naming the address for the common causes.
    pub fn from_bind(address: SocketAddr, error: io::Error) -> NetError {
        match OsErrorClass::of(&error) {
            OsErrorClass::AddressInUse => NetError::AddressInUse { address },
            OsErrorClass::AddressNotAvailable => NetError::AddressNotAvailable { address },
            OsErrorClass::PermissionDenied => NetError::PermissionDenied { address },
            _ => NetError::from(error),
        }
    }
}

impl From<io::Error> for NetError {
    fn from(error: io::Error) -> NetError {
        // An io::Error that wraps a NetError (from `Into<io::Error>` below) unwraps to it again.
        if error.get_ref().is_some_and(|inner| inner.is::<NetError>()) {
            let inner = error.into_inner().expect("checked above");
            return *inner.downcast::<NetError>().expect("checked above");
        }
        NetError::Os {
            class: OsErrorClass::of(&error),
            source: error,
        }
    }
}

impl From<NetError> for io::Error {
    fn from(error: NetError) -> io::Error {
        let kind = match &error {
            NetError::Os { .. } => {
                let NetError::Os { source, .. } = error else {
                    unreachable!("matched above")
                };
                return source;
            }
            NetError::AddressInUse { .. } => io::ErrorKind::AddrInUse,
            NetError::AddressNotAvailable { .. } => io::ErrorKind::AddrNotAvailable,
            NetError::PermissionDenied { .. } => io::ErrorKind::PermissionDenied,
            NetError::InvalidConfig(_) => io::ErrorKind::InvalidInput,
            NetError::UnknownListener { .. } => io::ErrorKind::NotFound,
            NetError::WrongSessionType { .. } => io::ErrorKind::InvalidInput,
            NetError::ConnectionCap { .. } => io::ErrorKind::QuotaExceeded,
            NetError::Timeout(_) => io::ErrorKind::TimedOut,
            NetError::Closed(_) => io::ErrorKind::NotConnected,
            NetError::OutputFull(_) => io::ErrorKind::WouldBlock,
            NetError::Proxy(_) => io::ErrorKind::InvalidData,
            NetError::ShuttingDown | NetError::ServerStopped => io::ErrorKind::Other,
        };
        io::Error::new(kind, error)
    }
}

/// The first half of the Display text of an OS error: what it means and what to do.
fn os_advice(class: OsErrorClass) -> &'static str {
    match class {
        OsErrorClass::WouldBlock => "the operation would block; retry when the socket is ready",
        OsErrorClass::Interrupted => "a signal interrupted the call; retry it",
        OsErrorClass::ConnectionReset => "the peer reset the connection",
        OsErrorClass::ConnectionAborted => "the connection was aborted",
        OsErrorClass::BrokenPipe => "the peer closed the connection; stop writing",
        OsErrorClass::TimedOut => {
            "the kernel timed the connection out (keepalive or retransmission)"
        }
        OsErrorClass::NotConnected => "the socket is not connected",
        OsErrorClass::ConnectionRefused => "the connection was refused; is the server running?",
        OsErrorClass::NetworkUnreachable => "the network is unreachable; check routes and links",
        OsErrorClass::HostUnreachable => "the host is unreachable",
        OsErrorClass::DescriptorsExhausted => {
            "out of file descriptors; raise RLIMIT_NOFILE or lower max_connections"
        }
        OsErrorClass::NoBuffers => "the kernel is short of memory; retry after a pause",
        OsErrorClass::AddressInUse => "the address is in use; pick another port",
        OsErrorClass::AddressNotAvailable => "the address is not available on this host",
        OsErrorClass::PermissionDenied => "permission denied",
        OsErrorClass::InvalidDescriptor => "the socket descriptor is unusable",
        OsErrorClass::Other => "operating-system error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_os_error_keeps_its_code_both_ways() {
        let error = NetError::from(io::Error::from_raw_os_error(libc::ECONNRESET));
        assert_eq!(error.os_error_code(), Some(libc::ECONNRESET));
        assert_eq!(error.class(), ErrorClass::PeerGone);
        assert!(
            !error.is_retryable(),
            "a reset connection cannot be retried"
        );
        let back: io::Error = error.into();
        assert_eq!(
            back.raw_os_error(),
            Some(libc::ECONNRESET),
            "the code was lost"
        );
    }

    #[test]
    fn a_net_error_survives_a_round_trip_through_io_error() {
        let error = NetError::Timeout(TimeoutKind::Write);
        let io_error: io::Error = error.into();
        assert_eq!(io_error.kind(), io::ErrorKind::TimedOut);
        let again = NetError::from(io_error);
        assert!(
            matches!(again, NetError::Timeout(TimeoutKind::Write)),
            "got {again:?} instead of the original timeout"
        );
    }

    #[test]
    fn would_block_and_descriptor_exhaustion_are_retryable() {
        let would_block = NetError::from(io::Error::from_raw_os_error(libc::EAGAIN));
        let exhausted = NetError::from(io::Error::from_raw_os_error(libc::EMFILE));
        assert!(would_block.is_retryable());
        assert!(exhausted.is_retryable());
        assert_eq!(exhausted.class(), ErrorClass::Resource);
    }

    #[test]
    fn a_bind_error_names_the_address() {
        let address: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let error = NetError::from_bind(address, io::Error::from_raw_os_error(libc::EADDRINUSE));
        assert!(
            error.to_string().contains("127.0.0.1:7000"),
            "the message does not name the address: {error}"
        );
    }
}
