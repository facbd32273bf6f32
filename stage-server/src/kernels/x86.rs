//! The x86-64 kernels: one body compiled twice, for AVX2 (+FMA, F16C) and for AVX-512 VNNI on 256-bit registers.
//!
//! A weight block is expanded in a register to 32 bytes, one per weight, in activation order (the low nibbles are
//! weights 0..16, the high nibbles 16..32, the fifth bits of Q5 are OR-ed in as 0x10). The products with the 32
//! activation bytes are summed to eight 32-bit integers (`maddubs` + `madd` on AVX2, one `vpdpbusd` on VNNI), turned
//! into floats and scaled once per block. Q8_0 weights are signed, and Q4_0/Q5_0 weights are centred to signed
//! (`q - 8`, `q - 16`) in the register: the sign is moved onto the activation (`sign`/`abs`) so the
//! unsigned-by-signed multiply still applies. Centring in integers (as ggml does) instead of adding
//! `-16·d·x_scale·Σq` as a float term avoids a cancellation between two large float terms that cost gemma-3's
//! Q5_0 products about ten times the rounding error of llama.cpp's (2.5e-7 relative against its tensors).
//!
//! A tile is `W` weight rows by `X` activation rows: each weight block is expanded once per tile and each
//! activation block loaded once per tile. Decode uses 1 x 1 (one sequential stream per thread); a batch 4 x 2
//! (AVX2, 16 registers) or 4 x 4 (VNNI, 32 registers).
//!
//! Batch invariance: every tile shape performs the same float operations per output element in the same order
//! (per block `fma(w_scale·x_scale, dot, acc)` and, for Q4_1/Q5_1, `fma(w_min, x_scale·Σq, offsets)`, blocks in order, then one
//! fixed horizontal sum), so a row's output is bit-identical whether it is computed alone or in any batch.

use std::arch::x86_64::*;

use super::activation::QuantizedActivations;
use super::format::{BLOCK, WeightFormat};
use super::{Output, QUAD, RowRange, SimdLevel};

const FORMAT_Q4_0: u8 = 0;
const FORMAT_Q4_1: u8 = 1;
const FORMAT_Q5_0: u8 = 2;
const FORMAT_Q5_1: u8 = 3;
const FORMAT_Q8_0: u8 = 4;

/// Whether the AVX2 kernels can run here.
pub(super) fn avx2_available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Whether the AVX-512 VNNI kernels can run here.
pub(super) fn avx512_vnni_available() -> bool {
    avx2_available()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// Runs the SIMD kernel of `level` over weight rows `rows`, for every activation row.
///
/// Panics if the level is not available or the slices are too short (both are checked by the caller already).
pub(super) fn matmul_rows(
    level: SimdLevel,
    format: WeightFormat,
    weights: &[u8],
    activations: &QuantizedActivations,
    rows: RowRange,
    output: &Output<'_>,
) {
    let row_bytes = activations.blocks_per_row() * format.block_bytes();
    assert!(
        weights.len() >= rows.end * row_bytes,
        "the weight bytes must cover every row the kernel reads"
    );
    match level {
        SimdLevel::Avx2 => {
            assert!(avx2_available(), "AVX2 kernels need AVX2, FMA and F16C");
            // SAFETY: the CPU has the features `avx2::matmul_rows` is compiled for (checked just above), and the
            // weight slice covers every row in `rows` (asserted above); activation slices are checked where indexed.
            unsafe { avx2::matmul_rows(format, weights, activations, rows, output) }
        }
        SimdLevel::Avx512Vnni => {
            assert!(
                avx512_vnni_available(),
                "VNNI kernels need AVX-512 F/BW/VL/VNNI"
            );
            // SAFETY: as above, for the AVX-512 feature set of `vnni::matmul_rows`.
            unsafe { vnni::matmul_rows(format, weights, activations, rows, output) }
        }
        SimdLevel::Scalar => unreachable!("the scalar level does not reach the x86 kernels"),
    }
}

/// Generates `matmul_rows` and its tile kernel for one target-feature set. The including module provides
/// `mul_sum_unsigned`, `mul_sum_signed` and `fifth_bits` for its instruction set, and `TILE_X`.
macro_rules! kernel_body {
    ($features:literal) => {
        /// Dispatches on the weight format to a kernel specialised for it.
        ///
        /// # Safety
        /// The CPU must support the module's target features, and `weights` must hold `rows.end` rows of
        /// `activations.blocks_per_row()` blocks.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn matmul_rows(
            format: WeightFormat,
            weights: &[u8],
            activations: &QuantizedActivations,
            rows: RowRange,
            output: &Output<'_>,
        ) {
            // SAFETY (all arms): forwarded from this function's contract.
            unsafe {
                match format {
                    WeightFormat::Q4_0 => {
                        rows_of::<FORMAT_Q4_0>(weights, activations, rows, output)
                    }
                    WeightFormat::Q4_1 => {
                        rows_of::<FORMAT_Q4_1>(weights, activations, rows, output)
                    }
                    WeightFormat::Q5_0 => {
                        rows_of::<FORMAT_Q5_0>(weights, activations, rows, output)
                    }
                    WeightFormat::Q5_1 => {
                        rows_of::<FORMAT_Q5_1>(weights, activations, rows, output)
                    }
                    WeightFormat::Q8_0 => {
                        rows_of::<FORMAT_Q8_0>(weights, activations, rows, output)
                    }
                }
            }
        }

        /// Walks the rows in quads and the activations in tiles of `TILE_X`, then the leftovers one by one.
        ///
        /// # Safety
        /// As for `matmul_rows`.
        #[target_feature(enable = $features)]
        unsafe fn rows_of<const F: u8>(
            weights: &[u8],
            activations: &QuantizedActivations,
            rows: RowRange,
            output: &Output<'_>,
        ) {
            let row_bytes = activations.blocks_per_row() * block_bytes(F);
            let inputs = activations.rows();
            let mut row = rows.start;
            while row + QUAD <= rows.end {
                let mut x = 0;
                while x + TILE_X <= inputs {
                    // SAFETY: rows row..row+QUAD < rows.end are inside `weights` (contract); x+TILE_X <= inputs.
                    let sums =
                        unsafe { tile::<F, QUAD, TILE_X>(weights, row_bytes, row, activations, x) };
                    for (i, line) in sums.iter().enumerate() {
                        for (j, value) in line.iter().enumerate() {
                            output.write(x + j, row + i, *value);
                        }
                    }
                    x += TILE_X;
                }
                // Two or three rows left over (a small batch under the 4-wide tile): pairs still decode each
                // weight block once for two rows, which single rows would decode twice (measured 1.2x on a
                // batch of 2). Every element is still one FMA chain over the blocks in order, so the results
                // do not depend on the tile shape.
                while TILE_X > 2 && x + 2 <= inputs {
                    // SAFETY: rows row..row+QUAD < rows.end are inside `weights` (contract); x+2 <= inputs.
                    let sums =
                        unsafe { tile::<F, QUAD, 2>(weights, row_bytes, row, activations, x) };
                    for (i, line) in sums.iter().enumerate() {
                        for (j, value) in line.iter().enumerate() {
                            output.write(x + j, row + i, *value);
                        }
                    }
                    x += 2;
                }
                while x < inputs {
                    // A single activation row (decode) walks the weight rows one at a time rather than four
                    // interleaved: measured 1.6x faster on weights streamed from DRAM, since one sequential stream
                    // per thread keeps the hardware prefetcher ahead.
                    for i in 0..QUAD {
                        // SAFETY: as above with one weight row and one activation row.
                        let sums =
                            unsafe { tile::<F, 1, 1>(weights, row_bytes, row + i, activations, x) };
                        output.write(x, row + i, sums[0][0]);
                    }
                    x += 1;
                }
                row += QUAD;
            }
            while row < rows.end {
                for x in 0..inputs {
                    // SAFETY: row < rows.end is inside `weights`; x < inputs.
                    let sums = unsafe { tile::<F, 1, 1>(weights, row_bytes, row, activations, x) };
                    output.write(x, row, sums[0][0]);
                }
                row += 1;
            }
        }

        /// Dot products of weight rows `first_row..first_row+W` with activation rows `first_x..first_x+X`.
        ///
        /// # Safety
        /// The CPU must support the module's target features; `weights` must hold `first_row + W` rows of
        /// `row_bytes`, and `activations` at least `first_x + X` rows.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn tile<const F: u8, const W: usize, const X: usize>(
            weights: &[u8],
            row_bytes: usize,
            first_row: usize,
            activations: &QuantizedActivations,
            first_x: usize,
        ) -> [[f32; X]; W] {
            let blocks = activations.blocks_per_row();
            debug_assert!(weights.len() >= (first_row + W) * row_bytes);
            let mut x_values = [std::ptr::null::<i8>(); X];
            let mut x_scales: [&[f32]; X] = [&[]; X];
            let mut x_sums: [&[f32]; X] = [&[]; X];
            for j in 0..X {
                x_values[j] = activations.row_values(first_x + j).as_ptr();
                x_scales[j] = &activations.row_scales(first_x + j)[..blocks];
                x_sums[j] = &activations.row_sums(first_x + j)[..blocks];
            }
            let base = weights.as_ptr();
            let mut accumulators = [[_mm256_setzero_ps(); X]; W];
            let mut offsets = [[0f32; X]; W];
            // One chain of FMAs per output element, blocks in order, whatever the tile shape: a row computed alone
            // (decode) and the same row inside a batch tile then round identically (batch invariance). Splitting
            // a lone row's blocks over two chains would hide FMA latency, but would change the sum's rounding.
            let mut block_index = 0;
            while block_index < blocks {
                // SAFETY: block_index < blocks; the rest is this function's contract.
                unsafe {
                    block_step::<F, W, X>(
                        base,
                        row_bytes,
                        first_row,
                        block_index,
                        &x_values,
                        &x_scales,
                        &x_sums,
                        &mut accumulators,
                        &mut offsets,
                    );
                }
                block_index += 1;
            }
            let mut result = [[0f32; X]; W];
            for i in 0..W {
                for j in 0..X {
                    result[i][j] = horizontal_sum(accumulators[i][j]) + offsets[i][j];
                }
            }
            result
        }

        /// Adds block `block_index` of the tile's weight rows times the tile's activation rows to the sums.
        ///
        /// # Safety
        /// The CPU must support the module's target features; `base` must point at `first_row + W` rows of
        /// `row_bytes`, each activation pointer at a row of more than `block_index` blocks, and `block_index` must be
        /// below the length of every scale and sum slice.
        #[target_feature(enable = $features)]
        #[inline]
        #[allow(clippy::too_many_arguments)]
        unsafe fn block_step<const F: u8, const W: usize, const X: usize>(
            base: *const u8,
            row_bytes: usize,
            first_row: usize,
            block_index: usize,
            x_values: &[*const i8; X],
            x_scales: &[&[f32]; X],
            x_sums: &[&[f32]; X],
            accumulators: &mut [[__m256; X]; W],
            offsets: &mut [[f32; X]; W],
        ) {
            let block_bytes = block_bytes(F);
            for i in 0..W {
                // A decode step (one row a lane, a few lanes) is bound by streaming the weights from memory once:
                // ask for each weight row's bytes PREFETCH_AHEAD on now, so their cache lines are on their way
                // while these compute. A hint only, never a fault: past the weights' end it reads nothing.
                let ahead = base.wrapping_add(
                    (first_row + i) * row_bytes + block_index * block_bytes + PREFETCH_AHEAD,
                );
                _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
            }
            let mut x_block = [_mm256_setzero_si256(); X];
            for j in 0..X {
                // SAFETY: each activation row holds more than `block_index` blocks of BLOCK bytes (contract).
                x_block[j] = unsafe {
                    _mm256_loadu_si256(x_values[j].add(block_index * BLOCK) as *const __m256i)
                };
            }
            // In a large tile, scales as vectors: one multiply per (weight row, activation row) pair instead of a
            // scalar multiply and a broadcast. (Unused, and removed by the compiler, in small tiles.)
            let mut x_scale = [_mm256_setzero_ps(); X];
            for j in 0..X {
                x_scale[j] = _mm256_set1_ps(x_scales[j][block_index]);
            }
            for i in 0..W {
                // SAFETY: row first_row+i is inside the weights and block_index is below the row's block count
                // (contract), so the block's `block_bytes` bytes are in bounds.
                let (q, scale, offset) = unsafe {
                    decode::<F>(base.add((first_row + i) * row_bytes + block_index * block_bytes))
                };
                let weight_scale = _mm256_set1_ps(scale);
                for j in 0..X {
                    let dot = if F == FORMAT_Q8_0 || F == FORMAT_Q4_0 || F == FORMAT_Q5_0 {
                        mul_sum_signed(q, x_block[j])
                    } else {
                        mul_sum_unsigned(q, x_block[j])
                    };
                    let factor = if W * X >= 4 {
                        _mm256_mul_ps(weight_scale, x_scale[j])
                    } else {
                        _mm256_set1_ps(scale * x_scales[j][block_index])
                    };
                    accumulators[i][j] =
                        _mm256_fmadd_ps(factor, _mm256_cvtepi32_ps(dot), accumulators[i][j]);
                    if F == FORMAT_Q4_1 || F == FORMAT_Q5_1 {
                        // One fused instruction (FMA is enabled here).
                        offsets[i][j] = offset.mul_add(x_sums[j][block_index], offsets[i][j]);
                    }
                }
            }
        }

        /// Expands the block at `block` to 32 bytes in weight order and returns them with `(scale, offset)`.
        ///
        /// # Safety
        /// `block` must point at `block_bytes(F)` readable bytes; the CPU must support the module's features.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn decode<const F: u8>(block: *const u8) -> (__m256i, f32, f32) {
            // SAFETY: every read below stays inside the block's bytes (layouts in `format.rs`).
            unsafe {
                match F {
                    FORMAT_Q4_0 => {
                        let d = f16_to_f32(block);
                        let centred = _mm256_sub_epi8(nibbles(block.add(2)), _mm256_set1_epi8(8));
                        (centred, d, 0.0)
                    }
                    FORMAT_Q4_1 => {
                        let (d, m) = f16_pair(block);
                        (nibbles(block.add(4)), d, m)
                    }
                    FORMAT_Q5_0 => {
                        let d = f16_to_f32(block);
                        let high = (block.add(2) as *const u32).read_unaligned();
                        let q =
                            _mm256_or_si256(nibbles(block.add(6)), fifth_bits(u32::from_le(high)));
                        (_mm256_sub_epi8(q, _mm256_set1_epi8(16)), d, 0.0)
                    }
                    FORMAT_Q5_1 => {
                        let (d, m) = f16_pair(block);
                        let high = (block.add(4) as *const u32).read_unaligned();
                        let q =
                            _mm256_or_si256(nibbles(block.add(8)), fifth_bits(u32::from_le(high)));
                        (q, d, m)
                    }
                    _ => {
                        let d = f16_to_f32(block);
                        (_mm256_loadu_si256(block.add(2) as *const __m256i), d, 0.0)
                    }
                }
            }
        }

        /// Loads 16 bytes of nibbles as 32 bytes: low nibbles first, then high nibbles.
        ///
        /// # Safety
        /// `at` must point at 16 readable bytes.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn nibbles(at: *const u8) -> __m256i {
            // SAFETY: 16 bytes readable (contract); unaligned load.
            let packed = unsafe { _mm_loadu_si128(at as *const __m128i) };
            let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
            _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
        }

        /// Reads the f16 at `at`.
        ///
        /// It loads four bytes and converts both halves: a two-byte load becomes `vpinsrw`, which merges into
        /// whatever register the compiler picks and so chained each block to the previous one (measured).
        ///
        /// # Safety
        /// `at` must point at 4 readable bytes (every block is at least 18 bytes long).
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn f16_to_f32(at: *const u8) -> f32 {
            // SAFETY: 4 bytes readable (contract).
            unsafe { f16_pair(at).0 }
        }

        /// Reads two consecutive f16 values at `at` (`d` then `m`).
        ///
        /// # Safety
        /// `at` must point at 4 readable bytes.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn f16_pair(at: *const u8) -> (f32, f32) {
            // SAFETY: 4 bytes readable (contract).
            let bits = unsafe { (at as *const u32).read_unaligned() };
            let both = _mm_cvtph_ps(_mm_cvtsi32_si128(u32::from_le(bits) as i32));
            (_mm_cvtss_f32(both), _mm_cvtss_f32(_mm_movehdup_ps(both)))
        }

        /// The sum of the eight lanes.
        #[target_feature(enable = $features)]
        #[inline]
        fn horizontal_sum(v: __m256) -> f32 {
            let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
            _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
        }
    };
}

/// How far ahead of the block it computes a product asks for its weights (see `block_step`). Measured on the
/// gemma-3 head (Q8_0, 262,144 x 640, one row, 2 threads, `--bench kernels`): no prefetch 14.4 to 17.1 ms, 1 KiB
/// ahead 8.5, 2 KiB 6.4 to 10.0, 4 KiB 7.4, 8 KiB 7.5; weights already in cache are not slowed. A decode step of
/// 2, 4 and 8 lanes (`--bench batch`, SmolLM2): 14.9, 20.8 and 33.7 ms with the single row's prefetch only,
/// 9.7, 16.2 and 29.3 with every tile's.
const PREFETCH_AHEAD: usize = 2048;

/// Bytes per block of the format with const tag `format`.
const fn block_bytes(format: u8) -> usize {
    match format {
        FORMAT_Q4_0 => WeightFormat::Q4_0.block_bytes(),
        FORMAT_Q4_1 => WeightFormat::Q4_1.block_bytes(),
        FORMAT_Q5_0 => WeightFormat::Q5_0.block_bytes(),
        FORMAT_Q5_1 => WeightFormat::Q5_1.block_bytes(),
        _ => WeightFormat::Q8_0.block_bytes(),
    }
}

mod avx2 {
    //! AVX2 + FMA + F16C.
    use super::*;

    /// Activation rows per tile in a batch: 4 x 2 accumulators plus operands fit the 16 ymm registers.
    const TILE_X: usize = 2;

    kernel_body!("avx2,fma,f16c");

    /// Eight sums of four products of unsigned weight bytes (at most 31) with signed activation bytes.
    ///
    /// `maddubs` saturates at ±32767 per pair; 2 · 31 · 127 is far below it.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn mul_sum_unsigned(weights: __m256i, activations: __m256i) -> __m256i {
        _mm256_madd_epi16(
            _mm256_maddubs_epi16(weights, activations),
            _mm256_set1_epi16(1),
        )
    }

    /// As `mul_sum_unsigned` for signed weights: |w| times x with w's sign (2 · 128 · 127 < 32767).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn mul_sum_signed(weights: __m256i, activations: __m256i) -> __m256i {
        let magnitude = _mm256_sign_epi8(weights, weights);
        let signed = _mm256_sign_epi8(activations, weights);
        _mm256_madd_epi16(
            _mm256_maddubs_epi16(magnitude, signed),
            _mm256_set1_epi16(1),
        )
    }

    /// Byte `i` is 0x10 when bit `i` of `high` is set, else 0.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn fifth_bits(high: u32) -> __m256i {
        // Spread byte i/8 of `high` to byte i, keep bit i%8, and compare to turn it into a full byte.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(high as i32),
            _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0x0000_0000_0000_0000,
            ),
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }
}

mod vnni {
    //! AVX-512 F/BW/VL/VNNI on 256-bit registers (plus AVX2, FMA, F16C).
    use super::*;

    /// Activation rows per tile in a batch: 4 x 4 accumulators fit the 32 registers AVX-512 VL gives.
    const TILE_X: usize = 4;

    kernel_body!("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");

    /// Eight sums of four products of unsigned weight bytes with signed activation bytes, in one `vpdpbusd`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    fn mul_sum_unsigned(weights: __m256i, activations: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), weights, activations)
    }

    /// As `mul_sum_unsigned` for signed weights, moving the weight's sign onto the activation.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    fn mul_sum_signed(weights: __m256i, activations: __m256i) -> __m256i {
        let magnitude = _mm256_abs_epi8(weights);
        let signed = _mm256_sign_epi8(activations, weights);
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, signed)
    }

    /// Byte `i` is 0x10 when bit `i` of `high` is set, else 0: one masked move.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    fn fifth_bits(high: u32) -> __m256i {
        _mm256_maskz_mov_epi8(high, _mm256_set1_epi8(0x10))
    }
}
