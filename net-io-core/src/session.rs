//! The sans-IO [`Session`]: the driver does every read, write, timer and limit; the session answers with a [`Step`].
//!
//! ```text
//!   driver ──on_open──────────▶ session ──Step──▶ driver
//!   recv ───on_data(Input)────▶ session ──Step──▶ Read: recv again / Write: flush Output, then on_writable
//!   wake ───on_wake(token,v)──▶ session          Park{until}: stop reading until a post or `until`
//!                                               Listen: read, or on_wake at a post, whichever is first
//!   timer ──on_timeout(kind)──▶ session          Close: flush, FIN, linger / Abort: RST
//!   close ──on_close(info, reason), exactly once
//! ```
//!
//! Every hook gets a [`SessionContext`] with the connection facts, the output queue, the time, and setters
//! for the exchange deadline, the phase and the idle timeout, and the half close.
//!
//! # Half close
//!
//! [`SessionContext::shutdown_write`] sends FIN while the session keeps reading, as
//! `TcpConnection::shutdown_write` does for a blocking handler. It is a request rather than a [`Step`]
//! because it is not a way to wait: the session still says how it goes on (`Read` for the peer's reply,
//! `Write` to flush first, `Close`), and the drivers apply the request the way they apply the deadline
//! setters, after the hook returns. The rules, the same on every driver:
//!
//! - The FIN goes after every byte queued before it: at once when the queue is empty after the hook, else
//!   when the flush of the next `Step::Write` (or `Close`) has emptied it, before `on_writable` runs.
//!   `Step::Read` does not flush, so a session that queued bytes and wants the FIN soon returns `Write`.
//! - Reading goes on under the usual deadlines (idle between exchanges, read once a request started, the
//!   exchange deadline, the minimum rate) until the peer's FIN, a deadline, a kill or a drain closes it.
//!   The close after the peer's FIN is `PeerClosed` (graceful), as for a blocking handler that half
//!   closed and then read the end of the stream.
//! - A byte queued once the FIN went out ([`SessionContext::is_write_shut`] is then true) cannot be sent:
//!   the driver closes the connection with `SessionError` (abortive) at the end of that hook rather than
//!   drop the bytes silently. A blocking handler's `write_all` after `shutdown_write` fails the same way.
//! - Asking twice changes nothing; a kill, a drain or an abort while half closed closes as it would
//!   otherwise.

use std::time::{Duration, Instant};

use crate::close::{CloseReason, TimeoutKind};
use crate::completion::Completer;
use crate::id::WorkerId;
use crate::info::ConnectionInfo;
use crate::input::Input;
use crate::output::Output;

/// What the session wants the driver to do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Read more input. Does not flush queued output (return `Write` for that).
    Read,
    /// Read more input, and also end the wait when a completion is posted for this connection
    /// ([`Session::on_wake`]), whichever comes first: for a full-duplex connection whose other side may
    /// need it at any time (a link that relays frames it is handed from another connection). The read
    /// deadlines apply as for `Read`; a completion posted while the session runs is delivered at its next
    /// `Listen` (or `Park`).
    Listen,
    /// Flush queued output, then call `on_writable`.
    Write,
    /// Stop reading (and the idle timer) until a completion is posted or `until` passes.
    Park {
        /// The park deadline; the driver also caps it at `park_timeout`.
        until: Instant,
    },
    /// Flush queued output, send FIN, linger, close (`SessionClosed`).
    Close,
    /// Reset the connection at once (`SessionError`).
    Abort,
}

/// Which deadline applies while the connection waits for the peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Between requests: the idle timeout applies.
    #[default]
    Idle,
    /// A request is arriving: the read timeout applies.
    Receiving,
    /// A reply is going out: the write timeout applies.
    Sending,
}

/// What a session asked of the driver during one hook; the driver reads and clears it after each hook.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SessionRequests {
    /// `Some(Some(t))` sets the exchange deadline to `t`, `Some(None)` clears it.
    pub exchange_deadline: Option<Option<Instant>>,
    /// A phase to switch to, overriding the automatic phase.
    pub phase: Option<Phase>,
    /// A per-connection idle timeout.
    pub idle_timeout: Option<Duration>,
    /// Send FIN once every queued byte is out (see the module doc's half close).
    pub shutdown_write: bool,
}

/// Something that can work out the load figure [`SessionContext::pressure`] reports: the driver's shared
/// server state. A context holding one asks it only when the session does, so a hook that never looks at the
/// load costs nothing for it.
pub trait LoadSource: Sync {
    /// The load now, 0.0 to 1.0.
    fn pressure(&self) -> f32;
}

/// Where a context's load figure comes from.
#[derive(Clone, Copy)]
pub enum Pressure<'a> {
    /// This figure.
    Fixed(f32),
    /// Worked out by this source when asked.
    Source(&'a dyn LoadSource),
}

impl Pressure<'_> {
    /// The figure now.
    pub fn value(&self) -> f32 {
        match self {
            Pressure::Fixed(pressure) => *pressure,
            Pressure::Source(source) => source.pressure(),
        }
    }
}

impl Default for Pressure<'_> {
    fn default() -> Self {
        Pressure::Fixed(0.0)
    }
}

impl std::fmt::Debug for Pressure<'_> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pressure::Fixed(pressure) => formatter.debug_tuple("Fixed").field(pressure).finish(),
            Pressure::Source(_) => formatter.write_str("Source(..)"),
        }
    }
}

/// What a session sees and can ask for during a hook. Made by the driver for each hook call.
#[derive(Debug)]
pub struct SessionContext<'a> {
    info: &'a ConnectionInfo,
    output: &'a mut Output,
    requests: &'a mut SessionRequests,
    now: Instant,
    worker: Option<WorkerId>,
    draining: bool,
    pressure: Pressure<'a>,
    completer: Option<&'a Completer>,
    write_shut: bool,
}

/// A sans-IO connection handler. Only [`Session::on_data`] is required.
///
/// The driver contains panics: a panicking hook closes only this connection, with `SessionPanicked`.
pub trait Session: Send + 'static {
    /// The connection was admitted. Default: read.
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        let _ = context;
        Step::Read
    }

    /// New input arrived. Consume what you used; unconsumed bytes stay for the next call.
    /// After `Step::Read` this is called again at once only if the input changed.
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step;

    /// Every queued byte was written. Default: read.
    fn on_writable(&mut self, context: &mut SessionContext<'_>) -> Step {
        let _ = context;
        Step::Read
    }

    /// A completion posted for this connection arrived while parked. Default: abort, since a session that
    /// parks without handling wake-ups is a bug.
    fn on_wake(&mut self, token: u64, value: u64, context: &mut SessionContext<'_>) -> Step {
        let _ = (token, value, context);
        Step::Abort
    }

    /// A deadline fired. `Close` or `Abort` keep the deadline's own close reason. Default: close.
    fn on_timeout(&mut self, kind: TimeoutKind, context: &mut SessionContext<'_>) -> Step {
        let _ = (kind, context);
        Step::Close
    }

    /// The peer sent FIN. The session may keep writing (half close). Default: close.
    fn on_peer_closed(&mut self, context: &mut SessionContext<'_>) -> Step {
        let _ = context;
        Step::Close
    }

    /// The gate denied a write with `code`. Pending output was wiped; anything queued here is the denial
    /// text, sent only if no byte of the current response went out yet. Default: nothing.
    fn on_denied(&mut self, code: u16, output: &mut Output) {
        let _ = (code, output);
    }

    /// The connection closed, exactly once, with its one reason.
    fn on_close(&mut self, info: &ConnectionInfo, reason: CloseReason) {
        let _ = (info, reason);
    }
}

/// Makes one session per admitted connection. `None` refuses the connection (`Refused(Session)`).
pub trait SessionFactory: Send + Sync + 'static {
    /// The session type.
    type Session: Session;

    /// A session for a new connection.
    fn create(&self, info: &ConnectionInfo) -> Option<Self::Session>;
}

impl<F, S> SessionFactory for F
where
    F: Fn(&ConnectionInfo) -> Option<S> + Send + Sync + 'static,
    S: Session,
{
    type Session = S;

    fn create(&self, info: &ConnectionInfo) -> Option<S> {
        self(info)
    }
}

impl<'a> SessionContext<'a> {
    /// A context for one hook call. Drivers make one; sessions only use it.
    pub fn new(
        info: &'a ConnectionInfo,
        output: &'a mut Output,
        requests: &'a mut SessionRequests,
        now: Instant,
    ) -> SessionContext<'a> {
        SessionContext {
            info,
            output,
            requests,
            now,
            worker: info.worker,
            draining: false,
            pressure: Pressure::Fixed(0.0),
            completer: None,
            write_shut: false,
        }
    }

    /// Sets whether the server is draining.
    pub fn with_draining(mut self, draining: bool) -> SessionContext<'a> {
        self.draining = draining;
        self
    }

    /// Sets the load figure (share of busy workers, 1.0 under shed).
    pub fn with_pressure(mut self, pressure: f32) -> SessionContext<'a> {
        self.pressure = Pressure::Fixed(pressure);
        self
    }

    /// Sets where the load figure comes from (worked out only if the session asks).
    pub fn with_pressure_source(mut self, pressure: Pressure<'a>) -> SessionContext<'a> {
        self.pressure = pressure;
        self
    }

    /// Gives the session a completer for offloaded work.
    pub fn with_completer(mut self, completer: &'a Completer) -> SessionContext<'a> {
        self.completer = Some(completer);
        self
    }

    /// Sets whether the FIN of a half close went out already.
    pub fn with_write_shut(mut self, write_shut: bool) -> SessionContext<'a> {
        self.write_shut = write_shut;
        self
    }

    /// The connection's facts.
    pub fn info(&self) -> &ConnectionInfo {
        self.info
    }

    /// The output queue.
    pub fn output(&mut self) -> &mut Output {
        self.output
    }

    /// The time the hook was called (from the server's clock).
    pub fn now(&self) -> Instant {
        self.now
    }

    /// The worker serving this connection.
    pub fn worker(&self) -> Option<WorkerId> {
        self.worker
    }

    /// True while the server drains: finish the current exchange and close.
    pub fn draining(&self) -> bool {
        self.draining
    }

    /// The share of busy workers, 0.0 to 1.0 (1.0 while shedding).
    pub fn pressure(&self) -> f32 {
        self.pressure.value()
    }

    /// A handle that posts completions to this connection from another thread, if the driver offers one.
    pub fn completer(&self) -> Option<Completer> {
        self.completer.cloned()
    }

    /// Sets a deadline for the whole exchange (`ExchangeDeadline` when it passes), or clears it with `None`.
    pub fn set_exchange_deadline(&mut self, deadline: Option<Instant>) {
        self.requests.exchange_deadline = Some(deadline);
    }

    /// Overrides the automatic phase.
    pub fn set_phase(&mut self, phase: Phase) {
        self.requests.phase = Some(phase);
    }

    /// Sets this connection's idle timeout.
    pub fn set_idle_timeout(&mut self, timeout: Duration) {
        self.requests.idle_timeout = Some(timeout);
    }

    /// Half close: send FIN once every byte queued so far is out, and keep reading. The peer sees the end
    /// of our stream; its own bytes keep arriving until it closes. See the module doc for the rules.
    pub fn shutdown_write(&mut self) {
        self.requests.shutdown_write = true;
    }

    /// True once the FIN of a half close went out: nothing queued now can be sent, and queueing a byte
    /// closes the connection with `SessionError`.
    pub fn is_write_shut(&self) -> bool {
        self.write_shut
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

    #[test]
    fn a_half_close_is_a_request_the_driver_reads_after_the_hook() {
        let info = info();
        let mut output = Output::new(1024);
        let mut requests = SessionRequests::default();
        let mut context = SessionContext::new(&info, &mut output, &mut requests, Instant::now());
        assert!(
            !context.is_write_shut(),
            "a new context should not say the write side is shut"
        );
        context.shutdown_write();
        assert!(
            !context.is_write_shut(),
            "asking for a half close does not shut the write side until the driver sends the FIN"
        );
        assert!(
            requests.shutdown_write,
            "the half close should reach the driver as a request"
        );
    }

    #[test]
    fn the_driver_tells_the_session_once_the_fin_went_out() {
        let info = info();
        let mut output = Output::new(1024);
        let mut requests = SessionRequests::default();
        let context = SessionContext::new(&info, &mut output, &mut requests, Instant::now())
            .with_write_shut(true);
        assert!(
            context.is_write_shut(),
            "a context made after the FIN should say the write side is shut"
        );
    }
}
