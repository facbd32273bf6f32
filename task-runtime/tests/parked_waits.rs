//! Parked waits hold no thread: 500 parked TCP receives and 300 parked file watches.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use task_runtime::{File, Runtime, Tcp};

use common::{becomes_running, join, take, wait_until};

#[test]
fn five_hundred_parked_receives_and_three_hundred_watches_hold_no_thread() {
    Runtime::builder().cores(2).init().expect("init");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    let mut peers = Vec::new();
    let mut receives = Vec::new();
    let mut connections = Vec::new();
    for _ in 0..500 {
        let connection = take(
            Runtime::task(Tcp::connect(address)).spawn(),
            "a connect to the local listener",
        )
        .expect("connect");
        let (peer, _) = listener.accept().expect("accept");
        receives.push(Runtime::task(connection.recv(16)).spawn());
        connections.push(connection);
        peers.push(peer);
    }
    let directory = std::env::temp_dir().join(format!("parked-watches-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("dir");
    let paths: Vec<_> = (0..300)
        .map(|index| {
            let path = directory.join(format!("file-{index}"));
            std::fs::write(&path, b"start").expect("write");
            path
        })
        .collect();
    let watches: Vec<_> = paths
        .iter()
        .map(|path| Runtime::task(File::watch(path)).spawn())
        .collect();
    assert!(
        receives.iter().all(becomes_running),
        "all receives are parked"
    );
    assert!(
        watches.iter().all(becomes_running),
        "all watches are parked"
    );
    let pool = Runtime::pool();
    assert!(
        pool.worker_count <= pool.target && pool.sleep_threads <= 1,
        "800 parked waits should hold no extra threads: {pool}"
    );
    // Each wakes on its own event.
    peers[123].write_all(b"ping").expect("write");
    // One 10 s budget for both wakes.
    let deadline = Instant::now() + Duration::from_secs(10);
    wait_until(
        deadline.saturating_duration_since(Instant::now()),
        "receive 123 should wake",
        || receives[123].is_settled(),
    );
    assert_eq!(
        join(&receives[123], "receive 123 after its ping"),
        Ok(b"ping".to_vec())
    );
    assert!(
        receives[122].is_running() && receives[124].is_running(),
        "neighbours stay parked"
    );
    std::fs::write(&paths[42], b"changed").expect("write");
    wait_until(
        deadline.saturating_duration_since(Instant::now()),
        "watch 42 should wake",
        || watches[42].is_settled(),
    );
    assert!(
        watches[41].is_running() && watches[43].is_running(),
        "other watches stay parked"
    );
    receives.iter().for_each(|handle| handle.cancel());
    watches.iter().for_each(|handle| handle.cancel());
    std::fs::remove_dir_all(&directory).expect("clean up");
}
