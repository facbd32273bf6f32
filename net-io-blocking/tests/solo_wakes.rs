//! What ends a loop's solo read early (a new connection, a kill, a drain or shutdown, an idle peer, a deadline):
//! the event loop's waits in `recv` under `SO_RCVTIMEO` for its one busy connection never hold up the rest.

mod common;

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::sessions::ParkOrEcho;
use common::{Recorder, SOON, client, eventually, round_trip};
use net_io_blocking::{CloseReason, ConnectionInfo, Limits, Server, ServerBuilder, SessionDriver};

/// Thread activity is read process-wide, so the tests take turns.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A one-loop echo server (`ParkOrEcho`) whose solo reads last at most `slice`.
fn solo_server(slice: Duration, limits: Limits, recorder: &Recorder) -> Server {
    ServerBuilder::new()
        .listen("127.0.0.1:0")
        .session_driver(SessionDriver::EventLoop { loops: 1 })
        .solo_read_slice(slice)
        .limits(limits)
        .events(recorder.clone())
        .sessions(|_: &ConnectionInfo| {
            Some(ParkOrEcho {
                completers: Arc::default(),
            })
        })
        .allow_all()
        .build()
        .expect("the event-loop server should start")
}

/// A slice far longer than anything the tests wait for: whatever ends a solo read sooner did it, not the
/// slice running out.
const LONG_SLICE: Duration = Duration::from_secs(2);

/// Waits until the loop is surely blocked in the solo read that follows a round trip.
fn settle_into_the_solo_read() {
    std::thread::sleep(Duration::from_millis(50));
}

/// The newest loop thread `net-io-loop-0` of this process (the current test's server; tests take turns):
/// its context switches and its CPU ticks so far.
fn loop_thread_activity() -> (u64, u64) {
    let tasks = std::fs::read_dir("/proc/self/task").expect("list this process's threads");
    let newest = tasks
        .filter_map(Result::ok)
        .filter(|task| {
            std::fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|name| name.trim_end() == "net-io-loop-0")
        })
        .max_by_key(|task| {
            task.file_name()
                .to_str()
                .and_then(|tid| tid.parse::<u64>().ok())
                .unwrap_or(0)
        });
    if let Some(task) = newest {
        let status = std::fs::read_to_string(task.path().join("status")).expect("read its status");
        let switches: u64 = status
            .lines()
            .filter(|line| line.contains("ctxt_switches:"))
            .filter_map(|line| line.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum();
        let stat = std::fs::read_to_string(task.path().join("stat")).expect("read its stat");
        // Fields after the command name (which may hold spaces) start after the last ')'; utime and stime
        // are the 14th and 15th fields of the line, the 12th and 13th after it.
        let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let ticks = fields.get(11..13).map_or(0, |times| {
            times.iter().filter_map(|t| t.parse::<u64>().ok()).sum()
        });
        return (switches, ticks);
    }
    panic!("no thread named net-io-loop-0 in this process");
}

#[test]
fn a_second_connection_reaches_a_loop_in_a_solo_read_within_one_slice() {
    let _turn = turn();
    let limits = Limits::new().idle_timeout(Duration::from_secs(60));
    // The default slice: the newcomer waits at most for its end (a jiffy or two).
    let recorder = Recorder::default();
    let server = solo_server(Duration::from_millis(1), limits, &recorder);
    let mut first = client(server.local_addr());
    let mut slowest = Duration::ZERO;
    for attempt in 0..20 {
        assert_eq!(round_trip(&mut first, b"busy\n"), b"busy\n");
        let started = Instant::now();
        let mut second = client(server.local_addr());
        assert_eq!(
            round_trip(&mut second, b"new\n"),
            b"new\n",
            "attempt {attempt}: the newcomer should be served"
        );
        slowest = slowest.max(started.elapsed());
        drop(second);
        assert!(
            eventually(SOON, || recorder.closes().len() == attempt + 1),
            "attempt {attempt}: the newcomer should close"
        );
    }
    println!("newcomer's first round trip beside a solo connection, slowest of 20: {slowest:?}");
    assert!(
        slowest < Duration::from_millis(500),
        "a new connection waited {slowest:?} beside a connection in 1 ms solo reads"
    );
    drop(server);
    // A long slice shows the bound: the newcomer is served once the slice ends, not before.
    let recorder = Recorder::default();
    let slice = Duration::from_millis(300);
    let server = solo_server(slice, limits, &recorder);
    let mut first = client(server.local_addr());
    assert_eq!(round_trip(&mut first, b"busy\n"), b"busy\n");
    let started = Instant::now();
    let mut second = client(server.local_addr());
    assert_eq!(round_trip(&mut second, b"new\n"), b"new\n");
    let waited = started.elapsed();
    println!("newcomer's first round trip beside a connection in {slice:?} solo reads: {waited:?}");
    assert!(
        waited < slice + Duration::from_secs(1),
        "a new connection waited {waited:?}, more than one {slice:?} slice and a second's margin"
    );
    // And once the loop holds two connections, neither is read alone: both are served at once.
    let started = Instant::now();
    for _ in 0..10 {
        assert_eq!(round_trip(&mut first, b"a\n"), b"a\n");
        assert_eq!(round_trip(&mut second, b"b\n"), b"b\n");
    }
    // A solo read holding either would cost a slice per round trip (3 s for the 10); five slices is the
    // margin for a loaded machine.
    assert!(
        started.elapsed() < slice * 5,
        "two connections on one loop took {:?} for 10 round trips each: a solo read held one",
        started.elapsed()
    );
    drop(server);
}

#[test]
fn a_kill_ends_a_solo_read_at_once() {
    let _turn = turn();
    let recorder = Recorder::default();
    let limits = Limits::new().idle_timeout(Duration::from_secs(60));
    let server = solo_server(LONG_SLICE, limits, &recorder);
    let handle = server.handle();
    // Quiet after a round trip: the loop is blocked in the solo read.
    let mut quiet = client(server.local_addr());
    assert_eq!(round_trip(&mut quiet, b"hi\n"), b"hi\n");
    settle_into_the_solo_read();
    let id = handle.connections()[0];
    let started = Instant::now();
    assert!(handle.kill(id, 3), "the kill should win");
    assert!(
        eventually(SOON, || recorder.closes().len() == 1),
        "the killed connection should close"
    );
    let took = started.elapsed();
    println!("kill of a connection in a solo read: closed after {took:?}");
    assert_eq!(recorder.closes()[0].1, CloseReason::Killed(3));
    assert!(
        took < Duration::from_millis(500),
        "a kill took {took:?} to end a solo read (the slice is {LONG_SLICE:?}): the kill must interrupt it"
    );
    assert!(
        common::is_closed_by_server(&mut quiet),
        "the client should see the close"
    );
    // Busy: a client in a tight loop of round trips, killed in the middle.
    let mut busy = client(server.local_addr());
    assert_eq!(round_trip(&mut busy, b"hi\n"), b"hi\n");
    let id = handle.connections()[0];
    let client_thread = std::thread::spawn(move || {
        let mut reply = [0u8; 3];
        let mut round_trips = 0u64;
        while busy.write_all(b"go\n").is_ok() && busy.read_exact(&mut reply).is_ok() {
            round_trips += 1;
        }
        round_trips
    });
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    assert!(
        handle.kill(id, 4),
        "the kill of the busy connection should win"
    );
    assert!(
        eventually(SOON, || recorder.closes().len() == 2),
        "the busy connection should close"
    );
    let took = started.elapsed();
    let round_trips = client_thread.join().expect("the client thread panicked");
    println!(
        "kill of a busy solo connection after {round_trips} round trips: closed after {took:?}"
    );
    assert_eq!(recorder.closes()[1].1, CloseReason::Killed(4));
    assert!(
        took < Duration::from_millis(500),
        "a kill of a busy solo connection took {took:?}"
    );
    drop(server);
}

#[test]
fn a_drain_and_a_shutdown_end_solo_reads_at_once() {
    let _turn = turn();
    let limits = Limits::new().idle_timeout(Duration::from_secs(60));
    let recorder = Recorder::default();
    let server = solo_server(LONG_SLICE, limits, &recorder);
    let mut stream = client(server.local_addr());
    assert_eq!(round_trip(&mut stream, b"hi\n"), b"hi\n");
    settle_into_the_solo_read();
    let report = server.handle().drain(Instant::now() + SOON);
    println!("drain of a connection in a solo read: {report:?}");
    assert_eq!(
        (report.graceful, report.killed),
        (1, 0),
        "the idle connection in its solo read should be drained gracefully"
    );
    assert!(
        report.elapsed < Duration::from_millis(500),
        "the drain took {:?} (the slice is {LONG_SLICE:?}): it must interrupt the solo read",
        report.elapsed
    );
    assert_eq!(recorder.single_close(SOON), CloseReason::Drained);
    assert!(common::is_closed_by_server(&mut stream));
    drop(server);

    let recorder = Recorder::default();
    let server = solo_server(LONG_SLICE, limits, &recorder);
    let mut stream = client(server.local_addr());
    assert_eq!(round_trip(&mut stream, b"hi\n"), b"hi\n");
    settle_into_the_solo_read();
    let started = Instant::now();
    let report = server.shutdown(Instant::now() + SOON);
    let took = started.elapsed();
    println!("shutdown with a connection in a solo read: {report:?}, returned after {took:?}");
    assert!(
        took < Duration::from_secs(1),
        "the shutdown took {took:?} (the slice is {LONG_SLICE:?}): it must interrupt the solo read"
    );
    assert_eq!(recorder.single_close(SOON), CloseReason::Shutdown);
    assert!(common::is_closed_by_server(&mut stream));
}

#[test]
fn an_idle_connection_leaves_solo_reads_and_its_loop_sleeps() {
    let _turn = turn();
    let recorder = Recorder::default();
    let limits = Limits::new().idle_timeout(Duration::from_secs(60));
    let server = solo_server(Duration::from_millis(1), limits, &recorder);
    let mut stream = client(server.local_addr());
    for _ in 0..50 {
        assert_eq!(round_trip(&mut stream, b"hi\n"), b"hi\n");
    }
    // One slice (and the wait that follows it) after the last round trip, then a second of idling.
    std::thread::sleep(Duration::from_millis(100));
    let (switches_before, ticks_before) = loop_thread_activity();
    std::thread::sleep(Duration::from_secs(1));
    let (switches_after, ticks_after) = loop_thread_activity();
    let (switches, ticks) = (switches_after - switches_before, ticks_after - ticks_before);
    println!(
        "loop thread over 1 s idle beside one idle connection: {switches} wake-ups, {ticks} CPU ticks"
    );
    assert!(
        switches <= 3,
        "the loop thread woke {switches} times in 1 s beside an idle connection: solo reads must end once \
         the connection goes quiet"
    );
    assert!(
        ticks <= 2,
        "the loop thread used {ticks} CPU ticks in 1 s of idling"
    );
    // It still serves the connection when it speaks again.
    assert_eq!(round_trip(&mut stream, b"back\n"), b"back\n");
    drop(server);
}

#[test]
fn deadlines_fire_on_time_while_a_loop_reads_one_connection_alone() {
    let _turn = turn();
    let recorder = Recorder::default();
    let idle = Duration::from_millis(300);
    let limits = Limits::new().idle_timeout(idle);
    let server = solo_server(LONG_SLICE, limits, &recorder);
    let mut stream = client(server.local_addr());
    for _ in 0..20 {
        assert_eq!(round_trip(&mut stream, b"hi\n"), b"hi\n");
    }
    let started = Instant::now();
    assert!(
        common::is_closed_by_server(&mut stream),
        "the idle connection should be closed by the server"
    );
    let took = started.elapsed();
    println!("idle timeout of {idle:?} beside {LONG_SLICE:?} solo reads: closed after {took:?}");
    assert_eq!(recorder.single_close(SOON), CloseReason::Idle);
    assert!(
        took >= idle - Duration::from_millis(50),
        "the idle timeout fired after {took:?}, before its {idle:?}"
    );
    assert!(
        took < idle + Duration::from_secs(1),
        "the idle timeout fired after {took:?}: a solo read must end at the connection's next timer, not \
         at the end of its {LONG_SLICE:?} slice"
    );
    drop(server);
}
