//! Manager faults: the supervisor restarts the manager and timers and parked tasks survive.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use task_runtime::{Compute, Runtime, Sleep, faults};

use common::{join, wait_until};

#[test]
fn the_manager_recovers_from_three_faults_and_keeps_timers() {
    // Injected panics are expected; keep their messages (and slow backtraces) out of the way.
    common::quiet_expected_panics(&["injected manager fault"]);
    Runtime::builder().cores(2).init().expect("init");
    let runs = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&runs);
    let repeat = Runtime::task(Compute::compute(move |()| {
        counted.fetch_add(1, Ordering::SeqCst)
    }))
    .repeat()
    .every(Duration::from_millis(20))
    .spawn();
    let parked = Runtime::task(Sleep::sleep(Duration::from_millis(400))).spawn();
    let timed = Runtime::task(Sleep::sleep(Duration::from_secs(30)))
        .timeout(Duration::from_millis(300))
        .spawn();
    std::thread::sleep(Duration::from_millis(50));
    for restart in 1..=3 {
        faults::panic_manager(1);
        wait_until(
            Duration::from_secs(5),
            &format!("restart {restart} should happen"),
            || Runtime::status().manager_restarts >= restart,
        );
    }
    let status = Runtime::status();
    assert!(
        status.manager_restarts >= 3,
        "three faults mean three restarts: {status:?}"
    );
    assert!(
        status.manager_alive,
        "the manager should be back: {status:?}"
    );
    let before = runs.load(Ordering::SeqCst);
    wait_until(
        Duration::from_secs(5),
        "the timed repeat should resume",
        || runs.load(Ordering::SeqCst) >= before + 3,
    );
    let slept = join(&parked, "a 400 ms sleep parked across restarts")
        .expect("a sleep parked across restarts still ends");
    assert!(
        slept >= Duration::from_millis(400),
        "and not early: {slept:?}"
    );
    assert_eq!(
        join(&timed, "a 30 s sleep with a 300 ms timeout"),
        Err(task_runtime::RuntimeError::TimedOut),
        "a timeout survives manager restarts"
    );
    repeat.cancel();
    assert!(Runtime::healthy());
}
