//! Wake-ups of parked workers: tasks spawned from outside the pool while its workers park and unpark start
//! promptly (a lost wake-up would leave a task queued behind sleeping workers).

mod common;

use std::time::{Duration, Instant};

use task_runtime::{Compute, Runtime};

use common::{init, join_thread_within};

/// Far above a wake-up on a loaded 2-core machine (tens of microseconds to a few milliseconds), and far
/// below what a lost wake-up costs: workers at the floor park without a timeout, so such a task would
/// wait for an unrelated spawn, and the spawns here are one at a time per thread.
const START_BOUND: Duration = Duration::from_millis(500);

#[test]
fn tasks_spawned_from_outside_while_workers_park_each_start_within_half_a_second() {
    init();
    // Two spawning threads (two pushers racing each other and the parking workers), each spawning one
    // short task at a time with gaps of 0 to 90 µs, so pushes land at every point of a worker's way from
    // its last task into its futex wait.
    let spawners: Vec<_> = (0..2u64)
        .map(|spawner| {
            std::thread::spawn(move || {
                let mut slowest = Duration::ZERO;
                for round in 0..5000u64 {
                    let gap = Duration::from_micros((round + spawner * 3) % 7 * 15);
                    if !gap.is_zero() {
                        std::thread::sleep(gap);
                    }
                    let spawned = Instant::now();
                    let handle =
                        Runtime::task(Compute::compute(move |()| spawned.elapsed())).spawn();
                    let waited = handle
                        .join_with_timeout(Duration::from_secs(10))
                        .unwrap_or_else(|error| {
                            panic!(
                                "task {round} of spawner {spawner} did not run within 10 s of its \
                                 spawn ({error}); a parked worker was not woken for it"
                            )
                        });
                    assert!(
                        waited < START_BOUND,
                        "task {round} of spawner {spawner} started {waited:?} after its spawn; a \
                         parked worker was not woken for it"
                    );
                    slowest = slowest.max(waited);
                }
                slowest
            })
        })
        .collect();
    for spawner in spawners {
        let slowest = join_thread_within(spawner, Duration::from_secs(60), "a spawning thread")
            .expect("a spawning thread panicked; see its message above");
        assert!(slowest < START_BOUND, "the slowest start took {slowest:?}");
    }
}
