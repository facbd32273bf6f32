//! [`TransferRates`]: when a connection's minimum-rate rule judges each direction, held once here so the
//! worker-thread link, the handlers and the event loop judge a slow peer the same way.
//!
//! A direction is judged only while it waits on the peer, never while bytes flow at once:
//!
//! ```text
//!   input   exchange starts ── bytes (counted, not judged) ── first wait for more ──▶ judged from here,
//!                                                              awaiting_input()        counting those bytes
//!           the exchange goes idle (reply flushed, park, idle wait) ── input_idle(): judging stops
//!   output  sends that go out at once (counted, not judged) ── first EAGAIN ──▶ judged from here,
//!                                                               awaiting_output()  counting those bytes
//!           every queued byte went out ── output_done(): judging stops
//! ```
//!
//! So a request that arrives in one read and a reply that leaves in one send cost the rule nothing: no clock
//! read, no bucket. A peer that trickles (slowloris) or reads slowly (a slow reader) is judged from its first
//! wait, with the bytes it had already moved in its favour. The caller owns the IO and the clock; every
//! method takes the time (or a closure that reads it only when the rule needs it) and returns a decision.

use std::time::{Duration, Instant};

use crate::close::{CloseReason, Direction};
use crate::limits::MinRateRule;
use crate::rate::{MinRate, RateVerdict};

/// One direction's rate ring and its next due check: between checks a judgement costs one comparison.
#[derive(Clone, Debug)]
struct RateWindow {
    rate: MinRate,
    due: Option<Instant>,
    /// The first judgement comes this long after a busy stretch starts: after the grace, and never sooner
    /// than one check interval. Kept so that starting a stretch is one addition.
    first_check: Duration,
}

impl RateWindow {
    fn new(rule: MinRateRule) -> RateWindow {
        RateWindow {
            rate: MinRate::new(rule),
            due: None,
            first_check: rule.grace.max(rule.check),
        }
    }

    /// The direction became busy at `now`; a direction already busy keeps its start.
    fn start(&mut self, now: Instant) {
        if self.rate.is_busy() {
            return;
        }
        self.rate.start(now);
        // What `MinRate::next_check` answers for a stretch that starts at `now`.
        self.due = now.checked_add(self.first_check);
    }

    fn is_busy(&self) -> bool {
        self.rate.is_busy()
    }

    fn stop(&mut self) {
        self.rate.stop();
        self.due = None;
    }

    fn record(&mut self, bytes: u64, now: Instant) {
        self.rate.record(now, bytes);
    }

    /// Judges the rate if a check is due; true when the peer is too slow.
    fn is_too_slow(&mut self, now: Instant) -> bool {
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

/// The minimum-rate state of one connection's two directions. No allocation; [`TransferRates::reset`] it
/// for the next connection in the same slot. Without a rule every method is a no-op that answers "fine".
#[derive(Clone, Debug, Default)]
pub struct TransferRates {
    input: Option<RateWindow>,
    output: Option<RateWindow>,
    /// Bytes of the exchange in progress that arrived before its first wait for input.
    received_unjudged: u64,
    /// Bytes of the flush in progress that went out before its first wait for room.
    sent_unjudged: u64,
}

impl TransferRates {
    /// The state of a new connection under `rule` (none: nothing is judged).
    pub fn new(rule: Option<MinRateRule>) -> TransferRates {
        TransferRates {
            input: rule.map(RateWindow::new),
            output: rule.map(RateWindow::new),
            received_unjudged: 0,
            sent_unjudged: 0,
        }
    }

    /// Starts over for a new connection under `rule`.
    pub fn reset(&mut self, rule: Option<MinRateRule>) {
        *self = TransferRates::new(rule);
    }

    /// True while `direction` is being judged (it waited on the peer since it last went idle).
    pub fn is_judging(&self, direction: Direction) -> bool {
        self.window(direction).is_some_and(RateWindow::is_busy)
    }

    /// `bytes` arrived. While input is judged they are counted at `now()` (read only then) and judged if a
    /// check is due; before that they are kept for the first wait. `Err` is the close for a slow peer.
    #[inline]
    pub fn received(
        &mut self,
        bytes: usize,
        now: impl FnOnce() -> Instant,
    ) -> Result<(), CloseReason> {
        let Some(window) = self.input.as_mut() else {
            return Ok(());
        };
        if !window.is_busy() {
            self.received_unjudged = self.received_unjudged.saturating_add(bytes as u64);
            return Ok(());
        }
        let now = now();
        window.record(bytes as u64, now);
        judged(window, now, Direction::In)
    }

    /// The exchange waits for more input from `now`: judging starts (counting what arrived before) unless it
    /// already runs. Returns when the next check is due, for the wait's wake-up.
    #[inline]
    pub fn awaiting_input(&mut self, now: Instant) -> Option<Instant> {
        let window = self.input.as_mut()?;
        if !window.is_busy() {
            window.start(now);
            let received = std::mem::take(&mut self.received_unjudged);
            if received > 0 {
                window.record(received, now);
            }
        }
        window.due
    }

    /// A wait for input woke at `now` (a timer, or before the next `recv`): `Err` if the peer is too slow,
    /// otherwise when the next check is due.
    #[inline]
    pub fn judge_input(&mut self, now: Instant) -> Result<Option<Instant>, CloseReason> {
        let Some(window) = self.input.as_mut() else {
            return Ok(None);
        };
        judged(window, now, Direction::In)?;
        Ok(window.due)
    }

    /// The connection is between exchanges (idle wait, park, a reply flushed with no input left): input is
    /// not judged, and what arrived so far is forgotten.
    #[inline]
    pub fn input_idle(&mut self) {
        if let Some(window) = self.input.as_mut() {
            window.stop();
        }
        self.received_unjudged = 0;
    }

    /// `bytes` went out. While output is judged they are counted at `now()` (read only then); before that
    /// they are kept for the first wait.
    #[inline]
    pub fn sent(&mut self, bytes: usize, now: impl FnOnce() -> Instant) {
        let Some(window) = self.output.as_mut() else {
            return;
        };
        if window.is_busy() {
            window.record(bytes as u64, now());
        } else {
            self.sent_unjudged = self.sent_unjudged.saturating_add(bytes as u64);
        }
    }

    /// A send would block at `now`: judging starts (counting what went out before) unless it already runs,
    /// and a due check is made. `Err` is the close for a slow reader; otherwise when the next check is due.
    #[inline]
    pub fn awaiting_output(&mut self, now: Instant) -> Result<Option<Instant>, CloseReason> {
        let Some(window) = self.output.as_mut() else {
            return Ok(None);
        };
        if !window.is_busy() {
            window.start(now);
            let sent = std::mem::take(&mut self.sent_unjudged);
            if sent > 0 {
                window.record(sent, now);
            }
        }
        judged(window, now, Direction::Out)?;
        Ok(window.due)
    }

    /// A wait for room woke at `now`: `Err` if the peer reads too slowly, otherwise the next check.
    #[inline]
    pub fn judge_output(&mut self, now: Instant) -> Result<Option<Instant>, CloseReason> {
        let Some(window) = self.output.as_mut() else {
            return Ok(None);
        };
        judged(window, now, Direction::Out)?;
        Ok(window.due)
    }

    /// Every queued byte went out (or the flush was given up): output is not judged until it waits again.
    #[inline]
    pub fn output_done(&mut self) {
        if let Some(window) = self.output.as_mut() {
            window.stop();
        }
        self.sent_unjudged = 0;
    }

    fn window(&self, direction: Direction) -> Option<&RateWindow> {
        match direction {
            Direction::In => self.input.as_ref(),
            Direction::Out => self.output.as_ref(),
        }
    }
}

/// A due judgement of `window` at `now`, as the close it calls for.
fn judged(window: &mut RateWindow, now: Instant, direction: Direction) -> Result<(), CloseReason> {
    if window.is_too_slow(now) {
        return Err(CloseReason::SlowPeer { direction });
    }
    Ok(())
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

    const SLOW_IN: CloseReason = CloseReason::SlowPeer {
        direction: Direction::In,
    };
    const SLOW_OUT: CloseReason = CloseReason::SlowPeer {
        direction: Direction::Out,
    };

    /// A clock closure that fails the test if the rule reads the time when it should not.
    fn never() -> Instant {
        panic!("the rate rule read the clock for bytes it does not judge")
    }

    #[test]
    fn a_trickle_of_one_byte_per_40_ms_is_too_slow_after_the_grace() {
        let start = Instant::now();
        let mut rates = TransferRates::new(Some(rule()));
        rates
            .received(1, never)
            .expect("the first byte is not judged");
        assert_eq!(
            rates.awaiting_input(start),
            Some(start + Duration::from_millis(300)),
            "the first check is due at the end of the grace"
        );
        let mut judged_slow_at = None;
        for step in 1..=25u32 {
            let now = start + Duration::from_millis(40) * step;
            if rates.received(1, || now).is_err() {
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
    fn a_request_that_arrives_at_once_is_never_judged_and_reads_no_clock() {
        let mut rates = TransferRates::new(Some(rule()));
        for _ in 0..100 {
            rates.received(4096, never).expect("never judged");
            rates.sent(4096, never);
            rates.output_done();
            rates.input_idle();
        }
        assert!(!rates.is_judging(Direction::In));
        assert!(!rates.is_judging(Direction::Out));
    }

    #[test]
    fn the_bytes_before_the_first_wait_count_for_the_peer() {
        let start = Instant::now();
        let mut rates = TransferRates::new(Some(rule()));
        // 1,000 bytes at once, then a wait: the window holds them, so the rule is met for a while.
        rates.received(1000, never).expect("not judged yet");
        rates.awaiting_input(start);
        assert!(rates.is_judging(Direction::In));
        assert_eq!(
            rates.judge_input(start + Duration::from_millis(400)),
            Ok(Some(start + Duration::from_millis(500))),
            "1,000 bytes in 400 ms meet a 1,000 B/s floor"
        );
        assert_eq!(
            rates.judge_input(start + Duration::from_millis(1300)),
            Err(SLOW_IN),
            "once they leave the window, silence is too slow"
        );
    }

    #[test]
    fn going_idle_forgets_what_arrived_and_stops_judging() {
        let start = Instant::now();
        let mut rates = TransferRates::new(Some(rule()));
        rates.received(5000, never).expect("not judged");
        rates.input_idle();
        rates.awaiting_input(start);
        assert_eq!(
            rates.judge_input(start + Duration::from_millis(400)),
            Err(SLOW_IN),
            "bytes of an earlier exchange must not buy time for this one"
        );
        rates.input_idle();
        assert_eq!(rates.judge_input(start + Duration::from_secs(60)), Ok(None));
    }

    #[test]
    fn a_slow_reader_is_judged_from_its_first_full_send_buffer() {
        let start = Instant::now();
        let mut rates = TransferRates::new(Some(rule()));
        rates.sent(100, never);
        assert_eq!(
            rates.awaiting_output(start),
            Ok(Some(start + Duration::from_millis(300)))
        );
        assert!(rates.is_judging(Direction::Out));
        rates.sent(10, || start + Duration::from_millis(200));
        assert_eq!(
            rates.judge_output(start + Duration::from_millis(300)),
            Err(SLOW_OUT),
            "110 bytes in 300 ms is under 1,000 B/s"
        );
        rates.output_done();
        assert!(!rates.is_judging(Direction::Out));
        assert_eq!(
            rates.judge_output(start + Duration::from_secs(60)),
            Ok(None)
        );
    }

    #[test]
    fn output_sent_before_the_first_full_buffer_counts_and_a_finished_flush_forgets_it() {
        let start = Instant::now();
        let mut rates = TransferRates::new(Some(rule()));
        rates.sent(1000, never);
        rates.awaiting_output(start).expect("not due yet");
        assert_eq!(
            rates.judge_output(start + Duration::from_millis(400)),
            Ok(Some(start + Duration::from_millis(500))),
            "1,000 bytes sent at once meet 1,000 B/s over the next 400 ms"
        );
        rates.output_done();
        rates.sent(5000, never);
        rates.output_done();
        rates.awaiting_output(start).expect("not due yet");
        assert_eq!(
            rates.judge_output(start + Duration::from_millis(400)),
            Err(SLOW_OUT),
            "bytes of a flush that finished must not buy time for the next one"
        );
    }

    #[test]
    fn a_fast_peer_is_never_too_slow() {
        let start = Instant::now();
        let mut rates = TransferRates::new(Some(rule()));
        rates.awaiting_input(start);
        rates.awaiting_output(start).expect("not due yet");
        for step in 1..=50u32 {
            let now = start + Duration::from_millis(20) * step;
            rates.received(100, || now).expect("5,000 B/s in");
            rates.sent(100, || now);
            rates.judge_output(now).expect("5,000 B/s out");
        }
    }

    #[test]
    fn without_a_rule_nothing_is_judged() {
        let start = Instant::now();
        let mut rates = TransferRates::new(None);
        assert_eq!(rates.awaiting_input(start), None);
        assert_eq!(rates.awaiting_output(start), Ok(None));
        rates.received(1, never).expect("no rule");
        rates.sent(1, never);
        assert_eq!(
            rates.judge_input(start + Duration::from_secs(3600)),
            Ok(None)
        );
        assert_eq!(
            rates.judge_output(start + Duration::from_secs(3600)),
            Ok(None)
        );
        assert!(!rates.is_judging(Direction::In));
    }
}
