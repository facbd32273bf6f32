//! A futureless task runtime for Linux: tasks are values run on a growing thread pool and park on kernel events.
//!
//! Tasks do nothing until spawned. A pool of worker threads (one per core to begin with, growing when
//! workers are blocked or stuck) runs them; tasks that wait on the kernel (timers, sockets, signals,
//! file changes, child exits, channel receives) *park*: they hold no thread until the manager's epoll
//! says they can continue. A [`TaskHandle`] joins, takes, cancels or times out.
//!
//! ```
//! use task_runtime::{Compute, Runtime};
//! # let _ = Runtime::init();
//! let handle = Runtime::task(Compute::compute(|()| 21 * 2)).spawn();
//! assert_eq!(handle.join(), Ok(42));
//! ```
//!
//! ```text
//!             ┌────────── task table (slots, futex state words) ──────────┐
//!   spawn ──> │ injector (4 priority bands) ─> workers ─> publish / park  │
//!             │ blocking queue ─────────────> blocking threads            │
//!             └── manager: epoll + ONE timerfd over a timer heap, signal ─┘
//!                 eventfd, inotify, socket and pidfd readiness; supervised
//! ```
//!
//! The behaviour follows the macOS crate `atap` 0.1.0 (see the workspace's reference notes), ported to
//! epoll, timerfd, eventfd, futex, inotify and pidfd through `net-io-sys`. Differences: sleeps park on
//! the manager's timer heap instead of holding a blocking thread, and waits use futexes on the task's
//! state word instead of a per-thread kqueue.

#![warn(missing_docs)]
// The README example runs as a doctest, so the crate's front page cannot drift from its API.
#![cfg_attr(doctest, doc = include_str!("../README.md"))]
#![forbid(unsafe_code)]

mod builder;
mod error;
mod executor;
mod handle;
mod kinds;
mod manager;
mod park;
mod pool;
mod runtime;
mod table;
mod task;

pub use builder::{
    Bounded, Delayed, Every, Gathering, NoGive, Once, Repeating, Series, TaskBuilder, Undelayed,
    Unwired, Waiting, Wiring,
};
pub use error::{JoinPolicy, RuntimeError, TaskState};
pub use handle::{HandleSet, TaskHandle};
pub use kinds::channel::{Channel, ChannelReceive, ChannelSend, Receiver, Sender};
pub use kinds::compute::Compute;
pub use kinds::file::{File, FileOutput, FileTask};
pub use kinds::process::{
    Exit, Output, Process, ProcessOutput, ProcessRun, ProcessSpec, ProcessWait, RunningProcess,
};
pub use kinds::signal::{Signal, SignalWait};
pub use kinds::sleep::{Sleep, SleepMode};
pub use kinds::tcp::{Tcp, TcpAccept, TcpConnect, TcpConnection, TcpListener, TcpRecv, TcpSend};
pub use kinds::watch::{Change, FileWatch};
pub use runtime::{PoolStatus, Runtime, RuntimeBuilder, Status};
#[doc(hidden)]
pub use table::TaskRef;
pub use task::{Step, Task, Wait};

#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub use runtime::faults;
