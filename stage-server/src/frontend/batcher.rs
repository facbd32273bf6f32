//! Continuous batching for the whole model: one compute thread runs every waiting lane's next chunk in one
//! forward pass under a token budget, and lanes are leased by the longest prompt prefix they already hold.
//!
//! ```text
//!   lane worker ─lease(prompt)─▶ free lane with the longest reusable prefix (trimmed to it)
//!   lane worker ─forward(tokens)─▶ pending ─┐
//!   lane worker ─forward(tokens)─▶ pending ─┼─▶ compute thread: one Stage::forward_batch per step
//!   lane worker ─forward(tokens)─▶ pending ─┘     decode rows first, then prompt chunks up to --batch-tokens
//! ```
//!
//! A lane worker keeps its generation loop (sampling, stop strings, events) and only hands its forward passes
//! here, so requests join and leave the batch independently. After a step the compute thread waits briefly
//! for every leased lane to hand in its next chunk, so the running streams decode together rather than in
//! turns; a lane that is slow to come back (a descheduled thread) is left for the next step after
//! [`GATHER_WAIT`].

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::model::{BatchEntry, Logits, ModelError, Stage, StageInput, StageOutput};

/// How long a step waits for a leased lane that has not handed in its next chunk yet. Workers come back
/// within tens of microseconds (they sample one row and push an event); this only bounds a stall.
const GATHER_WAIT: Duration = Duration::from_millis(2);

/// The default of `--batch-tokens`: rows of one forward pass at most (decode rows and prompt chunks).
pub(crate) const DEFAULT_BATCH_TOKENS: usize = 512;

/// The lanes of one whole-model stage and the thread that computes their batches.
#[derive(Debug)]
pub(crate) struct Batcher {
    shared: Arc<Shared>,
    compute: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    /// Locked by the compute thread for a pass, and by a lease to trim its lane.
    stage: Mutex<Stage>,
    state: Mutex<State>,
    /// The compute thread waits here for chunks.
    work: Condvar,
    /// Lane workers wait here for their results.
    done: Condvar,
    batch_tokens: usize,
}

#[derive(Debug, Default)]
struct State {
    lanes: Vec<LaneState>,
    stopping: bool,
    /// Orders chunks first come, first served among prompts, and leases by last use.
    clock: u64,
}

#[derive(Debug, Default)]
struct LaneState {
    leased: bool,
    /// When the lane was last leased (the least recently used free lane is reused first).
    last_used: u64,
    /// The tokens whose keys and values the lane's cache holds, in order.
    history: Vec<u32>,
    pending: Option<Pending>,
    result: Option<Result<Vec<f32>, ModelError>>,
}

/// A chunk handed in and not finished yet: a prompt longer than the budget runs over several steps.
#[derive(Debug)]
struct Pending {
    position: usize,
    tokens: Vec<u32>,
    /// Tokens of `tokens` already run.
    done: usize,
    order: u64,
}

/// One lane, held by one generation.
#[derive(Debug)]
pub(crate) struct Lease {
    shared: Arc<Shared>,
    lane: usize,
    length: usize,
    cached: usize,
}

impl Batcher {
    /// Starts the compute thread for `stage`, whose every lane this batcher leases; a pass runs at most
    /// `batch_tokens` rows.
    pub(crate) fn start(stage: Stage, batch_tokens: usize) -> Result<Arc<Batcher>, String> {
        let lanes = (0..stage.lane_count())
            .map(|_| LaneState::default())
            .collect();
        let shared = Arc::new(Shared {
            stage: Mutex::new(stage),
            state: Mutex::new(State {
                lanes,
                ..State::default()
            }),
            work: Condvar::new(),
            done: Condvar::new(),
            batch_tokens: batch_tokens.max(1),
        });
        let compute = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("stage-compute".into())
                .spawn(move || compute(&shared))
                .map_err(|error| format!("the compute thread did not start: {error}"))?
        };
        Ok(Arc::new(Batcher {
            shared,
            compute: Some(compute),
        }))
    }

    /// Leases the free lane that holds the longest prefix of `prompt` it can reuse (at most all but the
    /// prompt's last token, which must run to give logits), cut back to that prefix; with none to reuse, the
    /// least recently used free lane, emptied.
    pub(crate) fn lease(&self, prompt: &[u32]) -> Result<Lease, ModelError> {
        let mut state = lock(&self.shared.state);
        state.clock += 1;
        let clock = state.clock;
        // The stage is locked under the state (the compute thread never holds both), for at most one pass.
        let mut stage = lock(&self.shared.stage);
        let chosen = {
            let stage = &*stage;
            let reusable = |lane: usize, history: &[u32]| {
                let common = history
                    .iter()
                    .zip(prompt)
                    .take_while(|(held, wanted)| held == wanted)
                    .count()
                    .min(prompt.len().saturating_sub(1));
                // A sliding-window layer may no longer hold what a trim that far back needs.
                if common > 0 && stage.check_trim(lane, common).is_ok() {
                    common
                } else {
                    0
                }
            };
            state
                .lanes
                .iter()
                .enumerate()
                .filter(|(_, lane)| !lane.leased)
                .map(|(index, lane)| (reusable(index, &lane.history), index, lane.last_used))
                .max_by_key(|&(reusable, _, last_used)| (reusable, std::cmp::Reverse(last_used)))
        };
        let Some((cached, lane, _)) = chosen else {
            return Err(ModelError::Compute(
                "every lane is leased; a generation started without a free lane".into(),
            ));
        };
        if cached == 0 {
            stage.reset(lane)?;
        } else {
            stage.trim(lane, cached)?;
        }
        drop(stage);
        let entry = &mut state.lanes[lane];
        entry.leased = true;
        entry.last_used = clock;
        entry.history.truncate(cached);
        entry.result = None;
        entry.pending = None;
        Ok(Lease {
            shared: Arc::clone(&self.shared),
            lane,
            length: cached,
            cached,
        })
    }

    /// Positions each lane's cache holds (tests and `/metrics`).
    #[cfg(test)]
    fn lane_lengths(&self) -> Vec<usize> {
        let state = lock(&self.shared.state);
        state.lanes.iter().map(|lane| lane.history.len()).collect()
    }
}

impl Drop for Batcher {
    fn drop(&mut self) {
        lock(&self.shared.state).stopping = true;
        self.shared.work.notify_all();
        if let Some(compute) = self.compute.take() {
            let _ = compute.join();
        }
    }
}

impl Lease {
    /// Leading prompt tokens the lane already held.
    pub(crate) fn cached(&self) -> usize {
        self.cached
    }

    /// Runs `tokens` at the lane's end in some batch (or several, for a prompt longer than the budget) and
    /// returns the logit row of the last one.
    pub(crate) fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::EmptyChunk);
        }
        let mut state = lock(&self.shared.state);
        if state.stopping {
            return Err(ModelError::Compute("the compute thread is stopping".into()));
        }
        state.clock += 1;
        let order = state.clock;
        state.lanes[self.lane].pending = Some(Pending {
            position: self.length,
            tokens: tokens.to_vec(),
            done: 0,
            order,
        });
        self.shared.work.notify_one();
        loop {
            if let Some(result) = state.lanes[self.lane].result.take() {
                if result.is_ok() {
                    self.length += tokens.len();
                }
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

impl Drop for Lease {
    fn drop(&mut self) {
        let mut state = lock(&self.shared.state);
        let lane = &mut state.lanes[self.lane];
        lane.leased = false;
        lane.pending = None;
        lane.result = None;
        drop(state);
        // A step may be waiting for this lane's next chunk.
        self.shared.work.notify_one();
    }
}

/// One entry of a step: a lane and the slice of its pending chunk this step runs.
struct Planned {
    lane: usize,
    /// The pending chunk's order, so a result finds only the chunk it ran for.
    order: u64,
    position: usize,
    tokens: Vec<u32>,
}

/// The compute thread: waits for chunks, gathers a step, runs it, hands the results back.
fn compute(shared: &Shared) {
    let mut state = lock(&shared.state);
    let mut gather_until: Option<Instant> = None;
    loop {
        if state.stopping {
            break;
        }
        let pending = state
            .lanes
            .iter()
            .filter(|lane| lane.pending.is_some())
            .count();
        if pending == 0 {
            gather_until = None;
            state = shared
                .work
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            continue;
        }
        // Leased lanes still taking or sampling their last row: give them a moment to join this step.
        let thinking = state
            .lanes
            .iter()
            .filter(|lane| lane.leased && lane.pending.is_none())
            .count();
        if thinking > 0 {
            let until = *gather_until.get_or_insert_with(|| Instant::now() + GATHER_WAIT);
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
        let plan = plan_step(&state, shared.batch_tokens);
        drop(state);
        let started = Instant::now();
        let results = {
            let mut stage = lock(&shared.stage);
            let entries: Vec<BatchEntry> = plan
                .iter()
                .map(|planned| BatchEntry {
                    lane: planned.lane,
                    position: planned.position,
                    input: StageInput::Tokens(&planned.tokens),
                    logits: Logits::Last,
                })
                .collect();
            stage.forward_batch(&entries)
        };
        let rows: usize = plan.iter().map(|planned| planned.tokens.len()).sum();
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
                // The lease ended while its chunk ran (a new lease trimmed or reset the lane already, to no
                // more than this chunk's start).
                lane.history.truncate(planned.position);
                continue;
            };
            match result {
                Ok(output) => {
                    lane.history.extend_from_slice(&planned.tokens);
                    pending.done += planned.tokens.len();
                    if pending.done == pending.tokens.len() {
                        lane.pending = None;
                        lane.result = Some(match output {
                            StageOutput::Logits(row) => Ok(row),
                            StageOutput::Activations(_) => Err(ModelError::Compute(
                                "the local stage returned activations; it must hold every layer"
                                    .into(),
                            )),
                        });
                    }
                }
                Err(error) => {
                    lane.history.truncate(planned.position);
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

/// Chooses a step's entries: every one-token chunk (a running stream's next token) first, then the other
/// chunks first come, first served, each cut to what is left of the budget.
fn plan_step(state: &State, budget: usize) -> Vec<Planned> {
    let mut waiting: Vec<(usize, &Pending)> = state
        .lanes
        .iter()
        .enumerate()
        .filter_map(|(index, lane)| lane.pending.as_ref().map(|pending| (index, pending)))
        .collect();
    waiting.sort_by_key(|(_, pending)| (pending.tokens.len() - pending.done > 1, pending.order));
    let mut left = budget;
    let mut plan = Vec::with_capacity(waiting.len());
    for (lane, pending) in waiting {
        let remaining = pending.tokens.len() - pending.done;
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
            tokens: pending.tokens[pending.done..pending.done + take].to_vec(),
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
    use crate::model::testing::TinyModel;
    use crate::model::{StageOptions, StageSpec};
    use candle_core::quantized::GgmlDType;

    fn tiny_stage(lanes: usize) -> (std::path::PathBuf, Stage) {
        let model = TinyModel::llama(GgmlDType::Q4_1);
        let dir = std::env::temp_dir().join(format!(
            "stage-server-batcher-{}-{lanes}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let path = model.write_to_dir(&dir).expect("write the tiny model");
        let stage = Stage::load(
            &path,
            StageSpec::whole(model.block_count),
            StageOptions {
                lane_count: lanes,
                context_length: None,
            },
        )
        .expect("load");
        (dir, stage)
    }

    #[test]
    fn a_lease_reuses_the_longest_prefix_a_free_lane_holds_and_gives_the_same_logits() {
        let (dir, stage) = tiny_stage(2);
        let (_, mut reference) = tiny_stage(1);
        let batcher = Batcher::start(stage, 4).expect("start");
        let first = [1u32, 40, 41, 42, 43, 44, 45];
        {
            let mut lease = batcher.lease(&first).expect("lease");
            assert_eq!(lease.cached(), 0);
            // Seven tokens over a budget of four: two steps.
            lease.forward(&first).expect("prefill");
            lease.forward(&[50]).expect("decode");
        }
        assert!(batcher.lane_lengths().contains(&8));
        let second = [1u32, 40, 41, 42, 43, 99, 100];
        let mut lease = batcher.lease(&second).expect("lease");
        assert_eq!(lease.cached(), 5, "the shared five tokens are reused");
        let reused = lease.forward(&second[5..]).expect("the rest of the prompt");
        let cold = match reference
            .forward(0, 0, StageInput::Tokens(&second), Logits::Last)
            .expect("cold")
        {
            StageOutput::Logits(row) => row,
            StageOutput::Activations(_) => panic!("activations"),
        };
        let bits = |row: &[f32]| row.iter().map(|value| value.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&reused), bits(&cold));
        // The same prompt again reuses all but its last token.
        drop(lease);
        let lease = batcher.lease(&second).expect("lease");
        assert_eq!(lease.cached(), second.len() - 1);
        drop(lease);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn one_token_chunks_run_first_and_prompts_share_what_is_left_of_the_budget() {
        let mut state = State::default();
        let chunk = |position: usize, length: usize, order: u64| Pending {
            position,
            tokens: vec![7; length],
            done: 0,
            order,
        };
        for (length, order) in [(300, 1), (1, 5), (400, 2), (1, 9)] {
            state.lanes.push(LaneState {
                leased: true,
                pending: Some(chunk(10, length, order)),
                ..LaneState::default()
            });
        }
        let plan = plan_step(&state, 512);
        let taken: Vec<(usize, usize)> = plan
            .iter()
            .map(|planned| (planned.lane, planned.tokens.len()))
            .collect();
        assert_eq!(taken, [(1, 1), (3, 1), (0, 300), (2, 210)]);
        // A budget smaller than the streams still runs every stream's token.
        let plan = plan_step(&state, 1);
        let taken: Vec<(usize, usize)> = plan
            .iter()
            .map(|planned| (planned.lane, planned.tokens.len()))
            .collect();
        assert_eq!(taken, [(1, 1), (3, 1)]);
    }
}
