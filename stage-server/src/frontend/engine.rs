//! Admission and the lanes: a bounded queue of generation jobs, one worker thread per lane, and the events a
//! job streams back to the HTTP session that waits for it.
//!
//! ```text
//!   HTTP session (loop thread) ──submit──▶ queue (≤ --queue) ──▶ lane worker (one per lane) ──▶ LaneRunner
//!        ▲                                                              │
//!        └──── Completer::post (only when the job's event list was empty) ◀── JobEvent::{Delta, …}
//! ```
//!
//! A generation never runs on a loop thread: the session submits a [`Job`] and listens; the worker pushes
//! events onto the job and wakes the session through its completion ring. A job whose session went away is
//! cancelled: a queued one leaves the queue at once, a running one stops at its next token, or at its next
//! prefill chunk while its prompt runs (and its chain session is stopped down the pipeline), so its lane is free
//! within one decode step or one prompt chunk.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use net_io_blocking::Completer;

use super::metrics::Metrics;
use super::runner::{LaneRunner, RunError};
use crate::api::{ApiError, FinishReason, StopMatcher, TokenLogprob, TopLogprob, Usage};
use crate::driver::{Predicted, SamplerExtras};
use crate::model::{Arrival, Backlog, Finish, GenerateOptions, SamplingParams};
use crate::tokenizer::{StreamDecoder, Tokenizer};

use super::prompt::{PromptSource, TextModel};

/// The completion token that tells a session its job has new events.
pub(crate) const EVENTS_TOKEN: u64 = 1;

/// What a generation asks for, decided by the session from the request before it is queued.
#[derive(Debug)]
pub(crate) struct JobSpec {
    /// The prompt, tokenized on the lane.
    pub prompt: PromptSource,
    /// The sampler's parameters, the seed filled in.
    pub sampling: SamplingParams,
    /// The logit bias and alternatives.
    pub extras: SamplerExtras,
    /// Tokens to generate at most (`None`: what the context leaves).
    pub max_tokens: Option<usize>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Whether to report log-probabilities.
    pub logprobs: bool,
}

/// What a job tells its session.
#[derive(Debug)]
pub(crate) enum JobEvent {
    /// Text that can be shown (held back from any stop string), with the tokens it completes.
    Delta {
        /// The text.
        text: String,
        /// Log-probabilities of the tokens whose text is now complete, when asked for.
        logprobs: Vec<TokenLogprob>,
    },
    /// The generation ended.
    Finished {
        /// Why.
        finish: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The generation failed; if it had started, text sent so far stands.
    Failed(ApiError),
}

/// One generation, shared by its session and the lane that runs it.
#[derive(Debug)]
pub(crate) struct Job {
    spec: Mutex<Option<JobSpec>>,
    events: Mutex<Vec<JobEvent>>,
    cancelled: AtomicBool,
    /// Times a lane put the job back in the queue because a stage had no lane free for it.
    requeued: AtomicUsize,
    completer: Completer,
    enqueued: Instant,
    /// The HTTP request's span: the generation's span goes under it (and keeps it open until it ends).
    span: tracing::Span,
}

impl Job {
    /// A job for `spec` that wakes its session through `completer`; its generation's span goes under
    /// `span`.
    pub(crate) fn new(spec: JobSpec, completer: Completer, span: tracing::Span) -> Arc<Job> {
        Arc::new(Job {
            spec: Mutex::new(Some(spec)),
            events: Mutex::new(Vec::new()),
            cancelled: AtomicBool::new(false),
            requeued: AtomicUsize::new(0),
            completer,
            enqueued: Instant::now(),
            span,
        })
    }

    /// Takes the events pushed since the last call.
    pub(crate) fn take_events(&self) -> Vec<JobEvent> {
        std::mem::take(&mut *lock(&self.events))
    }

    /// Ends a job no lane took (see [`Engine::withdraw`]) with `error`, delivered to its session as an event.
    pub(crate) fn fail(&self, error: ApiError) {
        self.push(JobEvent::Failed(error));
    }

    /// Marks the job cancelled: a lane that runs it stops at its next token.
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
    }

    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Pushes `event` and wakes the session if nothing was waiting for it already (one wake drains all).
    fn push(&self, event: JobEvent) {
        let was_empty = {
            let mut events = lock(&self.events);
            let was_empty = events.is_empty();
            events.push(event);
            was_empty
        };
        if was_empty {
            let _ = self.completer.post(EVENTS_TOKEN, 0);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Makes a lane's runner, on the lane's own thread.
pub(crate) type RunnerFactory = Box<dyn FnOnce() -> Result<LaneRunner, String> + Send>;

#[derive(Debug, Default)]
struct Queue {
    waiting: VecDeque<Arc<Job>>,
    stopping: bool,
    /// What each lane holds while it waits for a job (the tokens its runner kept from its last generation,
    /// where it keeps any); `None` while it works. A lane that takes a job hands it to the idle lane that holds
    /// more of its prompt.
    idle: Vec<Option<Vec<u32>>>,
    /// A job handed to each lane by another, its prompt already prepared.
    handed: Vec<Option<Handed>>,
    /// The job each lane took last (still running, or just ended): a drain's deadline fails it at once,
    /// whatever the lane waits for (a prompt chunk's answer, or a chain that stopped answering).
    taken: Vec<Option<Arc<Job>>>,
}

/// A job one lane took off the queue and handed to another whose runner holds more of its prompt.
#[derive(Debug)]
struct Handed {
    job: Arc<Job>,
    spec: JobSpec,
    prompt: Vec<u32>,
    max_tokens: usize,
    /// The generation announced on the lane it goes to (taken over from the lane that took it off the queue).
    arrival: Option<Arrival>,
}

#[derive(Debug)]
struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    busy: AtomicUsize,
    lanes: usize,
    /// Generations the lanes may run at once: a chain's fewest lanes of any later stage (its links set it as
    /// they open), at most `lanes`; the lanes past it wait, and so do the requests, in the queue.
    capacity: Arc<AtomicUsize>,
    /// Set when a drain's deadline passed: running generations stop at their next token or prompt chunk and
    /// fail in words, and nothing more starts.
    cut: AtomicBool,
    queue_limit: usize,
    text: Arc<TextModel>,
    metrics: Arc<Metrics>,
    /// Told the queue's length whenever it changes, where the lanes' compute wants to know.
    backlog: Option<Backlog>,
}

impl Shared {
    /// Puts a job a lane took back at the queue's head (see [`REQUEUES_MAX`]); fails it if the engine stops.
    fn requeue(&self, job: &Arc<Job>) {
        let mut queue = lock(&self.queue);
        if queue.stopping {
            drop(queue);
            job.push(JobEvent::Failed(ApiError::unavailable(
                "the server is shutting down",
            )));
            return;
        }
        queue.waiting.push_front(Arc::clone(job));
        self.queue_changed(queue.waiting.len());
        drop(queue);
        self.ready.notify_one();
    }

    /// Generations the lanes may run at once.
    fn capacity(&self) -> usize {
        self.capacity
            .load(Ordering::Acquire)
            .clamp(1, self.lanes.max(1))
    }

    /// Reports the queue's new length (called with the queue locked, so reports arrive in order).
    fn queue_changed(&self, waiting: usize) {
        self.metrics.set_queue_depth(waiting);
        if let Some(backlog) = &self.backlog {
            backlog.set(waiting);
        }
    }
}

/// The lanes and their queue.
#[derive(Debug)]
pub(crate) struct Engine {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Engine {
    /// Starts one worker per factory, each making its runner on its own thread (a chain link's connection
    /// stays on the thread that opened it); at most `queue_limit` jobs wait behind busy lanes. Returns once
    /// every runner is made, or with the first failure. `backlog`, where given, hears the queue's length; no
    /// more than `capacity` generations run at once (read at each take: a chain's links update it).
    pub(crate) fn start(
        factories: Vec<RunnerFactory>,
        queue_limit: usize,
        text: Arc<TextModel>,
        metrics: Arc<Metrics>,
        backlog: Option<Backlog>,
        capacity: Arc<AtomicUsize>,
    ) -> Result<Engine, String> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                idle: vec![None; factories.len()],
                handed: (0..factories.len()).map(|_| None).collect(),
                taken: vec![None; factories.len()],
                ..Queue::default()
            }),
            ready: Condvar::new(),
            busy: AtomicUsize::new(0),
            lanes: factories.len(),
            capacity,
            cut: AtomicBool::new(false),
            queue_limit,
            text,
            metrics,
            backlog,
        });
        let (made, outcomes) = std::sync::mpsc::channel::<Result<(), String>>();
        let mut engine = Engine {
            shared,
            workers: Vec::new(),
        };
        let count = factories.len();
        for (index, factory) in factories.into_iter().enumerate() {
            let worker_shared = Arc::clone(&engine.shared);
            let made = made.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("lane-{index}"))
                .spawn(move || match factory() {
                    Ok(runner) => {
                        let _ = made.send(Ok(()));
                        work(&worker_shared, runner, index);
                    }
                    Err(error) => {
                        let _ = made.send(Err(error));
                    }
                });
            match spawned {
                Ok(handle) => engine.workers.push(handle),
                Err(error) => return Err(format!("lane {index}'s thread did not start: {error}")),
            }
        }
        drop(made);
        for _ in 0..count {
            match outcomes.recv() {
                Ok(Ok(())) => {}
                Ok(Err(error)) => return Err(error),
                Err(_) => return Err("a lane thread ended before it was ready".into()),
            }
        }
        Ok(engine)
    }

    /// Queues `job`, or refuses it with 429 when every lane is busy and the queue is full (503 once stopping).
    pub(crate) fn submit(&self, job: &Arc<Job>) -> Result<(), ApiError> {
        let mut queue = lock(&self.shared.queue);
        if queue.stopping {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let capacity = self.shared.capacity();
        let idle = capacity.saturating_sub(self.shared.busy.load(Ordering::Acquire));
        if queue.waiting.len() >= self.shared.queue_limit + idle {
            return Err(ApiError::overloaded(format!(
                "all {capacity} lanes are busy and {} requests are queued; retry shortly",
                queue.waiting.len()
            )));
        }
        queue.waiting.push_back(Arc::clone(job));
        self.shared.queue_changed(queue.waiting.len());
        drop(queue);
        self.shared.ready.notify_one();
        Ok(())
    }

    /// Takes `job` out of the queue if it is still there (its session went away, or waited too long).
    pub(crate) fn withdraw(&self, job: &Arc<Job>) -> bool {
        let mut queue = lock(&self.shared.queue);
        let before = queue.waiting.len();
        queue.waiting.retain(|waiting| !Arc::ptr_eq(waiting, job));
        self.shared.queue_changed(queue.waiting.len());
        queue.waiting.len() != before
    }

    /// A drain's deadline passed: the jobs still queued and those the lanes are running fail at once, each
    /// with an error that says so, which their sessions send before the drain closes them (a stream's last
    /// event, not a reset); the lanes stop the running ones at their next token or prompt chunk.
    pub(crate) fn cut(&self) {
        // One lock section: no lane takes a job between the running ones being failed and the queue stopping.
        let (running, waiting) = {
            let mut queue = lock(&self.shared.queue);
            self.shared.cut.store(true, Ordering::Release);
            let running: Vec<Arc<Job>> = queue.taken.iter_mut().filter_map(Option::take).collect();
            (running, self.stop_taking(&mut queue))
        };
        // Failed here, not when their lanes next look: a lane may wait seconds for the chain (a long prompt's
        // chunk, or a stage that stopped answering), longer than the connections have left to send the error.
        // A later event of the job's lane reaches nobody: its reply has ended.
        for job in &running {
            job.cancel();
        }
        fail_all(running.into_iter().chain(waiting), CUT_SHORT);
        self.shared.ready.notify_all();
    }

    /// Stops the lanes taking jobs and takes every job still waiting (queued, or handed to a lane that has not
    /// started it), for the caller to fail.
    fn stop_taking(&self, queue: &mut Queue) -> Vec<Arc<Job>> {
        queue.stopping = true;
        let mut waiting: Vec<Arc<Job>> = std::mem::take(&mut queue.waiting).into();
        waiting.extend(
            queue
                .handed
                .iter_mut()
                .filter_map(Option::take)
                .map(|handed| handed.job),
        );
        self.shared.queue_changed(0);
        waiting
    }

    /// The number of generations that run at once: the lanes, or a chain's fewest lanes if less.
    pub(crate) fn capacity(&self) -> usize {
        self.shared.capacity()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let waiting = self.stop_taking(&mut lock(&self.shared.queue));
        fail_all(waiting, "the server is shutting down");
        self.shared.ready.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// Fails each of `jobs` with a 503 saying `why`.
fn fail_all(jobs: impl IntoIterator<Item = Arc<Job>>, why: &str) {
    for job in jobs {
        job.push(JobEvent::Failed(ApiError::unavailable(why)));
    }
}

/// How many times a job goes back to the queue for want of a stage's lane before its client hears of it.
const REQUEUES_MAX: usize = 4;

/// Why a generation still running at a drain's deadline failed.
const CUT_SHORT: &str =
    "the server is shutting down and its drain deadline passed; the generation was stopped";

fn work(shared: &Shared, mut runner: LaneRunner, lane: usize) {
    loop {
        let (job, arrival, handed) = {
            let mut queue = lock(&shared.queue);
            queue.taken[lane] = None;
            loop {
                if queue.stopping {
                    return;
                }
                if let Some(mut handed) = queue.handed[lane].take() {
                    // Counted busy by the lane that took it off the queue.
                    queue.idle[lane] = None;
                    queue.taken[lane] = Some(Arc::clone(&handed.job));
                    let arrival = handed.arrival.take();
                    break (Arc::clone(&handed.job), arrival, Some(handed));
                }
                // A lane past the chain's capacity waits: a stage with fewer lanes would refuse its session.
                let under_capacity = shared.busy.load(Ordering::Acquire) < shared.capacity();
                if let Some(job) = under_capacity.then(|| queue.waiting.pop_front()).flatten() {
                    if job.is_cancelled() {
                        shared.queue_changed(queue.waiting.len());
                        continue;
                    }
                    // Announced before the queue says it is shorter, so a pass that waits for this request
                    // to take a free lane never sees it neither queued nor arriving.
                    let arrival = runner.expect_arrival();
                    shared.queue_changed(queue.waiting.len());
                    let busy = shared.busy.fetch_add(1, Ordering::AcqRel) + 1;
                    queue.idle[lane] = None;
                    queue.taken[lane] = Some(Arc::clone(&job));
                    if !queue.waiting.is_empty() && busy < shared.capacity() {
                        // Room for more (the capacity may have grown since the other lanes went to sleep).
                        shared.ready.notify_one();
                    }
                    break (job, arrival, None);
                }
                queue.idle[lane] = runner.held().map(<[u32]>::to_vec);
                queue = shared
                    .ready
                    .wait(queue)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        };
        shared
            .metrics
            .set_lanes_busy(shared.busy.load(Ordering::Acquire));
        // A job handed here runs here: handing it on again could pass it back and forth between lanes whose
        // reusable prefixes measure differently from each side (a sliding window refusing the trim).
        let was_handed = handed.is_some();
        let taken = match handed {
            Some(handed) => Some((handed.spec, Ok((handed.prompt, handed.max_tokens)))),
            None => lock(&job.spec).take().map(|spec| {
                shared
                    .metrics
                    .observe_queue_wait(job.enqueued.elapsed().as_secs_f64());
                let prepared = shared.text.prepare(&spec.prompt, spec.max_tokens);
                (spec, prepared)
            }),
        };
        if let Some((spec, prepared)) = taken {
            let prepared = match prepared {
                Ok(prepared) => prepared,
                Err(error) => {
                    job.push(JobEvent::Failed(error));
                    finish_job(shared);
                    continue;
                }
            };
            let (spec, (prompt, max_tokens)) = if was_handed {
                (spec, prepared)
            } else {
                match hand_over(shared, &runner, lane, &job, spec, prepared) {
                    // Another lane runs it; this one is free again (still counted busy, for the other).
                    None => continue,
                    Some(kept) => kept,
                }
            };
            // Counts as i64: tracing-opentelemetry exports unsigned fields as strings.
            let span = tracing::info_span!(
                parent: &job.span,
                "stage.openai_generation",
                lane = lane as i64,
                prompt_tokens = tracing::field::Empty,
                output_tokens = tracing::field::Empty,
            );
            span.in_scope(|| run(shared, &mut runner, &job, spec, prompt, max_tokens, arrival));
        }
        finish_job(shared);
    }
}

/// A lane's job is over (run, failed, or withdrawn): one lane fewer is busy.
fn finish_job(shared: &Shared) {
    shared.busy.fetch_sub(1, Ordering::AcqRel);
    shared
        .metrics
        .set_lanes_busy(shared.busy.load(Ordering::Acquire));
}

/// Gives `job` to the idle lane whose runner holds a longer prefix of its prompt than this lane's runner would
/// reuse (a chain's lanes keep their last generation's tokens at every stage; see [`LaneRunner::held`]), and
/// returns `None`; or gives the job back for this lane to run.
fn hand_over(
    shared: &Shared,
    runner: &LaneRunner,
    lane: usize,
    job: &Arc<Job>,
    spec: JobSpec,
    prepared: (Vec<u32>, usize),
) -> Option<(JobSpec, (Vec<u32>, usize))> {
    let (prompt, max_tokens) = prepared;
    let Some(ours) = runner.reusable(&prompt) else {
        return Some((spec, (prompt, max_tokens)));
    };
    let mut queue = lock(&shared.queue);
    if queue.stopping {
        // The engine is going away and has already failed the jobs it could see: run this one here.
        return Some((spec, (prompt, max_tokens)));
    }
    let usable = prompt.len().saturating_sub(1);
    let best = queue
        .idle
        .iter()
        .enumerate()
        .filter(|(other, _)| *other != lane)
        .filter_map(|(other, held)| {
            held.as_ref().map(|held| {
                (
                    crate::model::common_prefix(held, &prompt).min(usable),
                    other,
                )
            })
        })
        .filter(|(theirs, other)| *theirs > ours && queue.handed[*other].is_none())
        .max();
    let Some((_, other)) = best else {
        return Some((spec, (prompt, max_tokens)));
    };
    queue.idle[other] = None;
    // Announced on the other lane before this lane's announcement ends (when this returns), so a step never
    // sees the generation neither queued nor arriving.
    queue.handed[other] = Some(Handed {
        job: Arc::clone(job),
        spec,
        prompt,
        max_tokens,
        arrival: runner.expect_arrival_for(other),
    });
    drop(queue);
    // The lane it goes to waits on the same condition as every idle lane.
    shared.ready.notify_all();
    None
}

/// Runs one job on a lane, streaming its text through the stop matcher.
/// `arrival` was announced when the job left the queue, before its prompt is tokenized, so requests that
/// arrive together prefill in one pass.
fn run(
    shared: &Shared,
    runner: &mut LaneRunner,
    job: &Arc<Job>,
    spec: JobSpec,
    prompt: Vec<u32>,
    max_tokens: usize,
    arrival: Option<Arrival>,
) {
    let tokenizer = &shared.text.tokenizer;
    let options = GenerateOptions {
        max_tokens,
        stop_tokens: shared.text.stop_tokens.clone(),
        keep_logits: false,
    };
    let mut decoder = StreamDecoder::new(tokenizer);
    let mut matcher = StopMatcher::new(&spec.stop);
    // Log-probabilities wait with their text: a token's entry goes out once none of its text is held back.
    // Each waits with the offset its text starts at; a stop string drops those wholly inside it.
    let mut held: Vec<(TokenLogprob, usize)> = Vec::new();
    let (mut text_in, mut text_out) = (0usize, 0usize);
    // Characters of the output so far: the legacy logprobs' `text_offset` counts them.
    let mut chars_in = 0usize;
    let mut stopped_by_string = false;
    let mut generated = 0usize;
    let started = Instant::now();
    let mut last_token: Option<Instant> = None;
    let metrics = &shared.metrics;
    // Whether a drain's deadline stopped the generation (see `Engine::cut`).
    let cut = std::cell::Cell::new(false);
    let stop = || {
        if shared.cut.load(Ordering::Acquire) {
            cut.set(true);
        }
        cut.get() || job.is_cancelled()
    };
    let result = runner.generate(
        &prompt,
        spec.sampling.clone(),
        &spec.extras,
        &options,
        arrival,
        &stop,
        |predicted: &Predicted| {
            let now = Instant::now();
            match last_token {
                None => metrics.observe_first_token(now.duration_since(started).as_secs_f64()),
                Some(previous) => {
                    metrics.observe_inter_token(now.duration_since(previous).as_secs_f64())
                }
            }
            last_token = Some(now);
            generated += 1;
            if stop() {
                return ControlFlow::Break(());
            }
            let (piece, earlier_chars) = decoder.push_placed(predicted.token);
            if spec.logprobs {
                let entry = token_logprob(tokenizer, predicted, chars_in + earlier_chars);
                held.push((entry, text_in));
            }
            text_in += piece.len();
            chars_in += piece.chars().count();
            let release = matcher.push(&piece);
            text_out += release.text.len();
            let logprobs = if release.stopped {
                take_shown(&mut held, text_out)
            } else if text_in == text_out {
                take_shown(&mut held, usize::MAX)
            } else {
                Vec::new()
            };
            if !release.text.is_empty() || !logprobs.is_empty() {
                job.push(JobEvent::Delta {
                    text: release.text,
                    logprobs,
                });
            }
            if release.stopped {
                stopped_by_string = true;
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        },
    );
    if cut.get() {
        // `Engine::cut` failed the job already (this repeats it, in case the lane took it as the cut came).
        job.push(JobEvent::Failed(ApiError::unavailable(CUT_SHORT)));
        return;
    }
    // A stage with no lane free for the generation (a stage restarted with fewer lanes than the chain said
    // when this lane's link opened, before the lanes learnt it): back to the queue's head, nothing sent yet,
    // to run once another generation ends; a few times at most, in case the stage's lanes are taken by others.
    // Only while other generations hold the chain's lanes: otherwise nothing here will free one.
    let others = shared.busy.load(Ordering::Acquire).saturating_sub(1);
    if matches!(&result, Err(failure) if failure.busy)
        && generated == 0
        && others >= shared.capacity()
        && job.requeued.fetch_add(1, Ordering::AcqRel) < REQUEUES_MAX
    {
        *lock(&job.spec) = Some(spec);
        shared.requeue(job);
        return;
    }
    metrics.add_tokens(prompt.len(), generated);
    let span = tracing::Span::current();
    span.record("prompt_tokens", prompt.len() as i64);
    span.record("output_tokens", generated as i64);
    match result {
        Ok(generation) => {
            if !stopped_by_string {
                let release = matcher.push(&decoder.finish());
                let mut text = release.text;
                if release.stopped {
                    stopped_by_string = true;
                } else {
                    text.push_str(&matcher.finish());
                }
                text_out += text.len();
                let logprobs = take_shown(&mut held, text_out);
                if !text.is_empty() || !logprobs.is_empty() {
                    job.push(JobEvent::Delta { text, logprobs });
                }
            }
            let finish = if stopped_by_string || generation.finish == Finish::Stop {
                FinishReason::Stop
            } else {
                FinishReason::Length
            };
            job.push(JobEvent::Finished {
                finish,
                usage: Usage {
                    prompt_tokens: prompt.len(),
                    completion_tokens: generation.tokens.len(),
                    cached_tokens: generation.cached_tokens,
                },
            });
        }
        Err(RunError {
            context: Some(context),
            ..
        }) => {
            job.push(JobEvent::Failed(ApiError::context_exceeded(
                spec.prompt.param(),
                prompt.len(),
                context,
            )));
        }
        Err(failure) if failure.unavailable => {
            job.push(JobEvent::Failed(ApiError::unavailable(failure.message)));
        }
        Err(failure) => {
            job.push(JobEvent::Failed(ApiError::server_error(format!(
                "the generation failed: {}",
                failure.message
            ))));
        }
    }
}

/// The held entries whose text starts before `shown` bytes of output (the rest fell inside a stop string).
fn take_shown(held: &mut Vec<(TokenLogprob, usize)>, shown: usize) -> Vec<TokenLogprob> {
    held.drain(..)
        .filter(|(_, start)| *start < shown)
        .map(|(entry, _)| entry)
        .collect()
}

/// A token's log-probability entry, with its alternatives, as the API reports them; its text starts
/// `text_offset` characters into the completion.
fn token_logprob(tokenizer: &Tokenizer, predicted: &Predicted, text_offset: usize) -> TokenLogprob {
    let entry = |token: u32, logprob: f32| {
        let bytes = tokenizer.token_bytes(token).to_vec();
        TopLogprob {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob,
        }
    };
    let chosen = entry(predicted.token, predicted.logprob);
    TokenLogprob {
        token: chosen.token,
        bytes: chosen.bytes,
        logprob: chosen.logprob,
        top: predicted
            .top
            .iter()
            .map(|&(token, logprob)| entry(token, logprob))
            .collect(),
        text_offset,
    }
}

/// How long a job may wait in the queue before it is refused, if it is still there.
pub(crate) fn queue_wait_left(job: &Job, timeout: Duration) -> Duration {
    timeout.saturating_sub(job.enqueued.elapsed())
}
