//! Typed [`Event`]s, the [`EventSink`] that receives them, and the per-thread [`Coalescer`] that folds floods.
//!
//! Events are `Copy`, at most 64 bytes and borrow nothing, so emitting one is a few stores. The sink runs
//! on worker and accept threads and must not block. Under a flood of refusals or limit hits, a
//! [`Coalescer`] passes the first 1,000 per second per thread and folds the rest into one
//! [`Event::Coalesced`] per second (threat T-21: the sink must not become the bottleneck).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::close::{CloseReason, LimitKind, OsErrorClass, RefusalCause};
use crate::control::ControlState;
use crate::gate::Lane;
use crate::id::{ConnectionId, ListenerId, WorkerId};

/// The default number of events of one kind passed per second per thread before folding.
pub const COALESCE_THRESHOLD: u64 = 1000;

/// Something that happened in the server.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// A listener was bound.
    ListenerOpened {
        /// The listener.
        listener: ListenerId,
        /// Its bound address.
        local: SocketAddr,
        /// The effective backlog.
        backlog: u32,
    },
    /// A listener was closed.
    ListenerClosed {
        /// The listener.
        listener: ListenerId,
    },
    /// The door opened: listeners accept.
    DoorOpened,
    /// The door closed: listeners stop accepting.
    DoorClosed,
    /// A connection was accepted (before caps and the gate).
    Accepted {
        /// The new id.
        id: ConnectionId,
        /// The TCP peer.
        peer: SocketAddr,
        /// The listener.
        listener: ListenerId,
    },
    /// An outbound connection (opened by the server) finished its TCP handshake and its session opens.
    Connected {
        /// The connection's id.
        id: ConnectionId,
        /// The address connected to.
        peer: SocketAddr,
        /// How long the connect took.
        took: Duration,
    },
    /// A connection was refused before any read.
    Refused {
        /// The TCP peer.
        peer: SocketAddr,
        /// The listener.
        listener: ListenerId,
        /// Why.
        cause: RefusalCause,
    },
    /// The gate admitted a connection.
    Admitted {
        /// The connection.
        id: ConnectionId,
        /// Its lane.
        lane: Lane,
    },
    /// A trusted PROXY header named the real client.
    ProxyResolved {
        /// The connection.
        id: ConnectionId,
        /// The real client address.
        real_peer: SocketAddr,
    },
    /// The handshake finished.
    HandshakeDone {
        /// The connection.
        id: ConnectionId,
        /// How long it took.
        took: Duration,
    },
    /// A limit was hit.
    LimitHit {
        /// The connection, when the limit was per connection.
        id: Option<ConnectionId>,
        /// Which limit.
        which: LimitKind,
    },
    /// A connection was killed from another thread.
    Killed {
        /// The connection.
        id: ConnectionId,
        /// The killer's code.
        code: u16,
    },
    /// The gate denied a write.
    EgressDenied {
        /// The connection.
        id: ConnectionId,
        /// The gate's code.
        code: u16,
    },
    /// A connection closed; exactly one per admitted connection.
    Closed {
        /// The connection.
        id: ConnectionId,
        /// The one close reason.
        reason: CloseReason,
        /// Bytes received.
        bytes_in: u64,
        /// Bytes sent.
        bytes_out: u64,
        /// Time from accept to close.
        lifetime: Duration,
    },
    /// An accept call failed; the listener continues.
    AcceptError {
        /// The listener.
        listener: ListenerId,
        /// The error class.
        class: OsErrorClass,
    },
    /// The process ran out of descriptors; the acceptor shed one connection and backs off.
    DescriptorPressure {
        /// The listener.
        listener: ListenerId,
        /// The backoff before the next accept.
        backoff: Duration,
    },
    /// A listener failed for good (EBADF, EINVAL).
    ListenerFailed {
        /// The listener.
        listener: ListenerId,
        /// The error class.
        class: OsErrorClass,
    },
    /// A drain started.
    DrainStarted {
        /// Connections open at the start.
        open: u64,
    },
    /// A drain finished.
    DrainFinished {
        /// Connections that closed gracefully.
        graceful: u64,
        /// Connections killed at the deadline.
        killed: u64,
    },
    /// The server reacted to a control-line change.
    ControlReacted {
        /// The new state.
        state: ControlState,
    },
    /// Completions for closed connections were dropped.
    StaleCompletion {
        /// The worker whose ring held them.
        worker: WorkerId,
        /// How many.
        count: u64,
    },
    /// A session panicked; its connection was closed.
    SessionPanicked {
        /// The connection.
        id: ConnectionId,
    },
    /// The kernel would not map a coroutine handler's stack, so its connection closes with
    /// `Limit(HandlerStack)`. Coalesced like refusals: a server at the mapping limit fails every new
    /// connection the same way.
    HandlerStackFailed {
        /// The connection.
        id: ConnectionId,
        /// The `errno` of the failed mapping (`ENOMEM` at `vm.max_map_count`).
        errno: i32,
        /// What to do about it, for logs: [`handler_stack_hint`] of `errno`.
        hint: &'static str,
    },
    /// Events of one kind folded over the last second.
    Coalesced {
        /// Which kind.
        kind: CoalescedKind,
        /// How many were folded.
        count: u64,
    },
}

/// Which kind of event a [`Event::Coalesced`] stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CoalescedKind {
    /// [`Event::Refused`].
    Refused,
    /// [`Event::LimitHit`].
    LimitHit,
    /// [`Event::HandlerStackFailed`].
    HandlerStackFailed,
}

/// The hint [`Event::HandlerStackFailed`] carries for the `errno` of a failed stack mapping: what ran out
/// and what to change. `mmap` says `ENOMEM` both at the process's mapping limit and when memory or the
/// address space is short; on a server with memory to spare it is nearly always the mapping limit.
pub const fn handler_stack_hint(errno: i32) -> &'static str {
    if errno == libc::ENOMEM {
        "the kernel refused another handler stack mapping (ENOMEM): the process is most likely at \
         vm.max_map_count (two mappings a stack, 65530 by default); raise it (sysctl vm.max_map_count), \
         or lower max_connections or handler_stack_size; else memory or RLIMIT_AS ran out"
    } else {
        "the kernel refused to map a handler stack; check memory, RLIMIT_AS and handler_stack_size"
    }
}

/// Receives events. Runs on worker and accept threads: it must be quick and must not block.
pub trait EventSink: Send + Sync + 'static {
    /// Takes one event.
    fn emit(&self, event: Event);

    /// False when the sink ignores everything, so the driver can skip building events. Default: true.
    fn enabled(&self) -> bool {
        true
    }
}

/// The sink that ignores every event.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoopSink;

impl EventSink for NoopSink {
    fn emit(&self, _event: Event) {}

    fn enabled(&self) -> bool {
        false
    }
}

impl<F> EventSink for F
where
    F: Fn(Event) + Send + Sync + 'static,
{
    fn emit(&self, event: Event) {
        self(event)
    }
}

/// The kinds of event a [`Coalescer`] folds, in slot order.
const COALESCED: [CoalescedKind; 3] = [
    CoalescedKind::Refused,
    CoalescedKind::LimitHit,
    CoalescedKind::HandlerStackFailed,
];

/// Per-thread flood control for `Refused`, `LimitHit` and `HandlerStackFailed` events.
#[derive(Debug)]
pub struct Coalescer {
    threshold: u64,
    window_start: Option<Instant>,
    seen: [u64; COALESCED.len()],
    folded: [u64; COALESCED.len()],
}

impl Coalescer {
    /// A coalescer passing [`COALESCE_THRESHOLD`] events of each kind per second.
    pub fn new() -> Coalescer {
        Coalescer::with_threshold(COALESCE_THRESHOLD)
    }

    /// A coalescer passing `threshold` events of each kind per second.
    pub fn with_threshold(threshold: u64) -> Coalescer {
        Coalescer {
            threshold,
            window_start: None,
            seen: [0; COALESCED.len()],
            folded: [0; COALESCED.len()],
        }
    }

    /// Emits `event` to `sink` unless it is a `Refused`, `LimitHit` or `HandlerStackFailed` past the
    /// threshold in this second,
    /// in which case it is counted. When a new second starts, the previous second's folded counts are
    /// emitted first as [`Event::Coalesced`].
    pub fn emit<S: EventSink + ?Sized>(&mut self, sink: &S, event: Event, now: Instant) {
        self.flush(sink, now);
        let slot = match event {
            Event::Refused { .. } => 0,
            Event::LimitHit { .. } => 1,
            Event::HandlerStackFailed { .. } => 2,
            _ => {
                sink.emit(event);
                return;
            }
        };
        self.seen[slot] += 1;
        if self.seen[slot] > self.threshold {
            self.folded[slot] += 1;
        } else {
            sink.emit(event);
        }
    }

    /// True while counts folded in the current second wait for [`Coalescer::flush`] to report them.
    pub fn has_folded(&self) -> bool {
        self.folded.iter().any(|&count| count > 0)
    }

    /// When the folded counts of the current second are due for [`Coalescer::flush`]: the end of that second,
    /// or `None` while nothing is folded. A thread that would otherwise sleep without a deadline sleeps until
    /// then at most, so the count of a flood that stopped is reported within about a second.
    pub fn flush_due(&self) -> Option<Instant> {
        if !self.has_folded() {
            return None;
        }
        self.window_start
            .map(|start| start + Duration::from_secs(1))
    }

    /// Emits the folded counts of a finished second. Call it now and then (for example once per loop) so
    /// that a flood that stops still reports its count.
    pub fn flush<S: EventSink + ?Sized>(&mut self, sink: &S, now: Instant) {
        let start = *self.window_start.get_or_insert(now);
        if now.saturating_duration_since(start) < Duration::from_secs(1) {
            return;
        }
        for (&kind, &count) in COALESCED.iter().zip(&self.folded) {
            if count > 0 {
                sink.emit(Event::Coalesced { kind, count });
            }
        }
        self.window_start = Some(now);
        self.seen = [0; COALESCED.len()];
        self.folded = [0; COALESCED.len()];
    }
}

impl Default for Coalescer {
    fn default() -> Coalescer {
        Coalescer::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn an_event_fits_in_64_bytes() {
        assert!(
            std::mem::size_of::<Event>() <= 64,
            "Event is {} bytes",
            std::mem::size_of::<Event>()
        );
    }

    #[test]
    fn handler_stack_failures_fold_on_their_own_and_the_hint_names_the_mapping_limit() {
        let log = std::sync::Arc::new(Mutex::new(Vec::new()));
        let sink = {
            let log = std::sync::Arc::clone(&log);
            move |event: Event| log.lock().unwrap().push(event)
        };
        let mut coalescer = Coalescer::with_threshold(2);
        let start = Instant::now();
        for n in 0..5 {
            let failed = Event::HandlerStackFailed {
                id: ConnectionId::new(n + 1).unwrap(),
                errno: libc::ENOMEM,
                hint: handler_stack_hint(libc::ENOMEM),
            };
            coalescer.emit(&sink, failed, start + Duration::from_millis(n));
        }
        let refused = Event::Refused {
            peer: "192.0.2.1:9".parse().unwrap(),
            listener: ListenerId(0),
            cause: RefusalCause::GlobalCap,
        };
        coalescer.emit(&sink, refused, start + Duration::from_millis(6));
        assert_eq!(
            log.lock().unwrap().len(),
            3,
            "two stack failures and the refusal (its own count) pass"
        );
        assert!(coalescer.has_folded(), "three stack failures were folded");
        coalescer.flush(&sink, start + Duration::from_millis(1001));
        assert_eq!(
            *log.lock().unwrap().last().unwrap(),
            Event::Coalesced {
                kind: CoalescedKind::HandlerStackFailed,
                count: 3
            }
        );
        assert!(!coalescer.has_folded(), "the flush did not clear the count");
        assert!(
            handler_stack_hint(libc::ENOMEM).contains("vm.max_map_count"),
            "the ENOMEM hint does not name the mapping limit"
        );
    }

    #[test]
    fn refusals_past_the_threshold_fold_into_one_coalesced_event_per_second() {
        let log = std::sync::Arc::new(Mutex::new(Vec::new()));
        let sink = {
            let log = std::sync::Arc::clone(&log);
            move |event: Event| log.lock().unwrap().push(event)
        };
        let mut coalescer = Coalescer::with_threshold(3);
        let start = Instant::now();
        let refused = Event::Refused {
            peer: "192.0.2.1:9".parse().unwrap(),
            listener: ListenerId(0),
            cause: RefusalCause::GlobalCap,
        };
        for n in 0..10 {
            coalescer.emit(&sink, refused, start + Duration::from_millis(n));
        }
        coalescer.emit(&sink, Event::DoorOpened, start + Duration::from_millis(20));
        assert_eq!(
            log.lock().unwrap().len(),
            4,
            "3 refusals and the door event pass"
        );
        assert_eq!(
            coalescer.flush_due(),
            Some(start + Duration::from_secs(1)),
            "folded counts are due at the end of the second they were folded in"
        );
        coalescer.flush(&sink, start + Duration::from_millis(999));
        assert_eq!(
            log.lock().unwrap().len(),
            4,
            "a flush inside the second reports nothing yet"
        );
        coalescer.flush(&sink, start + Duration::from_millis(1001));
        assert_eq!(
            coalescer.flush_due(),
            None,
            "nothing is due once the count was reported"
        );
        let last = *log.lock().unwrap().last().unwrap();
        assert_eq!(
            last,
            Event::Coalesced {
                kind: CoalescedKind::Refused,
                count: 7
            }
        );
    }
}
