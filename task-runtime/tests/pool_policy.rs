//! Pool policy: stuck workers make the pool grow, blocking work gets its own threads, idle threads are reaped.

use std::time::{Duration, Instant};

use task_runtime::{Compute, Runtime};

#[test]
fn the_pool_grows_for_stuck_workers_and_shrinks_back_when_idle() {
    Runtime::builder()
        .cores(2)
        .workers_per_core(4)
        .init()
        .expect("init");
    let floor = Runtime::pool().floor;

    // Eight computes that hold their worker for 300 ms each: two workers would need 1.2 s.
    let started = Instant::now();
    let holders: Vec<_> = (0..8)
        .map(|_| {
            Runtime::task(Compute::compute(|()| {
                std::thread::sleep(Duration::from_millis(300))
            }))
            .spawn()
        })
        .collect();
    for holder in holders {
        holder.join().expect("holder");
    }
    let took = started.elapsed();
    let pool = Runtime::pool();
    assert!(
        pool.peak_workers > floor,
        "stuck workers should grow the pool: {pool}"
    );
    assert!(
        pool.peak_workers <= pool.target,
        "growth stays within the target here: {pool}"
    );
    assert!(
        took < Duration::from_millis(1100),
        "grown workers should finish 8 x 300 ms well under the 1.2 s two workers need: {took:?}"
    );

    // Blocking computes run on blocking threads in parallel, not on workers.
    let started = Instant::now();
    let blocking: Vec<_> = (0..8)
        .map(|_| {
            Runtime::task(
                Compute::compute(|()| std::thread::sleep(Duration::from_millis(200))).blocking(),
            )
            .spawn()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let during = Runtime::pool();
    for handle in blocking {
        handle.join().expect("blocking");
    }
    let took = started.elapsed();
    assert!(
        during.sleep_threads >= 4,
        "blocking work should start blocking threads: {during}"
    );
    assert!(
        took < Duration::from_millis(800),
        "8 x 200 ms blocking computes should overlap: {took:?}"
    );

    // Idle threads are reaped: workers back to the floor, blocking threads gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pool = Runtime::pool();
        if pool.worker_count == floor && pool.sleep_threads == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "idle threads should be reaped: {pool}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
