//! Timeouts: per run, an overrun ends a repeat, the start delay does not count, cancel keeps TimedOut.

mod common;

use std::time::{Duration, Instant};

use task_runtime::{Compute, Runtime, RuntimeError, Sleep, TaskState};

use common::{init, join, wait_until};

#[test]
fn a_slow_compute_and_a_long_sleep_time_out() {
    init();
    // The compute runs 3 s so that "settles without waiting" has seconds of room on a loaded machine.
    let slow = Runtime::task(Compute::compute(|()| {
        std::thread::sleep(Duration::from_secs(3))
    }))
    .timeout(Duration::from_millis(50))
    .spawn();
    let started = Instant::now();
    assert_eq!(
        join(&slow, "a 3 s compute with a 50 ms timeout"),
        Err(RuntimeError::TimedOut),
        "the compute should time out"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the timeout settles without waiting for the compute"
    );
    let sleep = Runtime::task(Sleep::sleep(Duration::from_secs(30)))
        .timeout(Duration::from_millis(50))
        .spawn();
    assert_eq!(
        sleep.join_with_timeout(Duration::from_secs(5)),
        Err(RuntimeError::TimedOut),
        "the parked sleep should time out"
    );
    assert_eq!(sleep.state(), TaskState::TimedOut);
    sleep.cancel();
    assert_eq!(
        sleep.state(),
        TaskState::TimedOut,
        "a cancel after a timeout keeps TimedOut"
    );
}

#[test]
fn the_limit_is_per_run_and_an_overrun_ends_a_repeat() {
    init();
    let mut run = 0u32;
    let handle = Runtime::task(Compute::compute(move |()| {
        run += 1;
        if run == 4 {
            std::thread::sleep(Duration::from_millis(300));
        } else {
            std::thread::sleep(Duration::from_millis(20));
        }
        run
    }))
    .repeat()
    .count(10)
    .timeout(Duration::from_millis(100))
    .spawn();
    wait_until(Duration::from_secs(10), "the repeat should end", || {
        handle.is_finished()
    });
    assert_eq!(
        join(&handle, "a repeat whose fourth run overruns"),
        Err(RuntimeError::TimedOut),
        "three 20 ms runs fit a 100 ms limit each; the fourth overruns and ends the repeat"
    );
}

#[test]
fn the_start_delay_is_not_counted() {
    init();
    // The limit is generous for an instant compute (a preempted worker on a loaded 2-core machine
    // can lose 50 ms between start and publish) and the delay is three times the limit.
    let handle = Runtime::task(Compute::compute(|()| 5))
        .timeout(Duration::from_millis(500))
        .after(Duration::from_millis(1500))
        .spawn();
    assert_eq!(
        join(&handle, "a compute delayed 1.5 s with a 500 ms limit"),
        Ok(5),
        "a 1.5 s delay does not count against a 500 ms limit"
    );
}

#[test]
fn a_waiting_task_is_limited_only_while_running() {
    init();
    let handle = Runtime::task(Compute::compute(|value: u32| value))
        .wait_for::<u32>()
        .timeout(Duration::from_millis(500))
        .spawn();
    // Waits three times the limit; the limit itself is generous for an instant compute under load.
    std::thread::sleep(Duration::from_millis(1500));
    handle.give(4).expect("give");
    wait_until(Duration::from_secs(5), "the give should run", || {
        handle.try_join().is_ok()
    });
    assert_eq!(
        join(&handle, "a waiting task given 4 after 1.5 s"),
        Ok(4),
        "waiting 1.5 s for a give is not a timeout"
    );
}
