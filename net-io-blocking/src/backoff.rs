//! The accept thread's backoff after descriptor pressure or a kernel memory shortage: 1 ms doubling to 1 s.

use std::time::Duration;

/// The first pause.
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(1);
/// The longest pause.
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// A doubling pause that resets after a successful accept.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    next: Duration,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Self { next: BACKOFF_MIN }
    }

    /// The pause to take now; the following one is twice as long, up to [`BACKOFF_MAX`].
    pub(crate) fn step(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(BACKOFF_MAX);
        now
    }

    /// Back to the shortest pause.
    pub(crate) fn reset(&mut self) {
        self.next = BACKOFF_MIN;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_from_one_millisecond_to_one_second_and_resets() {
        let mut backoff = Backoff::new();
        let pauses: Vec<_> = (0..12).map(|_| backoff.step()).collect();
        assert_eq!(pauses[0], Duration::from_millis(1));
        assert_eq!(pauses[1], Duration::from_millis(2));
        assert_eq!(pauses[9], Duration::from_millis(512));
        assert_eq!(
            pauses[10], BACKOFF_MAX,
            "the pause should stop at one second"
        );
        assert_eq!(pauses[11], BACKOFF_MAX);
        backoff.reset();
        assert_eq!(backoff.step(), BACKOFF_MIN);
    }
}
