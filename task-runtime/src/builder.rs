//! The typestate task builder: options that only make sense together can only be chained together.
//!
//! Type parameters track the wiring (`Unwired`, `Waiting<T>`, `Gathering<S>`), the shape (`Once`,
//! `Repeating`, `Every`, `Series`) and whether a start delay closed off `count` and deadlines
//! (`Undelayed`, `Delayed`). A chain that makes no sense does not compile:
//!
//! ```compile_fail
//! use task_runtime::{Compute, Runtime};
//! // `every` needs `repeat` first.
//! Runtime::task(Compute::compute(|()| 1)).every(std::time::Duration::from_millis(1));
//! ```
//!
//! ```compile_fail
//! use task_runtime::{Compute, Runtime};
//! // A single run has nothing to count.
//! Runtime::task(Compute::compute(|()| 1)).count(3);
//! ```
//!
//! ```compile_fail
//! use task_runtime::{Compute, Runtime};
//! // `after` closes off `count`: put the count first.
//! Runtime::task(Compute::compute(|()| 1)).repeat().after(std::time::Duration::from_millis(1)).count(3);
//! ```
//!
//! ```compile_fail
//! use task_runtime::{Compute, Runtime};
//! // A compute that takes a u64 cannot spawn before something gives it one.
//! Runtime::task(Compute::compute(|value: u64| value + 1)).spawn();
//! ```
//!
//! ```compile_fail
//! use task_runtime::{Compute, Runtime};
//! // The given type must match the compute's input.
//! Runtime::task(Compute::compute(|value: u64| value + 1)).wait_for::<String>().spawn();
//! ```
//!
//! ```compile_fail
//! use task_runtime::{Compute, Runtime};
//! // Only a waiting task's handle has `give`.
//! Runtime::task(Compute::compute(|()| 1)).spawn().give(5);
//! ```
//!
//! ```compile_fail
//! use task_runtime::{Compute, Runtime};
//! // A repeat is not also a series.
//! Runtime::task(Compute::compute(|()| 1)).repeat().at_rate(std::time::Duration::from_millis(5));
//! ```

use std::marker::PhantomData;
use std::time::{Duration, Instant};

use crate::handle::{HandleSet, SetBox, TaskHandle};
use crate::task::{Forward, Task};

/// Wiring: nothing wired; the task's input is `()`.
#[derive(Debug)]
pub struct Unwired;
/// Wiring: runs once per give of a `T`. Also the handle marker that adds `give`.
#[derive(Debug)]
pub struct Waiting<T>(PhantomData<fn() -> T>);
/// Wiring: runs when every member of the set `S` has published.
#[derive(Debug)]
pub struct Gathering<S>(PhantomData<fn() -> S>);
/// Handle marker for tasks that take no gives.
#[derive(Debug)]
pub struct NoGive;

/// Shape: one run.
#[derive(Debug)]
pub struct Once;
/// Shape: runs again as soon as the previous run publishes.
#[derive(Debug)]
pub struct Repeating;
/// Shape: a repeat with a gap between runs.
#[derive(Debug)]
pub struct Every;
/// Shape: a clone starts every period, overlapping runs.
#[derive(Debug)]
pub struct Series;
/// Delay: no start delay yet, so `count` and deadlines may still be chained.
#[derive(Debug)]
pub struct Undelayed;
/// Delay: a start delay is set; `count` and deadlines are closed off.
#[derive(Debug)]
pub struct Delayed;

/// Connects a builder's wiring to the task's input type; only matching pairs can spawn.
#[diagnostic::on_unimplemented(
    message = "this task takes `{I}` as input, which the builder's wiring does not provide",
    label = "wire the input with `.wait_for::<{I}>()` or `.receive(set)` before spawning"
)]
pub trait Wiring<I>: crate::task::sealed::Sealed {
    /// The handle marker spawning gives.
    type Handle;
    #[doc(hidden)]
    const WIRED: bool;
}

impl crate::task::sealed::Sealed for Unwired {}
impl<T> crate::task::sealed::Sealed for Waiting<T> {}
impl<S> crate::task::sealed::Sealed for Gathering<S> {}

impl Wiring<()> for Unwired {
    type Handle = NoGive;
    const WIRED: bool = false;
}
impl<T> Wiring<T> for Waiting<T> {
    type Handle = Waiting<T>;
    const WIRED: bool = true;
}
impl<S: HandleSet> Wiring<S::Output> for Gathering<S> {
    type Handle = NoGive;
    const WIRED: bool = true;
}

/// Shapes that repeat and so take `count`, `for_duration` and `until`.
pub trait Bounded: crate::task::sealed::Sealed {}
impl crate::task::sealed::Sealed for Repeating {}
impl crate::task::sealed::Sealed for Every {}
impl crate::task::sealed::Sealed for Series {}
impl crate::task::sealed::Sealed for Once {}
impl Bounded for Repeating {}
impl Bounded for Every {}
impl Bounded for Series {}

/// Everything a builder collected, untyped.
pub(crate) struct Options {
    pub(crate) priority: u8,
    pub(crate) timeout: Option<Duration>,
    pub(crate) after: Option<Duration>,
    pub(crate) repeat: bool,
    pub(crate) gap: Option<Duration>,
    pub(crate) series: Option<Duration>,
    pub(crate) count: Option<u64>,
    pub(crate) for_duration: Option<Duration>,
    pub(crate) until: Option<Instant>,
    pub(crate) gather: Option<Box<dyn crate::task::ErasedSet>>,
}

/// Builds a spawn: `Runtime::task(kind)`, then options, then [`spawn`](TaskBuilder::spawn).
pub struct TaskBuilder<K: Task, W = Unwired, S = Once, D = Undelayed> {
    pub(crate) kind: K,
    pub(crate) options: Options,
    pub(crate) forwards: Vec<Forward<K::Output>>,
    pub(crate) cloner: Option<fn(&K) -> K>,
    pub(crate) _marker: Markers<W, S, D>,
}

/// The typestate markers, held as a zero-sized function-pointer phantom so they impose no auto-trait bounds.
pub(crate) type Markers<W, S, D> = PhantomData<fn() -> (W, S, D)>;

impl<K: Task, W, S, D> std::fmt::Debug for TaskBuilder<K, W, S, D> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("TaskBuilder")
            .field("priority", &self.options.priority)
            .finish_non_exhaustive()
    }
}

impl<K: Task> TaskBuilder<K> {
    pub(crate) fn new(kind: K) -> Self {
        TaskBuilder {
            kind,
            options: Options {
                priority: 128,
                timeout: None,
                after: None,
                repeat: false,
                gap: None,
                series: None,
                count: None,
                for_duration: None,
                until: None,
                gather: None,
            },
            forwards: Vec::new(),
            cloner: None,
            _marker: PhantomData,
        }
    }
}

impl<K: Task, W, S, D> TaskBuilder<K, W, S, D> {
    fn retype<W2, S2, D2>(self) -> TaskBuilder<K, W2, S2, D2> {
        TaskBuilder {
            kind: self.kind,
            options: self.options,
            forwards: self.forwards,
            cloner: self.cloner,
            _marker: PhantomData,
        }
    }

    /// Start priority: higher starts first (default 128). Affects start order only.
    pub fn priority(mut self, priority: u8) -> Self {
        self.options.priority = priority;
        self
    }

    /// Limits each run; an overrun settles `TimedOut` and ends a repeat or series. Queue time and the
    /// start delay do not count. A compute cannot be interrupted, so its late output is discarded.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.options.timeout = Some(timeout);
        self
    }

    /// Forwards a copy of every output to a task waiting for that type. Chain it for fan-out.
    pub fn give_to<T2, O>(mut self, target: &TaskHandle<T2, Waiting<O>>) -> Self
    where
        K::Output: Clone + Into<O>,
        O: Send + 'static,
        T2: Send + 'static,
    {
        let target = target.clone();
        self.forwards.push(Box::new(move |output: &K::Output| {
            let _ = target.give(output.clone().into());
        }));
        self
    }
}

impl<K: Task, W, S> TaskBuilder<K, W, S, Undelayed> {
    /// Delays the start (a manager timer, no thread held). On a waiting task it applies after every give.
    pub fn after(mut self, delay: Duration) -> TaskBuilder<K, W, S, Delayed> {
        self.options.after = Some(delay);
        self.retype()
    }
}

impl<K: Task, W> TaskBuilder<K, W, Once, Undelayed> {
    /// Runs again as soon as each run publishes (never overlapping), until cancelled or bounded.
    pub fn repeat(mut self) -> TaskBuilder<K, W, Repeating, Undelayed> {
        self.options.repeat = true;
        self.retype()
    }

    /// Starts a clone every `period` whether or not the last one finished (runs overlap).
    pub fn at_rate(mut self, period: Duration) -> TaskBuilder<K, W, Series, Undelayed>
    where
        K: Clone,
    {
        self.options.series = Some(period);
        self.cloner = Some(K::clone);
        self.retype()
    }
}

impl<K: Task, W, D> TaskBuilder<K, W, Repeating, D> {
    /// Waits `gap` between the end of one run and the start of the next (a manager timer).
    pub fn every(mut self, gap: Duration) -> TaskBuilder<K, W, Every, D> {
        self.options.gap = Some(gap);
        self.retype()
    }
}

impl<K: Task, W, S: Bounded> TaskBuilder<K, W, S, Undelayed> {
    /// Number of runs (0 on a repeat still runs once).
    pub fn count(mut self, runs: u64) -> Self {
        self.options.count = Some(runs);
        self
    }

    /// Runs only those runs that fall due within `duration` of the spawn (the first run always runs).
    ///
    /// A run falls due on the schedule, not when a worker gets to it: the first at the spawn (plus the
    /// [`after`](TaskBuilder::after) delay), each later one after the one before fell due by that run's
    /// length plus the gap of [`every`](TaskBuilder::every) (on a series, one period after the one
    /// before). So how many runs there are depends only on the schedule and how long the runs take,
    /// never on how late a loaded machine starts them: `every(750 ms).for_duration(1 s)` of short runs
    /// runs twice, even when the second run starts after the whole second has passed. The price is that
    /// such a late run does start after the window has closed on the clock; the gap before it is
    /// always kept in full.
    pub fn for_duration(mut self, duration: Duration) -> Self {
        self.options.for_duration = Some(duration);
        self
    }

    /// Runs only those runs that fall due before `deadline` (the first run always runs); runs fall due
    /// on the schedule, as [`for_duration`](TaskBuilder::for_duration) explains, so a run due before
    /// `deadline` that a loaded machine starts after it still runs.
    pub fn until(mut self, deadline: Instant) -> Self {
        self.options.until = Some(deadline);
        self
    }
}

impl<K: Task, T> TaskBuilder<K, Waiting<T>, Once, Undelayed> {
    /// Number of gives that start a run; the task then settles.
    pub fn count(mut self, arrivals: u64) -> Self {
        self.options.count = Some(arrivals);
        self
    }
}

impl<K: Task, S, D> TaskBuilder<K, Unwired, S, D> {
    /// Runs only when given a `T` (by `give` or `give_to`); gives do not queue, the newest wins.
    pub fn wait_for<T: Send + 'static>(self) -> TaskBuilder<K, Waiting<T>, S, D> {
        self.retype()
    }

    /// Runs once every member of `set` has published, with their outputs in the shape of the set.
    pub fn receive<Set: HandleSet>(mut self, set: Set) -> TaskBuilder<K, Gathering<Set>, S, D> {
        self.options.gather = Some(Box::new(SetBox(set)));
        self.retype()
    }
}

impl<K: Task, W: Wiring<K::Input>, S, D> TaskBuilder<K, W, S, D> {
    /// Spawns the task onto the pool. Before `init` the handle reads `NotInitialised`; after shutdown
    /// it reads `TaskFailed`.
    pub fn spawn(self) -> TaskHandle<K::Output, W::Handle> {
        crate::runtime::spawn_built(
            self.kind,
            self.options,
            self.forwards,
            self.cloner,
            W::WIRED,
        )
    }
}
