//! Activation rows quantised to 8 bits per value, or about 15 with a residual byte, in blocks of 32.
//!
//! This is ggml's Q8_1 idea in our own layout: one scale per block (`d = max|x| / 127`), the rounded values
//! `round(x / d)` as `i8`, and `d * Σq` so that a weight format with an offset (`w = scale·q + offset`) costs one
//! extra multiply per block instead of a second pass, and the integer sum of each half of 16 values, which the
//! packed kernels subtract `centre` times from an unsigned weight's product. Values, scales, sums and half sums sit
//! in separate arrays so the SIMD kernels load 32 values with one instruction.
//!
//! The rounding follows ggml's x86 `quantize_row_q8_0` exactly: `q = round_ties_even(x * (127 / max))`, and the
//! scale kept is `d` rounded to f16, because ggml stores it in an f16 field and its products use that rounded
//! value. Keeping `d` in f32 looked more precise but made every product of a Q5_0/Q8_0 weight differ from
//! llama.cpp's by up to 2^-11 relative (a systematic per-block error, not noise); through gemma-3's 18 layers that
//! was enough to flip confident argmaxes against llama.cpp. The sum is `f16(d) * Σq`, exact in f32, which is
//! what ggml's integer `(q - 16)` arithmetic for Q5_0 amounts to.
//!
//! [`QuantizedActivations::quantize_wide`] carries a second byte per value: the rounding error of the first,
//! quantised again on a step of `d / 128`. A value is then `(128·q + r) · d/128`, about 15 bits where the first
//! byte alone is 8. The kernels take, per row and block, the exact integer `Σ w·(128·q + r)` from two integer
//! products (first bytes, residual bytes) and scale it once by `d / 128` (once per half for Q6_K), as they take
//! `Σ w·q` of an 8-bit row and scale it by `d`. ggml quantises every product's activations to 8 bits, and that
//! rounding is nearly all of the distance from its logits (and ours) to the exact forward
//! (`tests/exact_reference.rs`). Every output head takes wide activations
//! (the last product: no later layer amplifies a change of summation order), and so does every gemma-3 product,
//! which puts its logits within 2e-6 KL of the exact forward (`model::stage::block_precision`).

use super::SimdLevel;
use super::format::BLOCK;

/// The weight of the first byte against the residual byte in a wide quantisation: a value is
/// `(WIDE_FACTOR · value + residual) · scale / WIDE_FACTOR`. A power of two, so the residual's step `d / 128` is
/// exact.
pub const WIDE_FACTOR: i32 = 128;

/// A residual byte's step over the first byte's, `1 / WIDE_FACTOR`: the kernels scale a block's exact integer by
/// `w_scale · d · RESIDUAL_STEP` (exact, a power of two).
pub(super) const RESIDUAL_STEP: f32 = 1.0 / WIDE_FACTOR as f32;

/// Rows of activations quantised to 8 bits in blocks of 32 (or about 15, [`QuantizedActivations::quantize_wide`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QuantizedActivations {
    rows: usize,
    blocks_per_row: usize,
    values: Vec<i8>,
    /// Empty, or one residual byte per value (a wide quantisation).
    residuals: Vec<i8>,
    /// The integer sum of each half of 16 values of each block, two per block: `Σq`, or `Σ(128·q + r)` for a
    /// wide quantisation.
    half_sums: Vec<i32>,
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
        let mut half_sums = vec![0i32; 2 * total_blocks];
        let mut parts = Parts {
            values: &mut values,
            scales: &mut scales,
            sums: &mut sums,
            half_sums: &mut half_sums,
        };
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 | SimdLevel::Avx512Vnni if level.is_available() => {
                // SAFETY: `is_available` checked that the CPU has AVX2 (both levels include it).
                unsafe { quantize_blocks_avx2(input, &mut parts) }
            }
            _ => quantize_blocks(input, &mut parts),
        }
        Self {
            rows,
            blocks_per_row,
            values,
            residuals: Vec::new(),
            half_sums,
            scales,
            sums,
        }
    }

    /// Quantises as [`QuantizedActivations::quantize`], then quantises each value's rounding error `x - d·q` again
    /// on a step of `d / 128` into a residual byte, both with this CPU's fastest code.
    ///
    /// The first bytes and scales stay as they are; the sums become `d/128 · Σ(128·q + r)` (the whole value's sum,
    /// for the minimum of a Q4_1, Q5_1, Q4_K or Q5_K weight), and the half sums the integer `Σ(128·q + r)` of each
    /// half of 16 values (for the centre of an unsigned weight; Q6_K scales its halves apart). The residual is at
    /// most about `0.56·d` (`d` is rounded to f16 after `q` was), so it fits in `±72` steps, except in a block whose `d` is an f16 subnormal (largest value
    /// below about 8e-3), where rounding `d` moves it by more than 2^-11: there the clamp to `±127` holds it, and
    /// such a block is held less finely (a normalised head input has none). An infinite or NaN value gives a
    /// residual of 0, as it gives its first byte whatever `as i8` makes of it.
    pub fn quantize_wide(input: &[f32], rows: usize, width: usize) -> Self {
        Self::quantize_wide_at(SimdLevel::detect(), input, rows, width)
    }

    /// As [`QuantizedActivations::quantize_wide`], compiled for `level`; bit-identical at every level.
    pub fn quantize_wide_at(level: SimdLevel, input: &[f32], rows: usize, width: usize) -> Self {
        let mut wide = Self::quantize_at(level, input, rows, width);
        let mut residuals = vec![0i8; wide.values.len()];
        // Decided once per quantisation, not per block (`is_available` reads the detected features).
        let vector =
            matches!(level, SimdLevel::Avx2 | SimdLevel::Avx512Vnni) && level.is_available();
        for (block, chunk) in input.chunks_exact(BLOCK).enumerate() {
            let d = wide.scales[block];
            let values = &wide.values[block * BLOCK..(block + 1) * BLOCK];
            let block_residuals = &mut residuals[block * BLOCK..(block + 1) * BLOCK];
            let halves = if vector {
                // SAFETY: `vector` is set only where `is_available` found AVX2 (both levels include it).
                unsafe { residual_block_vector(chunk, values, d, block_residuals) }
            } else {
                residual_block(chunk, values, d, block_residuals)
            };
            wide.sums[block] = d / WIDE_FACTOR as f32 * (halves[0] + halves[1]) as f32;
            wide.half_sums[2 * block..2 * block + 2].copy_from_slice(&halves);
        }
        wide.residuals = residuals;
        wide
    }

    /// Whether the rows carry residual bytes ([`QuantizedActivations::quantize_wide`]).
    pub fn is_wide(&self) -> bool {
        !self.residuals.is_empty()
    }

    /// The residual bytes of row `row` of a wide quantisation; empty for an 8-bit one.
    pub fn row_residuals(&self, row: usize) -> &[i8] {
        if self.residuals.is_empty() {
            return &[];
        }
        let width = self.blocks_per_row * BLOCK;
        &self.residuals[row * width..(row + 1) * width]
    }

    /// The integer sums of the two halves of 16 values of each block in row `row`, two per block: `Σq`, or
    /// `Σ(128·q + r)` for a wide quantisation. The kernels multiply an unsigned stored weight `v = w + centre` and
    /// subtract `centre` times a sum to get the centred weight's product, exactly.
    pub fn row_half_sums(&self, row: usize) -> &[i32] {
        &self.half_sums[2 * row * self.blocks_per_row..2 * (row + 1) * self.blocks_per_row]
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

    /// The per-block scales `d` of row `row` (the first bytes' step; a residual's is `d / 128`).
    pub fn row_scales(&self, row: usize) -> &[f32] {
        &self.scales[row * self.blocks_per_row..(row + 1) * self.blocks_per_row]
    }

    /// The per-block `scale * Σq` of row `row` (`scale/128 · Σ(128·q + r)` for a wide quantisation).
    pub fn row_sums(&self, row: usize) -> &[f32] {
        &self.sums[row * self.blocks_per_row..(row + 1) * self.blocks_per_row]
    }
}

/// Quantises the rounding errors `x - d·q` of one block (`chunk`, its first bytes `values`, its scale `d`) on a step
/// of `d / 128` into `residuals`, and returns each half's `Σ(128·q + r)` (portable code).
#[inline(always)]
fn residual_block(chunk: &[f32], values: &[i8], d: f32, residuals: &mut [i8]) -> [i32; 2] {
    let step = d / WIDE_FACTOR as f32;
    let mut halves = [0i32; 2];
    for (j, ((residual, &x), &value)) in residuals.iter_mut().zip(chunk).zip(values).enumerate() {
        if step > 0.0 {
            let error = x - d * f32::from(value);
            // NaN (from an infinite x) casts to 0; a finite error is within ±72 steps but in a block whose
            // scale is an f16 subnormal (`quantize_wide`), which the clamp holds.
            *residual = (error / step).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
        halves[j / 16] += WIDE_FACTOR * i32::from(value) + i32::from(*residual);
    }
    halves
}

/// [`residual_block_avx2`] where it exists, else the portable code.
///
/// # Safety
/// On x86-64 the CPU must support AVX2.
#[inline(always)]
unsafe fn residual_block_vector(
    chunk: &[f32],
    values: &[i8],
    d: f32,
    residuals: &mut [i8],
) -> [i32; 2] {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: forwarded from this function's contract.
        unsafe { residual_block_avx2(chunk, values, d, residuals) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        residual_block(chunk, values, d, residuals)
    }
}

/// [`residual_block`] on AVX2 registers, the same operations per value (`x - d·q`, a division by the step, rounding
/// half to even, the clamp), so the same bytes; a block with an infinite or NaN value, or whose scale is not a
/// positive finite number, goes to the portable code (where NaN turns into 0, which the vector conversion does
/// not do). Compiled from the portable code, its libm rounding calls took a fifth of a SmolLM2 prefill whose every
/// product was wide.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn residual_block_avx2(
    chunk: &[f32],
    values: &[i8],
    d: f32,
    residuals: &mut [i8],
) -> [i32; 2] {
    use std::arch::x86_64::*;
    assert!(
        chunk.len() == BLOCK && values.len() == BLOCK && residuals.len() == BLOCK,
        "a residual block is 32 values, 32 first bytes and 32 residual bytes"
    );
    let step = d / WIDE_FACTOR as f32;
    // SAFETY: `chunk` holds 32 floats (asserted); unaligned loads.
    let lines: [__m256; 4] =
        std::array::from_fn(|i| unsafe { _mm256_loadu_ps(chunk.as_ptr().add(8 * i)) });
    let magnitude = _mm256_set1_ps(f32::INFINITY);
    let sign = _mm256_set1_ps(-0.0);
    let not_finite = lines
        .iter()
        .map(|&line| {
            _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(
                _mm256_andnot_ps(sign, line),
                magnitude,
            ))
        })
        .fold(0, |any, mask| any | mask);
    if not_finite != 0 || !(step > 0.0 && d.is_finite()) {
        return residual_block(chunk, values, d, residuals);
    }
    // SAFETY: `values` holds 32 bytes (asserted): four loads of 8.
    let firsts: [__m256i; 4] = std::array::from_fn(|i| unsafe {
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(values.as_ptr().add(8 * i) as *const __m128i))
    });
    let (scale, divisor) = (_mm256_set1_ps(d), _mm256_set1_ps(step));
    let (low, high) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let seconds: [__m256i; 4] = std::array::from_fn(|i| {
        let error = _mm256_sub_ps(
            lines[i],
            _mm256_mul_ps(scale, _mm256_cvtepi32_ps(firsts[i])),
        );
        let rounded = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_div_ps(error, divisor),
        );
        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, low), high))
    });
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(
            _mm256_packs_epi32(seconds[0], seconds[1]),
            _mm256_packs_epi32(seconds[2], seconds[3]),
        ),
        order,
    );
    // SAFETY: `residuals` holds 32 bytes (asserted).
    unsafe { _mm256_storeu_si256(residuals.as_mut_ptr() as *mut __m256i, bytes) };
    const _: () = assert!(
        WIDE_FACTOR == 1 << 7,
        "the shift below multiplies by the wide factor"
    );
    let whole = |i: usize| _mm256_add_epi32(_mm256_slli_epi32::<7>(firsts[i]), seconds[i]);
    let sum = |vector: __m256i| {
        let half = _mm_add_epi32(
            _mm256_castsi256_si128(vector),
            _mm256_extracti128_si256(vector, 1),
        );
        let pair = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
        _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32(pair, 0b01)))
    };
    [
        sum(_mm256_add_epi32(whole(0), whole(1))),
        sum(_mm256_add_epi32(whole(2), whole(3))),
    ]
}

/// The arrays one quantisation fills.
struct Parts<'a> {
    values: &'a mut [i8],
    scales: &'a mut [f32],
    sums: &'a mut [f32],
    half_sums: &'a mut [i32],
}

/// Quantises whole blocks of `input` into `values`, `scales`, `sums` and `half_sums` (portable code).
#[inline(always)]
fn quantize_blocks(input: &[f32], parts: &mut Parts<'_>) {
    for ((((chunk, block_values), scale), sum), block_halves) in input
        .chunks_exact(BLOCK)
        .zip(parts.values.chunks_exact_mut(BLOCK))
        .zip(parts.scales.iter_mut())
        .zip(parts.sums.iter_mut())
        .zip(parts.half_sums.chunks_exact_mut(2))
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
        for (half, values) in block_halves.iter_mut().zip(block_values.chunks_exact(16)) {
            *half = values.iter().map(|&value| i32::from(value)).sum();
        }
    }
}

/// Quantises block `block` alone with the portable code (`chunk` is its input).
#[cfg(target_arch = "x86_64")]
fn quantize_one_block(chunk: &[f32], parts: &mut Parts<'_>, block: usize) {
    let mut one = Parts {
        values: &mut parts.values[block * BLOCK..(block + 1) * BLOCK],
        scales: &mut parts.scales[block..block + 1],
        sums: &mut parts.sums[block..block + 1],
        half_sums: &mut parts.half_sums[2 * block..2 * block + 2],
    };
    quantize_blocks(chunk, &mut one);
}

/// [`quantize_blocks`] on AVX2 registers: a block's 32 values are four registers, its maximum one reduction, its
/// rounding one instruction per eight values, its bytes and half sums a few instructions each. The operations per
/// value are the portable code's (`x * inverse`, rounded half to even), so the bytes are the same; a block holding
/// an infinity or a NaN (a NaN is ordered differently by `max`), or values so small that `127 / max` overflows,
/// where the two would differ, goes to the portable code.
///
/// Each product quantises its input again (up to 121 times per SmolLM2 decode step), all on the calling thread:
/// compiled from the portable code this took 5% of a 4-lane step's samples.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_blocks_avx2(input: &[f32], parts: &mut Parts<'_>) {
    use std::arch::x86_64::*;
    let blocks = parts.scales.len();
    debug_assert!(input.len() >= blocks * BLOCK && parts.values.len() >= blocks * BLOCK);
    let sign = _mm256_set1_ps(-0.0);
    let infinity = _mm256_set1_ps(f32::INFINITY);
    let one_bytes = _mm256_set1_epi8(1);
    let one_words = _mm256_set1_epi16(1);
    // `packs` interleaves the 128-bit halves; this puts the 32 bytes back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for block in 0..blocks {
        let chunk = &input[block * BLOCK..(block + 1) * BLOCK];
        // SAFETY: `chunk` holds 32 floats; unaligned loads.
        let lines: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(chunk.as_ptr().add(8 * i)) });
        let magnitudes = lines.map(|line| _mm256_andnot_ps(sign, line));
        let not_finite = magnitudes
            .iter()
            .map(|&magnitude| _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(magnitude, infinity)))
            .fold(0, |any, mask| any | mask);
        if not_finite != 0 {
            quantize_one_block(chunk, parts, block);
            continue;
        }
        let widest = _mm256_max_ps(
            _mm256_max_ps(magnitudes[0], magnitudes[1]),
            _mm256_max_ps(magnitudes[2], magnitudes[3]),
        );
        let half = _mm_max_ps(
            _mm256_castps256_ps128(widest),
            _mm256_extractf128_ps(widest, 1),
        );
        let pair = _mm_max_ps(half, _mm_movehl_ps(half, half));
        let maximum = _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
        let d = maximum / 127.0;
        let inverse = if maximum > 0.0 { 127.0 / maximum } else { 0.0 };
        if inverse.is_infinite() {
            // A block of values below 127 / f32::MAX: the portable code's `as i8` turns `x * inf` into 127, -128
            // or 0 (NaN), where the vector conversion gives -128 for all three.
            quantize_one_block(chunk, parts, block);
            continue;
        }
        let factor = _mm256_set1_ps(inverse);
        let integers = lines.map(|line| {
            _mm256_cvtps_epi32(_mm256_round_ps::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(_mm256_mul_ps(line, factor)))
        });
        let words_low = _mm256_packs_epi32(integers[0], integers[1]);
        let words_high = _mm256_packs_epi32(integers[2], integers[3]);
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words_low, words_high), order);
        // The sums of each four bytes, in order: the low 128 bits hold the first half's four, the high the second's.
        let quads = _mm256_madd_epi16(_mm256_maddubs_epi16(one_bytes, bytes), one_words);
        // SAFETY: the target holds this block's 32 bytes.
        unsafe {
            _mm256_storeu_si256(
                parts.values[block * BLOCK..].as_mut_ptr() as *mut __m256i,
                bytes,
            );
        }
        let half_sum = |four: __m128i| {
            let pair = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
            _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32(pair, 0b01)))
        };
        let halves = [
            half_sum(_mm256_castsi256_si128(quads)),
            half_sum(_mm256_extracti128_si256(quads, 1)),
        ];
        parts.half_sums[2 * block..2 * block + 2].copy_from_slice(&halves);
        let total = halves[0] + halves[1];
        parts.scales[block] = half::f16::from_f32(d).to_f32();
        parts.sums[block] = parts.scales[block] * total as f32;
    }
}
