//! The compute thread's own hand-over of a link's answers: rows encoded and queued for the link to the next
//! stage, tokens queued for the prediction-return link that registered their session.
//!
//! ```text
//!   before:  compute ──post──▶ upstream link (loop A) ──post──▶ downstream link (loop B) ──▶ socket
//!   now:     compute ──post──▶ downstream link (loop B) ──▶ socket
//!                    └─post──▶ upstream link (loop A): counts the job done, off the step's path
//! ```
//!
//! Each wake of a sleeping loop thread cost 35 to 60 µs on the 2-vCPU hosts we measure on (`perf sched
//! timehist`), and the upstream and downstream links of a pair usually sit on different loops (a new
//! connection goes to the loop with the fewest), so a decode step's rows paid two wakes at every middle stage
//! and its token two at the last one.

use std::sync::Arc;
use std::time::Instant;

use super::compute::{Onward, Outcome};
use super::link::{RELAY_TOKEN, StageShared, Writing};
use super::pair::Pair;
use crate::wire::{Activations, Frame};

/// One upstream link's onward paths: its pair (at a stage with a next one) and the stage's return table.
#[derive(Debug)]
pub(crate) struct Forward {
    /// The pair whose downstream link carries this link's rows; `None` at the last stage.
    pair: Option<Arc<Pair>>,
    shared: Arc<StageShared>,
}

impl Forward {
    pub(crate) fn new(pair: Option<Arc<Pair>>, shared: Arc<StageShared>) -> Arc<Forward> {
        Arc::new(Forward { pair, shared })
    }
}

impl Onward for Forward {
    fn forward(
        &self,
        outcome: Outcome,
        frame: tracing::Span,
        delivered: Instant,
    ) -> Option<(Outcome, tracing::Span)> {
        match (&self.pair, outcome) {
            (
                Some(pair),
                Outcome::Rows {
                    session,
                    position,
                    rows,
                    sample,
                    decode,
                    batch,
                },
            ) => {
                let rows = Activations::encode(&rows, self.shared.hello.width, self.shared.codec);
                let onward = if decode {
                    Frame::Decode {
                        session,
                        position,
                        batch,
                        rows,
                    }
                } else {
                    Frame::Prefill {
                        session,
                        position,
                        last: sample,
                        batch,
                        rows,
                    }
                };
                pair.send_down(&onward, Writing::of(frame, delivered));
                None
            }
            (_, token @ Outcome::Token { session, .. }) => {
                match self.shared.returns.sink(session) {
                    Some(sink) => {
                        let bytes = token.token_bytes().unwrap_or_default();
                        sink.push((bytes, Writing::of(frame, delivered)), RELAY_TOKEN);
                        None
                    }
                    // A session stage 0 opened no return for goes up the chain, through the link that submitted it.
                    None => Some((token, frame)),
                }
            }
            // Rows at the last stage (there are none) or anything else: the submitting link acts on it.
            (_, other) => Some((other, frame)),
        }
    }
}
