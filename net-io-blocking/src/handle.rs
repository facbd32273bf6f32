//! The cloneable [`ServerHandle`] to a running server: kill, door, drain, stop, stats, listeners added and
//! removed, and outbound connections; and the [`DrainReport`] a drain returns.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use net_io_core::{CloseReason, ConnectionId, Event, ListenerId, NetError, ResolvedLimits, Stats};
use net_io_sys::kill::KillCondition;

use crate::codes::{CODE_DRAIN_DEADLINE, CODE_DRAINED, CODE_SHUTDOWN, RESERVED_CODES};
use crate::listener::{ListenerRuntime, ListenerSpec};
use crate::shared::{Acceptor, Core, NO_LISTENER, cut_linger};

/// What a drain did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainReport {
    /// Connections that closed on their own or as idle (`Drained`, or `Shutdown` when the drain is part of a
    /// [`Server::shutdown`](crate::Server::shutdown)) before the deadline.
    pub graceful: u64,
    /// Connections still busy at the deadline and killed (`DrainDeadline`).
    pub killed: u64,
    /// How long the drain took.
    pub elapsed: Duration,
}

/// A cloneable, thread-safe handle to a running server: kill, door, drain, stop, stats.
#[derive(Clone)]
pub struct ServerHandle {
    pub(crate) core: Arc<Core>,
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
    /// listener. Fails with `ShuttingDown` once a stop began, and when [`LISTENERS_MAX`](crate::LISTENERS_MAX) listeners are live.
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
    /// [`ConnectionInfo`](crate::ConnectionInfo) says it is outbound (`origin` is `Connected`, `listener` is
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

    /// Closes the door and the listening sockets, closes idle connections at once (`Drained`, graceful), lets
    /// busy ones finish, and kills what is still open at `deadline` (`DrainDeadline`, abortive). A deadline
    /// already past kills at once. Returns when every connection is closed (or a second after the deadline
    /// kills, at the latest). A connect during the drain is refused at once: each accept thread shuts its
    /// listening socket down (its descriptor stays open and the thread keeps watching the control line; a
    /// port the kernel chose, bound to port 0, may go to another socket from then on), where a closed door
    /// alone would leave the connect in the kernel's backlog, waiting out the drain, then reset.
    /// The drain that [`Server::shutdown`](crate::Server::shutdown) runs closes idle connections with `Shutdown` instead.
    pub fn drain(&self, deadline: Instant) -> DrainReport {
        let _serial = self
            .core
            .drain_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let started = Instant::now();
        self.close_door();
        self.core.draining.store(true, Ordering::Release);
        // Woken again now that `draining` is set: each accept thread stops its socket listening.
        self.core.wake_acceptors();
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

impl fmt::Debug for ServerHandle {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("ServerHandle")
            .field("core", &self.core)
            .finish()
    }
}
