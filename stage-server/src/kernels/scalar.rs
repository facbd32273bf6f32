//! The portable kernel: decodes each weight block to integers and takes integer dot products, no SIMD.
//!
//! It computes exactly what the SIMD kernels compute (the same integer sums, the same per-block scaling), so it is
//! both the fallback on machines without AVX2 and a readable statement of the algorithm.

use super::activation::QuantizedActivations;
use super::format::{BLOCK, WeightFormat};
use super::{Output, RowRange};

/// Writes `output[x * out_features + o]` for every weight row `o` in `rows` and every activation row `x`.
pub(super) fn matmul_rows(
    format: WeightFormat,
    weights: &[u8],
    activations: &QuantizedActivations,
    rows: RowRange,
    output: &Output<'_>,
) {
    let blocks = activations.blocks_per_row();
    let row_bytes = blocks * format.block_bytes();
    let mut q = [0i32; BLOCK];
    for row in rows.start..rows.end {
        let weight_row = &weights[row * row_bytes..(row + 1) * row_bytes];
        for x in 0..activations.rows() {
            let values = activations.row_values(x);
            let scales = activations.row_scales(x);
            let sums = activations.row_sums(x);
            let mut total = 0f32;
            let mut offsets = 0f32;
            for (block_index, block) in weight_row.chunks_exact(format.block_bytes()).enumerate() {
                let (scale, offset) = format.decode_block(block, &mut q);
                let x_values = &values[block_index * BLOCK..(block_index + 1) * BLOCK];
                let dot: i32 = q.iter().zip(x_values).map(|(w, x)| w * i32::from(*x)).sum();
                total += scale * scales[block_index] * dot as f32;
                offsets += offset * sums[block_index];
            }
            output.write(x, row, total + offsets);
        }
    }
}
