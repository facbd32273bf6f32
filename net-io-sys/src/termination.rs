//! Waiting for SIGINT or SIGTERM without a signal handler: the signals are blocked and taken with `sigwaitinfo`.
//!
//! [`TerminationSignals::block`] must run on the main thread before any other thread starts, so that every
//! thread inherits the mask and the kernel keeps the signal pending until [`TerminationSignals::wait`] takes it.

use std::io;
use std::mem::MaybeUninit;

use crate::{cvt, shim};

/// SIGINT and SIGTERM, blocked in this thread and in every thread it starts afterwards.
#[derive(Debug, Clone, Copy)]
pub struct TerminationSignals {
    set: libc::sigset_t,
}

impl TerminationSignals {
    /// Blocks SIGINT and SIGTERM in the calling thread. Call it before starting other threads.
    pub fn block() -> io::Result<Self> {
        let mut set = MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: sigemptyset(3) initialises the set it is given; sigaddset(3) reads and writes that initialised
        // set; both take a live, exclusively borrowed pointer.
        let set = unsafe {
            libc::sigemptyset(set.as_mut_ptr());
            libc::sigaddset(set.as_mut_ptr(), libc::SIGINT);
            libc::sigaddset(set.as_mut_ptr(), libc::SIGTERM);
            set.assume_init()
        };
        shim::enter("pthread_sigmask")?;
        // SAFETY: pthread_sigmask(3) reads the live set above; a null old-set pointer is allowed.
        let result = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if result != 0 {
            return Err(io::Error::from_raw_os_error(result));
        }
        Ok(Self { set })
    }

    /// Sleeps until SIGINT or SIGTERM arrives and returns its number.
    pub fn wait(&self) -> io::Result<i32> {
        loop {
            shim::enter("sigwaitinfo")?;
            // SAFETY: sigwaitinfo(2) reads the live set; a null info pointer is allowed.
            match cvt!(unsafe { libc::sigwaitinfo(&self.set, std::ptr::null_mut()) }) {
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocked_sigterm_raised_at_this_thread_is_taken_by_wait() {
        let signals = TerminationSignals::block().expect("block");
        // SAFETY: pthread_kill(3) on our own live thread with a signal we have blocked; it stays pending.
        let result = unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGTERM) };
        assert_eq!(result, 0);
        assert_eq!(signals.wait().expect("wait"), libc::SIGTERM);
    }
}
