//! The fault-injection shim: per-site call counters and programmed faults, compiled in only under `cfg(net_io_shim)`.
//!
//! Each OS call site names itself (`"recv"`, `"send"`, `"accept4"`, `"epoll_wait"`, ...) and calls
//! [`enter`] before the system call. Tests built with `--cfg net_io_shim` read `calls` to count system
//! calls per operation and use `inject` to make the next calls of a site fail with a chosen `errno`.
//! Without the cfg, [`enter`] is an empty inline function and the other items do not exist.

use std::io;

#[cfg(net_io_shim)]
mod enabled {
    use std::collections::HashMap;
    use std::io;
    use std::sync::Mutex;

    /// A fault programmed for one call site.
    #[derive(Debug, Clone, Copy)]
    struct Fault {
        /// Calls to let through before the fault starts.
        skip: u64,
        /// How many calls fail once it has started.
        repeat: u64,
        /// The `errno` each failing call returns.
        errno: i32,
    }

    #[derive(Debug, Default)]
    struct Site {
        calls: u64,
        fault: Option<Fault>,
    }

    static SITES: Mutex<Option<HashMap<&'static str, Site>>> = Mutex::new(None);

    pub(super) fn enter(site: &'static str) -> io::Result<()> {
        let mut guard = SITES
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let entry = guard
            .get_or_insert_with(HashMap::new)
            .entry(site)
            .or_default();
        entry.calls += 1;
        let Some(fault) = entry.fault.as_mut() else {
            return Ok(());
        };
        if fault.skip > 0 {
            fault.skip -= 1;
            return Ok(());
        }
        if fault.repeat == 0 {
            entry.fault = None;
            return Ok(());
        }
        fault.repeat -= 1;
        let errno = fault.errno;
        if fault.repeat == 0 {
            entry.fault = None;
        }
        Err(io::Error::from_raw_os_error(errno))
    }

    /// Makes calls at `site` fail with `errno`: the first `skip` calls pass, then `repeat` calls fail.
    pub fn inject(site: &'static str, skip: u64, repeat: u64, errno: i32) {
        let mut guard = SITES
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let entry = guard
            .get_or_insert_with(HashMap::new)
            .entry(site)
            .or_default();
        entry.fault = Some(Fault {
            skip,
            repeat,
            errno,
        });
    }

    /// How many times `site` has been entered since the process started or [`reset`] ran.
    pub fn calls(site: &str) -> u64 {
        let guard = SITES
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        guard
            .as_ref()
            .and_then(|sites| sites.get(site))
            .map_or(0, |entry| entry.calls)
    }

    /// Clears every counter and every programmed fault.
    pub fn reset() {
        let mut guard = SITES
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *guard = None;
    }
}

#[cfg(net_io_shim)]
pub use enabled::{calls, inject, reset};

/// Marks one OS call at `site`; under `cfg(net_io_shim)` it counts the call and may return an injected fault.
#[inline(always)]
pub fn enter(site: &'static str) -> io::Result<()> {
    #[cfg(net_io_shim)]
    {
        enabled::enter(site)
    }
    #[cfg(not(net_io_shim))]
    {
        let _ = site;
        Ok(())
    }
}
