//! Bounded schedules judged on when runs fall due, not on when they start: a manager kept off the CPU
//! (stalled through the fault hook, so the lateness is certain) must not change how many runs happen.
//! Its own binary: a stalled manager delays every timer of the process.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use task_runtime::{Compute, Runtime, faults};

use common::{finishes_within, init};

/// Held by each test: a stall delays every timer of the process, so the tests take turns.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Generous bound for one of these short schedules to end, even on a loaded machine.
const FINISH_LIMIT: Duration = Duration::from_secs(20);

/// A body that notes when each of its runs starts.
fn recorder() -> (
    Arc<Mutex<Vec<Instant>>>,
    impl FnMut(()) -> usize + Send + Clone + 'static,
) {
    let starts = Arc::new(Mutex::new(Vec::new()));
    let inside = Arc::clone(&starts);
    (starts, move |()| {
        let mut starts = inside.lock().unwrap_or_else(|p| p.into_inner());
        starts.push(Instant::now());
        starts.len()
    })
}

fn runs(starts: &Mutex<Vec<Instant>>) -> Vec<Instant> {
    starts.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

#[test]
fn a_run_due_inside_the_window_runs_even_when_its_timer_fires_after_the_window() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    init();
    let (starts, body) = recorder();
    let spawned = Instant::now();
    let handle = Runtime::task(Compute::compute(body))
        .repeat()
        .every(Duration::from_millis(750))
        .for_duration(Duration::from_secs(1))
        .spawn();
    // The first run needs no timer; the second falls due at about 750 ms, and the manager sleeps through
    // it and past the window.
    faults::stall_manager(Duration::from_millis(1300));
    assert!(
        finishes_within(&handle, FINISH_LIMIT),
        "the repeat should end after its second run, but it still runs after {FINISH_LIMIT:?}"
    );
    let starts = runs(&starts);
    assert_eq!(
        starts.len(),
        2,
        "a 750 ms gap in a 1 s window falls due twice, so it should run twice however late the timer fires"
    );
    let second = starts[1] - spawned;
    assert!(
        second >= Duration::from_secs(1),
        "the stalled manager should have held the second run past the window (it started at {second:?}), \
         or this test checks nothing"
    );
}

#[test]
fn a_late_first_run_does_not_cost_a_run_that_falls_due_inside_the_window() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    init();
    let (starts, body) = recorder();
    let spawned = Instant::now();
    // Due at 100 ms and 800 ms (plus the first run's length): two runs in the 1 s window.
    let handle = Runtime::task(Compute::compute(body))
        .repeat()
        .every(Duration::from_millis(700))
        .for_duration(Duration::from_secs(1))
        .after(Duration::from_millis(100))
        .spawn();
    // The start delay's timer fires only when the manager wakes, 600 ms or more after the spawn.
    faults::stall_manager(Duration::from_millis(600));
    assert!(
        finishes_within(&handle, FINISH_LIMIT),
        "the repeat should end after its second run, but it still runs after {FINISH_LIMIT:?}"
    );
    let starts = runs(&starts);
    assert_eq!(
        starts.len(),
        2,
        "runs due at 100 ms and 800 ms should both run, even though the first started late (runs at {:?})",
        starts
            .iter()
            .map(|start| *start - spawned)
            .collect::<Vec<_>>()
    );
    let first = starts[0] - spawned;
    assert!(
        first >= Duration::from_millis(500),
        "the stalled manager should have held the first run back (it started at {first:?}), or this test \
         checks nothing"
    );
}

#[test]
fn a_series_runs_every_period_that_falls_due_inside_the_window_even_when_started_late() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    init();
    let (starts, body) = recorder();
    let spawned = Instant::now();
    // Due at 0, 300, 600 and 900 ms: four runs in the 1 s window.
    let handle = Runtime::task(Compute::compute(body))
        .at_rate(Duration::from_millis(300))
        .for_duration(Duration::from_secs(1))
        .spawn();
    // The first run needs no timer; those due at 300, 600 and 900 ms wait for the manager until 1.2 s or
    // later, and then start one after the other.
    faults::stall_manager(Duration::from_millis(1200));
    assert!(
        finishes_within(&handle, FINISH_LIMIT),
        "the series should end after its fourth run, but it still runs after {FINISH_LIMIT:?}"
    );
    let starts = runs(&starts);
    assert_eq!(
        starts.len(),
        4,
        "a 300 ms period in a 1 s window falls due four times (runs at {:?})",
        starts
            .iter()
            .map(|start| *start - spawned)
            .collect::<Vec<_>>()
    );
    let last = starts[3] - spawned;
    assert!(
        last >= Duration::from_secs(1),
        "the stalled manager should have held the last run past the window (it started at {last:?}), or \
         this test checks nothing"
    );
}
