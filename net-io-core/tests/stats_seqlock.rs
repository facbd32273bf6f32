//! The per-worker sequence-locked counters: snapshots taken while workers count closes are never torn.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use net_io_core::close::CloseReason;
use net_io_core::stats::Counters;

#[test]
fn snapshots_taken_while_workers_count_are_never_torn() {
    let workers = 2;
    let counters = Arc::new(Counters::new(workers));
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..workers)
        .map(|slot| {
            let counters = Arc::clone(&counters);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut closes = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // Every close moves 3 bytes in and 5 out, so a consistent snapshot has
                    // bytes_in == 3 * closed and bytes_out == 5 * closed.
                    counters
                        .slot(slot)
                        .record_close(CloseReason::SessionClosed, 3, 5);
                    closes += 1;
                }
                closes
            })
        })
        .collect();
    // Read for at least 300 ms and at least 100 snapshots. Two writers in a tight loop on a loaded 2-core
    // machine can leave the reader few turns, so it keeps going (up to 10 s) until it has enough snapshots
    // for the check to mean something.
    let started = Instant::now();
    let mut snapshots = 0u64;
    let mut last_closed = 0;
    while (started.elapsed() < Duration::from_millis(300) || snapshots < 100)
        && started.elapsed() < Duration::from_secs(10)
    {
        let stats = counters.snapshot();
        assert_eq!(stats.bytes_in, 3 * stats.closed, "torn snapshot: {stats:?}");
        assert_eq!(
            stats.bytes_out,
            5 * stats.closed,
            "torn snapshot: {stats:?}"
        );
        assert_eq!(
            stats.closed_by(CloseReason::SessionClosed),
            stats.closed,
            "torn snapshot: {stats:?}"
        );
        assert!(
            stats.closed >= last_closed,
            "the close count went backwards"
        );
        last_closed = stats.closed;
        snapshots += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let total: u64 = writers
        .into_iter()
        .map(|writer| writer.join().unwrap())
        .sum();
    assert_eq!(counters.snapshot().closed, total, "closes were lost");
    assert!(
        snapshots > 10,
        "the reader barely ran ({snapshots} snapshots)"
    );
}
