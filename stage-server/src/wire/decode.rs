//! The incremental decoder: bytes in whatever pieces a link delivers them, frames out, every bound checked first.
//!
//! ```text
//!   input ──▶ header (5 B: length, kind) ──▶ length and kind checked
//!                  │
//!                  ├─ whole frame in this input: parsed in place, nothing buffered
//!                  │
//!                  └─ else body bytes buffered (never more than the declared length), and the prefix parsed
//!                     after each piece until every count and limit of the frame has been seen; then only
//!                     buffered until complete, and parsed once
//! ```
//!
//! Every field is read in wire order, so a count over its limit is refused as soon as its own bytes are in,
//! before the bytes it counts arrive or anything is allocated for them. The memory one decoder holds is at
//! most the frame it is in the middle of: `max_frame_bytes` plus its 5 header bytes.

use super::codec::{Activations, Codec, CodecSet};
use super::error::WireError;
use super::frame::{Batch, ErrorCode, Frame, Sampling, StageTiming, kind};
use super::hello::{Hello, Role};
use super::{MAGIC, PROTOCOL_VERSION, WireLimits};

/// Length and kind of a frame.
const HEADER_BYTES: usize = 5;

/// The largest body buffer kept for the next frame once a frame completes.
pub(crate) const RETAINED_BYTES: usize = 4096;

/// Turns a link's bytes into frames, whatever the read boundaries.
///
/// After an error the decoder keeps returning it: the stream's frame boundaries are lost, so the link must
/// be closed.
#[derive(Debug)]
pub struct Decoder {
    limits: WireLimits,
    header: [u8; HEADER_BYTES],
    header_filled: usize,
    /// The current frame's body bytes, once its header is complete and its body is not all in one input.
    body: Vec<u8>,
    /// Whether the current frame's prefix has shown every count and limit field (only bulk bytes remain).
    limits_checked: bool,
    failed: Option<WireError>,
}

/// The parsed header of the current frame.
#[derive(Clone, Copy, Debug)]
struct Head {
    length: u32,
    kind: u8,
}

/// How a parse of a body (or of a prefix of it) ended.
enum Parsed {
    /// The whole frame. An activation payload's bytes are left empty and their place in the body returned,
    /// so the caller can move them out of its buffer instead of copying.
    Frame {
        frame: Frame,
        activations: Option<std::ops::Range<usize>>,
    },
    /// The prefix holds no error so far; `limits_checked` says whether it reached the bulk bytes.
    NeedMore { limits_checked: bool },
}

/// Why a read stopped.
enum Stop {
    /// The field lies inside the frame but its bytes have not all arrived.
    More,
    /// The frame is wrong.
    Wire(WireError),
}

/// Sequential little-endian reads over a body, of which `bytes` may hold only a prefix of `total` bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    position: usize,
    total: usize,
    kind: &'static str,
    length: u32,
    limits_checked: bool,
}

impl Decoder {
    /// A decoder that holds frames to `limits`.
    pub fn new(limits: WireLimits) -> Decoder {
        Decoder {
            limits,
            header: [0; HEADER_BYTES],
            header_filled: 0,
            body: Vec::new(),
            limits_checked: false,
            failed: None,
        }
    }

    /// Consumes bytes from `input` up to the end of one frame at most; returns how many it took and the frame
    /// if one completed. Call it again with the rest of `input` while it takes bytes.
    ///
    /// A length or count over its limit is an error as soon as its field is read, before any allocation.
    /// Costs one copy of the bytes of a frame that arrives in pieces; a frame wholly inside `input` is parsed
    /// in place.
    pub fn decode(&mut self, input: &[u8]) -> Result<(usize, Option<Frame>), WireError> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        let outcome = self.step(input);
        if let Err(error) = &outcome {
            self.failed = Some(error.clone());
            self.body = Vec::new();
        }
        outcome
    }

    /// Bytes of an incomplete frame held (header and body).
    pub fn buffered(&self) -> usize {
        self.header_filled + self.body.len()
    }

    /// Bytes of memory the decoder holds (its header and its buffer's capacity): for the frame it is in the
    /// middle of, never more than that frame's declared length and at most about twice what has arrived of it,
    /// so a peer that declares a large frame and sends little of it costs little; between frames, at most a
    /// 4 KiB buffer kept from a small frame for the next one.
    pub fn held_bytes(&self) -> usize {
        HEADER_BYTES + self.body.capacity()
    }

    /// The limits this decoder holds frames to.
    pub fn limits(&self) -> &WireLimits {
        &self.limits
    }

    fn step(&mut self, input: &[u8]) -> Result<(usize, Option<Frame>), WireError> {
        let mut consumed = 0;
        if self.header_filled < HEADER_BYTES {
            // A frame wholly inside the input is parsed where it lies.
            if self.header_filled == 0 && input.len() >= HEADER_BYTES {
                let head = self.check_head(&input[..HEADER_BYTES])?;
                let end = 4 + head.length as usize;
                if input.len() >= end {
                    let body = &input[HEADER_BYTES..end];
                    let Parsed::Frame {
                        mut frame,
                        activations,
                    } = parse(head, body, body.len(), &self.limits)?
                    else {
                        unreachable!("a parse of a whole body always ends in a frame or an error");
                    };
                    if let Some(range) = activations {
                        set_activation_bytes(&mut frame, body[range].to_vec());
                    }
                    return Ok((end, Some(frame)));
                }
            }
            let take = (HEADER_BYTES - self.header_filled).min(input.len());
            self.header[self.header_filled..self.header_filled + take]
                .copy_from_slice(&input[..take]);
            self.header_filled += take;
            consumed = take;
            // The length alone is checked as soon as its four bytes are in.
            if self.header_filled >= 4 {
                let length = u32::from_le_bytes(self.header[..4].try_into().unwrap());
                self.check_length(length)?;
            }
            if self.header_filled < HEADER_BYTES {
                return Ok((consumed, None));
            }
            let header = self.header;
            self.check_head(&header)?;
            self.limits_checked = false;
        }
        let head = self.head();
        let body_length = head.length as usize - 1;
        let take = (body_length - self.body.len()).min(input.len() - consumed);
        self.reserve_within(body_length, take);
        self.body
            .extend_from_slice(&input[consumed..consumed + take]);
        consumed += take;
        if self.body.len() == body_length {
            let outcome = parse(head, &self.body, body_length, &self.limits)?;
            let Parsed::Frame {
                mut frame,
                activations,
            } = outcome
            else {
                unreachable!("a parse of a whole body always ends in a frame or an error");
            };
            let mut body = std::mem::take(&mut self.body);
            if let Some(range) = activations {
                // Moved, not copied: the payload is the body's tail, so this is one memmove in place.
                body.truncate(range.end);
                body.drain(..range.start);
                set_activation_bytes(&mut frame, body);
            } else if body.capacity() <= RETAINED_BYTES {
                // Small frames reuse one buffer; a large one's buffer is let go rather than held while idle.
                body.clear();
                self.body = body;
            }
            self.header_filled = 0;
            return Ok((consumed, Some(frame)));
        }
        if !self.limits_checked {
            match parse(head, &self.body, body_length, &self.limits)? {
                Parsed::NeedMore { limits_checked } => self.limits_checked = limits_checked,
                Parsed::Frame { .. } => unreachable!("a prefix cannot hold a whole frame"),
            }
        }
        Ok((consumed, None))
    }

    /// The current frame's header (only once all five bytes are in and checked).
    fn head(&self) -> Head {
        Head {
            length: u32::from_le_bytes(self.header[..4].try_into().unwrap()),
            kind: self.header[4],
        }
    }

    fn check_length(&self, length: u32) -> Result<(), WireError> {
        if length == 0 {
            return Err(WireError::EmptyFrame);
        }
        if length as usize > self.limits.max_frame_bytes {
            return Err(WireError::FrameTooLarge {
                length: u64::from(length),
                limit: self.limits.max_frame_bytes,
            });
        }
        Ok(())
    }

    fn check_head(&self, header: &[u8]) -> Result<Head, WireError> {
        let length = u32::from_le_bytes(header[..4].try_into().unwrap());
        self.check_length(length)?;
        let kind = header[4];
        if kind::name(kind).is_none() {
            return Err(WireError::UnknownKind(kind));
        }
        Ok(Head { length, kind })
    }

    /// Grows the body buffer for `incoming` more bytes, doubling as a `Vec` would but never past the frame's
    /// declared body length, so a frame that never completes holds no more than it declared.
    fn reserve_within(&mut self, body_length: usize, incoming: usize) {
        let needed = self.body.len() + incoming;
        if needed <= self.body.capacity() {
            return;
        }
        let target = (self.body.capacity() * 2)
            .max(needed)
            .max(64)
            .min(body_length);
        self.body.reserve_exact(target - self.body.len());
    }
}

impl<'a> Reader<'a> {
    fn take(&mut self, count: usize, field: &'static str) -> Result<&'a [u8], Stop> {
        let end = self
            .position
            .checked_add(count)
            .filter(|end| *end <= self.total);
        let Some(end) = end else {
            return Err(Stop::Wire(WireError::Truncated {
                kind: self.kind,
                field,
                length: self.length,
            }));
        };
        if end > self.bytes.len() {
            return Err(Stop::More);
        }
        let slice = &self.bytes[self.position..end];
        self.position = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], Stop> {
        Ok(self.take(N, field)?.try_into().unwrap())
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, Stop> {
        Ok(self.take(1, field)?[0])
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, Stop> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, Stop> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, Stop> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    fn f32(&mut self, field: &'static str) -> Result<f32, Stop> {
        Ok(f32::from_le_bytes(self.array(field)?))
    }

    fn bool(&mut self, field: &'static str) -> Result<bool, Stop> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(self.bad_value(field, u64::from(value))),
        }
    }

    /// A row frame's batch: the sender's step id, its frame count, which is never 0 (the frame itself is one),
    /// and its row count, which is never below the frame count (every frame carries a row).
    fn batch(&mut self) -> Result<Batch, Stop> {
        let id = self.u32("batch id")?;
        let frames = match self.u16("batch frame count")? {
            0 => return Err(self.bad_value("batch frame count", 0)),
            frames => frames,
        };
        let rows = self.u32("batch row count")?;
        if rows < u32::from(frames) {
            return Err(Stop::Wire(WireError::BatchRows {
                kind: self.kind,
                batch_rows: rows,
                least: u32::from(frames),
                this_frame: false,
            }));
        }
        Ok(Batch { id, frames, rows })
    }

    fn optional<const N: usize>(
        &mut self,
        flag: &'static str,
        field: &'static str,
    ) -> Result<Option<[u8; N]>, Stop> {
        if self.bool(flag)? {
            Ok(Some(self.array(field)?))
        } else {
            Ok(None)
        }
    }

    /// An optional socket address: a family byte (0 none, 4 or 6), the IP's bytes, the port. The address is
    /// canonical (an IPv6 one has no flow label or scope), so it encodes back to the same bytes.
    fn address(&mut self, field: &'static str) -> Result<Option<std::net::SocketAddr>, Stop> {
        use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
        match self.u8(field)? {
            0 => Ok(None),
            4 => {
                let ip = Ipv4Addr::from(self.array::<4>(field)?);
                let port = self.u16(field)?;
                Ok(Some(SocketAddr::V4(SocketAddrV4::new(ip, port))))
            }
            6 => {
                let ip = Ipv6Addr::from(self.array::<16>(field)?);
                let port = self.u16(field)?;
                Ok(Some(SocketAddr::V6(SocketAddrV6::new(ip, port, 0, 0))))
            }
            family => Err(self.bad_value(field, u64::from(family))),
        }
    }

    /// A count checked against `limit`, and against the bytes left in the frame at `item_bytes` per item, so
    /// the caller may allocate `count` items.
    fn count(
        &mut self,
        count: u64,
        limit: u64,
        item_bytes: usize,
        field: &'static str,
    ) -> Result<usize, Stop> {
        if count > limit {
            return Err(Stop::Wire(WireError::TooMany {
                kind: self.kind,
                field,
                count,
                limit,
            }));
        }
        let left = (self.total - self.position) as u64;
        if count.saturating_mul(item_bytes as u64) > left {
            return Err(Stop::Wire(WireError::Truncated {
                kind: self.kind,
                field,
                length: self.length,
            }));
        }
        Ok(count as usize)
    }

    fn bad_value(&self, field: &'static str, value: u64) -> Stop {
        Stop::Wire(WireError::BadValue {
            kind: self.kind,
            field,
            value,
        })
    }

    /// Marks that every count and limit of the frame has been read and only `remaining` bulk bytes are left
    /// (already checked to fit in the frame), so the frame's end is known: a frame longer than that is
    /// refused now, at the same field whatever the read boundaries, not once its last byte arrives.
    fn limits_checked(&mut self, remaining: usize) -> Result<(), Stop> {
        let end = self.position + remaining;
        if end < self.total {
            return Err(Stop::Wire(WireError::TrailingBytes {
                kind: self.kind,
                length: self.length,
                extra: (self.total - end) as u32,
            }));
        }
        self.limits_checked = true;
        Ok(())
    }
}

impl From<WireError> for Stop {
    fn from(error: WireError) -> Self {
        Stop::Wire(error)
    }
}

/// Parses `bytes`, a prefix (or all) of a body of `total` bytes.
fn parse(head: Head, bytes: &[u8], total: usize, limits: &WireLimits) -> Result<Parsed, WireError> {
    let kind = kind::name(head.kind).unwrap_or("unknown");
    let mut reader = Reader {
        bytes,
        position: 0,
        total,
        kind,
        length: head.length,
        limits_checked: false,
    };
    match parse_body(head.kind, &mut reader, limits) {
        Ok((frame, activations)) => {
            if reader.position != total {
                return Err(WireError::TrailingBytes {
                    kind,
                    length: head.length,
                    extra: (total - reader.position) as u32,
                });
            }
            Ok(Parsed::Frame { frame, activations })
        }
        Err(Stop::More) => Ok(Parsed::NeedMore {
            limits_checked: reader.limits_checked,
        }),
        Err(Stop::Wire(error)) => Err(error),
    }
}

type Body = (Frame, Option<std::ops::Range<usize>>);

fn parse_body(kind: u8, reader: &mut Reader<'_>, limits: &WireLimits) -> Result<Body, Stop> {
    let frame = match kind {
        kind::HELLO => Frame::Hello(parse_hello(reader)?),
        kind::PROOF => Frame::Proof {
            proof: reader.array("proof")?,
        },
        kind::CONFIGURE => parse_configure(reader, limits)?,
        kind::PREFILL => {
            let session = reader.u64("session")?;
            let position = reader.u32("position")?;
            let last = reader.bool("last flag")?;
            let batch = reader.batch()?;
            let (rows, range) = parse_activations(reader, limits, batch.rows)?;
            return Ok((
                Frame::Prefill {
                    session,
                    position,
                    last,
                    batch,
                    rows,
                },
                Some(range),
            ));
        }
        kind::DECODE => {
            let session = reader.u64("session")?;
            let position = reader.u32("position")?;
            let batch = reader.batch()?;
            let (rows, range) = parse_activations(reader, limits, batch.rows)?;
            return Ok((
                Frame::Decode {
                    session,
                    position,
                    batch,
                    rows,
                },
                Some(range),
            ));
        }
        kind::TRIM => Frame::Trim {
            session: reader.u64("session")?,
            length: reader.u32("length")?,
        },
        kind::STOP => Frame::Stop {
            session: reader.u64("session")?,
        },
        kind::KEEP => Frame::Keep {
            session: reader.u64("session")?,
        },
        kind::PING => Frame::Ping {
            nonce: reader.u64("nonce")?,
        },
        kind::PONG => Frame::Pong {
            nonce: reader.u64("nonce")?,
        },
        kind::OPEN_RETURN => Frame::OpenReturn {
            session: reader.u64("session")?,
        },
        kind::ACK => {
            let session = reader.u64("session")?;
            let position = reader.u32("position")?;
            let count = reader.u32("stage timings count")?;
            let count = reader.count(
                u64::from(count),
                u64::from(limits.max_timings),
                10,
                "stage timings",
            )?;
            reader.limits_checked(count * 10)?;
            let mut timings = Vec::with_capacity(count);
            for _ in 0..count {
                timings.push(StageTiming {
                    stage_index: reader.u16("stage timings")?,
                    compute_micros: reader.u32("stage timings")?,
                    wait_micros: reader.u32("stage timings")?,
                });
            }
            Frame::Ack {
                session,
                position,
                timings,
            }
        }
        kind::TOKEN => {
            let session = reader.u64("session")?;
            let position = reader.u32("position")?;
            let token = reader.u32("token")?;
            let logprob = reader.f32("logprob")?;
            let count = reader.u8("alternatives count")?;
            let count = reader.count(
                u64::from(count),
                u64::from(limits.max_top_logprobs),
                8,
                "alternatives",
            )?;
            reader.limits_checked(count * 8)?;
            let mut top = Vec::with_capacity(count);
            for _ in 0..count {
                top.push((reader.u32("alternatives")?, reader.f32("alternatives")?));
            }
            Frame::Token {
                session,
                position,
                token,
                logprob,
                top,
            }
        }
        kind::ERROR => {
            let session = reader.u64("session")?;
            let value = reader.u16("error code")?;
            let code = ErrorCode::from_wire(value)
                .ok_or_else(|| reader.bad_value("error code", value.into()))?;
            let length = reader.u32("message length")?;
            let length = reader.count(
                u64::from(length),
                u64::from(limits.max_message_bytes),
                1,
                "message bytes",
            )?;
            reader.limits_checked(length)?;
            let bytes = reader.take(length, "message")?;
            let message = std::str::from_utf8(bytes)
                .map_err(|_| WireError::BadText {
                    kind: "error",
                    field: "message",
                })?
                .to_owned();
            Frame::Error {
                session,
                code,
                message,
            }
        }
        other => return Err(Stop::Wire(WireError::UnknownKind(other))),
    };
    Ok((frame, None))
}

fn parse_hello(reader: &mut Reader<'_>) -> Result<Hello, Stop> {
    let magic = reader.array("magic")?;
    if magic != MAGIC {
        return Err(Stop::Wire(WireError::BadMagic { found: magic }));
    }
    // The version comes before anything whose layout another version may change.
    let version = reader.u16("version")?;
    if version != PROTOCOL_VERSION {
        return Err(Stop::Wire(WireError::Version {
            found: version,
            supported: PROTOCOL_VERSION,
        }));
    }
    let role = reader.u8("role")?;
    let role = Role::from_wire(role).ok_or_else(|| reader.bad_value("role", role.into()))?;
    let fingerprint = reader.array("fingerprint")?;
    let stage_index = reader.u16("stage index")?;
    let layer_start = reader.u32("layer start")?;
    let layer_end = reader.u32("layer end")?;
    let block_count = reader.u32("block count")?;
    let width = reader.u32("values per row")?;
    let vocab_size = reader.u32("vocabulary size")?;
    let lanes = reader.u16("lanes")?;
    let context_length = reader.u32("context length")?;
    let codecs = reader.u8("codecs")?;
    let codecs =
        CodecSet::from_bits(codecs).ok_or_else(|| reader.bad_value("codecs", codecs.into()))?;
    let nonce = reader.array("nonce")?;
    let proof = reader.optional("proof flag", "proof")?;
    let return_address = reader.address("return address")?;
    Ok(Hello {
        version,
        role,
        fingerprint,
        stage_index,
        layer_start,
        layer_end,
        block_count,
        width,
        vocab_size,
        lanes,
        context_length,
        codecs,
        nonce,
        proof,
        return_address,
    })
}

fn parse_configure(reader: &mut Reader<'_>, limits: &WireLimits) -> Result<Frame, Stop> {
    let session = reader.u64("session")?;
    let sampling = Sampling {
        temperature: reader.f32("temperature")?,
        top_k: reader.u32("top-k")?,
        top_p: reader.f32("top-p")?,
        min_p: reader.f32("min-p")?,
        seed: reader.u64("seed")?,
        repeat_penalty: reader.f32("repeat penalty")?,
        presence_penalty: reader.f32("presence penalty")?,
        frequency_penalty: reader.f32("frequency penalty")?,
        penalty_last_n: reader.u32("penalty window")?,
    };
    let top_logprobs = reader.u8("top log-probabilities")?;
    if top_logprobs > limits.max_top_logprobs {
        return Err(Stop::Wire(WireError::TooMany {
            kind: "configure",
            field: "top log-probabilities",
            count: top_logprobs.into(),
            limit: limits.max_top_logprobs.into(),
        }));
    }
    let logprob = reader.bool("log-probability flag")?;
    let resume = reader.bool("resume flag")?;
    let trace = reader.optional("trace flag", "trace context")?;
    let count = reader.u32("stop tokens count")?;
    let count = reader.count(
        u64::from(count),
        u64::from(limits.max_stop_tokens),
        4,
        "stop tokens",
    )?;
    let mut stop_tokens = Vec::with_capacity(count);
    for _ in 0..count {
        stop_tokens.push(reader.u32("stop tokens")?);
    }
    let count = reader.u32("history count")?;
    let count = reader.count(
        u64::from(count),
        u64::from(limits.max_history),
        4,
        "history tokens",
    )?;
    let mut history = Vec::with_capacity(count);
    for _ in 0..count {
        history.push(reader.u32("history tokens")?);
    }
    let count = reader.u32("logit-bias count")?;
    let count = reader.count(
        u64::from(count),
        u64::from(limits.max_logit_bias),
        8,
        "logit-bias entries",
    )?;
    reader.limits_checked(count * 8)?;
    let mut logit_bias = Vec::with_capacity(count);
    for _ in 0..count {
        logit_bias.push((
            reader.u32("logit-bias entries")?,
            reader.f32("logit-bias entries")?,
        ));
    }
    Ok(Frame::Configure {
        session,
        sampling,
        stop_tokens,
        logit_bias,
        history,
        top_logprobs,
        logprob,
        resume,
        trace,
    })
}

/// Reads an activation header and checks its shape, of at most `batch_rows` rows (the frame's batch's rows in
/// all); returns the activations with empty bytes and where the bytes lie in the body.
fn parse_activations(
    reader: &mut Reader<'_>,
    limits: &WireLimits,
    batch_rows: u32,
) -> Result<(Activations, std::ops::Range<usize>), Stop> {
    let rows = reader.u32("rows")?;
    reader.count(u64::from(rows), u64::from(limits.max_rows), 0, "rows")?;
    if rows > batch_rows {
        return Err(Stop::Wire(WireError::BatchRows {
            kind: reader.kind,
            batch_rows,
            least: rows,
            this_frame: true,
        }));
    }
    let width = reader.u32("values per row")?;
    reader.count(
        u64::from(width),
        u64::from(limits.max_width),
        0,
        "values per row",
    )?;
    let codec = reader.u8("codec")?;
    let codec = Codec::from_wire(codec).ok_or_else(|| reader.bad_value("codec", codec.into()))?;
    let bytes = reader.u32("activation byte count")?;
    let expected = u64::from(rows) * u64::from(width) * codec.value_bytes() as u64;
    if u64::from(bytes) != expected {
        return Err(Stop::Wire(WireError::RowsMismatch {
            rows,
            width,
            codec,
            expected,
            bytes,
        }));
    }
    let length = reader.count(u64::from(bytes), u64::MAX, 1, "activations")?;
    reader.limits_checked(length)?;
    let start = reader.position;
    reader.take(length, "activations")?;
    Ok((
        Activations {
            rows,
            width,
            codec,
            bytes: Vec::new(),
        },
        start..start + length,
    ))
}

fn set_activation_bytes(frame: &mut Frame, bytes: Vec<u8>) {
    if let Frame::Prefill { rows, .. } | Frame::Decode { rows, .. } = frame {
        rows.bytes = bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{CodecPolicy, encode_to_vec};

    fn prefill() -> Frame {
        Frame::Prefill {
            session: 3,
            position: 10,
            last: true,
            batch: Batch {
                id: 9,
                frames: 2,
                rows: 3,
            },
            rows: Activations::encode(&[1.0, 2.0, 3.0, 4.5], 2, CodecPolicy::F32),
        }
    }

    #[test]
    fn a_frame_fed_one_byte_at_a_time_comes_out_whole_at_its_last_byte() {
        let bytes = encode_to_vec(&prefill());
        let mut decoder = Decoder::new(WireLimits::default());
        for (index, byte) in bytes.iter().enumerate() {
            let (taken, frame) = decoder.decode(std::slice::from_ref(byte)).unwrap();
            assert_eq!(taken, 1, "the decoder did not take byte {index}");
            if index + 1 < bytes.len() {
                assert!(
                    frame.is_none(),
                    "a frame came out at byte {index} of {}",
                    bytes.len()
                );
            } else {
                assert_eq!(
                    frame,
                    Some(prefill()),
                    "the last byte did not complete the frame"
                );
            }
        }
        assert_eq!(
            decoder.buffered(),
            0,
            "bytes were left buffered after a whole frame"
        );
    }

    #[test]
    fn a_huge_length_is_refused_from_its_four_bytes_alone() {
        let mut decoder = Decoder::new(WireLimits::default());
        let error = decoder.decode(&u32::MAX.to_le_bytes()).unwrap_err();
        assert_eq!(
            error,
            WireError::FrameTooLarge {
                length: u64::from(u32::MAX),
                limit: 64 << 20
            },
            "a 4 GiB length was not refused at once"
        );
    }

    #[test]
    fn after_an_error_the_decoder_reads_no_further_frame() {
        let mut decoder = Decoder::new(WireLimits::default());
        let error = decoder.decode(&[1, 0, 0, 0, 99]).unwrap_err();
        assert_eq!(error, WireError::UnknownKind(99), "kind 99 was not refused");
        // The stream's frame boundaries are lost, so even a valid frame after the error must not be read.
        assert_eq!(
            decoder.decode(&encode_to_vec(&prefill())),
            Err(error),
            "the decoder forgot its error and read on"
        );
    }

    #[test]
    fn a_stop_token_count_over_the_limit_is_refused_before_the_tokens_arrive() {
        let mut bytes = encode_to_vec(&Frame::Configure {
            session: 1,
            sampling: Sampling::from(&crate::model::SamplingParams::default()),
            stop_tokens: vec![7; 65],
            logit_bias: Vec::new(),
            history: Vec::new(),
            top_logprobs: 0,
            logprob: false,
            resume: false,
            trace: None,
        });
        // Cut the frame right after the stop-token count: 4 + 1 + 8 + 44 + 1 + 1 + 1 + 4 bytes.
        bytes.truncate(64);
        // After a frame fed in pieces (which marks its limits as seen), so the mark must not carry over.
        let mut stream = encode_to_vec(&prefill());
        stream.extend_from_slice(&bytes);
        let mut decoder = Decoder::new(WireLimits::default());
        let mut outcome = Ok(());
        'feed: for mut piece in stream.chunks(5) {
            while !piece.is_empty() {
                match decoder.decode(piece) {
                    Ok((taken, _)) => piece = &piece[taken..],
                    Err(error) => {
                        outcome = Err(error);
                        break 'feed;
                    }
                }
            }
        }
        assert_eq!(
            outcome.unwrap_err(),
            WireError::TooMany {
                kind: "configure",
                field: "stop tokens",
                count: 65,
                limit: 64
            },
            "65 stop tokens were not refused as soon as their count was in"
        );
    }
}
