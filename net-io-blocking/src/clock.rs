//! The server's clock: a shared [`Clock`] that every deadline reads, the system clock unless a test injects one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use net_io_core::{Clock, SystemClock};

/// The clock shared by accept threads, workers and connections.
pub(crate) type SharedClock = Arc<dyn Clock>;

/// The default clock.
pub(crate) fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// How far ahead a deadline too far to represent is put instead: about 136 years, "never" for a connection.
const FAR_FUTURE: Duration = Duration::from_secs(1 << 32);

/// The deadline `timeout` after `now`, without the panic of `Instant + Duration` on overflow.
///
/// A timeout of `Duration::MAX` (from the limits or from a session's request) is a valid way to say "never";
/// the deadline then lies [`FAR_FUTURE`] ahead, which no wait ever reaches but every comparison still orders.
pub(crate) fn deadline_after(now: Instant, timeout: Duration) -> Instant {
    now.checked_add(timeout)
        .or_else(|| now.checked_add(FAR_FUTURE))
        .unwrap_or(now)
}
