//! Token sampling on the last stage: penalties, top-k, top-p, min-p, temperature and a seeded RNG.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Sampler settings, in the order llama.cpp's default chain applies them:
/// penalties, top-k, top-p, min-p, temperature, then a seeded draw (or argmax when `temperature <= 0`).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// `<= 0` means greedy (argmax after penalties).
    pub temperature: f32,
    /// Keep the `k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 keeps all.
    pub min_p: f32,
    /// Seed of the random draw; the same seed and logits give the same tokens.
    pub seed: u64,
    /// Divides positive (multiplies negative) logits of recently seen tokens; 1 disables.
    pub repeat_penalty: f32,
    /// Subtracted once from the logit of every recently seen token.
    pub presence_penalty: f32,
    /// Subtracted from a recently seen token's logit once per occurrence.
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at; 0 disables them.
    pub penalty_last_n: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed: 0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
        }
    }
}

/// A sampler with its own RNG state and the history the penalties need.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    random: SplitMix64,
    history: Vec<u32>,
    /// The (id, logit) list of the last draw, kept for its allocation: a vocabulary's worth (2 MiB on
    /// gemma-3's 262,144 tokens) per token would otherwise come from the allocator, and back, at every step.
    candidates: Scratch,
}

/// A buffer kept only for its allocation: a clone starts empty and `Debug` prints its length, not a
/// vocabulary of pairs.
#[derive(Default)]
struct Scratch(Vec<(u32, f32)>);

impl Clone for Scratch {
    fn clone(&self) -> Self {
        Scratch::default()
    }
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "Scratch({} pairs)", self.0.len())
    }
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Self {
            random: SplitMix64(params.seed),
            params,
            history: Vec::new(),
            candidates: Scratch::default(),
        }
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records `token` as seen (prompt tokens and generated ones), for the penalties.
    pub fn accept(&mut self, token: u32) {
        self.history.push(token);
    }

    /// Picks the next token from one row of logits. Does not record it; call [`Sampler::accept`].
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let mut candidates = std::mem::take(&mut self.candidates.0);
        candidates.clear();
        let top_k = self.params.top_k;
        if self.params.temperature > 0.0
            && top_k > 0
            && top_k < logits.len()
            && !self.penalties_apply()
        {
            // Only the k best are ever looked at, and without penalties their logits are the raw ones: one
            // pass over the logits keeps them, instead of listing the whole vocabulary and selecting from it
            // (on gemma-3's 262,144 ids, with 4 lanes sampling on 2 cores, that took long enough to drop a
            // lane's next token out of the batch a whole model gathers 2 ms after its last step).
            best_of(logits, top_k, &mut candidates);
        } else {
            candidates.extend(
                logits
                    .iter()
                    .enumerate()
                    .map(|(id, &logit)| (id as u32, logit)),
            );
        }
        let token = self.draw(&mut candidates);
        self.candidates = Scratch(candidates);
        token
    }

    /// [`Sampler::sample`] over the (id, logit) list of the vocabulary (or, without penalties, of the top k
    /// already), which it reorders and cuts.
    fn draw(&mut self, candidates: &mut Vec<(u32, f32)>) -> u32 {
        self.apply_penalties(candidates);
        if self.params.temperature <= 0.0 {
            return argmax(candidates);
        }
        // By logit, highest first; ties keep the lower id first so draws are reproducible. The order is total
        // (ids are unique), so selecting the top k and sorting only them gives the very list a sort of the
        // whole vocabulary cut to k gives, in linear time instead of a sort per token (which cost about 1 ms a
        // token on SmolLM2's 49,152 ids, and about 8 ms, a decode step, on gemma-3's 262,144).
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let top_k = self.params.top_k;
        if top_k > 0 && top_k < candidates.len() {
            candidates.select_nth_unstable_by(top_k - 1, order);
            candidates.truncate(top_k);
        }
        candidates.sort_unstable_by(order);
        self.cut_and_draw(candidates)
    }

    /// The cuts after top-k (top-p, then min-p) and the seeded draw, over `candidates` sorted highest first.
    fn cut_and_draw(&mut self, candidates: &mut Vec<(u32, f32)>) -> u32 {
        if self.params.top_p < 1.0 {
            let probabilities = softmax(candidates, 1.0);
            let mut cumulative = 0.0;
            let mut keep = candidates.len();
            for (index, probability) in probabilities.iter().enumerate() {
                cumulative += probability;
                if cumulative >= f64::from(self.params.top_p) {
                    keep = index + 1;
                    break;
                }
            }
            candidates.truncate(keep.max(1));
        }
        if self.params.min_p > 0.0 {
            let probabilities = softmax(candidates, 1.0);
            // An empty list (a vocabulary of none) has nothing to cut.
            if let Some(&top) = probabilities.first() {
                let threshold = top * f64::from(self.params.min_p);
                let keep = probabilities
                    .iter()
                    .take_while(|&&probability| probability >= threshold)
                    .count();
                candidates.truncate(keep.max(1));
            }
        }
        let probabilities = softmax(candidates, self.params.temperature);
        let draw = self.random.next_unit();
        let mut cumulative = 0.0;
        for (candidate, probability) in candidates.iter().zip(&probabilities) {
            cumulative += probability;
            if draw < cumulative {
                return candidate.0;
            }
        }
        candidates.last().map_or(0, |candidate| candidate.0)
    }

    /// Whether the penalties change any logit (else [`Sampler::apply_penalties`] does nothing).
    fn penalties_apply(&self) -> bool {
        let params = &self.params;
        let neutral = params.repeat_penalty == 1.0
            && params.presence_penalty == 0.0
            && params.frequency_penalty == 0.0;
        !neutral && params.penalty_last_n > 0
    }

    /// Applies the penalties to `candidates`, the whole vocabulary in id order (a candidate's index is its id).
    fn apply_penalties(&self, candidates: &mut [(u32, f32)]) {
        let params = &self.params;
        if !self.penalties_apply() {
            return;
        }
        let recent = &self.history[self.history.len().saturating_sub(params.penalty_last_n)..];
        // A map, not a list searched per token: the window comes off the wire (a stage link's `Configure`) and
        // may span a whole context of distinct tokens, which a linear search made quadratic per sampled token.
        // Each token's penalty touches its own candidate once, so the order they are applied in changes nothing.
        let mut counts: HashMap<u32, usize> = HashMap::with_capacity(recent.len().min(4096));
        for &token in recent {
            *counts.entry(token).or_insert(0) += 1;
        }
        for (token, count) in counts {
            let Some(candidate) = candidates.get_mut(token as usize) else {
                continue;
            };
            if candidate.1 <= 0.0 {
                candidate.1 *= params.repeat_penalty;
            } else {
                candidate.1 /= params.repeat_penalty;
            }
            candidate.1 -= count as f32 * params.frequency_penalty + params.presence_penalty;
        }
    }
}

/// Fills `best` with the `count` highest (id, logit) pairs of `logits`, in no particular order, by the order
/// the sampler sorts in (logit, highest first, then the lower id first): one pass that compares each logit with
/// the worst kept so far, on a min-heap of `count`.
fn best_of(logits: &[f32], count: usize, best: &mut Vec<(u32, f32)>) {
    /// A pair ordered by how good it is: the higher logit, then the lower id, is greater.
    #[derive(Clone, Copy, PartialEq)]
    struct Ranked(u32, f32);
    impl Eq for Ranked {}
    impl PartialOrd for Ranked {
        fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Ranked {
        fn cmp(&self, other: &Self) -> std::cmp::Ordering {
            self.1.total_cmp(&other.1).then(other.0.cmp(&self.0))
        }
    }
    let mut kept: BinaryHeap<Reverse<Ranked>> = BinaryHeap::with_capacity(count + 1);
    for (id, &logit) in logits.iter().enumerate() {
        let candidate = Ranked(id as u32, logit);
        if kept.len() < count {
            kept.push(Reverse(candidate));
        } else if let Some(mut worst) = kept.peek_mut()
            && candidate > worst.0
        {
            *worst = Reverse(candidate);
        }
    }
    best.extend(
        kept.into_iter()
            .map(|Reverse(Ranked(id, logit))| (id, logit)),
    );
}

/// The id of the largest logit; the lowest id wins a tie.
fn argmax(candidates: &[(u32, f32)]) -> u32 {
    let mut best = (0, f32::NEG_INFINITY);
    for &(id, logit) in candidates {
        if logit > best.1 {
            best = (id, logit);
        }
    }
    best.0
}

/// Probabilities of `candidates` (sorted, highest first) at `temperature`.
fn softmax(candidates: &[(u32, f32)], temperature: f32) -> Vec<f64> {
    let Some(&(_, top)) = candidates.first() else {
        return Vec::new();
    };
    let weights: Vec<f64> = candidates
        .iter()
        .map(|&(_, logit)| (((logit - top) / temperature) as f64).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    weights.iter().map(|weight| weight / total).collect()
}

/// A small, fast, seedable generator (Steele, Lea and Flood's SplitMix64); good enough for sampling.
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw in `[0, 1)`.
    fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The log-probability of `token` under `logits` and the `count` most likely tokens with theirs (computed in
/// f64 from the raw logits, before sampling's penalties and cuts, as llama-server reports them).
pub fn log_probabilities(logits: &[f32], token: u32, count: u8) -> (f32, Vec<(u32, f32)>) {
    let maximum = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = logits
        .iter()
        .map(|&logit| f64::from(logit - maximum).exp())
        .sum();
    let log_total = total.ln();
    let logprob = |logit: f32| (f64::from(logit - maximum) - log_total) as f32;
    let chosen = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&logit| logprob(logit));
    let mut top = Vec::new();
    if count > 0 {
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        let count = usize::from(count).min(order.len());
        order.select_nth_unstable_by(count.saturating_sub(1), |&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        order.truncate(count);
        order.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        top = order
            .into_iter()
            .map(|id| (id, logprob(logits[id as usize])))
            .collect();
    }
    (chosen, top)
}

/// [`log_probabilities`] when the caller reads them (`logprob`, or `count` alternatives, which bring the
/// chosen token's along); otherwise NaN and no alternatives, without the softmax over the vocabulary that
/// would cost (milliseconds a token on a 262,144-token vocabulary). The one rule for wherever sampling runs:
/// a whole model at stage 0, or a chain's last stage.
pub fn wanted_log_probabilities(
    logits: &[f32],
    token: u32,
    logprob: bool,
    count: u8,
) -> (f32, Vec<(u32, f32)>) {
    if logprob || count > 0 {
        log_probabilities(logits, token, count)
    } else {
        (f32::NAN, Vec::new())
    }
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

    #[test]
    fn log_probabilities_nobody_reads_are_not_computed() {
        let logits = [1.0, 3.0, 2.0];
        let (chosen, top) = wanted_log_probabilities(&logits, 1, false, 0);
        assert!(
            chosen.is_nan() && top.is_empty(),
            "unasked: NaN and no alternatives"
        );
        assert_eq!(
            wanted_log_probabilities(&logits, 1, true, 0),
            log_probabilities(&logits, 1, 0),
            "asked: the full figure"
        );
        assert_eq!(
            wanted_log_probabilities(&logits, 1, false, 2),
            log_probabilities(&logits, 1, 2),
            "alternatives bring the chosen token's log-probability along"
        );
    }

    #[test]
    fn greedy_takes_the_largest_logit_after_penalties() {
        let mut sampler = Sampler::new(SamplingParams {
            repeat_penalty: 2.0,
            ..SamplingParams::default()
        });
        assert_eq!(
            sampler.sample(&[0.0, 3.0, 2.0]),
            1,
            "argmax without history"
        );
        sampler.accept(1);
        assert_eq!(
            sampler.sample(&[0.0, 3.0, 2.0]),
            2,
            "a repeat penalty of 2 should halve token 1's logit below token 2's"
        );
    }

    #[test]
    fn top_k_of_one_is_greedy_at_any_temperature() {
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            seed: 7,
            ..SamplingParams::default()
        });
        for _ in 0..20 {
            assert_eq!(sampler.sample(&[0.5, 0.1, 0.9, 0.2]), 2);
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 42,
            ..SamplingParams::default()
        };
        let logits = [1.0, 1.1, 0.9, 1.05, 0.95];
        let draw = |params: &SamplingParams| {
            let mut sampler = Sampler::new(params.clone());
            (0..32).map(|_| sampler.sample(&logits)).collect::<Vec<_>>()
        };
        let first = draw(&params);
        assert_eq!(first, draw(&params), "same seed, different tokens");
        assert!(
            first.iter().any(|&token| token != first[0]),
            "near-uniform logits at temperature 1 should not always give one token: {first:?}"
        );
        let other = draw(&SamplingParams { seed: 43, ..params });
        assert_ne!(first, other, "a different seed gave the same 32 draws");
    }

    #[test]
    fn min_p_removes_unlikely_tokens() {
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            seed: 1,
            ..SamplingParams::default()
        });
        for _ in 0..50 {
            let token = sampler.sample(&[5.0, 0.0, 4.9, -3.0]);
            assert!(
                token == 0 || token == 2,
                "min-p 0.5 let token {token} through"
            );
        }
    }

    #[test]
    fn presence_and_frequency_penalties_lower_seen_tokens() {
        let mut sampler = Sampler::new(SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        });
        sampler.accept(0);
        sampler.accept(0);
        // Token 0: 2.0 - 2 * 0.5 - 0.5 = 0.5 < 1.0.
        assert_eq!(sampler.sample(&[2.0, 1.0]), 1);
    }

    #[test]
    fn an_empty_vocabulary_draws_token_zero_instead_of_panicking() {
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 0.8,
            min_p: 0.05,
            top_p: 0.9,
            ..SamplingParams::default()
        });
        assert_eq!(sampler.sample(&[]), 0);
    }

    /// The draw as it was written first, sorting the whole vocabulary before the top-k cut: the oracle the faster
    /// selection must equal (the cuts after it and the draw are the sampler's own, shared).
    mod sorted_reference {
        use super::super::*;
        use proptest::prelude::*;

        fn draw_by_full_sort(sampler: &mut Sampler, logits: &[f32]) -> u32 {
            let mut candidates: Vec<(u32, f32)> = logits
                .iter()
                .enumerate()
                .map(|(id, &logit)| (id as u32, logit))
                .collect();
            sampler.apply_penalties(&mut candidates);
            if sampler.params.temperature <= 0.0 {
                return argmax(&candidates);
            }
            candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            if sampler.params.top_k > 0 {
                candidates.truncate(sampler.params.top_k);
            }
            sampler.cut_and_draw(&mut candidates)
        }

        /// Logits with many ties (a few distinct values), as quantised heads and penalties make them.
        fn logits() -> impl Strategy<Value = Vec<f32>> {
            prop::collection::vec(
                prop_oneof![
                    8 => (-8i8..8).prop_map(|step| f32::from(step) * 0.5),
                    8 => -20.0f32..20.0,
                    1 => Just(f32::NEG_INFINITY),
                    1 => Just(f32::INFINITY),
                    1 => Just(f32::NAN),
                    1 => Just(-f32::NAN),
                ],
                1..400,
            )
        }

        fn params() -> impl Strategy<Value = SamplingParams> {
            let cuts = (
                0.0f32..2.0,
                prop_oneof![Just(0usize), 1usize..60, 300usize..500],
                prop_oneof![Just(1.0f32), 0.05f32..1.0],
                prop_oneof![Just(0.0f32), 0.0f32..0.5],
                any::<u64>(),
            );
            // Each penalty off half the time, so the path that keeps the top k in one pass (no penalty at
            // all) and the one that lists the vocabulary (some penalty) are both drawn often.
            let penalties = (
                prop_oneof![Just(1.0f32), 0.5f32..2.0],
                prop_oneof![Just(0.0f32), -2.0f32..2.0],
                prop_oneof![Just(0.0f32), -2.0f32..2.0],
                prop_oneof![Just(64usize), 0usize..8],
            );
            (cuts, penalties).prop_map(
                |(
                    (temperature, top_k, top_p, min_p, seed),
                    (repeat_penalty, presence_penalty, frequency_penalty, penalty_last_n),
                )| SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    seed,
                    repeat_penalty,
                    presence_penalty,
                    frequency_penalty,
                    penalty_last_n,
                },
            )
        }

        proptest! {
            #[test]
            fn selecting_the_top_k_draws_what_sorting_the_vocabulary_draws(
                params in params(),
                steps in prop::collection::vec(logits(), 1..6),
                history in prop::collection::vec(0u32..400, 0..30),
            ) {
                let mut fast = Sampler::new(params.clone());
                let mut reference = Sampler::new(params);
                for &token in &history {
                    fast.accept(token);
                    reference.accept(token);
                }
                for logits in &steps {
                    let expected = draw_by_full_sort(&mut reference, logits);
                    let got = fast.sample(logits);
                    prop_assert_eq!(
                        got,
                        expected,
                        "selecting the top k drew another token than sorting the whole vocabulary"
                    );
                    fast.accept(got);
                    reference.accept(expected);
                }
            }
        }
    }
}
