//! The manager: one thread on one epoll that holds a timer heap behind ONE timerfd, socket and process
//! readiness, the signal eventfd and the inotify instance; supervised and restarted with backoff.
//!
//! ```text
//!   workers ──add timer──> heap (mutex) ──earliest──> timerfd ─┐
//!   sockets/pidfds ──edge-triggered registration──────────────┤
//!   signal handler ──> eventfd ───────────────────────────────┼──> epoll ──> manager thread
//!   inotify ──────────────────────────────────────────────────┤       wakes parked tasks,
//!   shutdown/faults ──> wake eventfd ─────────────────────────┘       ticks the pool policy
//! ```
//!
//! Everything the manager owns lives in the [`Reactor`], which outlives a crashed manager loop, so a
//! restart keeps every timer and every parked task. A stale timer (its task re-parked or settled) is a
//! tombstone: its wake carries an old sequence and does nothing.

use std::collections::{BinaryHeap, HashMap};
use std::os::fd::AsFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use net_io_sys::epoll::{Epoll, Events, Interest};
use net_io_sys::eventfd::EventFd;
use net_io_sys::timerfd::TimerFd;

use crate::executor;
use crate::pool::Pool;
use crate::table::{TaskRef, monotonic_nanos, table};

/// Policy pass period while the pool is busy.
pub(crate) const MANAGER_TICK: Duration = Duration::from_millis(10);
/// Restart delay per consecutive failure.
const RESTART_BACKOFF: Duration = Duration::from_millis(10);
/// Alive this long and the failure count resets.
const RESTART_WINDOW: Duration = Duration::from_secs(5);
/// More consecutive failures than this and the supervisor gives up.
pub(crate) const RESTART_LIMIT: u32 = 5;

const TOKEN_WAKE: u64 = 0;
const TOKEN_TIMER: u64 = 1;
const TOKEN_SIGNAL: u64 = 2;
const TOKEN_INOTIFY: u64 = 3;
const FIRST_SOURCE_TOKEN: u64 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TimerKind {
    Wake(u64),
    Timeout(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Timer {
    at: u64,
    task: TaskRef,
    kind: TimerKind,
}

impl Ord for Timer {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Reversed: BinaryHeap is a max-heap and we want the earliest first.
        other.at.cmp(&self.at)
    }
}

impl PartialOrd for Timer {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

struct Timers {
    heap: BinaryHeap<Timer>,
    armed: Option<u64>,
}

/// Something the manager dispatches readiness to (a socket record, a child exit record).
pub(crate) trait Dispatch: Send + Sync {
    fn dispatch(&self, readiness: Interest);
    /// Writes off every waiter (the manager gave up).
    fn abandon(&self);
}

/// What the manager owns; shared with every thread that registers timers or descriptors.
pub(crate) struct Reactor {
    epoll: Epoll,
    timer: TimerFd,
    wake: EventFd,
    timers: Mutex<Timers>,
    sources: Mutex<HashMap<u64, Weak<dyn Dispatch>>>,
    next_token: AtomicU64,
    alive: AtomicBool,
    stopping: AtomicBool,
    idle: AtomicBool,
    pub(crate) restarts: AtomicU32,
    pub(crate) faults_pending: AtomicU32,
    /// Fault hook: nanoseconds the manager loop sleeps on its next iteration.
    pub(crate) stall_nanos: AtomicU64,
    pub(crate) watches: crate::kinds::watch::WatchRegistry,
    pub(crate) signals: crate::kinds::signal::SignalRegistry,
}

impl Reactor {
    pub(crate) fn new() -> std::io::Result<Arc<Self>> {
        let epoll = Epoll::new()?;
        let timer = TimerFd::new()?;
        let wake = EventFd::new()?;
        epoll.add(wake.as_fd(), TOKEN_WAKE, Interest::READABLE)?;
        epoll.add(timer.as_fd(), TOKEN_TIMER, Interest::READABLE)?;
        let signal_wake = net_io_sys::signal::wake_descriptor()?;
        // A previous runtime's epoll may hold the same process-wide eventfd; ours is a new epoll.
        epoll.add(signal_wake, TOKEN_SIGNAL, Interest::READABLE)?;
        let watches = crate::kinds::watch::WatchRegistry::new()?;
        epoll.add(watches.descriptor(), TOKEN_INOTIFY, Interest::READABLE)?;
        Ok(Arc::new(Reactor {
            epoll,
            timer,
            wake,
            timers: Mutex::new(Timers {
                heap: BinaryHeap::new(),
                armed: None,
            }),
            sources: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(FIRST_SOURCE_TOKEN),
            alive: AtomicBool::new(true),
            stopping: AtomicBool::new(false),
            idle: AtomicBool::new(false),
            restarts: AtomicU32::new(0),
            faults_pending: AtomicU32::new(0),
            stall_nanos: AtomicU64::new(0),
            watches,
            signals: crate::kinds::signal::SignalRegistry::default(),
        }))
    }

    /// Whether a manager loop runs (or will run again after a restart).
    pub(crate) fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    pub(crate) fn wake_manager(&self) {
        let _ = self.wake.signal();
    }

    /// A pool thread started work: an idle manager resumes its policy ticks.
    pub(crate) fn note_activity(&self) {
        if self.idle.load(Ordering::Relaxed) && self.idle.swap(false, Ordering::AcqRel) {
            self.wake_manager();
        }
    }

    /// Adds a wake timer; false when no manager will ever fire it (the caller writes the task off,
    /// outside any slot lock it holds).
    #[must_use]
    pub(crate) fn add_wake_timer(&self, at: Instant, task: TaskRef, sequence: u64) -> bool {
        self.add_timer(Timer {
            at: monotonic_nanos(at),
            task,
            kind: TimerKind::Wake(sequence),
        })
    }

    /// Adds a run-timeout timer; false when no manager will fire it.
    #[must_use]
    pub(crate) fn add_timeout_timer(&self, at: Instant, task: TaskRef, stamp: u64) -> bool {
        self.add_timer(Timer {
            at: monotonic_nanos(at),
            task,
            kind: TimerKind::Timeout(stamp),
        })
    }

    fn add_timer(&self, timer: Timer) -> bool {
        if !self.alive() {
            return false;
        }
        let mut timers = self.timers.lock().unwrap_or_else(|p| p.into_inner());
        let earliest = timers.armed.is_none_or(|armed| timer.at < armed);
        timers.heap.push(timer);
        if earliest {
            // Re-arming under the lock keeps two racing inserts from leaving the later deadline armed.
            timers.armed = Some(timer.at);
            let _ = self.timer.set_absolute(Duration::from_nanos(timer.at));
        }
        true
    }

    /// Timers waiting in the heap (including tombstones).
    pub(crate) fn timer_count(&self) -> usize {
        self.timers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .heap
            .len()
    }

    /// Registers a descriptor for edge-triggered read and write readiness; returns its token.
    pub(crate) fn register(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        target: Weak<dyn Dispatch>,
        interest: Interest,
    ) -> std::io::Result<u64> {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, target);
        if let Err(error) = self.epoll.add(fd, token, interest) {
            self.sources
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&token);
            return Err(error);
        }
        Ok(token)
    }

    /// Removes a descriptor; call before it closes.
    pub(crate) fn deregister(&self, fd: std::os::fd::BorrowedFd<'_>, token: u64) {
        let _ = self.epoll.delete(fd);
        self.sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&token);
    }

    fn fire_due_timers(&self) {
        let _ = self.timer.read();
        let now = monotonic_nanos(Instant::now());
        let mut due = Vec::new();
        {
            let mut timers = self.timers.lock().unwrap_or_else(|p| p.into_inner());
            while let Some(top) = timers.heap.peek() {
                if top.at > now {
                    break;
                }
                due.push(*top);
                timers.heap.pop();
            }
            timers.armed = timers.heap.peek().map(|top| top.at);
            match timers.armed {
                Some(at) => {
                    let _ = self.timer.set_absolute(Duration::from_nanos(at));
                }
                None => {
                    let _ = self.timer.disarm();
                }
            }
            if timers.heap.capacity() > 4096 && timers.heap.len() < timers.heap.capacity() / 4 {
                timers.heap.shrink_to_fit();
            }
        }
        for timer in due {
            match timer.kind {
                TimerKind::Wake(sequence) => {
                    executor::wake(timer.task, sequence);
                }
                TimerKind::Timeout(stamp) => executor::timeout(timer.task, stamp),
            }
        }
    }

    fn dispatch(&self, token: u64, readiness: Interest) {
        let target = self
            .sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&token)
            .and_then(Weak::upgrade);
        if let Some(target) = target {
            target.dispatch(readiness);
        }
    }

    /// The supervisor gave up: every task that waits on the manager is written off.
    fn abandon_everything(&self) {
        self.alive.store(false, Ordering::Release);
        let timers: Vec<Timer> = {
            let mut timers = self.timers.lock().unwrap_or_else(|p| p.into_inner());
            timers.armed = None;
            timers.heap.drain().collect()
        };
        for timer in timers {
            executor::write_off(timer.task);
        }
        let sources: Vec<Arc<dyn Dispatch>> = self
            .sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for source in sources {
            source.abandon();
        }
        self.signals.abandon();
        self.watches.abandon();
    }

    /// Shutdown: stop the loop for good and write off whatever still waits on it.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.wake_manager();
    }

    pub(crate) fn finish_stop(&self) {
        self.abandon_everything();
    }
}

/// Starts the supervisor thread, which runs the manager loop and restarts it on panic.
pub(crate) fn start(
    pool: Weak<Pool>,
    reactor: Arc<Reactor>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("task-manager".into())
        .spawn(move || supervise(pool, reactor))
}

fn supervise(pool: Weak<Pool>, reactor: Arc<Reactor>) {
    let _ = net_io_sys::timerfd::set_thread_timer_slack(Duration::from_nanos(1));
    let mut failures = 0u32;
    loop {
        let started = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| manager_loop(&pool, &reactor)));
        if outcome.is_ok() {
            return;
        }
        reactor.restarts.fetch_add(1, Ordering::AcqRel);
        if started.elapsed() >= RESTART_WINDOW {
            failures = 0;
        }
        failures += 1;
        if failures > RESTART_LIMIT {
            reactor.abandon_everything();
            return;
        }
        std::thread::sleep(RESTART_BACKOFF * failures);
        if reactor.stopping.load(Ordering::Acquire) {
            return;
        }
    }
}

fn manager_loop(weak_pool: &Weak<Pool>, reactor: &Arc<Reactor>) {
    let mut events = Events::with_capacity(256);
    let mut last_tick = Instant::now();
    loop {
        if reactor.stopping.load(Ordering::Acquire) {
            return;
        }
        if reactor.stall_nanos.load(Ordering::Acquire) > 0 {
            let stall = reactor.stall_nanos.swap(0, Ordering::AcqRel);
            std::thread::sleep(Duration::from_nanos(stall));
        }
        if reactor.faults_pending.load(Ordering::Acquire) > 0 {
            reactor.faults_pending.fetch_sub(1, Ordering::AcqRel);
            panic!("injected manager fault");
        }
        let Some(pool) = weak_pool.upgrade() else {
            return;
        };
        let busy = pool.busy();
        let timeout = if busy {
            reactor.idle.store(false, Ordering::Release);
            Some(MANAGER_TICK.saturating_sub(last_tick.elapsed()))
        } else {
            // Idle: sleep until an event; the first pool thread to start work wakes us.
            reactor.idle.store(true, Ordering::Release);
            if pool.busy() {
                reactor.idle.store(false, Ordering::Release);
                Some(MANAGER_TICK)
            } else {
                None
            }
        };
        let pool = Arc::downgrade(&pool);
        let _ = reactor.epoll.wait(&mut events, timeout);
        for event in events.iter() {
            match event.token {
                TOKEN_WAKE => {
                    let _ = reactor.wake.drain();
                }
                TOKEN_TIMER => reactor.fire_due_timers(),
                TOKEN_SIGNAL => reactor.signals.deliver(),
                TOKEN_INOTIFY => reactor.watches.deliver(),
                token => reactor.dispatch(token, event.readiness),
            }
        }
        if last_tick.elapsed() >= MANAGER_TICK {
            last_tick = Instant::now();
            if let Some(pool) = pool.upgrade() {
                pool.tick();
            }
        }
    }
}

/// Writes off every table task that still waits on a timer of a stopped runtime.
pub(crate) fn write_off_unsettled() {
    let mut unsettled = Vec::new();
    table().for_each_live(|task, slot| {
        if !slot.lock().settled {
            unsettled.push(task);
        }
    });
    for task in unsettled {
        executor::write_off(task);
    }
}
