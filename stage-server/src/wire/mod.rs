//! The stage protocol, sans IO: hellos, frames, activation codecs, link authentication and an incremental decoder.
//!
//! Nothing here touches a socket, a thread or a clock. A driver (the stage process in `serve`, stage 0's side
//! in `driver`) reads bytes from its link and hands them to a [`Decoder`], acts on the [`Frame`]s it returns,
//! and writes what [`encode`] appends. So the same code runs under property tests and a fuzzer as on a link.
//!
//! # Framing
//!
//! One ordered byte stream per link, every integer little-endian. A frame is
//!
//! ```text
//!   +----------------+------+---------------------+
//!   | length: u32 LE | kind | body (length-1 B)   |
//!   +----------------+------+---------------------+
//! ```
//!
//! where `length` counts the kind byte and the body. The decoder refuses a length over
//! [`WireLimits::max_frame_bytes`] as soon as the four length bytes are in, and every count inside a body
//! (rows, width, stop tokens, logit biases, alternatives, timings, message bytes) as soon as its own field is
//! in, before anything is allocated for it. The layout of each kind is in the docs of [`Frame`].
//!
//! Frozen across protocol versions, so that two releases can still refuse each other in words: the framing
//! above, the first fields of a hello ([`MAGIC`], then the `u16` version) and the layout of the `Error` frame.
//! A hello of another version fails to decode with [`WireError::Version`], which the driver answers with an
//! `Error` frame of code [`ErrorCode::Version`] before it closes the link.
//!
//! # Opening a link
//!
//! The stage that serves the earlier layers connects; the next stage accepts. With a cluster key
//! (`--cluster-key FILE`) both sides prove they hold it, and the accepting side reads no other frame before a
//! valid proof, so a peer without the key never gets an activation in:
//!
//! ```text
//!   connecting side (upstream)                         accepting side (downstream)
//!   ------------------------------                     ------------------------------
//!   c = fresh_nonce() (zeros without a key)
//!   Hello { nonce: c, proof: None }   ───────────────▶ check_adjacent(upstream, own hello)
//!                                                      mismatch: Error { code, "stage 1 serves ..." }, close
//!                                                      a = fresh_nonce() (zeros without a key)
//!                                      ◀─────────────── Hello { nonce: a, proof: proof(key, Accepting, c, a) }
//!   check_adjacent(own hello, downstream)
//!   verify(key, Accepting, c, a, proof)
//!   mismatch or bad proof: Error { code }, close
//!   Proof { proof(key, Connecting, c, a) } ──────────▶ verify(key, Connecting, c, a, proof)
//!                                                      bad or missing: Error { Auth }, close
//!   Configure / Prefill / Decode / ... ─────────────▶  (only now)
//!                                      ◀─────────────── Ack / Token / Error
//! ```
//!
//! Without a key on either side the `Proof` frame is not sent and both nonces are zero. A keyed side that sees
//! an all-zero nonce or a missing proof from its peer refuses it ([`ErrorCode::Auth`]): the key is all or
//! nothing across a cluster. Each proof covers both nonces and its own side, so neither a proof replayed from
//! another link nor the peer's own proof sent back is accepted.
//!
//! A prediction-return link (stage 0 connects to the last stage with [`Role::PredictionReturn`]) opens the
//! same way but its two stages are not adjacent: check it with [`check_same_model`] instead.

mod auth;
mod codec;
mod decode;
mod error;
mod frame;
mod hello;

pub use auth::{ClusterKey, KeyError, Side, fresh_nonce, proof, try_fresh_nonce, verify};
pub use codec::{Activations, Codec, CodecPolicy, CodecSet};
pub use decode::Decoder;
pub use error::WireError;
pub use frame::{Batch, ErrorCode, Frame, Sampling, StageTiming, encode, encode_to_vec};
pub use hello::{Hello, Mismatch, Role, check_adjacent, check_codec, check_same_model};

/// The four bytes every hello starts with.
pub const MAGIC: [u8; 4] = *b"SSTG";

/// The protocol version this build speaks; both ends of a link must speak the same one.
///
/// Bump it with any change to a frame's layout or meaning: the peer refuses another version instead of
/// misreading it.
///
/// Version 2: `Configure` carries whether the token's log-probability is wanted.
/// Version 3: a hello carries the address of the chain's last stage, for direct prediction return.
/// Version 4: `Prefill` and `Decode` carry the sender's step ([`Batch`]), so a stage runs a batch's rows together;
/// `Configure` can resume a session kept open from an earlier generation (prefix reuse down a chain).
/// Version 5: a hello carries a lane's context length, the chain's least in an answer.
/// Version 6: `Ping` and `Pong`, a liveness check through the chain's links.
/// Version 7: an answering hello's lane count is the chain's fewest from that stage on.
/// Version 8: a row frame's [`Batch`] carries the step's rows in all, so a stage waits for a late frame of a
/// long batch instead of splitting it.
pub const PROTOCOL_VERSION: u16 = 8;

/// Bounds the decoder checks before it allocates anything for a field.
///
/// The defaults fit the largest frames a stage sends (a prefill chunk of 4096 rows of a 65,536-wide model in
/// f32 is 1 GiB, so chunks that large need a larger `max_frame_bytes`; the default 64 MiB holds 512 rows of
/// width 32,768).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireLimits {
    /// Largest frame, counting its kind byte and body (not the four length bytes).
    pub max_frame_bytes: usize,
    /// Most activation rows in one frame.
    pub max_rows: u32,
    /// Widest activation row.
    pub max_width: u32,
    /// Most top alternatives a `Configure` may ask for and a `Token` may carry.
    pub max_top_logprobs: u8,
    /// Most stop tokens in a `Configure`.
    pub max_stop_tokens: u32,
    /// Most tokens a `Configure` hands the penalties as history.
    pub max_history: u32,
    /// Most logit-bias entries in a `Configure`.
    pub max_logit_bias: u32,
    /// Longest `Error` message in bytes.
    pub max_message_bytes: u32,
    /// Most per-stage timings in an `Ack` (one per stage of the chain).
    pub max_timings: u32,
}

impl Default for WireLimits {
    fn default() -> Self {
        Self {
            max_frame_bytes: 64 << 20,
            max_rows: 4096,
            max_width: 65536,
            max_top_logprobs: 20,
            max_stop_tokens: 64,
            max_history: 65536,
            max_logit_bias: 1024,
            max_message_bytes: 4096,
            max_timings: 256,
        }
    }
}
