//! Taking connections from the inbox: a slot, the registration with epoll, the PROXY handshake and the session's open.

use super::*;

impl<G: Gate, F: SessionFactory> EventLoop<'_, G, F> {
    /// Starts the queued connections in the order they came. Each is taken off `incoming` only as it starts,
    /// so a panic while starting one leaves the rest queued for the next pass.
    pub(super) fn admit_incoming(&mut self) {
        self.incoming.reverse();
        while let Some(job) = self.incoming.pop() {
            self.start(job);
            self.serving = None;
            self.turn_clock.set(None);
        }
    }

    /// Takes one admitted connection into the loop.
    pub(super) fn start(&mut self, job: Job<G::Ticket>) {
        let slot_index = match self.take_free() {
            Some(index) => Ok(index),
            None => self.new_entry(),
        };
        let Ok(index) = slot_index else {
            self.core.loops[self.index].remove_load();
            return self.runtime.refuse_job(job, RefusalCause::Busy, self.index);
        };
        let Job {
            socket,
            mut info,
            ticket,
            reservation,
            listener,
            outbound,
        } = job;
        info.worker = Some(WorkerId(self.index as u32));
        let limits = listener.limits;
        let entry = &mut self.entries[index as usize];
        entry.generation = entry.generation.wrapping_add(1);
        self.serving = Some((index, entry.generation));
        self.turn_clock.set(None);
        entry.shared.lane.store(info.lane.0, Ordering::Release);
        {
            // The slot is occupied and listed by id under the one lock a killer's lookup takes: a kill that
            // saw the occupant (through `connections`) finds the slot by id. (Listed after the lock, a kill
            // landing between the two found no loop holding the id: it returned false and did nothing.)
            let mut ids = self.core.loops[self.index].ids();
            entry.owner.occupy(info.id.get(), socket);
            ids.insert(info.id.get(), Arc::clone(&entry.shared));
        }
        entry.receiver.bind(info.id);
        entry.output.reset(limits.output_budget);
        let completer = entry.receiver.completer(info.id, entry.waker.clone());
        entry.conn = Some(Conn {
            info,
            ticket,
            reservation: Some(reservation),
            listener,
            session: None,
            completer,
            wait: Wait::Running,
            readable: true,
            writable: true,
            registered: false,
            read_closed: false,
            machine: SessionMachine::new(),
            listening: false,
            input_changed: false,
            rates: TransferRates::new(limits.min_rate),
            bytes_in: 0,
            bytes_out: 0,
            eof_seen: false,
            checked: false,
            recheck: false,
            write_deadline: None,
            prefix: Vec::new(),
            output_peak: 0,
            closing_reason: None,
            linger: None,
            // An accepted socket inherits the listener's receive timeout; one we opened has none yet.
            armed: outbound.is_none().then_some(limits.idle_timeout),
        });
        self.live += 1;
        let generation = entry.generation;
        if let Some(outbound) = outbound {
            let conn = self.conn(index);
            conn.session = crate::sessions::downcast_session::<F::Session>(outbound.session);
            if self.core.drain_expired.load(Ordering::Acquire) {
                return self.close(index, CloseReason::DrainDeadline);
            }
            if let Some(reason) = outbound.failed {
                return self.close(index, reason);
            }
            let conn = self.conn(index);
            conn.writable = false;
            conn.readable = false;
            conn.wait = Wait::Connect {
                deadline: outbound.deadline,
                nodelay: outbound.nodelay,
                started: outbound.started,
            };
            self.schedule(index, outbound.deadline);
            // The registration's EPOLLOUT edge reports the end of the handshake (see `connected`).
            return self.register(index, generation);
        }
        if self.core.drain_expired.load(Ordering::Acquire) {
            return self.close(index, CloseReason::DrainDeadline);
        }
        if self.conn(index).listener.proxy.is_some() {
            let now = self.core.now();
            let conn = self.conn(index);
            let deadline = deadline_after(now, conn.listener.limits.handshake_timeout);
            if !conn.listener.trusted.contains(conn.info.peer.ip()) {
                return self.close(index, CloseReason::ProxyUntrusted);
            }
            conn.wait = Wait::Handshake { deadline };
            self.schedule(index, deadline);
            self.handshake(index);
        } else {
            self.open_session(index);
        }
        self.register(index, generation);
    }

    /// Registers a new connection that is still open after its first turn.
    pub(super) fn register(&mut self, index: u32, generation: u32) {
        let entry = &mut self.entries[index as usize];
        if entry.generation != generation {
            return;
        }
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        let registered = match entry.owner.socket() {
            Some(socket) => self.epoll.add(
                socket,
                token(index, generation),
                Interest::READABLE | Interest::WRITABLE | Interest::READ_CLOSED | Interest::EDGE,
            ),
            None => Err(io::Error::from(io::ErrorKind::NotConnected)),
        };
        match registered {
            Ok(()) => conn.registered = true,
            // A lingering close ends now (with an RST); anything else closes with the error.
            Err(_) if matches!(conn.wait, Wait::Linger { .. }) => self.finish_linger(index, true),
            Err(error) => self.close(index, CloseReason::from_io(&error)),
        }
    }

    /// An outbound connection's socket became writable (or failed): its handshake ended. On success the
    /// socket is made blocking again (solo reads wait in a blocking `recv`; every other call passes
    /// `MSG_DONTWAIT`) and the session opens.
    pub(super) fn connected(&mut self, index: u32) {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        let Wait::Connect {
            nodelay, started, ..
        } = conn.wait
        else {
            return;
        };
        let Some(socket) = entry.owner.socket() else {
            return self.close(index, CloseReason::SessionError);
        };
        // EPOLLOUT (or EPOLLERR, EPOLLHUP) on a connecting socket means the handshake ended either way;
        // SO_ERROR tells which. Without an error it must be connected now.
        let failure = match socket::take_error(socket) {
            Ok(Some(error)) | Err(error) => Some(error),
            Ok(None) => socket::peer_addr(socket).err(),
        };
        if let Some(error) = failure {
            return self.close(index, CloseReason::from_io(&error));
        }
        let ready = socket::set_nonblocking(socket, false)
            .and_then(|()| socket::set_nodelay(socket, nodelay));
        if let Err(error) = ready {
            return self.close(index, CloseReason::from_io(&error));
        }
        conn.wait = Wait::Running;
        // Whatever the peer sent with its SYN-ACK is read by the session's first step.
        conn.readable = true;
        conn.writable = true;
        let (id, peer) = (conn.info.id, conn.info.peer);
        let took = self.core.now().saturating_duration_since(started);
        self.core.emit(Event::Connected { id, peer, took });
        self.open_session(index);
    }

    /// Makes the session (an outbound connection brought its own) and runs its `on_open`.
    pub(super) fn open_session(&mut self, index: u32) {
        let core = self.core;
        let runtime = self.runtime;
        let info = self.conn(index).info;
        let adopted = self.conn(index).session.take();
        let created = match adopted {
            Some(session) => Ok(Some(session)),
            None => catch_unwind(AssertUnwindSafe(|| runtime.workload.factory.create(&info))),
        };
        let session = match created {
            Ok(Some(session)) => session,
            Ok(None) => {
                let reason = crate::coroutines::reason_for_no_session();
                if let CloseReason::Refused(cause) = reason {
                    handshake::count_refusal(core, &info, cause);
                }
                return self.close(index, reason);
            }
            Err(_) => {
                core.emit(Event::SessionPanicked { id: info.id });
                return self.close(index, CloseReason::SessionPanicked);
            }
        };
        let conn = self.conn(index);
        conn.session = Some(session);
        if !conn.prefix.is_empty() {
            let prefix = std::mem::take(&mut conn.prefix);
            if let Err(reason) = self.ensure_read_buffer(index) {
                return self.close(index, reason);
            }
            let entry = &mut self.entries[index as usize];
            let Some(read) = entry.read.as_mut() else {
                return self.close(index, CloseReason::SessionError);
            };
            if read.extend_from_slice(&prefix) < prefix.len() {
                return self.close(index, CloseReason::Limit(LimitKind::ReadBuffer));
            }
            if let Some(conn) = entry.conn.as_mut() {
                conn.input_changed = true;
            }
        }
        let Some(step) = self.hook(index, |session, context| session.on_open(context)) else {
            return self.panicked(index);
        };
        self.drive(index, step);
    }

    // ----- events -----

    pub(super) fn handshake(&mut self, index: u32) {
        let limits = self.limits(index);
        let (proxy_header_max, mode) = (limits.proxy_header_max, self.conn(index).listener.proxy);
        let Some(mode) = mode else {
            return self.open_session(index);
        };
        let parser = ProxyParser::new(mode, proxy_header_max);
        let most = (V2_FIXED + proxy_header_max).max(V1_MAX);
        loop {
            let entry = &mut self.entries[index as usize];
            let Some(conn) = entry.conn.as_mut() else {
                return;
            };
            if !conn.readable {
                return;
            }
            let Some(socket) = entry.owner.socket() else {
                return self.close(index, CloseReason::SessionError);
            };
            // Read no further than the longest possible header, so application data is not pulled in bulk.
            let want = (most - conn.prefix.len().min(most)).clamp(1, CHUNK);
            let chunk = &mut self.scratch[..want];
            match socket::recv_ready(socket, chunk) {
                Ok(0) => {
                    conn.eof_seen = true;
                    let reason = if conn.prefix.is_empty() {
                        CloseReason::ProxyMissing
                    } else {
                        CloseReason::ProxyInvalid
                    };
                    return self.close(index, reason);
                }
                Ok(count) => {
                    if count < want && !conn.read_closed {
                        conn.readable = false;
                    }
                    conn.bytes_in += count as u64;
                    conn.prefix.extend_from_slice(&chunk[..count]);
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    conn.readable = false;
                    return;
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return self.close(index, CloseReason::from_io(&error)),
            }
            match parser.parse(&conn.prefix) {
                Ok(ProxyStatus::NeedMore) if conn.prefix.len() < most => {}
                Ok(ProxyStatus::NeedMore) => return self.close(index, CloseReason::ProxyInvalid),
                Ok(ProxyStatus::Done { header, consumed }) => {
                    let consumed = consumed.min(conn.prefix.len());
                    conn.prefix.drain(..consumed);
                    let real = match header.command {
                        ProxyCommand::Proxy => header.source,
                        ProxyCommand::Local => None,
                    };
                    let took = self
                        .core
                        .now()
                        .saturating_duration_since(conn.info.accepted_at);
                    let id = conn.info.id;
                    // The header's deadline no longer applies; the session's own come next.
                    conn.wait = Wait::Running;
                    self.entries[index as usize].timer_at = None;
                    self.open_session_after_handshake(index, real, id, took);
                    return;
                }
                Err(ProxyError::NotProxy) => return self.close(index, CloseReason::ProxyMissing),
                Err(_) => return self.close(index, CloseReason::ProxyInvalid),
            }
        }
    }

    pub(super) fn open_session_after_handshake(
        &mut self,
        index: u32,
        real: Option<std::net::SocketAddr>,
        id: net_io_core::ConnectionId,
        took: Duration,
    ) {
        // As in the threaded driver: the real peer moves the source cap first (ProxyResolved), then
        // HandshakeDone, then the session opens. `took` counts from the accept, which the loop follows closely.
        if let Some(real_peer) = real {
            let conn = self.conn(index);
            conn.info.set_real_peer(real_peer);
            let moved = conn
                .reservation
                .as_mut()
                .is_some_and(|reservation| reservation.move_source(real_peer.ip()).is_ok());
            if !moved {
                let reason = handshake::source_cap_refused(self.core, &self.conn(index).info);
                return self.close(index, reason);
            }
            // Then the gate sees the real client (it may swap the ticket or refuse), and only then is it resolved.
            let refusal_bytes_max = self.limits(index).refusal_bytes_max;
            let entry = &mut self.entries[index as usize];
            // Without its socket or ticket the connection cannot be asked about: fail closed, as the
            // handshake does without a socket.
            let (Some(conn), Some(socket)) = (entry.conn.as_mut(), entry.owner.socket()) else {
                return self.close(index, CloseReason::SessionError);
            };
            let Some(ticket) = conn.ticket.as_mut() else {
                return self.close(index, CloseReason::SessionError);
            };
            let readmitted = handshake::readmit(
                self.core,
                &self.runtime.gate,
                ticket,
                &conn.info,
                refusal_bytes_max,
                |bytes| {
                    if let Ok(sent) = socket::send(socket, bytes) {
                        conn.bytes_out += sent as u64;
                    }
                },
            );
            if let Err(reason) = readmitted {
                return self.close(index, reason);
            }
            self.core.emit(Event::ProxyResolved { id, real_peer });
        }
        self.core.emit(Event::HandshakeDone { id, took });
        self.open_session(index);
    }

    // ----- closing -----
}
