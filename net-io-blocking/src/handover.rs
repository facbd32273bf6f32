//! The bounded hand-over queue between accept threads and workers, with the Busy rule.
//!
//! A mutex-guarded deque plus a condition variable. A worker counts as busy from the moment it takes a job,
//! and [`HandOver::offer`] refuses when queued jobs plus busy workers have reached the worker count (both
//! read under the lock), so a burst can never queue more connections than there are workers to serve them.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};

#[derive(Debug)]
struct State<J> {
    jobs: VecDeque<J>,
    busy: usize,
    closed: bool,
}

/// Jobs waiting for a worker.
#[derive(Debug)]
pub(crate) struct HandOver<J> {
    state: Mutex<State<J>>,
    available: Condvar,
    workers: usize,
}

impl<J> HandOver<J> {
    pub(crate) fn new(workers: usize) -> Self {
        Self {
            state: Mutex::new(State {
                jobs: VecDeque::with_capacity(workers),
                busy: 0,
                closed: false,
            }),
            available: Condvar::new(),
            workers,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<J>> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues `job` for a worker, or gives it back when every worker is taken (the Busy rule) or the queue is closed.
    pub(crate) fn offer(&self, job: J) -> Result<(), J> {
        let mut state = self.lock();
        if state.closed || state.jobs.len() + state.busy >= self.workers {
            return Err(job);
        }
        state.jobs.push_back(job);
        drop(state);
        self.available.notify_one();
        Ok(())
    }

    /// Blocks until a job is queued (the caller is then busy until [`done`](Self::done)); `None` once closed.
    pub(crate) fn take(&self) -> Option<J> {
        let mut state = self.lock();
        loop {
            if let Some(job) = state.jobs.pop_front() {
                state.busy += 1;
                return Some(job);
            }
            if state.closed {
                return None;
            }
            state = self
                .available
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// Whether an offer would be taken now (checked before the gate is asked, so a full pool costs no gate call).
    pub(crate) fn has_room(&self) -> bool {
        let state = self.lock();
        !state.closed && state.jobs.len() + state.busy < self.workers
    }

    /// Marks one worker free again.
    pub(crate) fn done(&self) {
        let mut state = self.lock();
        state.busy = state.busy.saturating_sub(1);
    }

    /// Stops taking jobs, wakes every waiting worker and returns the jobs still queued (to be refused).
    pub(crate) fn close(&self) -> Vec<J> {
        let mut state = self.lock();
        state.closed = true;
        let left = state.jobs.drain(..).collect();
        drop(state);
        self.available.notify_all();
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_one_worker_a_second_job_is_refused_until_the_first_is_done() {
        let queue = HandOver::new(1);
        queue.offer(1).expect("the first job fits");
        assert_eq!(queue.offer(2), Err(2), "a queued job fills the only worker");
        assert_eq!(queue.take(), Some(1));
        assert_eq!(queue.offer(3), Err(3), "a busy worker still counts");
        queue.done();
        queue.offer(4).expect("a free worker takes a job again");
        assert_eq!(queue.close(), vec![4]);
        assert_eq!(queue.take(), None, "a closed queue hands out nothing");
    }
}
