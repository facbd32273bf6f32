//! Refused thread starts: when the system will not create a pool thread, the pool keeps no record of
//! it, counts the refusal, retries later with a backoff, and its tasks still run and its shutdown still ends.

use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use task_runtime::{Compute, PoolStatus, Runtime, faults};

/// The runtime is process-wide: the tests of this binary take turns.
static SERIAL: Mutex<()> = Mutex::new(());

/// Generous bound for anything that should take milliseconds (the machine may be loaded).
const PATIENCE: Duration = Duration::from_secs(10);

/// How long starts stay refused in the backoff test.
const REFUSAL_WINDOW: Duration = Duration::from_secs(3);

/// Most start attempts the backoff allows in `REFUSAL_WINDOW`, with room for racing callers.
const MOST_ATTEMPTS_IN_WINDOW: u64 = 16;

/// Starts a runtime of two workers that does not grow past them (floor and target both 2).
fn start_small_runtime() {
    Runtime::builder()
        .cores(2)
        .workers_per_core(1)
        .init()
        .expect("init");
}

/// Refuses every pool thread start while it lives, so a failing test does not leave the hook on.
struct RefusingStarts;

impl RefusingStarts {
    fn begin() -> Self {
        faults::refuse_thread_starts(u32::MAX / 2);
        RefusingStarts
    }
}

impl Drop for RefusingStarts {
    fn drop(&mut self) {
        faults::stop_refusing_thread_starts();
    }
}

/// Threads of this process whose name is `name` (pool threads name themselves).
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("read /proc/self/task")
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// Polls the pool until `settled` holds, for at most `PATIENCE`; returns the last snapshot.
fn wait_for_pool(settled: impl Fn(&PoolStatus) -> bool) -> PoolStatus {
    let started = Instant::now();
    loop {
        let pool = Runtime::pool();
        if settled(&pool) || started.elapsed() > PATIENCE {
            return pool;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Makes one worker die and waits until the pool has counted that death.
fn kill_one_worker() {
    faults::kill_workers(1);
    let pool = wait_for_pool(|pool| pool.deaths >= 1);
    assert_eq!(
        pool.deaths, 1,
        "the injected death should be counted: {pool}"
    );
}

/// Spawns `count` computes and checks each returns its own value.
fn tasks_still_run(count: u32) {
    let handles: Vec<_> = (0..count)
        .map(|index| Runtime::task(Compute::compute(move |()| index * 3)).spawn())
        .collect();
    for (index, handle) in (0..count).zip(handles) {
        assert_eq!(
            handle.join_with_timeout(PATIENCE),
            Ok(index * 3),
            "task {index} should run although a pool thread could not be started"
        );
    }
}

/// Shuts the runtime down on another thread and fails if that takes longer than `PATIENCE`.
fn shutdown_ends() {
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        Runtime::shutdown();
        let _ = done.send(());
    });
    assert!(
        finished.recv_timeout(PATIENCE).is_ok(),
        "shutdown should end after a refused thread start, but it still runs after {PATIENCE:?}"
    );
}

#[test]
fn a_refused_worker_replacement_leaves_no_dead_worker_in_the_pool() {
    let _turn = SERIAL.lock().unwrap_or_else(|poison| poison.into_inner());
    start_small_runtime();
    // One worker dies; the pool's first try to replace it is refused, a later tick's try succeeds.
    faults::refuse_thread_starts(1);
    kill_one_worker();
    tasks_still_run(200);
    let pool = wait_for_pool(|pool| {
        pool.worker_count == pool.floor && threads_named("task-worker") == pool.floor
    });
    assert_eq!(
        pool.worker_count, pool.floor,
        "the pool should list exactly its floor of workers, not a worker whose thread never started: {pool}"
    );
    assert_eq!(
        threads_named("task-worker"),
        pool.worker_count,
        "every worker the pool lists should be a running thread: {pool}"
    );
    shutdown_ends();
}

#[test]
fn a_refused_start_at_init_is_retried_and_tasks_still_run() {
    let _turn = SERIAL.lock().unwrap_or_else(|poison| poison.into_inner());
    // The first worker of a fresh pool cannot be started.
    faults::refuse_thread_starts(1);
    start_small_runtime();
    tasks_still_run(200);
    let pool = wait_for_pool(|pool| pool.worker_count == pool.floor);
    assert_eq!(
        pool.worker_count, pool.floor,
        "the pool should restore its floor after a refused start: {pool}"
    );
    assert!(Runtime::healthy(), "the runtime should be healthy: {pool}");
    shutdown_ends();
}

#[test]
fn a_refused_blocking_thread_start_is_retried_and_the_blocking_task_runs() {
    let _turn = SERIAL.lock().unwrap_or_else(|poison| poison.into_inner());
    start_small_runtime();
    // No blocking thread runs yet, so this task's push starts one, and that start is refused.
    faults::refuse_thread_starts(1);
    let handle = Runtime::task(Compute::compute(|()| 7).blocking()).spawn();
    assert_eq!(
        handle.join_with_timeout(PATIENCE),
        Ok(7),
        "a blocking task should run although its first blocking thread could not be started"
    );
    let pool = Runtime::pool();
    assert!(
        pool.peak_sleep_threads >= 1,
        "the blocking thread that ran the task should be counted: {pool}"
    );
    shutdown_ends();
}

#[test]
fn starts_refused_for_a_while_are_retried_with_backoff_and_the_pool_recovers() {
    let _turn = SERIAL.lock().unwrap_or_else(|poison| poison.into_inner());
    start_small_runtime();
    // Every start is refused until the test says otherwise (or fails); one of the two workers dies.
    let refusing = RefusingStarts::begin();
    kill_one_worker();
    let window_started = Instant::now();
    let attempts_before = faults::thread_start_attempts();
    // The one worker left runs everything while the replacement is refused.
    tasks_still_run(200);
    std::thread::sleep(REFUSAL_WINDOW.saturating_sub(window_started.elapsed()));
    let attempts = faults::thread_start_attempts() - attempts_before;
    // Retrying every 10 ms tick would make about 300 attempts in the window; a backoff that doubles
    // from 10 ms to 1 s makes 8 or 9. The bound leaves room for two callers racing past the gate.
    assert!(
        (1..=MOST_ATTEMPTS_IN_WINDOW).contains(&attempts),
        "a refused start should be retried, but with backoff: {attempts} attempts in {REFUSAL_WINDOW:?}, \
         expected 1 to {MOST_ATTEMPTS_IN_WINDOW}"
    );
    let pool = Runtime::pool();
    assert!(
        pool.refused_starts >= attempts,
        "every refused start should be reported in the pool status ({attempts} in the window): {pool}"
    );
    assert_eq!(
        pool.worker_count, 1,
        "only the surviving worker should be listed while starts are refused: {pool}"
    );
    drop(refusing);
    // The next retry comes at most the longest backoff (1 s) later.
    let pool = wait_for_pool(|pool| pool.worker_count == pool.floor);
    assert_eq!(
        pool.worker_count, pool.floor,
        "the pool should restore its floor once starts succeed again: {pool}"
    );
    tasks_still_run(200);
    shutdown_ends();
}
