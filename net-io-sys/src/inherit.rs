//! Listening sockets inherited from the process that started us (systemd socket activation): check a
//! descriptor number without taking it, take it exactly once, and clear the activation variables.
//!
//! The contract (`sd_listen_fds(3)`): when `LISTEN_PID` names this process, descriptors `3 ..
//! 3 + LISTEN_FDS` were opened for it and nobody else in it owns them. That contract, a range check and a
//! process-wide "taken" bit per descriptor are what make turning a number into an `OwnedFd` sound here: the
//! same number is never taken twice, so two owners can never close it.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use socket2::{Protocol, SockRef, Socket, Type};

use crate::socket::Listener;
use crate::{cvt, shim};

/// The first inherited descriptor (`SD_LISTEN_FDS_START`).
pub const FIRST_INHERITED: i32 = 3;
/// The most inherited listeners taken; more is refused rather than trusted.
pub const INHERITED_MAX: usize = 64;

/// One bit per descriptor `FIRST_INHERITED + bit`, set once that descriptor was taken.
static TAKEN: AtomicU64 = AtomicU64::new(0);

/// Why an inherited descriptor is not a listener we can serve on.
#[derive(Debug)]
#[non_exhaustive]
pub enum Unfit {
    /// The number is outside `FIRST_INHERITED .. FIRST_INHERITED + INHERITED_MAX`.
    OutOfRange,
    /// It was taken already in this process.
    AlreadyTaken,
    /// No descriptor is open under this number.
    NotOpen,
    /// The descriptor is not a socket (a file, a pipe, ...).
    NotSocket,
    /// The socket is not a stream socket (`SO_TYPE` is not `SOCK_STREAM`).
    NotStream,
    /// The stream socket is not TCP or MPTCP (`SO_PROTOCOL`; SCTP has stream sockets too).
    NotTcp,
    /// The socket is not listening (`SO_ACCEPTCONN` is 0).
    NotListening,
    /// The socket has no IP address (a Unix socket, for example).
    NotIp,
    /// A system call failed while checking or taking it.
    Os(io::Error),
}

impl std::fmt::Display for Unfit {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unfit::OutOfRange => write!(
                formatter,
                "it is outside the inherited range {FIRST_INHERITED}..{}",
                FIRST_INHERITED + INHERITED_MAX as i32
            ),
            Unfit::AlreadyTaken => formatter.write_str("it was taken already"),
            Unfit::NotOpen => formatter.write_str("it is not open"),
            Unfit::NotSocket => formatter.write_str("it is not a socket"),
            Unfit::NotStream => formatter.write_str("it is not a stream socket"),
            Unfit::NotTcp => formatter.write_str("it is not a TCP socket"),
            Unfit::NotListening => formatter.write_str("it is not listening"),
            Unfit::NotIp => formatter.write_str("it has no IP address"),
            Unfit::Os(error) => write!(formatter, "checking it failed: {error}"),
        }
    }
}

impl std::error::Error for Unfit {}

/// The bit of `fd` in [`TAKEN`], if it is in the inherited range.
fn bit(fd: i32) -> Result<u64, Unfit> {
    let offset = fd
        .checked_sub(FIRST_INHERITED)
        .filter(|offset| (0..INHERITED_MAX as i32).contains(offset))
        .ok_or(Unfit::OutOfRange)?;
    Ok(1 << offset)
}

/// Checks that inherited descriptor `fd` is an open, listening TCP (or MPTCP) socket not yet taken, and returns
/// its address; it stays where it is. Costs six system calls (`fcntl`, four `getsockopt`, `getsockname`).
pub fn check_listener(fd: i32) -> Result<SocketAddr, Unfit> {
    let bit = bit(fd)?;
    if TAKEN.load(Ordering::Acquire) & bit != 0 {
        return Err(Unfit::AlreadyTaken);
    }
    shim::enter("fcntl_getfd").map_err(Unfit::Os)?;
    // SAFETY: fcntl(2) F_GETFD reads the descriptor flags of a number; it takes no pointers and fails with
    // EBADF on a number that is not open, which is all we ask it.
    if let Err(error) = cvt!(unsafe { libc::fcntl(fd, libc::F_GETFD) }) {
        return Err(match error.raw_os_error() {
            Some(libc::EBADF) => Unfit::NotOpen,
            _ => Unfit::Os(error),
        });
    }
    // SAFETY: fcntl just found `fd` open, it is in the inherited range that sd_listen_fds(3) gives to this
    // process, and it is not taken (checked above), so no owner in this process closes it while this
    // borrow lives: the borrow ends with this function.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    verify(borrowed)
}

/// Makes inherited descriptor `fd` close-on-exec without taking it, as `sd_listen_fds(3)` does for every
/// passed descriptor before it is checked, so that a descriptor this process does not adopt (it failed a
/// check, or a neighbour did) still never leaks into a child it starts. The descriptor stays open: it is
/// not ours to close until taken. Costs one `fcntl`, two when the flag was not set yet.
///
/// Fails with [`Unfit::NotOpen`] when nothing is open under `fd`, and with [`Unfit::AlreadyTaken`] without a
/// system call when `fd` was taken: its owner made it close-on-exec, and once that owner closed it the number
/// may name an unrelated descriptor, which must be left alone.
pub fn set_close_on_exec(fd: i32) -> Result<(), Unfit> {
    let bit = bit(fd)?;
    if TAKEN.load(Ordering::Acquire) & bit != 0 {
        return Err(Unfit::AlreadyTaken);
    }
    shim::enter("fcntl_getfd").map_err(Unfit::Os)?;
    // SAFETY: fcntl(2) F_GETFD reads the descriptor flags of a number; it takes no pointers and fails with
    // EBADF on a number that is not open.
    let flags = match cvt!(unsafe { libc::fcntl(fd, libc::F_GETFD) }) {
        Ok(flags) => flags,
        Err(error) if error.raw_os_error() == Some(libc::EBADF) => return Err(Unfit::NotOpen),
        Err(error) => return Err(Unfit::Os(error)),
    };
    if flags & libc::FD_CLOEXEC != 0 {
        return Ok(());
    }
    shim::enter("fcntl_setfd").map_err(Unfit::Os)?;
    // SAFETY: fcntl(2) F_SETFD sets the descriptor flags of a number; it takes no pointers. The number is in
    // the range sd_listen_fds(3) hands to this process and not taken (checked above), so no owner here
    // relies on it being inheritable.
    cvt!(unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) }).map_err(Unfit::Os)?;
    Ok(())
}

/// `SO_TYPE`, `SO_PROTOCOL`, `SO_ACCEPTCONN` and `getsockname` of a borrowed descriptor.
fn verify(socket: BorrowedFd<'_>) -> Result<SocketAddr, Unfit> {
    let socket = SockRef::from(&socket);
    shim::enter("getsockopt_type").map_err(Unfit::Os)?;
    let kind = socket
        .r#type()
        .map_err(|error| match error.raw_os_error() {
            Some(libc::ENOTSOCK) => Unfit::NotSocket,
            _ => Unfit::Os(error),
        })?;
    if kind != Type::STREAM {
        return Err(Unfit::NotStream);
    }
    shim::enter("getsockopt_protocol").map_err(Unfit::Os)?;
    // 0 means the default protocol of an IP stream socket, which is TCP.
    match socket.protocol().map_err(Unfit::Os)? {
        None => {}
        Some(protocol) if protocol == Protocol::TCP || protocol == Protocol::MPTCP => {}
        Some(_) => return Err(Unfit::NotTcp),
    }
    shim::enter("getsockopt_acceptconn").map_err(Unfit::Os)?;
    if !socket.is_listener().map_err(Unfit::Os)? {
        return Err(Unfit::NotListening);
    }
    shim::enter("getsockname").map_err(Unfit::Os)?;
    socket
        .local_addr()
        .map_err(Unfit::Os)?
        .as_socket()
        .ok_or(Unfit::NotIp)
}

/// Takes inherited descriptor `fd` as a [`Listener`] after [`check_listener`]'s checks: it becomes
/// close-on-exec (systemd passes it inheritable) and non-blocking, like a listener we bind ourselves.
/// A number is taken at most once per process; a second call fails with [`Unfit::AlreadyTaken`].
pub fn take_listener(fd: i32) -> Result<Listener, Unfit> {
    let local = check_listener(fd)?;
    let bit = bit(fd)?;
    // The swap of the bit is the one point that decides ownership: of two racing callers one sees it clear.
    if TAKEN.fetch_or(bit, Ordering::AcqRel) & bit != 0 {
        return Err(Unfit::AlreadyTaken);
    }
    // SAFETY: `fd` is open and a listening socket (checked just above), sd_listen_fds(3) hands the
    // inherited range to this process, and the bit we just set makes this the only OwnedFd ever made from
    // it here, so it is closed exactly once, by this owner.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let socket = Socket::from(owned);
    shim::enter("fcntl_setfd").map_err(Unfit::Os)?;
    socket.set_cloexec(true).map_err(Unfit::Os)?;
    socket.set_nonblocking(true).map_err(Unfit::Os)?;
    debug_assert_eq!(socket.as_raw_fd(), fd);
    Ok(Listener::inherited(socket, local))
}

/// The inode number of a pidfd for this process: what systemd puts in `LISTEN_PIDFDID` (on kernels whose
/// pidfds have unique inodes, 6.9 and later), so a process that reuses our pid cannot be confused with us.
pub fn own_pidfd_id() -> io::Result<u64> {
    let pidfd = crate::pidfd::PidFd::open(std::process::id())?;
    shim::enter("fstat")?;
    let mut status = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstat(2) writes one `struct stat` into `status`, a live buffer of exactly that type; the
    // descriptor stays open for the call because `pidfd` lives to the end of this function.
    cvt!(unsafe {
        libc::fstat(
            std::os::fd::AsFd::as_fd(&pidfd).as_raw_fd(),
            status.as_mut_ptr(),
        )
    })?;
    // SAFETY: fstat succeeded, so it initialised the whole struct.
    let status = unsafe { status.assume_init() };
    Ok(status.st_ino)
}

/// Removes `LISTEN_PID`, `LISTEN_PIDFDID`, `LISTEN_FDS` and `LISTEN_FDNAMES` from the environment, so that a
/// child we start does not try to take the same descriptors.
///
/// Call it before starting threads that read the environment outside Rust's `std::env` (C libraries calling
/// `getenv`): `std::env` serialises its own readers and writers, C code does not.
pub fn clear_activation_variables() {
    for name in [
        "LISTEN_PID",
        "LISTEN_PIDFDID",
        "LISTEN_FDS",
        "LISTEN_FDNAMES",
    ] {
        // SAFETY: remove_var is unsafe because another thread may read the environment without std's lock
        // (a C getenv). The function's contract above leaves that to the caller, as sd_listen_fds(3) does for
        // its unset_environment flag; every std reader takes the same lock as this call.
        unsafe { std::env::remove_var(name) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_outside_the_inherited_range_are_refused_without_a_system_call() {
        for fd in [-1, 0, 1, 2, FIRST_INHERITED + INHERITED_MAX as i32] {
            assert!(
                matches!(check_listener(fd), Err(Unfit::OutOfRange)),
                "fd {fd} was not refused as out of range"
            );
        }
    }

    #[test]
    fn a_listener_passes_and_a_connected_socket_or_a_file_do_not() {
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let numbers = [listener.as_raw_fd(), stream.as_raw_fd(), file.as_raw_fd()];
        assert!(
            numbers.iter().all(|fd| bit(*fd).is_ok()),
            "the test's descriptors {numbers:?} fell outside the inherited range"
        );
        // Only checked, never taken: std owns these.
        assert_eq!(
            check_listener(listener.as_raw_fd()).ok(),
            listener.local_addr().ok(),
            "a listening TCP socket did not pass with its address"
        );
        assert!(
            matches!(check_listener(stream.as_raw_fd()), Err(Unfit::NotListening)),
            "a connected socket passed as a listener"
        );
        assert!(
            matches!(check_listener(file.as_raw_fd()), Err(Unfit::NotSocket)),
            "a file passed as a socket"
        );
        let datagram = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(
            matches!(check_listener(datagram.as_raw_fd()), Err(Unfit::NotStream)),
            "a UDP socket passed as a stream socket"
        );
        let path = std::env::temp_dir().join(format!("net-io-inherit-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let unix = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let unix_result = check_listener(unix.as_raw_fd());
        drop(unix);
        let _ = std::fs::remove_file(&path);
        assert!(
            matches!(unix_result, Err(Unfit::NotIp)),
            "a Unix listener passed as a TCP listener: {unix_result:?}"
        );
    }

    #[test]
    fn close_on_exec_is_set_on_an_inheritable_descriptor_and_never_outside_the_inherited_range() {
        use std::os::fd::AsRawFd;
        // An inheritable pipe end stands in for a passed descriptor; std makes its own close-on-exec.
        let (reader, writer) = std::io::pipe().unwrap();
        let fd = reader.as_raw_fd();
        assert!(bit(fd).is_ok(), "fd {fd} fell outside the inherited range");
        let flags = |fd: i32| {
            // SAFETY: F_GETFD takes no pointers; `fd` is open while `reader` lives.
            unsafe { libc::fcntl(fd, libc::F_GETFD) }
        };
        // SAFETY: F_SETFD takes no pointers; `reader` owns `fd` and lives to the end of the test.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }, 0);
        assert_eq!(
            flags(fd) & libc::FD_CLOEXEC,
            0,
            "the pipe stayed close-on-exec"
        );
        set_close_on_exec(fd).expect("an open descriptor could not be made close-on-exec");
        assert_ne!(
            flags(fd) & libc::FD_CLOEXEC,
            0,
            "set_close_on_exec left the descriptor inheritable"
        );
        set_close_on_exec(fd).expect("a descriptor already close-on-exec was refused");
        drop((reader, writer));
        // (Not asked again now it is closed: a test on another thread may already have the number.)
        assert!(
            matches!(set_close_on_exec(2), Err(Unfit::OutOfRange)),
            "stderr was touched as if it were inherited"
        );
    }

    #[test]
    fn a_pidfd_of_our_own_process_has_an_inode() {
        assert!(
            own_pidfd_id().is_ok_and(|inode| inode > 0),
            "no pidfd inode for our own process"
        );
    }
}
