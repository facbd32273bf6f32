//! One connection's turn: acting on the session's `Step` (read, write, park) and calling its hooks under panic containment.

use super::*;

impl<G: Gate, F: SessionFactory> EventLoop<'_, G, F> {
    pub(super) fn on_event(&mut self, token: u64, readiness: Interest) {
        let (index, generation) = split_token(token);
        let Some(entry) = self.entries.get_mut(index as usize) else {
            return;
        };
        if entry.generation != generation {
            return;
        }
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        if readiness.intersects(
            Interest::READABLE | Interest::READ_CLOSED | Interest::HANG_UP | Interest::ERROR,
        ) {
            conn.readable = true;
        }
        if readiness.intersects(Interest::READ_CLOSED | Interest::HANG_UP | Interest::ERROR) {
            conn.read_closed = true;
        }
        if readiness.intersects(Interest::WRITABLE | Interest::HANG_UP | Interest::ERROR) {
            conn.writable = true;
        }
        self.resume(index);
    }

    /// Continues a connection after readiness changed.
    pub(super) fn resume(&mut self, index: u32) {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        if let Wait::Linger { .. } = conn.wait {
            return self.linger_read(index);
        }
        if let Some(code) = entry.owner.closing() {
            return self.close(index, reason_for_code(code));
        }
        match conn.wait {
            Wait::Connect { .. } if conn.writable => self.connected(index),
            Wait::Handshake { .. } if conn.readable => self.handshake(index),
            Wait::Read { .. } if conn.readable => self.drive(index, Step::Read),
            Wait::Flush { then_close, .. } if conn.writable => {
                let step = if then_close { Step::Close } else { Step::Write };
                self.drive(index, step);
            }
            _ => {}
        }
    }

    pub(super) fn on_completion(&mut self, index: u32) {
        let Some(entry) = self.entries.get_mut(index as usize) else {
            return;
        };
        let Some(conn) = entry.conn.as_ref() else {
            return;
        };
        match conn.wait {
            Wait::Park { until } => self.drive(index, Step::Park { until }),
            // A listening session waiting for input takes the completion now; its read deadline's timer
            // stays in the heap and is found stale or re-armed by the next wait.
            Wait::Read { .. } if conn.listening => self.drive(index, Step::Listen),
            _ => {}
        }
    }

    /// `Step::Listen`: a completion already posted is delivered at once; otherwise the connection reads,
    /// and a completion posted while it waits for input ends that wait (see `on_completion`).
    pub(super) fn listen(&mut self, index: u32) -> Flow {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return Flow::Close(CloseReason::SessionError);
        };
        conn.listening = true;
        if let Some(completion) = entry.receiver.pop() {
            // An idle wait marked the slot idle (so a drain may close it); the session is busy again now.
            if !entry.owner.set_idle(false)
                && let Some(code) = entry.owner.closing()
            {
                return Flow::Close(reason_for_code(code));
            }
            return match self.hook(index, |session, context| {
                session.on_wake(completion.token, completion.value, context)
            }) {
                Some(step) => Flow::Next(step),
                None => self.panicked_flow(index),
            };
        }
        self.read(index)
    }

    // ----- timers -----

    /// Runs the session's steps until it waits for the peer, a completion or a timer, or closes.
    pub(super) fn drive(&mut self, index: u32, mut step: Step) {
        let mut steps = 0;
        loop {
            steps += 1;
            if steps > STEPS_PER_TURN
                && matches!(
                    step,
                    Step::Read | Step::Listen | Step::Write | Step::Park { .. }
                )
            {
                self.conn(index).wait = Wait::Yielded { step };
                let generation = self.entries[index as usize].generation;
                self.yielded.push((index, generation));
                return;
            }
            let conn = self.conn(index);
            conn.wait = Wait::Running;
            // Every step the session returns passes here, so a half close asked for in any hook is applied
            // (or bytes queued after it refused) before the loop acts on the step. An abort discards the
            // queue and keeps its own reason. (Without a half close there is nothing to do.)
            if step != Step::Abort
                && conn.machine.half_close_asked()
                && let Err(reason) = self.half_close(index)
            {
                return self.close(index, reason);
            }
            let flow = match step {
                Step::Read => {
                    self.conn(index).listening = false;
                    self.read(index)
                }
                Step::Listen => self.listen(index),
                Step::Write => self.flush(index, false),
                Step::Close => self.flush(index, true),
                Step::Park { until } => self.park(index, until),
                Step::Abort => Flow::Close(self.conn(index).machine.close_reason(Step::Abort)),
            };
            match flow {
                Flow::Next(next) => step = next,
                Flow::Wait => return,
                Flow::Close(reason) => return self.close(index, reason),
            }
        }
    }

    pub(super) fn read(&mut self, index: u32) -> Flow {
        let core = self.core;
        let conn = self.conn(index);
        if conn.input_changed {
            conn.input_changed = false;
            return self.on_data(index);
        }
        if conn.machine.is_peer_closed() {
            return Flow::Close(conn.machine.close_after_fin());
        }
        if let Some(code) = self.entries[index as usize].owner.closing() {
            return Flow::Close(reason_for_code(code));
        }
        if let Err(reason) = self.ensure_read_buffer(index) {
            return Flow::Close(reason);
        }
        let entry = &mut self.entries[index as usize];
        let (Some(conn), Some(read)) = (entry.conn.as_mut(), entry.read.as_mut()) else {
            return Flow::Close(CloseReason::SessionError);
        };
        let idle = conn
            .machine
            .is_idle(read.unread_len(), entry.output.is_empty());
        if idle && let Some(reason) = core.close_when_idle(conn.info.lane) {
            return Flow::Close(reason);
        }
        if !conn.readable {
            return self.wait_read(index, idle);
        }
        let Some(socket) = entry.owner.socket() else {
            return Flow::Close(CloseReason::SessionError);
        };
        let spare = read.spare_mut();
        let room = spare.len();
        let solo = self.solo_block.take();
        let received = if solo.is_some() {
            let received = socket::recv(socket, spare);
            // The recv may have blocked for up to a slice: whatever was read before it is stale.
            self.turn_clock.set(None);
            received
        } else {
            socket::recv_ready(socket, spare)
        };
        match received {
            Ok(0) => {
                if let Some(code) = entry.owner.closing() {
                    return Flow::Close(reason_for_code(code));
                }
                conn.readable = false;
                conn.eof_seen = true;
                conn.machine.peer_closed();
                match self.hook(index, |session, context| session.on_peer_closed(context)) {
                    Some(step) => Flow::Next(step),
                    None => self.panicked_flow(index),
                }
            }
            Ok(count) => {
                // A short read drained the socket: the next edge says when more arrives (unless the FIN
                // came already, which sends no further edge).
                if count < room && !conn.read_closed {
                    conn.readable = false;
                }
                read.commit(count);
                conn.bytes_in += count as u64;
                conn.recheck = false;
                self.served = Some((index, entry.generation));
                if !entry.owner.set_idle(false)
                    && let Some(code) = entry.owner.closing()
                {
                    return Flow::Close(reason_for_code(code));
                }
                conn.machine.input_arrived();
                let turn_clock = &self.turn_clock;
                if let Err(reason) = conn.rates.received(count, || turn_now(turn_clock, core)) {
                    return Flow::Close(reason);
                }
                self.on_data(index)
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                conn.readable = false;
                // Before registration no re-check is needed: registering reports what arrived since. After a
                // solo read's slice neither: the registered edge reports whatever arrives from now on.
                conn.recheck = conn.registered && solo.is_none();
                let flow = self.wait_read(index, idle);
                // A slice without input changes nothing: the deadline of the wait before it stays in force
                // (its timer is still in the heap), rather than starting again a slice later.
                if let Some(waiting @ Wait::Read { .. }) = solo
                    && let Some(conn) = self.entries[index as usize].conn.as_mut()
                    && matches!(conn.wait, Wait::Read { .. })
                {
                    conn.wait = waiting;
                }
                flow
            }
            Err(error) if error.kind() == io::ErrorKind::Interrupted => Flow::Next(Step::Read),
            Err(error) => match entry.owner.closing() {
                Some(code) => Flow::Close(reason_for_code(code)),
                None => Flow::Close(CloseReason::from_io(&error)),
            },
        }
    }

    /// Waits for input under the deadline of the phase; an idle connection gives its read buffer back.
    pub(super) fn wait_read(&mut self, index: u32, idle: bool) -> Flow {
        let now = self.now();
        let tick = self.core.limits.tick;
        let limits = self.limits(index);
        let (idle_timeout, read_timeout) = (limits.idle_timeout, limits.read_timeout);
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return Flow::Close(CloseReason::SessionError);
        };
        let (deadline, deadline_kind) = conn.machine.read_wait(now, idle_timeout, read_timeout);
        let mut wake_at = deadline;
        if idle {
            if !entry.owner.set_idle(true)
                && let Some(code) = entry.owner.closing()
            {
                return Flow::Close(reason_for_code(code));
            }
            conn.rates.input_idle();
            // An idle connection holds no large output queue either: one that grew past what a small reply
            // needs is dropped (a new queue allocates nothing until used), so a connection that once sent
            // a large reply does not keep its size while it idles, nor does its slot after it closes.
            // The queue's counters (`written_total`, response brackets) stay: only its memory goes.
            if conn.output_peak > OUTPUT_KEPT_IDLE && entry.output.release_memory() {
                conn.output_peak = 0;
            }
            // An idle connection holds no read buffer: the loop's free list keeps it warm for the next one.
            // A grown buffer goes back too (to its own class's list): kept, it would count against the
            // buffer budget for as long as the connection idles, and idle connections that once read one
            // long request would starve busy ones of the budget.
            if entry
                .read
                .as_ref()
                .is_some_and(|read| read.unread_len() == 0)
                && let Some(mut read) = entry.read.take()
            {
                read.clear();
                self.holding = self.holding.saturating_sub(1);
                Self::give_back(&mut self.buffers, self.holding, read.into_buffer());
            }
        } else if let Some(check) = conn.rates.awaiting_input(now) {
            // The request waits for more input: from now on its rate is judged, counting what it brought.
            wake_at = wake_at.min(check);
        }
        if conn.recheck {
            wake_at = wake_at.min(deadline_after(now, tick));
        }
        conn.wait = Wait::Read {
            deadline,
            kind: deadline_kind,
        };
        self.schedule(index, wake_at);
        Flow::Wait
    }

    pub(super) fn on_data(&mut self, index: u32) -> Flow {
        let core = self.core;
        let now = self.now();
        let entry = &mut self.entries[index as usize];
        let (Some(conn), Some(read)) = (entry.conn.as_mut(), entry.read.as_mut()) else {
            return Flow::Close(CloseReason::SessionError);
        };
        let Some(session) = conn.session.as_mut() else {
            return Flow::Close(CloseReason::SessionError);
        };
        let environment = core.hook_environment(&conn.completer);
        let answer = conn.machine.data_hook(
            session,
            read,
            &conn.info,
            &mut entry.output,
            now,
            environment,
        );
        self.turn_clock.set(None);
        match answer {
            Some((step, more)) => {
                conn.input_changed = more;
                Flow::Next(step)
            }
            None => self.panicked_flow(index),
        }
    }

    /// Flushes the output without blocking, asking the gate before each write call; `then_close` closes
    /// once it is all out, otherwise `on_writable` runs.
    pub(super) fn flush(&mut self, index: u32, then_close: bool) -> Flow {
        let core = self.core;
        let gate = &self.runtime.gate;
        let allow_all = std::any::TypeId::of::<G>() == std::any::TypeId::of::<AllowAll>();
        let refusal_bytes_max = self.limits(index).refusal_bytes_max;
        let write_timeout = self.limits(index).write_timeout;
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return Flow::Close(CloseReason::SessionError);
        };
        let output = &mut entry.output;
        conn.output_peak = conn.output_peak.max(output.pending());
        if !output.is_empty() {
            let mut zero_sends = 0;
            while !output.is_empty() {
                if let Some(code) = entry.owner.closing() {
                    return Flow::Close(reason_for_code(code));
                }
                if !conn.checked {
                    let verdict = match (allow_all, conn.ticket.as_ref()) {
                        (true, _) | (false, None) => Verdict::Allow,
                        (false, Some(ticket)) => check_or_deny(
                            gate,
                            ticket,
                            &WriteFacts::new(
                                conn.info.id,
                                conn.info.lane,
                                output.pending(),
                                output.response_started(),
                            ),
                        ),
                    };
                    if let Verdict::Deny(code) = verdict {
                        return self.denied(index, code, refusal_bytes_max);
                    }
                    conn.checked = true;
                }
                let Some(socket) = entry.owner.socket() else {
                    return Flow::Close(CloseReason::SessionError);
                };
                let (result, offered) = crate::link::send_queued(socket, output);
                match result {
                    Ok(0) => {
                        zero_sends += 1;
                        if zero_sends > 1 {
                            return Flow::Close(CloseReason::from_io(&io::Error::from(
                                io::ErrorKind::WriteZero,
                            )));
                        }
                    }
                    Ok(count) => {
                        zero_sends = 0;
                        output.advance(count);
                        conn.bytes_out += count as u64;
                        conn.write_deadline = None;
                        conn.recheck = false;
                        let turn_clock = &self.turn_clock;
                        conn.rates.sent(count, || turn_now(turn_clock, core));
                        // The rest of a partial write belongs to the same write call (no new gate check).
                        if count == offered && !output.is_empty() {
                            conn.checked = false;
                        }
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                        let recheck =
                            conn.registered && !std::mem::replace(&mut conn.recheck, true);
                        conn.writable = false;
                        let now = turn_now(&self.turn_clock, core);
                        let deadline = *conn.write_deadline.get_or_insert_with(|| {
                            let progress = deadline_after(now, write_timeout);
                            conn.machine
                                .exchange_deadline()
                                .map_or(progress, |exchange| exchange.min(progress))
                        });
                        let mut wake_at = deadline;
                        // The first wait starts judging the output rate, counting what went out before it.
                        match conn.rates.awaiting_output(now) {
                            Ok(Some(check)) => wake_at = wake_at.min(check),
                            Ok(None) => {}
                            Err(reason) => return Flow::Close(reason),
                        }
                        if recheck {
                            wake_at = wake_at.min(deadline_after(now, core.limits.tick));
                        }
                        conn.wait = Wait::Flush {
                            then_close,
                            deadline,
                        };
                        self.schedule(index, wake_at);
                        return Flow::Wait;
                    }
                    Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                    Err(error) => {
                        return match entry.owner.closing() {
                            Some(code) => Flow::Close(reason_for_code(code)),
                            None => Flow::Close(CloseReason::from_io(&error)),
                        };
                    }
                }
            }
        }
        conn.checked = false;
        conn.write_deadline = None;
        conn.rates.output_done();
        let unread = entry.read.as_ref().map_or(0, ReadBuffer::unread_len);
        if conn.machine.output_flushed(unread) {
            conn.rates.input_idle();
        }
        // A half close waiting for this flush sends its FIN before `on_writable` runs.
        if conn.machine.half_close_asked()
            && let Err(reason) = self.half_close(index)
        {
            return Flow::Close(reason);
        }
        if then_close {
            let conn = self.conn(index);
            return Flow::Close(conn.machine.close_reason(Step::Close));
        }
        match self.hook(index, |session, context| session.on_writable(context)) {
            Some(step) => Flow::Next(step),
            None => self.panicked_flow(index),
        }
    }

    /// Sends the FIN of a half close once the queue is empty; refuses bytes queued after it.
    pub(super) fn half_close(&mut self, index: u32) -> Result<(), CloseReason> {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return Err(CloseReason::SessionError);
        };
        match conn.machine.half_close_due(entry.output.is_empty()) {
            HalfClose::Nothing => Ok(()),
            HalfClose::Refuse => Err(CloseReason::SessionError),
            HalfClose::SendFin => {
                let Some(socket) = entry.owner.socket() else {
                    return Err(CloseReason::SessionError);
                };
                match socket::shutdown(socket, std::net::Shutdown::Write) {
                    Ok(()) => {
                        conn.machine.fin_sent();
                        Ok(())
                    }
                    Err(error) => Err(match entry.owner.closing() {
                        Some(code) => reason_for_code(code),
                        None => CloseReason::from_io(&error),
                    }),
                }
            }
        }
    }

    /// The gate denied a write: the session may queue a denial text, sent once only on a clean boundary.
    pub(super) fn denied(&mut self, index: u32, code: u16, refusal_bytes_max: usize) -> Flow {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return Flow::Close(CloseReason::EgressDenied(code));
        };
        let output = &mut entry.output;
        let clean = !output.response_started();
        if let Some(session) = conn.session.as_mut()
            && let Some(text) =
                SessionMachine::denial(session, code, output, clean, refusal_bytes_max)
            && let Some(socket) = entry.owner.socket()
            && let Ok(sent) = socket::send(socket, text)
        {
            conn.bytes_out += sent as u64;
        }
        output.clear();
        Flow::Close(CloseReason::EgressDenied(code))
    }

    pub(super) fn park(&mut self, index: u32, until: Instant) -> Flow {
        let now = self.core.now();
        let park_timeout = self.limits(index).park_timeout;
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return Flow::Close(CloseReason::SessionError);
        };
        let until = SessionMachine::park_deadline(now, until, park_timeout);
        conn.rates.input_idle();
        if let Some(completion) = entry.receiver.pop() {
            return match self.hook(index, |session, context| {
                session.on_wake(completion.token, completion.value, context)
            }) {
                Some(step) => Flow::Next(step),
                None => self.panicked_flow(index),
            };
        }
        if let Some(code) = entry.owner.closing() {
            return Flow::Close(reason_for_code(code));
        }
        if now >= until {
            // Returned to `drive` rather than driven from here, so a session that parks in the past again
            // and again loops (and yields its turn) instead of recursing.
            return self.park_timed_out(index);
        }
        conn.wait = Wait::Park { until };
        self.schedule(index, until);
        Flow::Wait
    }

    // ----- the PROXY handshake -----

    /// Calls a hook under `catch_unwind` with a fresh context, then applies what the session asked for.
    pub(super) fn hook<T>(
        &mut self,
        index: u32,
        call: impl FnOnce(&mut F::Session, &mut SessionContext<'_>) -> T,
    ) -> Option<T> {
        let core = self.core;
        let now = self.now();
        let entry = &mut self.entries[index as usize];
        let conn = entry.conn.as_mut()?;
        let session = conn.session.as_mut()?;
        let environment = core.hook_environment(&conn.completer);
        let result = conn.machine.hook(
            session,
            &conn.info,
            &mut entry.output,
            now,
            environment,
            call,
        );
        self.turn_clock.set(None);
        result
    }

    /// Asks the session's `on_timeout` about a deadline of `kind` that passed (`None`: it panicked).
    pub(super) fn timeout(&mut self, index: u32, kind: TimeoutKind) -> Option<Step> {
        let core = self.core;
        let now = self.now();
        let entry = &mut self.entries[index as usize];
        let conn = entry.conn.as_mut()?;
        let session = conn.session.as_mut()?;
        let environment = core.hook_environment(&conn.completer);
        let result = conn.machine.timeout_hook(
            session,
            kind,
            &conn.info,
            &mut entry.output,
            now,
            environment,
        );
        self.turn_clock.set(None);
        result
    }

    pub(super) fn panicked_flow(&mut self, index: u32) -> Flow {
        let id = self.conn(index).info.id;
        self.core.emit(Event::SessionPanicked { id });
        Flow::Close(CloseReason::SessionPanicked)
    }

    pub(super) fn panicked(&mut self, index: u32) {
        if let Flow::Close(reason) = self.panicked_flow(index) {
            self.close(index, reason);
        }
    }
}
