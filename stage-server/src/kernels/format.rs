//! The ggml block layouts our kernels read, and the scalar decoding of one block.
//!
//! Every format stores 32 weights per block. A block decodes to 32 small integers `q` (0..=31 for the 4- and 5-bit
//! formats, -128..=127 for Q8_0) and two numbers `scale` and `offset` such that weight `j` is
//! `scale * q[j] + offset`. The kernels compute the integer dot product of `q` with the
//! quantised activation and apply `scale` and `offset` once per block, which is what makes them cheap.

use candle_core::quantized::GgmlDType;

/// Weights per block, for every format handled here.
pub const BLOCK: usize = 32;

/// A weight format our kernels handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
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
}

impl WeightFormat {
    /// Every format, in a fixed order (for tests and benchmarks).
    pub const ALL: [WeightFormat; 5] = [
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
    ];

    /// The format of a ggml type, if we have kernels for it.
    pub fn from_ggml(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q5_0 => Some(Self::Q5_0),
            GgmlDType::Q5_1 => Some(Self::Q5_1),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
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
        }
    }

    /// Bytes per block of 32 weights.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
        }
    }

    /// Decodes one block (exactly `block_bytes()` long) into the unsigned or signed integers of its 32 weights and
    /// the `(scale, offset)` that turn them into weights. Used by the scalar kernel and by the tests' reference.
    pub fn decode_block(self, block: &[u8], q: &mut [i32; BLOCK]) -> (f32, f32) {
        let d = f16_at(block, 0);
        match self {
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
        }
    }
}

/// Reads the little-endian f16 at `at` as f32.
#[inline]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}
