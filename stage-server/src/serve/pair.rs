//! The state an upstream link shares with the downstream link opened for it: frames each hands the other, the
//! next stage's answer to the handshake, how each side ended, and the bytes the pair holds for the next stage.
//!
//! ```text
//!   Upstream ──send_down (control frames)──▶ to_downstream ──take_down──▶ Downstream ══▶ next stage
//!   compute thread ──send_down (rows)──────▶       │ Backlog: queued + what the downstream holds
//!   Upstream ◀──────────────── to_upstream ◀──send_up── Downstream ◀══ next stage
//!            ◀── RELAY_TOKEN wake when the Backlog falls back within the budget
//! ```

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use net_io_blocking::Completer;

use super::budget::{Backlog, LinkBudget};
use super::link::{RELAY_TOKEN, Writing};
use crate::wire::{Frame, Hello, encode};

/// Frames and news each link of a pair hands the other.
#[derive(Debug, Default)]
pub(crate) struct PairState {
    /// Encoded frames, each with the span of the frame whose rows it carries, if it is one.
    to_downstream: VecDeque<(Vec<u8>, Option<Writing>)>,
    pub(crate) to_upstream: VecDeque<Vec<u8>>,
    pub(crate) upstream: Option<Completer>,
    pub(crate) downstream: Option<Completer>,
    /// The next stage's hello once its handshake ended, or why it failed.
    pub(crate) downstream_answer: Option<Result<Hello, Unreached>>,
    /// Why the downstream link closed, once it did.
    pub(crate) downstream_closed: Option<String>,
    pub(crate) upstream_closed: bool,
    /// The upstream link has sessions open: both links are busy (a drain lets them finish).
    pub(crate) active: bool,
    /// The bytes held for the next stage, and whether the upstream link waits for them to fall.
    backlog: Backlog,
}

/// Why a downstream link did not come up, and whether trying again could help.
#[derive(Debug)]
pub(crate) struct Unreached {
    pub(crate) message: String,
    /// The next stage could not be reached (refused, timed out, closed before it answered): a later attempt
    /// may find it. `false` when it answered and refused the link, which no retry changes.
    pub(crate) retryable: bool,
}

/// An upstream link and the downstream link opened for it.
#[derive(Debug)]
pub(crate) struct Pair {
    state: Mutex<PairState>,
    /// The most bytes the pair holds for the next stage before its upstream link holds chunks back.
    budget: LinkBudget,
}

impl Pair {
    pub(crate) fn new(budget: LinkBudget) -> Pair {
        Pair {
            state: Mutex::new(PairState::default()),
            budget,
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, PairState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn wake(completer: Option<&Completer>) {
        if let Some(completer) = completer {
            // A full ring means a wake is pending already; that wake sees this news too.
            let _ = completer.post(RELAY_TOKEN, 0);
        }
    }

    /// Queues `frame` for the next stage; `writing`: the span of the computed frame whose rows it carries.
    pub(crate) fn send_down(&self, frame: &Frame, writing: Option<Writing>) {
        let mut bytes = Vec::new();
        encode(frame, &mut bytes);
        let mut state = self.lock();
        state.backlog.queued(bytes.len());
        state.to_downstream.push_back((bytes, writing));
        Self::wake(state.downstream.as_ref());
    }

    pub(crate) fn send_up(&self, bytes: Vec<u8>) {
        let mut state = self.lock();
        state.to_upstream.push_back(bytes);
        Self::wake(state.upstream.as_ref());
    }

    /// Every frame queued for the downstream link; their bytes count as its own until it says what it holds
    /// ([`Pair::downstream_holds`]).
    pub(crate) fn take_down(&self) -> VecDeque<(Vec<u8>, Option<Writing>)> {
        let mut state = self.lock();
        state.backlog.taken();
        std::mem::take(&mut state.to_downstream)
    }

    /// The downstream link holds `bytes` for the next stage (held by its shaper, queued in its output): wakes
    /// the upstream link if it waits and the backlog is back within the budget.
    pub(crate) fn downstream_holds(&self, bytes: usize) {
        let mut state = self.lock();
        if state.backlog.downstream_holds(bytes, self.budget) {
            Self::wake(state.upstream.as_ref());
        }
    }

    /// Whether the upstream link may hand compute another chunk while `committed` bytes of its rows are
    /// computing; if not, the downstream link wakes it once the backlog falls back within the budget.
    pub(crate) fn admits(&self, committed: usize) -> bool {
        self.lock().backlog.admits(committed, self.budget)
    }
}
