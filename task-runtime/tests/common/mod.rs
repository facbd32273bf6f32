//! Helpers shared by the resource tests: RSS, thread count and CPU time from /proc/self.

#![allow(dead_code)]

use std::time::Duration;

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
