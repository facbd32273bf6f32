//! The whole model's lanes for the API: each generation leases the free lane that holds the longest prefix of
//! its prompt, and every lane's forward passes run batched with the others' on one [`SharedStage`].
//!
//! ```text
//!   lane worker ─lease(prompt)─▶ free lane with the longest reusable prefix (trimmed to it), activated
//!   lane worker ─forward(tokens)─▶ SharedStage: every stream's next token, then prompt chunks up to
//!                                  --batch-tokens, in one forward pass
//! ```

use std::sync::{Arc, Mutex, MutexGuard};

use crate::model::{
    Arrival, Backlog, GATHER_WAIT, Logits, ModelError, PREFILL_CHUNK, SharedStage, Stage,
    StageInput, StageOutput, StepPolicy,
};

/// The whole model's lanes, leased per generation.
#[derive(Debug)]
pub(crate) struct Batcher {
    stage: SharedStage,
    lanes: Mutex<Lanes>,
}

#[derive(Debug, Default)]
struct Lanes {
    lanes: Vec<LaneRecord>,
    /// When each lane was last leased (the least recently used free lane is reused first).
    clock: u64,
}

#[derive(Debug, Default)]
struct LaneRecord {
    leased: bool,
    last_used: u64,
    /// The tokens whose keys and values the lane's cache holds, in order.
    history: Vec<u32>,
}

/// One lane, held by one generation.
#[derive(Debug)]
pub(crate) struct Lease {
    batcher: Arc<Batcher>,
    lane: usize,
    length: usize,
    cached: usize,
}

impl Batcher {
    /// Starts the compute thread for `stage`, whose every lane this batcher leases; a pass runs at most
    /// `batch_tokens` rows, and prompt rows stretch a decode pass at most `decode_stretch` times; a prompt waits
    /// at most `prompt_hold_steps` passes for streams about to end.
    pub(crate) fn start(
        stage: Stage,
        batch_tokens: usize,
        decode_stretch: Option<f64>,
        prompt_hold_steps: usize,
    ) -> Result<Arc<Batcher>, String> {
        let lane_count = stage.lane_count();
        let policy = StepPolicy {
            decode_stretch,
            prompt_hold_steps,
            ..StepPolicy::new(batch_tokens, GATHER_WAIT)
        };
        let stage = SharedStage::start(stage, policy)
            .map_err(|error| format!("the compute thread did not start: {error}"))?;
        Ok(Arc::new(Batcher {
            stage,
            lanes: Mutex::new(Lanes {
                lanes: (0..lane_count).map(|_| LaneRecord::default()).collect(),
                clock: 0,
            }),
        }))
    }

    /// Announces a generation that is about to lease a lane, so the next step waits for it (a prompt being
    /// tokenized takes well under the gather time); pass it to [`Batcher::lease`].
    pub(crate) fn expect_arrival(&self) -> Arrival {
        self.stage.expect_arrival()
    }

    /// Where the server's queue says how many requests wait for a lane (see [`Backlog`]).
    pub(crate) fn backlog(&self) -> Backlog {
        self.stage.backlog()
    }

    /// Leases the free lane that holds the longest prefix of `prompt` it can reuse (at most all but the
    /// prompt's last token, which must run to give logits), cut back to that prefix; with none to reuse, the
    /// least recently used free lane, emptied.
    pub(crate) fn lease(
        self: &Arc<Self>,
        prompt: &[u32],
        arrival: Option<Arrival>,
    ) -> Result<Lease, ModelError> {
        let mut lanes = lock(&self.lanes);
        lanes.clock += 1;
        let clock = lanes.clock;
        let (lane, cached) = self.stage.with_stage(|stage| {
            let reusable = |lane: usize, history: &[u32]| {
                let common = crate::model::common_prefix(history, prompt)
                    .min(prompt.len().saturating_sub(1));
                // A sliding-window layer may no longer hold what a trim that far back needs.
                if common > 0 && stage.check_trim(lane, common).is_ok() {
                    common
                } else {
                    0
                }
            };
            let (cached, lane, _) = lanes
                .lanes
                .iter()
                .enumerate()
                .filter(|(_, lane)| !lane.leased)
                .map(|(index, lane)| (reusable(index, &lane.history), index, lane.last_used))
                .max_by_key(|&(reusable, _, last_used)| (reusable, std::cmp::Reverse(last_used)))
                .ok_or_else(|| {
                    ModelError::Compute(
                        "every lane is leased; a generation started without a free lane".into(),
                    )
                })?;
            if cached == 0 {
                stage.reset(lane)?;
            } else {
                stage.trim(lane, cached)?;
            }
            Ok::<_, ModelError>((lane, cached))
        })?;
        let record = &mut lanes.lanes[lane];
        record.leased = true;
        record.last_used = clock;
        record.history.truncate(cached);
        drop(lanes);
        self.stage.activate(lane, true);
        // Active now: the step waits for the lane itself.
        drop(arrival);
        Ok(Lease {
            batcher: Arc::clone(self),
            lane,
            length: cached,
            cached,
        })
    }

    /// Positions each lane's cache holds, as the leases recorded them.
    #[cfg(test)]
    fn lane_lengths(&self) -> Vec<usize> {
        lock(&self.lanes)
            .lanes
            .iter()
            .map(|lane| lane.history.len())
            .collect()
    }
}

impl Batcher {
    /// The most prompt rows a generation hands in at once: a pass's budget (`--batch-tokens`), and at least
    /// [`PREFILL_CHUNK`]. Between two such chunks a cancelled generation stops.
    pub(crate) fn prompt_chunk(&self) -> usize {
        self.stage.policy().batch_tokens.max(PREFILL_CHUNK)
    }
}

impl Lease {
    /// Leading prompt tokens the lane already held.
    pub(crate) fn cached(&self) -> usize {
        self.cached
    }

    /// Runs `tokens` at the lane's end in the next batch (or several, for more than the budget) and returns
    /// the logit row of the last one.
    pub(crate) fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let batcher = &self.batcher;
        let outcome = batcher.stage.forward(
            self.lane,
            self.length,
            StageInput::Tokens(tokens),
            Logits::Last,
        );
        let mut lanes = lock(&batcher.lanes);
        let history = &mut lanes.lanes[self.lane].history;
        match outcome {
            Ok(StageOutput::Logits(row)) => {
                history.extend_from_slice(tokens);
                self.length += tokens.len();
                Ok(row)
            }
            Ok(StageOutput::Activations(_)) => Err(ModelError::Compute(
                "the local stage returned activations; it must hold every layer".into(),
            )),
            Err(error) => {
                // What the cache holds past the chunk's start is unknown now; the next lease resets or trims.
                history.truncate(self.length);
                Err(error)
            }
        }
    }
}

impl Lease {
    /// Says the generation hands in at most `chunks` more chunks (see [`crate::model::SharedStage::expect_end`]).
    pub(crate) fn expect_end(&self, chunks: usize) {
        self.batcher.stage.expect_end(self.lane, chunks);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.batcher.stage.activate(self.lane, false);
        lock(&self.batcher.lanes).lanes[self.lane].leased = false;
    }
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
    use candle_core::quantized::GgmlDType;

    fn tiny_stage(lanes: usize) -> (std::path::PathBuf, Stage) {
        TinyModel::llama(GgmlDType::Q4_1).scratch_stage(&format!("batcher-{lanes}"), lanes)
    }

    #[test]
    fn a_lease_reuses_the_longest_prefix_a_free_lane_holds_and_gives_the_same_logits() {
        let (dir, stage) = tiny_stage(2);
        let (_, mut reference) = tiny_stage(1);
        let batcher =
            Batcher::start(stage, 4, None, crate::model::PROMPT_HOLD_STEPS).expect("start");
        let first = [1u32, 40, 41, 42, 43, 44, 45];
        {
            let mut lease = batcher.lease(&first, None).expect("lease");
            assert_eq!(lease.cached(), 0);
            // Seven tokens over a budget of four: two steps.
            lease.forward(&first).expect("prefill");
            lease.forward(&[50]).expect("decode");
        }
        assert!(batcher.lane_lengths().contains(&8));
        let second = [1u32, 40, 41, 42, 43, 99, 100];
        let mut lease = batcher.lease(&second, None).expect("lease");
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
        let lease = batcher.lease(&second, None).expect("lease");
        assert_eq!(lease.cached(), second.len() - 1);
        drop(lease);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
