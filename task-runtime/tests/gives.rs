//! Gives and receives: newest value wins, a give mid-run owes one run, gathers, give_to fan-out, pipelines.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use task_runtime::{Compute, Runtime, RuntimeError, TaskHandle};

use common::{init, join, wait_until};

/// Generous bound for a give's run to start or end, even on a loaded machine.
const RUN_LIMIT: Duration = Duration::from_secs(10);

#[test]
fn nothing_runs_before_the_first_give_and_each_give_runs_once() {
    init();
    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    let handle = Runtime::task(Compute::compute(move |value: u32| {
        counted.fetch_add(1, Ordering::SeqCst);
        value * 2
    }))
    .wait_for::<u32>()
    .spawn();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing runs before a give");
    assert!(handle.is_pending(), "a waiting task reads Pending");
    handle.give(5).expect("give");
    assert_eq!(
        join(&handle, "the run after the first give"),
        Ok(10),
        "the give should run it with 5"
    );
    handle.give(7).expect("give");
    wait_until(RUN_LIMIT, "the second give should run the task", || {
        runs.load(Ordering::SeqCst) == 2
    });
    wait_until(RUN_LIMIT, "the task should wait again", || {
        handle.is_waiting()
    });
    assert_eq!(
        join(&handle, "the run after the second give"),
        Ok(14),
        "the second give runs it again"
    );
}

#[test]
fn a_give_during_a_run_leaves_one_more_run_with_the_newest_value() {
    init();
    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    let handle = Runtime::task(Compute::compute(move |value: u32| {
        counted.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(100));
        value
    }))
    .wait_for::<u32>()
    .spawn();
    handle.give(1).expect("give");
    wait_until(RUN_LIMIT, "the first run should start", || {
        runs.load(Ordering::SeqCst) == 1
    });
    handle.give(2).expect("give");
    handle.give(3).expect("give");
    wait_until(RUN_LIMIT, "the owed run should come", || {
        runs.load(Ordering::SeqCst) == 2
    });
    wait_until(RUN_LIMIT, "the task should go idle", || handle.is_waiting());
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "two gives mid-run owe exactly one run"
    );
    assert_eq!(
        join(&handle, "the owed run"),
        Ok(3),
        "the owed run uses the newest value"
    );
}

#[test]
fn a_give_to_a_cancelled_task_is_refused() {
    init();
    let handle = Runtime::task(Compute::compute(|value: u8| value))
        .wait_for::<u8>()
        .spawn();
    handle.cancel();
    assert_eq!(
        handle.give(1),
        Err(RuntimeError::Cancelled),
        "a cancelled task refuses gives"
    );
}

#[test]
fn a_counted_waiting_task_settles_after_that_many_gives() {
    init();
    let handle = Runtime::task(Compute::compute(|value: u32| value))
        .wait_for::<u32>()
        .count(2)
        .spawn();
    handle.give(1).expect("give");
    wait_until(RUN_LIMIT, "the first run should end", || {
        handle.is_waiting() || handle.is_finished()
    });
    wait_until(RUN_LIMIT, "the first output should be 1", || {
        join(&handle, "the first counted run") == Ok(1)
    });
    handle.give(2).expect("give");
    wait_until(RUN_LIMIT, "the task should finish after two gives", || {
        handle.is_finished()
    });
    assert_eq!(join(&handle, "the second counted run"), Ok(2));
    assert_eq!(
        handle.give(3),
        Err(RuntimeError::Finished),
        "a finished task refuses gives"
    );
}

#[test]
fn receive_gathers_tuples_vecs_and_nested_sets() {
    init();
    let first = Runtime::task(Compute::compute(|()| 1u32)).spawn();
    let second = Runtime::task(Compute::compute(|()| String::from("two"))).spawn();
    let third = Runtime::task(Compute::compute(|()| 3u64)).spawn();
    let gathered = Runtime::task(Compute::compute(|(a, (b, c)): (u32, (String, u64))| {
        format!("{a}-{b}-{c}")
    }))
    .receive((first.clone(), (second, third)))
    .spawn();
    assert_eq!(
        join(&gathered, "the task gathering a nested tuple"),
        Ok(String::from("1-two-3")),
        "a nested tuple gathers in shape"
    );

    let many: Vec<TaskHandle<u64>> = (0..1000u64)
        .map(|index| Runtime::task(Compute::compute(move |()| index)).spawn())
        .collect();
    let sum = Runtime::task(Compute::compute(|values: Vec<u64>| {
        values.iter().sum::<u64>()
    }))
    .receive(many)
    .spawn();
    assert_eq!(
        join(&sum, "the task gathering 1,000 outputs"),
        Ok(499_500),
        "a Vec of 1,000 gathers every output"
    );

    let array = Runtime::task(Compute::compute(|values: Vec<u32>| values.len()))
        .receive([first.clone(), first])
        .spawn();
    assert_eq!(
        join(&array, "the task gathering an array"),
        Ok(2),
        "arrays gather too"
    );

    let empty = Runtime::task(Compute::compute(|()| 9u8))
        .receive(())
        .spawn();
    assert_eq!(
        join(&empty, "the task gathering an empty set"),
        Ok(9),
        "an empty set runs once"
    );
}

#[test]
fn a_failing_source_writes_the_receiver_off() {
    init();
    let failing = Runtime::task(Compute::compute(|()| -> u32 {
        panic!("source fails on purpose")
    }))
    .spawn();
    let receiver = Runtime::task(Compute::compute(|value: u32| value))
        .receive(failing)
        .spawn();
    assert_eq!(
        join(&receiver, "the receiver of a failing source"),
        Err(RuntimeError::TaskFailed),
        "the receiver is written off"
    );
    let cancelled = Runtime::task(Compute::compute(|value: u32| value))
        .wait_for::<u32>()
        .spawn();
    let downstream = Runtime::task(Compute::compute(|value: u32| value))
        .receive(cancelled.clone())
        .spawn();
    cancelled.cancel();
    assert_eq!(
        downstream.join_with_timeout(Duration::from_secs(10)),
        Err(RuntimeError::TaskFailed),
        "a cancelled source writes the receiver off"
    );
}

#[test]
fn give_to_fans_out_to_every_target() {
    init();
    let doubled = Runtime::task(Compute::compute(|value: u32| value * 2))
        .wait_for::<u32>()
        .spawn();
    let tripled = Runtime::task(Compute::compute(|value: u32| value * 3))
        .wait_for::<u32>()
        .spawn();
    let source = Runtime::task(Compute::compute(|()| 7u32))
        .give_to(&doubled)
        .give_to(&tripled)
        .spawn();
    assert_eq!(join(&source, "the source giving to two targets"), Ok(7));
    assert_eq!(
        join(&doubled, "the first give_to target"),
        Ok(14),
        "the first target gets the output"
    );
    assert_eq!(
        join(&tripled, "the second give_to target"),
        Ok(21),
        "the second target gets it too"
    );
}

#[test]
fn a_thousand_stage_pipeline_carries_a_value_through() {
    init();
    let last = Runtime::task(Compute::compute(|value: u64| value))
        .wait_for::<u64>()
        .spawn();
    let mut next = last.clone();
    let mut stages = vec![last.clone()];
    for _ in 0..999 {
        let stage = Runtime::task(Compute::compute(|value: u64| value + 1))
            .wait_for::<u64>()
            .give_to(&next)
            .spawn();
        next = stage.clone();
        stages.push(stage);
    }
    next.give(0).expect("give to the first stage");
    assert_eq!(
        last.join_with_timeout(Duration::from_secs(30)),
        Ok(999),
        "999 increments should arrive at the last stage"
    );
    stages.iter().for_each(TaskHandle::cancel);
}

#[test]
fn waiting_tasks_in_recycled_slots_still_run_on_a_give() {
    init();
    // Fire-and-forget tasks free their slots as they finish; waiting tasks then reuse those slots.
    // A late scheduling mark left by a finished task must not stop the new task from running.
    for round in 0..20u64 {
        for index in 0..200u64 {
            drop(Runtime::task(Compute::compute(move |()| round + index)).spawn());
        }
        let waiting: Vec<_> = (0..50u64)
            .map(|_| {
                Runtime::task(Compute::compute(|value: u64| value + 1))
                    .wait_for::<u64>()
                    .spawn()
            })
            .collect();
        for (index, handle) in waiting.iter().enumerate() {
            handle.give(index as u64).expect("give");
        }
        for (index, handle) in waiting.iter().enumerate() {
            assert_eq!(
                handle.join_with_timeout(Duration::from_secs(10)),
                Ok(index as u64 + 1),
                "round {round}: a waiting task in a recycled slot did not run"
            );
            handle.cancel();
        }
    }
}
