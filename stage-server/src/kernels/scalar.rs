//! The portable kernel: reads each packed block back to integers and takes integer dot products, no SIMD.
//!
//! It computes exactly what the SIMD kernels compute, so it is both the fallback on machines without AVX2 and a
//! readable statement of the algorithm. Per output element, a block's 32 products are summed as eight exact
//! integer partial sums of four (`partial[l]` covers weights `4l..4l+4`, one 32-bit lane of ggml's x86 kernels),
//! and, blocks in order,
//!
//! ```text
//!   sum[l] = fma(w_scale[l / 4] · x_scale, partial[l], sum[l])      for l in 0..8
//!   offset = fma(w_minimum, x_scale · Σx, offset)            (formats with a minimum)
//!   result = ((sum[0] + sum[4]) + (sum[2] + sum[6])) + ((sum[1] + sum[5]) + (sum[3] + sum[7])) + offset
//! ```
//!
//! which is the order of operations of llama.cpp's x86 dot products (`ggml_vec_dot_q4_1_q8_1` and its siblings:
//! eight float lanes, one FMA per block, a fixed horizontal sum). Keeping it keeps our products within a few
//! units in the last place of llama.cpp's: gemma-3 amplifies any other order into argmax flips at positions
//! llama.cpp calls confident (a single sum per element, tried, flipped two in the agreement fixtures).
//!
//! (`w_scale[0]` covers a block's weights 0..16 and `w_scale[1]` weights 16..32: the same number but for Q6_K,
//! whose sub-blocks of 16 have scales of their own.)
//!
//! With wide activations (a residual byte `r` per value, `activation.rs`, for the output head) a block is one
//! exact integer instead of eight partials, or one per half for Q6_K:
//!
//! ```text
//!   sum    = fma(w_scale · x_scale · (1/128), Σ_32 q·(128·x + r), sum)   blocks in order
//!            (Q6_K: the same for weights 0..16 with w_scale[0], then for 16..32 with w_scale[1])
//!   offset as above (its sums cover the whole values)
//!   result = sum + offset
//! ```
//!
//! ggml has no such path, so its order is ours to choose; one conversion per block instead of eight pays for the
//! second integer product.

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
            let mut lanes = [0f32; 8];
            let mut offsets = 0f32;
            let mut wide = 0f32;
            for block in 0..blocks {
                let scaling = weights.block(row, block, &mut q);
                let x_values = &values[block * BLOCK..(block + 1) * BLOCK];
                let factors = scaling.scales.map(|scale| scale * scales[block]);
                if residuals.is_empty() {
                    for (lane, sum) in lanes.iter_mut().enumerate() {
                        let partial: i32 = (4 * lane..4 * lane + 4)
                            .map(|j| q[j] * i32::from(x_values[j]))
                            .sum();
                        *sum = factors[lane / 4].mul_add(partial as f32, *sum);
                    }
                } else {
                    let x_residuals = &residuals[block * BLOCK..(block + 1) * BLOCK];
                    // |q| <= 128 and |128·x + r| < 2^14: 32 of them stay far inside an i32.
                    let exact = |range: Range<usize>| -> i32 {
                        range
                            .map(|j| {
                                q[j] * (WIDE_FACTOR * i32::from(x_values[j])
                                    + i32::from(x_residuals[j]))
                            })
                            .sum()
                    };
                    if half_scales {
                        for (half, factor) in factors.iter().enumerate() {
                            let integer = exact(16 * half..16 * half + 16);
                            wide = (factor * RESIDUAL_STEP).mul_add(integer as f32, wide);
                        }
                    } else {
                        wide = (factors[0] * RESIDUAL_STEP).mul_add(exact(0..BLOCK) as f32, wide);
                    }
                }
                if has_minimums {
                    offsets = scaling.offset.mul_add(sums[block], offsets);
                }
            }
            let result = if residuals.is_empty() {
                let total = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
                    + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
                total + offsets
            } else {
                wide + offsets
            };
            output.write(x, row, result);
        }
    }
}
