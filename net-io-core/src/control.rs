//! The [`ControlLine`]: how an operator tells a running server to drain, stop, shed or lock down.
//!
//! ```text
//!   operator ──set(state)──▶ ControlLine { state (mutex), epoch (atomic) }
//!   accept loop ──ControlWatch::poll──▶ one Acquire load per loop; the mutex only when the epoch moved
//! ```
//!
//! Readers see only the latest state: several changes between two polls read as the last one.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::gate::Lane;

/// What the server should be doing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ControlState {
    /// Serving normally.
    #[default]
    Running,
    /// Close the door, close idle connections, kill the rest at the deadline (`drain_timeout` if `None`).
    Draining {
        /// When to kill what is still busy.
        deadline: Option<Instant>,
    },
    /// Stop: drain, then shut down.
    Stopping,
    /// Refuse new connections in lanes at or above `lane` and close idle ones there.
    Shed {
        /// The lowest lane shed.
        lane: Lane,
    },
    /// Refuse every new connection; keep the open ones.
    Lockdown,
}

/// A shared control state with an epoch, so pollers pay one atomic load when nothing changed.
#[derive(Debug, Default)]
pub struct ControlLine {
    epoch: AtomicU64,
    state: Mutex<ControlState>,
}

/// One reader's position on a [`ControlLine`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ControlWatch {
    seen: u64,
}

impl ControlLine {
    /// A line in the `Running` state.
    pub fn new() -> ControlLine {
        ControlLine::default()
    }

    /// Sets the state and moves the epoch, so every watcher sees the change on its next poll.
    pub fn set(&self, state: ControlState) {
        let mut guard = self
            .state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        *guard = state;
        // Bumped while holding the lock and with Release, so a poller that sees the new epoch and then
        // takes the lock reads this state or a later one.
        self.epoch.fetch_add(1, Ordering::Release);
    }

    /// The current state (takes the lock).
    pub fn state(&self) -> ControlState {
        *self
            .state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// The current epoch; it moves on every [`ControlLine::set`].
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }
}

impl ControlWatch {
    /// A watcher that has seen nothing yet: its first poll reports the current state if it was ever set.
    pub fn new() -> ControlWatch {
        ControlWatch::default()
    }

    /// The new state if the line changed since the last poll, else `None`. One atomic load when unchanged.
    pub fn poll(&mut self, line: &ControlLine) -> Option<ControlState> {
        let epoch = line.epoch();
        if epoch == self.seen {
            return None;
        }
        self.seen = epoch;
        Some(line.state())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_changes_between_polls_read_as_the_last_one() {
        let line = ControlLine::new();
        let mut watch = ControlWatch::new();
        assert_eq!(watch.poll(&line), None, "nothing was set yet");
        line.set(ControlState::Lockdown);
        line.set(ControlState::Shed { lane: Lane(2) });
        line.set(ControlState::Draining { deadline: None });
        assert_eq!(
            watch.poll(&line),
            Some(ControlState::Draining { deadline: None })
        );
        assert_eq!(
            watch.poll(&line),
            None,
            "an unchanged line must report nothing"
        );
    }
}
