//! The task table: fixed-size blocks of slots with stable addresses, a free list that reuses ids, and the
//! per-slot words (state futex, scheduling word, claims) that every thread touches without a lock.
//!
//! ```text
//!   directory [block 0][block 1] ...      each block: BLOCK_SLOTS slots, allocated on first use
//!   TaskRef { index, generation }  ->  slot = directory[index / BLOCK_SLOTS][index % BLOCK_SLOTS]
//!   slot.word   = generation << 4 | TaskState   (joiners futex-wait on it)
//!   slot.sched  = sequence << 2 | Idle/Scheduled/Running/Notified
//! ```
//!
//! A slot is freed when its last claim (the executor's plus one per handle) is released; its generation
//! then moves on so a stale reference never matches the next task in the slot.

use std::any::Any;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use crate::error::{RuntimeError, TaskState};
use crate::task::{Job, Plan};

/// Slots per block: small enough that an untouched block costs little, large enough to keep lookups flat.
pub(crate) const BLOCK_SLOTS: usize = 4096;
/// Blocks in the directory: 65,536 x 4,096 is about 268 million task ids.
const DIRECTORY_BLOCKS: usize = 65_536;

pub(crate) const SCHED_IDLE: u64 = 0;
pub(crate) const SCHED_SCHEDULED: u64 = 1;
pub(crate) const SCHED_RUNNING: u64 = 2;
pub(crate) const SCHED_NOTIFIED: u64 = 3;

/// Abort reasons a canceller or a timeout leaves for the thread that next touches the task.
pub(crate) const ABORT_NONE: u32 = 0;
pub(crate) const ABORT_CANCEL: u32 = 1;
pub(crate) const ABORT_TIMEOUT: u32 = 2;
pub(crate) const ABORT_FAIL: u32 = 3;

/// A generation-checked reference to a slot (internal; public only because `HandleSet` names it).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TaskRef {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl TaskRef {
    /// A reference that matches no slot (an empty `join_first`).
    pub(crate) const NONE: TaskRef = TaskRef {
        index: u32::MAX,
        generation: 0,
    };
}

/// The mutable part of a task, behind the slot's lock.
#[derive(Default)]
pub(crate) struct Body {
    /// The task itself; taken out while a thread steps it.
    pub(crate) job: Option<Box<dyn Job>>,
    /// The latest output.
    pub(crate) output: Option<Box<dyn Any + Send>>,
    /// Why it failed, when it did with a cause.
    pub(crate) error: Option<RuntimeError>,
    /// Schedule and wiring; boxed because most tasks run once.
    pub(crate) plan: Option<Box<Plan>>,
    /// Runs started.
    pub(crate) runs: u64,
    /// A run has started and not published yet.
    pub(crate) in_run: bool,
    /// No more runs will happen; the state word holds the final state.
    pub(crate) settled: bool,
    /// At least one output was published.
    pub(crate) published: bool,
    /// Start priority, 0 to 255.
    pub(crate) priority: u8,
    /// Runs on the blocking threads.
    pub(crate) blocking: bool,
    /// A thread holds the job (stepping it).
    pub(crate) job_out: bool,
    /// The executor's claim was dropped.
    pub(crate) executor_released: bool,
}

/// One task's slot.
pub(crate) struct Slot {
    pub(crate) word: AtomicU32,
    pub(crate) sched: AtomicU64,
    pub(crate) abort: AtomicU32,
    pub(crate) claims: AtomicU32,
    pub(crate) waiters: AtomicU32,
    /// Priority in the low byte, bit 8 set for blocking tasks: read by the queue without the lock.
    pub(crate) class: AtomicU32,
    pub(crate) body: Mutex<Body>,
}

impl Slot {
    fn new() -> Self {
        Slot {
            word: AtomicU32::new(0),
            sched: AtomicU64::new(0),
            abort: AtomicU32::new(ABORT_NONE),
            claims: AtomicU32::new(0),
            waiters: AtomicU32::new(0),
            class: AtomicU32::new(128),
            body: Mutex::new(Body::default()),
        }
    }

    /// Locks the body; a poisoned lock is taken over, because bodies are only changed in small steps.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Body> {
        self.body
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn state(&self) -> TaskState {
        TaskState::from_bits(self.word.load(Ordering::Acquire))
    }

    pub(crate) fn generation(&self) -> u32 {
        self.word.load(Ordering::Acquire) >> 4
    }

    /// Stores a state (keeping the generation) and wakes every joiner sleeping on the word.
    pub(crate) fn set_state(&self, state: TaskState) {
        let generation = self.word.load(Ordering::Relaxed) >> 4;
        // SeqCst pairs with the joiner's SeqCst increment of `waiters`: either the joiner sees the new
        // state before it sleeps, or we see its count and wake it (no lost wake-up).
        self.word
            .store(generation << 4 | state as u32, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            net_io_sys::futex::wake_all(&self.word);
        }
    }
}

struct FreeList {
    free: Vec<u32>,
    next: u32,
    live: u64,
}

/// The process-wide task table. It outlives runtimes, so handles keep their values after shutdown.
pub(crate) struct Table {
    directory: Box<[OnceLock<Box<[Slot]>>]>,
    free: Mutex<FreeList>,
    spawned: AtomicU64,
}

static TABLE: OnceLock<Table> = OnceLock::new();

/// The table, created on first use.
pub(crate) fn table() -> &'static Table {
    TABLE.get_or_init(|| Table {
        directory: (0..DIRECTORY_BLOCKS).map(|_| OnceLock::new()).collect(),
        free: Mutex::new(FreeList {
            free: Vec::new(),
            next: 0,
            live: 0,
        }),
        spawned: AtomicU64::new(0),
    })
}

impl Table {
    /// Takes a free slot (reusing ids before growing), sets it Pending with `claims` claims.
    pub(crate) fn allocate(&self, claims: u32) -> Result<TaskRef, RuntimeError> {
        let index = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.live += 1;
            match free.free.pop() {
                Some(index) => index,
                None => {
                    let index = free.next;
                    if index as usize >= BLOCK_SLOTS * DIRECTORY_BLOCKS {
                        free.live -= 1;
                        return Err(RuntimeError::CheckError(Some(libc::ENOMEM)));
                    }
                    free.next += 1;
                    index
                }
            }
        };
        self.spawned.fetch_add(1, Ordering::Relaxed);
        let slot = self.slot_or_create(index);
        slot.claims.store(claims, Ordering::Relaxed);
        slot.abort.store(ABORT_NONE, Ordering::Relaxed);
        let generation = slot.generation();
        // A fresh scheduling sequence in the Idle state: nothing left over from the slot's last task
        // (a late wake, a stale Scheduled mark) can match or block the new one.
        let sched = slot.sched.load(Ordering::Acquire);
        slot.sched
            .store(((sched >> 2) + 1) << 2 | SCHED_IDLE, Ordering::Release);
        slot.word.store(
            generation << 4 | TaskState::Pending as u32,
            Ordering::Release,
        );
        Ok(TaskRef { index, generation })
    }

    fn slot_or_create(&self, index: u32) -> &Slot {
        let block = &self.directory[index as usize / BLOCK_SLOTS];
        let slots = block.get_or_init(|| (0..BLOCK_SLOTS).map(|_| Slot::new()).collect());
        &slots[index as usize % BLOCK_SLOTS]
    }

    /// The slot for `task` if the reference is still current.
    pub(crate) fn get(&self, task: TaskRef) -> Option<&Slot> {
        let block = self
            .directory
            .get(task.index as usize / BLOCK_SLOTS)?
            .get()?;
        let slot = &block[task.index as usize % BLOCK_SLOTS];
        (slot.generation() == task.generation && slot.state() != TaskState::Free).then_some(slot)
    }

    /// Adds a claim (a new handle clone).
    pub(crate) fn claim(&self, task: TaskRef) {
        if let Some(slot) = self.get(task) {
            slot.claims.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Drops a claim; the last one frees the slot.
    pub(crate) fn release(&self, task: TaskRef) {
        let Some(slot) = self.get(task) else {
            return;
        };
        if slot.claims.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        // Last claim: nothing else can reach the slot except stale references, which the generation
        // bump below turns away. Drop the body outside the lock so task destructors cannot deadlock.
        let body = std::mem::take(&mut *slot.lock());
        let next_generation = (task.generation + 1) & 0x0fff_ffff;
        slot.word.store(next_generation << 4, Ordering::Release);
        // Keep the scheduling sequence moving so a stale wake can never match the slot's next task.
        let sched = slot.sched.load(Ordering::Acquire);
        slot.sched
            .store(((sched >> 2) + 1) << 2 | SCHED_IDLE, Ordering::Release);
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.free.push(task.index);
            free.live -= 1;
        }
        drop(body);
    }

    /// Live tasks (slots holding a task).
    pub(crate) fn live(&self) -> u64 {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).live
    }

    /// Slots ever handed out (the high-water mark of ids).
    pub(crate) fn peak_slots(&self) -> u64 {
        u64::from(self.free.lock().unwrap_or_else(|p| p.into_inner()).next)
    }

    /// Tasks spawned since the process started; ageing counts in spawns.
    pub(crate) fn spawned(&self) -> u64 {
        self.spawned.load(Ordering::Relaxed)
    }

    /// Calls `visit` for every slot that holds a task (used by shutdown and the manager's give-up).
    pub(crate) fn for_each_live(&self, mut visit: impl FnMut(TaskRef, &Slot)) {
        let next = self.free.lock().unwrap_or_else(|p| p.into_inner()).next;
        for index in 0..next {
            let Some(block) = self.directory[index as usize / BLOCK_SLOTS].get() else {
                continue;
            };
            let slot = &block[index as usize % BLOCK_SLOTS];
            let word = slot.word.load(Ordering::Acquire);
            if TaskState::from_bits(word) == TaskState::Free {
                continue;
            }
            visit(
                TaskRef {
                    index,
                    generation: word >> 4,
                },
                slot,
            );
        }
    }
}

/// Most readings [`calibrate`] takes while looking for a tight pair.
const CALIBRATION_TRIES: u32 = 16;
/// A pair of readings whose bracketing `Instant`s lie at most this far apart is taken at once.
const CALIBRATION_SPREAD: std::time::Duration = std::time::Duration::from_micros(20);

/// A moment as nanoseconds of `CLOCK_MONOTONIC`, the clock of the manager's timerfd.
///
/// `Instant` reads the same clock but does not expose its value, so the offset between the two is
/// measured once per process (see [`calibrate`]); every timer of the process inherits its error.
pub(crate) fn monotonic_nanos(at: Instant) -> u64 {
    static BASE: OnceLock<(Instant, u64)> = OnceLock::new();
    let (base_instant, base_nanos) = *BASE.get_or_init(calibrate);
    if at >= base_instant {
        base_nanos + (at - base_instant).as_nanos() as u64
    } else {
        base_nanos.saturating_sub((base_instant - at).as_nanos() as u64)
    }
}

/// Pairs an `Instant` with a `CLOCK_MONOTONIC` reading of the same moment.
///
/// Why bracketed: a thread preempted between the two readings would pair an `Instant` with a clock value
/// taken later, and every timer of the process would then fire that much late, for the life of the
/// process (a 300 ms preemption here made every repeat gap 300 ms longer). So the clock is read between
/// two `Instant`s and paired with their midpoint, which bounds the error by half their spread; a pair
/// spread wider than [`CALIBRATION_SPREAD`] is read again, and the tightest of [`CALIBRATION_TRIES`]
/// is kept. It costs a few microseconds once per process.
fn calibrate() -> (Instant, u64) {
    let mut best: Option<(std::time::Duration, Instant, u64)> = None;
    for _ in 0..CALIBRATION_TRIES {
        let before = Instant::now();
        #[cfg(feature = "fault-injection")]
        crate::runtime::faults::pause_in_calibration();
        let nanos = net_io_sys::timerfd::monotonic_now().as_nanos() as u64;
        let after = Instant::now();
        let spread = after - before;
        let pair = (spread, before + spread / 2, nanos);
        if best.is_none_or(|(tightest, _, _)| spread < tightest) {
            best = Some(pair);
        }
        if spread <= CALIBRATION_SPREAD {
            break;
        }
    }
    best.map_or_else(
        || {
            (
                Instant::now(),
                net_io_sys::timerfd::monotonic_now().as_nanos() as u64,
            )
        },
        |(_, instant, nanos)| (instant, nanos),
    )
}
