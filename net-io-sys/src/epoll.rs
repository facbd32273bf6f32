//! An `epoll(7)` instance: register descriptors with a `u64` token and wait for readiness into a caller's buffer.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

use crate::{cvt, shim};

/// Readiness a registration asks for, and readiness an event reports (the `EPOLL*` bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Interest(u32);

impl Interest {
    /// Data can be read, or a peer connected to a listener (`EPOLLIN`).
    pub const READABLE: Interest = Interest(libc::EPOLLIN as u32);
    /// Data can be written, or a connect finished (`EPOLLOUT`).
    pub const WRITABLE: Interest = Interest(libc::EPOLLOUT as u32);
    /// The peer shut its writing half (`EPOLLRDHUP`).
    pub const READ_CLOSED: Interest = Interest(libc::EPOLLRDHUP as u32);
    /// Report edges instead of levels (`EPOLLET`).
    pub const EDGE: Interest = Interest(libc::EPOLLET as u32);
    /// Disarm after one event until re-armed with [`Epoll::modify`] (`EPOLLONESHOT`).
    pub const ONESHOT: Interest = Interest(libc::EPOLLONESHOT as u32);
    /// The descriptor hung up (`EPOLLHUP`, always reported).
    pub const HANG_UP: Interest = Interest(libc::EPOLLHUP as u32);
    /// The descriptor has an error pending (`EPOLLERR`, always reported).
    pub const ERROR: Interest = Interest(libc::EPOLLERR as u32);

    /// The raw `EPOLL*` bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Builds an interest from raw `EPOLL*` bits.
    pub fn from_bits(bits: u32) -> Self {
        Interest(bits)
    }

    /// Whether every bit of `other` is set in `self`.
    pub fn contains(self, other: Interest) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether any bit of `other` is set in `self`.
    pub fn intersects(self, other: Interest) -> bool {
        self.0 & other.0 != 0
    }
}

impl std::ops::BitOr for Interest {
    type Output = Interest;
    fn bitor(self, other: Interest) -> Interest {
        Interest(self.0 | other.0)
    }
}

/// One readiness report: the token given at registration and the readiness bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// The token the descriptor was registered with.
    pub token: u64,
    /// What the descriptor is ready for; hang-up and error count as both readable and writable.
    pub readiness: Interest,
}

/// A reusable buffer that [`Epoll::wait`] fills; its capacity is the most events one wait returns.
#[derive(Debug)]
pub struct Events {
    raw: Vec<libc::epoll_event>,
    filled: usize,
}

impl Events {
    /// A buffer that takes up to `capacity` events per wait (at least one).
    pub fn with_capacity(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            raw: vec![libc::epoll_event { events: 0, u64: 0 }; capacity],
            filled: 0,
        }
    }

    /// The events the last wait returned.
    pub fn iter(&self) -> impl Iterator<Item = Event> + '_ {
        self.raw[..self.filled].iter().map(|raw| {
            // Copy out of the (packed on x86-64) struct before use.
            let bits = raw.events;
            let token = raw.u64;
            Event {
                token,
                readiness: Interest(bits),
            }
        })
    }

    /// How many events the last wait returned.
    pub fn len(&self) -> usize {
        self.filled
    }

    /// Whether the last wait returned no events (it timed out).
    pub fn is_empty(&self) -> bool {
        self.filled == 0
    }
}

/// An epoll instance, close-on-exec. Registration and waiting may happen on different threads.
///
/// ```
/// use std::os::fd::AsFd;
/// use std::time::Duration;
///
/// use net_io_sys::epoll::{Epoll, Events, Interest};
/// use net_io_sys::eventfd::EventFd;
///
/// let epoll = Epoll::new()?;
/// let wake = EventFd::new()?;
/// epoll.add(wake.as_fd(), 7, Interest::READABLE)?;
/// wake.signal()?;
/// let mut events = Events::with_capacity(8);
/// assert_eq!(epoll.wait(&mut events, Some(Duration::from_secs(5)))?, 1);
/// assert_eq!(events.iter().next().map(|event| event.token), Some(7), "the eventfd's token");
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct Epoll {
    descriptor: OwnedFd,
}

impl Epoll {
    /// Creates an epoll instance (`epoll_create1(EPOLL_CLOEXEC)`).
    pub fn new() -> io::Result<Self> {
        shim::enter("epoll_create1")?;
        // SAFETY: epoll_create1(2) takes no pointers; a non-negative return is a new descriptor we own alone.
        let raw = cvt!(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `raw` was just returned by epoll_create1(2) and nobody else owns it.
        let descriptor = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Self { descriptor })
    }

    /// Registers `fd` with `token`; a second registration of the same open file is `EEXIST`.
    pub fn add(&self, fd: BorrowedFd<'_>, token: u64, interest: Interest) -> io::Result<()> {
        shim::enter("epoll_ctl")?;
        self.control(libc::EPOLL_CTL_ADD, fd, token, interest)
    }

    /// Changes the token and interest of a registered `fd`; also re-arms a one-shot registration.
    pub fn modify(&self, fd: BorrowedFd<'_>, token: u64, interest: Interest) -> io::Result<()> {
        shim::enter("epoll_ctl")?;
        self.control(libc::EPOLL_CTL_MOD, fd, token, interest)
    }

    /// Removes `fd`. Call it before closing a descriptor that may have duplicates.
    pub fn delete(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        shim::enter("epoll_ctl")?;
        self.control(libc::EPOLL_CTL_DEL, fd, 0, Interest(0))
    }

    /// Waits up to `timeout` (`None` waits forever) and fills `events`; returns how many arrived.
    ///
    /// The timeout is rounded up to whole milliseconds so a wait never ends early. `EINTR` is returned
    /// as zero events, because the caller re-checks its own deadline anyway.
    pub fn wait(&self, events: &mut Events, timeout: Option<Duration>) -> io::Result<usize> {
        let milliseconds = match timeout {
            None => -1,
            Some(timeout) => {
                let rounded = timeout.as_nanos().div_ceil(1_000_000);
                rounded.min(i32::MAX as u128) as i32
            }
        };
        shim::enter("epoll_wait")?;
        let capacity = events.raw.len().min(i32::MAX as usize) as i32;
        // SAFETY: the buffer holds `capacity` initialised epoll_event values and lives across the call
        // (epoll_wait(2) writes at most maxevents entries).
        let result = unsafe {
            libc::epoll_wait(
                self.descriptor.as_raw_fd(),
                events.raw.as_mut_ptr(),
                capacity,
                milliseconds,
            )
        };
        match cvt!(result) {
            Ok(count) => {
                events.filled = count as usize;
                Ok(events.filled)
            }
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {
                events.filled = 0;
                Ok(0)
            }
            Err(error) => {
                events.filled = 0;
                Err(error)
            }
        }
    }

    fn control(
        &self,
        operation: i32,
        fd: BorrowedFd<'_>,
        token: u64,
        interest: Interest,
    ) -> io::Result<()> {
        let mut event = libc::epoll_event {
            events: interest.0,
            u64: token,
        };
        // SAFETY: both descriptors are live for the call (the borrow proves it for `fd`) and `event` is a
        // valid epoll_event; DEL ignores it on kernels after 2.6.9 (epoll_ctl(2)).
        cvt!(unsafe {
            libc::epoll_ctl(
                self.descriptor.as_raw_fd(),
                operation,
                fd.as_raw_fd(),
                &mut event,
            )
        })?;
        Ok(())
    }
}

impl AsFd for Epoll {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.descriptor.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::{Epoll, Events, Interest};
    use crate::eventfd::EventFd;
    use std::os::fd::AsFd;
    use std::time::Duration;

    #[test]
    fn a_signalled_eventfd_is_reported_with_its_token() {
        let epoll = Epoll::new().expect("epoll");
        let wake = EventFd::new().expect("eventfd");
        epoll
            .add(wake.as_fd(), 77, Interest::READABLE)
            .expect("add");
        let mut events = Events::with_capacity(4);
        let count = epoll
            .wait(&mut events, Some(Duration::from_millis(1)))
            .expect("wait");
        assert_eq!(
            count, 0,
            "nothing was signalled, so nothing should be ready"
        );
        wake.signal().expect("signal");
        epoll
            .wait(&mut events, Some(Duration::from_secs(5)))
            .expect("wait");
        let event = events.iter().next().expect("the eventfd should be ready");
        assert_eq!(
            event.token, 77,
            "the event should carry the registered token"
        );
        assert!(
            event.readiness.contains(Interest::READABLE),
            "it should read as readable"
        );
        epoll.delete(wake.as_fd()).expect("delete");
    }

    #[test]
    fn a_second_add_of_one_descriptor_is_refused() {
        let epoll = Epoll::new().expect("epoll");
        let wake = EventFd::new().expect("eventfd");
        epoll.add(wake.as_fd(), 1, Interest::READABLE).expect("add");
        let error = epoll
            .add(wake.as_fd(), 2, Interest::READABLE)
            .expect_err("a second add should fail");
        assert_eq!(
            error.raw_os_error(),
            Some(libc::EEXIST),
            "it should be EEXIST"
        );
    }
}
