//! [`Output`]: a connection's bounded queue of outgoing chunks, gathered into vectored writes.
//!
//! Copied bytes go into one reusable arena (consecutive pushes merge into one chunk), owned [`Bytes`] are
//! kept as they are, and `&'static` slices are queued by reference and do not count against the budget.
//! The driver gathers up to [`IO_SLICES_MAX`] chunks into `IoSlice`s for one `sendmsg` and calls
//! [`Output::advance`] with what the kernel took, so a partial write resumes at the exact byte.
//!
//! An `Output` can be [`reset`](Output::reset) and reused for the next connection, keeping its allocations,
//! so a warmed-up worker queues output without allocating.

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::Bytes;

/// The most chunks one vectored write takes.
pub const IO_SLICES_MAX: usize = 64;
/// The most chunks queued at once (static slices cost no budget but still a chunk).
pub const CHUNKS_MAX: usize = 1024;

/// The output budget was full; the push queued nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the output budget of {budget} bytes is full; return Step::Write to flush it before queuing more"
)]
pub struct OutputFull {
    /// The budget in bytes.
    pub budget: usize,
}

/// A bounded queue of outgoing bytes.
#[derive(Debug)]
pub struct Output {
    chunks: VecDeque<Chunk>,
    arena: Vec<u8>,
    budget: usize,
    /// Bytes counted against the budget (copied and owned), still queued.
    counted: usize,
    /// All bytes still queued, static included.
    pending: usize,
    /// Bytes of the front chunk already written.
    front_offset: usize,
    /// Every byte ever queued / written, as stream positions for response brackets.
    queued_total: u64,
    written_total: u64,
    response_start: u64,
    bracket_open: bool,
}

#[derive(Debug)]
enum Chunk {
    Copied { start: usize, end: usize },
    Static(&'static [u8]),
    Owned(Bytes),
}

impl Output {
    /// An empty queue with a budget of `budget` counted bytes.
    pub fn new(budget: usize) -> Output {
        Output {
            chunks: VecDeque::new(),
            arena: Vec::new(),
            budget,
            counted: 0,
            pending: 0,
            front_offset: 0,
            queued_total: 0,
            written_total: 0,
            response_start: 0,
            bracket_open: false,
        }
    }

    /// Copies all of `bytes` into the queue, or nothing if they do not fit the budget.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), OutputFull> {
        if bytes.is_empty() {
            return Ok(());
        }
        if bytes.len() > self.room() || !self.has_chunk_room() {
            return Err(self.full());
        }
        self.copy_in(bytes);
        Ok(())
    }

    /// Copies as much of `bytes` as fits and returns how many were queued.
    pub fn push_partial(&mut self, bytes: &[u8]) -> usize {
        let count = bytes.len().min(self.room());
        if count == 0 || !self.has_chunk_room() {
            return 0;
        }
        self.copy_in(&bytes[..count]);
        count
    }

    /// Queues a static slice by reference. It costs no budget, only a chunk.
    pub fn push_static(&mut self, bytes: &'static [u8]) -> Result<(), OutputFull> {
        if bytes.is_empty() {
            return Ok(());
        }
        if !self.has_chunk_room() {
            return Err(self.full());
        }
        self.note_push(bytes.len());
        self.chunks.push_back(Chunk::Static(bytes));
        Ok(())
    }

    /// Queues owned bytes without copying; they count against the budget.
    pub fn push_owned(&mut self, bytes: Bytes) -> Result<(), OutputFull> {
        if bytes.is_empty() {
            return Ok(());
        }
        if bytes.len() > self.room() || !self.has_chunk_room() {
            return Err(self.full());
        }
        self.counted += bytes.len();
        self.note_push(bytes.len());
        self.chunks.push_back(Chunk::Owned(bytes));
        Ok(())
    }

    /// Marks the start of a response: until [`Output::end_response`], a gate denial after some of its
    /// bytes went out must reset the connection instead of sending denial text.
    pub fn begin_response(&mut self) {
        self.response_start = self.queued_total;
        self.bracket_open = true;
    }

    /// Marks the end of the current response.
    pub fn end_response(&mut self) {
        self.bracket_open = false;
    }

    /// True when some bytes of the current response already went to the peer, so a denial now must be an RST.
    /// Without brackets, the current response is everything queued since the queue was last empty.
    pub fn response_started(&self) -> bool {
        self.written_total > self.response_start && (self.pending > 0 || self.bracket_open)
    }

    /// Bytes still queued, static slices included.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.pending == 0
    }

    /// Budget left for copied and owned bytes.
    pub fn room(&self) -> usize {
        self.budget - self.counted.min(self.budget)
    }

    /// The budget in bytes.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Every byte ever written out through [`Output::advance`].
    pub fn written_total(&self) -> u64 {
        self.written_total
    }

    /// Fills `slices` with the queued chunks in order (at most [`IO_SLICES_MAX`]) and returns how many it
    /// filled. The first slice starts after any partially written part.
    pub fn fill_io_slices<'a>(&'a self, slices: &mut [IoSlice<'a>]) -> usize {
        let limit = slices.len().min(IO_SLICES_MAX);
        let mut filled = 0;
        for (position, chunk) in self.chunks.iter().enumerate() {
            if filled == limit {
                break;
            }
            let bytes = self.chunk_bytes(chunk);
            let bytes = if position == 0 {
                &bytes[self.front_offset..]
            } else {
                bytes
            };
            slices[filled] = IoSlice::new(bytes);
            filled += 1;
        }
        filled
    }

    /// The first queued bytes (the rest of the front chunk), for a plain `send`.
    pub fn front(&self) -> &[u8] {
        match self.chunks.front() {
            Some(chunk) => &self.chunk_bytes(chunk)[self.front_offset..],
            None => &[],
        }
    }

    /// Drops `count` written bytes from the front, after a (possibly partial) write.
    pub fn advance(&mut self, count: usize) {
        let mut left = count.min(self.pending);
        self.written_total += left as u64;
        self.pending -= left;
        while left > 0 {
            let Some(front) = self.chunks.front() else {
                break;
            };
            let counts = !matches!(front, Chunk::Static(_));
            let remaining = self.chunk_len(front) - self.front_offset;
            let step = left.min(remaining);
            if counts {
                self.counted -= step;
            }
            left -= step;
            if step < remaining {
                self.front_offset += step;
                break;
            }
            self.front_offset = 0;
            self.chunks.pop_front();
        }
        if self.chunks.is_empty() {
            self.arena.clear();
            self.front_offset = 0;
        }
    }

    /// Drops everything queued (a gate denial or an abort), zeroing copied bytes.
    pub fn clear(&mut self) {
        self.arena.fill(0);
        self.arena.clear();
        self.chunks.clear();
        self.counted = 0;
        self.pending = 0;
        self.front_offset = 0;
        self.bracket_open = false;
        self.response_start = self.queued_total;
    }

    /// Gives the queue's memory back to the allocator when it is empty, keeping its counters and budget.
    ///
    /// A connection that once queued a large reply would otherwise hold that capacity while it idles. Returns
    /// false, changing nothing, while bytes are still queued.
    pub fn release_memory(&mut self) -> bool {
        if self.pending > 0 || !self.chunks.is_empty() {
            return false;
        }
        // Wiped before it goes, as `clear` does: the arena held application bytes.
        self.arena.fill(0);
        self.arena = Vec::new();
        self.chunks = VecDeque::new();
        self.front_offset = 0;
        true
    }

    /// Empties the queue for the next connection, keeping its allocations; `budget` may change.
    pub fn reset(&mut self, budget: usize) {
        self.clear();
        self.budget = budget;
        self.queued_total = 0;
        self.written_total = 0;
        self.response_start = 0;
    }

    fn full(&self) -> OutputFull {
        OutputFull {
            budget: self.budget,
        }
    }

    fn has_chunk_room(&self) -> bool {
        self.chunks.len() < CHUNKS_MAX
    }

    fn note_push(&mut self, count: usize) {
        if self.pending == 0 && !self.bracket_open {
            self.response_start = self.queued_total;
        }
        self.pending += count;
        self.queued_total += count as u64;
    }

    fn copy_in(&mut self, bytes: &[u8]) {
        if self.arena.len() + bytes.len() > self.arena.capacity() {
            self.compact_arena();
        }
        let start = self.arena.len();
        self.arena.extend_from_slice(bytes);
        let end = self.arena.len();
        self.counted += bytes.len();
        self.note_push(bytes.len());
        if let Some(Chunk::Copied {
            end: last_end,
            start: _,
        }) = self.chunks.back_mut()
            && *last_end == start
        {
            *last_end = end;
            return;
        }
        self.chunks.push_back(Chunk::Copied { start, end });
    }

    /// Moves the live part of the arena to its front, so written bytes stop taking room.
    fn compact_arena(&mut self) {
        let Some(low) = self.chunks.iter().find_map(|chunk| match chunk {
            Chunk::Copied { start, .. } => Some(*start),
            _ => None,
        }) else {
            self.arena.clear();
            return;
        };
        if low == 0 {
            return;
        }
        self.arena.copy_within(low.., 0);
        self.arena.truncate(self.arena.len() - low);
        for chunk in &mut self.chunks {
            if let Chunk::Copied { start, end } = chunk {
                *start -= low;
                *end -= low;
            }
        }
    }

    fn chunk_bytes<'a>(&'a self, chunk: &'a Chunk) -> &'a [u8] {
        match chunk {
            Chunk::Copied { start, end } => &self.arena[*start..*end],
            Chunk::Static(bytes) => bytes,
            Chunk::Owned(bytes) => bytes,
        }
    }

    fn chunk_len(&self, chunk: &Chunk) -> usize {
        match chunk {
            Chunk::Copied { start, end } => end - start,
            Chunk::Static(bytes) => bytes.len(),
            Chunk::Owned(bytes) => bytes.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain_all(output: &mut Output) -> Vec<u8> {
        let mut sent = Vec::new();
        while !output.is_empty() {
            let mut slices = [IoSlice::new(&[]); IO_SLICES_MAX];
            let filled = output.fill_io_slices(&mut slices);
            // Take at most 5 bytes per "syscall" to exercise partial writes.
            let mut taken = 0;
            for slice in &slices[..filled] {
                let room = 5 - taken;
                let part = &slice[..slice.len().min(room)];
                sent.extend_from_slice(part);
                taken += part.len();
                if taken == 5 {
                    break;
                }
            }
            output.advance(taken);
        }
        sent
    }

    #[test]
    fn releasing_memory_keeps_the_counters_and_waits_for_queued_bytes() {
        let mut output = Output::new(1 << 20);
        output.push(&[7u8; 100_000]).unwrap();
        assert!(
            !output.release_memory(),
            "memory holding queued bytes must not be released"
        );
        assert_eq!(drain_all(&mut output).len(), 100_000);
        assert!(
            output.release_memory(),
            "an empty queue gives its memory back"
        );
        assert_eq!(
            output.written_total(),
            100_000,
            "releasing memory must not reset what was written"
        );
        output.push(b"next").unwrap();
        assert_eq!(drain_all(&mut output), b"next".to_vec());
        assert_eq!(output.written_total(), 100_004);
    }

    #[test]
    fn static_copied_and_owned_chunks_come_out_in_order() {
        let mut output = Output::new(64);
        output.push(b"HTTP/1.1 200 OK\r\n").unwrap();
        output.push_static(b"Server: x\r\n").unwrap();
        output.push_owned(Bytes::from_static(b"\r\nbody")).unwrap();
        output.push(b"!").unwrap();
        assert_eq!(
            drain_all(&mut output),
            b"HTTP/1.1 200 OK\r\nServer: x\r\n\r\nbody!".to_vec()
        );
    }

    #[test]
    fn static_slices_do_not_count_against_the_budget() {
        let mut output = Output::new(4);
        output.push_static(&[0u8; 1000]).unwrap();
        output.push(b"abcd").unwrap();
        assert_eq!(output.push(b"e"), Err(OutputFull { budget: 4 }));
        assert_eq!(output.push_partial(b"efgh"), 0);
        assert_eq!(output.pending(), 1004);
    }

    #[test]
    fn a_partial_push_takes_what_fits() {
        let mut output = Output::new(6);
        assert_eq!(output.push_partial(b"abcdefgh"), 6);
        output.advance(4);
        assert_eq!(output.push_partial(b"ijklmn"), 4);
        assert_eq!(drain_all(&mut output), b"efijkl".to_vec());
    }

    #[test]
    fn a_denial_after_the_first_byte_of_a_response_counts_as_started() {
        let mut output = Output::new(64);
        output.begin_response();
        output.push(b"hello").unwrap();
        assert!(!output.response_started(), "nothing went out yet");
        output.advance(2);
        assert!(output.response_started());
        output.advance(3);
        assert!(output.response_started(), "the bracket is still open");
        output.end_response();
        assert!(
            !output.response_started(),
            "a finished response is a clean boundary"
        );
    }

    #[test]
    fn more_than_64_chunks_take_several_vectored_writes() {
        let mut output = Output::new(1024);
        for _ in 0..100 {
            output.push_static(b"x").unwrap();
        }
        let first = output.fill_io_slices(&mut [IoSlice::new(&[]); IO_SLICES_MAX]);
        assert_eq!(first, 64, "one vectored write takes at most 64 chunks");
        output.advance(64);
        let second = output.fill_io_slices(&mut [IoSlice::new(&[]); IO_SLICES_MAX]);
        assert_eq!(second, 36);
    }
}
