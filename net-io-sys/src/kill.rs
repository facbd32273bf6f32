//! The kill slot: one atomic state word per connection slot so that any thread can end a connection, one
//! killer wins, and only the owning thread ever closes the descriptor.
//!
//! ```text
//!   word (u64) = [ generation : 32 | reason : 16 | flags : 16 ]
//!   flags      = OCCUPIED | IDLE | CLOSING | KILLING
//!
//!   owner (worker)                          any thread (killer)
//!   occupy(id, fd) -> OCCUPIED, gen+1       kill(id, reason):
//!   set_idle(true/false)                      CAS  OCCUPIED & !CLOSING -> +CLOSING +KILLING +reason
//!   closing() -> Some(reason) after a kill    shutdown(fd, SHUT_RD)   (a blocked recv returns 0)
//!   begin_close(reason): CAS +CLOSING         clear KILLING
//!   release(): wait while KILLING, free the slot, hand the fd back to be closed
//! ```
//!
//! The CAS on CLOSING makes exactly one closer: the owner's own `begin_close` or one killer. A killer acts on
//! the descriptor only while KILLING is set, and the owner does not give the descriptor up until KILLING is
//! clear, so a killer can never shut down a descriptor number the kernel has handed to someone else. The
//! generation changes on every `occupy`, so a kill aimed at an earlier connection in the slot fails its CAS.

use std::net::Shutdown;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
// The slot is shared through std's Arc in both builds, so the public API is the same under loom; loom
// models the atomics, which is where the races live.
use std::sync::Arc;

#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};

use crate::socket;

const OCCUPIED: u64 = 1;
const IDLE: u64 = 2;
const CLOSING: u64 = 4;
const KILLING: u64 = 8;
const FLAGS: u64 = 0xffff;
const REASON_SHIFT: u32 = 16;
const GENERATION_SHIFT: u32 = 32;

/// Which connections a kill applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillCondition {
    /// Kill whatever the connection is doing.
    Always,
    /// Kill only while the owner has marked the connection idle (between requests); used by drain.
    OnlyIdle,
}

/// The shared half of a slot: any thread may [`kill`](KillSlot::kill) through it.
#[derive(Debug)]
pub struct KillSlot {
    word: AtomicU64,
    id: AtomicU64,
    descriptor: AtomicI32,
    claimed: AtomicBool,
    /// Under loom only: set while a killer uses the descriptor, so the model can check the owner never
    /// hands it back during that time.
    #[cfg(loom)]
    using: AtomicBool,
}

/// The owning half of a slot: holds the connection's descriptor and is the only one that can give it up.
#[derive(Debug)]
pub struct SlotOwner {
    slot: Arc<KillSlot>,
    socket: Option<OwnedFd>,
}

impl KillSlot {
    /// An empty slot.
    pub fn new() -> Self {
        Self {
            word: AtomicU64::new(0),
            id: AtomicU64::new(0),
            descriptor: AtomicI32::new(-1),
            claimed: AtomicBool::new(false),
            #[cfg(loom)]
            using: AtomicBool::new(false),
        }
    }

    /// Ends connection `id` if it occupies this slot and is not already closing; returns whether this call won.
    ///
    /// The winner stores `reason`, shuts the socket's read side (so a `recv` blocked in the owner returns 0 at
    /// once) and leaves the close itself to the owner. The caller should then wake the owner's waits.
    pub fn kill(&self, id: u64, reason: u16, condition: KillCondition) -> bool {
        let mut current = self.word.load(Ordering::Acquire);
        loop {
            let flags = current & FLAGS;
            if flags & OCCUPIED == 0 || flags & CLOSING != 0 {
                return false;
            }
            if condition == KillCondition::OnlyIdle && flags & IDLE == 0 {
                return false;
            }
            // The id read belongs to the generation in `current`: the owner writes a new id only after the
            // word has left `current`, and then the CAS below fails.
            if self.id.load(Ordering::Acquire) != id {
                return false;
            }
            let next = (current & !(FLAGS | (0xffff << REASON_SHIFT)))
                | flags
                | CLOSING
                | KILLING
                | (u64::from(reason) << REASON_SHIFT);
            match self.word.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(actual) => current = actual,
            }
        }
        #[cfg(loom)]
        self.using.store(true, Ordering::SeqCst);
        let raw = self.descriptor.load(Ordering::Acquire);
        if raw >= 0 {
            // SAFETY: KILLING is set and the owner does not close or hand out the descriptor until it is cleared
            // (SlotOwner::release waits), so `raw` is still the open socket of connection `id` for this borrow.
            let socket = unsafe { BorrowedFd::borrow_raw(raw) };
            // A failure (the peer already reset) changes nothing: the owner sees CLOSING on its next check.
            let _ = socket::shutdown(socket, Shutdown::Read);
        }
        #[cfg(loom)]
        self.using.store(false, Ordering::SeqCst);
        // Release: the owner's acquire load of a clear KILLING happens after our last use of the descriptor.
        self.word.fetch_and(!KILLING, Ordering::Release);
        true
    }

    /// The id of the connection in the slot, if one is there and no close has begun.
    pub fn occupant(&self) -> Option<u64> {
        let current = self.word.load(Ordering::Acquire);
        if current & OCCUPIED == 0 || current & CLOSING != 0 {
            return None;
        }
        Some(self.id.load(Ordering::Acquire))
    }

    /// Whether the occupant is marked idle (waiting for its next request).
    pub fn is_idle(&self) -> bool {
        let current = self.word.load(Ordering::Acquire);
        current & (OCCUPIED | IDLE | CLOSING) == OCCUPIED | IDLE
    }
}

impl Default for KillSlot {
    fn default() -> Self {
        Self::new()
    }
}

impl SlotOwner {
    /// Claims `slot` for one owning thread; `None` if another owner already holds it.
    pub fn claim(slot: Arc<KillSlot>) -> Option<Self> {
        if slot.claimed.swap(true, Ordering::AcqRel) {
            return None;
        }
        Some(Self { slot, socket: None })
    }

    /// The shared half, for handing to killers.
    pub fn slot(&self) -> &Arc<KillSlot> {
        &self.slot
    }

    /// Puts connection `id` with `socket` into the slot; returns the new generation.
    ///
    /// A connection already in the slot is released first (and its descriptor dropped, so closed).
    pub fn occupy(&mut self, id: u64, socket: OwnedFd) -> u32 {
        drop(self.release());
        self.slot.id.store(id, Ordering::Relaxed);
        self.slot
            .descriptor
            .store(socket.as_raw_fd(), Ordering::Relaxed);
        self.socket = Some(socket);
        let current = self.slot.word.load(Ordering::Relaxed);
        let generation = ((current >> GENERATION_SHIFT) as u32).wrapping_add(1);
        // Release: a killer that sees OCCUPIED also sees the id and descriptor stored above.
        self.slot.word.store(
            (u64::from(generation) << GENERATION_SHIFT) | OCCUPIED,
            Ordering::Release,
        );
        generation
    }

    /// The socket of the connection in the slot.
    pub fn socket(&self) -> Option<BorrowedFd<'_>> {
        self.socket.as_ref().map(AsFd::as_fd)
    }

    /// Marks the connection idle or busy; returns `false` (and changes nothing) once a close has begun.
    pub fn set_idle(&self, idle: bool) -> bool {
        let mut current = self.slot.word.load(Ordering::Acquire);
        loop {
            if current & OCCUPIED == 0 || current & CLOSING != 0 {
                return false;
            }
            let next = if idle {
                current | IDLE
            } else {
                current & !IDLE
            };
            if next == current {
                return true;
            }
            match self.slot.word.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }

    /// The reason stored by whoever began closing the connection, or `None` while it is open.
    ///
    /// One acquire load; the owner calls this after every wait or read that a kill can cut short.
    pub fn closing(&self) -> Option<u16> {
        let current = self.slot.word.load(Ordering::Acquire);
        (current & CLOSING != 0).then_some((current >> REASON_SHIFT) as u16)
    }

    /// Begins the close with `reason` unless a killer got there first; returns the reason that won.
    pub fn begin_close(&self, reason: u16) -> u16 {
        let mut current = self.slot.word.load(Ordering::Acquire);
        loop {
            if current & CLOSING != 0 || current & OCCUPIED == 0 {
                return (current >> REASON_SHIFT) as u16;
            }
            let next = (current & !(0xffff << REASON_SHIFT))
                | CLOSING
                | (u64::from(reason) << REASON_SHIFT);
            match self.slot.word.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return reason,
                Err(actual) => current = actual,
            }
        }
    }

    /// Empties the slot and hands the descriptor back for the caller to close (after setting linger).
    ///
    /// Begins a close first if none has begun, so no kill can start, then waits while a killer is still
    /// using the descriptor (one `shutdown` call at most).
    pub fn release(&mut self) -> Option<OwnedFd> {
        let socket = self.socket.take()?;
        self.begin_close(0);
        // Acquire pairs with the killer's release when it clears KILLING.
        let mut spins = 0u32;
        while self.slot.word.load(Ordering::Acquire) & KILLING != 0 {
            spins += 1;
            #[cfg(loom)]
            loom::thread::yield_now();
            #[cfg(not(loom))]
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        #[cfg(loom)]
        assert!(
            !self.slot.using.load(Ordering::SeqCst),
            "the descriptor was handed back while a killer used it"
        );
        self.slot.descriptor.store(-1, Ordering::Relaxed);
        let current = self.slot.word.load(Ordering::Relaxed);
        self.slot.word.store(
            current & !(FLAGS | (0xffff << REASON_SHIFT)),
            Ordering::Release,
        );
        Some(socket)
    }
}

impl Drop for SlotOwner {
    fn drop(&mut self) {
        drop(self.release());
        self.slot.claimed.store(false, Ordering::Release);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    fn descriptor() -> OwnedFd {
        crate::rlimit::open_reserve().expect("open /dev/null")
    }

    #[test]
    fn a_kill_racing_the_owners_close_has_one_winner_and_never_outlives_the_descriptor() {
        loom::model(|| {
            let slot = Arc::new(KillSlot::new());
            let mut owner = SlotOwner::claim(Arc::clone(&slot)).expect("first claim");
            owner.occupy(1, descriptor());
            let killer_slot = Arc::clone(&slot);
            let killer = loom::thread::spawn(move || killer_slot.kill(1, 5, KillCondition::Always));
            let winner = owner.begin_close(u16::MAX);
            let socket = owner.release();
            let killed = killer.join().expect("killer thread");
            assert_eq!(
                killed,
                winner == 5,
                "the kill's result and the stored reason disagree"
            );
            assert!(socket.is_some(), "the owner lost its descriptor");
        });
    }

    #[test]
    fn two_killers_and_a_reoccupied_slot_never_kill_the_next_connection() {
        // Three threads and a slot reuse: bound the preemptions so the model checks in seconds, not minutes.
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(2);
        builder.check(|| {
            let slot = Arc::new(KillSlot::new());
            let mut owner = SlotOwner::claim(Arc::clone(&slot)).expect("first claim");
            owner.occupy(1, descriptor());
            let first = {
                let slot = Arc::clone(&slot);
                loom::thread::spawn(move || slot.kill(1, 5, KillCondition::Always))
            };
            let second = {
                let slot = Arc::clone(&slot);
                loom::thread::spawn(move || slot.kill(1, 6, KillCondition::Always))
            };
            drop(owner.release());
            owner.occupy(2, descriptor());
            let wins = usize::from(first.join().unwrap()) + usize::from(second.join().unwrap());
            assert!(wins <= 1, "two killers won");
            assert_eq!(
                owner.closing(),
                None,
                "a kill for connection 1 reached connection 2"
            );
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::Barrier;

    fn connected_socket() -> (TcpListener, OwnedFd) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let socket = socket::connect(listener.local_addr().unwrap(), None).unwrap();
        (listener, socket)
    }

    #[test]
    fn sixty_four_racing_killers_produce_exactly_one_winner() {
        let (_listener, socket) = connected_socket();
        let slot = Arc::new(KillSlot::new());
        let mut owner = SlotOwner::claim(slot.clone()).expect("first claim");
        owner.occupy(7, socket);
        let barrier = Arc::new(Barrier::new(64));
        let winners: usize = (0..64)
            .map(|index| {
                let slot = slot.clone();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    slot.kill(7, 100 + index, KillCondition::Always)
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|handle| usize::from(handle.join().unwrap()))
            .sum();
        assert_eq!(winners, 1, "exactly one of 64 killers should win");
        let reason = owner.closing().expect("the slot should be closing");
        assert!(
            (100..164).contains(&reason),
            "the winner's reason should be stored"
        );
        assert_eq!(
            owner.begin_close(1),
            reason,
            "the owner should see the killer's reason"
        );
        assert!(owner.release().is_some());
    }

    #[test]
    fn a_stale_or_foreign_id_and_a_busy_connection_under_only_idle_are_not_killed() {
        let (_listener, socket) = connected_socket();
        let slot = Arc::new(KillSlot::new());
        let mut owner = SlotOwner::claim(slot.clone()).unwrap();
        assert!(
            SlotOwner::claim(slot.clone()).is_none(),
            "a slot has one owner"
        );
        owner.occupy(1, socket);
        assert!(!slot.kill(2, 9, KillCondition::Always), "foreign id killed");
        assert!(
            !slot.kill(1, 9, KillCondition::OnlyIdle),
            "busy connection killed as idle"
        );
        assert!(owner.set_idle(true));
        assert!(slot.is_idle());
        assert!(
            slot.kill(1, 9, KillCondition::OnlyIdle),
            "idle connection not killed"
        );
        assert!(
            !owner.set_idle(false),
            "set_idle after a kill should report the close"
        );
        let socket = owner.release().unwrap();
        let (_listener2, other) = connected_socket();
        drop(socket);
        owner.occupy(1, other);
        assert_eq!(slot.occupant(), Some(1));
        assert_eq!(
            owner.begin_close(3),
            3,
            "the owner's close should win when nobody killed"
        );
        assert!(
            !slot.kill(1, 9, KillCondition::Always),
            "kill after close should fail"
        );
    }

    #[test]
    fn a_kill_unblocks_a_receive_in_the_owner() {
        let (_listener, socket) = connected_socket();
        let slot = Arc::new(KillSlot::new());
        let mut owner = SlotOwner::claim(slot.clone()).unwrap();
        owner.occupy(5, socket);
        let killer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            slot.kill(5, 1, KillCondition::Always)
        });
        let mut buffer = [0u8; 8];
        let received = socket::recv(owner.socket().unwrap(), &mut buffer).unwrap();
        assert_eq!(
            received, 0,
            "a killed connection's blocked recv should return 0"
        );
        assert!(killer.join().unwrap());
        assert_eq!(owner.closing(), Some(1));
    }
}
