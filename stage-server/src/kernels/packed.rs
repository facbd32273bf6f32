//! Weights repacked at load time into groups of 16 rows, so one vector register holds four weights of each of 16 rows.
//!
//! The ggml layout stores each row's blocks one after another. A kernel reading it multiplies one row's block by
//! the activation in a register of 8 partial sums and must reduce them (or carry 8 float accumulators per
//! output) for every output element, so its float work grows with rows x activation rows. In the packed layout,
//! lane `r` of a register is row `r` of the group: a multiply-add of a register of weights with four activation
//! bytes broadcast to every lane advances 16 (AVX-512) or 8 (AVX2) outputs at once, the integer sum of a block
//! ends complete in its lane, and the per-block float work (convert, scale, accumulate) is one instruction for
//! 16 outputs. ggml does the same for its AMX and repacked CPU buffers.
//!
//! ```text
//!   group g, block b (16 rows x 32 weights), in order:
//!     scales   16 x f16, or 16 x f32 for the K-quants    (32 or 64 bytes)
//!     halves   16 x f32, Q6_K only: the scales of weights 16..32 (the first set then covers 0..16)
//!     minimums 16 x f16 (Q4_1, Q5_1) or f32 (Q4_K, Q5_K) (32 or 64 bytes)
//!     fifths   8 x u64, Q5_0, Q5_1, Q5_K only (64 bytes): bit 4r+t of word k is the fifth bit of row r's weight 4k+t
//!     values   Q4/Q5: 4 x 64 bytes, byte 4r+t of chunk c holds row r's weight 8c+t (low nibble) and 8c+4+t (high)
//!              Q8_0, Q6_K: 8 x 64 bytes, byte 4r+t of chunk k holds row r's weight 4k+t plus the centre
//! ```
//!
//! Every stored value is unsigned: the weight is `scale * (value - centre) + minimum` with the centre 8 (Q4_0),
//! 16 (Q5_0), 32 (Q6_K), 128 (Q8_0) or 0. The kernels take `Σ value·x` with an unsigned-by-signed multiply and
//! subtract `centre·Σx` in integers, which is exact, so every level computes the same integer per row and block.
//! For the 32-weight formats a group holds as many bytes as its 16 rows did in the ggml layout; rows past the
//! matrix's end (up to 15, in the last group) are zero. The K-quants' scales are products of the super-block's
//! f16 scale by a sub-block's small integer, exact in f32 but not in f16, so they are stored as f32 and Q6_K's
//! six-bit values as bytes: a Q4_K group takes 6 bits per weight (4.5 in ggml's layout), a Q5_K group 7 (5.5), a Q6_K group 10 (6.56),
//! for kernels that read them as they read Q4_1 and Q8_0.

use super::arena::WeightBytes;
use super::format::{BLOCK, BlockScaling, WeightFormat, f16_at};

/// Weight rows per packed group: the 32-bit lanes of one AVX-512 register.
pub const GROUP: usize = 16;

/// A weight matrix in the packed layout.
#[derive(Debug, Clone)]
pub struct PackedWeights {
    format: WeightFormat,
    rows: usize,
    blocks_per_row: usize,
    /// On huge pages where the system allows (`arena.rs`): a product reads all of them.
    bytes: WeightBytes,
}

/// Where the parts of one group's block sit, in bytes from its start.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockLayout {
    /// Bytes of one group's block.
    pub bytes: usize,
    /// Whether scales and minimums are f32 (the K-quants) rather than f16.
    pub wide_scales: bool,
    /// The 16 scales of weights 16..32, when they differ from the first 16's (Q6_K).
    pub half_scales: Option<usize>,
    /// The 16 minimums (formats with an offset).
    pub minimums: Option<usize>,
    /// The 8 words of fifth bits (5-bit formats).
    pub fifths: Option<usize>,
    /// The values.
    pub values: usize,
    /// Whether the values are one byte each (Q8_0, Q6_K) rather than nibbles.
    pub byte_values: bool,
    /// What is subtracted from each stored value to give the weight's integer.
    pub centre: i32,
}

impl BlockLayout {
    /// The layout of `format`.
    pub(crate) const fn of(format: WeightFormat) -> Self {
        let (fifths, centre) = match format {
            WeightFormat::Q4_0 => (false, 8),
            WeightFormat::Q5_0 => (true, 16),
            WeightFormat::Q5_1 | WeightFormat::Q5_K => (true, 0),
            WeightFormat::Q8_0 => (false, 128),
            WeightFormat::Q6_K => (false, 32),
            WeightFormat::Q4_1 | WeightFormat::Q4_K => (false, 0),
        };
        let wide_scales = matches!(
            format,
            WeightFormat::Q4_K | WeightFormat::Q5_K | WeightFormat::Q6_K
        );
        let scale_set = if wide_scales { 4 * GROUP } else { 2 * GROUP };
        let mut at = scale_set;
        let half_scales = if format.has_half_scales() {
            at += scale_set;
            Some(at - scale_set)
        } else {
            None
        };
        let minimums = if format.has_offsets() {
            at += scale_set;
            Some(at - scale_set)
        } else {
            None
        };
        let fifths_at = if fifths {
            at += 64;
            Some(at - 64)
        } else {
            None
        };
        let byte_values = matches!(format, WeightFormat::Q8_0 | WeightFormat::Q6_K);
        let value_bytes = if byte_values { 8 * 64 } else { 4 * 64 };
        Self {
            bytes: at + value_bytes,
            wide_scales,
            half_scales,
            minimums,
            fifths: fifths_at,
            values: at,
            byte_values,
            centre,
        }
    }

    /// Writes `value` as lane `lane` of the f32 scale set at `at` (the K-quants'; the f16 sets are copied from
    /// the ggml bytes as they are).
    fn put_wide_scale(target: &mut [u8], at: usize, lane: usize, value: f32) {
        target[at + 4 * lane..at + 4 * lane + 4].copy_from_slice(&value.to_le_bytes());
    }

    /// Reads lane `lane` of the scale set at `at`.
    fn scale(&self, source: &[u8], at: usize, lane: usize) -> f32 {
        if self.wide_scales {
            f32::from_le_bytes([
                source[at + 4 * lane],
                source[at + 4 * lane + 1],
                source[at + 4 * lane + 2],
                source[at + 4 * lane + 3],
            ])
        } else {
            f16_at(source, at + 2 * lane)
        }
    }
}

impl PackedWeights {
    /// Repacks `rows` rows of `blocks_per_row` blocks of 32 weights of `format` (`ggml.len()` must be exactly the
    /// ggml bytes of those rows; for a K-quant `blocks_per_row` is a multiple of 8).
    ///
    /// Cost: one pass over the weights, and as many bytes again (the caller drops the ggml copy); more for the
    /// K-quants, whose scales are stored as f32 (the module's header).
    pub fn pack(format: WeightFormat, ggml: &[u8], rows: usize, blocks_per_row: usize) -> Self {
        let row_bytes = format.bytes_of(blocks_per_row * BLOCK);
        let per_ggml_block = format.ggml_block_weights() / BLOCK;
        assert!(
            blocks_per_row.is_multiple_of(per_ggml_block),
            "a row must hold whole ggml blocks"
        );
        assert_eq!(
            ggml.len(),
            rows * row_bytes,
            "the ggml bytes must hold exactly rows x blocks"
        );
        let layout = BlockLayout::of(format);
        let groups = rows.div_ceil(GROUP);
        let mut bytes = WeightBytes::zeroed(groups * blocks_per_row * layout.bytes);
        let mut q = [0i32; BLOCK];
        for row in 0..rows {
            let (group, lane) = (row / GROUP, row % GROUP);
            for block in 0..blocks_per_row {
                let source = &ggml
                    [row * row_bytes + (block / per_ggml_block) * format.ggml_block_bytes()..]
                    [..format.ggml_block_bytes()];
                let scaling = format.decode_block(source, block % per_ggml_block, &mut q);
                let target =
                    &mut bytes[(group * blocks_per_row + block) * layout.bytes..][..layout.bytes];
                if layout.wide_scales {
                    BlockLayout::put_wide_scale(target, 0, lane, scaling.scales[0]);
                    if let Some(at) = layout.half_scales {
                        BlockLayout::put_wide_scale(target, at, lane, scaling.scales[1]);
                    }
                    if let Some(at) = layout.minimums {
                        BlockLayout::put_wide_scale(target, at, lane, scaling.offset);
                    }
                } else {
                    // The f16 fields are copied as they are, so every bit pattern (a NaN's too) survives.
                    target[2 * lane..2 * lane + 2].copy_from_slice(&source[0..2]);
                    if let Some(at) = layout.minimums {
                        target[at + 2 * lane..at + 2 * lane + 2].copy_from_slice(&source[2..4]);
                    }
                }
                // `decode_block` centres Q4_0, Q5_0, Q6_K and Q8_0 (signed integers); stored values are unsigned.
                let stored = |j: usize| (q[j] + layout.centre) as u8;
                if layout.byte_values {
                    for j in 0..BLOCK {
                        let (chunk, t) = (j / 4, j % 4);
                        target[layout.values + chunk * 64 + 4 * lane + t] = stored(j);
                    }
                } else {
                    for j in 0..BLOCK {
                        let value = stored(j);
                        let (chunk, within) = (j / 8, j % 8);
                        let byte = &mut target[layout.values + chunk * 64 + 4 * lane + within % 4];
                        if within < 4 {
                            *byte |= value & 0x0F;
                        } else {
                            *byte |= (value & 0x0F) << 4;
                        }
                        if value & 0x10 != 0 {
                            let at = layout
                                .fifths
                                .expect("only 5-bit formats have values of 16 and above");
                            let (word, t) = (j / 4, j % 4);
                            let bit = 4 * lane + t;
                            target[at + 8 * word + bit / 8] |= 1 << (bit % 8);
                        }
                    }
                }
            }
        }
        Self {
            format,
            rows,
            blocks_per_row,
            bytes,
        }
    }

    /// The weight format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Rows of the matrix (without the zero rows that fill the last group).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Groups of [`GROUP`] rows.
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Blocks of 32 weights per row.
    pub fn blocks_per_row(&self) -> usize {
        self.blocks_per_row
    }

    /// The packed bytes, group after group, each group's blocks in order.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The integers (centred, as [`WeightFormat::decode_block`] gives them), scales and offset of row `row`'s
    /// block `block`, read back from the packed bytes: the scalar kernel's view and the tests' check of the packing.
    pub fn block(&self, row: usize, block: usize, q: &mut [i32; BLOCK]) -> BlockScaling {
        let layout = BlockLayout::of(self.format);
        let (group, lane) = (row / GROUP, row % GROUP);
        let source =
            &self.bytes[(group * self.blocks_per_row + block) * layout.bytes..][..layout.bytes];
        let scale = layout.scale(source, 0, lane);
        let half = layout
            .half_scales
            .map_or(scale, |at| layout.scale(source, at, lane));
        let offset = layout
            .minimums
            .map_or(0.0, |at| layout.scale(source, at, lane));
        for (j, value) in q.iter_mut().enumerate() {
            let stored = if layout.byte_values {
                source[layout.values + (j / 4) * 64 + 4 * lane + j % 4]
            } else {
                let (chunk, within) = (j / 8, j % 8);
                let byte = source[layout.values + chunk * 64 + 4 * lane + within % 4];
                let nibble = if within < 4 { byte & 0x0F } else { byte >> 4 };
                let fifth = layout.fifths.map_or(0, |at| {
                    let bit = 4 * lane + j % 4;
                    (source[at + 8 * (j / 4) + bit / 8] >> (bit % 8)) & 1
                });
                nibble | (fifth << 4)
            };
            *value = i32::from(stored) - layout.centre;
        }
        BlockScaling {
            scales: [scale, half],
            offset,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ggml block of every byte pattern a seed gives, with finite f16 scales.
    fn block_of(format: WeightFormat, seed: u64) -> Vec<u8> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut bytes: Vec<u8> = (0..format.ggml_block_bytes())
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 33) as u8
            })
            .collect();
        // Keep the f16 scales and minimums finite (exponent bits not all ones).
        let high_bytes: &[usize] = match format {
            WeightFormat::Q6_K => &[209],
            _ => &[1, 3],
        };
        for &at in high_bytes {
            bytes[at] &= 0x3F;
        }
        bytes
    }

    #[test]
    fn every_block_reads_back_as_the_ggml_block_decodes() {
        for format in WeightFormat::ALL {
            let per_ggml_block = format.ggml_block_weights() / BLOCK;
            for (rows, ggml_blocks) in [(1, 1), (16, 2), (17, 3), (35, 1)] {
                let blocks = ggml_blocks * per_ggml_block;
                let ggml: Vec<u8> = (0..rows * ggml_blocks)
                    .flat_map(|index| block_of(format, index as u64 * 31 + 7))
                    .collect();
                let packed = PackedWeights::pack(format, &ggml, rows, blocks);
                let layout = BlockLayout::of(format);
                assert_eq!(
                    packed.bytes().len(),
                    rows.div_ceil(GROUP) * blocks * layout.bytes,
                    "{format:?}: a packed group takes its blocks' bytes"
                );
                if per_ggml_block == 1 {
                    assert_eq!(
                        layout.bytes,
                        GROUP * format.ggml_block_bytes(),
                        "{format:?}: a packed group takes as many bytes as its 16 ggml rows"
                    );
                }
                for row in 0..rows {
                    for block in 0..blocks {
                        let source = &ggml[row * format.bytes_of(blocks * BLOCK)
                            + (block / per_ggml_block) * format.ggml_block_bytes()..]
                            [..format.ggml_block_bytes()];
                        let (mut expected, mut got) = ([0i32; BLOCK], [0i32; BLOCK]);
                        let want =
                            format.decode_block(source, block % per_ggml_block, &mut expected);
                        let have = packed.block(row, block, &mut got);
                        let bits = |scaling: BlockScaling| {
                            (scaling.scales.map(f32::to_bits), scaling.offset.to_bits())
                        };
                        assert_eq!(
                            (got, bits(have)),
                            (expected, bits(want)),
                            "{format:?} {rows}x{blocks}: row {row} block {block} reads back differently"
                        );
                    }
                }
            }
        }
    }
}
