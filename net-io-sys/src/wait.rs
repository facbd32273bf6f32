//! A `poll(2)` wait on one socket and one wake descriptor with a deadline; `EINTR` retried with the time left.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use crate::{cvt, shim};

/// Which readiness of the socket to wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interest {
    /// Data, end of stream or an error to read (`POLLIN`).
    Readable,
    /// Room in the send buffer (`POLLOUT`).
    Writable,
}

/// Why a [`wait`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// The socket is ready for the interest (or has an error or hang-up, which the next call reports).
    Socket,
    /// The wake descriptor is readable. Reported first when both are ready, so a kill is never delayed.
    Woken,
    /// The timeout passed with nothing ready.
    TimedOut,
}

/// Waits until `socket` is ready for `interest`, `wake` is readable, or `timeout` passes (`None`: no limit).
///
/// A signal (`EINTR`) restarts the wait with what is left of the timeout. The wake descriptor is not
/// drained here; the caller decides what a wake means.
pub fn wait(
    socket: BorrowedFd<'_>,
    interest: Interest,
    wake: Option<BorrowedFd<'_>>,
    timeout: Option<Duration>,
) -> io::Result<Readiness> {
    let events = match interest {
        Interest::Readable => libc::POLLIN,
        Interest::Writable => libc::POLLOUT,
    };
    let mut descriptors = [
        libc::pollfd {
            fd: socket.as_raw_fd(),
            events,
            revents: 0,
        },
        libc::pollfd {
            // A negative fd makes poll(2) ignore the entry.
            fd: wake.map_or(-1, |wake| wake.as_raw_fd()),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let deadline = timeout.and_then(|timeout| Instant::now().checked_add(timeout));
    loop {
        let milliseconds = match deadline {
            None => -1,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                // Round up so a wait never returns a hair before the deadline and spins.
                let rounded = left.as_micros().div_ceil(1000);
                i32::try_from(rounded).unwrap_or(i32::MAX)
            }
        };
        shim::enter("poll")?;
        // SAFETY: poll(2) reads and writes exactly `descriptors.len()` live pollfd entries; both descriptors
        // are borrowed for the call, so they stay open.
        let result = cvt!(unsafe {
            libc::poll(
                descriptors.as_mut_ptr(),
                descriptors.len() as libc::nfds_t,
                milliseconds,
            )
        });
        match result {
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
            Ok(0) => {
                if deadline.is_some_and(|deadline| Instant::now() < deadline) {
                    continue;
                }
                return Ok(Readiness::TimedOut);
            }
            Ok(_) => {
                if descriptors[1].revents != 0 {
                    return Ok(Readiness::Woken);
                }
                return Ok(Readiness::Socket);
            }
        }
    }
}

/// Waits until `descriptor` is readable or `timeout` passes; for a wake descriptor alone (parking).
pub fn wait_readable(descriptor: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<bool> {
    Ok(wait(descriptor, Interest::Readable, None, timeout)? == Readiness::Socket)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eventfd::EventFd;
    use std::os::fd::AsFd;

    #[test]
    fn a_wait_on_silent_descriptors_times_out_and_a_signalled_wake_wins() {
        let socket_stand_in = EventFd::new().unwrap();
        let wake = EventFd::new().unwrap();
        let started = Instant::now();
        let readiness = wait(
            socket_stand_in.as_fd(),
            Interest::Readable,
            Some(wake.as_fd()),
            Some(Duration::from_millis(20)),
        )
        .unwrap();
        assert_eq!(readiness, Readiness::TimedOut);
        assert!(
            started.elapsed() >= Duration::from_millis(20),
            "the wait returned before its deadline"
        );
        socket_stand_in.signal().unwrap();
        wake.signal().unwrap();
        let readiness = wait(
            socket_stand_in.as_fd(),
            Interest::Readable,
            Some(wake.as_fd()),
            None,
        )
        .unwrap();
        assert_eq!(
            readiness,
            Readiness::Woken,
            "a wake should be reported first"
        );
        wake.drain().unwrap();
        let readiness = wait(
            socket_stand_in.as_fd(),
            Interest::Readable,
            Some(wake.as_fd()),
            None,
        )
        .unwrap();
        assert_eq!(readiness, Readiness::Socket);
    }
}
