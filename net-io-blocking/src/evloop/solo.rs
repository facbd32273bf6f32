//! Solo reads: a loop holding one busy connection waits for its next input in a blocking `recv` instead of `epoll_wait`.

use super::*;

impl<G: Gate, F: SessionFactory> EventLoop<'_, G, F> {
    /// The connection to serve with a solo read instead of an `epoll_wait`, and for how long at most.
    ///
    /// Only when the loop holds exactly one connection, that connection got data in the turn just run (a
    /// round trip is in progress, so more input is likely to follow soon), it now waits for input with its
    /// socket drained, and nothing else could need the loop: no yielded turn, no lingering close, no queued
    /// connection, no stop, no wake signalled since the last one acted on (read from memory, not from the
    /// eventfd), no timer due within [`SOLO_TIMER_MARGIN`]. The slice ends at the next timer.
    pub(super) fn solo_candidate(&mut self, stopping: bool) -> Option<(u32, Duration)> {
        let (index, generation) = self.served.take()?;
        if self.solo_slice.is_zero()
            || self.live != 1
            || stopping
            || !self.yielded.is_empty()
            || !self.lingering.is_empty()
            || !self.incoming.is_empty()
            || self.core.stopping.load(Ordering::Acquire)
            || self.core.loops[self.index].wake.eventfd.signals() != self.wake_seen
        {
            return None;
        }
        let entry = self.entries.get(index as usize)?;
        let conn = entry.conn.as_ref()?;
        let waits_to_read = matches!(conn.wait, Wait::Read { .. })
            && conn.registered
            && !conn.readable
            && !conn.read_closed
            && !conn.machine.is_peer_closed()
            // A listening session must see a post at once, not after a blocking recv's slice.
            && !conn.listening
            && !conn.input_changed;
        if entry.generation != generation || !waits_to_read {
            return None;
        }
        let slice = match self.next_timeout() {
            Some(timeout) if timeout < SOLO_TIMER_MARGIN => return None,
            Some(timeout) => timeout.min(self.solo_slice),
            None => self.solo_slice,
        };
        Some((index, slice))
    }

    /// Waits for the one connection's next input in a blocking `recv` under `SO_RCVTIMEO` (at most `slice`)
    /// instead of in `epoll_wait`, then serves it: a round trip costs the `recv` and the `send`, as on a
    /// worker thread, where the readiness loop costs an `epoll_wait` besides.
    ///
    /// A kill of this connection (or a drain's or shed's close of it while idle) shuts its read side down, so
    /// the `recv` returns at once. Any other wake (a new connection, a completion, a stop, a kill of a
    /// lingering close) is seen when the slice ends. No input within the slice: the socket is drained, so
    /// the next turn waits in `epoll_wait` again (its edge-triggered registration reports input from then
    /// on; input that the solo read took leaves at most a stale edge, which costs one `recv` answering
    /// `EAGAIN` or nothing at all).
    pub(super) fn solo_read(&mut self, index: u32, slice: Duration) {
        let margin = SOLO_REARM_MARGIN.min(self.core.limits.tick);
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        let Some(socket) = entry.owner.socket() else {
            return;
        };
        // The kernel rounds SO_RCVTIMEO up to a jiffy, so an armed timeout within a millisecond of the slice
        // is as good. Not within a tick: the socket comes armed with the idle timeout, which may be a tick
        // (seconds, with a long tick), and a solo read under it would hold the loop that long.
        let close_enough = conn
            .armed
            .is_some_and(|armed| !armed.is_zero() && armed.abs_diff(slice) <= margin);
        if !close_enough {
            if socket::set_receive_timeout(socket, Some(slice)).is_err() {
                // No solo read this time; `epoll_wait` serves the connection as before.
                return;
            }
            conn.armed = Some(slice);
        }
        conn.readable = true;
        let waiting = conn.wait;
        if !self.solo_marked {
            self.solo_marked = true;
            self.core.loops[self.index]
                .solo
                .store(true, Ordering::Relaxed);
        }
        self.solo_block = Some(waiting);
        self.drive(index, Step::Read);
        self.solo_block = None;
    }
}
