//! An `eventfd(2)` counter: the wake used by worker waits, accept threads and the task runtime's manager.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{cvt, shim};

/// A non-blocking, close-on-exec eventfd. Many threads may [`signal`](EventFd::signal) it; one drains it.
///
/// Besides the kernel's counter it keeps a count of signals in memory ([`signals`](EventFd::signals)), so the
/// draining thread can tell without a system call whether anyone signalled since it last looked.
#[derive(Debug)]
pub struct EventFd {
    descriptor: OwnedFd,
    /// Signals made so far, each counted after its write: a count seen here means the descriptor was
    /// readable (or drained since) by then.
    signals: AtomicU64,
}

impl EventFd {
    /// Creates an eventfd with a counter of zero.
    pub fn new() -> io::Result<Self> {
        shim::enter("eventfd")?;
        // SAFETY: eventfd(2) takes no pointers; a non-negative return is a new descriptor we own alone.
        let raw = cvt!(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: `raw` was just returned by eventfd(2) and is owned by nobody else.
        let descriptor = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Self {
            descriptor,
            signals: AtomicU64::new(0),
        })
    }

    /// Adds one to the counter, making the descriptor readable. Never blocks; a full counter is already readable.
    ///
    /// The in-memory count ([`signals`](EventFd::signals)) goes up after the write, also when the write fails.
    pub fn signal(&self) -> io::Result<()> {
        let result = self.write_one();
        // Release: whatever the signaller did before (queued work) is visible to a thread that sees the count.
        self.signals.fetch_add(1, Ordering::Release);
        result
    }

    /// Signals made so far. A reader that remembers the count it last acted on knows, without a system call,
    /// whether a signal came since: the count moved. Every signal counted here had made the descriptor
    /// readable before it was counted.
    pub fn signals(&self) -> u64 {
        self.signals.load(Ordering::Acquire)
    }

    fn write_one(&self) -> io::Result<()> {
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
            Err(error) if error.kind() == io::ErrorKind::Interrupted => self.write_one(),
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

    #[test]
    fn the_signal_count_moves_with_each_signal_and_not_with_a_drain() {
        let wake = EventFd::new().expect("eventfd");
        assert_eq!(wake.signals(), 0, "a new eventfd should count no signal");
        wake.signal().expect("signal");
        wake.signal().expect("signal");
        assert_eq!(wake.signals(), 2, "two signals should count 2");
        wake.drain().expect("drain");
        assert_eq!(
            wake.signals(),
            2,
            "a drain should leave the signal count alone (readers compare it with what they saw)"
        );
    }
}
