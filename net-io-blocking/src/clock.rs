//! The server's clock: a shared [`Clock`] that every deadline reads, the system clock unless a test injects one.

use std::sync::Arc;

use net_io_core::{Clock, SystemClock};

/// The clock shared by accept threads, workers and connections.
pub(crate) type SharedClock = Arc<dyn Clock>;

/// The default clock.
pub(crate) fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// The deadline `timeout` after `now`, saturating (see [`net_io_core::deadline_after`]).
pub(crate) use net_io_core::deadline_after;
