//! The compute owner of a stage process: one thread holds the [`Stage`] and its lanes, runs the chunks the link
//! sessions hand it in the order they came, and wakes each session through its completion ring.
//!
//! ```text
//!   link session (loop thread) ──Job──▶ channel ──▶ compute thread: Stage::forward, sampling (last stage)
//!        ▲                                               │
//!        └── on_wake ◀── Completer::post ◀── Mailbox ◀───┘ (the outcome, in order)
//!                                                │
//!                    rows, tokens ──▶ Onward ────┘ (straight to the link that writes them; the
//!                                                   submitting link gets `Outcome::Forwarded`)
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
    BatchEntry, Logits, ModelError, Sampler, SamplingParams, Stage, StageInput, StageOutput,
    wanted_log_probabilities,
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
        /// Whether each token's log-probability is wanted (see `Frame::Configure`).
        logprob: bool,
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
    /// Rows or a token the compute thread handed straight to the link that writes them ([`Onward`]): the
    /// link that submitted the job only counts it done.
    Forwarded,
}

impl Outcome {
    /// Rows for the next stage or a sampled token: answers another link may carry without this one.
    fn goes_onward(&self) -> bool {
        matches!(self, Outcome::Rows { .. } | Outcome::Token { .. })
    }

    /// A sampled token, encoded as the `Token` frame that carries it back to stage 0 (directly or relayed);
    /// `None` for any other outcome.
    pub(crate) fn token_bytes(self) -> Option<Vec<u8>> {
        let Outcome::Token {
            session,
            position,
            token,
            logprob,
            top,
        } = self
        else {
            return None;
        };
        let mut bytes = Vec::new();
        crate::wire::encode(
            &crate::wire::Frame::Token {
                session,
                position,
                token,
                logprob,
                top,
            },
            &mut bytes,
        );
        Some(bytes)
    }
}

/// Where a link's rows and tokens go without waking the link that submitted them: the compute thread hands
/// them over itself, so a decode step's answer costs one wake (the loop of the link that writes it) instead of
/// two (the submitting link's loop, then the writer's, often another loop thread).
pub(crate) trait Onward: Send + Sync + std::fmt::Debug {
    /// Hands `outcome` (rows or a token) with its frame's span to the link that writes it; gives both back
    /// when that link is not there, for the submitting link to act on as before.
    fn forward(
        &self,
        outcome: Outcome,
        frame: tracing::Span,
        delivered: Instant,
    ) -> Option<(Outcome, tracing::Span)>;
}

/// An outcome and the span of the frame it answers: the link keeps the span open until the answer is written
/// and records `write_micros` on it, timed from `delivered`.
#[derive(Debug)]
pub(crate) struct Delivery {
    pub(crate) outcome: Outcome,
    pub(crate) frame: tracing::Span,
    pub(crate) delivered: Instant,
}

/// Outcomes waiting for one link session, and the completer that wakes it.
#[derive(Debug)]
pub(crate) struct Mailbox {
    outcomes: Mutex<VecDeque<Delivery>>,
    completer: Completer,
    /// Where rows and tokens go straight to, once the link has said ([`Mailbox::set_onward`]).
    onward: Mutex<Option<Arc<dyn Onward>>>,
    /// The link's connection id: sessions are this link's own, so another link cannot reach them.
    link: u64,
}

impl Mailbox {
    pub(crate) fn new(completer: Completer, link: u64) -> Arc<Mailbox> {
        Arc::new(Mailbox {
            outcomes: Mutex::new(VecDeque::new()),
            completer,
            onward: Mutex::new(None),
            link,
        })
    }

    /// From now on, rows and tokens go to `onward` (replacing an earlier one: a link that opens its next
    /// stage again after a failed attempt has a new pair).
    pub(crate) fn set_onward(&self, onward: Arc<dyn Onward>) {
        *self
            .onward
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(onward);
    }

    /// Every outcome so far, oldest first.
    pub(crate) fn take(&self) -> VecDeque<Delivery> {
        std::mem::take(&mut *self.lock())
    }

    fn deliver(&self, outcome: Outcome, frame: tracing::Span) {
        let delivered = Instant::now();
        let onward = if outcome.goes_onward() {
            self.onward
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone()
        } else {
            None
        };
        let (outcome, frame) = match onward {
            Some(onward) => onward
                .forward(outcome, frame, delivered)
                .unwrap_or((Outcome::Forwarded, tracing::Span::none())),
            None => (outcome, frame),
        };
        self.lock().push_back(Delivery {
            outcome,
            frame,
            delivered,
        });
        // A full ring means a wake is already pending, and that wake drains this mailbox too.
        let _ = self.completer.post(COMPUTE_TOKEN, 0);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Delivery>> {
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
    /// When the link handed it over: the frame span's `queue_wait_micros` runs from here to its compute.
    submitted: Instant,
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
                submitted: Instant::now(),
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
    /// Whether each token's log-probability is wanted: without it (and no alternatives) the softmax over the
    /// vocabulary is skipped.
    logprob: bool,
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
        // Chunks that queued up while a batch ran form the next batch; there is no waiting for more, because
        // sessions of a chain are seldom in step (each waits for its own token's round trip).
        let mut waiting: VecDeque<Job> = VecDeque::new();
        loop {
            if waiting.is_empty() {
                match jobs.recv() {
                    Ok(job) => waiting.push_back(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = jobs.try_recv() {
                waiting.push_back(job);
            }
            let batch = take_batch(&mut waiting);
            if batch.len() == 1 && !matches!(batch[0].work, Work::Chunk { .. }) {
                for job in batch {
                    self.single(job);
                }
                continue;
            }
            self.chunks(batch);
        }
    }

    /// Runs one job that is not a chunk (open, trim, stop) and delivers its outcome.
    fn single(&mut self, job: Job) {
        let Job {
            work,
            mailbox,
            span,
            stage_index,
            submitted,
        } = job;
        let frame = frame_span(&span, stage_index, &work, submitted);
        let outcome = frame.in_scope(|| self.work(mailbox.link, work));
        mailbox.deliver(outcome, frame);
    }

    /// Runs chunks of distinct sessions as one batch and delivers each outcome, in the order they came.
    fn chunks(&mut self, batch: Vec<Job>) {
        let frames: Vec<tracing::Span> = batch
            .iter()
            .map(|job| frame_span(&job.span, job.stage_index, &job.work, job.submitted))
            .collect();
        let width = self.stage.width().max(1);
        // Each job's lane, if its session is open here.
        let lanes: Vec<Option<usize>> = batch
            .iter()
            .map(|job| self.lanes.get(&job.key()).map(|lane| lane.index))
            .collect();
        let mut entries = Vec::with_capacity(batch.len());
        for (job, lane) in batch.iter().zip(&lanes) {
            if let (Work::Chunk { position, rows, .. }, Some(lane)) = (&job.work, lane) {
                entries.push(BatchEntry {
                    lane: *lane,
                    position: *position as usize,
                    input: StageInput::Activations(rows),
                    logits: Logits::Last,
                });
            }
        }
        let started = Instant::now();
        let mut outputs = self.stage.forward_batch(&entries).into_iter();
        let compute_micros = micros(started);
        let row_count: usize = entries
            .iter()
            .map(|entry| match entry.input {
                StageInput::Activations(values) => values.len() / width,
                StageInput::Tokens(tokens) => tokens.len(),
            })
            .sum();
        if !entries.is_empty() {
            let stage_metrics = &crate::telemetry::registry::STAGE;
            stage_metrics.step(row_count, f64::from(compute_micros) / 1e6);
            stage_metrics.batch.observe(entries.len() as f64);
        }
        drop(entries);
        for ((job, lane), frame) in batch.into_iter().zip(lanes).zip(frames) {
            let key = job.key();
            let Work::Chunk {
                session,
                position,
                rows,
                sample,
                decode,
            } = job.work
            else {
                continue;
            };
            let outcome = match lane {
                None => unknown(session),
                Some(_) => {
                    let rows_here = rows.len() / width;
                    frame.record("rows", rows_here as i64);
                    frame.record("compute_micros", i64::from(compute_micros));
                    let output = outputs.next().unwrap_or(Err(ModelError::EmptyChunk));
                    frame.in_scope(|| {
                        self.settle(
                            key,
                            position,
                            rows_here,
                            output,
                            sample,
                            decode,
                            compute_micros,
                        )
                    })
                }
            };
            job.mailbox.deliver(outcome, frame);
        }
    }

    fn work(&mut self, link: u64, work: Work) -> Outcome {
        match work {
            Work::Open {
                session,
                sampling,
                history,
                logit_bias,
                top_logprobs,
                logprob,
            } => self.open(
                (link, session),
                sampling,
                history,
                logit_bias,
                top_logprobs,
                logprob,
            ),
            // Chunks run in batches (`Owner::chunks`); `take_batch` never hands one here.
            Work::Chunk { session, .. } => Outcome::Failed {
                session,
                code: ErrorCode::Internal,
                message: "a chunk reached the single-job path of the compute thread".into(),
            },
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
        logprob: bool,
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
                logprob,
            },
        );
        Outcome::Opened
    }

    /// What a computed chunk of `rows` rows at `position` gives: rows for the next stage, or at the last stage
    /// a sampled token (when `sample`) or an acknowledgement.
    #[allow(clippy::too_many_arguments)]
    fn settle(
        &mut self,
        key: (u64, u64),
        position: u32,
        rows: usize,
        output: Result<StageOutput, ModelError>,
        sample: bool,
        decode: bool,
        compute_micros: u32,
    ) -> Outcome {
        let session = key.1;
        let Some(lane) = self.lanes.get_mut(&key) else {
            return unknown(session);
        };
        // The token a chunk predicts goes to the position after its last row.
        let next_position = position.saturating_add(rows as u32);
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
                let (logprob, top) =
                    wanted_log_probabilities(&logits, token, lane.logprob, lane.top_logprobs);
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

/// A frame's span, made as its compute starts: per frame, so at trace level (off unless asked for, by RUST_LOG
/// or STAGE_SERVER_OTLP_FILTER). `queue_wait_micros` is the time since the link handed the frame over;
/// `write_micros` is recorded by the link once the answer is written. Counts as i64: tracing-opentelemetry
/// exports unsigned fields as strings.
fn frame_span(
    session: &tracing::Span,
    stage_index: u16,
    work: &Work,
    submitted: Instant,
) -> tracing::Span {
    tracing::trace_span!(
        parent: session,
        "stage.binary_llama_decode",
        stage_index = i64::from(stage_index),
        session_id = work.session(),
        kind = work.kind(),
        rows = tracing::field::Empty,
        compute_micros = tracing::field::Empty,
        queue_wait_micros = i64::from(micros(submitted)),
        write_micros = tracing::field::Empty,
    )
}

/// Takes the jobs of the next step off the front of `waiting`: the leading chunks of distinct sessions (a
/// second chunk of a session waits for its first), or the one job at the front that is not a chunk.
fn take_batch(waiting: &mut VecDeque<Job>) -> Vec<Job> {
    let mut batch: Vec<Job> = Vec::new();
    while let Some(job) = waiting.front() {
        let is_chunk = matches!(job.work, Work::Chunk { .. });
        if !is_chunk {
            if batch.is_empty() {
                batch.extend(waiting.pop_front());
            }
            break;
        }
        let key = job.key();
        if batch.iter().any(|taken| taken.key() == key) {
            break;
        }
        batch.extend(waiting.pop_front());
    }
    batch
}

impl Job {
    /// The (link, session) the job is for.
    fn key(&self) -> (u64, u64) {
        (self.mailbox.link, self.work.session())
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
    use std::sync::Mutex;
    use std::task::Waker;

    use net_io_blocking::ConnectionId;
    use net_io_core::CompletionRing;

    use super::*;

    /// An onward path that takes rows and refuses tokens (as the last stage does for a session stage 0 opened
    /// no return for), keeping what it took.
    #[derive(Debug, Default)]
    struct Recorder {
        taken: Mutex<Vec<u32>>,
    }

    impl Onward for Recorder {
        fn forward(
            &self,
            outcome: Outcome,
            frame: tracing::Span,
            _delivered: Instant,
        ) -> Option<(Outcome, tracing::Span)> {
            match outcome {
                Outcome::Rows { position, .. } => {
                    self.taken.lock().unwrap().push(position);
                    None
                }
                other => Some((other, frame)),
            }
        }
    }

    fn mailbox() -> (Arc<Mailbox>, net_io_core::CompletionReceiver) {
        let id = ConnectionId::new(7).unwrap();
        let (_ring, mut receiver) = CompletionRing::with_capacity(8);
        receiver.bind(id);
        let completer = receiver.completer(id, Waker::noop().clone());
        (Mailbox::new(completer, 7), receiver)
    }

    fn rows(position: u32) -> Outcome {
        Outcome::Rows {
            session: 1,
            position,
            rows: vec![0.5; 4],
            sample: true,
            decode: true,
        }
    }

    #[test]
    fn rows_go_onward_and_the_link_is_still_told_each_job_is_done() {
        let (mailbox, mut receiver) = mailbox();
        let recorder = Arc::new(Recorder::default());
        mailbox.set_onward(recorder.clone());
        mailbox.deliver(rows(3), tracing::Span::none());
        mailbox.deliver(rows(4), tracing::Span::none());
        assert_eq!(*recorder.taken.lock().unwrap(), vec![3, 4]);
        let outcomes: Vec<Outcome> = mailbox.take().into_iter().map(|d| d.outcome).collect();
        assert!(
            matches!(outcomes[..], [Outcome::Forwarded, Outcome::Forwarded]),
            "the submitting link counts both jobs done: {outcomes:?}"
        );
        assert_eq!(
            receiver.pop().map(|completion| completion.token),
            Some(COMPUTE_TOKEN),
            "the submitting link is woken to count them"
        );
    }

    #[test]
    fn what_the_onward_path_refuses_or_never_takes_reaches_the_link_itself() {
        let (mailbox, _receiver) = mailbox();
        let recorder = Arc::new(Recorder::default());
        mailbox.set_onward(recorder.clone());
        let token = Outcome::Token {
            session: 1,
            position: 9,
            token: 42,
            logprob: f32::NAN,
            top: Vec::new(),
        };
        mailbox.deliver(token, tracing::Span::none());
        mailbox.deliver(
            Outcome::Done {
                session: 1,
                position: 0,
                compute_micros: 5,
            },
            tracing::Span::none(),
        );
        let outcomes: Vec<Outcome> = mailbox.take().into_iter().map(|d| d.outcome).collect();
        assert!(
            matches!(
                outcomes[..],
                [Outcome::Token { token: 42, .. }, Outcome::Done { .. }]
            ),
            "{outcomes:?}"
        );
        assert!(recorder.taken.lock().unwrap().is_empty());
    }

    #[test]
    fn without_an_onward_path_rows_stay_with_the_link() {
        let (mailbox, _receiver) = mailbox();
        mailbox.deliver(rows(2), tracing::Span::none());
        let outcomes: Vec<Outcome> = mailbox.take().into_iter().map(|d| d.outcome).collect();
        assert!(
            matches!(outcomes[..], [Outcome::Rows { position: 2, .. }]),
            "{outcomes:?}"
        );
    }
}
