//! How much memory this process may still take: the kernel's `MemAvailable`, and the room its cgroup (v2) and
//! every cgroup above it leave when they set a limit, for checks that refuse a configuration before it runs out
//! midway.

use std::path::Path;

/// Bytes this process can still allocate without the machine or its cgroups running out, as far as the kernel
/// tells; `None` where it does not say (no `/proc/meminfo`), so a check that needs it is skipped rather than
/// guessed.
pub fn available_bytes() -> Option<u64> {
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_available(&text));
    let groups = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|text| cgroups_room(Path::new("/sys/fs/cgroup"), &text));
    match (machine, groups) {
        (Some(machine), Some(groups)) => Some(machine.min(groups)),
        (machine, groups) => machine.or(groups),
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

/// The least room any cgroup of this process leaves, from its own up to the root of its hierarchy, with the
/// hierarchies mounted under `mount`: the unified one (v2, `0::/path`: `memory.max` over `memory.current`) and a
/// v1 memory controller (`N:memory:/path` under `mount/memory`: `memory.limit_in_bytes` over
/// `memory.usage_in_bytes`), as `/proc/self/cgroup` names them. `None` where none sets a limit.
fn cgroups_room(mount: &Path, proc_self_cgroup: &str) -> Option<u64> {
    let mut least: Option<u64> = None;
    for line in proc_self_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (root, limit, usage) = if controllers.is_empty() {
            (mount.to_path_buf(), "memory.max", "memory.current")
        } else if controllers.split(',').any(|name| name == "memory") {
            (
                mount.join("memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        let mut directory = root.join(path.trim().trim_start_matches('/'));
        loop {
            if let Some(room) = cgroup_room(&directory, limit, usage) {
                least = Some(least.map_or(room, |least| least.min(room)));
            }
            if directory == root || !directory.pop() || !directory.starts_with(&root) {
                break;
            }
        }
    }
    least
}

/// What the cgroup in `directory` leaves: its `limit` file's bytes over its `usage` file's; `None` without a
/// limit (v2's "max") or without the files.
fn cgroup_room(directory: &Path, limit: &str, usage: &str) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(directory.join(name)).ok();
    let limit: u64 = read(limit)?.trim().parse().ok()?;
    let used: u64 = read(usage)?.trim().parse().ok()?;
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
    fn the_least_room_of_every_cgroup_on_the_way_up_counts_in_either_hierarchy() {
        let dir = std::env::temp_dir().join(format!("stage-server-cgroup-{}", std::process::id()));
        let write = |path: &str, text: &str| {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        // v2: the service sets no limit, its slice does; the root has no files.
        write("system.slice/app.service/memory.max", "max\n");
        write("system.slice/app.service/memory.current", "10\n");
        write("system.slice/memory.max", "5000\n");
        write("system.slice/memory.current", "1000\n");
        assert_eq!(
            cgroups_room(&dir, "0::/system.slice/app.service\n"),
            Some(4000)
        );
        // v1: the memory controller's own tree; a group's own limit below its parent's wins.
        write("memory/jobs/one/memory.limit_in_bytes", "3000\n");
        write("memory/jobs/one/memory.usage_in_bytes", "500\n");
        write("memory/jobs/memory.limit_in_bytes", "9223372036854771712\n");
        write("memory/jobs/memory.usage_in_bytes", "500\n");
        assert_eq!(
            cgroups_room(&dir, "4:memory:/jobs/one\n1:cpu:/\n"),
            Some(2500)
        );
        // Both: the least of all.
        let both = "4:cpu,memory:/jobs/one\n0::/system.slice/app.service\n";
        assert_eq!(cgroups_room(&dir, both), Some(2500));
        assert_eq!(
            cgroups_room(&dir, "1:cpu:/\n0::/\n"),
            None,
            "no limit anywhere"
        );
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            available_bytes().is_some(),
            "this Linux host has /proc/meminfo"
        );
    }
}
