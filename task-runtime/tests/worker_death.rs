//! Thread death: workers that die strand nothing and the pool heals.

use std::time::Duration;

use task_runtime::{Compute, Runtime, faults};

#[test]
fn dying_workers_strand_nothing() {
    // No hook to quiet: an injected death unwinds through `resume_unwind`, which calls no panic hook, so any
    // panic message printed here is one nobody planned.
    Runtime::builder().cores(2).init().expect("init");
    let handles: Vec<_> = (0..2000u32)
        .map(|index| Runtime::task(Compute::compute(move |()| index)).spawn())
        .collect();
    faults::kill_workers(2);
    for (index, handle) in handles.into_iter().enumerate() {
        assert_eq!(
            handle.join_with_timeout(Duration::from_secs(20)),
            Ok(index as u32),
            "a task queued while workers died should still run"
        );
    }
    std::thread::sleep(Duration::from_millis(50));
    let pool = Runtime::pool();
    assert!(pool.deaths >= 2, "two deaths should be recorded: {pool}");
    assert!(
        pool.worker_count >= pool.floor,
        "the floor is restored: {pool}"
    );
    assert!(Runtime::healthy());
}
