//! The [`ControlLine`]: how an operator tells a running server to drain, stop, shed or lock down.
//!
//! ```text
//!   operator ──set(state)──▶ ControlLine { state (mutex), epoch (atomic) } ──▶ each subscribed waker
//!   accept loop ──ControlWatch::poll──▶ one Acquire load per loop; the mutex only when the epoch moved
//! ```
//!
//! Readers see only the latest state: several changes between two polls read as the last one. A reader that
//! sleeps subscribes a waker, so it needs no periodic poll: [`ControlLine::set`] calls every live one.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
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

/// What [`ControlLine::set`] calls after each change: a sleeping reader's way to be woken.
pub type ControlWaker = dyn Fn() + Send + Sync;

/// A shared control state with an epoch, so pollers pay one atomic load when nothing changed.
#[derive(Default)]
pub struct ControlLine {
    epoch: AtomicU64,
    state: Mutex<ControlState>,
    /// Held weakly: a reader that is gone (a server that was dropped) needs no unsubscribe.
    wakers: Mutex<Vec<Weak<ControlWaker>>>,
}

impl fmt::Debug for ControlLine {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("ControlLine")
            .field("epoch", &self.epoch)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
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
        drop(guard);
        // Called after the epoch moved and outside both locks, so a woken reader sees the change and a
        // waker may read the line itself.
        for waker in self.live_wakers() {
            waker();
        }
    }

    /// Calls `waker` after every later [`ControlLine::set`], for as long as the caller keeps it alive. The
    /// line keeps only a weak reference, so dropping the `Arc` ends the subscription.
    pub fn subscribe(&self, waker: &Arc<ControlWaker>) {
        let mut wakers = self
            .wakers
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        wakers.retain(|known| known.strong_count() > 0);
        wakers.push(Arc::downgrade(waker));
    }

    fn live_wakers(&self) -> Vec<Arc<ControlWaker>> {
        let mut wakers = self
            .wakers
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        wakers.retain(|known| known.strong_count() > 0);
        wakers.iter().filter_map(Weak::upgrade).collect()
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
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_subscribed_waker_is_called_on_each_change_until_it_is_dropped() {
        let line = ControlLine::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let waker: Arc<ControlWaker> = Arc::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        line.subscribe(&waker);
        line.set(ControlState::Lockdown);
        line.set(ControlState::Running);
        assert_eq!(calls.load(Ordering::SeqCst), 2, "one call per change");
        drop(waker);
        line.set(ControlState::Lockdown);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "a dropped waker must not be called"
        );
    }

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
