//! The executor: how a slot's scheduling word moves, how a worker runs, parks and publishes a task, and
//! how cancels, timeouts, gives and gathers reach a task.
//!
//! ```text
//!   spawn ──> Scheduled ──pop──> Running ──Done──> publish (Ready / next run / settled)
//!                ^                  │  └─Park──> Idle ──wake(sequence)──> Scheduled
//!                └──── Notified <───┘ (a wake that lands while the step runs)
//! ```
//!
//! A wake carries the sequence of the run that parked, so a late timer or readiness event for an
//! earlier park does nothing. Every state change of the body happens under the slot lock; the
//! executor's own claim on a slot is dropped exactly once, by whoever settles the task while no thread
//! holds its job.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use crate::error::{RuntimeError, TaskState};
use crate::pool::{Pool, with_current_pool};
use crate::table::{
    ABORT_CANCEL, ABORT_FAIL, ABORT_NONE, ABORT_TIMEOUT, Body, SCHED_IDLE, SCHED_NOTIFIED,
    SCHED_RUNNING, SCHED_SCHEDULED, Slot, TaskRef, table,
};
use crate::task::{Job, Shape, Step, Wait, Waker};

/// Wakes `task` if it is still parked from the run with `sequence`; returns whether it was.
pub(crate) fn wake(task: TaskRef, sequence: u64) -> bool {
    let Some(slot) = table().get(task) else {
        return false;
    };
    loop {
        let sched = slot.sched.load(Ordering::Acquire);
        if sched >> 2 != sequence {
            return false;
        }
        let next = match sched & 3 {
            SCHED_IDLE => sequence << 2 | SCHED_SCHEDULED,
            SCHED_RUNNING => sequence << 2 | SCHED_NOTIFIED,
            _ => return true,
        };
        if slot
            .sched
            .compare_exchange(sched, next, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            if next & 3 == SCHED_SCHEDULED {
                enqueue(task, slot);
            }
            return true;
        }
    }
}

/// Wakes `task` whatever it waits for (a give, a cancel, a timer of the schedule).
pub(crate) fn nudge(task: TaskRef) {
    let Some(slot) = table().get(task) else {
        return;
    };
    let sequence = slot.sched.load(Ordering::Acquire) >> 2;
    wake(task, sequence);
}

/// Puts a scheduled task on the right queue of the current pool; without a pool it is written off.
pub(crate) fn enqueue(task: TaskRef, slot: &Slot) {
    let pushed = with_current_pool(|pool| match pool {
        Some(pool) => {
            pool.push(task, slot);
            true
        }
        None => false,
    });
    match pushed {
        true => {}
        false => {
            // No pool will ever run it: settle it so joiners do not hang.
            let mut body = slot.lock();
            settle_failed(&mut body, slot);
            release_settled(body, task, None);
        }
    }
}

/// Marks the body settled with a final state (first settle wins) and wakes every joiner.
pub(crate) fn settle(body: &mut Body, slot: &Slot, state: TaskState, error: Option<RuntimeError>) {
    if body.settled {
        return;
    }
    body.settled = true;
    if error.is_some() {
        body.error = error;
    }
    slot.set_state(state);
}

/// Settles the task Failed with `TaskFailed`: for a task nothing will ever run again (no pool to queue it
/// on, or no manager to fire its timer).
fn settle_failed(body: &mut Body, slot: &Slot) {
    settle(
        body,
        slot,
        TaskState::Failed,
        Some(RuntimeError::TaskFailed),
    );
}

/// The tasks that receive this task's outputs, each with this task's place in its gather, copied so that
/// they are reached after the lock is let go.
fn dependants_of(body: &Body) -> Vec<(TaskRef, usize)> {
    body.plan
        .as_ref()
        .map(|plan| plan.dependants.clone())
        .unwrap_or_default()
}

/// Whether the executor's claim should be dropped now (settled, and no thread holds the job).
pub(crate) fn release_if_idle(body: &mut Body) -> bool {
    if body.settled && !body.job_out && !body.executor_released {
        body.executor_released = true;
        true
    } else {
        false
    }
}

/// Ends the executor's part in a settled task: unlocks `body`, then drops the job (the one in hand and
/// any left in the slot) and frees the table slot if no thread holds the job any more. The job is
/// dropped after the unlock because dropping it runs user code (its captures) that may lock this slot
/// again, through a captured handle for example.
fn release_settled(mut body: MutexGuard<'_, Body>, task: TaskRef, in_hand: Option<Box<dyn Job>>) {
    let release = release_if_idle(&mut body);
    let left = body.job.take();
    drop(body);
    drop(in_hand);
    drop(left);
    if release {
        table().release(task);
    }
}

enum Prepared {
    Run(Box<dyn Job>),
    Nothing,
}

/// Runs one scheduled task on the current thread until it parks, publishes or settles.
pub(crate) fn run(pool: &Arc<Pool>, task: TaskRef) {
    let Some(slot) = table().get(task) else {
        return;
    };
    let sched = slot.sched.load(Ordering::Acquire);
    if sched & 3 != SCHED_SCHEDULED {
        return;
    }
    let sequence = (sched >> 2) + 1;
    if slot
        .sched
        .compare_exchange(
            sched,
            sequence << 2 | SCHED_RUNNING,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_err()
    {
        return;
    }
    let outcome = match prepare(pool, slot, task, sequence) {
        Prepared::Nothing => None,
        Prepared::Run(mut job) => {
            pool.note_running(task);
            let step = catch_unwind(AssertUnwindSafe(|| job.step()));
            pool.note_running(TaskRef::NONE);
            Some((job, step))
        }
    };
    let parked = match outcome {
        None => true,
        Some((job, Ok(Step::Park(wait)))) => park(pool, slot, task, sequence, job, wait),
        Some((job, Ok(Step::Done(result)))) => publish(pool, slot, task, job, result),
        Some((job, Err(_panic))) => {
            fail_run(slot, task, job, RuntimeError::TaskFailed);
            true
        }
    };
    let _ = parked;
    go_idle(slot, task, sequence);
}

/// Leaves the Running state; a wake that arrived during the step schedules the task again.
///
/// The word may also have moved on entirely: a task that settled can have had its slot released
/// (which bumps the sequence) and even reused before we get here. Only our own `(sequence, Running)`
/// or `(sequence, Notified)` is ours to change; anything else is left alone, or a recycled slot would
/// be marked Scheduled with nothing queued and never run.
fn go_idle(slot: &Slot, task: TaskRef, sequence: u64) {
    let running = sequence << 2 | SCHED_RUNNING;
    let notified = sequence << 2 | SCHED_NOTIFIED;
    if slot
        .sched
        .compare_exchange(
            running,
            sequence << 2 | SCHED_IDLE,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_ok()
    {
        return;
    }
    // Notified while running: queue it again (a fresh sequence is taken when it next runs).
    if slot
        .sched
        .compare_exchange(
            notified,
            sequence << 2 | SCHED_SCHEDULED,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_ok()
    {
        enqueue(task, slot);
    }
}

/// Under the lock: applies aborts, starts a new run when one is due, and takes the job out.
fn prepare(pool: &Arc<Pool>, slot: &Slot, task: TaskRef, sequence: u64) -> Prepared {
    let mut body = slot.lock();
    if body.settled || body.job.is_none() {
        release_settled(body, task, None);
        return Prepared::Nothing;
    }
    let abort = slot.abort.load(Ordering::Acquire);
    if abort != ABORT_NONE {
        let (state, error) = abort_state(abort);
        settle(&mut body, slot, state, error);
        release_settled(body, task, None);
        return Prepared::Nothing;
    }
    if !body.in_run {
        match start_run(pool, slot, &mut body, task, sequence) {
            Started::Yes => {}
            Started::Wait => return Prepared::Nothing,
            Started::Ended => {
                release_settled(body, task, None);
                return Prepared::Nothing;
            }
        }
    }
    let Some(job) = body.job.take() else {
        return Prepared::Nothing;
    };
    body.job_out = true;
    Prepared::Run(job)
}

enum Started {
    Yes,
    Wait,
    Ended,
}

/// Decides whether a run starts now; if so marks it started and hands the job its input.
fn start_run(
    pool: &Arc<Pool>,
    slot: &Slot,
    body: &mut Body,
    task: TaskRef,
    sequence: u64,
) -> Started {
    let runs = body.runs;
    // Reading the clock costs a vDSO call; plain one-shot tasks never need it.
    let now = if body.plan.is_some() {
        Instant::now()
    } else {
        pool.epoch()
    };
    let mut input: Box<dyn Any + Send> = Box::new(());
    let mut timeout = None;
    if let Some(plan) = body.plan.as_mut() {
        if plan.wired && plan.mailbox.is_none() {
            return Started::Wait;
        }
        // A start delay: once before the first run, or after every give on a wired task.
        if let Some(after) = plan.after
            && !plan.delay_done
            && (plan.wired || runs == 0)
        {
            plan.delay_done = true;
            if !pool.add_timer(now + after, task, sequence) {
                // No manager will end the delay: the task is written off (we hold its lock, so settle here).
                settle_failed(body, slot);
                return Started::Ended;
            }
            return Started::Wait;
        }
        plan.delay_done = false;
        // A bounded schedule: the count and deadline end it before a run that would start too late.
        let counted = if plan.wired { plan.arrivals } else { runs };
        let count_reached = match (plan.shape, plan.count) {
            (_, None) => false,
            (Shape::Repeat, Some(count)) => counted >= count.max(1),
            (_, Some(count)) => counted >= count,
        };
        // Judged on when the run fell due, not on when a worker got to it: a loaded machine that starts a
        // run late must not change how many runs there are (a 750 ms gap in a 1 s window runs twice).
        // Wired runs fall due when their value arrives, so they are judged on the clock.
        let due = match plan.due {
            Some(due) if !plan.wired => due,
            _ => now,
        };
        let past_deadline = runs > 0 && plan.deadline.is_some_and(|deadline| due >= deadline);
        if count_reached || past_deadline {
            if plan.outstanding > 0 {
                return Started::Wait;
            }
            let state = if body.published {
                TaskState::Ready
            } else {
                TaskState::Failed
            };
            let error = (!body.published).then_some(RuntimeError::TaskFailed);
            settle(body, slot, state, error);
            return Started::Ended;
        }
        if let Shape::Series(period) = plan.shape {
            // A series never runs the prototype: it starts a clone now and sets the next period's timer.
            let started = *plan.series_start.get_or_insert(now);
            plan.outstanding += 1;
            let timeout = plan.timeout;
            let next = started + period * (runs as u32 + 1);
            plan.due = Some(due + period);
            body.runs += 1;
            if body.runs == 1 {
                slot.set_state(TaskState::Running);
            }
            let clone = body.job.as_ref().and_then(|job| job.clone_job());
            if !pool.add_timer(next, task, sequence) {
                settle_failed(body, slot);
                return Started::Ended;
            }
            if let Some(clone) = clone {
                crate::runtime::spawn_child(
                    pool,
                    clone,
                    task,
                    timeout,
                    body.priority,
                    body.blocking,
                );
            }
            return Started::Wait;
        }
        if plan.wired {
            plan.arrivals += 1;
            if let Some(value) = plan.mailbox.take() {
                input = value;
            }
        }
        timeout = plan.timeout;
        plan.run_started = Some(now);
    }
    body.runs += 1;
    body.in_run = true;
    if let Some(job) = body.job.as_mut() {
        job.start(input);
    }
    slot.set_state(TaskState::Running);
    if let Some(timeout) = timeout {
        // Without a manager the limit cannot be enforced; the run goes ahead unlimited.
        let _ = pool.add_timeout(now + timeout, task, body.runs);
    }
    Started::Yes
}

fn abort_state(abort: u32) -> (TaskState, Option<RuntimeError>) {
    match abort {
        ABORT_CANCEL => (TaskState::Cancelled, None),
        ABORT_TIMEOUT => (TaskState::TimedOut, None),
        ABORT_FAIL => (TaskState::Failed, Some(RuntimeError::TaskFailed)),
        _ => (TaskState::Failed, Some(RuntimeError::TaskFailed)),
    }
}

/// Returns the job to its slot and registers the wait; returns true when it parked.
fn park(
    pool: &Arc<Pool>,
    slot: &Slot,
    task: TaskRef,
    sequence: u64,
    job: Box<dyn Job>,
    wait: Wait,
) -> bool {
    {
        let mut body = slot.lock();
        body.job_out = false;
        if body.settled {
            // Cancelled or timed out while stepping: drop the job, do not park.
            release_settled(body, task, Some(job));
            return false;
        }
        body.job = Some(job);
    }
    let waker = Waker::Task { task, sequence };
    if let Some(deadline) = wait.deadline
        && !pool.add_timer(deadline, task, sequence)
    {
        // No manager will ever fire the deadline: write the task off (no slot lock is held here).
        write_off(task);
        return false;
    }
    if let Some((source, direction)) = wait.source
        && !source.register(direction, waker.clone())
    {
        waker.wake();
    }
    if wait.deadline.is_none() && !pool.manager_alive() && !pool.closed() {
        // Without a manager nothing will deliver kernel events; poll instead.
        if !pool.add_timer(Instant::now() + crate::pool::READY_POLL, task, sequence) {
            write_off(task);
            return false;
        }
    }
    true
}

/// Stores the output of a finished run and decides what comes next.
fn publish(
    pool: &Arc<Pool>,
    slot: &Slot,
    task: TaskRef,
    job: Box<dyn Job>,
    result: Result<Box<dyn Any + Send>, RuntimeError>,
) -> bool {
    let output = match result {
        Ok(output) => output,
        Err(error) => {
            fail_run(slot, task, job, error);
            return false;
        }
    };
    let mut body = slot.lock();
    body.job_out = false;
    body.in_run = false;
    if body.settled {
        // Cancelled or timed out during the run: the output is discarded.
        release_settled(body, task, Some(job));
        return false;
    }
    let parent = body.plan.as_ref().and_then(|plan| plan.parent);
    if let Some(parent) = parent {
        // A series clone hands its output to the series and ends.
        settle(&mut body, slot, TaskState::Taken, None);
        release_settled(body, task, Some(job));
        publish_to_series(parent, Ok(output));
        return false;
    }
    body.output = Some(output);
    body.published = true;
    let now = if body.plan.is_some() {
        Instant::now()
    } else {
        pool.epoch()
    };
    let runs = body.runs;
    let mut next = Next::Settle;
    if let Some(plan) = body.plan.as_mut() {
        let counted = if plan.wired { plan.arrivals } else { runs };
        let count_left = match plan.count {
            None => true,
            Some(count) => counted < count,
        };
        // The next run falls due this run's length and the gap after this run fell due (see
        // `start_run`); the timer itself is set from now, so the gap between runs is kept in full.
        let next_due = match (plan.due, plan.run_started) {
            (Some(due), Some(started)) if !plan.wired => {
                due + now.saturating_duration_since(started) + plan.gap.unwrap_or_default()
            }
            _ => now + plan.gap.unwrap_or_default(),
        };
        plan.due = Some(next_due);
        let deadline_left = plan.deadline.is_none_or(|deadline| next_due < deadline);
        next = match plan.shape {
            _ if plan.wired => {
                if count_left {
                    if plan.mailbox.is_some() {
                        Next::Again
                    } else {
                        Next::Idle
                    }
                } else {
                    Next::Settle
                }
            }
            Shape::Repeat if count_left && deadline_left => match plan.gap {
                Some(gap) => Next::After(now + gap),
                None => Next::Again,
            },
            _ => Next::Settle,
        };
    }
    let dependants = dependants_of(&body);
    let mut release = false;
    let mut dropped = None;
    match next {
        Next::Settle => {
            settle(&mut body, slot, TaskState::Ready, None);
            release = release_if_idle(&mut body);
            dropped = Some(job);
        }
        Next::Again | Next::Idle | Next::After(_) => {
            slot.set_state(TaskState::Ready);
            body.job = Some(job);
        }
    }
    drop(body);
    drop(dropped);
    for (receiver, index) in dependants {
        arrival(receiver, index);
    }
    match next {
        Next::Again => {
            // Runs again at once: scheduled by the Notified path when this run goes idle.
            let sequence = slot.sched.load(Ordering::Acquire) >> 2;
            wake(task, sequence);
        }
        Next::After(at) => {
            let sequence = slot.sched.load(Ordering::Acquire) >> 2;
            if !pool.add_timer(at, task, sequence) {
                write_off(task);
            }
        }
        Next::Idle | Next::Settle => {}
    }
    if release {
        table().release(task);
    }
    false
}

enum Next {
    Settle,
    Again,
    Idle,
    After(Instant),
}

/// Ends a task whose run failed (panic or error) and writes off everything that depended on it.
fn fail_run(slot: &Slot, task: TaskRef, job: Box<dyn Job>, error: RuntimeError) {
    let mut body = slot.lock();
    body.job_out = false;
    body.in_run = false;
    let parent = body.plan.as_ref().and_then(|plan| plan.parent);
    settle(&mut body, slot, TaskState::Failed, Some(error.clone()));
    let release = release_if_idle(&mut body);
    let dependants = dependants_of(&body);
    drop(body);
    drop(job);
    if let Some(parent) = parent {
        publish_to_series(parent, Err(error));
    }
    for (receiver, _) in dependants {
        write_off(receiver);
    }
    if release {
        table().release(task);
    }
}

/// Settles a task Failed from outside (a failed source, a lost manager, a lost thread).
pub(crate) fn write_off(task: TaskRef) {
    abort(task, ABORT_FAIL);
}

/// Cancels `task`: settles it Cancelled unless it already settled; drops its job when no thread runs it.
pub(crate) fn cancel(task: TaskRef) {
    abort(task, ABORT_CANCEL);
}

fn abort(task: TaskRef, reason: u32) {
    let Some(slot) = table().get(task) else {
        return;
    };
    let mut body = slot.lock();
    if body.settled {
        return;
    }
    slot.abort.store(reason, Ordering::Release);
    let (state, error) = abort_state(reason);
    let parent = body.plan.as_ref().and_then(|plan| plan.parent);
    settle(&mut body, slot, state, error);
    let release = release_if_idle(&mut body);
    let job = body.job.take();
    let dependants = dependants_of(&body);
    let gather_members = body.plan.as_mut().and_then(|plan| plan.gather.take());
    drop(body);
    drop(job);
    drop(gather_members);
    if reason == ABORT_TIMEOUT
        && let Some(parent) = parent
    {
        abort(parent, ABORT_TIMEOUT);
    }
    for (receiver, _) in dependants {
        write_off(receiver);
    }
    if release {
        table().release(task);
    }
}

/// A run timeout fired: if run `stamp` is still going, the task settles TimedOut.
pub(crate) fn timeout(task: TaskRef, stamp: u64) {
    let Some(slot) = table().get(task) else {
        return;
    };
    {
        let body = slot.lock();
        if body.settled || !body.in_run || body.runs != stamp {
            return;
        }
    }
    abort(task, ABORT_TIMEOUT);
}

/// Gives `value` to a waiting task: the newest value wins; a give during a run leaves one more run.
pub(crate) fn give(task: TaskRef, value: Box<dyn Any + Send>) -> Result<(), RuntimeError> {
    let Some(slot) = table().get(task) else {
        return Err(RuntimeError::NoSuchTask);
    };
    let mut body = slot.lock();
    if body.settled {
        return Err(match slot.state() {
            TaskState::Cancelled => RuntimeError::Cancelled,
            TaskState::TimedOut => RuntimeError::TimedOut,
            TaskState::Failed => RuntimeError::TaskFailed,
            _ => RuntimeError::Finished,
        });
    }
    let Some(plan) = body.plan.as_mut() else {
        return Err(RuntimeError::BadArgument);
    };
    plan.mailbox = Some(value);
    let waiting = !body.in_run && !body.job_out;
    drop(body);
    if waiting {
        nudge(task);
    }
    Ok(())
}

/// A source of a gathering receive published: when every source has, collect and give.
pub(crate) fn arrival(receiver: TaskRef, index: usize) {
    let Some(slot) = table().get(receiver) else {
        return;
    };
    let collected = {
        let mut body = slot.lock();
        if body.settled {
            return;
        }
        let Some(gather) = body.plan.as_mut().and_then(|plan| plan.gather.as_mut()) else {
            return;
        };
        if let Some(arrived) = gather.arrived.get_mut(index) {
            *arrived = true;
        }
        if !gather.arrived.iter().all(|&arrived| arrived) {
            return;
        }
        gather
            .arrived
            .iter_mut()
            .for_each(|arrived| *arrived = false);
        // Collecting locks each source, so take the set out of the receiver's lock first.
        body.plan.as_mut().and_then(|plan| plan.gather.take())
    };
    let Some(gather) = collected else {
        return;
    };
    let value = gather.set.collect();
    {
        let mut body = slot.lock();
        if let Some(plan) = body.plan.as_mut()
            && plan.gather.is_none()
        {
            plan.gather = Some(gather);
        }
    }
    match value {
        Ok(value) => {
            let _ = give(receiver, value);
        }
        Err(_) => write_off(receiver),
    }
}

/// A series clone finished: its output becomes the series' latest; the series ends when all are in.
fn publish_to_series(parent: TaskRef, result: Result<Box<dyn Any + Send>, RuntimeError>) {
    let Some(slot) = table().get(parent) else {
        return;
    };
    let mut body = slot.lock();
    if let Some(plan) = body.plan.as_mut() {
        plan.outstanding = plan.outstanding.saturating_sub(1);
    }
    if body.settled {
        return;
    }
    match result {
        Ok(output) => {
            body.output = Some(output);
            body.published = true;
            slot.set_state(TaskState::Ready);
            let done = body.plan.as_ref().is_some_and(|plan| {
                plan.outstanding == 0
                    && (plan.count.is_some_and(|count| body.runs >= count)
                        || plan
                            .deadline
                            .zip(plan.due)
                            .is_some_and(|(deadline, due)| due >= deadline))
            });
            drop(body);
            if done {
                nudge(parent);
            }
        }
        Err(error) => {
            drop(body);
            let _ = error;
            write_off(parent);
        }
    }
}
