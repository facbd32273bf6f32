//! Task kinds: channels, files, file watches and processes.

mod common;

use std::time::{Duration, Instant};

use task_runtime::{
    Change, Channel, Exit, File, FileOutput, Process, Runtime, RuntimeError, TaskState,
};

use common::{becomes_running, init, join, take, wait_until};

fn scratch(name: &str) -> std::path::PathBuf {
    let directory = std::env::temp_dir().join(format!("kinds-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("dir");
    directory
}

#[test]
fn a_channel_keeps_order_parks_a_receive_and_closes_after_draining() {
    init();
    let (sender, receiver) = Channel::unbounded::<u32>();
    for value in 0..5 {
        sender.send(value).expect("send");
    }
    for value in 0..5 {
        assert_eq!(
            take(
                Runtime::task(receiver.receive()).spawn(),
                "a receive of a queued value"
            ),
            Ok(value),
            "order is kept"
        );
    }
    let parked = Runtime::task(receiver.receive()).spawn();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        parked.state(),
        TaskState::Running,
        "an empty channel parks the receive"
    );
    sender.send(99).expect("send");
    assert_eq!(
        take(parked, "the parked receive"),
        Ok(99),
        "a send wakes the parked receive"
    );
    sender.send(1).expect("send");
    sender.close();
    assert_eq!(
        take(
            Runtime::task(receiver.receive()).spawn(),
            "a receive after close"
        ),
        Ok(1),
        "close drains first"
    );
    assert_eq!(
        take(
            Runtime::task(receiver.receive()).spawn(),
            "a receive on a drained, closed channel"
        ),
        Err(RuntimeError::Closed),
        "then reads Closed"
    );
}

#[test]
fn a_cancelled_receive_takes_nothing_and_a_receive_can_time_out() {
    init();
    let (sender, receiver) = Channel::unbounded::<u32>();
    let cancelled = Runtime::task(receiver.receive()).spawn();
    std::thread::sleep(Duration::from_millis(10));
    cancelled.cancel();
    sender.send(5).expect("send");
    assert_eq!(
        take(
            Runtime::task(receiver.receive()).spawn(),
            "a receive after a cancelled one"
        ),
        Ok(5),
        "the value is still there"
    );
    let timed = Runtime::task(receiver.receive())
        .timeout(Duration::from_millis(50))
        .spawn();
    assert_eq!(
        join(&timed, "a receive with a 50 ms timeout"),
        Err(RuntimeError::TimedOut),
        "a receive can time out"
    );
}

#[test]
fn a_bounded_send_parks_while_full() {
    init();
    let (sender, receiver) = Channel::bounded::<u32>(1);
    sender.send(1).expect("first fits");
    assert_eq!(
        sender.send(2),
        Err(RuntimeError::NotReady),
        "the second does not"
    );
    let parked = Runtime::task(sender.send_task(2)).spawn();
    assert!(becomes_running(&parked), "the bounded send parks");
    assert_eq!(receiver.try_receive(), Ok(1));
    assert_eq!(
        join(&parked, "the parked bounded send"),
        Ok(()),
        "room wakes the send"
    );
    assert_eq!(receiver.try_receive(), Ok(2));
}

#[test]
fn files_are_written_appended_read_and_listed_on_blocking_threads() {
    init();
    let directory = scratch("files");
    let path = directory.join("data");
    let written = take(
        Runtime::task(File::write(&path, b"one ".to_vec())).spawn(),
        "a file write",
    );
    assert!(matches!(written, Ok(FileOutput::Written(4))), "{written:?}");
    take(
        Runtime::task(File::append(&path, b"two".to_vec())).spawn(),
        "a file append",
    )
    .expect("append");
    match take(Runtime::task(File::read(&path)).spawn(), "a file read") {
        Ok(FileOutput::Bytes(bytes)) => assert_eq!(bytes, b"one two"),
        other => panic!("read gave {other:?}"),
    }
    match take(
        Runtime::task(File::metadata(&path)).spawn(),
        "a metadata read",
    ) {
        Ok(FileOutput::Metadata(metadata)) => assert_eq!(metadata.len(), 7),
        other => panic!("metadata gave {other:?}"),
    }
    match take(
        Runtime::task(File::read_dir(&directory)).spawn(),
        "a directory listing",
    ) {
        Ok(FileOutput::Entries(entries)) => assert_eq!(entries, vec![path.clone()]),
        other => panic!("read_dir gave {other:?}"),
    }
    assert_eq!(
        take(
            Runtime::task(File::read(directory.join("missing"))).spawn(),
            "a read of a missing file"
        )
        .map(|_| ()),
        Err(RuntimeError::BadPath),
        "a missing file reads BadPath"
    );
    std::fs::remove_dir_all(&directory).expect("clean up");
}

#[test]
fn a_repeated_watch_loses_no_change_between_runs() {
    init();
    let directory = scratch("watch");
    let path = directory.join("watched");
    std::fs::write(&path, b"a").expect("write");
    // A 300 ms gap between runs: the second write lands while the watch is not parked at all.
    let watch = Runtime::task(File::watch(&path))
        .repeat()
        .every(Duration::from_millis(300))
        .count(2)
        .spawn();
    std::thread::sleep(Duration::from_millis(50));
    std::fs::write(&path, b"bb").expect("write");
    // One 10 s budget for both runs.
    let deadline = Instant::now() + Duration::from_secs(10);
    wait_until(
        deadline.saturating_duration_since(Instant::now()),
        "the first change should end the first run",
        || watch.try_join().is_ok(),
    );
    std::fs::write(&path, b"ccc").expect("write");
    wait_until(
        deadline.saturating_duration_since(Instant::now()),
        "the change made between runs should end the second run",
        || watch.is_finished(),
    );
    assert_eq!(
        join(&watch, "the repeated watch's last run"),
        Ok(Change::Written)
    );
    std::fs::remove_dir_all(&directory).expect("clean up");
}

#[test]
fn processes_run_capture_output_and_die_on_cancel() {
    init();
    assert_eq!(
        join(
            &Runtime::task(Process::run("/bin/sh", ["-c", "exit 3"])).spawn(),
            "a run of `sh -c 'exit 3'`"
        ),
        Ok(Exit::Code(3)),
        "run returns the exit code"
    );
    let output = take(
        Runtime::task(
            Process::command("/bin/sh")
                .args([
                    "-c",
                    "head -c 300000 /dev/zero; head -c 300000 /dev/zero >&2; cat",
                ])
                .input(b"echoed".to_vec())
                .output(),
        )
        .spawn(),
        "a process flooding stdout and stderr",
    )
    .expect("output");
    assert_eq!(
        output.stdout.len(),
        300_006,
        "stdout floods without deadlock"
    );
    assert_eq!(output.stderr.len(), 300_000, "stderr too");
    let started = Instant::now();
    let long = Runtime::task(Process::run("/bin/sh", ["-c", "sleep 30"]))
        .timeout(Duration::from_millis(100))
        .spawn();
    assert_eq!(
        join(&long, "a 30 s child with a 100 ms timeout"),
        Err(RuntimeError::TimedOut),
        "a timeout stops the child"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        join(
            &Runtime::task(
                Process::command("/bin/true")
                    .current_dir("/no/such/dir")
                    .run()
            )
            .spawn(),
            "a run in a missing directory"
        ),
        Err(RuntimeError::BadDirectory)
    );
}

#[test]
fn a_spawned_process_can_be_waited_on_and_killed() {
    init();
    let child = Process::spawn(Process::command("/bin/sh").args(["-c", "exit 7"])).expect("spawn");
    assert_eq!(
        join(
            &Runtime::task(child.wait()).spawn(),
            "the wait on `sh -c 'exit 7'`"
        ),
        Ok(Exit::Code(7))
    );
    let sleeper =
        Process::spawn(Process::command("/bin/sh").args(["-c", "sleep 30"])).expect("spawn");
    let waiting = Runtime::task(sleeper.wait()).spawn();
    assert!(
        becomes_running(&waiting),
        "the wait parks on the pidfd while the child runs"
    );
    sleeper.kill();
    assert_eq!(
        waiting.join_with_timeout(Duration::from_secs(10)),
        Ok(Exit::Signal(libc::SIGKILL)),
        "a kill wakes the wait with the signal"
    );
}
