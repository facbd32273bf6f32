//! Helpers shared by the test binaries: starting the runtime, waiting for a task to run, and RSS,
//! thread count and CPU time from /proc/self.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use task_runtime::{Runtime, RuntimeError, TaskHandle};

/// Starts the default runtime unless a test of this binary already did (the runtime is process-wide).
pub fn init() {
    match Runtime::init() {
        Ok(()) | Err(RuntimeError::AlreadyInit) => {}
        Err(error) => panic!("init failed: {error}"),
    }
}

/// Waits up to 10 s for `handle` to be started and parked: on a loaded 2-core machine a worker can take far
/// longer than a fixed 20-50 ms sleep to pick a fresh task up, and the check is that it parks, not how fast.
pub fn becomes_running<T: Send + 'static, G>(handle: &TaskHandle<T, G>) -> bool {
    holds_within(Duration::from_secs(10), Duration::from_millis(2), || {
        handle.is_running()
    })
}

/// Waits up to `limit` for `handle` to end for good (for a repeat: its last run is over); false if it
/// has not, so a test fails with its own message instead of hanging.
pub fn finishes_within<T: Send + 'static, G>(handle: &TaskHandle<T, G>, limit: Duration) -> bool {
    holds_within(limit, Duration::from_millis(5), || handle.is_finished())
}

/// Checks `condition` every `poll` until it holds (true) or `limit` has passed (false).
fn holds_within(limit: Duration, poll: Duration, condition: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !condition() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(poll);
    }
    true
}

/// A field of /proc/self/status in kB (VmRSS) or as a count (Threads).
pub fn status_field(name: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no {name} in /proc/self/status"))
}

/// Resident memory in bytes.
pub fn rss_bytes() -> u64 {
    status_field("VmRSS") * 1024
}

/// Threads of this process.
pub fn threads() -> u64 {
    status_field("Threads")
}

/// User plus system CPU time of this process (from /proc/self/stat, at USER_HZ = 100).
pub fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
    // The command name may hold spaces; fields after the closing parenthesis are plain.
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let user: u64 = fields[11].parse().expect("utime");
    let system: u64 = fields[12].parse().expect("stime");
    Duration::from_millis((user + system) * 10)
}

/// CPU used over `window`, as a fraction of one core.
pub fn cpu_share_over(window: Duration) -> f64 {
    let before = cpu_time();
    std::thread::sleep(window);
    let used = cpu_time() - before;
    used.as_secs_f64() / window.as_secs_f64()
}
