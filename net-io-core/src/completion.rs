//! The completion ring: a bounded multi-producer, single-consumer queue that wakes a parked session.
//!
//! ```text
//!   offload threads ──Completer::post(token, value)──▶ CompletionRing (per worker, bounded)
//!                        │ WakeWorker on the idle edge          │
//!                        └──▶ Waker (the worker's eventfd)      ▼
//!                                          worker: CompletionReceiver::pop ──▶ Session::on_wake
//! ```
//!
//! Posting never blocks: a full ring answers [`PostError::Full`]. A post for a connection that is not the
//! one bound to the ring answers [`PostError::Closed`], and a post that races a close is dropped by the
//! receiver and counted as stale; since [`ConnectionId`]s are never reused the id is the generation, so a
//! late post can never reach a later connection.
//!
//! Wake-ups go through one atomic word, `state`: bit 0 is `WAITING` (the receiver found the ring empty and
//! may sleep), the bits above count completions published so far. Every change to it is a
//! read-modify-write, and an RMW always reads the newest value in the word's modification order, so the
//! two sides cannot miss each other:
//!
//! ```text
//!   producer                                   receiver (finds its next slot empty)
//!   claim slot, write payload                  observed = state.load(Acquire)
//!   slot.sequence.store(Release)               take() again: a slot published before `observed` is visible
//!   state.fetch_add(count 1)                   state.compare_exchange(observed, observed | WAITING)
//!   saw WAITING? state.fetch_and(!WAITING)       ok: armed, return None; failed: a post landed, look again
//!   cleared it ourselves? ─▶ WakeWorker
//! ```
//!
//! The race this prevents is the lost wake-up: the receiver decides to sleep after a producer published
//! but before the producer checks the flag, and the producer sees the flag still clear. Here a producer's
//! count bump lands either before the receiver's arming CAS (which then fails, because the word changed,
//! and the receiver looks again; the Acquire load it retries from synchronises with the producer's
//! Release RMW, so the slot is visible) or after it (and then the producer's RMW sees `WAITING` and wakes
//! the worker). Only the RMW that clears `WAITING` reports a wake, so a worker is woken only on the idle edge; a
//! receiver that takes a completion while armed clears `WAITING` once, so posts to an awake worker stay
//! quiet. An earlier design (a separate flag and a `SeqCst` fence on each side, Dekker style) was reported
//! as stranding a completion by loom's unbounded run; whether that was a real race or loom modelling
//! `SeqCst` as `AcqRel`, this design needs no `SeqCst`: every decision is an RMW on one word (plus
//! Acquire/Release on the slots), which loom models exactly. The count wraps after 2^63
//! posts; an arming CAS could only be fooled by exactly that many posts between its load and its CAS. The
//! slots follow Vyukov's bounded queue, with the payload in atomics so that no `unsafe` is needed.
//!
//! Loom models (two producers and a consumer; a post racing a close) are meant to run with no preemption
//! bound: `RUSTFLAGS="--cfg loom" cargo test -p net-io-core --lib --release loom_models`. The full
//! exploration of the two-producer model is long (unfinished, with no failure, after 14 minutes in release
//! on a loaded 2-core machine); for a quick local check `LOOM_MAX_PREEMPTIONS=5` takes about two minutes.

use std::fmt;
use std::task::Waker;

use crate::id::ConnectionId;
use crate::loom::sync::Arc;
use crate::loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The `state` bit saying the receiver found the ring empty and may be asleep.
const WAITING: u64 = 1;
/// What one published completion adds to `state` (the count lives above the `WAITING` bit).
const ONE_PUBLISHED: u64 = 2;

/// One posted completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The connection it is for.
    pub id: ConnectionId,
    /// The poster's token (which operation finished).
    pub token: u64,
    /// The poster's value (its result).
    pub value: u64,
}

/// A successful post.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Posted {
    /// The worker may be asleep: wake it.
    WakeWorker,
    /// The worker is awake or already woken; nothing more to do.
    Queued,
}

/// Why a post was not queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// The ring is full; the worker has not caught up. Retry later or give up.
    #[error("the completion ring is full; retry later or raise completion_queue")]
    Full,
    /// The connection is closed (or was never on this worker); the completion is not needed.
    #[error("the connection is closed; the completion was dropped")]
    Closed,
}

/// The shared ring. Producers post through it (usually via a [`Completer`]).
pub struct CompletionRing {
    slots: Box<[Slot]>,
    mask: usize,
    tail: AtomicUsize,
    /// Published-completion count (bits 1..) and the `WAITING` bit; see the module doc.
    state: AtomicU64,
    bound: AtomicU64,
}

/// The single consumer of a ring, owned by its worker.
pub struct CompletionReceiver {
    ring: Arc<CompletionRing>,
    head: usize,
    stale: u64,
    /// Whether this receiver's last arming may still be set in `state`.
    armed: bool,
}

/// A cloneable, `Send` handle that posts completions for one connection and wakes its worker.
#[derive(Clone)]
pub struct Completer {
    ring: Arc<CompletionRing>,
    id: ConnectionId,
    waker: Waker,
}

struct Slot {
    sequence: AtomicUsize,
    id: AtomicU64,
    token: AtomicU64,
    value: AtomicU64,
}

impl CompletionRing {
    /// A ring holding `capacity` completions (rounded up to a power of two, at least 2), and its receiver.
    pub fn with_capacity(capacity: usize) -> (Arc<CompletionRing>, CompletionReceiver) {
        // Vyukov's sequence scheme needs at least two slots to tell "published" from "free for next lap".
        let capacity = capacity.max(2).next_power_of_two();
        let slots = (0..capacity)
            .map(|position| Slot {
                sequence: AtomicUsize::new(position),
                id: AtomicU64::new(0),
                token: AtomicU64::new(0),
                value: AtomicU64::new(0),
            })
            .collect();
        let ring = Arc::new(CompletionRing {
            slots,
            mask: capacity - 1,
            tail: AtomicUsize::new(0),
            // Starts armed: the worker has not looked yet, so the first post must wake it.
            state: AtomicU64::new(WAITING),
            bound: AtomicU64::new(0),
        });
        let receiver = CompletionReceiver {
            ring: Arc::clone(&ring),
            head: 0,
            stale: 0,
            armed: true,
        };
        (ring, receiver)
    }

    /// How many completions the ring holds.
    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Posts a completion for connection `id`. Never blocks.
    pub fn post(&self, id: ConnectionId, token: u64, value: u64) -> Result<Posted, PostError> {
        if self.bound.load(Ordering::Acquire) != id.get() {
            return Err(PostError::Closed);
        }
        let mut position = self.tail.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[position & self.mask];
            let sequence = slot.sequence.load(Ordering::Acquire);
            let lap = sequence.wrapping_sub(position) as isize;
            if lap == 0 {
                match self.tail.compare_exchange_weak(
                    position,
                    position.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        slot.id.store(id.get(), Ordering::Relaxed);
                        slot.token.store(token, Ordering::Relaxed);
                        slot.value.store(value, Ordering::Relaxed);
                        // Release publishes the payload to the receiver's Acquire load of the sequence.
                        slot.sequence
                            .store(position.wrapping_add(1), Ordering::Release);
                        break;
                    }
                    Err(current) => position = current,
                }
            } else if lap < 0 {
                return Err(PostError::Full);
            } else {
                position = self.tail.load(Ordering::Relaxed);
            }
        }
        // Count the post. Release makes the slot (published above) visible to the receiver's Acquire load
        // of `state`; being an RMW, it reads the newest `state`, so it either sees the receiver's arming or
        // lands before it and makes the arming CAS fail (the count changed), sending the receiver to look
        // again. One `fetch_add` cannot fail, so a post to an awake worker costs one RMW here.
        let counted = self.state.fetch_add(ONE_PUBLISHED, Ordering::AcqRel);
        if counted & WAITING == 0 {
            return Ok(Posted::Queued);
        }
        // The receiver is armed. Whoever clears WAITING wakes it; if another producer (or the receiver,
        // finding work itself) cleared it first, the worker is awake or being woken already. Clearing a newer
        // arming than the one we counted against is safe: we then wake a worker that is idle.
        let previous = self.state.fetch_and(!WAITING, Ordering::AcqRel);
        if previous & WAITING != 0 {
            Ok(Posted::WakeWorker)
        } else {
            Ok(Posted::Queued)
        }
    }
}

impl CompletionReceiver {
    /// The ring this receiver drains, for making [`Completer`]s.
    pub fn ring(&self) -> &Arc<CompletionRing> {
        &self.ring
    }

    /// Accepts posts for connection `id` from now on (the worker calls this when it takes a connection).
    pub fn bind(&mut self, id: ConnectionId) {
        self.ring.bound.store(id.get(), Ordering::Release);
    }

    /// Refuses further posts and drops any left in the ring as stale (the worker calls this at close).
    pub fn unbind(&mut self) {
        self.ring.bound.store(0, Ordering::Release);
        while self.pop().is_some() {}
    }

    /// The next completion for the bound connection. Completions for any other id are dropped and counted.
    ///
    /// When it returns `None` the receiver is armed: the next post reports [`Posted::WakeWorker`].
    pub fn pop(&mut self) -> Option<Completion> {
        loop {
            let completion = self.take_or_arm()?;
            if completion.id.get() == self.ring.bound.load(Ordering::Relaxed) {
                return Some(completion);
            }
            self.stale += 1;
        }
    }

    /// How many stale completions were dropped since the last call (for the `StaleCompletion` event and stats).
    pub fn take_stale(&mut self) -> u64 {
        std::mem::take(&mut self.stale)
    }

    /// A completer for connection `id` that wakes the worker through `waker`.
    pub fn completer(&self, id: ConnectionId, waker: Waker) -> Completer {
        Completer {
            ring: Arc::clone(&self.ring),
            id,
            waker,
        }
    }

    /// The next completion in the ring; or, if there is none, arms `WAITING` so the next post wakes the
    /// worker, and answers `None`.
    fn take_or_arm(&mut self) -> Option<Completion> {
        if let Some(completion) = self.take() {
            self.disarm();
            return Some(completion);
        }
        // Acquire synchronises with every producer RMW up to `observed` (all writes to `state` are RMWs, so
        // they extend each producer's release sequence): each slot counted in `observed` is visible below.
        let mut observed = self.ring.state.load(Ordering::Acquire);
        loop {
            // A producer may have published between our first look and the load above: look again.
            if let Some(completion) = self.take() {
                self.disarm();
                return Some(completion);
            }
            // Arm only if no producer counted a post since `observed`; one that did may have published the
            // slot we just found empty, and (seeing WAITING clear) would not wake us.
            match self.ring.state.compare_exchange(
                observed,
                observed | WAITING,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.armed = true;
                    return None;
                }
                Err(current) => observed = current,
            }
        }
    }

    /// Clears our arming after we found work ourselves, so that posts to an awake worker do not wake it.
    fn disarm(&mut self) {
        if std::mem::take(&mut self.armed) {
            // If a producer already cleared it, that producer reports WakeWorker: one spurious wake-up, harmless.
            self.ring.state.fetch_and(!WAITING, Ordering::AcqRel);
        }
    }

    fn take(&mut self) -> Option<Completion> {
        let slot = &self.ring.slots[self.head & self.ring.mask];
        let sequence = slot.sequence.load(Ordering::Acquire);
        if sequence != self.head.wrapping_add(1) {
            return None;
        }
        let raw_id = slot.id.load(Ordering::Relaxed);
        let token = slot.token.load(Ordering::Relaxed);
        let value = slot.value.load(Ordering::Relaxed);
        // Release hands the slot back to producers one lap later.
        slot.sequence.store(
            self.head.wrapping_add(self.ring.mask + 1),
            Ordering::Release,
        );
        self.head = self.head.wrapping_add(1);
        // Posts are checked against the bound id, which is never zero, so raw_id is non-zero.
        let id = ConnectionId::new(raw_id)?;
        Some(Completion { id, token, value })
    }
}

impl Completer {
    /// Posts a completion and wakes the worker if it may be asleep. Never blocks.
    pub fn post(&self, token: u64, value: u64) -> Result<(), PostError> {
        if self.ring.post(self.id, token, value)? == Posted::WakeWorker {
            self.waker.wake_by_ref();
        }
        Ok(())
    }

    /// The connection this completer posts to.
    pub fn id(&self) -> ConnectionId {
        self.id
    }
}

impl fmt::Debug for CompletionRing {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("CompletionRing")
            .field("capacity", &self.capacity())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for CompletionReceiver {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("CompletionReceiver")
            .field("head", &self.head)
            .field("stale", &self.stale)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Completer {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Completer")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn id(raw: u64) -> ConnectionId {
        ConnectionId::new(raw).unwrap()
    }

    #[test]
    fn the_first_post_into_an_idle_ring_asks_for_a_wake_and_the_next_does_not() {
        let (ring, mut receiver) = CompletionRing::with_capacity(4);
        receiver.bind(id(7));
        assert_eq!(ring.post(id(7), 1, 10), Ok(Posted::WakeWorker));
        assert_eq!(ring.post(id(7), 2, 20), Ok(Posted::Queued));
        assert_eq!(receiver.pop().map(|c| c.token), Some(1));
        assert_eq!(receiver.pop().map(|c| c.token), Some(2));
        assert_eq!(receiver.pop(), None);
        assert_eq!(
            ring.post(id(7), 3, 30),
            Ok(Posted::WakeWorker),
            "after the receiver found the ring empty, the next post must wake it"
        );
    }

    #[test]
    fn a_full_ring_refuses_without_blocking() {
        let (ring, mut receiver) = CompletionRing::with_capacity(2);
        receiver.bind(id(1));
        assert!(ring.post(id(1), 0, 0).is_ok());
        assert!(ring.post(id(1), 0, 0).is_ok());
        assert_eq!(ring.post(id(1), 0, 0), Err(PostError::Full));
        assert!(receiver.pop().is_some());
        assert!(
            ring.post(id(1), 0, 0).is_ok(),
            "a freed slot must be usable again"
        );
    }

    #[test]
    fn a_post_for_another_connection_never_reaches_the_next_one() {
        let (ring, mut receiver) = CompletionRing::with_capacity(4);
        receiver.bind(id(1));
        ring.post(id(1), 5, 5).unwrap();
        // Connection 1 closes with its completion still queued; connection 2 takes the worker.
        receiver.unbind();
        assert_eq!(receiver.take_stale(), 1);
        assert_eq!(ring.post(id(1), 6, 6), Err(PostError::Closed));
        receiver.bind(id(2));
        assert_eq!(
            receiver.pop(),
            None,
            "a stale completion reached the next connection"
        );
    }

    #[test]
    fn racing_producers_deliver_every_completion_exactly_once() {
        let (ring, mut receiver) = CompletionRing::with_capacity(8);
        receiver.bind(id(3));
        let producers: Vec<_> = (0..3u64)
            .map(|producer| {
                let ring = Arc::clone(&ring);
                std::thread::spawn(move || {
                    for n in 0..2000u64 {
                        while ring.post(id(3), producer, n) == Err(PostError::Full) {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut next = [0u64; 3];
        let mut received = 0;
        while received < 6000 {
            match receiver.pop() {
                Some(completion) => {
                    let producer = completion.token as usize;
                    assert_eq!(
                        completion.value, next[producer],
                        "completions were reordered or lost"
                    );
                    next[producer] += 1;
                    received += 1;
                }
                None => std::thread::yield_now(),
            }
        }
        for producer in producers {
            producer.join().unwrap();
        }
        assert_eq!(receiver.pop(), None);
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    use super::*;

    /// Two producers and one consumer: no completion is ever stranded without a pending wake-up, and the
    /// ring never holds more than its capacity.
    #[test]
    fn no_completion_is_stranded_without_a_wake() {
        loom::model(|| {
            let (ring, mut receiver) = CompletionRing::with_capacity(2);
            let id = ConnectionId::new(1).unwrap();
            receiver.bind(id);
            let woken = Arc::new(AtomicUsize::new(0));
            let producers: Vec<_> = (0..2)
                .map(|token| {
                    let ring = Arc::clone(&ring);
                    let woken = Arc::clone(&woken);
                    loom::thread::spawn(move || {
                        if ring.post(id, token, 0) == Ok(Posted::WakeWorker) {
                            woken.fetch_add(1, Ordering::SeqCst);
                        }
                    })
                })
                .collect();
            // The worker: drain, then sleep unless a wake-up (the eventfd count) is pending.
            let mut received = 0;
            loop {
                while receiver.pop().is_some() {
                    received += 1;
                }
                if woken.swap(0, Ordering::SeqCst) == 0 {
                    break;
                }
            }
            for producer in producers {
                producer.join().unwrap();
            }
            // The consumer went to sleep after its last None. Whatever is left must have a wake pending.
            let mut left = 0;
            while receiver.take().is_some() {
                left += 1;
            }
            assert!(received + left == 2, "a completion was lost");
            assert!(
                left == 0 || woken.load(Ordering::SeqCst) > 0,
                "a completion was stranded"
            );
        });
    }

    /// A post racing the close of its connection never reaches the next connection on the worker.
    #[test]
    fn a_post_racing_a_close_never_reaches_the_next_connection() {
        loom::model(|| {
            let (ring, mut receiver) = CompletionRing::with_capacity(2);
            let old = ConnectionId::new(1).unwrap();
            let new = ConnectionId::new(2).unwrap();
            receiver.bind(old);
            let producer = {
                let ring = Arc::clone(&ring);
                loom::thread::spawn(move || {
                    let _ = ring.post(old, 7, 7);
                })
            };
            receiver.unbind();
            receiver.bind(new);
            let mut delivered = Vec::new();
            while let Some(completion) = receiver.pop() {
                delivered.push(completion);
            }
            producer.join().unwrap();
            while let Some(completion) = receiver.pop() {
                delivered.push(completion);
            }
            assert!(
                delivered.iter().all(|completion| completion.id == new),
                "a completion for the closed connection reached the next one"
            );
        });
    }
}
