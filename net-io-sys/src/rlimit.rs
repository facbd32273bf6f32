//! The descriptor limit (`RLIMIT_NOFILE`) and the spare descriptor an accept thread keeps for `EMFILE`.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

use crate::{cvt, shim};

/// A soft and a hard resource limit; `u64::MAX` stands for `RLIM_INFINITY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceLimit {
    /// The limit the kernel enforces now.
    pub soft: u64,
    /// The ceiling an unprivileged process may raise the soft limit to.
    pub hard: u64,
}

/// Reads `RLIMIT_NOFILE`, the highest descriptor number plus one this process may open.
pub fn descriptor_limit() -> io::Result<ResourceLimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    shim::enter("getrlimit")?;
    // SAFETY: getrlimit(2) writes one rlimit into a live local.
    cvt!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) })?;
    Ok(ResourceLimit {
        soft: limit.rlim_cur,
        hard: limit.rlim_max,
    })
}

/// Sets `RLIMIT_NOFILE`. Raising the hard limit needs privilege; lowering is always allowed.
pub fn set_descriptor_limit(limit: ResourceLimit) -> io::Result<()> {
    let value = libc::rlimit {
        rlim_cur: limit.soft,
        rlim_max: limit.hard,
    };
    shim::enter("setrlimit")?;
    // SAFETY: setrlimit(2) reads one rlimit from a live local.
    cvt!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &value) })?;
    Ok(())
}

/// Opens `/dev/null` read-only and close-on-exec: the spare descriptor an accept thread closes when `accept4`
/// fails with `EMFILE`, so that it can take one connection off the queue and reset it instead of spinning.
pub fn open_reserve() -> io::Result<OwnedFd> {
    shim::enter("open_reserve")?;
    // SAFETY: open(2) reads a NUL-terminated path from a static C string; a non-negative return is a new
    // descriptor nobody else owns.
    let raw = cvt!(unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) })?;
    // SAFETY: `raw` was just returned by open(2).
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    #[test]
    fn the_descriptor_limit_is_the_one_the_kernel_lists_for_open_files() {
        let limit = descriptor_limit().expect("getrlimit");
        // /proc/self/limits is the kernel's own account of this process's limits, read apart from
        // getrlimit(2): it tells a wrong resource or a mangled RLIM_INFINITY from the right one.
        let listed = std::fs::read_to_string("/proc/self/limits").expect("read /proc/self/limits");
        let line = listed
            .lines()
            .find(|line| line.starts_with("Max open files"))
            .expect("/proc/self/limits has no line for open files");
        let value = |word: &str| match word {
            "unlimited" => u64::MAX,
            number => number
                .parse()
                .expect("a limit in /proc/self/limits is a number"),
        };
        let words: Vec<&str> = line["Max open files".len()..].split_whitespace().collect();
        let expected = ResourceLimit {
            soft: value(words[0]),
            hard: value(words[1]),
        };
        assert_eq!(
            limit, expected,
            "descriptor_limit() read {limit:?}, but the kernel lists {line:?}"
        );
    }

    #[test]
    fn the_reserve_descriptor_is_dev_null_read_only_and_close_on_exec() {
        let reserve = open_reserve().expect("open /dev/null");
        let descriptor = reserve.as_raw_fd();
        assert_eq!(
            std::fs::read_link(format!("/proc/self/fd/{descriptor}"))
                .expect("read the descriptor's link"),
            std::path::Path::new("/dev/null"),
            "the reserve descriptor is not /dev/null"
        );
        // fdinfo lists the open flags in octal, with O_CLOEXEC among them while the descriptor has FD_CLOEXEC.
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{descriptor}"))
            .expect("read the descriptor's fdinfo");
        let flags = info
            .lines()
            .find_map(|line| line.strip_prefix("flags:"))
            .map(|octal| i32::from_str_radix(octal.trim(), 8).expect("fdinfo flags are octal"))
            .expect("fdinfo has no flags line");
        assert_eq!(
            flags & libc::O_ACCMODE,
            libc::O_RDONLY,
            "the reserve descriptor should be read-only, its flags are {flags:o}"
        );
        assert_ne!(
            flags & libc::O_CLOEXEC,
            0,
            "the reserve descriptor is not close-on-exec (flags {flags:o}), so a child would inherit it"
        );
    }
}
