//! Repeats and schedules: count, every, at_rate, deadlines, whichever ends first, start delays.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use task_runtime::{Compute, Runtime, RuntimeError, Sleep, TaskState};

use common::{finishes_within, init, join, wait, wait_until};

/// Generous bound for one of these short repeats to end, even on a loaded machine.
const FINISH_LIMIT: Duration = Duration::from_secs(20);

fn counter() -> (
    Arc<AtomicU32>,
    impl FnMut(()) -> u32 + Send + Clone + 'static,
) {
    let runs = Arc::new(AtomicU32::new(0));
    let inside = Arc::clone(&runs);
    (runs, move |()| inside.fetch_add(1, Ordering::SeqCst) + 1)
}

#[test]
fn a_counted_repeat_runs_exactly_that_many_times() {
    init();
    let (runs, body) = counter();
    let handle = Runtime::task(Compute::compute(body))
        .repeat()
        .count(5)
        .spawn();
    // Not `wait()`: a repeat reads Ready between its runs (the state is terminal there, as in atap), so
    // `wait` may return after any run; only `is_finished` says no run is left.
    assert!(
        finishes_within(&handle, FINISH_LIMIT),
        "a counted repeat should finish"
    );
    assert_eq!(
        join(&handle, "a repeat counted to 5"),
        Ok(5),
        "the last output should be from the fifth run"
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        5,
        "it should run exactly five times"
    );
}

#[test]
fn a_repeat_with_a_gap_holds_no_thread_between_runs() {
    init();
    let (runs, body) = counter();
    let handle = Runtime::task(Compute::compute(body))
        .repeat()
        .every(Duration::from_millis(400))
        .count(2)
        .spawn();
    std::thread::sleep(Duration::from_millis(200));
    let pool = Runtime::pool();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "one run before the gap ends"
    );
    assert_eq!(
        handle.state(),
        TaskState::Ready,
        "between runs a repeat reads Ready"
    );
    assert!(
        pool.workers.iter().all(|worker| worker.1 == 0),
        "no backlog mid-gap: {pool}"
    );
    wait(&handle, "a repeat with a 400 ms gap");
    assert!(
        finishes_within(&handle, FINISH_LIMIT),
        "the repeat should end after its second run, but it still runs after {FINISH_LIMIT:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the second run comes after the gap"
    );
}

#[test]
fn count_and_deadline_end_at_whichever_comes_first() {
    init();
    let (runs, body) = counter();
    // A 1 s window of 20 ms gaps: runs fall due every 20 ms plus the run's own few microseconds, so 50
    // fit (due at 0 to about 980 ms). The window is judged on those due times, so a late wake-up costs
    // no run (on the clock a 300 ms window once saw only two); only the runs' own lengths do, and they
    // would have to take 80% of the window to bring the count under 10.
    let handle = Runtime::task(Compute::compute(body))
        .repeat()
        .every(Duration::from_millis(20))
        .count(1000)
        .for_duration(Duration::from_secs(1))
        .spawn();
    wait_until(
        Duration::from_secs(10),
        "the deadline should end the repeat",
        || handle.is_finished(),
    );
    let count = runs.load(Ordering::SeqCst);
    assert!(
        (10..=50).contains(&count),
        "runs due inside 1 s of 20 ms gaps are at most 50, and even on a loaded machine more than 10, \
         not 1000: {count}"
    );
    let (runs, body) = counter();
    let handle = Runtime::task(Compute::compute(body))
        .repeat()
        .count(3)
        .for_duration(Duration::from_secs(60))
        .spawn();
    assert!(
        finishes_within(&handle, FINISH_LIMIT),
        "the count of 3 should end the repeat, but it still runs after {FINISH_LIMIT:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "the count should end it first"
    );
}

#[test]
fn a_bounded_duration_stops_before_the_run_that_would_overrun() {
    init();
    let (runs, body) = counter();
    // Runs fall due at 0 and 750 ms (plus the first run's microseconds); the third would fall due at
    // 1.5 s. The count is judged on those due times, so it holds however late a loaded machine starts
    // the runs (tests/late_runs.rs makes them late on purpose); it once failed when it was judged on
    // the clock.
    let handle = Runtime::task(Compute::compute(body))
        .repeat()
        .every(Duration::from_millis(750))
        .for_duration(Duration::from_secs(1))
        .spawn();
    assert!(
        finishes_within(&handle, FINISH_LIMIT),
        "the 1 s duration should end the repeat, but it still runs after {FINISH_LIMIT:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "a 750 ms gap in 1 s runs twice"
    );
}

#[test]
fn a_delayed_task_can_be_cancelled_before_it_starts() {
    init();
    let (runs, body) = counter();
    let handle = Runtime::task(Compute::compute(body))
        .after(Duration::from_millis(200))
        .spawn();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        handle.state(),
        TaskState::Pending,
        "a delayed task reads Pending"
    );
    handle.cancel();
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "a cancelled delay never runs"
    );
    assert_eq!(
        join(&handle, "a delayed task cancelled before it starts"),
        Err(RuntimeError::Cancelled)
    );
}

#[test]
fn a_start_delay_is_honoured() {
    init();
    let started = Instant::now();
    let handle = Runtime::task(Compute::compute(move |()| started.elapsed()))
        .after(Duration::from_millis(100))
        .spawn();
    let waited = join(&handle, "a task delayed 100 ms").expect("the delayed task should run");
    assert!(
        waited >= Duration::from_millis(100),
        "it should start after 100 ms: {waited:?}"
    );
}

#[test]
fn two_thousand_delayed_tasks_hold_no_threads() {
    init();
    let before = Runtime::pool();
    let handles: Vec<_> = (0..2000u32)
        .map(|index| {
            Runtime::task(Compute::compute(move |()| index))
                .after(Duration::from_millis(300))
                .spawn()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let during = Runtime::pool();
    assert!(
        during.sleep_threads <= before.sleep_threads.max(1) && during.worker_count <= during.target,
        "delays should hold no threads: before {before}, during {during}"
    );
    for (index, handle) in handles.into_iter().enumerate() {
        assert_eq!(
            join(&handle, "one of 2,000 tasks delayed 300 ms"),
            Ok(index as u32),
            "every delayed task should run"
        );
    }
}

#[test]
fn until_in_the_past_runs_once() {
    init();
    let (runs, body) = counter();
    let handle = Runtime::task(Compute::compute(body))
        .repeat()
        .until(Instant::now() - Duration::from_millis(1))
        .spawn();
    assert!(
        finishes_within(&handle, FINISH_LIMIT),
        "a deadline in the past should end the repeat after one run, but it still runs after {FINISH_LIMIT:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "a deadline in the past still runs once"
    );
}

#[test]
fn runs_of_a_repeat_never_overlap() {
    init();
    let inside = Arc::new(AtomicBool::new(false));
    let overlapped = Arc::new(AtomicBool::new(false));
    let (flag, seen) = (Arc::clone(&inside), Arc::clone(&overlapped));
    let handle = Runtime::task(Compute::compute(move |()| {
        if flag.swap(true, Ordering::SeqCst) {
            seen.store(true, Ordering::SeqCst);
        }
        std::thread::sleep(Duration::from_millis(2));
        flag.store(false, Ordering::SeqCst);
    }))
    .repeat()
    .count(30)
    .spawn();
    assert!(
        finishes_within(&handle, FINISH_LIMIT),
        "the count of 30 should end the repeat, but it still runs after {FINISH_LIMIT:?}"
    );
    assert!(
        !overlapped.load(Ordering::SeqCst),
        "two runs of one repeat overlapped"
    );
}

#[test]
fn at_rate_overlaps_its_runs() {
    init();
    // Ten runs of 1 s each, one started every 50 ms. Overlapped they all end about 1.45 s after the
    // start. With at most two in flight at a time they could not end before 5 s (five rounds of 1 s;
    // each run sleeps at least 1 s, checked below), so a series that ends before 5 s had three or more
    // runs in flight together: the bound is what overlap implies, not a guess at how fast the machine
    // wakes up. (A 3 s bound on five runs once failed when the whole test process stalled on a loaded
    // machine; with two CPU hogs and the pool pinned to one core the series still takes 1.2 to 1.6 s, so
    // the slowness was not the runtime falling behind under CPU load.)
    const RUN: Duration = Duration::from_secs(1);
    const RUNS: u32 = 10;
    let two_at_a_time = RUN * RUNS.div_ceil(2);
    let started = Instant::now();
    let handle = Runtime::task(Sleep::sleep(RUN).relaxed())
        .at_rate(Duration::from_millis(50))
        .count(u64::from(RUNS))
        .spawn();
    wait_until(Duration::from_secs(30), "the series should end", || {
        handle.is_finished()
    });
    let total = started.elapsed();
    let slept = join(&handle, "a series of ten 1 s sleeps")
        .expect("the series should leave the last output");
    assert!(
        slept >= RUN,
        "the last run slept only {slept:?} of its {RUN:?}, so the series' time says nothing about overlap"
    );
    assert!(
        total < two_at_a_time,
        "ten 1 s runs started every 50 ms should overlap (about 1.45 s in all), but the series took \
         {total:?}, no less than with at most two runs in flight ({two_at_a_time:?}); its last run slept \
         {slept:?}"
    );
}

#[test]
fn at_rate_with_count_zero_reads_task_failed() {
    init();
    let handle = Runtime::task(Compute::compute(|()| 1))
        .at_rate(Duration::from_millis(10))
        .count(0)
        .spawn();
    assert_eq!(
        join(&handle, "a series counted to 0"),
        Err(RuntimeError::TaskFailed),
        "a series of no runs fails"
    );
}

#[test]
fn a_wrong_but_valid_looking_chain_still_compiles_where_it_should() {
    init();
    // The positive control for the compile_fail doctests: the same options in a valid order compile.
    let handle = Runtime::task(Compute::compute(|()| 3))
        .priority(200)
        .repeat()
        .every(Duration::from_millis(1))
        .count(2)
        .timeout(Duration::from_secs(5))
        .after(Duration::from_millis(1))
        .spawn();
    assert!(
        finishes_within(&handle, FINISH_LIMIT),
        "the count of 2 should end the repeat, but it still runs after {FINISH_LIMIT:?}"
    );
    assert_eq!(
        join(&handle, "a repeat with every option in a valid order"),
        Ok(3)
    );
}
