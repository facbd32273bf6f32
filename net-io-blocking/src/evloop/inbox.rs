//! The inbox through which accept threads hand admitted connections to one loop.

use std::sync::{Mutex, MutexGuard};

/// Jobs handed from accept threads to one loop.
pub(crate) struct Inbox<J> {
    pub(super) state: Mutex<InboxState<J>>,
}

pub(super) struct InboxState<J> {
    pub(super) jobs: Vec<J>,
    pub(super) closed: bool,
}

impl<J> Inbox<J> {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(InboxState {
                jobs: Vec::new(),
                closed: false,
            }),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, InboxState<J>> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues `job`, or gives it back once the inbox is closed. Answers whether the loop must be woken: only
    /// the job that finds the inbox empty wakes it, since the loop drains its eventfd before it takes the
    /// jobs, so any job queued behind that one is taken in the same pass.
    pub(crate) fn offer(&self, job: J) -> Result<bool, J> {
        let mut state = self.lock();
        if state.closed {
            return Err(job);
        }
        let was_empty = state.jobs.is_empty();
        state.jobs.push(job);
        Ok(was_empty)
    }

    /// Closes the inbox and returns what was still queued (to be refused).
    pub(crate) fn close(&self) -> Vec<J> {
        let mut state = self.lock();
        state.closed = true;
        std::mem::take(&mut state.jobs)
    }

    /// Moves queued jobs into `into` (keeping both vectors' capacity); returns whether the inbox is closed.
    pub(super) fn take_into(&self, into: &mut Vec<J>) -> bool {
        let mut state = self.lock();
        into.append(&mut state.jobs);
        state.closed
    }
}
