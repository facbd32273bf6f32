//! What a coroutine handler's [`TcpConnection`](crate::TcpConnection) and the loop session driving it pass
//! each other at each suspend and resume, and the per-thread staging buffer input travels through.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use net_io_core::{CloseReason, Output, Step, TimeoutKind};

thread_local! {
    /// Input on its way from the loop's read buffer to a handler's buffer. One per loop thread: a handler
    /// is resumed on the thread that drives it, and copies the bytes out before it can suspend again.
    pub(crate) static STAGING: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// What a resume tells the handler's waiting call.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Wakeup {
    /// The connection opened: the handler starts.
    Start,
    /// This many bytes of input wait in the loop thread's staging buffer.
    Data(usize),
    /// The peer sent FIN.
    PeerClosed,
    /// Everything queued was written.
    Writable,
    /// A deadline passed.
    Timeout(TimeoutKind),
    /// The connection closed with this reason.
    Closed(CloseReason),
}

/// What the loop hands the coroutine at each resume.
pub(crate) struct Resume {
    pub(crate) wakeup: Wakeup,
    pub(crate) output: Output,
}

/// What the handler asked of the loop since its last suspend.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Requests {
    pub(crate) exchange_deadline: Option<Option<Instant>>,
    pub(crate) idle_timeout: Option<Duration>,
    /// `shutdown_write` was called: the loop's session half close.
    pub(crate) shutdown_write: bool,
}

/// What the coroutine hands back when it suspends.
pub(crate) struct Suspend {
    pub(crate) step: Step,
    /// The most bytes the waiting `read` takes (0 unless the step is a read).
    pub(crate) want: usize,
    pub(crate) output: Output,
    pub(crate) requests: Requests,
}

/// The yielder a loop-driven [`TcpConnection`](crate::TcpConnection) suspends through.
pub(crate) type Yielder = net_io_sys::coroutine::Yielder<Resume, Suspend>;

/// Copies the staged input (`count` bytes) into `buffer`.
pub(crate) fn take_staged(buffer: &mut [u8], count: usize) -> usize {
    STAGING.with(|staging| {
        let staging = staging.borrow();
        let count = count.min(buffer.len()).min(staging.len());
        buffer[..count].copy_from_slice(&staging[..count]);
        count
    })
}
