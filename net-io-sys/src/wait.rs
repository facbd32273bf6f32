//! `poll(2)` waits with a deadline: one socket and one wake descriptor, or any of a few readable descriptors;
//! `EINTR` retried with the time left.

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
    if poll_until(&mut descriptors, timeout)? == 0 {
        return Ok(Readiness::TimedOut);
    }
    if descriptors[1].revents != 0 {
        return Ok(Readiness::Woken);
    }
    Ok(Readiness::Socket)
}

/// Most descriptors one [`wait_any_readable`] watches (it keeps them on the stack).
pub const WAIT_ANY_MAX: usize = 8;

/// Waits until one of `descriptors` is readable (data, end of stream, an error or hang-up to read) or
/// `timeout` passes (`None`: no limit); returns the index of the first readable one, `None` at the timeout.
///
/// For a caller that reads several sockets from one thread (stage 0 with its link down the chain and the
/// link tokens come back on). At most [`WAIT_ANY_MAX`] descriptors; more are an `InvalidInput` error.
pub fn wait_any_readable(
    descriptors: &[BorrowedFd<'_>],
    timeout: Option<Duration>,
) -> io::Result<Option<usize>> {
    if descriptors.len() > WAIT_ANY_MAX {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a wait watches at most {WAIT_ANY_MAX} descriptors, not {}",
                descriptors.len()
            ),
        ));
    }
    let mut entries = [libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    }; WAIT_ANY_MAX];
    for (entry, descriptor) in entries.iter_mut().zip(descriptors) {
        entry.fd = descriptor.as_raw_fd();
        entry.events = libc::POLLIN;
    }
    let entries = &mut entries[..descriptors.len()];
    if poll_until(entries, timeout)? == 0 {
        return Ok(None);
    }
    Ok(entries.iter().position(|entry| entry.revents != 0))
}

/// `poll(2)` over `descriptors` until one is ready or `timeout` passes; returns how many are ready (0: the
/// timeout). A signal restarts the wait with what is left; an early wake-up short of the deadline waits on.
fn poll_until(descriptors: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
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
        // SAFETY: poll(2) reads and writes exactly `descriptors.len()` live pollfd entries; every descriptor
        // in them is borrowed by the caller for the call (or negative, which poll ignores), so it stays open.
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
                return Ok(0);
            }
            Ok(ready) => return Ok(usize::try_from(ready).unwrap_or(1)),
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

    #[test]
    fn a_wait_on_several_descriptors_names_the_first_readable_one_or_times_out() {
        let descriptors: Vec<EventFd> = (0..3).map(|_| EventFd::new().unwrap()).collect();
        let borrowed: Vec<BorrowedFd<'_>> = descriptors.iter().map(|fd| fd.as_fd()).collect();
        let started = Instant::now();
        assert_eq!(
            wait_any_readable(&borrowed, Some(Duration::from_millis(20))).unwrap(),
            None,
            "nothing is readable, so the wait should time out"
        );
        assert!(
            started.elapsed() >= Duration::from_millis(20),
            "the wait returned before its deadline"
        );
        descriptors[2].signal().unwrap();
        assert_eq!(
            wait_any_readable(&borrowed, None).unwrap(),
            Some(2),
            "the third descriptor is the readable one"
        );
        descriptors[1].signal().unwrap();
        assert_eq!(
            wait_any_readable(&borrowed, None).unwrap(),
            Some(1),
            "with two readable, the first of them is named"
        );
        let too_many: Vec<BorrowedFd<'_>> = (0..=WAIT_ANY_MAX).map(|_| borrowed[0]).collect();
        let error = wait_any_readable(&too_many, None).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput, "{error}");
    }
}
