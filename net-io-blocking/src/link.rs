//! The connection IO core shared by handlers, sessions and the client: deadline-bound `recv` and `send`,
//! the minimum-rate checks, kill detection and the two close styles.
//!
//! Reads are a plain blocking `recv` under `SO_RCVTIMEO`. The socket timeout is re-set only when the wanted
//! timeout differs from the armed one by more than a tick, so a keep-alive connection whose deadline is
//! always "idle timeout from now" pays no `setsockopt` per request. Writes are `send`/`sendmsg` with
//! `MSG_DONTWAIT | MSG_NOSIGNAL`; only on `EAGAIN` does the link `poll` the socket and the worker's wake.
//! An echo round trip therefore costs one `recv` and one `send`.
//!
//! The clock is read only where a deadline or a rate needs a fresh time: the caller passes the reading it
//! took for its own deadline into `receive`, `send_all` and `flush`, a send that went out whole reads no
//! clock afterwards, and a direction with no rate rule (or an idle one) never asks for the time. A handler's
//! echo round trip reads the clock three times.

use std::io::{self, IoSlice};
use std::net::Shutdown;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use net_io_core::{CloseReason, LingerRead, Lingered, MinRateRule, Output, TransferRates, Verdict};
use net_io_sys::eventfd::EventFd;
use net_io_sys::kill::SlotOwner;
use net_io_sys::socket::{self, Linger};
use net_io_sys::wait::{self, Interest, Readiness};

use crate::clock::SharedClock;
use crate::codes::reason_for_code;

/// The code an owner passes to its own `begin_close`; any other code that comes back is a killer's.
pub(crate) const OWNER_CODE: u16 = u16::MAX;

/// How [`Link::wait_input_or_wake`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listened {
    /// Input, its end or an error is ready to read.
    Input,
    /// The wake descriptor was signalled: a completion was posted, or a kill.
    Woken,
    /// The deadline passed first.
    Deadline,
}

/// What a receive produced.
#[derive(Debug)]
pub(crate) enum Received {
    /// This many bytes arrived.
    Data(usize),
    /// The peer sent FIN.
    Eof,
    /// The deadline passed with nothing received.
    Deadline,
    /// The inbound minimum rate was not met.
    Slow,
    /// Another thread killed the connection with this slot code.
    Killed(u16),
    /// The socket failed.
    Failed(io::Error),
}

/// What a send produced.
#[derive(Debug)]
pub(crate) enum Sent {
    /// Every byte went out.
    Done,
    /// The deadline passed before the peer took every byte.
    Deadline,
    /// The outbound minimum rate was not met.
    Slow,
    /// Another thread killed the connection with this slot code.
    Killed(u16),
    /// The gate denied the write with this code.
    Denied(u16),
    /// The socket failed.
    Failed(io::Error),
}

/// One connection's socket, its kill slot, its wake and its transfer accounting.
#[derive(Debug)]
pub(crate) struct Link {
    owner: SlotOwner,
    wake: Arc<EventFd>,
    /// The id of the connection whose graceful close is lingering, 0 otherwise. The kill slot is already
    /// closing then, so a killer cannot win it; instead it swaps this word to 0 and wakes us, and the linger
    /// ends at once with an RST.
    linger: Arc<AtomicU64>,
    clock: SharedClock,
    tick: Duration,
    armed: Option<Duration>,
    max_wait: Option<Duration>,
    /// When the minimum-rate rule judges each direction (the policy the event loop follows too).
    rates: TransferRates,
    pub(crate) bytes_in: u64,
    pub(crate) bytes_out: u64,
    pub(crate) eof_seen: bool,
}

impl Link {
    /// A link over the socket already placed in `owner`'s slot.
    pub(crate) fn new(
        owner: SlotOwner,
        wake: Arc<EventFd>,
        linger: Arc<AtomicU64>,
        clock: SharedClock,
        tick: Duration,
        min_rate: Option<MinRateRule>,
        manual_clock: bool,
    ) -> Self {
        Self {
            owner,
            wake,
            linger,
            clock,
            tick,
            armed: None,
            // An injected clock may jump at any moment, so waits are cut to a tick to notice it.
            max_wait: manual_clock.then_some(tick),
            rates: TransferRates::new(min_rate),
            bytes_in: 0,
            bytes_out: 0,
            eof_seen: false,
        }
    }

    /// Resets per-connection state for a new connection in the same slot (the owner is re-occupied).
    ///
    /// `inherited_timeout` is the `SO_RCVTIMEO` the socket got from its listener.
    pub(crate) fn reset(
        &mut self,
        min_rate: Option<MinRateRule>,
        inherited_timeout: Option<Duration>,
    ) {
        self.armed = inherited_timeout;
        self.rates.reset(min_rate);
        self.bytes_in = 0;
        self.bytes_out = 0;
        self.eof_seen = false;
    }

    pub(crate) fn owner(&self) -> &SlotOwner {
        &self.owner
    }

    pub(crate) fn owner_mut(&mut self) -> &mut SlotOwner {
        &mut self.owner
    }

    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    pub(crate) fn socket(&self) -> io::Result<BorrowedFd<'_>> {
        self.owner
            .socket()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))
    }

    /// The exchange in progress waits for more input from `now`: the input rate is judged from here.
    pub(crate) fn awaiting_input(&mut self, now: Instant) {
        self.rates.awaiting_input(now);
    }

    /// The connection is between exchanges: its input rate is not judged.
    pub(crate) fn input_idle(&mut self) {
        self.rates.input_idle();
    }

    /// Receives into `buffer`, waiting at most until `deadline`; `now` is the caller's fresh clock reading.
    pub(crate) fn receive(
        &mut self,
        buffer: &mut [u8],
        deadline: Option<Instant>,
        now: Instant,
    ) -> Received {
        let mut fresh = Some(now);
        loop {
            if let Some(code) = self.owner.closing() {
                return Received::Killed(code);
            }
            // Only the first pass may use the caller's reading; a retry comes after a wait.
            let now = fresh.take().unwrap_or_else(|| self.clock.now());
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Received::Deadline;
            }
            let wake_at = match self.rates.judge_input(now) {
                Ok(check) => earliest(deadline, check),
                Err(_) => return Received::Slow,
            };
            let wanted = self.cap_wait(wake_at.map(|at| at.saturating_duration_since(now)));
            if let Err(error) = self.arm(wanted) {
                return Received::Failed(error);
            }
            let socket = match self.socket() {
                Ok(socket) => socket,
                Err(error) => return Received::Failed(error),
            };
            match socket::recv(socket, buffer) {
                Ok(0) if !buffer.is_empty() => {
                    if let Some(code) = self.owner.closing() {
                        return Received::Killed(code);
                    }
                    self.eof_seen = true;
                    return Received::Eof;
                }
                Ok(count) => {
                    self.bytes_in += count as u64;
                    // Input not judged yet counts nothing now, so it needs no time stamp either.
                    let clock = &self.clock;
                    if self.rates.received(count, || clock.now()).is_err() {
                        return Received::Slow;
                    }
                    return Received::Data(count);
                }
                Err(error)
                    if matches!(
                        error.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Err(error) => {
                    if let Some(code) = self.owner.closing() {
                        return Received::Killed(code);
                    }
                    return Received::Failed(error);
                }
            }
        }
    }

    /// Sends all of `bytes`, failing when the peer takes nothing for `progress_timeout` or `hard_deadline`
    /// (an exchange deadline) passes; `now` is the caller's fresh clock reading.
    pub(crate) fn send_all(
        &mut self,
        bytes: &[u8],
        progress_timeout: Duration,
        hard_deadline: Option<Instant>,
        now: Instant,
    ) -> Sent {
        let sent = self.send_all_judged(bytes, progress_timeout, hard_deadline, now);
        // However the send ended, the output is not judged until a later one waits.
        self.rates.output_done();
        sent
    }

    fn send_all_judged(
        &mut self,
        bytes: &[u8],
        progress_timeout: Duration,
        hard_deadline: Option<Instant>,
        now: Instant,
    ) -> Sent {
        let mut pace = Pace::new(now, progress_timeout, hard_deadline);
        let mut offset = 0;
        let mut zero_sends = 0;
        while offset < bytes.len() {
            if let Some(code) = self.owner.closing() {
                return Sent::Killed(code);
            }
            let socket = match self.socket() {
                Ok(socket) => socket,
                Err(error) => return Sent::Failed(error),
            };
            match socket::send(socket, &bytes[offset..]) {
                Ok(0) => {
                    // A zero-byte send is "try again" once and an error the second time.
                    zero_sends += 1;
                    if zero_sends > 1 {
                        return Sent::Failed(io::Error::from(io::ErrorKind::WriteZero));
                    }
                }
                Ok(count) => {
                    zero_sends = 0;
                    offset += count;
                    self.account_sent(count, &mut pace);
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    let deadline = pace.deadline(&self.clock);
                    if let Some(outcome) = self.wait_writable(deadline) {
                        return outcome;
                    }
                    pace.waited();
                }
                Err(error) => return self.send_failure(error),
            }
        }
        Sent::Done
    }

    /// Flushes `output` with vectored sends, asking `check` before each write call; fails when the peer
    /// takes nothing for `progress_timeout` or `hard_deadline` (an exchange deadline) passes.
    ///
    /// `check` is called once per write call before its first system call, not again after `EAGAIN`.
    /// `now` is the caller's fresh clock reading.
    pub(crate) fn flush(
        &mut self,
        output: &mut Output,
        progress_timeout: Duration,
        hard_deadline: Option<Instant>,
        check: &mut dyn FnMut(usize, bool) -> Verdict,
        now: Instant,
    ) -> Sent {
        let sent = self.flush_judged(output, progress_timeout, hard_deadline, check, now);
        self.rates.output_done();
        sent
    }

    fn flush_judged(
        &mut self,
        output: &mut Output,
        progress_timeout: Duration,
        hard_deadline: Option<Instant>,
        check: &mut dyn FnMut(usize, bool) -> Verdict,
        now: Instant,
    ) -> Sent {
        let mut pace = Pace::new(now, progress_timeout, hard_deadline);
        let mut checked = false;
        let mut zero_sends = 0;
        while !output.is_empty() {
            if let Some(code) = self.owner.closing() {
                return Sent::Killed(code);
            }
            if !checked {
                if let Verdict::Deny(code) = check(output.pending(), output.response_started()) {
                    return Sent::Denied(code);
                }
                checked = true;
            }
            let socket = match self.socket() {
                Ok(socket) => socket,
                Err(error) => return Sent::Failed(error),
            };
            let (result, offered) = send_queued(socket, output);
            match result {
                Ok(0) => {
                    zero_sends += 1;
                    if zero_sends > 1 {
                        return Sent::Failed(io::Error::from(io::ErrorKind::WriteZero));
                    }
                }
                Ok(count) => {
                    zero_sends = 0;
                    output.advance(count);
                    self.account_sent(count, &mut pace);
                    // The rest of a partial write belongs to the same write call (no new gate check);
                    // chunks beyond the IO_SLICES_MAX just written start a new one.
                    if count == offered && !output.is_empty() {
                        checked = false;
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    let deadline = pace.deadline(&self.clock);
                    if let Some(outcome) = self.wait_writable(deadline) {
                        return outcome;
                    }
                    pace.waited();
                }
                Err(error) => return self.send_failure(error),
            }
        }
        Sent::Done
    }

    /// One non-blocking send attempt, for a refusal or denial text; the result is deliberately not retried.
    pub(crate) fn send_once(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let sent = socket::send(self.socket()?, bytes)?;
        self.bytes_out += sent as u64;
        Ok(sent)
    }

    /// Sends FIN (a half close): the peer reads the end of our stream, and we can still receive.
    pub(crate) fn shutdown_write(&self) -> io::Result<()> {
        socket::shutdown(self.socket()?, Shutdown::Write)
    }

    /// Parks until the wake fires or `until` passes; returns `true` when woken.
    pub(crate) fn park(&mut self, until: Instant) -> io::Result<bool> {
        let now = self.clock.now();
        let timeout = self.cap_wait(Some(until.saturating_duration_since(now)));
        let woken = wait::wait_readable(self.wake_fd(), timeout)?;
        if woken {
            self.wake.drain()?;
        }
        Ok(woken)
    }

    /// Waits until input (or its end) is ready, the wake descriptor is signalled (a post or a kill; the wake
    /// is drained here), or `deadline` passes; for a session that listens for both. Reads nothing.
    pub(crate) fn wait_input_or_wake(&mut self, deadline: Instant) -> io::Result<Listened> {
        loop {
            let now = self.clock.now();
            if now >= deadline {
                return Ok(Listened::Deadline);
            }
            let timeout = self.cap_wait(Some(deadline.saturating_duration_since(now)));
            let socket = self.socket()?;
            match wait::wait(socket, Interest::Readable, Some(self.wake_fd()), timeout)? {
                Readiness::Socket => return Ok(Listened::Input),
                Readiness::Woken => {
                    self.wake.drain()?;
                    return Ok(Listened::Woken);
                }
                // A capped wait (an injected clock) comes back to look at the time again.
                Readiness::TimedOut => {}
            }
        }
    }

    /// Waits for an outbound connect to finish, a kill, or `deadline` (then `ConnectTimeout`), and makes the
    /// socket blocking again, as every other call on this link expects; sets `TCP_NODELAY` as asked.
    pub(crate) fn finish_connect(
        &mut self,
        deadline: Instant,
        nodelay: bool,
    ) -> Result<(), CloseReason> {
        loop {
            if let Some(code) = self.owner.closing() {
                return Err(reason_for_code(code));
            }
            let now = self.clock.now();
            if now >= deadline {
                return Err(CloseReason::ConnectTimeout);
            }
            let timeout = self.cap_wait(Some(deadline.saturating_duration_since(now)));
            let socket = self
                .socket()
                .map_err(|error| CloseReason::from_io(&error))?;
            match wait::wait(socket, Interest::Writable, Some(self.wake_fd()), timeout) {
                Ok(Readiness::Socket) => {
                    // poll(2) reports a connecting socket writable once the handshake ended, either way:
                    // SO_ERROR tells which. Without an error it must be connected now.
                    let failure = match socket::take_error(socket) {
                        Ok(Some(error)) | Err(error) => Some(error),
                        Ok(None) => socket::peer_addr(socket).err(),
                    };
                    if let Some(error) = failure {
                        return Err(CloseReason::from_io(&error));
                    }
                    let ready = socket::set_nonblocking(socket, false)
                        .and_then(|()| socket::set_nodelay(socket, nodelay));
                    return ready.map_err(|error| CloseReason::from_io(&error));
                }
                Ok(Readiness::Woken) => {
                    let _ = self.wake.drain();
                }
                Ok(Readiness::TimedOut) => {}
                Err(error) => return Err(CloseReason::from_io(&error)),
            }
        }
    }

    /// The owner's own close of connection `id` with `reason`: takes the kill slot (one winner: this close
    /// or a killer that got there first, whose `Killed` reason then replaces `reason`), then FIN and a
    /// bounded linger read when the reason is graceful, RST otherwise. Returns the reason the close keeps.
    ///
    /// A graceful close publishes its linger word before it takes the kill slot, so a killer that finds the
    /// slot closing always finds the word to cut, whether the linger has started, is about to, or will not
    /// happen at all. (Published only once the linger started, as it was, a kill landing between the slot
    /// and the word found neither: it returned `false` and the linger ran its full course.) The word is
    /// taken back at the end; if a killer cut it meanwhile, the close ends with an RST.
    pub(crate) fn close_as(
        &mut self,
        id: u64,
        reason: CloseReason,
        linger_timeout: Duration,
        linger_bytes: usize,
    ) -> CloseReason {
        let published = !reason.is_abortive();
        if published {
            self.linger.store(id, Ordering::Release);
        }
        let code = self.owner.begin_close(OWNER_CODE);
        let reason = if code == OWNER_CODE {
            reason
        } else {
            reason_for_code(code)
        };
        let graceful = !reason.is_abortive();
        if let Ok(socket) = self.socket() {
            if graceful {
                let _ = socket::shutdown(socket, Shutdown::Write);
                if !self.eof_seen {
                    self.linger(id, linger_timeout, linger_bytes);
                }
            } else {
                let _ = socket::set_linger(socket, Linger::Abortive);
            }
        }
        if published {
            // Whoever takes the word first decides: a killer that swapped it away makes the close abortive,
            // and one that comes after this swap finds 0 and does nothing. (A kill that won the slot instead
            // made the reason abortive, and the socket is set so already.)
            let cut = self.linger.swap(0, Ordering::AcqRel) != id;
            if cut
                && graceful
                && let Ok(socket) = self.socket()
            {
                let _ = socket::set_linger(socket, Linger::Abortive);
            }
        }
        let socket: Option<OwnedFd> = self.owner.release();
        drop(socket);
        reason
    }

    /// Reads and discards what the peer still sends after our FIN, so that closing with unread data does not
    /// turn into an RST that could destroy our last reply in flight.
    ///
    /// Runs while the linger word (published by `close_as`) still reads `id`, and waits on the socket and
    /// the worker's wake together, so a kill (which swaps the word away from `id` and signals the wake) ends
    /// the linger at once.
    fn linger(&mut self, id: u64, timeout: Duration, max_bytes: usize) {
        let mut scratch = [0u8; 1024];
        let Ok(socket) = self.socket() else {
            return;
        };
        let first = socket::recv_nonblocking(socket, &mut scratch);
        let Some(mut linger) = LingerRead::start(&first, Instant::now(), timeout, max_bytes) else {
            return;
        };
        while self.linger.load(Ordering::Acquire) == id {
            let left = linger.end().saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let Ok(socket) = self.socket() else {
                break;
            };
            match wait::wait(socket, Interest::Readable, Some(self.wake_fd()), Some(left)) {
                Ok(Readiness::Socket) => {}
                Ok(Readiness::Woken) => {
                    let _ = self.wake.drain();
                    continue;
                }
                Ok(Readiness::TimedOut) | Err(_) => break,
            }
            let Ok(socket) = self.socket() else {
                break;
            };
            let received = socket::recv_nonblocking(socket, &mut scratch);
            if linger.received(&received) == Lingered::Done {
                break;
            }
        }
    }

    pub(crate) fn wake_fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.wake.as_fd()
    }

    /// Waits for room in the send buffer; `Some` ends the send.
    fn wait_writable(&mut self, deadline: Option<Instant>) -> Option<Sent> {
        loop {
            let now = self.clock.now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Some(Sent::Deadline);
            }
            // The first wait starts judging the output rate (counting what this send moved before it).
            let wake_at = match self.rates.awaiting_output(now) {
                Ok(check) => earliest(deadline, check),
                Err(_) => return Some(Sent::Slow),
            };
            let timeout = self.cap_wait(wake_at.map(|at| at.saturating_duration_since(now)));
            let socket = match self.socket() {
                Ok(socket) => socket,
                Err(error) => return Some(Sent::Failed(error)),
            };
            match wait::wait(socket, Interest::Writable, Some(self.wake_fd()), timeout) {
                Ok(Readiness::Socket) => return None,
                Ok(Readiness::Woken) => {
                    let _ = self.wake.drain();
                    if let Some(code) = self.owner.closing() {
                        return Some(Sent::Killed(code));
                    }
                }
                Ok(Readiness::TimedOut) => {}
                Err(error) => return Some(Sent::Failed(error)),
            }
        }
    }

    fn cap_wait(&self, wanted: Option<Duration>) -> Option<Duration> {
        match (wanted, self.max_wait) {
            (Some(wanted), Some(cap)) => Some(wanted.min(cap)),
            (None, cap) => cap,
            (wanted, None) => wanted,
        }
    }

    fn account_sent(&mut self, count: usize, pace: &mut Pace) {
        self.bytes_out += count as u64;
        pace.progressed();
        let clock = &self.clock;
        self.rates.sent(count, || pace.stamp(clock));
    }

    fn send_failure(&self, error: io::Error) -> Sent {
        if let Some(code) = self.owner.closing() {
            return Sent::Killed(code);
        }
        Sent::Failed(error)
    }

    /// Sets `SO_RCVTIMEO` to `wanted` unless the armed value is already within a tick of it.
    fn arm(&mut self, wanted: Option<Duration>) -> io::Result<()> {
        let close_enough = match (self.armed, wanted) {
            (None, None) => true,
            (Some(armed), Some(wanted)) => armed.abs_diff(wanted) <= self.tick && !wanted.is_zero(),
            _ => false,
        };
        if close_enough {
            return Ok(());
        }
        socket::set_receive_timeout(self.socket()?, wanted)?;
        self.armed = wanted;
        Ok(())
    }
}

/// The write deadline of one send: "no progress for `progress_timeout`", capped by a hard deadline.
///
/// Progress restarts the progress deadline, but it is only worked out again when a send would block: a send
/// that goes out whole, the usual case, costs no clock read after it.
struct Pace {
    progress_timeout: Duration,
    hard_deadline: Option<Instant>,
    /// The deadline in force, or `None` after progress until the next wait needs it.
    deadline: Option<Option<Instant>>,
    /// A clock reading still current: taken before the last send with no wait since.
    stamp: Option<Instant>,
}

impl Pace {
    fn new(now: Instant, progress_timeout: Duration, hard_deadline: Option<Instant>) -> Self {
        Self {
            progress_timeout,
            hard_deadline,
            deadline: Some(earliest(
                Some(crate::clock::deadline_after(now, progress_timeout)),
                hard_deadline,
            )),
            stamp: Some(now),
        }
    }

    /// Bytes went out: the progress deadline starts again (from the next reading).
    fn progressed(&mut self) {
        self.deadline = None;
    }

    /// A wait happened, so the last reading is stale.
    fn waited(&mut self) {
        self.stamp = None;
    }

    /// A current time for the rate ring; a non-blocking send takes microseconds, far below its buckets.
    fn stamp(&mut self, clock: &SharedClock) -> Instant {
        *self.stamp.get_or_insert_with(|| clock.now())
    }

    /// The deadline for a wait about to start.
    fn deadline(&mut self, clock: &SharedClock) -> Option<Instant> {
        if let Some(deadline) = self.deadline {
            return deadline;
        }
        let now = clock.now();
        self.stamp = Some(now);
        let deadline = earliest(
            Some(crate::clock::deadline_after(now, self.progress_timeout)),
            self.hard_deadline,
        );
        self.deadline = Some(deadline);
        deadline
    }
}

fn earliest(first: Option<Instant>, second: Option<Instant>) -> Option<Instant> {
    match (first, second) {
        (Some(first), Some(second)) => Some(first.min(second)),
        (first, None) => first,
        (None, second) => second,
    }
}

/// Sends what `output` has queued with one system call, returning its result and the bytes offered.
///
/// One chunk queued (an echo's usual case) goes as a plain send, without building the slice array; more go as
/// one vectored send. Shared by the worker-thread link and the event loop so both cost the same per write.
pub(crate) fn send_queued(socket: BorrowedFd<'_>, output: &Output) -> (io::Result<usize>, usize) {
    let front = output.front();
    if front.len() == output.pending() {
        return (socket::send(socket, front), front.len());
    }
    let mut slices = [IoSlice::new(&[]); net_io_core::output::IO_SLICES_MAX];
    let filled = output.fill_io_slices(&mut slices);
    let offered: usize = slices[..filled].iter().map(|slice| slice.len()).sum();
    let result = if filled == 1 {
        socket::send(socket, &slices[0])
    } else {
        socket::send_vectored(socket, &slices[..filled])
    };
    (result, offered)
}
