//! The loop's slab of connection slots (made, reused, cut back after a spike) and the read buffers they borrow.

use super::*;

impl<G: Gate, F: SessionFactory> EventLoop<'_, G, F> {
    pub(super) fn new_entry(&mut self) -> io::Result<u32> {
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
    pub(super) fn take_free(&mut self) -> Option<u32> {
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
    pub(super) fn shrink_slab(&mut self) {
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

    pub(super) fn conn(&mut self, index: u32) -> &mut Conn<F::Session, G::Ticket> {
        self.entries[index as usize]
            .conn
            .as_mut()
            .expect("a connection being run is in its entry")
    }

    pub(super) fn limits(&self, index: u32) -> &ResolvedLimits {
        self.entries[index as usize]
            .conn
            .as_ref()
            .map_or(&self.core.limits, |conn| &conn.listener.limits)
    }

    pub(super) fn usual_class(&self, index: u32) -> SizeClass {
        SizeClass::for_size(self.limits(index).read_buffer).unwrap_or(SizeClass::Large)
    }

    /// Gives the connection a read buffer of its usual class, or grows a full one.
    pub(super) fn ensure_read_buffer(&mut self, index: u32) -> Result<(), CloseReason> {
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
        let buffers = &mut self.buffers;
        match read.grow_class(limit, |class| buffers.acquire(class)) {
            Ok(old) => {
                Self::give_back(&mut self.buffers, self.holding, old);
                Ok(())
            }
            Err((reason, unused)) => {
                if let Some(unused) = unused {
                    Self::give_back(&mut self.buffers, self.holding, unused);
                }
                Err(reason)
            }
        }
    }

    /// Puts `buffer` on the loop's free list, then frees what the list holds beyond what this loop can use.
    ///
    /// A loop's free list would otherwise keep every buffer of its busiest moment, charged against the
    /// budget that all loops share, while another loop is refused buffers. Keeping as many as connections
    /// hold now (at least [`FREE_BUFFERS_KEPT`]) leaves a steady exchange allocation-free.
    /// (A function of the two fields, not a method, so callers may hold a connection's entry meanwhile.)
    pub(super) fn give_back(
        buffers: &mut WorkerBuffers,
        holding: usize,
        buffer: net_io_core::Buffer,
    ) {
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
}
