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
//! A caller keeps its own loop (sampling, the chain link, events) and only hands its forward passes here, so
//! lanes join and leave batches independently, and every lane's result is bit-identical to running it alone
//! (see [`Stage::forward_batch`]). A lane in a generation is *active* ([`SharedStage::activate`]): after a step
//! the compute thread can wait briefly for every active lane to hand in its next chunk, so streams decode
//! together instead of in turns; one that is slow to come back (a descheduled thread) is left for the next
//! step after the gather time ([`GATHER_WAIT`] for a whole model). A chunk longer than the budget runs over several steps, its output rows
//! joined.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{BatchEntry, Logits, ModelError, Stage, StageInput, StageOutput};

/// How long a step of a whole model waits for an active lane that has not handed in its next chunk yet. Callers
/// come back within tens of microseconds when they only sample a row; this bounds the wait for one that does
/// more.
pub const GATHER_WAIT: Duration = Duration::from_millis(2);

/// The default row budget of one pass.
pub const DEFAULT_BATCH_TOKENS: usize = 512;

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
    batch_tokens: usize,
    /// How long a step waits for active lanes to hand in their next chunk (zero: not at all).
    gather: Duration,
    /// Whether the stage holds the model's head (its output is logits, not activation rows).
    last: bool,
    width: usize,
}

#[derive(Debug, Default)]
struct State {
    lanes: Vec<LaneState>,
    /// Generations about to take a lane (see [`SharedStage::expect_arrival`]).
    arriving: usize,
    stopping: bool,
    /// Orders chunks first come, first served.
    clock: u64,
}

#[derive(Debug, Default)]
struct LaneState {
    active: bool,
    pending: Option<Pending>,
    result: Option<Result<StageOutput, ModelError>>,
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
}

impl SharedStage {
    /// Starts the compute thread for `stage`; a pass runs at most `batch_tokens` rows (every pending one-row
    /// chunk runs whatever the budget), and a step waits up to `gather` for active lanes that have not handed
    /// in their next chunk yet. A gather pays where lanes come back within it (a whole model: they only
    /// sample); where a lane's next chunk waits for a round trip down a chain, `Duration::ZERO` lets the
    /// steps batch only what has queued up meanwhile.
    pub fn start(
        stage: Stage,
        batch_tokens: usize,
        gather: Duration,
    ) -> std::io::Result<SharedStage> {
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
            batch_tokens: batch_tokens.max(1),
            gather,
            last,
            width,
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
        }
    }

    /// Marks `lane` as in a generation (`true`) or not: the compute thread waits a little for active lanes to
    /// hand in their next chunk before it starts a step.
    pub fn activate(&self, lane: usize, active: bool) {
        let mut state = lock(&self.shared.state);
        if let Some(entry) = state.lanes.get_mut(lane) {
            entry.active = active;
        }
        drop(state);
        if !active {
            // A step may be waiting for this lane.
            self.shared.work.notify_one();
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
        state.lanes[lane].result = None;
        state.lanes[lane].pending = Some(Pending {
            position,
            input,
            logits,
            done: 0,
            output: Vec::new(),
            order,
        });
        self.shared.work.notify_one();
        loop {
            if let Some(result) = state.lanes[lane].result.take() {
                return result;
            }
            if state.stopping {
                return Err(ModelError::Compute("the compute thread stopped".into()));
            }
            state = self
                .shared
                .done
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

/// A generation on its way to a lane (its prompt being tokenized): while it lives, a step waits for it as for
/// an active lane, so requests that start together prefill in one pass. Drop it once the lane is active.
#[derive(Debug)]
pub struct Arrival {
    shared: Arc<Shared>,
}

impl Drop for Arrival {
    fn drop(&mut self) {
        let mut state = lock(&self.shared.state);
        state.arriving = state.arriving.saturating_sub(1);
        drop(state);
        self.shared.work.notify_one();
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

/// The compute thread: waits for chunks, gathers a step, runs it, hands the results back.
fn compute(shared: &Shared) {
    let width = shared.width;
    let mut state = lock(&shared.state);
    let mut gather_until: Option<Instant> = None;
    loop {
        if state.stopping {
            break;
        }
        if !state.lanes.iter().any(|lane| lane.pending.is_some()) {
            gather_until = None;
            state = shared
                .work
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            continue;
        }
        // Active lanes still taking or using their last result: give them a moment to join this step.
        let thinking = state.arriving > 0
            || state
                .lanes
                .iter()
                .any(|lane| lane.active && lane.pending.is_none());
        if thinking && !shared.gather.is_zero() {
            let until = *gather_until.get_or_insert_with(|| Instant::now() + shared.gather);
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
        gather_until = None;
        let plan = plan_step(&state, shared.batch_tokens, width);
        if plan.is_empty() {
            // Cannot happen (a pending chunk has rows and the budget at least one), but a loop that found
            // nothing to run must sleep rather than spin.
            state = shared
                .work
                .wait_timeout(state, GATHER_WAIT)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
            continue;
        }
        drop(state);
        let started = Instant::now();
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
        let rows: usize = plan.iter().map(|planned| planned.input.rows(width)).sum();
        let stage_metrics = &crate::telemetry::registry::STAGE;
        stage_metrics.step(rows, started.elapsed().as_secs_f64());
        stage_metrics.batch.observe(plan.len() as f64);
        state = lock(&shared.state);
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
                        lane.result = Some(Ok(if shared.last {
                            StageOutput::Logits(done.output)
                        } else {
                            StageOutput::Activations(done.output)
                        }));
                    }
                }
                Err(error) => {
                    lane.pending = None;
                    lane.result = Some(Err(error));
                }
            }
        }
        shared.done.notify_all();
    }
    drop(state);
    shared.done.notify_all();
}

/// Chooses a step: every one-row chunk (a running stream's next token) first, then the other chunks first
/// come, first served, each cut to what is left of the budget.
fn plan_step(state: &State, budget: usize, width: usize) -> Vec<Planned> {
    let mut waiting: Vec<(usize, &Pending)> = state
        .lanes
        .iter()
        .enumerate()
        .filter_map(|(index, lane)| lane.pending.as_ref().map(|pending| (index, pending)))
        .collect();
    let remaining = |pending: &Pending| pending.input.rows(width) - pending.done;
    waiting.sort_by_key(|(_, pending)| (remaining(pending) > 1, pending.order));
    let mut left = budget;
    let mut plan = Vec::with_capacity(waiting.len());
    for (lane, pending) in waiting {
        let remaining = remaining(pending);
        // A stream's next token always runs, even past the budget, so no stream stalls behind others.
        let take = if remaining == 1 {
            1
        } else {
            remaining.min(left)
        };
        if take == 0 {
            continue;
        }
        left = left.saturating_sub(take);
        plan.push(Planned {
            lane,
            order: pending.order,
            position: pending.position + pending.done,
            input: pending.input.copy(pending.done..pending.done + take, width),
            logits: pending.logits,
            ends: take == remaining,
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
mod tests {
    use super::*;

    fn waiting(rows: usize, order: u64) -> LaneState {
        LaneState {
            active: true,
            pending: Some(Pending {
                position: 10,
                input: OwnedInput::Tokens(vec![7; rows]),
                logits: Logits::Last,
                done: 0,
                output: Vec::new(),
                order,
            }),
            result: None,
        }
    }

    fn taken(plan: &[Planned]) -> Vec<(usize, usize, bool)> {
        plan.iter()
            .map(|planned| (planned.lane, planned.input.rows(1), planned.ends))
            .collect()
    }

    #[test]
    fn one_row_chunks_run_first_and_longer_ones_share_what_is_left_of_the_budget_in_order() {
        let state = State {
            lanes: vec![
                waiting(300, 1),
                waiting(1, 5),
                waiting(400, 2),
                waiting(1, 9),
            ],
            ..State::default()
        };
        assert_eq!(
            taken(&plan_step(&state, 512, 1)),
            [(1, 1, true), (3, 1, true), (0, 300, true), (2, 210, false)]
        );
        // A budget smaller than the streams still runs every stream's token, and nothing else.
        assert_eq!(
            taken(&plan_step(&state, 1, 1)),
            [(1, 1, true), (3, 1, true)]
        );
    }

    #[test]
    fn a_chunk_over_several_steps_resumes_where_it_stopped() {
        let mut lane = waiting(700, 1);
        if let Some(pending) = lane.pending.as_mut() {
            pending.done = 512;
        }
        let state = State {
            lanes: vec![lane],
            ..State::default()
        };
        let plan = plan_step(&state, 512, 1);
        assert_eq!(taken(&plan), [(0, 188, true)]);
        assert_eq!(plan[0].position, 10 + 512);
    }

    #[test]
    fn a_chunk_longer_than_the_budget_gives_the_rows_of_one_pass() {
        use crate::model::testing::TinyModel;
        use crate::model::{StageOptions, StageSpec};
        use candle_core::quantized::GgmlDType;
        let model = TinyModel::llama(GgmlDType::Q4_1);
        let dir = std::env::temp_dir().join(format!("stage-server-shared-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let path = model.write_to_dir(&dir).expect("write the tiny model");
        let first = StageSpec::split(model.block_count, &[2]).expect("split")[0].clone();
        let load = || {
            Stage::load(
                &path,
                first.clone(),
                StageOptions {
                    lane_count: 1,
                    context_length: None,
                },
            )
            .expect("load")
        };
        let prompt: Vec<u32> = (0..11).map(|index| 40 + index).collect();
        let whole = load()
            .forward(0, 0, StageInput::Tokens(&prompt), Logits::Last)
            .expect("one pass");
        // A budget of 4 rows: the 11 rows run in three steps, their activation rows joined in order.
        let shared = SharedStage::start(load(), 4, Duration::ZERO).expect("start");
        let stepped = shared
            .forward(0, 0, StageInput::Tokens(&prompt), Logits::Last)
            .expect("three steps");
        let bits = |output: &StageOutput| match output {
            StageOutput::Activations(values) | StageOutput::Logits(values) => values
                .iter()
                .map(|value| value.to_bits())
                .collect::<Vec<_>>(),
        };
        assert!(matches!(stepped, StageOutput::Activations(_)));
        assert_eq!(bits(&stepped), bits(&whole));
        drop(shared);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
