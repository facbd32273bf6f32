//! TCP sockets: listener creation and options, per-connection options, `accept4`, `recv`, `send`, `shutdown`, `connect` (blocking and non-blocking).
//!
//! Options go through `socket2`; the calls on the hot path (`accept4`, `recv`, `send`, `sendmsg`, `setsockopt` of
//! `SO_RCVTIMEO`) are made here directly so that each has its own shim site and its exact flags are visible.
//! Listeners are non-blocking (an accept thread accepts until `EAGAIN` after one wake); accepted and connected
//! sockets are blocking, because a worker reads with a plain `recv` under `SO_RCVTIMEO` and writes with
//! `MSG_DONTWAIT` per call. Event-driven callers (task-runtime) make sockets non-blocking with
//! [`connect_nonblocking`] and [`set_nonblocking`].

use std::io::{self, IoSlice};
use std::mem::{MaybeUninit, size_of};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

use socket2::{Domain, SockRef, Socket, TcpKeepalive, Type};

use crate::{cvt, shim};

/// The backlog asked for when the caller names none.
pub const DEFAULT_BACKLOG: u32 = 1024;

/// How a listener is created: options applied between `socket` and `bind`, then `listen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenOptions {
    /// Pending-connection queue length asked of `listen(2)`; capped at `/proc/sys/net/core/somaxconn`.
    pub backlog: u32,
    /// `SO_REUSEADDR`, on by default so a restart does not wait for `TIME_WAIT` sockets.
    pub reuse_address: bool,
    /// `SO_REUSEPORT`, off by default: several processes (or listeners) sharing one port.
    pub reuse_port: bool,
    /// `IPV6_V6ONLY` for IPv6 addresses, on by default so `[::]` does not silently take the IPv4 port too.
    pub only_v6: bool,
    /// `SO_RCVBUF` in bytes; accepted sockets inherit it. `None` keeps the kernel default.
    pub receive_buffer: Option<usize>,
    /// `SO_SNDBUF` in bytes; accepted sockets inherit it. `None` keeps the kernel default.
    pub send_buffer: Option<usize>,
}

impl Default for ListenOptions {
    fn default() -> Self {
        Self {
            backlog: DEFAULT_BACKLOG,
            reuse_address: true,
            reuse_port: false,
            only_v6: true,
            receive_buffer: None,
            send_buffer: None,
        }
    }
}

/// A bound, listening, non-blocking TCP socket.
#[derive(Debug)]
pub struct Listener {
    socket: Socket,
    local: SocketAddr,
    backlog: u32,
}

/// A connection taken off a listener's queue: its socket (blocking, close-on-exec) and its peer.
#[derive(Debug)]
pub struct Accepted {
    /// The connected socket.
    pub socket: OwnedFd,
    /// The peer address as the kernel reported it (IPv4-mapped IPv6 is not normalised here).
    pub peer: SocketAddr,
}

/// What an accept thread should do about a failed `accept4`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptFailure {
    /// `EAGAIN`: the queue is empty; wait for the next wake.
    Empty,
    /// `EMFILE` or `ENFILE`: out of descriptors; use the reserve descriptor and back off.
    DescriptorPressure,
    /// `ENOBUFS` or `ENOMEM`: the kernel is short of memory; pause, then retry.
    Pause,
    /// `EBADF`, `EINVAL` or `ENOTSOCK`: the listener itself is broken; stop accepting on it.
    ListenerFailed,
    /// Anything else (`ECONNABORTED`, `EPROTO`, `EPERM`, ...): one connection failed; count it and continue.
    PerConnection,
}

/// `SO_LINGER` behaviour at close.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Linger {
    /// The kernel default: `close` returns at once and the kernel sends what is queued, then FIN.
    #[default]
    Off,
    /// Linger on with a zero timeout: `close` discards queued data and sends RST.
    Abortive,
    /// Linger on with this timeout: `close` blocks until queued data is sent or the timeout passes.
    Timeout(Duration),
}

/// TCP keepalive probing: first probe after `idle`, then every `interval`, giving up after `count` probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Idle time before the first probe (`TCP_KEEPIDLE`).
    pub idle: Duration,
    /// Time between probes (`TCP_KEEPINTVL`).
    pub interval: Duration,
    /// Unanswered probes before the connection is dropped (`TCP_KEEPCNT`).
    pub count: u32,
}

/// Options set on each connection. On Linux an accepted socket inherits the listener's buffer sizes, so
/// those need setting per connection only when they differ from the listener's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnectionOptions {
    /// `TCP_NODELAY`: send small writes at once instead of waiting for the previous ACK.
    pub nodelay: bool,
    /// Keepalive probing, off when `None`.
    pub keepalive: Option<Keepalive>,
    /// `SO_LINGER` at close.
    pub linger: Linger,
    /// `SO_RCVBUF` in bytes, unchanged when `None`.
    pub receive_buffer: Option<usize>,
    /// `SO_SNDBUF` in bytes, unchanged when `None`.
    pub send_buffer: Option<usize>,
}

impl Listener {
    /// The address the listener is bound to (with the real port when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The backlog passed to `listen(2)` after capping at `somaxconn`; 0 for an inherited listener, whose
    /// creator chose it (the kernel does not report it).
    pub fn backlog(&self) -> u32 {
        self.backlog
    }

    /// A listener made from a checked, inherited socket (see [`crate::inherit`]).
    pub(crate) fn inherited(socket: Socket, local: SocketAddr) -> Listener {
        Listener {
            socket,
            local,
            backlog: 0,
        }
    }

    /// Takes one connection off the queue with `accept4(SOCK_CLOEXEC)`; never blocks.
    ///
    /// The returned socket is blocking. Classify an error with [`classify_accept`].
    pub fn accept(&self) -> io::Result<Accepted> {
        let mut storage = MaybeUninit::<libc::sockaddr_storage>::zeroed();
        let mut length = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        let raw = loop {
            shim::enter("accept4")?;
            // SAFETY: accept4(2) writes at most `length` bytes into `storage`, a live sockaddr_storage, and
            // updates `length`; the listener descriptor is valid for the lifetime of `self`.
            let result = cvt!(unsafe {
                libc::accept4(
                    self.socket.as_raw_fd(),
                    storage.as_mut_ptr().cast(),
                    &mut length,
                    libc::SOCK_CLOEXEC,
                )
            });
            match result {
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                other => break other?,
            }
        };
        // SAFETY: `raw` was just returned by accept4(2); nobody else owns it.
        let socket = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: accept4(2) succeeded, so it initialised `length` bytes of `storage`; zeroed covers the rest.
        let storage = unsafe { storage.assume_init() };
        let peer = socket_address(&storage, length)
            .unwrap_or(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)));
        Ok(Accepted { socket, peer })
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

/// Creates a non-blocking, close-on-exec TCP listener on `address` with `options`.
///
/// The backlog is capped at [`somaxconn`]. An address in use comes back as `AddrInUse`; callers add the advice.
///
/// ```
/// use net_io_sys::socket::{self, ListenOptions};
///
/// let options = ListenOptions {
///     backlog: u32::MAX,
///     ..ListenOptions::default()
/// };
/// let listener = socket::listen("127.0.0.1:0".parse().unwrap(), &options)?;
/// assert_ne!(listener.local_addr().port(), 0, "port 0 asks the kernel for a free port");
/// assert!(listener.backlog() <= socket::somaxconn().unwrap_or(4096), "the backlog is capped");
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn listen(address: SocketAddr, options: &ListenOptions) -> io::Result<Listener> {
    let domain = Domain::for_address(address);
    shim::enter("socket")?;
    // socket2 creates the socket with SOCK_CLOEXEC on Linux.
    let socket = Socket::new(domain, Type::STREAM, None)?;
    shim::enter("setsockopt_listen")?;
    socket.set_reuse_address(options.reuse_address)?;
    if options.reuse_port {
        socket.set_reuse_port(true)?;
    }
    if address.is_ipv6() {
        socket.set_only_v6(options.only_v6)?;
    }
    if let Some(bytes) = options.receive_buffer {
        socket.set_recv_buffer_size(bytes)?;
    }
    if let Some(bytes) = options.send_buffer {
        socket.set_send_buffer_size(bytes)?;
    }
    shim::enter("bind")?;
    socket.bind(&address.into())?;
    let backlog = effective_backlog(options.backlog);
    shim::enter("listen")?;
    socket.listen(i32::try_from(backlog).unwrap_or(i32::MAX))?;
    socket.set_nonblocking(true)?;
    let local = socket
        .local_addr()?
        .as_socket()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "listener has no IP address"))?;
    Ok(Listener {
        socket,
        local,
        backlog,
    })
}

/// Reads `/proc/sys/net/core/somaxconn`, the kernel's ceiling on any listen backlog; `None` if unreadable.
pub fn somaxconn() -> Option<u32> {
    let text = std::fs::read_to_string("/proc/sys/net/core/somaxconn").ok()?;
    text.trim().parse().ok()
}

/// The backlog actually used for `requested`: at least 1 and at most `somaxconn`.
pub fn effective_backlog(requested: u32) -> u32 {
    let ceiling = somaxconn().unwrap_or(4096).max(1);
    requested.clamp(1, ceiling)
}

/// Sorts an `accept4` error into what the accept thread should do about it.
pub fn classify_accept(error: &io::Error) -> AcceptFailure {
    match error.raw_os_error() {
        Some(libc::EAGAIN) => AcceptFailure::Empty,
        Some(libc::EMFILE | libc::ENFILE) => AcceptFailure::DescriptorPressure,
        Some(libc::ENOBUFS | libc::ENOMEM) => AcceptFailure::Pause,
        Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EOPNOTSUPP) => {
            AcceptFailure::ListenerFailed
        }
        _ if error.kind() == io::ErrorKind::WouldBlock => AcceptFailure::Empty,
        _ => AcceptFailure::PerConnection,
    }
}

/// Applies per-connection options to `socket`.
pub fn apply_connection_options(
    socket: BorrowedFd<'_>,
    options: &ConnectionOptions,
) -> io::Result<()> {
    let socket_ref = SockRef::from(&socket);
    shim::enter("setsockopt_connection")?;
    if options.nodelay {
        socket_ref.set_tcp_nodelay(true)?;
    }
    if let Some(keepalive) = options.keepalive {
        let parameters = TcpKeepalive::new()
            .with_time(keepalive.idle)
            .with_interval(keepalive.interval)
            .with_retries(keepalive.count);
        socket_ref.set_tcp_keepalive(&parameters)?;
    }
    if let Some(bytes) = options.receive_buffer {
        socket_ref.set_recv_buffer_size(bytes)?;
    }
    if let Some(bytes) = options.send_buffer {
        socket_ref.set_send_buffer_size(bytes)?;
    }
    if options.linger != Linger::Off {
        set_linger(socket, options.linger)?;
    }
    Ok(())
}

/// Sets `SO_LINGER`; [`Linger::Abortive`] right before the last close makes the kernel send RST.
pub fn set_linger(socket: BorrowedFd<'_>, linger: Linger) -> io::Result<()> {
    shim::enter("setsockopt_linger")?;
    let value = match linger {
        Linger::Off => None,
        Linger::Abortive => Some(Duration::ZERO),
        Linger::Timeout(timeout) => Some(timeout),
    };
    SockRef::from(&socket).set_linger(value)
}

/// Sets `SO_RCVTIMEO`: a blocking [`recv`] returns `WouldBlock` after `timeout`. `None` blocks without limit.
///
/// A zero timeval means "no timeout" to the kernel, so a zero or sub-microsecond `timeout` is raised to 1 µs.
pub fn set_receive_timeout(socket: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<()> {
    let value = match timeout {
        None => libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        Some(timeout) => {
            let timeout = timeout.max(Duration::from_micros(1));
            libc::timeval {
                tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
                tv_usec: libc::suseconds_t::from(timeout.subsec_micros() as i32),
            }
        }
    };
    shim::enter("setsockopt_rcvtimeo")?;
    // SAFETY: setsockopt(2) reads `size_of::<timeval>()` bytes from a live timeval; the descriptor is borrowed
    // for the call, so it stays open.
    cvt!(unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&value as *const libc::timeval).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// A blocking `recv(2)` into `buffer`; returns 0 at end of stream (or after our own `SHUT_RD`).
///
/// Under `SO_RCVTIMEO` it fails with `WouldBlock` when the timeout passes. `EINTR` comes back as
/// `Interrupted` so that the caller can retry with what is left of its deadline. An empty buffer
/// returns 0 without a system call.
pub fn recv(socket: BorrowedFd<'_>, buffer: &mut [u8]) -> io::Result<usize> {
    receive_with_flags(socket, buffer, 0, "recv")
}

/// A `recv(2)` with `MSG_DONTWAIT`: returns what is already queued, or `WouldBlock`.
pub fn recv_nonblocking(socket: BorrowedFd<'_>, buffer: &mut [u8]) -> io::Result<usize> {
    receive_with_flags(socket, buffer, libc::MSG_DONTWAIT, "recv_nonblocking")
}

/// A `recv(2)` with `MSG_DONTWAIT` for an event loop's data reads: returns what is queued, 0 at end of
/// stream, or `WouldBlock`. It is the one receive of a round trip, so the shim counts it at the `recv` site
/// like the blocking [`recv`]; `EINTR` comes back as `Interrupted`.
pub fn recv_ready(socket: BorrowedFd<'_>, buffer: &mut [u8]) -> io::Result<usize> {
    receive_with_flags(socket, buffer, libc::MSG_DONTWAIT, "recv")
}

/// Sends from `buffer` with `MSG_DONTWAIT | MSG_NOSIGNAL`: never blocks, never raises `SIGPIPE`.
///
/// Returns the bytes the kernel took (possibly fewer than asked) or `WouldBlock` when the send buffer is full.
/// `EINTR` is retried here since the call does not block.
pub fn send(socket: BorrowedFd<'_>, buffer: &[u8]) -> io::Result<usize> {
    if buffer.is_empty() {
        return Ok(0);
    }
    loop {
        shim::enter("send")?;
        // SAFETY: send(2) reads at most `buffer.len()` bytes from a live slice; the descriptor is borrowed.
        let result = cvt!(unsafe {
            libc::send(
                socket.as_raw_fd(),
                buffer.as_ptr().cast(),
                buffer.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        });
        match result {
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            other => return other.map(|sent| sent as usize),
        }
    }
}

/// Sends several slices in one `sendmsg(2)` with `MSG_DONTWAIT | MSG_NOSIGNAL`.
///
/// The kernel accepts at most `IOV_MAX` (1,024) slices; callers pass fewer (the driver uses up to 64).
pub fn send_vectored(socket: BorrowedFd<'_>, slices: &[IoSlice<'_>]) -> io::Result<usize> {
    if slices.is_empty() {
        return Ok(0);
    }
    let count = slices.len().min(1024);
    loop {
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is guaranteed ABI-compatible with iovec on Unix (std documents this).
        header.msg_iov = slices.as_ptr() as *mut libc::iovec;
        header.msg_iovlen = count as _;
        shim::enter("sendmsg")?;
        // SAFETY: sendmsg(2) reads `count` iovecs, each pointing at a live slice borrowed for this call; no
        // address and no control data are passed.
        let result = cvt!(unsafe {
            libc::sendmsg(
                socket.as_raw_fd(),
                &header,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        });
        match result {
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            other => return other.map(|sent| sent as usize),
        }
    }
}

/// `shutdown(2)`; `ENOTCONN` (the peer already went away) counts as success, so a second call is a no-op.
pub fn shutdown(socket: BorrowedFd<'_>, how: Shutdown) -> io::Result<()> {
    let how = match how {
        Shutdown::Read => libc::SHUT_RD,
        Shutdown::Write => libc::SHUT_WR,
        Shutdown::Both => libc::SHUT_RDWR,
    };
    shim::enter("shutdown")?;
    // SAFETY: shutdown(2) takes no pointers; the descriptor is borrowed, so it is open.
    match cvt!(unsafe { libc::shutdown(socket.as_raw_fd(), how) }) {
        Ok(_) => Ok(()),
        Err(error) if error.raw_os_error() == Some(libc::ENOTCONN) => Ok(()),
        Err(error) => Err(error),
    }
}

/// The local address of a connected or bound socket.
pub fn local_addr(socket: BorrowedFd<'_>) -> io::Result<SocketAddr> {
    shim::enter("getsockname")?;
    SockRef::from(&socket)
        .local_addr()?
        .as_socket()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "socket has no IP address"))
}

/// The peer address of a connected socket.
pub fn peer_addr(socket: BorrowedFd<'_>) -> io::Result<SocketAddr> {
    shim::enter("getpeername")?;
    SockRef::from(&socket)
        .peer_addr()?
        .as_socket()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "socket has no IP address"))
}

/// The pending socket error (`SO_ERROR`), cleared by reading it.
pub fn take_error(socket: BorrowedFd<'_>) -> io::Result<Option<io::Error>> {
    shim::enter("getsockopt_error")?;
    SockRef::from(&socket).take_error()
}

/// The socket's `SO_SNDBUF` as the kernel reports it (double what was asked, on Linux).
pub fn send_buffer_size(socket: BorrowedFd<'_>) -> io::Result<usize> {
    shim::enter("getsockopt_sndbuf")?;
    SockRef::from(&socket).send_buffer_size()
}

/// Connects to `address` within `timeout` and returns a blocking, close-on-exec socket.
pub fn connect(address: SocketAddr, timeout: Option<Duration>) -> io::Result<OwnedFd> {
    shim::enter("socket")?;
    let socket = Socket::new(Domain::for_address(address), Type::STREAM, None)?;
    shim::enter("connect")?;
    match timeout {
        Some(timeout) => socket.connect_timeout(&address.into(), timeout)?,
        None => socket.connect(&address.into())?,
    }
    // connect_timeout leaves the socket blocking again when it returns.
    Ok(OwnedFd::from(socket))
}

/// How far [`connect_nonblocking`] got before returning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectProgress {
    /// The connection is established (loopback can finish at once).
    Connected,
    /// `EINPROGRESS`: the handshake continues; wait until the socket is writable, then read [`take_error`].
    InProgress,
}

/// Starts a connect to `address` on a new non-blocking, close-on-exec socket without waiting for it.
///
/// For event-driven callers that park on writability instead of blocking a thread. Once the socket is
/// writable, [`take_error`] says whether the connect failed and [`peer_addr`] (`ENOTCONN` while pending)
/// whether it finished. A refusal the kernel knows at once (loopback) comes back here as
/// `ConnectionRefused`.
///
/// ```
/// use std::os::fd::AsFd;
/// use std::time::Duration;
///
/// use net_io_sys::epoll::{Epoll, Events, Interest};
/// use net_io_sys::socket::{self, ConnectProgress};
///
/// let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
/// let (socket, progress) = socket::connect_nonblocking(listener.local_addr()?)?;
/// if progress == ConnectProgress::InProgress {
///     // Writable means the handshake ended, one way or the other.
///     let epoll = Epoll::new()?;
///     epoll.add(socket.as_fd(), 1, Interest::WRITABLE)?;
///     epoll.wait(&mut Events::with_capacity(1), Some(Duration::from_secs(5)))?;
/// }
/// assert!(socket::take_error(socket.as_fd())?.is_none(), "the connect succeeded");
/// assert_eq!(socket::peer_addr(socket.as_fd())?, listener.local_addr()?);
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn connect_nonblocking(address: SocketAddr) -> io::Result<(OwnedFd, ConnectProgress)> {
    let socket = stream_socket_for(address)?;
    let progress = start_connect(socket.as_fd(), address)?;
    Ok((socket, progress))
}

/// A new non-blocking, close-on-exec TCP socket of `address`'s family, not yet connected.
///
/// With [`start_connect`] this is [`connect_nonblocking`] in two steps, for a caller that must keep the
/// socket even when the connect fails at once (a server driver reports that failure through the
/// connection's normal close rather than to the caller of `connect`).
pub fn stream_socket_for(address: SocketAddr) -> io::Result<OwnedFd> {
    shim::enter("socket")?;
    // SOCK_NONBLOCK at creation saves an fcntl; socket2 adds SOCK_CLOEXEC on Linux.
    let socket = Socket::new(
        Domain::for_address(address),
        Type::STREAM.nonblocking(),
        None,
    )?;
    Ok(OwnedFd::from(socket))
}

/// Starts connecting the non-blocking `socket` to `address` without waiting for the handshake.
pub fn start_connect(socket: BorrowedFd<'_>, address: SocketAddr) -> io::Result<ConnectProgress> {
    shim::enter("connect")?;
    match SockRef::from(&socket).connect(&address.into()) {
        Ok(()) => Ok(ConnectProgress::Connected),
        Err(error) if error.raw_os_error() == Some(libc::EINPROGRESS) => {
            Ok(ConnectProgress::InProgress)
        }
        // connect(2): an interrupted connect goes on asynchronously, like EINPROGRESS, so it is not retried.
        Err(error) if error.kind() == io::ErrorKind::Interrupted => Ok(ConnectProgress::InProgress),
        Err(error) => Err(error),
    }
}

/// Sets `TCP_NODELAY` on a connected socket (an accepted one inherits it from its listener instead).
pub fn set_nodelay(socket: BorrowedFd<'_>, nodelay: bool) -> io::Result<()> {
    shim::enter("setsockopt_nodelay")?;
    SockRef::from(&socket).set_tcp_nodelay(nodelay)
}

/// Sets or clears `O_NONBLOCK` on `socket` (an accepted socket starts blocking).
pub fn set_nonblocking(socket: BorrowedFd<'_>, nonblocking: bool) -> io::Result<()> {
    shim::enter("fcntl_nonblocking")?;
    SockRef::from(&socket).set_nonblocking(nonblocking)
}

fn receive_with_flags(
    socket: BorrowedFd<'_>,
    buffer: &mut [u8],
    flags: libc::c_int,
    site: &'static str,
) -> io::Result<usize> {
    if buffer.is_empty() {
        return Ok(0);
    }
    shim::enter(site)?;
    // SAFETY: recv(2) writes at most `buffer.len()` bytes into a live, exclusively borrowed slice; the
    // descriptor is borrowed for the call.
    let received = cvt!(unsafe {
        libc::recv(
            socket.as_raw_fd(),
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            flags,
        )
    })?;
    Ok(received as usize)
}

/// Converts a kernel socket address to a std one; `None` for families other than IPv4 and IPv6.
fn socket_address(storage: &libc::sockaddr_storage, length: libc::socklen_t) -> Option<SocketAddr> {
    match i32::from(storage.ss_family) {
        libc::AF_INET if length as usize >= size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family is AF_INET and the kernel wrote a full sockaddr_in; sockaddr_storage is
            // aligned for every socket address type (socket(7)).
            let address =
                unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(address.sin_addr.s_addr)),
                u16::from_be(address.sin_port),
            )))
        }
        libc::AF_INET6 if length as usize >= size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for AF_INET6 and sockaddr_in6.
            let address = unsafe {
                &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(address.sin6_addr.s6_addr),
                u16::from_be(address.sin6_port),
                u32::from_be(address.sin6_flowinfo),
                address.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    fn loopback_listener() -> Listener {
        listen("127.0.0.1:0".parse().unwrap(), &ListenOptions::default()).expect("listen")
    }

    #[test]
    fn an_accepted_connection_carries_the_peer_address_and_echoes_through_recv_and_send() {
        let listener = loopback_listener();
        let mut client = TcpStream::connect(listener.local_addr()).expect("connect");
        let accepted = loop {
            match listener.accept() {
                Ok(accepted) => break accepted,
                Err(error) if classify_accept(&error) == AcceptFailure::Empty => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(error) => panic!("accept failed: {error}"),
            }
        };
        assert_eq!(
            accepted.peer,
            client.local_addr().unwrap(),
            "the peer address should be the client's"
        );
        client.write_all(b"ping").unwrap();
        let mut buffer = [0u8; 16];
        set_receive_timeout(accepted.socket.as_fd(), Some(Duration::from_secs(5))).unwrap();
        let received = recv(accepted.socket.as_fd(), &mut buffer).unwrap();
        assert_eq!(
            &buffer[..received],
            b"ping",
            "recv should return the bytes sent"
        );
        let sent = send_vectored(
            accepted.socket.as_fd(),
            &[IoSlice::new(b"po"), IoSlice::new(b"ng")],
        )
        .unwrap();
        assert_eq!(sent, 4, "a small vectored send should be taken whole");
        let mut reply = [0u8; 4];
        client.read_exact(&mut reply).unwrap();
        assert_eq!(
            &reply, b"pong",
            "the client should read both slices in order"
        );
    }

    #[test]
    fn a_receive_timeout_turns_a_silent_peer_into_would_block() {
        let listener = loopback_listener();
        let _client = TcpStream::connect(listener.local_addr()).expect("connect");
        std::thread::sleep(Duration::from_millis(20));
        let accepted = listener.accept().expect("accept");
        set_receive_timeout(accepted.socket.as_fd(), Some(Duration::from_millis(30))).unwrap();
        let mut buffer = [0u8; 4];
        let error = recv(accepted.socket.as_fd(), &mut buffer).expect_err("recv should time out");
        assert_eq!(
            error.kind(),
            io::ErrorKind::WouldBlock,
            "SO_RCVTIMEO should surface as WouldBlock"
        );
    }

    #[test]
    fn an_empty_listener_classifies_as_empty_and_errno_classes_map_as_documented() {
        let listener = loopback_listener();
        let error = listener.accept().expect_err("nothing queued");
        assert_eq!(classify_accept(&error), AcceptFailure::Empty);
        let class = |errno| classify_accept(&io::Error::from_raw_os_error(errno));
        assert_eq!(class(libc::EMFILE), AcceptFailure::DescriptorPressure);
        assert_eq!(class(libc::ENFILE), AcceptFailure::DescriptorPressure);
        assert_eq!(class(libc::ENOBUFS), AcceptFailure::Pause);
        assert_eq!(class(libc::ENOMEM), AcceptFailure::Pause);
        assert_eq!(class(libc::EBADF), AcceptFailure::ListenerFailed);
        assert_eq!(class(libc::EINVAL), AcceptFailure::ListenerFailed);
        assert_eq!(class(libc::ECONNABORTED), AcceptFailure::PerConnection);
        assert_eq!(class(libc::EPERM), AcceptFailure::PerConnection);
    }

    #[test]
    fn a_second_listener_on_the_same_port_reports_address_in_use() {
        let first = loopback_listener();
        let error =
            listen(first.local_addr(), &ListenOptions::default()).expect_err("the port is taken");
        assert_eq!(
            error.kind(),
            io::ErrorKind::AddrInUse,
            "expected AddrInUse, got {error}"
        );
    }

    #[test]
    fn a_listener_asks_the_kernel_for_the_requested_backlog_capped_at_somaxconn_and_at_least_one() {
        // Read here on its own rather than through `somaxconn`, so that a wrong path or parse there fails.
        let ceiling: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .expect(
                "this test reads the kernel's backlog ceiling from /proc/sys/net/core/somaxconn",
            )
            .trim()
            .parse()
            .expect("somaxconn should hold one number");
        assert_eq!(
            somaxconn(),
            Some(ceiling),
            "somaxconn() disagrees with /proc/sys/net/core/somaxconn"
        );
        let small = 7.min(ceiling);
        for (requested, expected) in [(0, 1), (small, small), (u32::MAX, ceiling)] {
            assert_eq!(
                effective_backlog(requested),
                expected,
                "a requested backlog of {requested} should become {expected} (somaxconn is {ceiling})"
            );
            let options = ListenOptions {
                backlog: requested,
                ..ListenOptions::default()
            };
            let listener = listen("127.0.0.1:0".parse().unwrap(), &options).expect("listen");
            assert_eq!(
                listener.backlog(),
                expected,
                "the listener reports a backlog other than the one it should ask for"
            );
            assert_eq!(
                kernel_backlog(listener.as_fd()),
                expected,
                "a requested backlog of {requested} did not reach listen(2) as {expected}"
            );
        }
    }

    /// The accept-queue length a listening socket was given, as the kernel keeps it: for a socket in
    /// LISTEN, `TCP_INFO` reports it in `tcpi_sacked` (tcp(7), and `tcp_get_info` in the kernel).
    fn kernel_backlog(socket: BorrowedFd<'_>) -> u32 {
        // SAFETY: tcp_info is plain integers, for which all zeroes is a valid value.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut length = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: getsockopt(2) writes at most `length` bytes into the live local `info` and updates the live
        // local `length`; the descriptor is borrowed for the call.
        let result = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&raw mut info).cast(),
                &mut length,
            )
        };
        assert_eq!(
            result,
            0,
            "getsockopt(TCP_INFO) failed: {}",
            io::Error::last_os_error()
        );
        info.tcpi_sacked
    }

    #[test]
    fn accepted_sockets_inherit_nodelay_keepalive_and_the_receive_timeout_from_the_listener() {
        let listener = loopback_listener();
        apply_connection_options(
            listener.as_fd(),
            &ConnectionOptions {
                nodelay: true,
                keepalive: Some(Keepalive {
                    idle: Duration::from_secs(30),
                    interval: Duration::from_secs(5),
                    count: 3,
                }),
                ..ConnectionOptions::default()
            },
        )
        .unwrap();
        set_receive_timeout(listener.as_fd(), Some(Duration::from_secs(5))).unwrap();
        let _client = TcpStream::connect(listener.local_addr()).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let accepted = listener.accept().expect("accept");
        let socket = SockRef::from(&accepted.socket);
        assert_eq!(
            socket.read_timeout().unwrap(),
            Some(Duration::from_secs(5)),
            "SO_RCVTIMEO was not inherited; the driver relies on it"
        );
        assert!(
            socket.tcp_nodelay().unwrap(),
            "TCP_NODELAY was not inherited; the driver relies on it"
        );
        assert!(
            socket.keepalive().unwrap(),
            "SO_KEEPALIVE was not inherited"
        );
    }

    #[test]
    fn a_nonblocking_connect_finishes_once_writable_and_a_closed_port_is_refused() {
        let listener = loopback_listener();
        let (socket, progress) = connect_nonblocking(listener.local_addr()).expect("connect");
        if progress == ConnectProgress::InProgress {
            let mut poll = libc::pollfd {
                fd: socket.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            };
            // SAFETY: poll(2) reads and writes one live pollfd for the length of the call.
            let ready = unsafe { libc::poll(&mut poll, 1, 5_000) };
            assert_eq!(
                ready, 1,
                "a loopback connect should become writable within 5 s"
            );
        }
        assert!(
            take_error(socket.as_fd()).unwrap().is_none(),
            "a connect to a listening port should carry no socket error"
        );
        assert_eq!(
            peer_addr(socket.as_fd()).unwrap(),
            listener.local_addr(),
            "the connected socket's peer should be the listener"
        );
        let mut buffer = [0u8; 1];
        assert_eq!(
            recv_nonblocking(socket.as_fd(), &mut buffer)
                .expect_err("nothing was sent")
                .kind(),
            io::ErrorKind::WouldBlock,
            "the socket should be non-blocking"
        );

        let closed = listener.local_addr();
        drop(listener);
        let refused = match connect_nonblocking(closed) {
            Err(error) => error,
            Ok((socket, _)) => {
                let mut poll = libc::pollfd {
                    fd: socket.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: as above.
                unsafe { libc::poll(&mut poll, 1, 5_000) };
                take_error(socket.as_fd())
                    .unwrap()
                    .expect("a connect to a closed port should fail")
            }
        };
        assert_eq!(
            refused.kind(),
            io::ErrorKind::ConnectionRefused,
            "a closed loopback port should refuse, got {refused}"
        );
    }

    #[test]
    fn set_nonblocking_turns_an_accepted_blocking_socket_non_blocking() {
        let listener = loopback_listener();
        let _client = TcpStream::connect(listener.local_addr()).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let accepted = listener.accept().expect("accept");
        // The receive timeout bounds the test if O_NONBLOCK did not take; the elapsed time tells them apart.
        set_receive_timeout(accepted.socket.as_fd(), Some(Duration::from_secs(5))).unwrap();
        set_nonblocking(accepted.socket.as_fd(), true).unwrap();
        let mut buffer = [0u8; 1];
        let started = std::time::Instant::now();
        let error = recv(accepted.socket.as_fd(), &mut buffer).expect_err("nothing was sent");
        assert_eq!(error.kind(), io::ErrorKind::WouldBlock);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a plain recv on a non-blocking socket waited {:?} (the 5 s receive timeout, not O_NONBLOCK)",
            started.elapsed()
        );
    }

    #[test]
    fn shutdown_twice_and_abortive_linger_are_not_errors() {
        let listener = loopback_listener();
        let client = connect(listener.local_addr(), Some(Duration::from_secs(5))).expect("connect");
        shutdown(client.as_fd(), Shutdown::Write).unwrap();
        shutdown(client.as_fd(), Shutdown::Write).unwrap();
        apply_connection_options(
            client.as_fd(),
            &ConnectionOptions {
                nodelay: true,
                keepalive: Some(Keepalive {
                    idle: Duration::from_secs(30),
                    interval: Duration::from_secs(5),
                    count: 3,
                }),
                linger: Linger::Abortive,
                receive_buffer: Some(64 * 1024),
                send_buffer: Some(64 * 1024),
            },
        )
        .unwrap();
        assert!(send_buffer_size(client.as_fd()).unwrap() >= 64 * 1024);
    }
}
