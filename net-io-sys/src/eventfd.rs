//! An `eventfd(2)` counter: the wake used by worker waits, accept threads and the task runtime's manager.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::{cvt, shim};

/// A non-blocking, close-on-exec eventfd. Many threads may [`signal`](EventFd::signal) it; one drains it.
#[derive(Debug)]
pub struct EventFd {
    descriptor: OwnedFd,
}

impl EventFd {
    /// Creates an eventfd with a counter of zero.
    pub fn new() -> io::Result<Self> {
        shim::enter("eventfd")?;
        // SAFETY: eventfd(2) takes no pointers; a non-negative return is a new descriptor we own alone.
        let raw = cvt!(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: `raw` was just returned by eventfd(2) and is owned by nobody else.
        let descriptor = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Self { descriptor })
    }

    /// Adds one to the counter, making the descriptor readable. Never blocks; a full counter is already readable.
    pub fn signal(&self) -> io::Result<()> {
        let one: u64 = 1;
        shim::enter("eventfd_write")?;
        // SAFETY: writes 8 bytes from a live u64 to a descriptor we own (eventfd(2): writes must be 8 bytes).
        let result = unsafe {
            libc::write(
                self.descriptor.as_raw_fd(),
                (&one as *const u64).cast(),
                size_of::<u64>(),
            )
        };
        match cvt!(result) {
            Ok(_) => Ok(()),
            // EAGAIN means the counter is at its maximum, so the descriptor is readable already.
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => Ok(()),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => self.signal(),
            Err(error) => Err(error),
        }
    }

    /// Reads and resets the counter; returns 0 when nothing was signalled.
    pub fn drain(&self) -> io::Result<u64> {
        let mut value: u64 = 0;
        shim::enter("eventfd_read")?;
        // SAFETY: reads 8 bytes into a live u64 from a descriptor we own (eventfd(2): reads must be 8 bytes).
        let result = unsafe {
            libc::read(
                self.descriptor.as_raw_fd(),
                (&mut value as *mut u64).cast(),
                size_of::<u64>(),
            )
        };
        match cvt!(result) {
            Ok(_) => Ok(value),
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => self.drain(),
            Err(error) => Err(error),
        }
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.descriptor.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::EventFd;

    #[test]
    fn signals_add_up_and_a_drain_resets_the_counter() {
        let wake = EventFd::new().expect("eventfd");
        assert_eq!(
            wake.drain().expect("drain"),
            0,
            "a new eventfd should read as empty"
        );
        wake.signal().expect("signal");
        wake.signal().expect("signal");
        assert_eq!(
            wake.drain().expect("drain"),
            2,
            "two signals should read as 2"
        );
        assert_eq!(
            wake.drain().expect("drain"),
            0,
            "a drain should reset the counter"
        );
    }
}
