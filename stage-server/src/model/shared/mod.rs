//! A stage shared by many threads, one lane each, whose concurrent forward passes run as one batch on a compute
//! thread of its own, under a row budget.
//!
//! ```text
//!   thread of lane 0 ─forward(position, rows)─▶ pending ─┐
//!   thread of lane 1 ─forward(position, rows)─▶ pending ─┼─▶ compute thread: one Stage::forward_batch per step
//!   thread of lane 2 ─forward(position, rows)─▶ pending ─┘     one-row chunks first, then longer chunks, FIFO,
//!                                                             up to `batch_tokens` rows
//! ```
//!
//! Where steps never gather (a chain's stage 0), a caller that finds no step running runs the step itself
//! (taking in whatever else is pending), so it pays no wake of the compute thread and none back.
//!
//! A caller keeps its own loop (sampling, the chain link, events) and only hands its forward passes here, so
//! lanes join and leave batches independently, and every lane's result is bit-identical to running it alone
//! (see [`Stage::forward_batch`]). A lane in a generation is *active* ([`SharedStage::activate`]): after a step
//! the compute thread can wait briefly for every active lane to hand in its next chunk, so streams decode
//! together instead of in turns; one that is slow to come back (a descheduled thread) is left for the next
//! step after the gather time ([`GATHER_WAIT`] for a whole model). A chunk longer than the budget runs over several steps, its output rows
//! joined.
//!
//! Three rules keep running streams' inter-token latency bounded while prompts are admitted:
//! - *admit together*: while a server's queue holds requests for free lanes ([`Backlog`]), a generation is on
//!   its way to a lane ([`Arrival`]), or a lane's generation left it moments ago (its client's next request is
//!   likely on its way), a step with no stream to decode, or one in which a prompt starts, waits up to
//!   [`ARRIVAL_WAIT`] for them, so prompts that can start together prefill in one pass instead of each
//!   stalling the streams the one before it started (in front of a chain too, where the prompts then also go
//!   down together and their streams stay in one step);
//! - *a prompt's share of a decode step* (when [`StepPolicy::decode_stretch`] is set): while streams decode, a
//!   step also runs prompt rows only as many as keep it within that many times a decode-only step, by the costs
//!   measured on the steps so far; a long prompt runs over several steps beside the streams instead of freezing
//!   them for its whole prefill;
//! - *wait for streams about to end* ([`StepPolicy::prompt_hold_steps`], off with a stretch): a prompt about to
//!   start sits out the steps of streams that all end within what its prefill would add to a step, so requests
//!   queued behind full lanes do not admit (and end) out of step with the streams beside them.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{BatchEntry, Logits, ModelError, Stage, StageInput, StageOutput};

/// How long a step of a whole model waits for an active lane that has not handed in its next chunk yet. Callers
/// come back within tens of microseconds when they only sample a row; this bounds the wait for one that does
/// more.
pub const GATHER_WAIT: Duration = Duration::from_millis(2);

/// How long a step with no stream to decode, or one in which a prompt starts, waits for a generation arriving at
/// a lane (a prompt being tokenized, a queued request taking a free lane, a free lane's client's next request):
/// longer than [`GATHER_WAIT`], because a prompt that misses the pass stalls every stream for its own prefill a
/// step later. The default of [`StepPolicy::arrival_wait`].
pub const ARRIVAL_WAIT: Duration = Duration::from_millis(10);

/// The longest a chain's stage 0 holds a step for lanes still out on their round trip (see
/// [`StepPolicy::batches_in_flight`]), however long the measured round trips are: past it the lanes that came
/// back run without the others.
pub const HOLD_WAIT_MAX: Duration = Duration::from_secs(1);

/// The shortest hold, before any round trip is measured or where round trips are very short.
pub const HOLD_WAIT_MIN: Duration = Duration::from_millis(5);

/// The default row budget of one pass.
pub const DEFAULT_BATCH_TOKENS: usize = 512;

/// How a [`SharedStage`] forms its steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepPolicy {
    /// Rows of one pass at most; every pending one-row chunk (a stream's next token) runs whatever the budget.
    pub batch_tokens: usize,
    /// How long a step waits for active lanes that have not handed in their next chunk yet (zero: not at all;
    /// the callers run the steps, as in front of a chain).
    pub gather: Duration,
    /// While streams decode, the most a step that also runs prompt rows may take, as a multiple of a
    /// decode-only step: the prompt rows are cut to fit (at least one a step). `None`: prompt rows up to
    /// `batch_tokens` whatever the streams wait. A value below 1 or not finite cannot hold and counts as `None`
    /// ([`SharedStage::start`] drops it; the command line refuses it with an error).
    pub decode_stretch: Option<f64>,
    /// Where a lane's next chunk comes after a round trip down a chain (stage 0 of a chain, which never
    /// gathers), how many steps' chunks may be out on their round trips at once: a lane back from its round
    /// trip, or a new generation's first chunk, waits (up to twice the measured round trip, within
    /// [`HOLD_WAIT_MIN`] and [`HOLD_WAIT_MAX`]) while that many are out, so the lanes that went down in one
    /// step come back into one step, lanes that went down in different steps merge, and a new generation
    /// joins the batch. 1 keeps a single batch going round (best where the stages share
    /// cores, one host); the stage count keeps every stage busy where each has its own. 0: no hold, each step
    /// runs whatever has come back (lanes drift apart into one-row steps).
    pub batches_in_flight: usize,
    /// How long a step with no stream to decode, or one in which a prompt starts, waits for generations arriving
    /// at lanes (announced ones, [`SharedStage::expect_arrival`], to hand in their first chunks);
    /// [`ARRIVAL_WAIT`] by default. (A gathering stage waits this or its gather, the longer.)
    pub arrival_wait: Duration,
    /// How long after a generation leaves a lane its client's next request counts as a generation arriving
    /// (see [`LaneState::freed`]); [`ARRIVAL_WAIT`] by default, zero for never. A step waits for one at most
    /// `arrival_wait`.
    pub next_request_wait: Duration,
    /// The most decode steps a prompt about to start waits for the streams beside it to end: a step leaves a
    /// generation's first prompt chunk out while every running stream has said it ends within that many steps
    /// ([`SharedStage::expect_end`]) and within as many as the prompt's rows would add to a step (by the costs
    /// measured so far), so the prompt stalls no stream and its own first token comes at most about a prefill
    /// later. 0: never. Without it, a prompt that arrives a step or two before the streams beside it end (the
    /// requests queued behind full lanes take each lane as it frees) stalls them for its whole prefill, and the
    /// prompts that take their lanes a step later stall it in turn: the lanes' generations end and start out of
    /// step from then on.
    pub prompt_hold_steps: usize,
}

/// The default of [`StepPolicy::prompt_hold_steps`].
pub const PROMPT_HOLD_STEPS: usize = 16;

impl StepPolicy {
    /// `batch_tokens` and `gather`, with no decode stretch: on a CPU a prompt row costs about as much as a
    /// decode row, so bounding the streams' steps slows the admitted prompt by as much as it spares them (see
    /// `docs/PERFORMANCE.md`); the bound is for callers who want it.
    pub fn new(batch_tokens: usize, gather: Duration) -> StepPolicy {
        StepPolicy {
            batch_tokens,
            gather,
            decode_stretch: None,
            batches_in_flight: 0,
            arrival_wait: ARRIVAL_WAIT,
            next_request_wait: ARRIVAL_WAIT,
            prompt_hold_steps: PROMPT_HOLD_STEPS,
        }
    }
}

/// A [`Stage`] behind a batching compute thread.
#[derive(Debug)]
pub struct SharedStage {
    shared: Arc<Shared>,
    compute: Option<JoinHandle<()>>,
    width: usize,
    lane_count: usize,
    context_length: usize,
}

#[derive(Debug)]
struct Shared {
    /// Locked by the compute thread for a pass, and by [`SharedStage::with_stage`] between passes.
    stage: Mutex<Stage>,
    state: Mutex<State>,
    /// The compute thread waits here for chunks.
    work: Condvar,
    /// Callers wait here for their results.
    done: Condvar,
    policy: StepPolicy,
    /// Whether the stage holds the model's head (its output is logits, not activation rows).
    last: bool,
    width: usize,
    /// Steps callers ran themselves instead of the compute thread (see [`SharedStage::forward`]).
    steps_by_callers: std::sync::atomic::AtomicUsize,
}

#[derive(Debug, Default)]
struct State {
    lanes: Vec<LaneState>,
    /// Generations about to take a lane (see [`SharedStage::expect_arrival`]).
    arriving: usize,
    /// Requests waiting in a server's queue for a lane (see [`Backlog`]).
    backlog: usize,
    /// What the steps so far cost, to size a prompt's share of a decode step.
    costs: StepCosts,
    stopping: bool,
    /// A step is being planned or run (by the compute thread or by a caller, see [`SharedStage::forward`]):
    /// nobody else plans one, so no chunk is planned twice.
    running: bool,
    /// Orders chunks first come, first served.
    clock: u64,
    /// Steps run so far: the id of the last one ([`StepTag::id`]).
    steps: u64,
    /// Since when a step has been held for lanes out on their round trip (see
    /// [`StepPolicy::batches_in_flight`]).
    held_since: Option<Instant>,
    /// Since when a step of a chain's stage 0 has been held for generations arriving at lanes (see
    /// [`SharedStage::expect_arrival_on`]).
    arrivals_since: Option<Instant>,
    /// Moving average of a round trip: from the step that sent a lane's chunk to its next chunk.
    round_trip: Option<Duration>,
}

#[derive(Debug, Default)]
struct LaneState {
    active: bool,
    /// A generation announced for this lane ([`SharedStage::expect_arrival_on`]) has not handed in its first
    /// chunk yet (it is counted in [`State::arriving`]).
    arriving: bool,
    /// Whether the lane's generation is past its prompt (see [`SharedStage::mark_decoding`]): a stream, rather
    /// than a prompt cut into rows.
    past_prompt: bool,
    pending: Option<Pending>,
    result: Option<Result<(StageOutput, StepTag), ModelError>>,
    /// The step the lane's last chunk ended in, when, and whether that chunk was one row, while its answer is on
    /// its way round (see [`SharedStage::forward_tagged`]): cleared when the lane hands in its next chunk or
    /// leaves.
    out: Option<(u64, Instant, bool)>,
    /// Whether the lane has handed in a chunk since it became active: its next chunk is not a generation's
    /// first.
    started: bool,
    /// When the lane's last generation left it, while it stays free and no new generation has taken its place:
    /// a closed-loop client (an agent's next call, a benchmark's worker) sends its next request within
    /// milliseconds, so for [`StepPolicy::next_request_wait`] the lane counts as a generation arriving (see
    /// [`State::next_request_until`]).
    freed: Option<Instant>,
    /// The most chunks the lane's generation still hands in, as its caller last said ([`SharedStage::expect_end`]):
    /// a stream this close to its end is waited for by a prompt about to start ([`StepPolicy::prompt_hold_steps`]).
    /// Cleared when the lane leaves or takes a generation.
    chunks_left: Option<usize>,
}

/// A chunk handed in and not finished yet.
#[derive(Debug)]
struct Pending {
    position: usize,
    input: OwnedInput,
    logits: Logits,
    /// Rows already run.
    done: usize,
    /// Output values of the rows run so far (a chunk over several steps).
    output: Vec<f32>,
    order: u64,
    /// Whether the chunk's answer comes back to the lane after a round trip (the caller said so).
    awaits_answer: bool,
    /// Whether the lane came back from a round trip with this chunk: a step holds for such chunks.
    returned: bool,
    /// Whether this is the first chunk of the lane's generation: a step holds for these too, so that a new
    /// generation joins the batch out on its round trip instead of starting a second one.
    first: bool,
}

/// The step a chunk ended in: a chain's stage 0 tells the next stage which of its frames ran together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepTag {
    /// The step's number (steps of this stage count from 1).
    pub id: u64,
    /// How many chunks ended in the step, this one included.
    pub chunks: usize,
    /// The rows of those chunks in all (of every step each ran in).
    pub rows: usize,
}

#[derive(Debug)]
enum OwnedInput {
    Tokens(Vec<u32>),
    Activations(Vec<f32>),
}

/// One entry of a step: a lane and a copy of the rows of its pending chunk this step runs.
struct Planned {
    lane: usize,
    order: u64,
    position: usize,
    input: OwnedInput,
    /// The chunk's logits: `Last` takes the head's row only from the step that ends the chunk.
    logits: Logits,
    /// Whether these rows end the chunk.
    ends: bool,
    /// Whether this is a one-row chunk (a stream's next token), which runs whatever the budget.
    decode: bool,
}

impl SharedStage {
    /// Starts the compute thread for `stage`, forming steps by `policy`. A gather pays where lanes come back
    /// within it (a whole model: they only sample); where a lane's next chunk waits for a round trip down a
    /// chain, `Duration::ZERO` lets the steps batch only what has queued up meanwhile.
    pub fn start(stage: Stage, policy: StepPolicy) -> std::io::Result<SharedStage> {
        let lane_count = stage.lane_count();
        let (width, context_length, last) =
            (stage.width(), stage.context_length(), stage.spec().last);
        let shared = Arc::new(Shared {
            stage: Mutex::new(stage),
            state: Mutex::new(State {
                lanes: (0..lane_count).map(|_| LaneState::default()).collect(),
                ..State::default()
            }),
            work: Condvar::new(),
            done: Condvar::new(),
            policy: StepPolicy {
                batch_tokens: policy.batch_tokens.max(1),
                decode_stretch: policy
                    .decode_stretch
                    .filter(|stretch| stretch.is_finite() && *stretch >= 1.0),
                ..policy
            },
            last,
            width,
            steps_by_callers: std::sync::atomic::AtomicUsize::new(0),
        });
        let compute = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("stage-compute".into())
                .spawn(move || compute(&shared))?
        };
        Ok(SharedStage {
            shared,
            compute: Some(compute),
            width,
            lane_count,
            context_length,
        })
    }

    /// The width of an activation row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The number of lanes.
    pub fn lane_count(&self) -> usize {
        self.lane_count
    }

    /// The context length of a lane.
    pub fn context_length(&self) -> usize {
        self.context_length
    }

    /// Runs `f` on the stage between passes (a reset, a trim, a look at its spec), waiting for at most the
    /// pass that runs now.
    pub fn with_stage<R>(&self, f: impl FnOnce(&mut Stage) -> R) -> R {
        f(&mut lock(&self.shared.stage))
    }

    /// Announces a generation that will activate a lane shortly (see [`Arrival`]).
    pub fn expect_arrival(&self) -> Arrival {
        lock(&self.shared.state).arriving += 1;
        Arrival {
            shared: Arc::clone(&self.shared),
            lane: None,
        }
    }

    /// Announces a generation that will hand in its first chunk on `lane` shortly: it counts as arriving until
    /// that chunk comes (or the guard is dropped), however long the lane takes to get there. Where callers run
    /// the steps (a chain's stage 0), a step with no stream to decode (or one a prompt starts in) waits for such
    /// arrivals up to
    /// [`StepPolicy::arrival_wait`], so prompts that lanes took together prefill in one pass down the chain instead of one
    /// pass each, which would leave their streams a step apart and stall each other's at every later admission.
    pub fn expect_arrival_on(&self, lane: usize) -> Arrival {
        let mut state = lock(&self.shared.state);
        if let Some(entry) = state.lanes.get_mut(lane)
            && !entry.arriving
        {
            entry.arriving = true;
            state.arriving += 1;
        }
        Arrival {
            shared: Arc::clone(&self.shared),
            lane: Some(lane),
        }
    }

    /// A handle through which a server tells the compute thread how many requests wait for a lane.
    pub fn backlog(&self) -> Backlog {
        Backlog {
            shared: Arc::clone(&self.shared),
        }
    }

    /// How many prompt rows `lane` should hand in at a time now so that, beside the streams of the other active
    /// lanes, a pass stays within the decode stretch (by the costs measured so far); `None` when no other
    /// active lane is decoding (prompts beside prompts run as large as they come), nothing is measured yet,
    /// or the policy sets no stretch. A chain's stage 0 sizes its
    /// prefill frames by it, so every stage downstream, which batches what queues up, keeps the bound too.
    pub fn prompt_share(&self, lane: usize) -> Option<usize> {
        let state = lock(&self.shared.state);
        let streams = state
            .lanes
            .iter()
            .enumerate()
            .filter(|(index, entry)| *index != lane && entry.active && entry.past_prompt)
            .count();
        let stretch = self.shared.policy.decode_stretch?;
        (streams > 0)
            .then(|| state.costs.prompt_rows_within(stretch, streams))
            .flatten()
    }

    /// How this stage forms its steps.
    pub fn policy(&self) -> StepPolicy {
        self.shared.policy
    }

    /// Marks `lane`'s generation as past its prompt: its chunks from now on are a stream's tokens, which
    /// [`SharedStage::prompt_share`] protects. Said by the caller because a row count cannot tell: a prompt cut
    /// to one row a frame looks like a stream. Cleared when the lane leaves its generation.
    pub fn mark_decoding(&self, lane: usize) {
        if let Some(entry) = lock(&self.shared.state).lanes.get_mut(lane) {
            entry.past_prompt = true;
        }
    }

    /// Says that `lane`'s generation hands in at most `chunks` more chunks, the next one included (a stream's
    /// tokens left before its `max_tokens`): a prompt about to start may wait for a stream this close to its end
    /// rather than stall it ([`StepPolicy::prompt_hold_steps`]). Said before each of the stream's chunks; a lane
    /// that never says it is never waited for.
    pub fn expect_end(&self, lane: usize, chunks: usize) {
        if let Some(entry) = lock(&self.shared.state).lanes.get_mut(lane) {
            entry.chunks_left = Some(chunks);
        }
    }

    /// Marks `lane` as in a generation (`true`) or not: the compute thread waits a little for active lanes to
    /// hand in their next chunk before it starts a step.
    pub fn activate(&self, lane: usize, active: bool) {
        let window = self.shared.policy.next_request_wait;
        let mut state = lock(&self.shared.state);
        let now = Instant::now();
        let open = |freed: Option<Instant>| freed.is_some_and(|freed| now < freed + window);
        if let Some(entry) = state.lanes.get_mut(lane) {
            let own_window = open(entry.freed);
            // Only a generation that held the lane frees it (a lane deactivated twice keeps its first time).
            entry.freed = match (active, entry.active) {
                (true, _) => None,
                (false, true) => Some(now),
                (false, false) => entry.freed,
            };
            entry.active = active;
            entry.past_prompt = false;
            entry.out = None;
            entry.started = false;
            entry.chunks_left = None;
            if active && !own_window {
                // A new generation on another lane than the one just freed is most likely that lane's client's next
                // request (a free lane is leased by its cached prefix, or least recently used): it closes the oldest
                // open window, so a client's next request waits for no one but other clients.
                if let Some(other) = state
                    .lanes
                    .iter_mut()
                    .filter(|other| !other.active && open(other.freed))
                    .min_by_key(|other| other.freed)
                {
                    other.freed = None;
                }
            }
        }
        drop(state);
        if !active {
            // A step may be waiting for this lane: the compute thread's gather, or a caller's hold.
            self.shared.work.notify_one();
            self.shared.done.notify_all();
        }
    }

    /// Runs one chunk of `lane` at `position` in the next batch (or several, for a chunk longer than the
    /// budget) and returns what [`Stage::forward`] would. One caller per lane at a time.
    pub fn forward(
        &self,
        lane: usize,
        position: usize,
        input: StageInput<'_>,
        logits: Logits,
    ) -> Result<StageOutput, ModelError> {
        self.forward_tagged(lane, position, input, logits, false)
            .map(|(output, _)| output)
    }

    /// [`SharedStage::forward`], also saying which step the chunk ended in. `awaits_answer`: the chunk goes
    /// down a chain and the lane's next chunk comes once its answer is back (a decode row, a prompt's last
    /// chunk), which [`StepPolicy::batches_in_flight`] holds steps for.
    pub fn forward_tagged(
        &self,
        lane: usize,
        position: usize,
        input: StageInput<'_>,
        logits: Logits,
        awaits_answer: bool,
    ) -> Result<(StageOutput, StepTag), ModelError> {
        let input = match input {
            StageInput::Tokens(tokens) if !tokens.is_empty() => OwnedInput::Tokens(tokens.to_vec()),
            StageInput::Activations(values) if !values.is_empty() => {
                if !values.len().is_multiple_of(self.width) {
                    return Err(ModelError::ActivationSize {
                        values: values.len(),
                        width: self.width,
                    });
                }
                OwnedInput::Activations(values.to_vec())
            }
            _ => return Err(ModelError::EmptyChunk),
        };
        let mut state = lock(&self.shared.state);
        let lane_count = state.lanes.len();
        if lane >= lane_count {
            return Err(ModelError::LaneOutOfRange { lane, lane_count });
        }
        if state.stopping {
            return Err(ModelError::Compute("the compute thread is stopping".into()));
        }
        if state.lanes[lane].pending.is_some() {
            return Err(ModelError::Compute(format!(
                "lane {lane} already has a chunk waiting; one caller per lane"
            )));
        }
        state.clock += 1;
        let order = state.clock;
        let returned = match state.lanes[lane].out.take() {
            Some((_, sent, one_row)) => {
                // Only a decode row's round trip sizes the holds: a prompt's last chunk takes its whole prefill
                // through every stage, which would stretch them to a second while it is out.
                if one_row {
                    state.observe_round_trip(sent.elapsed());
                }
                true
            }
            None => false,
        };
        state.lanes[lane].result = None;
        let first = !std::mem::replace(&mut state.lanes[lane].started, true);
        if std::mem::take(&mut state.lanes[lane].arriving) {
            state.arriving = state.arriving.saturating_sub(1);
        }
        state.lanes[lane].pending = Some(Pending {
            position,
            input,
            logits,
            done: 0,
            output: Vec::new(),
            order,
            awaits_answer,
            returned,
            first,
        });
        // Where steps never gather (a chain's stage 0), the caller runs the step itself when none is running:
        // no wake of the compute thread and no wake back, two thread wakes per token (35 to 60 µs each on our
        // 2-vCPU hosts). Otherwise the compute thread (or the caller running a step now) takes the chunk, and
        // this caller waits; a step's end wakes it to try again.
        let mut handed_over = false;
        loop {
            if let Some(result) = state.lanes[lane].result.take() {
                return result;
            }
            if state.stopping {
                return Err(ModelError::Compute("the compute thread stopped".into()));
            }
            if !state.running && self.shared.callers_run_steps() {
                // Lanes of this step's batch still out on their round trip, or (a step with no stream to decode,
                // or one a prompt starts in) generations on their way to lanes: wait for them (a hand-in runs
                // the step; a lane leaving or a guard dropped wakes this thread), or for the hold to end.
                let policy = self.shared.policy;
                let held = hold_until(&mut state, policy.batches_in_flight)
                    .or_else(|| arrivals_hold_until(&mut state, self.width, &policy));
                if let Some(until) = held {
                    let now = Instant::now();
                    state = self
                        .shared
                        .done
                        .wait_timeout(state, until.saturating_duration_since(now))
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .0;
                    continue;
                }
                let ran;
                (state, ran) = run_step(&self.shared, state);
                if ran {
                    self.shared
                        .steps_by_callers
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    continue;
                }
            }
            if !handed_over {
                self.shared.work.notify_one();
                handed_over = true;
            }
            state = self
                .shared
                .done
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

impl Shared {
    /// Whether a caller may run the step itself: only where steps never gather (a chain's stage 0, whose lanes
    /// drift apart on their round trips). Where they do (the whole model), the compute thread keeps running
    /// every step: with callers running the steps that found nothing to gather for, the whole model's ITL p99
    /// at 4 streams rose from 32 to 42-47 ms (bench serve, alternating binaries in one run), at equal
    /// throughput.
    fn callers_run_steps(&self) -> bool {
        self.policy.gather.is_zero()
    }
}

/// A generation on its way to a lane (its prompt being tokenized): while it lives, a step waits for it as for
/// an active lane, so requests that start together prefill in one pass. Drop it once the lane is active.
#[derive(Debug)]
pub struct Arrival {
    shared: Arc<Shared>,
    /// The lane it was announced for, if any: its first chunk ends the arrival.
    lane: Option<usize>,
}

/// How many requests wait in a server's queue for a lane: while some do and a lane is free, a step with no stream
/// to decode (or one a prompt starts in) waits for the free lane to be taken (up to
/// [`StepPolicy::arrival_wait`]), as for an [`Arrival`]. Every lane
/// of the stage must have a worker that takes the next queued request when its generation ends.
#[derive(Clone, Debug)]
pub struct Backlog {
    shared: Arc<Shared>,
}

impl Backlog {
    /// Records that `waiting` requests wait for a lane now.
    pub fn set(&self, waiting: usize) {
        let mut state = lock(&self.shared.state);
        let emptied = state.backlog > 0 && waiting == 0;
        state.backlog = waiting;
        drop(state);
        if emptied {
            // A step may be waiting for a request that is no longer coming.
            self.shared.work.notify_one();
            self.shared.done.notify_all();
        }
    }
}

impl Drop for Arrival {
    fn drop(&mut self) {
        let mut state = lock(&self.shared.state);
        let counted = match self.lane {
            None => true,
            // Its lane's first chunk may have ended it already.
            Some(lane) => state
                .lanes
                .get_mut(lane)
                .is_some_and(|entry| std::mem::take(&mut entry.arriving)),
        };
        if counted {
            state.arriving = state.arriving.saturating_sub(1);
        }
        drop(state);
        self.shared.work.notify_one();
        self.shared.done.notify_all();
    }
}

impl Drop for SharedStage {
    fn drop(&mut self) {
        lock(&self.shared.state).stopping = true;
        self.shared.work.notify_all();
        self.shared.done.notify_all();
        if let Some(compute) = self.compute.take() {
            let _ = compute.join();
        }
    }
}

impl Pending {
    /// Whether this is a generation's first chunk, of more than one row, not yet begun: a prompt about to start.
    fn starts_prompt(&self, width: usize) -> bool {
        self.first && self.done == 0 && self.input.rows(width) > 1
    }
}

impl LaneState {
    /// Whether the lane's waiting chunk is a prompt about to start ([`Pending::starts_prompt`]).
    fn starts_prompt(&self, width: usize) -> bool {
        self.pending
            .as_ref()
            .is_some_and(|pending| pending.starts_prompt(width))
    }
}

impl OwnedInput {
    fn rows(&self, width: usize) -> usize {
        match self {
            OwnedInput::Tokens(tokens) => tokens.len(),
            OwnedInput::Activations(values) => values.len() / width.max(1),
        }
    }

    fn copy(&self, rows: std::ops::Range<usize>, width: usize) -> OwnedInput {
        match self {
            OwnedInput::Tokens(tokens) => OwnedInput::Tokens(tokens[rows].to_vec()),
            OwnedInput::Activations(values) => {
                OwnedInput::Activations(values[rows.start * width..rows.end * width].to_vec())
            }
        }
    }

    fn borrow(&self) -> StageInput<'_> {
        match self {
            OwnedInput::Tokens(tokens) => StageInput::Tokens(tokens),
            OwnedInput::Activations(values) => StageInput::Activations(values),
        }
    }
}

/// The compute thread: waits for chunks, gathers a step, runs it (unless a caller runs it, see
/// [`SharedStage::forward`]), hands the results back.
fn compute(shared: &Shared) {
    let width = shared.width;
    let policy = shared.policy;
    let mut state = lock(&shared.state);
    let mut gather_started: Option<Instant> = None;
    loop {
        if state.stopping {
            break;
        }
        if state.running || !state.lanes.iter().any(|lane| lane.pending.is_some()) {
            // Nothing to run, or a caller runs the step: its end wakes this thread if chunks are left.
            gather_started = None;
            state = shared
                .work
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            continue;
        }
        // Where callers run the steps, this thread runs one only when woken with chunks left and no caller
        // running it; it keeps the same holds they do, or a wake here would run a lone prompt the callers hold.
        let held = hold_until(&mut state, policy.batches_in_flight).or_else(|| {
            if policy.gather.is_zero() {
                arrivals_hold_until(&mut state, width, &policy)
            } else {
                None
            }
        });
        if let Some(until) = held {
            state = shared
                .work
                .wait_timeout(state, until.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
            continue;
        }
        if !policy.gather.is_zero()
            && let Some(until) = gather_until(
                &state,
                width,
                &policy,
                *gather_started.get_or_insert_with(Instant::now),
            )
        {
            let now = Instant::now();
            if now < until {
                state = shared
                    .work
                    .wait_timeout(state, until - now)
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .0;
                continue;
            }
        }
        gather_started = None;
        let ran;
        (state, ran) = run_step(shared, state);
        if !ran {
            // Cannot happen (a pending chunk has rows and the budget at least one), but a loop that found
            // nothing to run must sleep rather than spin.
            state = shared
                .work
                .wait_timeout(state, GATHER_WAIT)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }
    drop(state);
    shared.done.notify_all();
}

/// Plans one step over the pending chunks, runs it with the state unlocked (and `running` set, so nobody else
/// plans one), and hands the results back to their lanes; called by whichever thread found no step running
/// (the compute thread, or a caller of [`SharedStage::forward`]), with the state locked. Returns it locked, and
/// whether a step ran.
fn run_step<'a>(
    shared: &'a Shared,
    mut state: MutexGuard<'a, State>,
) -> (MutexGuard<'a, State>, bool) {
    let width = shared.width;
    let policy = shared.policy;
    let hold_prompts = state.prompts_wait_for_ending_streams(width, &policy);
    let plan = plan_step(
        &state,
        policy.batch_tokens,
        width,
        hold_prompts,
        |streams| {
            policy
                .decode_stretch
                .and_then(|stretch| state.costs.prompt_rows_within(stretch, streams))
        },
    );
    if plan.is_empty() {
        return (state, false);
    }
    state.running = true;
    state.held_since = None;
    state.arrivals_since = None;
    state.steps += 1;
    let step = state.steps;
    drop(state);
    let started = Instant::now();
    // A pass that panics answers every entry with an error (`Stage::forward_batch`), so this step's lanes fail
    // whichever thread ran it: left pending, their chunks would be planned again by the next step, and a caller
    // waiting for a gather would wait for a step that never ends.
    let results = {
        let mut stage = lock(&shared.stage);
        let entries: Vec<BatchEntry> = plan
            .iter()
            .map(|planned| BatchEntry {
                lane: planned.lane,
                position: planned.position,
                input: planned.input.borrow(),
                logits: planned.logits,
            })
            .collect();
        stage.forward_batch(&entries)
    };
    let seconds = started.elapsed().as_secs_f64();
    let rows: usize = plan.iter().map(|planned| planned.input.rows(width)).sum();
    let decode_rows = plan.iter().filter(|planned| planned.decode).count();
    let stage_metrics = &crate::telemetry::registry::STAGE;
    stage_metrics.step(rows, seconds);
    stage_metrics.batch.observe(plan.len() as f64);
    let mut state = lock(&shared.state);
    state
        .costs
        .observe(decode_rows, rows - decode_rows, seconds);
    // The chunks that end here go on whole, with the rows of their earlier steps too.
    let (ended, ended_rows) = plan
        .iter()
        .zip(&results)
        .filter(|(planned, result)| planned.ends && result.is_ok())
        .filter_map(|(planned, _)| {
            state.lanes[planned.lane]
                .pending
                .as_ref()
                .filter(|pending| pending.order == planned.order)
        })
        .fold((0, 0), |(chunks, rows), pending| {
            (chunks + 1, rows + pending.input.rows(width))
        });
    let tag = StepTag {
        id: step,
        chunks: ended,
        rows: ended_rows,
    };
    let finished = Instant::now();
    for (planned, result) in plan.into_iter().zip(results) {
        let lane = &mut state.lanes[planned.lane];
        let Some(pending) = lane
            .pending
            .as_mut()
            .filter(|pending| pending.order == planned.order)
        else {
            continue;
        };
        match result {
            Ok(output) => {
                let values = match output {
                    StageOutput::Activations(values) | StageOutput::Logits(values) => values,
                };
                // Activation rows of every step are joined; of logits only the last step's row counts,
                // unless the chunk asked for every row's.
                if !shared.last || planned.ends || planned.logits == Logits::All {
                    pending.output.extend_from_slice(&values);
                }
                pending.done += planned.input.rows(width);
                if planned.ends {
                    let Some(done) = lane.pending.take() else {
                        continue;
                    };
                    if done.awaits_answer {
                        lane.out = Some((step, finished, done.input.rows(width) == 1));
                    }
                    let output = if shared.last {
                        StageOutput::Logits(done.output)
                    } else {
                        StageOutput::Activations(done.output)
                    };
                    lane.result = Some(Ok((output, tag)));
                }
            }
            Err(error) => {
                lane.pending = None;
                lane.result = Some(Err(error));
            }
        }
    }
    // The step is over: the waiting callers take their results (or run the next step themselves), and the
    // compute thread, which waits while a caller runs a step, takes any chunks left.
    state.running = false;
    shared.done.notify_all();
    if state.lanes.iter().any(|lane| lane.pending.is_some()) {
        shared.work.notify_one();
    }
    (state, true)
}

/// Until when the step about to run is held for lanes out on their round trip (see
/// [`StepPolicy::batches_in_flight`]); `None` when it may run now. A step holds only if a lane back from its
/// round trip, or a generation's first chunk, is pending (a prompt's later chunks never wait) and the steps
/// with lanes still out are `in_flight` or more; the hold lasts twice the average round trip (within
/// [`HOLD_WAIT_MIN`] and [`HOLD_WAIT_MAX`]) from when it began.
///
/// Why a first chunk waits: lanes whose generations end in one step leave a moment apart, and a request that
/// takes the first lane freed would otherwise prefill alone while the others are still leaving; the requests
/// that take those prefill a step later, and from then on the chain's lanes end, and admit, out of step, so
/// that every later admission stalls running streams. Held, it runs once the others have come back (and it
/// joins their step) or left (and the arrival hold gathers the requests that take their lanes).
fn hold_until(state: &mut State, in_flight: usize) -> Option<Instant> {
    if in_flight == 0 {
        return None;
    }
    let returned = state.lanes.iter().any(|lane| {
        lane.pending
            .as_ref()
            .is_some_and(|pending| (pending.returned || pending.first) && pending.done == 0)
    });
    let mut out: Vec<u64> = state
        .lanes
        .iter()
        .filter_map(|lane| lane.out.map(|(step, _, _)| step))
        .collect();
    out.sort_unstable();
    out.dedup();
    if !returned || out.len() < in_flight {
        state.held_since = None;
        return None;
    }
    let wait = state
        .round_trip
        .map_or(HOLD_WAIT_MIN, |round_trip| round_trip * 2)
        .clamp(HOLD_WAIT_MIN, HOLD_WAIT_MAX);
    let until = *state.held_since.get_or_insert_with(Instant::now) + wait;
    (Instant::now() < until).then_some(until)
}

impl State {
    /// Whether a generation is known to be on its way to a lane: an [`Arrival`], or a queued request and a free
    /// lane to take.
    fn generation_announced(&self) -> bool {
        self.arriving > 0 || (self.backlog > 0 && self.lanes.iter().any(|lane| !lane.active))
    }

    /// Until when a free lane's client may still send its next request, counted as arriving: the latest end of
    /// the `window`s open since a generation left its lane (see [`LaneState::freed`]); `None` when none is open.
    fn next_request_until(&self, window: Duration) -> Option<Instant> {
        let now = Instant::now();
        self.lanes
            .iter()
            .filter(|lane| !lane.active)
            .filter_map(|lane| lane.freed)
            .map(|freed| freed + window)
            .filter(|end| *end > now)
            .max()
    }

    /// Whether a step with what is pending now may wait for generations arriving: one with no stream to decode,
    /// or one in which a prompt starts (its streams stall for that prompt anyway, and prompts on their way then
    /// share the one stall instead of each stalling them again a step later). A prompt that sits the step out for
    /// ending streams ([`State::prompts_wait_for_ending_streams`]) does not start in it.
    fn admitting(&self, width: usize, policy: &StepPolicy) -> bool {
        !self.stream_waiting(width)
            || (self.prompt_starting(width) && !self.prompts_wait_for_ending_streams(width, policy))
    }

    /// Whether a generation's first chunk of more than one row waits for the step: a prompt about to start,
    /// which stalls any stream in its step for its rows.
    fn prompt_starting(&self, width: usize) -> bool {
        self.lanes.iter().any(|lane| lane.starts_prompt(width))
    }

    /// Whether the generations' first prompt chunks waiting now sit this step out for the streams beside them to
    /// end ([`StepPolicy::prompt_hold_steps`]): a stream's next token waits for the step, every other active lane
    /// said it ends within the hold (a lane that did not say, such as one between its own prompt's chunks, keeps
    /// the prompts in), and waiting those steps costs no more decode steps than the prompts' rows would add to
    /// one. Never with a decode stretch, which bounds what a prompt adds to a step anyway.
    fn prompts_wait_for_ending_streams(&self, width: usize, policy: &StepPolicy) -> bool {
        if policy.prompt_hold_steps == 0 || policy.decode_stretch.is_some() {
            return false;
        }
        let prompt_rows: usize = self
            .lanes
            .iter()
            .filter(|lane| lane.starts_prompt(width))
            .filter_map(|lane| lane.pending.as_ref())
            .map(|pending| pending.input.rows(width))
            .sum();
        if prompt_rows == 0 || !self.stream_waiting(width) {
            return false;
        }
        let mut streams = 0;
        let mut longest = 0;
        // Every lane in a generation, or with a chunk waiting (a lane that never said it was active still stalls).
        let others = self
            .lanes
            .iter()
            .filter(|lane| (lane.active || lane.pending.is_some()) && !lane.starts_prompt(width));
        for lane in others {
            let Some(chunks) = lane.chunks_left else {
                return false;
            };
            streams += 1;
            longest = longest.max(chunks);
        }
        let worth = self
            .costs
            .decode_steps_within(prompt_rows, streams)
            .unwrap_or(0.0)
            .min(policy.prompt_hold_steps as f64);
        streams > 0 && longest as f64 <= worth
    }

    /// Whether a stream's next token (a chunk with one row left) waits for the step.
    fn stream_waiting(&self, width: usize) -> bool {
        self.lanes.iter().any(|lane| {
            lane.pending
                .as_ref()
                .is_some_and(|pending| pending.input.rows(width) - pending.done == 1)
        })
    }
}

/// Until when a step of a chain's stage 0 (callers run the steps) is held for generations arriving at lanes;
/// `None` when it may run now. A step that may wait for arrivals ([`State::admitting`]) holds for an announced
/// one up to the policy's `arrival_wait` from when it could first have run, as a whole model's gather does, and
/// for a free lane's next request as long too, but no longer than that lane's `next_request_wait` lasts.
fn arrivals_hold_until(state: &mut State, width: usize, policy: &StepPolicy) -> Option<Instant> {
    let wait = policy.arrival_wait;
    let announced = state.generation_announced();
    let next_request = state.next_request_until(policy.next_request_wait);
    if !state.admitting(width, policy) || !(announced || next_request.is_some()) {
        state.arrivals_since = None;
        return None;
    }
    let mut until = *state.arrivals_since.get_or_insert_with(Instant::now) + wait;
    if !announced && let Some(window) = next_request {
        until = until.min(window);
    }
    (Instant::now() < until).then_some(until)
}

/// Until when the step about to run, which could first have run at `started`, may wait for more chunks; `None`
/// when nothing it would wait for is on its way. Active lanes still taking or using their last result, and an
/// announced generation, get the policy's `gather`. A step that may wait for arrivals ([`State::admitting`])
/// waits the policy's `arrival_wait` (or its gather, the longer) for an announced generation, and for a free
/// lane's next request until that lane's window ends, so prompts that can start together prefill together (and
/// stall running streams once, not once each). The caller does not ask with a zero gather (a chain's stage 0,
/// whose callers run the steps and hold them for arrivals in [`arrivals_hold_until`] instead).
fn gather_until(
    state: &State,
    width: usize,
    policy: &StepPolicy,
    started: Instant,
) -> Option<Instant> {
    let announced = state.generation_announced();
    let lagging = state
        .lanes
        .iter()
        .any(|lane| lane.active && lane.pending.is_none());
    let admitting = state.admitting(width, policy);
    let arrival = started + policy.arrival_wait.max(policy.gather);
    let mut until: Option<Instant> = None;
    let mut wait_to = |end: Instant| until = Some(until.map_or(end, |until| until.max(end)));
    if lagging || announced {
        wait_to(started + policy.gather);
    }
    if admitting && announced {
        wait_to(arrival);
    }
    if admitting && let Some(window) = state.next_request_until(policy.next_request_wait) {
        wait_to(arrival.min(window));
    }
    until
}

/// What the steps so far cost, to size a prompt's share of a decode step: moving averages of a decode row in a
/// decode-only step and of what a prompt row adds to a step with decode rows (or, before any such step, of a
/// prompt row in a prompt-only step). A decode-only step is taken to cost its rows times the row average, so a
/// figure measured with one stream sizes a step with three.
#[derive(Debug, Default)]
struct StepCosts {
    /// Seconds per row of a step of decode rows only.
    decode_row: Option<f64>,
    /// Seconds a prompt row added to a step with decode rows.
    prompt_row_mixed: Option<f64>,
    /// Seconds of a prompt row in a step without decode rows.
    prompt_row_alone: Option<f64>,
}

impl State {
    /// Adds a lane's round trip to the moving average the holds are sized by.
    fn observe_round_trip(&mut self, round_trip: Duration) {
        self.round_trip = Some(match self.round_trip {
            Some(before) => before.mul_f64(0.75) + round_trip.mul_f64(0.25),
            None => round_trip,
        });
    }
}

impl StepCosts {
    /// Weight of the newest step in each average: a few steps follow a change of load (the host getting busy)
    /// without one descheduled step swinging the share.
    const WEIGHT: f64 = 0.25;

    fn observe(&mut self, decode_rows: usize, prompt_rows: usize, seconds: f64) {
        let average = |slot: &mut Option<f64>, value: f64| {
            *slot = Some(match *slot {
                Some(before) => before + Self::WEIGHT * (value - before),
                None => value,
            });
        };
        match (decode_rows, prompt_rows) {
            (0, 0) => {}
            (decode, 0) => average(&mut self.decode_row, seconds / decode as f64),
            (0, prompt) => average(&mut self.prompt_row_alone, seconds / prompt as f64),
            (decode, prompt) => {
                if let Some(row) = self.decode_row {
                    // Measured against the decode-only average: a step that cost less than that gives a prompt
                    // row a small positive cost, never zero or less, so the share stays finite.
                    let added = (seconds - row * decode as f64).max(seconds * 0.01);
                    average(&mut self.prompt_row_mixed, added / prompt as f64);
                }
            }
        }
    }

    /// How many decode-only steps of `streams` rows cost what `rows` prompt rows add to a step; `None` before a
    /// decode-only step and a step with prompt rows have been measured.
    fn decode_steps_within(&self, rows: usize, streams: usize) -> Option<f64> {
        let decode = self.decode_row? * streams.max(1) as f64;
        let row = self.prompt_row_mixed.or(self.prompt_row_alone)?;
        Some(rows as f64 * row / decode.max(f64::MIN_POSITIVE))
    }

    /// The prompt rows a step with `streams` decode rows may add to stay within `stretch` times a decode-only
    /// step (at least one, so a prompt always moves on); `None` before a decode-only step has been measured.
    fn prompt_rows_within(&self, stretch: f64, streams: usize) -> Option<usize> {
        let decode = self.decode_row? * streams.max(1) as f64;
        let row = self
            .prompt_row_mixed
            .or(self.prompt_row_alone)
            .unwrap_or(decode)
            .max(f64::MIN_POSITIVE);
        let rows = ((stretch - 1.0) * decode / row).floor();
        Some(if rows.is_finite() && rows >= 1.0 {
            rows.min(usize::MAX as f64) as usize
        } else {
            1
        })
    }
}

/// Chooses a step: every one-row chunk (a running stream's next token) first, then the other chunks first
/// come, first served, each cut to what is left of the budget, and, when the step decodes streams, to
/// `prompt_cap(streams)` rows in all. With `hold_prompts`, generations' first prompt chunks of more than one row
/// sit the step out ([`State::prompts_wait_for_ending_streams`]).
fn plan_step(
    state: &State,
    budget: usize,
    width: usize,
    hold_prompts: bool,
    prompt_cap: impl Fn(usize) -> Option<usize>,
) -> Vec<Planned> {
    let held = |pending: &Pending| hold_prompts && pending.starts_prompt(width);
    let mut waiting: Vec<(usize, &Pending)> = state
        .lanes
        .iter()
        .enumerate()
        .filter_map(|(index, lane)| lane.pending.as_ref().map(|pending| (index, pending)))
        .filter(|(_, pending)| !held(pending))
        .collect();
    let remaining = |pending: &Pending| pending.input.rows(width) - pending.done;
    waiting.sort_by_key(|(_, pending)| (remaining(pending) > 1, pending.order));
    let decodes = waiting
        .iter()
        .filter(|(_, pending)| remaining(pending) == 1)
        .count();
    let mut left = budget;
    let mut prompt_left = match (decodes > 0).then(|| prompt_cap(decodes)).flatten() {
        Some(cap) => cap.max(1),
        None => usize::MAX,
    };
    let mut plan = Vec::with_capacity(waiting.len());
    for (lane, pending) in waiting {
        let remaining = remaining(pending);
        // A stream's next token always runs, even past the budget, so no stream stalls behind others.
        let take = if remaining == 1 {
            1
        } else {
            remaining.min(left).min(prompt_left)
        };
        if take == 0 {
            continue;
        }
        left = left.saturating_sub(take);
        if remaining > 1 {
            prompt_left -= take;
        }
        plan.push(Planned {
            lane,
            order: pending.order,
            position: pending.position + pending.done,
            input: pending.input.copy(pending.done..pending.done + take, width),
            logits: pending.logits,
            ends: take == remaining,
            decode: remaining == 1,
        });
    }
    plan
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests;
