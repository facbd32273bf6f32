//! Blocking handlers on coroutines over the event loops (`HandlerDriver::Coroutines`): what that driver adds
//! to the handler suites (which `coroutine_suites.rs` runs on it): no thread per connection, suspended
//! handlers that are killed, drained, timed out or panic, replies larger than the output budget, and a stack
//! overflow that ends the process at the guard page (in a child process).
//!
//! The thread count is process-wide, so the test that counts threads runs alone (the others share a read
//! lock of `TURN`, it takes the write lock).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use common::{Recorder, SOON, client, round_trip};
use net_io_blocking::{
    Admission, CloseReason, ConnectionInfo, Direction, Gate, HandlerDriver, KillHandle, Lane,
    Limits, ListenerSpec, MinRateRule, NetError, Refusal, Server, ServerBuilder, TcpConnection,
    Verdict, WriteFacts,
};

static TURN: RwLock<()> = RwLock::new(());

fn shared_turn() -> std::sync::RwLockReadGuard<'static, ()> {
    TURN.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A server whose handlers run on coroutines over two loops, with the minimum rate off unless `limits` set it.
fn server<H>(limits: Limits, recorder: &Recorder, handler: H) -> Server
where
    H: Fn(&mut TcpConnection<'_>) -> Result<(), NetError> + Send + Sync + 'static,
{
    ServerBuilder::new()
        .listen("127.0.0.1:0")
        .handler_driver(HandlerDriver::Coroutines { loops: 2 })
        .limits(limits.or(Limits::new().min_rate(None)))
        .events(recorder.clone())
        .handler(handler)
        .allow_all()
        .build()
        .expect("the coroutine handler server did not start")
}

/// Echoes each read until the peer closes.
fn echo(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let mut buffer = [0_u8; 4096];
    loop {
        let count = connection.read(&mut buffer)?;
        if count == 0 {
            return Ok(());
        }
        connection.write_all(&buffer[..count])?;
    }
}

/// Echoes 4-byte requests, reading each one whole.
fn echo_fours(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    loop {
        let mut request = [0_u8; 4];
        let mut got = 0;
        while got < request.len() {
            let count = connection.read(&mut request[got..])?;
            if count == 0 {
                return Ok(());
            }
            got += count;
        }
        connection.write_all(&request)?;
    }
}

/// Threads of this process right now.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("could not list /proc/self/task")
        .count()
}

/// Resident memory of this process in KiB.
fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .unwrap_or(0)
}

/// Counts drops: a handler's local that shows whether its destructors ran.
struct DropCounter(Arc<AtomicUsize>);

impl Drop for DropCounter {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn two_thousand_idle_handler_connections_hold_no_extra_threads() {
    const CONNECTIONS: usize = 2_000;
    let _alone = TURN
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    // Two descriptors a connection (client and server side) in this one process.
    let limit = net_io_sys::rlimit::descriptor_limit().expect("could not read RLIMIT_NOFILE");
    let wanted = (4 * CONNECTIONS as u64 + 256).min(limit.hard);
    if limit.soft < wanted {
        net_io_sys::rlimit::set_descriptor_limit(net_io_sys::rlimit::ResourceLimit {
            soft: wanted,
            hard: limit.hard,
        })
        .expect("could not raise RLIMIT_NOFILE");
    }
    let recorder = Recorder::default();
    let server = server(
        Limits::new()
            .max_connections(CONNECTIONS + 16)
            .max_per_source(CONNECTIONS + 16)
            .idle_timeout(Duration::from_secs(120)),
        &recorder,
        echo,
    );
    let address = server.local_addr();
    // The loops and the accept thread run already; warm each loop's first connection up too.
    let mut first = client(address);
    assert_eq!(round_trip(&mut first, b"warm"), b"warm");
    let threads_before = threads();
    let resident_before = resident_kib();
    let mut streams = Vec::with_capacity(CONNECTIONS);
    for index in 0..CONNECTIONS {
        let mut stream = TcpStream::connect(address).expect("could not connect");
        stream
            .set_read_timeout(Some(SOON))
            .expect("could not set a read timeout");
        let message = (index as u32).to_le_bytes();
        stream.write_all(&message).expect("write failed");
        let mut echo = [0_u8; 4];
        stream.read_exact(&mut echo).expect("echo read failed");
        assert_eq!(echo, message, "connection {index} echoed other bytes");
        streams.push(stream);
    }
    let threads_after = threads();
    let resident_after = resident_kib();
    println!(
        "{CONNECTIONS} idle handler connections: {threads_before} -> {threads_after} threads, resident \
         {resident_before} -> {resident_after} KiB ({:.1} KiB a connection, both sides of each socket)",
        resident_after.saturating_sub(resident_before) as f64 / CONNECTIONS as f64
    );
    assert_eq!(
        threads_after, threads_before,
        "{CONNECTIONS} suspended handlers should hold no thread of their own"
    );
    assert!(
        recorder.closes().is_empty(),
        "no connection should close while they idle: {:?}",
        recorder.closes().first()
    );
    // Every handler is still there, suspended in its read.
    for (index, stream) in streams.iter_mut().enumerate().step_by(97) {
        assert_eq!(
            round_trip(stream, b"back"),
            b"back",
            "idle connection {index} did not answer again"
        );
    }
    drop(streams);
    drop(first);
    let closes = recorder.wait_for_closes(CONNECTIONS + 1, Duration::from_secs(30));
    assert_eq!(
        closes.len(),
        CONNECTIONS + 1,
        "every connection should close once"
    );
    assert!(
        closes
            .iter()
            .all(|(_, reason)| *reason == CloseReason::PeerClosed),
        "every client closed first, so every close should be PeerClosed"
    );
}

#[test]
fn a_panicking_handler_closes_only_its_connection() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let server = server(
        Limits::new(),
        &recorder,
        |connection: &mut TcpConnection<'_>| {
            let mut buffer = [0_u8; 64];
            loop {
                let count = connection.read(&mut buffer)?;
                if count == 0 {
                    return Ok(());
                }
                if &buffer[..count] == b"boom" {
                    panic!("the handler was told to panic");
                }
                connection.write_all(&buffer[..count])?;
            }
        },
    );
    let mut calm = client(server.local_addr());
    let mut doomed = client(server.local_addr());
    assert_eq!(round_trip(&mut calm, b"one"), b"one");
    doomed.write_all(b"boom").unwrap();
    assert_eq!(
        recorder.single_close(SOON),
        CloseReason::SessionPanicked,
        "the panicking handler's connection should close with SessionPanicked"
    );
    assert!(
        common::is_closed_by_server(&mut doomed),
        "the panicking handler's connection is still open"
    );
    assert_eq!(
        round_trip(&mut calm, b"two"),
        b"two",
        "the other connection on the loops should carry on"
    );
}

/// Admits everything, denies every write with code 42 and records the closes it is told of.
#[derive(Clone, Default)]
struct DenyingGate {
    closed: Arc<Mutex<Vec<CloseReason>>>,
}

impl Gate for DenyingGate {
    type Ticket = ();

    fn admit(&self, _info: &ConnectionInfo) -> Result<Admission<()>, Refusal> {
        Ok(Admission {
            ticket: (),
            lane: Lane::DEFAULT,
        })
    }

    fn check(&self, _ticket: &(), _write: &WriteFacts) -> Verdict {
        Verdict::Deny(42)
    }

    fn closed(&self, _ticket: (), _info: &ConnectionInfo, reason: CloseReason) {
        self.closed.lock().unwrap().push(reason);
    }
}

#[test]
fn a_write_the_gate_denies_fails_in_the_handler_and_closes_once_with_egress_denied() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let gate = DenyingGate::default();
    let seen: Arc<Mutex<Option<String>>> = Arc::default();
    let outcome = Arc::clone(&seen);
    let server = ServerBuilder::new()
        .listen("127.0.0.1:0")
        .handler_driver(HandlerDriver::Coroutines { loops: 2 })
        .events(recorder.clone())
        .handler(move |connection: &mut TcpConnection<'_>| {
            let mut buffer = [0_u8; 64];
            let count = connection.read(&mut buffer)?;
            let written = connection.write_all(&buffer[..count]);
            *outcome.lock().unwrap() = Some(format!("{written:?}"));
            written
        })
        .gate(gate.clone())
        .build()
        .expect("the gated server did not start");
    let mut stream = client(server.local_addr());
    stream.write_all(b"let me out").unwrap();
    assert_eq!(recorder.single_close(SOON), CloseReason::EgressDenied(42));
    assert_eq!(
        seen.lock().unwrap().as_deref(),
        Some("Err(Closed(EgressDenied(42)))"),
        "the handler's write_all should report the denial"
    );
    assert_eq!(
        *gate.closed.lock().unwrap(),
        vec![CloseReason::EgressDenied(42)],
        "the gate should hear of the one close with the same reason"
    );
    let mut received = Vec::new();
    let _ = stream.read_to_end(&mut received);
    assert!(
        received.is_empty(),
        "denied bytes reached the peer: {received:?}"
    );
}

/// Writes a farewell when dropped, reporting what the write returned.
struct Farewell<'c, 'a> {
    connection: &'c mut TcpConnection<'a>,
    outcome: Arc<Mutex<Option<String>>>,
}

impl Drop for Farewell<'_, '_> {
    fn drop(&mut self) {
        let written = self.connection.write_all(b"bye");
        *self.outcome.lock().unwrap() = Some(format!("{written:?}"));
    }
}

#[test]
fn a_destructor_that_writes_while_a_handler_unwinds_gets_an_error_instead_of_suspending() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let seen: Arc<Mutex<Option<String>>> = Arc::default();
    let outcome = Arc::clone(&seen);
    let server = server(
        Limits::new(),
        &recorder,
        move |connection: &mut TcpConnection<'_>| {
            let farewell = Farewell {
                connection,
                outcome: Arc::clone(&outcome),
            };
            let mut buffer = [0_u8; 8];
            let _ = farewell.connection.read(&mut buffer)?;
            panic!("the handler fails after its first read");
        },
    );
    let mut stream = client(server.local_addr());
    stream.write_all(b"go").unwrap();
    assert_eq!(recorder.single_close(SOON), CloseReason::SessionPanicked);
    assert_eq!(
        seen.lock().unwrap().as_deref(),
        Some("Err(Closed(SessionError))"),
        "a write from a destructor during the unwind should fail at once, not suspend the unwinding handler"
    );
    let mut received = Vec::new();
    let _ = stream.read_to_end(&mut received);
    assert!(
        received.is_empty(),
        "the farewell written during the unwind reached the client: {received:?}"
    );
}

#[test]
fn a_kill_while_the_handler_waits_in_read_closes_once_with_killed_and_runs_its_destructors() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let drops = Arc::new(AtomicUsize::new(0));
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let (handles, handle_receiver) = std::sync::mpsc::channel::<KillHandle>();
    let handles = Mutex::new(handles);
    let (counter, errors) = (Arc::clone(&drops), Arc::clone(&seen));
    let server = server(
        Limits::new().idle_timeout(Duration::from_secs(60)),
        &recorder,
        move |connection: &mut TcpConnection<'_>| {
            let _guard = DropCounter(Arc::clone(&counter));
            handles
                .lock()
                .unwrap()
                .send(connection.kill_handle())
                .unwrap();
            let mut buffer = [0_u8; 16];
            let result = connection.read(&mut buffer);
            errors.lock().unwrap().push(format!("{result:?}"));
            // A second call after the close fails at once instead of waiting again.
            let again = connection.read(&mut buffer);
            errors.lock().unwrap().push(format!("{again:?}"));
            errors
                .lock()
                .unwrap()
                .push(format!("{:?}", connection.close_reason()));
            result.map(|_| ())
        },
    );
    let mut stream = client(server.local_addr());
    let handle = handle_receiver.recv_timeout(SOON).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(handle.kill(7), "the first kill should win");
    assert!(
        !handle.kill(8),
        "a second kill should not win a closing connection"
    );
    assert_eq!(recorder.single_close(SOON), CloseReason::Killed(7));
    assert!(
        common::eventually(SOON, || drops.load(Ordering::SeqCst) == 1),
        "the handler's destructors did not run after the kill"
    );
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![
            "Err(Closed(Killed(7)))".to_owned(),
            "Err(Closed(Killed(7)))".to_owned(),
            "Some(Killed(7))".to_owned()
        ],
        "the suspended read, the call after it and close_reason should all report the kill"
    );
    assert!(common::is_closed_by_server(&mut stream));
}

#[test]
fn a_drain_lets_a_handler_mid_exchange_finish_and_closes_idle_ones() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let server = server(
        Limits::new().idle_timeout(Duration::from_secs(60)),
        &recorder,
        echo_fours,
    );
    let mut idle = client(server.local_addr());
    let mut busy = client(server.local_addr());
    assert_eq!(round_trip(&mut idle, b"idle"), b"idle");
    assert_eq!(round_trip(&mut busy, b"busy"), b"busy");
    // Half a request: that handler is mid-exchange, waiting for the rest.
    busy.write_all(b"ha").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let handle = server.handle();
    let drain = std::thread::spawn(move || handle.drain(Instant::now() + Duration::from_secs(10)));
    let idle_closed = recorder.wait_for_closes(1, SOON);
    assert_eq!(
        idle_closed.len(),
        1,
        "the idle connection should close at once"
    );
    assert_eq!(idle_closed[0].1, CloseReason::Drained);
    assert!(common::is_closed_by_server(&mut idle));
    busy.write_all(b"lf").unwrap();
    let mut reply = [0_u8; 4];
    busy.read_exact(&mut reply)
        .expect("the handler mid-exchange should finish its reply during the drain");
    assert_eq!(&reply, b"half");
    let report = drain.join().unwrap();
    let closes = recorder.wait_for_closes(2, SOON);
    assert_eq!(
        closes.len(),
        2,
        "both connections should close once: {closes:?}"
    );
    assert_eq!(
        closes[1].1,
        CloseReason::Drained,
        "the finished handler's next read (idle, draining) should close it as drained"
    );
    assert_eq!(report.killed, 0, "nothing should be left for the deadline");
}

#[test]
fn an_idle_handler_connection_closes_at_the_idle_deadline() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let seen: Arc<Mutex<Option<String>>> = Arc::default();
    let errors = Arc::clone(&seen);
    let server = server(
        Limits::new().idle_timeout(Duration::from_millis(200)),
        &recorder,
        move |connection: &mut TcpConnection<'_>| {
            let result = echo_fours(connection);
            *errors.lock().unwrap() = Some(format!("{result:?}"));
            result
        },
    );
    let mut stream = client(server.local_addr());
    assert_eq!(round_trip(&mut stream, b"ping"), b"ping");
    assert_eq!(recorder.single_close(SOON), CloseReason::Idle);
    assert_eq!(
        seen.lock().unwrap().as_deref(),
        Some("Err(Timeout(Idle))"),
        "the handler's read should report the idle deadline"
    );
}

#[test]
fn a_request_that_stops_halfway_closes_at_the_read_deadline() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let server = server(
        Limits::new()
            .idle_timeout(Duration::from_secs(60))
            .read_timeout(Duration::from_millis(200)),
        &recorder,
        echo_fours,
    );
    let mut stream = client(server.local_addr());
    stream.write_all(b"ab").unwrap();
    let started = Instant::now();
    assert_eq!(recorder.single_close(SOON), CloseReason::ReadTimeout);
    assert!(
        started.elapsed() < Duration::from_secs(50),
        "the read deadline, not the idle one, should apply once a request started"
    );
}

#[test]
fn a_handler_exchange_deadline_closes_with_exchange_deadline() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let server = server(
        Limits::new().idle_timeout(Duration::from_secs(60)),
        &recorder,
        |connection: &mut TcpConnection<'_>| {
            connection.set_exchange_deadline(Some(Instant::now() + Duration::from_millis(200)));
            echo_fours(connection)
        },
    );
    let _stream = client(server.local_addr());
    assert_eq!(recorder.single_close(SOON), CloseReason::ExchangeDeadline);
}

#[test]
fn a_handler_idle_timeout_set_on_its_connection_applies() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let server = server(
        Limits::new().idle_timeout(Duration::from_secs(60)),
        &recorder,
        |connection: &mut TcpConnection<'_>| {
            connection.set_idle_timeout(Duration::from_millis(200));
            echo_fours(connection)
        },
    );
    let mut stream = client(server.local_addr());
    assert_eq!(round_trip(&mut stream, b"ping"), b"ping");
    assert_eq!(recorder.single_close(SOON), CloseReason::Idle);
}

/// A server whose handler answers any byte with `reply_bytes` of data, behind a small send buffer.
fn flooding_server(limits: Limits, recorder: &Recorder, reply_bytes: usize) -> Server {
    ServerBuilder::new()
        .listener(ListenerSpec::new("127.0.0.1:0".parse().unwrap()).send_buffer(64 * 1024))
        .handler_driver(HandlerDriver::Coroutines { loops: 2 })
        .limits(limits)
        .events(recorder.clone())
        .handler(move |connection: &mut TcpConnection<'_>| {
            let mut byte = [0_u8; 1];
            if connection.read(&mut byte)? == 0 {
                return Ok(());
            }
            let chunk = [0x61_u8; 64 * 1024];
            let mut left = reply_bytes;
            while left > 0 {
                let count = left.min(chunk.len());
                connection.write_all(&chunk[..count])?;
                left -= count;
            }
            Ok(())
        })
        .allow_all()
        .build()
        .expect("the flooding server did not start")
}

#[test]
fn a_reply_larger_than_the_output_budget_arrives_whole() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let reply_bytes = 3 * 1024 * 1024 + 17;
    let server = flooding_server(
        Limits::new()
            .min_rate(None)
            .output_budget(256 * 1024)
            .idle_timeout(Duration::from_secs(60)),
        &recorder,
        reply_bytes,
    );
    let mut stream = client(server.local_addr());
    stream.set_read_timeout(Some(SOON)).unwrap();
    stream.write_all(b"x").unwrap();
    let mut received = Vec::new();
    stream
        .read_to_end(&mut received)
        .expect("the reply should arrive and end with FIN");
    assert_eq!(
        received.len(),
        reply_bytes,
        "the reply should arrive whole, one budget at a time"
    );
    assert!(received.iter().all(|byte| *byte == 0x61));
    assert_eq!(recorder.single_close(SOON), CloseReason::SessionClosed);
}

#[test]
fn a_large_reply_to_a_reader_that_never_reads_closes_at_the_write_deadline() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let server = flooding_server(
        Limits::new()
            .min_rate(None)
            .write_timeout(Duration::from_millis(300)),
        &recorder,
        64 * 1024 * 1024,
    );
    let stream = client(server.local_addr());
    socket2::SockRef::from(&stream)
        .set_recv_buffer_size(4096)
        .unwrap();
    (&stream).write_all(b"x").unwrap();
    assert_eq!(recorder.single_close(SOON), CloseReason::WriteTimeout);
    drop(stream);
}

#[test]
fn a_handler_writing_a_large_reply_to_a_slow_reader_is_closed_for_the_slow_reader() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let server = flooding_server(
        Limits::new()
            .write_timeout(Duration::from_secs(30))
            .min_rate(Some(MinRateRule {
                bytes_per_second: 100_000,
                window: Duration::from_millis(500),
                grace: Duration::from_millis(300),
                check: Duration::from_millis(100),
            })),
        &recorder,
        64 * 1024 * 1024,
    );
    let mut stream = client(server.local_addr());
    socket2::SockRef::from(&stream)
        .set_recv_buffer_size(4096)
        .unwrap();
    stream.write_all(b"x").unwrap();
    // Read a trickle, far below 100 kB/s, so the connection is slow rather than stalled.
    let started = Instant::now();
    let mut sip = [0_u8; 512];
    while recorder.closes().is_empty() && started.elapsed() < SOON {
        let _ = stream.read(&mut sip);
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        recorder.single_close(SOON),
        CloseReason::SlowPeer {
            direction: Direction::Out
        },
        "a reader below the minimum rate should be closed as a slow peer"
    );
}

/// Set in the child process of the stack-overflow test.
const OVERFLOW_CHILD: &str = "NET_IO_TEST_COROUTINE_OVERFLOW_CHILD";

/// Recurses `depth` times with a kilobyte on each frame.
fn deep(depth: usize) -> u64 {
    let frame = std::hint::black_box([depth as u8; 1024]);
    if depth == 0 {
        return u64::from(frame[0]);
    }
    deep(depth - 1) + u64::from(std::hint::black_box(frame)[1])
}

#[test]
fn a_handler_that_overflows_its_coroutine_stack_kills_the_process_at_the_guard_page() {
    use std::os::unix::process::ExitStatusExt;
    if std::env::var_os(OVERFLOW_CHILD).is_some() {
        // The child: a handler that needs about 10 MB of stack on a 64 KiB coroutine stack.
        let server = ServerBuilder::new()
            .listen("127.0.0.1:0")
            .handler_driver(HandlerDriver::Coroutines { loops: 1 })
            .handler_stack_size(64 * 1024)
            .handler(|connection: &mut TcpConnection<'_>| {
                let mut byte = [0_u8; 1];
                connection.read(&mut byte)?;
                let sum = deep(10_000);
                connection.write_all(&sum.to_le_bytes())
            })
            .allow_all()
            .build()
            .expect("the child's server did not start");
        let mut stream = client(server.local_addr());
        stream.write_all(b"x").unwrap();
        let mut reply = [0_u8; 8];
        let _ = stream.read_exact(&mut reply);
        std::thread::sleep(SOON);
        // Still alive: the parent sees a normal exit and fails.
        return;
    }
    let _turn = shared_turn();
    let output =
        std::process::Command::new(std::env::current_exe().expect("no path to this test binary"))
            .args([
                "a_handler_that_overflows_its_coroutine_stack_kills_the_process_at_the_guard_page",
                "--exact",
                "--test-threads=1",
            ])
            .env(OVERFLOW_CHILD, "1")
            .output()
            .expect("could not run the child");
    assert_eq!(
        output.status.signal(),
        Some(libc::SIGSEGV),
        "a coroutine stack overflow should end the process with SIGSEGV at the guard page, got {:?}",
        output.status
    );
}
