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
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use common::echo::{echo, echo_fours};
use common::gates::CountingGate;
use common::{Recorder, SOON, child, client, open_descriptors, round_trip, test_builder};
use net_io_blocking::{
    CloseReason, DEFAULT_WORKERS, Direction, Event, HandlerDriver, KillHandle, LimitKind, Limits,
    ListenerSpec, MinRateRule, NetError, RefusalCause, Server, ServerBuilder, TcpConnection,
};

static TURN: RwLock<()> = RwLock::new(());

fn shared_turn() -> std::sync::RwLockReadGuard<'static, ()> {
    TURN.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A server whose handlers run on coroutines over two loops, with the recorder of its events:
/// [`common::test_builder`]'s settings (so the minimum rate is off) with the default worker count, which
/// only enters the descriptor budget here.
fn serve<H>(limits: Limits, handler: H) -> (Recorder, Server)
where
    H: Fn(&mut TcpConnection<'_>) -> Result<(), NetError> + Send + Sync + 'static,
{
    let recorder = Recorder::default();
    let server = test_builder(DEFAULT_WORKERS, limits, &recorder)
        .handler_driver(HandlerDriver::Coroutines { loops: 2 })
        .handler(handler)
        .allow_all()
        .build()
        .expect("the coroutine handler server did not start");
    (recorder, server)
}

/// What a handler's call returned, as its `Debug` text, once [`reporting`] saw it.
type Outcome = Arc<Mutex<Option<String>>>;

/// Wraps `handler` so that what it returns is kept, as `Debug` text, in the [`Outcome`] returned with it.
fn reporting<H>(
    handler: H,
) -> (
    Outcome,
    impl Fn(&mut TcpConnection<'_>) -> Result<(), NetError> + Send + Sync + 'static,
)
where
    H: Fn(&mut TcpConnection<'_>) -> Result<(), NetError> + Send + Sync + 'static,
{
    let seen = Outcome::default();
    let outcome = Arc::clone(&seen);
    let wrapped = move |connection: &mut TcpConnection<'_>| {
        let result = handler(connection);
        *outcome.lock().unwrap() = Some(format!("{result:?}"));
        result
    };
    (seen, wrapped)
}

/// The live server threads of this process right now (named `net-io-…`): the test harness starts and ends
/// a thread per test meanwhile, which a count of every thread would see, and a thread that a previous test
/// joined can linger in `/proc` for a moment as a zombie, which is not counted either.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("could not list /proc/self/task")
        .filter_map(Result::ok)
        .filter(|task| {
            let named = std::fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|name| name.starts_with("net-io-"));
            // The state follows the command name in parentheses: `R`, `S`, ... or `Z`/`X` once exited.
            let live = std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next())
                    .is_some_and(|state| state != "Z" && state != "X")
            });
            named && live
        })
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
    let (recorder, server) = serve(
        Limits::new()
            .max_connections(CONNECTIONS + 16)
            .max_per_source(CONNECTIONS + 16)
            .idle_timeout(Duration::from_secs(120)),
        echo,
    );
    let address = server.local_addr();
    // The loops and the accept thread run already; warm each loop's first connection up too.
    let mut first = client(address);
    assert_eq!(round_trip(&mut first, b"warm"), b"warm");
    // Two loops and one accept thread; a thread names itself once it first runs, which on a loaded machine
    // can come after the warm-up.
    assert!(
        common::eventually(SOON, || threads() == 3),
        "the server should run two loop threads and one accept thread, saw {}",
        threads()
    );
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
    let (recorder, server) = serve(Limits::new(), |connection: &mut TcpConnection<'_>| {
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
    });
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

#[test]
fn a_write_the_gate_denies_fails_in_the_handler_and_closes_once_with_egress_denied() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let gate = CountingGate::deny_all(42);
    let (seen, handler) = reporting(|connection: &mut TcpConnection<'_>| {
        let mut buffer = [0_u8; 64];
        let count = connection.read(&mut buffer)?;
        connection.write_all(&buffer[..count])
    });
    let server = ServerBuilder::new()
        .listen("127.0.0.1:0")
        .handler_driver(HandlerDriver::Coroutines { loops: 2 })
        .events(recorder.clone())
        .handler(handler)
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
        gate.closes(),
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
    let seen: Arc<Mutex<Option<String>>> = Arc::default();
    let outcome = Arc::clone(&seen);
    let (recorder, server) = serve(Limits::new(), move |connection: &mut TcpConnection<'_>| {
        let farewell = Farewell {
            connection,
            outcome: Arc::clone(&outcome),
        };
        let mut buffer = [0_u8; 8];
        let _ = farewell.connection.read(&mut buffer)?;
        panic!("the handler fails after its first read");
    });
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
    let drops = Arc::new(AtomicUsize::new(0));
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let (handles, handle_receiver) = std::sync::mpsc::channel::<KillHandle>();
    let handles = Mutex::new(handles);
    let (counter, errors) = (Arc::clone(&drops), Arc::clone(&seen));
    let (recorder, server) = serve(
        Limits::new().idle_timeout(Duration::from_secs(60)),
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
    let (recorder, server) = serve(
        Limits::new().idle_timeout(Duration::from_secs(60)),
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
    let (seen, handler) = reporting(echo_fours);
    let (recorder, server) = serve(
        Limits::new().idle_timeout(Duration::from_millis(200)),
        handler,
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
fn a_handler_exchange_deadline_closes_with_exchange_deadline() {
    let _turn = shared_turn();
    let (recorder, server) = serve(
        Limits::new().idle_timeout(Duration::from_secs(60)),
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
    let (recorder, server) = serve(
        Limits::new().idle_timeout(Duration::from_secs(60)),
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

/// A builder for a child's or a build check's server: handlers on coroutines over one loop, each on a stack
/// of `bytes`, the builder's defaults otherwise.
fn one_loop_with_stack(bytes: usize) -> ServerBuilder {
    ServerBuilder::new()
        .listen("127.0.0.1:0")
        .handler_driver(HandlerDriver::Coroutines { loops: 1 })
        .handler_stack_size(bytes)
}

/// How long a child process may run before the test kills it and fails: the slowest child (the one that
/// fills the mapping limit) takes seconds even on a loaded machine.
const CHILD_DEADLINE: Duration = Duration::from_secs(120);

/// Runs `command` (a [`child::rerun`] of one test) to its end under the shared turn and returns its output.
/// A child still running at [`CHILD_DEADLINE`] is killed and the test fails with what it printed, instead of
/// hanging the test run.
fn run_child(mut command: Command) -> Output {
    let _turn = shared_turn();
    let process = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("could not start the child");
    child::output_within(process, CHILD_DEADLINE)
}

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
    if child::is_child(OVERFLOW_CHILD) {
        // The child: a handler that needs about 10 MB of stack on a 64 KiB coroutine stack.
        let server = one_loop_with_stack(64 * 1024)
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
    let output = run_child(child::rerun(
        "a_handler_that_overflows_its_coroutine_stack_kills_the_process_at_the_guard_page",
        OVERFLOW_CHILD,
    ));
    assert_eq!(
        output.status.signal(),
        Some(libc::SIGSEGV),
        "a coroutine stack overflow should end the process with SIGSEGV at the guard page, got {:?}",
        output.status
    );
}

/// Lines of `/proc/self/maps`: the memory mappings of this process (two per coroutine stack).
fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|maps| maps.lines().count())
        .unwrap_or(0)
}

#[test]
fn ten_thousand_churned_handler_connections_leave_no_descriptor_and_a_bounded_stack_pool() {
    const CONNECTIONS: usize = 10_000;
    let _alone = TURN
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let server = ServerBuilder::new()
        .listen("127.0.0.1:0")
        .handler_driver(HandlerDriver::Coroutines { loops: 2 })
        .limits(
            Limits::new()
                .min_rate(None)
                .linger_timeout(Duration::from_millis(50))
                // Closes trail the client's by a moment on a loaded machine: no cap may refuse meanwhile.
                .max_connections(1_000)
                .max_per_source(1_000),
        )
        .handler(|connection: &mut TcpConnection<'_>| {
            let mut request = [0_u8; 1];
            if connection.read(&mut request)? == 0 {
                return Ok(());
            }
            // A few panics (each prints its message), a quarter of errors, the rest echoed.
            match request[0] {
                0 => panic!("a handler that fails"),
                byte if byte % 4 == 1 => Err(NetError::ServerStopped),
                _ => connection.write_all(&request),
            }
        })
        .allow_all()
        .build()
        .expect("the coroutine handler server did not start");
    let address = server.local_addr();
    // Warm both loops' pools and this process's other lazy mappings first.
    for index in 0..64_u8 {
        let mut stream = client(address);
        let _ = stream.write_all(&[index]);
        let _ = stream.read(&mut [0_u8; 1]);
    }
    std::thread::sleep(Duration::from_millis(300));
    let (descriptors_before, mappings_before) = (open_descriptors(), mappings());
    let started = Instant::now();
    for index in 0..CONNECTIONS {
        let mut stream = client(address);
        let byte = (index % 251) as u8;
        let _ = stream.write_all(&[byte]);
        let mut reply = [0_u8; 1];
        let got = stream.read(&mut reply);
        if byte != 0 && byte % 4 != 1 {
            assert!(
                matches!(got, Ok(1)) && reply[0] == byte,
                "connection {index} should be echoed, got {got:?}"
            );
        }
        if index % 3 == 0 {
            common::reset(stream);
        }
    }
    let done = common::eventually(Duration::from_secs(30), || {
        server.stats().closed >= CONNECTIONS as u64 + 64
    });
    println!(
        "{CONNECTIONS} churned handler connections in {:?}; descriptors {descriptors_before} -> {}, mappings \
         {mappings_before} -> {}",
        started.elapsed(),
        open_descriptors(),
        mappings()
    );
    assert!(done, "every connection should close: {:?}", server.stats());
    assert!(
        common::eventually(SOON, || open_descriptors() <= descriptors_before),
        "descriptors grew from {descriptors_before} to {} after {CONNECTIONS} closed connections",
        open_descriptors()
    );
    // Each loop keeps at most STACK_POOL_MAX stacks (two mappings each); the warm-up filled part of that.
    let bound = 2 * 2 * net_io_sys::coroutine::STACK_POOL_MAX + 64;
    assert!(
        mappings() <= mappings_before + bound,
        "mappings grew from {mappings_before} to {} after {CONNECTIONS} closed connections: stacks leak",
        mappings()
    );
    let stats = server.stats();
    assert_eq!(
        stats.accepted, stats.closed,
        "every accepted connection should be counted closed once: {stats:?}"
    );
}

#[test]
fn a_shutdown_with_handlers_in_every_state_closes_each_once_and_runs_every_destructor() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let drops = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&drops);
    let server = ServerBuilder::new()
        .listener(ListenerSpec::new("127.0.0.1:0".parse().unwrap()).send_buffer(16 * 1024))
        .handler_driver(HandlerDriver::Coroutines { loops: 2 })
        .limits(
            Limits::new()
                .min_rate(None)
                .idle_timeout(Duration::from_secs(60))
                .output_budget(16 * 1024),
        )
        .events(recorder.clone())
        .handler(move |connection: &mut TcpConnection<'_>| {
            let _guard = DropCounter(Arc::clone(&counter));
            let mut request = [0_u8; 4];
            let mut got = 0;
            while got < 4 {
                let count = connection.read(&mut request[got..])?;
                if count == 0 {
                    return Ok(());
                }
                got += count;
            }
            match &request {
                // Suspended in write: a reply far larger than the socket buffers to a client that never reads.
                b"big!" => connection.write_all(&vec![7_u8; 8 << 20]),
                // Finished: the handler returns, the close lingers while the client keeps sending.
                b"done" => Ok(()),
                _ => connection.write_all(&request),
            }
        })
        .allow_all()
        .build()
        .expect("the coroutine handler server did not start");
    let address = server.local_addr();
    let mut idle = client(address);
    assert_eq!(round_trip(&mut idle, b"idle"), b"idle");
    let mut half = client(address);
    half.write_all(b"ha").unwrap();
    let mut writer = client(address);
    writer.write_all(b"big!").unwrap();
    let mut finished = client(address);
    finished.write_all(b"done").unwrap();
    finished.write_all(b"more bytes for the linger").unwrap();
    let _never_started = client(address);
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    let report = server.shutdown(Instant::now() + Duration::from_millis(500));
    let took = started.elapsed();
    println!("shutdown with handlers in every state: {report:?} after {took:?}");
    assert!(
        took < Duration::from_secs(5),
        "the shutdown took {took:?} with a 500 ms deadline"
    );
    let closes = recorder.closes();
    assert_eq!(
        closes.len(),
        5,
        "each connection should close once: {closes:?}"
    );
    let mut ids: Vec<_> = closes.iter().map(|(id, _)| *id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 5, "a connection closed twice: {closes:?}");
    assert_eq!(
        drops.load(Ordering::SeqCst),
        5,
        "every handler's destructors should run once, whatever state the shutdown found it in"
    );
    drop((idle, half, writer, finished));
}

#[test]
fn a_handler_reads_what_came_before_the_fin_then_end_of_stream_and_may_still_reply() {
    let _turn = shared_turn();
    let (recorder, server) = serve(Limits::new(), |connection: &mut TcpConnection<'_>| {
        let mut received = Vec::new();
        let mut buffer = [0_u8; 3];
        loop {
            let count = connection.read(&mut buffer)?;
            if count == 0 {
                break;
            }
            received.extend_from_slice(&buffer[..count]);
        }
        // Reads after the end of stream keep answering 0 at once.
        assert_eq!(connection.read(&mut buffer)?, 0);
        assert_eq!(std::io::Read::read(connection, &mut buffer).unwrap(), 0);
        received.reverse();
        connection.write_all(&received)?;
        std::io::Write::write_all(connection, b"!")?;
        std::io::Write::flush(connection)?;
        Ok(())
    });
    let mut stream = client(server.local_addr());
    stream.write_all(b"abcdefghij").unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).unwrap();
    assert_eq!(
        reply, b"jihgfedcba!",
        "the handler should read every byte before the FIN and its reply should arrive whole"
    );
    assert_eq!(recorder.single_close(SOON), CloseReason::PeerClosed);
}

#[test]
fn an_exchange_deadline_already_past_fails_the_next_read_at_once() {
    let _turn = shared_turn();
    let (seen, handler) = reporting(|connection: &mut TcpConnection<'_>| {
        connection.set_exchange_deadline(Some(Instant::now() - Duration::from_secs(1)));
        connection.read(&mut [0_u8; 4]).map(|_| ())
    });
    let (recorder, server) = serve(Limits::new().idle_timeout(Duration::from_secs(60)), handler);
    let started = Instant::now();
    let _stream = client(server.local_addr());
    assert_eq!(recorder.single_close(SOON), CloseReason::ExchangeDeadline);
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(
        seen.lock().unwrap().as_deref(),
        Some("Err(Timeout(Exchange))")
    );
}

/// Set in the child process of the small-stack test.
const SMALL_STACK_CHILD: &str = "NET_IO_TEST_COROUTINE_SMALL_STACK_CHILD";

/// The smallest handler stack size the builder accepts (64 KiB).
const SMALLEST_HANDLER_STACK: usize = 64 * 1024;

#[test]
fn a_handler_stack_too_small_for_the_driver_or_too_large_to_map_fails_at_build_naming_the_field() {
    // Builds start threads, which the thread-counting test must not see.
    let _turn = shared_turn();
    let build = |bytes: usize| one_loop_with_stack(bytes).handler(echo).allow_all().build();
    // 8 KiB ended the process with SIGSEGV at the first connection: the driver's own frames need more.
    let error = build(8 * 1024).expect_err("an 8 KiB handler stack should be refused at build");
    assert_eq!(
        error.to_string(),
        "invalid configuration: handler_stack_size is 8192, below its minimum of 65536; raise it",
        "the error should name the field, the value and the minimum"
    );
    let error =
        build(usize::MAX).expect_err("a handler stack of usize::MAX should be refused at build");
    assert!(
        error.to_string().contains("handler_stack_size") && error.to_string().contains("maximum"),
        "the error should name the field and its maximum: {error}"
    );
    let server =
        build(SMALLEST_HANDLER_STACK).expect("the smallest accepted stack size should build");
    drop(server);
}

#[test]
fn the_smallest_handler_stack_size_serves_and_survives_a_panic_with_a_backtrace() {
    use std::os::unix::process::ExitStatusExt;
    if child::is_child(SMALL_STACK_CHILD) {
        let server = one_loop_with_stack(SMALLEST_HANDLER_STACK)
            .handler(|connection: &mut TcpConnection<'_>| {
                // One byte at a time: the handler's own frames are tiny, the stack is the driver's and the
                // panic machinery's.
                let mut byte = [0_u8; 1];
                while connection.read(&mut byte)? == 1 {
                    if byte[0] == b'!' {
                        panic!("a handler that fails on the smallest stack");
                    }
                    connection.write_all(&byte)?;
                }
                Ok(())
            })
            .allow_all()
            .build()
            .expect("the child's server did not start");
        let mut stream = client(server.local_addr());
        assert_eq!(round_trip(&mut stream, b"tiny"), b"tiny");
        // The panic unwinds, and the panic hook captures a backtrace, on the handler's own stack.
        let mut failing = client(server.local_addr());
        failing.write_all(b"!").unwrap();
        assert!(common::is_closed_by_server(&mut failing));
        assert_eq!(round_trip(&mut stream, b"still"), b"still");
        return;
    }
    let mut command = child::rerun(
        "the_smallest_handler_stack_size_serves_and_survives_a_panic_with_a_backtrace",
        SMALL_STACK_CHILD,
    );
    command.env("RUST_BACKTRACE", "full");
    let output = run_child(command);
    assert!(
        output.status.success(),
        "a server on the smallest handler stack should serve and contain a panic, not end the process: \
         {:?} (signal {:?})",
        output.status,
        output.status.signal()
    );
}

/// Set in the child process of the memory-mapping limit test.
const MAP_LIMIT_CHILD: &str = "NET_IO_TEST_COROUTINE_MAP_LIMIT_CHILD";

#[test]
fn at_the_memory_mapping_limit_new_handlers_are_refused_and_the_server_serves_on() {
    if child::is_child(MAP_LIMIT_CHILD) {
        use net_io_sys::coroutine::{Coroutine, STACK_POOL_MAX};
        let recorder = Recorder::default();
        // Caps well above the 40 connections: the mapping limit is the only thing that refuses here.
        let server = test_builder(
            DEFAULT_WORKERS,
            Limits::new().max_connections(1_000).max_per_source(1_000),
            &recorder,
        )
        .handler_driver(HandlerDriver::Coroutines { loops: 1 })
        .handler(echo)
        .allow_all()
        .build()
        .expect("the child's server did not start");
        let address = server.local_addr();
        let mut warm = client(address);
        assert_eq!(round_trip(&mut warm, b"warm"), b"warm");
        drop(warm);
        assert!(common::eventually(SOON, || recorder.closes().len() == 1));
        // Take every mapping the kernel allows this process (vm.max_map_count): two a stack.
        let mut filler = Vec::new();
        while let Ok(coroutine) = Coroutine::<(), (), ()>::new(4096, |_, ()| ()) {
            filler.push(coroutine);
            assert!(filler.len() < 1_000_000, "mappings never ran out");
        }
        let filled = filler.len();
        // Give a few back (this thread's pool keeps the first STACK_POOL_MAX of them mapped).
        filler.truncate(filled - STACK_POOL_MAX - 8);
        let mut served = 0;
        let mut refused = 0;
        let mut streams = Vec::new();
        for index in 0..40_u8 {
            // A connection refused at the limit is reset at once, and that reset can beat the connect.
            let Some(mut stream) = common::connect_unless_turned_away(address) else {
                refused += 1;
                continue;
            };
            let _ = stream.write_all(&[index]);
            let mut reply = [0_u8; 1];
            match stream.read(&mut reply) {
                Ok(1) => served += 1,
                _ => refused += 1,
            }
            streams.push(stream);
        }
        println!("{filled} filler stacks; at the limit {served} served, {refused} refused");
        assert!(refused > 0, "the limit was never reached: {served} served");
        assert!(
            common::eventually(SOON, || recorder.closes().len() == 1 + refused),
            "each refused connection should close once: {:?}",
            recorder.closes()
        );
        let closes = recorder.closes();
        let reasons: Vec<_> = closes.iter().skip(1).map(|(_, reason)| *reason).collect();
        assert!(
            reasons
                .iter()
                .all(|reason| *reason == CloseReason::Limit(LimitKind::HandlerStack)),
            "a connection whose coroutine stack could not be mapped should close with \
             Limit(HandlerStack): {reasons:?}"
        );
        // Each failure is reported with the OS error and the hint (40 stay below the coalescing threshold).
        let failures: Vec<(i32, &str)> = recorder
            .events()
            .into_iter()
            .filter_map(|event| match event {
                Event::HandlerStackFailed { errno, hint, .. } => Some((errno, hint)),
                _ => None,
            })
            .collect();
        assert_eq!(
            failures.len(),
            refused,
            "every connection without a stack should report HandlerStackFailed once: {failures:?}"
        );
        assert!(
            failures
                .iter()
                .all(|(errno, hint)| *errno == libc::ENOMEM && hint.contains("vm.max_map_count")),
            "a stack mapping at the limit should fail with ENOMEM and a hint naming vm.max_map_count: \
             {failures:?}"
        );
        // Mappings come back: new connections are served again.
        drop(filler);
        drop(streams);
        let mut after = client(address);
        assert_eq!(
            round_trip(&mut after, b"back"),
            b"back",
            "once mappings are free again, a new connection should be served"
        );
        return;
    }
    let output = run_child(child::rerun(
        "at_the_memory_mapping_limit_new_handlers_are_refused_and_the_server_serves_on",
        MAP_LIMIT_CHILD,
    ));
    println!("{}", String::from_utf8_lossy(&output.stdout));
    println!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        output.status.success(),
        "at the memory-mapping limit the server should refuse new handlers and serve on, not end the \
         process: {:?}",
        output.status
    );
}

#[test]
fn stacks_kept_for_reuse_after_deep_handlers_hold_few_resident_pages() {
    const CONNECTIONS: usize = 128;
    let _alone = TURN
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let recorder = Recorder::default();
    let server = test_builder(
        DEFAULT_WORKERS,
        Limits::new()
            .max_connections(CONNECTIONS + 8)
            .max_per_source(CONNECTIONS + 8),
        &recorder,
    )
    .handler_driver(HandlerDriver::Coroutines { loops: 1 })
    .handler(|connection: &mut TcpConnection<'_>| {
        let mut byte = [0_u8; 1];
        if connection.read(&mut byte)? == 0 {
            return Ok(());
        }
        // About 120 KiB of this coroutine's stack touched once, then an idle wait on a shallow stack.
        let sum = deep(50);
        connection.write_all(&[sum as u8])?;
        while connection.read(&mut byte)? > 0 {}
        Ok(())
    })
    .allow_all()
    .build()
    .expect("the coroutine handler server did not start");
    let address = server.local_addr();
    let mut warm = client(address);
    warm.write_all(b"w").unwrap();
    let _ = warm.read(&mut [0_u8; 1]);
    drop(warm);
    assert!(common::eventually(SOON, || recorder.closes().len() == 1));
    let resident_before = resident_kib();
    let mut streams = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        let mut stream = client(address);
        stream.write_all(b"d").unwrap();
        stream
            .read_exact(&mut [0_u8; 1])
            .expect("the deep handler should answer");
        streams.push(stream);
    }
    let resident_open = resident_kib();
    drop(streams);
    assert!(
        common::eventually(SOON, || recorder.closes().len() == CONNECTIONS + 1),
        "every connection should close"
    );
    std::thread::sleep(Duration::from_millis(100));
    let resident_after = resident_kib();
    println!(
        "resident KiB: {resident_before} before, {resident_open} with {CONNECTIONS} deep handlers open, \
         {resident_after} once they closed (their stacks pooled)"
    );
    // Kept whole, the pooled stacks would hold about 120 KiB each: 15 MiB for 128 of them.
    assert!(
        resident_after < resident_before + 6 * 1024,
        "the stack pool keeps {} KiB resident after {CONNECTIONS} deep handlers closed: a pooled stack \
         should give back the pages below its top",
        resident_after.saturating_sub(resident_before)
    );
}

#[test]
fn the_global_cap_refuses_on_coroutines_and_no_connection_is_ever_busy() {
    let _turn = shared_turn();
    let (_recorder, server) = serve(Limits::new().max_connections(2).max_per_source(2), echo);
    let address = server.local_addr();
    let mut first = client(address);
    let mut second = client(address);
    assert_eq!(round_trip(&mut first, b"a"), b"a");
    assert_eq!(round_trip(&mut second, b"b"), b"b");
    let mut third = common::UnwantedClient::connect(address);
    third.send(b"never read");
    assert!(
        third.is_closed_by_server(),
        "the third connection passed the global cap of two"
    );
    drop(first);
    assert!(
        common::eventually(SOON, || server.handle().open_connections() == 1),
        "the first connection should close and free its place"
    );
    let mut fourth = client(address);
    assert_eq!(
        round_trip(&mut fourth, b"d"),
        b"d",
        "a freed place should admit again"
    );
    let stats = server.stats();
    assert_eq!(stats.refused_by(RefusalCause::GlobalCap), 1, "{stats:?}");
    assert_eq!(
        stats.refused_by(RefusalCause::Busy),
        0,
        "coroutines have no worker pool to be busy: {stats:?}"
    );
}

#[test]
fn a_handler_that_panics_after_its_connection_was_killed_is_reported_as_a_panic() {
    let _turn = shared_turn();
    let (handles, handle_receiver) = std::sync::mpsc::channel::<KillHandle>();
    let handles = Mutex::new(handles);
    let (recorder, server) = serve(
        Limits::new().idle_timeout(Duration::from_secs(60)),
        move |connection: &mut TcpConnection<'_>| {
            handles
                .lock()
                .unwrap()
                .send(connection.kill_handle())
                .unwrap();
            let mut buffer = [0_u8; 8];
            if connection.read(&mut buffer).is_err() {
                panic!("the handler fails on the kill's error");
            }
            Ok(())
        },
    );
    let mut stream = client(server.local_addr());
    let handle = handle_receiver.recv_timeout(SOON).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(handle.kill(9), "the kill should win");
    assert_eq!(recorder.single_close(SOON), CloseReason::Killed(9));
    let panicked = |recorder: &Recorder| {
        recorder
            .events()
            .iter()
            .filter(|event| matches!(event, net_io_blocking::Event::SessionPanicked { .. }))
            .count()
    };
    assert!(
        common::eventually(SOON, || panicked(&recorder) == 1),
        "a handler panic on the close path went unreported: {:?}",
        recorder.events()
    );
    assert!(common::is_closed_by_server(&mut stream));
}

#[test]
fn an_exchange_deadline_that_passes_while_a_handler_waits_in_write_closes_with_exchange_deadline() {
    let _turn = shared_turn();
    let recorder = Recorder::default();
    let (seen, handler) = reporting(|connection: &mut TcpConnection<'_>| {
        let mut byte = [0_u8; 1];
        connection.read(&mut byte)?;
        connection.set_exchange_deadline(Some(Instant::now() + Duration::from_millis(300)));
        connection.write_all(&vec![1_u8; 16 << 20])
    });
    let server = ServerBuilder::new()
        .listener(ListenerSpec::new("127.0.0.1:0".parse().unwrap()).send_buffer(16 * 1024))
        .handler_driver(HandlerDriver::Coroutines { loops: 2 })
        .limits(
            Limits::new()
                .min_rate(None)
                .write_timeout(Duration::from_secs(60)),
        )
        .events(recorder.clone())
        .handler(handler)
        .allow_all()
        .build()
        .expect("the coroutine handler server did not start");
    let mut stream = client(server.local_addr());
    stream.write_all(b"x").unwrap();
    let started = Instant::now();
    assert_eq!(recorder.single_close(SOON), CloseReason::ExchangeDeadline);
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the exchange deadline, not the 60 s write timeout, should end the write"
    );
    assert_eq!(
        seen.lock().unwrap().as_deref(),
        Some("Err(Timeout(Exchange))"),
        "the handler's write should report the exchange deadline"
    );
    drop(stream);
}
