//! A block's row-wise ops on plain f32 slices between its products: norms, RoPE, attention, GELU, adds.

use super::{LayerCache, Segment};
use crate::kernels::vector::{dots_f16_heads, weighted_sum_f16_heads};

/// `values += other`, element by element.
pub(super) fn add_in_place(values: &mut [f32], other: &[f32]) {
    debug_assert_eq!(
        values.len(),
        other.len(),
        "a residual add of rows of different shapes"
    );
    values.iter_mut().zip(other).for_each(|(x, &y)| *x += y);
}

/// Segment `segment`'s rows of `all` (`[rows][heads][width]`, every segment's rows in order) as
/// `[heads][segment rows][width]`, the layout RoPE, the cache and attention take.
pub(super) fn heads_first(all: &[f32], heads: usize, width: usize, segment: &Segment) -> Vec<f32> {
    let mut out = Vec::with_capacity(heads * segment.rows * width);
    for head in 0..heads {
        for row in segment.offset..segment.offset + segment.rows {
            let at = (row * heads + head) * width;
            out.extend_from_slice(&all[at..at + width]);
        }
    }
    out
}

/// Which elements of a head RoPE rotates together.
#[derive(Clone, Copy)]
pub(super) enum RopePairing {
    /// Elements `2i` and `2i + 1` (llama).
    Adjacent,
    /// Elements `i` and `i + width / 2` (NeoX style, gemma).
    Halves,
}

/// Rotates `data` (`[heads][rows][width]`) by the angles of `cos`/`sin` (`[rows][width / 2]`):
/// `(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)`, the first product fused with the sum of the other, rounded
/// one, as ggml's compiled kernel evaluates it (checked bit for bit against llama.cpp's gemma-3 tensors).
pub(super) fn rotate_rows(
    data: &mut [f32],
    rows: usize,
    width: usize,
    cos: &[f32],
    sin: &[f32],
    pairing: RopePairing,
) {
    let half = width / 2;
    let rotate = |index: usize, head_row: &mut [f32]| {
        let row = index % rows;
        let (cos, sin) = (&cos[row * half..][..half], &sin[row * half..][..half]);
        for pair in 0..half {
            let (first, second) = match pairing {
                RopePairing::Adjacent => (2 * pair, 2 * pair + 1),
                RopePairing::Halves => (pair, pair + half),
            };
            let (x0, x1) = (head_row[first], head_row[second]);
            // In f64 the product x0 * cos is exact, so one rounding to f32 gives the fused result (double
            // rounding could differ in a one-in-billions tie; it matched every element of llama.cpp's tensors)
            // while staying a plain vectorisable multiply-add instead of a libm `fmaf` call on targets
            // without FMA.
            let (c, s) = (f64::from(cos[pair]), f64::from(sin[pair]));
            head_row[first] = (f64::from(x0) * c - f64::from(x1 * sin[pair])) as f32;
            head_row[second] = (f64::from(x0) * s + f64::from(x1 * cos[pair])) as f32;
        }
    };
    if rows == 0 || width == 0 {
        return;
    }
    if data.len() >= PARALLEL_ROW_WORK {
        crate::kernels::ComputePool::global().for_each_chunk_mut(data, width, rotate);
    } else {
        data.chunks_exact_mut(width)
            .enumerate()
            .for_each(|(index, head_row)| rotate(index, head_row));
    }
}

/// How the attention scale is applied: gemma scales the queries before the product, llama the scores after.
#[derive(Clone, Copy)]
pub(super) struct AttentionScale {
    pub(super) query: f32,
    pub(super) score: f32,
}

/// Causal (and, for sliding-window layers, windowed) attention of every segment's rows over its own lane's
/// cache (`caches[i]` for `segments[i]`), written into `output` as `[rows][heads * width]` for the rows of all
/// segments in order. `queries[i]` is segment `i`'s `[heads][rows][width]`.
///
/// Each output row is computed on its own, over exactly the keys it can see, in a fixed order of operations:
/// an 8-lane dot product per score, the softmax in f32 with unnormalised weights summed in key order, the
/// weighted values accumulated in key order and divided by that sum at the end (as llama.cpp's flash-attention
/// kernel does). So a row's result does not depend on the chunk it came in, on the other lanes of its batch, on
/// how much the cache holds, or on the thread that ran it: chunked prefill, decode, batches, split stages and
/// the bounded sliding-window cache all give the same bits.
pub(super) fn attend(
    queries: &[Vec<f32>],
    segments: &[Segment],
    heads: usize,
    caches: &[&LayerCache],
    scale: AttentionScale,
    output: &mut [f32],
) {
    let Some(width) = caches.first().map(|cache| cache.width) else {
        return;
    };
    // The segment of each output row, so a head-row index finds its query and cache.
    let owners: Vec<usize> = segments
        .iter()
        .enumerate()
        .flat_map(|(index, segment)| std::iter::repeat_n(index, segment.rows))
        .collect();
    let work: usize = segments
        .iter()
        .zip(caches)
        .map(|(segment, cache)| {
            let end = segment.position + segment.rows;
            segment.rows * heads * (end - cache.first_visible(segment.position)) * width
        })
        .sum();
    let parallel = work >= PARALLEL_ATTENTION_WORK;
    // The query heads that share a key head (grouped-query attention) run as one unit: each key and value row
    // is widened once for all of them, and their outputs sit side by side in the output row. Where that leaves
    // too few units to share among the pool's threads (gemma-3 has one key head: a decode row would be one
    // unit), each query head is a unit of its own, as before the grouping.
    let kv_heads = caches[0].kv_heads;
    let group = heads / kv_heads;
    let unit_heads = if parallel && owners.len() * kv_heads < MIN_GROUPED_UNITS {
        1
    } else {
        group
    };
    let units_per_row = heads / unit_heads;
    let run = |index: usize, out: &mut [f32]| {
        let (global_row, unit) = (index / units_per_row, index % units_per_row);
        let first_head = unit * unit_heads;
        let kv_head = first_head / group;
        let owner = owners[global_row];
        let (segment, cache, query) = (&segments[owner], caches[owner], &queries[owner]);
        let row = global_row - segment.offset;
        let query_position = segment.position + row;
        let keys_seen = cache.first_visible(query_position)..query_position + 1;
        let keys = cache.keys(kv_head, keys_seen.clone());
        let values = cache.values(kv_head, keys_seen);
        let mut scaled = Vec::with_capacity(unit_heads * width);
        for head in first_head..first_head + unit_heads {
            scaled.extend_from_slice(&query[(head * segment.rows + row) * width..][..width]);
        }
        if scale.query != 1.0 {
            scaled.iter_mut().for_each(|value| *value *= scale.query);
        }
        let count = keys.len() / width;
        let mut weights = vec![0f32; unit_heads * count];
        dots_f16_heads(&scaled, width, keys, &mut weights);
        if scale.score != 1.0 {
            weights.iter_mut().for_each(|weight| *weight *= scale.score);
        }
        let mut sums = vec![0f32; unit_heads];
        for (head_weights, sum) in weights.chunks_exact_mut(count.max(1)).zip(sums.iter_mut()) {
            let maximum = head_weights
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            for weight in head_weights.iter_mut() {
                *weight = (*weight - maximum).exp();
                *sum += *weight;
            }
        }
        weighted_sum_f16_heads(out, width, &weights, values);
        for (head_out, sum) in out.chunks_exact_mut(width).zip(sums.iter()) {
            let inverse = 1.0 / sum;
            head_out.iter_mut().for_each(|value| *value *= inverse);
        }
    };
    let output = &mut output[..owners.len() * heads * width];
    if parallel {
        crate::kernels::ComputePool::global().for_each_chunk_mut(output, unit_heads * width, run);
    } else {
        output
            .chunks_mut(unit_heads * width)
            .enumerate()
            .for_each(|(index, out)| run(index, out));
    }
}

/// Below this many multiply-adds attention runs on the calling thread (a decode step at a short context).
/// With the compute pool's workers spinning inside a pass, handing head-rows out costs little more than a
/// product's dispatch: at 1 << 20 a decode step after a 512-token prompt ran its attention on one thread
/// (SmolLM2 97.0 against 103.1 tok/s split, gemma-3 49.5 against 57.9; 4 interleaved rounds).
pub(super) const PARALLEL_ATTENTION_WORK: usize = 1 << 16;

/// Below this many units of grouped heads a parallel attention runs each query head as its own unit: a pool of
/// two threads (and its caller) takes chunks of several units each, so a handful would leave a thread idle.
const MIN_GROUPED_UNITS: usize = 8;

/// Below this many values a row-wise op (norm, RoPE) runs on the calling thread: a few rows of a decode
/// step cost less than handing them to the pool.
pub(super) const PARALLEL_ROW_WORK: usize = 64 * 1024;

/// The RMS norm of each `weight.len()`-wide row of `data`, in place, times `weight`, computed as ggml does:
/// squares summed in f64, the scale `1 / sqrt(mean + epsilon)` in f32, then `x * scale * weight`.
///
/// Why not candle's: it sums in f32 and divides by the root, which differs in the last bit now and then. The
/// 8-bit activation quantisation that follows turns such a bit into a whole quantisation step when a value sits
/// on a rounding tie, and ties are common in gemma-3's first layer (its embeddings are Q8_0 values, so the
/// normed rows are small multiples of one step): those flips moved its logits by tenths against llama.cpp.
pub(super) fn rms_norm_rows(data: &mut [f32], weight: &[f32], epsilon: f32) {
    let width = weight.len();
    if width == 0 {
        return;
    }
    // Each row on its own, in place: the same operations in the same order whichever thread takes it.
    let normalise = |row: &mut [f32]| {
        let sum: f64 = row.iter().map(|&x| f64::from(x * x)).sum();
        let mean = (sum / width as f64) as f32;
        let scale = 1.0 / (mean + epsilon).sqrt();
        row.iter_mut()
            .zip(weight)
            .for_each(|(x, &w)| *x = *x * scale * w);
    };
    if data.len() >= PARALLEL_ROW_WORK {
        crate::kernels::ComputePool::global()
            .for_each_chunk_mut(data, width, |_, row| normalise(row));
    } else {
        data.chunks_exact_mut(width).for_each(normalise);
    }
}

/// GELU (tanh form) as llama.cpp's CPU backend computes it: 0 at or below -10, the identity at or above 10, and
/// in between a table indexed by the input rounded to f16 (see [`gelu_table`]).
///
/// Checked against llama.cpp's `ffn_geglu` tensors for gemma-3: this matches every element bit for bit, where
/// candle's `gelu` on f16-rounded input (what we had) differed in about 1 element in 6000 by an f16 step.
pub(super) fn gelu_as_ggml_in_place(values: &mut [f32]) {
    let table = gelu_table();
    for x in values {
        *x = if *x <= -10.0 {
            0.0
        } else if *x >= 10.0 {
            *x
        } else {
            table[usize::from(half::f16::from_f32(*x).to_bits())]
        };
    }
}

/// GELU of every f16 value, rounded to f16 (held as f32): `0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))`
/// in f32 with the inner `1 + 0.044715 x * x` as one fused multiply-add, which is how the compiler builds
/// ggml's table. 256 KB, computed once per process.
pub(super) fn gelu_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        const CUBIC: f32 = 0.044_715;
        (0..=u16::MAX)
            .map(|bits| {
                let x = half::f16::from_bits(bits).to_f32();
                let inner = (CUBIC * x).mul_add(x, 1.0);
                let y = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh());
                half::f16::from_f32(y).to_f32()
            })
            .collect()
    })
}
