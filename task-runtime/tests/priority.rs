//! Priority: a priority-255 task overtakes a deep queue of default-priority work.

mod common;

use std::time::{Duration, Instant};

use task_runtime::{Compute, Runtime};

use common::join;

#[test]
fn a_priority_255_task_overtakes_a_deep_queue() {
    Runtime::builder().cores(2).init().expect("init");
    let batch_started = Instant::now();
    let queued: Vec<_> = (0..10_000)
        .map(|_| {
            Runtime::task(Compute::compute(|()| {
                let until = Instant::now() + Duration::from_micros(50);
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
            }))
            .spawn()
        })
        .collect();
    let spawned = Instant::now();
    let urgent = Runtime::task(Compute::compute(move |()| spawned.elapsed()))
        .priority(255)
        .spawn();
    let waited = join(&urgent, "the priority-255 task").expect("the urgent task should run");
    for handle in queued {
        join(&handle, "a queued 50 µs compute").expect("queued work should finish");
    }
    let batch = batch_started.elapsed();
    assert!(
        waited * 4 < batch,
        "the urgent task waited {waited:?}, not well under the batch's {batch:?}"
    );
}
