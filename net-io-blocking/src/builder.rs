//! [`ServerBuilder`]: listeners, workers, limits, gate, events, control line and clock; validated and bound at
//! build with the door closed, which opens last.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU16, AtomicU32, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use net_io_core::{
    AllowAll, BufferPool, Clock, Coalescer, ConfigError, ControlLine, ControlWaker, ControlWatch,
    Counters, EventSink, Gate, IdAllocator, Limits, ListenerId, NetError, NoopSink, ResolvedLimits,
    SessionFactory,
};
use net_io_sys::eventfd::EventFd;
use net_io_sys::kill::KillSlot;
use net_io_sys::socket::{self, ConnectionOptions, Keepalive, ListenOptions, Listener};

use crate::caps::{Caps, ListenerCaps, ListenerCounts};
use crate::connection::TcpConnection;
use crate::coroutines::{CoroutineFactory, HandlerDriver};
use crate::evloop::SessionDriver;
use crate::handle::ServerHandle;
use crate::handover::HandOver;
use crate::listener::{LISTENERS_MAX, ListenerDefaults, ListenerRuntime, ListenerSpec};
use crate::loop_shared::{Inbox, LoopShared};
use crate::runtime::{Runtime, Workload};
use crate::server::Server;
use crate::sessions::{HandlerWorkload, SessionWorkload};
use crate::shared::{Core, ListenerSet, NO_LISTENER, RuntimeControl, WorkerShared};
use crate::systemd::{InheritedListener, SystemdError};

/// Workers when none are configured.
pub const DEFAULT_WORKERS: usize = 128;
/// Worker stack size when none is configured.
pub const DEFAULT_WORKER_STACK: usize = 256 * 1024;

/// The builder's state before a workload is chosen.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoWorkload;

/// The builder's state before a gate is chosen: there is no `build()` until [`ServerBuilder::gate`] or
/// [`ServerBuilder::allow_all`] picks one, so "no admission policy" is always a visible decision.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoGate;

/// A blocking handler workload.
#[derive(Debug, Clone, Copy)]
pub struct Handler<H>(H);

/// A session factory workload.
#[derive(Debug, Clone, Copy)]
pub struct Sessions<F>(F);

/// Builds a [`Server`]. See the crate docs for an example.
pub struct ServerBuilder<W = NoWorkload, G = NoGate> {
    workload: W,
    gate: G,
    settings: Settings,
}

/// Everything but the workload and the gate.
struct Settings {
    listeners: Vec<ListenerSpec>,
    address_error: Option<NetError>,
    workers: usize,
    worker_stack: usize,
    limits: Limits,
    events: Arc<dyn EventSink>,
    control: Option<Arc<ControlLine>>,
    clock: Option<Arc<dyn Clock>>,
    connection_options: ConnectionOptions,
    open_door: bool,
    session_driver: SessionDriver,
    solo_read_slice: Duration,
    handler_driver: HandlerDriver,
    handler_stack: usize,
    /// Inherited listeners, each taken out by the one spec that names it.
    adopted: Vec<Option<Listener>>,
}

impl ServerBuilder<NoWorkload, NoGate> {
    /// A builder with no listener, workload or gate yet.
    pub fn new() -> Self {
        Self {
            workload: NoWorkload,
            gate: NoGate,
            settings: Settings {
                listeners: Vec::new(),
                address_error: None,
                workers: DEFAULT_WORKERS,
                worker_stack: DEFAULT_WORKER_STACK,
                limits: Limits::new(),
                events: Arc::new(NoopSink),
                control: None,
                clock: None,
                connection_options: ConnectionOptions {
                    nodelay: true,
                    ..ConnectionOptions::default()
                },
                open_door: true,
                session_driver: SessionDriver::event_loop(),
                solo_read_slice: crate::evloop::SOLO_READ_SLICE_DEFAULT,
                handler_driver: HandlerDriver::Threads,
                handler_stack: DEFAULT_WORKER_STACK,
                adopted: Vec::new(),
            },
        }
    }
}

impl Default for ServerBuilder<NoWorkload, NoGate> {
    fn default() -> Self {
        Self::new()
    }
}

impl<W, G> ServerBuilder<W, G> {
    /// Adds a listener on `address` (the first address it resolves to). Port 0 picks a free port.
    pub fn listen(mut self, address: impl ToSocketAddrs) -> Self {
        match address
            .to_socket_addrs()
            .map(|mut addresses| addresses.next())
        {
            Ok(Some(address)) => self.settings.listeners.push(ListenerSpec::new(address)),
            Ok(None) => {
                self.settings
                    .address_error
                    .get_or_insert(NetError::from(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "the listen address resolved to nothing",
                    )));
            }
            Err(error) => {
                self.settings
                    .address_error
                    .get_or_insert(NetError::from(error));
            }
        }
        self
    }

    /// Adds a listener with its own settings.
    pub fn listener(mut self, spec: ListenerSpec) -> Self {
        self.settings.listeners.push(spec);
        self
    }

    /// Serves on a listener inherited from systemd (see [`systemd::listeners`](crate::systemd::listeners))
    /// with the server's settings.
    pub fn adopt(self, inherited: InheritedListener) -> Self {
        self.adopt_with(inherited, |spec| spec)
    }

    /// Serves on an inherited listener with its own settings: `configure` gets a spec for its address and
    /// may set limits and a PROXY requirement. Socket options of the spec (`reuse_port`, buffer sizes) are
    /// not applied: the socket was created and bound by its creator.
    pub fn adopt_with(
        mut self,
        inherited: InheritedListener,
        configure: impl FnOnce(ListenerSpec) -> ListenerSpec,
    ) -> Self {
        let mut spec = configure(ListenerSpec::new(inherited.local_addr()));
        spec.adopted = Some(self.settings.adopted.len());
        self.settings.adopted.push(Some(inherited.listener));
        self.settings.listeners.push(spec);
        self
    }

    /// Serves on every listener systemd passed to this process (socket activation), in descriptor order,
    /// with the server's settings; see [`systemd::listeners`](crate::systemd::listeners) for the checks. When
    /// the variables are absent or meant for another process nothing is added, and `build` fails with no
    /// listeners unless others were added.
    pub fn systemd(self) -> Result<Self, SystemdError> {
        Ok(crate::systemd::listeners()?
            .into_iter()
            .fold(self, |builder, inherited| builder.adopt(inherited)))
    }

    /// Sets the worker count (128 by default); each worker serves one connection at a time (handlers on
    /// [`HandlerDriver::Threads`], and sessions on [`SessionDriver::Threads`], where it is also the default
    /// `max_connections`). With event loops (sessions, or handlers on [`HandlerDriver::Coroutines`]) no
    /// worker starts; the count then only enters the descriptor budget check (2 descriptors each), and the
    /// default `max_connections` is that budget instead (see [`EVENT_LOOP_CONNECTIONS_DEFAULT_MAX`]).
    pub fn workers(mut self, workers: usize) -> Self {
        self.settings.workers = workers;
        self
    }

    /// Sets each worker's (and event-loop thread's) stack size (256 KiB by default); raise it for handlers
    /// with deep stacks. Handlers on coroutines have their own stacks: see [`ServerBuilder::handler_stack_size`].
    pub fn worker_stack_size(mut self, bytes: usize) -> Self {
        self.settings.worker_stack = bytes;
        self
    }

    /// Sets the server's limits; unset fields take the defaults of [`Limits`].
    pub fn limits(mut self, limits: Limits) -> Self {
        self.settings.limits = limits;
        self
    }

    /// Sends events to `sink` (on worker and accept threads; it must not block).
    pub fn events(mut self, sink: impl EventSink) -> Self {
        self.settings.events = Arc::new(sink);
        self
    }

    /// Sends events to a shared sink.
    pub fn events_shared(mut self, sink: Arc<dyn EventSink>) -> Self {
        self.settings.events = sink;
        self
    }

    /// Watches `control` for drain, stop, shed and lockdown: each [`ControlLine::set`] wakes the accept
    /// thread that watches it (no periodic poll).
    pub fn control(mut self, control: Arc<ControlLine>) -> Self {
        self.settings.control = Some(control);
        self
    }

    /// Uses `clock` for every deadline (tests inject a manual clock; waits are then cut to one tick).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.settings.clock = Some(clock);
        self
    }

    /// Sets `TCP_NODELAY` on every connection (on by default).
    pub fn nodelay(mut self, nodelay: bool) -> Self {
        self.settings.connection_options.nodelay = nodelay;
        self
    }

    /// Sets TCP keepalive probing on every connection.
    pub fn keepalive(mut self, keepalive: Option<Keepalive>) -> Self {
        self.settings.connection_options.keepalive = keepalive;
        self
    }

    /// Whether `build` opens the door at its end (the default) or leaves it closed for
    /// [`ServerHandle::open_door`] (for example after dropping privileges).
    pub fn open_door_at_build(mut self, open: bool) -> Self {
        self.settings.open_door = open;
        self
    }

    /// Chooses how sessions are driven: event loops (the default, one loop thread per core), where a few
    /// threads serve any number of connections and a parked or idle session holds no thread, or worker
    /// threads ([`SessionDriver::Threads`], one connection each, with the Busy rule). With event loops the
    /// default `max_connections` is the descriptor budget (`RLIMIT_NOFILE` less 2 per worker and 32 spare, at
    /// most [`EVENT_LOOP_CONNECTIONS_DEFAULT_MAX`]) rather than the worker count. Handlers are driven as
    /// [`ServerBuilder::handler_driver`] says; for them this setting is ignored.
    pub fn session_driver(mut self, driver: SessionDriver) -> Self {
        self.settings.session_driver = driver;
        self
    }

    /// How long an event loop holding a single busy connection waits for that connection's next input in a
    /// blocking `recv` (under `SO_RCVTIMEO`) instead of in `epoll_wait`: 1 ms by default, `Duration::ZERO`
    /// turns these solo reads off.
    ///
    /// A solo read makes a keep-alive round trip cost two system calls (`recv` and `send`) instead of three,
    /// and it starts only when the loop has nothing else to do. The costs: a connection placed on a loop in a
    /// solo read waits until the slice ends (placement prefers a loop that is not in one; when every loop
    /// is, the new connection's first byte can wait one slice), and so do completions, stops and other
    /// wakes of the loop; an idle connection costs one extra wake-up, after which the loop sleeps in
    /// `epoll_wait` again. The kernel counts `SO_RCVTIMEO` in jiffies and rounds the timer up once more, so
    /// any slice up to a jiffy lasts one to three jiffies (4 to 12 ms at `HZ=250`, 6 ms measured median),
    /// and a longer one ends up to two jiffies late. The slice also ends at the connection's next deadline.
    /// A kill of the connection in the solo read (or a drain's close of it while idle) ends the read at once.
    /// Applies to every event loop: sessions on [`SessionDriver::EventLoop`] and handlers on
    /// [`HandlerDriver::Coroutines`]; worker threads always read this way.
    pub fn solo_read_slice(mut self, slice: Duration) -> Self {
        self.settings.solo_read_slice = slice;
        self
    }

    /// Chooses how blocking handlers run: on worker threads ([`HandlerDriver::Threads`], the default; a
    /// handler may call any blocking code) or on coroutines over event loops ([`HandlerDriver::Coroutines`]:
    /// an idle connection holds no thread, but a handler must block on nothing but its connection). With
    /// coroutines the connection cap defaults as for event-loop sessions. Sessions ignore this setting.
    pub fn handler_driver(mut self, driver: HandlerDriver) -> Self {
        self.settings.handler_driver = driver;
        self
    }

    /// Sets the stack size of each handler's coroutine under [`HandlerDriver::Coroutines`] (256 KiB by
    /// default, like a worker's stack). It is address space: only the pages a handler touches are resident.
    /// A handler that overflows it hits the guard page and kills the process. `build` refuses a size below
    /// 64 KiB (the driver's own frames and a panic's unwind need that much) or above 1 GiB.
    pub fn handler_stack_size(mut self, bytes: usize) -> Self {
        self.settings.handler_stack = bytes;
        self
    }

    /// Serves each connection with a blocking `handler`.
    pub fn handler<H>(self, handler: H) -> ServerBuilder<Handler<H>, G>
    where
        H: Fn(&mut TcpConnection<'_>) -> Result<(), NetError> + Send + Sync + 'static,
    {
        ServerBuilder {
            workload: Handler(handler),
            gate: self.gate,
            settings: self.settings,
        }
    }

    /// Serves each connection with a session made by `factory`.
    pub fn sessions<F: SessionFactory>(self, factory: F) -> ServerBuilder<Sessions<F>, G> {
        ServerBuilder {
            workload: Sessions(factory),
            gate: self.gate,
            settings: self.settings,
        }
    }

    /// Uses `gate` for admission and egress policy.
    pub fn gate<G2: Gate>(self, gate: G2) -> ServerBuilder<W, G2> {
        ServerBuilder {
            workload: self.workload,
            gate,
            settings: self.settings,
        }
    }

    /// Admits everything: the explicit choice of no admission policy.
    pub fn allow_all(self) -> ServerBuilder<W, AllowAll> {
        self.gate(AllowAll)
    }
}

impl<H, G> ServerBuilder<Handler<H>, G>
where
    H: Fn(&mut TcpConnection<'_>) -> Result<(), NetError> + Send + Sync + 'static,
    G: Gate,
{
    /// Validates the configuration, binds every listener, starts the threads and opens the door.
    pub fn build(self) -> Result<Server, NetError> {
        let Handler(handler) = self.workload;
        let HandlerDriver::Coroutines { loops } = self.settings.handler_driver else {
            return start(self.settings, self.gate, HandlerWorkload { handler }, None);
        };
        if loops == 0 {
            return Err(ConfigError::Zero { field: "loops" }.into());
        }
        crate::coroutines::check_stack_size(self.settings.handler_stack)?;
        // Each session needs the server's core (for its kill handle and the drain flag), which exists only
        // once `start` made it: the door stays closed until the factory has it.
        let core = Arc::new(OnceLock::new());
        let factory =
            CoroutineFactory::new(handler, Arc::clone(&core), self.settings.handler_stack);
        let mut settings = self.settings;
        let open_door = std::mem::replace(&mut settings.open_door, false);
        let body: LoopBody<G, SessionWorkload<CoroutineFactory<H>>> = Runtime::event_loop;
        let server = start(
            settings,
            self.gate,
            SessionWorkload { factory },
            Some((loops, body)),
        )?;
        let handle = server.handle();
        let _ = core.set(Arc::clone(&handle.core));
        if open_door {
            handle.open_door();
        }
        Ok(server)
    }
}

impl<F, G> ServerBuilder<Sessions<F>, G>
where
    F: SessionFactory,
    G: Gate,
{
    /// Validates the configuration, binds every listener, starts the threads and opens the door.
    pub fn build(self) -> Result<Server, NetError> {
        let Sessions(factory) = self.workload;
        let loops = match self.settings.session_driver {
            SessionDriver::Threads => None,
            SessionDriver::EventLoop { loops } => {
                if loops == 0 {
                    return Err(ConfigError::Zero { field: "loops" }.into());
                }
                let body: LoopBody<G, SessionWorkload<F>> = Runtime::event_loop;
                Some((loops, body))
            }
        };
        start(self.settings, self.gate, SessionWorkload { factory }, loops)
    }
}

impl<W, G> std::fmt::Debug for ServerBuilder<W, G> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ServerBuilder")
            .field("listeners", &self.settings.listeners)
            .field("workers", &self.settings.workers)
            .field("limits", &self.settings.limits)
            .finish_non_exhaustive()
    }
}

/// The most connections event loops admit by default, whatever the descriptor limit: the per-source caps
/// size their tables for the connection cap up front (about 32 bytes a connection), and a host with a
/// descriptor limit in the millions should choose such a cap on purpose. `max_connections` raises it.
pub const EVENT_LOOP_CONNECTIONS_DEFAULT_MAX: usize = 65_536;

/// The default `max_connections` with event loops: the descriptor budget that `Limits` validation checks
/// (`RLIMIT_NOFILE` less 2 per worker and 32 spare), so the default always passes it, at least 1 and at most
/// [`EVENT_LOOP_CONNECTIONS_DEFAULT_MAX`]. Each connection holds one descriptor and no thread.
fn event_loop_connections_default(descriptor_limit: u64, workers: usize) -> usize {
    let reserved = (workers as u64).saturating_mul(2).saturating_add(32);
    let budget = descriptor_limit.saturating_sub(reserved);
    usize::try_from(budget)
        .unwrap_or(usize::MAX)
        .clamp(1, EVENT_LOOP_CONNECTIONS_DEFAULT_MAX)
}

/// The body of an event-loop thread.
type LoopBody<G, W> = fn(Arc<Runtime<G, W>>, usize);

/// Validates, binds with the door closed, starts workers (or `loops` event-loop threads running the given
/// body) and accept threads, then opens the door.
fn start<G: Gate, W: Workload>(
    settings: Settings,
    gate: G,
    workload: W,
    loops: Option<(usize, LoopBody<G, W>)>,
) -> Result<Server, NetError> {
    if let Some(error) = settings.address_error {
        return Err(error);
    }
    if settings.listeners.is_empty() {
        return Err(ConfigError::Zero { field: "listeners" }.into());
    }
    if settings.listeners.len() > LISTENERS_MAX {
        return Err(ConfigError::TooLarge {
            field: "listeners",
            value: settings.listeners.len() as u64,
            max: LISTENERS_MAX as u64,
        }
        .into());
    }
    let workers = settings.workers;
    let descriptor_limit = net_io_sys::rlimit::descriptor_limit()?.soft;
    // Worker threads cap connections at one each; event loops are bounded by descriptors instead.
    let base_limits = match loops {
        Some(_) => settings.limits.or(Limits::new()
            .max_connections(event_loop_connections_default(descriptor_limit, workers))),
        None => settings.limits,
    };
    let limits = base_limits.validate(workers, descriptor_limit)?;
    let defaults = ListenerDefaults {
        base_limits,
        global: limits,
        workers,
        connection_options: settings.connection_options,
    };
    let mut listener_limits = Vec::with_capacity(settings.listeners.len());
    for spec in &settings.listeners {
        listener_limits.push(validate_listener(spec, &defaults, descriptor_limit)?);
    }
    // Bind everything before any thread starts: a taken port fails the build with nothing to undo.
    let mut adopted = settings.adopted;
    let mut bound = Vec::with_capacity(settings.listeners.len());
    for (spec, limits) in settings.listeners.iter().zip(&listener_limits) {
        let inherited = match spec.adopted {
            // Each adopted spec is made by `adopt_with` with its own index, so each slot is taken once.
            Some(index) => Some(adopted.get_mut(index).and_then(Option::take).ok_or_else(
                || {
                    NetError::from(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "an inherited listener was configured twice; adopt each one once",
                    ))
                },
            )?),
            None => None,
        };
        bound.push(bind_listener(spec, limits, &defaults, inherited)?);
    }
    let events_enabled = settings.events.enabled();
    let manual_clock = settings.clock.is_some();
    let clock = settings.clock.unwrap_or_else(crate::clock::system);
    // Event loops replace the workers: their connections live in the loops' slots.
    let worker_threads = if loops.is_some() { 0 } else { workers };
    let mut loop_shared = Vec::new();
    for _ in 0..loops.map_or(0, |(count, _)| count) {
        loop_shared.push(LoopShared::new(settings.solo_read_slice)?);
    }
    let mut worker_shared = Vec::with_capacity(worker_threads);
    for _ in 0..worker_threads {
        worker_shared.push(WorkerShared {
            slot: Arc::new(KillSlot::new()),
            wake: Arc::new(EventFd::new()?),
            linger: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            lane: AtomicU8::new(0),
        });
    }
    let first_local = bound
        .first()
        .map(Listener::local_addr)
        .ok_or(ConfigError::Zero { field: "listeners" })?;
    let core = Arc::new(Core {
        limits,
        clock,
        manual_clock,
        events: settings.events,
        events_enabled,
        // One close slot per worker and loop, one per accept thread that can be live at once, one for the
        // thread that shuts down and one for outbound connections refused before a loop or worker took them.
        counters: Counters::new(worker_threads + loop_shared.len() + LISTENERS_MAX + 2),
        caps: Arc::new(Caps::new(limits.max_connections)),
        workers: worker_shared,
        loops: loop_shared,
        listeners: Mutex::new(ListenerSet::default()),
        next_listener: AtomicU32::new(0),
        control_owner: AtomicU32::new(NO_LISTENER),
        first_local,
        runtime: OnceLock::new(),
        door_open: AtomicBool::new(false),
        draining: AtomicBool::new(false),
        drain_expired: AtomicBool::new(false),
        stopping: AtomicBool::new(false),
        stop_requested: Mutex::new(false),
        stop_signal: Condvar::new(),
        busy_workers: AtomicU64::new(0),
        shed_lane: AtomicU16::new(u16::MAX),
        drain_lock: Mutex::new(()),
        serving_coalescer: Mutex::new(Coalescer::new()),
        serving_folded: AtomicBool::new(false),
    });
    let ids = IdAllocator::new();
    let runtime = Arc::new(Runtime {
        core: Arc::clone(&core),
        gate,
        workload,
        handover: HandOver::new(workers),
        listener_defaults: defaults,
        pool: BufferPool::new(limits.buffer_budget, limits.wipe_buffers),
        outbound: crate::runtime::OutboundShared::new(limits, &ids),
        ids,
        _control_waker: settings.control.as_ref().map(|line| {
            let core = Arc::downgrade(&core);
            let waker: Arc<ControlWaker> = Arc::new(move || {
                if let Some(core) = core.upgrade() {
                    core.wake_acceptors();
                }
            });
            line.subscribe(&waker);
            waker
        }),
        control: settings.control,
        control_watch: Mutex::new(ControlWatch::new()),
        lockdown: AtomicBool::new(false),
        inboxes: (0..loops.map_or(0, |(count, _)| count))
            .map(|_| Inbox::new())
            .collect(),
    });
    let handle = ServerHandle {
        core: Arc::clone(&core),
    };
    let closer: Arc<dyn RuntimeControl> = runtime.clone();
    let _ = core.runtime.set(Arc::downgrade(&closer));
    let mut server = Server::new(handle.clone(), Vec::new(), closer);
    if let Some((count, body)) = loops {
        for index in 0..count {
            let runtime = Arc::clone(&runtime);
            let thread = std::thread::Builder::new()
                .name(format!("net-io-loop-{index}"))
                .stack_size(settings.worker_stack)
                .spawn(move || body(runtime, index))?;
            server.push_thread(thread);
        }
    }
    for index in 0..worker_threads {
        let runtime = Arc::clone(&runtime);
        let thread = std::thread::Builder::new()
            .name(format!("net-io-worker-{index}"))
            .stack_size(settings.worker_stack)
            .spawn(move || runtime.worker_loop(index))?;
        server.push_thread(thread);
    }
    // The builder's listeners follow the server's door: open as soon as it opens.
    for ((socket, spec), limits) in bound
        .into_iter()
        .zip(settings.listeners)
        .zip(listener_limits)
    {
        register_listener(&runtime, socket, listener_settings(spec, limits), true)?;
    }
    // The door opens last, once every thread runs.
    if settings.open_door {
        handle.open_door();
    }
    Ok(server)
}

/// Checks one listener's settings as the builder does: its limits laid over the server's and validated, its
/// per-listener cap under the global one, and trusted proxies when it requires a PROXY header.
fn validate_listener(
    spec: &ListenerSpec,
    defaults: &ListenerDefaults,
    descriptor_limit: u64,
) -> Result<ResolvedLimits, NetError> {
    let merged = spec
        .limits
        .or(defaults.base_limits)
        .validate(defaults.workers, descriptor_limit)?;
    if merged.max_per_listener > defaults.global.max_connections {
        return Err(ConfigError::AboveGlobal {
            field: "max_per_listener",
            value: merged.max_per_listener,
            global: defaults.global.max_connections,
        }
        .into());
    }
    if spec.proxy.is_some() && spec.trusted.is_empty() {
        return Err(ConfigError::Zero {
            field: "trusted_proxies",
        }
        .into());
    }
    Ok(merged)
}

/// Binds `spec` (or takes the `inherited` socket) and sets the options accepted sockets inherit.
fn bind_listener(
    spec: &ListenerSpec,
    limits: &ResolvedLimits,
    defaults: &ListenerDefaults,
    inherited: Option<Listener>,
) -> Result<Listener, NetError> {
    let options = ListenOptions {
        backlog: spec
            .limits
            .or(defaults.base_limits)
            .resolve(defaults.workers)
            .backlog,
        reuse_port: spec.reuse_port,
        receive_buffer: spec.receive_buffer,
        send_buffer: spec.send_buffer,
        ..ListenOptions::default()
    };
    let listener = match inherited {
        Some(listener) => listener,
        None => socket::listen(spec.address, &options)
            .map_err(|error| NetError::from_bind(spec.address, error))?,
    };
    // Accepted sockets inherit these from the listener, so workers need not set them per connection.
    socket::apply_connection_options(
        std::os::fd::AsFd::as_fd(&listener),
        &defaults.connection_options,
    )?;
    // Likewise SO_RCVTIMEO: a new connection's first wait is usually the idle one, already armed.
    socket::set_receive_timeout(
        std::os::fd::AsFd::as_fd(&listener),
        Some(limits.idle_timeout),
    )?;
    Ok(listener)
}

/// The settings a listener's connections are served with.
fn listener_settings(spec: ListenerSpec, limits: ResolvedLimits) -> ListenerRuntime {
    ListenerRuntime {
        limits,
        proxy: spec.proxy,
        trusted: spec.trusted,
        counts: Arc::new(ListenerCounts::new(ListenerCaps {
            max_per_listener: limits.max_per_listener,
            max_per_source: limits.max_per_source,
            policy: limits.source_prefix,
        })),
    }
}

/// Adds a bound listener to the server's live set and starts its accept thread.
fn register_listener<G: Gate, W: Workload>(
    runtime: &Arc<Runtime<G, W>>,
    socket: Listener,
    settings: ListenerRuntime,
    door_open: bool,
) -> Result<ListenerId, NetError> {
    let settings = Arc::new(settings);
    let (local, backlog) = (socket.local_addr(), socket.backlog());
    let accepting = Arc::clone(runtime);
    let served = Arc::clone(&settings);
    runtime.core.register_listener(
        settings,
        local,
        backlog,
        door_open,
        move |acceptor, counter_slot| {
            std::thread::Builder::new()
                .name(format!("net-io-accept-{}", acceptor.id.0))
                .stack_size(DEFAULT_WORKER_STACK)
                .spawn(move || accepting.accept_loop(socket, served, acceptor, counter_slot))
        },
    )
}

/// Validates, binds and starts a listener on a running server (see [`ServerHandle::add_listener`]).
pub(crate) fn start_listener<G: Gate, W: Workload>(
    runtime: &Arc<Runtime<G, W>>,
    spec: ListenerSpec,
    door_open: bool,
) -> Result<ListenerId, NetError> {
    if spec.adopted.is_some() {
        return Err(NetError::from(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a spec for an inherited listener can be used only in the builder; adopt it there",
        )));
    }
    let defaults = &runtime.listener_defaults;
    let descriptor_limit = net_io_sys::rlimit::descriptor_limit()?.soft;
    let limits = validate_listener(&spec, defaults, descriptor_limit)?;
    let socket = bind_listener(&spec, &limits, defaults, None)?;
    register_listener(runtime, socket, listener_settings(spec, limits), door_open)
}

/// The handles reach the generic runtime through this: it sits here, at the top, because starting a
/// listener at run time is the builder's own validation and binding (everything else it forwards).
impl<G: Gate, W: Workload> RuntimeControl for Runtime<G, W> {
    fn start_listener(self: Arc<Self>, spec: ListenerSpec) -> Result<ListenerId, NetError> {
        start_listener(&self, spec, false)
    }

    fn connect(
        self: Arc<Self>,
        address: SocketAddr,
        session: Box<dyn std::any::Any + Send>,
        given: &'static str,
        options: crate::outbound::ConnectOptions,
    ) -> Result<net_io_core::ConnectionId, NetError> {
        self.connect_outbound(address, session, given, options)
    }

    fn close_queue(&self) {
        Runtime::close_queue(self);
    }
}
