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
    use super::*;

    #[test]
    fn the_descriptor_limit_is_readable_and_the_soft_limit_is_within_the_hard_one() {
        let limit = descriptor_limit().expect("getrlimit");
        assert!(
            limit.soft <= limit.hard,
            "soft {} above hard {}",
            limit.soft,
            limit.hard
        );
        assert!(
            limit.soft >= 16,
            "a soft limit of {} leaves no room to run",
            limit.soft
        );
    }

    #[test]
    fn the_reserve_descriptor_opens() {
        let reserve = open_reserve().expect("open /dev/null");
        drop(reserve);
    }
}
