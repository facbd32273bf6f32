//! The pairing of `Instant` with the timerfd's clock, made once per process: a preemption in the middle of
//! it must not make every timer of the process late (its own binary, so that its pause is the first).

mod common;

use std::time::Duration;

use task_runtime::{Runtime, Sleep, faults};

use common::{init, join};

#[test]
fn a_preemption_while_the_clocks_are_paired_does_not_make_every_timer_late() {
    // The pause stands for the thread being kept off the CPU between its two clock readings. Before the
    // readings were bracketed and retried, every timer of the process then fired this much late.
    const PAUSE: Duration = Duration::from_millis(400);
    const SLEEP: Duration = Duration::from_millis(20);
    faults::pause_clock_calibration(PAUSE);
    init();
    // The first timer pairs the clocks, so its own thread sits through the pause: not measured.
    join(
        &Runtime::task(Sleep::sleep(SLEEP).relaxed()).spawn(),
        "the sleep whose timer pairs the clocks",
    )
    .expect("the first sleep should finish");
    for round in 0..3 {
        let slept = join(
            &Runtime::task(Sleep::sleep(SLEEP).relaxed()).spawn(),
            "a 20 ms relaxed sleep",
        )
        .expect("the sleep should finish");
        // Generous: a loaded machine can wake a timer tens of milliseconds late, but not by the pause.
        assert!(
            slept < SLEEP + PAUSE / 2,
            "round {round}: a {SLEEP:?} sleep took {slept:?}; the {PAUSE:?} pause in the clock pairing \
             should not delay the timers"
        );
    }
}
