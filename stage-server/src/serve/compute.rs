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
use std::time::{Duration, Instant};

use net_io_blocking::Completer;

use crate::model::{
    BatchEntry, Logits, ModelError, Sampler, SamplingParams, Stage, StageInput, StageOutput,
    wanted_log_probabilities,
};
use crate::wire::{Batch, ErrorCode};

/// How long the compute thread waits at least for the rest of a batch once one of its frames is here. A previous
/// stage writes a step's frames one after another, each on its own link, so they arrive within tens of
/// microseconds when both processes run; a long batch is waited for longer (see [`LATE_FRAME_SHARE`]), up to
/// [`BATCH_WAIT_MAX`] for a frame that never comes (its session failed upstream after the step).
const BATCH_WAIT: Duration = Duration::from_millis(3);

/// A late frame of a batch is waited for longer than [`BATCH_WAIT`] when the batch is long: up to this share
/// (1/N) of what the batch's rows cost here. Run without it, the frames that came would go on, come round again
/// and wait behind the late frame's pass anyway, at this stage and at every one after: streams in a batch with
/// a long prompt chunk would stall once per stage instead of once (seen on a loaded host, where a 457-row
/// frame came 4 to 11 ms after its step's one-row frames).
const LATE_FRAME_SHARE: u32 = 10;

/// The longest a batch's frames wait for a late one however long the batch: what a frame that never comes (its
/// session failed upstream after the step) costs the others at most.
const BATCH_WAIT_MAX: Duration = Duration::from_millis(250);

/// Steps of at least this many rows measure what a row costs here (a pass of fewer is mostly fixed cost).
const ROW_COST_MIN_ROWS: usize = 16;

/// How many batches whose wait ran out the compute thread remembers, so that their frames still queued behind
/// other work are not waited for again.
const GIVEN_UP_BATCHES: usize = 16;

/// The completion token with which the compute thread wakes a link session.
pub(crate) const COMPUTE_TOKEN: u64 = 1;

/// What a link session asks of the compute thread.
#[derive(Debug)]
pub(crate) enum Work {
    /// Takes a free lane for `session` (and, at the last stage, a sampler), or with `resume` keeps the lane the
    /// session already has and sets up its sampling anew.
    Open {
        session: u64,
        setup: Setup,
        /// The session is open from an earlier generation: keep its lane and cache, set up the sampling anew.
        resume: bool,
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
        /// The previous stage's step the rows ran in: this stage waits briefly for the step's other frames.
        batch: Batch,
    },
    /// Cuts `session`'s lane back to `length` positions.
    Trim { session: u64, length: u32 },
    /// `session` is kept between generations (`Keep`): its lane holds a reusable prefix and nothing else,
    /// so an open that finds no free lane may take it (the oldest kept first) rather than be refused.
    Keep { session: u64 },
    /// Ends `session` and frees its lane.
    Stop { session: u64 },
}

/// What came of one job, in the order the jobs came.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The session has a lane.
    Opened { session: u64 },
    /// A `Configure` was refused: the session got no lane from it (but may hold one from an earlier open, as
    /// a session already open does when it is configured again without resuming).
    NotOpened {
        session: u64,
        code: ErrorCode,
        message: String,
    },
    /// Activation rows for the next stage.
    Rows {
        session: u64,
        position: u32,
        rows: Vec<f32>,
        sample: bool,
        decode: bool,
        /// This stage's step the rows ran in, and how many row frames it sends on.
        batch: Batch,
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
    /// When the session was kept between generations (the owner's count of keeps), if it is idle so.
    kept: Option<u64>,
    sampler: Option<Sampler>,
    logit_bias: Vec<(u32, f32)>,
    top_logprobs: u8,
    /// Whether each token's log-probability is wanted: without it (and no alternatives) the softmax over the
    /// vocabulary is skipped.
    logprob: bool,
}

/// What a `Configure` sets up for a session's generation.
#[derive(Debug)]
pub(crate) struct Setup {
    pub(crate) sampling: SamplingParams,
    /// The tokens the penalties look back on before the first generated one.
    pub(crate) history: Vec<u32>,
    pub(crate) logit_bias: Vec<(u32, f32)>,
    pub(crate) top_logprobs: u8,
    /// Whether each token's log-probability is wanted (see `Frame::Configure`).
    pub(crate) logprob: bool,
}

impl Setup {
    /// The session's lane record on lane `index`; at the last stage (`last`) with a sampler that has seen the
    /// history.
    fn lane(self, index: usize, last: bool) -> Lane {
        let sampler = last.then(|| {
            let mut sampler = Sampler::new(self.sampling);
            for token in self.history {
                sampler.accept(token);
            }
            sampler
        });
        Lane {
            index,
            kept: None,
            sampler,
            logit_bias: self.logit_bias,
            top_logprobs: self.top_logprobs,
            logprob: self.logprob,
        }
    }
}

/// The compute thread's state.
struct Owner {
    stage: Stage,
    /// Open sessions by (link, session id).
    lanes: HashMap<(u64, u64), Lane>,
    free: Vec<usize>,
    /// The id of the last step that sent rows on ([`Batch::id`]).
    steps: u32,
    /// Keeps counted so far: the order in which kept lanes are taken back.
    keeps: u64,
    /// How long a batch's first frame waits for the rest at least ([`BATCH_WAIT`]; longer in tests).
    batch_wait: Duration,
    /// What a row costs in a pass here, a moving average over steps of [`ROW_COST_MIN_ROWS`] rows or more.
    row_cost: Option<Duration>,
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
        // A random start, so a stage process that restarts does not reuse the ids its next stage just saw.
        steps: u32::from_le_bytes(
            crate::wire::fresh_nonce()[..4]
                .try_into()
                .unwrap_or_default(),
        ),
        batch_wait: BATCH_WAIT,
        row_cost: None,
        keeps: 0,
    };
    let thread = std::thread::Builder::new()
        .name("stage-compute".into())
        .spawn(move || owner.run(receiver))?;
    Ok((ComputeHandle { jobs }, thread))
}

impl Owner {
    fn run(mut self, jobs: Receiver<Job>) {
        // Chunks that queued up while a batch ran form the next batch, and a batch of the previous stage whose
        // frames are not all here yet is waited for (see `gather_wait`): run as they come, its rows would split
        // into smaller passes here and at every stage after.
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut gather_started: Option<Instant> = None;
        let mut given_up: VecDeque<u32> = VecDeque::new();
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
            if let Some(batch_rows) = incomplete_batch_rows(&waiting, &given_up) {
                let until =
                    *gather_started.get_or_insert_with(Instant::now) + self.gather_wait(batch_rows);
                let now = Instant::now();
                if now < until
                    && let Ok(job) = jobs.recv_timeout(until - now)
                {
                    waiting.push_back(job);
                    continue;
                }
                // Timed out (or every handle is gone): run what is here, and wait no more for these batches.
                for id in incomplete_batches(&waiting, &given_up) {
                    if given_up.len() == GIVEN_UP_BATCHES {
                        given_up.pop_front();
                    }
                    given_up.push_back(id);
                }
            }
            gather_started = None;
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

    /// How long the frames of a batch of `rows` rows that came wait for the rest.
    fn gather_wait(&self, rows: u32) -> Duration {
        late_frame_wait(self.batch_wait, self.row_cost, rows)
    }

    /// Counts a pass of `rows` rows that took `compute` into [`Owner::row_cost`].
    fn observe_pass(&mut self, rows: usize, compute: Duration) {
        if rows < ROW_COST_MIN_ROWS {
            return;
        }
        let Ok(rows) = u32::try_from(rows) else {
            return;
        };
        let cost = compute / rows;
        self.row_cost = Some(match self.row_cost {
            None => cost,
            Some(average) => (average * 3 + cost) / 4,
        });
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
        let session = work.session();
        let opening = matches!(work, Work::Open { .. });
        let outcome = frame.in_scope(|| {
            guarded(session, "the stage's work on the session", || {
                self.work(mailbox.link, work)
            })
        });
        // The link counts the opens it is waiting for, so it learns which one a refusal answers.
        let outcome = match outcome {
            Outcome::Failed {
                session,
                code,
                message,
            } if opening => Outcome::NotOpened {
                session,
                code,
                message,
            },
            other => other,
        };
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
        // A pass that panics answers every entry with an error (`Stage::forward_batch`), so the thread serves on.
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
            self.observe_pass(row_count, Duration::from_micros(u64::from(compute_micros)));
            let stage_metrics = &crate::telemetry::registry::STAGE;
            stage_metrics.step(row_count, f64::from(compute_micros) / 1e6);
            stage_metrics.batch.observe(entries.len() as f64);
        }
        drop(entries);
        let mut answers = Vec::with_capacity(batch.len());
        for ((job, lane), frame) in batch.into_iter().zip(lanes).zip(frames) {
            let key = job.key();
            let Work::Chunk {
                session,
                position,
                rows,
                sample,
                decode,
                ..
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
                        guarded(session, "sampling the session's token", || {
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
                    })
                }
            };
            answers.push((job.mailbox, outcome, frame));
        }
        // The rows this step sends on carry its id, their frame count and their row count, so the next stage
        // runs them together.
        let (sent_on, rows_on) = answers
            .iter()
            .filter_map(|(_, outcome, _)| match outcome {
                Outcome::Rows { rows, .. } => Some(rows.len() / width),
                _ => None,
            })
            .fold((0usize, 0usize), |(frames, rows), more| {
                (frames + 1, rows + more)
            });
        if sent_on > 0 {
            self.steps = self.steps.wrapping_add(1);
        }
        let frames = u16::try_from(sent_on).unwrap_or(u16::MAX);
        let step = Batch {
            id: self.steps,
            frames,
            rows: u32::try_from(rows_on)
                .unwrap_or(u32::MAX)
                .max(u32::from(frames)),
        };
        for (mailbox, mut outcome, frame) in answers {
            if let Outcome::Rows { batch, .. } = &mut outcome {
                *batch = step;
            }
            mailbox.deliver(outcome, frame);
        }
    }

    fn work(&mut self, link: u64, work: Work) -> Outcome {
        match work {
            Work::Open {
                session,
                setup,
                resume,
            } => self.open((link, session), setup, resume),
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
            Work::Keep { session } => {
                if let Some(lane) = self.lanes.get_mut(&(link, session)) {
                    self.keeps += 1;
                    lane.kept = Some(self.keeps);
                }
                Outcome::Settled
            }
            Work::Stop { session } => {
                if let Some(lane) = self.lanes.remove(&(link, session)) {
                    // Freed before the reset, so that even a reset that panicked could not lose the lane (an
                    // open resets the lane it takes again).
                    self.free.push(lane.index);
                    let _ = self.stage.reset(lane.index);
                }
                Outcome::Settled
            }
        }
    }

    fn open(&mut self, key: (u64, u64), setup: Setup, resume: bool) -> Outcome {
        let session = key.1;
        match (self.lanes.get(&key).map(|lane| lane.index), resume) {
            (Some(index), true) => {
                // The lane and its cache stay (the Trim before this set how much); the sampling starts anew.
                let last = self.stage.spec().last;
                self.lanes.insert(key, setup.lane(index, last));
                return Outcome::Opened { session };
            }
            (Some(_), false) => {
                return Outcome::Failed {
                    session,
                    code: ErrorCode::SessionBusy,
                    message: format!("session {session} is already open on this stage"),
                };
            }
            (None, true) => {
                return Outcome::Failed {
                    session,
                    code: ErrorCode::UnknownSession,
                    message: format!(
                        "session {session} is not open on this stage, so it cannot resume; configure it anew"
                    ),
                };
            }
            (None, false) => {}
        }
        let Some(index) = self.free.pop().or_else(|| self.take_kept_lane()) else {
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
        let last = self.stage.spec().last;
        self.lanes.insert(key, setup.lane(index, last));
        Outcome::Opened { session }
    }

    /// Takes the lane of the session kept longest between generations, for an open that found no free lane: a
    /// kept prefix is a cache, not a claim (its owner's next resume is answered `UnknownSession` and runs its
    /// prompt from scratch, as after a restart), so idle kept sessions never keep new generations out.
    fn take_kept_lane(&mut self) -> Option<usize> {
        let oldest = self
            .lanes
            .iter()
            .filter_map(|(key, lane)| lane.kept.map(|kept| (kept, *key)))
            .min()?
            .1;
        self.lanes.remove(&oldest).map(|lane| lane.index)
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
                // Set by `chunks` once the step's outcomes are all known.
                batch: Batch::alone(0, 1),
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

/// When a chunk in `waiting` belongs to a batch of the previous stage whose other frames are not all here yet
/// (and not given up on), the rows in all of the batch of the chunk at the front, or 0 when that one is whole
/// (a later batch's late frame is waited for only the shortest wait, not at the cost of a whole batch ahead of
/// it). Only when the next step would start with chunks (a job that is not a chunk runs alone first).
fn incomplete_batch_rows(waiting: &VecDeque<Job>, given_up: &VecDeque<u32>) -> Option<u32> {
    let Some(Work::Chunk { batch: front, .. }) = waiting.front().map(|job| &job.work) else {
        return None;
    };
    let incomplete = incomplete_batches(waiting, given_up);
    if incomplete.is_empty() {
        return None;
    }
    Some(if incomplete.contains(&front.id) {
        front.rows
    } else {
        0
    })
}

/// The ids of the batches of the previous stage with a chunk in `waiting` whose other frames are not all here,
/// leaving out those in `given_up`.
fn incomplete_batches(waiting: &VecDeque<Job>, given_up: &VecDeque<u32>) -> Vec<u32> {
    // Most steps have a lone frame or nothing held back: no table to build on the step's path then.
    let batched = waiting
        .iter()
        .any(|job| matches!(&job.work, Work::Chunk { batch, .. } if batch.frames > 1));
    if !batched {
        return Vec::new();
    }
    let mut counts: HashMap<u32, (usize, u16)> = HashMap::new();
    for job in waiting {
        if let Work::Chunk { batch, .. } = &job.work
            && !given_up.contains(&batch.id)
        {
            counts.entry(batch.id).or_insert((0, batch.frames)).0 += 1;
        }
    }
    counts
        .into_iter()
        .filter(|(_, (here, frames))| *here < usize::from(*frames))
        .map(|(id, _)| id)
        .collect()
}

/// How long the frames of a batch of `rows` rows that came wait for the rest: at least `floor`, and up to
/// [`BATCH_WAIT_MAX`] a [`LATE_FRAME_SHARE`]th of what the rows cost at `row_cost` each. `rows` comes from the
/// network: any value gives a wait within those bounds.
fn late_frame_wait(floor: Duration, row_cost: Option<Duration>, rows: u32) -> Duration {
    let by_cost = row_cost.map_or(Duration::ZERO, |cost| {
        cost.checked_mul(rows)
            .unwrap_or(Duration::MAX)
            .checked_div(LATE_FRAME_SHARE)
            .unwrap_or(Duration::MAX)
    });
    floor.max(by_cost.min(BATCH_WAIT_MAX))
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
            | Work::Keep { session }
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
            Work::Keep { .. } => "keep",
            Work::Stop { .. } => "stop",
        }
    }
}

/// Runs `body` for `session`; a panic in it (a bug) becomes an `Internal` error for that session, naming
/// `what` panicked, so the compute thread and its other sessions go on.
fn guarded(session: u64, what: &str, body: impl FnOnce() -> Outcome) -> Outcome {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or_else(|_| {
        Outcome::Failed {
            session,
            code: ErrorCode::Internal,
            message: format!("{what} panicked; the session is failed"),
        }
    })
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
            batch: Batch::alone(1, 1),
        }
    }

    /// A compute thread over the middle layers (1..3) of the tiny model with `lanes` lanes, its batches
    /// waited for up to `batch_wait`, and sessions 1 to `lanes` open on link 7.
    fn middle_stage(
        name: &str,
        lanes: usize,
        batch_wait: Duration,
    ) -> (std::path::PathBuf, Sender<Job>, JoinHandle<()>) {
        stage_with(name, lanes, batch_wait, false)
    }

    /// [`middle_stage`], whose first forward pass panics when `panic_next_pass`.
    fn stage_with(
        name: &str,
        lanes: usize,
        batch_wait: Duration,
        panic_next_pass: bool,
    ) -> (std::path::PathBuf, Sender<Job>, JoinHandle<()>) {
        use crate::model::testing::TinyModel;
        use crate::model::{StageOptions, StageSpec};
        use candle_core::quantized::GgmlDType;
        let tiny = TinyModel::llama(GgmlDType::Q4_1);
        let dir = std::env::temp_dir().join(format!("stage-server-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = tiny.write_to_dir(&dir).unwrap();
        let spec = StageSpec {
            layers: 1..3,
            first: false,
            last: false,
        };
        let options = StageOptions {
            lane_count: lanes,
            context_length: None,
        };
        let mut stage = Stage::load(&path, spec, options).unwrap();
        stage.panic_next_pass = panic_next_pass;
        let owner = Owner {
            stage,
            lanes: HashMap::new(),
            free: (0..lanes).rev().collect(),
            steps: 0,
            batch_wait,
            row_cost: None,
            keeps: 0,
        };
        let (jobs, receiver) = channel();
        let thread = std::thread::spawn(move || owner.run(receiver));
        (dir, jobs, thread)
    }

    fn job(work: Work, mailbox: &Arc<Mailbox>) -> Job {
        Job {
            work,
            mailbox: Arc::clone(mailbox),
            span: tracing::Span::none(),
            stage_index: 1,
            submitted: Instant::now(),
        }
    }

    /// Opens sessions 1 to `count` with default sampling, each through `mailbox`.
    fn open_sessions(jobs: &Sender<Job>, mailbox: &Arc<Mailbox>, count: u64) {
        for session in 1..=count {
            let open = Work::Open {
                session,
                setup: Setup {
                    sampling: SamplingParams::default(),
                    history: Vec::new(),
                    logit_bias: Vec::new(),
                    top_logprobs: 0,
                    logprob: false,
                },
                resume: false,
            };
            jobs.send(job(open, mailbox)).unwrap();
        }
    }

    fn decode(session: u64, position: u32, batch: Batch, width: usize) -> Work {
        Work::Chunk {
            session,
            position,
            rows: vec![0.25; width],
            sample: true,
            decode: true,
            batch,
        }
    }

    /// A previous stage's step `id` that sent `frames` row frames of `rows` rows in all.
    fn batch(id: u32, frames: u16, rows: u32) -> Batch {
        Batch { id, frames, rows }
    }

    /// Waits for `count` outcomes in `mailbox` and gives the batch of each `Rows` among them.
    fn batches_of(mailbox: &Mailbox, count: usize) -> Vec<Batch> {
        outcomes_of(mailbox, count)
            .into_iter()
            .filter_map(|outcome| match outcome {
                Outcome::Rows { batch, .. } => Some(batch),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_batchs_frames_run_as_one_step_however_far_apart_they_come_and_a_missing_one_is_not_waited_for_long()
     {
        let width =
            crate::model::testing::TinyModel::llama(candle_core::quantized::GgmlDType::Q4_1)
                .embedding_length;
        let (dir, jobs, thread) = middle_stage("batch-gather", 3, Duration::from_secs(2));
        let (mailbox, _receiver) = mailbox();
        open_sessions(&jobs, &mailbox, 3);
        assert!(batches_of(&mailbox, 3).is_empty(), "three sessions open");
        // The previous stage's step 40 sent two frames; the second comes 50 ms after the first. They run as
        // one step here, whose two frames go on together.
        jobs.send(job(decode(1, 0, batch(40, 2, 2), width), &mailbox))
            .unwrap();
        std::thread::sleep(Duration::from_millis(50));
        jobs.send(job(decode(2, 0, batch(40, 2, 2), width), &mailbox))
            .unwrap();
        let together = batches_of(&mailbox, 2);
        assert_eq!(together.len(), 2, "{together:?}");
        assert_eq!(
            together[0], together[1],
            "the two frames ran in different steps"
        );
        assert_eq!(together[0].frames, 2);
        // A frame alone is not held.
        let started = Instant::now();
        jobs.send(job(decode(3, 0, Batch::alone(41, 1), width), &mailbox))
            .unwrap();
        assert_eq!(batches_of(&mailbox, 1)[0].frames, 1);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "a lone frame waited"
        );
        // A batch of three of which one never comes runs the two that did once the wait is over.
        let started = Instant::now();
        jobs.send(job(decode(1, 1, batch(42, 3, 3), width), &mailbox))
            .unwrap();
        jobs.send(job(decode(2, 1, batch(42, 3, 3), width), &mailbox))
            .unwrap();
        let partial = batches_of(&mailbox, 2);
        let waited = started.elapsed();
        assert_eq!(partial[0], partial[1]);
        assert_eq!(partial[0].frames, 2);
        assert!(
            (Duration::from_secs(2)..Duration::from_secs(10)).contains(&waited),
            "waited {waited:?} for the missing frame"
        );
        drop(jobs);
        thread.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn late_frame_waits_follow_a_tenth_of_the_batchs_cost_between_the_floor_and_the_bound() {
        let floor = BATCH_WAIT;
        let millisecond = Duration::from_millis(1);
        assert_eq!(
            late_frame_wait(floor, Some(millisecond), 100),
            Duration::from_millis(10)
        );
        assert_eq!(late_frame_wait(floor, Some(millisecond), 10), floor);
        assert_eq!(late_frame_wait(floor, None, 1_000_000), floor);
        assert_eq!(
            late_frame_wait(floor, Some(millisecond), u32::MAX),
            BATCH_WAIT_MAX
        );
        assert_eq!(
            late_frame_wait(floor, Some(Duration::MAX), u32::MAX),
            BATCH_WAIT_MAX
        );
        assert_eq!(
            late_frame_wait(Duration::from_secs(2), Some(millisecond), 100),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn a_late_frame_of_a_long_batch_is_waited_for_past_the_floor_within_a_bound() {
        let width =
            crate::model::testing::TinyModel::llama(candle_core::quantized::GgmlDType::Q4_1)
                .embedding_length;
        let floor = Duration::from_millis(20);
        let late = Duration::from_millis(120);
        let (dir, jobs, thread) = middle_stage("batch-rows", 3, floor);
        let (mailbox, _receiver) = mailbox();
        open_sessions(&jobs, &mailbox, 3);
        assert!(batches_of(&mailbox, 3).is_empty(), "three sessions open");
        // A 64-row prompt chunk measures what a row costs here.
        jobs.send(job(
            Work::Chunk {
                session: 3,
                position: 0,
                rows: vec![0.25; 64 * width],
                sample: false,
                decode: false,
                batch: Batch::alone(1, 64),
            },
            &mailbox,
        ))
        .unwrap();
        assert_eq!(batches_of(&mailbox, 1).len(), 1);
        let send_two = |id: u32, rows: u32, position: u32| {
            jobs.send(job(
                decode(1, position, batch(id, 2, rows), width),
                &mailbox,
            ))
            .unwrap();
            std::thread::sleep(late);
            jobs.send(job(
                decode(2, position, batch(id, 2, rows), width),
                &mailbox,
            ))
            .unwrap();
            batches_of(&mailbox, 2)
        };
        // A batch of two rows is waited for only the floor: its second frame, later than that, runs apart.
        let short = send_two(2, 2, 0);
        assert_ne!(short[0], short[1], "a short batch waited {late:?}");
        // A batch that counts many rows (a long prompt chunk still on its way) is waited for: one step.
        let long = send_two(3, u32::MAX, 1);
        assert_eq!(long[0], long[1], "a long batch's late frame ran apart");
        // A short batch at the front is waited for only the floor, even with a later long batch's frame queued
        // behind it (the short one holds the thread while the others queue, so the three run in one step).
        let started = Instant::now();
        let short = batch(4, 2, 2);
        jobs.send(job(decode(3, 64, short, width), &mailbox))
            .unwrap();
        jobs.send(job(decode(1, 2, Batch::alone(5, 1), width), &mailbox))
            .unwrap();
        let long = batch(6, 2, u32::MAX);
        jobs.send(job(decode(2, 2, long, width), &mailbox)).unwrap();
        assert_eq!(batches_of(&mailbox, 3).len(), 3);
        let waited = started.elapsed();
        assert!(
            waited < BATCH_WAIT_MAX / 2,
            "the front batch waited {waited:?} for a later batch's frame"
        );
        // However many rows it counts, a frame that never comes holds the others BATCH_WAIT_MAX at most, and
        // once: a frame of that batch still queued after the wait (a second chunk of one of its sessions, run
        // in the next step) runs without waiting again.
        let started = Instant::now();
        let never_whole = batch(7, 3, u32::MAX);
        jobs.send(job(decode(1, 3, never_whole, width), &mailbox))
            .unwrap();
        jobs.send(job(decode(1, 4, never_whole, width), &mailbox))
            .unwrap();
        let mut outcomes = batches_of(&mailbox, 1);
        if outcomes.len() < 2 {
            outcomes.extend(batches_of(&mailbox, 1));
        }
        assert_eq!(outcomes.len(), 2);
        let waited = started.elapsed();
        assert!(
            (BATCH_WAIT_MAX..BATCH_WAIT_MAX * 2).contains(&waited),
            "waited {waited:?} for a frame that never came"
        );
        drop(jobs);
        thread.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Waits for `count` outcomes in `mailbox`.
    fn outcomes_of(mailbox: &Mailbox, count: usize) -> Vec<Outcome> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut outcomes = Vec::new();
        while outcomes.len() < count {
            assert!(
                Instant::now() < deadline,
                "outcomes did not come: {outcomes:?}"
            );
            outcomes.extend(mailbox.take().into_iter().map(|delivery| delivery.outcome));
            std::thread::sleep(Duration::from_millis(1));
        }
        outcomes
    }

    #[test]
    fn a_pass_that_panics_fails_its_sessions_and_the_compute_thread_serves_on() {
        let width =
            crate::model::testing::TinyModel::llama(candle_core::quantized::GgmlDType::Q4_1)
                .embedding_length;
        // The two sessions' frames name a batch of two, which the stage waits for (up to 2 s), so the pass that
        // panics is theirs together however the test thread is scheduled.
        let (dir, jobs, thread) = stage_with("pass-panic", 3, Duration::from_secs(2), true);
        let (mailbox, _receiver) = mailbox();
        open_sessions(&jobs, &mailbox, 3);
        let opened = outcomes_of(&mailbox, 3);
        assert!(
            opened
                .iter()
                .all(|outcome| matches!(outcome, Outcome::Opened { .. })),
            "{opened:?}"
        );
        // One step of two sessions panics: both get an error naming it.
        for session in 1..=2 {
            jobs.send(job(decode(session, 0, batch(9, 2, 2), width), &mailbox))
                .unwrap();
        }
        let failed = outcomes_of(&mailbox, 2);
        for outcome in &failed {
            match outcome {
                Outcome::Failed { code, message, .. } => {
                    assert_eq!(*code, ErrorCode::Compute);
                    assert!(message.contains("panicked"), "{message}");
                }
                other => panic!("a panicked pass answered {other:?}"),
            }
        }
        // The thread is still there: the third session's step runs.
        jobs.send(job(decode(3, 0, Batch::alone(10, 1), width), &mailbox))
            .unwrap();
        let next = outcomes_of(&mailbox, 1);
        assert!(
            matches!(next[..], [Outcome::Rows { session: 3, .. }]),
            "{next:?}"
        );
        drop(jobs);
        thread.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
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
