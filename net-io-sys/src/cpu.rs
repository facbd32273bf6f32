//! Which core the calling thread is running on, for code that adapts to sharing a core with another thread.

/// The core the calling thread runs on at this instant, or `None` where the kernel cannot tell (the answer may
/// be stale by the time it is used: the thread can migrate at any moment, so callers use it as a hint only).
///
/// Cheap: glibc 2.35 and later answer it from the thread's restartable-sequence area, older ones through the
/// vDSO on x86, neither with a system call. Under `--cfg net_io_shim` it goes through the shim's counter like
/// every other call here, which is slow but only ever in tests.
#[inline]
pub fn current_cpu() -> Option<usize> {
    if crate::shim::enter("sched_getcpu").is_err() {
        return None;
    }
    // SAFETY: sched_getcpu(3) takes no arguments and touches no memory of ours; it returns a core number or
    // -1 with errno set, both handled below.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_current_core_is_below_the_machine_s_configured_core_count() {
        let cpu = current_cpu().expect("Linux tells a thread its core");
        let cores = std::thread::available_parallelism()
            .map(usize::from)
            .unwrap_or(1);
        // available_parallelism counts the cores of our affinity mask; the core numbers can be sparse (a
        // cpuset of 4,7), so bound by the machine's configured cores instead.
        // SAFETY: sysconf(3) with a valid name has no memory effects.
        let configured = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
        assert!(
            configured >= cores as libc::c_long,
            "{configured} configured cores, fewer than the {cores} this process may use"
        );
        assert!(
            (cpu as libc::c_long) < configured,
            "core {cpu} is not below the {configured} configured cores"
        );
    }
}
