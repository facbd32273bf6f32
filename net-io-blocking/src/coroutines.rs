//! Blocking handlers on the event loops: each handler runs on a stackful coroutine owned by a [`Session`]
//! (the [`HandlerSession`] adapter), and its [`TcpConnection`] suspends where a worker thread would block.
//!
//! ```text
//!   event loop ──on_open / on_data / on_writable / on_timeout / on_peer_closed──▶ HandlerSession
//!        ▲                                                                          │ resume(Wakeup, Output)
//!        │ Step::Read / Step::Write / Close / Abort                                  ▼
//!        └──────────────── suspend(Step, Output) ◀── TcpConnection::read / write_all ◀── handler
//!   on_close(reason) ──resume(Closed(reason))──▶ the handler's next call returns Err(Closed(reason))
//! ```
//!
//! The loop owns the connection, so everything it guarantees a session holds for the handler too:
//! admission and caps, the gate before each write, PROXY headers, deadlines by phase, the minimum rate,
//! kills, drain, panic containment and one close with one reason. The adapter only translates:
//!
//! - `read` suspends with [`Step::Read`]; the loop's `on_data` copies up to the handler's buffer length of
//!   the input it received into a per-thread staging buffer, consumes that much and resumes the handler,
//!   which copies it out. Input beyond the handler's buffer stays in the loop's read buffer for the next read.
//! - `write_all` queues into the connection's [`Output`] (moved into the coroutine for the length of each
//!   resume, so no byte is copied twice) and suspends with [`Step::Write`] until the loop has flushed it;
//!   a reply larger than the output budget goes out one budget at a time.
//! - a deadline resumes the waiting call with `Err(Timeout(kind))`, the peer's FIN with `Ok(0)`, and the
//!   close (kill, drain, slow peer, gate denial, a reset) with `Err(Closed(reason))`. After a deadline or
//!   the close, every call returns an error at once without suspending, so the handler runs to its end
//!   inside the loop's `on_close` (or, should it be dropped suspended, during the unwind of its stack).
//!   After the FIN, reads return `Ok(0)` at once and writes still go out (a half close). A handler that
//!   panics while it runs to its end after the close is reported (`SessionPanicked` event) as on a worker
//!   thread; the close keeps the reason it already had.
//! - `shutdown_write` asks the loop for the session half close (`SessionContext::shutdown_write`) and
//!   suspends with [`Step::Write`]; the loop sends the FIN after the queue (empty, since `write_all` waits
//!   for its flush) and resumes the handler with `Writable`. A later `write_all` fails at once.
//! - the handler's return value becomes `Step::Close` (`Ok`, flushed then FIN) or `Step::Abort` (`Err`),
//!   which the loop turns into the same close reasons the threaded driver reports.
//!
//! What the adapter relies on from the loop (a change there must keep these): a session's hooks all run on
//! the loop thread that made it (the coroutine refuses any other); after `Step::Read`, input left unconsumed
//! is offered again through `on_data` before the loop reads more; `Step::Write` ends in `on_writable` (or a
//! deadline, or the close) once the queue is flushed; and `on_close` runs before the session is dropped.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock};

use net_io_core::{
    CloseReason, ConfigError, ConnectionInfo, Event, Input, LimitKind, NetError, Output,
    RefusalCause, Session, SessionContext, SessionFactory, Step, TimeoutKind, handler_stack_hint,
};
use net_io_sys::coroutine::{Coroutine, CoroutineResult};

use crate::connection::TcpConnection;
use crate::handler_io::{Requests, Resume, STAGING, Suspend, Wakeup, Yielder};
use crate::shared::{Core, KillHandle};

/// The smallest handler stack the builder accepts. The driver's own frames (the coroutine's entry, the
/// adapter, a suspend) take 8 to 12 KiB in a debug build, and a handler's panic unwinds and runs the panic
/// hook (which may capture a backtrace) on the same stack: 16 KiB ended the process with `SIGSEGV` there,
/// 32 KiB did not. Twice that leaves the handler room of its own.
pub(crate) const MIN_HANDLER_STACK: usize = 64 * 1024;
/// The largest handler stack the builder accepts: 1 GiB of address space a connection. Beyond it the
/// mapping fails for every connection (or the size overflows when the guard page is added).
pub(crate) const MAX_HANDLER_STACK: usize = 1 << 30;

/// How blocking handlers are run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandlerDriver {
    /// One worker thread per connection (the default). A handler may call any blocking code: a database
    /// client, a file read, a lock, `thread::sleep`. The worker count caps how many connections are served.
    Threads,
    /// Each handler runs on a stackful coroutine over `loops` event-loop threads; a call on its
    /// [`TcpConnection`] that would wait suspends the coroutine instead, so an idle or waiting connection
    /// holds no thread, only its coroutine's stack pages.
    ///
    /// **Hazard: a handler must not block on anything but its `TcpConnection`.** A blocking call elsewhere
    /// (another socket, a file, a lock held by another thread, a channel, `thread::sleep`, a long
    /// computation) runs on the loop thread and stalls every connection of that loop until it returns,
    /// deadlines and kills included. Offload such work or use [`HandlerDriver::Threads`]. Worse, a lock
    /// (a `Mutex`, a `RefCell` borrow) held across a `read` or `write_all` is held by a suspended handler: a
    /// second handler on the same loop that takes it blocks the loop thread on which the holder would have
    /// to resume, and the loop deadlocks for good (a `RefCell` panics instead). Release locks before any
    /// call on the connection.
    ///
    /// Each coroutine has its own stack ([`ServerBuilder::handler_stack_size`](crate::ServerBuilder::handler_stack_size),
    /// 256 KiB of address space by default, at least 64 KiB and at most 1 GiB, else the build fails; only the
    /// touched pages are resident) with a guard page below it: overflowing it kills the process with
    /// `SIGSEGV`, as a thread's stack overflow aborts.
    /// Each stack is a memory mapping, so the kernel's `vm.max_map_count` (65,530 by default, two
    /// mappings a stack) bounds the open connections unless it is raised; at that limit a new connection
    /// closes after admission with `Limit(HandlerStack)`, an [`Event::HandlerStackFailed`] carries the
    /// `errno` and a hint naming `vm.max_map_count` (coalesced in a flood), and the server serves on (a test
    /// fills the limit).
    Coroutines {
        /// How many loop threads; at least one.
        loops: usize,
    },
}

impl HandlerDriver {
    /// Coroutines over one loop thread per available core.
    pub fn coroutines() -> HandlerDriver {
        let loops = std::thread::available_parallelism().map_or(2, |cores| cores.get());
        HandlerDriver::Coroutines { loops }
    }
}

/// What the coroutine hands back when the handler returned.
pub(crate) struct Finish {
    result: Result<(), NetError>,
    output: Option<Output>,
    requests: Requests,
}

/// Makes a [`HandlerSession`] for each connection the loops admit.
pub(crate) struct CoroutineFactory<H> {
    handler: Arc<H>,
    /// Set once the server's core exists (before the door opens, so before any connection).
    core: Arc<OnceLock<Arc<Core>>>,
    stack_size: usize,
}

/// The session that runs one handler on its coroutine.
pub(crate) struct HandlerSession {
    coroutine: Coroutine<Resume, Suspend, Finish>,
    /// For the `SessionPanicked` event of a handler that panics on the close path, where no hook of the
    /// loop sees it.
    core: Arc<Core>,
    /// The most bytes the handler's waiting `read` takes; 0 when it is not waiting in a `read`.
    want: usize,
    finished: bool,
}

thread_local! {
    /// Set by [`CoroutineFactory::create`] when it made no session because the stack could not be mapped,
    /// and taken by the loop (on the same thread, right after) through [`reason_for_no_session`]: the
    /// factory interface can only say "no session", this says why.
    static STACK_FAILED: Cell<bool> = const { Cell::new(false) };
}

/// The close reason for a connection whose factory made no session on this thread just now:
/// `Limit(HandlerStack)` when a coroutine stack could not be mapped, else `Refused(Session)` (the
/// factory declined). Clears the mark, so it answers once per failure.
pub(crate) fn reason_for_no_session() -> CloseReason {
    if STACK_FAILED.with(|failed| failed.replace(false)) {
        CloseReason::Limit(LimitKind::HandlerStack)
    } else {
        CloseReason::Refused(RefusalCause::Session)
    }
}

impl<H> CoroutineFactory<H> {
    pub(crate) fn new(handler: H, core: Arc<OnceLock<Arc<Core>>>, stack_size: usize) -> Self {
        Self {
            handler: Arc::new(handler),
            core,
            stack_size,
        }
    }
}

impl HandlerSession {
    /// Resumes the handler with `wakeup` and the connection's output, and turns what it does next into a step.
    fn run(&mut self, wakeup: Wakeup, context: &mut SessionContext<'_>) -> Step {
        if self.finished {
            return Step::Close;
        }
        let budget = context.output().budget();
        let output = std::mem::replace(context.output(), Output::new(budget));
        // A panic in the handler continues from here into the loop's hook, which closes the connection
        // with `SessionPanicked`; the output queue it held goes with its stack.
        let resumed = self.coroutine.resume(Resume { wakeup, output });
        self.want = 0;
        match resumed {
            Ok(CoroutineResult::Yield(suspend)) => {
                *context.output() = suspend.output;
                apply(suspend.requests, context);
                self.want = suspend.want;
                suspend.step
            }
            Ok(CoroutineResult::Return(finish)) => {
                self.finished = true;
                if let Some(output) = finish.output {
                    *context.output() = output;
                }
                apply(finish.requests, context);
                match finish.result {
                    Ok(()) => Step::Close,
                    Err(_) => Step::Abort,
                }
            }
            Err(_) => {
                self.finished = true;
                Step::Abort
            }
        }
    }
}

impl<H> SessionFactory for CoroutineFactory<H>
where
    H: Fn(&mut TcpConnection<'_>) -> Result<(), NetError> + Send + Sync + 'static,
{
    type Session = HandlerSession;

    fn create(&self, info: &ConnectionInfo) -> Option<HandlerSession> {
        let core = Arc::clone(self.core.get()?);
        let loop_index = info.worker?.0 as usize;
        let shared = core.loops.get(loop_index)?;
        let slot = shared.find(info.id.get())?;
        let kill = KillHandle {
            slot: Arc::clone(&slot.slot),
            wake: Arc::clone(&shared.wake.eventfd),
            linger: Arc::clone(&slot.linger),
            id: info.id,
        };
        let handler = Arc::clone(&self.handler);
        let info = *info;
        let session_core = Arc::clone(&core);
        let created = Coroutine::new(self.stack_size, move |yielder: &Yielder, first: Resume| {
            let mut connection = TcpConnection::on_loop(yielder, first.output, info, &core, kill);
            let result = handler(&mut connection);
            let (output, requests) = connection.into_loop_parts();
            Finish {
                result,
                output,
                requests,
            }
        });
        let coroutine = match created {
            Ok(coroutine) => coroutine,
            Err(error) => {
                // At the mapping limit every new connection fails here, so the event goes through the
                // coalescer; the close reason says what ran out.
                let errno = error.raw_os_error().unwrap_or(0);
                session_core.emit_coalesced(Event::HandlerStackFailed {
                    id: info.id,
                    errno,
                    hint: handler_stack_hint(errno),
                });
                STACK_FAILED.with(|failed| failed.set(true));
                return None;
            }
        };
        Some(HandlerSession {
            coroutine,
            core: session_core,
            want: 0,
            finished: false,
        })
    }
}

impl Session for HandlerSession {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        self.run(Wakeup::Start, context)
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let count = input.len().min(self.want);
        if count == 0 {
            return if self.finished {
                Step::Close
            } else {
                Step::Read
            };
        }
        STAGING.with(|staging| {
            let mut staging = staging.borrow_mut();
            staging.clear();
            staging.extend_from_slice(&input.bytes()[..count]);
        });
        input.consume(count);
        self.run(Wakeup::Data(count), context)
    }

    fn on_writable(&mut self, context: &mut SessionContext<'_>) -> Step {
        self.run(Wakeup::Writable, context)
    }

    fn on_timeout(&mut self, kind: TimeoutKind, context: &mut SessionContext<'_>) -> Step {
        self.run(Wakeup::Timeout(kind), context)
    }

    fn on_peer_closed(&mut self, context: &mut SessionContext<'_>) -> Step {
        self.run(Wakeup::PeerClosed, context)
    }

    fn on_close(&mut self, info: &ConnectionInfo, reason: CloseReason) {
        if self.finished || !self.coroutine.is_started() {
            return;
        }
        self.finished = true;
        // The handler's waiting call returns `Err(Closed(reason))` and every later call fails at once, so
        // it runs to its end here; what it queues now has no socket to go to.
        let resumed = catch_unwind(AssertUnwindSafe(|| {
            self.coroutine.resume(Resume {
                wakeup: Wakeup::Closed(reason),
                output: Output::new(0),
            })
        }));
        // The close and its reason are decided already; the panic is still the handler's, and a worker
        // thread would report it, so the event says so (the loop would swallow it silently).
        if resumed.is_err() {
            self.core.emit(Event::SessionPanicked { id: info.id });
        }
    }
}

impl std::fmt::Debug for HandlerSession {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("HandlerSession")
            .field("want", &self.want)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

/// Checks [`ServerBuilder::handler_stack_size`](crate::ServerBuilder::handler_stack_size) at build: a stack
/// too small for the driver would end the process with `SIGSEGV` at the first connection, one too large to
/// map would refuse every connection.
pub(crate) fn check_stack_size(bytes: usize) -> Result<(), ConfigError> {
    if bytes < MIN_HANDLER_STACK {
        return Err(ConfigError::TooSmall {
            field: "handler_stack_size",
            value: bytes as u64,
            min: MIN_HANDLER_STACK as u64,
        });
    }
    if bytes > MAX_HANDLER_STACK {
        return Err(ConfigError::TooLarge {
            field: "handler_stack_size",
            value: bytes as u64,
            max: MAX_HANDLER_STACK as u64,
        });
    }
    Ok(())
}

fn apply(requests: Requests, context: &mut SessionContext<'_>) {
    if let Some(deadline) = requests.exchange_deadline {
        context.set_exchange_deadline(deadline);
    }
    if let Some(timeout) = requests.idle_timeout {
        context.set_idle_timeout(timeout);
    }
    if requests.shutdown_write {
        context.shutdown_write();
    }
}
