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
//!     scales   16 x f16                      (32 bytes)
//!     minimums 16 x f16, Q4_1 and Q5_1 only  (32 bytes)
//!     fifths   8 x u64, Q5_0 and Q5_1 only   (64 bytes): bit 4r+t of word k is the fifth bit of row r's weight 4k+t
//!     values   Q4/Q5: 4 x 64 bytes, byte 4r+t of chunk c holds row r's weight 8c+t (low nibble) and 8c+4+t (high)
//!              Q8_0:  8 x 64 bytes, byte 4r+t of chunk k holds row r's weight 4k+t plus 128
//! ```
//!
//! Every stored value is unsigned: the weight is `scale * (value - centre) + minimum` with the centre 8 (Q4_0),
//! 16 (Q5_0), 128 (Q8_0) or 0. The kernels take `Σ value·x` with an unsigned-by-signed multiply and subtract
//! `centre·Σx` in integers, which is exact, so every level computes the same integer per row and block. A group
//! holds as many bytes as its 16 rows did in the ggml layout; rows past the matrix's end (up to 15, in the last
//! group) are zero.

use super::arena::WeightBytes;
use super::format::{BLOCK, WeightFormat, f16_at};

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
    /// The 16 minimums (formats with an offset).
    pub minimums: Option<usize>,
    /// The 8 words of fifth bits (5-bit formats).
    pub fifths: Option<usize>,
    /// The values.
    pub values: usize,
    /// What is subtracted from each stored value to give the weight's integer.
    pub centre: i32,
}

impl BlockLayout {
    /// The layout of `format`.
    pub(crate) const fn of(format: WeightFormat) -> Self {
        let (minimums, fifths, centre) = match format {
            WeightFormat::Q4_0 => (false, false, 8),
            WeightFormat::Q4_1 => (true, false, 0),
            WeightFormat::Q5_0 => (false, true, 16),
            WeightFormat::Q5_1 => (true, true, 0),
            WeightFormat::Q8_0 => (false, false, 128),
        };
        let mut at = 2 * GROUP;
        let minimums_at = if minimums {
            at += 2 * GROUP;
            Some(at - 2 * GROUP)
        } else {
            None
        };
        let fifths_at = if fifths {
            at += 64;
            Some(at - 64)
        } else {
            None
        };
        let values_at = at;
        let value_bytes = match format {
            WeightFormat::Q8_0 => 8 * 64,
            _ => 4 * 64,
        };
        Self {
            bytes: values_at + value_bytes,
            minimums: minimums_at,
            fifths: fifths_at,
            values: values_at,
            centre,
        }
    }
}

impl PackedWeights {
    /// Repacks `rows` rows of `blocks_per_row` ggml blocks of `format` (`ggml.len()` must be exactly that).
    ///
    /// Cost: one pass over the weights, and as many bytes again (the caller drops the ggml copy).
    pub fn pack(format: WeightFormat, ggml: &[u8], rows: usize, blocks_per_row: usize) -> Self {
        let block_bytes = format.block_bytes();
        assert_eq!(
            ggml.len(),
            rows * blocks_per_row * block_bytes,
            "the ggml bytes must hold exactly rows x blocks"
        );
        let layout = BlockLayout::of(format);
        let groups = rows.div_ceil(GROUP);
        let mut bytes = WeightBytes::zeroed(groups * blocks_per_row * layout.bytes);
        let mut q = [0i32; BLOCK];
        for row in 0..rows {
            let (group, lane) = (row / GROUP, row % GROUP);
            for block in 0..blocks_per_row {
                let source = &ggml[(row * blocks_per_row + block) * block_bytes..][..block_bytes];
                let (scale_bits, minimum_bits) = (&source[0..2], &source[2..4]);
                format.decode_block(source, &mut q);
                let target =
                    &mut bytes[(group * blocks_per_row + block) * layout.bytes..][..layout.bytes];
                target[2 * lane..2 * lane + 2].copy_from_slice(scale_bits);
                if let Some(at) = layout.minimums {
                    target[at + 2 * lane..at + 2 * lane + 2].copy_from_slice(minimum_bits);
                }
                // `decode_block` centres Q4_0, Q5_0 and Q8_0 (signed integers); stored values are unsigned.
                let stored = |j: usize| (q[j] + layout.centre) as u8;
                match format {
                    WeightFormat::Q8_0 => {
                        for j in 0..BLOCK {
                            let (chunk, t) = (j / 4, j % 4);
                            target[layout.values + chunk * 64 + 4 * lane + t] = stored(j);
                        }
                    }
                    _ => {
                        for j in 0..BLOCK {
                            let value = stored(j);
                            let (chunk, within) = (j / 8, j % 8);
                            let byte =
                                &mut target[layout.values + chunk * 64 + 4 * lane + within % 4];
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

    /// The integers (centred, as [`WeightFormat::decode_block`] gives them), scale and offset of row `row`'s block
    /// `block`, read back from the packed bytes: the scalar kernel's view and the tests' check of the packing.
    pub fn block(&self, row: usize, block: usize, q: &mut [i32; BLOCK]) -> (f32, f32) {
        let layout = BlockLayout::of(self.format);
        let (group, lane) = (row / GROUP, row % GROUP);
        let source =
            &self.bytes[(group * self.blocks_per_row + block) * layout.bytes..][..layout.bytes];
        let scale = f16_at(source, 2 * lane);
        let offset = layout
            .minimums
            .map_or(0.0, |at| f16_at(source, at + 2 * lane));
        for (j, value) in q.iter_mut().enumerate() {
            let stored = match self.format {
                WeightFormat::Q8_0 => source[layout.values + (j / 4) * 64 + 4 * lane + j % 4],
                _ => {
                    let (chunk, within) = (j / 8, j % 8);
                    let byte = source[layout.values + chunk * 64 + 4 * lane + within % 4];
                    let nibble = if within < 4 { byte & 0x0F } else { byte >> 4 };
                    let fifth = layout.fifths.map_or(0, |at| {
                        let bit = 4 * lane + j % 4;
                        (source[at + 8 * (j / 4) + bit / 8] >> (bit % 8)) & 1
                    });
                    nibble | (fifth << 4)
                }
            };
            *value = i32::from(stored) - layout.centre;
        }
        (scale, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block of every byte pattern a seed gives, with finite f16 scales.
    fn block_of(format: WeightFormat, seed: u64) -> Vec<u8> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut bytes: Vec<u8> = (0..format.block_bytes())
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 33) as u8
            })
            .collect();
        // Keep the scale and minimum finite (exponent bits not all ones).
        bytes[1] &= 0x3F;
        bytes[3] &= 0x3F;
        bytes
    }

    #[test]
    fn every_block_reads_back_as_the_ggml_block_decodes() {
        for format in WeightFormat::ALL {
            for (rows, blocks) in [(1, 1), (16, 2), (17, 3), (35, 1)] {
                let ggml: Vec<u8> = (0..rows * blocks)
                    .flat_map(|index| block_of(format, index as u64 * 31 + 7))
                    .collect();
                let packed = PackedWeights::pack(format, &ggml, rows, blocks);
                assert_eq!(
                    packed.bytes().len(),
                    rows.div_ceil(GROUP) * GROUP * blocks * format.block_bytes(),
                    "{format:?}: a packed group takes as many bytes as its 16 ggml rows"
                );
                for row in 0..rows {
                    for block in 0..blocks {
                        let source = &ggml[(row * blocks + block) * format.block_bytes()..]
                            [..format.block_bytes()];
                        let (mut expected, mut got) = ([0i32; BLOCK], [0i32; BLOCK]);
                        let want = format.decode_block(source, &mut expected);
                        let have = packed.block(row, block, &mut got);
                        assert_eq!(
                            (got, have.0.to_bits(), have.1.to_bits()),
                            (expected, want.0.to_bits(), want.1.to_bits()),
                            "{format:?} {rows}x{blocks}: row {row} block {block} reads back differently"
                        );
                    }
                }
            }
        }
    }
}
