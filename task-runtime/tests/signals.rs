//! Signals: a parked signal wait wakes on delivery and reports the count (own binary: signals are process-wide).

mod common;

use std::time::Duration;

use task_runtime::{Runtime, RuntimeError, Signal};

use common::{becomes_running, join, wait_until};

#[test]
fn a_signal_wakes_its_waiter_and_bad_signals_are_refused() {
    Runtime::builder().cores(2).init().expect("init");
    let waiter = Runtime::task(Signal::wait(libc::SIGUSR1)).spawn();
    assert!(
        becomes_running(&waiter),
        "the wait parks until a signal arrives"
    );
    net_io_sys::signal::send_to_self(libc::SIGUSR1).expect("kill");
    assert_eq!(
        waiter.join_with_timeout(Duration::from_secs(5)),
        Ok(1),
        "one delivery is reported"
    );
    let repeating = Runtime::task(Signal::wait(libc::SIGUSR1))
        .repeat()
        .count(2)
        .spawn();
    std::thread::sleep(Duration::from_millis(20));
    net_io_sys::signal::send_to_self(libc::SIGUSR1).expect("kill");
    std::thread::sleep(Duration::from_millis(100));
    net_io_sys::signal::send_to_self(libc::SIGUSR1).expect("kill");
    wait_until(
        Duration::from_secs(5),
        "two deliveries should end a count of two",
        || repeating.is_finished(),
    );
    assert_eq!(
        join(
            &Runtime::task(Signal::wait(libc::SIGKILL)).spawn(),
            "a wait on SIGKILL"
        ),
        Err(RuntimeError::BadSignal),
        "SIGKILL cannot be watched"
    );
}
