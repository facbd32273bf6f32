//! Zero-copy input: [`ReadBuffer`] (owned by the driver) and [`Input`] (the session's borrowed view of it).
//!
//! ```text
//!   ReadBuffer:  [ consumed | unread (Input sees this) | spare (recv writes here) ]
//!                0        start                      end                   capacity
//! ```
//!
//! The driver receives into [`ReadBuffer::spare_mut`], commits the count, lends the unread bytes to the
//! session as an [`Input`], and applies what the session consumed. Unread bytes move to the front only when
//! the spare tail is under a quarter of the buffer, so a stream of small requests costs no copies.

use crate::buffer::{BudgetExhausted, Buffer, SizeClass};
use crate::close::{CloseReason, LimitKind};

/// The session's view of the unread input. The session calls [`Input::consume`] for what it used;
/// anything left stays for the next call.
#[derive(Debug)]
pub struct Input<'a> {
    bytes: &'a [u8],
    consumed: usize,
}

/// A connection's read buffer: a pooled [`Buffer`] with a read position and a fill position.
#[derive(Debug)]
pub struct ReadBuffer {
    buffer: Buffer,
    start: usize,
    end: usize,
}

impl<'a> Input<'a> {
    /// A view over `bytes` with nothing consumed yet.
    pub fn new(bytes: &'a [u8]) -> Input<'a> {
        Input { bytes, consumed: 0 }
    }

    /// The bytes not yet consumed.
    pub fn bytes(&self) -> &'a [u8] {
        &self.bytes[self.consumed..]
    }

    /// How many bytes are not yet consumed.
    pub fn len(&self) -> usize {
        self.bytes.len() - self.consumed
    }

    /// True when every byte was consumed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Marks `count` more bytes as used. Consuming more than is left consumes everything.
    pub fn consume(&mut self, count: usize) {
        self.consumed = (self.consumed + count).min(self.bytes.len());
    }

    /// Marks every byte as used.
    pub fn consume_all(&mut self) {
        self.consumed = self.bytes.len();
    }

    /// How many bytes were consumed since this view was made.
    pub fn consumed(&self) -> usize {
        self.consumed
    }
}

impl ReadBuffer {
    /// An empty read buffer over `buffer`.
    pub fn new(buffer: Buffer) -> ReadBuffer {
        ReadBuffer {
            buffer,
            start: 0,
            end: 0,
        }
    }

    /// The free tail for `recv` to write into, compacting first if it is under a quarter of the buffer.
    /// Empty when the buffer is full of unread bytes (see [`ReadBuffer::is_full`]).
    pub fn spare_mut(&mut self) -> &mut [u8] {
        self.compact_if_needed();
        let end = self.end;
        self.buffer.tail_mut(end)
    }

    /// Records that `count` bytes were received into the spare tail.
    pub fn commit(&mut self, count: usize) {
        self.end = (self.end + count).min(self.buffer.capacity());
        self.buffer.mark_written(self.end);
    }

    /// Appends `bytes` (for bytes that arrived another way, such as after a PROXY header); returns how many fit.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) -> usize {
        let spare = self.spare_mut();
        let count = bytes.len().min(spare.len());
        spare[..count].copy_from_slice(&bytes[..count]);
        self.commit(count);
        count
    }

    /// The unread bytes as an [`Input`] for the session.
    pub fn input(&self) -> Input<'_> {
        Input::new(self.unread())
    }

    /// The unread bytes.
    pub fn unread(&self) -> &[u8] {
        &self.buffer.as_slice()[self.start..self.end]
    }

    /// How many bytes are unread.
    pub fn unread_len(&self) -> usize {
        self.end - self.start
    }

    /// Drops `count` unread bytes (what the session consumed). Resets to the front once empty.
    pub fn consume(&mut self, count: usize) {
        self.start = (self.start + count).min(self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// True when unread bytes fill the whole buffer: nothing more can be received until the session
    /// consumes or the buffer grows. At the largest class this is `Limit(ReadBuffer)`, never a spin.
    pub fn is_full(&self) -> bool {
        self.start == 0 && self.end == self.buffer.capacity()
    }

    /// The buffer's capacity.
    pub fn capacity(&self) -> usize {
        self.buffer.capacity()
    }

    /// The buffer's size class.
    pub fn class(&self) -> SizeClass {
        self.buffer.class()
    }

    /// Moves the unread bytes into `larger` and returns the old buffer for release.
    /// Fails (giving `larger` back) if the unread bytes do not fit in it.
    pub fn grow(&mut self, mut larger: Buffer) -> Result<Buffer, Buffer> {
        let unread = self.unread_len();
        if larger.capacity() < unread {
            return Err(larger);
        }
        larger.tail_mut(0)[..unread].copy_from_slice(self.unread());
        larger.mark_written(unread);
        self.start = 0;
        self.end = unread;
        Ok(std::mem::replace(&mut self.buffer, larger))
    }

    /// Moves a full buffer's input into the next larger size class, taking the buffer from `acquire`, as
    /// long as that class is at most `limit` bytes (the listener's `read_buffer_max`). `Ok` holds the old
    /// buffer for the caller to give back. `Err` holds the close: `Limit(ReadBuffer)` past the limit or the
    /// largest class, `Limit(BufferBudget)` when the budget has nothing left, with a buffer that was taken
    /// but not used, if any, for the caller to give back. Both drivers grow their read buffers here.
    pub fn grow_class(
        &mut self,
        limit: usize,
        acquire: impl FnOnce(SizeClass) -> Result<Buffer, BudgetExhausted>,
    ) -> Result<Buffer, (CloseReason, Option<Buffer>)> {
        let too_long = CloseReason::Limit(LimitKind::ReadBuffer);
        let Some(larger) = self.class().larger() else {
            return Err((too_long, None));
        };
        if larger.bytes() > limit {
            return Err((too_long, None));
        }
        let buffer =
            acquire(larger).map_err(|_| (CloseReason::Limit(LimitKind::BufferBudget), None))?;
        self.grow(buffer).map_err(|unused| (too_long, Some(unused)))
    }

    /// Forgets every unread byte.
    pub fn clear(&mut self) {
        self.start = 0;
        self.end = 0;
    }

    /// The underlying buffer, for release to the pool.
    pub fn into_buffer(self) -> Buffer {
        self.buffer
    }

    /// Moves unread bytes to the front when the spare tail is under a quarter of the capacity.
    fn compact_if_needed(&mut self) {
        let capacity = self.buffer.capacity();
        if self.start > 0 && capacity - self.end < capacity / 4 {
            let (start, end) = (self.start, self.end);
            self.buffer.tail_mut(0).copy_within(start..end, 0);
            self.start = 0;
            self.end = end - start;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::BufferPool;

    #[test]
    fn consumed_bytes_leave_and_the_rest_stays() {
        let pool = BufferPool::new(1 << 20, true);
        let mut worker = pool.worker();
        let mut read = ReadBuffer::new(worker.acquire(SizeClass::Small).unwrap());
        assert_eq!(read.extend_from_slice(b"GET /a\nGET /b"), 13);
        let mut input = read.input();
        assert_eq!(input.bytes(), b"GET /a\nGET /b");
        input.consume(7);
        let consumed = input.consumed();
        read.consume(consumed);
        assert_eq!(
            read.unread(),
            b"GET /b",
            "the second request must stay unread"
        );
    }

    #[test]
    fn the_buffer_compacts_only_when_the_tail_is_under_a_quarter() {
        let pool = BufferPool::new(1 << 20, true);
        let mut worker = pool.worker();
        let mut read = ReadBuffer::new(worker.acquire(SizeClass::Small).unwrap());
        let filler = vec![7u8; 3500];
        read.extend_from_slice(&filler);
        read.consume(3000);
        // 596 bytes of tail left, under a quarter of 4096: the next spare request compacts.
        let spare = read.spare_mut().len();
        assert_eq!(
            spare,
            4096 - 500,
            "compaction should move 500 unread bytes to the front"
        );
        assert_eq!(read.unread(), &filler[..500]);
    }

    #[test]
    fn a_full_buffer_grows_into_a_larger_class() {
        let pool = BufferPool::new(1 << 20, true);
        let mut worker = pool.worker();
        let mut read = ReadBuffer::new(worker.acquire(SizeClass::Small).unwrap());
        read.extend_from_slice(&[1u8; 4096]);
        assert!(read.is_full());
        assert!(
            read.spare_mut().is_empty(),
            "a full buffer has no spare tail"
        );
        let old = read
            .grow(worker.acquire(SizeClass::Medium).unwrap())
            .unwrap();
        worker.release(old);
        assert_eq!(read.unread_len(), 4096);
        assert!(!read.is_full());
        assert_eq!(read.class(), SizeClass::Medium);
    }

    #[test]
    fn growing_stops_at_the_limit_the_largest_class_and_an_empty_budget() {
        let pool = BufferPool::new(1 << 20, true);
        let mut worker = pool.worker();
        let mut read = ReadBuffer::new(worker.acquire(SizeClass::Small).unwrap());
        read.extend_from_slice(&[7u8; 4096]);
        let too_long = CloseReason::Limit(LimitKind::ReadBuffer);
        let refused = read.grow_class(SizeClass::Small.bytes(), |class| worker.acquire(class));
        assert!(
            matches!(refused, Err((reason, None)) if reason == too_long),
            "a limit of one small buffer refuses to grow: {refused:?}"
        );
        let empty = read.grow_class(usize::MAX, |class| {
            Err(BudgetExhausted { class, budget: 0 })
        });
        assert!(
            matches!(
                empty,
                Err((CloseReason::Limit(LimitKind::BufferBudget), None))
            ),
            "an empty budget is its own limit: {empty:?}"
        );
        let old = read
            .grow_class(usize::MAX, |class| worker.acquire(class))
            .expect("a medium buffer fits");
        worker.release(old);
        assert_eq!(read.class(), SizeClass::Medium);
        assert_eq!(read.unread(), &[7u8; 4096][..], "the input moved whole");
        let mut largest = SizeClass::Medium;
        while let Some(next) = largest.larger() {
            largest = next;
        }
        let mut read = ReadBuffer::new(worker.acquire(largest).unwrap());
        assert!(
            matches!(read.grow_class(usize::MAX, |class| worker.acquire(class)), Err((reason, None)) if reason == too_long),
            "the largest class cannot grow"
        );
    }
}
