//! Link shaping for tests and benchmarks: a one-way delay and a rate on each direction of a stage's link to
//! the next stage (what it sends down and the answers it relays up), and at the last stage on the tokens it
//! returns to stage 0 directly, applied in the process (the kernel's `netem` is not available here), with the
//! wake-ups on task-runtime timers so a delayed frame holds no thread.
//!
//! A frame of `n` bytes queued at `t` starts when the previous one has finished (`start = max(t, free)`),
//! takes `8n / rate` to send, and is handed to the socket `delay` after it finished sending: what a link of
//! that rate and one-way latency would deliver, at the moment it would.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use net_io_blocking::Completer;
use task_runtime::{Compute, Runtime};

/// The completion token of a shaper's timer.
pub(crate) const SHAPER_TOKEN: u64 = 3;

/// How a link is shaped.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkShape {
    /// One-way delay added to every frame.
    pub delay: Duration,
    /// The link's rate in bits per second; `None` is unlimited.
    pub rate_bits_per_second: Option<u64>,
}

impl LinkShape {
    /// True when the link is shaped at all.
    pub fn is_shaped(&self) -> bool {
        !self.delay.is_zero() || self.rate_bits_per_second.is_some()
    }

    /// When a frame of `bytes` queued at `now` is handed over, given the link is free from `free` on;
    /// returns (hand-over time, the time the link is free again).
    pub fn schedule(&self, now: Instant, free: Instant, bytes: usize) -> (Instant, Instant) {
        let start = now.max(free);
        let sending = self.rate_bits_per_second.map_or(Duration::ZERO, |rate| {
            Duration::from_secs_f64(bytes as f64 * 8.0 / rate.max(1) as f64)
        });
        let done = start + sending;
        (done + self.delay, done)
    }
}

/// Frames held back by a shaped link, in order.
#[derive(Debug)]
pub(crate) struct Shaper {
    shape: LinkShape,
    free: Instant,
    held: VecDeque<(Instant, Vec<u8>)>,
    /// The bytes of the frames in `held` (the link's byte budget counts them).
    held_bytes: usize,
    /// The hand-over time a timer is armed for, so a burst arms one timer, not one per frame.
    armed: Option<Instant>,
}

impl Shaper {
    pub(crate) fn new(shape: LinkShape) -> Shaper {
        Shaper {
            shape,
            free: Instant::now(),
            held: VecDeque::new(),
            held_bytes: 0,
            armed: None,
        }
    }

    /// Holds `bytes` until the link would deliver them.
    pub(crate) fn hold(&mut self, now: Instant, bytes: Vec<u8>) {
        let (release, free) = self.shape.schedule(now, self.free, bytes.len());
        self.free = free;
        self.held_bytes += bytes.len();
        self.held.push_back((release, bytes));
    }

    /// The frames due by `now`, oldest first.
    pub(crate) fn due(&mut self, now: Instant) -> Vec<Vec<u8>> {
        let mut due = Vec::new();
        while self
            .held
            .front()
            .is_some_and(|(release, _)| *release <= now)
        {
            if let Some((_, bytes)) = self.held.pop_front() {
                self.held_bytes -= bytes.len();
                due.push(bytes);
            }
        }
        if self.armed.is_some_and(|armed| armed <= now) {
            self.armed = None;
        }
        due
    }

    /// The bytes of the frames held back now.
    pub(crate) fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// Arms a timer that posts to `completer` when the next held frame is due (unless one is armed for it).
    pub(crate) fn arm(&mut self, now: Instant, completer: &Completer) {
        let Some(&(release, _)) = self.held.front() else {
            return;
        };
        if self.armed.is_some_and(|armed| armed <= release) {
            return;
        }
        self.armed = Some(release);
        let completer = completer.clone();
        let _ = Runtime::task(Compute::compute(move |()| {
            let _ = completer.post(SHAPER_TOKEN, 0);
        }))
        .after(release.saturating_duration_since(now))
        .spawn();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shaped_link_delays_each_frame_and_queues_them_behind_its_rate() {
        let shape = LinkShape {
            delay: Duration::from_millis(20),
            rate_bits_per_second: Some(100_000_000),
        };
        let now = Instant::now();
        // 125,000 bytes at 100 Mbit/s take 10 ms.
        let (first, free) = shape.schedule(now, now, 125_000);
        assert_eq!(first - now, Duration::from_millis(30));
        let (second, _) = shape.schedule(now, free, 125_000);
        assert_eq!(
            second - now,
            Duration::from_millis(40),
            "the second frame waits for the first"
        );
        let unshaped = LinkShape::default();
        assert!(!unshaped.is_shaped());
        assert_eq!(unshaped.schedule(now, now, 1 << 20).0, now);
    }

    #[test]
    fn held_frames_come_out_in_order_once_due() {
        let mut shaper = Shaper::new(LinkShape {
            delay: Duration::from_millis(5),
            rate_bits_per_second: None,
        });
        let now = Instant::now();
        shaper.hold(now, vec![1]);
        shaper.hold(now, vec![2]);
        assert!(shaper.due(now).is_empty());
        assert_eq!(shaper.held_bytes(), 2, "both held frames count");
        assert_eq!(
            shaper.due(now + Duration::from_millis(5)),
            vec![vec![1], vec![2]]
        );
        assert_eq!(shaper.held_bytes(), 0, "frames handed over count no more");
    }
}
