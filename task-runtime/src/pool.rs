//! The thread pool: the priority injector, per-worker queues, workers, blocking threads, parking, growth,
//! reaping, helping waits, recovery from a dying thread and backoff after a refused thread start.
//!
//! ```text
//!   spawn (outside) ──> injector [band 3][band 2][band 1][band 0] ──┐
//!   spawn (worker)  ──> that worker's local deque ──────────────────┤──> worker: local (LIFO),
//!                                                                   │    injector by band, steal
//!   blocking tasks  ──> blocking queue ──> blocking ("sleep") threads
//! ```
//!
//! Workers park through [`Parking`] (see `park.rs`): a push costs a fence and a load while no worker is
//! parked, and at most one wake system call is in flight; the woken worker passes the wake on.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use net_io_sys::futex;

use crate::error::TaskState;
use crate::executor;
use crate::manager::Reactor;
use crate::park::{Parking, Wake};
use crate::table::{Slot, TaskRef, table};

/// Idle time before a parked thread above the floor stops.
pub(crate) const IDLE_REAP: Duration = Duration::from_millis(500);
/// Idle time before a thread above the target stops.
pub(crate) const IDLE_REAP_OVER: Duration = Duration::from_millis(50);
/// Nesting limit for helping waits.
pub(crate) const HELP_DEPTH: usize = 64;
/// Longest sleep slice of a helping waiter.
pub(crate) const HELP_POLL: Duration = Duration::from_millis(10);
/// How often a parked socket wait re-checks when no manager can deliver events.
pub(crate) const READY_POLL: Duration = Duration::from_millis(10);
/// Priority bands: band = priority >> 6.
const BANDS: usize = 4;
/// A ready task older than this many spawns moves up a band.
const STARVE_AGE: u64 = 1_000_000;
/// Oldest-first pops after an ageing promotion.
const STARVE_RELIEF: u32 = 64;
/// Local takes in a row before the injector gets a turn.
const LIFO_STREAK: u32 = 3;
/// How long a worker that ran out of work keeps looking before it parks (yielding in between).
const SPIN_BEFORE_PARK: Duration = Duration::from_micros(50);
/// Checks of the state word a joiner off the pool makes before it sleeps (a few microseconds).
const SPIN_BEFORE_SLEEP: u32 = 2000;
/// Most tasks a worker moves from the injector to its own deque at once.
const REFILL: usize = 32;
/// Wait before the first retry after the system refused a pool thread.
const START_BACKOFF_FIRST: Duration = Duration::from_millis(10);
/// Longest wait between retries while the system keeps refusing pool threads.
const START_BACKOFF_LONGEST: Duration = Duration::from_secs(1);

/// Sizes chosen at `init`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Config {
    pub(crate) cores: usize,
    pub(crate) workers_per_core: usize,
    pub(crate) sleep_threads_per_core: usize,
    pub(crate) worker_stack: usize,
}

impl Config {
    pub(crate) fn floor(&self) -> usize {
        self.cores
    }
    pub(crate) fn target(&self) -> usize {
        self.cores * self.workers_per_core
    }
    pub(crate) fn sleep_target(&self) -> usize {
        self.cores * self.sleep_threads_per_core
    }
    pub(crate) fn ceiling(&self) -> usize {
        thread_ceiling()
    }
}

#[derive(Clone, Copy)]
struct Entry {
    task: TaskRef,
    age: u64,
}

#[derive(Default)]
struct Bands {
    bands: [VecDeque<Entry>; BANDS],
    relief: u32,
}

impl Bands {
    fn push(&mut self, priority: u8, entry: Entry) {
        self.bands[usize::from(priority >> 6)].push_back(entry);
    }

    fn pop(&mut self, spawned: u64) -> Option<Entry> {
        if self.relief > 0 {
            self.relief -= 1;
            return self.pop_oldest();
        }
        // Ageing: the oldest waiting task of any band moves up once it is STARVE_AGE spawns old.
        let oldest = (0..BANDS)
            .filter_map(|band| self.bands[band].front().map(|entry| (band, entry.age)))
            .min_by_key(|&(_, age)| age);
        if let Some((band, age)) = oldest
            && spawned.saturating_sub(age) > STARVE_AGE
            && band + 1 < BANDS
            && let Some(entry) = self.bands[band].pop_front()
        {
            // It keeps its age, so the oldest-first relief pops that follow serve it at once.
            self.bands[band + 1].push_front(entry);
            self.relief = STARVE_RELIEF - 1;
            return self.pop_oldest();
        }
        (0..BANDS)
            .rev()
            .find_map(|band| self.bands[band].pop_front())
    }

    fn pop_oldest(&mut self) -> Option<Entry> {
        let band = (0..BANDS)
            .filter_map(|band| self.bands[band].front().map(|entry| (band, entry.age)))
            .min_by_key(|&(_, age)| age)?
            .0;
        self.bands[band].pop_front()
    }

    fn len(&self) -> usize {
        self.bands.iter().map(VecDeque::len).sum()
    }

    fn drain(&mut self) -> Vec<TaskRef> {
        self.bands
            .iter_mut()
            .flat_map(|band| band.drain(..))
            .map(|entry| entry.task)
            .collect()
    }
}

/// When the pool may next try to start a thread after the system refused one: a bounded exponential
/// backoff (10 ms doubling to 1 s), cleared by the next start that succeeds.
///
/// A refusal (`EAGAIN` from `clone`: threads-max, RLIMIT_NPROC, the cgroup's pids.max, or memory) is a
/// state of the whole system, so one backoff covers workers and blocking threads alike; retrying every
/// 10 ms tick would only add load to a machine that is already short of threads. It takes the times as
/// arguments so its policy is tested without a clock.
#[derive(Debug, Default)]
struct StartBackoff {
    /// The wait after the last refusal; zero while starts succeed.
    delay: Duration,
    /// No start is tried before this instant; `None` while starts succeed.
    not_before: Option<Instant>,
}

impl StartBackoff {
    /// Whether a start may be tried at `now`.
    fn may_try(&self, now: Instant) -> bool {
        self.not_before.is_none_or(|not_before| now >= not_before)
    }

    /// A start was refused at `now`: wait twice as long as last time (at least the first delay, at most
    /// the longest) before the next try.
    fn refused(&mut self, now: Instant) {
        self.delay = (self.delay * 2).clamp(START_BACKOFF_FIRST, START_BACKOFF_LONGEST);
        self.not_before = Some(now + self.delay);
    }

    /// A start succeeded: the next refusal starts again from the first delay.
    fn started(&mut self) {
        *self = StartBackoff::default();
    }
}

/// One worker's shared record.
pub(crate) struct WorkerSlot {
    local: Mutex<VecDeque<TaskRef>>,
    local_len: AtomicUsize,
    /// The task being stepped (packed index << 32 | generation), `u64::MAX` for none.
    running: AtomicU64,
    pub(crate) busy: AtomicBool,
    pub(crate) completed: AtomicU64,
    stop: AtomicBool,
    last_completed: AtomicU64,
    stuck_ticks: AtomicU32,
}

impl WorkerSlot {
    /// Takes one task out of the local deque with `take`, keeping `local_len` and the pool-wide `total`
    /// in step; an empty deque is seen without taking the lock.
    fn take_local(
        &self,
        total: &AtomicUsize,
        take: impl FnOnce(&mut VecDeque<TaskRef>) -> Option<TaskRef>,
    ) -> Option<TaskRef> {
        if self.local_len.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut local = self.local.lock().unwrap_or_else(|p| p.into_inner());
        let task = take(&mut local);
        self.local_len.store(local.len(), Ordering::Release);
        if task.is_some() {
            total.fetch_sub(1, Ordering::AcqRel);
        }
        task
    }

    /// The owner's pop: the newest task.
    fn pop_back(&self, total: &AtomicUsize) -> Option<TaskRef> {
        self.take_local(total, VecDeque::pop_back)
    }

    /// A thief's pop: the oldest task.
    fn steal_front(&self, total: &AtomicUsize) -> Option<TaskRef> {
        self.take_local(total, VecDeque::pop_front)
    }

    /// Takes `wanted` out of the newest end of the deque if it is among the last few entries.
    fn take_specific(&self, wanted: TaskRef, total: &AtomicUsize) -> Option<TaskRef> {
        self.take_local(total, |local| {
            let length = local.len();
            let position = (length.saturating_sub(8)..length)
                .rev()
                .find(|&position| local[position] == wanted)?;
            local.remove(position)
        })
    }
}

/// One blocking thread's shared record.
struct SleeperSlot {
    stop: AtomicBool,
}

/// Counters that feed `Runtime::pool()`.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) peak_workers: AtomicUsize,
    pub(crate) peak_sleepers: AtomicUsize,
    pub(crate) deaths: AtomicU64,
    /// Pool thread starts the system refused.
    pub(crate) refused_starts: AtomicU64,
}

/// A running pool. Dropped once shutdown has stopped every thread.
pub(crate) struct Pool {
    pub(crate) config: Config,
    closed: AtomicBool,
    injector: Mutex<Bands>,
    injected: AtomicUsize,
    blocking: Mutex<VecDeque<TaskRef>>,
    blocking_queued: AtomicUsize,
    /// Where idle workers park and how pushes wake them.
    parking: Parking,
    blocking_word: AtomicU32,
    parked_sleepers: AtomicU32,
    workers: Mutex<Vec<Arc<WorkerSlot>>>,
    pub(crate) live_workers: AtomicUsize,
    sleepers: Mutex<Vec<Arc<SleeperSlot>>>,
    pub(crate) live_sleepers: AtomicUsize,
    pub(crate) busy_sleepers: AtomicUsize,
    waiting_workers: AtomicUsize,
    /// Tasks in all workers' local deques together, so idle checks need no lock.
    local_queued: AtomicUsize,
    pub(crate) counters: Counters,
    pub(crate) reactor: Arc<Reactor>,
    /// Fault hook: pool threads that should die on their next loop.
    pub(crate) kill_threads: AtomicU32,
    /// Fault hook: the help depth in use.
    pub(crate) help_depth: AtomicUsize,
    /// Backoff after a refused thread start; `start_thread` checks it before every try.
    start_backoff: Mutex<StartBackoff>,
    created: Instant,
}

struct Context {
    pool: Arc<Pool>,
    worker: Option<Arc<WorkerSlot>>,
    depth: usize,
}

thread_local! {
    static CONTEXT: RefCell<Option<Context>> = const { RefCell::new(None) };
}

static GLOBAL: RwLock<Option<Arc<Pool>>> = RwLock::new(None);
/// Bumped whenever GLOBAL changes, so threads outside the pool can cache it (see `current_pool`).
static GLOBAL_EPOCH: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static CACHED: RefCell<(u64, Option<Arc<Pool>>)> = const { RefCell::new((0, None)) };
}

/// The pool of the calling pool thread, or the running global pool.
pub(crate) fn current_pool() -> Option<Arc<Pool>> {
    let local = CONTEXT.with(|context| {
        context
            .borrow()
            .as_ref()
            .filter(|context| !context.pool.closed())
            .map(|context| Arc::clone(&context.pool))
    });
    if local.is_some() {
        return local;
    }
    // Outside the pool: reuse this thread's copy unless the global pool changed since it was taken,
    // so a spawning thread does not take the global lock on every spawn.
    let epoch = GLOBAL_EPOCH.load(Ordering::Acquire);
    CACHED.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != epoch {
            *cached = (
                epoch,
                GLOBAL.read().unwrap_or_else(|p| p.into_inner()).clone(),
            );
        }
        cached.1.clone()
    })
}

/// Calls `visit` with the current pool (as [`current_pool`] finds it) without cloning the `Arc`, so the
/// hot spawn and wake paths do not bounce the pool's reference count between cores.
pub(crate) fn with_current_pool<R>(visit: impl FnOnce(Option<&Arc<Pool>>) -> R) -> R {
    let mut visit = Some(visit);
    let on_pool = CONTEXT.with(|context| {
        let context = context.borrow();
        let context = context.as_ref().filter(|context| !context.pool.closed())?;
        let visit = visit.take()?;
        Some(visit(Some(&context.pool)))
    });
    if let Some(result) = on_pool {
        return result;
    }
    // Off the pool the thread's cached copy is cloned; only this thread touches that count.
    let pool = current_pool();
    match visit.take() {
        Some(visit) => visit(pool.as_ref()),
        None => unreachable!("the visitor runs exactly once"),
    }
}

/// The running global pool, if any (not the one a stopping pool thread belongs to).
pub(crate) fn global_pool() -> Option<Arc<Pool>> {
    GLOBAL.read().unwrap_or_else(|p| p.into_inner()).clone()
}

pub(crate) fn set_global(pool: Option<Arc<Pool>>) {
    *GLOBAL.write().unwrap_or_else(|p| p.into_inner()) = pool;
    GLOBAL_EPOCH.fetch_add(1, Ordering::AcqRel);
}

impl Pool {
    pub(crate) fn new(config: Config, reactor: Arc<Reactor>) -> Arc<Self> {
        Arc::new(Pool {
            config,
            closed: AtomicBool::new(false),
            injector: Mutex::new(Bands::default()),
            injected: AtomicUsize::new(0),
            blocking: Mutex::new(VecDeque::new()),
            blocking_queued: AtomicUsize::new(0),
            parking: Parking::new(),
            blocking_word: AtomicU32::new(0),
            parked_sleepers: AtomicU32::new(0),
            workers: Mutex::new(Vec::new()),
            live_workers: AtomicUsize::new(0),
            sleepers: Mutex::new(Vec::new()),
            live_sleepers: AtomicUsize::new(0),
            busy_sleepers: AtomicUsize::new(0),
            waiting_workers: AtomicUsize::new(0),
            local_queued: AtomicUsize::new(0),
            counters: Counters::default(),
            reactor,
            kill_threads: AtomicU32::new(0),
            help_depth: AtomicUsize::new(HELP_DEPTH),
            start_backoff: Mutex::new(StartBackoff::default()),
            created: Instant::now(),
        })
    }

    /// A fixed instant for code paths that need an `Instant` value but not the current time.
    pub(crate) fn epoch(&self) -> Instant {
        self.created
    }

    pub(crate) fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    pub(crate) fn manager_alive(&self) -> bool {
        self.reactor.alive()
    }

    /// Queues a scheduled task: blocking tasks to the blocking threads, others to a worker.
    pub(crate) fn push(self: &Arc<Self>, task: TaskRef, slot: &Slot) {
        let class = slot.class.load(Ordering::Relaxed);
        if class & 0x100 != 0 {
            self.push_blocking(task);
            return;
        }
        let pushed_locally = CONTEXT.with(|context| {
            let context = context.borrow();
            let Some(context) = context.as_ref() else {
                return false;
            };
            let Some(worker) = context.worker.as_ref() else {
                return false;
            };
            if !Arc::ptr_eq(&context.pool, self) || worker.stop.load(Ordering::Relaxed) {
                return false;
            }
            let mut local = worker.local.lock().unwrap_or_else(|p| p.into_inner());
            local.push_back(task);
            worker.local_len.store(local.len(), Ordering::Release);
            self.local_queued.fetch_add(1, Ordering::AcqRel);
            true
        });
        if !pushed_locally {
            self.inject(task, class as u8);
        }
        self.notify_worker();
    }

    /// Queues `task` on the shared injector in the band of `priority`, aged from now.
    fn inject(&self, task: TaskRef, priority: u8) {
        let mut injector = self.injector.lock().unwrap_or_else(|p| p.into_inner());
        injector.push(
            priority,
            Entry {
                task,
                age: table().spawned(),
            },
        );
        self.injected.store(injector.len(), Ordering::Release);
    }

    /// Tells parked workers that a task was queued (see [`Parking::notify`]); the woken worker wakes the
    /// next one if work remains (the chain wake in `worker_main`).
    fn notify_worker(&self) {
        self.parking.notify();
    }

    fn push_blocking(self: &Arc<Self>, task: TaskRef) {
        {
            let mut queue = self.blocking.lock().unwrap_or_else(|p| p.into_inner());
            queue.push_back(task);
            self.blocking_queued.store(queue.len(), Ordering::Release);
        }
        self.blocking_word.fetch_add(1, Ordering::SeqCst);
        if self.parked_sleepers.load(Ordering::SeqCst) > 0 {
            futex::wake(&self.blocking_word, 1);
            return;
        }
        let live = self.live_sleepers.load(Ordering::Acquire);
        if live < self.config.sleep_target() && !self.closed() {
            self.start_sleeper();
        }
    }

    pub(crate) fn queued(&self) -> usize {
        let workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        self.injected.load(Ordering::Acquire)
            + workers
                .iter()
                .map(|worker| worker.local_len.load(Ordering::Acquire))
                .sum::<usize>()
    }

    pub(crate) fn blocking_queued(&self) -> usize {
        self.blocking_queued.load(Ordering::Acquire)
    }

    fn has_work(&self, _me: Option<&WorkerSlot>) -> bool {
        self.injected.load(Ordering::Acquire) > 0 || self.local_queued.load(Ordering::Acquire) > 0
    }

    /// Whether a worker about to park has something to do instead: queued work, a stop, or an injected
    /// death. Checked again after [`Parking::prepare`], because `stop_threads` and `kill_workers` set their
    /// flag before [`Parking::wake_all`]: a worker that read the bumped epoch sees the flag here.
    fn has_cause_to_wake(&self, me: &WorkerSlot) -> bool {
        self.has_work(Some(me))
            || me.stop.load(Ordering::Acquire)
            || self.kill_threads.load(Ordering::Acquire) > 0
    }

    /// Pops one task from the injector and, for a worker, moves a share of the rest into its own deque
    /// (min(length / live workers, REFILL)) so the injector lock is taken once per batch, not per task.
    fn pop_injector(&self, me: Option<&WorkerSlot>) -> Option<TaskRef> {
        if self.injected.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut injector = self.injector.lock().unwrap_or_else(|p| p.into_inner());
        let spawned = table().spawned();
        let entry = injector.pop(spawned)?;
        if let Some(me) = me {
            let live = self.live_workers.load(Ordering::Acquire).max(1);
            let share = (injector.len() / live).min(REFILL);
            if share > 0 {
                let mut local = me.local.lock().unwrap_or_else(|p| p.into_inner());
                let mut batch: Vec<TaskRef> = Vec::with_capacity(share);
                for _ in 0..share {
                    match injector.pop(spawned) {
                        Some(entry) => batch.push(entry.task),
                        None => break,
                    }
                }
                // The deque pops from the back, so store the batch reversed to keep it first-in first-out.
                self.local_queued.fetch_add(batch.len(), Ordering::AcqRel);
                local.extend(batch.into_iter().rev());
                me.local_len.store(local.len(), Ordering::Release);
            }
        }
        self.injected.store(injector.len(), Ordering::Release);
        Some(entry.task)
    }

    fn steal(&self, me: &WorkerSlot) -> Option<TaskRef> {
        if self.local_queued.load(Ordering::Acquire) == 0 {
            return None;
        }
        let workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        workers
            .iter()
            .filter(|worker| !std::ptr::eq(worker.as_ref(), me))
            .find_map(|worker| worker.steal_front(&self.local_queued))
    }

    fn find_work(&self, me: &WorkerSlot, streak: &mut u32) -> Option<TaskRef> {
        if *streak >= LIFO_STREAK {
            *streak = 0;
            if let Some(task) = self.pop_injector(Some(me)) {
                return Some(task);
            }
        }
        if let Some(task) = me.pop_back(&self.local_queued) {
            *streak += 1;
            return Some(task);
        }
        *streak = 0;
        self.pop_injector(Some(me)).or_else(|| self.steal(me))
    }

    pub(crate) fn note_running(&self, task: TaskRef) {
        CONTEXT.with(|context| {
            if let Some(worker) = context
                .borrow()
                .as_ref()
                .and_then(|context| context.worker.as_ref())
            {
                let packed = if task == TaskRef::NONE {
                    u64::MAX
                } else {
                    u64::from(task.index) << 32 | u64::from(task.generation)
                };
                worker.running.store(packed, Ordering::Release);
            }
        });
    }

    /// Adds a wake timer; false when the manager is gone for good (never call `write_off` while
    /// holding the task's own slot lock: it takes that lock).
    #[must_use]
    pub(crate) fn add_timer(&self, at: Instant, task: TaskRef, sequence: u64) -> bool {
        self.reactor.add_wake_timer(at, task, sequence)
    }

    /// Adds a run-timeout timer; false when the manager is gone for good.
    #[must_use]
    pub(crate) fn add_timeout(&self, at: Instant, task: TaskRef, stamp: u64) -> bool {
        self.reactor.add_timeout_timer(at, task, stamp)
    }

    /// Starts workers up to the floor.
    pub(crate) fn ensure_floor(self: &Arc<Self>) {
        while self.live_workers.load(Ordering::Acquire) < self.config.floor() && !self.closed() {
            if !self.start_worker() {
                break;
            }
        }
    }

    /// Starts one worker; false when the thread could not be created or the ceiling is reached.
    pub(crate) fn start_worker(self: &Arc<Self>) -> bool {
        self.start_thread::<WorkerSlot>()
    }

    /// Starts one blocking thread; false when the thread could not be created.
    fn start_sleeper(self: &Arc<Self>) -> bool {
        self.start_thread::<SleeperSlot>()
    }

    /// Starts one pool thread of kind `S` and lists its slot, or leaves no trace when the system refuses
    /// the thread. A refusal is counted and backs further tries off (see [`StartBackoff`]); the manager
    /// keeps ticking while the pool is short of threads, so a tick after the backoff tries again.
    /// Until then tasks run on the threads that exist.
    fn start_thread<S: PoolThread>(self: &Arc<Self>) -> bool {
        if !self.may_start_thread() {
            return false;
        }
        let live = S::live(self).fetch_add(1, Ordering::AcqRel) + 1;
        if live > S::limit(self) {
            S::live(self).fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        let slot = Arc::new(S::new());
        // The list stays locked across the spawn: the new thread takes this lock to unlist itself when it
        // retires or dies, so it cannot leave before it is listed (which would leave a dead slot behind).
        let mut slots = S::slots(self).lock().unwrap_or_else(|p| p.into_inner());
        // Checked under the lock: shutdown closes the pool before `stop_threads` walks this list, so a
        // new thread is either listed before that walk (and told to stop) or not started at all; one
        // listed after it would never stop and shutdown would wait for it forever.
        if self.closed() {
            drop(slots);
            S::live(self).fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        let pool = Arc::clone(self);
        let thread_slot = Arc::clone(&slot);
        let started = spawn_thread(
            std::thread::Builder::new()
                .name(S::NAME.into())
                .stack_size(self.config.worker_stack),
            move || S::main(pool, thread_slot),
        );
        if started.is_err() {
            drop(slots);
            S::live(self).fetch_sub(1, Ordering::AcqRel);
            self.counters.refused_starts.fetch_add(1, Ordering::AcqRel);
            self.backoff().refused(Instant::now());
            self.reactor.wake_manager();
            return false;
        }
        slots.push(slot);
        drop(slots);
        S::peak(self).fetch_max(live, Ordering::AcqRel);
        self.backoff().started();
        true
    }

    /// Whether the start backoff allows a try now (reads the clock only while backing off).
    fn may_start_thread(&self) -> bool {
        let backoff = self.backoff();
        backoff.not_before.is_none() || backoff.may_try(Instant::now())
    }

    fn backoff(&self) -> std::sync::MutexGuard<'_, StartBackoff> {
        self.start_backoff.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the pool has anything to look after (the manager ticks only then).
    pub(crate) fn busy(&self) -> bool {
        let workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        self.injected.load(Ordering::Acquire) > 0
            || self.blocking_queued() > 0
            || workers.iter().any(|worker| {
                worker.busy.load(Ordering::Acquire) || worker.local_len.load(Ordering::Acquire) > 0
            })
            || workers.len() > self.config.floor()
            || self.below_floor()
    }

    /// Fewer workers run than the floor (after a death or a refused start) and the ceiling allows more,
    /// so the manager must keep ticking until `ensure_floor` has restored them.
    fn below_floor(&self) -> bool {
        self.live_workers.load(Ordering::Acquire) < self.config.floor().min(self.config.ceiling())
    }

    /// The manager's policy pass: grow when workers are stuck while work waits; grow blocking threads.
    pub(crate) fn tick(self: &Arc<Self>) {
        if self.closed() {
            return;
        }
        self.ensure_floor();
        let workers: Vec<Arc<WorkerSlot>> = self
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let pending = self.queued();
        let mut stuck = 0;
        for worker in &workers {
            let completed = worker.completed.load(Ordering::Acquire);
            let last = worker.last_completed.swap(completed, Ordering::AcqRel);
            if worker.busy.load(Ordering::Acquire) && completed == last {
                worker.stuck_ticks.fetch_add(1, Ordering::AcqRel);
                stuck += 1;
            } else {
                worker.stuck_ticks.store(0, Ordering::Release);
            }
        }
        let live = self.live_workers.load(Ordering::Acquire);
        let all_stuck = stuck > 0 && stuck >= live;
        if pending > 0 && all_stuck {
            let long_stuck = workers
                .iter()
                .filter(|worker| worker.stuck_ticks.load(Ordering::Acquire) >= 2)
                .count();
            if live < self.config.target() {
                if long_stuck >= live {
                    let start = (self.config.target() - live).min(pending);
                    for _ in 0..start {
                        self.start_worker();
                    }
                }
            } else if long_stuck >= live
                && workers.iter().all(|worker| {
                    worker.stuck_ticks.load(Ordering::Acquire) as usize
                        > live - self.config.target() + 2
                })
            {
                self.start_worker();
            }
        }
        // Blocking threads: if all are busy and work waits past the target, add one.
        let blocking_pending = self.blocking_queued();
        if blocking_pending > 0 && self.parked_sleepers.load(Ordering::Acquire) == 0 {
            let live = self.live_sleepers.load(Ordering::Acquire);
            let busy = self.busy_sleepers.load(Ordering::Acquire);
            if busy >= live {
                let start = blocking_pending.min(live.max(1));
                for _ in 0..start {
                    self.start_sleeper();
                }
            }
        }
    }

    /// Asks every thread to stop between tasks and wakes them all.
    pub(crate) fn stop_threads(&self) {
        for worker in self
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            worker.stop.store(true, Ordering::Release);
        }
        for sleeper in self
            .sleepers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            sleeper.stop.store(true, Ordering::Release);
        }
        self.parking.wake_all();
        self.blocking_word.fetch_add(1, Ordering::SeqCst);
        futex::wake_all(&self.blocking_word);
    }

    /// Wakes every parked worker (fault hooks use it so a kill lands at once).
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    pub(crate) fn stop_threads_wake(&self) {
        self.parking.wake_all();
    }

    /// Takes every queued task out of every queue (shutdown writes them off).
    pub(crate) fn drain_queues(&self) -> Vec<TaskRef> {
        let mut tasks = self
            .injector
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain();
        self.injected.store(0, Ordering::Release);
        tasks.extend(
            self.blocking
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .drain(..),
        );
        self.blocking_queued.store(0, Ordering::Release);
        for worker in self
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let mut local = worker.local.lock().unwrap_or_else(|p| p.into_inner());
            self.local_queued.fetch_sub(local.len(), Ordering::AcqRel);
            tasks.extend(local.drain(..));
            worker.local_len.store(0, Ordering::Release);
        }
        tasks
    }

    /// A snapshot of the per-worker numbers: (busy, backlog, completed).
    pub(crate) fn worker_snapshot(&self) -> Vec<(bool, usize, u64)> {
        self.workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|worker| {
                (
                    worker.busy.load(Ordering::Acquire),
                    worker.local_len.load(Ordering::Acquire),
                    worker.completed.load(Ordering::Acquire),
                )
            })
            .collect()
    }

    fn remove_worker(&self, me: &Arc<WorkerSlot>) {
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        workers.retain(|worker| !Arc::ptr_eq(worker, me));
    }
}

/// A kind of pool thread (worker or blocking thread): where the pool lists and counts it, and what it
/// runs, so that both kinds start through one function ([`Pool::start_thread`]).
trait PoolThread: Sized + Send + Sync + 'static {
    /// The thread's name, as `/proc/self/task/*/comm` shows it.
    const NAME: &'static str;
    /// A fresh shared record for a new thread.
    fn new() -> Self;
    /// The pool's list of these threads' records.
    fn slots(pool: &Pool) -> &Mutex<Vec<Arc<Self>>>;
    /// How many of these threads are running or starting.
    fn live(pool: &Pool) -> &AtomicUsize;
    /// The most of these threads that ran at once.
    fn peak(pool: &Pool) -> &AtomicUsize;
    /// The most of these threads the pool may run.
    fn limit(pool: &Pool) -> usize;
    /// The thread's body.
    fn main(pool: Arc<Pool>, me: Arc<Self>);
}

impl PoolThread for WorkerSlot {
    const NAME: &'static str = "task-worker";
    fn new() -> Self {
        WorkerSlot {
            local: Mutex::new(VecDeque::new()),
            local_len: AtomicUsize::new(0),
            running: AtomicU64::new(u64::MAX),
            busy: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            last_completed: AtomicU64::new(0),
            stuck_ticks: AtomicU32::new(0),
        }
    }
    fn slots(pool: &Pool) -> &Mutex<Vec<Arc<Self>>> {
        &pool.workers
    }
    fn live(pool: &Pool) -> &AtomicUsize {
        &pool.live_workers
    }
    fn peak(pool: &Pool) -> &AtomicUsize {
        &pool.counters.peak_workers
    }
    fn limit(pool: &Pool) -> usize {
        pool.config.ceiling()
    }
    fn main(pool: Arc<Pool>, me: Arc<Self>) {
        worker_main(pool, me);
    }
}

impl PoolThread for SleeperSlot {
    const NAME: &'static str = "task-blocking";
    fn new() -> Self {
        SleeperSlot {
            stop: AtomicBool::new(false),
        }
    }
    fn slots(pool: &Pool) -> &Mutex<Vec<Arc<Self>>> {
        &pool.sleepers
    }
    fn live(pool: &Pool) -> &AtomicUsize {
        &pool.live_sleepers
    }
    fn peak(pool: &Pool) -> &AtomicUsize {
        &pool.counters.peak_sleepers
    }
    /// Blocking threads are not held to the worker ceiling: the tick grows them with their backlog.
    fn limit(_pool: &Pool) -> usize {
        usize::MAX
    }
    fn main(pool: Arc<Pool>, me: Arc<Self>) {
        sleeper_main(pool, me);
    }
}

/// Exit guard of a pool thread: on an unwinding death it fails the task in hand, hands the local queue
/// back and starts a replacement so nothing is stranded.
struct DeathGuard {
    pool: Arc<Pool>,
    worker: Arc<WorkerSlot>,
}

impl Drop for DeathGuard {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let pool = &self.pool;
        pool.counters.deaths.fetch_add(1, Ordering::AcqRel);
        pool.live_workers.fetch_sub(1, Ordering::AcqRel);
        pool.remove_worker(&self.worker);
        let packed = self.worker.running.swap(u64::MAX, Ordering::AcqRel);
        if packed != u64::MAX {
            executor::write_off(TaskRef {
                index: (packed >> 32) as u32,
                generation: packed as u32,
            });
        }
        requeue_local(pool, &self.worker);
        if !pool.closed() {
            pool.ensure_floor();
        }
        pool.notify_worker();
    }
}

fn worker_main(pool: Arc<Pool>, me: Arc<WorkerSlot>) {
    CONTEXT.with(|context| {
        *context.borrow_mut() = Some(Context {
            pool: Arc::clone(&pool),
            worker: Some(Arc::clone(&me)),
            depth: 0,
        });
    });
    let _guard = DeathGuard {
        pool: Arc::clone(&pool),
        worker: Arc::clone(&me),
    };
    let mut streak = 0;
    loop {
        if me.stop.load(Ordering::Acquire) {
            break;
        }
        if pool.kill_threads.load(Ordering::Acquire) > 0
            && pool
                .kill_threads
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                    left.checked_sub(1)
                })
                .is_ok()
        {
            std::panic::resume_unwind(Box::new("injected pool thread death"));
        }
        if let Some(task) = pool.find_work(&me, &mut streak) {
            // Chain wake: more work is queued and a worker is parked, so pass the wake on.
            if pool.parking.parked() > 0 && pool.has_work(None) {
                pool.notify_worker();
            }
            me.busy.store(true, Ordering::Release);
            pool.reactor.note_activity();
            executor::run(&pool, task);
            me.completed.fetch_add(1, Ordering::AcqRel);
            me.busy.store(false, Ordering::Release);
            continue;
        }
        let mut found = false;
        let spin_started = Instant::now();
        while spin_started.elapsed() < SPIN_BEFORE_PARK {
            if pool.has_cause_to_wake(&me) {
                found = true;
                break;
            }
            std::thread::yield_now();
        }
        if found {
            continue;
        }
        let ticket = pool.parking.prepare();
        if pool.has_cause_to_wake(&me) {
            pool.parking.cancel(ticket);
            continue;
        }
        let live = pool.live_workers.load(Ordering::Acquire);
        let timeout = if live > pool.config.target() {
            Some(IDLE_REAP_OVER)
        } else if live > pool.config.floor() {
            Some(IDLE_REAP)
        } else {
            None
        };
        let woke = pool.parking.wait(ticket, timeout);
        if woke == Wake::TimedOut && !pool.has_work(Some(&me)) {
            // Retire if still above the floor; the CAS keeps two idle workers from both leaving.
            let retired = pool
                .live_workers
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |live| {
                    (live > pool.config.floor()).then(|| live - 1)
                })
                .is_ok();
            if retired {
                pool.remove_worker(&me);
                hand_back(&pool, &me);
                forget_context();

                return;
            }
        }
    }
    // Stopped by shutdown.
    pool.live_workers.fetch_sub(1, Ordering::AcqRel);
    pool.remove_worker(&me);
    hand_back(&pool, &me);
    forget_context();
}

/// Gives a leaving worker's queued tasks back to the pool and wakes a worker to take them.
fn hand_back(pool: &Arc<Pool>, me: &WorkerSlot) {
    requeue_local(pool, me);
    pool.notify_worker();
}

/// Moves every task in `worker`'s local deque to the injector, each in its priority band, so that no
/// task stays behind with a worker that retires, stops or dies.
fn requeue_local(pool: &Pool, worker: &WorkerSlot) {
    let leftover: Vec<TaskRef> = worker
        .local
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain(..)
        .collect();
    worker.local_len.store(0, Ordering::Release);
    pool.local_queued
        .fetch_sub(leftover.len(), Ordering::AcqRel);
    for task in leftover {
        if let Some(slot) = table().get(task) {
            pool.inject(task, slot.class.load(Ordering::Relaxed) as u8);
        }
    }
}

fn forget_context() {
    CONTEXT.with(|context| *context.borrow_mut() = None);
}

fn sleeper_main(pool: Arc<Pool>, me: Arc<SleeperSlot>) {
    CONTEXT.with(|context| {
        *context.borrow_mut() = Some(Context {
            pool: Arc::clone(&pool),
            worker: None,
            depth: 0,
        });
    });
    let _ = net_io_sys::timerfd::set_thread_timer_slack(Duration::from_nanos(1));
    loop {
        if me.stop.load(Ordering::Acquire) {
            break;
        }
        let task = {
            let mut queue = pool.blocking.lock().unwrap_or_else(|p| p.into_inner());
            let task = queue.pop_front();
            pool.blocking_queued.store(queue.len(), Ordering::Release);
            task
        };
        if let Some(task) = task {
            pool.busy_sleepers.fetch_add(1, Ordering::AcqRel);
            pool.reactor.note_activity();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                executor::run(&pool, task);
            }));
            pool.busy_sleepers.fetch_sub(1, Ordering::AcqRel);
            if outcome.is_err() {
                executor::write_off(task);
            }
            continue;
        }
        let epoch = pool.blocking_word.load(Ordering::SeqCst);
        pool.parked_sleepers.fetch_add(1, Ordering::SeqCst);
        if pool.blocking_queued() > 0 || me.stop.load(Ordering::Acquire) {
            pool.parked_sleepers.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let timeout = if pool.live_sleepers.load(Ordering::Acquire) > pool.config.sleep_target() {
            IDLE_REAP_OVER
        } else {
            IDLE_REAP
        };
        let woke = futex::wait(&pool.blocking_word, epoch, Some(timeout));
        pool.parked_sleepers.fetch_sub(1, Ordering::SeqCst);
        if matches!(woke, Ok(futex::Wake::TimedOut)) && pool.blocking_queued() == 0 {
            break;
        }
    }
    pool.live_sleepers.fetch_sub(1, Ordering::AcqRel);
    pool.sleepers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|sleeper| !Arc::ptr_eq(sleeper, &me));
    forget_context();
}

/// Waits until `slot` settles, for at most `deadline`. On a worker it helps: runs the awaited task if it
/// is still in this worker's deque, then other queued work, and sleeps in short slices in between.
pub(crate) fn wait_settled(slot: &Slot, task: TaskRef, deadline: Option<Instant>) -> bool {
    let helper = CONTEXT.with(|context| {
        context.borrow().as_ref().and_then(|context| {
            context
                .worker
                .as_ref()
                .map(|worker| (Arc::clone(&context.pool), Arc::clone(worker), context.depth))
        })
    });
    let mut slice = Duration::from_micros(50);
    let mut spins = 0u32;
    loop {
        let word = slot.word.load(Ordering::SeqCst);
        if TaskState::from_bits(word).is_settled() || word >> 4 != task.generation {
            return true;
        }
        // Only timed waits need the clock (a vDSO call per check is measurable on the join path).
        let now = deadline.map(|_| Instant::now());
        if let (Some(deadline), Some(now)) = (deadline, now)
            && now >= deadline
        {
            return false;
        }
        if let Some((pool, worker, depth)) = helper.as_ref() {
            let limit = pool.help_depth.load(Ordering::Relaxed);
            if *depth < limit {
                let mut streak = 0;
                let found = worker.take_specific(task, &pool.local_queued).or_else(|| {
                    if *depth < limit / 2 {
                        pool.find_work(worker, &mut streak)
                    } else {
                        worker.pop_back(&pool.local_queued)
                    }
                });
                if let Some(found) = found {
                    set_depth(depth + 1);
                    let saved = worker.running.load(Ordering::Acquire);
                    executor::run(pool, found);
                    worker.running.store(saved, Ordering::Release);
                    set_depth(*depth);
                    slice = Duration::from_micros(50);
                    continue;
                }
            }
            // Nothing to help with: this worker is blocked. If every worker is, start a replacement.
            let waiting = pool.waiting_workers.fetch_add(1, Ordering::AcqRel) + 1;
            if waiting >= pool.live_workers.load(Ordering::Acquire) && pool.has_work(Some(worker)) {
                pool.start_worker();
            }
            let mut timeout = slice;
            if let (Some(deadline), Some(now)) = (deadline, now) {
                timeout = timeout.min(deadline.saturating_duration_since(now));
            }
            sleep_on(slot, word, Some(timeout));
            pool.waiting_workers.fetch_sub(1, Ordering::AcqRel);
            slice = (slice * 2).min(HELP_POLL);
        } else {
            // Off the pool: spin briefly first, since most joins of short tasks settle within a wake-up.
            if spins < SPIN_BEFORE_SLEEP {
                spins += 1;
                std::hint::spin_loop();
                if spins.is_multiple_of(64) {
                    std::thread::yield_now();
                }
                continue;
            }
            let timeout = deadline
                .zip(now)
                .map(|(deadline, now)| deadline.saturating_duration_since(now));
            sleep_on(slot, word, timeout);
        }
    }
}

fn sleep_on(slot: &Slot, word: u32, timeout: Option<Duration>) {
    slot.waiters.fetch_add(1, Ordering::SeqCst);
    if slot.word.load(Ordering::SeqCst) == word {
        let _ = futex::wait(&slot.word, word, timeout);
    }
    slot.waiters.fetch_sub(1, Ordering::SeqCst);
}

fn set_depth(depth: usize) {
    CONTEXT.with(|context| {
        if let Some(context) = context.borrow_mut().as_mut() {
            context.depth = depth;
        }
    });
}

/// Fault hook: how many of the next pool thread starts fail as if the system refused the thread.
#[cfg(feature = "fault-injection")]
pub(crate) static REFUSE_THREAD_STARTS: AtomicU32 = AtomicU32::new(0);

/// Fault hook: how many times any pool tried to start a thread (refused or not), so tests can count
/// retries.
#[cfg(feature = "fault-injection")]
pub(crate) static THREAD_START_ATTEMPTS: AtomicU64 = AtomicU64::new(0);

/// Spawns a pool thread, unless the fault hook says to refuse it.
fn spawn_thread(
    builder: std::thread::Builder,
    main: impl FnOnce() + Send + 'static,
) -> std::io::Result<()> {
    #[cfg(feature = "fault-injection")]
    THREAD_START_ATTEMPTS.fetch_add(1, Ordering::AcqRel);
    #[cfg(feature = "fault-injection")]
    if REFUSE_THREAD_STARTS
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
            left.checked_sub(1)
        })
        .is_ok()
    {
        return Err(std::io::Error::other(
            "injected refusal of a pool thread start",
        ));
    }
    builder.spawn(main).map(drop)
}

/// The most threads the pool may start: min(threads-max / 2, RLIMIT_NPROC, cgroup pids.max) less a reserve.
fn thread_ceiling() -> usize {
    static CEILING: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CEILING.get_or_init(|| {
        let read = |path: &str| {
            std::fs::read_to_string(path)
                .ok()
                .and_then(|text| text.trim().parse::<usize>().ok())
        };
        let mut ceiling = 4096usize;
        if let Some(threads) = read("/proc/sys/kernel/threads-max") {
            ceiling = ceiling.min(threads / 2);
        }
        if let Some(pids) = read("/sys/fs/cgroup/pids.max") {
            ceiling = ceiling.min(pids.saturating_sub(256));
        }
        ceiling.max(4)
    })
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{
        Bands, Entry, START_BACKOFF_FIRST, START_BACKOFF_LONGEST, STARVE_AGE, STARVE_RELIEF,
        StartBackoff,
    };
    use crate::table::TaskRef;

    fn entry(index: u32, age: u64) -> Entry {
        Entry {
            task: TaskRef {
                index,
                generation: 0,
            },
            age,
        }
    }

    #[test]
    fn higher_bands_pop_first_and_each_band_is_first_in_first_out() {
        let mut bands = Bands::default();
        bands.push(10, entry(1, 0));
        bands.push(128, entry(2, 1));
        bands.push(255, entry(3, 2));
        bands.push(128, entry(4, 3));
        let order: Vec<u32> = std::iter::from_fn(|| bands.pop(4))
            .map(|e| e.task.index)
            .collect();
        assert_eq!(
            order,
            vec![3, 2, 4, 1],
            "band 3 first, then band 2 in order, then band 0"
        );
    }

    #[test]
    fn a_starving_task_moves_up_and_the_oldest_are_served_for_a_while() {
        let mut bands = Bands::default();
        bands.push(0, entry(1, 0));
        for index in 0..10 {
            bands.push(255, entry(100 + index, STARVE_AGE + 5));
        }
        let first = bands.pop(STARVE_AGE + 10).expect("a task");
        assert_eq!(
            first.task.index, 1,
            "the starving low-priority task should be served first"
        );
        assert_eq!(bands.relief, STARVE_RELIEF - 1, "relief pops follow");
        assert_eq!(bands.len(), 10);
    }

    #[test]
    fn a_refused_start_backs_off_doubling_to_a_bound_and_a_success_resets_it() {
        let start = Instant::now();
        let mut backoff = StartBackoff::default();
        assert!(
            backoff.may_try(start),
            "a fresh pool may start threads at once"
        );
        let mut now = start;
        let mut delays = Vec::new();
        for _ in 0..10 {
            backoff.refused(now);
            delays.push(backoff.delay);
            assert!(
                !backoff.may_try(now + backoff.delay - Duration::from_millis(1)),
                "no try before the backoff of {:?} has passed",
                backoff.delay
            );
            now += backoff.delay;
            assert!(backoff.may_try(now), "a try once the backoff has passed");
        }
        let expected: Vec<Duration> = [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]
            .into_iter()
            .map(Duration::from_millis)
            .collect();
        assert_eq!(
            delays, expected,
            "delays should double from {START_BACKOFF_FIRST:?} and stop at {START_BACKOFF_LONGEST:?}"
        );
        backoff.started();
        assert!(backoff.may_try(now), "a success lifts the backoff");
        backoff.refused(now);
        assert_eq!(
            backoff.delay, START_BACKOFF_FIRST,
            "after a success the next refusal starts again from the first delay"
        );
    }
}
