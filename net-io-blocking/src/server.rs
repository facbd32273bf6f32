//! The running server: its shared state, the [`Server`] owner, the cloneable [`ServerHandle`], the per-connection
//! [`KillHandle`], drain and shutdown, and the set of live listeners that can grow and shrink while it runs.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use net_io_core::{
    CloseReason, Coalescer, ConnectionId, ConnectionInfo, Counters, Event, EventSink, ListenerId,
    NetError, ResolvedLimits, Stats,
};
use net_io_sys::eventfd::EventFd;
use net_io_sys::kill::{KillCondition, KillSlot};

use crate::builder::{LISTENERS_MAX, ListenerSpec};
use crate::caps::Caps;
use crate::clock::SharedClock;
use crate::evloop::LoopShared;
use crate::runtime::ListenerRuntime;

/// Slot codes at or above this value are the driver's own; user kill codes are capped just below.
pub(crate) const RESERVED_CODES: u16 = 0xff00;
/// Kill code: closed by a drain while idle (graceful).
pub(crate) const CODE_DRAINED: u16 = 0xff01;
/// Kill code: still busy at the drain deadline (abortive).
pub(crate) const CODE_DRAIN_DEADLINE: u16 = 0xff02;
/// Kill code: the server shut down.
pub(crate) const CODE_SHUTDOWN: u16 = 0xff03;
/// Kill code: shed by the control line.
pub(crate) const CODE_SHED: u16 = 0xff04;

/// The close reason a slot code stands for.
pub(crate) fn reason_for_code(code: u16) -> CloseReason {
    match code {
        CODE_DRAINED => CloseReason::Drained,
        CODE_DRAIN_DEADLINE => CloseReason::DrainDeadline,
        CODE_SHUTDOWN => CloseReason::Shutdown,
        CODE_SHED => CloseReason::Shed,
        code => CloseReason::Killed(code),
    }
}

/// What a drain did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainReport {
    /// Connections that closed on their own or as idle (`Drained`, or `Shutdown` when the drain is part of a
    /// [`Server::shutdown`]) before the deadline.
    pub graceful: u64,
    /// Connections still busy at the deadline and killed (`DrainDeadline`).
    pub killed: u64,
    /// How long the drain took.
    pub elapsed: Duration,
}

/// One worker's shared parts: its kill slot and its wake.
#[derive(Debug)]
pub(crate) struct WorkerShared {
    pub(crate) slot: Arc<KillSlot>,
    pub(crate) wake: Arc<EventFd>,
    /// The id of the connection whose graceful close is lingering on this worker, 0 otherwise.
    pub(crate) linger: Arc<AtomicU64>,
    /// The lane of the connection the worker holds, for shedding.
    pub(crate) lane: AtomicU8,
}

/// What one listener's accept thread shares with the handles: its wake, its own door and its removal.
#[derive(Debug)]
pub(crate) struct Acceptor {
    pub(crate) id: ListenerId,
    pub(crate) local: SocketAddr,
    pub(crate) wake: EventFd,
    /// This listener's part of the door: a listener added at run time stays closed until the next
    /// [`ServerHandle::open_door`], even while the server's door is open, so its caller can finish set-up.
    pub(crate) door_open: AtomicBool,
    /// Set by [`ServerHandle::remove_listener`]: the accept thread returns and its socket closes.
    pub(crate) closing: AtomicBool,
}

/// One live listener: its accept thread's shared parts, its settings and the thread itself.
pub(crate) struct LiveListener {
    pub(crate) acceptor: Arc<Acceptor>,
    pub(crate) settings: Arc<ListenerRuntime>,
    pub(crate) thread: Option<JoinHandle<()>>,
    /// The accept thread's close slot in the counters, relative to [`Core::close_slot_base`].
    pub(crate) counter_slot: usize,
}

/// The live listeners, in the order they were added, and which accept-thread counter slots they hold.
#[derive(Default)]
pub(crate) struct ListenerSet {
    pub(crate) live: Vec<LiveListener>,
    /// Bit `i` set: counter slot `i` belongs to a live accept thread. A slot is given back only once its
    /// thread was joined, so each slot has one writer at a time (the counters are single-writer seqlocks).
    pub(crate) counter_slots: u64,
}

/// No listener watches the control line (every one was removed).
pub(crate) const NO_LISTENER: u32 = u32::MAX;

/// Everything the threads and handles of one server share, independent of the gate and workload types.
pub(crate) struct Core {
    pub(crate) limits: ResolvedLimits,
    pub(crate) clock: SharedClock,
    pub(crate) manual_clock: bool,
    pub(crate) events: Arc<dyn EventSink>,
    pub(crate) events_enabled: bool,
    pub(crate) counters: Counters,
    pub(crate) caps: Arc<Caps>,
    pub(crate) workers: Vec<WorkerShared>,
    /// The event loops' shared parts; empty when connections run on worker threads.
    pub(crate) loops: Vec<LoopShared>,
    /// The live listeners. Locked to add or remove one, to open the door, and to list addresses; never by
    /// the accept or serving paths.
    pub(crate) listeners: Mutex<ListenerSet>,
    /// The next listener id: ids are never reused, so a stale id cannot name a newer listener.
    pub(crate) next_listener: AtomicU32,
    /// The listener whose accept thread watches the control line ([`NO_LISTENER`] when none).
    pub(crate) control_owner: AtomicU32,
    /// The address of the first listener the server was built with, for `local_addr` once it is gone.
    pub(crate) first_local: SocketAddr,
    /// The generic runtime, to start accept threads for listeners added at run time. Weak: the runtime
    /// holds the core, and the [`Server`] holds the runtime.
    pub(crate) runtime: OnceLock<Weak<dyn RuntimeControl>>,
    pub(crate) door_open: AtomicBool,
    pub(crate) draining: AtomicBool,
    pub(crate) drain_expired: AtomicBool,
    pub(crate) stopping: AtomicBool,
    pub(crate) stop_requested: Mutex<bool>,
    pub(crate) stop_signal: Condvar,
    pub(crate) busy_workers: AtomicU64,
    /// Lanes at or above this value are shed; `u16::MAX` sheds nothing.
    pub(crate) shed_lane: AtomicU16,
    pub(crate) drain_lock: Mutex<()>,
    /// Flood control for the events serving threads raise in bulk (a refusal after the PROXY header, a
    /// coroutine stack the kernel would not map): one coalescer shared by those threads, so a flood costs a
    /// lock per connection that already paid for an accept, and the sink sees at most the threshold a second.
    pub(crate) serving_coalescer: Mutex<Coalescer>,
    /// Set when `serving_coalescer` holds folded counts, so a close can report them once their second is over
    /// without taking the lock on every close.
    pub(crate) serving_folded: AtomicBool,
}

/// The parts of the generic runtime that the server's handles reach: closing the hand-over queue and
/// starting a listener at run time.
pub(crate) trait RuntimeControl: Send + Sync {
    fn close_queue(&self);

    /// Opens an outbound connection driven by `session` (see [`ServerHandle::connect`]).
    fn connect(
        self: Arc<Self>,
        address: SocketAddr,
        session: Box<dyn std::any::Any + Send>,
        given: &'static str,
        options: crate::outbound::ConnectOptions,
    ) -> Result<ConnectionId, NetError>;

    /// Validates and binds `spec` as the builder does, then starts its accept thread with its door closed.
    fn start_listener(self: Arc<Self>, spec: ListenerSpec) -> Result<ListenerId, NetError>;
}

/// A cloneable, thread-safe handle to a running server: kill, door, drain, stop, stats.
#[derive(Clone)]
pub struct ServerHandle {
    pub(crate) core: Arc<Core>,
}

/// Ends one connection from any thread. Cheap to clone.
#[derive(Clone, Debug)]
pub struct KillHandle {
    pub(crate) slot: Arc<KillSlot>,
    pub(crate) wake: Arc<EventFd>,
    pub(crate) linger: Arc<AtomicU64>,
    pub(crate) id: ConnectionId,
}

/// A running server. Dropping it runs [`Server::shutdown`] with the configured `drain_timeout`.
#[must_use = "dropping the server shuts it down at once"]
pub struct Server {
    handle: ServerHandle,
    threads: Vec<JoinHandle<()>>,
    closer: Arc<dyn RuntimeControl>,
    finished: bool,
}

impl Core {
    pub(crate) fn emit(&self, event: Event) {
        if self.events_enabled {
            let sink = &self.events;
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink.emit(event)));
        }
    }

    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Emits an event a serving thread may raise once per connection in a flood, through the shared
    /// coalescer (see [`Coalescer`]): past the threshold in one second it is counted, and the count is
    /// reported as one [`Event::Coalesced`] once the second is over.
    pub(crate) fn emit_coalesced(&self, event: Event) {
        if !self.events_enabled {
            return;
        }
        let now = self.now();
        let mut coalescer = self
            .serving_coalescer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let sink = &self.events;
        // A panicking sink must not take the serving thread down with it.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            coalescer.emit(&**sink, event, now)
        }));
        let folded = coalescer.has_folded();
        drop(coalescer);
        let was_folded = self.serving_folded.swap(folded, Ordering::Relaxed);
        if folded && !was_folded {
            // The accept threads report the count once its second is over (see `serving_flush_due`), even if
            // no connection closes after the flood; one may be asleep with no deadline, so wake them. At most
            // once a second in a flood.
            self.wake_acceptors();
        }
    }

    /// When the counts folded by [`Core::emit_coalesced`] are due for [`Core::flush_coalesced`], if any are:
    /// the accept threads sleep until then at most.
    pub(crate) fn serving_flush_due(&self) -> Option<Instant> {
        if !self.serving_folded.load(Ordering::Relaxed) {
            return None;
        }
        self.serving_coalescer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .flush_due()
    }

    /// Reports counts folded by [`Core::emit_coalesced`] once their second is over. Cheap when nothing was
    /// folded (one relaxed load), so it runs on every close.
    pub(crate) fn flush_coalesced(&self) {
        if !self.serving_folded.load(Ordering::Relaxed) {
            return;
        }
        let now = self.now();
        let Ok(mut coalescer) = self.serving_coalescer.try_lock() else {
            // Someone else is emitting; their emit flushes a finished second first.
            return;
        };
        let sink = &self.events;
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            coalescer.flush(&**sink, now)
        }));
        self.serving_folded
            .store(coalescer.has_folded(), Ordering::Relaxed);
    }

    /// The events of one close, after its caps were freed: the event naming the cause when the reason has
    /// one (a kill, a limit, a gate denial), then `Closed`. Both drivers end every connection here.
    pub(crate) fn emit_closed(
        &self,
        info: &ConnectionInfo,
        reason: CloseReason,
        bytes_in: u64,
        bytes_out: u64,
    ) {
        match reason {
            CloseReason::Killed(code) => self.emit(Event::Killed { id: info.id, code }),
            CloseReason::Limit(which) => self.emit(Event::LimitHit {
                id: Some(info.id),
                which,
            }),
            CloseReason::EgressDenied(code) => self.emit(Event::EgressDenied { id: info.id, code }),
            _ => {}
        }
        self.emit(Event::Closed {
            id: info.id,
            reason,
            bytes_in,
            bytes_out,
            lifetime: self.now().saturating_duration_since(info.accepted_at),
        });
        self.flush_coalesced();
    }

    /// Why an idle connection closes while the server drains: `Shutdown` once [`Server::shutdown`] (or a drop,
    /// or [`Server::run_until_stopped`]) has begun, since the server is going away; `Drained` for a drain on
    /// its own, after which the server could still be kept or handed over.
    pub(crate) fn idle_close_reason(&self) -> CloseReason {
        if self.stopping.load(Ordering::Acquire) {
            CloseReason::Shutdown
        } else {
            CloseReason::Drained
        }
    }

    /// Whether a connection in `lane` should close instead of waiting idle.
    pub(crate) fn is_shed(&self, lane: net_io_core::Lane) -> bool {
        u16::from(lane.0) >= self.shed_lane.load(Ordering::Acquire)
    }

    /// The share of busy workers for `SessionContext::pressure` (with event loops, the share of the
    /// connection cap in use), 1.0 while shedding.
    pub(crate) fn pressure(&self) -> f32 {
        if self.shed_lane.load(Ordering::Relaxed) != u16::MAX {
            return 1.0;
        }
        if !self.loops.is_empty() {
            let open = self.caps.open() as f32;
            return (open / self.limits.max_connections.max(1) as f32).min(1.0);
        }
        let busy = self.busy_workers.load(Ordering::Relaxed) as f32;
        (busy / self.workers.len().max(1) as f32).min(1.0)
    }

    /// Wakes every accept thread (door or stop changed).
    pub(crate) fn wake_acceptors(&self) {
        for listener in &self.lock_listeners().live {
            let _ = listener.acceptor.wake.signal();
        }
    }

    pub(crate) fn lock_listeners(&self) -> MutexGuard<'_, ListenerSet> {
        self.listeners
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The first counter slot after the workers' and the loops': [`LISTENERS_MAX`] slots for accept
    /// threads follow, then one for the thread that shuts down ([`Core::shutdown_slot`]).
    pub(crate) fn close_slot_base(&self) -> usize {
        self.workers.len() + self.loops.len()
    }

    /// The counter slot of the thread that shuts the server down.
    pub(crate) fn shutdown_slot(&self) -> usize {
        self.close_slot_base() + LISTENERS_MAX
    }

    /// The counter slot for outbound connections closed before a loop or worker took them (written under
    /// the outbound lock, since any thread may connect).
    pub(crate) fn outbound_slot(&self) -> usize {
        self.shutdown_slot() + 1
    }

    /// Adds a bound listener to the live set and starts its accept thread with `spawn`, under the set's
    /// lock so that a concurrent stop or `open_door` sees it. Fails when the server is stopping or already
    /// has [`LISTENERS_MAX`] listeners; the socket is then dropped with nothing started.
    pub(crate) fn register_listener(
        &self,
        settings: Arc<ListenerRuntime>,
        local: SocketAddr,
        backlog: u32,
        door_open: bool,
        spawn: impl FnOnce(Arc<Acceptor>, usize) -> std::io::Result<JoinHandle<()>>,
    ) -> Result<ListenerId, NetError> {
        let mut set = self.lock_listeners();
        if self.stopping.load(Ordering::Acquire) {
            return Err(NetError::ShuttingDown);
        }
        if set.live.len() >= LISTENERS_MAX {
            return Err(net_io_core::ConfigError::TooLarge {
                field: "listeners",
                value: set.live.len() as u64 + 1,
                max: LISTENERS_MAX as u64,
            }
            .into());
        }
        let counter_slot = (!set.counter_slots).trailing_zeros() as usize;
        let id = ListenerId(self.next_listener.fetch_add(1, Ordering::AcqRel));
        let acceptor = Arc::new(Acceptor {
            id,
            local,
            wake: EventFd::new()?,
            door_open: AtomicBool::new(door_open),
            closing: AtomicBool::new(false),
        });
        let thread = spawn(Arc::clone(&acceptor), counter_slot)?;
        set.counter_slots |= 1 << counter_slot;
        set.live.push(LiveListener {
            acceptor,
            settings,
            thread: Some(thread),
            counter_slot,
        });
        // The first listener to arrive while none watches the control line takes it over.
        let _ = self.control_owner.compare_exchange(
            NO_LISTENER,
            id.0,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        drop(set);
        self.emit(Event::ListenerOpened {
            listener: id,
            local,
            backlog,
        });
        Ok(id)
    }

    /// Stops and joins the accept thread of `live` (its socket closes as the thread returns), gives its
    /// counter slot back and reports the listener closed.
    fn retire_listener(&self, mut live: LiveListener) {
        live.acceptor.closing.store(true, Ordering::Release);
        let _ = live.acceptor.wake.signal();
        let mut joined = true;
        if let Some(thread) = live.thread.take() {
            if thread.thread().id() == std::thread::current().id() {
                // Removed from its own accept thread (a gate or an event sink did it): it returns when this
                // call does. Its counter slot stays taken, since it may still write to it.
                joined = false;
            } else {
                let _ = thread.join();
            }
        }
        if joined {
            self.lock_listeners().counter_slots &= !(1 << live.counter_slot);
        }
        self.emit(Event::ListenerClosed {
            listener: live.acceptor.id,
        });
    }

    /// Visits every connection slot (workers', then every loop's) with its owner's wake, its linger word and
    /// its lane, until `visit` returns true. A loop's slots are scanned under its lock: O(slots) per call.
    pub(crate) fn for_each_slot(
        &self,
        mut visit: impl FnMut(&KillSlot, &EventFd, &AtomicU64, u8) -> bool,
    ) {
        for worker in &self.workers {
            if visit(
                &worker.slot,
                &worker.wake,
                &worker.linger,
                worker.lane.load(Ordering::Acquire),
            ) {
                return;
            }
        }
        for event_loop in &self.loops {
            let slots = event_loop.slots();
            for slot in slots.iter() {
                if visit(
                    &slot.slot,
                    &event_loop.wake.eventfd,
                    &slot.linger,
                    slot.lane.load(Ordering::Acquire),
                ) {
                    return;
                }
            }
        }
    }

    fn kill_where(&self, id: ConnectionId, code: u16, condition: KillCondition) -> bool {
        // Event loops: one lookup by id per loop, not a scan of every slot under the loop's lock.
        for event_loop in &self.loops {
            let Some(slot) = event_loop.find(id.get()) else {
                continue;
            };
            let wake = &event_loop.wake.eventfd;
            if slot.slot.kill(id.get(), code, condition) {
                let _ = wake.signal();
                return true;
            }
            if condition == KillCondition::Always {
                cut_linger(&slot.linger, wake, id.get());
            }
            return false;
        }
        if !self.loops.is_empty() {
            // No loop holds it: closed already, or still queued for a loop (as for a worker's queue).
            return false;
        }
        let mut won = false;
        self.for_each_slot(|slot, wake, _, _| {
            if slot.occupant() == Some(id.get()) && slot.kill(id.get(), code, condition) {
                let _ = wake.signal();
                won = true;
            }
            won
        });
        if !won && condition == KillCondition::Always {
            self.for_each_slot(|_, wake, linger, _| cut_linger(linger, wake, id.get()));
        }
        won
    }

    /// Cuts every lingering graceful close short (they end with an RST); used at the drain deadline.
    fn cut_all_lingers(&self) {
        self.for_each_slot(|_, wake, linger, _| {
            if linger.swap(0, Ordering::AcqRel) != 0 {
                let _ = wake.signal();
            }
            false
        });
    }
}

impl ServerHandle {
    /// The address of the first live listener (with the real port when port 0 was asked for); once every
    /// listener was removed, the address of the first one the server was built with.
    pub fn local_addr(&self) -> SocketAddr {
        self.core
            .lock_listeners()
            .live
            .first()
            .map_or(self.core.first_local, |listener| listener.acceptor.local)
    }

    /// The addresses of every live listener, in the order they were added.
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.core
            .lock_listeners()
            .live
            .iter()
            .map(|listener| listener.acceptor.local)
            .collect()
    }

    /// The ids of every live listener, in the order they were added (the builder's first, from 0).
    pub fn listener_ids(&self) -> Vec<ListenerId> {
        self.core
            .lock_listeners()
            .live
            .iter()
            .map(|listener| listener.acceptor.id)
            .collect()
    }

    /// The address of live listener `id`, or `None` if it is unknown or was removed.
    pub fn listener_addr(&self, id: ListenerId) -> Option<SocketAddr> {
        self.core
            .lock_listeners()
            .live
            .iter()
            .find(|listener| listener.acceptor.id == id)
            .map(|listener| listener.acceptor.local)
    }

    /// Binds a new listener while the server runs, with the builder's validation (its limits laid over the
    /// server's, the per-listener cap under the global one, a PROXY mode with trusted proxies; an address in
    /// use is named in the error), and starts its accept thread. Its connections go to the same workers or
    /// event loops as every other listener's.
    ///
    /// The new listener stays closed, even if the server's door is open, until the next
    /// [`open_door`](Self::open_door): connections wait in its backlog until then, so the caller can finish
    /// its set-up (register the address, open a firewall) first. Its id is new, never one of a removed
    /// listener. Fails with `ShuttingDown` once a stop began, and when [`LISTENERS_MAX`] listeners are live.
    /// A spec made for an inherited listener ([`ServerBuilder::adopt_with`](crate::ServerBuilder::adopt_with))
    /// is refused: adopt inherited listeners in the builder.
    pub fn add_listener(&self, spec: ListenerSpec) -> Result<ListenerId, NetError> {
        let Some(runtime) = self.core.runtime.get().and_then(Weak::upgrade) else {
            return Err(NetError::ServerStopped);
        };
        runtime.start_listener(spec)
    }

    /// Opens a TCP connection to `address` from this server and drives `session` on it, on the same loops
    /// (or workers) as accepted connections and with the same guarantees: the server's limits and phase
    /// deadlines, park and the completion ring, kill by id, drain, stats and events. Returns the new
    /// connection's id at once; the connect runs in the background under `options.connect_timeout`.
    ///
    /// The session's `on_open` runs once the TCP handshake is done. A refused connect, an unreachable
    /// address, the connect deadline ([`CloseReason::ConnectTimeout`]), a kill or the drain deadline instead
    /// reach its `on_close` with their reason, exactly once, as every later close does. Its
    /// [`ConnectionInfo`] says it is outbound (`origin` is `Connected`, `listener` is
    /// [`ListenerId::OUTBOUND`]); the gate is not asked about it, since the gate admits peers that come to
    /// us. It counts against `max_connections` (no per-listener or per-source cap applies).
    ///
    /// Fails at once, dropping `session` without calling any hook, when `session` is not of the type the
    /// server's factory makes ([`NetError::WrongSessionType`]; a handler server takes none), when the server
    /// is draining or stopping ([`NetError::ShuttingDown`], [`NetError::ServerStopped`]), when the global cap
    /// is full ([`NetError::ConnectionCap`]), or when no socket can be made ([`NetError::Os`]).
    ///
    /// ```no_run
    /// use std::net::SocketAddr;
    /// use net_io_blocking::{ConnectOptions, Input, Session, SessionContext, Step, serve_sessions};
    ///
    /// struct Hello;
    /// impl Session for Hello {
    ///     fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
    ///         let _ = context.output().push_static(b"hello\n");
    ///         Step::Write
    ///     }
    ///     fn on_data(&mut self, input: &mut Input<'_>, _: &mut SessionContext<'_>) -> Step {
    ///         input.consume(input.len());
    ///         Step::Read
    ///     }
    /// }
    ///
    /// let server = serve_sessions("127.0.0.1:0", |_: &net_io_blocking::ConnectionInfo| Some(Hello))?;
    /// let peer: SocketAddr = "127.0.0.1:7000".parse().unwrap();
    /// let id = server.handle().connect(peer, Hello, ConnectOptions::new())?;
    /// println!("connecting as {id}");
    /// # Ok::<(), net_io_blocking::NetError>(())
    /// ```
    pub fn connect<S: net_io_core::Session>(
        &self,
        address: SocketAddr,
        session: S,
        options: crate::outbound::ConnectOptions,
    ) -> Result<ConnectionId, NetError> {
        let Some(runtime) = self.core.runtime.get().and_then(Weak::upgrade) else {
            return Err(NetError::ServerStopped);
        };
        if self.core.stopping.load(Ordering::Acquire) {
            return Err(NetError::ShuttingDown);
        }
        runtime.connect(
            address,
            Box::new(session),
            std::any::type_name::<S>(),
            options,
        )
    }

    /// Removes listener `id` while the server runs: closes its socket at once (its port refuses new
    /// connects; connections still in its backlog are reset), joins its accept thread, then drains only
    /// its connections until `drain_deadline`: idle ones close at once (`Drained`, graceful), busy ones
    /// finish their exchange and close when they next go idle, and those still open at the deadline are
    /// killed (`DrainDeadline`). Every other listener and connection is left alone; the server's door and
    /// its `is_draining` do not change. Returns when the listener's last connection closed (or a second
    /// after the deadline kills, at the latest), with what the drain did.
    ///
    /// Reports `ListenerClosed` (no `DrainStarted`/`DrainFinished`: those are the server's own drain).
    /// An id that is unknown or already removed is an error, and so is a second concurrent removal of it.
    /// If the listener watching the control line is removed, the next live one takes the line over.
    /// Called on the listener's own accept thread (from a gate or an event sink), it cannot join that
    /// thread: the socket then closes when the call returns and the thread ends, and the drain runs on it.
    /// Called from a connection's own worker or loop, the drain waits for that connection like any other.
    pub fn remove_listener(
        &self,
        id: ListenerId,
        drain_deadline: Instant,
    ) -> Result<DrainReport, NetError> {
        let started = Instant::now();
        let live = {
            let mut set = self.core.lock_listeners();
            let Some(position) = set
                .live
                .iter()
                .position(|listener| listener.acceptor.id == id)
            else {
                return Err(NetError::UnknownListener { listener: id });
            };
            let live = set.live.remove(position);
            if self.core.control_owner.load(Ordering::Acquire) == id.0 {
                let next = set
                    .live
                    .first()
                    .map_or(NO_LISTENER, |next| next.acceptor.id.0);
                self.core.control_owner.store(next, Ordering::Release);
                if let Some(next) = set.live.first() {
                    let _ = next.acceptor.wake.signal();
                }
            }
            live
        };
        let settings = Arc::clone(&live.settings);
        self.core.retire_listener(live);
        Ok(self.drain_listener(&settings, drain_deadline, started))
    }

    /// Drains the connections of one removed listener (see [`remove_listener`](Self::remove_listener)).
    fn drain_listener(
        &self,
        settings: &ListenerRuntime,
        deadline: Instant,
        started: Instant,
    ) -> DrainReport {
        let counts = &settings.counts;
        let open_at_start = counts.open() as u64;
        let tick = self.core.limits.tick.max(Duration::from_millis(1));
        let mut killed = 0u64;
        // Kills every occupant of a slot that belongs to this listener under `condition`; returns how many
        // kills won. Members are listed first so that no set lock is held while a loop's slots are locked.
        let kill_members = |code: u16, condition: KillCondition| -> u64 {
            let members = counts.members();
            let mut won = 0;
            self.core.for_each_slot(|slot, wake, _, _| {
                if let Some(id) = slot.occupant()
                    && members.binary_search(&id).is_ok()
                    && slot.kill(id, code, condition)
                {
                    won += 1;
                    let _ = wake.signal();
                }
                false
            });
            won
        };
        loop {
            if counts.open() == 0 {
                break;
            }
            if Instant::now() >= deadline {
                killed += kill_members(CODE_DRAIN_DEADLINE, KillCondition::Always);
                let members = counts.members();
                self.core.for_each_slot(|_, wake, linger, _| {
                    let lingering = linger.load(Ordering::Acquire);
                    if lingering != 0 && members.binary_search(&lingering).is_ok() {
                        cut_linger(linger, wake, lingering);
                    }
                    false
                });
                // Connections still queued for a worker or a loop reach a slot soon: kill them there.
                let limit = Instant::now() + Duration::from_secs(1);
                while counts.open() > 0 && Instant::now() < limit {
                    std::thread::sleep(tick);
                    killed += kill_members(CODE_DRAIN_DEADLINE, KillCondition::Always);
                }
                break;
            }
            let idle_code = if self.core.idle_close_reason() == CloseReason::Shutdown {
                CODE_SHUTDOWN
            } else {
                CODE_DRAINED
            };
            kill_members(idle_code, KillCondition::OnlyIdle);
            let left = deadline.saturating_duration_since(Instant::now());
            std::thread::sleep(tick.min(left).max(Duration::from_micros(100)));
        }
        DrainReport {
            graceful: open_at_start.saturating_sub(killed),
            killed,
            elapsed: started.elapsed(),
        }
    }

    /// A consistent snapshot of the counters.
    pub fn stats(&self) -> Stats {
        self.core.counters.snapshot()
    }

    /// Connections admitted and not yet closed (including those waiting for a worker).
    pub fn open_connections(&self) -> usize {
        self.core.caps.open()
    }

    /// Ends connection `id` with `Killed(code)` (codes of 0xff00 and above are the driver's and are lowered
    /// to 0xfeff). Returns `false` if the connection is not open on this server or someone else closed it
    /// first. Only the connection's worker closes the socket; this call shuts its read side and wakes it.
    pub fn kill(&self, id: ConnectionId, code: u16) -> bool {
        self.core
            .kill_where(id, code.min(RESERVED_CODES - 1), KillCondition::Always)
    }

    /// The ids of the connections workers hold right now.
    pub fn connections(&self) -> Vec<ConnectionId> {
        let mut ids = Vec::new();
        self.core.for_each_slot(|slot, _, _, _| {
            if let Some(id) = slot.occupant().and_then(ConnectionId::new) {
                ids.push(id);
            }
            false
        });
        ids
    }

    /// Starts accepting, on every listener including those added since the last call. Idempotent; the
    /// door starts closed until `build` finishes or this is called. Does nothing once a drain or stop began.
    pub fn open_door(&self) {
        if self.core.stopping.load(Ordering::Acquire) || self.core.draining.load(Ordering::Acquire)
        {
            return;
        }
        // Listeners added at run time open here; set under the set's lock, so one added concurrently is
        // either opened now or by the next call.
        let newly_opened: Vec<Arc<Acceptor>> = self
            .core
            .lock_listeners()
            .live
            .iter()
            .filter(|listener| !listener.acceptor.door_open.swap(true, Ordering::AcqRel))
            .map(|listener| Arc::clone(&listener.acceptor))
            .collect();
        if !self.core.door_open.swap(true, Ordering::AcqRel) {
            self.core.emit(Event::DoorOpened);
            self.core.wake_acceptors();
        } else {
            for acceptor in newly_opened {
                let _ = acceptor.wake.signal();
            }
        }
    }

    /// Stops accepting. The listeners stay bound; new connections wait in the kernel backlog. Idempotent.
    pub fn close_door(&self) {
        if self.core.door_open.swap(false, Ordering::AcqRel) {
            self.core.emit(Event::DoorClosed);
            self.core.wake_acceptors();
        }
    }

    /// Whether the door is open.
    pub fn is_door_open(&self) -> bool {
        self.core.door_open.load(Ordering::Acquire)
    }

    /// Whether a drain has started.
    pub fn is_draining(&self) -> bool {
        self.core.draining.load(Ordering::Acquire)
    }

    /// Interrupts every worker's wait (parked sessions and sends waiting for room see a wake).
    pub fn wake_all(&self) {
        for worker in &self.core.workers {
            let _ = worker.wake.signal();
        }
        for event_loop in &self.core.loops {
            let _ = event_loop.wake.eventfd.signal();
        }
    }

    /// Closes the door, closes idle connections at once (`Drained`, graceful), lets busy ones finish, and
    /// kills what is still open at `deadline` (`DrainDeadline`, abortive). A deadline already past kills at
    /// once. Returns when every connection is closed (or a second after the deadline kills, at the latest).
    /// The drain that [`Server::shutdown`] runs closes idle connections with `Shutdown` instead.
    pub fn drain(&self, deadline: Instant) -> DrainReport {
        let _serial = self
            .core
            .drain_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let started = Instant::now();
        self.close_door();
        self.core.draining.store(true, Ordering::Release);
        let open_at_start = self.core.caps.open() as u64;
        self.core.emit(Event::DrainStarted {
            open: open_at_start,
        });
        let tick = self.core.limits.tick.max(Duration::from_millis(1));
        let mut killed = 0u64;
        loop {
            if self.core.caps.open() == 0 {
                break;
            }
            if Instant::now() >= deadline {
                self.core.for_each_slot(|slot, wake, _, _| {
                    if let Some(id) = slot.occupant()
                        && slot.kill(id, CODE_DRAIN_DEADLINE, KillCondition::Always)
                    {
                        killed += 1;
                        let _ = wake.signal();
                    }
                    false
                });
                // Graceful closes still lingering end now too, with an RST.
                self.core.cut_all_lingers();
                // Connections still queued for a worker are closed by it at once (it sees the expiry).
                self.core.drain_expired.store(true, Ordering::Release);
                let limit = Instant::now() + Duration::from_secs(1);
                while self.core.caps.open() > 0 && Instant::now() < limit {
                    std::thread::sleep(tick);
                }
                break;
            }
            let idle_code = if self.core.idle_close_reason() == CloseReason::Shutdown {
                CODE_SHUTDOWN
            } else {
                CODE_DRAINED
            };
            self.core.for_each_slot(|slot, wake, _, _| {
                if let Some(id) = slot.occupant()
                    && slot.kill(id, idle_code, KillCondition::OnlyIdle)
                {
                    let _ = wake.signal();
                }
                false
            });
            let left = deadline.saturating_duration_since(Instant::now());
            std::thread::sleep(tick.min(left).max(Duration::from_micros(100)));
        }
        let report = DrainReport {
            graceful: open_at_start.saturating_sub(killed),
            killed,
            elapsed: started.elapsed(),
        };
        self.core.emit(Event::DrainFinished {
            graceful: report.graceful,
            killed: report.killed,
        });
        report
    }

    /// Asks whoever waits in [`wait_for_stop`](Self::wait_for_stop) to stop the server. Safe from inside a
    /// handler or session.
    pub fn request_stop(&self) {
        let mut requested = self
            .core
            .stop_requested
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *requested = true;
        self.core.stop_signal.notify_all();
    }

    /// Sleeps without using CPU until [`request_stop`](Self::request_stop) is called.
    pub fn wait_for_stop(&self) {
        let mut requested = self
            .core
            .stop_requested
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while !*requested {
            requested = self
                .core
                .stop_signal
                .wait(requested)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// Like [`wait_for_stop`](Self::wait_for_stop) but gives up after `timeout`; true when a stop was asked.
    pub fn wait_for_stop_timeout(&self, timeout: Duration) -> bool {
        let requested = self
            .core
            .stop_requested
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (requested, _) = self
            .core
            .stop_signal
            .wait_timeout_while(requested, timeout, |requested| !*requested)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *requested
    }

    /// The limits the server runs with, defaults filled in.
    pub fn limits(&self) -> &ResolvedLimits {
        &self.core.limits
    }
}

impl KillHandle {
    /// Ends the connection with `Killed(code)`; returns `false` if it already closed or someone else won.
    ///
    /// A connection whose graceful close is still lingering (reading what the peer sends after our FIN) has
    /// its close reason already; the kill then returns `false` but turns that close into an RST at once.
    pub fn kill(&self, code: u16) -> bool {
        let won = self.slot.kill(
            self.id.get(),
            code.min(RESERVED_CODES - 1),
            KillCondition::Always,
        );
        if won {
            let _ = self.wake.signal();
        } else {
            cut_linger(&self.linger, &self.wake, self.id.get());
        }
        won
    }

    /// The connection this handle kills.
    pub fn id(&self) -> ConnectionId {
        self.id
    }
}

impl Server {
    pub(crate) fn new(
        handle: ServerHandle,
        threads: Vec<JoinHandle<()>>,
        closer: Arc<dyn RuntimeControl>,
    ) -> Self {
        Self {
            handle,
            threads,
            closer,
            finished: false,
        }
    }

    pub(crate) fn push_thread(&mut self, thread: JoinHandle<()>) {
        self.threads.push(thread);
    }

    /// A cloneable handle for other threads.
    pub fn handle(&self) -> ServerHandle {
        self.handle.clone()
    }

    /// The address of the first listener.
    pub fn local_addr(&self) -> SocketAddr {
        self.handle.local_addr()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        self.handle.stats()
    }

    /// Adds a listener while the server runs; see [`ServerHandle::add_listener`].
    pub fn add_listener(&self, spec: ListenerSpec) -> Result<ListenerId, NetError> {
        self.handle.add_listener(spec)
    }

    /// Removes a listener and drains its connections; see [`ServerHandle::remove_listener`].
    pub fn remove_listener(
        &self,
        id: ListenerId,
        drain_deadline: Instant,
    ) -> Result<DrainReport, NetError> {
        self.handle.remove_listener(id, drain_deadline)
    }

    /// Drains until `deadline`, stops the accept threads and workers, closes the listeners and joins every
    /// thread. Idle connections close at once with `Shutdown` (which, like every reason but the four graceful
    /// ones, resets), busy ones may finish until `deadline` and are then killed with `DrainDeadline`.
    /// Connections still in the kernel backlog are reset when the listeners close.
    pub fn shutdown(mut self, deadline: Instant) -> DrainReport {
        self.stop(deadline)
    }

    /// Sleeps until [`ServerHandle::request_stop`], then shuts down with the `drain_timeout`.
    pub fn run_until_stopped(self) -> DrainReport {
        self.handle.wait_for_stop();
        let deadline =
            crate::clock::deadline_after(Instant::now(), self.handle.core.limits.drain_timeout);
        self.shutdown(deadline)
    }

    fn stop(&mut self, deadline: Instant) -> DrainReport {
        if self.finished {
            return DrainReport {
                graceful: 0,
                killed: 0,
                elapsed: Duration::ZERO,
            };
        }
        self.finished = true;
        // Set before the drain so that its idle closes say `Shutdown`; the accept threads return at once
        // (the drain closes the door anyway) and the door cannot be opened again.
        self.handle.core.stopping.store(true, Ordering::Release);
        self.handle.core.wake_acceptors();
        let report = self.handle.drain(deadline);
        self.closer.close_queue();
        self.handle.wake_all();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        // Taken out under the lock and joined without it: an accept thread may itself take the lock (its
        // control-line reaction opens or closes the door).
        let live = std::mem::take(&mut self.handle.core.lock_listeners().live);
        for listener in live {
            self.handle.core.retire_listener(listener);
        }
        self.handle.request_stop();
        report
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let deadline =
            crate::clock::deadline_after(Instant::now(), self.handle.core.limits.drain_timeout);
        self.stop(deadline);
    }
}

impl fmt::Debug for Core {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Core")
            .field("listeners", &self.lock_listeners().live.len())
            .field("workers", &self.workers.len())
            .field("door_open", &self.door_open)
            .field("draining", &self.draining)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for ServerHandle {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("ServerHandle")
            .field("core", &self.core)
            .finish()
    }
}

impl fmt::Debug for Server {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Server")
            .field("handle", &self.handle)
            .field("threads", &self.threads.len())
            .finish_non_exhaustive()
    }
}

/// Ends the linger of connection `id` if it is lingering behind `linger`: the owner sees the word change and
/// closes with an RST. Returns whether it did.
fn cut_linger(linger: &AtomicU64, wake: &EventFd, id: u64) -> bool {
    let cut = linger
        .compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire)
        .is_ok();
    if cut {
        let _ = wake.signal();
    }
    cut
}
