//! Panics: a panicking task fails alone and its neighbours finish; a flood of panics leaves others correct.

mod common;

use task_runtime::{Compute, Runtime, RuntimeError, TaskState};

use common::{init, join};

/// The panics both tests cause on purpose; each test quiets all of them, since the two run at once and a
/// panic hook is process-wide.
const PLANNED_PANICS: &[&str] = &["on purpose", "child fails", "flood"];

#[test]
fn a_panicking_task_fails_alone_and_its_neighbours_finish() {
    init();
    common::quiet_expected_panics(PLANNED_PANICS);
    let before: Vec<_> = (0..10u32)
        .map(|index| Runtime::task(Compute::compute(move |()| index)).spawn())
        .collect();
    let panicking = Runtime::task(Compute::compute(|()| -> u32 { panic!("on purpose") })).spawn();
    let after: Vec<_> = (10..20u32)
        .map(|index| Runtime::task(Compute::compute(move |()| index)).spawn())
        .collect();
    assert_eq!(
        join(&panicking, "the panicking compute"),
        Err(RuntimeError::TaskFailed),
        "the panic should fail the task"
    );
    assert_eq!(panicking.state(), TaskState::Failed);
    for (index, handle) in before.into_iter().chain(after).enumerate() {
        assert_eq!(
            join(&handle, "a neighbour of the panicking compute"),
            Ok(index as u32),
            "a neighbour of the panic should finish"
        );
    }
}

#[test]
fn a_parent_sees_its_child_panic_and_a_flood_of_panics_leaves_the_rest_correct() {
    init();
    common::quiet_expected_panics(PLANNED_PANICS);
    let parent = Runtime::task(Compute::compute(|()| {
        let child = Runtime::task(Compute::compute(|()| -> u8 { panic!("child fails") })).spawn();
        // deadline: the test's own join of the parent bounds this join on a worker (what it checks).
        child.join()
    }))
    .spawn();
    assert_eq!(
        join(&parent, "the parent joining its panicking child"),
        Ok(Err(RuntimeError::TaskFailed)),
        "the parent sees the failure"
    );
    let handles: Vec<_> = (0..2000u32)
        .map(|index| {
            Runtime::task(Compute::compute(move |()| {
                if index % 2 == 0 {
                    panic!("flood");
                }
                index
            }))
            .spawn()
        })
        .collect();
    for (index, handle) in handles.into_iter().enumerate() {
        let result = join(&handle, "a task of the panic flood");
        if index % 2 == 0 {
            assert_eq!(result, Err(RuntimeError::TaskFailed), "even tasks panic");
        } else {
            assert_eq!(
                result,
                Ok(index as u32),
                "odd tasks are untouched by the flood"
            );
        }
    }
    assert!(
        Runtime::healthy(),
        "the pool should stay healthy after a flood of panics"
    );
}
