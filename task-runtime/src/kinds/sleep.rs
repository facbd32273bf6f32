//! `Sleep`: parks on the manager's timer heap (no thread held); precise mode spins the last stretch.

use std::time::{Duration, Instant};

use crate::task::{Step, Task, Wait, sealed};

/// How close to the deadline a precise sleep gets by spinning on its worker.
pub(crate) const PRECISE_SPIN: Duration = Duration::from_micros(150);

/// How exact a sleep is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SleepMode {
    /// Wakes from the timer a little early and spins on a worker to the deadline (default).
    #[default]
    Precise,
    /// Wakes from the timer only: tens of microseconds late, no spinning.
    Relaxed,
}

/// A sleep task; its output is the time actually slept, measured from the start of the run.
#[derive(Debug, Clone)]
pub struct Sleep {
    length: Option<Duration>,
    until: Option<Instant>,
    mode: SleepMode,
    started: Option<Instant>,
    deadline: Option<Instant>,
}

impl Sleep {
    /// Sleeps for `duration` from the start of each run.
    // The name mirrors atap (`Compute::compute`, `Sleep::sleep`) so its users feel at home.
    #[allow(clippy::self_named_constructors)]
    pub fn sleep(duration: Duration) -> Self {
        Sleep {
            length: Some(duration),
            until: None,
            mode: SleepMode::Precise,
            started: None,
            deadline: None,
        }
    }

    /// Sleeps until `deadline` (a deadline in the past returns at once).
    pub fn until(deadline: Instant) -> Self {
        Sleep {
            length: None,
            until: Some(deadline),
            mode: SleepMode::Precise,
            started: None,
            deadline: None,
        }
    }

    /// Chooses precise or relaxed.
    pub fn mode(mut self, mode: SleepMode) -> Self {
        self.mode = mode;
        self
    }

    /// Shorthand for `mode(SleepMode::Relaxed)`.
    pub fn relaxed(self) -> Self {
        self.mode(SleepMode::Relaxed)
    }
}

impl sealed::Sealed for Sleep {}

impl Task for Sleep {
    type Input = ();
    type Output = Duration;

    fn start(&mut self, _input: ()) {
        let now = Instant::now();
        self.started = Some(now);
        self.deadline = Some(match (self.length, self.until) {
            (Some(length), _) => now + length,
            (None, Some(until)) => until,
            (None, None) => now,
        });
    }

    fn step(&mut self) -> Step<Duration> {
        let now = Instant::now();
        let started = *self.started.get_or_insert(now);
        let deadline = *self.deadline.get_or_insert(now);
        if now >= deadline {
            return Step::Done(Ok(now - started));
        }
        let left = deadline - now;
        match self.mode {
            SleepMode::Precise if left <= PRECISE_SPIN => {
                while Instant::now() < deadline {
                    std::hint::spin_loop();
                }
                Step::Done(Ok(Instant::now() - started))
            }
            SleepMode::Precise => Step::Park(Wait::until(deadline - PRECISE_SPIN)),
            SleepMode::Relaxed => Step::Park(Wait::until(deadline)),
        }
    }
}
