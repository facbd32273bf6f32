//! The loop's timer heap and what each deadline does when it fires: handshake, idle, read, write, exchange, park, linger, minimum rate.

use super::*;

impl<G: Gate, F: SessionFactory> EventLoop<'_, G, F> {
    /// Puts `at` in the heap for `index` unless an earlier (or equal) time is there already.
    pub(super) fn schedule(&mut self, index: u32, at: Instant) {
        let entry = &mut self.entries[index as usize];
        if entry.timer_at.is_some_and(|current| current <= at) {
            return;
        }
        entry.timer_at = Some(at);
        self.timers.push(Reverse((at, index, entry.generation)));
        if self.timers.len() > TIMERS_SLACK + 2 * self.live {
            self.compact_timers();
        }
    }

    /// Drops the heap's stale entries (of closed connections, or superseded by an earlier time), keeping its
    /// allocation. A closed connection leaves its entry behind until it comes due, so with long timeouts and
    /// many short connections the heap would otherwise grow with the connection rate times the timeout (an
    /// hour's idle timeout at 20,000 closes/s is 72 million entries). Each live connection has at most one
    /// current entry, so after this the heap holds at most `live`; the next compaction is `live + slack`
    /// pushes away, which makes it O(1) per push.
    pub(super) fn compact_timers(&mut self) {
        let entries = &self.entries;
        let mut timers = std::mem::take(&mut self.timers).into_vec();
        timers.retain(|Reverse((at, index, generation))| {
            entries.get(*index as usize).is_some_and(|entry| {
                entry.generation == *generation
                    && entry.timer_at == Some(*at)
                    && entry.conn.is_some()
            })
        });
        self.timers = BinaryHeap::from(timers);
    }

    pub(super) fn fire_timers(&mut self) {
        let now = self.core.now();
        while let Some(Reverse((at, index, generation))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            let Some(entry) = self.entries.get_mut(index as usize) else {
                continue;
            };
            if entry.generation != generation || entry.timer_at != Some(at) || entry.conn.is_none()
            {
                continue;
            }
            entry.timer_at = None;
            self.serve(index, |event_loop| event_loop.on_timer(index, now));
        }
    }

    /// A timer of `index` came due: act on whatever deadline passed, or put the next one back in the heap.
    pub(super) fn on_timer(&mut self, index: u32, now: Instant) {
        let entry = &mut self.entries[index as usize];
        let Some(conn) = entry.conn.as_mut() else {
            return;
        };
        if let Some(code) = entry.owner.closing()
            && !matches!(conn.wait, Wait::Linger { .. })
        {
            return self.close(index, reason_for_code(code));
        }
        match conn.wait {
            Wait::Connect { deadline, .. } => {
                if now >= deadline {
                    return self.close(index, CloseReason::ConnectTimeout);
                }
                self.schedule(index, deadline);
            }
            Wait::Handshake { deadline } => {
                if now >= deadline {
                    return self.close(index, CloseReason::HandshakeTimeout);
                }
                self.schedule(index, deadline);
            }
            Wait::Read { deadline, kind } => {
                let check = match conn.rates.judge_input(now) {
                    Ok(check) => check,
                    Err(reason) => return self.close(index, reason),
                };
                if now >= deadline {
                    return self.read_deadline(index, kind);
                }
                if std::mem::take(&mut conn.recheck) {
                    conn.readable = true;
                    return self.drive(index, Step::Read);
                }
                let next = earliest(deadline, check);
                self.schedule(index, next);
            }
            Wait::Flush {
                then_close,
                deadline,
            } => {
                let check = match conn.rates.judge_output(now) {
                    Ok(check) => check,
                    Err(reason) => return self.close(index, reason),
                };
                if now >= deadline {
                    return self.write_deadline(index, now);
                }
                if conn.recheck && !conn.writable {
                    // Keep `recheck` set: a second EAGAIN then waits for the edge alone.
                    conn.writable = true;
                    let step = if then_close { Step::Close } else { Step::Write };
                    return self.drive(index, step);
                }
                let next = earliest(deadline, check);
                self.schedule(index, next);
            }
            Wait::Park { until } => {
                if now >= until {
                    return self.park_deadline(index);
                }
                self.schedule(index, until);
            }
            Wait::Linger { end } => {
                let real_now = Instant::now();
                if real_now >= end {
                    return self.finish_linger(index, false);
                }
                self.schedule(index, deadline_after(now, end - real_now));
            }
            Wait::Running | Wait::Yielded { .. } => {}
        }
    }

    pub(super) fn read_deadline(&mut self, index: u32, kind: TimeoutKind) {
        self.conn(index).wait = Wait::Running;
        // Carrying on, the deadline starts again from now.
        let Some(step) = self.timeout(index, kind) else {
            return self.panicked(index);
        };
        self.drive(index, step);
    }

    /// A write (or exchange) deadline passed during a flush: the session decides, as in the threaded driver;
    /// a flush for `Close` that the session carries on becomes whatever step it returns.
    pub(super) fn write_deadline(&mut self, index: u32, now: Instant) {
        let conn = self.conn(index);
        let kind = conn.machine.flush_deadline_kind(now);
        conn.wait = Wait::Running;
        conn.checked = false;
        conn.write_deadline = None;
        conn.rates.output_done();
        // A spent exchange deadline is cleared; a new one the session sets in `on_timeout` stands.
        let Some(step) = self.timeout(index, kind) else {
            return self.panicked(index);
        };
        match SessionMachine::flush_timeout_answer(kind, step) {
            Ok(next) => self.drive(index, next),
            Err(reason) => self.close(index, reason),
        }
    }

    pub(super) fn park_deadline(&mut self, index: u32) {
        match self.park_timed_out(index) {
            Flow::Next(step) => self.drive(index, step),
            Flow::Close(reason) => self.close(index, reason),
            Flow::Wait => {}
        }
    }

    /// The park deadline passed: the session's `on_timeout` picks the next step.
    pub(super) fn park_timed_out(&mut self, index: u32) -> Flow {
        self.conn(index).wait = Wait::Running;
        match self.timeout(index, TimeoutKind::Park) {
            Some(step) => Flow::Next(step),
            None => self.panicked_flow(index),
        }
    }

    // ----- the session steps -----
}
