//! Stress: thousands of mixed tasks while workers die and the manager faults; nothing is lost or crossed.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use task_runtime::{Channel, Compute, Runtime, RuntimeError, Sleep, TaskHandle, faults};

enum Expect {
    Value(TaskHandle<u64>, u64),
    Failed(TaskHandle<u64>),
    Slept(TaskHandle<Duration>, Duration),
}

#[test]
fn mixed_work_survives_worker_deaths_and_manager_faults() {
    common::quiet_expected_panics(&["stress ", "injected manager fault"]);
    Runtime::builder().cores(2).init().expect("init");
    let started = Instant::now();
    let mut expectations = Vec::new();
    let mut round = 0u64;
    let (sender, receiver) = Channel::unbounded::<u64>();
    let mut receives = Vec::new();
    let mut sent = BTreeSet::new();
    let mut kills = 0u64;
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
                    sent.insert(key);
                    continue;
                }
            };
            expectations.push(expectation);
        }
        if last_kill.elapsed() > Duration::from_millis(700) {
            faults::kill_workers(1);
            kills += 1;
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
    // Tasks that did not end the way they were written: a worker that dies while running a task writes
    // that one task off, so there may be at most as many of these as deaths, and no other kind of failure.
    let mut written_off = 0u64;
    for expectation in expectations {
        match expectation {
            Expect::Value(handle, value) => {
                let mut result = handle.join_with_timeout(remaining(deadline));
                // A counted repeat reads its last output once finished.
                while !handle.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                    result = handle.join_with_timeout(remaining(deadline));
                }
                match result {
                    Ok(got) => assert_eq!(got, value, "a value task gave another task's value"),
                    Err(RuntimeError::TaskFailed) => written_off += 1,
                    Err(error) => panic!("a value task expected to give {value} gave {error:?}"),
                }
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
                Err(RuntimeError::TaskFailed) => written_off += 1,
                Err(error) => panic!("a sleep of {length:?} gave {error:?}"),
            },
        }
    }
    // Every value sent is received at most once, by a receive that ended well, and only values sent are
    // received; with one receive per send, that leaves exactly one value unreceived per failed receive
    // (still in the channel, or gone down with that receive), and the failures are held to the deaths below.
    let mut received = BTreeSet::new();
    let mut failed_receives = 0u64;
    for handle in receives {
        match handle.join_with_timeout(remaining(deadline)) {
            Ok(value) => assert!(
                received.insert(value),
                "the value {value} was received twice"
            ),
            Err(RuntimeError::TaskFailed) => failed_receives += 1,
            Err(error) => panic!("a channel receive gave {error:?}"),
        }
    }
    assert!(
        received.is_subset(&sent),
        "a receive got a value nobody sent: {:?}",
        received.difference(&sent).collect::<Vec<_>>()
    );
    while let Ok(value) = receiver.try_receive() {
        assert!(
            sent.contains(&value) && !received.contains(&value),
            "the value {value} left in the channel was never sent or was received too"
        );
    }
    written_off += failed_receives;
    let status = Runtime::status();
    assert!(
        status.manager_alive,
        "the manager should still be alive: {status:?}"
    );
    // Each injected kill ends one worker the next time it looks for work, so by now every kill has landed;
    // a death beyond them would be a worker lost to something else.
    common::wait_until(
        Duration::from_secs(10),
        "every injected worker kill should have ended a worker",
        || Runtime::pool().deaths >= kills,
    );
    let pool = Runtime::pool();
    println!(
        "sent {}, received {}, written off {written_off}, kills {kills}, deaths {}",
        sent.len(),
        received.len(),
        pool.deaths
    );
    assert!(kills >= 1, "the storm should have injected a worker death");
    assert_eq!(
        pool.deaths, kills,
        "{kills} worker deaths were injected, but the pool counts other deaths too: {pool}"
    );
    assert!(
        written_off <= pool.deaths,
        "{written_off} tasks failed although only {} workers died (each death writes off at most the task it \
         was running): {pool}",
        pool.deaths
    );
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
