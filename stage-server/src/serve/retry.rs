//! When a stage tries its connect to the next stage again: a doubling backoff inside a time budget, so a next
//! stage that is restarting (or not yet listening) is waited for briefly, and one that is down is reported soon.
//!
//! ```text
//!   attempt 1 ─✗─ 25 ms ─ attempt 2 ─✗─ 50 ms ─ attempt 3 ─✗─ 100 ms ─ … ─ (budget spent) ─▶ StageDown
//! ```
//!
//! Only a failure to reach the next stage is tried again (refused, timed out, or closed before it answered the
//! hello); an answer that refuses the link (another model, a gap in the layers, a wrong key) is final. The
//! timer between attempts is a task-runtime task that wakes the upstream link, so a wait holds no thread.

use std::time::{Duration, Instant};

use net_io_blocking::Completer;
use task_runtime::{Compute, Runtime};

/// The completion token of a retry timer.
pub(crate) const RETRY_TOKEN: u64 = 5;
/// The wait before the second attempt; each later wait doubles, up to [`RETRY_GAP_MAX`].
const RETRY_GAP_FIRST: Duration = Duration::from_millis(25);
/// The longest wait between two attempts.
const RETRY_GAP_MAX: Duration = Duration::from_millis(400);

/// The attempts of one upstream link at reaching the next stage.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Retries {
    started: Instant,
    budget: Duration,
    attempts: u32,
}

impl Retries {
    /// The first attempt, starting at `now`; later ones may start until `budget` after it.
    pub(crate) fn new(now: Instant, budget: Duration) -> Retries {
        Retries {
            started: now,
            budget,
            attempts: 1,
        }
    }

    /// Attempts made so far.
    pub(crate) fn attempts(&self) -> u32 {
        self.attempts
    }

    /// How long the attempts have taken by `now`.
    pub(crate) fn elapsed(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.started)
    }

    /// The last attempt failed at `now`: the wait before the next one, or `None` once the next one would
    /// start past the budget. Counts the next attempt.
    pub(crate) fn next_gap(&mut self, now: Instant) -> Option<Duration> {
        let doublings = self.attempts.saturating_sub(1).min(16);
        let gap = RETRY_GAP_FIRST
            .saturating_mul(1 << doublings)
            .min(RETRY_GAP_MAX);
        if self.elapsed(now).saturating_add(gap) > self.budget {
            return None;
        }
        self.attempts += 1;
        Some(gap)
    }
}

/// Wakes `completer` with [`RETRY_TOKEN`] after `gap`, on a task-runtime timer.
pub(crate) fn wake_after(gap: Duration, completer: &Completer) {
    let completer = completer.clone();
    let _ = Runtime::task(Compute::compute(move |()| {
        let _ = completer.post(RETRY_TOKEN, 0);
    }))
    .after(gap)
    .spawn();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gaps_double_up_to_their_cap_and_stop_at_the_budget() {
        let start = Instant::now();
        let mut retries = Retries::new(start, Duration::from_secs(2));
        let mut now = start;
        let mut gaps = Vec::new();
        while let Some(gap) = retries.next_gap(now) {
            gaps.push(gap.as_millis());
            now += gap;
        }
        assert_eq!(
            gaps,
            vec![25, 50, 100, 200, 400, 400, 400, 400],
            "25 ms doubling to 400 ms, until the next would start past 2 s"
        );
        assert_eq!(retries.attempts(), 9, "the first attempt and eight more");
        assert!(retries.elapsed(now) <= Duration::from_secs(2));
    }

    #[test]
    fn a_zero_budget_makes_one_attempt() {
        let start = Instant::now();
        let mut retries = Retries::new(start, Duration::ZERO);
        assert_eq!(retries.next_gap(start), None);
        assert_eq!(retries.attempts(), 1);
    }

    #[test]
    fn a_slow_failure_uses_up_the_budget_too() {
        let start = Instant::now();
        let mut retries = Retries::new(start, Duration::from_secs(1));
        assert_eq!(
            retries.next_gap(start + Duration::from_millis(990)),
            None,
            "an attempt that took 990 ms to fail leaves no room for a 25 ms wait and another"
        );
    }
}
