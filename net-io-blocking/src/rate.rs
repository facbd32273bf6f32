//! The minimum transfer rate for one direction: byte counts in a ring of buckets spanning the window.
//!
//! A direction counts only while it is busy (a request is arriving, or output is pending). After `grace` of
//! busy time, every `check` the bytes of the last `min(window, busy time)` must reach `bytes_per_second`
//! times that span, or the peer is too slow (`SlowPeer`). An idle keep-alive connection is never judged.

use std::time::{Duration, Instant};

use net_io_core::MinRateRule;

const BUCKETS_MAX: usize = 64;

/// One direction's rate window.
#[derive(Debug, Clone)]
pub(crate) struct RateWindow {
    rule: MinRateRule,
    buckets: [u64; BUCKETS_MAX],
    count: usize,
    current: usize,
    bucket_start: Instant,
    busy_since: Option<Instant>,
    next_check: Option<Instant>,
}

impl RateWindow {
    pub(crate) fn new(rule: MinRateRule) -> Self {
        let check = rule.check.max(Duration::from_millis(1));
        let count =
            (rule.window.as_nanos() / check.as_nanos()).clamp(1, BUCKETS_MAX as u128) as usize;
        Self {
            rule: MinRateRule { check, ..rule },
            buckets: [0; BUCKETS_MAX],
            count,
            current: 0,
            bucket_start: Instant::now(),
            busy_since: None,
            next_check: None,
        }
    }

    /// The direction became busy at `now`; a direction already busy keeps its start.
    pub(crate) fn start(&mut self, now: Instant) {
        if self.busy_since.is_some() {
            return;
        }
        self.buckets = [0; BUCKETS_MAX];
        self.current = 0;
        self.bucket_start = now;
        self.busy_since = Some(now);
        self.next_check = Some(now + self.rule.grace);
    }

    /// The direction went idle: nothing is judged until it is busy again.
    pub(crate) fn stop(&mut self) {
        self.busy_since = None;
        self.next_check = None;
    }

    /// Counts `bytes` moved at `now`.
    pub(crate) fn record(&mut self, bytes: u64, now: Instant) {
        if self.busy_since.is_none() {
            return;
        }
        self.rotate(now);
        self.buckets[self.current] += bytes;
    }

    /// When the next judgement is due, if the direction is busy.
    pub(crate) fn next_check(&self, _now: Instant) -> Option<Instant> {
        self.next_check
    }

    /// Judges the rate if a check is due; true when the peer is too slow.
    pub(crate) fn is_too_slow(&mut self, now: Instant) -> bool {
        let (Some(busy_since), Some(due)) = (self.busy_since, self.next_check) else {
            return false;
        };
        if now < due {
            return false;
        }
        self.next_check = Some(now + self.rule.check);
        self.rotate(now);
        let span = now
            .saturating_duration_since(busy_since)
            .min(self.rule.window);
        let moved: u64 = self.buckets[..self.count].iter().sum();
        let needed = self.rule.bytes_per_second as f64 * span.as_secs_f64();
        (moved as f64) < needed
    }

    /// Advances the ring to the bucket holding `now`, zeroing the buckets passed over.
    fn rotate(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.bucket_start);
        let steps = (elapsed.as_nanos() / self.rule.check.as_nanos()) as usize;
        if steps == 0 {
            return;
        }
        for _ in 0..steps.min(self.count) {
            self.current = (self.current + 1) % self.count;
            self.buckets[self.current] = 0;
        }
        self.bucket_start += self.rule.check * steps as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
