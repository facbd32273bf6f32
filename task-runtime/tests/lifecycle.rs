//! Lifecycle: spawn before init, shutdown drains then refuses, block still works, init again works.

mod common;

use std::time::{Duration, Instant};

use task_runtime::{Compute, Runtime, RuntimeError, Sleep};

use common::{join, wait, wait_until, within};

// One test function: the runtime is process-wide and these steps must run in order.
#[test]
fn the_runtime_lifecycle_behaves_over_two_cycles() {
    let early = Runtime::task(Compute::compute(|()| 1)).spawn();
    assert_eq!(
        join(&early, "a spawn before init"),
        Err(RuntimeError::NotInitialised),
        "a spawn before init says so"
    );
    assert!(!Runtime::initialised());

    assert_eq!(
        Runtime::builder().workers_per_core(0).init(),
        Err(RuntimeError::BadArgument),
        "a zero worker count is refused"
    );
    assert_eq!(
        Runtime::builder().worker_stack(1024).init(),
        Err(RuntimeError::BadArgument),
        "a tiny stack is refused"
    );

    for cycle in 0..2 {
        Runtime::builder()
            .cores(2)
            .workers_per_core(3)
            .sleep_threads_per_core(2)
            .init()
            .expect("init");
        assert_eq!(
            Runtime::init(),
            Err(RuntimeError::AlreadyInit),
            "a second init is refused"
        );
        assert!(Runtime::healthy(), "a fresh runtime is healthy");
        let pool = Runtime::pool();
        assert_eq!(pool.target, 6, "tuned sizes reach the pool: {pool}");
        assert_eq!(pool.sleep_target, 4, "tuned sizes reach the pool: {pool}");

        // 2,000 mixed sleeps and computes are drained by shutdown.
        let handles: Vec<_> = (0..2000u64)
            .map(|index| {
                if index % 2 == 0 {
                    Runtime::task(Sleep::sleep(Duration::from_millis(1 + index % 50)).relaxed())
                        .spawn()
                } else {
                    Runtime::task(Sleep::sleep(Duration::ZERO)).spawn()
                }
            })
            .collect();
        let counted = Runtime::task(Compute::compute(|()| 1))
            .repeat()
            .every(Duration::from_millis(5))
            .count(3)
            .after(Duration::from_millis(5))
            .spawn();
        wait_until(
            Duration::from_secs(10),
            &format!("cycle {cycle}: the repeat should finish"),
            || counted.is_finished(),
        );
        assert_eq!(
            join(&counted, "a delayed, counted repeat"),
            Ok(1),
            "delayed, counted repeats work in cycle {cycle}"
        );
        // Let queued work reach its parks, then shut down: parked sleeps still queued or parked
        // are either finished or written off, never left pending.
        for handle in &handles[..100] {
            wait(handle, "one of the first 100 sleeps");
        }
        let shutdown_started = Instant::now();
        within(&format!("the shutdown of cycle {cycle}"), Runtime::shutdown);
        assert!(
            shutdown_started.elapsed() < Duration::from_secs(30),
            "shutdown should finish promptly"
        );
        for handle in &handles {
            assert!(
                handle.is_settled(),
                "after shutdown no task is left pending"
            );
        }
        let finished = handles
            .iter()
            .filter(|handle| join(handle, "a sleep settled by shutdown").is_ok())
            .count();
        assert!(
            finished >= 1000,
            "queued work drains: only {finished} of 2000 finished"
        );

        within("a second shutdown", Runtime::shutdown);
        assert!(!Runtime::initialised(), "shutdown is idempotent");
        let late = Runtime::task(Compute::compute(|()| 1)).spawn();
        assert_eq!(
            join(&late, "a spawn after shutdown"),
            Err(RuntimeError::TaskFailed),
            "a spawn after shutdown fails"
        );
        assert_eq!(
            within("Runtime::block of a compute after shutdown", || {
                Runtime::block(Compute::compute(|()| 5))
            }),
            Ok(5),
            "block still works after shutdown"
        );
        let slept = within("Runtime::block of a 2 ms sleep after shutdown", || {
            Runtime::block(Sleep::sleep(Duration::from_millis(2)))
        })
        .expect("sleep");
        assert!(
            slept >= Duration::from_millis(2),
            "a blocked sleep works after shutdown"
        );
        assert_eq!(Runtime::pool().worker_count, 0, "no worker is left");
    }
}
