//! What every thread and handle of one server shares, whatever its gate and workload: [`Core`] (limits, clock,
//! events, counters, caps, the workers' and loops' slots, the live listeners, the door and drain flags),
//! the [`RuntimeControl`] the handles reach the generic runtime through, and the per-connection [`KillHandle`].

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use net_io_core::{
    CloseReason, Coalescer, ConnectionId, ConnectionInfo, Counters, Event, EventSink, ListenerId,
    NetError, ResolvedLimits,
};
use net_io_sys::eventfd::EventFd;
use net_io_sys::kill::{KillCondition, KillSlot};

use crate::caps::Caps;
use crate::clock::SharedClock;
use crate::codes::RESERVED_CODES;
use crate::listener::{LISTENERS_MAX, ListenerRuntime, ListenerSpec};
use crate::loop_shared::LoopShared;

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

/// Ends one connection from any thread. Cheap to clone.
#[derive(Clone, Debug)]
pub struct KillHandle {
    pub(crate) slot: Arc<KillSlot>,
    pub(crate) wake: Arc<EventFd>,
    pub(crate) linger: Arc<AtomicU64>,
    pub(crate) id: ConnectionId,
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

    /// The close an idle connection in `lane` takes instead of waiting for its next request: the drain's
    /// (see [`Core::idle_close_reason`]) or a shed's. `None`: it waits. Every driver asks this before an idle
    /// wait, so a drain or a shed reaches each the same way.
    pub(crate) fn close_when_idle(&self, lane: net_io_core::Lane) -> Option<CloseReason> {
        if self.draining.load(Ordering::Acquire) {
            return Some(self.idle_close_reason());
        }
        self.is_shed(lane).then_some(CloseReason::Shed)
    }

    /// What a session hook's context tells the session about the server now, with the connection's
    /// completer; both session drivers build every hook's environment here.
    pub(crate) fn hook_environment<'a>(
        &'a self,
        completer: &'a net_io_core::Completer,
    ) -> net_io_core::HookEnvironment<'a> {
        net_io_core::HookEnvironment {
            draining: self.draining.load(Ordering::Acquire),
            pressure: net_io_core::Pressure::Source(self),
            completer: Some(completer),
        }
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
    pub(crate) fn retire_listener(&self, mut live: LiveListener) {
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

    pub(crate) fn kill_where(&self, id: ConnectionId, code: u16, condition: KillCondition) -> bool {
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
    pub(crate) fn cut_all_lingers(&self) {
        self.for_each_slot(|_, wake, linger, _| {
            if linger.swap(0, Ordering::AcqRel) != 0 {
                let _ = wake.signal();
            }
            false
        });
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

/// Ends the linger of connection `id` if it is lingering behind `linger`: the owner sees the word change and
/// closes with an RST. Returns whether it did.
pub(crate) fn cut_linger(linger: &AtomicU64, wake: &EventFd, id: u64) -> bool {
    let cut = linger
        .compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire)
        .is_ok();
    if cut {
        let _ = wake.signal();
    }
    cut
}

impl net_io_core::LoadSource for Core {
    fn pressure(&self) -> f32 {
        Core::pressure(self)
    }
}
