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
//! ```
//!
//! What stays in the drivers, because it is IO: reading and writing, the minimum-rate windows, the read
//! buffer's growth, the park wait itself, the linger of a graceful close and the kill slot.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use crate::clock::deadline_after;
use crate::close::{CloseReason, TimeoutKind};
use crate::completion::Completer;
use crate::info::ConnectionInfo;
use crate::output::Output;
use crate::session::{Phase, Session, SessionContext, SessionRequests, Step};

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
    /// The load figure ([`SessionContext::pressure`]).
    pub pressure: f32,
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

    /// The request slots a [`SessionContext`] writes to; for drivers that build a context themselves
    /// (`on_data` borrows the input as well). Call [`SessionMachine::apply_requests`] after the hook.
    pub fn requests(&mut self) -> &mut SessionRequests {
        &mut self.requests
    }

    /// Applies and clears what the session asked for during a hook.
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
        let mut context = SessionContext::new(info, output, &mut self.requests, now)
            .with_draining(environment.draining)
            .with_pressure(environment.pressure)
            .with_write_shut(write_shut);
        if let Some(completer) = environment.completer {
            context = context.with_completer(completer);
        }
        let result = catch_unwind(AssertUnwindSafe(|| call(session, &mut context))).ok();
        self.apply_requests();
        result
    }

    /// Whether the connection is between exchanges: the idle timeout applies, and a drain or a shed may
    /// close it now. `unread` is the input the session left unconsumed.
    pub fn is_idle(&self, unread: usize, output_empty: bool) -> bool {
        self.phase == Phase::Idle && unread == 0 && output_empty
    }

    /// The deadline a wait for input starting `now` runs under, and which deadline it is: the idle timeout
    /// (the session's own if it set one) between exchanges, the read timeout once a request started, or the
    /// exchange deadline when that comes first.
    pub fn read_wait(
        &self,
        now: Instant,
        idle_timeout: Duration,
        read_timeout: Duration,
    ) -> (Instant, TimeoutKind) {
        let (timeout, kind) = if self.phase == Phase::Idle {
            (self.idle_timeout.unwrap_or(idle_timeout), TimeoutKind::Idle)
        } else {
            (read_timeout, TimeoutKind::Read)
        };
        let deadline = deadline_after(now, timeout);
        match self.exchange {
            Some(exchange) if exchange < deadline => (exchange, TimeoutKind::Exchange),
            _ => (deadline, kind),
        }
    }

    /// Input arrived: an automatic phase moves from idle to receiving. True if it moved (the driver then
    /// starts judging the input rate).
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

    const IDLE: Duration = Duration::from_secs(5);
    const READ: Duration = Duration::from_secs(2);

    #[test]
    fn the_close_reason_table_prefers_a_fixed_reason_over_the_sessions_own() {
        let mut machine = SessionMachine::new();
        assert_eq!(
            machine.close_reason(Step::Close),
            CloseReason::SessionClosed
        );
        assert_eq!(machine.close_reason(Step::Abort), CloseReason::SessionError);
        for kind in [
            TimeoutKind::Idle,
            TimeoutKind::Read,
            TimeoutKind::Write,
            TimeoutKind::Exchange,
            TimeoutKind::Park,
        ] {
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
                pressure: 0.5,
                completer: None,
            },
            |_, context| (context.draining(), context.pressure(), context.now()),
        );
        assert_eq!(seen, Some((true, 0.5, now)));
    }
}
