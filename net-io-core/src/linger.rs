//! [`LingerRead`]: the bounded read-and-discard after a graceful close's FIN, decided once here for the
//! worker-thread link and the event loop.
//!
//! Closing a socket that still holds unread input makes the kernel send an RST, which can destroy the last
//! reply still in flight to the peer. So a graceful close sends its FIN and then reads and drops what the
//! peer still sends, until the peer's own FIN, a byte limit or a time limit, whichever comes first:
//!
//! ```text
//!   FIN sent ── first non-blocking recv ── nothing / EOF / error / over the limit ──▶ close now
//!                        │ some bytes
//!                        ▼
//!               LingerRead (discarded, limit, end) ── each recv ──▶ Again | Wait | Done
//! ```
//!
//! The caller does the `recv` and the waiting, and cuts the linger short on a kill.

use std::io;
use std::time::{Duration, Instant};

use crate::clock::deadline_after;

/// What the linger does after one `recv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lingered {
    /// Read again now (bytes were dropped, or the call was interrupted).
    Again,
    /// Nothing is waiting: wait for input until [`LingerRead::end`].
    Wait,
    /// The linger is over: the peer's FIN, the byte limit, or a failed read.
    Done,
}

/// A linger in progress: the bytes dropped so far, the most it drops, and when it gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LingerRead {
    discarded: usize,
    max_bytes: usize,
    end: Instant,
}

impl LingerRead {
    /// Judges the first non-blocking `recv` after the FIN, made at `now`: `Some` when the peer is still
    /// sending and the close should linger (for at most `timeout` and `max_bytes`); `None` to close at once
    /// (nothing waiting, the peer's FIN, an error, or already more than the limit).
    pub fn start(
        first: &io::Result<usize>,
        now: Instant,
        timeout: Duration,
        max_bytes: usize,
    ) -> Option<LingerRead> {
        match *first {
            Ok(count) if count > 0 && count < max_bytes => Some(LingerRead {
                discarded: count,
                max_bytes,
                end: deadline_after(now, timeout),
            }),
            _ => None,
        }
    }

    /// When the linger gives up.
    pub fn end(&self) -> Instant {
        self.end
    }

    /// True once `now` reached the end.
    pub fn is_over(&self, now: Instant) -> bool {
        now >= self.end
    }

    /// The bytes dropped so far.
    pub fn discarded(&self) -> usize {
        self.discarded
    }

    /// Judges one more `recv` of the linger.
    pub fn received(&mut self, result: &io::Result<usize>) -> Lingered {
        match result {
            Ok(0) => Lingered::Done,
            Ok(count) => {
                self.discarded = self.discarded.saturating_add(*count);
                if self.discarded >= self.max_bytes {
                    Lingered::Done
                } else {
                    Lingered::Again
                }
            }
            Err(error) if error.kind() == io::ErrorKind::Interrupted => Lingered::Again,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => Lingered::Wait,
            Err(_) => Lingered::Done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_millis(500);

    fn would_block() -> io::Result<usize> {
        Err(io::Error::from(io::ErrorKind::WouldBlock))
    }

    #[test]
    fn a_close_with_nothing_to_read_does_not_linger() {
        let now = Instant::now();
        for first in [
            Ok(0),
            would_block(),
            Err(io::Error::from(io::ErrorKind::ConnectionReset)),
            Ok(4096),
            Ok(5000),
        ] {
            assert_eq!(
                LingerRead::start(&first, now, TIMEOUT, 4096),
                None,
                "{first:?} after the FIN should close at once"
            );
        }
    }

    #[test]
    fn a_peer_still_sending_is_read_until_its_fin() {
        let now = Instant::now();
        let mut linger =
            LingerRead::start(&Ok(100), now, TIMEOUT, 4096).expect("100 bytes waiting lingers");
        assert_eq!(linger.end(), now + TIMEOUT);
        assert_eq!(linger.discarded(), 100, "the first read counts");
        assert_eq!(linger.received(&Ok(200)), Lingered::Again);
        assert_eq!(linger.received(&would_block()), Lingered::Wait);
        assert_eq!(
            linger.received(&Err(io::Error::from(io::ErrorKind::Interrupted))),
            Lingered::Again
        );
        assert_eq!(linger.received(&Ok(0)), Lingered::Done, "the peer's FIN");
        assert_eq!(linger.discarded(), 300);
    }

    #[test]
    fn the_byte_limit_and_the_time_limit_end_a_linger() {
        let now = Instant::now();
        let mut linger = LingerRead::start(&Ok(1000), now, TIMEOUT, 4096).expect("lingers");
        assert_eq!(linger.received(&Ok(3000)), Lingered::Again);
        assert_eq!(
            linger.received(&Ok(96)),
            Lingered::Done,
            "4,096 bytes dropped reach the limit"
        );
        assert!(!linger.is_over(now + TIMEOUT - Duration::from_millis(1)));
        assert!(linger.is_over(now + TIMEOUT));
        let mut failing = LingerRead::start(&Ok(1), now, TIMEOUT, 4096).expect("lingers");
        assert_eq!(
            failing.received(&Err(io::Error::from(io::ErrorKind::ConnectionReset))),
            Lingered::Done
        );
    }

    #[test]
    fn a_far_timeout_saturates() {
        let now = Instant::now();
        let linger = LingerRead::start(&Ok(1), now, Duration::MAX, 10).expect("lingers");
        assert!(linger.end() > now + Duration::from_secs(100 * 365 * 24 * 3600));
    }
}
