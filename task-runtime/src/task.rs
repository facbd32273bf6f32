//! The task contract (a sealed trait every kind implements), the parking request a step returns, wakers,
//! and the erased job the executor stores in a slot.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::error::RuntimeError;
use crate::table::TaskRef;

pub(crate) mod sealed {
    /// Keeps [`Task`](super::Task) implementable only inside this crate.
    pub trait Sealed {}
}

/// A unit of work the runtime can run: a compute, a sleep, a socket operation, a channel receive, ...
///
/// Tasks are plain values that do nothing until spawned with [`Runtime::task`](crate::Runtime::task) or
/// run with [`Runtime::block`](crate::Runtime::block). The trait is sealed: the kinds are this crate's.
pub trait Task: sealed::Sealed + Send + 'static {
    /// What a run takes: `()` unless the task is wired with `wait_for` or `receive`.
    type Input: Send + 'static;
    /// What a run produces.
    type Output: Send + 'static;

    #[doc(hidden)]
    /// Whether the task runs on the blocking threads instead of the workers.
    fn blocking(&self) -> bool {
        false
    }

    #[doc(hidden)]
    /// Begins a run with its input.
    fn start(&mut self, input: Self::Input);

    #[doc(hidden)]
    /// Advances the run: finished, or parked until an event or a deadline.
    fn step(&mut self) -> Step<Self::Output>;
}

/// What one step of a task returns.
#[doc(hidden)]
#[derive(Debug)]
pub enum Step<T> {
    /// The run finished with an output or an error.
    Done(Result<T, RuntimeError>),
    /// The run waits: step again after the event or the deadline, whichever comes first.
    Park(Wait),
}

/// A parking request: a kernel event source, a deadline, or both.
#[doc(hidden)]
pub struct Wait {
    pub(crate) deadline: Option<Instant>,
    pub(crate) source: Option<(Arc<dyn Source>, u8)>,
}

impl std::fmt::Debug for Wait {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Wait")
            .field("deadline", &self.deadline)
            .field("has_source", &self.source.is_some())
            .finish()
    }
}

impl Wait {
    pub(crate) fn until(deadline: Instant) -> Self {
        Wait {
            deadline: Some(deadline),
            source: None,
        }
    }

    pub(crate) fn on(source: Arc<dyn Source>, direction: u8, deadline: Option<Instant>) -> Self {
        Wait {
            deadline,
            source: Some((source, direction)),
        }
    }
}

/// Something a parked task waits on (socket readiness, a channel, a signal, a file change, a child exit).
pub(crate) trait Source: Send + Sync {
    /// Records `waker` to be woken on the event; returns false when the event is already there, in which
    /// case the caller steps again at once instead of parking.
    fn register(&self, direction: u8, waker: Waker) -> bool;
}

/// Wakes a parked task (by slot and scheduling sequence) or a thread blocked in `Runtime::block`.
#[derive(Clone)]
pub(crate) enum Waker {
    Task { task: TaskRef, sequence: u64 },
    Thread(Arc<ThreadWake>),
}

impl Waker {
    /// Wakes the target; returns whether it was still waiting for this wake (a stale one is ignored).
    pub(crate) fn wake(&self) -> bool {
        match self {
            Waker::Task { task, sequence } => crate::executor::wake(*task, *sequence),
            Waker::Thread(thread) => {
                thread.wake();
                true
            }
        }
    }
}

/// A thread's own wait word, used by `Runtime::block`.
#[derive(Debug, Default)]
pub(crate) struct ThreadWake {
    pub(crate) word: AtomicU32,
}

impl ThreadWake {
    pub(crate) fn wake(&self) {
        self.word.store(1, Ordering::SeqCst);
        net_io_sys::futex::wake_all(&self.word);
    }

    /// Sleeps until woken or `timeout` passes; clears the word.
    pub(crate) fn sleep(&self, timeout: Option<Duration>) {
        if self.word.swap(0, Ordering::SeqCst) == 1 {
            return;
        }
        let _ = net_io_sys::futex::wait(&self.word, 0, timeout);
        self.word.store(0, Ordering::SeqCst);
    }
}

/// The erased task the executor stores in a slot.
pub(crate) trait Job: Send {
    fn start(&mut self, input: Box<dyn Any + Send>);
    fn step(&mut self) -> Step<Box<dyn Any + Send>>;
    fn clone_job(&self) -> Option<Box<dyn Job>>;
}

/// Forwards a copy of each output to another task (`give_to`).
pub(crate) type Forward<T> = Box<dyn Fn(&T) + Send>;

pub(crate) struct JobOf<K: Task> {
    pub(crate) kind: K,
    pub(crate) forwards: Vec<Forward<K::Output>>,
    pub(crate) cloner: Option<fn(&K) -> K>,
}

impl<K: Task> Job for JobOf<K> {
    fn start(&mut self, input: Box<dyn Any + Send>) {
        // The builder's typestate makes the input type match; a mismatch cannot be built.
        if let Ok(input) = input.downcast::<K::Input>() {
            self.kind.start(*input);
        }
    }

    fn step(&mut self) -> Step<Box<dyn Any + Send>> {
        match self.kind.step() {
            Step::Park(wait) => Step::Park(wait),
            Step::Done(Err(error)) => Step::Done(Err(error)),
            Step::Done(Ok(output)) => {
                for forward in &self.forwards {
                    forward(&output);
                }
                Step::Done(Ok(Box::new(output)))
            }
        }
    }

    fn clone_job(&self) -> Option<Box<dyn Job>> {
        let cloner = self.cloner?;
        Some(Box::new(JobOf {
            kind: cloner(&self.kind),
            forwards: Vec::new(),
            cloner: self.cloner,
        }))
    }
}

/// How a task repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    Once,
    Repeat,
    Series(Duration),
}

/// The schedule and wiring of a task that is more than a single run.
pub(crate) struct Plan {
    pub(crate) shape: Shape,
    pub(crate) gap: Option<Duration>,
    pub(crate) count: Option<u64>,
    pub(crate) deadline: Option<Instant>,
    pub(crate) after: Option<Duration>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) wired: bool,
    pub(crate) gather: Option<Gather>,
    pub(crate) mailbox: Option<Box<dyn Any + Send>>,
    pub(crate) arrivals: u64,
    pub(crate) delay_done: bool,
    pub(crate) dependants: Vec<(TaskRef, usize)>,
    pub(crate) parent: Option<TaskRef>,
    pub(crate) outstanding: u64,
    pub(crate) series_start: Option<Instant>,
    /// When the next run falls due on the schedule: the spawn (plus the start delay), then for a repeat
    /// each run's due time plus its length and the gap, for a series one period after the last. The
    /// count of runs inside `deadline` is judged on these, not on when a worker gets to a run.
    pub(crate) due: Option<Instant>,
    /// When the current run of a repeat started, so that its length moves `due` on.
    pub(crate) run_started: Option<Instant>,
}

impl Plan {
    pub(crate) fn new() -> Self {
        Plan {
            shape: Shape::Once,
            gap: None,
            count: None,
            deadline: None,
            after: None,
            timeout: None,
            wired: false,
            gather: None,
            mailbox: None,
            arrivals: 0,
            delay_done: false,
            dependants: Vec::new(),
            parent: None,
            outstanding: 0,
            series_start: None,
            due: None,
            run_started: None,
        }
    }
}

/// A receive's view of its sources: which have published since the last run.
pub(crate) struct Gather {
    pub(crate) set: Box<dyn ErasedSet>,
    pub(crate) arrived: Vec<bool>,
}

/// A set of handles, erased: its members and how to collect their outputs into one value.
pub(crate) trait ErasedSet: Send {
    fn members(&self) -> Vec<TaskRef>;
    fn collect(&self) -> Result<Box<dyn Any + Send>, RuntimeError>;
}
