//! The byte budget of a link pair, sans IO: how many bytes a pair holds for the next stage and how many an
//! upstream link has read ahead, and when each stops the link (no chunk to compute, no read of its socket).
//!
//! ```text
//!   previous stage ══▶ socket ──read──▶ ReadAhead ──chunk──▶ compute ──rows──▶ Backlog ══▶ next stage
//!                        ▲                 │          ▲      (Jobs)             │
//!                        │ park while      │          └── held while Backlog ───┘ (to_downstream, the shaper,
//!                        └─ ReadAhead is ──┘              + Jobs > budget;          the downstream output)
//!                           over the budget               a fall under it wakes the upstream link
//! ```
//!
//! A stage behind a slower next link would otherwise take every chunk the stage before sends (up to stage 0's
//! reply credits, which this stage cannot see), compute it and queue its rows for the slow link: the issue's
//! "memory held per link is bounded by credits x chunk size" held only at one credit. With the budget, what a
//! pair holds stays under about twice the budget plus one chunk in each place, whatever the credits, and the
//! stage before sees TCP back-pressure instead of a refusal.

use std::collections::VecDeque;

use crate::model::PREFILL_CHUNK;
use crate::wire::{Frame, WireLimits};

/// Compute jobs one upstream link may have in flight before it hands no more (frames then wait in its
/// read-ahead).
pub(crate) const JOBS_IN_FLIGHT_MAX: usize = 8;
/// Frames an upstream link may hold read ahead before it stops reading its socket, whatever their bytes: a
/// stream of small frames (decode steps of a narrow model) stays bounded in count as well.
pub(crate) const QUEUED_FRAMES_MAX: usize = 64;
/// The least default budget: room for the bandwidth-delay product of a fast long link (1 Gbit/s over a
/// 500 ms round trip), so a narrow model's link is never held back by a budget sized to its small frames.
const BUDGET_FLOOR_BYTES: usize = 64 << 20;
/// What a frame costs besides its payload (its enum and header), so a stream of control frames counts too.
const FRAME_OVERHEAD_BYTES: usize = 64;

/// The most bytes one link pair holds for the next stage, and the most it reads ahead of its answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LinkBudget {
    bytes: usize,
}

impl LinkBudget {
    /// A budget of `bytes` (0 counts as 1; either way an empty pair still lets one chunk through at a time).
    pub(crate) fn new(bytes: usize) -> LinkBudget {
        LinkBudget {
            bytes: bytes.max(1),
        }
    }

    /// The default for a stage of `width`-wide rows and `lanes` lanes: `lanes + 2` of the largest prefill
    /// frame stage 0 sends ([`PREFILL_CHUNK`] rows in f32, no more than `limits` lets a frame be), so every
    /// lane can have a chunk in each place of the pair with two to spare, and never under 64 MiB. A stream
    /// that keeps to one reply credit never comes near it.
    pub(crate) fn default_for(width: u32, lanes: usize, limits: &WireLimits) -> LinkBudget {
        let frame = (PREFILL_CHUNK * width as usize * 4).min(limits.max_frame_bytes);
        LinkBudget::new(
            lanes
                .saturating_add(2)
                .saturating_mul(frame)
                .max(BUDGET_FLOOR_BYTES),
        )
    }

    /// The budget in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

/// What one pair holds for the next stage, in bytes, and whether its upstream link waits for that to fall.
/// Lives in the pair's state, under its lock, so a wait and the fall that ends it cannot miss each other.
#[derive(Debug, Default)]
pub(crate) struct Backlog {
    /// Encoded frames queued for the downstream link, not yet taken.
    queued: usize,
    /// What the downstream link holds: its shaper's frames and its output queue, as it last said.
    downstream: usize,
    /// The upstream link held a chunk back for this backlog and waits for a wake.
    upstream_waits: bool,
}

impl Backlog {
    /// Every byte the pair holds for the next stage.
    pub(crate) fn bytes(&self) -> usize {
        self.queued.saturating_add(self.downstream)
    }

    /// A frame of `bytes` was queued for the downstream link.
    pub(crate) fn queued(&mut self, bytes: usize) {
        self.queued = self.queued.saturating_add(bytes);
    }

    /// The downstream link took every queued frame: they count as its own until it says what it holds.
    pub(crate) fn taken(&mut self) {
        self.downstream = self.downstream.saturating_add(self.queued);
        self.queued = 0;
    }

    /// The downstream link holds `bytes` now. True when the upstream link waits and the backlog is back
    /// within `budget`: it is to be woken (once: the wait is over).
    #[must_use]
    pub(crate) fn downstream_holds(&mut self, bytes: usize, budget: LinkBudget) -> bool {
        self.downstream = bytes;
        if self.upstream_waits && self.bytes() <= budget.bytes() {
            self.upstream_waits = false;
            return true;
        }
        false
    }

    /// Whether the upstream link may hand compute another chunk while `committed` bytes of its chunks are
    /// computing (their rows join this backlog when done): yes while the two together are within `budget`.
    /// A no makes the upstream wait for [`Backlog::downstream_holds`] to say the backlog fell (or for a job
    /// to finish, which wakes it anyway). An empty pair always admits, so a budget smaller than one chunk
    /// slows the link to a chunk at a time rather than stopping it.
    pub(crate) fn admits(&mut self, committed: usize, budget: LinkBudget) -> bool {
        let admitted = self.bytes().saturating_add(committed) <= budget.bytes();
        self.upstream_waits = !admitted;
        admitted
    }
}

/// Frames an upstream link read and has not acted on yet (the compute thread is busy with its jobs, or the
/// pair's backlog is over the budget), in order, with their bytes.
#[derive(Debug, Default)]
pub(crate) struct ReadAhead {
    frames: VecDeque<Frame>,
    bytes: usize,
}

impl ReadAhead {
    pub(crate) fn push(&mut self, frame: Frame) {
        self.bytes = self.bytes.saturating_add(frame_bytes(&frame));
        self.frames.push_back(frame);
    }

    pub(crate) fn front(&self) -> Option<&Frame> {
        self.frames.front()
    }

    pub(crate) fn pop(&mut self) -> Option<Frame> {
        let frame = self.frames.pop_front()?;
        self.bytes = self.bytes.saturating_sub(frame_bytes(&frame));
        Some(frame)
    }

    /// True while the link should not read its socket: more than `budget` bytes or [`QUEUED_FRAMES_MAX`]
    /// frames wait. The stage before then meets TCP back-pressure instead of a refusal.
    pub(crate) fn is_full(&self, budget: LinkBudget) -> bool {
        self.bytes > budget.bytes() || self.frames.len() > QUEUED_FRAMES_MAX
    }
}

/// The compute jobs an upstream link handed over and has no outcome for yet, with the bytes of rows each
/// commits to the pair's backlog (outcomes come back in the order the jobs went, one each).
#[derive(Debug, Default)]
pub(crate) struct Jobs {
    committed: VecDeque<usize>,
    bytes: usize,
}

impl Jobs {
    /// A job went to the compute thread; `bytes` of rows will come of it (0 for a control job).
    pub(crate) fn submitted(&mut self, bytes: usize) {
        self.committed.push_back(bytes);
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// The oldest job's outcome came.
    pub(crate) fn answered(&mut self) {
        if let Some(bytes) = self.committed.pop_front() {
            self.bytes = self.bytes.saturating_sub(bytes);
        }
    }

    /// Jobs in flight.
    pub(crate) fn count(&self) -> usize {
        self.committed.len()
    }

    /// True while the link may hand over another job.
    pub(crate) fn has_room(&self) -> bool {
        self.count() < JOBS_IN_FLIGHT_MAX
    }

    /// Bytes of rows the jobs in flight will add to the backlog.
    pub(crate) fn committed(&self) -> usize {
        self.bytes
    }
}

/// Bytes of rows a frame hands the compute thread, as the f32 it decodes them to (the rows it sends on have
/// the same shape, and no codec makes them larger); 0 for a frame without rows.
pub(crate) fn rows_bytes(frame: &Frame) -> usize {
    match frame {
        Frame::Prefill { rows, .. } | Frame::Decode { rows, .. } => (rows.rows as usize)
            .saturating_mul(rows.width as usize)
            .saturating_mul(4),
        _ => 0,
    }
}

/// About the bytes a decoded frame holds: its payload and a fixed overhead.
fn frame_bytes(frame: &Frame) -> usize {
    let payload = match frame {
        Frame::Prefill { rows, .. } | Frame::Decode { rows, .. } => rows.bytes.len(),
        Frame::Configure {
            stop_tokens,
            logit_bias,
            history,
            ..
        } => (stop_tokens.len() + history.len()) * 4 + logit_bias.len() * 8,
        Frame::Error { message, .. } => message.len(),
        _ => 0,
    };
    payload.saturating_add(FRAME_OVERHEAD_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Activations, CodecPolicy};

    const MIB: usize = 1 << 20;

    fn prefill(rows: usize, width: usize) -> Frame {
        Frame::Prefill {
            session: 1,
            position: 0,
            last: false,
            batch: crate::wire::Batch::alone(1, rows as u32),
            rows: Activations::encode(&vec![0.5; rows * width], width as u32, CodecPolicy::F32),
        }
    }

    #[test]
    fn the_default_budget_holds_two_more_of_the_largest_prefill_frame_than_there_are_lanes() {
        let limits = WireLimits::default();
        // 512 rows of 8,192 f32 values are 16 MiB a frame; four lanes and two to spare make six.
        assert_eq!(LinkBudget::default_for(8_192, 4, &limits).bytes(), 96 * MIB);
        // A narrow model's frames are small: the floor gives its link the room a fast long link needs.
        assert_eq!(
            LinkBudget::default_for(576, 4, &limits).bytes(),
            64 * MIB,
            "a narrow model should get the 64 MiB floor"
        );
        // A frame is never counted past what the wire lets one be.
        assert_eq!(
            LinkBudget::default_for(65_536, 1, &limits).bytes(),
            3 * limits.max_frame_bytes
        );
        assert_eq!(LinkBudget::new(0).bytes(), 1, "a budget is never zero");
    }

    #[test]
    fn a_pair_admits_chunks_while_its_backlog_and_the_rows_computing_fit_the_budget() {
        let budget = LinkBudget::new(4 * MIB);
        let mut backlog = Backlog::default();
        assert!(
            backlog.admits(0, budget),
            "an empty pair admits even a chunk larger than the budget"
        );
        assert!(backlog.admits(4 * MIB, budget), "exactly the budget fits");
        assert!(
            !backlog.admits(4 * MIB + 1, budget),
            "rows computing past the budget should hold the next chunk"
        );
        backlog.queued(3 * MIB);
        assert_eq!(backlog.bytes(), 3 * MIB);
        assert!(backlog.admits(MIB, budget));
        assert!(
            !backlog.admits(2 * MIB, budget),
            "queued rows and rows computing count together"
        );
    }

    #[test]
    fn the_upstream_is_woken_once_when_the_backlog_falls_back_within_the_budget() {
        let budget = LinkBudget::new(4 * MIB);
        let mut backlog = Backlog::default();
        backlog.queued(6 * MIB);
        assert!(
            !backlog.downstream_holds(0, budget),
            "nobody waits yet, so there is nobody to wake"
        );
        assert!(!backlog.admits(0, budget), "6 MiB queued is over 4 MiB");
        // The downstream link takes the frames: the bytes move, the total stays.
        backlog.taken();
        assert_eq!(backlog.bytes(), 6 * MIB, "taking frames moves their bytes");
        assert!(
            !backlog.downstream_holds(5 * MIB, budget),
            "still over the budget: no wake"
        );
        assert!(
            backlog.downstream_holds(4 * MIB, budget),
            "back within the budget: the waiting upstream is woken"
        );
        assert!(
            !backlog.downstream_holds(0, budget),
            "the wait ended with the first wake"
        );
        assert!(backlog.admits(0, budget));
    }

    #[test]
    fn frames_read_ahead_fill_by_bytes_or_by_count() {
        let budget = LinkBudget::new(4 * MIB);
        let mut ahead = ReadAhead::default();
        // 64 rows of 8,192 f32 values: 2 MiB and a header each.
        ahead.push(prefill(64, 8_192));
        ahead.push(prefill(64, 8_192));
        assert!(
            ahead.is_full(budget),
            "two 2 MiB frames and their headers are over a 4 MiB budget"
        );
        assert!(ahead.pop().is_some());
        assert!(!ahead.is_full(budget), "one frame fits");
        assert!(ahead.pop().is_some());
        assert_eq!(ahead.bytes, 0, "popping every frame gives every byte back");
        for session in 0..=QUEUED_FRAMES_MAX as u64 {
            ahead.push(Frame::Stop { session });
        }
        assert!(
            ahead.is_full(budget),
            "more than {QUEUED_FRAMES_MAX} small frames stop the reading too"
        );
        assert!(matches!(ahead.front(), Some(Frame::Stop { session: 0 })));
    }

    #[test]
    fn jobs_commit_their_rows_until_their_outcomes_come_in_order() {
        let mut jobs = Jobs::default();
        let chunk = prefill(64, 8_192);
        assert_eq!(rows_bytes(&chunk), 2 * MIB);
        assert_eq!(rows_bytes(&Frame::Stop { session: 1 }), 0);
        jobs.submitted(0);
        jobs.submitted(rows_bytes(&chunk));
        jobs.submitted(rows_bytes(&chunk));
        assert_eq!((jobs.count(), jobs.committed()), (3, 4 * MIB));
        jobs.answered();
        assert_eq!(
            jobs.committed(),
            4 * MIB,
            "the control job's outcome frees no rows"
        );
        jobs.answered();
        jobs.answered();
        jobs.answered();
        assert_eq!((jobs.count(), jobs.committed()), (0, 0));
        for _ in 0..JOBS_IN_FLIGHT_MAX {
            assert!(jobs.has_room());
            jobs.submitted(1);
        }
        assert!(
            !jobs.has_room(),
            "{JOBS_IN_FLIGHT_MAX} jobs fill the link's share"
        );
    }
}
