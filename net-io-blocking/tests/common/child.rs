//! Child processes for the tests that need a process of their own: this test binary re-run for one test,
//! told by an environment variable that it is the child.

use std::env;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output};
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

/// Waits up to `timeout` for `child` (spawned with piped stdout and stderr, or either left alone) to exit and
/// returns what it printed. Both pipes are read while it runs, so a child that prints much (a full backtrace)
/// does not stall on a full pipe and look hung. A child still running at `timeout` is killed, and the test
/// fails with what it printed instead of hanging the test run.
pub fn output_within(mut child: Child, timeout: Duration) -> Output {
    let stdout = read_in_background(child.stdout.take());
    let stderr = read_in_background(child.stderr.take());
    let status = exit_within(&mut child, timeout);
    // The child has exited or been killed and reaped, so both pipes are at their end.
    let stdout = stdout.join().expect("the child's stdout reader panicked");
    let stderr = stderr.join().expect("the child's stderr reader panicked");
    let Some(status) = status else {
        panic!(
            "the child ran past {timeout:?} and was killed; it printed:\n{}\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        );
    };
    Output {
        status,
        stdout,
        stderr,
    }
}

/// Waits for `child` as [`output_within`] does, fails the test unless it exited successfully, and returns
/// what follows `RESULT ` on each line it printed (libtest prints `test NAME ... ` without a newline before
/// a test's own output, so the marker may sit mid-line).
pub fn result_lines(child: Child, timeout: Duration) -> Vec<String> {
    let output = output_within(child, timeout);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the child failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
        .lines()
        .filter_map(|line| {
            line.split_once("RESULT ")
                .map(|(_, result)| result.to_owned())
        })
        .collect()
}

/// Reads `pipe` to its end on a thread of its own.
fn read_in_background(
    pipe: Option<impl Read + Send + 'static>,
) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        bytes
    })
}
