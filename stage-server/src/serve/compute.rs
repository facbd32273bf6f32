//! The compute owner of a stage process: one thread holds the [`Stage`] and its lanes, runs the chunks the link
//! sessions hand it in the order they came, and wakes each session through its completion ring.
//!
//! ```text
//!   link session (loop thread) ──Job──▶ channel ──▶ compute thread: Stage::forward, sampling (last stage)
//!        ▲                                               │
//!        └── on_wake ◀── Completer::post ◀── Mailbox ◀───┘ (the outcome, in order)
//! ```
//!
//! A session never computes on a loop thread, and a loop thread never waits for the compute thread: the
//! session hands a job over and goes on listening; the outcome comes back as a completion.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use net_io_blocking::Completer;

use crate::model::{
    Logits, ModelError, Sampler, SamplingParams, Stage, StageInput, StageOutput, log_probabilities,
};
use crate::wire::ErrorCode;

/// The completion token with which the compute thread wakes a link session.
pub(crate) const COMPUTE_TOKEN: u64 = 1;

/// What a link session asks of the compute thread.
#[derive(Debug)]
pub(crate) enum Work {
    /// Takes a free lane for `session` (and, at the last stage, a sampler).
    Open {
        session: u64,
        sampling: SamplingParams,
        history: Vec<u32>,
        logit_bias: Vec<(u32, f32)>,
        top_logprobs: u8,
    },
    /// Runs rows at `position` of `session`'s lane. `sample`: the chunk ends a prompt or is a decode step,
    /// so the last stage picks a token from its last row.
    Chunk {
        session: u64,
        position: u32,
        rows: Vec<f32>,
        sample: bool,
        /// A decode step rather than a prefill chunk (it goes on down the chain as one).
        decode: bool,
    },
    /// Cuts `session`'s lane back to `length` positions.
    Trim { session: u64, length: u32 },
    /// Ends `session` and frees its lane.
    Stop { session: u64 },
}

/// What came of one job, in the order the jobs came.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The session has a lane.
    Opened,
    /// Activation rows for the next stage.
    Rows {
        session: u64,
        position: u32,
        rows: Vec<f32>,
        sample: bool,
        decode: bool,
    },
    /// The last stage's pick from the final row of a chunk (or, for a chunk that did not end a prompt,
    /// nothing to send on but an acknowledgement).
    Token {
        session: u64,
        position: u32,
        token: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
    },
    /// A non-final prefill chunk at the last stage: done, nothing to forward.
    Done {
        session: u64,
        position: u32,
        compute_micros: u32,
    },
    /// A job failed; the session's other jobs go on.
    Failed {
        session: u64,
        code: ErrorCode,
        message: String,
    },
    /// Trimmed or stopped.
    Settled,
}

/// Outcomes waiting for one link session, and the completer that wakes it.
#[derive(Debug)]
pub(crate) struct Mailbox {
    outcomes: Mutex<VecDeque<Outcome>>,
    completer: Completer,
    /// The link's connection id: sessions are this link's own, so another link cannot reach them.
    link: u64,
}

impl Mailbox {
    pub(crate) fn new(completer: Completer, link: u64) -> Arc<Mailbox> {
        Arc::new(Mailbox {
            outcomes: Mutex::new(VecDeque::new()),
            completer,
            link,
        })
    }

    /// Every outcome so far, oldest first.
    pub(crate) fn take(&self) -> VecDeque<Outcome> {
        std::mem::take(&mut *self.lock())
    }

    fn deliver(&self, outcome: Outcome) {
        self.lock().push_back(outcome);
        // A full ring means a wake is already pending, and that wake drains this mailbox too.
        let _ = self.completer.post(COMPUTE_TOKEN, 0);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Outcome>> {
        self.outcomes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A job and where its outcome goes.
struct Job {
    work: Work,
    mailbox: Arc<Mailbox>,
    /// The session's span (disabled when nothing records it): the frame's span goes under it.
    span: tracing::Span,
    /// The stage's place in the chain, as the link learned it.
    stage_index: u16,
}

/// The handle link sessions submit jobs through; the thread ends when every handle is dropped.
#[derive(Clone, Debug)]
pub(crate) struct ComputeHandle {
    jobs: Sender<Job>,
}

impl ComputeHandle {
    /// Hands `work` to the compute thread; false if it has stopped (the outcome then never comes).
    pub(crate) fn submit(&self, work: Work, mailbox: &Arc<Mailbox>) -> bool {
        self.submit_in(work, mailbox, tracing::Span::none(), 0)
    }

    /// [`ComputeHandle::submit`] with the span of the session the work belongs to.
    pub(crate) fn submit_in(
        &self,
        work: Work,
        mailbox: &Arc<Mailbox>,
        span: tracing::Span,
        stage_index: u16,
    ) -> bool {
        self.jobs
            .send(Job {
                work,
                mailbox: Arc::clone(mailbox),
                span,
                stage_index,
            })
            .is_ok()
    }
}

/// One session's lane and, at the last stage, its sampler.
struct Lane {
    index: usize,
    sampler: Option<Sampler>,
    logit_bias: Vec<(u32, f32)>,
    top_logprobs: u8,
}

/// The compute thread's state.
struct Owner {
    stage: Stage,
    /// Open sessions by (link, session id).
    lanes: HashMap<(u64, u64), Lane>,
    free: Vec<usize>,
}

/// Starts the compute thread over `stage`; it runs until every [`ComputeHandle`] is dropped.
pub(crate) fn start(stage: Stage) -> std::io::Result<(ComputeHandle, JoinHandle<()>)> {
    let (jobs, receiver) = channel();
    let lanes = stage.lane_count();
    let owner = Owner {
        stage,
        lanes: HashMap::new(),
        // Lowest lane first, so a lightly used stage keeps reusing the same warm caches.
        free: (0..lanes).rev().collect(),
    };
    let thread = std::thread::Builder::new()
        .name("stage-compute".into())
        .spawn(move || owner.run(receiver))?;
    Ok((ComputeHandle { jobs }, thread))
}

impl Owner {
    fn run(mut self, jobs: Receiver<Job>) {
        while let Ok(Job {
            work,
            mailbox,
            span,
            stage_index,
        }) = jobs.recv()
        {
            // Per frame, so at trace level: off unless asked for (RUST_LOG or STAGE_SERVER_OTLP_FILTER).
            // Counts as i64: tracing-opentelemetry exports unsigned fields as strings.
            let frame = tracing::trace_span!(
                parent: &span,
                "stage.binary_llama_decode",
                stage_index = i64::from(stage_index),
                session_id = work.session(),
                kind = work.kind(),
                rows = tracing::field::Empty,
                compute_micros = tracing::field::Empty,
            );
            let outcome = frame.in_scope(|| self.work(mailbox.link, work, &frame));
            mailbox.deliver(outcome);
        }
    }

    fn work(&mut self, link: u64, work: Work, frame: &tracing::Span) -> Outcome {
        match work {
            Work::Open {
                session,
                sampling,
                history,
                logit_bias,
                top_logprobs,
            } => self.open((link, session), sampling, history, logit_bias, top_logprobs),
            Work::Chunk {
                session,
                position,
                rows,
                sample,
                decode,
            } => self.chunk((link, session), position, &rows, sample, decode, frame),
            Work::Trim { session, length } => match self.lanes.get(&(link, session)) {
                None => unknown(session),
                Some(lane) => match self.stage.trim(lane.index, length as usize) {
                    Ok(()) => Outcome::Settled,
                    Err(error) => failed(session, ErrorCode::Position, &error),
                },
            },
            Work::Stop { session } => {
                if let Some(lane) = self.lanes.remove(&(link, session)) {
                    let _ = self.stage.reset(lane.index);
                    self.free.push(lane.index);
                }
                Outcome::Settled
            }
        }
    }

    fn open(
        &mut self,
        key: (u64, u64),
        sampling: SamplingParams,
        history: Vec<u32>,
        logit_bias: Vec<(u32, f32)>,
        top_logprobs: u8,
    ) -> Outcome {
        let session = key.1;
        if self.lanes.contains_key(&key) {
            return Outcome::Failed {
                session,
                code: ErrorCode::SessionBusy,
                message: format!("session {session} is already open on this stage"),
            };
        }
        let Some(index) = self.free.pop() else {
            return Outcome::Failed {
                session,
                code: ErrorCode::NoFreeLane,
                message: format!(
                    "every one of this stage's {} lanes is busy; retry when a generation ends",
                    self.stage.lane_count()
                ),
            };
        };
        if let Err(error) = self.stage.reset(index) {
            self.free.push(index);
            return failed(session, ErrorCode::Compute, &error);
        }
        let sampler = self.stage.spec().last.then(|| {
            let mut sampler = Sampler::new(sampling);
            for token in history {
                sampler.accept(token);
            }
            sampler
        });
        self.lanes.insert(
            key,
            Lane {
                index,
                sampler,
                logit_bias,
                top_logprobs,
            },
        );
        Outcome::Opened
    }

    fn chunk(
        &mut self,
        key: (u64, u64),
        position: u32,
        rows: &[f32],
        sample: bool,
        decode: bool,
        frame: &tracing::Span,
    ) -> Outcome {
        let session = key.1;
        let Some(lane) = self.lanes.get_mut(&key) else {
            return unknown(session);
        };
        let width = self.stage.width().max(1);
        // The token a chunk predicts goes to the position after its last row.
        let next_position = position.saturating_add((rows.len() / width) as u32);
        let started = Instant::now();
        let input = StageInput::Activations(rows);
        let output = self
            .stage
            .forward(lane.index, position as usize, input, Logits::Last);
        let compute_micros = micros(started);
        let row_count = rows.len() / width;
        crate::telemetry::registry::STAGE.step(row_count, f64::from(compute_micros) / 1e6);
        frame.record("rows", row_count as i64);
        frame.record("compute_micros", i64::from(compute_micros));
        let output = match output {
            Ok(output) => output,
            Err(error @ ModelError::PositionMismatch { .. }) => {
                return failed(session, ErrorCode::Position, &error);
            }
            Err(error) => return failed(session, ErrorCode::Compute, &error),
        };
        match output {
            StageOutput::Activations(rows) => Outcome::Rows {
                session,
                position,
                rows,
                sample,
                decode,
            },
            StageOutput::Logits(mut logits) if sample => {
                for &(token, bias) in &lane.logit_bias {
                    if let Some(logit) = logits.get_mut(token as usize) {
                        *logit += bias;
                    }
                }
                let Some(sampler) = lane.sampler.as_mut() else {
                    return Outcome::Failed {
                        session,
                        code: ErrorCode::Internal,
                        message: "the last stage has no sampler for this session".into(),
                    };
                };
                let token = sampler.sample(&logits);
                sampler.accept(token);
                let (logprob, top) = log_probabilities(&logits, token, lane.top_logprobs);
                Outcome::Token {
                    session,
                    position: next_position,
                    token,
                    logprob,
                    top,
                }
            }
            StageOutput::Logits(_) => Outcome::Done {
                session,
                position: next_position,
                compute_micros,
            },
        }
    }
}

impl Work {
    /// The session the work is for.
    fn session(&self) -> u64 {
        match self {
            Work::Open { session, .. }
            | Work::Chunk { session, .. }
            | Work::Trim { session, .. }
            | Work::Stop { session } => *session,
        }
    }

    /// The frame kind it came from, for spans.
    fn kind(&self) -> &'static str {
        match self {
            Work::Open { .. } => "configure",
            Work::Chunk { decode: true, .. } => "decode",
            Work::Chunk { .. } => "prefill",
            Work::Trim { .. } => "trim",
            Work::Stop { .. } => "stop",
        }
    }
}

fn unknown(session: u64) -> Outcome {
    Outcome::Failed {
        session,
        code: ErrorCode::UnknownSession,
        message: format!("session {session} is not open on this stage; send Configure first"),
    }
}

fn failed(session: u64, code: ErrorCode, error: &ModelError) -> Outcome {
    Outcome::Failed {
        session,
        code,
        message: error.to_string(),
    }
}

fn micros(started: Instant) -> u32 {
    u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_probabilities_name_the_likeliest_tokens_first_and_sum_to_one() {
        let logits = [1.0, 3.0, 2.0, 3.0];
        let (chosen, top) = log_probabilities(&logits, 2, 3);
        let ids: Vec<u32> = top.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, vec![1, 3, 2], "ties keep the lower id first");
        let total: f64 = logits.iter().map(|&logit| f64::from(logit).exp()).sum();
        let expected = (2.0f64 - total.ln()) as f32;
        assert!(
            (chosen - expected).abs() < 1e-6,
            "{chosen} against {expected}"
        );
        let mass: f32 = (0..4)
            .map(|token| log_probabilities(&logits, token, 0).0.exp())
            .sum();
        assert!(
            (mass - 1.0).abs() < 1e-5,
            "probabilities should sum to 1, got {mass}"
        );
    }
}
