//! A signal-counting facility: a `sigaction` handler that counts deliveries per signal and rings an eventfd.
//!
//! The handler is async-signal-safe: it does one atomic add, one `write(2)` to an eventfd whose
//! descriptor never closes, and saves and restores `errno`. A [`SignalWatch`] installs the handler for
//! one signal (reference-counted across watches) and restores the previous disposition when the last
//! watch is released.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::eventfd::EventFd;
use crate::{cvt, shim};

/// Signal numbers run from 1 to 64 on Linux.
const SIGNAL_LIMIT: usize = 65;

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);
static COUNTS: [AtomicU64; SIGNAL_LIMIT] = [ZERO; SIGNAL_LIMIT];
/// The raw eventfd the handler writes to; -1 until [`wake_descriptor`] creates it. Never closed.
static WAKE_RAW: AtomicI32 = AtomicI32::new(-1);
static WAKE: OnceLock<EventFd> = OnceLock::new();

struct Installed {
    watches: u32,
    previous: libc::sigaction,
}

// SAFETY: libc::sigaction is plain data (a handler address, a mask and flags); moving it between threads
// is sound.
unsafe impl Send for Installed {}

static INSTALLED: Mutex<Vec<Option<Installed>>> = Mutex::new(Vec::new());

/// A claim on the counting handler for one signal; dropping the last one restores the old disposition.
#[derive(Debug)]
pub struct SignalWatch {
    signal: i32,
}

impl SignalWatch {
    /// Installs the counting handler for `signal` (or adds a claim to an installed one).
    ///
    /// `SIGKILL`, `SIGSTOP`, the two glibc-reserved real-time signals and numbers outside 1..=64 are
    /// refused with `EINVAL`.
    pub fn install(signal: i32) -> io::Result<Self> {
        if !watchable(signal) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        wake_descriptor()?;
        let mut installed = INSTALLED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if installed.len() < SIGNAL_LIMIT {
            installed.resize_with(SIGNAL_LIMIT, || None);
        }
        let entry = &mut installed[signal as usize];
        if let Some(existing) = entry.as_mut() {
            existing.watches += 1;
            return Ok(Self { signal });
        }
        // SAFETY: sigaction is plain data for which all-zero bytes are valid.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = count_delivery as extern "C" fn(libc::c_int) as usize;
        action.sa_flags = libc::SA_RESTART;
        // SAFETY: sa_mask is a valid sigset_t to initialise.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: sigaction is plain data for which all-zero bytes are valid.
        let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
        shim::enter("sigaction")?;
        // SAFETY: both pointers are to live sigaction values; the handler is async-signal-safe
        // (signal-safety(7): it only uses atomics and write(2)).
        cvt!(unsafe { libc::sigaction(signal, &action, &mut previous) })?;
        *entry = Some(Installed {
            watches: 1,
            previous,
        });
        Ok(Self { signal })
    }

    /// The signal this watch counts.
    pub fn signal(&self) -> i32 {
        self.signal
    }

    /// Returns the deliveries counted since the last call for this signal, and resets the count.
    pub fn take_count(&self) -> u64 {
        take_count(self.signal)
    }
}

impl Drop for SignalWatch {
    fn drop(&mut self) {
        let mut installed = INSTALLED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(slot) = installed.get_mut(self.signal as usize) else {
            return;
        };
        let Some(entry) = slot.as_mut() else {
            return;
        };
        entry.watches -= 1;
        if entry.watches > 0 {
            return;
        }
        let previous = entry.previous;
        *slot = None;
        if shim::enter("sigaction").is_ok() {
            // SAFETY: restores the disposition saved at install; the pointer is to a live sigaction and
            // the old-action pointer may be null (sigaction(2)).
            unsafe { libc::sigaction(self.signal, &previous, std::ptr::null_mut()) };
        }
    }
}

/// Whether `signal` may be watched: 1..=64 except SIGKILL, SIGSTOP and glibc's reserved 32 and 33.
pub fn watchable(signal: i32) -> bool {
    (1..SIGNAL_LIMIT as i32).contains(&signal)
        && signal != libc::SIGKILL
        && signal != libc::SIGSTOP
        && signal != 32
        && signal != 33
}

/// Returns and resets the deliveries counted for `signal` (0 for a number out of range).
pub fn take_count(signal: i32) -> u64 {
    COUNTS
        .get(signal as usize)
        .map_or(0, |count| count.swap(0, Ordering::AcqRel))
}

/// The process-wide eventfd the handler rings; readable after any counted delivery. Drain it to re-arm.
pub fn wake_descriptor() -> io::Result<BorrowedFd<'static>> {
    if let Some(wake) = WAKE.get() {
        return Ok(wake.as_fd());
    }
    let created = EventFd::new()?;
    let wake = WAKE.get_or_init(|| created);
    WAKE_RAW.store(wake.as_fd().as_raw_fd(), Ordering::Release);
    Ok(wake.as_fd())
}

/// Drains the wake eventfd; returns how many rings were pending.
pub fn drain_wake() -> io::Result<u64> {
    match WAKE.get() {
        Some(wake) => wake.drain(),
        None => Ok(0),
    }
}

/// Sends `signal` to this whole process (`kill(getpid(), signal)`), as another process would.
pub fn send_to_self(signal: i32) -> io::Result<()> {
    shim::enter("kill")?;
    // SAFETY: kill(2) and getpid(2) take integers only and read no memory of ours.
    cvt!(unsafe { libc::kill(libc::getpid(), signal) })?;
    Ok(())
}

extern "C" fn count_delivery(signal: libc::c_int) {
    // SAFETY: __errno_location returns the calling thread's errno slot, always valid; saving and
    // restoring it keeps the interrupted code's errno intact (signal-safety(7)).
    let errno = unsafe { *libc::__errno_location() };
    if let Some(count) = COUNTS.get(signal as usize) {
        count.fetch_add(1, Ordering::AcqRel);
    }
    let raw = WAKE_RAW.load(Ordering::Acquire);
    if raw >= 0 {
        let one: u64 = 1;
        // SAFETY: write(2) is async-signal-safe; `raw` is an eventfd that is never closed once published
        // and `one` is a live u64.
        unsafe { libc::write(raw, (&one as *const u64).cast(), size_of::<u64>()) };
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

#[cfg(test)]
mod tests {
    use super::{SignalWatch, drain_wake, send_to_self, watchable};
    use std::time::{Duration, Instant};

    #[test]
    fn a_raised_signal_is_counted_and_rings_the_wake() {
        let watch = SignalWatch::install(libc::SIGUSR2).expect("install");
        watch.take_count();
        drain_wake().expect("drain");
        send_to_self(libc::SIGUSR2).expect("kill");
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut counted = 0;
        while counted == 0 && Instant::now() < deadline {
            counted += watch.take_count();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(counted, 1, "one delivery should count once");
        assert!(
            drain_wake().expect("drain") >= 1,
            "the wake eventfd should ring"
        );
        assert!(!watchable(libc::SIGKILL), "SIGKILL cannot be watched");
        assert!(
            SignalWatch::install(libc::SIGSTOP).is_err(),
            "SIGSTOP is refused"
        );
    }
}
