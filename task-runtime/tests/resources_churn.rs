//! Churn: 200,000 spawn-join cycles do not grow memory, and table slots are reused across waves (one test, in order).

mod common;

use std::time::Duration;

use task_runtime::{Compute, Runtime, Sleep};

#[test]
fn two_hundred_thousand_spawn_join_cycles_do_not_grow_memory() {
    Runtime::builder().cores(2).init().expect("init");
    for _ in 0..1000 {
        common::join(
            &Runtime::task(Sleep::sleep(Duration::from_nanos(1))).spawn(),
            "a warm-up sleep",
        )
        .expect("warm-up");
    }
    let before = common::rss_bytes();
    for _ in 0..200_000 {
        common::join(
            &Runtime::task(Sleep::sleep(Duration::from_nanos(1))).spawn(),
            "a 1 ns sleep of the churn",
        )
        .expect("cycle");
    }
    let growth = common::rss_bytes().saturating_sub(before);
    assert!(
        growth < 2 << 20,
        "200k cycles grew RSS by {growth} bytes (limit 2 MiB)"
    );
    // The executor drops its claim just after publishing, so allow it a moment.
    common::wait_until(
        Duration::from_secs(5),
        "every slot should come back once handles drop",
        || Runtime::pool().live == 0,
    );
    table_slots_are_reused_across_waves();
}

// Called from the test above rather than run in parallel with it: both read process-wide numbers.
fn table_slots_are_reused_across_waves() {
    let mut first_peak = None;
    for wave in 0..16u64 {
        let handles: Vec<_> = (0..20_000u64)
            .map(|index| Runtime::task(Compute::compute(move |()| wave + index)).spawn())
            .collect();
        for (index, handle) in handles.into_iter().enumerate() {
            assert_eq!(
                common::join(&handle, "a compute of a wave"),
                Ok(wave + index as u64)
            );
        }
        let peak = Runtime::pool().peak_slots;
        let first = *first_peak.get_or_insert(peak);
        assert!(
            peak <= first + first / 10,
            "wave {wave}: peak slots {peak} grew past the first wave's {first} + 10 %"
        );
    }
}
