//! The quantised matmul kernels against a scalar f32 reference and against candle, on seeded random blocks.
//!
//! Tolerance: the kernels quantise each activation block of 32 values to 8 bits with step `d = max|x| / 127`, so
//! each activation moves by at most `d / 2`. An output element therefore differs from the exact product by at most
//! `Σ_blocks (d_block / 2) · Σ_j |w_j|`, plus float rounding (bounded by 1e-5 of `Σ|w·x|` here). Every comparison
//! with a dequantised reference uses exactly that bound, computed per element, so it can fail on a real error
//! (a wrong nibble, bit or scale moves an element by far more) but not on the quantisation the method implies.
//! Wide activations (a residual byte per value) move each value by at most `d / 256`, with `d` rounded to f16
//! (2^-11 relative at most for the normal f16 scales of these inputs): their bound is the same sum on that step.

use std::borrow::Cow;
use std::num::NonZeroUsize;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use stage_server::kernels::{
    ActivationPrecision, Linear, QuantizedActivations, QuantizedMatrix, SimdLevel, Threads,
    WIDE_FACTOR, WeightFormat,
};

/// Both activation precisions: every invariance below must hold for each.
const PRECISIONS: [ActivationPrecision; 2] = [ActivationPrecision::Byte, ActivationPrecision::Wide];

/// (out_features, in_features): odd row counts, partial quads, widths that are not multiples of 256.
const SHAPES: [(usize, usize); 7] = [
    (1, 32),
    (5, 96),
    (7, 640),
    (13, 160),
    (64, 576),
    (129, 640),
    (31, 1536),
];

/// (out_features, in_features) for the K-quants, whose rows are whole super-blocks of 256 values.
const K_SHAPES: [(usize, usize); 6] = [
    (1, 256),
    (5, 512),
    (13, 256),
    (64, 768),
    (129, 1024),
    (31, 2048),
];

/// The shapes a format is tested at.
fn shapes(format: WeightFormat) -> &'static [(usize, usize)] {
    if format.ggml_block_weights() == 32 {
        &SHAPES
    } else {
        &K_SHAPES
    }
}

/// Activation rows per product: decode, a small batch, and one that leaves partial tiles at every level.
const BATCHES: [usize; 3] = [1, 3, 9];

/// Random ggml blocks of `format`: random nibbles, fifth and high bits, signed bytes and sub-block scales, with
/// f16 scales of both signs.
fn random_blocks(format: WeightFormat, blocks: usize, rng: &mut StdRng) -> Vec<u8> {
    let block_bytes = format.ggml_block_bytes();
    let mut bytes = Vec::with_capacity(blocks * block_bytes);
    let f16_bytes = |value: f32| half::f16::from_f32(value).to_bits().to_le_bytes();
    for _ in 0..blocks {
        let start = bytes.len();
        match format {
            WeightFormat::Q6_K => {
                // Scales of up to ±128 per 16 weights times `d`.
                while bytes.len() - start < block_bytes - 2 {
                    bytes.push(rng.random());
                }
                bytes.extend_from_slice(&f16_bytes(rng.random_range(-0.0005f32..0.0005)));
            }
            WeightFormat::Q4_K | WeightFormat::Q5_K => {
                // 6-bit scales and minimums of up to 63 times `d` and `dmin`.
                bytes.extend_from_slice(&f16_bytes(rng.random_range(-0.001f32..0.001)));
                bytes.extend_from_slice(&f16_bytes(rng.random_range(-0.01f32..0.01)));
                while bytes.len() - start < block_bytes {
                    bytes.push(rng.random());
                }
            }
            _ => {
                bytes.extend_from_slice(&f16_bytes(rng.random_range(-0.05f32..0.05)));
                if matches!(format, WeightFormat::Q4_1 | WeightFormat::Q5_1) {
                    bytes.extend_from_slice(&f16_bytes(rng.random_range(-0.5f32..0.5)));
                }
                while bytes.len() - start < block_bytes {
                    bytes.push(rng.random());
                }
            }
        }
    }
    assert_eq!(
        bytes.len(),
        blocks * block_bytes,
        "block generator wrote the wrong size"
    );
    bytes
}

fn random_tensor(format: WeightFormat, rows: usize, columns: usize, rng: &mut StdRng) -> QTensor {
    let bytes = random_blocks(format, rows * columns / format.ggml_block_weights(), rng);
    let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, format.ggml()).unwrap();
    QTensor::new(storage, (rows, columns)).unwrap()
}

fn random_input(rows: usize, columns: usize, rng: &mut StdRng) -> Vec<f32> {
    // A few large values per row, as real activations have, so block scales vary widely.
    (0..rows * columns)
        .map(|i| {
            let base = rng.random_range(-1.0f32..1.0);
            if i % 97 == 5 { base * 40.0 } else { base }
        })
        .collect()
}

/// Reads the f16 at `at`.
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Our own plain dequantisation of one ggml block, written from the ggml layout description, not from the kernels.
fn dequantize_block(format: WeightFormat, block: &[u8]) -> Vec<f32> {
    if format == WeightFormat::Q4_K {
        return dequantize_q4_k(block);
    }
    if format == WeightFormat::Q6_K {
        return dequantize_q6_k(block);
    }
    if format == WeightFormat::Q5_K {
        return dequantize_q5_k(block);
    }
    let mut out = vec![0f32; 32];
    let d = f16_at(block, 0);
    match format {
        WeightFormat::Q4_0 => {
            for j in 0..16 {
                out[j] = d * ((block[2 + j] & 15) as f32 - 8.0);
                out[j + 16] = d * ((block[2 + j] >> 4) as f32 - 8.0);
            }
        }
        WeightFormat::Q4_1 => {
            let m = f16_at(block, 2);
            for j in 0..16 {
                out[j] = d * (block[4 + j] & 15) as f32 + m;
                out[j + 16] = d * (block[4 + j] >> 4) as f32 + m;
            }
        }
        WeightFormat::Q5_0 => {
            let high = u32::from_le_bytes(block[2..6].try_into().unwrap());
            for j in 0..16 {
                let low = (block[6 + j] & 15) as u32 | (((high >> j) & 1) << 4);
                let upper = (block[6 + j] >> 4) as u32 | (((high >> (j + 16)) & 1) << 4);
                out[j] = d * (low as f32 - 16.0);
                out[j + 16] = d * (upper as f32 - 16.0);
            }
        }
        WeightFormat::Q5_1 => {
            let m = f16_at(block, 2);
            let high = u32::from_le_bytes(block[4..8].try_into().unwrap());
            for j in 0..16 {
                let low = (block[8 + j] & 15) as u32 | (((high >> j) & 1) << 4);
                let upper = (block[8 + j] >> 4) as u32 | (((high >> (j + 16)) & 1) << 4);
                out[j] = d * low as f32 + m;
                out[j + 16] = d * upper as f32 + m;
            }
        }
        WeightFormat::Q8_0 => {
            for j in 0..32 {
                out[j] = d * (block[2 + j] as i8) as f32;
            }
        }
        other => panic!("test reference lacks format {other:?}"),
    }
    out
}

/// The 6-bit scale and minimum of sub-block `index` of a Q4_K or Q5_K super-block, from its 12 scale bytes as
/// ggml's `get_scale_min_k4` unpacks them.
fn scale_and_minimum_k4(scales: &[u8], index: usize) -> (u8, u8) {
    if index < 4 {
        (scales[index] & 63, scales[index + 4] & 63)
    } else {
        (
            (scales[index + 4] & 0xF) | ((scales[index - 4] >> 6) << 4),
            (scales[index + 4] >> 4) | ((scales[index] >> 6) << 4),
        )
    }
}

/// The step `d·scale` and offset `dmin·minimum` of sub-block `index` of a Q4_K or Q5_K super-block (both start
/// with `d`, `dmin` and the 12 scale bytes).
fn step_and_offset_k4(block: &[u8], index: usize) -> (f32, f32) {
    let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
    let (scale, minimum) = scale_and_minimum_k4(&block[4..16], index);
    (d * scale as f32, dmin * minimum as f32)
}

/// A Q4_K super-block as ggml's `dequantize_row_q4_K` walks it: four runs of 64 weights, each the low then the
/// high nibbles of 32 bytes, with the 6-bit scale and minimum pairs unpacked from the 12 scale bytes.
fn dequantize_q4_k(block: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(256);
    for run in 0..4 {
        let bytes = &block[16 + 32 * run..16 + 32 * run + 32];
        let (low_step, low_offset) = step_and_offset_k4(block, 2 * run);
        let (high_step, high_offset) = step_and_offset_k4(block, 2 * run + 1);
        out.extend(
            bytes
                .iter()
                .map(|b| low_step * (b & 0xF) as f32 - low_offset),
        );
        out.extend(
            bytes
                .iter()
                .map(|b| high_step * (b >> 4) as f32 - high_offset),
        );
    }
    out
}

/// A Q5_K super-block as ggml's `dequantize_row_q5_K` walks it: Q4_K's runs of 64 over the 128 nibble bytes that
/// follow 32 bytes of high bits, run `r` taking bits `2r` (its low nibbles) and `2r + 1` (its high ones) of each.
fn dequantize_q5_k(block: &[u8]) -> Vec<f32> {
    let high = &block[16..48];
    let mut out = Vec::with_capacity(256);
    let (mut low_bit, mut high_bit) = (1u8, 2u8);
    for run in 0..4 {
        let bytes = &block[48 + 32 * run..48 + 32 * run + 32];
        let (low_step, low_offset) = step_and_offset_k4(block, 2 * run);
        let (high_step, high_offset) = step_and_offset_k4(block, 2 * run + 1);
        out.extend(bytes.iter().zip(high).map(|(b, h)| {
            let fifth = if h & low_bit != 0 { 16.0 } else { 0.0 };
            low_step * ((b & 0xF) as f32 + fifth) - low_offset
        }));
        out.extend(bytes.iter().zip(high).map(|(b, h)| {
            let fifth = if h & high_bit != 0 { 16.0 } else { 0.0 };
            high_step * ((b >> 4) as f32 + fifth) - high_offset
        }));
        low_bit <<= 2;
        high_bit <<= 2;
    }
    out
}

/// A Q6_K super-block as ggml's `dequantize_row_q6_K` walks it: two halves of 128 weights, each from 64 bytes of
/// low nibbles, 32 bytes of high bit pairs and 8 signed scales of 16 weights.
fn dequantize_q6_k(block: &[u8]) -> Vec<f32> {
    let d = f16_at(block, 208);
    let mut out = vec![0f32; 256];
    for half in 0..2 {
        let low = &block[64 * half..64 * half + 64];
        let high = &block[128 + 32 * half..128 + 32 * half + 32];
        let scales = &block[192 + 8 * half..192 + 8 * half + 8];
        let weights = &mut out[128 * half..128 * half + 128];
        for at in 0..32 {
            let scale = at / 16;
            let q1 = ((low[at] & 0xF) | ((high[at] & 3) << 4)) as i32 - 32;
            let q2 = ((low[at + 32] & 0xF) | (((high[at] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((low[at] >> 4) | (((high[at] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((low[at + 32] >> 4) | (((high[at] >> 6) & 3) << 4)) as i32 - 32;
            weights[at] = d * (scales[scale] as i8) as f32 * q1 as f32;
            weights[at + 32] = d * (scales[scale + 2] as i8) as f32 * q2 as f32;
            weights[at + 64] = d * (scales[scale + 4] as i8) as f32 * q3 as f32;
            weights[at + 96] = d * (scales[scale + 6] as i8) as f32 * q4 as f32;
        }
    }
    out
}

fn dequantize(format: WeightFormat, bytes: &[u8], rows: usize, columns: usize) -> Vec<f32> {
    let weights: Vec<f32> = bytes
        .chunks_exact(format.ggml_block_bytes())
        .flat_map(|block| dequantize_block(format, block))
        .collect();
    assert_eq!(weights.len(), rows * columns, "dequantised size");
    weights
}

/// The exact product in f64 and, per element, the bound on what activations quantised at `precision` may change
/// (see the file doc).
fn reference(
    weights: &[f32],
    input: &[f32],
    rows: usize,
    columns: usize,
    precision: ActivationPrecision,
) -> Vec<(f64, f64)> {
    let batch = input.len() / columns;
    let mut result = Vec::with_capacity(batch * rows);
    for x in input.chunks_exact(columns) {
        for w in weights.chunks_exact(columns) {
            let mut exact = 0f64;
            let mut magnitude = 0f64;
            let mut quantisation = 0f64;
            for (w_block, x_block) in w.chunks_exact(32).zip(x.chunks_exact(32)) {
                let byte_step = x_block.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                let step = match precision {
                    ActivationPrecision::Byte => byte_step,
                    // The residual's step is d / WIDE_FACTOR with d rounded to f16.
                    ActivationPrecision::Wide => {
                        byte_step * (1.0 + 1.0 / 2048.0) / f64::from(WIDE_FACTOR)
                    }
                    other => panic!("no quantisation bound for {other:?} activations"),
                };
                let mut block_weight = 0f64;
                for (a, b) in w_block.iter().zip(x_block) {
                    exact += *a as f64 * *b as f64;
                    magnitude += (*a as f64 * *b as f64).abs();
                    block_weight += (*a as f64).abs();
                }
                quantisation += step / 2.0 * block_weight;
            }
            result.push((exact, quantisation * 1.001 + magnitude * 1e-5 + 1e-6));
        }
    }
    result
}

fn run(
    matrix: &QuantizedMatrix,
    input: &[f32],
    batch: usize,
    level: SimdLevel,
    threads: Threads,
) -> Vec<f32> {
    let mut output = vec![f32::NAN; batch * matrix.out_features()];
    matrix
        .matmul(input, batch, &mut output, level, threads)
        .unwrap();
    output
}

/// The levels this CPU runs; the others are named in the output, since their kernels go untested here.
fn levels() -> Vec<SimdLevel> {
    let (levels, missing): (Vec<SimdLevel>, Vec<SimdLevel>) = SimdLevel::ALL
        .into_iter()
        .partition(|level| level.is_available());
    if !missing.is_empty() {
        eprintln!("not testing the {missing:?} kernels: this CPU cannot run them");
    }
    levels
}

fn threads(count: usize) -> Threads {
    Threads::Exactly(NonZeroUsize::new(count).unwrap())
}

#[test]
fn every_kernel_matches_the_dequantised_reference_within_the_activation_quantisation_bound() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0001);
    for format in WeightFormat::ALL {
        for &(rows, columns) in shapes(format) {
            let tensor = random_tensor(format, rows, columns, &mut rng);
            let weights = dequantize(format, &tensor.data().unwrap(), rows, columns);
            let byte = QuantizedMatrix::new(Arc::new(tensor)).unwrap();
            for precision in PRECISIONS {
                let matrix = byte.clone().with_precision(precision);
                for batch in BATCHES {
                    let input = random_input(batch, columns, &mut rng);
                    let expected = reference(&weights, &input, rows, columns, precision);
                    for level in levels() {
                        let got = run(&matrix, &input, batch, level, threads(1));
                        for (index, (value, (exact, bound))) in
                            got.iter().zip(&expected).enumerate()
                        {
                            let error = (*value as f64 - exact).abs();
                            assert!(
                                error <= *bound,
                                "{format:?} {rows}x{columns} batch {batch} at {level:?}, {precision:?} activations: \
                                 element {index} is {value}, exact {exact}, error {error} exceeds the quantisation \
                                 bound {bound}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn every_simd_level_gives_the_scalar_kernels_bits() {
    // Every level sums the same integers per row and block and applies the same float operations in the same
    // order (packed.rs, x86.rs), so a product does not depend on the CPU it ran on. Levels this CPU lacks are
    // named by `levels()`; the scalar kernel runs everywhere.
    let mut rng = StdRng::seed_from_u64(0x5eed_0002);
    for format in WeightFormat::ALL {
        for &(rows, columns) in shapes(format) {
            let byte =
                QuantizedMatrix::new(Arc::new(random_tensor(format, rows, columns, &mut rng)))
                    .unwrap();
            for (precision, batch) in PRECISIONS
                .into_iter()
                .flat_map(|precision| BATCHES.map(|batch| (precision, batch)))
            {
                let matrix = byte.clone().with_precision(precision);
                let input = random_input(batch, columns, &mut rng);
                let scalar = run(&matrix, &input, batch, SimdLevel::Scalar, threads(1));
                for level in levels() {
                    let got = run(&matrix, &input, batch, level, threads(1));
                    let differing: Vec<usize> = got
                        .iter()
                        .zip(&scalar)
                        .enumerate()
                        .filter(|(_, (a, b))| a.to_bits() != b.to_bits())
                        .map(|(index, _)| index)
                        .collect();
                    assert!(
                        differing.is_empty(),
                        "{format:?} {rows}x{columns} batch {batch}, {precision:?} activations: {} outputs at \
                         {level:?} differ from the scalar kernel's bits, the first at {:?}: {} against {}",
                        differing.len(),
                        differing.first(),
                        differing.first().map_or(0.0, |&index| got[index]),
                        differing.first().map_or(0.0, |&index| scalar[index]),
                    );
                }
            }
        }
    }
}

/// Whether two quantisations hold the same bytes, integers and float bits (a NaN scale or sum equals itself).
fn same_bits(a: &QuantizedActivations, b: &QuantizedActivations) -> bool {
    let bits = |values: &[f32]| {
        values
            .iter()
            .map(|value| value.to_bits())
            .collect::<Vec<_>>()
    };
    a.rows() == b.rows()
        && a.blocks_per_row() == b.blocks_per_row()
        && a.is_wide() == b.is_wide()
        && (0..a.rows()).all(|row| {
            a.row_values(row) == b.row_values(row)
                && a.row_residuals(row) == b.row_residuals(row)
                && a.row_half_sums(row) == b.row_half_sums(row)
                && bits(a.row_scales(row)) == bits(b.row_scales(row))
                && bits(a.row_sums(row)) == bits(b.row_sums(row))
        })
}

#[test]
fn activation_quantisation_is_bit_identical_at_every_simd_level() {
    let mut rng = StdRng::seed_from_u64(11);
    let width = 640;
    let rows = 7;
    let mut input = random_input(rows, width, &mut rng);
    // Values that land exactly halfway between two steps (the tie rule must hold at every level),
    // an all-zero block, a block of one sign and a block with a huge outlier.
    for (index, value) in input[..32].iter_mut().enumerate() {
        *value = (index as f32 - 16.0) + 0.5;
    }
    input[31] = 127.0;
    input[32..64].fill(0.0);
    for value in &mut input[64..96] {
        *value = -value.abs();
    }
    input[100] = 3.0e6;
    // Blocks the vector code hands to the portable code, or must clamp as it does: an infinity, a NaN, values
    // whose scale is an f16 subnormal (residuals past ±72 steps, held by the clamp), and a maximum whose scale
    // overflows f16 to infinity.
    input[160] = f32::INFINITY;
    input[200] = f32::NAN;
    for (index, value) in input[224..256].iter_mut().enumerate() {
        *value = (index as f32 - 15.3) * 1.0e-6;
    }
    input[256..288].fill(1.0);
    input[260] = 1.0e7;
    let scalar = QuantizedActivations::quantize_at(SimdLevel::Scalar, &input, rows, width);
    let scalar_wide =
        QuantizedActivations::quantize_wide_at(SimdLevel::Scalar, &input, rows, width);
    for level in levels() {
        let quantised = QuantizedActivations::quantize_at(level, &input, rows, width);
        assert!(
            same_bits(&quantised, &scalar),
            "quantising activations at {level:?} gave different bytes, scales or sums than the portable code"
        );
        let wide = QuantizedActivations::quantize_wide_at(level, &input, rows, width);
        assert!(
            same_bits(&wide, &scalar_wide),
            "quantising activations wide at {level:?} gave different bytes, residuals, scales or sums than the \
             portable code"
        );
    }
    // The wide form keeps the first bytes and adds the rounding error, on a step 128 times finer: every value
    // is recovered to within half that step (with `d` rounded to f16, 2^-11 relative at most).
    assert!(scalar_wide.is_wide() && !scalar.is_wide());
    for row in 0..rows {
        assert_eq!(scalar_wide.row_values(row), scalar.row_values(row));
        for (block, chunk) in input[row * width..(row + 1) * width]
            .chunks_exact(32)
            .enumerate()
        {
            assert_eq!(
                scalar_wide.row_scales(row)[block],
                scalar.row_scales(row)[block]
            );
            let residuals = &scalar_wide.row_residuals(row)[block * 32..(block + 1) * 32];
            let firsts = &scalar_wide.row_values(row)[block * 32..(block + 1) * 32];
            for half in 0..2 {
                let range = 16 * half..16 * half + 16;
                assert_eq!(
                    scalar.row_half_sums(row)[2 * block + half],
                    firsts[range.clone()]
                        .iter()
                        .map(|&q| i32::from(q))
                        .sum::<i32>(),
                    "row {row} block {block} half {half}: the half sum is not the sum of the half's values"
                );
                assert_eq!(
                    scalar_wide.row_half_sums(row)[2 * block + half],
                    firsts[range.clone()]
                        .iter()
                        .zip(&residuals[range])
                        .map(|(&q, &r)| WIDE_FACTOR * i32::from(q) + i32::from(r))
                        .sum::<i32>(),
                    "row {row} block {block} half {half}: the wide sum is not the sum of the half's whole values"
                );
            }
            let step = scalar_wide.row_scales(row)[block] / WIDE_FACTOR as f32;
            let maximum = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            // The special blocks above are not held to the bound: an infinity or a NaN has no finite error, and a
            // scale that is an f16 subnormal or infinite is not within 2^-11 of `max / 127`.
            if row == 0 && (5..9).contains(&block) {
                continue;
            }
            for (index, &x) in chunk.iter().enumerate() {
                let at = block * 32 + index;
                let combined = WIDE_FACTOR * i32::from(scalar_wide.row_values(row)[at])
                    + i32::from(scalar_wide.row_residuals(row)[at]);
                let error = (combined as f32 * step - x).abs();
                assert!(
                    error <= maximum / 127.0 / 256.0 * 1.001 + maximum * 1e-6,
                    "row {row} value {at}: {x} came back as {} (residual {})",
                    combined as f32 * step,
                    scalar_wide.row_residuals(row)[at]
                );
            }
        }
    }
    assert!(
        scalar.row_values(0)[..31]
            .iter()
            .zip(&input[..31])
            .all(|(&q, &x)| (f32::from(q) - x).abs() == 0.5),
        "the halfway values of the first block must round to a neighbouring integer"
    );
    // Blocks holding an infinity of either sign or a NaN (a model gone wrong must still quantise the same way
    // everywhere; the stage reports the non-finite rows afterwards). Compared by bits: a NaN sum is not equal to
    // itself.
    // And a block of values so small that 127 / max overflows (its products are zero either way).
    for (index, value) in input[288..320].iter_mut().enumerate() {
        *value = (index as f32 - 15.5) * 1.0e-39;
    }
    input[130] = f32::INFINITY;
    input[170] = f32::NAN;
    input[200] = f32::NEG_INFINITY;
    input[260] = f32::NAN;
    input[261] = f32::INFINITY;
    let bits = |values: &[f32]| {
        values
            .iter()
            .map(|value| value.to_bits())
            .collect::<Vec<_>>()
    };
    let scalar = QuantizedActivations::quantize_at(SimdLevel::Scalar, &input, rows, width);
    let scalar_wide =
        QuantizedActivations::quantize_wide_at(SimdLevel::Scalar, &input, rows, width);
    for level in levels() {
        let quantised = QuantizedActivations::quantize_at(level, &input, rows, width);
        let wide = QuantizedActivations::quantize_wide_at(level, &input, rows, width);
        for row in 0..rows {
            assert!(
                wide.row_values(row) == scalar_wide.row_values(row)
                    && wide.row_residuals(row) == scalar_wide.row_residuals(row)
                    && wide.row_half_sums(row) == scalar_wide.row_half_sums(row)
                    && bits(wide.row_scales(row)) == bits(scalar_wide.row_scales(row))
                    && bits(wide.row_sums(row)) == bits(scalar_wide.row_sums(row)),
                "quantising non-finite or tiny activations wide at {level:?} gave different bytes, residuals, \
                 half sums, scales or sums than the portable code in row {row}"
            );
            assert!(
                quantised.row_values(row) == scalar.row_values(row)
                    && quantised.row_half_sums(row) == scalar.row_half_sums(row)
                    && bits(quantised.row_scales(row)) == bits(scalar.row_scales(row))
                    && bits(quantised.row_sums(row)) == bits(scalar.row_sums(row)),
                "quantising non-finite or tiny activations at {level:?} gave different bytes, half sums, \
                 scales or sums than the portable code in row {row}"
            );
        }
    }
}

#[test]
fn results_are_bit_identical_for_every_thread_count() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0003);
    for format in WeightFormat::ALL {
        // Large enough to be split across threads (the kernel runs small products on one thread).
        for (rows, columns, batch) in [(259, 640usize, 1), (130, 576, 5), (67, 1536, 2)] {
            let columns: usize = columns.next_multiple_of(format.ggml_block_weights());
            let tensor = random_tensor(format, rows, columns, &mut rng);
            let byte = QuantizedMatrix::new(Arc::new(tensor)).unwrap();
            let input = random_input(batch, columns, &mut rng);
            for (precision, level) in PRECISIONS
                .into_iter()
                .flat_map(|precision| levels().into_iter().map(move |level| (precision, level)))
            {
                let matrix = byte.clone().with_precision(precision);
                let one = run(&matrix, &input, batch, level, threads(1));
                for other in [threads(2), threads(3), threads(7), Threads::Pool] {
                    let got = run(&matrix, &input, batch, level, other);
                    let same = one
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{format:?} {rows}x{columns} at {level:?}, {precision:?} activations: {other:?} differs \
                         from one thread"
                    );
                }
            }
        }
    }
}

#[test]
fn a_row_computed_inside_a_batch_is_bit_identical_to_the_row_computed_alone() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0009);
    for format in WeightFormat::ALL {
        // 67 rows leave a partial quad; 5 blocks per row is odd, 48 is even; the larger shape is split over threads.
        for (rows, columns) in [(67, 160usize), (130, 1536)] {
            let columns: usize = columns.next_multiple_of(format.ggml_block_weights());
            let tensor = random_tensor(format, rows, columns, &mut rng);
            let byte = QuantizedMatrix::new(Arc::new(tensor)).unwrap();
            // Every way the SIMD kernels cut a batch: tiles of four, a pair, a single row, and all three (7).
            for batch in [2, 3, 5, 7, 9, 17] {
                let input = random_input(batch, columns, &mut rng);
                for (precision, level) in PRECISIONS
                    .into_iter()
                    .flat_map(|precision| levels().into_iter().map(move |level| (precision, level)))
                {
                    let matrix = byte.clone().with_precision(precision);
                    let alone: Vec<Vec<f32>> = input
                        .chunks_exact(columns)
                        .map(|row| run(&matrix, row, 1, level, threads(1)))
                        .collect();
                    for count in [threads(1), threads(3), Threads::Pool] {
                        let together = run(&matrix, &input, batch, level, count);
                        for (x, (in_batch, single)) in
                            together.chunks_exact(rows).zip(&alone).enumerate()
                        {
                            let first_difference = in_batch
                                .iter()
                                .zip(single)
                                .position(|(a, b)| a.to_bits() != b.to_bits());
                            assert_eq!(
                                first_difference, None,
                                "{format:?} {rows}x{columns} at {level:?} with {count:?}, {precision:?} activations: \
                                 row {x} of a batch of {batch} differs from the same row computed alone (first at \
                                 the output index given)"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn linear_matches_candle_dequantize_and_matmul_on_quantised_random_weights() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0004);
    for dtype in [
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        for (rows, columns) in [(7, 640usize), (64, 576), (33, 1536)] {
            let columns: usize = columns.next_multiple_of(dtype.block_size());
            let values: Vec<f32> = (0..rows * columns)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let dense = Tensor::from_vec(values, (rows, columns), &Device::Cpu).unwrap();
            let quantised = QTensor::quantize(&dense, dtype).unwrap();
            let candle_weights = quantised.dequantize(&Device::Cpu).unwrap();
            let format = WeightFormat::from_ggml(dtype).unwrap();
            let our_weights = dequantize(format, &quantised.data().unwrap(), rows, columns);
            let shared = Arc::new(quantised);
            for (level, batch) in levels()
                .into_iter()
                .flat_map(|level| [(level, 1), (level, 4)])
            {
                let linear = Linear::from_arc_at(shared.clone(), level).unwrap();
                assert!(
                    linear.uses_own_kernels(),
                    "{dtype:?} should run on our kernels at {level:?}"
                );
                let input = random_input(2 * batch, columns, &mut rng);
                let x = Tensor::from_vec(input.clone(), (2, batch, columns), &Device::Cpu).unwrap();
                let got = linear.forward(&x).unwrap();
                assert_eq!(got.dims(), &[2, batch, rows], "output shape");
                let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let expected = x
                    .reshape((2 * batch, columns))
                    .unwrap()
                    .matmul(&candle_weights.t().unwrap())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let bounds = reference(
                    &our_weights,
                    &input,
                    rows,
                    columns,
                    ActivationPrecision::Byte,
                );
                for (index, ((a, b), (exact, bound))) in
                    got.iter().zip(&expected).zip(&bounds).enumerate()
                {
                    assert!(
                        ((b - *exact as f32).abs() as f64) < 1e-4 * bound.max(1.0),
                        "candle's dequantisation disagrees with ours at {index}: {b} vs {exact}"
                    );
                    assert!(
                        ((a - b).abs() as f64) <= *bound,
                        "{dtype:?} {rows}x{columns} at {level:?}: ours {a} vs candle {b} at {index}, beyond the \
                         bound {bound}"
                    );
                }
            }
        }
    }
}

#[test]
fn linear_leaves_other_k_quants_and_floats_to_candle_and_gives_its_exact_result() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0005);
    for dtype in [
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::F32,
        GgmlDType::F16,
    ] {
        let (rows, columns) = (16, 256);
        let values: Vec<f32> = (0..rows * columns)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let dense = Tensor::from_vec(values, (rows, columns), &Device::Cpu).unwrap();
        let quantised = QTensor::quantize(&dense, dtype).unwrap();
        let reference = candle_core::quantized::QMatMul::from_qtensor(
            QTensor::quantize(&dense, dtype).unwrap(),
        )
        .unwrap();
        let linear = Linear::from_qtensor(quantised).unwrap();
        assert!(
            !linear.uses_own_kernels(),
            "{dtype:?} should stay on candle's QMatMul"
        );
        let x = Tensor::from_vec(
            random_input(3, columns, &mut rng),
            (3, columns),
            &Device::Cpu,
        )
        .unwrap();
        let got = linear.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        let expected = reference.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(got, expected, "{dtype:?}: Linear must be candle's QMatMul");
    }
}

#[test]
fn a_wide_linear_runs_our_kernels_and_gives_the_wide_matrix_bits_while_candle_layers_stay_byte() {
    let mut rng = StdRng::seed_from_u64(0x5eed_000b);
    // 512 x 32 is the shape candle repacks for VNNI, where a Byte Q8_0 layer runs candle's product.
    for (dtype, rows, columns) in [
        (GgmlDType::Q8_0, 32, 512),
        (GgmlDType::Q8_0, 37, 640),
        (GgmlDType::Q4_1, 37, 640),
    ] {
        let values: Vec<f32> = (0..rows * columns)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let dense = Tensor::from_vec(values, (rows, columns), &Device::Cpu).unwrap();
        let shared = Arc::new(QTensor::quantize(&dense, dtype).unwrap());
        let input = random_input(3, columns, &mut rng);
        let wide_matrix = QuantizedMatrix::new(shared.clone())
            .unwrap()
            .with_precision(ActivationPrecision::Wide);
        let expected = run(&wide_matrix, &input, 3, SimdLevel::Scalar, threads(1));
        for level in levels() {
            let linear = Linear::from_arc_at(shared.clone(), level)
                .unwrap()
                .with_activation_precision(ActivationPrecision::Wide);
            assert!(
                linear.uses_own_kernels(),
                "a wide {dtype:?} {rows}x{columns} layer must run our kernels at {level:?}"
            );
            assert_eq!(linear.activation_precision(), ActivationPrecision::Wide);
            let got = linear.forward_rows(&input, 3).unwrap();
            assert!(
                got.iter()
                    .zip(&expected)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "a wide {dtype:?} {rows}x{columns} layer at {level:?} differs from the wide matrix's bits"
            );
        }
    }
    let dense = Tensor::from_vec(
        (0..16 * 256)
            .map(|index| (index % 7) as f32 - 3.0)
            .collect::<Vec<_>>(),
        (16, 256),
        &Device::Cpu,
    )
    .unwrap();
    let k_quant = Linear::from_qtensor(QTensor::quantize(&dense, GgmlDType::Q3K).unwrap())
        .unwrap()
        .with_activation_precision(ActivationPrecision::Wide);
    assert!(!k_quant.uses_own_kernels());
    assert_eq!(
        k_quant.activation_precision(),
        ActivationPrecision::Byte,
        "candle's K-quant products quantise their own way, reported as 8-bit"
    );
}

#[test]
fn linear_runs_q4_0_and_q8_0_heads_on_our_kernels() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0007);
    // 640 values per row (gemma's width) is not a multiple of 256, so candle would not repack Q8_0 either.
    for dtype in [GgmlDType::Q4_0, GgmlDType::Q8_0] {
        let (rows, columns) = (37, 640);
        let values: Vec<f32> = (0..rows * columns)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let dense = Tensor::from_vec(values, (rows, columns), &Device::Cpu).unwrap();
        let quantised = QTensor::quantize(&dense, dtype).unwrap();
        let format = WeightFormat::from_ggml(dtype).unwrap();
        let weights = dequantize(format, &quantised.data().unwrap(), rows, columns);
        // Shared with an embedding lookup, as a tied output head is.
        let shared = Arc::new(quantised);
        let input = random_input(2, columns, &mut rng);
        let x = Tensor::from_vec(input.clone(), (2, columns), &Device::Cpu).unwrap();
        let expected = reference(&weights, &input, rows, columns, ActivationPrecision::Byte);
        for level in levels() {
            let linear = Linear::from_arc_at(shared.clone(), level).unwrap();
            assert!(
                linear.uses_own_kernels(),
                "{dtype:?} should run on our kernels at {level:?}"
            );
            assert_eq!(
                (linear.out_features(), linear.in_features()),
                (rows, columns),
                "{dtype:?}: the layer's shape"
            );
            let got = linear
                .forward(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for (index, (value, (exact, bound))) in got.iter().zip(&expected).enumerate() {
                assert!(
                    (*value as f64 - exact).abs() <= *bound,
                    "{dtype:?} at {level:?}: element {index} is {value}, exact {exact}, beyond the bound {bound}"
                );
            }
        }
    }
}

#[test]
fn linear_gives_a_row_the_same_bits_alone_and_inside_a_batch_at_every_level() {
    // Linear may run one row at another level than a batch (AVX2 for a single Q8_0 row on an AVX-512 CPU); a
    // decode step must still give the bits the same position gets in a prefill.
    let mut rng = StdRng::seed_from_u64(0x5eed_000a);
    for format in WeightFormat::ALL {
        let (rows, columns, batch) = (
            37,
            640usize.next_multiple_of(format.ggml_block_weights()),
            5,
        );
        let tensor = Arc::new(random_tensor(format, rows, columns, &mut rng));
        let input = random_input(batch, columns, &mut rng);
        for level in levels() {
            let linear = Linear::from_arc_at(tensor.clone(), level).unwrap();
            let product = |values: &[f32], count: usize| {
                let x = Tensor::from_vec(values.to_vec(), (count, columns), &Device::Cpu).unwrap();
                linear
                    .forward(&x)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            let together = product(&input, batch);
            for row in 0..batch {
                let alone = product(&input[row * columns..(row + 1) * columns], 1);
                let inside = &together[row * rows..(row + 1) * rows];
                assert!(
                    alone
                        .iter()
                        .zip(inside)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{format:?} at {level:?}: row {row} alone differs from the same row inside a batch of {batch}"
                );
            }
        }
    }
}

#[test]
fn linear_refuses_a_level_this_cpu_cannot_run() {
    let mut rng = StdRng::seed_from_u64(0x5eed_000b);
    let tensor = Arc::new(random_tensor(WeightFormat::Q4_1, 4, 64, &mut rng));
    for level in SimdLevel::ALL {
        let result = Linear::from_arc_at(tensor.clone(), level);
        assert_eq!(
            result.is_ok(),
            level.is_available(),
            "Linear::from_arc_at at {level:?} gave {result:?}, though this CPU {} run it",
            if level.is_available() {
                "can"
            } else {
                "cannot"
            }
        );
    }
}

#[test]
fn mismatched_shapes_and_unknown_types_are_errors_not_panics() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0006);
    let matrix =
        QuantizedMatrix::new(Arc::new(random_tensor(WeightFormat::Q4_1, 4, 64, &mut rng))).unwrap();
    let mut output = vec![0f32; 4];
    let error = matrix
        .matmul(&[0.0; 63], 1, &mut output, SimdLevel::Scalar, Threads::Pool)
        .unwrap_err();
    assert!(
        error.to_string().contains("does not fit"),
        "unexpected error text: {error}"
    );
    let dense = Tensor::zeros((4, 256), candle_core::DType::F32, &Device::Cpu).unwrap();
    let q3k = QTensor::quantize(&dense, GgmlDType::Q3K).unwrap();
    let error = QuantizedMatrix::new(Arc::new(q3k)).unwrap_err();
    assert!(
        error.to_string().contains("no kernel for weight type"),
        "unexpected error text: {error}"
    );
}

#[test]
fn layers_can_be_shared_between_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Linear>();
    shareable::<QuantizedMatrix>();
}
