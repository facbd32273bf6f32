//! The [`Clock`] every deadline is computed from: [`SystemClock`] in production, [`ManualClock`] in tests.

use std::fmt::Debug;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How far ahead a deadline too far to represent is put instead: about 136 years, "never" for a connection.
const FAR_FUTURE: Duration = Duration::from_secs(1 << 32);

/// The deadline `timeout` after `now`, without the panic of `Instant + Duration` on overflow.
///
/// A timeout of `Duration::MAX` (from the limits or from a session's request) is a valid way to say "never";
/// the deadline then lies about 136 years ahead, which no wait ever reaches but every comparison still
/// orders.
pub fn deadline_after(now: Instant, timeout: Duration) -> Instant {
    now.checked_add(timeout)
        .or_else(|| now.checked_add(FAR_FUTURE))
        .unwrap_or(now)
}

/// A source of the current time. Injected so tests can move time by hand.
pub trait Clock: Send + Sync + Debug + 'static {
    /// The current time.
    fn now(&self) -> Instant;
}

/// The monotonic system clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that only moves when told to. Starts at the real time of its creation.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Instant>,
}

impl ManualClock {
    /// A clock frozen at the current real time.
    pub fn new() -> ManualClock {
        ManualClock::starting_at(Instant::now())
    }

    /// A clock frozen at `start`.
    pub fn starting_at(start: Instant) -> ManualClock {
        ManualClock {
            now: Mutex::new(start),
        }
    }

    /// Moves the clock forward by `step`.
    pub fn advance(&self, step: Duration) {
        let mut now = self.now.lock().unwrap_or_else(|poison| poison.into_inner());
        *now += step;
    }

    /// Sets the clock to `time`; a time before the current one is ignored, so the clock never runs back.
    pub fn set(&self, time: Instant) {
        let mut now = self.now.lock().unwrap_or_else(|poison| poison.into_inner());
        if time > *now {
            *now = time;
        }
    }
}

impl Default for ManualClock {
    fn default() -> ManualClock {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        *self.now.lock().unwrap_or_else(|poison| poison.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told_and_never_backwards() {
        let clock = ManualClock::new();
        let start = clock.now();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(clock.now(), start, "a manual clock moved by itself");
        clock.advance(Duration::from_secs(3));
        assert_eq!(clock.now(), start + Duration::from_secs(3));
        clock.set(start);
        assert_eq!(
            clock.now(),
            start + Duration::from_secs(3),
            "the clock ran backwards"
        );
    }
}
