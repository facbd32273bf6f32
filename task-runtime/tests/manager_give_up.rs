//! Manager faults past the restart limit: the supervisor gives up and every dependent task settles.

mod common;

use std::time::Duration;

use task_runtime::{Compute, Runtime, RuntimeError, Sleep, faults};

use common::{join, wait_until, within};

#[test]
fn past_the_restart_limit_everything_that_depends_on_the_manager_settles() {
    common::quiet_expected_panics(&["injected manager fault"]);
    Runtime::builder().cores(2).init().expect("init");
    let sleep = Runtime::task(Sleep::sleep(Duration::from_secs(60))).spawn();
    let repeat = Runtime::task(Compute::compute(|()| 1))
        .repeat()
        .every(Duration::from_secs(60))
        .spawn();
    std::thread::sleep(Duration::from_millis(50));
    faults::panic_manager(10);
    wait_until(
        Duration::from_secs(10),
        "the supervisor should give up",
        || !Runtime::status().manager_alive,
    );
    assert_eq!(
        sleep.join_with_timeout(Duration::from_secs(5)),
        Err(RuntimeError::TaskFailed),
        "a parked sleep is written off"
    );
    // Not `wait()`: a repeat reads Ready between runs, so only `is_finished` says it was written off.
    wait_until(
        Duration::from_secs(10),
        "a gapped repeat should be written off",
        || repeat.is_finished(),
    );
    assert_eq!(
        join(
            &Runtime::task(Compute::compute(|()| 2)).spawn(),
            "a compute without a manager"
        ),
        Ok(2),
        "computes still run without a manager"
    );
    assert!(
        !Runtime::healthy(),
        "without a manager the runtime is not healthy"
    );
    within("the shutdown after a give-up", Runtime::shutdown);
    Runtime::init().expect("init works again after a give-up");
    assert!(Runtime::healthy());
    assert_eq!(
        join(
            &Runtime::task(Compute::compute(|()| 3)).spawn(),
            "a compute after init again"
        ),
        Ok(3)
    );
}
