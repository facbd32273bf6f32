//! A `timerfd(2)` on `CLOCK_MONOTONIC`, plus the monotonic clock reading and the thread timer slack it pairs with.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

use crate::{cvt, shim};

/// A non-blocking, close-on-exec timer on the monotonic clock; readable once it has expired.
#[derive(Debug)]
pub struct TimerFd {
    descriptor: OwnedFd,
}

impl TimerFd {
    /// Creates a disarmed timer.
    pub fn new() -> io::Result<Self> {
        shim::enter("timerfd_create")?;
        // SAFETY: timerfd_create(2) takes no pointers; a non-negative return is a new descriptor we own.
        let raw = cvt!(unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_CLOEXEC | libc::TFD_NONBLOCK,
            )
        })?;
        // SAFETY: `raw` was just returned by timerfd_create(2) and nobody else owns it.
        let descriptor = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Self { descriptor })
    }

    /// Arms the timer to expire once at `deadline`, a reading of [`monotonic_now`].
    ///
    /// A deadline of zero would disarm the timer, so it is raised to one nanosecond (already past).
    pub fn set_absolute(&self, deadline: Duration) -> io::Result<()> {
        let deadline = deadline.max(Duration::from_nanos(1));
        self.set(libc::TFD_TIMER_ABSTIME, deadline, Duration::ZERO)
    }

    /// Arms the timer to expire after `delay`, then every `interval` unless it is zero.
    pub fn set_relative(&self, delay: Duration, interval: Duration) -> io::Result<()> {
        let delay = delay.max(Duration::from_nanos(1));
        self.set(0, delay, interval)
    }

    /// Stops the timer; a pending expiration count is cleared.
    pub fn disarm(&self) -> io::Result<()> {
        self.set(0, Duration::ZERO, Duration::ZERO)
    }

    /// Reads and clears the number of expirations since the last read; 0 when none.
    pub fn read(&self) -> io::Result<u64> {
        let mut expirations: u64 = 0;
        shim::enter("timerfd_read")?;
        // SAFETY: reads 8 bytes into a live u64 from a descriptor we own (timerfd_create(2): reads are u64).
        let result = unsafe {
            libc::read(
                self.descriptor.as_raw_fd(),
                (&mut expirations as *mut u64).cast(),
                size_of::<u64>(),
            )
        };
        match cvt!(result) {
            Ok(_) => Ok(expirations),
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => self.read(),
            Err(error) => Err(error),
        }
    }

    fn set(&self, flags: i32, value: Duration, interval: Duration) -> io::Result<()> {
        let specification = libc::itimerspec {
            it_interval: timespec(interval),
            it_value: timespec(value),
        };
        shim::enter("timerfd_settime")?;
        // SAFETY: `specification` is a valid itimerspec for the call; the old value pointer may be null
        // (timerfd_settime(2)).
        cvt!(unsafe {
            libc::timerfd_settime(
                self.descriptor.as_raw_fd(),
                flags,
                &specification,
                std::ptr::null_mut(),
            )
        })?;
        Ok(())
    }
}

impl AsFd for TimerFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.descriptor.as_fd()
    }
}

/// Reads `CLOCK_MONOTONIC` (the clock `std::time::Instant` uses on Linux) as time since boot.
pub fn monotonic_now() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec to write; CLOCK_MONOTONIC always exists (clock_gettime(2)), so the
    // call cannot fail and no shim site is needed for a vDSO read.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// Sets the calling thread's timer slack (`PR_SET_TIMERSLACK`); 1 ns makes its timed waits wake on time.
pub fn set_thread_timer_slack(slack: Duration) -> io::Result<()> {
    let nanoseconds = slack.as_nanos().clamp(1, libc::c_ulong::MAX as u128) as libc::c_ulong;
    shim::enter("prctl")?;
    // SAFETY: PR_SET_TIMERSLACK takes an integer argument and no pointers (prctl(2)).
    cvt!(unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, nanoseconds, 0, 0, 0) })?;
    Ok(())
}

fn timespec(duration: Duration) -> libc::timespec {
    libc::timespec {
        tv_sec: duration.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: duration.subsec_nanos() as libc::c_long,
    }
}

#[cfg(test)]
mod tests {
    use super::{TimerFd, monotonic_now};
    use std::time::Duration;

    #[test]
    fn an_absolute_deadline_expires_once_it_has_passed() {
        let timer = TimerFd::new().expect("timerfd");
        assert_eq!(
            timer.read().expect("read"),
            0,
            "a new timer has no expirations"
        );
        timer
            .set_absolute(monotonic_now() + Duration::from_millis(2))
            .expect("set");
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            timer.read().expect("read"),
            1,
            "the timer should have expired once"
        );
        timer
            .set_relative(Duration::from_secs(60), Duration::ZERO)
            .expect("set");
        timer.disarm().expect("disarm");
        assert_eq!(
            timer.read().expect("read"),
            0,
            "a disarmed timer has no expirations"
        );
    }
}
