//! The parts of an event loop other threads reach: its wake (eventfd and the ready list completions fill),
//! its connection slots by id (for kills, drains and sheds), its load (for placement) and its inbox (where
//! accept threads hand it admitted connections).

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Wake;
use std::time::Duration;

use net_io_sys::eventfd::EventFd;
use net_io_sys::kill::KillSlot;

/// The load a loop that could not start reports.
const DEAD_LOOP_LOAD: usize = usize::MAX / 2;

/// What a loop shares with accept threads, killers, drains and completers.
pub(crate) struct LoopShared {
    pub(crate) wake: Arc<LoopWake>,
    /// Every connection slot the loop ever made (slots are reused, never removed); drains and sheds scan it.
    pub(crate) slots: Mutex<Vec<Arc<ConnectionSlot>>>,
    /// The slot of each connection the loop holds, by id, so that a kill by id is one lookup per loop rather
    /// than a scan of every slot. Written only by the loop (at start and at the final close); the map keeps
    /// its capacity, so a steady number of connections allocates nothing.
    pub(crate) by_id: Mutex<HashMap<u64, Arc<ConnectionSlot>>>,
    /// Connections queued for this loop or held by it: accept threads place each new connection on the loop
    /// with the fewest, so a loop emptied by closes fills first instead of taking every n-th id.
    pub(crate) load: AtomicUsize,
    /// The loop serves its one connection in solo reads (see [`EventLoop::solo_read`]): a new connection
    /// placed here waits for the end of the current slice, so placement breaks a tie against this loop.
    pub(crate) solo: AtomicBool,
    /// The longest solo read; zero turns solo reads off.
    pub(crate) solo_slice: Duration,
}

/// A loop's wake: its eventfd and the entries whose completion ring got a post.
pub(crate) struct LoopWake {
    pub(crate) eventfd: Arc<EventFd>,
    pub(crate) ready: Mutex<Vec<u32>>,
}

/// The shared parts of one connection slot of a loop.
pub(crate) struct ConnectionSlot {
    pub(crate) slot: Arc<KillSlot>,
    /// The id of the connection whose graceful close lingers in this slot, 0 otherwise (as for workers).
    pub(crate) linger: Arc<AtomicU64>,
    pub(crate) lane: AtomicU8,
}

/// Wakes a loop for one entry's completion.
pub(crate) struct EntryWake {
    pub(crate) wake: Arc<LoopWake>,
    pub(crate) index: u32,
}

impl LoopShared {
    /// A loop's shared parts; `solo_slice` is the longest solo read (zero: none).
    pub(crate) fn new(solo_slice: Duration) -> io::Result<Self> {
        Ok(Self {
            wake: Arc::new(LoopWake {
                eventfd: Arc::new(EventFd::new()?),
                ready: Mutex::new(Vec::new()),
            }),
            slots: Mutex::new(Vec::new()),
            by_id: Mutex::new(HashMap::new()),
            load: AtomicUsize::new(0),
            solo: AtomicBool::new(false),
            solo_slice,
        })
    }

    /// The slot that holds connection `id` on this loop, if this loop holds it (open or lingering).
    pub(crate) fn find(&self, id: u64) -> Option<Arc<ConnectionSlot>> {
        self.by_id
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&id)
            .cloned()
    }

    /// The placement weight of this loop: twice the connections queued for it or held by it right now, plus
    /// one while it is in solo reads. Fewer connections always weigh less; between loops holding as many,
    /// one that would make a new connection wait for the end of a solo slice weighs more.
    pub(crate) fn load(&self) -> usize {
        self.load
            .load(Ordering::Relaxed)
            .saturating_mul(2)
            .saturating_add(usize::from(self.solo.load(Ordering::Relaxed)))
    }

    /// Counts a connection queued for this loop (by the accept thread, before it offers the job).
    pub(crate) fn add_load(&self) {
        self.load.fetch_add(1, Ordering::Relaxed);
    }

    /// Marks a loop that could not start: its load reads as far above any real one (and stays there under
    /// the counting above, which neither wraps nor reaches it), so no connection is placed on it while
    /// another loop runs.
    pub(crate) fn mark_dead(&self) {
        self.load.store(DEAD_LOOP_LOAD, Ordering::Relaxed);
    }

    /// Counts a connection gone from this loop: closed, or refused before the loop took it.
    pub(crate) fn remove_load(&self) {
        // Never below zero, even if a refusal path and a close both counted (they cannot, but a wrap here
        // would make the loop look full forever).
        let _ = self
            .load
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |load| {
                Some(load.saturating_sub(1))
            });
    }

    pub(crate) fn ids(&self) -> MutexGuard<'_, HashMap<u64, Arc<ConnectionSlot>>> {
        self.by_id
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn slots(&self) -> MutexGuard<'_, Vec<Arc<ConnectionSlot>>> {
        self.slots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Wake for EntryWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wake
            .ready
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(self.index);
        let _ = self.wake.eventfd.signal();
    }
}

/// Jobs handed from accept threads to one loop.
pub(crate) struct Inbox<J> {
    pub(crate) state: Mutex<InboxState<J>>,
}

pub(crate) struct InboxState<J> {
    pub(crate) jobs: Vec<J>,
    pub(crate) closed: bool,
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

    pub(crate) fn lock(&self) -> MutexGuard<'_, InboxState<J>> {
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
    pub(crate) fn take_into(&self, into: &mut Vec<J>) -> bool {
        let mut state = self.lock();
        into.append(&mut state.jobs);
        state.closed
    }
}
