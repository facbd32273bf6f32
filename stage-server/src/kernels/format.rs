//! The ggml block layouts our kernels read, and the scalar decoding of one block of 32 weights.
//!
//! Every format is read in blocks of 32 weights. A block decodes to 32 small integers `q` (0..=15 for Q4_1 and
//! Q4_K, 0..=31 for Q5_1 and Q5_K, centred for the others: -8..=7 for Q4_0, -16..=15 for Q5_0, -32..=31 for Q6_K, -128..=127
//! for Q8_0), a scale for each half of 16 and an `offset` such that
//! weight `j` is `scale[j / 16] * q[j] + offset`. The kernels compute the integer dot product of `q` with the
//! quantised activation and apply the scales and the offset once per block, which is what makes them cheap.
//!
//! The K-quants store 256 weights per ggml block (a super-block) with one f16 scale (and one f16 minimum) for the
//! super-block and small integer scales for its sub-blocks: Q4_K and Q5_K have 8 sub-blocks of 32 with 6-bit
//! scales and minimums, Q6_K 16 sub-blocks of 16 with signed 8-bit scales. A block of 32 here is a Q4_K or Q5_K
//! sub-block (scale
//! `d·sc`, offset `-dmin·m`) or two Q6_K sub-blocks (scales `d·sc₀` and `d·sc₁`); each product of an f16 by a
//! 6- or 8-bit integer is exact in f32, so these are the weights ggml's dequantisation gives, bit for bit.

use candle_core::quantized::GgmlDType;

/// Weights per block, for every format handled here.
pub const BLOCK: usize = 32;

/// Weights per K-quant super-block (ggml's `QK_K`).
const SUPER_BLOCK: usize = 256;

/// A weight format our kernels handle, in ggml's spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[allow(non_camel_case_types)] // `Q4_K`, as ggml, llama.cpp and the GGUF files name it.
pub enum WeightFormat {
    /// `f16 d`, 16 bytes of nibbles: `w = d * (q - 8)`.
    Q4_0,
    /// `f16 d`, `f16 m`, 16 bytes of nibbles: `w = d * q + m`.
    Q4_1,
    /// `f16 d`, 4 bytes of fifth bits, 16 bytes of nibbles: `w = d * (q - 16)`.
    Q5_0,
    /// `f16 d`, `f16 m`, 4 bytes of fifth bits, 16 bytes of nibbles: `w = d * q + m`.
    Q5_1,
    /// `f16 d`, 32 signed bytes: `w = d * q`.
    Q8_0,
    /// Super-blocks of 256: `f16 d`, `f16 dmin`, 12 bytes of 6-bit scales and minimums for 8 sub-blocks of 32,
    /// 128 bytes of nibbles: `w = d·sc * q - dmin·m`.
    Q4_K,
    /// Super-blocks of 256: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 signed scales (one per 16
    /// weights), `f16 d`: `w = d·sc * (q - 32)`.
    Q6_K,
    /// Super-blocks of 256: `f16 d`, `f16 dmin`, 12 bytes of 6-bit scales and minimums for 8 sub-blocks of 32,
    /// 32 bytes of fifth bits (bit `s` of byte `l` for weight `l` of sub-block `s`), 128 bytes of nibbles:
    /// `w = d·sc * q - dmin·m`.
    Q5_K,
}

impl WeightFormat {
    /// Every format, in a fixed order (for tests and benchmarks).
    pub const ALL: [WeightFormat; 8] = [
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
        WeightFormat::Q4_K,
        WeightFormat::Q6_K,
        WeightFormat::Q5_K,
    ];

    /// The format of a ggml type, if we have kernels for it.
    pub fn from_ggml(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q5_0 => Some(Self::Q5_0),
            GgmlDType::Q5_1 => Some(Self::Q5_1),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4K => Some(Self::Q4_K),
            GgmlDType::Q6K => Some(Self::Q6_K),
            GgmlDType::Q5K => Some(Self::Q5_K),
            _ => None,
        }
    }

    /// The ggml type with this block layout.
    pub fn ggml(self) -> GgmlDType {
        match self {
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q5_1 => GgmlDType::Q5_1,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4_K => GgmlDType::Q4K,
            Self::Q6_K => GgmlDType::Q6K,
            Self::Q5_K => GgmlDType::Q5K,
        }
    }

    /// Weights per ggml block: 32, or 256 for the K-quants' super-blocks. A row's length must be a multiple.
    pub const fn ggml_block_weights(self) -> usize {
        match self {
            Self::Q4_K | Self::Q5_K | Self::Q6_K => SUPER_BLOCK,
            _ => BLOCK,
        }
    }

    /// Bytes per ggml block ([`WeightFormat::ggml_block_weights`] weights).
    pub const fn ggml_block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4_K => 144,
            Self::Q6_K => 210,
            Self::Q5_K => 176,
        }
    }

    /// Bytes of `weights` weights in this format (a multiple of [`WeightFormat::ggml_block_weights`]).
    pub const fn bytes_of(self, weights: usize) -> usize {
        weights / self.ggml_block_weights() * self.ggml_block_bytes()
    }

    /// Whether the format adds an offset per block (`w = scale·q + offset`).
    pub const fn has_offsets(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1 | Self::Q4_K | Self::Q5_K)
    }

    /// Whether a block's two halves of 16 weights have scales of their own (Q6_K's sub-blocks of 16).
    pub const fn has_half_scales(self) -> bool {
        matches!(self, Self::Q6_K)
    }

    /// Decodes block `sub` (of 32 weights) of one ggml block (exactly `ggml_block_bytes()` long) into the
    /// unsigned or signed integers of its weights and the scales and offset that turn them into weights. Used
    /// by the packing (and by its test, against what the packed bytes read back as).
    ///
    /// Panics if `sub` is not below `ggml_block_weights() / 32`.
    pub fn decode_block(self, ggml_block: &[u8], sub: usize, q: &mut [i32; BLOCK]) -> BlockScaling {
        assert!(
            sub < self.ggml_block_weights() / BLOCK,
            "block {sub} is past the ggml block"
        );
        match self {
            Self::Q4_K => return decode_q4_k(ggml_block, sub, q),
            Self::Q5_K => return decode_q5_k(ggml_block, sub, q),
            Self::Q6_K => return decode_q6_k(ggml_block, sub, q),
            _ => {}
        }
        let block = ggml_block;
        let d = f16_at(block, 0);
        let (scale, offset) = match self {
            Self::Q4_0 | Self::Q4_1 => {
                // Q4_0's zero point is centred in the integers (`q - 8`), as the SIMD kernels do.
                let (nibbles, centre, offset) = match self {
                    Self::Q4_0 => (&block[2..18], 8, 0.0),
                    _ => (&block[4..20], 0, f16_at(block, 2)),
                };
                for (j, byte) in nibbles.iter().enumerate() {
                    q[j] = i32::from(byte & 0x0F) - centre;
                    q[j + 16] = i32::from(byte >> 4) - centre;
                }
                (d, offset)
            }
            Self::Q5_0 | Self::Q5_1 => {
                // Q5_0's zero point is centred in the integers (`q - 16`), as the SIMD kernels do.
                let (high, nibbles, centre, offset) = match self {
                    Self::Q5_0 => (&block[2..6], &block[6..22], 16, 0.0),
                    _ => (&block[4..8], &block[8..24], 0, f16_at(block, 2)),
                };
                let high = u32::from_le_bytes([high[0], high[1], high[2], high[3]]);
                for (j, byte) in nibbles.iter().enumerate() {
                    let bit_low = ((high >> j) & 1) as i32;
                    let bit_high = ((high >> (j + 16)) & 1) as i32;
                    q[j] = (i32::from(byte & 0x0F) | (bit_low << 4)) - centre;
                    q[j + 16] = (i32::from(byte >> 4) | (bit_high << 4)) - centre;
                }
                (d, offset)
            }
            Self::Q8_0 => {
                for (j, byte) in block[2..34].iter().enumerate() {
                    q[j] = i32::from(*byte as i8);
                }
                (d, 0.0)
            }
            Self::Q4_K | Self::Q5_K | Self::Q6_K => unreachable!("decoded above"),
        };
        BlockScaling {
            scales: [scale, scale],
            offset,
        }
    }
}

/// What turns a block's integers into weights: weight `j` is `scales[j / 16] * q[j] + offset`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockScaling {
    /// The scale of weights 0..16 and of weights 16..32 (the same number but for Q6_K).
    pub scales: [f32; 2],
    /// Added to every weight (0 for the formats without a minimum).
    pub offset: f32,
}

/// Sub-block `sub` (0..8) of a Q4_K super-block: ggml's `get_scale_min_k4` for its 6-bit scale and minimum, and
/// its nibbles (sub-blocks `2i` and `2i + 1` share 32 bytes, low nibbles then high).
fn decode_q4_k(block: &[u8], sub: usize, q: &mut [i32; BLOCK]) -> BlockScaling {
    let nibbles = &block[16 + 32 * (sub / 2)..][..32];
    for (value, byte) in q.iter_mut().zip(nibbles) {
        *value = i32::from(if sub.is_multiple_of(2) {
            byte & 0x0F
        } else {
            byte >> 4
        });
    }
    k4_scaling(block, sub)
}

/// Sub-block `sub` (0..8) of a Q5_K super-block: Q4_K's scales and nibbles (the nibbles after 32 bytes of fifth
/// bits), and bit `sub` of byte `l` of those as weight `l`'s fifth bit (ggml's `dequantize_row_q5_K`).
fn decode_q5_k(block: &[u8], sub: usize, q: &mut [i32; BLOCK]) -> BlockScaling {
    let fifths = &block[16..48];
    let nibbles = &block[48 + 32 * (sub / 2)..][..32];
    for ((value, byte), high) in q.iter_mut().zip(nibbles).zip(fifths) {
        let nibble = if sub.is_multiple_of(2) {
            byte & 0x0F
        } else {
            byte >> 4
        };
        *value = i32::from(nibble | (((high >> sub) & 1) << 4));
    }
    k4_scaling(block, sub)
}

/// The scale `d·sc` and offset `-dmin·m` of sub-block `sub` of a Q4_K or Q5_K super-block, whose 6-bit `sc` and
/// `m` are packed in its 12 bytes after `d` and `dmin` as ggml's `get_scale_min_k4` reads them.
fn k4_scaling(block: &[u8], sub: usize) -> BlockScaling {
    let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
    let packed = &block[4..16];
    let (scale, minimum) = if sub < 4 {
        (packed[sub] & 63, packed[sub + 4] & 63)
    } else {
        (
            (packed[sub + 4] & 0x0F) | ((packed[sub - 4] >> 6) << 4),
            (packed[sub + 4] >> 4) | ((packed[sub] >> 6) << 4),
        )
    };
    let scale = d * f32::from(scale);
    BlockScaling {
        scales: [scale, scale],
        offset: -(dmin * f32::from(minimum)),
    }
}

/// Block `sub` (0..8) of a Q6_K super-block: ggml's `dequantize_row_q6_K` lays each half of 128 weights out as
/// four runs of 32, run `r` taking the low (`r < 2`) or high nibbles of 32 bytes of `ql` and bit pair `r` of the
/// half's 32 bytes of `qh`; each run has a scale for its first 16 weights and one for the rest.
fn decode_q6_k(block: &[u8], sub: usize, q: &mut [i32; BLOCK]) -> BlockScaling {
    let (half, run) = (sub / 4, sub % 4);
    let low = &block[64 * half + 32 * (run % 2)..][..32];
    let high = &block[128 + 32 * half..][..32];
    for (index, value) in q.iter_mut().enumerate() {
        let nibble = if run < 2 {
            low[index] & 0x0F
        } else {
            low[index] >> 4
        };
        let pair = (high[index] >> (2 * run)) & 3;
        *value = i32::from(nibble | (pair << 4)) - 32;
    }
    let d = f16_at(block, 208);
    let scale = |index: usize| d * f32::from(block[192 + index] as i8);
    BlockScaling {
        scales: [scale(8 * half + 2 * run), scale(8 * half + 2 * run + 1)],
        offset: 0.0,
    }
}

/// Reads the little-endian f16 at `at` as f32.
#[inline]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}
