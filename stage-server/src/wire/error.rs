//! Why bytes from a link are not a frame of this protocol: each text names the field, the value and the limit.

use super::codec::Codec;
use super::frame::ErrorCode;

/// Why the decoder refused its input. After one, the link's byte stream cannot be trusted any further: answer
/// with an `Error` frame of [`WireError::code`] and close the link.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// A frame's length is over [`WireLimits::max_frame_bytes`](super::WireLimits::max_frame_bytes).
    #[error(
        "a frame declares {length} bytes, over the limit of {limit}; the peer is not a stage of this protocol, or raise the frame limit if its chunks are that large"
    )]
    FrameTooLarge {
        /// The declared length.
        length: u64,
        /// The limit.
        limit: usize,
    },
    /// A frame's length is zero, so it has no kind byte.
    #[error(
        "a frame declares length 0 and has no kind byte; the peer is not a stage of this protocol"
    )]
    EmptyFrame,
    /// A kind byte names no frame of this protocol.
    #[error(
        "frame kind {0} is not one of this protocol's (1 to 12); the peer is not a stage of this protocol"
    )]
    UnknownKind(u8),
    /// A frame ends before one of its fields does.
    #[error(
        "{} frame of {length} bytes ends inside its {field}; the peer wrote a broken frame",
        with_article(.kind)
    )]
    Truncated {
        /// The frame kind's name.
        kind: &'static str,
        /// The field it ends in.
        field: &'static str,
        /// The frame's declared length.
        length: u32,
    },
    /// A frame has bytes after its last field.
    #[error(
        "{} frame of {length} bytes has {extra} {} after its last field; the peer wrote a broken frame",
        with_article(.kind),
        bytes_word(u64::from(*.extra))
    )]
    TrailingBytes {
        /// The frame kind's name.
        kind: &'static str,
        /// The frame's declared length.
        length: u32,
        /// The bytes left over.
        extra: u32,
    },
    /// A count or length inside a frame is over its limit.
    #[error(
        "{} frame carries {count} {field}, over the limit of {limit}; the peer sent more than this stage accepts",
        with_article(.kind)
    )]
    TooMany {
        /// The frame kind's name.
        kind: &'static str,
        /// What is counted (`rows`, `values per row`, `stop tokens`, ...).
        field: &'static str,
        /// The count it holds.
        count: u64,
        /// The limit.
        limit: u64,
    },
    /// A hello does not start with [`MAGIC`](super::MAGIC).
    #[error(
        "a hello starts with {} instead of {}; the peer is not a stage-server stage",
        hex(.found),
        hex(&super::MAGIC)
    )]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// A hello is of another protocol version.
    #[error(
        "the peer speaks stage protocol version {found} but this stage speaks version {supported}; run the same stage-server release on every stage"
    )]
    Version {
        /// The peer's version.
        found: u16,
        /// This build's [`PROTOCOL_VERSION`](super::PROTOCOL_VERSION).
        supported: u16,
    },
    /// A field holds a value it has no meaning for (a flag that is not 0 or 1, an unknown codec, role or code).
    #[error(
        "{} frame's {field} holds {value}, which is not one of its values; the peer wrote a broken frame",
        with_article(.kind)
    )]
    BadValue {
        /// The frame kind's name.
        kind: &'static str,
        /// The field.
        field: &'static str,
        /// The value found.
        value: u64,
    },
    /// A text field is not UTF-8.
    #[error(
        "{} frame's {field} is not UTF-8; the peer wrote a broken frame",
        with_article(.kind)
    )]
    BadText {
        /// The frame kind's name.
        kind: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A row frame's batch counts fewer rows in all than it must hold: one per frame, and this frame's own.
    #[error(
        "{} frame's batch counts {batch_rows} {} in all, {}; the peer wrote a broken frame",
        with_article(.kind),
        rows_word(*.batch_rows),
        batch_shortfall(*.least, *.this_frame)
    )]
    BatchRows {
        /// The frame kind's name.
        kind: &'static str,
        /// The batch's row count.
        batch_rows: u32,
        /// The least it may count: the batch's frame count, or this frame's rows.
        least: u32,
        /// Whether `least` is this frame's rows (else the batch's frame count).
        this_frame: bool,
    },
    /// An activation payload's byte count does not match its shape.
    #[error(
        "an activation payload of {rows} x {width} values in {codec} needs {expected} {} but declares {bytes}; the peer wrote a broken frame",
        bytes_word(*.expected)
    )]
    RowsMismatch {
        /// Rows declared.
        rows: u32,
        /// Width declared.
        width: u32,
        /// The codec.
        codec: Codec,
        /// Bytes the shape needs.
        expected: u64,
        /// Bytes declared.
        bytes: u32,
    },
}

impl WireError {
    /// The code of the `Error` frame that answers this error: [`ErrorCode::Version`] for another version,
    /// [`ErrorCode::Protocol`] for everything else.
    pub fn code(&self) -> ErrorCode {
        match self {
            WireError::Version { .. } => ErrorCode::Version,
            _ => ErrorCode::Protocol,
        }
    }
}

/// `a hello`, `an error`: a frame kind's name after its article.
fn with_article(kind: &str) -> String {
    let article = if kind.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{article} {kind}")
}

/// `byte` or `bytes`, for a count.
fn bytes_word(count: u64) -> &'static str {
    if count == 1 { "byte" } else { "bytes" }
}

fn rows_word(count: u32) -> &'static str {
    if count == 1 { "row" } else { "rows" }
}

fn batch_shortfall(least: u32, this_frame: bool) -> String {
    if this_frame {
        format!("but this frame alone carries {least}")
    } else {
        format!("fewer than its frame count of {least} (each frame carries a row)")
    }
}

/// Bytes as `0x..` hex.
fn hex(bytes: &[u8]) -> String {
    let digits: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("0x{digits}")
}
