//! Idle CPU: parked sleeps and a quiet pool cost under 5 % of one core, measured from /proc/self/stat.

mod common;

use std::time::{Duration, Instant};

use task_runtime::{Compute, Runtime, Sleep};

#[test]
fn twenty_long_sleeps_and_a_quiet_pool_keep_idle_cpu_under_five_percent() {
    Runtime::builder().cores(2).init().expect("init");
    let started = Instant::now();
    let sleeps: Vec<_> = (0..20)
        .map(|_| Runtime::task(Sleep::sleep(Duration::from_secs(3))).spawn())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let share = common::cpu_share_over(Duration::from_secs(2));
    assert!(
        share < 0.05,
        "20 parked sleeps should cost under 5 % of a core, used {:.1} %",
        share * 100.0
    );
    for sleep in sleeps {
        let slept = common::join(&sleep, "a 3 s sleep").expect("sleep");
        assert!(
            slept >= Duration::from_secs(3),
            "no sleep may end early: {slept:?}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(10));

    let burst: Vec<_> = (0..100u64)
        .map(|index| Runtime::task(Compute::compute(move |()| index * index)).spawn())
        .collect();
    for (index, handle) in burst.into_iter().enumerate() {
        assert_eq!(
            common::join(&handle, "a compute of the burst"),
            Ok((index * index) as u64)
        );
    }
    // Let spinning workers park and grown threads reap, then measure a quiet window.
    std::thread::sleep(Duration::from_millis(700));
    let share = common::cpu_share_over(Duration::from_secs(2));
    assert!(
        share < 0.05,
        "a quiet pool should cost under 5 % of a core, used {:.1} %",
        share * 100.0
    );
}
