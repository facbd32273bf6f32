//! The model fingerprint: sha256 of a GGUF file's header, metadata and tensor table, without the weights.

use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::ModelError;

/// The sha256 of everything in the GGUF file at `path` before its tensor data: the header, every metadata
/// key and value, and the tensor-info table (names, types, shapes, offsets), with the alignment padding.
///
/// Two stages compare fingerprints in their hellos to know they loaded the same model. Hashing only the
/// header costs a few milliseconds even for a multi-gigabyte file (gemma 3's header, with its 262,144-token
/// vocabulary, is a few MiB), where hashing the weights would take seconds. The price: two files that differ
/// only in their tensor data (a fine-tune saved with identical metadata, or a corrupted download) share a
/// fingerprint; the GGUF pre-check and each stage's own load still catch a truncated file.
///
/// The file is checked with [`crate::model::gguf_check::validate`] first, so a malformed header is reported as
/// such instead of being hashed.
pub fn fingerprint(path: &Path) -> Result<[u8; 32], ModelError> {
    let summary = crate::model::gguf_check::validate(path)?;
    let io_error = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io_error)?;
    let mut header = file.take(summary.tensor_data_offset);
    let mut hasher = Sha256::new();
    let mut buffer = vec![0; 64 << 10];
    let mut hashed = 0u64;
    loop {
        let read = header.read(&mut buffer).map_err(io_error)?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
        hashed += read as u64;
    }
    if hashed != summary.tensor_data_offset {
        // The file shrank between the check and the read.
        return Err(ModelError::Format {
            path: path.to_path_buf(),
            detail: format!(
                "the header ends at byte {} but only {hashed} bytes could be read",
                summary.tensor_data_offset
            ),
        });
    }
    Ok(hasher.finalize().into())
}
