//! Child processes for the tests that need a process of their own: this test binary re-run for one test,
//! told by an environment variable that it is the child.

use std::env;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// Whether this process is a child started with `variable` set (see [`rerun`]).
pub fn is_child(variable: &str) -> bool {
    env::var_os(variable).is_some()
}

/// The path of this test binary, to re-run it.
pub fn this_binary() -> PathBuf {
    env::current_exe().expect("no path to this test binary")
}

/// The libtest arguments that run `test` alone, one thread, with its output printed as it happens (the
/// parent reads the child's lines while it runs).
pub fn only_test(test: &str) -> [&str; 4] {
    [test, "--exact", "--nocapture", "--test-threads=1"]
}

/// A command that re-runs this test binary for `test` alone with `variable` set, so the test takes the
/// child's part. The caller adds its pipes and spawns it.
pub fn rerun(test: &str, variable: &str) -> Command {
    let mut command = Command::new(this_binary());
    command.args(only_test(test)).env(variable, "1");
    command
}

/// Waits up to `timeout` for `child` to exit; past it, kills and reaps the child and returns `None`, so a
/// hung child fails the test instead of hanging it.
pub fn exit_within(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("could not wait for the child") {
            return Some(status);
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
