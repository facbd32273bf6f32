//! The process-wide runtime: init, builder, shutdown, status, pool snapshot, spawning, `block`,
//! `join_all`, `join_first` and the fault hooks.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::builder::{Options, TaskBuilder};
use crate::error::{JoinPolicy, RuntimeError, TaskState};
use crate::executor;
use crate::handle::{Registration, TaskHandle, register_dependant};
use crate::manager::{self, Reactor};
use crate::pool::{Config, Pool, global_pool, set_global, with_current_pool};
use crate::table::{SCHED_SCHEDULED, TaskRef, table};
use crate::task::{Forward, Gather, Job, JobOf, Plan, Shape, Step, Task, ThreadWake, Waker};

const STOPPED: u32 = 0;
const STARTING: u32 = 1;
const RUNNING: u32 = 2;
const STOPPING: u32 = 3;

static LIFECYCLE: AtomicU32 = AtomicU32::new(STOPPED);
static SUPERVISOR: Mutex<Option<std::thread::JoinHandle<()>>> = Mutex::new(None);
/// Set once any runtime has been shut down: later spawns read `TaskFailed` instead of `NotInitialised`.
static EVER_STOPPED: AtomicU32 = AtomicU32::new(0);

/// Poll period of shutdown's drain.
const SHUTDOWN_POLL: Duration = Duration::from_millis(1);
/// Backstop slice of `join_first`.
const SELECT_POLL: Duration = Duration::from_millis(50);

/// The runtime's entry points. There is no runtime object: the pool is process-wide.
#[derive(Debug)]
pub struct Runtime;

/// Sizes for [`Runtime::builder`].
#[derive(Debug, Clone)]
pub struct RuntimeBuilder {
    workers_per_core: usize,
    sleep_threads_per_core: usize,
    worker_stack: usize,
    cores: Option<usize>,
}

/// Health of the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    /// `init` ran and `shutdown` has not.
    pub initialised: bool,
    /// A shutdown has completed since the last `init`.
    pub shut_down: bool,
    /// The manager loop runs (or is being restarted).
    pub manager_alive: bool,
    /// At least one worker is alive.
    pub pool_alive: bool,
    /// Manager restarts so far.
    pub manager_restarts: u32,
}

impl Status {
    /// Initialised, manager and pool alive.
    pub fn healthy(&self) -> bool {
        self.initialised && self.manager_alive && self.pool_alive
    }
}

/// A snapshot of the pool, for tests and monitoring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStatus {
    /// Tasks in the table (not yet released).
    pub live: u64,
    /// Tasks queued for workers.
    pub queued: usize,
    /// Tasks queued for blocking threads.
    pub blocking_queued: usize,
    /// Per worker: (busy, backlog, completed).
    pub workers: Vec<(bool, usize, u64)>,
    /// Live workers.
    pub worker_count: usize,
    /// Live blocking threads.
    pub sleep_threads: usize,
    /// Blocking threads running a task.
    pub busy_sleep_threads: usize,
    /// Slots ever handed out (ids are reused before this grows).
    pub peak_slots: u64,
    /// Worker target (cores x workers per core).
    pub target: usize,
    /// Worker floor (one per core).
    pub floor: usize,
    /// Most threads the pool may start.
    pub ceiling: usize,
    /// Blocking-thread target.
    pub sleep_target: usize,
    /// Most workers at once.
    pub peak_workers: usize,
    /// Most blocking threads at once.
    pub peak_sleep_threads: usize,
    /// Pool threads that died.
    pub deaths: u64,
    /// Pool thread starts the system refused (each is retried later, with backoff).
    pub refused_starts: u64,
    /// Timers in the manager's heap (stale ones included until they pop).
    pub timers: usize,
}

impl PoolStatus {
    /// Workers running a task right now.
    pub fn busy_workers(&self) -> usize {
        self.workers.iter().filter(|worker| worker.0).count()
    }
}

impl std::fmt::Display for PoolStatus {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "live {} queued {} blocking-queued {} workers {} (busy {}, floor {}, target {}, peak {}) \
             sleep threads {} (busy {}, target {}, peak {}) slots {} deaths {} refused starts {} timers {}",
            self.live,
            self.queued,
            self.blocking_queued,
            self.worker_count,
            self.busy_workers(),
            self.floor,
            self.target,
            self.peak_workers,
            self.sleep_threads,
            self.busy_sleep_threads,
            self.sleep_target,
            self.peak_sleep_threads,
            self.peak_slots,
            self.deaths,
            self.refused_starts,
            self.timers
        )
    }
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        RuntimeBuilder {
            workers_per_core: 4,
            sleep_threads_per_core: 8,
            worker_stack: 8 << 20,
            cores: None,
        }
    }
}

impl RuntimeBuilder {
    /// Worker target per core (default 4); the floor is one per core.
    pub fn workers_per_core(mut self, count: usize) -> Self {
        self.workers_per_core = count;
        self
    }

    /// Blocking-thread target per core (default 8).
    pub fn sleep_threads_per_core(mut self, count: usize) -> Self {
        self.sleep_threads_per_core = count;
        self
    }

    /// Stack size of pool threads (default 8 MiB, at least 16 KiB).
    pub fn worker_stack(mut self, bytes: usize) -> Self {
        self.worker_stack = bytes;
        self
    }

    /// Pretends the machine has `cores` cores (the floor and targets scale with it).
    pub fn cores(mut self, cores: usize) -> Self {
        self.cores = Some(cores);
        self
    }

    /// Starts the runtime with these sizes; zero counts or a stack under 16 KiB are `BadArgument`.
    pub fn init(self) -> Result<(), RuntimeError> {
        if self.workers_per_core == 0
            || self.sleep_threads_per_core == 0
            || self.worker_stack < 16 << 10
            || self.cores == Some(0)
        {
            return Err(RuntimeError::BadArgument);
        }
        let cores = self.cores.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        });
        let config = Config {
            cores,
            workers_per_core: self.workers_per_core,
            sleep_threads_per_core: self.sleep_threads_per_core,
            worker_stack: self.worker_stack,
        };
        start(config)
    }
}

fn start(config: Config) -> Result<(), RuntimeError> {
    loop {
        match LIFECYCLE.compare_exchange(STOPPED, STARTING, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break,
            Err(RUNNING) => return Err(RuntimeError::AlreadyInit),
            Err(_) => std::thread::sleep(SHUTDOWN_POLL),
        }
    }
    let started = (|| {
        let reactor = Reactor::new()?;
        let pool = Pool::new(config, Arc::clone(&reactor));
        let supervisor = manager::start(Arc::downgrade(&pool), reactor)?;
        *SUPERVISOR.lock().unwrap_or_else(|p| p.into_inner()) = Some(supervisor);
        pool.ensure_floor();
        set_global(Some(pool));
        Ok::<(), std::io::Error>(())
    })();
    match started {
        Ok(()) => {
            LIFECYCLE.store(RUNNING, Ordering::Release);
            Ok(())
        }
        Err(error) => {
            LIFECYCLE.store(STOPPED, Ordering::Release);
            Err(error.into())
        }
    }
}

impl Runtime {
    /// Starts the pool (one worker per core to begin with), the manager and its supervisor.
    /// A second call while running is `AlreadyInit`; after `shutdown` it starts a new runtime.
    pub fn init() -> Result<(), RuntimeError> {
        RuntimeBuilder::default().init()
    }

    /// A builder for pool sizes.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// Starts building a spawn of `kind`.
    pub fn task<K: Task>(kind: K) -> TaskBuilder<K> {
        TaskBuilder::new(kind)
    }

    /// Runs `kind` to completion on the calling thread (no pool needed; parks on the thread's own futex).
    /// It cannot be cancelled. It works before `init` and after `shutdown`.
    pub fn block<K: Task<Input = ()>>(mut kind: K) -> Result<K::Output, RuntimeError> {
        kind.start(());
        let wake = Arc::new(ThreadWake::default());
        loop {
            match kind.step() {
                Step::Done(result) => return result,
                Step::Park(wait) => {
                    let manager = global_pool().is_some_and(|pool| pool.manager_alive());
                    let mut timeout = wait
                        .deadline
                        .map(|deadline| deadline.saturating_duration_since(Instant::now()));
                    if let Some((source, direction)) = wait.source {
                        if !source.register(direction, Waker::Thread(Arc::clone(&wake))) {
                            continue;
                        }
                        if !manager {
                            // Nothing delivers readiness without a manager: poll.
                            let poll = crate::pool::READY_POLL;
                            timeout = Some(timeout.map_or(poll, |timeout| timeout.min(poll)));
                        }
                    }
                    wake.sleep(timeout);
                }
            }
        }
    }

    /// A sleep on the calling thread: `Runtime::block(Sleep::sleep(duration))`.
    pub fn sleep(duration: Duration) -> Duration {
        Runtime::block(crate::kinds::sleep::Sleep::sleep(duration)).unwrap_or(duration)
    }

    /// Joins every handle in the order given.
    pub fn join_all<T: Clone + Send + 'static, G>(
        handles: impl IntoIterator<Item = TaskHandle<T, G>>,
    ) -> Vec<Result<T, RuntimeError>> {
        handles.into_iter().map(|handle| handle.join()).collect()
    }

    /// Waits for the first handle to settle and returns it; the losers are cancelled, passed back in
    /// order, or dropped, as `policy` says. An empty set gives a handle that reads `NoSuchTask`.
    pub fn join_first<T: Send + 'static, G>(
        handles: impl IntoIterator<Item = TaskHandle<T, G>>,
        policy: JoinPolicy,
    ) -> (TaskHandle<T, G>, Vec<TaskHandle<T, G>>) {
        let mut handles: Vec<TaskHandle<T, G>> = handles.into_iter().collect();
        if handles.is_empty() {
            return (TaskHandle::from_ref(TaskRef::NONE), Vec::new());
        }
        let mut slice = Duration::from_micros(50);
        let winner = loop {
            if let Some(position) = handles.iter().position(TaskHandle::is_settled) {
                break position;
            }
            // Sleep on the first handle's word in growing slices: any settle is seen within one slice.
            let first = &handles[0];
            let _ = first.join_deadline_hint(slice);
            slice = (slice * 2).min(Duration::from_millis(2)).min(SELECT_POLL);
        };
        let winner = handles.remove(winner);
        let losers = match policy {
            JoinPolicy::PassBack => handles,
            JoinPolicy::Cancel => {
                handles.iter().for_each(TaskHandle::cancel);
                Vec::new()
            }
            JoinPolicy::Drop => Vec::new(),
        };
        (winner, losers)
    }

    /// Drains and stops the runtime: queued and running work finishes first, then the manager stops,
    /// work parked on it (sleeps, delays, gaps, sockets, watches) is written off as `TaskFailed`, the
    /// pool threads stop, and later spawns read `TaskFailed`. Idempotent; `init` starts a new runtime
    /// afterwards and old handles keep their values. A task that never stops queueing itself (an
    /// unbounded `repeat()` without a gap) keeps the drain waiting: cancel it first. Never call it from
    /// a task.
    pub fn shutdown() {
        loop {
            match LIFECYCLE.compare_exchange(RUNNING, STOPPING, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(STOPPED) => return,
                Err(_) => std::thread::sleep(SHUTDOWN_POLL),
            }
        }
        EVER_STOPPED.store(1, Ordering::Release);
        let Some(pool) = global_pool() else {
            LIFECYCLE.store(STOPPED, Ordering::Release);
            return;
        };
        // Drain: queued and running work finishes; parked work (timers, sockets) is written off below.
        loop {
            let running = pool.worker_snapshot().iter().any(|worker| worker.0)
                || pool.busy_sleepers.load(Ordering::Acquire) > 0;
            if pool.queued() == 0 && pool.blocking_queued() == 0 && !running {
                break;
            }
            std::thread::sleep(SHUTDOWN_POLL);
        }
        pool.close();
        set_global(None);
        pool.reactor.stop();
        if let Some(supervisor) = SUPERVISOR.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = supervisor.join();
        }
        pool.reactor.finish_stop();
        pool.stop_threads();
        while pool.live_workers.load(Ordering::Acquire) > 0
            || pool.live_sleepers.load(Ordering::Acquire) > 0
        {
            std::thread::sleep(SHUTDOWN_POLL);
        }
        for task in pool.drain_queues() {
            executor::write_off(task);
        }
        manager::write_off_unsettled();
        LIFECYCLE.store(STOPPED, Ordering::Release);
    }

    /// A health snapshot.
    pub fn status() -> Status {
        let pool = global_pool();
        Status {
            initialised: LIFECYCLE.load(Ordering::Acquire) == RUNNING,
            shut_down: LIFECYCLE.load(Ordering::Acquire) == STOPPED
                && EVER_STOPPED.load(Ordering::Acquire) == 1,
            manager_alive: pool.as_ref().is_some_and(|pool| pool.manager_alive()),
            pool_alive: pool
                .as_ref()
                .is_some_and(|pool| pool.live_workers.load(Ordering::Acquire) > 0),
            manager_restarts: pool
                .as_ref()
                .map_or(0, |pool| pool.reactor.restarts.load(Ordering::Acquire)),
        }
    }

    /// Whether the runtime is initialised with a live manager and pool.
    pub fn healthy() -> bool {
        Runtime::status().healthy()
    }

    /// Whether `init` ran and `shutdown` has not.
    pub fn initialised() -> bool {
        LIFECYCLE.load(Ordering::Acquire) == RUNNING
    }

    /// A snapshot of the pool and the task table.
    pub fn pool() -> PoolStatus {
        let table = table();
        let pool = global_pool();
        let workers = pool
            .as_ref()
            .map(|pool| pool.worker_snapshot())
            .unwrap_or_default();
        PoolStatus {
            live: table.live(),
            queued: pool.as_ref().map_or(0, |pool| pool.queued()),
            blocking_queued: pool.as_ref().map_or(0, |pool| pool.blocking_queued()),
            worker_count: workers.len(),
            workers,
            sleep_threads: pool
                .as_ref()
                .map_or(0, |pool| pool.live_sleepers.load(Ordering::Acquire)),
            busy_sleep_threads: pool
                .as_ref()
                .map_or(0, |pool| pool.busy_sleepers.load(Ordering::Acquire)),
            peak_slots: table.peak_slots(),
            target: pool.as_ref().map_or(0, |pool| pool.config.target()),
            floor: pool.as_ref().map_or(0, |pool| pool.config.floor()),
            ceiling: pool.as_ref().map_or(0, |pool| pool.config.ceiling()),
            sleep_target: pool.as_ref().map_or(0, |pool| pool.config.sleep_target()),
            peak_workers: pool
                .as_ref()
                .map_or(0, |pool| pool.counters.peak_workers.load(Ordering::Acquire)),
            peak_sleep_threads: pool.as_ref().map_or(0, |pool| {
                pool.counters.peak_sleepers.load(Ordering::Acquire)
            }),
            deaths: pool
                .as_ref()
                .map_or(0, |pool| pool.counters.deaths.load(Ordering::Acquire)),
            refused_starts: pool.as_ref().map_or(0, |pool| {
                pool.counters.refused_starts.load(Ordering::Acquire)
            }),
            timers: pool.as_ref().map_or(0, |pool| pool.reactor.timer_count()),
        }
    }
}

impl<T: Send + 'static, G> TaskHandle<T, G> {
    /// Sleeps up to `slice` on this task's word (used by `join_first` between checks).
    fn join_deadline_hint(&self, slice: Duration) -> bool {
        match table().get(self.task) {
            Some(slot) => crate::pool::wait_settled(slot, self.task, Some(Instant::now() + slice)),
            None => true,
        }
    }
}

/// Spawns a built task: allocates a slot, stores the job and plan, and schedules it.
pub(crate) fn spawn_built<K: Task, G>(
    kind: K,
    options: Options,
    forwards: Vec<Forward<K::Output>>,
    cloner: Option<fn(&K) -> K>,
    wired: bool,
) -> TaskHandle<K::Output, G> {
    let blocking = kind.blocking();
    let job: Box<dyn Job> = Box::new(JobOf {
        kind,
        forwards,
        cloner,
    });
    let Ok(task) = table().allocate(2) else {
        return TaskHandle::from_ref(TaskRef::NONE);
    };
    let handle = TaskHandle::from_ref(task);
    let Some(slot) = table().get(task) else {
        return handle;
    };
    slot.class.store(
        u32::from(options.priority) | if blocking { 0x100 } else { 0 },
        Ordering::Relaxed,
    );
    if !with_current_pool(|pool| pool.is_some()) {
        let error = if EVER_STOPPED.load(Ordering::Acquire) == 1 {
            RuntimeError::TaskFailed
        } else {
            RuntimeError::NotInitialised
        };
        let mut body = slot.lock();
        body.job = None;
        executor::settle(&mut body, slot, TaskState::Failed, Some(error));
        body.executor_released = true;
        drop(body);
        table().release(task);
        return handle;
    }
    let needs_plan = wired
        || options.repeat
        || options.series.is_some()
        || options.after.is_some()
        || options.timeout.is_some()
        || options.count.is_some();
    let mut gather_members = Vec::new();
    {
        let mut body = slot.lock();
        body.job = Some(job);
        body.priority = options.priority;
        body.blocking = blocking;
        if needs_plan {
            let now = Instant::now();
            let mut plan = Plan::new();
            plan.shape = match (options.repeat, options.series) {
                (_, Some(period)) => Shape::Series(period),
                (true, None) => Shape::Repeat,
                (false, None) => Shape::Once,
            };
            plan.gap = options.gap;
            plan.count = options.count;
            plan.deadline = match (options.for_duration, options.until) {
                (Some(duration), Some(until)) => Some((now + duration).min(until)),
                (Some(duration), None) => Some(now + duration),
                (None, until) => until,
            };
            plan.after = options.after;
            plan.due = Some(now + options.after.unwrap_or_default());
            plan.timeout = options.timeout;
            plan.wired = wired;
            if let Some(set) = options.gather {
                gather_members = set.members();
                plan.gather = Some(Gather {
                    set,
                    arrived: vec![false; gather_members.len()],
                });
            }
            body.plan = Some(Box::new(plan));
        }
    }
    if wired && !gather_members.is_empty() {
        for (index, member) in gather_members.iter().enumerate() {
            match register_dependant(*member, task, index) {
                Registration::Arrived => executor::arrival(task, index),
                Registration::Waiting => {}
                Registration::Failed => {
                    executor::write_off(task);
                    return handle;
                }
            }
        }
        return handle;
    }
    if wired && gather_members.is_empty() {
        // An empty gather set runs once at once. Collect outside the slot lock: give takes it again.
        let value = slot
            .lock()
            .plan
            .as_ref()
            .and_then(|plan| plan.gather.as_ref())
            .map(|gather| gather.set.collect());
        match value {
            Some(Ok(value)) => {
                let _ = executor::give(task, value);
            }
            Some(Err(_)) => executor::write_off(task),
            None => {}
        }
        return handle;
    }
    let sequence = slot.sched.load(Ordering::Acquire) >> 2;
    slot.sched
        .store(sequence << 2 | SCHED_SCHEDULED, Ordering::Release);
    executor::enqueue(task, slot);
    handle
}

/// Spawns one clone of a series: it publishes into the series and then ends.
pub(crate) fn spawn_child(
    pool: &Arc<Pool>,
    job: Box<dyn Job>,
    parent: TaskRef,
    timeout: Option<Duration>,
    priority: u8,
    blocking: bool,
) {
    let Ok(task) = table().allocate(1) else {
        return;
    };
    let Some(slot) = table().get(task) else {
        return;
    };
    slot.class.store(
        u32::from(priority) | if blocking { 0x100 } else { 0 },
        Ordering::Relaxed,
    );
    {
        let mut body = slot.lock();
        body.job = Some(job);
        body.priority = priority;
        body.blocking = blocking;
        let mut plan = Plan::new();
        plan.parent = Some(parent);
        plan.timeout = timeout;
        body.plan = Some(Box::new(plan));
    }
    let sequence = slot.sched.load(Ordering::Acquire) >> 2;
    slot.sched
        .store(sequence << 2 | SCHED_SCHEDULED, Ordering::Release);
    pool.push(task, slot);
}

/// Test hooks, compiled only with the `fault-injection` feature.
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod faults {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use crate::pool::global_pool;

    /// Makes the manager loop panic on its next `count` iterations (and wakes it so it notices).
    pub fn panic_manager(count: u32) {
        if let Some(pool) = global_pool() {
            pool.reactor
                .faults_pending
                .fetch_add(count, Ordering::AcqRel);
            pool.reactor.wake_manager();
        }
    }

    /// Makes `count` pool workers die (unwind out of their loop) the next time they look for work.
    pub fn kill_workers(count: u32) {
        if let Some(pool) = global_pool() {
            pool.kill_threads.fetch_add(count, Ordering::AcqRel);
            pool.stop_threads_wake();
        }
    }

    /// Makes the next `count` pool thread starts (workers and blocking threads, of this runtime or of
    /// one `init` starts later) fail as if the system had refused to create the thread.
    pub fn refuse_thread_starts(count: u32) {
        crate::pool::REFUSE_THREAD_STARTS.fetch_add(count, Ordering::AcqRel);
    }

    /// Stops refusing thread starts; returns how many refusals were still pending.
    pub fn stop_refusing_thread_starts() -> u32 {
        crate::pool::REFUSE_THREAD_STARTS.swap(0, Ordering::AcqRel)
    }

    /// How many pool thread starts were tried so far in this process, refused or not.
    pub fn thread_start_attempts() -> u64 {
        crate::pool::THREAD_START_ATTEMPTS.load(Ordering::Acquire)
    }

    /// Makes the next pairing of the two clock readings behind every timer (done once per process, at
    /// its first timer) pause `pause` between the readings, as a preemption there would.
    pub fn pause_clock_calibration(pause: Duration) {
        CALIBRATION_PAUSE.store(pause.as_nanos() as u64, Ordering::Release);
    }

    /// Makes the manager loop sleep `stall` on its next iteration (and wakes it so it notices), as a
    /// manager thread kept off the CPU would: every timer due meanwhile fires late.
    pub fn stall_manager(stall: Duration) {
        if let Some(pool) = global_pool() {
            pool.reactor
                .stall_nanos
                .store(stall.as_nanos() as u64, Ordering::Release);
            pool.reactor.wake_manager();
        }
    }

    static CALIBRATION_PAUSE: AtomicU64 = AtomicU64::new(0);

    /// Called between the clock readings of a calibration: sleeps a pause set by
    /// [`pause_clock_calibration`], once.
    pub(crate) fn pause_in_calibration() {
        let pause = CALIBRATION_PAUSE.swap(0, Ordering::AcqRel);
        if pause > 0 {
            std::thread::sleep(Duration::from_nanos(pause));
        }
    }

    /// Lowers the help depth (the nesting limit for helping waits).
    pub fn set_help_depth(depth: usize) {
        if let Some(pool) = global_pool() {
            pool.help_depth.store(depth, Ordering::Release);
        }
    }
}
