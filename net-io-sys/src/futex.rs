//! `futex(2)` wait and wake on an `AtomicU32`: the per-task and per-thread sleep of the task runtime.

use std::io;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use crate::shim;

/// Why a [`wait`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// A wake arrived, or the wait ended spuriously (signal): re-check the word.
    Woken,
    /// The word did not hold the expected value, so the thread never slept.
    Changed,
    /// The timeout passed.
    TimedOut,
}

/// Sleeps while `word` holds `expected`, for at most `timeout` (`None` sleeps until woken).
///
/// Uses the process-private futex operations, which are correct because the word lives in ordinary
/// private memory of this process.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) -> io::Result<Wake> {
    let specification = timeout.map(|timeout| libc::timespec {
        tv_sec: timeout.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    });
    let pointer = specification
        .as_ref()
        .map_or(std::ptr::null(), |value| value as *const libc::timespec);
    shim::enter("futex_wait")?;
    // SAFETY: `word` is a live, aligned u32 for the whole call and the timeout pointer is null or points
    // at a live timespec (futex(2), FUTEX_WAIT: a relative timeout).
    let result = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            pointer,
        )
    };
    if result == 0 {
        return Ok(Wake::Woken);
    }
    let error = io::Error::last_os_error();
    match error.raw_os_error() {
        Some(libc::EAGAIN) => Ok(Wake::Changed),
        Some(libc::EINTR) => Ok(Wake::Woken),
        Some(libc::ETIMEDOUT) => Ok(Wake::TimedOut),
        _ => Err(error),
    }
}

/// Wakes up to `count` threads sleeping on `word`; returns how many were woken.
pub fn wake(word: &AtomicU32, count: u32) -> usize {
    let count = count.min(i32::MAX as u32) as i32;
    // A shim fault cannot be returned here (a lost wake would hang a waiter), so the site is only counted.
    let _ = shim::enter("futex_wake");
    // SAFETY: `word` is a live, aligned u32; FUTEX_WAKE reads no other pointer (futex(2)).
    let result = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            count,
        )
    };
    result.max(0) as usize
}

/// Wakes every thread sleeping on `word`.
pub fn wake_all(word: &AtomicU32) -> usize {
    wake(word, i32::MAX as u32)
}

#[cfg(test)]
mod tests {
    use super::{Wake, wait, wake};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::time::{Duration, Instant};

    #[test]
    fn a_changed_word_never_sleeps_and_a_timeout_returns() {
        let word = AtomicU32::new(5);
        assert_eq!(wait(&word, 4, None).expect("wait"), Wake::Changed);
        assert_eq!(
            wait(&word, 5, Some(Duration::from_millis(5))).expect("wait"),
            Wake::TimedOut,
            "nobody wakes the word, so the wait should time out"
        );
    }

    #[test]
    fn a_wake_ends_a_wait_long_before_its_timeout() {
        // The word never changes, so nothing but a wake (or a signal, also reported as Woken) can end the wait
        // before its timeout. A wake sent before the waiter sleeps is lost, so the wakes repeat until the
        // waiter is done.
        const TIMEOUT: Duration = Duration::from_secs(10);
        let word = Arc::new(AtomicU32::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (word, done) = (Arc::clone(&word), Arc::clone(&done));
            std::thread::spawn(move || {
                let started = Instant::now();
                let outcome = wait(&word, 0, Some(TIMEOUT)).expect("wait");
                done.store(true, Ordering::Release);
                (outcome, started.elapsed())
            })
        };
        let mut woken = 0;
        while !done.load(Ordering::Acquire) {
            woken += wake(&word, 1);
            std::thread::sleep(Duration::from_millis(1));
        }
        let (outcome, waited) = waiter.join().expect("the waiter panicked");
        assert_eq!(
            outcome,
            Wake::Woken,
            "the wait ended as {outcome:?} after {waited:?} although wakes were sent all along"
        );
        // Half the timeout: a woken thread on a loaded 2-core machine gets a core within milliseconds, and a
        // wait that wake did not end would run the full 10 s.
        assert!(
            waited < TIMEOUT / 2,
            "the wait took {waited:?} of its {TIMEOUT:?} timeout: the wakes did not end it"
        );
        assert_eq!(
            woken, 1,
            "wake should report the one sleeping waiter it woke, once"
        );
    }
}
