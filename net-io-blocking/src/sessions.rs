//! The two workloads a worker runs: a blocking handler over a [`TcpConnection`], and the sans-IO session
//! driver that performs every read, write, timer and limit for a [`Session`].

use std::any::{Any, TypeId};
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use net_io_core::{
    BufferPool, CloseReason, ConnectionInfo, Direction, Event, HalfClose, HookEnvironment,
    LimitKind, NetError, Output, ReadBuffer, Session, SessionContext, SessionFactory,
    SessionMachine, SizeClass, Step, TimeoutKind, WorkerBuffers,
};

use crate::codes::reason_for_code;
use crate::connection::TcpConnection;
use crate::link::{Listened, Received, Sent};
use crate::runtime::{Run, Workload};
use crate::shared::Core;

/// A blocking handler: one call per connection.
pub(crate) struct HandlerWorkload<H> {
    pub(crate) handler: H,
}

/// A session factory and its driver.
pub(crate) struct SessionWorkload<F> {
    pub(crate) factory: F,
}

/// A worker's reusable session state.
pub(crate) struct SessionState<S> {
    buffers: WorkerBuffers,
    read: Option<ReadBuffer>,
    output: Output,
    session: Option<S>,
}

impl<H> Workload for HandlerWorkload<H>
where
    H: Fn(&mut TcpConnection<'_>) -> Result<(), NetError> + Send + Sync + 'static,
{
    type State = ();

    fn new_state(&self, _core: &Core, _pool: &BufferPool) {}

    fn serve(&self, _state: &mut (), run: Run<'_>) -> CloseReason {
        let Run {
            link,
            info,
            core,
            limits,
            check,
            kill,
            prefix,
            ..
        } = run;
        let mut connection = TcpConnection::served(link, *info, core, limits, check, kill, prefix);
        match catch_unwind(AssertUnwindSafe(|| (self.handler)(&mut connection))) {
            Ok(result) => connection.final_reason(&result),
            Err(_) => {
                core.emit(Event::SessionPanicked { id: info.id });
                CloseReason::SessionPanicked
            }
        }
    }

    fn closed(&self, _state: &mut (), _info: &ConnectionInfo, _reason: CloseReason) {}
}

impl<F: SessionFactory> Workload for SessionWorkload<F> {
    type State = SessionState<F::Session>;

    fn new_state(&self, core: &Core, pool: &BufferPool) -> Self::State {
        SessionState {
            buffers: pool.worker(),
            read: None,
            output: Output::new(core.limits.output_budget),
            session: None,
        }
    }

    fn serve(&self, state: &mut Self::State, run: Run<'_>) -> CloseReason {
        let info = *run.info;
        let limits_read_buffer = run.limits.read_buffer;
        // An outbound connection brought its session along (`adopt`); the factory makes the others.
        let adopted = state.session.take();
        let created = match adopted {
            Some(session) => Ok(Some(session)),
            None => catch_unwind(AssertUnwindSafe(|| self.factory.create(&info))),
        };
        let session = match created {
            Ok(Some(session)) => session,
            Ok(None) => {
                // The factory refused an admitted connection: a refusal in the figures, and one close.
                let cause = net_io_core::RefusalCause::Session;
                crate::handshake::count_refusal(run.core, &info, cause);
                return CloseReason::Refused(cause);
            }
            Err(_) => {
                run.core.emit(Event::SessionPanicked { id: info.id });
                return CloseReason::SessionPanicked;
            }
        };
        state.session = Some(session);
        state.output.reset(run.limits.output_budget);
        if state.read.is_none() {
            let class = SizeClass::for_size(run.limits.read_buffer).unwrap_or(SizeClass::Large);
            match state.buffers.acquire(class) {
                Ok(buffer) => state.read = Some(ReadBuffer::new(buffer)),
                Err(_) => return CloseReason::Limit(LimitKind::BufferBudget),
            }
        }
        let SessionState {
            buffers,
            read,
            output,
            session,
        } = state;
        let (Some(read), Some(session)) = (read.as_mut(), session.as_mut()) else {
            return CloseReason::SessionError;
        };
        read.clear();
        if !run.prefix.is_empty() && read.extend_from_slice(run.prefix) < run.prefix.len() {
            return CloseReason::Limit(LimitKind::ReadBuffer);
        }
        let reason = Driver {
            run,
            read,
            output,
            buffers,
            machine: SessionMachine::new(),
            _session: PhantomData,
        }
        .drive(session);
        // A grown read buffer goes back to the pool; the next connection starts with the usual class.
        let usual = SizeClass::for_size(limits_read_buffer).unwrap_or(SizeClass::Large);
        if state
            .read
            .as_ref()
            .is_some_and(|read| read.class() != usual)
            && let Some(grown) = state.read.take()
        {
            state.buffers.release(grown.into_buffer());
        }
        reason
    }

    fn closed(&self, state: &mut Self::State, info: &ConnectionInfo, reason: CloseReason) {
        if let Some(session) = state.session.take() {
            close_session(session, info, reason);
        }
        state.output.clear();
        if let Some(read) = state.read.as_mut() {
            read.clear();
        }
    }

    fn outbound_session(&self) -> Option<(TypeId, &'static str)> {
        Some((
            TypeId::of::<F::Session>(),
            std::any::type_name::<F::Session>(),
        ))
    }

    fn adopt(&self, state: &mut Self::State, session: Box<dyn Any + Send>) {
        state.session = downcast_session::<F::Session>(session);
    }

    fn abandon(&self, session: Box<dyn Any + Send>, info: &ConnectionInfo, reason: CloseReason) {
        if let Some(session) = downcast_session::<F::Session>(session) {
            close_session(session, info, reason);
        }
    }
}

/// The one `on_close` of a session, then its drop, each contained.
fn close_session<S: Session>(mut session: S, info: &ConnectionInfo, reason: CloseReason) {
    let _ = catch_unwind(AssertUnwindSafe(|| session.on_close(info, reason)));
    let _ = catch_unwind(AssertUnwindSafe(move || drop(session)));
}

/// An outbound session back from the type-erased job; the type was checked when the job was made.
pub(crate) fn downcast_session<S: Session>(session: Box<dyn Any + Send>) -> Option<S> {
    session.downcast::<S>().ok().map(|session| *session)
}

/// How a flush ended when it did not close the connection.
enum Flushed {
    /// Every queued byte went out.
    Done,
    /// A write or exchange deadline passed and the session chose to carry on with this step.
    TimedOut(Step),
}

/// The state of one session run.
struct Driver<'r, 'a, S> {
    run: Run<'a>,
    read: &'r mut ReadBuffer,
    output: &'r mut Output,
    buffers: &'r mut WorkerBuffers,
    /// The session policy shared with the event loop: phase, deadlines, the reason fixed, the half close.
    machine: SessionMachine,
    _session: PhantomData<S>,
}

impl<'a, S: Session> Driver<'_, 'a, S> {
    fn drive(mut self, session: &mut S) -> CloseReason {
        let Some(mut step) = self.hook(session, |session, context| session.on_open(context)) else {
            return self.panicked();
        };
        let mut input_changed = self.read.unread_len() > 0;
        loop {
            // Every step the session returns passes here, so a half close asked for in any hook is applied
            // (or bytes queued after it refused) before the driver acts on the step. An abort discards the
            // queue and keeps its own reason.
            if step != Step::Abort
                && let Err(reason) = self.half_close()
            {
                return reason;
            }
            step = match step {
                Step::Read | Step::Listen => {
                    if input_changed {
                        input_changed = false;
                        match self.on_data(session, &mut input_changed) {
                            Some(next) => next,
                            None => return self.panicked(),
                        }
                    } else {
                        let listening = step == Step::Listen;
                        match self.receive(session, &mut input_changed, listening) {
                            Ok(next) => next,
                            Err(reason) => return reason,
                        }
                    }
                }
                Step::Write => match self.flush(session) {
                    Ok(Flushed::Done) => {
                        match self.hook(session, |session, context| session.on_writable(context)) {
                            Some(next) => next,
                            None => return self.panicked(),
                        }
                    }
                    Ok(Flushed::TimedOut(next)) => next,
                    Err(reason) => return reason,
                },
                Step::Park { until } => match self.park(session, until) {
                    Ok(next) => next,
                    Err(reason) => return reason,
                },
                Step::Close => match self.flush(session) {
                    Ok(Flushed::Done) => return self.machine.close_reason(Step::Close),
                    // The session carried on past a write deadline: its step runs next.
                    Ok(Flushed::TimedOut(next)) => next,
                    Err(reason) => return reason,
                },
                Step::Abort => return self.machine.close_reason(Step::Abort),
            };
        }
    }

    /// Sends the FIN of a half close once the queue is empty; refuses bytes queued after it.
    fn half_close(&mut self) -> Result<(), CloseReason> {
        match self.machine.half_close_due(self.output.is_empty()) {
            HalfClose::Nothing => Ok(()),
            HalfClose::Refuse => Err(CloseReason::SessionError),
            HalfClose::SendFin => match self.run.link.shutdown_write() {
                Ok(()) => {
                    self.machine.fin_sent();
                    Ok(())
                }
                Err(error) => Err(match self.run.link.owner().closing() {
                    Some(code) => reason_for_code(code),
                    None => CloseReason::from_io(&error),
                }),
            },
        }
    }

    fn panicked(&self) -> CloseReason {
        self.run.core.emit(Event::SessionPanicked {
            id: self.run.info.id,
        });
        CloseReason::SessionPanicked
    }

    /// Calls a hook under `catch_unwind` with a fresh context, then applies what the session asked for.
    fn hook<T>(
        &mut self,
        session: &mut S,
        call: impl FnOnce(&mut S, &mut SessionContext<'_>) -> T,
    ) -> Option<T> {
        let environment = self.environment();
        self.machine.hook(
            session,
            self.run.info,
            self.output,
            self.run.core.now(),
            environment,
            call,
        )
    }

    /// What a hook's context tells the session about the server now.
    fn environment(&self) -> HookEnvironment<'a> {
        self.run.core.hook_environment(self.run.completer)
    }

    fn on_data(&mut self, session: &mut S, input_changed: &mut bool) -> Option<Step> {
        let environment = self.environment();
        let (step, more) = self.machine.data_hook(
            session,
            self.read,
            self.run.info,
            self.output,
            self.run.core.now(),
            environment,
        )?;
        *input_changed = more;
        Some(step)
    }

    /// Asks the session's `on_timeout` about a deadline of `kind` that passed.
    fn timeout(&mut self, session: &mut S, kind: TimeoutKind) -> Result<Step, CloseReason> {
        let environment = self.environment();
        self.machine
            .timeout_hook(
                session,
                kind,
                self.run.info,
                self.output,
                self.run.core.now(),
                environment,
            )
            .ok_or_else(|| self.panicked())
    }

    /// Receives more input under the deadline of the phase; returns the session's next step.
    ///
    /// `listening` (the session returned `Step::Listen`): a completion posted before input comes ends the
    /// wait too, with `on_wake`.
    fn receive(
        &mut self,
        session: &mut S,
        input_changed: &mut bool,
        listening: bool,
    ) -> Result<Step, CloseReason> {
        if self.machine.is_peer_closed() {
            return Err(self.machine.close_after_fin());
        }
        if listening && let Some(completion) = self.run.receiver.pop() {
            return self
                .hook(session, |session, context| {
                    session.on_wake(completion.token, completion.value, context)
                })
                .ok_or_else(|| self.panicked());
        }
        if self.read.is_full() {
            self.grow()?;
        }
        let core = self.run.core;
        let limits = self.run.limits;
        let idle = self
            .machine
            .is_idle(self.read.unread_len(), self.output.is_empty());
        if idle && let Some(reason) = core.close_when_idle(self.run.info.lane) {
            return Err(reason);
        }
        let now = core.now();
        let (deadline, deadline_kind) =
            self.machine
                .read_wait(now, limits.idle_timeout, limits.read_timeout);
        let link = &mut *self.run.link;
        if idle {
            link.owner().set_idle(true);
            link.input_idle();
        } else {
            link.awaiting_input(now);
        }
        let mut woken = None;
        let received = if listening {
            // Wait for input or a post; only input (or its end) goes on to the `recv`.
            loop {
                match link.wait_input_or_wake(deadline) {
                    Ok(Listened::Input) => {
                        break link.receive(self.read.spare_mut(), Some(deadline), now);
                    }
                    Ok(Listened::Deadline) => break Received::Deadline,
                    Ok(Listened::Woken) => {
                        if let Some(code) = link.owner().closing() {
                            break Received::Killed(code);
                        }
                        if let Some(completion) = self.run.receiver.pop() {
                            woken = Some(completion);
                            break Received::Deadline;
                        }
                    }
                    Err(error) => break Received::Failed(error),
                }
            }
        } else {
            link.receive(self.read.spare_mut(), Some(deadline), now)
        };
        if idle {
            link.owner().set_idle(false);
        }
        if let Some(completion) = woken {
            return self
                .hook(session, |session, context| {
                    session.on_wake(completion.token, completion.value, context)
                })
                .ok_or_else(|| self.panicked());
        }
        match received {
            Received::Data(count) => {
                self.read.commit(count);
                self.machine.input_arrived();
                self.on_data(session, input_changed)
                    .ok_or_else(|| self.panicked())
            }
            Received::Eof => {
                self.machine.peer_closed();
                self.hook(session, |session, context| session.on_peer_closed(context))
                    .ok_or_else(|| self.panicked())
            }
            // Carrying on, the deadline starts again from now.
            Received::Deadline => self.timeout(session, deadline_kind),
            Received::Slow => Err(CloseReason::SlowPeer {
                direction: Direction::In,
            }),
            Received::Killed(code) => Err(reason_for_code(code)),
            Received::Failed(error) => Err(CloseReason::from_io(&error)),
        }
    }

    /// Moves the input to the next larger buffer class, or fails with `Limit(ReadBuffer)`.
    fn grow(&mut self) -> Result<(), CloseReason> {
        let buffers = &mut *self.buffers;
        match self
            .read
            .grow_class(self.run.limits.read_buffer_max, |class| {
                buffers.acquire(class)
            }) {
            Ok(old) => {
                self.buffers.release(old);
                Ok(())
            }
            Err((reason, unused)) => {
                if let Some(unused) = unused {
                    self.buffers.release(unused);
                }
                Err(reason)
            }
        }
    }

    /// Flushes the output under the write deadline, asking the gate before each write call.
    ///
    /// At a write or exchange deadline the session's `on_timeout` decides: `Close` or `Abort` end the
    /// connection with the deadline's own (abortive) reason, any other step carries on with a fresh deadline.
    fn flush(&mut self, session: &mut S) -> Result<Flushed, CloseReason> {
        if self.output.is_empty() {
            return Ok(Flushed::Done);
        }
        let core = self.run.core;
        let link = &mut *self.run.link;
        let started = self.output.response_started();
        let sent = link.flush(
            self.output,
            self.run.limits.write_timeout,
            self.machine.exchange_deadline(),
            &mut *self.run.check,
            core.now(),
        );
        match sent {
            Sent::Done => {
                if self.machine.output_flushed(self.read.unread_len()) {
                    self.run.link.input_idle();
                }
                // A half close waiting for this flush sends its FIN before `on_writable` runs.
                self.half_close()?;
                Ok(Flushed::Done)
            }
            Sent::Deadline => {
                let kind = self.machine.flush_deadline_kind(core.now());
                // A spent exchange deadline is cleared; a new one the session sets in `on_timeout` stands.
                let step = self.timeout(session, kind)?;
                SessionMachine::flush_timeout_answer(kind, step).map(Flushed::TimedOut)
            }
            Sent::Slow => Err(CloseReason::SlowPeer {
                direction: Direction::Out,
            }),
            Sent::Killed(code) => Err(reason_for_code(code)),
            Sent::Denied(code) => {
                // Denial text only on a clean response boundary; otherwise the close is an RST anyway.
                let clean = !started && !self.output.response_started();
                let limit = self.run.limits.refusal_bytes_max;
                if let Some(text) = SessionMachine::denial(session, code, self.output, clean, limit)
                {
                    let _ = self.run.link.send_once(text);
                }
                self.output.clear();
                Err(CloseReason::EgressDenied(code))
            }
            Sent::Failed(error) => Err(CloseReason::from_io(&error)),
        }
    }

    /// Waits for a completion, a kill or the park deadline.
    fn park(&mut self, session: &mut S, until: Instant) -> Result<Step, CloseReason> {
        let core = self.run.core;
        let until = SessionMachine::park_deadline(core.now(), until, self.run.limits.park_timeout);
        self.run.link.input_idle();
        loop {
            if let Some(completion) = self.run.receiver.pop() {
                return self
                    .hook(session, |session, context| {
                        session.on_wake(completion.token, completion.value, context)
                    })
                    .ok_or_else(|| self.panicked());
            }
            if let Some(code) = self.run.link.owner().closing() {
                return Err(reason_for_code(code));
            }
            if core.now() >= until {
                return self.timeout(session, TimeoutKind::Park);
            }
            if let Err(error) = self.run.link.park(until) {
                return Err(CloseReason::from_io(&error));
            }
        }
    }
}
