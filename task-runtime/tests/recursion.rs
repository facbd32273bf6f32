//! Recursion: recursive splits and chains deeper than the help depth finish with the right results.
//!
//! The joins inside tasks are plain `join` on purpose (nested helping joins on workers are what these
//! tests check); the test thread's own joins have deadlines, so a nested join that hangs still fails.

mod common;

use std::time::Duration;

use task_runtime::{Compute, Runtime, RuntimeError};

use common::join;

fn fibonacci(n: u64) -> u64 {
    if n < 2 {
        return n;
    }
    let left = Runtime::task(Compute::compute(move |()| fibonacci(n - 1))).spawn();
    let right = fibonacci(n - 2);
    // deadline: the test thread's timed join of the whole computation.
    left.join().unwrap_or(0) + right
}

fn chain(depth: u32) -> u32 {
    if depth == 0 {
        return 0;
    }
    let link = Runtime::task(Compute::compute(move |()| chain(depth - 1) + 1)).spawn();
    // deadline: the test thread's timed join of the whole chain.
    link.join().unwrap_or(u32::MAX)
}

#[test]
fn recursive_splits_and_chains_past_the_help_depth_finish() {
    match Runtime::builder().cores(2).init() {
        Ok(()) | Err(RuntimeError::AlreadyInit) => {}
        Err(error) => panic!("{error}"),
    }
    assert_eq!(
        Runtime::task(Compute::compute(|()| fibonacci(18)))
            .spawn()
            .join_with_timeout(Duration::from_secs(60)),
        Ok(2584),
        "fib(18) with a task per call"
    );
    // Chains deeper than the help depth (64 by default, lowered to 4 here) need replacement workers.
    task_runtime::faults::set_help_depth(4);
    let chains: Vec<_> = (0..2)
        .map(|_| Runtime::task(Compute::compute(|()| chain(80))).spawn())
        .collect();
    for handle in chains {
        assert_eq!(
            handle.join_with_timeout(Duration::from_secs(60)),
            Ok(80),
            "a chain of 80 nested joins should finish"
        );
    }
    let pool = Runtime::pool();
    assert!(
        pool.peak_workers > pool.floor,
        "blocked chains should have grown the pool: {pool}"
    );
    assert!(
        pool.peak_workers <= pool.ceiling,
        "within the ceiling: {pool}"
    );
}

#[test]
fn block_inside_a_compute_works() {
    match Runtime::builder().cores(2).init() {
        Ok(()) | Err(RuntimeError::AlreadyInit) => {}
        Err(error) => panic!("{error}"),
    }
    let outer = Runtime::task(Compute::compute(|()| {
        Runtime::block(Compute::compute(|()| 6)).unwrap_or(0) * 7
    }))
    .spawn();
    assert_eq!(join(&outer, "a compute that calls Runtime::block"), Ok(42));
}
