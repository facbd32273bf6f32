//! Helpers shared by the test binaries: starting the runtime, waiting for a task to run, joins that
//! give up after a deadline, and RSS, thread count and CPU time from /proc/self.

#![allow(dead_code)]

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use task_runtime::{Runtime, RuntimeError, TaskHandle};

/// How long a test waits for a task or thread that should end. Everything these tests wait for ends in
/// well under a second on an idle machine; a minute leaves room for a loaded 2-core CI box while a
/// hang (a lost wake, a deadlock) fails with a message long before CI's 40-minute cap.
pub const JOIN_PATIENCE: Duration = Duration::from_secs(60);

/// Keeps the panics a test causes on purpose (messages starting with one of `expected`) out of its output and
/// prints every other one as before: a hook that hid them all would also hide the message of an assertion
/// that fails, or of a bug in the runtime. Hooks are process-wide; a second call adds its messages to the
/// first's.
pub fn quiet_expected_panics(expected: &'static [&'static str]) {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if !expected.iter().any(|start| message.starts_with(start)) {
            previous(info);
        }
    }));
}

/// Starts the default runtime unless a test of this binary already did (the runtime is process-wide).
pub fn init() {
    match Runtime::init() {
        Ok(()) | Err(RuntimeError::AlreadyInit) => {}
        Err(error) => panic!("init failed: {error}"),
    }
}

/// Waits up to 10 s for `handle` to be started and parked: on a loaded 2-core machine a worker can take far
/// longer than a fixed 20-50 ms sleep to pick a fresh task up, and the check is that it parks, not how fast.
pub fn becomes_running<T: Send + 'static, G>(handle: &TaskHandle<T, G>) -> bool {
    holds_within(Duration::from_secs(10), Duration::from_millis(2), || {
        handle.is_running()
    })
}

/// Checks `condition` every 2 ms until it holds, failing the test with `expectation` (a sentence
/// saying what should happen) if it still does not after `limit`.
#[track_caller]
pub fn wait_until(limit: Duration, expectation: &str, condition: impl Fn() -> bool) {
    if !holds_within(limit, Duration::from_millis(2), condition) {
        panic!("{expectation}, but after {limit:?} it still had not");
    }
}

/// Waits up to `limit` for `handle` to end for good (for a repeat: its last run is over); false if it
/// has not, so a test fails with its own message instead of hanging.
pub fn finishes_within<T: Send + 'static, G>(handle: &TaskHandle<T, G>, limit: Duration) -> bool {
    holds_within(limit, Duration::from_millis(5), || handle.is_finished())
}

/// Joins `handle` as [`TaskHandle::join`] does, but fails the test naming `what` if the task has not
/// settled within [`JOIN_PATIENCE`] instead of hanging.
#[track_caller]
pub fn join<T: Clone + Send + 'static, G>(
    handle: &TaskHandle<T, G>,
    what: &str,
) -> Result<T, RuntimeError> {
    join_within(handle, JOIN_PATIENCE, what)
}

/// [`join`] with its own limit (for the tests of this helper).
#[track_caller]
pub fn join_within<T: Clone + Send + 'static, G>(
    handle: &TaskHandle<T, G>,
    limit: Duration,
    what: &str,
) -> Result<T, RuntimeError> {
    let result = handle.join_with_timeout(limit);
    if matches!(result, Err(RuntimeError::NotReady)) && !handle.is_settled() {
        did_not_finish(what, limit, handle.state());
    }
    result
}

/// Takes the output as [`TaskHandle::take`] does, but fails the test naming `what` if the task has not
/// settled within [`JOIN_PATIENCE`].
#[track_caller]
pub fn take<T: Send + 'static, G>(handle: TaskHandle<T, G>, what: &str) -> Result<T, RuntimeError> {
    let result = handle.take_with_timeout(JOIN_PATIENCE);
    if matches!(result, Err(RuntimeError::NotReady)) && !handle.is_settled() {
        did_not_finish(what, JOIN_PATIENCE, handle.state());
    }
    result
}

/// Waits as [`TaskHandle::wait`] does (until the state is terminal), but fails the test naming `what`
/// if that takes longer than [`JOIN_PATIENCE`].
#[track_caller]
pub fn wait<T: Send + 'static, G>(handle: &TaskHandle<T, G>, what: &str) {
    if !holds_within(JOIN_PATIENCE, Duration::from_millis(1), || {
        handle.is_settled()
    }) {
        did_not_finish(what, JOIN_PATIENCE, handle.state());
    }
}

/// Joins a std thread, but fails the test naming `what` if it still runs after [`JOIN_PATIENCE`] (the
/// thread is then left behind; the failing test ends the process soon after).
#[track_caller]
pub fn join_thread<R>(thread: JoinHandle<R>, what: &str) -> std::thread::Result<R> {
    join_thread_within(thread, JOIN_PATIENCE, what)
}

/// [`join_thread`] with its own limit (for the tests of this helper).
#[track_caller]
pub fn join_thread_within<R>(
    thread: JoinHandle<R>,
    limit: Duration,
    what: &str,
) -> std::thread::Result<R> {
    if !holds_within(limit, Duration::from_millis(1), || thread.is_finished()) {
        did_not_finish(what, limit, "still running");
    }
    thread.join()
}

/// Runs `work` (a call that blocks, such as `Runtime::join_all`) on its own thread and returns what it
/// returns, failing the test naming `what` if it has not returned within [`JOIN_PATIENCE`].
#[track_caller]
pub fn within<R: Send + 'static>(what: &str, work: impl FnOnce() -> R + Send + 'static) -> R {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(work());
    });
    match result.recv_timeout(JOIN_PATIENCE) {
        Ok(value) => value,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            did_not_finish(what, JOIN_PATIENCE, "still blocked")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what} panicked"),
    }
}

#[track_caller]
fn did_not_finish(what: &str, limit: Duration, state: impl std::fmt::Debug) -> ! {
    panic!(
        "{what} did not finish within {limit:?} (state: {state:?}); something it waits for never came"
    )
}

/// Checks `condition` every `poll` until it holds (true) or `limit` has passed (false).
fn holds_within(limit: Duration, poll: Duration, condition: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !condition() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(poll);
    }
    true
}

/// A field of /proc/self/status in kB (VmRSS) or as a count (Threads).
pub fn status_field(name: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no {name} in /proc/self/status"))
}

/// Resident memory in bytes.
pub fn rss_bytes() -> u64 {
    status_field("VmRSS") * 1024
}

/// Threads of this process.
pub fn threads() -> u64 {
    status_field("Threads")
}

/// User plus system CPU time of this process (from /proc/self/stat, at USER_HZ = 100).
pub fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
    // The command name may hold spaces; fields after the closing parenthesis are plain.
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let user: u64 = fields[11].parse().expect("utime");
    let system: u64 = fields[12].parse().expect("stime");
    Duration::from_millis((user + system) * 10)
}

/// CPU used over `window`, as a fraction of one core.
pub fn cpu_share_over(window: Duration) -> f64 {
    let before = cpu_time();
    std::thread::sleep(window);
    let used = cpu_time() - before;
    used.as_secs_f64() / window.as_secs_f64()
}
