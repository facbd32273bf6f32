//! Counters and the [`Stats`] snapshot: server-wide relaxed atomics plus per-worker sequence-locked counters.
//!
//! ```text
//!   accept threads ──▶ ServerCounters (relaxed atomics: accepted, refused per cause, pressure, stale)
//!   worker i ────────▶ WorkerCounters[i] (seqlock: closed, bytes in/out, closes per reason)
//!   any thread ──────▶ Counters::snapshot() ──▶ Stats (Copy)
//! ```
//!
//! A close updates several worker counters together (closed, bytes, the reason's count). The sequence
//! number is odd while that happens and readers retry, so a snapshot never shows a close half-counted.
//! Each slot is meant to have one writer (its worker); a compare-and-swap on the sequence still guards
//! it, so a second writer costs a spin, never a torn snapshot.

use std::sync::atomic::{AtomicU64, Ordering, fence};

use crate::close::{CloseReason, RefusalCause};

/// Server-wide counters, written from any thread with relaxed atomics.
#[derive(Debug, Default)]
pub struct ServerCounters {
    accepted: AtomicU64,
    connected: AtomicU64,
    refused: [AtomicU64; RefusalCause::COUNT],
    /// Of `refused`, the refusals of admitted connections (after a PROXY header), which also count as closes.
    refused_after_admission: AtomicU64,
    descriptor_pressure: AtomicU64,
    stale_completions: AtomicU64,
}

/// One worker's close counters behind a sequence lock.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct WorkerCounters {
    sequence: AtomicU64,
    closed: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    by_reason: [AtomicU64; CloseReason::COUNT],
}

/// All counters of one server: the server-wide ones and one slot per worker (or other closing thread).
#[derive(Debug)]
pub struct Counters {
    server: ServerCounters,
    slots: Box<[WorkerCounters]>,
}

/// A consistent copy of the counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Connections admitted or opened (outbound) and not yet closed.
    pub open: u64,
    /// Connections accepted (admitted or refused).
    pub accepted: u64,
    /// Outbound connections the server opened (sessions it connected; each also counts in `closed` when it
    /// ends, whether or not its connect succeeded).
    pub connected: u64,
    /// Connections refused: before any read, or after admission and still before any byte was served (a
    /// PROXY header named a real client that the gate or the per-source cap refused, or no worker or loop
    /// could take the connection: `Busy`, `DoorClosed`).
    pub refused: u64,
    /// Of `refused`, the connections refused after admission. Each of them also counts once in `closed`.
    pub refused_after_admission: u64,
    /// Admitted and outbound connections that closed.
    pub closed: u64,
    /// Bytes received on closed connections.
    pub bytes_in: u64,
    /// Bytes sent on closed connections.
    pub bytes_out: u64,
    /// Closes by a gate denial.
    pub egress_denied: u64,
    /// Closes by a kill.
    pub killed: u64,
    /// Closes for a too-slow peer.
    pub slow_peers: u64,
    /// Closes by one of our deadlines.
    pub timeouts: u64,
    /// Times the process ran out of descriptors at accept.
    pub descriptor_pressure: u64,
    /// Completions dropped because their connection had closed.
    pub stale_completions: u64,
    /// Closes by a session panic.
    pub session_panics: u64,
    by_reason: [u64; CloseReason::COUNT],
    by_cause: [u64; RefusalCause::COUNT],
}

impl ServerCounters {
    /// Counts an accepted connection.
    pub fn record_accepted(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an outbound connection the server started (its close is counted like an accepted one's).
    pub fn record_connected(&self) {
        self.connected.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a refusal.
    pub fn record_refused(&self, cause: RefusalCause) {
        self.refused[cause.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a refusal of a connection that was already admitted (the real client a PROXY header named was
    /// refused). It counts in `refused` like any refusal; its close is counted as well, so `open` must not
    /// subtract it twice.
    pub fn record_refused_after_admission(&self, cause: RefusalCause) {
        // Release: a snapshot that sees this refusal among the causes also sees it among the late ones.
        self.refused_after_admission.fetch_add(1, Ordering::Relaxed);
        self.refused[cause.index()].fetch_add(1, Ordering::Release);
    }

    /// Counts a descriptor-exhaustion episode at accept.
    pub fn record_descriptor_pressure(&self) {
        self.descriptor_pressure.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts dropped stale completions.
    pub fn record_stale_completions(&self, count: u64) {
        self.stale_completions.fetch_add(count, Ordering::Relaxed);
    }
}

impl WorkerCounters {
    /// Counts one close with its byte totals. Two extra stores over plain counters (the sequence).
    pub fn record_close(&self, reason: CloseReason, bytes_in: u64, bytes_out: u64) {
        let start = self.lock();
        bump(&self.closed, 1);
        bump(&self.bytes_in, bytes_in);
        bump(&self.bytes_out, bytes_out);
        bump(&self.by_reason[reason.index()], 1);
        // Release orders the data stores before the even sequence a reader checks.
        self.sequence
            .store(start.wrapping_add(2), Ordering::Release);
    }

    /// Takes the write side: moves the sequence from even to odd and returns the even value.
    fn lock(&self) -> u64 {
        let mut current = self.sequence.load(Ordering::Relaxed);
        loop {
            if current & 1 == 1 {
                std::hint::spin_loop();
                current = self.sequence.load(Ordering::Relaxed);
                continue;
            }
            match self.sequence.compare_exchange_weak(
                current,
                current.wrapping_add(1),
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(actual) => current = actual,
            }
        }
        // Keeps the data stores after the odd sequence: a reader that sees any new data then sees
        // a changed sequence on its second load and retries.
        fence(Ordering::Release);
        current
    }

    /// Reads the counters into `stats`, retrying while a close is being counted.
    fn read_into(&self, stats: &mut Stats) {
        loop {
            let before = self.sequence.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let closed = self.closed.load(Ordering::Relaxed);
            let bytes_in = self.bytes_in.load(Ordering::Relaxed);
            let bytes_out = self.bytes_out.load(Ordering::Relaxed);
            let mut by_reason = [0u64; CloseReason::COUNT];
            for (count, counter) in by_reason.iter_mut().zip(&self.by_reason) {
                *count = counter.load(Ordering::Relaxed);
            }
            // Keeps the data loads before the second sequence load.
            fence(Ordering::Acquire);
            if self.sequence.load(Ordering::Relaxed) != before {
                continue;
            }
            stats.closed += closed;
            stats.bytes_in += bytes_in;
            stats.bytes_out += bytes_out;
            for (total, count) in stats.by_reason.iter_mut().zip(by_reason) {
                *total += count;
            }
            return;
        }
    }
}

impl Counters {
    /// Counters with `slots` close slots (one per worker, plus any for other threads that close).
    pub fn new(slots: usize) -> Counters {
        Counters {
            server: ServerCounters::default(),
            slots: (0..slots.max(1))
                .map(|_| WorkerCounters::default())
                .collect(),
        }
    }

    /// The server-wide counters.
    pub fn server(&self) -> &ServerCounters {
        &self.server
    }

    /// Close slot `index` (wraps around if out of range, so it never panics).
    pub fn slot(&self, index: usize) -> &WorkerCounters {
        &self.slots[index % self.slots.len()]
    }

    /// A consistent snapshot. Each slot is read atomically; slots are read one after another.
    pub fn snapshot(&self) -> Stats {
        let mut stats = Stats::default();
        for slot in self.slots.iter() {
            slot.read_into(&mut stats);
        }
        stats.accepted = self.server.accepted.load(Ordering::Relaxed);
        stats.connected = self.server.connected.load(Ordering::Relaxed);
        for (count, counter) in stats.by_cause.iter_mut().zip(&self.server.refused) {
            *count = counter.load(Ordering::Acquire);
        }
        stats.refused = stats.by_cause.iter().sum();
        // Read after the causes (it is bumped before them, and they are read with Acquire), so every late
        // refusal counted above is in it: at worst `open` shows one connection more for an instant, never less.
        stats.refused_after_admission = self.server.refused_after_admission.load(Ordering::Relaxed);
        stats.descriptor_pressure = self.server.descriptor_pressure.load(Ordering::Relaxed);
        stats.stale_completions = self.server.stale_completions.load(Ordering::Relaxed);
        // Accepted is read after the closes, so open never counts a close without its accept. A connection
        // refused after admission counts in both `refused` and `closed`; it leaves `open` once.
        let refused_at_accept = stats.refused.saturating_sub(stats.refused_after_admission);
        stats.open = stats
            .accepted
            .saturating_add(stats.connected)
            .saturating_sub(refused_at_accept)
            .saturating_sub(stats.closed);
        let count = |reason: CloseReason| stats.by_reason[reason.index()];
        stats.killed = count(CloseReason::Killed(0));
        stats.egress_denied = count(CloseReason::EgressDenied(0));
        stats.session_panics = count(CloseReason::SessionPanicked);
        stats.slow_peers = count(CloseReason::SlowPeer {
            direction: crate::close::Direction::In,
        });
        stats.timeouts = CloseReason::ALL
            .iter()
            .filter(|reason| reason.is_timeout())
            .map(|&reason| count(reason))
            .sum();
        stats
    }
}

impl Stats {
    /// Closes with this reason (payload ignored).
    pub fn closed_by(&self, reason: CloseReason) -> u64 {
        self.by_reason[reason.index()]
    }

    /// Refusals with this cause (gate code ignored).
    pub fn refused_by(&self, cause: RefusalCause) -> u64 {
        self.by_cause[cause.index()]
    }

    /// Non-zero close counts by reason name (`refused_busy` stands for every refusal cause, and so on).
    pub fn close_reasons(&self) -> impl Iterator<Item = (CloseReason, u64)> + '_ {
        CloseReason::ALL
            .iter()
            .zip(self.by_reason)
            .filter(|(_, count)| *count > 0)
            .map(|(&reason, count)| (reason, count))
    }

    /// Non-zero refusal counts by cause.
    pub fn refusal_causes(&self) -> impl Iterator<Item = (RefusalCause, u64)> + '_ {
        RefusalCause::ALL
            .iter()
            .zip(self.by_cause)
            .filter(|(_, count)| *count > 0)
            .map(|(&cause, count)| (cause, count))
    }
}

/// Adds to a counter only its one writer changes: a load and a store, cheaper than an atomic add.
fn bump(counter: &AtomicU64, amount: u64) {
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(amount),
        Ordering::Relaxed,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::close::Direction;

    #[test]
    fn a_snapshot_adds_up_slots_and_derives_the_totals() {
        let counters = Counters::new(2);
        for _ in 0..5 {
            counters.server().record_accepted();
        }
        counters.server().record_refused(RefusalCause::Busy);
        counters
            .slot(0)
            .record_close(CloseReason::Killed(3), 10, 20);
        counters.slot(1).record_close(
            CloseReason::SlowPeer {
                direction: Direction::Out,
            },
            1,
            2,
        );
        counters.slot(1).record_close(CloseReason::Idle, 0, 0);
        let stats = counters.snapshot();
        assert_eq!(stats.accepted, 5);
        assert_eq!(stats.refused, 1);
        assert_eq!(stats.closed, 3);
        assert_eq!(stats.open, 1, "5 accepted - 1 refused - 3 closed");
        assert_eq!((stats.bytes_in, stats.bytes_out), (11, 22));
        assert_eq!(stats.killed, 1);
        assert_eq!(stats.slow_peers, 1);
        assert_eq!(stats.timeouts, 1, "idle is one of our deadlines");
        assert_eq!(stats.refused_by(RefusalCause::Busy), 1);
        assert_eq!(stats.close_reasons().count(), 3);
    }

    #[test]
    fn outbound_connections_count_as_open_until_they_close() {
        let counters = Counters::new(1);
        counters.server().record_accepted();
        counters.server().record_connected();
        counters.server().record_connected();
        let stats = counters.snapshot();
        assert_eq!((stats.accepted, stats.connected, stats.open), (1, 2, 3));
        counters.slot(0).record_close(CloseReason::Idle, 0, 0);
        counters.slot(0).record_close(CloseReason::Idle, 0, 0);
        let stats = counters.snapshot();
        assert_eq!(
            stats.open, 1,
            "two closes of three connections, one accepted and two opened: one is open"
        );
    }

    #[test]
    fn a_refusal_after_admission_leaves_open_once() {
        let counters = Counters::new(1);
        counters.server().record_accepted();
        counters.server().record_accepted();
        counters
            .server()
            .record_refused_after_admission(RefusalCause::Gate(7));
        let stats = counters.snapshot();
        assert_eq!(
            (stats.refused, stats.refused_after_admission, stats.open),
            (1, 1, 2),
            "a late refusal counts as refused but its connection is open until its close is counted"
        );
        counters
            .slot(0)
            .record_close(CloseReason::Refused(RefusalCause::Gate(7)), 0, 0);
        let stats = counters.snapshot();
        assert_eq!(
            (stats.refused, stats.closed, stats.open),
            (1, 1, 1),
            "the refused connection must leave open exactly once, not once as refused and once as closed"
        );
        assert_eq!(stats.refused_by(RefusalCause::Gate(0)), 1);
    }
}
