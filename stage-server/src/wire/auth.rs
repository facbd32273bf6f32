//! Link authentication: a cluster key shared by every stage, fresh nonces, and HMAC-SHA256 proofs over both.
//!
//! Each side proves the key with `HMAC-SHA256(key, LABEL || side || connecting_nonce || accepting_nonce)`.
//! The label keeps these MACs apart from any other use of the key; the side byte keeps a side from passing
//! its peer's proof back as its own; both nonces make every proof good for one link only. A peer without the
//! key learns nothing it can replay. See the module docs of [`wire`](super) for the order of the frames.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Shortest key accepted: 128 bits.
const MINIMUM_KEY_BYTES: usize = 16;

/// Fixed label mixed into every proof (domain separation).
const LABEL: &[u8] = b"stage-server link proof v1\0";

/// The secret every stage of a cluster shares. Its `Debug` shows only its length.
#[derive(Clone)]
pub struct ClusterKey(Vec<u8>);

/// Why a cluster key could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key file could not be read.
    #[error("cannot read cluster key file {path}: {source}; check the path and its permissions")]
    Read {
        /// The key file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// The key file holds too few bytes.
    #[error(
        "cluster key file {path} holds {length} bytes, fewer than the {minimum} a key needs; write a longer random key, e.g. `head -c 32 /dev/urandom > {path}`"
    )]
    FileTooShort {
        /// The key file.
        path: PathBuf,
        /// Its key's length.
        length: usize,
        /// The least accepted.
        minimum: usize,
    },
    /// The key bytes given are too few.
    #[error(
        "a cluster key of {length} bytes is shorter than the {minimum} a key needs; use a longer random key"
    )]
    TooShort {
        /// The length given.
        length: usize,
        /// The least accepted.
        minimum: usize,
    },
}

/// Which end of a link a proof is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The side that opened the connection (the upstream stage, or stage 0 on a prediction return).
    Connecting,
    /// The side that accepted it.
    Accepting,
}

impl ClusterKey {
    /// A key of `bytes`, at least 16 of them.
    pub fn from_bytes(bytes: &[u8]) -> Result<ClusterKey, KeyError> {
        if bytes.len() < MINIMUM_KEY_BYTES {
            return Err(KeyError::TooShort {
                length: bytes.len(),
                minimum: MINIMUM_KEY_BYTES,
            });
        }
        Ok(ClusterKey(bytes.to_vec()))
    }

    /// The key in the file at `path`: its bytes, less one line ending at the end when the file is text (so a
    /// key written by `openssl rand -hex 32 > FILE` and one edited by hand are the same key); at least 16.
    pub fn load(path: &Path) -> Result<ClusterKey, KeyError> {
        let bytes = std::fs::read(path).map_err(|source| KeyError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let key = key_bytes(&bytes);
        ClusterKey::from_bytes(key).map_err(|_| KeyError::FileTooShort {
            path: path.to_path_buf(),
            length: key.len(),
            minimum: MINIMUM_KEY_BYTES,
        })
    }
}

impl Side {
    fn label(self) -> u8 {
        match self {
            Side::Connecting => b'C',
            Side::Accepting => b'A',
        }
    }
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "ClusterKey({} bytes)", self.0.len())
    }
}

/// 16 random bytes from the kernel for a hello's nonce.
///
/// # Panics
///
/// When `/dev/urandom` cannot be read (a broken system); use [`try_fresh_nonce`] to handle that.
pub fn fresh_nonce() -> [u8; 16] {
    try_fresh_nonce()
        .unwrap_or_else(|error| panic!("cannot read /dev/urandom for a nonce: {error}"))
}

/// 16 random bytes from `/dev/urandom` (one open and read, a few microseconds).
pub fn try_fresh_nonce() -> std::io::Result<[u8; 16]> {
    let mut nonce = [0; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut nonce)?;
    Ok(nonce)
}

/// The proof `side` sends for a link whose hellos carried these nonces.
pub fn proof(
    key: &ClusterKey,
    side: Side,
    connecting_nonce: &[u8; 16],
    accepting_nonce: &[u8; 16],
) -> [u8; 32] {
    mac(key, side, connecting_nonce, accepting_nonce)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `proof` is what `side` must send for these nonces under `key`, compared in constant time.
pub fn verify(
    key: &ClusterKey,
    side: Side,
    connecting_nonce: &[u8; 16],
    accepting_nonce: &[u8; 16],
    proof: &[u8; 32],
) -> bool {
    mac(key, side, connecting_nonce, accepting_nonce)
        .verify_slice(proof)
        .is_ok()
}

fn mac(
    key: &ClusterKey,
    side: Side,
    connecting_nonce: &[u8; 16],
    accepting_nonce: &[u8; 16],
) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(&key.0).expect("HMAC takes a key of any length");
    mac.update(LABEL);
    mac.update(&[side.label()]);
    mac.update(connecting_nonce);
    mac.update(accepting_nonce);
    mac
}

/// The key in a file's bytes: a text file loses one trailing `\n` or `\r\n`, a binary file keeps every byte.
fn key_bytes(bytes: &[u8]) -> &[u8] {
    let text = std::str::from_utf8(bytes).is_ok_and(|text| {
        text.trim_end_matches(['\r', '\n'])
            .chars()
            .all(|character| !character.is_control())
    });
    if !text {
        return bytes;
    }
    let bytes = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    bytes.strip_suffix(b"\r").unwrap_or(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> ClusterKey {
        ClusterKey::from_bytes(&[byte; 32]).unwrap()
    }

    const CONNECTING: [u8; 16] = [1; 16];
    const ACCEPTING: [u8; 16] = [2; 16];

    #[test]
    fn a_proof_verifies_under_the_same_key_side_and_nonces() {
        for side in [Side::Connecting, Side::Accepting] {
            let proof = proof(&key(7), side, &CONNECTING, &ACCEPTING);
            assert!(
                verify(&key(7), side, &CONNECTING, &ACCEPTING, &proof),
                "a {side:?} proof did not verify under its own key"
            );
        }
    }

    #[test]
    fn a_wrong_key_fails() {
        let proof = proof(&key(7), Side::Connecting, &CONNECTING, &ACCEPTING);
        assert!(
            !verify(&key(8), Side::Connecting, &CONNECTING, &ACCEPTING, &proof),
            "a proof made with another key verified"
        );
    }

    #[test]
    fn a_proof_sent_back_as_the_other_side_fails() {
        let proof = proof(&key(7), Side::Accepting, &CONNECTING, &ACCEPTING);
        assert!(
            !verify(&key(7), Side::Connecting, &CONNECTING, &ACCEPTING, &proof),
            "the accepting side's proof passed as the connecting side's: a reflection would work"
        );
    }

    #[test]
    fn swapped_or_other_nonces_fail() {
        let proof = proof(&key(7), Side::Connecting, &CONNECTING, &ACCEPTING);
        assert!(
            !verify(&key(7), Side::Connecting, &ACCEPTING, &CONNECTING, &proof),
            "a proof verified with its nonces swapped"
        );
        assert!(
            !verify(&key(7), Side::Connecting, &CONNECTING, &[3; 16], &proof),
            "a proof from another link verified"
        );
    }

    #[test]
    fn a_key_shorter_than_sixteen_bytes_is_refused() {
        let error = ClusterKey::from_bytes(&[0; 15]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "a cluster key of 15 bytes is shorter than the 16 a key needs; use a longer random key",
            "the short key text"
        );
    }

    #[test]
    fn a_text_key_file_loses_its_line_ending_and_a_binary_one_keeps_every_byte() {
        assert_eq!(
            key_bytes(b"abcdef\r\n"),
            b"abcdef",
            "a CRLF line ending stayed"
        );
        assert_eq!(
            key_bytes(b"abcdef\n"),
            b"abcdef",
            "an LF line ending stayed"
        );
        assert_eq!(
            key_bytes(b"\x00\xff\n"),
            b"\x00\xff\n",
            "a binary key lost a byte"
        );
    }

    #[test]
    fn fresh_nonces_differ() {
        assert_ne!(fresh_nonce(), fresh_nonce(), "two nonces were equal");
    }

    #[test]
    fn a_key_does_not_show_in_debug_output() {
        assert_eq!(
            format!("{:?}", key(0x41)),
            "ClusterKey(32 bytes)",
            "the key leaked"
        );
    }
}
