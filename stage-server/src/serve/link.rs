//! The stage links of a stage process as net-io-blocking sessions: an accepted link from the stage before this
//! one (`Upstream`, here), and, unless this stage is last, the link it opens to the next stage (`Downstream`,
//! in [`super::downstream`]), the two sharing a [`Pair`].
//!
//! ```text
//!   previous stage ══▶ Upstream session ──Work──▶ compute thread ──Outcome──▶ Upstream (on_wake): acks,
//!                          ▲    │ Configure, Trim, Stop  │ rows (serve::onward)      errors, relayed tokens
//!                          │    ▼                        ▼
//!                          │  Pair.to_downstream ──post──▶ Downstream session ══▶ next stage
//!                          └─── Pair.to_upstream ◀──post── Downstream (Ack, Token, Error from the next stage)
//! ```
//!
//! Every session listens ([`Step::Listen`]): it reads its socket and is woken by a post when the compute thread
//! or its partner has something for it, so neither side ever holds a thread or waits on the other. One
//! downstream link per upstream link, opened once the upstream hello checked out, so the lanes of the chain
//! mirror each other; the upstream's hello is answered only once the whole rest of the chain answered, so a
//! refusal anywhere reaches stage 0 before any activation moves.
//!
//! A pair keeps to its byte budget ([`super::budget`], `--link-buffer-mib`) by back-pressure: while the rows
//! it holds for the next stage and those computing are over it, the upstream link hands compute no chunk (its
//! frames wait, read ahead), and while what it has read ahead is over it, the link parks ([`Step::Park`]) and
//! stops reading, so the stage before meets a full TCP window. The downstream link wakes it once its backlog
//! is back within the budget. Frames are acted on in the order they came: a Stop behind held chunks waits for
//! them (at most as long as the next stage takes to drain one budget); a link whose next stage stops reading
//! altogether ends with the downstream link, which stops every session of the pair anyway. The one exception
//! is a `Ping`, passed on (or, at the last stage, answered) as soon as it is read, since it concerns no session;
//! it still waits behind whatever is unread while the link parks, and behind the frames already queued to go
//! down.
//!
//! A computed frame's span rides with its answer ([`Writing`]): to the upstream's output for a token, an
//! acknowledgement or an error, through the pair (and any shaping) to the downstream's output for rows. The
//! session that queued the bytes records `write_micros` once the driver has flushed them to the socket
//! (`on_writable`), so the field is the time from the end of the frame's compute to its answer being on the
//! link, including the hand-over between the two sessions and any wait for the socket.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use net_io_blocking::{
    CloseReason, Completer, ConnectOptions, ConnectionInfo, Input, Phase, ServerHandle, Session,
    SessionContext, Step, TimeoutKind,
};

use super::budget::{Jobs, LinkBudget, ReadAhead, rows_bytes};
use super::compute::{COMPUTE_TOKEN, ComputeHandle, Delivery, Mailbox, Outcome, Setup, Work};
use super::downstream::Downstream;
use super::onward::Forward;
use super::pair::{Pair, Unreached};
use super::retry::{self, RETRY_TOKEN, Retries};
use super::returns::{ReturnLink, Returns};
use super::shaping::{LinkShape, SHAPER_TOKEN};
use crate::telemetry::registry::{LinkSide, STAGE};
use crate::telemetry::{self, TraceContext, names};
use crate::wire::{
    Activations, ClusterKey, CodecPolicy, Decoder, ErrorCode, Frame, Hello, Role, Side,
    StageTiming, WireLimits, check_adjacent, check_same_model, encode, fresh_nonce, proof, verify,
};

/// The completion token with which one link of a pair wakes the other.
pub(crate) const RELAY_TOKEN: u64 = 2;
/// How long an accepted link has to open, besides the time this stage gives its own connect to the next one
/// (`--connect-retry-timeout`): from the accept to the link serving, that is the upstream's hello, this stage's
/// opening of its own link to the next stage and that stage's answer, and with a cluster key the upstream's
/// proof. A connection that says nothing is closed then instead of holding a slot of the stage's caps for as
/// long as it likes; stage 0 itself gives up on an unanswered hello after 10 s (twice its connect deadline).
pub(crate) const OPENING_TIMEOUT: Duration = Duration::from_secs(10);

/// The completion token that tells an upstream link the stage's drain deadline passed: its sessions get an
/// `Error` frame (`draining`) and the link closes gracefully, instead of being reset by the deadline's kill.
pub(crate) const DRAIN_DEADLINE_TOKEN: u64 = 4;
/// How long a link may sit idle between generations.
const LINK_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long an upstream link parked on its budget sleeps before it looks again by itself. A wake (a job done,
/// the downstream backlog back within the budget) is what ends a park; this only makes a lost one cost
/// seconds rather than the link, and is far enough apart that a long park costs nothing. (The server caps a
/// park at its own park timeout, and a park that times out parks again if it must: it never closes the link.)
const PARK_RECHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// What every link of one stage process shares.
#[derive(Debug)]
pub(crate) struct StageShared {
    /// This stage's hello (its stage index is filled in per link, from the upstream's).
    pub(crate) hello: Hello,
    pub(crate) key: Option<ClusterKey>,
    pub(crate) compute: ComputeHandle,
    /// The server's handle, for opening downstream links; set right after the server is built.
    pub(crate) handle: OnceLock<ServerHandle>,
    /// How to wake each open upstream link, by connection id (to stop its sessions at the drain deadline).
    pub(crate) upstreams: Mutex<HashMap<u64, Completer>>,
    pub(crate) next: Option<std::net::SocketAddr>,
    pub(crate) limits: WireLimits,
    pub(crate) codec: CodecPolicy,
    pub(crate) connect_timeout: Duration,
    /// How long a link keeps trying to reach the next stage before it refuses the stage before it.
    pub(crate) connect_retry_timeout: Duration,
    /// Shaping of the downstream links (tests and benchmarks).
    pub(crate) shape: LinkShape,
    /// The stage's index as the operator gave it, for lifecycle events.
    pub(crate) stage_index: Option<u16>,
    /// Sessions configured and not yet stopped, over every upstream link (a drain reports them).
    pub(crate) open_sessions: AtomicUsize,
    /// Sessions stopped by the drain deadline (an `Error` frame, `draining`) rather than by their Stop.
    pub(crate) stopped_sessions: AtomicUsize,
    /// At the last stage: the sessions whose tokens go straight back to stage 0, and over which link.
    pub(crate) returns: Returns,
    /// At the last stage: the address its hellos name for prediction returns (`--advertise`); `None`: the
    /// address each upstream link reached it at.
    pub(crate) advertise: Option<std::net::SocketAddr>,
    /// This stage's index as the latest chain link told it (the upstream's plus one), for the hellos of
    /// prediction-return links, which come from stage 0 and so cannot tell it.
    pub(crate) chain_index: std::sync::atomic::AtomicU16,
    /// The most bytes each pair holds for the next stage and each upstream link reads ahead.
    pub(crate) link_budget: LinkBudget,
}

/// The one session type of a stage's server: links it accepted and links it opened.
#[derive(Debug)]
pub(crate) enum Link {
    /// From the stage before this one (or stage 0).
    Upstream(Upstream),
    /// To the next stage.
    Downstream(Downstream),
}

/// A computed frame's span, held until its answer has been written to a socket, to record `write_micros` on
/// (the span ends when this is dropped, written or not).
#[derive(Debug)]
pub(crate) struct Writing {
    frame: tracing::Span,
    /// When the compute thread delivered the frame's outcome.
    delivered: Instant,
}

impl Writing {
    /// `frame` to time from `delivered`, unless nothing records it (frame spans are at trace level).
    pub(crate) fn of(frame: tracing::Span, delivered: Instant) -> Option<Writing> {
        (!frame.is_disabled()).then_some(Writing { frame, delivered })
    }

    /// The answer is on the socket: records the time since its delivery.
    fn written(self, now: Instant) {
        let micros = now.saturating_duration_since(self.delivered).as_micros();
        self.frame
            .record("write_micros", i64::try_from(micros).unwrap_or(i64::MAX));
    }
}

/// Records `write_micros` on every frame whose answer the flush that just ended wrote.
pub(crate) fn flushed(writing: &mut Vec<Writing>) {
    if writing.is_empty() {
        return;
    }
    let now = Instant::now();
    for frame in writing.drain(..) {
        frame.written(now);
    }
}

/// Where an upstream link is in its life.
#[derive(Debug)]
enum UpstreamState {
    /// Waiting for the upstream's hello.
    Hello,
    /// The upstream's hello checked out; waiting for the next stage to answer ours.
    Downstream { theirs: Hello },
    /// Our hello went out on a keyed link; waiting for the upstream's proof.
    Proof { theirs: Hello, ours: [u8; 16] },
    /// Frames flow.
    Serving,
    /// An error frame went out; the link closes once it is flushed.
    Closing,
}

/// A link accepted from the stage before this one.
#[derive(Debug)]
pub(crate) struct Upstream {
    shared: Arc<StageShared>,
    decoder: Decoder,
    state: UpstreamState,
    mailbox: Option<Arc<Mailbox>>,
    pair: Option<Arc<Pair>>,
    /// Sessions configured over this link and in a generation: stopped when the link ends.
    sessions: HashSet<u64>,
    /// Sessions between generations, kept for stage 0 to resume (`Keep`): idle, so a drain does not wait for
    /// them, and stopped when the link ends.
    kept: HashSet<u64>,
    /// Compute jobs submitted and not yet answered, with the rows each will add to the pair's backlog.
    jobs: Jobs,
    /// Frames read and not yet acted on (while `jobs` is at its limit, or the pair's backlog over budget).
    queued: ReadAhead,
    /// This stage's index on this link (the upstream's plus one), once its hello came.
    stage_index: u16,
    /// Each open session's span, Configure to Stop, in the trace stage 0 started. Never entered (so it ends
    /// when its last handle closes: after the Stop frame's compute, whose span holds it as parent).
    spans: HashMap<u64, tracing::Span>,
    /// Frames whose answers are in this link's output, until the flush writes them.
    writing: Vec<Writing>,
    /// The connection's id, once open (its key in `StageShared::upstreams`).
    id: Option<u64>,
    /// The attempts at reaching the next stage for this link, while its handshake waits for one.
    retries: Option<Retries>,
    /// What a prediction-return link (from stage 0, at the last stage) holds; `None` on a chain link.
    returning: Option<Box<ReturnLink>>,
    /// The `Configure`s of each session handed to the compute thread and not yet answered: a refusal forgets
    /// the session only when no later open of it is on its way.
    opening: HashMap<u64, u32>,
    /// Where the chain's last stage takes prediction returns, as the next stage's hello said (a middle
    /// stage passes it on in its own).
    return_address: Option<std::net::SocketAddr>,
    /// The context length the next stage's hello said (the least from it to the chain's end): this stage's
    /// answer passes on the least of it and its own.
    next_context: Option<u32>,
    /// The lanes the next stage's hello said (the least from it to the chain's end), passed on the same way.
    next_lanes: Option<u16>,
    /// The address the upstream reached this stage at (the last stage names it for prediction returns).
    local: Option<std::net::SocketAddr>,
}

impl Link {
    /// A link accepted on this stage's listener.
    pub(crate) fn accepted(shared: Arc<StageShared>) -> Link {
        Link::Upstream(Upstream {
            decoder: Decoder::new(shared.limits),
            shared,
            state: UpstreamState::Hello,
            mailbox: None,
            pair: None,
            sessions: HashSet::new(),
            kept: HashSet::new(),
            jobs: Jobs::default(),
            queued: ReadAhead::default(),
            stage_index: 0,
            spans: HashMap::new(),
            writing: Vec::new(),
            id: None,
            retries: None,
            returning: None,
            opening: HashMap::new(),
            return_address: None,
            next_context: None,
            next_lanes: None,
            local: None,
        })
    }
}

impl Session for Link {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        context.set_idle_timeout(LINK_IDLE_TIMEOUT);
        match self {
            Link::Upstream(link) => link.on_open(context),
            Link::Downstream(link) => link.on_open(context),
        }
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        match self {
            Link::Upstream(link) => link.on_data(input, context),
            Link::Downstream(link) => link.on_data(input, context),
        }
    }

    fn on_writable(&mut self, context: &mut SessionContext<'_>) -> Step {
        match self {
            Link::Upstream(link) => {
                flushed(&mut link.writing);
                if matches!(link.state, UpstreamState::Closing) {
                    Step::Close
                } else {
                    link.next_step(context)
                }
            }
            Link::Downstream(link) => link.on_writable(context),
        }
    }

    fn on_wake(&mut self, token: u64, _value: u64, context: &mut SessionContext<'_>) -> Step {
        match self {
            Link::Upstream(link) => link.on_wake(token, context),
            Link::Downstream(link) => link.on_wake(context),
        }
    }

    fn on_timeout(&mut self, kind: TimeoutKind, context: &mut SessionContext<'_>) -> Step {
        match (self, kind) {
            // A park on the budget that outlived its deadline is a link waiting for a slow next stage, not a
            // dead one: it looks again, and parks again if it must.
            (Link::Upstream(link), TimeoutKind::Park) => link.on_wake(RELAY_TOKEN, context),
            _ => Step::Close,
        }
    }

    fn on_peer_closed(&mut self, _context: &mut SessionContext<'_>) -> Step {
        Step::Close
    }

    fn on_close(&mut self, info: &ConnectionInfo, reason: CloseReason) {
        match self {
            Link::Upstream(link) => link.on_close(info, reason),
            Link::Downstream(link) => link.on_close(info, reason),
        }
    }
}

impl Upstream {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        let Some(completer) = context.completer() else {
            return Step::Abort;
        };
        let id = context.info().id.get();
        let mailbox = Mailbox::new(completer.clone(), id);
        // Cleared once frames flow (see `opened`).
        context.set_exchange_deadline(Some(
            context.now() + OPENING_TIMEOUT + self.shared.connect_retry_timeout,
        ));
        if self.shared.next.is_none() {
            // The last stage: tokens go straight to their return links (a middle stage's rows go to its pair,
            // once there is one).
            mailbox.set_onward(Forward::new(None, Arc::clone(&self.shared)));
        }
        self.mailbox = Some(mailbox);
        self.id = Some(id);
        self.local = Some(context.info().local);
        lock_upstreams(&self.shared).insert(id, completer);
        tracing::debug!(
            connection_id = id,
            peer = %context.info().peer,
            "{}",
            names::EVENT_UPSTREAM_ACCEPTED
        );
        if context.info().lane == super::gate::REFUSED_LANE {
            let peer = context.info().peer;
            self.refuse(
                context,
                0,
                ErrorCode::Auth,
                format!(
                    "this stage takes links only from the addresses given to --allow-from, and {} is not one of them",
                    peer.ip()
                ),
            );
            return Step::Write;
        }
        Step::Listen
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        // Every byte is taken (a frame cut by a read boundary waits in the decoder), so nothing is left in the
        // driver's buffer that no later read would bring back to this hook; whole frames wait in `queued`.
        STAGE.received(LinkSide::Upstream, input.bytes().len());
        while !input.is_empty() && !matches!(self.state, UpstreamState::Closing) {
            match self.decoder.decode(input.bytes()) {
                Ok((taken, frame)) => {
                    input.consume(taken);
                    match frame {
                        // A liveness check is answered as it is read, not behind frames waiting for compute.
                        Some(Frame::Ping { nonce })
                            if matches!(self.state, UpstreamState::Serving)
                                && self.returning.is_none() =>
                        {
                            self.on_ping(nonce, context);
                        }
                        Some(frame) => self.queued.push(frame),
                        None => {}
                    }
                }
                Err(error) => {
                    self.refuse(context, 0, error.code(), error.to_string());
                }
            }
        }
        input.consume_all();
        self.run_queued(context);
        self.mark_busy(context);
        self.next_step(context)
    }

    /// How the link goes on after a hook: it flushes what it queued first (a parked session writes nothing),
    /// then parks while what it read ahead is over the budget (the socket unread, so the stage before meets
    /// TCP back-pressure), else listens. A wake ends the park: a job done (`COMPUTE_TOKEN`), the downstream
    /// backlog back within the budget or an answer from the next stage (`RELAY_TOKEN`), the drain deadline.
    fn next_step(&mut self, context: &mut SessionContext<'_>) -> Step {
        if matches!(self.state, UpstreamState::Closing) || !context.output().is_empty() {
            Step::Write
        } else if self.queued.is_full(self.shared.link_budget) {
            Step::Park {
                until: context.now() + PARK_RECHECK_TIMEOUT,
            }
        } else {
            Step::Listen
        }
    }

    /// A link with a session open is busy, not idle, between its frames: a drain lets the generation finish
    /// instead of closing the link as idle. The downstream link follows.
    fn mark_busy(&mut self, context: &mut SessionContext<'_>) {
        // A return link with sessions registered carries their tokens: busy as their chain links are.
        let active = !self.sessions.is_empty()
            || self
                .returning
                .as_ref()
                .is_some_and(|returning| returning.has_sessions());
        context.set_phase(if active {
            Phase::Receiving
        } else {
            Phase::Idle
        });
        if let Some(pair) = &self.pair {
            let mut state = pair.lock();
            if state.active != active {
                state.active = active;
                Pair::wake(state.downstream.as_ref());
            }
        }
    }

    /// Acts on queued frames, in order, while the compute thread has room for more of this link's work and,
    /// for a frame with rows, while the pair's backlog and the rows computing are within the budget (else the
    /// pair wakes this link once the backlog falls). Control frames are never held for the budget, but wait
    /// behind the frames before them, so a Stop never overtakes rows still read ahead (rows already computing may
    /// reach the next stage after it, which answers them `UnknownSession`; stage 0 has let the session go).
    fn run_queued(&mut self, context: &mut SessionContext<'_>) {
        while self.jobs.has_room() && !matches!(self.state, UpstreamState::Closing) {
            let Some(frame) = self.queued.front() else {
                break;
            };
            if rows_bytes(frame) > 0
                && let Some(pair) = &self.pair
                && !pair.admits(self.jobs.committed())
            {
                break;
            }
            let Some(frame) = self.queued.pop() else {
                break;
            };
            self.on_frame(frame, context);
        }
    }

    fn on_frame(&mut self, frame: Frame, context: &mut SessionContext<'_>) {
        match std::mem::replace(&mut self.state, UpstreamState::Serving) {
            UpstreamState::Hello => {
                let Frame::Hello(theirs) = frame else {
                    return self.refuse(
                        context,
                        0,
                        ErrorCode::Protocol,
                        format!("expected a hello first, got a {} frame", frame.kind_name()),
                    );
                };
                self.on_hello(theirs, context);
            }
            UpstreamState::Downstream { theirs } => {
                self.state = UpstreamState::Downstream { theirs };
                self.refuse(
                    context,
                    frame.session().unwrap_or(0),
                    ErrorCode::Protocol,
                    format!(
                        "a {} frame came before this stage answered the hello",
                        frame.kind_name()
                    ),
                );
            }
            UpstreamState::Proof { theirs, ours } => {
                let (Frame::Proof { proof }, Some(key)) = (&frame, &self.shared.key) else {
                    return self.refuse(
                        context,
                        0,
                        ErrorCode::Auth,
                        "this stage needs the cluster key's proof before any other frame".into(),
                    );
                };
                if verify(key, Side::Connecting, &theirs.nonce, &ours, proof) {
                    opened(context);
                } else {
                    self.refuse(
                        context,
                        0,
                        ErrorCode::Auth,
                        "the proof does not match this stage's cluster key; give every stage the same --cluster-key file".into(),
                    );
                }
            }
            UpstreamState::Serving => self.on_serving(frame, context),
            UpstreamState::Closing => self.state = UpstreamState::Closing,
        }
    }

    fn on_hello(&mut self, theirs: Hello, context: &mut SessionContext<'_>) {
        if theirs.role == Role::PredictionReturn {
            return self.on_return_hello(theirs, context);
        }
        let ours = self.our_hello(&theirs);
        self.shared
            .chain_index
            .store(ours.stage_index, Ordering::Relaxed);
        self.stage_index = ours.stage_index;
        tracing::debug!(
            stage_index = ours.stage_index,
            peer = %context.info().peer,
            "stage.binary_link_hello"
        );
        if let Err(mismatch) = check_adjacent(&theirs, &ours) {
            return self.refuse(context, 0, mismatch.code(), mismatch.to_string());
        }
        if self.shared.key.is_some() && theirs.nonce == [0; 16] {
            return self.refuse(
                context,
                0,
                ErrorCode::Auth,
                format!(
                    "stage {} sent no cluster-key nonce, but this stage requires --cluster-key",
                    theirs.stage_index
                ),
            );
        }
        if self.shared.next.is_none() {
            return self.answer(theirs, context);
        }
        self.retries = Some(Retries::new(
            Instant::now(),
            self.shared.connect_retry_timeout,
        ));
        self.open_downstream(theirs, context);
    }

    /// A prediction-return link from stage 0: taken only at the last stage, for the same model, and with the
    /// cluster key when the stage has one; then answered at once (nothing is behind this stage).
    fn on_return_hello(&mut self, theirs: Hello, context: &mut SessionContext<'_>) {
        let layers = format!(
            "{}..{}",
            self.shared.hello.layer_start, self.shared.hello.layer_end
        );
        if let Some(next) = self.shared.next {
            return self.refuse(
                context,
                0,
                ErrorCode::Protocol,
                format!(
                    "this stage serves layers {layers} and passes them on to {next}; open the prediction-return link to the chain's last stage"
                ),
            );
        }
        let Some(completer) = context.completer() else {
            return self.refuse(context, 0, ErrorCode::Internal, "no completer".into());
        };
        self.returning = Some(Box::new(ReturnLink::new(completer, self.shared.shape)));
        let ours = self.our_hello(&theirs);
        self.stage_index = ours.stage_index;
        if let Err(mismatch) = check_same_model(&theirs, &ours) {
            return self.refuse(context, 0, mismatch.code(), mismatch.to_string());
        }
        if self.shared.key.is_some() && theirs.nonce == [0; 16] {
            return self.refuse(
                context,
                0,
                ErrorCode::Auth,
                format!(
                    "stage {} sent no cluster-key nonce, but this stage requires --cluster-key",
                    theirs.stage_index
                ),
            );
        }
        tracing::debug!(
            stage_index = ours.stage_index,
            peer = %context.info().peer,
            "stage.prediction_return_opened"
        );
        self.answer(theirs, context);
    }

    /// A frame on a prediction-return link: `OpenReturn` registers a session (answered with an `Ack` at
    /// position 0), `Stop` unregisters it; nothing else belongs on such a link.
    fn on_return_frame(&mut self, frame: Frame, context: &mut SessionContext<'_>) {
        let Some(returning) = self.returning.as_mut() else {
            return;
        };
        match frame {
            Frame::OpenReturn { session } => match returning.open(&self.shared.returns, session) {
                Ok(()) => self.write(
                    context,
                    &Frame::Ack {
                        session,
                        position: 0,
                        timings: Vec::new(),
                    },
                ),
                Err(message) => self.error(context, session, ErrorCode::Protocol, message),
            },
            Frame::Stop { session } => returning.stop(&self.shared.returns, session),
            other => {
                let message = format!(
                    "a {} frame does not belong on a prediction-return link; send it down the chain",
                    other.kind_name()
                );
                self.error(
                    context,
                    other.session().unwrap_or(0),
                    ErrorCode::Protocol,
                    message,
                );
            }
        }
    }

    /// Writes the tokens handed to this prediction-return link (those the shaper lets through now).
    fn take_returned(&mut self, context: &mut SessionContext<'_>) {
        let completer = context.completer();
        let Some(returning) = self.returning.as_mut() else {
            return;
        };
        for (bytes, writing) in returning.take_due(completer.as_ref()) {
            self.write_bytes(context, &bytes);
            self.writing.extend(writing);
        }
    }

    /// Opens the link to the next stage for this one (again, after a failed attempt); the upstream's hello is
    /// answered once the next stage answered ours.
    fn open_downstream(&mut self, theirs: Hello, context: &mut SessionContext<'_>) {
        let ours = self.our_hello(&theirs);
        let Some(next) = self.shared.next else {
            return self.answer(theirs, context);
        };
        let Some(handle) = self.shared.handle.get() else {
            return self.refuse(
                context,
                0,
                ErrorCode::Internal,
                "the stage is still starting; retry".into(),
            );
        };
        let pair = Arc::new(Pair::new(self.shared.link_budget));
        pair.lock().upstream = context.completer();
        let downstream = Downstream::new(
            Arc::clone(&self.shared),
            Arc::clone(&pair),
            Hello {
                nonce: if self.shared.key.is_some() {
                    fresh_nonce()
                } else {
                    [0; 16]
                },
                proof: None,
                // The side that connects names no return address.
                return_address: None,
                ..ours
            },
        );
        let options = ConnectOptions::new().connect_timeout(self.shared.connect_timeout);
        if let Some(mailbox) = &self.mailbox {
            mailbox.set_onward(Forward::new(
                Some(Arc::clone(&pair)),
                Arc::clone(&self.shared),
            ));
        }
        self.pair = Some(pair);
        self.state = UpstreamState::Downstream { theirs };
        if let Err(error) = handle.connect(next, Link::Downstream(downstream), options) {
            let message = format!(
                "stage {} could not reach the next stage at {next}: {error}",
                ours.stage_index
            );
            self.unreached(
                Unreached {
                    message,
                    retryable: true,
                },
                context,
            );
        }
    }

    /// The attempt at reaching the next stage failed: tries again after a backoff while the budget lasts
    /// (`--connect-retry-timeout`) and the failure is one a retry could change; otherwise refuses the
    /// upstream's link with the reason, and the attempts when there were several.
    fn unreached(&mut self, failure: Unreached, context: &mut SessionContext<'_>) {
        let now = Instant::now();
        if failure.retryable
            && let Some(retries) = self.retries.as_mut()
            && let Some(gap) = retries.next_gap(now)
            && let Some(completer) = context.completer()
        {
            tracing::debug!(
                stage_index = self.stage_index,
                attempt = retries.attempts(),
                gap_millis = u64::try_from(gap.as_millis()).unwrap_or(u64::MAX),
                reason = failure.message,
                "stage.downstream_retry"
            );
            retry::wake_after(gap, &completer);
            return;
        }
        let message = match self.retries {
            Some(retries) if retries.attempts() > 1 => format!(
                "{} (after {} attempts over {} ms)",
                failure.message,
                retries.attempts(),
                retries.elapsed(now).as_millis()
            ),
            _ => failure.message,
        };
        self.refuse(context, 0, ErrorCode::StageDown, message);
    }

    /// A retry timer fired: the next attempt, if the handshake still waits for one.
    fn retry_downstream(&mut self, context: &mut SessionContext<'_>) {
        if !matches!(self.state, UpstreamState::Downstream { .. }) {
            return;
        }
        let UpstreamState::Downstream { theirs } =
            std::mem::replace(&mut self.state, UpstreamState::Serving)
        else {
            return;
        };
        self.open_downstream(theirs, context);
    }

    /// This stage's hello toward `upstream`: on a chain link its stage index follows the upstream's and it
    /// names where the chain's last stage takes prediction returns (itself, when it is last, else what the
    /// next stage said); on a prediction-return link it is the last stage's as its chain links know it.
    fn our_hello(&self, upstream: &Hello) -> Hello {
        if self.returning.is_some() {
            return Hello {
                role: Role::PredictionReturn,
                stage_index: self.shared.chain_index.load(Ordering::Relaxed),
                ..self.shared.hello.clone()
            };
        }
        let return_address = if self.shared.next.is_none() {
            self.shared.advertise.or(self.local)
        } else {
            self.return_address
        };
        let own = self.shared.hello.context_length;
        Hello {
            stage_index: upstream.stage_index.saturating_add(1),
            return_address,
            context_length: self.next_context.map_or(own, |next| next.min(own)),
            lanes: self.next_lanes.map_or(self.shared.hello.lanes, |next| {
                next.min(self.shared.hello.lanes)
            }),
            ..self.shared.hello.clone()
        }
    }

    /// Answers the upstream's hello (the rest of the chain, if any, has answered ours).
    fn answer(&mut self, theirs: Hello, context: &mut SessionContext<'_>) {
        let mut ours = self.our_hello(&theirs);
        if let Some(key) = &self.shared.key {
            ours.nonce = fresh_nonce();
            ours.proof = Some(proof(key, Side::Accepting, &theirs.nonce, &ours.nonce));
            let nonce = ours.nonce;
            self.write(context, &Frame::Hello(ours));
            self.state = UpstreamState::Proof {
                theirs,
                ours: nonce,
            };
        } else {
            self.write(context, &Frame::Hello(ours));
            self.state = UpstreamState::Serving;
            opened(context);
        }
    }

    fn on_serving(&mut self, frame: Frame, context: &mut SessionContext<'_>) {
        if self.returning.is_some() {
            return self.on_return_frame(frame, context);
        }
        let session = frame.session().unwrap_or(0);
        if let Frame::Keep { session } = frame {
            // Nothing to compute: the session's lane and cache stay as they are, idle until resumed.
            if self.sessions.remove(&session) {
                self.shared.open_sessions.fetch_sub(1, Ordering::Relaxed);
                self.kept.insert(session);
                // The compute thread may lend the kept lane to an open that finds none free.
                self.submit(Work::Keep { session }, session, context);
            } else if !self.kept.contains(&session) {
                // Only a session this link opened can be kept: a table of any ids a peer names would grow
                // without bound, and each would be stopped down the chain when the link ends.
                let message = format!(
                    "session {session} is not open on this link; only an open session can be kept"
                );
                return self.error(context, session, ErrorCode::UnknownSession, message);
            }
            if let Some(pair) = &self.pair {
                pair.send_down(&frame, None);
            }
            // The generation's session span ends here, with the keep as its last frame; a resume opens the next.
            if let Some(span) = self.spans.remove(&session) {
                let _keep = tracing::trace_span!(
                    parent: &span,
                    "stage.binary_llama_decode",
                    stage_index = i64::from(self.stage_index),
                    session_id = session,
                    kind = "keep",
                    // Handled where it is read: no compute queue to wait in.
                    queue_wait_micros = 0i64,
                );
            }
            self.mark_busy(context);
            return;
        }
        let work = match &frame {
            Frame::Configure {
                session,
                sampling,
                logit_bias,
                history,
                top_logprobs,
                logprob,
                resume,
                trace,
                ..
            } => {
                if context.draining() {
                    let message = "this stage is draining (it is shutting down); start the generation on another chain".to_owned();
                    return self.error(context, *session, ErrorCode::Draining, message);
                }
                // A link holds at most as many sessions as the stage has lanes (stage 0 opens one link per
                // lane, and each stage mirrors its links down the chain, so a well-behaved link holds one or
                // two): a peer naming fresh ids would otherwise grow this link's tables without bound.
                let known = self.sessions.contains(session) || self.kept.contains(session);
                let held = self.sessions.len() + self.kept.len();
                let lanes = usize::from(self.shared.hello.lanes);
                if !known && held >= lanes {
                    let message = format!(
                        "this link already holds {held} sessions, as many as the stage has lanes ({lanes}); \
                         stop or keep one before opening session {session}"
                    );
                    return self.error(context, *session, ErrorCode::NoFreeLane, message);
                }
                self.kept.remove(session);
                if self.sessions.insert(*session) {
                    self.shared.open_sessions.fetch_add(1, Ordering::Relaxed);
                }
                *self.opening.entry(*session).or_insert(0) += 1;
                self.open_span(*session, trace.as_ref());
                Work::Open {
                    session: *session,
                    setup: Setup {
                        sampling: (*sampling).into(),
                        history: history.clone(),
                        logit_bias: logit_bias.clone(),
                        top_logprobs: *top_logprobs,
                        logprob: *logprob,
                    },
                    resume: *resume,
                }
            }
            Frame::Prefill {
                session,
                position,
                last,
                batch,
                rows,
            } => match self.rows(rows) {
                Ok(values) => Work::Chunk {
                    session: *session,
                    position: *position,
                    rows: values,
                    sample: *last,
                    decode: false,
                    batch: *batch,
                },
                Err(message) => {
                    return self.error(context, *session, ErrorCode::Protocol, message);
                }
            },
            Frame::Decode {
                session,
                position,
                batch,
                rows,
            } => match self.rows(rows) {
                Ok(values) => Work::Chunk {
                    session: *session,
                    position: *position,
                    rows: values,
                    sample: true,
                    decode: true,
                    batch: *batch,
                },
                Err(message) => {
                    return self.error(context, *session, ErrorCode::Protocol, message);
                }
            },
            Frame::Trim { session, length } => Work::Trim {
                session: *session,
                length: *length,
            },
            Frame::Stop { session } => {
                if self.sessions.remove(session) {
                    self.shared.open_sessions.fetch_sub(1, Ordering::Relaxed);
                }
                self.kept.remove(session);
                Work::Stop { session: *session }
            }
            other => {
                let message = format!(
                    "a {} frame is not something a stage is sent",
                    other.kind_name()
                );
                return self.error(context, session, ErrorCode::Protocol, message);
            }
        };
        // Control frames go down the chain as they came (a Configure names this stage's session span as
        // the next stage's parent); rows go down once computed.
        if let Some(pair) = &self.pair {
            match frame {
                Frame::Configure { .. } => {
                    pair.send_down(&self.with_own_trace(frame.clone()), None)
                }
                Frame::Trim { .. } | Frame::Stop { .. } => pair.send_down(&frame, None),
                _ => {}
            }
        }
        self.submit(work, session, context);
        if let Frame::Stop { session } = frame {
            // Dropping the span ends it.
            self.spans.remove(&session);
        }
    }

    /// Opens `session`'s span, continuing stage 0's trace when the Configure carried one.
    fn open_span(&mut self, session: u64, trace: Option<&[u8; 25]>) {
        let span = tracing::info_span!(
            "stage.binary_session",
            // Counts as i64: tracing-opentelemetry exports unsigned fields as strings (the random session
            // id stays one: it does not fit an i64).
            stage_index = i64::from(self.stage_index),
            session_id = session,
            layer_start = i64::from(self.shared.hello.layer_start),
            layer_end = i64::from(self.shared.hello.layer_end),
        );
        if let Some(parent) = trace.and_then(TraceContext::from_wire) {
            telemetry::continue_trace(&span, &parent);
        }
        debug_assert_eq!(names::SPAN_STAGE_SESSION, "stage.binary_session");
        self.spans.insert(session, span);
    }

    /// `frame` (a Configure) with its trace context replaced by this stage's session span, if it records.
    fn with_own_trace(&self, frame: Frame) -> Frame {
        let Frame::Configure {
            session,
            sampling,
            stop_tokens,
            logit_bias,
            history,
            top_logprobs,
            logprob,
            resume,
            trace,
        } = frame
        else {
            return frame;
        };
        let own = self
            .spans
            .get(&session)
            // Read without entering: an entered span would end at that exit (see `telemetry`'s doc).
            .and_then(telemetry::trace_context_of)
            .map(|context| context.to_wire());
        Frame::Configure {
            session,
            sampling,
            stop_tokens,
            logit_bias,
            history,
            top_logprobs,
            logprob,
            resume,
            trace: own.or(trace),
        }
    }

    fn rows(&self, rows: &Activations) -> Result<Vec<f32>, String> {
        if rows.width != self.shared.hello.width {
            return Err(format!(
                "activation rows are {} wide but this model's width is {}",
                rows.width, self.shared.hello.width
            ));
        }
        if rows.rows == 0 {
            return Err("a chunk with no rows".into());
        }
        Ok(rows.decode())
    }

    fn submit(&mut self, work: Work, session: u64, context: &mut SessionContext<'_>) {
        let Some(mailbox) = &self.mailbox else {
            return self.refuse(context, 0, ErrorCode::Internal, "no mailbox".into());
        };
        let span = self
            .spans
            .get(&session)
            .cloned()
            .unwrap_or_else(tracing::Span::none);
        // A chunk's rows come out the same shape as they went in, as f32 before any codec shrinks them.
        let committed = match &work {
            Work::Chunk { rows, .. } => rows.len() * std::mem::size_of::<f32>(),
            _ => 0,
        };
        if self
            .shared
            .compute
            .submit_in(work, mailbox, span, self.stage_index)
        {
            self.jobs.submitted(committed);
        } else {
            self.refuse(
                context,
                0,
                ErrorCode::Internal,
                "this stage's compute thread has stopped".into(),
            );
        }
    }

    fn on_wake(&mut self, token: u64, context: &mut SessionContext<'_>) -> Step {
        if token == DRAIN_DEADLINE_TOKEN {
            return self.stop_at_drain_deadline(context);
        }
        if token == RETRY_TOKEN {
            self.retry_downstream(context);
        }
        if self.returning.is_some() {
            if token == RELAY_TOKEN || token == SHAPER_TOKEN {
                self.take_returned(context);
            }
        } else if token == COMPUTE_TOKEN || token == RELAY_TOKEN {
            self.take_outcomes(context);
            self.take_relayed(context);
        }
        self.run_queued(context);
        self.mark_busy(context);
        self.next_step(context)
    }

    fn take_outcomes(&mut self, context: &mut SessionContext<'_>) {
        let Some(mailbox) = self.mailbox.clone() else {
            return;
        };
        let stage_index = self.shared.hello.stage_index;
        for Delivery {
            outcome,
            frame: span,
            delivered,
        } in mailbox.take()
        {
            self.jobs.answered();
            // Dropped (ending the frame's span) unless an answer goes out for it.
            let writing = Writing::of(span, delivered);
            match outcome {
                Outcome::Opened { session } => self.open_answered(session),
                Outcome::NotOpened {
                    session,
                    code,
                    message,
                } => {
                    self.open_answered(session);
                    // An open the stage refused for want of a lane leaves no session here, unless a later
                    // `Configure` of the same id is still on its way to the stage: counted open, it would hold the
                    // link busy (a drain would wait for it) and count against its sessions. (A Keep read while
                    // the open computed may have moved it to the kept ones already.)
                    if code == ErrorCode::NoFreeLane && !self.opening.contains_key(&session) {
                        if self.sessions.remove(&session) {
                            self.shared.open_sessions.fetch_sub(1, Ordering::Relaxed);
                        }
                        self.kept.remove(&session);
                        self.spans.remove(&session);
                    }
                    self.error(context, session, code, message);
                    self.writing.extend(writing);
                }
                Outcome::Settled | Outcome::Forwarded => {}
                // Rows go straight to the pair's downstream link from the compute thread (`onward`), which is
                // set with the pair; rows before there is one have nowhere to go.
                Outcome::Rows { .. } => {}
                // A token reaches this link only when the compute thread found no return link for its session
                // (`onward`, set before the link's first job): it goes up the chain.
                token @ Outcome::Token { .. } => {
                    let bytes = token.token_bytes().unwrap_or_default();
                    self.write_bytes(context, &bytes);
                    self.writing.extend(writing);
                }
                Outcome::Done {
                    session,
                    position,
                    compute_micros,
                } => {
                    self.write(
                        context,
                        &Frame::Ack {
                            session,
                            position,
                            timings: vec![StageTiming {
                                stage_index,
                                compute_micros,
                                wait_micros: 0,
                            }],
                        },
                    );
                    self.writing.extend(writing);
                }
                Outcome::Failed {
                    session,
                    code,
                    message,
                } => {
                    self.error(context, session, code, message);
                    self.writing.extend(writing);
                }
            }
        }
    }

    fn take_relayed(&mut self, context: &mut SessionContext<'_>) {
        let Some(pair) = self.pair.clone() else {
            return;
        };
        let (frames, answer, closed) = {
            let mut state = pair.lock();
            (
                std::mem::take(&mut state.to_upstream),
                state.downstream_answer.take(),
                state.downstream_closed.clone(),
            )
        };
        for bytes in frames {
            STAGE.sent(LinkSide::Upstream, bytes.len());
            if context.output().push(&bytes).is_err() {
                return self.refuse(
                    context,
                    0,
                    ErrorCode::Internal,
                    "the link's output budget is full".into(),
                );
            }
        }
        if let Some(answer) = answer {
            let UpstreamState::Downstream { theirs } =
                std::mem::replace(&mut self.state, UpstreamState::Serving)
            else {
                return;
            };
            match answer {
                Ok(next) => {
                    self.retries = None;
                    self.return_address = next.return_address;
                    self.next_context = Some(next.context_length);
                    self.next_lanes = Some(next.lanes);
                    self.answer(theirs, context)
                }
                Err(failure) => {
                    // Waiting for the next attempt is still waiting for the next stage.
                    self.state = UpstreamState::Downstream { theirs };
                    self.unreached(failure, context);
                }
            }
            return;
        }
        if let Some(reason) = closed
            && !matches!(self.state, UpstreamState::Closing)
        {
            self.refuse(context, 0, ErrorCode::StageDown, reason);
        }
    }

    /// Stage 0 asks whether the chain is alive: a stage with a next one passes the ping on (its answer comes
    /// back up the pair as every answer does), the last stage answers it.
    fn on_ping(&mut self, nonce: u64, context: &mut SessionContext<'_>) {
        match &self.pair {
            Some(pair) => pair.send_down(&Frame::Ping { nonce }, None),
            None => self.write(context, &Frame::Pong { nonce }),
        }
    }

    fn write(&mut self, context: &mut SessionContext<'_>, frame: &Frame) {
        let mut bytes = Vec::new();
        encode(frame, &mut bytes);
        self.write_bytes(context, &bytes);
    }

    fn write_bytes(&mut self, context: &mut SessionContext<'_>, bytes: &[u8]) {
        STAGE.sent(LinkSide::Upstream, bytes.len());
        if context.output().push(bytes).is_err() {
            self.state = UpstreamState::Closing;
        }
    }

    /// The compute thread answered one of `session`'s opens.
    fn open_answered(&mut self, session: u64) {
        if let Some(pending) = self.opening.get_mut(&session) {
            *pending -= 1;
            if *pending == 0 {
                self.opening.remove(&session);
            }
        }
    }

    /// An error for one session; the link and its other sessions go on.
    fn error(
        &mut self,
        context: &mut SessionContext<'_>,
        session: u64,
        code: ErrorCode,
        message: String,
    ) {
        self.write(
            context,
            &Frame::Error {
                session,
                code,
                message,
            },
        );
    }

    /// An error for the whole link, then a close once it is flushed.
    fn refuse(
        &mut self,
        context: &mut SessionContext<'_>,
        session: u64,
        code: ErrorCode,
        message: String,
    ) {
        tracing::warn!(peer = %context.info().peer, code = code.as_str(), "refused a link: {message}");
        self.error(context, session, code, message);
        self.state = UpstreamState::Closing;
    }

    /// The drain deadline passed with sessions still open on this link: each gets an `Error` frame in words,
    /// and the link closes once they are flushed (`on_close` then frees their lanes, here and downstream).
    fn stop_at_drain_deadline(&mut self, context: &mut SessionContext<'_>) -> Step {
        let mut sessions: Vec<u64> = self.sessions.iter().copied().collect();
        self.shared
            .stopped_sessions
            .fetch_add(sessions.len(), Ordering::Relaxed);
        // A return link tells its sessions too (their chain links count them), so stage 0 hears why whichever
        // of its two links it reads first.
        if let Some(returning) = &self.returning {
            sessions.extend(returning.sessions());
        }
        sessions.sort_unstable();
        for session in sessions {
            self.error(
                context,
                session,
                ErrorCode::Draining,
                format!(
                    "stage {} is shutting down and its drain deadline passed; the generation was stopped",
                    self.stage_index
                ),
            );
        }
        self.state = UpstreamState::Closing;
        Step::Write
    }

    fn on_close(&mut self, info: &ConnectionInfo, reason: CloseReason) {
        if let Some(id) = self.id.take() {
            lock_upstreams(&self.shared).remove(&id);
        }
        if let Some(returning) = self.returning.as_mut() {
            returning.close(&self.shared.returns);
        }
        self.spans.clear();
        tracing::debug!(
            stage_index = self.stage_index,
            connection_id = info.id.get(),
            peer = %info.peer,
            reason = %reason,
            sessions_stopped = self.sessions.len(),
            "{}",
            names::EVENT_UPSTREAM_CLOSED
        );
        self.shared
            .open_sessions
            .fetch_sub(self.sessions.len(), Ordering::Relaxed);
        // The lanes of this link's sessions are freed at once, whatever ended the link.
        if let Some(mailbox) = &self.mailbox {
            for session in self.sessions.drain().chain(self.kept.drain()) {
                let _ = self.shared.compute.submit(Work::Stop { session }, mailbox);
            }
        }
        if let Some(pair) = &self.pair {
            let mut state = pair.lock();
            state.upstream_closed = true;
            state.upstream = None;
            Pair::wake(state.downstream.as_ref());
        }
    }
}

/// The link is open (hellos and proofs checked): no deadline for the exchange from here, only the limits' own.
fn opened(context: &mut SessionContext<'_>) {
    context.set_exchange_deadline(None);
}

fn lock_upstreams(shared: &StageShared) -> MutexGuard<'_, HashMap<u64, Completer>> {
    shared
        .upstreams
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
