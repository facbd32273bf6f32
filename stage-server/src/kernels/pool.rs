//! The compute pool: a fixed set of threads that share each op of a forward pass with the calling thread,
//! spinning between ops while a pass runs and parking the moment it ends.
//!
//! ```text
//!   caller:   pass { op ──publish──▶ own chunks ──close, wait──▶ op ──▶ … } ──▶ workers park
//!   workers:          ╰─spin─▶ claim chunks ─▶ spin (between ops) ─▶ claim ─▶ …     (no CPU when idle)
//! ```
//!
//! Why our own: candle's barrier pool (what the products used before) spins 25,000 rounds after every op
//! before it parks, since it cannot know whether another op follows. Between two decode steps, and while the
//! next stage of a pipeline computes on the same cores, those spins took the CPU another process needed. A
//! pass knows when it ends, so the workers here spin only inside one and park as soon as it ends.
//!
//! The one `unsafe` step: a job is a borrowed closure on the caller's stack, handed to the workers as a raw
//! pointer. The caller does not return (or unwind) until every worker that could still read the job has
//! left it; the protocol that guarantees this is on [`Shared::state`].

use std::cell::Cell;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sync::{
    Arc, AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, JoinHandle, Ordering, Thread, spin_loop,
    thread,
};

/// The synchronisation the pool uses: std's, or loom's under the `loom-models` feature (whose model
/// below explores the job hand-over; run it with `cargo test --release -p stage-server --features
/// loom-models --lib kernels::pool::loom_models`).
#[cfg(not(feature = "loom-models"))]
mod sync {
    pub(super) use std::hint::spin_loop;
    pub(super) use std::sync::Arc;
    pub(super) use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
    pub(super) use std::thread::{self, JoinHandle, Thread};
}
#[cfg(feature = "loom-models")]
mod sync {
    pub(super) use loom::hint::spin_loop;
    pub(super) use loom::sync::Arc;
    pub(super) use loom::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
    pub(super) use loom::thread::{self, JoinHandle, Thread};
}

/// How long a worker spins without a job inside a pass before it parks anyway (a pass that stalls on
/// something else, or a caller descheduled by the kernel, should not hold a core). Under loom it parks at
/// once: a model explores interleavings, not time.
#[cfg(not(feature = "loom-models"))]
const SPIN_INSIDE_PASS: Duration = Duration::from_micros(500);
#[cfg(feature = "loom-models")]
const SPIN_INSIDE_PASS: Duration = Duration::ZERO;

/// Chunks per thread a job is cut into: a fast thread takes over a slow one's share, while each claim stays
/// rare enough that the shared cursor costs nothing measurable.
const CHUNKS_PER_THREAD: usize = 8;

/// Rounds the caller spins waiting for the workers inside a job before it also yields its core: a worker
/// descheduled by the kernel (likely where stage processes share cores) should get that core back soon.
const CALLER_SPINS_BEFORE_YIELD: u32 = 1_000;

#[cfg(not(feature = "loom-models"))]
thread_local! {
    /// Whether this thread is one of a pool's workers (a job that starts a job runs it in place).
    static IN_WORKER: Cell<bool> = const { Cell::new(false) };
    /// Passes this thread is running (so that `aside` gives up only a pass of its own).
    static PASSES_HERE: Cell<usize> = const { Cell::new(0) };
}
#[cfg(feature = "loom-models")]
loom::thread_local! {
    static IN_WORKER: Cell<bool> = Cell::new(false);
    static PASSES_HERE: Cell<usize> = Cell::new(0);
}

/// A pool of compute threads; [`ComputePool::global`] is the one the kernels use.
#[derive(Debug)]
pub struct ComputePool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Set while a caller's job holds the pool: a second caller runs its job on its own thread instead of
    /// waiting. A flag, not a mutex: a panicking job must not leave it poisoned (and the pool serial).
    dispatching: AtomicBool,
}

/// One job as the workers see it: lives on the caller's stack for the job's duration.
struct Job<'work> {
    work: &'work (dyn Fn(Range<usize>) + Sync),
    items: usize,
    chunk: usize,
    cursor: AtomicUsize,
    /// A worker's job panicked; the caller re-raises it once every worker has left.
    panicked: AtomicBool,
    /// Under loom: read by every worker that reads the job and written by the caller once it has closed the
    /// job and seen every worker leave, so that a worker reading a job its caller is done with is a data
    /// race the model reports.
    #[cfg(feature = "loom-models")]
    lifetime: loom::cell::UnsafeCell<()>,
}

#[derive(Debug)]
struct Shared {
    /// One word for the whole hand-over: the job's generation (from bit [`GENERATION_SHIFT`]), whether it is
    /// open for workers to join ([`OPEN`]), and how many workers are inside it (the low bits, [`INSIDE`]).
    ///
    /// The caller publishes job `g` by storing its pointer in `job`, then `state = g | OPEN` (release). A
    /// worker joins with a compare-exchange (acquire) that adds one to the count only while the word is open,
    /// and leaves with a subtraction (release). The caller, its own chunks done, clears `OPEN` and waits
    /// until the count is zero (acquire). Every step but the publish (made when nobody can join) is a
    /// read-modify-write or a load of this one word, so
    /// they fall in its single modification order: a join that succeeded came before the close and is
    /// counted until its leave, and one that came after fails. No worker touches a job once its caller
    /// returned, with no reliance on sequential consistency across two variables.
    state: AtomicU64,
    /// The open job; valid while `state` names it as open and for every worker counted in it.
    job: AtomicPtr<()>,
    /// Passes running: while above zero, idle workers spin instead of parking.
    passes: AtomicUsize,
    /// The pool is being dropped: workers exit.
    stop: AtomicBool,
    /// Whether each worker is parked or about to be (a test's view; the wake itself needs no flag, see
    /// [`Shared::unpark_all`]).
    parked: Vec<AtomicBool>,
    /// Each worker's thread, to unpark it.
    threads: OnceLock<Vec<Thread>>,
    /// The core the caller ran on when it last began a pass, published a job or took its pass back from
    /// [`ComputePool::aside`] ([`NO_CORE`] when unknown): a worker that finds itself on that core while it waits
    /// for a job yields instead of spinning. One slot for every caller: a second thread's pass overwrites it,
    /// which costs only a spin or a yield in the wrong place (a stage process has one caller).
    ///
    /// Why: the gap between two ops of a pass is microseconds, so a worker spins through it; but on a host
    /// whose kernel packs threads onto busy cores (these 2-vCPU hosts wake a worker onto its caller's core
    /// while the other core idles), the worker preempts the caller, and the next op cannot come while it
    /// spins: the op after each wake waited out the whole spin ([`SPIN_INSIDE_PASS`]). Seen with `perf sched`
    /// on a 3-process SmolLM2 chain with 5 ms links, whose stages wake after every idle gap: a 10-layer pass
    /// took 1.8 to 1.9 ms instead of 1.0. Yielding only when the cores match, not after some spin, keeps the
    /// spin where it pays: a first version that yielded after 20 µs of spinning wherever it ran cost gemma-3
    /// whole 15%, whose K-quant products then ran on candle's own spinning pool beside ours.
    caller_core: AtomicUsize,
}

/// [`Shared::caller_core`] when the caller's core is not known.
const NO_CORE: usize = usize::MAX;

/// The bits of [`Shared::state`] that count the workers inside the current job.
const INSIDE: u64 = (1 << 16) - 1;
/// The bit of [`Shared::state`] that says the current job is open to join.
const OPEN: u64 = 1 << 16;
/// Where the generation starts in [`Shared::state`].
const GENERATION_SHIFT: u32 = 17;

impl ComputePool {
    /// A pool whose jobs run on `threads` threads: the caller and `threads - 1` workers.
    pub fn new(threads: NonZeroUsize) -> ComputePool {
        // The state word counts the workers inside a job in 16 bits.
        let workers = (threads.get() - 1).min(INSIDE as usize);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            passes: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            parked: (0..workers).map(|_| AtomicBool::new(false)).collect(),
            threads: OnceLock::new(),
            caller_core: AtomicUsize::new(NO_CORE),
        });
        let handles: Vec<JoinHandle<()>> = (0..workers)
            .map(|index| {
                let shared = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("compute-{index}"))
                    .spawn(move || work_loop(&shared, index))
                    .unwrap_or_else(|error| {
                        // Without its threads the pool cannot keep its promise of `threads`; a process that
                        // cannot start a thread at start-up has no better way on.
                        panic!("could not start compute pool thread {index}: {error}")
                    })
            })
            .collect();
        let _ = shared.threads.set(
            handles
                .iter()
                .map(|handle| handle.thread().clone())
                .collect(),
        );
        ComputePool {
            shared,
            workers: handles,
            dispatching: AtomicBool::new(false),
        }
    }

    /// The process's pool, sized at first use from `CANDLE_NUM_THREADS`, else `RAYON_NUM_THREADS`, else the
    /// cores this process may run on (the same rule, and so the same `--threads`, as candle's pools).
    pub fn global() -> &'static ComputePool {
        static GLOBAL: OnceLock<ComputePool> = OnceLock::new();
        GLOBAL.get_or_init(|| ComputePool::new(threads_from_environment()))
    }

    /// Threads a job runs on, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `body` as one pass: between the jobs `body` starts, the workers spin instead of parking, so each
    /// op reaches them at once; when `body` returns they park (at once, not after a spin).
    pub fn pass<R>(&self, body: impl FnOnce() -> R) -> R {
        struct Ending<'pool>(&'pool Shared);
        impl Drop for Ending<'_> {
            fn drop(&mut self) {
                PASSES_HERE.with(|passes| passes.set(passes.get() - 1));
                self.0.passes.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.shared.passes.fetch_add(1, Ordering::SeqCst);
        PASSES_HERE.with(|passes| passes.set(passes.get() + 1));
        let _ending = Ending(&self.shared);
        self.shared.note_caller_core();
        self.shared.unpark_all();
        body()
    }

    /// Runs `body`, which computes on threads of its own (candle's products for the formats our kernels do
    /// not cover), with this pool's workers parked instead of spinning beside it: inside a pass they would
    /// hold the cores `body`'s threads need (gemma-3's K-quant products, on candle until session 25, ran at
    /// 0.65x with them spinning).
    /// It gives up only the calling thread's own passes (all of them, when passes nest, as a split's stages
    /// do inside the split's pass): while another thread's pass runs, the workers spin for that one.
    pub fn aside<R>(&self, body: impl FnOnce() -> R) -> R {
        struct Back<'pool>(&'pool Shared, usize);
        impl Drop for Back<'_> {
            fn drop(&mut self) {
                PASSES_HERE.with(|passes| passes.set(passes.get() + self.1));
                self.0.passes.fetch_add(self.1, Ordering::SeqCst);
                // candle's product may have moved the caller to another core.
                self.0.note_caller_core();
                self.0.unpark_all();
            }
        }
        // Only a pass makes the workers spin; outside one of ours there is nothing to give up.
        let here = PASSES_HERE.with(Cell::get);
        if here == 0 {
            return body();
        }
        PASSES_HERE.with(|passes| passes.set(0));
        self.shared.passes.fetch_sub(here, Ordering::SeqCst);
        let _back = Back(&self.shared, here);
        body()
    }

    /// Calls `work` on disjoint ranges that together cover `0..items`, shared between the caller and the
    /// workers that join in time, and returns when all are done. Runs on the calling thread alone when the pool has no workers, when called
    /// from inside a job, or while another caller's job holds the pool.
    pub fn run(&self, items: usize, work: &(dyn Fn(Range<usize>) + Sync)) {
        if items == 0 {
            return;
        }
        if self.workers.is_empty() || IN_WORKER.with(Cell::get) {
            return work(0..items);
        }
        if self
            .dispatching
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return work(0..items);
        }
        struct Dispatched<'pool>(&'pool AtomicBool);
        impl Drop for Dispatched<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _dispatched = Dispatched(&self.dispatching);
        let job = Job {
            work,
            items,
            chunk: items.div_ceil(self.threads() * CHUNKS_PER_THREAD).max(1),
            cursor: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            #[cfg(feature = "loom-models")]
            lifetime: loom::cell::UnsafeCell::new(()),
        };
        let shared = &*self.shared;
        // The previous job is closed with nobody inside (its caller waited), and no worker can join a closed
        // word, so nothing else writes it now and a plain store loses nothing.
        let generation = (shared.state.load(Ordering::Acquire) >> GENERATION_SHIFT) + 1;
        shared
            .job
            .store(&job as *const Job<'_> as *mut (), Ordering::Relaxed);
        shared
            .state
            .store(generation << GENERATION_SHIFT | OPEN, Ordering::Release);
        shared.note_caller_core();
        shared.unpark_all();
        // Closes the job and waits for the workers inside it even if our own share panics, so that no worker
        // reads `job` after this frame is gone.
        struct Closing<'pool>(&'pool Shared);
        impl Drop for Closing<'_> {
            fn drop(&mut self) {
                self.0.state.fetch_and(!OPEN, Ordering::AcqRel);
                let mut spins = 0u32;
                while self.0.state.load(Ordering::Acquire) & INSIDE != 0 {
                    spins += 1;
                    if spins < CALLER_SPINS_BEFORE_YIELD {
                        spin_loop();
                    } else {
                        thread::yield_now();
                    }
                }
            }
        }
        let closing = Closing(shared);
        job.claim_all();
        drop(closing);
        #[cfg(feature = "loom-models")]
        job.lifetime.with_mut(|_| ());
        if job.panicked.load(Ordering::SeqCst) {
            resume_unwind(Box::new("a compute pool job panicked on a worker thread"));
        }
    }

    /// Calls `work(index, chunk)` for each `chunk_length`-long chunk of `data` (the last may be shorter; a
    /// length of 0 counts as 1), shared between the threads as [`ComputePool::run`] does.
    pub fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk_length: usize,
        work: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let chunk_length = chunk_length.max(1);
        let length = data.len();
        let chunks = length.div_ceil(chunk_length);
        // An address, not a pointer, so that the closure is `Sync` whatever `T` is.
        let base = data.as_mut_ptr() as usize;
        self.run(chunks, &|range: Range<usize>| {
            for index in range {
                let start = index * chunk_length;
                let end = length.min(start + chunk_length);
                // SAFETY: `run` hands each index in `0..chunks` to exactly one call, so the chunks built here are
                // disjoint, and each lies inside `data` (`start < end <= length`); `data` is borrowed mutably
                // for this whole call, so nothing else reads or writes it meanwhile, and `run` returns only after
                // every call has.
                let chunk = unsafe {
                    std::slice::from_raw_parts_mut((base as *mut T).add(start), end - start)
                };
                work(index, chunk);
            }
        });
    }
}

impl Job<'_> {
    /// Takes chunks from the shared cursor until none is left.
    fn claim_all(&self) {
        loop {
            let start = self.cursor.fetch_add(self.chunk, Ordering::Relaxed);
            if start >= self.items {
                return;
            }
            (self.work)(start..self.items.min(start + self.chunk));
        }
    }
}

impl Shared {
    fn thread(&self, index: usize) -> Option<&Thread> {
        self.threads.get().and_then(|threads| threads.get(index))
    }

    /// Records the calling thread's core as the caller's (see [`Shared::caller_core`]).
    fn note_caller_core(&self) {
        // Stored only when it changed: the workers read this word at every look, and a store per op would
        // take their cache line away each time for nothing.
        if let Some(core) = this_core()
            && self.caller_core.load(Ordering::Relaxed) != core
        {
            self.caller_core.store(core, Ordering::Relaxed);
        }
    }

    /// Whether the calling worker runs on the core the caller last ran on.
    fn caller_shares_this_core(&self) -> bool {
        this_core().is_some_and(|core| self.caller_core.load(Ordering::Relaxed) == core)
    }

    /// Unparks every worker. Unconditional, so no flag has to be read against a worker about to park (a
    /// store-then-load race on two variables): an unpark before a park makes that park return, and one to a
    /// thread that is not parked costs one atomic operation.
    fn unpark_all(&self) {
        for index in 0..self.parked.len() {
            if let Some(thread) = self.thread(index) {
                thread.unpark();
            }
        }
    }
}

/// The core the calling thread runs on; under loom none: a model must replay the same way every time, and
/// the hint changes no outcome, only who spins (loom's `spin_loop` yields anyway).
fn this_core() -> Option<usize> {
    #[cfg(not(feature = "loom-models"))]
    {
        net_io_sys::cpu::current_cpu()
    }
    #[cfg(feature = "loom-models")]
    {
        None
    }
}

/// A worker: joins each open job once, spins between jobs while a pass runs, parks otherwise.
fn work_loop(shared: &Shared, index: usize) {
    IN_WORKER.with(|flag| flag.set(true));
    let mut last_done = 0u64;
    let mut idle_since: Option<Instant> = None;
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let state = shared.state.load(Ordering::Acquire);
        let generation = state >> GENERATION_SHIFT;
        if state & OPEN != 0 && generation != last_done {
            idle_since = None;
            if shared
                .state
                .compare_exchange_weak(state, state + 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                // Another worker joined or left, or the job closed: look again.
                continue;
            }
            last_done = generation;
            // SAFETY: our join succeeded on an open word, so it precedes the caller's close in the word's
            // modification order, and the caller waits for our leave below before its `Job` (on its stack,
            // where `job` points) goes away; see `Shared::state`. The pointer was stored before the caller's
            // release store of this generation, which our acquire exchange read, so it is this job's.
            let job = unsafe { &*(shared.job.load(Ordering::Relaxed) as *const Job<'_>) };
            #[cfg(feature = "loom-models")]
            job.lifetime.with(|_| ());
            // The leave happens in a guard, so that the caller is released even should this thread die on
            // the way out (a panic payload whose own drop panics).
            struct Leave<'pool>(&'pool Shared);
            impl Drop for Leave<'_> {
                fn drop(&mut self) {
                    self.0.state.fetch_sub(1, Ordering::Release);
                }
            }
            let _leave = Leave(shared);
            if catch_unwind(AssertUnwindSafe(|| job.claim_all())).is_err() {
                job.panicked.store(true, Ordering::SeqCst);
            }
            continue;
        }
        let in_pass = shared.passes.load(Ordering::SeqCst) > 0;
        let spun_enough = idle_since.is_some_and(|since| since.elapsed() >= SPIN_INSIDE_PASS);
        if in_pass && !spun_enough {
            idle_since.get_or_insert_with(Instant::now);
            if shared.caller_shares_this_core() {
                // The caller cannot publish the next op while we hold its core: hand the core back.
                thread::yield_now();
            } else {
                spin_loop();
            }
            continue;
        }
        // Park. A job published or a pass begun after our last look unparks us (every publish and pass start
        // unparks every worker, and an unpark that comes before the park makes it return at once).
        shared.parked[index].store(true, Ordering::Relaxed);
        if !shared.stop.load(Ordering::Acquire) {
            thread::park();
        }
        shared.parked[index].store(false, Ordering::Relaxed);
        idle_since = None;
    }
}

impl Drop for ComputePool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.unpark_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// `CANDLE_NUM_THREADS`, else `RAYON_NUM_THREADS`, else the cores this process may use.
fn threads_from_environment() -> NonZeroUsize {
    ["CANDLE_NUM_THREADS", "RAYON_NUM_THREADS"]
        .iter()
        .find_map(|name| {
            std::env::var(name)
                .ok()
                .and_then(|value| value.trim().parse::<NonZeroUsize>().ok())
        })
        .or_else(|| std::thread::available_parallelism().ok())
        .unwrap_or(NonZeroUsize::MIN)
}

#[cfg(all(test, not(feature = "loom-models")))]
mod tests {
    use super::*;

    fn pool(threads: usize) -> ComputePool {
        ComputePool::new(NonZeroUsize::new(threads).unwrap())
    }

    /// Runs one job over `items` and returns how many items its calls saw.
    fn items_run(pool: &ComputePool, items: usize) -> usize {
        let count = AtomicUsize::new(0);
        pool.run(items, &|range: Range<usize>| {
            count.fetch_add(range.len(), Ordering::Relaxed);
        });
        count.load(Ordering::Relaxed)
    }

    /// Whether every worker is parked within 5 s.
    fn all_parked(pool: &ComputePool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !pool
            .shared
            .parked
            .iter()
            .all(|parked| parked.load(Ordering::SeqCst))
        {
            if Instant::now() > deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(1));
        }
        true
    }

    #[test]
    fn every_item_is_run_exactly_once_for_any_thread_count() {
        for threads in 1..=4 {
            let pool = pool(threads);
            for items in [1, 2, 7, 64, 1000] {
                let counts: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
                pool.pass(|| {
                    for _ in 0..3 {
                        pool.run(items, &|range: Range<usize>| {
                            for item in range {
                                counts[item].fetch_add(1, Ordering::Relaxed);
                            }
                        });
                    }
                });
                assert!(
                    counts
                        .iter()
                        .all(|count| count.load(Ordering::Relaxed) == 3),
                    "{threads} threads, {items} items: every item should run once per job"
                );
            }
        }
    }

    #[test]
    fn chunks_cover_the_slice_once_with_their_indices() {
        let pool = pool(2);
        for (length, chunk) in [(0, 4), (1, 4), (10, 3), (64, 8), (65, 8)] {
            let mut data = vec![0usize; length];
            pool.for_each_chunk_mut(&mut data, chunk, |index, part| {
                assert!(part.len() <= chunk && !part.is_empty());
                for (offset, value) in part.iter_mut().enumerate() {
                    *value += index * chunk + offset + 1;
                }
            });
            let expected: Vec<usize> = (1..=length).collect();
            assert_eq!(data, expected, "{length} items in chunks of {chunk}");
        }
    }

    #[test]
    fn jobs_outside_a_pass_run_and_the_workers_park_after() {
        let pool = pool(3);
        let sum = AtomicUsize::new(0);
        for _ in 0..100 {
            pool.run(100, &|range: Range<usize>| {
                sum.fetch_add(range.sum::<usize>(), Ordering::Relaxed);
            });
        }
        assert_eq!(sum.load(Ordering::Relaxed), 100 * 4950);
        assert!(
            all_parked(&pool),
            "the workers should park with no pass running"
        );
    }

    #[test]
    fn aside_a_pass_the_workers_park_and_come_back_after() {
        let pool = pool(2);
        pool.pass(|| {
            pool.aside(|| {
                assert!(all_parked(&pool), "aside a pass the workers should park");
            });
            assert_eq!(items_run(&pool, 64), 64, "jobs run after the aside");
            assert_eq!(
                pool.shared.passes.load(Ordering::SeqCst),
                1,
                "the pass counts again after the aside"
            );
        });
        pool.aside(|| ());
        assert_eq!(
            pool.shared.passes.load(Ordering::SeqCst),
            0,
            "an aside outside a pass leaves the count alone"
        );
        // Another thread's pass is not this thread's to give up.
        pool.pass(|| {
            thread::scope(|scope| {
                scope.spawn(|| {
                    pool.aside(|| {
                        assert_eq!(
                            pool.shared.passes.load(Ordering::SeqCst),
                            1,
                            "an aside on a thread without a pass leaves another thread's pass running"
                        );
                    });
                });
            });
        });
    }

    #[test]
    fn nested_passes_keep_the_workers_until_the_outer_ends_and_an_aside_gives_up_both() {
        let pool = pool(2);
        pool.pass(|| {
            pool.pass(|| assert_eq!(items_run(&pool, 64), 64, "jobs run in the inner pass"));
            assert_eq!(
                pool.shared.passes.load(Ordering::SeqCst),
                1,
                "the outer pass still runs after the inner one ends"
            );
            pool.pass(|| {
                pool.aside(|| {
                    assert_eq!(
                        pool.shared.passes.load(Ordering::SeqCst),
                        0,
                        "an aside gives up every pass of its thread"
                    );
                    assert!(
                        all_parked(&pool),
                        "aside nested passes the workers should park"
                    );
                });
                assert_eq!(
                    pool.shared.passes.load(Ordering::SeqCst),
                    2,
                    "both passes count again after the aside"
                );
            });
        });
        assert_eq!(
            pool.shared.passes.load(Ordering::SeqCst),
            0,
            "no pass is left"
        );
        assert!(all_parked(&pool), "after the outer pass the workers park");
    }

    /// How many threads took chunks of 50 slow jobs in one pass.
    fn threads_taking_part(pool: &ComputePool) -> usize {
        let threads = std::sync::Mutex::new(std::collections::HashSet::new());
        pool.pass(|| {
            for _ in 0..50 {
                pool.run(64, &|_range: Range<usize>| {
                    thread::sleep(Duration::from_micros(50));
                    threads.lock().unwrap().insert(thread::current().id());
                });
            }
        });
        threads.into_inner().unwrap().len()
    }

    #[test]
    fn the_workers_share_the_work() {
        let pool = pool(2);
        assert_eq!(
            threads_taking_part(&pool),
            2,
            "the caller and the worker should both have taken chunks"
        );
    }

    #[test]
    fn a_panic_in_a_job_reaches_the_caller_and_the_pool_serves_on() {
        let pool = pool(2);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            pool.run(64, &|range: Range<usize>| {
                if range.contains(&40) {
                    panic!("job fails on item 40");
                }
            })
        }));
        assert!(outcome.is_err(), "the panic should reach the caller");
        assert_eq!(items_run(&pool, 64), 64, "the next job runs in full");
        assert_eq!(
            threads_taking_part(&pool),
            2,
            "after a panic the jobs should still be shared, not run by the caller alone"
        );
    }

    #[test]
    fn concurrent_callers_and_nested_jobs_each_complete() {
        let pool = Arc::new(pool(2));
        let callers: Vec<_> = (0..3)
            .map(|_| {
                let pool = Arc::clone(&pool);
                thread::spawn(move || {
                    let total = AtomicUsize::new(0);
                    for _ in 0..200 {
                        pool.run(10, &|outer: Range<usize>| {
                            // A job inside a job runs in place on whichever thread it is.
                            pool.run(outer.len(), &|inner: Range<usize>| {
                                total.fetch_add(inner.len(), Ordering::Relaxed);
                            });
                        });
                    }
                    total.load(Ordering::Relaxed)
                })
            })
            .collect();
        for caller in callers {
            assert_eq!(caller.join().unwrap(), 2000);
        }
    }
}

/// Loom models of the job hand-over: every item of every job runs exactly once, and no worker reads a job
/// after its caller is done with it (the `lifetime` cell), whatever the interleaving, in and out of a pass.
#[cfg(all(test, feature = "loom-models"))]
mod loom_models {
    use super::*;

    #[test]
    fn two_jobs_in_a_pass_then_one_outside_run_each_item_once() {
        loom::model(|| {
            let pool = ComputePool::new(NonZeroUsize::new(2).unwrap());
            let counts: Vec<AtomicUsize> = (0..2).map(|_| AtomicUsize::new(0)).collect();
            let count = |range: Range<usize>| {
                for item in range {
                    counts[item].fetch_add(1, Ordering::Relaxed);
                }
            };
            pool.pass(|| {
                pool.run(2, &count);
                pool.run(2, &count);
            });
            pool.run(2, &count);
            for item in &counts {
                assert_eq!(item.load(Ordering::Relaxed), 3);
            }
        });
    }

    #[test]
    fn the_job_s_own_data_is_free_once_run_returns() {
        loom::model(|| {
            let pool = ComputePool::new(NonZeroUsize::new(2).unwrap());
            // What a job borrows: read by every call, written by the caller after `run` returns. A call
            // still running (or starting) then would race the write.
            struct Borrowed(loom::cell::UnsafeCell<usize>);
            // SAFETY: shared only as the model below uses it, which is the claim under test; loom reports
            // any access that races another.
            unsafe impl Sync for Borrowed {}
            impl Borrowed {
                fn read(&self) {
                    self.0.with(|_| ());
                }
            }
            let borrowed = Borrowed(loom::cell::UnsafeCell::new(0usize));
            for round in 1..=2 {
                pool.run(2, &|_range: Range<usize>| borrowed.read());
                borrowed.0.with_mut(|value| {
                    // SAFETY: the model's own cell; loom checks that no call of the job reads it meanwhile.
                    unsafe { *value = round };
                });
            }
        });
    }
}
