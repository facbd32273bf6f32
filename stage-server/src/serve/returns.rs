//! Direct prediction return at the last stage: the links stage 0 opened to it (role `PredictionReturn`), the
//! sessions each one asked for, and the hand-over of a sampled token from the compute thread to the return link
//! that carries it straight back, so that middle stages never relay tokens.
//!
//! ```text
//!   stage 0 ══ OpenReturn{s} ══▶ return link ──register s──▶ Returns (session → ReturnSink)
//!                                                                  ▲
//!   compute thread (serve::onward) ── Outcome::Token{s} ── lookup s ─┘ push + post ──▶ return link ══ Token ══▶ stage 0
//!                         └─ no entry: the token goes to the chain link that submitted the job, up the chain
//! ```
//!
//! A return link answers each `OpenReturn` with an `Ack` (position 0), so stage 0 knows the session is
//! registered before its last prefill chunk goes down the chain, and with it the first token. Its `Stop`
//! unregisters the session; its close unregisters every session it holds.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use net_io_blocking::Completer;

use super::link::Writing;
use super::shaping::{LinkShape, Shaper};

/// An encoded frame and the span of the computed frame it answers, if that span records.
type Queued = (Vec<u8>, Option<Writing>);

/// Sessions one return link may hold at once: a stage 0 runs one generation per lane, so far fewer; the
/// bound keeps a peer that never sends `Stop` from growing the table without end.
pub(crate) const RETURN_SESSIONS_MAX: usize = 1024;

/// Where the tokens of the registered sessions go: one per return link.
#[derive(Debug)]
pub(crate) struct ReturnSink {
    /// Encoded `Token` frames for the link to write, oldest first.
    queue: Mutex<VecDeque<Queued>>,
    /// Wakes the return link's session.
    completer: Completer,
}

impl ReturnSink {
    fn lock(&self) -> MutexGuard<'_, VecDeque<Queued>> {
        self.queue
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues an encoded frame for the return link and wakes it.
    pub(crate) fn push(&self, frame: Queued, wake_token: u64) {
        self.lock().push_back(frame);
        // A full ring means a wake is pending already; that wake takes this frame too.
        let _ = self.completer.post(wake_token, 0);
    }
}

/// The stage's table of registered sessions, shared by every link of the stage.
#[derive(Debug, Default)]
pub(crate) struct Returns {
    sessions: Mutex<HashMap<u64, Arc<ReturnSink>>>,
}

impl Returns {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<ReturnSink>>> {
        self.sessions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The return link that registered `session`, if one did.
    pub(crate) fn sink(&self, session: u64) -> Option<Arc<ReturnSink>> {
        self.lock().get(&session).cloned()
    }
}

/// A return link's own state at the last stage.
#[derive(Debug)]
pub(crate) struct ReturnLink {
    sink: Arc<ReturnSink>,
    /// The sessions this link registered.
    sessions: HashSet<u64>,
    /// Holds tokens back when the stage's link is shaped (`--link-delay`, `--link-rate`).
    shaper: Option<Shaper>,
    /// The spans of the frames the shaper holds, in its order (it hands frames over first in, first out).
    shaped: VecDeque<Option<Writing>>,
}

impl ReturnLink {
    /// A return link woken through `completer`, its tokens shaped by `shape`.
    pub(crate) fn new(completer: Completer, shape: LinkShape) -> ReturnLink {
        ReturnLink {
            sink: Arc::new(ReturnSink {
                queue: Mutex::new(VecDeque::new()),
                completer,
            }),
            sessions: HashSet::new(),
            shaper: shape.is_shaped().then(|| Shaper::new(shape)),
            shaped: VecDeque::new(),
        }
    }

    /// Whether the link holds any session (then it is busy: a drain lets its generations finish).
    pub(crate) fn has_sessions(&self) -> bool {
        !self.sessions.is_empty()
    }

    /// The sessions this link holds.
    pub(crate) fn sessions(&self) -> impl Iterator<Item = u64> + '_ {
        self.sessions.iter().copied()
    }

    /// Registers `session` for this link (taking it from another return link that held it). Refuses past
    /// [`RETURN_SESSIONS_MAX`], in words.
    pub(crate) fn open(&mut self, returns: &Returns, session: u64) -> Result<(), String> {
        if !self.sessions.contains(&session) && self.sessions.len() >= RETURN_SESSIONS_MAX {
            return Err(format!(
                "this prediction-return link already holds {RETURN_SESSIONS_MAX} sessions; send Stop for finished ones"
            ));
        }
        self.sessions.insert(session);
        returns.lock().insert(session, Arc::clone(&self.sink));
        Ok(())
    }

    /// Unregisters `session`, if this link holds it.
    pub(crate) fn stop(&mut self, returns: &Returns, session: u64) {
        if self.sessions.remove(&session) {
            self.forget(&mut returns.lock(), session);
        }
    }

    /// The link closed: every session it held goes back to being answered up the chain.
    pub(crate) fn close(&mut self, returns: &Returns) {
        let mut table = returns.lock();
        for session in std::mem::take(&mut self.sessions) {
            self.forget(&mut table, session);
        }
    }

    /// Removes `session`'s entry if it still points at this link (a later `OpenReturn` on another link
    /// took it over otherwise).
    fn forget(&self, table: &mut HashMap<u64, Arc<ReturnSink>>, session: u64) {
        if table
            .get(&session)
            .is_some_and(|sink| Arc::ptr_eq(sink, &self.sink))
        {
            table.remove(&session);
        }
    }

    /// The frames to write now, in order: what was queued, through the shaper when there is one (which then
    /// arms its timer through `completer` for the frames it still holds).
    pub(crate) fn take_due(&mut self, completer: Option<&Completer>) -> Vec<Queued> {
        let queued: Vec<Queued> = self.sink.lock().drain(..).collect();
        let Some(shaper) = self.shaper.as_mut() else {
            return queued;
        };
        let now = Instant::now();
        for (bytes, writing) in queued {
            shaper.hold(now, bytes);
            self.shaped.push_back(writing);
        }
        let due = shaper.due(now);
        if let Some(completer) = completer {
            shaper.arm(now, completer);
        }
        due.into_iter()
            .map(|bytes| (bytes, self.shaped.pop_front().flatten()))
            .collect()
    }
}
