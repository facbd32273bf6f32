//! A process descriptor (`pidfd_open(2)`): readable when the child exits, reaped with `waitid(P_PIDFD)`.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::{cvt, shim};

/// How a reaped child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// It called `exit` with this code.
    Exited(i32),
    /// A signal with this number ended it.
    Signaled(i32),
}

/// A close-on-exec descriptor for one child process (Linux 5.3+; reaping needs 5.4+).
#[derive(Debug)]
pub struct PidFd {
    descriptor: OwnedFd,
}

impl PidFd {
    /// Opens a descriptor for `pid`, which must be a child nobody else reaps (else the pid may be reused).
    pub fn open(pid: u32) -> io::Result<Self> {
        let pid =
            libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        shim::enter("pidfd_open")?;
        // SAFETY: pidfd_open(2) takes a pid and flags, no pointers; the result is a new close-on-exec
        // descriptor we own alone.
        let raw = cvt!(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
        // SAFETY: `raw` was just returned by pidfd_open(2) and fits a c_int (descriptors do).
        let descriptor = unsafe { OwnedFd::from_raw_fd(raw as i32) };
        Ok(Self { descriptor })
    }

    /// Reaps the child if it has exited: `Ok(None)` while it runs. Once reaped, later calls fail with `ECHILD`.
    pub fn try_wait(&self) -> io::Result<Option<ExitStatus>> {
        // SAFETY: siginfo_t is plain data for which all-zero bytes are valid.
        let mut information: libc::siginfo_t = unsafe { std::mem::zeroed() };
        shim::enter("waitid")?;
        // SAFETY: `information` is a live siginfo_t to write; P_PIDFD (3) takes our live descriptor as the
        // id (waitid(2), Linux 5.4).
        cvt!(unsafe {
            libc::waitid(
                P_PIDFD,
                self.descriptor.as_raw_fd() as libc::id_t,
                &mut information,
                libc::WEXITED | libc::WNOHANG,
            )
        })?;
        // SAFETY: waitid filled `information` for a child event, or left it zeroed (si_pid 0) with WNOHANG.
        let pid = unsafe { information.si_pid() };
        if pid == 0 {
            return Ok(None);
        }
        // SAFETY: as above, the child fields are valid once si_pid is set.
        let status = unsafe { information.si_status() };
        if information.si_code == libc::CLD_EXITED {
            Ok(Some(ExitStatus::Exited(status)))
        } else {
            Ok(Some(ExitStatus::Signaled(status)))
        }
    }

    /// Sends `signal` to the process through the descriptor, so a reused pid is never hit.
    pub fn send_signal(&self, signal: i32) -> io::Result<()> {
        shim::enter("pidfd_send_signal")?;
        // SAFETY: pidfd_send_signal(2) with a null siginfo and zero flags reads no memory of ours.
        cvt!(unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.descriptor.as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        })?;
        Ok(())
    }
}

/// `P_PIDFD` from `<linux/wait.h>`, not exported by every libc version.
const P_PIDFD: libc::idtype_t = 3;

impl AsFd for PidFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.descriptor.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::{ExitStatus, PidFd};
    use std::time::{Duration, Instant};

    // The child is reaped through the pidfd (waitid), which clippy cannot see.
    #[allow(clippy::zombie_processes)]
    #[test]
    fn an_exited_child_is_reaped_with_its_code() {
        let child = std::process::Command::new("/bin/sh")
            .args(["-c", "exit 3"])
            .spawn()
            .expect("spawn /bin/sh");
        let descriptor = PidFd::open(child.id()).expect("pidfd_open");
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = descriptor.try_wait().expect("waitid") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "the child should exit within 10 s"
            );
            std::thread::sleep(Duration::from_millis(2));
        };
        assert_eq!(
            status,
            ExitStatus::Exited(3),
            "the exit code should come through"
        );
    }
}
