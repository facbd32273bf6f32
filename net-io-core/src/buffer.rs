//! The buffer pool: size classes of 4, 16 and 64 KiB, a global byte budget, per-worker free lists, wipe on release.
//!
//! ```text
//!             BufferPool (shared: budget counter)
//!            /             |               \
//!   WorkerBuffers 0   WorkerBuffers 1  ...   (one per worker thread, no lock)
//!   free[4K] free[16K] free[64K]
//! ```
//!
//! A buffer is allocated the first time a worker needs one of its class and no free one is at hand; the
//! budget is charged then and only returned when the buffer is dropped. Released buffers go back to the
//! worker's free list, so a warmed-up server allocates nothing. Release zeroes the part of the buffer that
//! was written, so bytes of one connection never reach another (threat T-16).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A buffer size class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SizeClass {
    /// 4 KiB.
    Small,
    /// 16 KiB.
    Medium,
    /// 64 KiB.
    Large,
}

impl SizeClass {
    /// Every class, smallest first.
    pub const ALL: [SizeClass; 3] = [SizeClass::Small, SizeClass::Medium, SizeClass::Large];

    /// The size of a buffer of this class in bytes.
    pub const fn bytes(self) -> usize {
        match self {
            SizeClass::Small => 4 * 1024,
            SizeClass::Medium => 16 * 1024,
            SizeClass::Large => 64 * 1024,
        }
    }

    /// The smallest class that holds `bytes`, or `None` above 64 KiB.
    pub const fn for_size(bytes: usize) -> Option<SizeClass> {
        if bytes <= 4 * 1024 {
            Some(SizeClass::Small)
        } else if bytes <= 16 * 1024 {
            Some(SizeClass::Medium)
        } else if bytes <= 64 * 1024 {
            Some(SizeClass::Large)
        } else {
            None
        }
    }

    /// The next larger class, or `None` for the largest.
    pub const fn larger(self) -> Option<SizeClass> {
        match self {
            SizeClass::Small => Some(SizeClass::Medium),
            SizeClass::Medium => Some(SizeClass::Large),
            SizeClass::Large => None,
        }
    }

    const fn slot(self) -> usize {
        match self {
            SizeClass::Small => 0,
            SizeClass::Medium => 1,
            SizeClass::Large => 2,
        }
    }
}

impl fmt::Display for SizeClass {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{} KiB", self.bytes() / 1024)
    }
}

/// The shared side of the pool: the budget. Cheap to clone.
#[derive(Clone)]
pub struct BufferPool {
    shared: Arc<PoolShared>,
}

/// One worker's free lists. Not shared: each worker owns one and takes and releases buffers without a lock.
pub struct WorkerBuffers {
    shared: Arc<PoolShared>,
    free: [Vec<Buffer>; 3],
}

/// A pooled byte buffer of one size class.
///
/// Tracks how far it was written so that release zeroes only that part. Dropping it (instead of releasing
/// it to a [`WorkerBuffers`]) wipes it too and returns its bytes to the budget.
pub struct Buffer {
    bytes: Box<[u8]>,
    class: SizeClass,
    written: usize,
    shared: Arc<PoolShared>,
}

/// The buffer budget had no room for another buffer of the asked class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the buffer budget of {budget} bytes has no room for another {class} buffer; raise buffer_budget or lower max_connections"
)]
pub struct BudgetExhausted {
    /// The class asked for.
    pub class: SizeClass,
    /// The whole budget.
    pub budget: usize,
}

struct PoolShared {
    budget: usize,
    charged: AtomicUsize,
    wipe: bool,
}

impl BufferPool {
    /// A pool that may hold at most `budget` bytes of buffers; `wipe` zeroes buffers on release.
    pub fn new(budget: usize, wipe: bool) -> BufferPool {
        BufferPool {
            shared: Arc::new(PoolShared {
                budget,
                charged: AtomicUsize::new(0),
                wipe,
            }),
        }
    }

    /// Free lists for one worker.
    pub fn worker(&self) -> WorkerBuffers {
        WorkerBuffers {
            shared: Arc::clone(&self.shared),
            free: [Vec::new(), Vec::new(), Vec::new()],
        }
    }

    /// Bytes of buffers allocated now (in use or on a free list).
    pub fn charged(&self) -> usize {
        self.shared.charged.load(Ordering::Relaxed)
    }

    /// The whole budget in bytes.
    pub fn budget(&self) -> usize {
        self.shared.budget
    }
}

impl WorkerBuffers {
    /// A buffer of `class`: a free one if there is one, else a new one if the budget has room.
    pub fn acquire(&mut self, class: SizeClass) -> Result<Buffer, BudgetExhausted> {
        if let Some(buffer) = self.free[class.slot()].pop() {
            return Ok(buffer);
        }
        let size = class.bytes();
        // A CAS loop rather than fetch_add so that a failed charge never pushes the counter past the budget.
        let charged =
            self.shared
                .charged
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |charged| {
                    charged
                        .checked_add(size)
                        .filter(|&total| total <= self.shared.budget)
                });
        if charged.is_err() {
            return Err(BudgetExhausted {
                class,
                budget: self.shared.budget,
            });
        }
        Ok(Buffer {
            bytes: vec![0; size].into_boxed_slice(),
            class,
            written: 0,
            shared: Arc::clone(&self.shared),
        })
    }

    /// Returns a buffer to this worker's free list, zeroing its written part first (when wiping is on).
    pub fn release(&mut self, mut buffer: Buffer) {
        buffer.wipe();
        self.free[buffer.class.slot()].push(buffer);
    }

    /// How many free buffers of `class` this worker holds.
    pub fn free_count(&self, class: SizeClass) -> usize {
        self.free[class.slot()].len()
    }
}

impl Buffer {
    /// The size class.
    pub fn class(&self) -> SizeClass {
        self.class
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.bytes.len()
    }

    /// The whole buffer, read-only.
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes
    }

    /// The whole buffer, writable. Marks all of it as written, so release wipes all of it.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.written = self.bytes.len();
        &mut self.bytes
    }

    /// The bytes from `start` on, writable. The caller must call [`Buffer::mark_written`] for what it
    /// wrote, so that release wipes it.
    pub(crate) fn tail_mut(&mut self, start: usize) -> &mut [u8] {
        &mut self.bytes[start..]
    }

    /// Notes that bytes up to `end` hold data, without handing out a slice.
    pub(crate) fn mark_written(&mut self, end: usize) {
        self.written = self.written.max(end.min(self.bytes.len()));
    }

    /// Zeroes the written part if the pool wipes, so that the compiler cannot drop the stores as dead.
    fn wipe(&mut self) {
        if self.shared.wipe && self.written > 0 {
            let written = &mut self.bytes[..self.written];
            written.fill(0);
            // black_box makes the zeroed bytes observable, which keeps the fill from being elided
            // even when the buffer is dropped right after.
            std::hint::black_box(&*written);
        }
        self.written = 0;
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.wipe();
        self.shared
            .charged
            .fetch_sub(self.bytes.len(), Ordering::Relaxed);
    }
}

impl fmt::Debug for BufferPool {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("BufferPool")
            .field("budget", &self.shared.budget)
            .field("charged", &self.charged())
            .field("wipe", &self.shared.wipe)
            .finish()
    }
}

impl fmt::Debug for WorkerBuffers {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("WorkerBuffers")
            .field("free_small", &self.free[0].len())
            .field("free_medium", &self.free[1].len())
            .field("free_large", &self.free[2].len())
            .finish()
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Buffer")
            .field("class", &self.class)
            .field("written", &self.written)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_buffer_is_reused_and_wiped() {
        let pool = BufferPool::new(1 << 20, true);
        let mut worker = pool.worker();
        let mut buffer = worker.acquire(SizeClass::Small).unwrap();
        buffer.as_mut_slice()[..5].copy_from_slice(b"token");
        worker.release(buffer);
        assert_eq!(worker.free_count(SizeClass::Small), 1);
        let again = worker.acquire(SizeClass::Small).unwrap();
        assert!(
            again.as_slice().iter().all(|&byte| byte == 0),
            "a reused buffer still holds the previous connection's bytes"
        );
        assert_eq!(
            pool.charged(),
            4096,
            "reuse must not charge the budget again"
        );
    }

    #[test]
    fn the_budget_refuses_a_buffer_that_does_not_fit_and_drop_returns_bytes() {
        let pool = BufferPool::new(76 * 1024, true);
        let mut worker = pool.worker();
        let large = worker.acquire(SizeClass::Large).unwrap();
        let error = worker.acquire(SizeClass::Medium).unwrap_err();
        assert_eq!(error.class, SizeClass::Medium);
        let small = worker.acquire(SizeClass::Small).unwrap();
        drop(large);
        assert_eq!(
            pool.charged(),
            4096,
            "dropping a buffer must return its bytes"
        );
        assert!(worker.acquire(SizeClass::Large).is_ok());
        drop(small);
    }

    #[test]
    fn size_classes_round_up() {
        assert_eq!(SizeClass::for_size(1), Some(SizeClass::Small));
        assert_eq!(SizeClass::for_size(4097), Some(SizeClass::Medium));
        assert_eq!(SizeClass::for_size(65_536), Some(SizeClass::Large));
        assert_eq!(SizeClass::for_size(65_537), None);
    }
}
