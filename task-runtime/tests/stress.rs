//! Stress: thousands of mixed tasks while workers die and the manager faults; nothing is lost or crossed.

mod common;

use std::time::{Duration, Instant};

use task_runtime::{Channel, Compute, Runtime, RuntimeError, Sleep, TaskHandle, faults};

enum Expect {
    Value(TaskHandle<u64>, u64),
    Failed(TaskHandle<u64>),
    Slept(TaskHandle<Duration>, Duration),
}

#[test]
fn mixed_work_survives_worker_deaths_and_manager_faults() {
    std::panic::set_hook(Box::new(|_| {}));
    Runtime::builder().cores(2).init().expect("init");
    let started = Instant::now();
    let mut expectations = Vec::new();
    let mut round = 0u64;
    let (sender, receiver) = Channel::unbounded::<u64>();
    let mut receives = Vec::new();
    let mut last_kill = Instant::now();
    let mut last_fault = Instant::now();
    while started.elapsed() < Duration::from_secs(4) {
        round += 1;
        for index in 0..200u64 {
            let key = round * 1_000 + index;
            let expectation = match index % 5 {
                0 => Expect::Value(
                    Runtime::task(Compute::compute(move |()| key * 3)).spawn(),
                    key * 3,
                ),
                1 => Expect::Failed(
                    Runtime::task(Compute::compute(move |()| -> u64 {
                        panic!("stress {key}")
                    }))
                    .spawn(),
                ),
                2 => {
                    let length = Duration::from_micros(key % 2_000);
                    Expect::Slept(Runtime::task(Sleep::sleep(length)).spawn(), length)
                }
                3 => Expect::Value(
                    Runtime::task(Compute::compute(move |()| key))
                        .repeat()
                        .count(3)
                        .spawn(),
                    key,
                ),
                _ => {
                    receives.push(Runtime::task(receiver.receive()).spawn());
                    sender.send(key).expect("send");
                    continue;
                }
            };
            expectations.push(expectation);
        }
        if last_kill.elapsed() > Duration::from_millis(700) {
            faults::kill_workers(1);
            last_kill = Instant::now();
        }
        if last_fault.elapsed() > Duration::from_millis(1000) {
            faults::panic_manager(1);
            last_fault = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let remaining = |deadline: Instant| deadline.saturating_duration_since(Instant::now());
    for expectation in expectations {
        match expectation {
            Expect::Value(handle, value) => {
                let mut result = handle.join_with_timeout(remaining(deadline));
                // A counted repeat reads its last output once finished.
                while !handle.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                    result = handle.join_with_timeout(remaining(deadline));
                }
                // A worker death may write off the task it was running; anything else is a bug.
                assert!(
                    result == Ok(value) || result == Err(RuntimeError::TaskFailed),
                    "a value task gave {result:?}, expected {value}"
                );
            }
            Expect::Failed(handle) => assert_eq!(
                handle.join_with_timeout(remaining(deadline)),
                Err(RuntimeError::TaskFailed),
                "a panicking task must fail"
            ),
            Expect::Slept(handle, length) => match handle.join_with_timeout(remaining(deadline)) {
                Ok(slept) => assert!(
                    slept >= length,
                    "a sleep of {length:?} ended early: {slept:?}"
                ),
                Err(error) => assert_eq!(error, RuntimeError::TaskFailed, "sleep gave {error:?}"),
            },
        }
    }
    let mut received: Vec<u64> = receives
        .into_iter()
        .filter_map(|handle| handle.join_with_timeout(remaining(deadline)).ok())
        .collect();
    received.sort_unstable();
    received.dedup();
    assert!(!received.is_empty(), "channel receives should get values");
    let status = Runtime::status();
    assert!(
        status.manager_alive,
        "the manager should still be alive: {status:?}"
    );
    let pool = Runtime::pool();
    assert!(pool.deaths >= 1, "worker deaths were injected: {pool}");
    assert!(
        Runtime::healthy(),
        "the runtime should be healthy after the storm: {pool}"
    );
    common::within("the shutdown after the storm", Runtime::shutdown);
    assert_eq!(
        common::join(
            &Runtime::task(Compute::compute(|()| 1)).spawn(),
            "a spawn after shutdown"
        ),
        Err(RuntimeError::TaskFailed),
        "a spawn after shutdown fails"
    );
}
