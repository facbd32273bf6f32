//! A bounded, streaming pre-check of a GGUF file's header, metadata and tensor directory, run before candle reads it.
//!
//! candle's GGUF reader trusts the file: an alignment of zero divides by zero, dimensions whose product
//! overflows panic in debug builds (and wrap in release), and lengths are only bounded by the bytes left
//! in the whole file. [`validate`] walks the same sections itself, reading fixed-size fields and skipping
//! string and array payloads with seeks, so it never allocates more than one key or tensor name (at most
//! [`MAX_NAME_LENGTH`] bytes) at a time and never reads tensor data. Every length and count is checked
//! against the bytes left before it is used; every tensor's data range is checked against the file size.
//! When it returns `Ok`, candle's `Content::read` on the same file cannot panic or over-allocate, and
//! every tensor candle would read lies inside the file.
//!
//! The cost is one pass over the header sections (a few megabytes for a real model's vocabulary) through
//! a buffered reader.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;

/// Longest metadata key or tensor name accepted, in bytes (GGUF limits keys to 65,535 bytes).
pub const MAX_NAME_LENGTH: u64 = 65_535;
/// Most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMENSIONS: u32 = 4;
/// Deepest nesting of arrays inside arrays accepted in metadata.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Most array elements all metadata may hold together. candle keeps each element as a 32-byte `Value`,
/// so a one-byte element costs it 32 bytes of memory; this cap bounds that to half a gigabyte, far
/// above the largest real vocabulary (gemma 3: three arrays of 262,144 entries).
pub const MAX_METADATA_ELEMENTS: u64 = 1 << 24;
/// The tensor-data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// What a valid file's header says, as [`validate`] found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// The GGUF version (2 or 3).
    pub version: u32,
    /// The file's size in bytes.
    pub file_size: u64,
    /// Metadata entries.
    pub metadata_count: u64,
    /// Tensors.
    pub tensor_count: u64,
    /// `general.architecture`, if present as a string.
    pub architecture: Option<String>,
    /// The alignment of tensor data (`general.alignment` or 32).
    pub alignment: u64,
    /// Where the tensor data section starts.
    pub tensor_data_offset: u64,
    /// One past the last byte of tensor data any tensor uses (the data section's start if there are none).
    pub tensor_data_end: u64,
}

/// Why a file is not a GGUF file this server can read safely. Every variant names the file; most name
/// the byte offset and the key or tensor where the problem was found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened or read.
    #[error("cannot read {path}: {source}; check the path and its permissions")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// The file does not start with the GGUF magic.
    #[error(
        "{path}: the file starts with the bytes `{}` where a GGUF file starts with `GGUF`; it is no GGUF model, pass a .gguf file",
        .magic.escape_ascii()
    )]
    NotGguf {
        /// The file.
        path: PathBuf,
        /// Its first four bytes.
        magic: [u8; 4],
    },
    /// The GGUF version is not 2 or 3.
    #[error(
        "{path}: GGUF version {version} is not supported (only versions 2 and 3 are); convert the model again with a current llama.cpp"
    )]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version the file declares.
        version: u32,
    },
    /// The file ends inside the header sections.
    #[error(
        "{path}: the file ends at byte {} while reading {what} at byte {} ({needed} bytes needed); the file is truncated, download it again",
        grouped(.file_size), grouped(.offset)
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Where the field starts.
        offset: u64,
        /// What was being read.
        what: String,
        /// Bytes the field needs.
        needed: u64,
        /// The file's size.
        file_size: u64,
    },
    /// The header declares more tensors or metadata entries than the file could hold.
    #[error(
        "{path}: the header at byte {offset} declares {} {what}, which need at least {} bytes, but the file has only {} bytes after it; the file is truncated or corrupt, download it again",
        grouped(.count), grouped(.minimum_bytes), grouped(.remaining)
    )]
    CountTooLarge {
        /// The file.
        path: PathBuf,
        /// Where the count is.
        offset: u64,
        /// `tensors` or `metadata entries`.
        what: &'static str,
        /// The declared count.
        count: u64,
        /// The smallest number of bytes that many entries take.
        minimum_bytes: u128,
        /// Bytes left in the file after the header.
        remaining: u64,
    },
    /// A string's declared length exceeds what the file (or the name limit) allows.
    #[error(
        "{path}: {what} at byte {} declares a length of {} bytes, but at most {} bytes can be there; the file is truncated or corrupt, download it again",
        grouped(.offset), grouped(.length), grouped(.limit)
    )]
    StringTooLong {
        /// The file.
        path: PathBuf,
        /// Where the length prefix is.
        offset: u64,
        /// Which string: a key, a value or a tensor name.
        what: String,
        /// The declared length.
        length: u64,
        /// The largest length possible there.
        limit: u64,
    },
    /// An array's declared length exceeds what the rest of the file could hold.
    #[error(
        "{path}: metadata key `{key}` at byte {} declares an array of {} {element_type} values needing at least {} bytes, but only {} bytes remain in the file; the file is truncated or corrupt, download it again",
        grouped(.offset), grouped(.length), grouped(.minimum_bytes), grouped(.remaining)
    )]
    ArrayTooLong {
        /// The file.
        path: PathBuf,
        /// Where the array length is.
        offset: u64,
        /// The metadata key.
        key: String,
        /// The declared element count.
        length: u64,
        /// The element type's name.
        element_type: &'static str,
        /// The smallest number of bytes that many elements take.
        minimum_bytes: u128,
        /// Bytes left in the file.
        remaining: u64,
    },
    /// The metadata arrays hold more elements together than [`MAX_METADATA_ELEMENTS`].
    #[error(
        "{path}: metadata key `{key}` at byte {} brings the metadata arrays to {} elements, more than the limit of {}, which would take candle's reader over half a gigabyte of memory; the file is corrupt or not a language model",
        grouped(.offset), grouped(.elements), grouped(.limit)
    )]
    MetadataTooLarge {
        /// The file.
        path: PathBuf,
        /// Where the array length is.
        offset: u64,
        /// The metadata key.
        key: String,
        /// Elements counted so far, this array included.
        elements: u128,
        /// The limit.
        limit: u64,
    },
    /// A metadata value type id GGUF does not define.
    #[error(
        "{path}: metadata key `{key}` at byte {offset} has value type {type_id}, which GGUF does not define (types are 0 to 12); the file is corrupt, download it again"
    )]
    UnknownValueType {
        /// The file.
        path: PathBuf,
        /// Where the type id is.
        offset: u64,
        /// The metadata key.
        key: String,
        /// The type id found.
        type_id: u32,
    },
    /// A boolean that is neither 0 nor 1.
    #[error(
        "{path}: metadata key `{key}` at byte {offset} holds the boolean byte {value}, which is neither 0 nor 1; the file is corrupt, download it again"
    )]
    InvalidBool {
        /// The file.
        path: PathBuf,
        /// Where the byte is.
        offset: u64,
        /// The metadata key.
        key: String,
        /// The byte found.
        value: u8,
    },
    /// Arrays nested deeper than [`MAX_ARRAY_DEPTH`].
    #[error(
        "{path}: metadata key `{key}` at byte {offset} nests arrays more than {limit} deep; the file is corrupt, download it again"
    )]
    ArrayTooDeep {
        /// The file.
        path: PathBuf,
        /// Where the innermost array starts.
        offset: u64,
        /// The metadata key.
        key: String,
        /// The nesting limit.
        limit: usize,
    },
    /// The same metadata key appears twice.
    #[error(
        "{path}: metadata key `{key}` appears a second time at byte {offset}; the file is corrupt, download it again"
    )]
    DuplicateKey {
        /// The file.
        path: PathBuf,
        /// Where the second key starts.
        offset: u64,
        /// The key.
        key: String,
    },
    /// `general.alignment` is zero or not a power of two.
    #[error(
        "{path}: metadata key `general.alignment` is {value}, but the tensor-data alignment must be a power of two; the file is corrupt, download it again"
    )]
    InvalidAlignment {
        /// The file.
        path: PathBuf,
        /// The alignment found.
        value: u64,
    },
    /// A tensor with more than [`MAX_DIMENSIONS`] dimensions.
    #[error(
        "{path}: tensor `{tensor}` at byte {offset} has {dimensions} dimensions, but at most {limit} are allowed; the file is corrupt, download it again"
    )]
    TooManyDimensions {
        /// The file.
        path: PathBuf,
        /// Where the dimension count is.
        offset: u64,
        /// The tensor name.
        tensor: String,
        /// The declared dimension count.
        dimensions: u32,
        /// The limit.
        limit: u32,
    },
    /// A ggml tensor type id this server (candle) does not know.
    #[error(
        "{path}: tensor `{tensor}` at byte {offset} has ggml type id {type_id}, which this server cannot read (known ids: 0, 1, 2, 3, 6 to 15 and 30); re-quantize the model to a supported type"
    )]
    UnknownTensorType {
        /// The file.
        path: PathBuf,
        /// Where the type id is.
        offset: u64,
        /// The tensor name.
        tensor: String,
        /// The type id found.
        type_id: u32,
    },
    /// A tensor with a dimension of zero, or with no dimensions at all: it holds no values.
    ///
    /// Refused because no model weight is empty, and because candle 0.11.1 builds an empty tensor's block
    /// slice from an unaligned dangling pointer, which a debug build stops with a non-unwinding panic (an
    /// abort, not an error) while a release build has undefined behaviour.
    #[error(
        "{path}: tensor `{tensor}` has dimensions {dimensions:?} and so holds no values; the file is corrupt, download it again"
    )]
    EmptyTensor {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dimensions as stored (innermost first).
        dimensions: Vec<u64>,
    },
    /// A tensor's dimensions multiply past 2^64 elements.
    #[error(
        "{path}: tensor `{tensor}` has dimensions {dimensions:?}, whose element count overflows 64 bits; the file is corrupt, download it again"
    )]
    ElementCountOverflow {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dimensions as stored (innermost first).
        dimensions: Vec<u64>,
    },
    /// A tensor whose rows are not a whole number of its type's blocks.
    #[error(
        "{path}: tensor `{tensor}` of type {type_name} has rows of {row_length} values, not a whole number of its {block_size}-value blocks; the file is corrupt, download it again"
    )]
    PartialBlock {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The ggml type name.
        type_name: String,
        /// The innermost dimension.
        row_length: u64,
        /// Values per block of the type.
        block_size: u64,
    },
    /// The same tensor name appears twice.
    #[error(
        "{path}: tensor `{tensor}` is described a second time at byte {offset}; the file is corrupt, download it again"
    )]
    DuplicateTensor {
        /// The file.
        path: PathBuf,
        /// Where the second description starts.
        offset: u64,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor's data offset is not a multiple of the alignment.
    #[error(
        "{path}: tensor `{tensor}` has data offset {offset}, which is not a multiple of the alignment {alignment}; the file is corrupt, download it again"
    )]
    MisalignedTensor {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// Its offset inside the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// A tensor's data runs past the end of the file.
    #[error(
        "{path}: tensor `{tensor}` data ends at byte {} but the file has {} bytes; the file is truncated, download it again",
        grouped(.end), grouped(.file_size)
    )]
    TensorOutOfFile {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// Where its data starts in the file.
        start: u128,
        /// One past its last byte.
        end: u128,
        /// The file's size.
        file_size: u64,
    },
}

impl GgufError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            Self::Io { path, .. }
            | Self::NotGguf { path, .. }
            | Self::UnsupportedVersion { path, .. }
            | Self::Truncated { path, .. }
            | Self::CountTooLarge { path, .. }
            | Self::StringTooLong { path, .. }
            | Self::ArrayTooLong { path, .. }
            | Self::MetadataTooLarge { path, .. }
            | Self::UnknownValueType { path, .. }
            | Self::InvalidBool { path, .. }
            | Self::ArrayTooDeep { path, .. }
            | Self::DuplicateKey { path, .. }
            | Self::InvalidAlignment { path, .. }
            | Self::TooManyDimensions { path, .. }
            | Self::UnknownTensorType { path, .. }
            | Self::EmptyTensor { path, .. }
            | Self::ElementCountOverflow { path, .. }
            | Self::PartialBlock { path, .. }
            | Self::DuplicateTensor { path, .. }
            | Self::MisalignedTensor { path, .. }
            | Self::TensorOutOfFile { path, .. } => path,
        }
    }
}

impl From<GgufError> for crate::model::ModelError {
    /// Maps a failed check onto the model core's error: I/O stays I/O, an unknown tensor type becomes
    /// [`ModelError::UnsupportedTensorType`](crate::model::ModelError::UnsupportedTensorType), and the rest
    /// is carried whole as [`ModelError::Gguf`](crate::model::ModelError::Gguf), whose text is this error's
    /// own (file, offset, key or tensor, limit, and the advice that fits the finding).
    fn from(error: GgufError) -> Self {
        use crate::model::ModelError;
        match error {
            GgufError::Io { path, source } => ModelError::Io { path, source },
            GgufError::UnknownTensorType {
                path,
                tensor,
                type_id,
                ..
            } => ModelError::UnsupportedTensorType {
                path,
                detail: format!("tensor `{tensor}` has ggml type id {type_id}"),
            },
            other => ModelError::Gguf(other),
        }
    }
}

/// Checks the header, metadata and tensor directory of the GGUF file at `path` without reading tensor
/// data, so that candle's reader can then be trusted with it. See the module docs for what is checked.
pub fn validate(path: &Path) -> Result<Summary, GgufError> {
    let io_error = |source| GgufError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io_error)?;
    let file_size = file.metadata().map_err(io_error)?.len();
    let mut cursor = Cursor {
        path,
        reader: BufReader::new(file),
        position: 0,
        file_size,
        metadata_elements: 0,
    };
    check(&mut cursor)
}

/// As [`validate`], for a whole file already in memory (the fuzz target's entry point). `path` only names the
/// bytes in errors.
///
/// The same walk as for a file, so an `Ok` here means the same: candle's `Content::read` over these bytes
/// cannot panic or over-allocate, and every tensor it would read lies inside them.
pub fn validate_bytes(bytes: &[u8], path: &Path) -> Result<Summary, GgufError> {
    let mut cursor = Cursor {
        path,
        reader: bytes,
        position: 0,
        file_size: bytes.len() as u64,
        metadata_elements: 0,
    };
    check(&mut cursor)
}

/// A GGUF metadata value type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ValueType {
    Fixed { size: u64, name: &'static str },
    Bool,
    String,
    Array,
}

impl ValueType {
    fn from_id(id: u32) -> Option<Self> {
        let fixed = |size, name| Some(Self::Fixed { size, name });
        match id {
            0 => fixed(1, "u8"),
            1 => fixed(1, "i8"),
            2 => fixed(2, "u16"),
            3 => fixed(2, "i16"),
            4 => fixed(4, "u32"),
            5 => fixed(4, "i32"),
            6 => fixed(4, "f32"),
            7 => Some(Self::Bool),
            8 => Some(Self::String),
            9 => Some(Self::Array),
            10 => fixed(8, "u64"),
            11 => fixed(8, "i64"),
            12 => fixed(8, "f64"),
            _ => None,
        }
    }

    /// The fewest bytes one value of this type takes on disk.
    fn minimum_size(self) -> u64 {
        match self {
            Self::Fixed { size, .. } => size,
            Self::Bool => 1,
            Self::String => 8,
            Self::Array => 12,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Fixed { name, .. } => name,
            Self::Bool => "bool",
            Self::String => "string",
            Self::Array => "array",
        }
    }
}

/// What the walk reads from: bytes in order, and a forward skip that keeps what is buffered.
trait Source: Read {
    /// Moves `count` bytes forward without reading them; the caller checked that they are there.
    fn skip_forward(&mut self, count: i64) -> std::io::Result<()>;
}

/// A buffered reader that knows its position and the file size, so every read is checked first.
struct Cursor<'a, R> {
    path: &'a Path,
    reader: R,
    position: u64,
    file_size: u64,
    /// Array elements seen so far in the metadata, against [`MAX_METADATA_ELEMENTS`].
    metadata_elements: u64,
}

impl<R: Source> Cursor<'_, R> {
    fn remaining(&self) -> u64 {
        self.file_size.saturating_sub(self.position)
    }

    /// Fails with [`GgufError::Truncated`] unless `needed` bytes are left.
    fn need(&self, needed: u64, what: &dyn Fn() -> String) -> Result<(), GgufError> {
        if needed > self.remaining() {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                offset: self.position,
                what: what(),
                needed,
                file_size: self.file_size,
            });
        }
        Ok(())
    }

    fn read_array<const N: usize>(
        &mut self,
        what: &dyn Fn() -> String,
    ) -> Result<[u8; N], GgufError> {
        self.need(N as u64, what)?;
        let mut bytes = [0u8; N];
        self.reader
            .read_exact(&mut bytes)
            .map_err(|source| self.io_error(source))?;
        self.position += N as u64;
        Ok(bytes)
    }

    fn u8(&mut self, what: &dyn Fn() -> String) -> Result<u8, GgufError> {
        Ok(self.read_array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.read_array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.read_array(what)?))
    }

    /// Moves `count` bytes forward without reading them (they were checked to be there).
    fn skip(&mut self, count: u64, what: &dyn Fn() -> String) -> Result<(), GgufError> {
        self.need(count, what)?;
        let Ok(step) = i64::try_from(count) else {
            // `need` bounds `count` by the file size, which fits an i64 on every file system.
            return Err(self.io_error(std::io::Error::other("skip beyond i64")));
        };
        self.reader
            .skip_forward(step)
            .map_err(|source| self.io_error(source))?;
        self.position += count;
        Ok(())
    }

    /// Reads a string's length prefix and checks it against `limit` and the bytes left.
    fn string_length(&mut self, limit: u64, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        let offset = self.position;
        let length = self.u64(&|| format!("the length of {}", what()))?;
        let limit = limit.min(self.remaining());
        if length > limit {
            return Err(GgufError::StringTooLong {
                path: self.path.to_path_buf(),
                offset,
                what: what(),
                length,
                limit,
            });
        }
        Ok(length)
    }

    /// Reads a string of at most `limit` bytes (lossy UTF-8, trailing NULs dropped as candle does).
    fn string(&mut self, limit: u64, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let length = self.string_length(limit, what)?;
        // `string_length` bounded `length` by `limit` (at most MAX_NAME_LENGTH here) and the bytes left.
        let mut bytes = vec![0u8; length as usize];
        self.reader
            .read_exact(&mut bytes)
            .map_err(|source| self.io_error(source))?;
        self.position += length;
        while bytes.last() == Some(&0) {
            bytes.pop();
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn io_error(&self, source: std::io::Error) -> GgufError {
        GgufError::Io {
            path: self.path.to_path_buf(),
            source,
        }
    }
}

impl Source for BufReader<File> {
    fn skip_forward(&mut self, count: i64) -> std::io::Result<()> {
        // `seek_relative` keeps the buffer when the target is inside it; a plain seek would drop it and make
        // every skipped vocabulary string a system call.
        self.seek_relative(count)
    }
}

impl Source for &[u8] {
    fn skip_forward(&mut self, count: i64) -> std::io::Result<()> {
        let rest = usize::try_from(count)
            .ok()
            .and_then(|count| self.get(count..))
            .ok_or_else(|| std::io::Error::other("skip beyond the end of the bytes"))?;
        *self = rest;
        Ok(())
    }
}

/// The walk over the header sections.
fn check(cursor: &mut Cursor<'_, impl Source>) -> Result<Summary, GgufError> {
    let path = cursor.path;
    let magic = cursor.read_array::<4>(&|| "the GGUF magic".to_string())?;
    if &magic != b"GGUF" {
        return Err(GgufError::NotGguf {
            path: path.to_path_buf(),
            magic,
        });
    }
    let version = cursor.u32(&|| "the GGUF version".to_string())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    let tensor_count_offset = cursor.position;
    let tensor_count = cursor.u64(&|| "the tensor count".to_string())?;
    let metadata_count_offset = cursor.position;
    let metadata_count = cursor.u64(&|| "the metadata entry count".to_string())?;
    // A metadata entry takes at least a key length, a type id and one byte; a tensor description at
    // least a name length, a dimension count, a type id and an offset.
    for (offset, count, per_entry, what) in [
        (
            metadata_count_offset,
            metadata_count,
            8 + 4 + 1,
            "metadata entries",
        ),
        (tensor_count_offset, tensor_count, 8 + 4 + 4 + 8, "tensors"),
    ] {
        let minimum_bytes = u128::from(count) * per_entry;
        if minimum_bytes > u128::from(cursor.remaining()) {
            return Err(GgufError::CountTooLarge {
                path: path.to_path_buf(),
                offset,
                what,
                count,
                minimum_bytes,
                remaining: cursor.remaining(),
            });
        }
    }

    let mut keys = HashSet::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    let mut architecture = None;
    for index in 0..metadata_count {
        let key_offset = cursor.position;
        let key = cursor.string(MAX_NAME_LENGTH, &|| {
            format!("the key of metadata entry {index}")
        })?;
        if !keys.insert(key.clone()) {
            return Err(GgufError::DuplicateKey {
                path: path.to_path_buf(),
                offset: key_offset,
                key,
            });
        }
        let value_type = read_value_type(cursor, &key)?;
        match (key.as_str(), value_type) {
            ("general.alignment", ValueType::Fixed { size, name }) => {
                alignment = read_alignment(cursor, size, name, &key)?;
            }
            ("general.architecture", ValueType::String) => {
                architecture = Some(cursor.string(MAX_NAME_LENGTH, &|| {
                    format!("the value of metadata key `{key}`")
                })?);
            }
            _ => skip_value(cursor, value_type, &key, 0)?,
        }
    }

    let mut tensors = Vec::new();
    let mut names = HashSet::new();
    for index in 0..tensor_count {
        let name_offset = cursor.position;
        let name = cursor.string(MAX_NAME_LENGTH, &|| format!("the name of tensor {index}"))?;
        if !names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor {
                path: path.to_path_buf(),
                offset: name_offset,
                tensor: name,
            });
        }
        let what = |field: &str| format!("the {field} of tensor `{name}`");
        let dimensions_offset = cursor.position;
        let dimension_count = cursor.u32(&|| what("dimension count"))?;
        if dimension_count > MAX_DIMENSIONS {
            return Err(GgufError::TooManyDimensions {
                path: path.to_path_buf(),
                offset: dimensions_offset,
                tensor: name,
                dimensions: dimension_count,
                limit: MAX_DIMENSIONS,
            });
        }
        let mut dimensions = Vec::with_capacity(dimension_count as usize);
        for _ in 0..dimension_count {
            dimensions.push(cursor.u64(&|| what("dimensions"))?);
        }
        if dimensions.is_empty() || dimensions.contains(&0) {
            return Err(GgufError::EmptyTensor {
                path: path.to_path_buf(),
                tensor: name,
                dimensions,
            });
        }
        let type_offset = cursor.position;
        let type_id = cursor.u32(&|| what("ggml type"))?;
        let Some(dtype) = ggml_type(type_id) else {
            return Err(GgufError::UnknownTensorType {
                path: path.to_path_buf(),
                offset: type_offset,
                tensor: name,
                type_id,
            });
        };
        let offset = cursor.u64(&|| what("data offset"))?;
        tensors.push(TensorEntry {
            name,
            dimensions,
            dtype,
            offset,
        });
    }

    let tensor_data_offset = cursor.position.div_ceil(alignment) * alignment;
    let mut tensor_data_end = tensor_data_offset;
    for tensor in &tensors {
        let end = tensor.check(path, alignment, tensor_data_offset, cursor.file_size)?;
        // `check` bounded `end` by the file size.
        tensor_data_end = tensor_data_end.max(end as u64);
    }
    Ok(Summary {
        version,
        file_size: cursor.file_size,
        metadata_count,
        tensor_count,
        architecture,
        alignment,
        tensor_data_offset,
        tensor_data_end,
    })
}

/// One tensor's description from the directory.
struct TensorEntry {
    name: String,
    /// Innermost first, as stored.
    dimensions: Vec<u64>,
    dtype: GgmlDType,
    offset: u64,
}

impl TensorEntry {
    /// Checks the element count, blocks, alignment and data range; returns where the data ends.
    fn check(
        &self,
        path: &Path,
        alignment: u64,
        tensor_data_offset: u64,
        file_size: u64,
    ) -> Result<u128, GgufError> {
        // candle multiplies the dimensions in `usize`; a product past 64 bits panics there in debug builds.
        let elements = self
            .dimensions
            .iter()
            .try_fold(1u64, |product, &dimension| product.checked_mul(dimension))
            .filter(|&elements| usize::try_from(elements).is_ok());
        let Some(elements) = elements else {
            return Err(GgufError::ElementCountOverflow {
                path: path.to_path_buf(),
                tensor: self.name.clone(),
                dimensions: self.dimensions.clone(),
            });
        };
        let block_size = self.dtype.block_size() as u64;
        let row_length = self.dimensions.first().copied().unwrap_or(1);
        if !row_length.is_multiple_of(block_size) {
            return Err(GgufError::PartialBlock {
                path: path.to_path_buf(),
                tensor: self.name.clone(),
                type_name: crate::model::type_name(self.dtype),
                row_length,
                block_size,
            });
        }
        if !self.offset.is_multiple_of(alignment) {
            return Err(GgufError::MisalignedTensor {
                path: path.to_path_buf(),
                tensor: self.name.clone(),
                offset: self.offset,
                alignment,
            });
        }
        let bytes = u128::from(elements / block_size) * self.dtype.type_size() as u128;
        let start = u128::from(tensor_data_offset) + u128::from(self.offset);
        let end = start + bytes;
        if end > u128::from(file_size) {
            return Err(GgufError::TensorOutOfFile {
                path: path.to_path_buf(),
                tensor: self.name.clone(),
                start,
                end,
                file_size,
            });
        }
        Ok(end)
    }
}

/// Reads a metadata value type id and maps it.
fn read_value_type(
    cursor: &mut Cursor<'_, impl Source>,
    key: &str,
) -> Result<ValueType, GgufError> {
    let offset = cursor.position;
    let type_id = cursor.u32(&|| format!("the value type of metadata key `{key}`"))?;
    ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
        path: cursor.path.to_path_buf(),
        offset,
        key: key.to_string(),
        type_id,
    })
}

/// Reads `general.alignment` the way candle does, rejecting the zero candle would divide by (and any
/// other value that is not a power of two, which GGUF forbids).
fn read_alignment(
    cursor: &mut Cursor<'_, impl Source>,
    size: u64,
    name: &'static str,
    key: &str,
) -> Result<u64, GgufError> {
    let what = || format!("the value of metadata key `{key}`");
    let raw = match size {
        1 => u64::from(cursor.u8(&what)?),
        2 => u64::from(u16::from_le_bytes(cursor.read_array(&what)?)),
        4 => u64::from(cursor.u32(&what)?),
        _ => cursor.u64(&what)?,
    };
    // candle honours u8/u16/u32 and non-negative i8/i16/i32 values; for 64-bit and negative values it
    // uses the default, so this check must too or the data offsets would disagree with candle's.
    let value = match name {
        "u8" | "u16" | "u32" => raw,
        "i8" if raw < 0x80 => raw,
        "i16" if raw < 0x8000 => raw,
        "i32" if raw < 0x8000_0000 => raw,
        _ => return Ok(DEFAULT_ALIGNMENT),
    };
    if !value.is_power_of_two() {
        return Err(GgufError::InvalidAlignment {
            path: cursor.path.to_path_buf(),
            value,
        });
    }
    Ok(value)
}

/// Steps over one value of `value_type`, checking every length and nested type on the way.
fn skip_value(
    cursor: &mut Cursor<'_, impl Source>,
    value_type: ValueType,
    key: &str,
    depth: usize,
) -> Result<(), GgufError> {
    let what = || format!("the value of metadata key `{key}`");
    match value_type {
        ValueType::Fixed { size, .. } => cursor.skip(size, &what),
        ValueType::Bool => {
            let offset = cursor.position;
            let value = cursor.u8(&what)?;
            if value > 1 {
                return Err(GgufError::InvalidBool {
                    path: cursor.path.to_path_buf(),
                    offset,
                    key: key.to_string(),
                    value,
                });
            }
            Ok(())
        }
        ValueType::String => {
            let length = cursor.string_length(u64::MAX, &what)?;
            cursor.skip(length, &what)
        }
        ValueType::Array => {
            let array_offset = cursor.position;
            if depth >= MAX_ARRAY_DEPTH {
                return Err(GgufError::ArrayTooDeep {
                    path: cursor.path.to_path_buf(),
                    offset: array_offset,
                    key: key.to_string(),
                    limit: MAX_ARRAY_DEPTH,
                });
            }
            let element_type = read_value_type(cursor, key)?;
            let length_offset = cursor.position;
            let length = cursor.u64(&|| format!("the array length of metadata key `{key}`"))?;
            let minimum_bytes = u128::from(length) * u128::from(element_type.minimum_size());
            if minimum_bytes > u128::from(cursor.remaining()) {
                return Err(GgufError::ArrayTooLong {
                    path: cursor.path.to_path_buf(),
                    offset: length_offset,
                    key: key.to_string(),
                    length,
                    element_type: element_type.name(),
                    minimum_bytes,
                    remaining: cursor.remaining(),
                });
            }
            let elements = u128::from(cursor.metadata_elements) + u128::from(length);
            if elements > u128::from(MAX_METADATA_ELEMENTS) {
                return Err(GgufError::MetadataTooLarge {
                    path: cursor.path.to_path_buf(),
                    offset: length_offset,
                    key: key.to_string(),
                    elements,
                    limit: MAX_METADATA_ELEMENTS,
                });
            }
            // Bounded by MAX_METADATA_ELEMENTS just above.
            cursor.metadata_elements = elements as u64;
            match element_type {
                // The product was bounded by the bytes left just above.
                ValueType::Fixed { size, .. } => cursor.skip(length * size, &what),
                _ => {
                    for _ in 0..length {
                        skip_value(cursor, element_type, key, depth + 1)?;
                    }
                    Ok(())
                }
            }
        }
    }
}

/// The ggml types candle can read, by GGUF type id.
fn ggml_type(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// `1234567` as `1,234,567`: byte offsets in error text are read by people.
fn grouped(value: &impl ToString) -> String {
    let digits = value.to_string();
    let mut text = String::with_capacity(digits.len() + digits.len() / 3);
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            text.push(',');
        }
        text.push(digit);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_puts_commas_between_thousands() {
        assert_eq!(grouped(&0u64), "0");
        assert_eq!(grouped(&999u64), "999");
        assert_eq!(grouped(&1000u64), "1,000");
        assert_eq!(grouped(&9_437_184u64), "9,437,184");
        assert_eq!(
            grouped(&u128::MAX),
            "340,282,366,920,938,463,463,374,607,431,768,211,455"
        );
    }

    #[test]
    fn the_metadata_cap_bounds_candles_values_to_half_a_gigabyte() {
        let value_size = std::mem::size_of::<candle_core::quantized::gguf_file::Value>() as u64;
        assert_eq!(
            value_size, 32,
            "the cap's documentation assumes 32-byte values"
        );
        assert_eq!(MAX_METADATA_ELEMENTS * value_size, 512 << 20);
    }

    #[test]
    fn every_ggml_type_id_candle_reads_is_known_and_the_rest_are_not() {
        let known: Vec<u32> = (0..64).filter(|&id| ggml_type(id).is_some()).collect();
        assert_eq!(known, [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 30]);
    }
}
