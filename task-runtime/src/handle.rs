//! Task handles: join, take, timed and try reads, cancel, state, gives; and handle sets for `receive`.

use std::any::Any;
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::builder::{NoGive, Waiting};
use crate::error::{RuntimeError, TaskState};
use crate::executor;
use crate::pool::wait_settled;
use crate::table::{Slot, TaskRef, table};
use crate::task::ErasedSet;

/// A listener on a spawned task. Clones are further listeners; dropping every handle does not stop the
/// task (the runtime holds its own claim until the task settles).
///
/// `G` is [`Waiting<T>`] for a task built with `wait_for::<T>()`, which adds [`give`](TaskHandle::give).
pub struct TaskHandle<T, G = NoGive> {
    pub(crate) task: TaskRef,
    pub(crate) _marker: PhantomData<fn() -> (T, G)>,
}

impl<T: Send + 'static, G> TaskHandle<T, G> {
    pub(crate) fn from_ref(task: TaskRef) -> Self {
        TaskHandle {
            task,
            _marker: PhantomData,
        }
    }

    /// The task's id (its slot index; reused after the task is gone).
    pub fn id(&self) -> u64 {
        u64::from(self.task.index)
    }

    fn slot(&self) -> Result<&'static Slot, RuntimeError> {
        table().get(self.task).ok_or(RuntimeError::NoSuchTask)
    }

    /// The current state.
    pub fn state(&self) -> TaskState {
        self.slot().map_or(TaskState::Free, Slot::state)
    }

    /// Whether the task settled (anything but Pending and Running).
    pub fn is_settled(&self) -> bool {
        self.state().is_settled()
    }
    /// Whether it is spawned and not started.
    pub fn is_pending(&self) -> bool {
        self.state() == TaskState::Pending
    }
    /// Whether it is running or parked.
    pub fn is_running(&self) -> bool {
        self.state() == TaskState::Running
    }
    /// Whether an output is ready.
    pub fn is_ready(&self) -> bool {
        self.state() == TaskState::Ready
    }
    /// Whether the output was taken.
    pub fn is_taken(&self) -> bool {
        self.state() == TaskState::Taken
    }
    /// Whether it was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.state() == TaskState::Cancelled
    }
    /// Whether a run timed out.
    pub fn is_timed_out(&self) -> bool {
        self.state() == TaskState::TimedOut
    }
    /// Whether it failed.
    pub fn is_failed(&self) -> bool {
        self.state() == TaskState::Failed
    }
    /// Whether it ended for good (no further runs will happen).
    pub fn is_finished(&self) -> bool {
        self.slot().is_ok_and(|slot| slot.lock().settled)
    }

    /// Waits until the task's state is terminal (anything but Pending and Running), without reading the output.
    ///
    /// A repeat or series reads Ready between its runs, so for those this returns once any run has published;
    /// [`is_finished`](Self::is_finished) says whether a run is still to come.
    pub fn wait(&self) {
        if let Ok(slot) = self.slot() {
            wait_settled(slot, self.task, None);
        }
    }

    /// Cancels the task: every listener reads `Cancelled`. A settled task keeps its state; a running
    /// compute cannot be interrupted, so its output is discarded.
    pub fn cancel(&self) {
        executor::cancel(self.task);
    }

    /// Waits for the output and returns a copy of it.
    pub fn join(&self) -> Result<T, RuntimeError>
    where
        T: Clone,
    {
        let slot = self.slot()?;
        wait_settled(slot, self.task, None);
        read(slot, |output| output.downcast_ref::<T>().cloned())
    }

    /// Returns a copy of the output if the task has settled, else `NotReady`.
    pub fn try_join(&self) -> Result<T, RuntimeError>
    where
        T: Clone,
    {
        let slot = self.slot()?;
        if !slot.state().is_settled() {
            return Err(RuntimeError::NotReady);
        }
        read(slot, |output| output.downcast_ref::<T>().cloned())
    }

    /// Waits at most `timeout` for the output; `NotReady` when it runs out.
    pub fn join_with_timeout(&self, timeout: Duration) -> Result<T, RuntimeError>
    where
        T: Clone,
    {
        let slot = self.slot()?;
        if !wait_settled(slot, self.task, Some(Instant::now() + timeout)) {
            return Err(RuntimeError::NotReady);
        }
        read(slot, |output| output.downcast_ref::<T>().cloned())
    }

    /// Waits for the output and moves it out; other listeners then read `AlreadyTaken`.
    pub fn take(self) -> Result<T, RuntimeError> {
        let slot = self.slot()?;
        wait_settled(slot, self.task, None);
        take_output(slot)
    }

    /// Moves the output out if the task has settled, else `NotReady` (the handle stays usable).
    pub fn try_take(&self) -> Result<T, RuntimeError> {
        let slot = self.slot()?;
        if !slot.state().is_settled() {
            return Err(RuntimeError::NotReady);
        }
        take_output(slot)
    }

    /// Waits at most `timeout`, then moves the output out; `NotReady` when it runs out.
    pub fn take_with_timeout(&self, timeout: Duration) -> Result<T, RuntimeError> {
        let slot = self.slot()?;
        if !wait_settled(slot, self.task, Some(Instant::now() + timeout)) {
            return Err(RuntimeError::NotReady);
        }
        take_output(slot)
    }
}

impl<T: Send + 'static, W: Send + 'static> TaskHandle<T, Waiting<W>> {
    /// Gives a value to the waiting task: the newest value wins, a give during a run leaves one more run.
    /// A cancelled or finished task refuses it.
    pub fn give(&self, value: W) -> Result<(), RuntimeError> {
        executor::give(self.task, Box::new(value))
    }

    /// Whether the task is waiting for a give (idle, not running).
    pub fn is_waiting(&self) -> bool {
        self.slot().is_ok_and(|slot| {
            let body = slot.lock();
            !body.settled && !body.in_run && !body.job_out
        })
    }
}

fn read<T>(
    slot: &Slot,
    copy: impl FnOnce(&(dyn Any + Send)) -> Option<T>,
) -> Result<T, RuntimeError> {
    let body = slot.lock();
    match slot.state() {
        // A repeat between runs reads Ready; one that started its next run still shows the last output.
        TaskState::Ready | TaskState::Pending | TaskState::Running if body.output.is_some() => body
            .output
            .as_deref()
            .and_then(copy)
            .ok_or(RuntimeError::Finished),
        state => Err(ending(state, body.error.clone())),
    }
}

fn take_output<T: 'static>(slot: &Slot) -> Result<T, RuntimeError> {
    let mut body = slot.lock();
    match slot.state() {
        TaskState::Ready => {
            let Some(output) = body.output.take() else {
                return Err(RuntimeError::Finished);
            };
            match output.downcast::<T>() {
                Ok(value) => {
                    slot.set_state(TaskState::Taken);
                    Ok(*value)
                }
                Err(output) => {
                    body.output = Some(output);
                    Err(RuntimeError::Finished)
                }
            }
        }
        state => Err(ending(state, body.error.clone())),
    }
}

fn ending(state: TaskState, error: Option<RuntimeError>) -> RuntimeError {
    match state {
        TaskState::Taken => RuntimeError::AlreadyTaken,
        TaskState::Cancelled => RuntimeError::Cancelled,
        TaskState::TimedOut => RuntimeError::TimedOut,
        TaskState::Failed => error.unwrap_or(RuntimeError::TaskFailed),
        TaskState::Free => RuntimeError::NoSuchTask,
        TaskState::Pending | TaskState::Running => RuntimeError::NotReady,
        TaskState::Ready => RuntimeError::Finished,
    }
}

impl<T, G> Clone for TaskHandle<T, G> {
    fn clone(&self) -> Self {
        table().claim(self.task);
        TaskHandle {
            task: self.task,
            _marker: PhantomData,
        }
    }
}

impl<T, G> Drop for TaskHandle<T, G> {
    fn drop(&mut self) {
        if self.task != TaskRef::NONE {
            table().release(self.task);
        }
    }
}

impl<T, G> PartialEq for TaskHandle<T, G> {
    fn eq(&self, other: &Self) -> bool {
        self.task == other.task
    }
}

impl<T, G> Eq for TaskHandle<T, G> {}

impl<T, G> Hash for TaskHandle<T, G> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.task.hash(state);
    }
}

impl<T, G> std::fmt::Debug for TaskHandle<T, G> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = table().get(self.task).map_or(TaskState::Free, Slot::state);
        formatter
            .debug_struct("TaskHandle")
            .field("id", &self.task.index)
            .field("state", &state)
            .finish()
    }
}

/// A set of handles a task can `receive` from: a handle, tuples, arrays, `Vec`s, nested freely.
/// The receiving task runs once every member has published, with their outputs in the same shape.
pub trait HandleSet: Send + 'static {
    /// The outputs, shaped like the set.
    type Output: Send + 'static;
    #[doc(hidden)]
    fn members(&self, into: &mut Vec<TaskRef>);
    #[doc(hidden)]
    fn collect(&self) -> Result<Self::Output, RuntimeError>;
}

impl<T: Clone + Send + 'static, G: 'static> HandleSet for TaskHandle<T, G> {
    type Output = T;
    fn members(&self, into: &mut Vec<TaskRef>) {
        into.push(self.task);
    }
    fn collect(&self) -> Result<T, RuntimeError> {
        let slot = table().get(self.task).ok_or(RuntimeError::NoSuchTask)?;
        let body = slot.lock();
        body.output
            .as_deref()
            .and_then(|output| output.downcast_ref::<T>().cloned())
            .ok_or(RuntimeError::TaskFailed)
    }
}

impl<S: HandleSet> HandleSet for Vec<S> {
    type Output = Vec<S::Output>;
    fn members(&self, into: &mut Vec<TaskRef>) {
        self.iter().for_each(|set| set.members(into));
    }
    fn collect(&self) -> Result<Self::Output, RuntimeError> {
        self.iter().map(HandleSet::collect).collect()
    }
}

impl<S: HandleSet, const N: usize> HandleSet for [S; N] {
    type Output = Vec<S::Output>;
    fn members(&self, into: &mut Vec<TaskRef>) {
        self.iter().for_each(|set| set.members(into));
    }
    fn collect(&self) -> Result<Self::Output, RuntimeError> {
        self.iter().map(HandleSet::collect).collect()
    }
}

macro_rules! tuple_set {
    ($($name:ident $index:tt),+) => {
        impl<$($name: HandleSet),+> HandleSet for ($($name,)+) {
            type Output = ($($name::Output,)+);
            fn members(&self, into: &mut Vec<TaskRef>) {
                $(self.$index.members(into);)+
            }
            fn collect(&self) -> Result<Self::Output, RuntimeError> {
                Ok(($(self.$index.collect()?,)+))
            }
        }
    };
}

tuple_set!(A 0);
tuple_set!(A 0, B 1);
tuple_set!(A 0, B 1, C 2);
tuple_set!(A 0, B 1, C 2, D 3);
tuple_set!(A 0, B 1, C 2, D 3, E 4);
tuple_set!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple_set!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_set!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);

impl HandleSet for () {
    type Output = ();
    fn members(&self, _into: &mut Vec<TaskRef>) {}
    fn collect(&self) -> Result<(), RuntimeError> {
        Ok(())
    }
}

/// Erases a handle set for storage in a receiving task's plan.
pub(crate) struct SetBox<S: HandleSet>(pub(crate) S);

impl<S: HandleSet> ErasedSet for SetBox<S> {
    fn members(&self) -> Vec<TaskRef> {
        let mut members = Vec::new();
        self.0.members(&mut members);
        members
    }
    fn collect(&self) -> Result<Box<dyn Any + Send>, RuntimeError> {
        Ok(Box::new(self.0.collect()?))
    }
}

/// Whether a member already published (or failed) when a receiver registers with it.
pub(crate) fn register_dependant(member: TaskRef, receiver: TaskRef, index: usize) -> Registration {
    let Some(slot) = table().get(member) else {
        return Registration::Failed;
    };
    let mut body = slot.lock();
    let state = slot.state();
    if matches!(
        state,
        TaskState::Cancelled | TaskState::Failed | TaskState::TimedOut
    ) {
        return Registration::Failed;
    }
    let published = body.published;
    let settled = body.settled;
    if !settled {
        body.plan
            .get_or_insert_with(|| Box::new(crate::task::Plan::new()))
            .dependants
            .push((receiver, index));
    }
    let _ = Ordering::Relaxed;
    if published {
        Registration::Arrived
    } else if settled {
        Registration::Failed
    } else {
        Registration::Waiting
    }
}

pub(crate) enum Registration {
    Arrived,
    Waiting,
    Failed,
}
