//! Identifiers: [`ConnectionId`] (never reused), [`ListenerId`], [`WorkerId`], and the block allocator for ids.
//!
//! ```text
//!   IdAllocator (shared)            IdBlock (one per accepting thread)
//!   next: AtomicU64 ──fetch_add(1024)──▶ [start+1 ..= start+1024]  ──next()──▶ ConnectionId
//! ```
//!
//! One `fetch_add` hands a thread 1,024 ids, so the shared counter is touched once per 1,024 connections
//! and the block an id falls in tells which thread handed it out.

use std::fmt;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// How many ids one [`IdBlock`] holds.
pub const ID_BLOCK_SIZE: u64 = 1024;

/// The id of one connection: non-zero and never reused within a process.
///
/// Because ids are never reused, an id doubles as a generation: anything addressed to an id (a kill, a
/// completion) can never reach a later connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnectionId(NonZeroU64);

impl ConnectionId {
    /// Wraps a raw id; `None` for zero.
    pub const fn new(raw: u64) -> Option<ConnectionId> {
        match NonZeroU64::new(raw) {
            Some(value) => Some(ConnectionId(value)),
            None => None,
        }
    }

    /// The raw non-zero value.
    pub const fn get(self) -> u64 {
        self.0.get()
    }

    /// The number of the block this id was handed out in.
    pub const fn block(self) -> u64 {
        (self.0.get() - 1) / ID_BLOCK_SIZE
    }
}

impl fmt::Display for ConnectionId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}", self.0)
    }
}

/// The id of a listener within one server; never reused while the server runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ListenerId(pub u32);

impl ListenerId {
    /// The listener id that outbound connections carry: they were opened by the server, not accepted, and
    /// no listener is ever given this id.
    pub const OUTBOUND: ListenerId = ListenerId(u32::MAX);
}

impl fmt::Display for ListenerId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}", self.0)
    }
}

/// The index of a worker thread within one server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(pub u32);

impl fmt::Display for WorkerId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}", self.0)
    }
}

/// The shared source of [`ConnectionId`] blocks. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct IdAllocator {
    next_start: Arc<AtomicU64>,
}

/// A thread's private run of 1,024 connection ids; refills itself from its [`IdAllocator`].
#[derive(Debug)]
pub struct IdBlock {
    allocator: IdAllocator,
    next: u64,
    end: u64,
}

impl IdAllocator {
    /// A fresh allocator whose first id is 1.
    pub fn new() -> IdAllocator {
        IdAllocator::default()
    }

    /// A block handle for one thread. It takes its first block lazily, on the first [`IdBlock::next_id`].
    pub fn block(&self) -> IdBlock {
        IdBlock {
            allocator: self.clone(),
            next: 0,
            end: 0,
        }
    }

    /// Reserves the next block and returns its first raw id.
    fn reserve(&self) -> u64 {
        // Relaxed is enough: uniqueness comes from the atomicity of fetch_add, not from ordering.
        let start = self.next_start.fetch_add(ID_BLOCK_SIZE, Ordering::Relaxed);
        assert!(
            start <= u64::MAX - 2 * ID_BLOCK_SIZE,
            "connection ids exhausted after 2^64 connections"
        );
        start + 1
    }
}

impl IdBlock {
    /// The next id of this block, taking a new block from the allocator when this one is used up.
    ///
    /// # Panics
    /// After 2^64 ids in one process (centuries at a hundred million connections per second).
    pub fn next_id(&mut self) -> ConnectionId {
        if self.next == self.end {
            self.next = self.allocator.reserve();
            self.end = self.next + ID_BLOCK_SIZE;
        }
        let raw = self.next;
        self.next += 1;
        ConnectionId::new(raw).expect("block starts at 1 or later")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_from_racing_threads_are_unique_and_non_zero() {
        let allocator = IdAllocator::new();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let allocator = allocator.clone();
                std::thread::spawn(move || {
                    let mut block = allocator.block();
                    (0..5000).map(|_| block.next_id()).collect::<Vec<_>>()
                })
            })
            .collect();
        let mut seen = HashSet::new();
        for thread in threads {
            for id in thread.join().unwrap() {
                assert!(seen.insert(id), "id {id} was handed out twice");
            }
        }
        assert_eq!(seen.len(), 20_000);
    }

    #[test]
    fn one_block_covers_1024_consecutive_ids() {
        let allocator = IdAllocator::new();
        let mut block = allocator.block();
        let first = block.next_id();
        let mut last = first;
        for _ in 1..ID_BLOCK_SIZE {
            last = block.next_id();
        }
        assert_eq!(first.get(), 1);
        assert_eq!(last.get(), ID_BLOCK_SIZE);
        assert_eq!(
            first.block(),
            last.block(),
            "a block spans exactly 1,024 ids"
        );
        assert_eq!(block.next_id().block(), first.block() + 1);
    }
}
