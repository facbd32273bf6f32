//! The generic part of a running server: accept threads, the hand-over queue, and the worker loop that runs one
//! connection at a time and closes it exactly once.

use std::any::{Any, TypeId};
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use net_io_core::{
    AllowAll, BufferPool, CloseReason, Coalescer, Completer, CompletionReceiver, CompletionRing,
    ConnectionId, ConnectionInfo, ControlLine, ControlState, ControlWaker, ControlWatch, Event,
    Gate, IdAllocator, IdBlock, LimitKind, ListenerId, NetError, OsErrorClass, Refusal,
    RefusalCause, ResolvedLimits, TrustedProxies, Verdict, WorkerId, WriteFacts, admit_or_refuse,
    check_or_deny, close_ticket, normalize,
};
use net_io_sys::eventfd::EventFd;
use net_io_sys::kill::SlotOwner;
use net_io_sys::socket::{self, AcceptFailure, Linger, Listener};
use net_io_sys::wait::{self, Interest};

use crate::backoff::Backoff;
use crate::caps::{CapRefusal, ListenerCaps, ListenerCounts, Reservation};
use crate::codes::CODE_SHED;
use crate::handover::HandOver;
use crate::handshake;
use crate::link::Link;
use crate::listener::{ListenerDefaults, ListenerRuntime};
use crate::loop_shared::{Inbox, LoopShared};
use crate::outbound::{ConnectOptions, Outbound};
use crate::shared::{Acceptor, Core, KillHandle};

/// An admitted connection waiting for a worker.
pub(crate) struct Job<T> {
    pub(crate) socket: OwnedFd,
    pub(crate) info: ConnectionInfo,
    /// The gate's ticket; `None` for an outbound connection, which the gate never admitted.
    pub(crate) ticket: Option<T>,
    pub(crate) reservation: Reservation,
    /// The settings of the listener that accepted it; shared, so they outlive a listener removed while
    /// this connection is still open.
    pub(crate) listener: Arc<ListenerRuntime>,
    /// Set when the server opened this connection itself ([`crate::ServerHandle::connect`]).
    pub(crate) outbound: Option<Outbound>,
}

/// What a workload sees while it runs one connection.
pub(crate) struct Run<'a> {
    pub(crate) link: &'a mut Link,
    pub(crate) info: &'a ConnectionInfo,
    pub(crate) core: &'a Core,
    pub(crate) limits: &'a ResolvedLimits,
    pub(crate) check: &'a mut dyn FnMut(usize, bool) -> Verdict,
    pub(crate) completer: &'a Completer,
    pub(crate) receiver: &'a mut CompletionReceiver,
    pub(crate) kill: KillHandle,
    pub(crate) prefix: &'a [u8],
}

/// A handler or a session factory, run by workers.
pub(crate) trait Workload: Send + Sync + 'static {
    /// Per-worker state kept across connections (buffers, output queue), so serving does not allocate.
    type State: Send;

    fn new_state(&self, core: &Core, pool: &BufferPool) -> Self::State;

    /// Serves one connection and returns why it should close.
    fn serve(&self, state: &mut Self::State, run: Run<'_>) -> CloseReason;

    /// Tells the workload the final close reason, exactly once per served connection.
    fn closed(&self, state: &mut Self::State, info: &ConnectionInfo, reason: CloseReason);

    /// The session type an outbound connection must carry, with its name for errors; `None` for a workload
    /// that cannot drive one (blocking handlers).
    fn outbound_session(&self) -> Option<(TypeId, &'static str)> {
        None
    }

    /// Takes an outbound connection's session into `state` before the connect finishes, so that `closed`
    /// delivers its `on_close` whatever happens next and `serve` drives it instead of a new one.
    fn adopt(&self, state: &mut Self::State, session: Box<dyn Any + Send>) {
        let _ = (state, session);
    }

    /// Closes an outbound session that no worker or loop took (refused at the hand-over): its one
    /// `on_close`.
    fn abandon(&self, session: Box<dyn Any + Send>, info: &ConnectionInfo, reason: CloseReason) {
        let _ = (session, info, reason);
    }
}

/// The generic runtime of one server.
pub(crate) struct Runtime<G: Gate, W: Workload> {
    pub(crate) core: Arc<Core>,
    pub(crate) gate: G,
    pub(crate) workload: W,
    pub(crate) handover: HandOver<Job<G::Ticket>>,
    /// What a listener added at run time is validated and set up against (the builder's settings).
    pub(crate) listener_defaults: ListenerDefaults,
    pub(crate) pool: BufferPool,
    pub(crate) ids: IdAllocator,
    pub(crate) control: Option<Arc<ControlLine>>,
    /// The control line's last seen epoch, kept here (not on an accept thread) so that when the watching
    /// listener is removed, the next one carries on without applying the current state a second time.
    pub(crate) control_watch: std::sync::Mutex<ControlWatch>,
    /// Subscribed to `control` (which holds it weakly): wakes the accept threads on each change, so the one
    /// watching needs no periodic poll and an idle server costs no CPU.
    pub(crate) _control_waker: Option<Arc<ControlWaker>>,
    pub(crate) lockdown: std::sync::atomic::AtomicBool,
    /// One inbox per event loop; empty when sessions run on worker threads.
    pub(crate) inboxes: Vec<Inbox<Job<G::Ticket>>>,
    /// What outbound connections share (their settings, ids and refusal counter).
    pub(crate) outbound: OutboundShared,
}

/// Wakes a worker by signalling its eventfd; used as the completer's waker.
struct WakeSignal(Arc<EventFd>);

impl Wake for WakeSignal {
    fn wake(self: Arc<Self>) {
        let _ = self.0.signal();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let _ = self.0.signal();
    }
}

impl<G: Gate, W: Workload> Runtime<G, W> {
    /// Refuses every job still queued for a worker or a loop (the server is stopping) and wakes the loops.
    pub(crate) fn close_queue(&self) {
        let slot = self.core.shutdown_slot();
        for job in self.handover.close() {
            self.refuse_job(job, RefusalCause::DoorClosed, slot);
        }
        for (index, inbox) in self.inboxes.iter().enumerate() {
            for job in inbox.close() {
                self.core.loops[index].remove_load();
                self.refuse_job(job, RefusalCause::DoorClosed, slot);
            }
            let _ = self.core.loops[index].wake.eventfd.signal();
        }
    }
}

impl<G: Gate, W: Workload> Runtime<G, W> {
    /// The loop of the accept thread of one listener; it owns the socket, which closes when it returns
    /// (at a stop, or when the listener is removed). `counter_slot` is its close slot past the base.
    pub(crate) fn accept_loop(
        self: Arc<Self>,
        socket: Listener,
        settings: Arc<ListenerRuntime>,
        acceptor: Arc<Acceptor>,
        counter_slot: usize,
    ) {
        let core = &self.core;
        let listener = Accepting {
            socket: &socket,
            settings: &settings,
            counter_slot: core.close_slot_base() + counter_slot,
        };
        let wake = &acceptor.wake;
        let listener_id = acceptor.id;
        let mut ids = self.ids.block();
        let mut reserve = socket_reserve();
        let mut backoff = Backoff::new();
        let mut coalescer = Coalescer::new();
        let ends = |acceptor: &Acceptor| {
            core.stopping.load(Ordering::Acquire) || acceptor.closing.load(Ordering::Acquire)
        };
        let mut listening = true;
        loop {
            if ends(&acceptor) {
                return;
            }
            // First on every pass (whichever way the last one ended), so that a due count never leaves the
            // wait below with nothing to wait for.
            if core.events_enabled {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    coalescer.flush(&*core.events, core.now())
                }));
                core.flush_coalesced();
            }
            self.watch_control(listener_id);
            // Folded event counts are reported once their second is over even if nothing else happens: the
            // wait ends then at the latest. Otherwise it has no deadline (a control-line change wakes it), so
            // an idle server costs no CPU.
            let wait_limit = [coalescer.flush_due(), core.serving_flush_due()]
                .into_iter()
                .flatten()
                .min()
                .map(|due| due.saturating_duration_since(core.now()));
            let door_open = core.door_open.load(Ordering::Acquire)
                && acceptor.door_open.load(Ordering::Acquire);
            let waited = if door_open {
                wait::wait(
                    listener.socket.as_fd(),
                    Interest::Readable,
                    Some(wake.as_fd()),
                    wait_limit,
                )
                .map(|_| ())
            } else {
                wait::wait_readable(wake.as_fd(), wait_limit).map(|_| ())
            };
            if waited.is_err() {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = wake.drain();
            if ends(&acceptor) {
                return;
            }
            if listening && core.draining.load(Ordering::Acquire) {
                // A drain never opens the door again: the socket stops listening, so a connect is refused at
                // once and what waits in the backlog is reset, instead of waiting out the drain first.
                listening = false;
                let _ = socket::shutdown(listener.socket.as_fd(), std::net::Shutdown::Read);
            }
            // The wake may be a control-line change: applied before anything that arrived meanwhile is
            // accepted, so a lockdown or a drain refuses the connection that raced it.
            self.watch_control(listener_id);
            let door_is_open = || {
                core.door_open.load(Ordering::Acquire) && acceptor.door_open.load(Ordering::Acquire)
            };
            if !door_is_open() {
                continue;
            }
            if reserve.is_none() {
                // The spare could not be reopened after the last pressure episode; try again now.
                reserve = socket_reserve();
            }
            for _ in 0..listener.settings.limits.accept_batch {
                // Checked before each accept, so a door closed mid-batch leaves the rest in the backlog.
                if !door_is_open() {
                    break;
                }
                match listener.socket.accept() {
                    Ok(accepted) => {
                        backoff.reset();
                        self.admit(
                            &listener,
                            listener_id,
                            accepted.socket,
                            accepted.peer,
                            &mut ids,
                            &mut coalescer,
                        );
                    }
                    Err(error) => match socket::classify_accept(&error) {
                        AcceptFailure::Empty => break,
                        AcceptFailure::PerConnection => {
                            core.emit(Event::AcceptError {
                                listener: listener_id,
                                class: OsErrorClass::of(&error),
                            });
                        }
                        AcceptFailure::DescriptorPressure => {
                            // Give the spare descriptor back to the kernel, take the waiting connection
                            // and reset it, so the backlog drains instead of the loop spinning.
                            drop(reserve.take());
                            if let Ok(shed) = listener.socket.accept() {
                                reset(shed.socket);
                            }
                            reserve = socket_reserve();
                            let pause = backoff.step();
                            core.counters.server().record_descriptor_pressure();
                            core.emit(Event::DescriptorPressure {
                                listener: listener_id,
                                backoff: pause,
                            });
                            let _ = wait::wait_readable(wake.as_fd(), Some(pause));
                            break;
                        }
                        AcceptFailure::Pause => {
                            core.emit(Event::AcceptError {
                                listener: listener_id,
                                class: OsErrorClass::of(&error),
                            });
                            let _ = wait::wait_readable(wake.as_fd(), Some(backoff.step()));
                            break;
                        }
                        AcceptFailure::ListenerFailed => {
                            core.emit(Event::ListenerFailed {
                                listener: listener_id,
                                class: OsErrorClass::of(&error),
                            });
                            // Wait for the stop (or the removal) instead of spinning on a broken listener.
                            while !ends(&acceptor) {
                                let _ = wait::wait_readable(wake.as_fd(), None);
                                let _ = wake.drain();
                            }
                            return;
                        }
                    },
                }
            }
        }
    }

    /// Runs caps, the gate and the hand-over for one accepted connection; refuses with RST on any no.
    fn admit(
        &self,
        listener: &Accepting<'_>,
        listener_id: ListenerId,
        socket: OwnedFd,
        peer: std::net::SocketAddr,
        ids: &mut net_io_core::IdBlock,
        coalescer: &mut Coalescer,
    ) {
        let core = &self.core;
        let peer = normalize(peer);
        core.counters.server().record_accepted();
        // Counted and reported before the reset, so whoever sees the RST also sees the refusal.
        let refuse = |socket: OwnedFd, cause: RefusalCause, coalescer: &mut Coalescer| {
            core.counters.server().record_refused(cause);
            if core.events_enabled {
                let event = Event::Refused {
                    peer,
                    listener: listener_id,
                    cause,
                };
                // A panicking sink must not take the accept thread down with it.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    coalescer.emit(&*core.events, event, core.now())
                }));
            }
            reset(socket);
        };
        if self.lockdown.load(Ordering::Acquire) {
            return refuse(socket, RefusalCause::Lockdown, coalescer);
        }
        let mut reservation = match core.caps.reserve(&listener.settings.counts, peer.ip()) {
            Ok(reservation) => reservation,
            Err(refusal) => {
                let (cause, which) = match refusal {
                    CapRefusal::Global => (RefusalCause::GlobalCap, LimitKind::Connections),
                    CapRefusal::Listener => (RefusalCause::ListenerCap, LimitKind::PerListener),
                    CapRefusal::Source => (RefusalCause::SourceCap, LimitKind::PerSource),
                };
                if core.events_enabled {
                    let event = Event::LimitHit { id: None, which };
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        coalescer.emit(&*core.events, event, core.now())
                    }));
                }
                return refuse(socket, cause, coalescer);
            }
        };
        // Event loops take any number of connections (the caps bound them); workers take one each.
        if self.inboxes.is_empty() && !self.handover.has_room() {
            drop(reservation);
            return refuse(socket, RefusalCause::Busy, coalescer);
        }
        let id = ids.next_id();
        reservation.enroll(id.get());
        let mut local = listener.socket.local_addr();
        if local.ip().is_unspecified()
            && let Ok(actual) = socket::local_addr(socket.as_fd())
        {
            local = actual;
        }
        let mut info = ConnectionInfo::new(id, listener_id, local, peer, core.now());
        core.emit(Event::Accepted {
            id,
            peer,
            listener: listener_id,
        });
        let admission = match admit_or_refuse(&self.gate, &info) {
            Ok(admission) => admission,
            Err(Refusal::Reset { code }) => {
                drop(reservation);
                return refuse(socket, RefusalCause::Gate(code), coalescer);
            }
            Err(Refusal::Reply { code, bytes }) => {
                let limit = bytes.len().min(listener.settings.limits.refusal_bytes_max);
                // One non-blocking attempt only: the refusal path must not become an amplifier.
                let _ = socket::send(socket.as_fd(), &bytes[..limit]);
                drop(reservation);
                return refuse(socket, RefusalCause::Gate(code), coalescer);
            }
        };
        info.lane = admission.lane;
        let shed_lane = self.core.shed_lane.load(Ordering::Acquire);
        if u16::from(admission.lane.0) >= shed_lane {
            close_ticket(
                &self.gate,
                admission.ticket,
                &info,
                CloseReason::Refused(RefusalCause::Shed),
            );
            drop(reservation);
            return refuse(socket, RefusalCause::Shed, coalescer);
        }
        core.emit(Event::Admitted {
            id,
            lane: admission.lane,
        });
        let job = Job {
            socket,
            info,
            ticket: Some(admission.ticket),
            reservation,
            listener: Arc::clone(listener.settings),
            outbound: None,
        };
        self.place(job, listener.counter_slot);
    }

    /// Hands an admitted (or outbound) job to the loop with the fewest connections, or to the workers'
    /// hand-over queue; a job nobody can take is refused, its close counted in `counter_slot`.
    pub(crate) fn place(&self, job: Job<G::Ticket>, counter_slot: usize) {
        let core = &self.core;
        let id = job.info.id;
        if !self.inboxes.is_empty() {
            let loop_index = fewest_connections(&core.loops, id.get());
            core.loops[loop_index].add_load();
            match self.inboxes[loop_index].offer(job) {
                Ok(true) => {
                    let _ = core.loops[loop_index].wake.eventfd.signal();
                }
                Ok(false) => {}
                Err(job) => {
                    core.loops[loop_index].remove_load();
                    // An inbox closes when the server stops (its queue is closed after `stopping` is
                    // set), or when its loop could not start and no other loop runs: then the door is
                    // open but nothing can serve the connection, which is what `Busy` says.
                    let cause = if core.stopping.load(Ordering::Acquire) {
                        RefusalCause::DoorClosed
                    } else {
                        RefusalCause::Busy
                    };
                    self.refuse_job(job, cause, counter_slot);
                }
            }
            return;
        }
        if let Err(job) = self.handover.offer(job) {
            self.refuse_job(job, RefusalCause::Busy, counter_slot);
        }
    }

    /// Closes a job the gate already admitted but no worker will serve: it counts as admitted and closed with
    /// `Refused(cause)`, so the ticket, the `Closed` event and the stats all see one close.
    pub(crate) fn refuse_job(&self, job: Job<G::Ticket>, cause: RefusalCause, counter_slot: usize) {
        let Job {
            socket,
            info,
            ticket,
            reservation,
            outbound,
            ..
        } = job;
        let reason = CloseReason::Refused(cause);
        // Admitted but never served: a refusal in the figures like one at accept (and still one close).
        handshake::count_refusal(&self.core, &info, cause);
        if let Some(ticket) = ticket {
            close_ticket(&self.gate, ticket, &info, reason);
        }
        // An outbound job is refused on the thread that connected (or that stops the server): its
        // counters go to the outbound slot, one writer at a time.
        let _outbound_slot = outbound.as_ref().map(|_| self.outbound.lock_refusals());
        let counter_slot = if outbound.is_some() {
            self.core.outbound_slot()
        } else {
            counter_slot
        };
        if let Some(outbound) = outbound {
            self.workload.abandon(outbound.session, &info, reason);
        }
        self.core
            .counters
            .slot(counter_slot)
            .record_close(reason, 0, 0);
        self.core.emit_closed(&info, reason, 0, 0);
        drop(reservation);
        reset(socket);
    }

    /// Applies a control-line change, if the line moved and this accept thread is the one watching it (one
    /// at a time does, so each change is applied once; the watcher changes only when its listener is removed).
    fn watch_control(self: &Arc<Self>, listener_id: ListenerId) {
        let Some(control) = self
            .control
            .as_ref()
            .filter(|_| self.core.control_owner.load(Ordering::Acquire) == listener_id.0)
        else {
            return;
        };
        let state = self
            .control_watch
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .poll(control);
        if let Some(state) = state {
            self.react(state);
        }
    }

    /// Applies a control-line state on the accept thread.
    fn react(self: &Arc<Self>, state: ControlState) {
        let handle = crate::handle::ServerHandle {
            core: Arc::clone(&self.core),
        };
        self.core.emit(Event::ControlReacted { state });
        match state {
            ControlState::Running => {
                self.lockdown.store(false, Ordering::Release);
                self.core.shed_lane.store(u16::MAX, Ordering::Release);
                handle.open_door();
            }
            ControlState::Lockdown => self.lockdown.store(true, Ordering::Release),
            ControlState::Shed { lane } => {
                self.core
                    .shed_lane
                    .store(u16::from(lane.0), Ordering::Release);
                // Idle connections in a shed lane close now; busy ones close when they next go idle.
                self.core.for_each_slot(|slot, wake, _, slot_lane| {
                    if u16::from(slot_lane) < u16::from(lane.0) {
                        return false;
                    }
                    if let Some(id) = slot.occupant()
                        && slot.kill(id, CODE_SHED, net_io_sys::kill::KillCondition::OnlyIdle)
                    {
                        let _ = wake.signal();
                    }
                    false
                });
            }
            ControlState::Draining { deadline } => {
                let deadline = deadline.unwrap_or_else(|| {
                    crate::clock::deadline_after(Instant::now(), self.core.limits.drain_timeout)
                });
                handle.close_door();
                let _ = std::thread::Builder::new()
                    .name("net-io-drain".into())
                    .spawn(move || {
                        handle.drain(deadline);
                    });
            }
            ControlState::Stopping => {
                handle.close_door();
                handle.request_stop();
            }
        }
    }

    /// The loop of worker `index`: one connection at a time until the queue closes.
    pub(crate) fn worker_loop(self: Arc<Self>, index: usize) {
        let core = Arc::clone(&self.core);
        let shared = &core.workers[index];
        let Some(owner) = SlotOwner::claim(Arc::clone(&shared.slot)) else {
            return;
        };
        let mut link = Link::new(
            owner,
            Arc::clone(&shared.wake),
            Arc::clone(&shared.linger),
            Arc::clone(&core.clock),
            core.limits.tick,
            core.limits.min_rate,
            core.manual_clock,
        );
        let (_ring, mut receiver) = CompletionRing::with_capacity(core.limits.completion_queue);
        let waker = Waker::from(Arc::new(WakeSignal(Arc::clone(&shared.wake))));
        let mut state = self.workload.new_state(&core, &self.pool);
        let mut prefix = Vec::with_capacity(handshake::PREFIX_CAPACITY);
        while let Some(job) = self.handover.take() {
            core.busy_workers.fetch_add(1, Ordering::Relaxed);
            let busy = BusyGuard {
                core: &core,
                handover: &self.handover,
            };
            // Every hook is contained already; this catches a bug in the driver itself, so that the worker
            // (and its place in the Busy rule, given back by the guard) survives it.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.run_job(
                    index,
                    &mut link,
                    &mut receiver,
                    &waker,
                    &mut state,
                    &mut prefix,
                    job,
                    busy,
                )
            }));
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_job(
        &self,
        index: usize,
        link: &mut Link,
        receiver: &mut CompletionReceiver,
        waker: &Waker,
        state: &mut W::State,
        prefix: &mut Vec<u8>,
        job: Job<G::Ticket>,
        busy: BusyGuard<'_, G::Ticket>,
    ) {
        let core = &*self.core;
        let Job {
            socket,
            mut info,
            mut ticket,
            mut reservation,
            listener,
            outbound,
        } = job;
        info.worker = Some(WorkerId(index as u32));
        core.workers[index]
            .lane
            .store(info.lane.0, Ordering::Release);
        link.owner_mut().occupy(info.id.get(), socket);
        let listener_runtime = &*listener;
        let limits = &listener_runtime.limits;
        // An accepted socket inherits the listener's receive timeout; a socket we opened has none set yet.
        let inherited_timeout = outbound.is_none().then_some(limits.idle_timeout);
        link.reset(limits.min_rate, inherited_timeout);
        receiver.bind(info.id);
        let completer = receiver.completer(info.id, waker.clone());
        let kill = KillHandle {
            slot: Arc::clone(&core.workers[index].slot),
            wake: Arc::clone(&core.workers[index].wake),
            linger: Arc::clone(&core.workers[index].linger),
            id: info.id,
        };
        prefix.clear();
        let mut early: Option<CloseReason> = None;
        // TCP_NODELAY and keepalive were set on the listener; Linux copies them to every accepted socket,
        // so a connection costs no setsockopt here.
        if core.drain_expired.load(Ordering::Acquire) {
            early = Some(CloseReason::DrainDeadline);
        }
        if let Some(outbound) = outbound {
            let Outbound {
                session,
                deadline,
                nodelay,
                failed,
                started,
            } = outbound;
            // Adopted first, so that `closed` below gives it its one `on_close` however the connect ends.
            self.workload.adopt(state, session);
            if early.is_none() {
                early = failed;
            }
            if early.is_none() {
                match link.finish_connect(deadline, nodelay) {
                    Ok(()) => core.emit(Event::Connected {
                        id: info.id,
                        peer: info.peer,
                        took: core.now().saturating_duration_since(started),
                    }),
                    Err(reason) => early = Some(reason),
                }
            }
        } else if early.is_none()
            && let Some(mode) = listener_runtime.proxy
            && let Some(ticket) = ticket.as_mut()
        {
            let started = core.now();
            match handshake::read_proxy_header(
                link,
                &info,
                mode,
                &listener_runtime.trusted,
                limits,
                prefix,
            ) {
                Ok(Some(real_peer)) => {
                    info.set_real_peer(real_peer);
                    if reservation.move_source(real_peer.ip()).is_err() {
                        early = Some(handshake::source_cap_refused(core, &info));
                    } else if let Err(reason) = handshake::readmit(
                        core,
                        &self.gate,
                        ticket,
                        &info,
                        limits.refusal_bytes_max,
                        |bytes| {
                            let _ = link.send_once(bytes);
                        },
                    ) {
                        early = Some(reason);
                    } else {
                        core.emit(Event::ProxyResolved {
                            id: info.id,
                            real_peer,
                        });
                    }
                }
                Ok(None) => {}
                Err(reason) => early = Some(reason),
            }
            if early.is_none() {
                core.emit(Event::HandshakeDone {
                    id: info.id,
                    took: core.now().saturating_duration_since(started),
                });
            }
        }
        let reason = match early {
            Some(reason) => reason,
            None => {
                let gate = &self.gate;
                let ticket_ref = ticket.as_ref();
                let (id, lane) = (info.id, info.lane);
                let allow_all = TypeId::of::<G>() == TypeId::of::<AllowAll>();
                let mut check = move |bytes: usize, started: bool| {
                    // An outbound connection has no ticket: the gate admits peers, not our own connects.
                    let Some(ticket) = ticket_ref.filter(|_| !allow_all) else {
                        return Verdict::Allow;
                    };
                    check_or_deny(gate, ticket, &WriteFacts::new(id, lane, bytes, started))
                };
                self.workload.serve(
                    state,
                    Run {
                        link,
                        info: &info,
                        core,
                        limits,
                        check: &mut check,
                        completer: &completer,
                        receiver,
                        kill,
                        prefix,
                    },
                )
            }
        };
        // One winner: our own close or a killer that got there first (see `Link::close_as` for a kill
        // racing a graceful close's linger).
        let reason = link.close_as(
            info.id.get(),
            reason,
            limits.linger_timeout,
            limits.linger_bytes,
        );
        drop(completer);
        receiver.unbind();
        let stale = receiver.take_stale();
        if stale > 0 {
            core.counters.server().record_stale_completions(stale);
            core.emit(Event::StaleCompletion {
                worker: WorkerId(index as u32),
                count: stale,
            });
        }
        self.workload.closed(state, &info, reason);
        if let Some(ticket) = ticket {
            close_ticket(&self.gate, ticket, &info, reason);
        }
        core.counters
            .slot(index)
            .record_close(reason, link.bytes_in, link.bytes_out);
        // Caps and the worker are free before anyone can see the close, so a client that reconnects on the
        // Closed event is never refused by a connection that is already gone.
        drop(reservation);
        drop(busy);
        core.emit_closed(&info, reason, link.bytes_in, link.bytes_out);
    }
}

impl<G: Gate, W: Workload> Runtime<G, W> {
    /// Opens an outbound connection and hands it, with `session`, to a loop or a worker (see
    /// [`crate::outbound`]). Fails at once, dropping `session` without a hook, only when the server is
    /// stopping or draining, the session is not of the workload's type, the global cap is full, or no
    /// socket can be made; every later failure (a refusal, the connect deadline, a kill) reaches the
    /// session's `on_close`.
    pub(crate) fn connect_outbound(
        &self,
        address: SocketAddr,
        session: Box<dyn Any + Send>,
        given: &'static str,
        options: ConnectOptions,
    ) -> Result<ConnectionId, NetError> {
        let core = &*self.core;
        if core.stopping.load(Ordering::Acquire) || core.draining.load(Ordering::Acquire) {
            return Err(NetError::ShuttingDown);
        }
        let expected = self.workload.outbound_session();
        let Some((_, _)) = expected.filter(|(type_id, _)| (*session).type_id() == *type_id) else {
            return Err(NetError::WrongSessionType {
                expected: expected
                    .map_or("none: this server runs blocking handlers", |(_, name)| name),
                given,
            });
        };
        let address = normalize(address);
        let settings = Arc::clone(&self.outbound.settings);
        let Ok(mut reservation) = core.caps.reserve(&settings.counts, address.ip()) else {
            return Err(NetError::ConnectionCap {
                cap: core.limits.max_connections,
            });
        };
        let socket = socket::stream_socket_for(address).map_err(NetError::from)?;
        let started = core.now();
        // A failure connect(2) reports at once still goes through the connection's close, so the session
        // learns of it the one way it learns of every other.
        let failed = socket::start_connect(socket.as_fd(), address)
            .err()
            .map(|error| CloseReason::from_io(&error));
        let local = socket::local_addr(socket.as_fd()).unwrap_or_else(|_| {
            SocketAddr::new(
                match address {
                    SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
                    SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
                },
                0,
            )
        });
        let id = self.outbound.next_id();
        reservation.enroll(id.get());
        // From here the connection ends through its close, which is counted: so is its start, or `open`
        // would sink below the connections really open (to zero, on a stage whose links reconnected).
        core.counters.server().record_connected();
        let info = ConnectionInfo::outbound(id, local, address, started);
        let job = Job {
            socket,
            info,
            ticket: None,
            reservation,
            listener: settings,
            outbound: Some(Outbound {
                session,
                deadline: crate::clock::deadline_after(started, options.connect_timeout),
                nodelay: options.nodelay,
                failed,
                started,
            }),
        };
        self.place(job, core.outbound_slot());
        Ok(id)
    }
}

/// The server-wide parts of outbound connections.
pub(crate) struct OutboundShared {
    /// Settings every outbound connection shares, in place of a listener's: the server's limits, no PROXY,
    /// and counts that take only the global cap (the per-source caps guard us against peers, not the other
    /// way round).
    pub(crate) settings: Arc<ListenerRuntime>,
    ids: Mutex<IdBlock>,
    /// Serialises writes to the counters' outbound slot (any thread may connect, and a slot's counters have
    /// one writer at a time).
    refusals: Mutex<()>,
}

impl OutboundShared {
    pub(crate) fn new(limits: ResolvedLimits, ids: &IdAllocator) -> OutboundShared {
        OutboundShared {
            settings: Arc::new(ListenerRuntime {
                limits,
                proxy: None,
                trusted: TrustedProxies::default(),
                counts: Arc::new(ListenerCounts::new(ListenerCaps {
                    max_per_listener: limits.max_connections,
                    max_per_source: limits.max_connections,
                    policy: limits.source_prefix,
                })),
            }),
            ids: Mutex::new(ids.block()),
            refusals: Mutex::new(()),
        }
    }

    pub(crate) fn next_id(&self) -> ConnectionId {
        self.ids
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .next_id()
    }

    /// Held while a thread that is not a loop or a worker records an outbound connection's close.
    pub(crate) fn lock_refusals(&self) -> MutexGuard<'_, ()> {
        self.refusals
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What an accept thread holds of its listener while it admits.
struct Accepting<'a> {
    socket: &'a Listener,
    settings: &'a Arc<ListenerRuntime>,
    /// Its close slot in the counters (absolute).
    counter_slot: usize,
}

/// Marks a worker free again when dropped: at the normal end of a connection, or while unwinding.
struct BusyGuard<'a, T> {
    core: &'a Core,
    handover: &'a HandOver<Job<T>>,
}

impl<T> Drop for BusyGuard<'_, T> {
    fn drop(&mut self) {
        self.core.busy_workers.fetch_sub(1, Ordering::Relaxed);
        self.handover.done();
    }
}

/// Resets a connection: linger zero, then close, so the kernel sends RST and nothing lingers in TIME_WAIT.
pub(crate) fn reset(socket: OwnedFd) {
    let _ = socket::set_linger(socket.as_fd(), Linger::Abortive);
    drop(socket);
}

fn socket_reserve() -> Option<OwnedFd> {
    net_io_sys::rlimit::open_reserve().ok()
}

/// The loop with the fewest connections (queued or held); ties go to the first one at or after `id` modulo the
/// loop count, so equal loads still spread. One relaxed load per loop: two accept threads placing at the same
/// moment may pick the same loop, which the next placements even out.
fn fewest_connections(loops: &[LoopShared], id: u64) -> usize {
    let count = loops.len().max(1);
    let start = (id % count as u64) as usize;
    let mut best = start;
    let mut best_load = usize::MAX;
    for offset in 0..loops.len() {
        let index = (start + offset) % count;
        let load = loops[index].load();
        if load < best_load {
            best = index;
            best_load = load;
        }
    }
    best
}
