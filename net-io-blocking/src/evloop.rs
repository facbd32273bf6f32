//! The event-loop session driver: a few loop threads, each with its own edge-triggered epoll, driving many
//! sans-IO sessions without a thread per connection.
//!
//! ```text
//!   accept thread ──caps, gate──▶ inbox of the least loaded loop ──eventfd──▶ loop thread 0..L
//!                                                                            │ epoll_wait(timeout = next timer)
//!   ServerHandle::kill ──id map──▶ KillSlot::kill ──shutdown(SHUT_RD)───────▶│ closing()? close with its reason
//!   Completer::post ──entry waker──▶ ready list + eventfd ──────────────────▶│ on_wake for a parked session
//!                                                                            │ per connection: recv until a short
//!                                                                            │ read, send until EAGAIN, then wait
//!                                                                            ▼ for the next edge; timers in a heap
//! ```
//!
//! A new connection is served at once (its first `recv` often finds the request already there) and only
//! then registered, once, with `EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET`; the registration is never
//! modified, so a keep-alive round trip costs one `recv` and one `send`, plus one `epoll_wait` shared by
//! every connection that became ready in the same batch (a test counts about 0.03 to 0.08 per round trip
//! with 32 busy connections on one loop). Deadlines (handshake, idle, read, write, exchange, park,
//! linger and the minimum-rate checks) live in one heap per loop, keyed by the earliest deadline each
//! connection has; a deadline that only moves later (the usual keep-alive case) costs no heap push, the
//! stale entry is found and re-pushed when it comes due. A parked or idle session holds no thread and, when
//! its input is empty, no read buffer either.
//!
//! **What else a round trip costs.** Besides its system calls, a keep-alive round trip reads the server's
//! clock three times: a connection's turn keeps one reading until a session hook returns (hooks may run for
//! long, so the deadlines after one count from a fresh reading). The minimum-rate windows cost nothing while
//! nothing waits: the input window starts when a request first has to wait for more input, the output window
//! when a send first answers `EAGAIN`, each counting the bytes moved before it at that moment (microseconds
//! later than when they moved, which buckets of a check interval each, a second by default, do not see).
//! A step checks for a half close only when the session asked for one. Together this is about a quarter of
//! the loop's own instructions per round trip (callgrind, 256 connections: 2,450 before, 1,810 after); the
//! kernel's TCP path, about nine tenths of the loop's time, is untouched.
//!
//! **Solo reads.** A loop holding a single connection has nobody to share its `epoll_wait` with, so a round
//! trip would cost three calls. When that one connection got data in the turn just run and now waits for
//! more, and nothing else could need the loop (no yielded turn, no lingering close, no queued connection, no
//! stop, no wake signalled since the last one acted on, no timer due within 50 us), the loop waits for the
//! connection's next input in a blocking `recv` under `SO_RCVTIMEO` instead: a round trip costs the `recv`
//! and the `send`, as on a worker thread.
//!
//! ```text
//!   turn served the one connection ──▶ solo_candidate? ──no──▶ epoll_wait (as above)
//!                                          │ yes: the eventfd's signal count (memory, no system call) is
//!                                          │      the one last acted on, nothing queued, no timer due
//!                                          ▼
//!              recv under SO_RCVTIMEO = min(slice, next timer)   (armed only when that moves by a tick)
//!                 │ data: serve it, next turn may read alone again
//!                 │ 0 after a kill's / drain's shutdown(SHUT_RD): close at once with the kill's reason
//!                 │ EAGAIN (slice over, nothing came): the deadline in force stays; next turn epoll_waits
//! ```
//!
//! The slice ([`ServerBuilder::solo_read_slice`], 1 ms by default, zero turns it off) bounds how long
//! anything else waits: a new connection handed to this loop, a completion, a stop or a cut linger is seen
//! when the slice ends (or at once, when the connection's next input ends the `recv` first). The kernel
//! counts `SO_RCVTIMEO` in jiffies and its timer wheel rounds up once more, so on a `HZ=250` kernel any slice
//! up to 4 ms lasts 4 to 12 ms (measured median 6 ms): that is a new connection's worst extra wait when every
//! loop is in a solo read (placement prefers, between loops holding as many connections, one that is not),
//! and an idle connection costs one such wake-up before its loop sleeps in `epoll_wait` again. The
//! registration stays edge-triggered and untouched: input that a solo read took leaves at most a stale edge,
//! which the next `epoll_wait` reports once and which costs nothing (or one `recv` answering `EAGAIN`).
//!
//! [`ServerBuilder::solo_read_slice`]: crate::ServerBuilder::solo_read_slice
//!
//! Everything the threaded driver guarantees holds here too: admission before any read (on the accept
//! thread), one close per connection with its reason delivered to the session, the gate and the event sink,
//! kills from any thread (the kill slot's `shutdown(SHUT_RD)` wakes the loop through epoll), drain, PROXY
//! headers read without blocking under the handshake deadline, the gate asked before every write call,
//! panics contained to their connection, and graceful closes whose linger runs inside the loop.
//!
//! Panics: every session hook, the gate and the event sink are contained where they are called. A panic in
//! the driver's own code (or in an injected clock it reads) is caught around each connection's turn; the
//! connection whose turn it interrupted is closed abortively as `SessionPanicked` (its state is unknown, and
//! nothing would ever come back to it), and the turns, completions and queued connections that the
//! interrupted pass had taken out of their lists are put back. A graceful close publishes its linger word
//! before it takes the kill slot, so a kill that finds the close already decided always cuts the linger to
//! an RST instead of being lost.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::net::Shutdown;
use std::os::fd::AsFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use net_io_core::proxy::{ProxyCommand, ProxyError, ProxyParser, ProxyStatus, V1_MAX};
use net_io_core::{
    AllowAll, CloseReason, Completer, CompletionReceiver, CompletionRing, ConnectionInfo,
    Direction, Event, Gate, LimitKind, Output, Phase, ReadBuffer, RefusalCause, ResolvedLimits,
    Session, SessionContext, SessionFactory, SessionRequests, SizeClass, Step, TimeoutKind,
    Verdict, WorkerBuffers, WorkerId, WriteFacts, check_or_deny, close_ticket,
};
use net_io_sys::epoll::{Epoll, Events, Interest};
use net_io_sys::eventfd::EventFd;
use net_io_sys::kill::{KillSlot, SlotOwner};
use net_io_sys::socket::{self, Linger};

use crate::caps::Reservation;
use crate::clock::deadline_after;
use crate::handshake;
use crate::link::OWNER_CODE;
use crate::rate::RateWindow;
use crate::runtime::{Job, ListenerRuntime, Runtime};
use crate::server::{CODE_DRAIN_DEADLINE, Core, reason_for_code};
use crate::sessions::{HalfClose, SessionWorkload, WriteShut};

/// How sessions are driven.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionDriver {
    /// One worker thread per connection (the worker count caps how many are served at once).
    Threads,
    /// `loops` event-loop threads, each with its own epoll, serving any number of connections.
    ///
    /// Hooks run on the loop thread: a hook that blocks or computes for long stalls every connection of
    /// its loop. Offload such work (return [`Step::Park`] and post the result through the
    /// [`Completer`]), or choose [`SessionDriver::Threads`].
    EventLoop {
        /// How many loop threads; at least one.
        loops: usize,
    },
}

impl SessionDriver {
    /// An event loop with one loop thread per available core.
    pub fn event_loop() -> SessionDriver {
        let loops = std::thread::available_parallelism().map_or(2, |cores| cores.get());
        SessionDriver::EventLoop { loops }
    }
}

/// What a loop shares with accept threads, killers, drains and completers.
pub(crate) struct LoopShared {
    pub(crate) wake: Arc<LoopWake>,
    /// Every connection slot the loop ever made (slots are reused, never removed); drains and sheds scan it.
    pub(crate) slots: Mutex<Vec<Arc<ConnectionSlot>>>,
    /// The slot of each connection the loop holds, by id, so that a kill by id is one lookup per loop rather
    /// than a scan of every slot. Written only by the loop (at start and at the final close); the map keeps
    /// its capacity, so a steady number of connections allocates nothing.
    by_id: Mutex<HashMap<u64, Arc<ConnectionSlot>>>,
    /// Connections queued for this loop or held by it: accept threads place each new connection on the loop
    /// with the fewest, so a loop emptied by closes fills first instead of taking every n-th id.
    load: AtomicUsize,
    /// The loop serves its one connection in solo reads (see [`EventLoop::solo_read`]): a new connection
    /// placed here waits for the end of the current slice, so placement breaks a tie against this loop.
    solo: AtomicBool,
    /// The longest solo read; zero turns solo reads off.
    solo_slice: Duration,
}

/// A loop's wake: its eventfd and the entries whose completion ring got a post.
pub(crate) struct LoopWake {
    pub(crate) eventfd: Arc<EventFd>,
    ready: Mutex<Vec<u32>>,
}

/// The shared parts of one connection slot of a loop.
pub(crate) struct ConnectionSlot {
    pub(crate) slot: Arc<KillSlot>,
    /// The id of the connection whose graceful close lingers in this slot, 0 otherwise (as for workers).
    pub(crate) linger: Arc<AtomicU64>,
    pub(crate) lane: AtomicU8,
}

/// Jobs handed from accept threads to one loop.
pub(crate) struct Inbox<J> {
    state: Mutex<InboxState<J>>,
}

struct InboxState<J> {
    jobs: Vec<J>,
    closed: bool,
}

/// Wakes a loop for one entry's completion.
struct EntryWake {
    wake: Arc<LoopWake>,
    index: u32,
}

impl LoopShared {
    /// A loop's shared parts; `solo_slice` is the longest solo read (zero: none).
    pub(crate) fn new(solo_slice: Duration) -> io::Result<Self> {
        Ok(Self {
            wake: Arc::new(LoopWake {
                eventfd: Arc::new(EventFd::new()?),
                ready: Mutex::new(Vec::new()),
            }),
            slots: Mutex::new(Vec::new()),
            by_id: Mutex::new(HashMap::new()),
            load: AtomicUsize::new(0),
            solo: AtomicBool::new(false),
            solo_slice,
        })
    }

    /// The slot that holds connection `id` on this loop, if this loop holds it (open or lingering).
    pub(crate) fn find(&self, id: u64) -> Option<Arc<ConnectionSlot>> {
        self.by_id
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&id)
            .cloned()
    }

    /// The placement weight of this loop: twice the connections queued for it or held by it right now, plus
    /// one while it is in solo reads. Fewer connections always weigh less; between loops holding as many,
    /// one that would make a new connection wait for the end of a solo slice weighs more.
    pub(crate) fn load(&self) -> usize {
        self.load
            .load(Ordering::Relaxed)
            .saturating_mul(2)
            .saturating_add(usize::from(self.solo.load(Ordering::Relaxed)))
    }

    /// Counts a connection queued for this loop (by the accept thread, before it offers the job).
    pub(crate) fn add_load(&self) {
        self.load.fetch_add(1, Ordering::Relaxed);
    }

    /// Marks a loop that could not start: its load reads as far above any real one (and stays there under
    /// the counting above, which neither wraps nor reaches it), so no connection is placed on it while
    /// another loop runs.
    fn mark_dead(&self) {
        self.load.store(DEAD_LOOP_LOAD, Ordering::Relaxed);
    }

    /// Counts a connection gone from this loop: closed, or refused before the loop took it.
    pub(crate) fn remove_load(&self) {
        // Never below zero, even if a refusal path and a close both counted (they cannot, but a wrap here
        // would make the loop look full forever).
        let _ = self
            .load
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |load| {
                Some(load.saturating_sub(1))
            });
    }

    fn ids(&self) -> MutexGuard<'_, HashMap<u64, Arc<ConnectionSlot>>> {
        self.by_id
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn slots(&self) -> MutexGuard<'_, Vec<Arc<ConnectionSlot>>> {
        self.slots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<J> Inbox<J> {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(InboxState {
                jobs: Vec::new(),
                closed: false,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, InboxState<J>> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues `job`, or gives it back once the inbox is closed. Answers whether the loop must be woken: only
    /// the job that finds the inbox empty wakes it, since the loop drains its eventfd before it takes the
    /// jobs, so any job queued behind that one is taken in the same pass.
    pub(crate) fn offer(&self, job: J) -> Result<bool, J> {
        let mut state = self.lock();
        if state.closed {
            return Err(job);
        }
        let was_empty = state.jobs.is_empty();
        state.jobs.push(job);
        Ok(was_empty)
    }

    /// Closes the inbox and returns what was still queued (to be refused).
    pub(crate) fn close(&self) -> Vec<J> {
        let mut state = self.lock();
        state.closed = true;
        std::mem::take(&mut state.jobs)
    }

    /// Moves queued jobs into `into` (keeping both vectors' capacity); returns whether the inbox is closed.
    fn take_into(&self, into: &mut Vec<J>) -> bool {
        let mut state = self.lock();
        into.append(&mut state.jobs);
        state.closed
    }
}

impl Wake for EntryWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wake
            .ready
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(self.index);
        let _ = self.wake.eventfd.signal();
    }
}

/// The epoll token of the loop's own eventfd.
const WAKE_TOKEN: u64 = u64::MAX;
/// Events taken per `epoll_wait`.
const EVENTS_PER_WAIT: usize = 256;
/// Bytes read at a time during a PROXY handshake and a linger.
const CHUNK: usize = 512;
/// The fixed part of a PROXY v2 header before its body.
const V2_FIXED: usize = 16;
/// The solo read's slice by default. `SO_RCVTIMEO` is counted in jiffies and rounded up by the timer wheel,
/// so any slice up to a jiffy lasts 4 to 12 ms at `HZ=250` (measured); the busy case, which ends the `recv`
/// with data, does not depend on it. See [`ServerBuilder::solo_read_slice`].
///
/// [`ServerBuilder::solo_read_slice`]: crate::ServerBuilder::solo_read_slice
pub(crate) const SOLO_READ_SLICE_DEFAULT: Duration = Duration::from_millis(1);
/// How far the socket's armed `SO_RCVTIMEO` may be from the wanted slice before a solo read sets it again
/// (a jiffy at `HZ=1000`; the kernel rounds up to one anyway).
const SOLO_REARM_MARGIN: Duration = Duration::from_millis(1);
/// A timer due sooner than this is left to `epoll_wait` rather than to a solo read's slice.
const SOLO_TIMER_MARGIN: Duration = Duration::from_micros(50);
/// How often a stopping loop looks at what is still open.
const STOP_POLL: Duration = Duration::from_millis(100);
/// Output queued at once (bytes) up to which an idle connection keeps its output queue's allocation, so a
/// steady exchange of small replies allocates nothing; a queue that grew larger is dropped when it idles.
const OUTPUT_KEPT_IDLE: usize = 4096;
/// Slots a loop keeps however few connections it holds (the slab is cut down to this at the least).
const SLAB_KEPT: usize = 64;
/// Free read buffers a loop keeps per size class even when none of its connections holds one.
const FREE_BUFFERS_KEPT: usize = 16;
/// The load a loop that could not start reports.
const DEAD_LOOP_LOAD: usize = usize::MAX / 2;
/// Stale timer entries tolerated beyond twice the live connections before the heap is compacted.
const TIMERS_SLACK: usize = 1024;
/// Steps one connection may take per turn before the others get theirs: a peer that keeps the socket full
/// (every read fills the buffer) would otherwise hold the loop.
const STEPS_PER_TURN: usize = 64;

/// What a connection waits for between events.
#[derive(Clone, Copy, Debug)]
enum Wait {
    /// A PROXY header, until the handshake deadline.
    Handshake { deadline: Instant },
    /// Input, until `deadline` (a deadline of `kind`).
    Read {
        deadline: Instant,
        kind: TimeoutKind,
    },
    /// Room in the send buffer, until no progress for the write timeout (or the exchange deadline).
    Flush { then_close: bool, deadline: Instant },
    /// A completion, until `until`.
    Park { until: Instant },
    /// The end of a graceful close's linger.
    Linger { end: Instant },
    /// Nothing yet (the connection is being run).
    Running,
    /// Used up its turn with more to do; `step` runs again after the other ready connections had theirs.
    Yielded { step: Step },
}

/// How one run of a connection ended.
enum Flow {
    Next(Step),
    Wait,
    Close(CloseReason),
}

/// One connection being served.
struct Conn<S, T> {
    info: ConnectionInfo,
    ticket: Option<T>,
    reservation: Option<Reservation>,
    listener: Arc<ListenerRuntime>,
    session: Option<S>,
    completer: Completer,
    wait: Wait,
    readable: bool,
    writable: bool,
    /// Registered with the loop's epoll. A new connection is first served without it (its socket is read
    /// at once, since a request often arrives with the handshake) and registered once it waits, so a peer
    /// that resets at once costs no `epoll_ctl`; the registration reports any readiness that came since.
    registered: bool,
    /// The peer's FIN (or a hang-up) was reported: no edge follows it, so a short read no longer means
    /// the socket is drained, and reading goes on until `recv` answers 0.
    read_closed: bool,
    requests: SessionRequests,
    phase: Phase,
    phase_override: Option<Phase>,
    exchange: Option<Instant>,
    idle_timeout: Option<Duration>,
    pending: Option<CloseReason>,
    peer_closed: bool,
    /// The session's half close (see `net_io_core::session`).
    write_shut: WriteShut,
    input_changed: bool,
    rate_in: Option<RateWindow>,
    rate_out: Option<RateWindow>,
    /// Bytes of the request in progress that the input rate window has not counted: the window starts only
    /// when the request has to wait for more input (and counts these then), so a request that arrives in
    /// one read, the usual case, costs the minimum-rate rule nothing.
    received_unjudged: u64,
    bytes_in: u64,
    bytes_out: u64,
    eof_seen: bool,
    /// The gate was asked for the write call in progress.
    checked: bool,
    /// The last `recv` or `send` said `EAGAIN`: try once more a tick later in case no edge follows (an
    /// injected or otherwise spurious `EAGAIN` has none). One retry per wait, so a full send buffer is not
    /// polled.
    recheck: bool,
    /// The write deadline in force, or `None` after progress until the next wait works it out.
    write_deadline: Option<Instant>,
    /// PROXY header bytes read so far (only while a handshake runs).
    prefix: Vec<u8>,
    /// The most output queued at once since the connection last went idle: the output queue keeps its
    /// allocation at that size, so an idle connection above [`OUTPUT_KEPT_IDLE`] gives it back.
    output_peak: usize,
    /// The reason a lingering close will report.
    closing_reason: Option<CloseReason>,
    linger_discarded: usize,
    /// The socket's `SO_RCVTIMEO` as last set (inherited from the listener at first), which only a solo read
    /// waits under: it is set again only when the wanted slice moves by more than a tick.
    armed: Option<Duration>,
}

/// One slot of a loop's slab; reused by one connection after another.
struct Entry<S, T> {
    owner: SlotOwner,
    shared: Arc<ConnectionSlot>,
    generation: u32,
    receiver: CompletionReceiver,
    waker: Waker,
    output: Output,
    read: Option<ReadBuffer>,
    /// The earliest time this entry has in the timer heap, if any.
    timer_at: Option<Instant>,
    conn: Option<Conn<S, T>>,
}

/// The state of one loop thread.
struct EventLoop<'r, G: Gate, F: SessionFactory> {
    runtime: &'r Runtime<G, SessionWorkload<F>>,
    core: &'r Core,
    index: usize,
    epoll: Epoll,
    entries: Vec<Entry<F::Session, G::Ticket>>,
    /// Free slots, lowest index first, so the top of the slab empties and can be cut off after a spike. May
    /// hold indices that are stale (cut off, or taken again): `take_free` skips those.
    free: BinaryHeap<Reverse<u32>>,
    /// A connection closed while at most a quarter of the slab is in use: see whether the top of the slab
    /// can be cut off once this turn is done (a check of one slot when the top is still taken).
    shrink_wanted: bool,
    /// The generation a newly made slot starts at: above that of every slot ever cut off, so no stale timer
    /// or token naming a cut-off slot matches the slot made again at its index.
    generation_floor: u32,
    timers: BinaryHeap<Reverse<(Instant, u32, u32)>>,
    buffers: WorkerBuffers,
    /// Connections of this loop holding a read buffer now: the loop keeps about this many free buffers
    /// per class (at least [`FREE_BUFFERS_KEPT`]) and gives the rest back to the shared budget.
    holding: usize,
    incoming: Vec<Job<G::Ticket>>,
    ready: Vec<u32>,
    lingering: Vec<u32>,
    /// Connections that used up their turn, with the generation they had then.
    yielded: Vec<(u32, u32)>,
    live: usize,
    scratch: Box<[u8]>,
    /// The longest solo read (zero: solo reads are off).
    solo_slice: Duration,
    /// The connection (index, generation) that got data in this turn: the one candidate for a solo read.
    served: Option<(u32, u32)>,
    /// The next `read` blocks in `recv` under `SO_RCVTIMEO` instead of using `MSG_DONTWAIT`; it holds the
    /// wait the connection had, which a slice without input leaves in force (its deadline does not move).
    solo_block: Option<Wait>,
    /// This loop told placement that it is in solo reads ([`LoopShared::solo`]).
    solo_marked: bool,
    /// The loop eventfd's signal count up to which every wake has been acted on: a solo read happens only
    /// while the count still reads this, so no wake waits behind it for longer than one slice.
    wake_seen: u64,
    /// The connection (index, generation) whose turn is running, `None` between turns. A panic inside the
    /// driver leaves it set: [`EventLoop::contain_panic`] then closes that connection instead of leaving it
    /// open with no event, timer or turn that would ever come back to it.
    serving: Option<(u32, u32)>,
    /// The clock as read during the connection turn in progress: taken at its first use, forgotten when the
    /// turn ends and after every session hook (a hook may run for long, and the deadlines that follow it
    /// count from a reading taken after it). See [`EventLoop::now`].
    turn_clock: Cell<Option<Instant>>,
}

impl<G: Gate, F: SessionFactory> Runtime<G, SessionWorkload<F>> {
    /// The body of loop thread `index`.
    pub(crate) fn event_loop(self: Arc<Self>, index: usize) {
        let runtime = &*self;
        let epoll = match Epoll::new() {
            Ok(epoll) => epoll,
            Err(_) => return runtime.refuse_inbox_forever(index),
        };
        let wake = Arc::clone(&runtime.core.loops[index].wake);
        if epoll
            .add(wake.eventfd.as_fd(), WAKE_TOKEN, Interest::READABLE)
            .is_err()
        {
            return runtime.refuse_inbox_forever(index);
        }
        let mut event_loop = EventLoop {
            runtime,
            core: &runtime.core,
            index,
            epoll,
            entries: Vec::new(),
            free: BinaryHeap::new(),
            shrink_wanted: false,
            generation_floor: 0,
            timers: BinaryHeap::new(),
            buffers: runtime.pool.worker(),
            holding: 0,
            incoming: Vec::new(),
            ready: Vec::new(),
            lingering: Vec::new(),
            yielded: Vec::new(),
            live: 0,
            scratch: vec![0u8; CHUNK].into_boxed_slice(),
            solo_slice: runtime.core.loops[index].solo_slice,
            served: None,
            solo_block: None,
            solo_marked: false,
            wake_seen: 0,
            serving: None,
            turn_clock: Cell::new(None),
        };
        event_loop.run();
    }

    /// A loop that could not start: refuse whatever reaches its inbox until the server stops. It reports
    /// itself as full so that placement passes it by while any other loop runs.
    fn refuse_inbox_forever(&self, index: usize) {
        self.core.loops[index].mark_dead();
        let wake = Arc::clone(&self.core.loops[index].wake);
        let slot = index;
        loop {
            for job in self.inboxes[index].close() {
                self.core.loops[index].remove_load();
                self.refuse_job(job, RefusalCause::Busy, slot);
            }
            if self.core.stopping.load(Ordering::Acquire) {
                return;
            }
            let _ = net_io_sys::wait::wait_readable(
                wake.eventfd.as_fd(),
                Some(Duration::from_millis(100)),
            );
            let _ = wake.eventfd.drain();
        }
    }
}

impl<'r, G: Gate, F: SessionFactory> EventLoop<'r, G, F> {
    fn run(&mut self) {
        let mut events = Events::with_capacity(EVENTS_PER_WAIT);
        let mut inbox_closed = false;
        let mut stop_seen: Option<Instant> = None;
        loop {
            let stopping = stop_seen.is_some();
            let solo = catch_unwind(AssertUnwindSafe(|| self.solo_candidate(stopping)));
            if let Ok(Some((index, slice))) = solo {
                // Contained like every other turn of the driver (see `wait_and_dispatch`).
                let turn = catch_unwind(AssertUnwindSafe(|| {
                    self.serve(index, |event_loop| event_loop.solo_read(index, slice))
                }));
                self.contain(turn);
            } else {
                if std::mem::take(&mut self.solo_marked) {
                    self.core.loops[self.index]
                        .solo
                        .store(false, Ordering::Relaxed);
                }
                self.wait_and_dispatch(&mut events, stop_seen.is_some(), &mut inbox_closed);
            }
            let housekeeping = catch_unwind(AssertUnwindSafe(|| {
                self.fire_timers();
                self.end_overdue_lingers();
                self.resume_yielded();
                if std::mem::take(&mut self.shrink_wanted) {
                    self.shrink_slab();
                }
            }));
            self.contain(housekeeping);
            if self.core.stopping.load(Ordering::Acquire) {
                // A drain ran before the stop; what is still open now is killed so the stop can finish.
                let since = *stop_seen.get_or_insert_with(Instant::now);
                if inbox_closed && self.live == 0 {
                    return;
                }
                if since.elapsed() > Duration::from_secs(1) {
                    let killed =
                        catch_unwind(AssertUnwindSafe(|| self.kill_all(CODE_DRAIN_DEADLINE)));
                    self.contain(killed);
                }
                if !inbox_closed {
                    inbox_closed = self.runtime.inboxes[self.index].take_into(&mut self.incoming);
                    let admitted = catch_unwind(AssertUnwindSafe(|| self.admit_incoming()));
                    self.contain(admitted);
                }
            }
        }
    }

    /// Runs `call` as connection `index`'s turn: a panic inside it (caught further up) is blamed on
    /// that connection, see [`EventLoop::contain_panic`].
    fn serve<T>(&mut self, index: u32, call: impl FnOnce(&mut Self) -> T) -> T {
        self.serving = self
            .entries
            .get(index as usize)
            .map(|entry| (index, entry.generation));
        self.turn_clock.set(None);
        let result = call(self);
        self.turn_clock.set(None);
        self.serving = None;
        result
    }

    /// The server clock's time for the connection turn in progress (see [`EventLoop::turn_clock`]).
    ///
    /// A keep-alive round trip needs the time for its read rate, the session's context twice, its flush and
    /// the next wait's deadline; reading the clock once for all of them until a hook runs saves about half
    /// of the readings (each a virtual call and a `clock_gettime`, a few percent of the loop's own time).
    /// Within one turn the loop runs only its own bookkeeping and system calls that do not block, so the
    /// reading is at most microseconds old; a solo read's blocking `recv` forgets it.
    fn now(&self) -> Instant {
        turn_now(&self.turn_clock, self.core)
    }

    /// Acts on the outcome of a contained part of the loop: after a panic, closes the connection whose
    /// turn it interrupted and puts back in line whatever the interrupted pass had taken out of it.
    fn contain(&mut self, outcome: std::thread::Result<()>) {
        if outcome.is_err() {
            let _ = catch_unwind(AssertUnwindSafe(|| self.contain_panic()));
            let _ = catch_unwind(AssertUnwindSafe(|| self.requeue_after_panic()));
        }
        self.serving = None;
    }

    /// After a panic: a pass that had taken its list (turns to resume, completions to deliver) lost the rest
    /// of it. Connections waiting for another turn go back on the turn list; parked ones are handed to the
    /// next wake, which looks for their completions (one that has none parks again); queued connections not
    /// yet started are started at that wake. O(slots), on the panic path only.
    fn requeue_after_panic(&mut self) {
        let mut parked = Vec::new();
        for (index, entry) in self.entries.iter().enumerate() {
            let Some(conn) = entry.conn.as_ref() else {
                continue;
            };
            let index = index as u32;
            match conn.wait {
                Wait::Yielded { .. }
                    if !self.yielded.iter().any(|&(queued, _)| queued == index) =>
                {
                    self.yielded.push((index, entry.generation));
                }
                Wait::Park { .. } => parked.push(index),
                _ => {}
            }
        }
        let wake = &self.core.loops[self.index].wake;
        if !parked.is_empty() {
            wake.ready
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .extend(parked);
        }
        let _ = wake.eventfd.signal();
    }

    /// A panic inside the driver itself (every session hook, the gate and the event sink are contained
    /// already) interrupted a connection's turn and left it in a state no event, timer or turn would leave:
    /// it is closed abortively as `SessionPanicked`, its one close delivered as usual, so it is neither
    /// stranded nor its caps, ticket and slot kept. A panic between turns blames no connection.
    fn contain_panic(&mut self) {
        let Some((index, generation)) = self.serving.take() else {
            return;
        };
        let Some(entry) = self.entries.get(index as usize) else {
            return;
        };
        let Some(conn) = entry
            .conn
            .as_ref()
            .filter(|_| entry.generation == generation)
        else {
            return;
        };
        let id = conn.info.id;
        let lingering = matches!(conn.wait, Wait::Linger { .. });
        let closed = catch_unwind(AssertUnwindSafe(|| {
            self.core.emit(Event::SessionPanicked { id });
            if lingering {
                self.finish_linger(index, true);
            } else {
                self.close(index, CloseReason::SessionPanicked);
            }
        }));
        if closed.is_err() {
            // The close itself panicked (the fault persists): give the slot and its socket up at least, so
            // the peer sees a reset and the connection's caps come back.
            let _ = catch_unwind(AssertUnwindSafe(|| self.abandon(index)));
        }
        self.serving = None;
    }

    /// Drops connection `index` with an RST and no further hooks: the last resort when closing it panicked.
    fn abandon(&mut self, index: u32) {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.take() else {
            return;
        };
        if let Some(socket) = entry.owner.socket() {
            let _ = socket::set_linger(socket, Linger::Abortive);
        }
        drop(entry.owner.release());
        entry.shared.linger.store(0, Ordering::Release);
        entry.timer_at = None;
        entry.generation = entry.generation.wrapping_add(1);
        entry.receiver.unbind();
        entry.output.clear();
        if entry.read.take().is_some() {
            self.holding = self.holding.saturating_sub(1);
        }
        self.lingering.retain(|&lingering| lingering != index);
        let shared = &self.core.loops[self.index];
        shared.ids().remove(&conn.info.id.get());
        shared.remove_load();
        self.free.push(Reverse(index));
        self.live -= 1;
        // The reservation, the ticket and the session go with `conn`: the caps come back by their drop.
        drop(conn);
    }

    /// One `epoll_wait` and what it reported: readiness to the connections, a wake to the inbox, the
    /// completions and the lingers.
    fn wait_and_dispatch(&mut self, events: &mut Events, stopping: bool, inbox_closed: &mut bool) {
        let timeout = catch_unwind(AssertUnwindSafe(|| {
            if self.yielded.is_empty() {
                self.next_timeout()
            } else {
                Some(Duration::ZERO)
            }
        }));
        // A clock that panics gets one tick's wait; the turn that reads it next is contained.
        let mut timeout = timeout.unwrap_or(Some(self.core.limits.tick));
        if stopping {
            // Stopping: look again soon, so the forced close below happens even with nothing ready.
            timeout = Some(timeout.map_or(STOP_POLL, |timeout| timeout.min(STOP_POLL)));
        }
        let eventfd = Arc::clone(&self.core.loops[self.index].wake.eventfd);
        // Loaded before the wait: each signal counted here wrote the eventfd before, so the wait reports it
        // unless this loop drained it already (and then acted on it).
        let signals_before = eventfd.signals();
        if self.epoll.wait(events, timeout).is_err() {
            std::thread::sleep(Duration::from_millis(1));
            return;
        }
        let mut woken = false;
        for event in events.iter() {
            if event.token == WAKE_TOKEN {
                woken = true;
                continue;
            }
            // Every hook is contained already; this keeps a bug in the driver itself from taking down
            // the loop and every connection on it, and closes the connection it was serving.
            let (index, _) = split_token(event.token);
            let turn = catch_unwind(AssertUnwindSafe(|| {
                self.serve(index, |event_loop| {
                    event_loop.on_event(event.token, event.readiness)
                })
            }));
            self.contain(turn);
        }
        if woken {
            // Loaded before the drain: whatever these signals queued is taken by `on_wake` below.
            let signals = eventfd.signals();
            let _ = eventfd.drain();
            self.wake_seen = signals;
            let wake = catch_unwind(AssertUnwindSafe(|| self.on_wake(inbox_closed)));
            self.contain(wake);
        } else if events.len() < EVENTS_PER_WAIT {
            // A batch that was not full reported everything ready, and the (level-triggered) eventfd was not:
            // the signals counted before the wait were drained and acted on already.
            self.wake_seen = signals_before;
        }
    }

    /// The connection to serve with a solo read instead of an `epoll_wait`, and for how long at most.
    ///
    /// Only when the loop holds exactly one connection, that connection got data in the turn just run (a
    /// round trip is in progress, so more input is likely to follow soon), it now waits for input with its
    /// socket drained, and nothing else could need the loop: no yielded turn, no lingering close, no queued
    /// connection, no stop, no wake signalled since the last one acted on (read from memory, not from the
    /// eventfd), no timer due within [`SOLO_TIMER_MARGIN`]. The slice ends at the next timer.
    fn solo_candidate(&mut self, stopping: bool) -> Option<(u32, Duration)> {
        let (index, generation) = self.served.take()?;
        if self.solo_slice.is_zero()
            || self.live != 1
            || stopping
            || !self.yielded.is_empty()
            || !self.lingering.is_empty()
            || !self.incoming.is_empty()
            || self.core.stopping.load(Ordering::Acquire)
            || self.core.loops[self.index].wake.eventfd.signals() != self.wake_seen
        {
            return None;
        }
        let entry = self.entries.get(index as usize)?;
        let conn = entry.conn.as_ref()?;
        let waits_to_read = matches!(conn.wait, Wait::Read { .. })
            && conn.registered
            && !conn.readable
            && !conn.read_closed
            && !conn.peer_closed
            && !conn.input_changed;
        if entry.generation != generation || !waits_to_read {
            return None;
        }
        let slice = match self.next_timeout() {
            Some(timeout) if timeout < SOLO_TIMER_MARGIN => return None,
            Some(timeout) => timeout.min(self.solo_slice),
            None => self.solo_slice,
        };
        Some((index, slice))
    }

    /// Waits for the one connection's next input in a blocking `recv` under `SO_RCVTIMEO` (at most `slice`)
    /// instead of in `epoll_wait`, then serves it: a round trip costs the `recv` and the `send`, as on a
    /// worker thread, where the readiness loop costs an `epoll_wait` besides.
    ///
    /// A kill of this connection (or a drain's or shed's close of it while idle) shuts its read side down, so
    /// the `recv` returns at once. Any other wake (a new connection, a completion, a stop, a kill of a
    /// lingering close) is seen when the slice ends. No input within the slice: the socket is drained, so
    /// the next turn waits in `epoll_wait` again (its edge-triggered registration reports input from then
    /// on; input that the solo read took leaves at most a stale edge, which costs one `recv` answering
    /// `EAGAIN` or nothing at all).
    fn solo_read(&mut self, index: u32, slice: Duration) {
        let margin = SOLO_REARM_MARGIN.min(self.core.limits.tick);
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        let Some(socket) = entry.owner.socket() else {
            return;
        };
        // The kernel rounds SO_RCVTIMEO up to a jiffy, so an armed timeout within a millisecond of the slice
        // is as good. Not within a tick: the socket comes armed with the idle timeout, which may be a tick
        // (seconds, with a long tick), and a solo read under it would hold the loop that long.
        let close_enough = conn
            .armed
            .is_some_and(|armed| !armed.is_zero() && armed.abs_diff(slice) <= margin);
        if !close_enough {
            if socket::set_receive_timeout(socket, Some(slice)).is_err() {
                // No solo read this time; `epoll_wait` serves the connection as before.
                return;
            }
            conn.armed = Some(slice);
        }
        conn.readable = true;
        let waiting = conn.wait;
        if !self.solo_marked {
            self.solo_marked = true;
            self.core.loops[self.index]
                .solo
                .store(true, Ordering::Relaxed);
        }
        self.solo_block = Some(waiting);
        self.drive(index, Step::Read);
        self.solo_block = None;
    }

    /// How long the next `epoll_wait` may sleep: until the earliest timer, cut to a tick under a manual clock.
    fn next_timeout(&self) -> Option<Duration> {
        let wanted = self
            .timers
            .peek()
            .map(|Reverse((at, _, _))| at.saturating_duration_since(self.core.now()));
        let wanted = if self.core.manual_clock {
            Some(wanted.map_or(self.core.limits.tick, |wanted| {
                wanted.min(self.core.limits.tick)
            }))
        } else {
            wanted
        };
        // An already-due timer still waits one millisecond at least (epoll rounds up), never spins at zero.
        wanted.map(|wanted| wanted.max(Duration::from_micros(1)))
    }

    fn on_wake(&mut self, inbox_closed: &mut bool) {
        *inbox_closed = self.runtime.inboxes[self.index].take_into(&mut self.incoming);
        self.admit_incoming();
        {
            let wake = &self.core.loops[self.index].wake;
            let mut ready = wake
                .ready
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            std::mem::swap(&mut *ready, &mut self.ready);
        }
        let mut ready = std::mem::take(&mut self.ready);
        for index in ready.drain(..) {
            self.serve(index, |event_loop| event_loop.on_completion(index));
        }
        self.ready = ready;
        // A kill or a drain deadline cuts a lingering close short by clearing its word.
        let mut position = 0;
        while position < self.lingering.len() {
            let index = self.lingering[position];
            let entry = &self.entries[index as usize];
            let cut = entry.conn.as_ref().is_some_and(|conn| {
                entry.shared.linger.load(Ordering::Acquire) != conn.info.id.get()
            });
            if cut {
                self.serve(index, |event_loop| event_loop.finish_linger(index, true));
            } else {
                position += 1;
            }
        }
    }

    /// Gives each connection that used up its last turn another one.
    fn resume_yielded(&mut self) {
        let mut yielded = std::mem::take(&mut self.yielded);
        for (index, generation) in yielded.drain(..) {
            let Some(entry) = self.entries.get(index as usize) else {
                continue;
            };
            if entry.generation != generation {
                continue;
            }
            if let Some(Wait::Yielded { step }) = entry.conn.as_ref().map(|conn| conn.wait) {
                self.serve(index, |event_loop| event_loop.drive(index, step));
            }
        }
        // Keep the capacity; connections that yielded again during this pass are in `self.yielded`.
        yielded.append(&mut self.yielded);
        self.yielded = yielded;
    }

    /// Ends lingers whose real-time end passed (the heap runs on the server's clock, which may be manual).
    fn end_overdue_lingers(&mut self) {
        if self.lingering.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut position = 0;
        while position < self.lingering.len() {
            let index = self.lingering[position];
            let overdue = self.entries[index as usize]
                .conn
                .as_ref()
                .is_some_and(|conn| matches!(conn.wait, Wait::Linger { end } if now >= end));
            if overdue {
                self.serve(index, |event_loop| event_loop.finish_linger(index, false));
            } else {
                position += 1;
            }
        }
    }

    fn kill_all(&mut self, code: u16) {
        for index in 0..self.entries.len() {
            let entry = &self.entries[index];
            let Some(conn) = entry.conn.as_ref() else {
                continue;
            };
            let id = conn.info.id.get();
            let index = index as u32;
            if matches!(conn.wait, Wait::Linger { .. }) {
                self.serve(index, |event_loop| event_loop.finish_linger(index, true));
                continue;
            }
            entry
                .shared
                .slot
                .kill(id, code, net_io_sys::kill::KillCondition::Always);
            self.serve(index, |event_loop| {
                event_loop.close(index, reason_for_code(code))
            });
        }
    }

    // ----- admission -----

    /// Starts the queued connections in the order they came. Each is taken off `incoming` only as it starts,
    /// so a panic while starting one leaves the rest queued for the next pass.
    fn admit_incoming(&mut self) {
        self.incoming.reverse();
        while let Some(job) = self.incoming.pop() {
            self.start(job);
            self.serving = None;
            self.turn_clock.set(None);
        }
    }

    fn new_entry(&mut self) -> io::Result<u32> {
        let index = self.entries.len() as u32;
        let shared = Arc::new(ConnectionSlot {
            slot: Arc::new(KillSlot::new()),
            linger: Arc::new(AtomicU64::new(0)),
            lane: AtomicU8::new(0),
        });
        let Some(owner) = SlotOwner::claim(Arc::clone(&shared.slot)) else {
            return Err(io::Error::other("a fresh kill slot was already claimed"));
        };
        let (_ring, receiver) = CompletionRing::with_capacity(self.core.limits.completion_queue);
        let waker = Waker::from(Arc::new(EntryWake {
            wake: Arc::clone(&self.core.loops[self.index].wake),
            index,
        }));
        self.core.loops[self.index]
            .slots()
            .push(Arc::clone(&shared));
        self.entries.push(Entry {
            owner,
            shared,
            generation: self.generation_floor,
            receiver,
            waker,
            output: Output::new(self.core.limits.output_budget),
            read: None,
            timer_at: None,
            conn: None,
        });
        Ok(index)
    }

    /// The lowest free slot, skipping indices that were cut off or are taken.
    fn take_free(&mut self) -> Option<u32> {
        while let Some(Reverse(index)) = self.free.pop() {
            if self
                .entries
                .get(index as usize)
                .is_some_and(|entry| entry.conn.is_none())
            {
                return Some(index);
            }
        }
        None
    }

    /// Cuts free slots off the top of the slab once at most a quarter of it is in use, down to twice the
    /// live connections (at least [`SLAB_KEPT`]): after a spike the loop gives back its slots' memory
    /// (about a kilobyte each with their kill slot, completion ring and waker). New connections take the
    /// lowest free slot, so the top empties as the spike's connections close. Runs between turns, when no
    /// slot index is in use; timers, tokens, completions and turns that still name a cut-off slot find no
    /// entry (or a newer generation) and are ignored.
    fn shrink_slab(&mut self) {
        let length = self.entries.len();
        if length <= SLAB_KEPT || self.live * 4 >= length {
            return;
        }
        let floor = SLAB_KEPT.max(self.live * 2);
        let mut keep = length;
        while keep > floor && self.entries[keep - 1].conn.is_none() {
            keep -= 1;
        }
        if keep == length {
            return;
        }
        for entry in &self.entries[keep..] {
            self.generation_floor = self.generation_floor.max(entry.generation.wrapping_add(1));
        }
        self.entries.truncate(keep);
        self.core.loops[self.index].slots().truncate(keep);
    }

    /// Takes one admitted connection into the loop.
    fn start(&mut self, job: Job<G::Ticket>) {
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
        } = job;
        info.worker = Some(WorkerId(self.index as u32));
        let limits = listener.limits;
        let entry = &mut self.entries[index as usize];
        entry.generation = entry.generation.wrapping_add(1);
        self.serving = Some((index, entry.generation));
        self.turn_clock.set(None);
        entry.shared.lane.store(info.lane.0, Ordering::Release);
        entry.owner.occupy(info.id.get(), socket);
        entry.receiver.bind(info.id);
        entry.output.reset(limits.output_budget);
        self.core.loops[self.index]
            .ids()
            .insert(info.id.get(), Arc::clone(&entry.shared));
        let completer = entry.receiver.completer(info.id, entry.waker.clone());
        entry.conn = Some(Conn {
            info,
            ticket: Some(ticket),
            reservation: Some(reservation),
            listener,
            session: None,
            completer,
            wait: Wait::Running,
            readable: true,
            writable: true,
            registered: false,
            read_closed: false,
            requests: SessionRequests::default(),
            phase: Phase::Idle,
            phase_override: None,
            exchange: None,
            idle_timeout: None,
            pending: None,
            peer_closed: false,
            write_shut: WriteShut::Open,
            input_changed: false,
            rate_in: limits.min_rate.map(RateWindow::new),
            rate_out: limits.min_rate.map(RateWindow::new),
            received_unjudged: 0,
            bytes_in: 0,
            bytes_out: 0,
            eof_seen: false,
            checked: false,
            recheck: false,
            write_deadline: None,
            prefix: Vec::new(),
            output_peak: 0,
            closing_reason: None,
            linger_discarded: 0,
            armed: Some(limits.idle_timeout),
        });
        self.live += 1;
        let generation = entry.generation;
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
    fn register(&mut self, index: u32, generation: u32) {
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

    /// Makes the session and runs its `on_open`.
    fn open_session(&mut self, index: u32) {
        let core = self.core;
        let runtime = self.runtime;
        let info = self.conn(index).info;
        let created = catch_unwind(AssertUnwindSafe(|| runtime.workload.factory.create(&info)));
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

    fn on_event(&mut self, token: u64, readiness: Interest) {
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
    fn resume(&mut self, index: u32) {
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
            Wait::Handshake { .. } if conn.readable => self.handshake(index),
            Wait::Read { .. } if conn.readable => self.drive(index, Step::Read),
            Wait::Flush { then_close, .. } if conn.writable => {
                let step = if then_close { Step::Close } else { Step::Write };
                self.drive(index, step);
            }
            _ => {}
        }
    }

    fn on_completion(&mut self, index: u32) {
        let Some(entry) = self.entries.get_mut(index as usize) else {
            return;
        };
        let Some(conn) = entry.conn.as_ref() else {
            return;
        };
        if let Wait::Park { until } = conn.wait {
            self.drive(index, Step::Park { until });
        }
    }

    // ----- timers -----

    /// Puts `at` in the heap for `index` unless an earlier (or equal) time is there already.
    fn schedule(&mut self, index: u32, at: Instant) {
        let entry = &mut self.entries[index as usize];
        if entry.timer_at.is_some_and(|current| current <= at) {
            return;
        }
        entry.timer_at = Some(at);
        self.timers.push(Reverse((at, index, entry.generation)));
        if self.timers.len() > TIMERS_SLACK + 2 * self.live {
            self.compact_timers();
        }
    }

    /// Drops the heap's stale entries (of closed connections, or superseded by an earlier time), keeping its
    /// allocation. A closed connection leaves its entry behind until it comes due, so with long timeouts and
    /// many short connections the heap would otherwise grow with the connection rate times the timeout (an
    /// hour's idle timeout at 20,000 closes/s is 72 million entries). Each live connection has at most one
    /// current entry, so after this the heap holds at most `live`; the next compaction is `live + slack`
    /// pushes away, which makes it O(1) per push.
    fn compact_timers(&mut self) {
        let entries = &self.entries;
        let mut timers = std::mem::take(&mut self.timers).into_vec();
        timers.retain(|Reverse((at, index, generation))| {
            entries.get(*index as usize).is_some_and(|entry| {
                entry.generation == *generation
                    && entry.timer_at == Some(*at)
                    && entry.conn.is_some()
            })
        });
        self.timers = BinaryHeap::from(timers);
    }

    fn fire_timers(&mut self) {
        let now = self.core.now();
        while let Some(Reverse((at, index, generation))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            let Some(entry) = self.entries.get_mut(index as usize) else {
                continue;
            };
            if entry.generation != generation || entry.timer_at != Some(at) || entry.conn.is_none()
            {
                continue;
            }
            entry.timer_at = None;
            self.serve(index, |event_loop| event_loop.on_timer(index, now));
        }
    }

    /// A timer of `index` came due: act on whatever deadline passed, or put the next one back in the heap.
    fn on_timer(&mut self, index: u32, now: Instant) {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        if let Some(code) = entry.owner.closing()
            && !matches!(conn.wait, Wait::Linger { .. })
        {
            return self.close(index, reason_for_code(code));
        }
        match conn.wait {
            Wait::Handshake { deadline } => {
                if now >= deadline {
                    return self.close(index, CloseReason::HandshakeTimeout);
                }
                self.schedule(index, deadline);
            }
            Wait::Read { deadline, kind } => {
                if let Some(rate) = conn.rate_in.as_mut()
                    && rate.is_too_slow(now)
                {
                    return self.close(
                        index,
                        CloseReason::SlowPeer {
                            direction: Direction::In,
                        },
                    );
                }
                if now >= deadline {
                    return self.read_deadline(index, kind);
                }
                if std::mem::take(&mut conn.recheck) {
                    conn.readable = true;
                    return self.drive(index, Step::Read);
                }
                let next = earliest(
                    deadline,
                    conn.rate_in.as_ref().and_then(|r| r.next_check(now)),
                );
                self.schedule(index, next);
            }
            Wait::Flush {
                then_close,
                deadline,
            } => {
                if let Some(rate) = conn.rate_out.as_mut()
                    && rate.is_too_slow(now)
                {
                    return self.close(
                        index,
                        CloseReason::SlowPeer {
                            direction: Direction::Out,
                        },
                    );
                }
                if now >= deadline {
                    return self.write_deadline(index, now);
                }
                if conn.recheck && !conn.writable {
                    // Keep `recheck` set: a second EAGAIN then waits for the edge alone.
                    conn.writable = true;
                    let step = if then_close { Step::Close } else { Step::Write };
                    return self.drive(index, step);
                }
                let next = earliest(
                    deadline,
                    conn.rate_out.as_ref().and_then(|r| r.next_check(now)),
                );
                self.schedule(index, next);
            }
            Wait::Park { until } => {
                if now >= until {
                    return self.park_deadline(index);
                }
                self.schedule(index, until);
            }
            Wait::Linger { end } => {
                let real_now = Instant::now();
                if real_now >= end {
                    return self.finish_linger(index, false);
                }
                self.schedule(index, deadline_after(now, end - real_now));
            }
            Wait::Running | Wait::Yielded { .. } => {}
        }
    }

    fn read_deadline(&mut self, index: u32, kind: TimeoutKind) {
        let conn = self.conn(index);
        conn.pending = Some(kind.close_reason());
        conn.wait = Wait::Running;
        let Some(step) = self.hook(index, |session, context| session.on_timeout(kind, context))
        else {
            return self.panicked(index);
        };
        let conn = self.conn(index);
        if matches!(step, Step::Read | Step::Write | Step::Park { .. }) {
            // The session chose to carry on: the deadline starts again from now.
            conn.pending = None;
            if kind == TimeoutKind::Exchange {
                conn.exchange = None;
            }
        }
        self.drive(index, step);
    }

    /// A write (or exchange) deadline passed during a flush: the session decides, as in the threaded driver;
    /// a flush for `Close` that the session carries on becomes whatever step it returns.
    fn write_deadline(&mut self, index: u32, now: Instant) {
        let conn = self.conn(index);
        let kind = if conn.exchange.is_some_and(|exchange| now >= exchange) {
            TimeoutKind::Exchange
        } else {
            TimeoutKind::Write
        };
        if kind == TimeoutKind::Exchange {
            conn.exchange = None;
        }
        conn.wait = Wait::Running;
        conn.checked = false;
        conn.write_deadline = None;
        if let Some(rate) = conn.rate_out.as_mut() {
            rate.stop();
        }
        let Some(step) = self.hook(index, |session, context| session.on_timeout(kind, context))
        else {
            return self.panicked(index);
        };
        match step {
            // Unsent output stays queued, so even `Close` ends abortively with the deadline's reason.
            Step::Close | Step::Abort => self.close(index, kind.close_reason()),
            next => self.drive(index, next),
        }
    }

    fn park_deadline(&mut self, index: u32) {
        match self.park_timed_out(index) {
            Flow::Next(step) => self.drive(index, step),
            Flow::Close(reason) => self.close(index, reason),
            Flow::Wait => {}
        }
    }

    /// The park deadline passed: the session's `on_timeout` picks the next step.
    fn park_timed_out(&mut self, index: u32) -> Flow {
        let conn = self.conn(index);
        conn.pending = Some(CloseReason::ParkDeadline);
        conn.wait = Wait::Running;
        let Some(step) = self.hook(index, |session, context| {
            session.on_timeout(TimeoutKind::Park, context)
        }) else {
            return self.panicked_flow(index);
        };
        if matches!(step, Step::Read | Step::Write | Step::Park { .. }) {
            self.conn(index).pending = None;
        }
        Flow::Next(step)
    }

    // ----- the session steps -----

    /// Runs the session's steps until it waits for the peer, a completion or a timer, or closes.
    fn drive(&mut self, index: u32, mut step: Step) {
        let mut steps = 0;
        loop {
            steps += 1;
            if steps > STEPS_PER_TURN
                && matches!(step, Step::Read | Step::Write | Step::Park { .. })
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
                && conn.write_shut != WriteShut::Open
                && let Err(reason) = self.half_close(index)
            {
                return self.close(index, reason);
            }
            let flow = match step {
                Step::Read => self.read(index),
                Step::Write => self.flush(index, false),
                Step::Close => self.flush(index, true),
                Step::Park { until } => self.park(index, until),
                Step::Abort => {
                    let pending = self.conn(index).pending;
                    Flow::Close(pending.unwrap_or(CloseReason::SessionError))
                }
            };
            match flow {
                Flow::Next(next) => step = next,
                Flow::Wait => return,
                Flow::Close(reason) => return self.close(index, reason),
            }
        }
    }

    fn read(&mut self, index: u32) -> Flow {
        let core = self.core;
        let conn = self.conn(index);
        if conn.input_changed {
            conn.input_changed = false;
            return self.on_data(index);
        }
        if conn.peer_closed {
            return Flow::Close(conn.pending.unwrap_or(CloseReason::PeerClosed));
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
        let idle = conn.phase == Phase::Idle && read.unread_len() == 0 && entry.output.is_empty();
        if idle && core.draining.load(Ordering::Acquire) {
            return Flow::Close(core.idle_close_reason());
        }
        if idle && core.is_shed(conn.info.lane) {
            return Flow::Close(CloseReason::Shed);
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
                conn.peer_closed = true;
                conn.pending = Some(CloseReason::PeerClosed);
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
                if conn.phase == Phase::Idle && conn.phase_override.is_none() {
                    conn.phase = Phase::Receiving;
                }
                if let Some(rate) = conn.rate_in.as_mut() {
                    if rate.is_busy() {
                        let now = turn_now(&self.turn_clock, core);
                        rate.record(count as u64, now);
                        if rate.is_too_slow(now) {
                            return Flow::Close(CloseReason::SlowPeer {
                                direction: Direction::In,
                            });
                        }
                    } else if conn.phase != Phase::Idle {
                        // Counted when the request first waits for more input (see `wait_read`).
                        conn.received_unjudged += count as u64;
                    }
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
    fn wait_read(&mut self, index: u32, idle: bool) -> Flow {
        let now = self.now();
        let tick = self.core.limits.tick;
        let limits = self.limits(index);
        let (idle_timeout, read_timeout) = (limits.idle_timeout, limits.read_timeout);
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return Flow::Close(CloseReason::SessionError);
        };
        let (timeout, kind) = if conn.phase == Phase::Idle {
            (conn.idle_timeout.unwrap_or(idle_timeout), TimeoutKind::Idle)
        } else {
            (read_timeout, TimeoutKind::Read)
        };
        let mut deadline = deadline_after(now, timeout);
        let mut deadline_kind = kind;
        if let Some(exchange) = conn.exchange
            && exchange < deadline
        {
            deadline = exchange;
            deadline_kind = TimeoutKind::Exchange;
        }
        let mut wake_at = deadline;
        if idle {
            if !entry.owner.set_idle(true)
                && let Some(code) = entry.owner.closing()
            {
                return Flow::Close(reason_for_code(code));
            }
            if let Some(rate) = conn.rate_in.as_mut() {
                rate.stop();
            }
            conn.received_unjudged = 0;
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
        } else if let Some(rate) = conn.rate_in.as_mut() {
            if !rate.is_busy() {
                // The request waits for more input for the first time: from now on its rate is judged,
                // counting what it brought so far.
                rate.start(now);
                let received = std::mem::take(&mut conn.received_unjudged);
                if received > 0 {
                    rate.record(received, now);
                }
            }
            if let Some(check) = rate.next_check(now) {
                wake_at = wake_at.min(check);
            }
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

    fn on_data(&mut self, index: u32) -> Flow {
        let core = self.core;
        let now = self.now();
        let draining = core.draining.load(Ordering::Acquire);
        let entry = &mut self.entries[index as usize];
        let (Some(conn), Some(read)) = (entry.conn.as_mut(), entry.read.as_mut()) else {
            return Flow::Close(CloseReason::SessionError);
        };
        let Some(session) = conn.session.as_mut() else {
            return Flow::Close(CloseReason::SessionError);
        };
        let mut input = read.input();
        let before = input.len();
        let mut context =
            SessionContext::new(&conn.info, &mut entry.output, &mut conn.requests, now)
                .with_draining(draining)
                .with_completer(&conn.completer)
                .with_write_shut(conn.write_shut.is_sent());
        let step = catch_unwind(AssertUnwindSafe(|| {
            session.on_data(&mut input, &mut context)
        }));
        self.turn_clock.set(None);
        let consumed = input.consumed().min(before);
        read.consume(consumed);
        conn.input_changed = consumed > 0 && read.unread_len() > 0;
        apply_requests(conn);
        match step {
            Ok(step) => Flow::Next(step),
            Err(_) => self.panicked_flow(index),
        }
    }

    /// Flushes the output without blocking, asking the gate before each write call; `then_close` closes
    /// once it is all out, otherwise `on_writable` runs.
    fn flush(&mut self, index: u32, then_close: bool) -> Flow {
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
        // Bytes this flush sent before its output rate window started: the window starts only when a send
        // has to wait (and counts these then), so output that leaves at once, the usual small reply, costs
        // the minimum-rate rule nothing.
        let mut sent_unjudged: u64 = 0;
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
                        match conn.rate_out.as_mut() {
                            Some(rate) if rate.is_busy() => {
                                rate.record(count as u64, turn_now(&self.turn_clock, core));
                            }
                            Some(_) => sent_unjudged += count as u64,
                            None => {}
                        }
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
                            conn.exchange
                                .map_or(progress, |exchange| exchange.min(progress))
                        });
                        let mut wake_at = deadline;
                        if let Some(rate) = conn.rate_out.as_mut() {
                            if !rate.is_busy() {
                                rate.start(now);
                                if sent_unjudged > 0 {
                                    rate.record(sent_unjudged, now);
                                }
                            }
                            if rate.is_too_slow(now) {
                                return Flow::Close(CloseReason::SlowPeer {
                                    direction: Direction::Out,
                                });
                            }
                            if let Some(check) = rate.next_check(now) {
                                wake_at = wake_at.min(check);
                            }
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
        if let Some(rate) = conn.rate_out.as_mut() {
            rate.stop();
        }
        let unread = entry.read.as_ref().map_or(0, ReadBuffer::unread_len);
        if unread == 0 && conn.phase_override.is_none() {
            conn.phase = Phase::Idle;
            if let Some(rate) = conn.rate_in.as_mut() {
                rate.stop();
            }
            conn.received_unjudged = 0;
        }
        // A half close waiting for this flush sends its FIN before `on_writable` runs.
        if conn.write_shut != WriteShut::Open
            && let Err(reason) = self.half_close(index)
        {
            return Flow::Close(reason);
        }
        if then_close {
            let conn = self.conn(index);
            return Flow::Close(conn.pending.unwrap_or(CloseReason::SessionClosed));
        }
        match self.hook(index, |session, context| session.on_writable(context)) {
            Some(step) => Flow::Next(step),
            None => self.panicked_flow(index),
        }
    }

    /// Sends the FIN of a half close once the queue is empty; refuses bytes queued after it.
    fn half_close(&mut self, index: u32) -> Result<(), CloseReason> {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return Err(CloseReason::SessionError);
        };
        match conn.write_shut.due(entry.output.is_empty()) {
            HalfClose::Nothing => Ok(()),
            HalfClose::Refuse => Err(CloseReason::SessionError),
            HalfClose::SendFin => {
                let Some(socket) = entry.owner.socket() else {
                    return Err(CloseReason::SessionError);
                };
                match socket::shutdown(socket, std::net::Shutdown::Write) {
                    Ok(()) => {
                        conn.write_shut = WriteShut::Sent;
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
    fn denied(&mut self, index: u32, code: u16, refusal_bytes_max: usize) -> Flow {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return Flow::Close(CloseReason::EgressDenied(code));
        };
        let output = &mut entry.output;
        let nothing_sent = !output.response_started();
        output.clear();
        if let Some(session) = conn.session.as_mut() {
            let _ = catch_unwind(AssertUnwindSafe(|| session.on_denied(code, output)));
        }
        if nothing_sent
            && !output.is_empty()
            && let Some(socket) = entry.owner.socket()
        {
            let front = output.front();
            let text = &front[..front.len().min(refusal_bytes_max)];
            if let Ok(sent) = socket::send(socket, text) {
                conn.bytes_out += sent as u64;
            }
        }
        output.clear();
        Flow::Close(CloseReason::EgressDenied(code))
    }

    fn park(&mut self, index: u32, until: Instant) -> Flow {
        let now = self.core.now();
        let park_timeout = self.limits(index).park_timeout;
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return Flow::Close(CloseReason::SessionError);
        };
        let until = until.min(deadline_after(now, park_timeout));
        if let Some(rate) = conn.rate_in.as_mut() {
            rate.stop();
        }
        conn.received_unjudged = 0;
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

    fn handshake(&mut self, index: u32) {
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

    fn open_session_after_handshake(
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

    /// Closes connection `index` with `reason` (unless a killer won first): FIN and a linger inside the loop
    /// when graceful, RST otherwise; the bookkeeping follows once the socket is closed.
    fn close(&mut self, index: u32, reason: CloseReason) {
        let linger_bytes = self.limits(index).linger_bytes;
        let linger_timeout = self.limits(index).linger_timeout;
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        let id = conn.info.id.get();
        // A graceful close publishes its linger word before it takes the kill slot, so a killer that finds the
        // slot closing always finds the word to cut. (Published after, as it was, a kill landing between the
        // two found neither: it returned false and the linger ran its full course.)
        let graceful = !reason.is_abortive();
        if graceful {
            entry.shared.linger.store(id, Ordering::Release);
        }
        let code = entry.owner.begin_close(OWNER_CODE);
        let reason = if code == OWNER_CODE {
            reason
        } else {
            reason_for_code(code)
        };
        conn.closing_reason = Some(reason);
        let mut linger = false;
        if let Some(socket) = entry.owner.socket() {
            if reason.is_abortive() {
                let _ = socket::set_linger(socket, Linger::Abortive);
            } else {
                let _ = socket::shutdown(socket, Shutdown::Write);
                if !conn.eof_seen {
                    match socket::recv_nonblocking(socket, &mut self.scratch) {
                        Ok(0) => {}
                        Ok(count) if count >= linger_bytes => {}
                        Ok(count) => {
                            conn.linger_discarded = count;
                            linger = true;
                        }
                        // Nothing waiting: a close now sends FIN with an empty receive queue.
                        Err(_) => {}
                    }
                }
            }
        }
        if linger {
            // Until the linger ends a killer can cut it short (the loop's wake scans lingerers); one that cut
            // it already is seen by `linger_read` below.
            // The linger runs on real time, like the threaded driver's, whatever clock the server reads;
            // the loop checks lingerers against real time on every turn as well.
            conn.wait = Wait::Linger {
                end: deadline_after(Instant::now(), linger_timeout),
            };
            conn.readable = true;
            self.lingering.push(index);
            let at = deadline_after(self.core.now(), linger_timeout);
            self.schedule(index, at);
            return self.linger_read(index);
        }
        if graceful {
            // No linger: take the word back. A killer that cut it meanwhile asked for an RST; a kill that won
            // the slot first made the reason abortive, and the socket is set so already.
            let cut = entry.shared.linger.swap(0, Ordering::AcqRel) != id;
            if cut
                && !reason.is_abortive()
                && let Some(socket) = entry.owner.socket()
            {
                let _ = socket::set_linger(socket, Linger::Abortive);
            }
        }
        self.finish(index);
    }

    /// Reads and discards what the peer sends after our FIN, until EOF, the byte limit or `EAGAIN`.
    fn linger_read(&mut self, index: u32) {
        let linger_bytes = self.limits(index).linger_bytes;
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        if entry.shared.linger.load(Ordering::Acquire) != conn.info.id.get() {
            return self.finish_linger(index, true);
        }
        loop {
            let Some(socket) = entry.owner.socket() else {
                return self.finish_linger(index, false);
            };
            match socket::recv_nonblocking(socket, &mut self.scratch) {
                Ok(0) => return self.finish_linger(index, false),
                Ok(count) => {
                    conn.linger_discarded += count;
                    if conn.linger_discarded >= linger_bytes {
                        return self.finish_linger(index, false);
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => return self.finish_linger(index, false),
            }
        }
    }

    /// Ends a linger; `cut` (by a kill) or losing the linger word to a killer makes the close an RST.
    fn finish_linger(&mut self, index: u32, cut: bool) {
        self.lingering.retain(|&lingering| lingering != index);
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_ref() else {
            return;
        };
        let id = conn.info.id.get();
        // Whoever takes the word first decides, as in the threaded driver.
        let killed = entry.shared.linger.swap(0, Ordering::AcqRel) != id;
        if (cut || killed)
            && let Some(socket) = entry.owner.socket()
        {
            let _ = socket::set_linger(socket, Linger::Abortive);
        }
        self.finish(index);
    }

    /// Closes the socket and delivers the one close: session, gate, stats, caps, events.
    fn finish(&mut self, index: u32) {
        let core = self.core;
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.take() else {
            return;
        };
        let reason = conn.closing_reason.unwrap_or(CloseReason::SessionError);
        // Closing the descriptor removes it from the epoll set (it has no duplicates).
        drop(entry.owner.release());
        entry.timer_at = None;
        entry.generation = entry.generation.wrapping_add(1);
        let Conn {
            info,
            ticket,
            reservation,
            session,
            completer,
            bytes_in,
            bytes_out,
            output_peak,
            ..
        } = conn;
        drop(completer);
        entry.receiver.unbind();
        let stale = entry.receiver.take_stale();
        if stale > 0 {
            core.counters.server().record_stale_completions(stale);
            core.emit(Event::StaleCompletion {
                worker: WorkerId(self.index as u32),
                count: stale,
            });
        }
        if let Some(mut session) = session {
            let _ = catch_unwind(AssertUnwindSafe(|| session.on_close(&info, reason)));
            let _ = catch_unwind(AssertUnwindSafe(move || drop(session)));
        }
        entry.output.clear();
        // A free slot keeps no output memory at all: slots are never removed, so after a spike of many
        // connections each would otherwise hold up to OUTPUT_KEPT_IDLE bytes. The next connection in the slot
        // pays a few small allocations for its first reply, which its accept costs dwarf.
        if output_peak > 0 {
            entry.output = Output::new(entry.output.budget());
        }
        if let Some(mut read) = entry.read.take() {
            // A grown buffer goes back to its own class's free list; the next connection starts usual.
            read.clear();
            self.holding = self.holding.saturating_sub(1);
            Self::give_back(&mut self.buffers, self.holding, read.into_buffer());
        }
        if let Some(ticket) = ticket {
            close_ticket(&self.runtime.gate, ticket, &info, reason);
        }
        core.counters
            .slot(self.index)
            .record_close(reason, bytes_in, bytes_out);
        // Caps are free before anyone can see the close, so a client that reconnects on the Closed event is
        // never refused by a connection that is already gone.
        drop(reservation);
        let shared = &self.core.loops[self.index];
        shared.ids().remove(&info.id.get());
        shared.remove_load();
        self.free.push(Reverse(index));
        self.live -= 1;
        if self.entries.len() > SLAB_KEPT && self.live * 4 < self.entries.len() {
            self.shrink_wanted = true;
        }
        core.emit_closed(&info, reason, bytes_in, bytes_out);
    }

    // ----- helpers -----

    fn conn(&mut self, index: u32) -> &mut Conn<F::Session, G::Ticket> {
        self.entries[index as usize]
            .conn
            .as_mut()
            .expect("a connection being run is in its entry")
    }

    fn limits(&self, index: u32) -> &ResolvedLimits {
        self.entries[index as usize]
            .conn
            .as_ref()
            .map_or(&self.core.limits, |conn| &conn.listener.limits)
    }

    fn usual_class(&self, index: u32) -> SizeClass {
        SizeClass::for_size(self.limits(index).read_buffer).unwrap_or(SizeClass::Large)
    }

    /// Gives the connection a read buffer of its usual class, or grows a full one.
    fn ensure_read_buffer(&mut self, index: u32) -> Result<(), CloseReason> {
        let usual = self.usual_class(index);
        let limit = self.limits(index).read_buffer_max;
        let entry = &mut self.entries[index as usize];
        let Some(read) = entry.read.as_mut() else {
            let buffer = self
                .buffers
                .acquire(usual)
                .map_err(|_| CloseReason::Limit(LimitKind::BufferBudget))?;
            entry.read = Some(ReadBuffer::new(buffer));
            self.holding += 1;
            return Ok(());
        };
        if !read.is_full() {
            return Ok(());
        }
        let Some(larger) = read.class().larger() else {
            return Err(CloseReason::Limit(LimitKind::ReadBuffer));
        };
        if larger.bytes() > limit {
            return Err(CloseReason::Limit(LimitKind::ReadBuffer));
        }
        let buffer = self
            .buffers
            .acquire(larger)
            .map_err(|_| CloseReason::Limit(LimitKind::BufferBudget))?;
        match read.grow(buffer) {
            Ok(old) => {
                Self::give_back(&mut self.buffers, self.holding, old);
                Ok(())
            }
            Err(unused) => {
                Self::give_back(&mut self.buffers, self.holding, unused);
                Err(CloseReason::Limit(LimitKind::ReadBuffer))
            }
        }
    }

    /// Puts `buffer` on the loop's free list, then frees what the list holds beyond what this loop can use.
    ///
    /// A loop's free list would otherwise keep every buffer of its busiest moment, charged against the
    /// budget that all loops share, while another loop is refused buffers. Keeping as many as connections
    /// hold now (at least [`FREE_BUFFERS_KEPT`]) leaves a steady exchange allocation-free.
    /// (A function of the two fields, not a method, so callers may hold a connection's entry meanwhile.)
    fn give_back(buffers: &mut WorkerBuffers, holding: usize, buffer: net_io_core::Buffer) {
        let class = buffer.class();
        buffers.release(buffer);
        let keep = FREE_BUFFERS_KEPT.max(holding);
        while buffers.free_count(class) > keep {
            // Dropping a buffer (rather than releasing it) returns its bytes to the shared budget.
            match buffers.acquire(class) {
                Ok(spare) => drop(spare),
                Err(_) => break,
            }
        }
    }

    /// Calls a hook under `catch_unwind` with a fresh context, then applies what the session asked for.
    fn hook<T>(
        &mut self,
        index: u32,
        call: impl FnOnce(&mut F::Session, &mut SessionContext<'_>) -> T,
    ) -> Option<T> {
        let core = self.core;
        let now = self.now();
        let draining = core.draining.load(Ordering::Acquire);
        let pressure = core.pressure();
        let entry = &mut self.entries[index as usize];
        let conn = entry.conn.as_mut()?;
        let session = conn.session.as_mut()?;
        let mut context =
            SessionContext::new(&conn.info, &mut entry.output, &mut conn.requests, now)
                .with_draining(draining)
                .with_pressure(pressure)
                .with_completer(&conn.completer)
                .with_write_shut(conn.write_shut.is_sent());
        let result = catch_unwind(AssertUnwindSafe(|| call(session, &mut context))).ok();
        self.turn_clock.set(None);
        apply_requests(conn);
        result
    }

    fn panicked_flow(&mut self, index: u32) -> Flow {
        let id = self.conn(index).info.id;
        self.core.emit(Event::SessionPanicked { id });
        Flow::Close(CloseReason::SessionPanicked)
    }

    fn panicked(&mut self, index: u32) {
        if let Flow::Close(reason) = self.panicked_flow(index) {
            self.close(index, reason);
        }
    }
}

/// Applies and clears what the session asked for during a hook.
fn apply_requests<S, T>(conn: &mut Conn<S, T>) {
    let requests = std::mem::take(&mut conn.requests);
    if let Some(exchange) = requests.exchange_deadline {
        conn.exchange = exchange;
    }
    if let Some(phase) = requests.phase {
        conn.phase_override = Some(phase);
        conn.phase = phase;
    }
    if let Some(idle) = requests.idle_timeout {
        conn.idle_timeout = Some(idle);
    }
    conn.write_shut.request(requests.shutdown_write);
}

/// The turn's clock reading from `cache`, read from `core` (and kept) if the turn has none yet. A function of
/// the field rather than a method, so callers may hold a connection's entry meanwhile.
fn turn_now(cache: &Cell<Option<Instant>>, core: &Core) -> Instant {
    match cache.get() {
        Some(now) => now,
        None => {
            let now = core.now();
            cache.set(Some(now));
            now
        }
    }
}

fn token(index: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(index)
}

fn split_token(token: u64) -> (u32, u32) {
    (token as u32, (token >> 32) as u32)
}

fn earliest(first: Instant, second: Option<Instant>) -> Instant {
    second.map_or(first, |second| first.min(second))
}
