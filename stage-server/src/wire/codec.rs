//! Activation payloads: rows of f32 values carried as raw f32, f16 or bf16, and the policy that picks the codec.

use std::fmt;

use half::{bf16, f16};

/// How one activation frame's values are carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// Raw little-endian IEEE f32, 4 bytes a value: exact, the default.
    F32,
    /// IEEE half precision (round to nearest even), 2 bytes a value: lossy unless every value fits.
    F16,
    /// bfloat16 (round to nearest even), 2 bytes a value: f32's range with 8 bits of mantissa.
    Bf16,
}

/// Which codec a sender uses for each activation frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodecPolicy {
    /// Always raw f32.
    F32,
    /// Always f16, rounding values that do not fit (lossy; only when configured).
    F16,
    /// Always bf16, rounding values that do not fit (lossy; only when configured).
    Bf16,
    /// bf16 or f16 only when every value of this frame round-trips bit-exactly (bf16 first, as it keeps f32's
    /// range), else f32: never changes a value, halves the bytes when it can.
    AutoLossless,
}

/// A set of codecs, one bit each: what a stage accepts, as its hello says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CodecSet(u8);

/// One frame's activations: `rows` x `width` values in `codec`, as their little-endian bytes.
///
/// A decoded frame always has `bytes.len() == rows * width * codec.value_bytes()`; the decoder refuses any
/// other count ([`WireError::RowsMismatch`](super::WireError::RowsMismatch)).
#[derive(Clone, Debug, PartialEq)]
pub struct Activations {
    /// Rows (one per token of the chunk).
    pub rows: u32,
    /// Values per row (the model's embedding width).
    pub width: u32,
    /// How the values are carried.
    pub codec: Codec,
    /// The values, row-major, in the codec's little-endian encoding.
    pub bytes: Vec<u8>,
}

impl Codec {
    /// Every codec, in wire-id order.
    pub const ALL: [Codec; 3] = [Codec::F32, Codec::F16, Codec::Bf16];

    /// Bytes one value takes.
    pub fn value_bytes(self) -> usize {
        match self {
            Codec::F32 => 4,
            Codec::F16 | Codec::Bf16 => 2,
        }
    }

    /// The codec's name in messages and flags (`f32`, `f16`, `bf16`).
    pub fn as_str(self) -> &'static str {
        match self {
            Codec::F32 => "f32",
            Codec::F16 => "f16",
            Codec::Bf16 => "bf16",
        }
    }

    /// The byte that names the codec on the wire.
    pub(crate) fn to_wire(self) -> u8 {
        match self {
            Codec::F32 => 1,
            Codec::F16 => 2,
            Codec::Bf16 => 3,
        }
    }

    /// The codec a wire byte names, if any.
    pub(crate) fn from_wire(byte: u8) -> Option<Codec> {
        Codec::ALL.into_iter().find(|codec| codec.to_wire() == byte)
    }

    fn bit(self) -> u8 {
        1 << (self.to_wire() - 1)
    }
}

impl CodecPolicy {
    /// The codecs a frame sent under this policy may use: the receiver must accept all of them.
    pub fn codecs(self) -> CodecSet {
        let mut set = CodecSet::default();
        match self {
            CodecPolicy::F32 => set.insert(Codec::F32),
            CodecPolicy::F16 => set.insert(Codec::F16),
            CodecPolicy::Bf16 => set.insert(Codec::Bf16),
            CodecPolicy::AutoLossless => set = CodecSet::all(),
        }
        set
    }

    /// The policy's name in messages and flags (`f32`, `f16`, `bf16`, `auto-lossless`).
    pub fn as_str(self) -> &'static str {
        match self {
            CodecPolicy::F32 => "f32",
            CodecPolicy::F16 => "f16",
            CodecPolicy::Bf16 => "bf16",
            CodecPolicy::AutoLossless => "auto-lossless",
        }
    }
}

impl CodecSet {
    /// The bits a set may have on the wire.
    pub(crate) const KNOWN_BITS: u8 = 0b111;

    /// Every codec.
    pub fn all() -> CodecSet {
        CodecSet(Self::KNOWN_BITS)
    }

    /// Whether `codec` is in the set.
    pub fn contains(self, codec: Codec) -> bool {
        self.0 & codec.bit() != 0
    }

    /// Adds `codec`.
    pub fn insert(&mut self, codec: Codec) {
        self.0 |= codec.bit();
    }

    /// Whether every codec of `other` is in this set.
    pub fn contains_all(self, other: CodecSet) -> bool {
        other.0 & !self.0 == 0
    }

    /// The set's wire byte.
    pub(crate) fn bits(self) -> u8 {
        self.0
    }

    /// The set a wire byte names, unless it has bits no codec uses.
    pub(crate) fn from_bits(bits: u8) -> Option<CodecSet> {
        (bits & !Self::KNOWN_BITS == 0).then_some(CodecSet(bits))
    }
}

impl Activations {
    /// Encodes `values` (row-major, `width` per row) under `policy`.
    ///
    /// Costs one pass to encode, plus one pass per candidate codec under [`CodecPolicy::AutoLossless`] (which
    /// stops at the first value that does not round-trip).
    ///
    /// # Panics
    ///
    /// When `width` is zero or `values.len()` is not a multiple of it, or when the row count does not fit in a
    /// `u32`: the caller's shapes are wrong, not the peer's input.
    pub fn encode(values: &[f32], width: u32, policy: CodecPolicy) -> Activations {
        assert!(width > 0, "an activation row cannot have width 0");
        assert!(
            values.len().is_multiple_of(width as usize),
            "{} values are not whole rows of width {width}",
            values.len()
        );
        let rows = u32::try_from(values.len() / width as usize)
            .expect("an activation frame has more rows than a u32 counts");
        let codec = match policy {
            CodecPolicy::F32 => Codec::F32,
            CodecPolicy::F16 => Codec::F16,
            CodecPolicy::Bf16 => Codec::Bf16,
            CodecPolicy::AutoLossless => lossless_codec(values),
        };
        let mut bytes = Vec::with_capacity(values.len() * codec.value_bytes());
        match codec {
            Codec::F32 => {
                for value in values {
                    bytes.extend_from_slice(&value.to_le_bytes());
                }
            }
            Codec::F16 => {
                for &value in values {
                    bytes.extend_from_slice(&f16::from_f32(value).to_bits().to_le_bytes());
                }
            }
            Codec::Bf16 => {
                for &value in values {
                    bytes.extend_from_slice(&bf16::from_f32(value).to_bits().to_le_bytes());
                }
            }
        }
        Activations {
            rows,
            width,
            codec,
            bytes,
        }
    }

    /// The values as f32, row-major.
    pub fn decode(&self) -> Vec<f32> {
        let mut values = Vec::with_capacity(self.values_len());
        self.decode_into(&mut values);
        values
    }

    /// Appends the values as f32 to `values` (reusing its allocation across frames).
    pub fn decode_into(&self, values: &mut Vec<f32>) {
        values.reserve(self.values_len());
        match self.codec {
            Codec::F32 => values.extend(
                self.bytes
                    .chunks_exact(4)
                    .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]])),
            ),
            Codec::F16 => values.extend(
                self.bytes
                    .chunks_exact(2)
                    .map(|chunk| f16::from_bits(u16::from_le_bytes([chunk[0], chunk[1]])).to_f32()),
            ),
            Codec::Bf16 => {
                values.extend(self.bytes.chunks_exact(2).map(|chunk| {
                    bf16::from_bits(u16::from_le_bytes([chunk[0], chunk[1]])).to_f32()
                }))
            }
        }
    }

    /// How many values the bytes hold.
    pub fn values_len(&self) -> usize {
        self.bytes.len() / self.codec.value_bytes()
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

impl fmt::Display for CodecPolicy {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

impl fmt::Display for CodecSet {
    /// The codec names joined by `+` (`f32+bf16`), or `none`.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Codec::ALL
            .into_iter()
            .filter(|codec| self.contains(*codec))
            .map(Codec::as_str)
            .collect();
        if names.is_empty() {
            formatter.write_str("none")
        } else {
            formatter.write_str(&names.join("+"))
        }
    }
}

/// The codec [`CodecPolicy::AutoLossless`] picks: bf16 when every value round-trips through it bit for bit,
/// else f16 when every value does through that, else f32. An empty frame stays f32 (nothing to save).
fn lossless_codec(values: &[f32]) -> Codec {
    if values.is_empty() {
        return Codec::F32;
    }
    // Bits, not `==`: -0.0 must stay negative and a NaN's payload must survive.
    if values
        .iter()
        .all(|value| bf16::from_f32(*value).to_f32().to_bits() == value.to_bits())
    {
        return Codec::Bf16;
    }
    if values
        .iter()
        .all(|value| f16::from_f32(*value).to_f32().to_bits() == value.to_bits())
    {
        return Codec::F16;
    }
    Codec::F32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_lossless_keeps_f32_when_one_value_needs_its_mantissa() {
        let values = [1.0, 2.5, 1.0 + f32::EPSILON];
        let encoded = Activations::encode(&values, 3, CodecPolicy::AutoLossless);
        assert_eq!(
            encoded.codec,
            Codec::F32,
            "a value with low mantissa bits cannot travel in 16 bits"
        );
        assert_eq!(encoded.decode(), values, "f32 changed a value");
    }

    #[test]
    fn auto_lossless_picks_bf16_for_values_with_short_mantissas() {
        // 2^100 is past f16's range but exact in bf16.
        let values = [1.0, -2.0, 2f32.powi(100), -0.0];
        let encoded = Activations::encode(&values, 2, CodecPolicy::AutoLossless);
        assert_eq!(
            encoded.codec,
            Codec::Bf16,
            "values with 8-bit mantissas fit bf16"
        );
        assert_eq!(encoded.rows, 2, "4 values of width 2 are 2 rows");
        let decoded = encoded.decode();
        assert!(
            decoded
                .iter()
                .zip(values)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "bf16 changed a value: {decoded:?}"
        );
    }

    #[test]
    fn auto_lossless_picks_f16_for_small_values_with_ten_bit_mantissas() {
        // 1 + 2^-10 needs 10 mantissa bits: too many for bf16 (7), exact in f16 (10).
        let values = [1.0 + 1.0 / 1024.0, 0.5];
        let encoded = Activations::encode(&values, 2, CodecPolicy::AutoLossless);
        assert_eq!(encoded.codec, Codec::F16, "10-bit mantissas fit f16 only");
        assert_eq!(encoded.decode(), values, "f16 changed a value");
    }

    #[test]
    fn a_codec_set_holds_what_was_inserted_and_prints_it() {
        let mut set = CodecSet::default();
        assert!(!set.contains(Codec::F32), "the empty set holds f32");
        set.insert(Codec::F32);
        set.insert(Codec::Bf16);
        assert!(
            set.contains(Codec::Bf16) && !set.contains(Codec::F16),
            "the set lost or invented a codec"
        );
        assert_eq!(set.to_string(), "f32+bf16", "the set prints its names");
        assert!(
            CodecSet::all().contains_all(CodecPolicy::AutoLossless.codecs()),
            "all codecs cover the auto policy"
        );
        assert!(
            !set.contains_all(CodecPolicy::AutoLossless.codecs()),
            "a set without f16 cannot take auto-lossless frames"
        );
    }
}
