//! [`MinRate`]: the minimum transfer rate of one direction, the slowloris and slow-reader defence.
//!
//! A ring of byte buckets, each `check` wide, spans the window: `ceil(window / check)` complete buckets
//! plus the current, partly filled one, so a check made right at a bucket boundary still judges a whole
//! window. The rule applies only while the direction is busy (judged: waiting on the peer, see `TransferRates`) and
//! only after `grace` from when it became busy. At a check, the bytes in the ring must reach
//! `bytes_per_second` times the time the ring covers; that is at least the window once the direction has
//! been busy that long, and the busy time before then, so a peer is never judged on time it did not have.
//!
//! ```text
//!   busy_since            grace                     now
//!   |-----|-----|-----|-----|-----|-----|-----|--x--|
//!                     [ ring of n buckets, covered ]   bytes >= rate * covered ?
//! ```

use std::time::{Duration, Instant};

use crate::limits::{MIN_RATE_BUCKETS_MAX, MinRateRule};

/// The answer of a rate check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RateVerdict {
    /// Fast enough, idle, or still in grace.
    Fine,
    /// Slower than the rule over the covered window: close with `SlowPeer`.
    TooSlow,
}

/// The rate tracker of one direction of one connection. No allocation; reset it for the next connection.
#[derive(Clone, Debug)]
pub struct MinRate {
    rule: MinRateRule,
    buckets: [u64; MIN_RATE_BUCKETS_MAX as usize + 1],
    count: usize,
    busy_since: Option<Instant>,
    current: u64,
}

impl MinRate {
    /// A tracker for `rule`. A window of more than 64 checks is clamped to 64 buckets
    /// (validation rejects such rules before they get here).
    pub fn new(rule: MinRateRule) -> MinRate {
        let check = rule.check.max(Duration::from_nanos(1));
        let count = rule
            .window
            .as_nanos()
            .div_ceil(check.as_nanos())
            .clamp(1, u128::from(MIN_RATE_BUCKETS_MAX)) as usize
            + 1;
        MinRate {
            rule: MinRateRule { check, ..rule },
            buckets: [0; MIN_RATE_BUCKETS_MAX as usize + 1],
            count,
            busy_since: None,
            current: 0,
        }
    }

    /// The direction became busy at `now`. Does nothing if it already is.
    pub fn start(&mut self, now: Instant) {
        if self.busy_since.is_none() {
            self.busy_since = Some(now);
            self.current = 0;
            self.buckets[..self.count].fill(0);
        }
    }

    /// The direction went idle: the rule stops applying and the history is dropped.
    pub fn stop(&mut self) {
        self.busy_since = None;
    }

    /// True while the direction is busy.
    pub fn is_busy(&self) -> bool {
        self.busy_since.is_some()
    }

    /// Counts `bytes` moved at `now`. Ignored while idle.
    pub fn record(&mut self, now: Instant, bytes: u64) {
        if self.busy_since.is_none() {
            return;
        }
        self.advance(now);
        let slot = (self.current % self.count as u64) as usize;
        self.buckets[slot] = self.buckets[slot].saturating_add(bytes);
    }

    /// Judges the rate at `now`.
    pub fn check(&mut self, now: Instant) -> RateVerdict {
        let Some(busy_since) = self.busy_since else {
            return RateVerdict::Fine;
        };
        let elapsed = now.saturating_duration_since(busy_since);
        if elapsed < self.rule.grace {
            return RateVerdict::Fine;
        }
        self.advance(now);
        let oldest = self.current.saturating_sub(self.count as u64 - 1);
        let covered = elapsed
            .as_nanos()
            .saturating_sub(u128::from(oldest) * self.rule.check.as_nanos());
        let moved: u128 = self.buckets[..self.count]
            .iter()
            .map(|&bytes| u128::from(bytes))
            .sum();
        // bytes / covered_seconds < rate, without division: bytes * 1e9 < rate * covered_nanos.
        if moved * 1_000_000_000 < u128::from(self.rule.bytes_per_second) * covered {
            RateVerdict::TooSlow
        } else {
            RateVerdict::Fine
        }
    }

    /// When the next check is due: one `check` interval from `now` (or the end of grace, if later).
    pub fn next_check(&self, now: Instant) -> Option<Instant> {
        let busy_since = self.busy_since?;
        Some((busy_since + self.rule.grace).max(now + self.rule.check))
    }

    /// Moves the ring to the bucket that holds `now`, zeroing the buckets skipped over.
    fn advance(&mut self, now: Instant) {
        let Some(busy_since) = self.busy_since else {
            return;
        };
        let elapsed = now.saturating_duration_since(busy_since).as_nanos();
        let target = u64::try_from(elapsed / self.rule.check.as_nanos()).unwrap_or(u64::MAX);
        if target <= self.current {
            return;
        }
        let steps = (target - self.current).min(self.count as u64);
        for step in 1..=steps {
            let slot = ((self.current + step) % self.count as u64) as usize;
            self.buckets[slot] = 0;
        }
        self.current = target;
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
    fn a_slowloris_sending_a_byte_every_40_ms_is_too_slow_after_grace() {
        let start = Instant::now();
        let mut rate = MinRate::new(rule());
        rate.start(start);
        let mut verdict_at = None;
        for tick in 1..=50u64 {
            let now = start + Duration::from_millis(tick * 40);
            rate.record(now, 1);
            if rate.check(now) == RateVerdict::TooSlow {
                verdict_at = Some(tick * 40);
                break;
            }
        }
        let at = verdict_at.expect("25 B/s against a 1,000 B/s floor was never flagged");
        assert!(at >= 300, "flagged at {at} ms, inside the 300 ms grace");
        assert!(at <= 400, "flagged only at {at} ms");
    }

    #[test]
    fn an_idle_direction_is_never_too_slow() {
        let start = Instant::now();
        let mut rate = MinRate::new(rule());
        assert_eq!(
            rate.check(start + Duration::from_secs(60)),
            RateVerdict::Fine
        );
        rate.start(start);
        rate.stop();
        assert_eq!(
            rate.check(start + Duration::from_secs(60)),
            RateVerdict::Fine
        );
    }

    #[test]
    fn a_burst_then_silence_becomes_too_slow_once_the_burst_leaves_the_window() {
        let start = Instant::now();
        let mut rate = MinRate::new(rule());
        rate.start(start);
        rate.record(start, 10_000);
        assert_eq!(
            rate.check(start + Duration::from_millis(400)),
            RateVerdict::Fine
        );
        assert_eq!(
            rate.check(start + Duration::from_millis(1200)),
            RateVerdict::TooSlow,
            "a burst must not buy silence forever"
        );
    }
}
