//! The frames of the stage protocol, their wire layouts and the encoder.

use super::codec::Activations;
use super::hello::Hello;

/// Sampler settings of one generation, as `Configure` carries them to the last stage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// `<= 0` means greedy.
    pub temperature: f32,
    /// Keep the `k` most likely tokens; 0 keeps all.
    pub top_k: u32,
    /// Nucleus threshold; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely; 0 keeps all.
    pub min_p: f32,
    /// Seed of the random draw.
    pub seed: u64,
    /// Repetition penalty; 1 disables.
    pub repeat_penalty: f32,
    /// Presence penalty.
    pub presence_penalty: f32,
    /// Frequency penalty.
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub penalty_last_n: u32,
}

/// One stage's share of a step, merged down the chain into an `Ack`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageTiming {
    /// The stage.
    pub stage_index: u16,
    /// Time it spent computing the step.
    pub compute_micros: u32,
    /// Time it spent waiting for the stage after it.
    pub wait_micros: u32,
}

/// Why a stage refused a frame, a session or a link: the code of an `Error` frame.
///
/// Each code has a fixed `u16` on the wire ([`ErrorCode::to_wire`]) and a name ([`ErrorCode::as_str`]);
/// neither changes once released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    /// A frame was malformed or unexpected.
    Protocol,
    /// The peers speak different protocol versions.
    Version,
    /// The peers serve different models.
    Model,
    /// The layer ranges leave a gap or overlap.
    Layers,
    /// The activation widths differ.
    Width,
    /// Link authentication failed.
    Auth,
    /// Every lane of the stage is busy.
    NoFreeLane,
    /// A frame named a session the stage does not know.
    UnknownSession,
    /// A frame named a session that is busy with another step.
    SessionBusy,
    /// A frame's position does not follow the session's.
    Position,
    /// The stage's computation failed.
    Compute,
    /// The stage is draining and takes no new sessions.
    Draining,
    /// A stage further down the chain is unreachable.
    StageDown,
    /// The sender went past its reply credits.
    Credits,
    /// A bug in the stage.
    Internal,
}

/// One message on a link.
///
/// Every frame is `length: u32, kind: u8, body` (see the module docs of [`wire`](super)); the bodies, all
/// integers and floats little-endian, `bool` a byte that is 0 or 1, `T?` a 0/1 byte followed by `T` when 1:
///
/// ```text
///  kind  frame        body
///  1     Hello        magic [4] "SSTG", version u16, role u8, fingerprint [32], stage_index u16,
///                     layer_start u32, layer_end u32, block_count u32, width u32, vocab_size u32,
///                     lanes u16, context_length u32, codecs u8, nonce [16], proof [32]?,
///                     return_address address?
///  2     Proof        proof [32]
///  3     Configure    session u64, sampling (temperature f32, top_k u32, top_p f32, min_p f32, seed u64,
///                     repeat_penalty f32, presence_penalty f32, frequency_penalty f32, penalty_last_n u32),
///                     top_logprobs u8, logprob bool, resume bool, trace [25]?, stop_count u32,
///                     stop_count x token u32,
///                     history_count u32, history_count x token u32, bias_count u32,
///                     bias_count x (token u32, bias f32)
///  4     Prefill      session u64, position u32, last bool, batch, activations
///  5     Decode       session u64, position u32, batch, activations
///  6     Trim         session u64, length u32
///  7     Stop         session u64
///  8     OpenReturn   session u64
///  9     Ack          session u64, position u32, count u32, count x (stage_index u16, compute_micros u32,
///                     wait_micros u32)
///  10    Token        session u64, position u32, token u32, logprob f32, count u8, count x (token u32, logprob f32)
///  11    Error        session u64, code u16, length u32, message [length] (UTF-8)
///  12    Keep         session u64
///  13    Ping         nonce u64
///  14    Pong         nonce u64
///
///  address     = family u8 (4: ip [4], 6: ip [16]), port u16; after the presence byte of `address?`, which
///                is the family byte itself: 0 for none
///
///  batch       = id u32, frames u16 (1 or more), rows u32 (frames or more): the sending stage's step, and how
///                many row frames and rows in all it sent the receiver
///
///  activations = rows u32, width u32, codec u8 (1 f32, 2 f16, 3 bf16), byte_count u32, bytes [byte_count]
///                with byte_count == rows x width x bytes per value
/// ```
///
/// Role bytes: 1 stage link, 2 prediction return. Codec sets: bit 0 f32, bit 1 f16, bit 2 bf16. Error codes are
/// the `u16`s of [`ErrorCode::to_wire`]. The encoding is canonical: a frame the decoder accepts encodes back to
/// exactly the bytes it came from (the fuzz target checks this).
#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    /// The first frame each way on a link: who the sender is and what it serves.
    Hello(Hello),
    /// The connecting side's proof that it holds the cluster key (keyed links only), after both hellos.
    Proof {
        /// `proof(key, Side::Connecting, connecting_nonce, accepting_nonce)`.
        proof: [u8; 32],
    },
    /// Sets up sampling for a session on the last stage (forwarded down the chain).
    Configure {
        /// The session.
        session: u64,
        /// Sampler settings.
        sampling: Sampling,
        /// Tokens that end the generation.
        stop_tokens: Vec<u32>,
        /// Added to the logits of these tokens before sampling.
        logit_bias: Vec<(u32, f32)>,
        /// The tokens the penalties look back on before the first generated one: the prompt's last
        /// `penalty_last_n` (the last stage never sees token ids otherwise).
        history: Vec<u32>,
        /// How many top alternatives each `Token` carries.
        top_logprobs: u8,
        /// Whether each `Token` carries the chosen token's log-probability. When false (and `top_logprobs` is
        /// 0) it carries NaN and the last stage skips the softmax over the whole vocabulary, which on a
        /// 262,144-token vocabulary costs milliseconds a token.
        logprob: bool,
        /// The session is already open on this link from an earlier generation: keep its lane and cache (a
        /// `Trim` before this frame sets how much of it stays) and only set up the sampling anew. A stage where
        /// it is not open answers `UnknownSession`; without the flag, a session already open is refused as busy.
        resume: bool,
        /// W3C trace context: trace-id (16 bytes), span-id (8), flags (1).
        trace: Option<[u8; 25]>,
    },
    /// A chunk of a prompt's activations, starting at absolute `position`.
    Prefill {
        /// The session.
        session: u64,
        /// Absolute position of the first row.
        position: u32,
        /// Whether this is the prompt's last chunk (the last stage answers it with a `Token`).
        last: bool,
        /// The sender's step these rows ran in.
        batch: Batch,
        /// One row per token.
        rows: Activations,
    },
    /// One decode step's activations at absolute `position` (authoritative: the stage trims back to it).
    Decode {
        /// The session.
        session: u64,
        /// Absolute position of the first row.
        position: u32,
        /// The sender's step these rows ran in.
        batch: Batch,
        /// One row per token.
        rows: Activations,
    },
    /// Shortens a session's cache to `length` tokens.
    Trim {
        /// The session.
        session: u64,
        /// Tokens to keep.
        length: u32,
    },
    /// Ends a session and frees its lane.
    Stop {
        /// The session.
        session: u64,
    },
    /// On a prediction-return link: send this session's tokens here.
    OpenReturn {
        /// The session.
        session: u64,
    },
    /// A step or control frame was handled, with each stage's timing.
    Ack {
        /// The session.
        session: u64,
        /// The session's position after the step.
        position: u32,
        /// Per-stage timings, merged down the chain.
        timings: Vec<StageTiming>,
    },
    /// A token the last stage predicted.
    Token {
        /// The session.
        session: u64,
        /// The absolute position the token goes to.
        position: u32,
        /// The token id.
        token: u32,
        /// Its log-probability.
        logprob: f32,
        /// The most likely alternatives with their log-probabilities, when asked for.
        top: Vec<(u32, f32)>,
    },
    /// The session's generation ended with nothing of it in flight: every stage keeps its lane and cache for
    /// the next generation to resume (`Trim`, then `Configure` with `resume`), or frees them at `Stop`. A kept
    /// session is idle: a draining stage closes a link whose sessions are all kept at once.
    Keep {
        /// The session.
        session: u64,
    },
    /// Is the chain alive? Sent down a stage link by stage 0 when the chain has been silent a while; each stage
    /// passes it on to the next as it reads it (not behind its compute), and the last answers [`Frame::Pong`],
    /// which comes back up the chain as answers do. A link frame: it names no session.
    Ping {
        /// Echoed in the answer.
        nonce: u64,
    },
    /// The last stage's answer to a [`Frame::Ping`], with its nonce.
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// A refusal or failure. Build it with [`Frame::error`], which keeps the message within the limit.
    Error {
        /// The session it concerns; 0 for the whole link.
        session: u64,
        /// Why.
        code: ErrorCode,
        /// What happened and what to do, in words.
        message: String,
    },
}

/// The step of the sending stage that a row frame's rows ran in, so the next stage can run those rows as one
/// pass again: a step's frames go out on as many links as it had sessions and arrive one by one, and a stage
/// that ran whatever had arrived would split the batch (and, stage after stage, run one-row passes).
///
/// Ids are the sender's own and wrap; a receiver only compares them with the ids of frames from the same
/// stage, close in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Batch {
    /// The sender's number for the step.
    pub id: u32,
    /// How many row frames the step sent to the receiving stage, this one included: at least 1.
    pub frames: u16,
    /// How many rows those frames carry in all (at least `frames`): what running the batch costs the receiver,
    /// and so how long it is worth waiting for a late frame of it rather than splitting it.
    pub rows: u32,
}

impl Batch {
    /// A step that sent one frame of `rows` rows: the receiver has nothing to wait for.
    pub const fn alone(id: u32, rows: u32) -> Batch {
        Batch {
            id,
            frames: 1,
            rows,
        }
    }
}

/// Frame kind bytes.
pub(crate) mod kind {
    pub const HELLO: u8 = 1;
    pub const PROOF: u8 = 2;
    pub const CONFIGURE: u8 = 3;
    pub const PREFILL: u8 = 4;
    pub const DECODE: u8 = 5;
    pub const TRIM: u8 = 6;
    pub const STOP: u8 = 7;
    pub const OPEN_RETURN: u8 = 8;
    pub const ACK: u8 = 9;
    pub const TOKEN: u8 = 10;
    pub const ERROR: u8 = 11;
    pub const KEEP: u8 = 12;
    pub const PING: u8 = 13;
    pub const PONG: u8 = 14;

    /// The name of a known kind byte.
    pub fn name(kind: u8) -> Option<&'static str> {
        Some(match kind {
            HELLO => "hello",
            PROOF => "proof",
            CONFIGURE => "configure",
            PREFILL => "prefill",
            DECODE => "decode",
            TRIM => "trim",
            STOP => "stop",
            OPEN_RETURN => "open-return",
            ACK => "ack",
            TOKEN => "token",
            ERROR => "error",
            KEEP => "keep",
            PING => "ping",
            PONG => "pong",
            _ => return None,
        })
    }
}

impl ErrorCode {
    /// Every code, in wire order.
    pub const ALL: [ErrorCode; 15] = [
        ErrorCode::Protocol,
        ErrorCode::Version,
        ErrorCode::Model,
        ErrorCode::Layers,
        ErrorCode::Width,
        ErrorCode::Auth,
        ErrorCode::NoFreeLane,
        ErrorCode::UnknownSession,
        ErrorCode::SessionBusy,
        ErrorCode::Position,
        ErrorCode::Compute,
        ErrorCode::Draining,
        ErrorCode::StageDown,
        ErrorCode::Credits,
        ErrorCode::Internal,
    ];

    /// The code's stable name (`protocol`, `no-free-lane`, ...), for logs and the HTTP API.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Protocol => "protocol",
            ErrorCode::Version => "version",
            ErrorCode::Model => "model",
            ErrorCode::Layers => "layers",
            ErrorCode::Width => "width",
            ErrorCode::Auth => "auth",
            ErrorCode::NoFreeLane => "no-free-lane",
            ErrorCode::UnknownSession => "unknown-session",
            ErrorCode::SessionBusy => "session-busy",
            ErrorCode::Position => "position",
            ErrorCode::Compute => "compute",
            ErrorCode::Draining => "draining",
            ErrorCode::StageDown => "stage-down",
            ErrorCode::Credits => "credits",
            ErrorCode::Internal => "internal",
        }
    }

    /// The code's stable `u16` on the wire.
    pub fn to_wire(self) -> u16 {
        match self {
            ErrorCode::Protocol => 1,
            ErrorCode::Version => 2,
            ErrorCode::Model => 3,
            ErrorCode::Layers => 4,
            ErrorCode::Width => 5,
            ErrorCode::Auth => 6,
            ErrorCode::NoFreeLane => 7,
            ErrorCode::UnknownSession => 8,
            ErrorCode::SessionBusy => 9,
            ErrorCode::Position => 10,
            ErrorCode::Compute => 11,
            ErrorCode::Draining => 12,
            ErrorCode::StageDown => 13,
            ErrorCode::Credits => 14,
            ErrorCode::Internal => 15,
        }
    }

    /// The code a wire `u16` names, if any.
    pub fn from_wire(value: u16) -> Option<ErrorCode> {
        ErrorCode::ALL
            .into_iter()
            .find(|code| code.to_wire() == value)
    }
}

impl Frame {
    /// An `Error` frame whose message fits the default [`WireLimits::max_message_bytes`](super::WireLimits)
    /// (4096 bytes): a longer message is cut at a character boundary and ends in `...`, so the refusal reaches
    /// the peer instead of being refused itself.
    pub fn error(session: u64, code: ErrorCode, message: impl Into<String>) -> Frame {
        let mut message = message.into();
        let limit = super::WireLimits::default().max_message_bytes as usize;
        if message.len() > limit {
            let mut cut = limit - 3;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str("...");
        }
        Frame::Error {
            session,
            code,
            message,
        }
    }

    /// The frame kind's name (`hello`, `prefill`, `open-return`, ...), for logs and errors.
    pub fn kind_name(&self) -> &'static str {
        kind::name(self.kind()).unwrap_or("unknown")
    }

    /// The session the frame names: `None` for `Hello` and `Proof` (link frames) and for an `Error` about the
    /// whole link (session 0).
    pub fn session(&self) -> Option<u64> {
        match self {
            Frame::Hello(_) | Frame::Proof { .. } | Frame::Ping { .. } | Frame::Pong { .. } => None,
            Frame::Error { session: 0, .. } => None,
            Frame::Configure { session, .. }
            | Frame::Prefill { session, .. }
            | Frame::Decode { session, .. }
            | Frame::Trim { session, .. }
            | Frame::Stop { session }
            | Frame::OpenReturn { session }
            | Frame::Keep { session }
            | Frame::Ack { session, .. }
            | Frame::Token { session, .. }
            | Frame::Error { session, .. } => Some(*session),
        }
    }

    /// The kind byte.
    pub(crate) fn kind(&self) -> u8 {
        match self {
            Frame::Hello(_) => kind::HELLO,
            Frame::Proof { .. } => kind::PROOF,
            Frame::Configure { .. } => kind::CONFIGURE,
            Frame::Prefill { .. } => kind::PREFILL,
            Frame::Decode { .. } => kind::DECODE,
            Frame::Trim { .. } => kind::TRIM,
            Frame::Stop { .. } => kind::STOP,
            Frame::OpenReturn { .. } => kind::OPEN_RETURN,
            Frame::Keep { .. } => kind::KEEP,
            Frame::Ping { .. } => kind::PING,
            Frame::Pong { .. } => kind::PONG,
            Frame::Ack { .. } => kind::ACK,
            Frame::Token { .. } => kind::TOKEN,
            Frame::Error { .. } => kind::ERROR,
        }
    }
}

impl From<&crate::model::SamplingParams> for Sampling {
    /// Counts past `u32::MAX` saturate (no vocabulary or window is that large).
    fn from(params: &crate::model::SamplingParams) -> Self {
        Sampling {
            temperature: params.temperature,
            top_k: u32::try_from(params.top_k).unwrap_or(u32::MAX),
            top_p: params.top_p,
            min_p: params.min_p,
            seed: params.seed,
            repeat_penalty: params.repeat_penalty,
            presence_penalty: params.presence_penalty,
            frequency_penalty: params.frequency_penalty,
            penalty_last_n: u32::try_from(params.penalty_last_n).unwrap_or(u32::MAX),
        }
    }
}

impl From<Sampling> for crate::model::SamplingParams {
    fn from(sampling: Sampling) -> Self {
        crate::model::SamplingParams {
            temperature: sampling.temperature,
            top_k: sampling.top_k as usize,
            top_p: sampling.top_p,
            min_p: sampling.min_p,
            seed: sampling.seed,
            repeat_penalty: sampling.repeat_penalty,
            presence_penalty: sampling.presence_penalty,
            frequency_penalty: sampling.frequency_penalty,
            penalty_last_n: sampling.penalty_last_n as usize,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.as_str())
    }
}

/// Appends `frame` to `out`: its `u32` length, its kind byte and its body.
///
/// # Panics
///
/// When a length or count does not fit its wire field (a body over 4 GiB, more than 255 alternatives in a
/// `Token`, more than `u32::MAX` rows): the caller built a frame no peer could take. Frames within
/// [`WireLimits`](super::WireLimits) never panic.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.push(frame.kind());
    let mut writer = Writer(out);
    match frame {
        Frame::Hello(hello) => {
            writer.bytes(&super::MAGIC);
            writer.u16(hello.version);
            writer.u8(hello.role.to_wire());
            writer.bytes(&hello.fingerprint);
            writer.u16(hello.stage_index);
            writer.u32(hello.layer_start);
            writer.u32(hello.layer_end);
            writer.u32(hello.block_count);
            writer.u32(hello.width);
            writer.u32(hello.vocab_size);
            writer.u16(hello.lanes);
            writer.u32(hello.context_length);
            writer.u8(hello.codecs.bits());
            writer.bytes(&hello.nonce);
            writer.optional(hello.proof.as_ref());
            writer.address(hello.return_address);
        }
        Frame::Proof { proof } => writer.bytes(proof),
        Frame::Configure {
            session,
            sampling,
            stop_tokens,
            logit_bias,
            history,
            top_logprobs,
            logprob,
            resume,
            trace,
        } => {
            writer.u64(*session);
            writer.f32(sampling.temperature);
            writer.u32(sampling.top_k);
            writer.f32(sampling.top_p);
            writer.f32(sampling.min_p);
            writer.u64(sampling.seed);
            writer.f32(sampling.repeat_penalty);
            writer.f32(sampling.presence_penalty);
            writer.f32(sampling.frequency_penalty);
            writer.u32(sampling.penalty_last_n);
            // Every field with a limit comes before the lists' bulk, so the decoder sees them all early.
            writer.u8(*top_logprobs);
            writer.u8(u8::from(*logprob));
            writer.u8(u8::from(*resume));
            writer.optional(trace.as_ref());
            writer.count_u32(stop_tokens.len(), "stop tokens");
            for token in stop_tokens {
                writer.u32(*token);
            }
            writer.count_u32(history.len(), "history tokens");
            for token in history {
                writer.u32(*token);
            }
            // The last list: once its count is read, the decoder knows where the frame ends.
            writer.count_u32(logit_bias.len(), "logit-bias entries");
            for (token, bias) in logit_bias {
                writer.u32(*token);
                writer.f32(*bias);
            }
        }
        Frame::Prefill {
            session,
            position,
            last,
            batch,
            rows,
        } => {
            writer.u64(*session);
            writer.u32(*position);
            writer.u8(u8::from(*last));
            writer.batch(*batch);
            writer.activations(rows);
        }
        Frame::Decode {
            session,
            position,
            batch,
            rows,
        } => {
            writer.u64(*session);
            writer.u32(*position);
            writer.batch(*batch);
            writer.activations(rows);
        }
        Frame::Trim { session, length } => {
            writer.u64(*session);
            writer.u32(*length);
        }
        Frame::Stop { session } | Frame::OpenReturn { session } | Frame::Keep { session } => {
            writer.u64(*session)
        }
        Frame::Ping { nonce } | Frame::Pong { nonce } => writer.u64(*nonce),
        Frame::Ack {
            session,
            position,
            timings,
        } => {
            writer.u64(*session);
            writer.u32(*position);
            writer.count_u32(timings.len(), "stage timings");
            for timing in timings {
                writer.u16(timing.stage_index);
                writer.u32(timing.compute_micros);
                writer.u32(timing.wait_micros);
            }
        }
        Frame::Token {
            session,
            position,
            token,
            logprob,
            top,
        } => {
            writer.u64(*session);
            writer.u32(*position);
            writer.u32(*token);
            writer.f32(*logprob);
            let count = u8::try_from(top.len()).unwrap_or_else(|_| {
                panic!("a token frame carries {} alternatives, over 255", top.len())
            });
            writer.u8(count);
            for (token, logprob) in top {
                writer.u32(*token);
                writer.f32(*logprob);
            }
        }
        Frame::Error {
            session,
            code,
            message,
        } => {
            writer.u64(*session);
            writer.u16(code.to_wire());
            writer.count_u32(message.len(), "message bytes");
            writer.bytes(message.as_bytes());
        }
    }
    let length = out.len() - start - 4;
    let length = u32::try_from(length).unwrap_or_else(|_| {
        panic!(
            "a {} frame of {length} bytes is over 4 GiB",
            frame.kind_name()
        )
    });
    out[start..start + 4].copy_from_slice(&length.to_le_bytes());
}

/// [`encode`] into a new vector.
pub fn encode_to_vec(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::new();
    encode(frame, &mut out);
    out
}

/// Little-endian field writes onto a frame being encoded.
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn bytes(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }

    fn u8(&mut self, value: u8) {
        self.0.push(value);
    }

    fn u16(&mut self, value: u16) {
        self.bytes(&value.to_le_bytes());
    }

    fn u32(&mut self, value: u32) {
        self.bytes(&value.to_le_bytes());
    }

    fn u64(&mut self, value: u64) {
        self.bytes(&value.to_le_bytes());
    }

    fn f32(&mut self, value: f32) {
        self.bytes(&value.to_le_bytes());
    }

    fn count_u32(&mut self, count: usize, what: &str) {
        let count = u32::try_from(count)
            .unwrap_or_else(|_| panic!("a frame carries {count} {what}, over u32::MAX"));
        self.u32(count);
    }

    /// An optional socket address: its family byte (0: none), the IP's bytes, the port.
    fn address(&mut self, address: Option<std::net::SocketAddr>) {
        match address {
            None => self.u8(0),
            Some(std::net::SocketAddr::V4(address)) => {
                self.u8(4);
                self.bytes(&address.ip().octets());
                self.u16(address.port());
            }
            Some(std::net::SocketAddr::V6(address)) => {
                self.u8(6);
                self.bytes(&address.ip().octets());
                self.u16(address.port());
            }
        }
    }

    fn optional<const N: usize>(&mut self, value: Option<&[u8; N]>) {
        match value {
            Some(bytes) => {
                self.u8(1);
                self.bytes(bytes);
            }
            None => self.u8(0),
        }
    }

    fn batch(&mut self, batch: Batch) {
        self.u32(batch.id);
        self.u16(batch.frames);
        self.u32(batch.rows);
    }

    fn activations(&mut self, activations: &Activations) {
        self.u32(activations.rows);
        self.u32(activations.width);
        self.u8(activations.codec.to_wire());
        self.count_u32(activations.bytes.len(), "activation bytes");
        self.bytes(&activations.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_code_has_a_distinct_wire_value_and_name_that_read_back() {
        for code in ErrorCode::ALL {
            assert_eq!(
                ErrorCode::from_wire(code.to_wire()),
                Some(code),
                "{code:?} does not read back from its wire value"
            );
        }
        let mut names: Vec<&str> = ErrorCode::ALL.iter().map(|code| code.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ErrorCode::ALL.len(), "two codes share a name");
        assert_eq!(ErrorCode::from_wire(0), None, "0 is not a code");
    }

    #[test]
    fn sampling_params_survive_the_trip_through_the_wire_type() {
        let params = crate::model::SamplingParams {
            temperature: 0.7,
            top_k: 12,
            top_p: 0.9,
            min_p: 0.02,
            seed: 99,
            repeat_penalty: 1.1,
            presence_penalty: 0.3,
            frequency_penalty: 0.2,
            penalty_last_n: 32,
        };
        let back: crate::model::SamplingParams = Sampling::from(&params).into();
        assert_eq!(
            back, params,
            "a setting changed on its way through Sampling"
        );
    }

    #[test]
    fn a_long_error_message_is_cut_to_the_limit_at_a_character_boundary() {
        let Frame::Error { message, .. } = Frame::error(0, ErrorCode::Internal, "é".repeat(3000))
        else {
            unreachable!("Frame::error builds an Error frame");
        };
        assert_eq!(
            message.len(),
            4095,
            "the message was not cut to the last whole character"
        );
        assert!(
            message.ends_with("..."),
            "a cut message does not say it was cut"
        );
        let Frame::Error { message, .. } = Frame::error(0, ErrorCode::Internal, "short") else {
            unreachable!("Frame::error builds an Error frame");
        };
        assert_eq!(message, "short", "a short message was changed");
    }

    #[test]
    fn link_frames_name_no_session_and_session_frames_name_theirs() {
        assert_eq!(
            Frame::Proof { proof: [0; 32] }.session(),
            None,
            "a proof names a session"
        );
        assert_eq!(
            Frame::error(0, ErrorCode::Auth, "no").session(),
            None,
            "an error for the whole link names session 0"
        );
        assert_eq!(
            Frame::error(9, ErrorCode::SessionBusy, "busy").session(),
            Some(9),
            "an error for session 9 lost its session"
        );
        assert_eq!(
            Frame::Stop { session: 4 }.session(),
            Some(4),
            "a stop lost its session"
        );
    }

    #[test]
    fn the_length_prefix_counts_the_kind_byte_and_the_body() {
        let bytes = encode_to_vec(&Frame::Stop { session: 7 });
        assert_eq!(
            bytes,
            [9, 0, 0, 0, kind::STOP, 7, 0, 0, 0, 0, 0, 0, 0],
            "a stop frame is length 9, kind, session"
        );
    }
}
