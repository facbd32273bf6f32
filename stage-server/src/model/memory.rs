//! How much memory this process may still take: the kernel's `MemAvailable`, and the cgroup's room when a
//! cgroup (v2) limits it, for checks that refuse a configuration before it runs out midway.

use std::path::Path;

/// Bytes this process can still allocate without the machine or its cgroup running out, as far as the kernel
/// tells; `None` where it does not say (no `/proc/meminfo`), so a check that needs it is skipped rather than
/// guessed.
pub fn available_bytes() -> Option<u64> {
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_available(&text));
    let group = cgroup_room(Path::new("/sys/fs/cgroup"));
    match (machine, group) {
        (Some(machine), Some(group)) => Some(machine.min(group)),
        (machine, group) => machine.or(group),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find(|line| line.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

/// What a cgroup v2 limit (`memory.max`) leaves over its use (`memory.current`) under `root`; `None` without a
/// limit ("max") or without the files.
fn cgroup_room(root: &Path) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(root.join(name)).ok();
    let limit: u64 = read("memory.max")?.trim().parse().ok()?;
    let used: u64 = read("memory.current")?.trim().parse().ok()?;
    Some(limit.saturating_sub(used))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes_and_a_strange_line_is_no_answer() {
        let text = "MemTotal:       24567892 kB\nMemFree:  100 kB\nMemAvailable:   24124708 kB\n";
        assert_eq!(mem_available(text), Some(24_124_708 * 1024));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots\n"), None);
        assert_eq!(mem_available("MemAvailable: 5 MB\n"), None);
    }

    #[test]
    fn a_cgroup_limit_leaves_its_room_and_no_limit_says_nothing() {
        let dir = std::env::temp_dir().join(format!("stage-server-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "1000000\n").unwrap();
        std::fs::write(dir.join("memory.current"), "250000\n").unwrap();
        assert_eq!(cgroup_room(&dir), Some(750_000));
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_room(&dir), None);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            available_bytes().is_some(),
            "this Linux host has /proc/meminfo"
        );
    }
}
