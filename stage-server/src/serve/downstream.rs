//! The link a stage opens to the next one for each upstream link (`Downstream`): it says this stage's hello,
//! writes the frames its pair queues for the next stage (through the shaper on a shaped link), relays the next
//! stage's answers up, and tells its pair how many bytes it holds so the upstream link can keep to the budget.
//!
//! ```text
//!   Pair.to_downstream ──take_down──▶ shaper (if shaped) ──▶ output ══▶ next stage
//!                                     └──── their bytes ────┘──▶ Pair::downstream_holds: wakes a waiting
//!                                                                upstream link once back within the budget
//!   Pair.to_upstream ◀──send_up── shaper_up (if shaped) ◀══ next stage
//! ```

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use net_io_blocking::{CloseReason, ConnectionInfo, Input, Phase, SessionContext, Step};

use super::link::{StageShared, Writing, flushed};
use super::pair::{Pair, Unreached};
use super::shaping::Shaper;
use crate::telemetry::names;
use crate::telemetry::registry::{LinkSide, STAGE};
use crate::wire::{Decoder, Frame, Hello, Side, check_adjacent, encode, proof, verify};

/// A link this stage opened to the next one.
#[derive(Debug)]
pub(crate) struct Downstream {
    shared: Arc<StageShared>,
    decoder: Decoder,
    pair: Arc<Pair>,
    /// Our hello as sent (for the adjacency check and the nonces).
    ours: Hello,
    /// The next stage's hello checked out.
    serving: bool,
    /// Holds frames back when the link is shaped (`--link-delay`, `--link-rate`).
    shaper: Option<Shaper>,
    /// Holds the next stage's answers back the same way before they go up: a shaped link is slow both ways.
    shaper_up: Option<Shaper>,
    /// The spans of the frames the shaper holds, in its order (it hands frames over first in, first out).
    shaped: VecDeque<Option<Writing>>,
    /// Frames whose rows are in this link's output, until the flush writes them.
    writing: Vec<Writing>,
    /// Why the link failed, when this stage ended it (the close's reason says less).
    failure: Option<String>,
}

impl Downstream {
    /// The link to the next stage for `pair`, saying `ours` (with its nonce set on a keyed stage).
    pub(crate) fn new(shared: Arc<StageShared>, pair: Arc<Pair>, ours: Hello) -> Downstream {
        let shaped = shared.shape.is_shaped();
        Downstream {
            decoder: Decoder::new(shared.limits),
            shaper: shaped.then(|| Shaper::new(shared.shape)),
            shaper_up: shaped.then(|| Shaper::new(shared.shape)),
            shared,
            pair,
            ours,
            serving: false,
            shaped: VecDeque::new(),
            writing: Vec::new(),
            failure: None,
        }
    }

    pub(crate) fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        {
            let mut state = self.pair.lock();
            if state.upstream_closed {
                // The upstream link ended while this connect was under way, so its wake found no session to
                // tell: the link would have stayed open, held by nobody, against the next stage's caps.
                return Step::Close;
            }
            state.downstream = context.completer();
        }
        let mut bytes = Vec::new();
        encode(&Frame::Hello(self.ours.clone()), &mut bytes);
        if context.output().push(&bytes).is_err() {
            return Step::Abort;
        }
        Step::Write
    }

    pub(crate) fn on_data(
        &mut self,
        input: &mut Input<'_>,
        context: &mut SessionContext<'_>,
    ) -> Step {
        STAGE.received(LinkSide::Downstream, input.bytes().len());
        while !input.is_empty() {
            match self.decoder.decode(input.bytes()) {
                Ok((taken, frame)) => {
                    input.consume(taken);
                    let Some(frame) = frame else {
                        break;
                    };
                    if let Some(step) = self.on_frame(frame, context) {
                        return step;
                    }
                }
                Err(error) => {
                    input.consume_all();
                    self.fail(format!(
                        "stage {} sent a frame this stage cannot read: {error}",
                        u32::from(self.ours.stage_index) + 1
                    ));
                    return Step::Abort;
                }
            }
        }
        if context.output().is_empty() {
            Step::Listen
        } else {
            Step::Write
        }
    }

    fn on_frame(&mut self, frame: Frame, context: &mut SessionContext<'_>) -> Option<Step> {
        if !self.serving {
            match frame {
                Frame::Hello(theirs) => {
                    if let Err(mismatch) = check_adjacent(&self.ours, &theirs) {
                        self.fail(mismatch.to_string());
                        return Some(Step::Close);
                    }
                    if let Some(key) = &self.shared.key {
                        let proven = theirs.proof.is_some_and(|proof| {
                            verify(
                                key,
                                Side::Accepting,
                                &self.ours.nonce,
                                &theirs.nonce,
                                &proof,
                            )
                        });
                        if !proven {
                            self.fail(format!(
                                "stage {} did not prove the cluster key; give every stage the same --cluster-key file",
                                theirs.stage_index
                            ));
                            return Some(Step::Close);
                        }
                        let answer = proof(key, Side::Connecting, &self.ours.nonce, &theirs.nonce);
                        let mut bytes = Vec::new();
                        encode(&Frame::Proof { proof: answer }, &mut bytes);
                        let _ = context.output().push(&bytes);
                    }
                    self.serving = true;
                    tracing::debug!(
                        stage_index = self.ours.stage_index,
                        peer = self.shared.next.map(tracing::field::display),
                        "{}",
                        names::EVENT_DOWNSTREAM_UP
                    );
                    let mut state = self.pair.lock();
                    state.downstream_answer = Some(Ok(theirs));
                    Pair::wake(state.upstream.as_ref());
                }
                Frame::Error { message, .. } => {
                    self.fail(message);
                    return Some(Step::Close);
                }
                other => {
                    self.fail(format!(
                        "the next stage answered the hello with a {} frame",
                        other.kind_name()
                    ));
                    return Some(Step::Close);
                }
            }
            self.take_queued(context);
            return None;
        }
        // Answers from the rest of the chain go up as they came (once a shaped link would have delivered them).
        let mut bytes = Vec::new();
        encode(&frame, &mut bytes);
        match self.shaper_up.as_mut() {
            None => self.pair.send_up(bytes),
            Some(shaper) => {
                shaper.hold(Instant::now(), bytes);
                self.release_up(context);
            }
        }
        None
    }

    /// Hands the answers the upward shaper lets through now to the upstream link, and arms its timer for the
    /// rest.
    fn release_up(&mut self, context: &mut SessionContext<'_>) {
        let Some(shaper) = self.shaper_up.as_mut() else {
            return;
        };
        let now = Instant::now();
        for bytes in shaper.due(now) {
            self.pair.send_up(bytes);
        }
        if let Some(completer) = context.completer() {
            shaper.arm(now, &completer);
        }
    }

    pub(crate) fn on_wake(&mut self, context: &mut SessionContext<'_>) -> Step {
        let (closed, active) = {
            let state = self.pair.lock();
            (state.upstream_closed, state.active)
        };
        if closed {
            return Step::Close;
        }
        context.set_phase(if active {
            Phase::Receiving
        } else {
            Phase::Idle
        });
        if self.serving {
            self.take_queued(context);
            self.release_up(context);
        }
        if context.output().is_empty() {
            Step::Listen
        } else {
            Step::Write
        }
    }

    /// Every byte is out: the pair hears what the link still holds (its shaper's frames).
    pub(crate) fn on_writable(&mut self, context: &mut SessionContext<'_>) -> Step {
        flushed(&mut self.writing);
        self.report_held(context);
        Step::Listen
    }

    /// Tells the pair the bytes this link holds for the next stage: its shaper's frames and its output queue
    /// (a flush in progress is counted whole until it ends: the session hears only of a whole flush).
    fn report_held(&mut self, context: &mut SessionContext<'_>) {
        let shaped = self.shaper.as_ref().map_or(0, Shaper::held_bytes);
        self.pair
            .downstream_holds(shaped.saturating_add(context.output().pending()));
    }

    fn take_queued(&mut self, context: &mut SessionContext<'_>) {
        let frames = self.pair.take_down();
        let frames: Vec<(Vec<u8>, Option<Writing>)> = match self.shaper.as_mut() {
            None => frames.into(),
            Some(shaper) => {
                let now = Instant::now();
                for (bytes, writing) in frames {
                    shaper.hold(now, bytes);
                    self.shaped.push_back(writing);
                }
                let due = shaper.due(now);
                if let Some(completer) = context.completer() {
                    shaper.arm(now, &completer);
                }
                due.into_iter()
                    .map(|bytes| (bytes, self.shaped.pop_front().flatten()))
                    .collect()
            }
        };
        for (bytes, writing) in frames {
            STAGE.sent(LinkSide::Downstream, bytes.len());
            if context.output().push(&bytes).is_err() {
                self.fail("the link to the next stage has too much queued output".into());
                return;
            }
            self.writing.extend(writing);
        }
        self.report_held(context);
    }

    /// The handshake failed: the upstream link answers its own upstream with `message`.
    fn fail(&mut self, message: String) {
        self.failure.get_or_insert_with(|| message.clone());
        let mut state = self.pair.lock();
        if state.downstream_answer.is_none() && !self.serving {
            // The next stage answered and refused (or spoke nonsense): trying again changes nothing.
            state.downstream_answer = Some(Err(Unreached {
                message,
                retryable: false,
            }));
        } else {
            state.downstream_closed = Some(message);
        }
        Pair::wake(state.upstream.as_ref());
    }

    pub(crate) fn on_close(&mut self, info: &ConnectionInfo, reason: CloseReason) {
        let mut state = self.pair.lock();
        state.downstream = None;
        let why = self
            .failure
            .take()
            .unwrap_or_else(|| format!("closed ({reason})"));
        if state.upstream_closed {
            tracing::debug!(
                stage_index = self.ours.stage_index,
                peer = %info.peer,
                reason = why,
                "{}",
                names::EVENT_DOWNSTREAM_DOWN
            );
            return;
        }
        tracing::warn!(
            stage_index = self.ours.stage_index,
            peer = %info.peer,
            reason = why,
            "{}",
            names::EVENT_DOWNSTREAM_DOWN
        );
        // Widened: the index comes from the peer's hello (saturated at u16::MAX), and the next one is named.
        let stage = u32::from(self.ours.stage_index) + 1;
        let message = format!("the link to stage {stage} closed ({reason})");
        if !self.serving && state.downstream_answer.is_none() {
            // Not reached: refused, timed out, or closed before it answered the hello.
            state.downstream_answer = Some(Err(Unreached {
                message,
                retryable: true,
            }));
        } else if state.downstream_closed.is_none() {
            state.downstream_closed = Some(message);
        }
        Pair::wake(state.upstream.as_ref());
    }
}
