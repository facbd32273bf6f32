//! Activation rows quantised to 8 bits per value in blocks of 32, with each block's sum carried along.
//!
//! This is ggml's Q8_1 idea in our own layout: one scale per block (`d = max|x| / 127`), the rounded values
//! `round(x / d)` as `i8`, and `d * Σq` so that a weight format with an offset (`w = scale·q + offset`) costs one
//! extra multiply per block instead of a second pass. Values, scales and sums sit in three separate arrays so the
//! SIMD kernels load 32 values with one instruction.
//!
//! The rounding follows ggml's x86 `quantize_row_q8_0` exactly: `q = round_ties_even(x * (127 / max))`, and the
//! scale kept is `d` rounded to f16, because ggml stores it in an f16 field and its products use that rounded
//! value. Keeping `d` in f32 looked more precise but made every product of a Q5_0/Q8_0 weight differ from
//! llama.cpp's by up to 2^-11 relative (a systematic per-block error, not noise); through gemma-3's 18 layers that
//! was enough to flip confident argmaxes against llama.cpp. The sum is `f16(d) * Σq`, exact in f32, which is
//! what ggml's integer `(q - 16)` arithmetic for Q5_0 amounts to.

use super::SimdLevel;
use super::format::BLOCK;

/// Rows of activations quantised to 8 bits in blocks of 32.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QuantizedActivations {
    rows: usize,
    blocks_per_row: usize,
    values: Vec<i8>,
    scales: Vec<f32>,
    sums: Vec<f32>,
}

impl QuantizedActivations {
    /// Quantises `rows` rows of `width` values each (`width` a multiple of 32, `input.len() == rows * width`),
    /// with the fastest code this CPU runs.
    ///
    /// The same input always gives the same bytes: the kernels at every SIMD level then see identical integers.
    pub fn quantize(input: &[f32], rows: usize, width: usize) -> Self {
        Self::quantize_at(SimdLevel::detect(), input, rows, width)
    }

    /// As [`QuantizedActivations::quantize`], compiled for `level` (falling back to portable code when this CPU
    /// lacks it). Every level gives bit-identical results: IEEE rounding of each operation is fixed, the block
    /// maximum and the integer sum do not depend on their order, and rounding to an integer is exact at any
    /// level. Only the speed differs: without SSE4.1 the rounding is a libm call per value.
    pub fn quantize_at(level: SimdLevel, input: &[f32], rows: usize, width: usize) -> Self {
        debug_assert_eq!(
            width % BLOCK,
            0,
            "the width must be a whole number of blocks"
        );
        debug_assert_eq!(
            input.len(),
            rows * width,
            "the input must hold rows * width values"
        );
        let blocks_per_row = width / BLOCK;
        let total_blocks = rows * blocks_per_row;
        let mut values = vec![0i8; total_blocks * BLOCK];
        let mut scales = vec![0f32; total_blocks];
        let mut sums = vec![0f32; total_blocks];
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 | SimdLevel::Avx512Vnni if level.is_available() => {
                // SAFETY: `is_available` checked that the CPU has AVX2 (both levels include it).
                unsafe { quantize_blocks_avx2(input, &mut values, &mut scales, &mut sums) }
            }
            _ => quantize_blocks(input, &mut values, &mut scales, &mut sums),
        }
        Self {
            rows,
            blocks_per_row,
            values,
            scales,
            sums,
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Blocks of 32 per row.
    pub fn blocks_per_row(&self) -> usize {
        self.blocks_per_row
    }

    /// The quantised values of row `row`.
    pub fn row_values(&self, row: usize) -> &[i8] {
        let width = self.blocks_per_row * BLOCK;
        &self.values[row * width..(row + 1) * width]
    }

    /// The per-block scales of row `row`.
    pub fn row_scales(&self, row: usize) -> &[f32] {
        &self.scales[row * self.blocks_per_row..(row + 1) * self.blocks_per_row]
    }

    /// The per-block `scale * Σq` of row `row`.
    pub fn row_sums(&self, row: usize) -> &[f32] {
        &self.sums[row * self.blocks_per_row..(row + 1) * self.blocks_per_row]
    }
}

/// Quantises whole blocks of `input` into `values`, `scales` and `sums` (portable code).
#[inline(always)]
fn quantize_blocks(input: &[f32], values: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
    for (((chunk, block_values), scale), sum) in input
        .chunks_exact(BLOCK)
        .zip(values.chunks_exact_mut(BLOCK))
        .zip(scales.iter_mut())
        .zip(sums.iter_mut())
    {
        let maximum = chunk.iter().fold(0f32, |acc, x| acc.max(x.abs()));
        let d = maximum / 127.0;
        let inverse = if maximum > 0.0 { 127.0 / maximum } else { 0.0 };
        let mut total = 0i32;
        for (value, x) in block_values.iter_mut().zip(chunk) {
            // |x * inverse| <= 127 up to rounding, so the cast never saturates in practice; `as` clamps anyway.
            let q = (x * inverse).round_ties_even() as i8;
            *value = q;
            total += i32::from(q);
        }
        *scale = half::f16::from_f32(d).to_f32();
        *sum = *scale * total as f32;
    }
}

/// [`quantize_blocks`] compiled with AVX2, where `round` becomes a few vector instructions instead of a libm call.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_blocks_avx2(
    input: &[f32],
    values: &mut [i8],
    scales: &mut [f32],
    sums: &mut [f32],
) {
    quantize_blocks(input, values, scales, sums);
}
