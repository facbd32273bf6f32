//! OS calls for the workspace behind safe types: sockets, polling, kernel event primitives, rlimits, memory maps.
//!
//! This is the one crate of the workspace that holds `unsafe` OS code. Every block carries a `// SAFETY:`
//! comment naming the invariant it relies on and the man page that states it. Raw descriptors never cross
//! the crate boundary: functions take `BorrowedFd` and return `OwnedFd`, and every descriptor is `CLOEXEC`.
//!
//! Every call site goes through [`shim::enter`] first. In a normal build that is an empty inline function;
//! built with `RUSTFLAGS="--cfg net_io_shim"` it counts calls per site and can inject faults, so that
//! release builds can never carry fault injection.

#![warn(missing_docs)]
// The README example runs as a doctest, so the crate's front page cannot drift from its API.
#![cfg_attr(doctest, doc = include_str!("../README.md"))]

pub mod coroutine;
pub mod cpu;
pub mod epoll;
pub mod eventfd;
pub mod futex;
pub mod inherit;
pub mod inotify;
pub mod kill;
pub mod memory;
pub mod pidfd;
pub mod process;
pub mod rlimit;
pub mod shim;
pub mod signal;
pub mod socket;
pub mod termination;
pub mod timerfd;
pub mod wait;

use std::io;

/// Turns a `-1` return of a libc call into the thread's `errno` as an [`io::Error`].
///
/// Works for any signed integer return type (`c_int`, `ssize_t`).
#[macro_export]
#[doc(hidden)]
macro_rules! cvt {
    ($call:expr) => {{
        let result = $call;
        if result == -1 {
            Err(::std::io::Error::last_os_error())
        } else {
            Ok(result)
        }
    }};
}

/// Runs `operation` again while it fails with `EINTR`, so a signal never surfaces as an error.
///
/// Callers with a deadline pass a closure that recomputes the time left on each attempt.
pub fn retry_interrupted<T>(mut operation: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match operation() {
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}
