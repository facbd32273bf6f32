//! [`SessionMachine`]: the per-connection policy every session driver applies around a [`Session`]'s steps,
//! held once here so the worker-thread driver and the event loop cannot drift apart.
//!
//! A driver moves bytes and timers; what those mean for the session lives here, with no socket:
//!
//! ```text
//!   driver                                   SessionMachine
//!   ──────                                   ──────────────
//!   hook call ─────────── hook(session, …) ─▶ context with the half close and the requests; panic
//!                                             contained (None); requests applied after the hook
//!   about to wait for input ── read_wait() ─▶ (deadline, kind): idle / read timeout by phase, or the
//!                                             exchange deadline when earlier; is_idle() for drain, shed
//!   bytes arrived ───────── input_arrived() ▶ automatic phase Idle → Receiving
//!   queue flushed ──────── output_flushed() ▶ automatic phase back to Idle once no input is left
//!   FIN read ────────────── peer_closed() ──▶ pending PeerClosed (a later read closes with it)
//!   a deadline passed ─── deadline_passed() ▶ pending = that deadline's reason (the exchange deadline is
//!                                             spent before the hook, so a new one set there stands)
//!   on_timeout's step ─ timeout_answered() ─▶ carrying on (Read, Write, Park) clears the pending reason
//!   Close / Abort ─────── close_reason(step) ▶ the pending reason, else SessionClosed / SessionError
//!   any step but Abort ─ half_close_due() ──▶ SendFin once the queue is empty; Refuse bytes after it
//!   input in the buffer ─── data_hook(…) ──▶ on_data over the unread input; consumed, more to give
//!   a deadline passed ─── timeout_hook(…) ──▶ deadline_passed, on_timeout, timeout_answered in one
//!   a flush timed out ─ flush_deadline_kind ▶ exchange or write; flush_timeout_answer: Close is abortive
//!   a park starts ──────── park_deadline() ─▶ the session's time, never past the park timeout
//! ```
//!
//! When a slow peer is judged lives beside it in [`TransferRates`](crate::transfer::TransferRates), and the
//! linger of a graceful close in [`LingerRead`](crate::linger::LingerRead). What stays in the drivers,
//! because it is IO: reading and writing, acquiring and releasing buffers, the waits themselves and the kill slot.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use crate::clock::deadline_after;
use crate::close::{CloseReason, TimeoutKind};
use crate::completion::Completer;
use crate::info::ConnectionInfo;
use crate::input::ReadBuffer;
use crate::output::Output;
use crate::session::{Phase, Pressure, Session, SessionContext, SessionRequests, Step};

/// Where a session's half close stands ([`SessionContext::shutdown_write`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WriteShut {
    /// No half close asked for.
    #[default]
    Open,
    /// Asked for: the FIN goes once the output queue is empty.
    Requested,
    /// The FIN went out: a byte queued now cannot be sent.
    Sent,
}

/// What a driver does about the half close once a hook returned or a flush emptied the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfClose {
    /// Nothing now.
    Nothing,
    /// Send the FIN now, then call [`SessionMachine::fin_sent`].
    SendFin,
    /// Bytes were queued after the FIN: close with `SessionError` rather than drop them silently.
    Refuse,
}

/// What the driver knows about the server when it calls a hook.
#[derive(Clone, Copy, Debug, Default)]
pub struct HookEnvironment<'a> {
    /// The server drains ([`SessionContext::draining`]).
    pub draining: bool,
    /// Where the load figure comes from ([`SessionContext::pressure`]).
    pub pressure: Pressure<'a>,
    /// The completer for offloaded work, if the driver offers one.
    pub completer: Option<&'a Completer>,
}

/// The session policy of one connection: its phase, the deadlines a session set, the reason a deadline or
/// the peer's FIN fixed, and its half close. See the module doc for who calls what.
#[derive(Clone, Debug, Default)]
pub struct SessionMachine {
    requests: SessionRequests,
    phase: Phase,
    phase_override: Option<Phase>,
    exchange: Option<Instant>,
    idle_timeout: Option<Duration>,
    pending: Option<CloseReason>,
    peer_closed: bool,
    write_shut: WriteShut,
}

impl SessionMachine {
    /// The state of a new connection: idle, nothing asked for.
    pub fn new() -> SessionMachine {
        SessionMachine::default()
    }

    /// The phase the connection is in.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The exchange deadline the session set, if any.
    pub fn exchange_deadline(&self) -> Option<Instant> {
        self.exchange
    }

    /// True once the peer's FIN was read.
    pub fn is_peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// True if the session ever asked for a half close (the drivers skip the half-close check otherwise).
    pub fn half_close_asked(&self) -> bool {
        self.write_shut != WriteShut::Open
    }

    /// True once the FIN of a half close went out.
    pub fn is_write_shut(&self) -> bool {
        self.write_shut == WriteShut::Sent
    }

    /// The request slots a [`SessionContext`] writes to, for a caller that builds a context itself (the drivers
    /// use [`SessionMachine::hook`] and [`SessionMachine::data_hook`]). Call [`SessionMachine::apply_requests`]
    /// after the hook.
    pub fn requests(&mut self) -> &mut SessionRequests {
        &mut self.requests
    }

    /// Applies and clears what the session asked for during a hook.
    #[inline]
    pub fn apply_requests(&mut self) {
        let requests = std::mem::take(&mut self.requests);
        if let Some(exchange) = requests.exchange_deadline {
            self.exchange = exchange;
        }
        if let Some(phase) = requests.phase {
            self.phase_override = Some(phase);
            self.phase = phase;
        }
        if let Some(idle) = requests.idle_timeout {
            self.idle_timeout = Some(idle);
        }
        if requests.shutdown_write && self.write_shut == WriteShut::Open {
            self.write_shut = WriteShut::Requested;
        }
    }

    /// Calls a hook under `catch_unwind` with a fresh context, then applies what the session asked for.
    /// `None` means the hook panicked: the driver closes the connection with `SessionPanicked`.
    #[inline]
    pub fn hook<S: Session, T>(
        &mut self,
        session: &mut S,
        info: &ConnectionInfo,
        output: &mut Output,
        now: Instant,
        environment: HookEnvironment<'_>,
        call: impl FnOnce(&mut S, &mut SessionContext<'_>) -> T,
    ) -> Option<T> {
        let write_shut = self.is_write_shut();
        let mut context = hook_context(
            info,
            output,
            &mut self.requests,
            now,
            write_shut,
            environment,
        );
        let result = catch_unwind(AssertUnwindSafe(|| call(session, &mut context))).ok();
        self.apply_requests();
        result
    }

    /// Calls `on_data` over the unread input of `read` under `catch_unwind`, consumes what the session took
    /// and applies its requests. `Some((step, more))`: `more` is true when the session consumed some input
    /// and left some (the driver calls `on_data` again before reading). `None`: the hook panicked.
    #[inline]
    pub fn data_hook<S: Session>(
        &mut self,
        session: &mut S,
        read: &mut ReadBuffer,
        info: &ConnectionInfo,
        output: &mut Output,
        now: Instant,
        environment: HookEnvironment<'_>,
    ) -> Option<(Step, bool)> {
        let mut input = read.input();
        let before = input.len();
        let write_shut = self.is_write_shut();
        let mut context = hook_context(
            info,
            output,
            &mut self.requests,
            now,
            write_shut,
            environment,
        );
        let step = catch_unwind(AssertUnwindSafe(|| {
            session.on_data(&mut input, &mut context)
        }));
        let consumed = input.consumed().min(before);
        self.apply_requests();
        read.consume(consumed);
        let more = consumed > 0 && read.unread_len() > 0;
        step.ok().map(|step| (step, more))
    }

    /// A deadline of `kind` passed: fixes its reason, asks the session's `on_timeout` what to do, and forgets
    /// the reason again if the session carries on. `None`: the hook panicked.
    #[inline]
    pub fn timeout_hook<S: Session>(
        &mut self,
        session: &mut S,
        kind: TimeoutKind,
        info: &ConnectionInfo,
        output: &mut Output,
        now: Instant,
        environment: HookEnvironment<'_>,
    ) -> Option<Step> {
        self.deadline_passed(kind);
        let step = self.hook(
            session,
            info,
            output,
            now,
            environment,
            |session, context| session.on_timeout(kind, context),
        )?;
        self.timeout_answered(step);
        Some(step)
    }

    /// Which deadline ended a flush that timed out at `now`: the exchange deadline if it has passed, the
    /// write timeout otherwise.
    pub fn flush_deadline_kind(&self, now: Instant) -> TimeoutKind {
        match self.exchange {
            Some(exchange) if now >= exchange => TimeoutKind::Exchange,
            _ => TimeoutKind::Write,
        }
    }

    /// What a flush that hit the deadline of `kind` does after the session answered `step`: unsent output
    /// stays queued, so `Close` ends abortively with the deadline's own reason, as `Abort` does; any other
    /// step carries on.
    pub fn flush_timeout_answer(kind: TimeoutKind, step: Step) -> Result<Step, CloseReason> {
        match step {
            Step::Close | Step::Abort => Err(kind.close_reason()),
            next => Ok(next),
        }
    }

    /// When a park starting at `now` that the session asked to last `until` ends: never later than the
    /// server's park timeout.
    pub fn park_deadline(now: Instant, until: Instant, park_timeout: Duration) -> Instant {
        until.min(deadline_after(now, park_timeout))
    }

    /// The gate denied a write with `code`: the queue is dropped, and the session may queue a denial text in
    /// its `on_denied` (panic contained). Returns the text to send once, without blocking, at most `limit`
    /// bytes, and only if `clean` (nothing of a response went out yet; otherwise the close is an RST
    /// anyway). The driver sends it, then clears the queue and closes with `EgressDenied(code)`.
    pub fn denial<'o, S: Session>(
        session: &mut S,
        code: u16,
        output: &'o mut Output,
        clean: bool,
        limit: usize,
    ) -> Option<&'o [u8]> {
        output.clear();
        let _ = catch_unwind(AssertUnwindSafe(|| session.on_denied(code, output)));
        if !clean || output.is_empty() {
            return None;
        }
        let front = output.front();
        Some(&front[..front.len().min(limit)])
    }

    /// Whether the connection is between exchanges: the idle timeout applies, and a drain or a shed may
    /// close it now. `unread` is the input the session left unconsumed.
    #[inline]
    pub fn is_idle(&self, unread: usize, output_empty: bool) -> bool {
        self.phase == Phase::Idle && unread == 0 && output_empty
    }

    /// The deadline a wait for input starting `now` runs under, and which deadline it is: the idle timeout
    /// (the session's own if it set one) between exchanges, the read timeout once a request started, or the
    /// exchange deadline when that comes first.
    #[inline]
    pub fn read_wait(
        &self,
        now: Instant,
        idle_timeout: Duration,
        read_timeout: Duration,
    ) -> (Instant, TimeoutKind) {
        phase_wait(
            self.phase == Phase::Idle,
            now,
            self.idle_timeout.unwrap_or(idle_timeout),
            read_timeout,
            self.exchange,
        )
    }

    /// Input arrived: an automatic phase moves from idle to receiving. True if it moved (an exchange began;
    /// its input rate is judged once it waits for more, see `TransferRates`).
    #[inline]
    pub fn input_arrived(&mut self) -> bool {
        if self.phase == Phase::Idle && self.phase_override.is_none() {
            self.phase = Phase::Receiving;
            return true;
        }
        false
    }

    /// Every queued byte went out: with no input left, an automatic phase is idle again. True then (the
    /// exchange is over, so the driver stops judging the input rate), false while the input still holds
    /// part of a request or the session chose its phase itself.
    #[inline]
    pub fn output_flushed(&mut self, unread: usize) -> bool {
        if unread == 0 && self.phase_override.is_none() {
            self.phase = Phase::Idle;
            return true;
        }
        false
    }

    /// The peer's FIN was read: a read after it closes (gracefully, unless a deadline fixed another reason).
    pub fn peer_closed(&mut self) {
        self.peer_closed = true;
        self.pending = Some(CloseReason::PeerClosed);
    }

    /// The reason a read after the peer's FIN closes with.
    pub fn close_after_fin(&self) -> CloseReason {
        self.pending.unwrap_or(CloseReason::PeerClosed)
    }

    /// A deadline of `kind` passed; its reason is kept if the session's `on_timeout` then closes. A spent
    /// exchange deadline is cleared now, before the hook, so one the session sets in `on_timeout` stands.
    pub fn deadline_passed(&mut self, kind: TimeoutKind) {
        self.pending = Some(kind.close_reason());
        if kind == TimeoutKind::Exchange {
            self.exchange = None;
        }
    }

    /// The session answered a deadline with `step`: carrying on (`Read`, `Listen`, `Write`, `Park`) forgets the
    /// deadline's reason, so a later close is the session's own.
    pub fn timeout_answered(&mut self, step: Step) {
        if matches!(
            step,
            Step::Read | Step::Listen | Step::Write | Step::Park { .. }
        ) {
            self.pending = None;
        }
    }

    /// The reason the connection closes with when the session returns `Close` (after its flush) or
    /// `Abort`: a deadline's or the FIN's reason fixed before, else the session's own.
    pub fn close_reason(&self, step: Step) -> CloseReason {
        let own = match step {
            Step::Abort => CloseReason::SessionError,
            _ => CloseReason::SessionClosed,
        };
        self.pending.unwrap_or(own)
    }

    /// What to do about the half close now, with the output queue empty or not.
    pub fn half_close_due(&self, output_empty: bool) -> HalfClose {
        match self.write_shut {
            WriteShut::Requested if output_empty => HalfClose::SendFin,
            WriteShut::Sent if !output_empty => HalfClose::Refuse,
            _ => HalfClose::Nothing,
        }
    }

    /// The FIN of the half close went out.
    pub fn fin_sent(&mut self) {
        self.write_shut = WriteShut::Sent;
    }
}

/// The context of one hook: the connection, its output, the request slots the session writes to, and what
/// the driver knows about the server.
#[inline]
fn hook_context<'c>(
    info: &'c ConnectionInfo,
    output: &'c mut Output,
    requests: &'c mut SessionRequests,
    now: Instant,
    write_shut: bool,
    environment: HookEnvironment<'c>,
) -> SessionContext<'c> {
    let context = SessionContext::new(info, output, requests, now)
        .with_draining(environment.draining)
        .with_pressure_source(environment.pressure)
        .with_write_shut(write_shut);
    match environment.completer {
        Some(completer) => context.with_completer(completer),
        None => context,
    }
}

/// The deadline a wait for input starting `now` runs under, and which one it is: `idle_timeout` between
/// exchanges, `read_timeout` within one, or the `exchange` deadline when that comes first. What
/// [`SessionMachine::read_wait`] answers, for a driver that keeps its phase itself (a blocking handler's
/// connection, which has no session).
pub fn phase_wait(
    idle: bool,
    now: Instant,
    idle_timeout: Duration,
    read_timeout: Duration,
    exchange: Option<Instant>,
) -> (Instant, TimeoutKind) {
    let (timeout, kind) = if idle {
        (idle_timeout, TimeoutKind::Idle)
    } else {
        (read_timeout, TimeoutKind::Read)
    };
    let deadline = deadline_after(now, timeout);
    match exchange {
        Some(exchange) if exchange < deadline => (exchange, TimeoutKind::Exchange),
        _ => (deadline, kind),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::{ConnectionId, ListenerId};

    fn info() -> ConnectionInfo {
        ConnectionInfo::new(
            ConnectionId::new(1).expect("a nonzero id"),
            ListenerId(0),
            "127.0.0.1:7000".parse().expect("an address"),
            "127.0.0.1:50000".parse().expect("an address"),
            Instant::now(),
        )
    }

    /// A session whose every hook runs a closure over the context.
    struct Scripted<F: FnMut(&mut SessionContext<'_>) -> Step + Send + 'static>(F);

    impl<F: FnMut(&mut SessionContext<'_>) -> Step + Send + 'static> Session for Scripted<F> {
        fn on_data(
            &mut self,
            _input: &mut crate::input::Input<'_>,
            context: &mut SessionContext<'_>,
        ) -> Step {
            (self.0)(context)
        }
    }

    fn run_hook(
        machine: &mut SessionMachine,
        now: Instant,
        body: impl FnMut(&mut SessionContext<'_>) -> Step + Send + 'static,
    ) -> Option<Step> {
        let info = info();
        let mut output = Output::new(1024);
        let mut session = Scripted(body);
        machine.hook(
            &mut session,
            &info,
            &mut output,
            now,
            HookEnvironment::default(),
            |session, context| (session.0)(context),
        )
    }

    /// A small read buffer from a pool of its own, holding `bytes` unread.
    fn read_buffer(bytes: &[u8]) -> ReadBuffer {
        let pool = crate::buffer::BufferPool::new(1 << 20, false);
        let mut read = ReadBuffer::new(
            pool.worker()
                .acquire(crate::buffer::SizeClass::Small)
                .expect("a small buffer"),
        );
        assert_eq!(read.extend_from_slice(bytes), bytes.len(), "the bytes fit");
        read
    }

    const IDLE: Duration = Duration::from_secs(5);
    /// Every deadline a session hears of through `on_timeout`.
    const EVERY_DEADLINE: [TimeoutKind; 5] = [
        TimeoutKind::Idle,
        TimeoutKind::Read,
        TimeoutKind::Write,
        TimeoutKind::Exchange,
        TimeoutKind::Park,
    ];
    const READ: Duration = Duration::from_secs(2);

    #[test]
    fn the_close_reason_table_prefers_a_fixed_reason_over_the_sessions_own() {
        let mut machine = SessionMachine::new();
        assert_eq!(
            machine.close_reason(Step::Close),
            CloseReason::SessionClosed
        );
        assert_eq!(machine.close_reason(Step::Abort), CloseReason::SessionError);
        for kind in EVERY_DEADLINE {
            let mut machine = SessionMachine::new();
            machine.deadline_passed(kind);
            assert_eq!(
                machine.close_reason(Step::Close),
                kind.close_reason(),
                "a close answering the {} deadline should keep its reason",
                kind.as_str()
            );
            assert_eq!(
                machine.close_reason(Step::Abort),
                kind.close_reason(),
                "an abort answering the {} deadline should keep its reason",
                kind.as_str()
            );
            machine.timeout_answered(Step::Read);
            assert_eq!(
                machine.close_reason(Step::Close),
                CloseReason::SessionClosed,
                "carrying on past the {} deadline should forget its reason",
                kind.as_str()
            );
        }
        machine.peer_closed();
        assert_eq!(machine.close_reason(Step::Close), CloseReason::PeerClosed);
        assert_eq!(machine.close_after_fin(), CloseReason::PeerClosed);
        assert!(machine.is_peer_closed());
    }

    #[test]
    fn a_closing_answer_to_a_deadline_keeps_the_deadlines_reason() {
        for step in [Step::Close, Step::Abort] {
            let mut machine = SessionMachine::new();
            machine.deadline_passed(TimeoutKind::Park);
            machine.timeout_answered(step);
            assert_eq!(machine.close_reason(step), CloseReason::ParkDeadline);
        }
        let mut machine = SessionMachine::new();
        machine.deadline_passed(TimeoutKind::Park);
        machine.timeout_answered(Step::Park {
            until: Instant::now(),
        });
        assert_eq!(
            machine.close_reason(Step::Close),
            CloseReason::SessionClosed,
            "parking again past the park deadline carries on"
        );
    }

    #[test]
    fn the_idle_timeout_applies_between_exchanges_and_the_read_timeout_within_one() {
        let now = Instant::now();
        let mut machine = SessionMachine::new();
        assert!(machine.is_idle(0, true));
        assert_eq!(
            machine.read_wait(now, IDLE, READ),
            (now + IDLE, TimeoutKind::Idle)
        );
        assert!(machine.input_arrived(), "input should start an exchange");
        assert!(!machine.is_idle(0, true));
        assert_eq!(machine.phase(), Phase::Receiving);
        assert_eq!(
            machine.read_wait(now, IDLE, READ),
            (now + READ, TimeoutKind::Read)
        );
        assert!(
            !machine.output_flushed(3),
            "unconsumed input keeps the exchange going"
        );
        assert!(machine.output_flushed(0), "a flushed reply ends it");
        assert_eq!(machine.phase(), Phase::Idle);
        assert!(!machine.is_idle(1, true), "unread input is not idle");
        assert!(!machine.is_idle(0, false), "queued output is not idle");
    }

    #[test]
    fn a_sessions_idle_timeout_and_phase_override_the_automatic_ones() {
        let now = Instant::now();
        let mut machine = SessionMachine::new();
        run_hook(&mut machine, now, |context| {
            context.set_idle_timeout(Duration::from_secs(60));
            Step::Read
        });
        assert_eq!(
            machine.read_wait(now, IDLE, READ),
            (now + Duration::from_secs(60), TimeoutKind::Idle)
        );
        run_hook(&mut machine, now, |context| {
            context.set_phase(Phase::Sending);
            Step::Read
        });
        assert_eq!(machine.phase(), Phase::Sending);
        assert!(
            !machine.input_arrived(),
            "an overridden phase does not move on input"
        );
        assert!(!machine.output_flushed(0), "nor when the queue empties");
        assert_eq!(machine.phase(), Phase::Sending);
    }

    #[test]
    fn an_earlier_exchange_deadline_wins_and_a_new_one_set_at_its_timeout_stands() {
        let now = Instant::now();
        let mut machine = SessionMachine::new();
        let exchange = now + Duration::from_millis(500);
        run_hook(&mut machine, now, move |context| {
            context.set_exchange_deadline(Some(exchange));
            Step::Read
        });
        assert_eq!(
            machine.read_wait(now, IDLE, READ),
            (exchange, TimeoutKind::Exchange)
        );
        let later = now + Duration::from_secs(60);
        assert_eq!(
            machine.read_wait(now, Duration::from_millis(100), READ).1,
            TimeoutKind::Idle,
            "a phase deadline before the exchange deadline wins"
        );
        machine.deadline_passed(TimeoutKind::Exchange);
        assert_eq!(
            machine.exchange_deadline(),
            None,
            "a passed exchange deadline is spent"
        );
        let answer = run_hook(&mut machine, now, move |context| {
            context.set_exchange_deadline(Some(later));
            Step::Read
        });
        machine.timeout_answered(answer.expect("the hook did not panic"));
        assert_eq!(
            machine.exchange_deadline(),
            Some(later),
            "an exchange deadline set while answering the last one should stand"
        );
        run_hook(&mut machine, now, |context| {
            context.set_exchange_deadline(None);
            Step::Read
        });
        assert_eq!(machine.exchange_deadline(), None, "None clears it");
    }

    #[test]
    fn a_far_timeout_saturates_instead_of_overflowing() {
        let now = Instant::now();
        let machine = SessionMachine::new();
        let (deadline, kind) = machine.read_wait(now, Duration::MAX, READ);
        assert_eq!(kind, TimeoutKind::Idle);
        assert!(deadline > now + Duration::from_secs(100 * 365 * 24 * 3600));
    }

    #[test]
    fn a_half_close_sends_its_fin_once_the_queue_is_empty_and_refuses_bytes_after() {
        let now = Instant::now();
        let mut machine = SessionMachine::new();
        assert!(!machine.half_close_asked());
        assert_eq!(machine.half_close_due(true), HalfClose::Nothing);
        run_hook(&mut machine, now, |context| {
            context.shutdown_write();
            Step::Write
        });
        assert!(machine.half_close_asked());
        assert_eq!(
            machine.half_close_due(false),
            HalfClose::Nothing,
            "the FIN waits for the queued bytes"
        );
        assert_eq!(machine.half_close_due(true), HalfClose::SendFin);
        machine.fin_sent();
        assert!(machine.is_write_shut());
        assert_eq!(machine.half_close_due(true), HalfClose::Nothing);
        assert_eq!(
            machine.half_close_due(false),
            HalfClose::Refuse,
            "a byte queued after the FIN cannot be sent"
        );
        run_hook(&mut machine, now, |context| {
            assert!(
                context.is_write_shut(),
                "the hook should see the FIN went out"
            );
            context.shutdown_write();
            Step::Read
        });
        assert!(machine.is_write_shut(), "asking twice changes nothing");
    }

    #[test]
    fn a_panicking_hook_is_contained_and_its_requests_still_apply() {
        let now = Instant::now();
        let mut machine = SessionMachine::new();
        let answer = run_hook(&mut machine, now, |context| {
            context.set_phase(Phase::Sending);
            panic!("a session bug");
        });
        assert_eq!(answer, None, "a panic should come back as None");
        assert_eq!(machine.phase(), Phase::Sending);
        assert_eq!(
            *machine.requests(),
            SessionRequests::default(),
            "requests are cleared after every hook"
        );
    }

    #[test]
    fn the_hook_sees_the_drivers_environment() {
        let now = Instant::now();
        let mut machine = SessionMachine::new();
        let info = info();
        let mut output = Output::new(64);
        let mut session = Scripted(|_: &mut SessionContext<'_>| Step::Read);
        let seen = machine.hook(
            &mut session,
            &info,
            &mut output,
            now,
            HookEnvironment {
                draining: true,
                pressure: Pressure::Fixed(0.5),
                completer: None,
            },
            |_, context| (context.draining(), context.pressure(), context.now()),
        );
        assert_eq!(seen, Some((true, 0.5, now)));
    }

    /// A session that takes whole lines and answers each deadline with a step picked by the test.
    struct Lines {
        on_timeout: Step,
        timeouts: Vec<TimeoutKind>,
    }

    impl Session for Lines {
        fn on_data(
            &mut self,
            input: &mut crate::input::Input<'_>,
            context: &mut SessionContext<'_>,
        ) -> Step {
            let Some(end) = input.bytes().iter().position(|&byte| byte == b'\n') else {
                return Step::Read;
            };
            if end == 0 {
                panic!("an empty line is a session bug");
            }
            context.set_phase(Phase::Sending);
            input.consume(end + 1);
            Step::Write
        }

        fn on_timeout(&mut self, kind: TimeoutKind, _context: &mut SessionContext<'_>) -> Step {
            self.timeouts.push(kind);
            self.on_timeout
        }
    }

    fn lines(on_timeout: Step) -> Lines {
        Lines {
            on_timeout,
            timeouts: Vec::new(),
        }
    }

    #[test]
    fn the_data_hook_consumes_what_the_session_took_and_says_whether_input_is_left() {
        let mut read = read_buffer(b"one\ntwo\nthr");
        let (info, now) = (info(), Instant::now());
        let mut output = Output::new(1024);
        let mut machine = SessionMachine::new();
        let mut session = lines(Step::Close);
        let environment = HookEnvironment::default();
        let answer = machine.data_hook(
            &mut session,
            &mut read,
            &info,
            &mut output,
            now,
            environment,
        );
        assert_eq!(answer, Some((Step::Write, true)), "a line taken, more left");
        assert_eq!(read.input().bytes(), b"two\nthr");
        assert_eq!(
            machine.phase(),
            Phase::Sending,
            "the session's phase applies"
        );
        let answer = machine.data_hook(
            &mut session,
            &mut read,
            &info,
            &mut output,
            now,
            environment,
        );
        assert_eq!(answer, Some((Step::Write, true)));
        let answer = machine.data_hook(
            &mut session,
            &mut read,
            &info,
            &mut output,
            now,
            environment,
        );
        assert_eq!(
            answer,
            Some((Step::Read, false)),
            "a partial line is left unconsumed: nothing more to give until more arrives"
        );
        assert_eq!(read.input().bytes(), b"thr");
        read.consume(3);
        read.extend_from_slice(b"\n");
        let answer = machine.data_hook(
            &mut session,
            &mut read,
            &info,
            &mut output,
            now,
            environment,
        );
        assert_eq!(answer, None, "a panicking on_data comes back as None");
    }

    #[test]
    fn the_timeout_hook_keeps_the_reason_of_a_closing_answer_and_forgets_it_when_carrying_on() {
        let (info, now) = (info(), Instant::now());
        let mut output = Output::new(64);
        let environment = HookEnvironment::default();
        for kind in EVERY_DEADLINE {
            let mut machine = SessionMachine::new();
            let mut session = lines(Step::Close);
            let step =
                machine.timeout_hook(&mut session, kind, &info, &mut output, now, environment);
            assert_eq!(step, Some(Step::Close));
            assert_eq!(
                session.timeouts,
                vec![kind],
                "on_timeout heard of the deadline"
            );
            assert_eq!(
                machine.close_reason(Step::Close),
                kind.close_reason(),
                "closing at the {} deadline keeps its reason",
                kind.as_str()
            );
            let mut session = lines(Step::Read);
            let mut machine = SessionMachine::new();
            machine.timeout_hook(&mut session, kind, &info, &mut output, now, environment);
            assert_eq!(
                machine.close_reason(Step::Close),
                CloseReason::SessionClosed,
                "reading on past the {} deadline forgets it",
                kind.as_str()
            );
        }
    }

    #[test]
    fn a_flush_deadline_is_the_exchange_deadline_once_that_passed_and_a_close_answer_is_abortive() {
        let now = Instant::now();
        let mut machine = SessionMachine::new();
        assert_eq!(machine.flush_deadline_kind(now), TimeoutKind::Write);
        let exchange = now + Duration::from_millis(500);
        run_hook(&mut machine, now, move |context| {
            context.set_exchange_deadline(Some(exchange));
            Step::Write
        });
        assert_eq!(machine.flush_deadline_kind(now), TimeoutKind::Write);
        assert_eq!(machine.flush_deadline_kind(exchange), TimeoutKind::Exchange);
        for kind in [TimeoutKind::Write, TimeoutKind::Exchange] {
            for step in [Step::Close, Step::Abort] {
                assert_eq!(
                    SessionMachine::flush_timeout_answer(kind, step),
                    Err(kind.close_reason()),
                    "unsent output is lost, so {step:?} at the {} deadline ends with its reason",
                    kind.as_str()
                );
            }
            for step in [Step::Write, Step::Read, Step::Park { until: now }] {
                assert_eq!(SessionMachine::flush_timeout_answer(kind, step), Ok(step));
            }
        }
    }

    #[test]
    fn a_park_never_outlasts_the_park_timeout() {
        let now = Instant::now();
        let timeout = Duration::from_secs(30);
        let soon = now + Duration::from_millis(10);
        assert_eq!(SessionMachine::park_deadline(now, soon, timeout), soon);
        let far = now + Duration::from_secs(3600);
        assert_eq!(
            SessionMachine::park_deadline(now, far, timeout),
            now + timeout,
            "a session asking for an hour gets the server's 30 s"
        );
        assert_eq!(
            SessionMachine::park_deadline(now, far, Duration::MAX),
            far,
            "a timeout of Duration::MAX means never"
        );
    }

    /// A session whose denial text is `text`, or that panics in `on_denied` when `text` is empty.
    struct Denied(&'static [u8]);

    impl Session for Denied {
        fn on_data(
            &mut self,
            _input: &mut crate::input::Input<'_>,
            _context: &mut SessionContext<'_>,
        ) -> Step {
            Step::Read
        }

        fn on_denied(&mut self, code: u16, output: &mut Output) {
            assert!(
                output.is_empty(),
                "the denied queue is dropped before on_denied"
            );
            if self.0.is_empty() {
                panic!("a session bug in on_denied ({code})");
            }
            output.push(self.0).expect("room for the text");
        }
    }

    #[test]
    fn a_denial_text_goes_out_only_on_a_clean_boundary_and_within_the_limit() {
        let mut output = Output::new(1024);
        output.push(b"half a reply").expect("room");
        let text = SessionMachine::denial(
            &mut Denied(b"HTTP/1.1 403\r\n\r\n"),
            403,
            &mut output,
            true,
            512,
        );
        assert_eq!(text, Some(&b"HTTP/1.1 403\r\n\r\n"[..]));
        let text = SessionMachine::denial(&mut Denied(b"0123456789"), 403, &mut output, true, 4);
        assert_eq!(text, Some(&b"0123"[..]), "cut to the refusal limit");
        let text = SessionMachine::denial(&mut Denied(b"late"), 403, &mut output, false, 512);
        assert_eq!(
            text, None,
            "after part of a response, no text: the close is an RST"
        );
        let text = SessionMachine::denial(&mut Denied(b""), 403, &mut output, true, 512);
        assert_eq!(
            text, None,
            "a panicking on_denied is contained and sends nothing"
        );
    }

    /// A load source that counts how often it is asked.
    struct Counting(std::sync::atomic::AtomicUsize);

    impl crate::session::LoadSource for Counting {
        fn pressure(&self) -> f32 {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            0.25
        }
    }

    #[test]
    fn the_load_is_worked_out_only_when_a_session_asks_and_on_data_sees_the_environment() {
        let source = Counting(std::sync::atomic::AtomicUsize::new(0));
        let environment = HookEnvironment {
            draining: true,
            pressure: Pressure::Source(&source),
            completer: None,
        };
        let (info, now) = (info(), Instant::now());
        let mut output = Output::new(64);
        let mut machine = SessionMachine::new();
        let mut session = Scripted(|_: &mut SessionContext<'_>| Step::Read);
        machine.hook(
            &mut session,
            &info,
            &mut output,
            now,
            environment,
            |_, _| (),
        );
        assert_eq!(
            source.0.load(std::sync::atomic::Ordering::Relaxed),
            0,
            "a hook that never reads the load must not work it out"
        );
        let mut read = read_buffer(b"x");
        let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
        let record = std::sync::Arc::clone(&seen);
        let mut session = Scripted(move |context: &mut SessionContext<'_>| {
            *record.lock().expect("not poisoned") = Some((context.draining(), context.pressure()));
            Step::Read
        });
        machine.data_hook(
            &mut session,
            &mut read,
            &info,
            &mut output,
            now,
            environment,
        );
        assert_eq!(
            *seen.lock().expect("not poisoned"),
            Some((true, 0.25)),
            "on_data sees the drain and the load like every other hook"
        );
        assert_eq!(source.0.load(std::sync::atomic::Ordering::Relaxed), 1);
    }
}
