//! The runtime's error type and the task states a handle reads.

use std::io;

/// Why a runtime call or a task failed. Every variant says what happened and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// An OS call failed; the errno is attached when there was one.
    #[error(
        "an OS call failed (errno {0:?}); check the resource (descriptor limits, permissions) and retry"
    )]
    CheckError(Option<i32>),
    /// The address is in use.
    #[error("the address is in use; pick another port or stop the other server")]
    AddressLock,
    /// `init` ran while a runtime is already running.
    #[error("the runtime is already running; call shutdown before init")]
    AlreadyInit,
    /// Nothing can run because `init` has not been called.
    #[error("the runtime is not initialised; call Runtime::init first")]
    NotInitialised,
    /// Another handle took the output.
    #[error("the output was already taken by another handle; use join on clones that share it")]
    AlreadyTaken,
    /// The task ended without leaving an output to read.
    #[error("the task finished without an output to read")]
    Finished,
    /// The task was cancelled.
    #[error("the task was cancelled before it produced an output")]
    Cancelled,
    /// No task exists for this handle (an empty set or a released slot).
    #[error("there is no such task; the handle is empty or stale")]
    NoSuchTask,
    /// The task panicked, lost its thread, depended on a failed task or was spawned after shutdown.
    #[error("the task failed (panic, lost thread, failed dependency or spawn after shutdown)")]
    TaskFailed,
    /// The output is not there yet (a try read or a timed read that ran out).
    #[error("the task has not settled yet; wait longer or join")]
    NotReady,
    /// A memory trim could not run because slots are held.
    #[error("slots are still in use; drop handles and try again")]
    StillInUse,
    /// A path does not exist or cannot be used.
    #[error("the path does not exist or cannot be used; check it")]
    BadPath,
    /// An argument is out of range.
    #[error("an argument is out of range; see the method's documentation for its limits")]
    BadArgument,
    /// An environment variable name or value is invalid.
    #[error("an environment variable name or value is invalid")]
    BadVariable,
    /// A working directory does not exist.
    #[error("the working directory does not exist")]
    BadDirectory,
    /// A run went past its timeout.
    #[error("the task ran past its timeout; raise the timeout or shorten the work")]
    TimedOut,
    /// An address cannot be resolved or reached.
    #[error("the address cannot be resolved or reached; check host and port")]
    BadAddress,
    /// The peer or channel is closed.
    #[error("the connection or channel is closed")]
    Closed,
    /// A message exceeded its limit.
    #[error("the data is longer than the limit; raise the limit or split it")]
    TooLong,
    /// The signal cannot be watched.
    #[error("this signal cannot be watched (SIGKILL, SIGSTOP, reserved or out of range)")]
    BadSignal,
}

impl From<io::Error> for RuntimeError {
    fn from(error: io::Error) -> Self {
        match error.kind() {
            io::ErrorKind::AddrInUse => RuntimeError::AddressLock,
            io::ErrorKind::NotFound => RuntimeError::BadPath,
            io::ErrorKind::TimedOut => RuntimeError::TimedOut,
            io::ErrorKind::AddrNotAvailable | io::ErrorKind::ConnectionRefused => {
                RuntimeError::BadAddress
            }
            io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof => RuntimeError::Closed,
            _ => RuntimeError::CheckError(error.raw_os_error()),
        }
    }
}

/// Where a task is in its life; the value is also the futex word joiners sleep on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum TaskState {
    /// The slot holds no task.
    Free = 0,
    /// Spawned, not started (queued, delayed or waiting for a give).
    Pending = 1,
    /// Running on a thread or parked on the kernel.
    Running = 2,
    /// An output is ready (a repeat reads Ready between runs).
    Ready = 3,
    /// The output was taken.
    Taken = 4,
    /// Cancelled.
    Cancelled = 5,
    /// Failed: panic, lost thread, failed dependency or an error from the task.
    Failed = 6,
    /// A run went past its timeout.
    TimedOut = 7,
}

impl TaskState {
    pub(crate) fn from_bits(bits: u32) -> TaskState {
        match bits & 0xf {
            1 => TaskState::Pending,
            2 => TaskState::Running,
            3 => TaskState::Ready,
            4 => TaskState::Taken,
            5 => TaskState::Cancelled,
            6 => TaskState::Failed,
            7 => TaskState::TimedOut,
            _ => TaskState::Free,
        }
    }

    /// Whether the state is settled: anything except Pending and Running.
    pub fn is_settled(self) -> bool {
        !matches!(self, TaskState::Pending | TaskState::Running)
    }
}

/// What `join_first` does with the handles that lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JoinPolicy {
    /// Cancel the losers.
    Cancel,
    /// Give the losers back, in the order they were passed.
    #[default]
    PassBack,
    /// Drop the losers' handles; the tasks keep running.
    Drop,
}
