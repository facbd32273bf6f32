//! The portable kernel: reads each packed block back to integers and takes integer dot products, no SIMD.
//!
//! It computes exactly what the SIMD kernels compute, so it is both the fallback on machines without AVX2 and a
//! readable statement of the algorithm. Per output element, a block's 32 products are summed as one exact integer
//! (one per half of 16 for Q6_K, whose halves have scales of their own), converted once, and, blocks in order,
//!
//! ```text
//!   sum    = fma(w_scale · x_scale, Σ_32 q·x, sum)
//!            (Q6_K: the same for weights 0..16 with w_scale[0], then for 16..32 with w_scale[1])
//!   offset = fma(w_minimum, x_scale · Σx, offset)            (formats with a minimum)
//!   result = sum + offset
//! ```
//!
//! With wide activations (a residual byte `r` per value, `activation.rs`) the integer is `Σ_32 q·(128·x + r)` and
//! its factor `w_scale · x_scale · (1/128)`; the offset's sums cover the whole values.
//!
//! The integer is exact (|q| <= 128, |x| <= 127, 32 of them: far inside an i32, and inside f32's 24 bits), so a
//! block costs one rounding. llama.cpp's x86 dot products (`ggml_vec_dot_q4_1_q8_1` and its siblings) keep eight
//! partial sums of four per block and round each into its own float lane; we kept that order until session 26, for
//! our products to stay within a few units in the last place of llama.cpp's, since gemma-3 amplified any other
//! order into argmax flips at positions llama.cpp calls confident. gemma-3's products are now all wide (and so
//! nearer the exact forward than llama.cpp's by three orders of magnitude, `tests/exact_reference.rs`), and the
//! eight conversions and multiply-adds per block were most of a batched product's float work: the prefill of 128
//! rows of SmolLM2's `ffn_up` went from 0.39-0.43 ms to 0.31-0.32 ms with this order (`docs/PERFORMANCE.md`).

use std::ops::Range;

use super::Output;
use super::activation::{QuantizedActivations, RESIDUAL_STEP, WIDE_FACTOR};
use super::format::BLOCK;
use super::packed::{GROUP, PackedWeights};

/// Writes `output[x * out_features + o]` for every weight row `o` of the groups `groups` and every activation row.
pub(super) fn matmul_groups(
    weights: &PackedWeights,
    activations: &QuantizedActivations,
    groups: Range<usize>,
    output: &Output<'_>,
) {
    let blocks = activations.blocks_per_row();
    let has_minimums = weights.format().has_offsets();
    let half_scales = weights.format().has_half_scales();
    let mut q = [0i32; BLOCK];
    let rows = groups.start * GROUP..(groups.end * GROUP).min(weights.rows());
    for row in rows {
        for x in 0..activations.rows() {
            let values = activations.row_values(x);
            let residuals = activations.row_residuals(x);
            let scales = activations.row_scales(x);
            let sums = activations.row_sums(x);
            let mut total = 0f32;
            let mut offsets = 0f32;
            for block in 0..blocks {
                let scaling = weights.block(row, block, &mut q);
                let x_values = &values[block * BLOCK..(block + 1) * BLOCK];
                let x_residuals = if residuals.is_empty() {
                    &[][..]
                } else {
                    &residuals[block * BLOCK..(block + 1) * BLOCK]
                };
                let factors = scaling.scales.map(|scale| {
                    let factor = scale * scales[block];
                    if x_residuals.is_empty() {
                        factor
                    } else {
                        factor * RESIDUAL_STEP
                    }
                });
                // |q| <= 128 and |128·x + r| < 2^14: 32 of them stay far inside an i32.
                let exact = |range: Range<usize>| -> i32 {
                    range
                        .map(|j| {
                            let x = i32::from(x_values[j]);
                            match x_residuals.get(j) {
                                Some(&r) => q[j] * (WIDE_FACTOR * x + i32::from(r)),
                                None => q[j] * x,
                            }
                        })
                        .sum()
                };
                if half_scales {
                    for (half, factor) in factors.iter().enumerate() {
                        let integer = exact(16 * half..16 * half + 16);
                        total = factor.mul_add(integer as f32, total);
                    }
                } else {
                    total = factors[0].mul_add(exact(0..BLOCK) as f32, total);
                }
                if has_minimums {
                    offsets = scaling.offset.mul_add(sums[block], offsets);
                }
            }
            let result = total + offsets;
            output.write(x, row, result);
        }
    }
}
