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
use std::collections::BinaryHeap;
use std::io;
use std::net::Shutdown;
use std::os::fd::AsFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::task::Waker;
use std::time::{Duration, Instant};

use net_io_core::proxy::{ProxyCommand, ProxyError, ProxyParser, ProxyStatus, V1_MAX};
use net_io_core::{
    AllowAll, CloseReason, Completer, CompletionReceiver, CompletionRing, ConnectionInfo, Event,
    Gate, HalfClose, LimitKind, LingerRead, Lingered, Output, ReadBuffer, RefusalCause,
    ResolvedLimits, Session, SessionContext, SessionFactory, SessionMachine, SizeClass, Step,
    TimeoutKind, TransferRates, Verdict, WorkerBuffers, WorkerId, WriteFacts, check_or_deny,
    close_ticket,
};
use net_io_sys::epoll::{Epoll, Events, Interest};
use net_io_sys::kill::{KillSlot, SlotOwner};
use net_io_sys::socket::{self, Linger};

use crate::caps::Reservation;
use crate::clock::deadline_after;
use crate::codes::{CODE_DRAIN_DEADLINE, reason_for_code};
use crate::handshake;
use crate::link::OWNER_CODE;
use crate::listener::ListenerRuntime;
use crate::runtime::{Job, Runtime};
use crate::sessions::SessionWorkload;
use crate::shared::Core;

mod close;
mod open;
mod slab;
mod solo;
mod step;
mod timers;

use crate::loop_shared::{ConnectionSlot, EntryWake};

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
/// Stale timer entries tolerated beyond twice the live connections before the heap is compacted.
const TIMERS_SLACK: usize = 1024;
/// Steps one connection may take per turn before the others get theirs: a peer that keeps the socket full
/// (every read fills the buffer) would otherwise hold the loop.
const STEPS_PER_TURN: usize = 64;

/// What a connection waits for between events.
#[derive(Clone, Copy, Debug)]
enum Wait {
    /// An outbound connect's TCP handshake, until its connect deadline.
    Connect {
        deadline: Instant,
        nodelay: bool,
        started: Instant,
    },
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
    /// The session's last wait for input was a `Step::Listen`: a completion posted meanwhile ends it.
    listening: bool,
    /// The session policy shared with the worker-thread driver: phase, deadlines the session set, the
    /// reason a deadline or the FIN fixed, the half close.
    machine: SessionMachine,
    input_changed: bool,
    /// When the minimum-rate rule judges each direction: only once the connection waits on the peer, so a
    /// request that arrives in one read and a reply that leaves in one send cost it nothing.
    rates: TransferRates,
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
    /// The linger of a graceful close in progress.
    linger: Option<LingerRead>,
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
    pub(super) fn run(&mut self) {
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
    pub(super) fn serve<T>(&mut self, index: u32, call: impl FnOnce(&mut Self) -> T) -> T {
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
    pub(super) fn now(&self) -> Instant {
        turn_now(&self.turn_clock, self.core)
    }

    /// Acts on the outcome of a contained part of the loop: after a panic, closes the connection whose
    /// turn it interrupted and puts back in line whatever the interrupted pass had taken out of it.
    pub(super) fn contain(&mut self, outcome: std::thread::Result<()>) {
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
    pub(super) fn requeue_after_panic(&mut self) {
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
    pub(super) fn contain_panic(&mut self) {
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
    pub(super) fn abandon(&mut self, index: u32) {
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
    pub(super) fn wait_and_dispatch(
        &mut self,
        events: &mut Events,
        stopping: bool,
        inbox_closed: &mut bool,
    ) {
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

    /// How long the next `epoll_wait` may sleep: until the earliest timer, cut to a tick under a manual clock.
    pub(super) fn next_timeout(&self) -> Option<Duration> {
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

    pub(super) fn on_wake(&mut self, inbox_closed: &mut bool) {
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
    pub(super) fn resume_yielded(&mut self) {
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
    pub(super) fn end_overdue_lingers(&mut self) {
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

    pub(super) fn kill_all(&mut self, code: u16) {
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
