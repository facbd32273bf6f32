//! Scale: 1,000,000 live parked sleeps hold no threads and cost little memory each.

mod common;

use std::time::Duration;

use task_runtime::{Runtime, Sleep};

#[test]
fn a_million_live_parked_sleeps_hold_no_threads() {
    Runtime::builder().cores(2).init().expect("init");
    let threads_before = common::threads();
    let rss_before = common::rss_bytes();
    let handles: Vec<_> = (0..1_000_000)
        .map(|_| Runtime::task(Sleep::sleep(Duration::from_secs(120))).spawn())
        .collect();
    // Wait until every sleep has parked on the timer heap and its worker has let go. An empty queue is
    // not enough: a worker may have just taken the last few sleeps and still be starting them (seen
    // once under load: queued 0, busy 1, timers 999997). A sleep that kept its worker would never
    // get here, so the busy check below still means what it says.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let pool = loop {
        let pool = Runtime::pool();
        if pool.queued == 0 && pool.timers >= 1_000_000 && pool.busy_workers() == 0 {
            break pool;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the sleeps should all park and leave their workers idle: {pool}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let growth = common::rss_bytes().saturating_sub(rss_before);
    let per_task = growth / 1_000_000;
    eprintln!("1M parked sleeps: RSS growth {growth} bytes, {per_task} bytes per task, {pool}");
    assert!(
        pool.peak_slots >= 1_000_000,
        "every sleep holds its own slot: {pool}"
    );
    assert!(
        growth < 512 << 20,
        "1M parked sleeps grew RSS by {growth} bytes (limit 512 MiB)"
    );
    // The pool may grow while a million spawns queue up, but never by anything like a thread per task,
    // and once parked nothing is busy.
    assert!(
        common::threads() <= threads_before + pool.peak_workers as u64 + 2,
        "parked sleeps should hold no threads: {} before, {} now, {pool}",
        threads_before,
        common::threads()
    );
    assert_eq!(
        pool.busy_workers(),
        0,
        "no worker is busy with a parked sleep: {pool}"
    );
    assert_eq!(
        pool.sleep_threads, 0,
        "no blocking thread holds a sleep: {pool}"
    );
    assert!(
        handles.iter().take(1000).all(|handle| handle.is_running()),
        "they are parked"
    );
    handles.iter().for_each(|handle| handle.cancel());
    drop(handles);
    assert_eq!(
        Runtime::pool().live,
        0,
        "cancelled and dropped, every slot is free"
    );
}
