//! The minimum transfer rate for one direction, judged once per `check` interval.
//!
//! `net-io-core`'s [`MinRate`] keeps the ring of byte buckets and judges the rate; this wrapper remembers when
//! the next judgement is due, so the receive loop (which runs on every `recv`) pays one comparison between
//! checks and tells the socket wait when to wake up for the next one.

use std::time::{Duration, Instant};

use net_io_core::{MinRate, MinRateRule, RateVerdict};

/// One direction's rate rule and its next due check.
#[derive(Debug, Clone)]
pub(crate) struct RateWindow {
    rate: MinRate,
    due: Option<Instant>,
    /// The first judgement comes this long after a busy stretch starts: after the grace, and never sooner
    /// than one check interval. Kept here so that starting a stretch (twice per round trip) is one addition.
    first_check: Duration,
}

impl RateWindow {
    pub(crate) fn new(rule: MinRateRule) -> Self {
        Self {
            rate: MinRate::new(rule),
            due: None,
            first_check: rule.grace.max(rule.check),
        }
    }

    /// The direction became busy at `now`; a direction already busy keeps its start.
    pub(crate) fn start(&mut self, now: Instant) {
        if self.rate.is_busy() {
            return;
        }
        self.rate.start(now);
        // What `MinRate::next_check` answers for a stretch that starts at `now`.
        self.due = now.checked_add(self.first_check);
    }

    /// True while the direction is busy (bytes are being counted).
    pub(crate) fn is_busy(&self) -> bool {
        self.rate.is_busy()
    }

    /// The direction went idle: nothing is judged until it is busy again.
    pub(crate) fn stop(&mut self) {
        self.rate.stop();
        self.due = None;
    }

    /// Counts `bytes` moved at `now`.
    pub(crate) fn record(&mut self, bytes: u64, now: Instant) {
        self.rate.record(now, bytes);
    }

    /// When the next judgement is due, if the direction is busy.
    pub(crate) fn next_check(&self, _now: Instant) -> Option<Instant> {
        self.due
    }

    /// Judges the rate if a check is due; true when the peer is too slow.
    pub(crate) fn is_too_slow(&mut self, now: Instant) -> bool {
        let Some(due) = self.due else {
            return false;
        };
        if now < due {
            return false;
        }
        self.due = self.rate.next_check(now);
        self.rate.check(now) == RateVerdict::TooSlow
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn rule() -> MinRateRule {
        MinRateRule {
            bytes_per_second: 1000,
            window: Duration::from_millis(500),
            grace: Duration::from_millis(300),
            check: Duration::from_millis(100),
        }
    }

    #[test]
    fn a_trickle_of_one_byte_per_40_ms_is_too_slow_after_the_grace() {
        let start = Instant::now();
        let mut window = RateWindow::new(rule());
        window.start(start);
        let mut judged_slow_at = None;
        for step in 1..=25u32 {
            let now = start + Duration::from_millis(40) * step;
            window.record(1, now);
            if window.is_too_slow(now) {
                judged_slow_at = Some(now - start);
                break;
            }
        }
        let at = judged_slow_at.expect("a 25 B/s trickle should be judged too slow");
        assert!(
            at >= Duration::from_millis(300),
            "judged during the grace, at {at:?}"
        );
    }

    #[test]
    fn a_fast_peer_and_an_idle_direction_are_never_too_slow() {
        let start = Instant::now();
        let mut window = RateWindow::new(rule());
        assert!(
            !window.is_too_slow(start + Duration::from_secs(5)),
            "idle judged"
        );
        window.start(start);
        for step in 1..=50u32 {
            let now = start + Duration::from_millis(20) * step;
            window.record(100, now);
            assert!(
                !window.is_too_slow(now),
                "5,000 B/s judged too slow at step {step}"
            );
        }
    }
}
