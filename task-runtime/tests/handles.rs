//! Handles: joins, takes, clones as listeners, cancels that settle every listener, try and timed reads.

mod common;

use std::time::{Duration, Instant};

use task_runtime::{Compute, JoinPolicy, Runtime, RuntimeError, Sleep, TaskState};

use common::{init, join, join_thread, join_thread_within, join_within, wait, within};

#[test]
fn a_compute_spawned_and_joined_gives_its_output() {
    init();
    let handle = Runtime::task(Compute::compute(|()| 21 * 2)).spawn();
    // `join` itself is what this test checks, so it runs unchanged on a watched thread.
    let joined = handle.clone();
    assert_eq!(
        within("the join of a compute", move || joined.join()),
        Ok(42),
        "the compute should give 42"
    );
    assert_eq!(
        handle.state(),
        TaskState::Ready,
        "a joined task reads Ready"
    );
}

#[test]
fn clones_read_the_same_value_across_threads() {
    init();
    let handle = Runtime::task(Compute::compute(|()| String::from("shared"))).spawn();
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let clone = handle.clone();
            // deadline: join_thread below bounds each reader.
            std::thread::spawn(move || clone.join())
        })
        .collect();
    for reader in readers {
        assert_eq!(
            join_thread(reader, "a thread joining a clone").expect("reader thread"),
            Ok(String::from("shared")),
            "every clone should read the same output"
        );
    }
}

#[test]
fn take_moves_the_output_and_other_listeners_read_already_taken() {
    init();
    let handle = Runtime::task(Compute::compute(|()| vec![1u8, 2, 3])).spawn();
    let listener = handle.clone();
    // `take` itself is what this test checks, so it runs unchanged on a watched thread.
    assert_eq!(
        within("the take of a compute", move || handle.take()),
        Ok(vec![1, 2, 3]),
        "take should move the output out"
    );
    assert_eq!(
        join(&listener, "a listener's join after the take"),
        Err(RuntimeError::AlreadyTaken),
        "a listener after a take should read AlreadyTaken"
    );
    assert!(listener.is_taken(), "the state should read Taken");
}

#[test]
fn cancel_settles_every_listener() {
    init();
    let handle = Runtime::task(Sleep::sleep(Duration::from_secs(30))).spawn();
    let listeners: Vec<_> = (0..3).map(|_| handle.clone()).collect();
    std::thread::sleep(Duration::from_millis(20));
    handle.cancel();
    for listener in &listeners {
        assert_eq!(
            listener.join_with_timeout(Duration::from_secs(5)),
            Err(RuntimeError::Cancelled),
            "every listener should read Cancelled"
        );
    }
}

#[test]
fn try_reads_say_not_ready_until_the_task_settles() {
    init();
    let handle = Runtime::task(Sleep::sleep(Duration::from_millis(100))).spawn();
    assert_eq!(
        handle.try_join(),
        Err(RuntimeError::NotReady),
        "a running sleep is not ready"
    );
    assert_eq!(
        handle.try_take(),
        Err(RuntimeError::NotReady),
        "nor can it be taken"
    );
    let slept = join(&handle, "a 100 ms sleep").expect("the sleep should finish");
    assert!(
        slept >= Duration::from_millis(100),
        "it should not end early: {slept:?}"
    );
    assert_eq!(
        handle.try_take(),
        Ok(slept),
        "after settling try_take moves the output"
    );
}

#[test]
fn a_timed_join_runs_out_with_not_ready_and_a_quick_one_succeeds() {
    init();
    let slow = Runtime::task(Sleep::sleep(Duration::from_secs(5))).spawn();
    let started = Instant::now();
    assert_eq!(
        slow.join_with_timeout(Duration::from_millis(100)),
        Err(RuntimeError::NotReady),
        "a 100 ms wait on a 5 s sleep should run out"
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(100) && waited < Duration::from_secs(1),
        "the timed wait should end between 100 ms and 1 s, took {waited:?}"
    );
    slow.cancel();
    let quick = Runtime::task(Sleep::sleep(Duration::from_millis(20))).spawn();
    assert!(
        quick.take_with_timeout(Duration::from_secs(10)).is_ok(),
        "a 20 ms sleep should be taken well inside 10 s"
    );
}

#[test]
fn dropping_every_handle_does_not_stop_the_task() {
    init();
    let (sender, receiver) = std::sync::mpsc::channel();
    drop(
        Runtime::task(Compute::compute(move |()| {
            std::thread::sleep(Duration::from_millis(20));
            sender.send(7).expect("send");
        }))
        .spawn(),
    );
    assert_eq!(
        receiver.recv_timeout(Duration::from_secs(10)),
        Ok(7),
        "a fire-and-forget task should still run"
    );
}

#[test]
fn tasks_spawned_from_many_threads_get_their_own_results() {
    init();
    let spawners: Vec<_> = (0..4u64)
        .map(|thread| {
            std::thread::spawn(move || {
                let handles: Vec<_> = (0..500u64)
                    .map(|index| {
                        Runtime::task(Compute::compute(move |()| thread * 10_000 + index)).spawn()
                    })
                    .collect();
                for (index, handle) in handles.into_iter().enumerate() {
                    assert_eq!(
                        join(&handle, "a compute spawned from a thread"),
                        Ok(thread * 10_000 + index as u64),
                        "a result crossed between tasks"
                    );
                }
            })
        })
        .collect();
    for spawner in spawners {
        join_thread(spawner, "a thread spawning and joining 500 computes").expect("spawner thread");
    }
}

#[test]
fn join_all_keeps_the_order_given() {
    init();
    let handles: Vec<_> = (0..50u32)
        .map(|index| Runtime::task(Compute::compute(move |()| index * 3)).spawn())
        .collect();
    let results = within("join_all of 50 computes", move || {
        Runtime::join_all(handles)
    });
    let expected: Vec<_> = (0..50u32).map(|index| Ok(index * 3)).collect();
    assert_eq!(
        results, expected,
        "join_all should return results in the order given"
    );
}

#[test]
fn join_first_pass_back_returns_the_losers_in_order() {
    init();
    let handles = vec![
        Runtime::task(Sleep::sleep(Duration::from_secs(5))).spawn(),
        Runtime::task(Sleep::sleep(Duration::from_millis(10))).spawn(),
        Runtime::task(Sleep::sleep(Duration::from_secs(6))).spawn(),
    ];
    let ids: Vec<u64> = handles.iter().map(|handle| handle.id()).collect();
    let (winner, losers) = within("join_first of three sleeps", move || {
        Runtime::join_first(handles, JoinPolicy::PassBack)
    });
    assert_eq!(winner.id(), ids[1], "the 10 ms sleep should win");
    let loser_ids: Vec<u64> = losers.iter().map(|handle| handle.id()).collect();
    assert_eq!(loser_ids, vec![ids[0], ids[2]], "losers come back in order");
    assert!(
        losers.iter().all(|loser| !loser.is_settled()),
        "losers keep running"
    );
    losers.iter().for_each(|loser| loser.cancel());
}

#[test]
fn join_first_cancel_stops_the_losers_and_drop_leaves_them_running() {
    init();
    let slow = Runtime::task(Sleep::sleep(Duration::from_secs(5))).spawn();
    let watcher = slow.clone();
    let quick = Runtime::task(Sleep::sleep(Duration::from_millis(5))).spawn();
    let (_winner, losers) = within("join_first with Cancel", move || {
        Runtime::join_first(vec![slow, quick], JoinPolicy::Cancel)
    });
    assert!(losers.is_empty(), "Cancel passes nothing back");
    assert_eq!(
        watcher.state(),
        TaskState::Cancelled,
        "the loser should be cancelled"
    );

    let slow = Runtime::task(Sleep::sleep(Duration::from_millis(300))).spawn();
    let watcher = slow.clone();
    let quick = Runtime::task(Compute::compute(|()| Duration::ZERO)).spawn();
    let (_winner, losers) = within("join_first with Drop", move || {
        Runtime::join_first(vec![slow, quick], JoinPolicy::Drop)
    });
    assert!(losers.is_empty(), "Drop passes nothing back");
    assert!(
        join(&watcher, "the dropped 300 ms loser").is_ok(),
        "a dropped loser should keep running to its end"
    );
}

#[test]
fn join_first_of_nothing_reads_no_such_task_and_a_finished_task_wins_at_once() {
    init();
    let (empty, losers) = within("join_first of nothing", || {
        Runtime::join_first(
            Vec::<task_runtime::TaskHandle<u8>>::new(),
            JoinPolicy::PassBack,
        )
    });
    assert!(losers.is_empty());
    assert_eq!(
        join(&empty, "the winner of an empty join_first"),
        Err(RuntimeError::NoSuchTask),
        "an empty set reads NoSuchTask"
    );
    let done = Runtime::task(Compute::compute(|()| 1u8)).spawn();
    wait(&done, "a quick compute");
    let pending = Runtime::task(Compute::compute(|()| 2u8))
        .after(Duration::from_secs(5))
        .spawn();
    let started = Instant::now();
    let (winner, losers) = within("join_first with a finished task", move || {
        Runtime::join_first(vec![pending, done], JoinPolicy::Cancel)
    });
    assert_eq!(
        join(&winner, "the finished winner"),
        Ok(1),
        "the finished task should win"
    );
    assert!(started.elapsed() < Duration::from_secs(1), "and at once");
    assert!(losers.is_empty());
}

#[test]
#[should_panic(expected = "a 30 s sleep did not finish within 100ms (state: Running)")]
fn a_bounded_join_of_a_task_that_does_not_end_fails_naming_it() {
    init();
    let sleep = Runtime::task(Sleep::sleep(Duration::from_secs(30))).spawn();
    let _ = join_within(&sleep, Duration::from_millis(100), "a 30 s sleep");
}

#[test]
#[should_panic(expected = "a thread waiting on a channel did not finish within 100ms")]
fn a_bounded_join_of_a_thread_that_does_not_end_fails_naming_it() {
    // The sender lives until the helper panics; then the receive ends and so does the thread.
    let (_sender, receiver) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let _ = receiver.recv_timeout(Duration::from_secs(10));
    });
    let _ = join_thread_within(
        thread,
        Duration::from_millis(100),
        "a thread waiting on a channel",
    );
}

#[test]
fn runtime_block_runs_on_the_calling_thread() {
    init();
    // The calls run on a watched thread, which is then the calling thread.
    let (caller, ran_on) = within("Runtime::block of a compute", || {
        let caller = std::thread::current().id();
        let ran_on = Runtime::block(Compute::compute(move |()| std::thread::current().id()));
        (caller, ran_on.expect("block should run the compute"))
    });
    assert_eq!(
        ran_on, caller,
        "block should run the task on the calling thread"
    );
    let slept = within("Runtime::block of a 5 ms sleep", || {
        Runtime::block(Sleep::sleep(Duration::from_millis(5)))
    })
    .expect("sleep");
    assert!(
        slept >= Duration::from_millis(5),
        "a blocked sleep should not end early"
    );
}
