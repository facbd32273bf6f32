//! Child processes tied to their parent: a child that gets SIGTERM when the thread that started it ends.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes the child `command` starts receive SIGTERM when the thread that spawns it ends (with its process,
/// however that ends: even SIGKILL), so a supervisor's stage processes never outlive it. Spawn from a thread
/// that lives as long as the children should (the main thread).
pub fn terminate_with_parent(command: &mut Command) -> &mut Command {
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe calls are
    // allowed: prctl(2), getppid(2) and kill(2) are; it allocates nothing and touches no lock.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl: then no signal would ever come.
            if libc::getppid() as u32 != parent {
                libc::kill(libc::getpid(), libc::SIGTERM);
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_tied_to_its_parent_runs_normally_while_the_parent_lives() {
        let status = terminate_with_parent(&mut Command::new("true"))
            .status()
            .expect("true runs");
        assert!(status.success());
    }

    #[test]
    fn a_child_is_terminated_when_the_thread_that_spawned_it_ends() {
        let child = std::thread::spawn(|| {
            terminate_with_parent(Command::new("sleep").arg("30"))
                .spawn()
                .expect("sleep starts")
        })
        .join()
        .expect("the spawning thread ends");
        let mut child = child;
        let started = std::time::Instant::now();
        let status = child.wait().expect("the child is reaped");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the child outlived its parent thread"
        );
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGTERM));
    }
}
