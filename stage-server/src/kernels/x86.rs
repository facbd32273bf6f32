//! The x86-64 kernels over packed weights: AVX-512 VNNI on 16 rows per register, AVX2 on 8.
//!
//! A group's block (16 rows x 32 weights, `packed.rs`) is loaded as eight registers, register `k` holding weights
//! `4k..4k+4` of every row, one row per 32-bit lane. Four activation bytes broadcast to every lane and one
//! unsigned-by-signed multiply-add (`vpdpbusd` on VNNI, `maddubs` + `madd` on AVX2) advance every row's integer
//! product by those four; the eight of a block go into two integer chains, whose sum less `centre` times the
//! values' sum is the block's exact product with the centred weights (one per half of the block for Q6_K, whose
//! halves have scales of their own). That integer is converted, scaled by the 16 weight scales times the
//! activation's and accumulated once per block, as `scalar.rs` states; one instruction does it for 16 rows.
//!
//! A tile is one group by `X` activation rows: the group's block is expanded once and multiplied by each row.
//! Decode is X = 1, one sequential stream of packed bytes per thread, prefetched ahead.
//!
//! Wide activations (a residual byte per value, `activation.rs`) add a second chain of multiply-adds over the
//! residual bytes; the block's integer is then `128 ·` the first bytes' product plus the residuals'. The K-quants'
//! scales are f32 in the packed layout; every other format's are f16.
//!
//! Batch and level invariance: every tile shape, both SIMD levels and the scalar kernel perform the same
//! operations per output element in the same order, so a row's output is bit-identical alone, in any batch, at
//! any level and for any thread count.

use std::arch::x86_64::*;
use std::ops::Range;

use super::activation::{QuantizedActivations, RESIDUAL_STEP, WIDE_FACTOR};
use super::format::WeightFormat;
use super::packed::{BlockLayout, GROUP, PackedWeights};
use super::{Output, SimdLevel};

const FORMAT_Q4_0: u8 = 0;
const FORMAT_Q4_1: u8 = 1;
const FORMAT_Q5_0: u8 = 2;
const FORMAT_Q5_1: u8 = 3;
const FORMAT_Q8_0: u8 = 4;
const FORMAT_Q4_K: u8 = 5;
const FORMAT_Q6_K: u8 = 6;
const FORMAT_Q5_K: u8 = 7;

/// How far ahead of the block it computes a kernel asks for the packed bytes (every line of the block, into
/// L2: `_MM_HINT_T1`). A decode step streams every weight once. On the ggml layout a T0 prefetch 2 KiB ahead
/// gained 1.5x to 2x (the gemma-3 head, one row, 2 threads: 14.4 to 17.1 ms without, 6.4 to 10.0 with). On the
/// packed layout (`--bench batch`, a SmolLM2 decode step of one lane, 2 threads, medians of three same-run
/// rounds): 2 KiB T0 4.26 ms, 8 KiB T0 3.98, 8 KiB T1 3.72, 16 KiB T1 3.84, 8 KiB T2 3.89, no prefetch 5.7; a
/// 4-lane step did not move beyond the noise (9.4 to 10.6 ms for each).
const PREFETCH_AHEAD: usize = 8192;

/// The left shift that multiplies the first bytes' product by [`WIDE_FACTOR`].
const WIDE_SHIFT: u32 = WIDE_FACTOR.trailing_zeros();
const _: () = assert!(
    1 << WIDE_SHIFT == WIDE_FACTOR,
    "the wide factor must be a power of two"
);

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

/// Runs the SIMD kernel of `level` over the weight groups `groups`, for every activation row.
///
/// Panics if the level is not available or the activations do not match the weights (both are checked by the
/// caller already).
pub(super) fn matmul_groups(
    level: SimdLevel,
    weights: &PackedWeights,
    activations: &QuantizedActivations,
    groups: Range<usize>,
    output: &Output<'_>,
) {
    let group_bytes = weights.blocks_per_row() * BlockLayout::of(weights.format()).bytes;
    assert!(
        activations.blocks_per_row() == weights.blocks_per_row()
            && groups.end <= weights.groups()
            && weights.bytes().len() >= groups.end * group_bytes,
        "the packed weights must cover every group the kernel reads, at the activations' width"
    );
    match level {
        SimdLevel::Avx2 => {
            assert!(avx2_available(), "AVX2 kernels need AVX2, FMA and F16C");
            // SAFETY: the CPU has the features `avx2::matmul_groups` is compiled for (checked just above), and the
            // packed bytes cover every group in `groups` at the activations' block count (asserted above).
            unsafe { avx2::matmul_groups(weights, activations, groups, output) }
        }
        SimdLevel::Avx512Vnni => {
            assert!(
                avx512_vnni_available(),
                "VNNI kernels need AVX-512 F/BW/VL/VNNI"
            );
            // SAFETY: as above, for the AVX-512 feature set of `vnni::matmul_groups`.
            unsafe { vnni::matmul_groups(weights, activations, groups, output) }
        }
        SimdLevel::Scalar => unreachable!("the scalar level does not reach the x86 kernels"),
    }
}

/// Calls `$kernel::<F, WIDE>(arguments)` with `F` the const tag of `$weights`' format (`$weights` is the first
/// argument) and `WIDE` whether `$activations` (the second) carry residual bytes.
macro_rules! for_each_format {
    ($kernel:ident, $weights:expr, $activations:expr, $($argument:expr),*) => {
        if $activations.is_wide() {
            for_each_format!(@formats $kernel, true, $weights, $activations, $($argument),*)
        } else {
            for_each_format!(@formats $kernel, false, $weights, $activations, $($argument),*)
        }
    };
    (@formats $kernel:ident, $wide:literal, $weights:expr, $($argument:expr),*) => {
        match tag_of($weights.format()) {
            FORMAT_Q4_0 => $kernel::<FORMAT_Q4_0, $wide>($weights, $($argument),*),
            FORMAT_Q4_1 => $kernel::<FORMAT_Q4_1, $wide>($weights, $($argument),*),
            FORMAT_Q5_0 => $kernel::<FORMAT_Q5_0, $wide>($weights, $($argument),*),
            FORMAT_Q5_1 => $kernel::<FORMAT_Q5_1, $wide>($weights, $($argument),*),
            FORMAT_Q4_K => $kernel::<FORMAT_Q4_K, $wide>($weights, $($argument),*),
            FORMAT_Q6_K => $kernel::<FORMAT_Q6_K, $wide>($weights, $($argument),*),
            FORMAT_Q5_K => $kernel::<FORMAT_Q5_K, $wide>($weights, $($argument),*),
            _ => $kernel::<FORMAT_Q8_0, $wide>($weights, $($argument),*),
        }
    };
}

/// The format with const tag `tag`.
const fn format_of(tag: u8) -> WeightFormat {
    match tag {
        FORMAT_Q4_0 => WeightFormat::Q4_0,
        FORMAT_Q4_1 => WeightFormat::Q4_1,
        FORMAT_Q5_0 => WeightFormat::Q5_0,
        FORMAT_Q5_1 => WeightFormat::Q5_1,
        FORMAT_Q4_K => WeightFormat::Q4_K,
        FORMAT_Q6_K => WeightFormat::Q6_K,
        FORMAT_Q5_K => WeightFormat::Q5_K,
        _ => WeightFormat::Q8_0,
    }
}

/// The const tag of `format`.
fn tag_of(format: WeightFormat) -> u8 {
    match format {
        WeightFormat::Q4_0 => FORMAT_Q4_0,
        WeightFormat::Q4_1 => FORMAT_Q4_1,
        WeightFormat::Q5_0 => FORMAT_Q5_0,
        WeightFormat::Q5_1 => FORMAT_Q5_1,
        WeightFormat::Q8_0 => FORMAT_Q8_0,
        WeightFormat::Q4_K => FORMAT_Q4_K,
        WeightFormat::Q6_K => FORMAT_Q6_K,
        WeightFormat::Q5_K => FORMAT_Q5_K,
    }
}

/// Pointers to the parts of `X` activation rows that a tile reads.
struct Inputs<'a, const X: usize> {
    values: [*const u8; X],
    /// The residual bytes of a wide quantisation; for an 8-bit one an empty slice's pointer, never read (only
    /// the wide tiles read it).
    residuals: [*const u8; X],
    /// The integer sums of each half block's values, two per block (`Σ(128·q + r)` for a wide quantisation).
    half_sums: [&'a [i32]; X],
    scales: [&'a [f32]; X],
    sums: [&'a [f32]; X],
}

impl<'a, const X: usize> Inputs<'a, X> {
    /// Rows `first..first + X` of `activations` (which must hold them).
    fn new(activations: &'a QuantizedActivations, first: usize) -> Self {
        let blocks = activations.blocks_per_row();
        Self {
            values: std::array::from_fn(|j| {
                activations.row_values(first + j).as_ptr() as *const u8
            }),
            residuals: std::array::from_fn(|j| {
                activations.row_residuals(first + j).as_ptr() as *const u8
            }),
            half_sums: std::array::from_fn(|j| &activations.row_half_sums(first + j)[..2 * blocks]),
            scales: std::array::from_fn(|j| &activations.row_scales(first + j)[..blocks]),
            sums: std::array::from_fn(|j| &activations.row_sums(first + j)[..blocks]),
        }
    }
}

/// Writes a tile's results: lane `r` of line `j` is weight row `first_row + r` for activation row `first_x + j`.
fn write_tile<const X: usize, const LANES: usize>(
    output: &Output<'_>,
    rows: usize,
    first_row: usize,
    first_x: usize,
    lines: &[[f32; LANES]; X],
) {
    let lanes = LANES.min(rows.saturating_sub(first_row));
    for (j, line) in lines.iter().enumerate() {
        for (r, value) in line[..lanes].iter().enumerate() {
            output.write(first_x + j, first_row + r, *value);
        }
    }
}

mod vnni {
    //! AVX-512 F/BW/VL/VNNI (plus AVX2, FMA, F16C): one group of 16 rows per register.
    use super::*;

    /// Activation rows per tile in a batch of 8-bit rows: the eight weight registers, a sum and an offset per row
    /// and each row's integer chains (live only while its block is computed) fit the 32 zmm registers at four.
    /// (With ggml's eight float sums per row, before session 26, two fitted.) Wide rows, with twice the chains,
    /// go in pairs: in fours they spilled (SmolLM2's `ffn_up`, 8 rows: 36 µs in pairs, 41 µs in fours).
    const TILE_X: usize = 4;

    /// Dispatches on the weight format to a kernel specialised for it.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C, and `weights` must hold every group in
    /// `groups` at the activations' block count. (The dispatch takes the wide path exactly when the activations
    /// are wide, which the wide tiles' reads of residual bytes rely on.)
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn matmul_groups(
        weights: &PackedWeights,
        activations: &QuantizedActivations,
        groups: Range<usize>,
        output: &Output<'_>,
    ) {
        // SAFETY: forwarded from this function's contract.
        unsafe { for_each_format!(groups_of, weights, activations, groups, output) }
    }

    /// Walks the groups, and in each the activation rows in tiles of `TILE_X` (8-bit rows only), then pairs, then a
    /// single row.
    ///
    /// # Safety
    /// As for `matmul_groups`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn groups_of<const F: u8, const WIDE: bool>(
        weights: &PackedWeights,
        activations: &QuantizedActivations,
        groups: Range<usize>,
        output: &Output<'_>,
    ) {
        debug_assert_eq!(WIDE, activations.is_wide(), "the wide path needs wide rows");
        let blocks = activations.blocks_per_row();
        let group_bytes = blocks * BlockLayout::of(format_of(F)).bytes;
        // The activation rows of each tile, looked up once per product rather than once per group.
        let rows = activations.rows();
        let tiles: Vec<Inputs<'_, TILE_X>> = (0..if WIDE { 0 } else { rows / TILE_X })
            .map(|tile| Inputs::new(activations, tile * TILE_X))
            .collect();
        let in_fours = tiles.len() * TILE_X;
        let pairs: Vec<Inputs<'_, 2>> = (0..(rows - in_fours) / 2)
            .map(|pair| Inputs::new(activations, in_fours + 2 * pair))
            .collect();
        let rest = in_fours + 2 * pairs.len();
        let single = (rest < rows).then(|| Inputs::<'_, 1>::new(activations, rest));
        for group in groups {
            // SAFETY: the group is inside the packed bytes (contract).
            let base = unsafe { weights.bytes().as_ptr().add(group * group_bytes) };
            let first_row = group * GROUP;
            for (index, rows) in tiles.iter().enumerate() {
                // SAFETY: the group's blocks are readable at `base` (contract); the tile's rows exist.
                let lines = unsafe { tile::<F, WIDE, TILE_X>(base, blocks, rows) };
                write_tile(output, weights.rows(), first_row, index * TILE_X, &lines);
            }
            for (index, rows) in pairs.iter().enumerate() {
                // SAFETY: as above with two rows.
                let lines = unsafe { tile::<F, WIDE, 2>(base, blocks, rows) };
                write_tile(
                    output,
                    weights.rows(),
                    first_row,
                    in_fours + 2 * index,
                    &lines,
                );
            }
            if let Some(rows) = &single {
                // SAFETY: as above with one row.
                let lines = unsafe { tile::<F, WIDE, 1>(base, blocks, rows) };
                write_tile(output, weights.rows(), first_row, rest, &lines);
            }
        }
    }

    /// The 16 x `X` products of one group (at `base`, `blocks` blocks) with activation rows `inputs`.
    ///
    /// # Safety
    /// The CPU must support the module's features; `base` must point at the group's `blocks` packed blocks and
    /// every activation row in `inputs` must hold `blocks` blocks; with `WIDE`, as many blocks of residual bytes
    /// (the rows of a wide quantisation).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn tile<const F: u8, const WIDE: bool, const X: usize>(
        base: *const u8,
        blocks: usize,
        inputs: &Inputs<'_, X>,
    ) -> [[f32; GROUP]; X] {
        let layout = BlockLayout::of(format_of(F));
        let has_minimums = format_of(F).has_offsets();
        let half_scales = format_of(F).has_half_scales();
        let mut totals = [_mm512_setzero_ps(); X];
        let mut offsets = [_mm512_setzero_ps(); X];
        let low_nibbles = _mm512_set1_epi8(0x0F);
        for block in 0..blocks {
            let at = base.wrapping_add(block * layout.bytes);
            let mut line = 0;
            while line < layout.bytes {
                // A hint only, never a fault: past the weights' end it reads nothing.
                _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(PREFETCH_AHEAD + line) as *const i8);
                line += 64;
            }
            // SAFETY: every load below reads inside this block's `layout.bytes` bytes (contract and `packed.rs`).
            let (scales, halves, minimums, values) = unsafe {
                let scales = scale_set(at, layout.wide_scales);
                let halves = match layout.half_scales {
                    Some(offset) => scale_set(at.add(offset), layout.wide_scales),
                    None => scales,
                };
                let minimums = match layout.minimums {
                    Some(offset) => scale_set(at.add(offset), layout.wide_scales),
                    None => _mm512_setzero_ps(),
                };
                let mut values = [_mm512_setzero_si512(); 8];
                if layout.byte_values {
                    for (k, value) in values.iter_mut().enumerate() {
                        *value = _mm512_loadu_si512(at.add(layout.values + 64 * k) as *const _);
                    }
                } else {
                    for chunk in 0..4 {
                        let packed =
                            _mm512_loadu_si512(at.add(layout.values + 64 * chunk) as *const _);
                        values[2 * chunk] = _mm512_and_si512(packed, low_nibbles);
                        values[2 * chunk + 1] =
                            _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
                    }
                    if let Some(offset) = layout.fifths {
                        let sixteen = _mm512_set1_epi8(0x10);
                        for (k, value) in values.iter_mut().enumerate() {
                            let mask = (at.add(offset + 8 * k) as *const u64).read_unaligned();
                            *value =
                                _mm512_mask_add_epi8(*value, u64::from_le(mask), *value, sixteen);
                        }
                    }
                }
                (scales, halves, minimums, values)
            };
            for j in 0..X {
                let x_block = inputs.values[j].wrapping_add(block * 32) as *const i32;
                let x_scale = _mm512_set1_ps(inputs.scales[j][block]);
                // A wide row's residual bytes are on a step of 1/128 of the first bytes'.
                let step = |factor: __m512| {
                    if WIDE {
                        _mm512_mul_ps(factor, _mm512_set1_ps(RESIDUAL_STEP))
                    } else {
                        factor
                    }
                };
                // The second half's factor is a product of its own only where the halves are scaled apart (Q6_K).
                let first = step(_mm512_mul_ps(scales, x_scale));
                let factors = [
                    first,
                    if half_scales {
                        step(_mm512_mul_ps(halves, x_scale))
                    } else {
                        first
                    },
                ];
                // Integers, so the chains' order is free: two per byte kind keep the adds' latency apart, one per
                // half of the block where the halves are scaled apart.
                let mut firsts = [_mm512_setzero_si512(); 2];
                let mut residuals = [_mm512_setzero_si512(); 2];
                let r_block = inputs.residuals[j].wrapping_add(block * 32) as *const i32;
                for (k, value) in values.iter().enumerate() {
                    let chain = if half_scales { k / 4 } else { k % 2 };
                    // SAFETY: each activation row holds `blocks` blocks of 32 bytes (contract).
                    let x_quad = unsafe { x_block.add(k).read_unaligned() };
                    firsts[chain] =
                        _mm512_dpbusd_epi32(firsts[chain], *value, _mm512_set1_epi32(x_quad));
                    if WIDE {
                        // SAFETY: a wide row holds as many residual bytes as values (contract).
                        let r_quad = unsafe { r_block.add(k).read_unaligned() };
                        residuals[chain] = _mm512_dpbusd_epi32(
                            residuals[chain],
                            *value,
                            _mm512_set1_epi32(r_quad),
                        );
                    }
                }
                let half_sums = &inputs.half_sums[j][2 * block..2 * block + 2];
                // The centred weights' exact product: the stored weights' less `centre` times the values' sum.
                let exact = |first: __m512i, residual: __m512i, sum: i32| {
                    let stored = if WIDE {
                        _mm512_add_epi32(_mm512_slli_epi32::<WIDE_SHIFT>(first), residual)
                    } else {
                        first
                    };
                    if layout.centre == 0 {
                        stored
                    } else {
                        _mm512_add_epi32(_mm512_set1_epi32(-layout.centre * sum), stored)
                    }
                };
                if half_scales {
                    for part in 0..2 {
                        let integer = exact(firsts[part], residuals[part], half_sums[part]);
                        totals[j] =
                            _mm512_fmadd_ps(factors[part], _mm512_cvtepi32_ps(integer), totals[j]);
                    }
                } else {
                    let integer = exact(
                        _mm512_add_epi32(firsts[0], firsts[1]),
                        _mm512_add_epi32(residuals[0], residuals[1]),
                        half_sums[0] + half_sums[1],
                    );
                    totals[j] = _mm512_fmadd_ps(factors[0], _mm512_cvtepi32_ps(integer), totals[j]);
                }
                if has_minimums {
                    offsets[j] = _mm512_fmadd_ps(
                        minimums,
                        _mm512_set1_ps(inputs.sums[j][block]),
                        offsets[j],
                    );
                }
            }
        }
        let mut lines = [[0f32; GROUP]; X];
        for (j, line) in lines.iter_mut().enumerate() {
            let result = _mm512_add_ps(totals[j], offsets[j]);
            // SAFETY: `line` is 16 writable floats.
            unsafe { _mm512_storeu_ps(line.as_mut_ptr(), result) };
        }
        lines
    }

    /// The 16 scales (or minimums) at `at`: f32 for the K-quants, f16 otherwise.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and F16C, and `at` must point at 64 (`wide`) or 32 readable bytes.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn scale_set(at: *const u8, wide: bool) -> __m512 {
        // SAFETY: the contract's bytes are readable; unaligned loads.
        unsafe {
            if wide {
                _mm512_loadu_ps(at as *const f32)
            } else {
                _mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i))
            }
        }
    }
}

mod avx2 {
    //! AVX2 + FMA + F16C: a group of 16 rows as two halves of 8, each a pass over the group's blocks (the second
    //! pass finds them in cache: a group of SmolLM2's or gemma-3's widest rows is 15 to 22 KiB).
    use super::*;

    /// Activation rows per tile. Eight weight registers, then per row a sum, an offset and the block's integer
    /// chains, against 16 ymm registers: one row. (Two might fit now that a row keeps one sum, not ggml's
    /// eight; not measured.)
    const TILE_X: usize = 1;

    /// Dispatches on the weight format to a kernel specialised for it.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C, and `weights` must hold every group in `groups` at the
    /// activations' block count. (The dispatch takes the wide path exactly when the activations are wide, which
    /// the wide tiles' reads of residual bytes rely on.)
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn matmul_groups(
        weights: &PackedWeights,
        activations: &QuantizedActivations,
        groups: Range<usize>,
        output: &Output<'_>,
    ) {
        // SAFETY: forwarded from this function's contract.
        unsafe { for_each_format!(groups_of, weights, activations, groups, output) }
    }

    /// Walks the groups, both halves of each, and the activation rows in tiles of `TILE_X`, then singles.
    ///
    /// # Safety
    /// As for `matmul_groups`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn groups_of<const F: u8, const WIDE: bool>(
        weights: &PackedWeights,
        activations: &QuantizedActivations,
        groups: Range<usize>,
        output: &Output<'_>,
    ) {
        debug_assert_eq!(WIDE, activations.is_wide(), "the wide path needs wide rows");
        let blocks = activations.blocks_per_row();
        let group_bytes = blocks * BlockLayout::of(format_of(F)).bytes;
        // The activation rows of each tile, looked up once per product rather than once per group.
        let tiles: Vec<Inputs<'_, TILE_X>> = (0..activations.rows() / TILE_X)
            .map(|tile| Inputs::new(activations, tile * TILE_X))
            .collect();
        for group in groups {
            // SAFETY: the group is inside the packed bytes (contract).
            let base = unsafe { weights.bytes().as_ptr().add(group * group_bytes) };
            for half in 0..2 {
                let first_row = group * GROUP + 8 * half;
                for (index, rows) in tiles.iter().enumerate() {
                    // SAFETY: the group's blocks are readable at `base` (contract); the tile's rows exist.
                    let lines = unsafe { tile::<F, WIDE, TILE_X>(base, blocks, half, rows) };
                    write_tile(output, weights.rows(), first_row, index * TILE_X, &lines);
                }
            }
        }
    }

    /// The 8 x `X` products of half `half` of one group (at `base`, `blocks` blocks) with activation rows `inputs`.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `base` must point at the group's `blocks` packed blocks and every
    /// activation row in `inputs` must hold `blocks` blocks; with `WIDE`, as many blocks of residual bytes (the
    /// rows of a wide quantisation).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn tile<const F: u8, const WIDE: bool, const X: usize>(
        base: *const u8,
        blocks: usize,
        half: usize,
        inputs: &Inputs<'_, X>,
    ) -> [[f32; 8]; X] {
        let layout = BlockLayout::of(format_of(F));
        let has_minimums = format_of(F).has_offsets();
        let half_scales = format_of(F).has_half_scales();
        let mut totals = [_mm256_setzero_ps(); X];
        let mut offsets = [_mm256_setzero_ps(); X];
        let low_nibbles = _mm256_set1_epi8(0x0F);
        for block in 0..blocks {
            let at = base.wrapping_add(block * layout.bytes);
            if half == 0 {
                let mut line = 0;
                while line < layout.bytes {
                    // A hint only, never a fault: past the weights' end it reads nothing.
                    _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(PREFETCH_AHEAD + line) as *const i8);
                    line += 64;
                }
            }
            // SAFETY: every load below reads inside this block's `layout.bytes` bytes (contract and `packed.rs`).
            let (scales, halves, minimums, values) = unsafe {
                let scales = half_scale_set(at, half, layout.wide_scales);
                let halves = match layout.half_scales {
                    Some(offset) => half_scale_set(at.add(offset), half, layout.wide_scales),
                    None => scales,
                };
                let minimums = match layout.minimums {
                    Some(offset) => half_scale_set(at.add(offset), half, layout.wide_scales),
                    None => _mm256_setzero_ps(),
                };
                let mut values = [_mm256_setzero_si256(); 8];
                if layout.byte_values {
                    for (k, value) in values.iter_mut().enumerate() {
                        let stored = _mm256_loadu_si256(
                            at.add(layout.values + 64 * k + 32 * half) as *const __m256i
                        );
                        *value = if F == FORMAT_Q8_0 {
                            // Back to the signed weight: `maddubs` of 255 by 127 twice would saturate.
                            _mm256_xor_si256(stored, _mm256_set1_epi8(-128))
                        } else {
                            // Q6_K's values are at most 63: unsigned, as the 4- and 5-bit ones.
                            stored
                        };
                    }
                } else {
                    for chunk in 0..4 {
                        let packed = _mm256_loadu_si256(
                            at.add(layout.values + 64 * chunk + 32 * half) as *const __m256i,
                        );
                        values[2 * chunk] = _mm256_and_si256(packed, low_nibbles);
                        values[2 * chunk + 1] =
                            _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
                    }
                    if let Some(offset) = layout.fifths {
                        for (k, value) in values.iter_mut().enumerate() {
                            let bits =
                                (at.add(offset + 8 * k + 4 * half) as *const u32).read_unaligned();
                            *value = _mm256_or_si256(*value, fifth_bits(u32::from_le(bits)));
                        }
                    }
                }
                (scales, halves, minimums, values)
            };
            for j in 0..X {
                // Q8_0 went back to signed weights above, so only the other formats' centres are subtracted here.
                let centre = if F == FORMAT_Q8_0 { 0 } else { layout.centre };
                let x_block = inputs.values[j].wrapping_add(block * 32) as *const i32;
                let x_scale = _mm256_set1_ps(inputs.scales[j][block]);
                // A wide row's residual bytes are on a step of 1/128 of the first bytes'.
                let step = |factor: __m256| {
                    if WIDE {
                        _mm256_mul_ps(factor, _mm256_set1_ps(RESIDUAL_STEP))
                    } else {
                        factor
                    }
                };
                // The second half's factor is a product of its own only where the halves are scaled apart (Q6_K).
                let first = step(_mm256_mul_ps(scales, x_scale));
                let factors = [
                    first,
                    if half_scales {
                        step(_mm256_mul_ps(halves, x_scale))
                    } else {
                        first
                    },
                ];
                // One chain per half of the block where the halves are scaled apart (integers: the order is free).
                let mut firsts = [_mm256_setzero_si256(); 2];
                let mut residuals = [_mm256_setzero_si256(); 2];
                let r_block = inputs.residuals[j].wrapping_add(block * 32) as *const i32;
                for (k, value) in values.iter().enumerate() {
                    let chain = if half_scales { k / 4 } else { k % 2 };
                    // SAFETY: each activation row holds `blocks` blocks of 32 bytes (contract).
                    let x = _mm256_set1_epi32(unsafe { x_block.add(k).read_unaligned() });
                    firsts[chain] = _mm256_add_epi32(firsts[chain], dot::<F>(*value, x));
                    if WIDE {
                        // SAFETY: a wide row holds as many residual bytes as values (contract).
                        let r = _mm256_set1_epi32(unsafe { r_block.add(k).read_unaligned() });
                        residuals[chain] = _mm256_add_epi32(residuals[chain], dot::<F>(*value, r));
                    }
                }
                let half_sums = &inputs.half_sums[j][2 * block..2 * block + 2];
                // The centred weights' exact product: the stored weights' less `centre` times the values' sum.
                let exact = |first: __m256i, residual: __m256i, sum: i32| {
                    let stored = if WIDE {
                        _mm256_add_epi32(
                            _mm256_slli_epi32::<{ WIDE_SHIFT as i32 }>(first),
                            residual,
                        )
                    } else {
                        first
                    };
                    if centre == 0 {
                        stored
                    } else {
                        _mm256_add_epi32(_mm256_set1_epi32(-centre * sum), stored)
                    }
                };
                if half_scales {
                    // `part` is the half of the block's weights; `half` is the half of the group's rows.
                    for part in 0..2 {
                        let integer = exact(firsts[part], residuals[part], half_sums[part]);
                        totals[j] =
                            _mm256_fmadd_ps(factors[part], _mm256_cvtepi32_ps(integer), totals[j]);
                    }
                } else {
                    let integer = exact(
                        _mm256_add_epi32(firsts[0], firsts[1]),
                        _mm256_add_epi32(residuals[0], residuals[1]),
                        half_sums[0] + half_sums[1],
                    );
                    totals[j] = _mm256_fmadd_ps(factors[0], _mm256_cvtepi32_ps(integer), totals[j]);
                }
                if has_minimums {
                    offsets[j] = _mm256_fmadd_ps(
                        minimums,
                        _mm256_set1_ps(inputs.sums[j][block]),
                        offsets[j],
                    );
                }
            }
        }
        let mut lines = [[0f32; 8]; X];
        for (j, line) in lines.iter_mut().enumerate() {
            let result = _mm256_add_ps(totals[j], offsets[j]);
            // SAFETY: `line` is 8 writable floats.
            unsafe { _mm256_storeu_ps(line.as_mut_ptr(), result) };
        }
        lines
    }

    /// The 8 scales (or minimums) of half `half` of the set of 16 at `at`: f32 for the K-quants, f16 otherwise.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C, and `at` must point at the set's 64 (`wide`) or 32 readable bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn half_scale_set(at: *const u8, half: usize, wide: bool) -> __m256 {
        // SAFETY: the contract's bytes are readable; unaligned loads of 8 lanes at the half's offset.
        unsafe {
            if wide {
                _mm256_loadu_ps(at.add(32 * half) as *const f32)
            } else {
                _mm256_cvtph_ps(_mm_loadu_si128(at.add(16 * half) as *const __m128i))
            }
        }
    }

    /// The exact sums of four products of each 32-bit lane of `value` (stored weights) with the four bytes of
    /// `x` (the same in every lane).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn dot<const F: u8>(value: __m256i, x: __m256i) -> __m256i {
        let pairs = if F == FORMAT_Q8_0 {
            // |w| times x with w's sign: 2 · 128 · 127 < 32767, no saturation.
            _mm256_maddubs_epi16(_mm256_sign_epi8(value, value), _mm256_sign_epi8(x, value))
        } else {
            // Unsigned weights of at most 63 (Q6_K; 31 for the 5-bit formats): 2 · 63 · 128 < 32767.
            _mm256_maddubs_epi16(value, x)
        };
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
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
