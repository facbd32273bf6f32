//! Closing a connection once with its reason: the graceful linger, the abortive reset, and giving the slot back.

use super::*;

impl<G: Gate, F: SessionFactory> EventLoop<'_, G, F> {
    /// Closes connection `index` with `reason` (unless a killer won first): FIN and a linger inside the loop
    /// when graceful, RST otherwise; the bookkeeping follows once the socket is closed.
    pub(super) fn close(&mut self, index: u32, reason: CloseReason) {
        let linger_bytes = self.limits(index).linger_bytes;
        let linger_timeout = self.limits(index).linger_timeout;
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        let id = conn.info.id.get();
        // A graceful close publishes its linger word before it takes the kill slot, so a killer that finds the
        // slot closing always finds the word to cut. (Published after, as it was, a kill landing between the
        // two found neither: it returned false and the linger ran its full course.)
        let graceful = !reason.is_abortive();
        if graceful {
            entry.shared.linger.store(id, Ordering::Release);
        }
        let code = entry.owner.begin_close(OWNER_CODE);
        let reason = if code == OWNER_CODE {
            reason
        } else {
            reason_for_code(code)
        };
        conn.closing_reason = Some(reason);
        // Decided afresh by this close: a linger belongs to the close that started it.
        conn.linger = None;
        if let Some(socket) = entry.owner.socket() {
            if reason.is_abortive() {
                let _ = socket::set_linger(socket, Linger::Abortive);
            } else {
                let _ = socket::shutdown(socket, Shutdown::Write);
                if !conn.eof_seen {
                    // The linger runs on real time, like the threaded driver's, whatever clock the server
                    // reads; the loop checks lingerers against real time on every turn as well.
                    let first = socket::recv_nonblocking(socket, &mut self.scratch);
                    conn.linger =
                        LingerRead::start(&first, Instant::now(), linger_timeout, linger_bytes);
                }
            }
        }
        if let Some(linger) = conn.linger {
            // Until the linger ends a killer can cut it short (the loop's wake scans lingerers); one that cut
            // it already is seen by `linger_read` below.
            conn.wait = Wait::Linger { end: linger.end() };
            conn.readable = true;
            self.lingering.push(index);
            let at = deadline_after(self.core.now(), linger_timeout);
            self.schedule(index, at);
            return self.linger_read(index);
        }
        if graceful {
            // No linger: take the word back. A killer that cut it meanwhile asked for an RST; a kill that won
            // the slot first made the reason abortive, and the socket is set so already.
            let cut = entry.shared.linger.swap(0, Ordering::AcqRel) != id;
            if cut
                && !reason.is_abortive()
                && let Some(socket) = entry.owner.socket()
            {
                let _ = socket::set_linger(socket, Linger::Abortive);
            }
        }
        self.finish(index);
    }

    /// Reads and discards what the peer sends after our FIN, until EOF, the byte limit or `EAGAIN`.
    pub(super) fn linger_read(&mut self, index: u32) {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        if entry.shared.linger.load(Ordering::Acquire) != conn.info.id.get() {
            return self.finish_linger(index, true);
        }
        loop {
            let (Some(socket), Some(linger)) = (entry.owner.socket(), conn.linger.as_mut()) else {
                return self.finish_linger(index, false);
            };
            let received = socket::recv_nonblocking(socket, &mut self.scratch);
            match linger.received(&received) {
                Lingered::Again => {}
                Lingered::Wait => return,
                Lingered::Done => return self.finish_linger(index, false),
            }
        }
    }

    /// Ends a linger; `cut` (by a kill) or losing the linger word to a killer makes the close an RST.
    pub(super) fn finish_linger(&mut self, index: u32, cut: bool) {
        self.lingering.retain(|&lingering| lingering != index);
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_ref() else {
            return;
        };
        let id = conn.info.id.get();
        // Whoever takes the word first decides, as in the threaded driver.
        let killed = entry.shared.linger.swap(0, Ordering::AcqRel) != id;
        if (cut || killed)
            && let Some(socket) = entry.owner.socket()
        {
            let _ = socket::set_linger(socket, Linger::Abortive);
        }
        self.finish(index);
    }

    /// Closes the socket and delivers the one close: session, gate, stats, caps, events.
    pub(super) fn finish(&mut self, index: u32) {
        let core = self.core;
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.take() else {
            return;
        };
        let reason = conn.closing_reason.unwrap_or(CloseReason::SessionError);
        // Closing the descriptor removes it from the epoll set (it has no duplicates).
        drop(entry.owner.release());
        entry.timer_at = None;
        entry.generation = entry.generation.wrapping_add(1);
        let Conn {
            info,
            ticket,
            reservation,
            session,
            completer,
            bytes_in,
            bytes_out,
            output_peak,
            ..
        } = conn;
        drop(completer);
        entry.receiver.unbind();
        let stale = entry.receiver.take_stale();
        if stale > 0 {
            core.counters.server().record_stale_completions(stale);
            core.emit(Event::StaleCompletion {
                worker: WorkerId(self.index as u32),
                count: stale,
            });
        }
        if let Some(mut session) = session {
            let _ = catch_unwind(AssertUnwindSafe(|| session.on_close(&info, reason)));
            let _ = catch_unwind(AssertUnwindSafe(move || drop(session)));
        }
        entry.output.clear();
        // A free slot keeps no output memory at all: slots are never removed, so after a spike of many
        // connections each would otherwise hold up to OUTPUT_KEPT_IDLE bytes. The next connection in the slot
        // pays a few small allocations for its first reply, which its accept costs dwarf.
        if output_peak > 0 {
            entry.output = Output::new(entry.output.budget());
        }
        if let Some(mut read) = entry.read.take() {
            // A grown buffer goes back to its own class's free list; the next connection starts usual.
            read.clear();
            self.holding = self.holding.saturating_sub(1);
            Self::give_back(&mut self.buffers, self.holding, read.into_buffer());
        }
        if let Some(ticket) = ticket {
            close_ticket(&self.runtime.gate, ticket, &info, reason);
        }
        core.counters
            .slot(self.index)
            .record_close(reason, bytes_in, bytes_out);
        // Caps are free before anyone can see the close, so a client that reconnects on the Closed event is
        // never refused by a connection that is already gone.
        drop(reservation);
        let shared = &self.core.loops[self.index];
        shared.ids().remove(&info.id.get());
        shared.remove_load();
        self.free.push(Reverse(index));
        self.live -= 1;
        if self.entries.len() > SLAB_KEPT && self.live * 4 < self.entries.len() {
            self.shrink_wanted = true;
        }
        core.emit_closed(&info, reason, bytes_in, bytes_out);
    }

    // ----- helpers -----
}
