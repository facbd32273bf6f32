//! Fault injection through the `net_io_shim` cfg: accept errors of every class, a failing `recv`, spurious
//! `EAGAIN` and `EINTR`, an event loop whose epoll cannot be created, a coroutine stack that cannot be mapped. Run with
//! `RUSTFLAGS="--cfg net_io_shim" cargo test -p net-io-blocking --test faults`.
//!
//! The shim's faults are process-wide, so every scenario runs in one test, one after another; the systemd
//! scenario (a take that fails half-way) injects its fault in a child process of its own.

#![cfg(net_io_shim)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::echo::{Echo, echo_server};
use common::{Recorder, SOON, client, eventually, round_trip};
use net_io_blocking::{
    CloseReason, ConnectionInfo, Event, HandlerDriver, LimitKind, Limits, NetError, RefusalCause,
    Server, ServerBuilder, TcpConnection,
};
use net_io_sys::shim;

fn server(recorder: &Recorder) -> Server {
    echo_server(2, Limits::new(), recorder)
}

/// An echo server on `loops` event loops.
fn loop_server(loops: usize, recorder: &Recorder) -> Server {
    ServerBuilder::new()
        .session_driver(net_io_blocking::SessionDriver::EventLoop { loops })
        .listen("127.0.0.1:0")
        .limits(Limits::new().min_rate(None))
        .events(recorder.clone())
        .sessions(|_info: &ConnectionInfo| Some(Echo))
        .allow_all()
        .build()
        .expect("the test server should start")
}

fn has_event(recorder: &Recorder, wanted: impl Fn(&Event) -> bool) -> bool {
    eventually(SOON, || recorder.events().iter().any(&wanted))
}

fn a_per_connection_accept_error_is_counted_and_the_next_connection_served() {
    let recorder = Recorder::default();
    let server = server(&recorder);
    shim::inject("accept4", 0, 1, libc::ECONNABORTED);
    let _lost = std::net::TcpStream::connect(server.local_addr()).unwrap();
    assert!(has_event(&recorder, |event| matches!(
        event,
        Event::AcceptError { .. }
    )));
    let mut stream = client(server.local_addr());
    assert_eq!(round_trip(&mut stream, b"next"), b"next");
}

fn a_kernel_memory_shortage_pauses_accepting_then_resumes() {
    let recorder = Recorder::default();
    let server = server(&recorder);
    shim::inject("accept4", 0, 3, libc::ENOBUFS);
    let mut stream = client(server.local_addr());
    assert_eq!(
        round_trip(&mut stream, b"later"),
        b"later",
        "accepting did not resume after ENOBUFS"
    );
}

fn descriptor_pressure_sheds_one_connection_and_then_serves() {
    let recorder = Recorder::default();
    let server = server(&recorder);
    shim::inject("accept4", 0, 1, libc::EMFILE);
    let mut shed = common::UnwantedClient::connect(server.local_addr());
    assert!(shed.is_closed_by_server(), "the shed connection was served");
    assert!(has_event(&recorder, |event| matches!(
        event,
        Event::DescriptorPressure { .. }
    )));
    assert_eq!(server.stats().descriptor_pressure, 1);
    let mut stream = client(server.local_addr());
    assert_eq!(round_trip(&mut stream, b"after"), b"after");
}

fn a_broken_listener_stops_accepting_without_spinning() {
    let recorder = Recorder::default();
    let server = server(&recorder);
    shim::inject("accept4", 0, 1, libc::EBADF);
    let _stream = std::net::TcpStream::connect(server.local_addr()).unwrap();
    assert!(has_event(&recorder, |event| matches!(
        event,
        Event::ListenerFailed { .. }
    )));
    let calls = shim::calls("accept4");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        shim::calls("accept4"),
        calls,
        "the failed listener kept calling accept4"
    );
}

fn a_failing_recv_closes_only_its_connection() {
    let recorder = Recorder::default();
    let server = server(&recorder);
    let mut other = client(server.local_addr());
    assert_eq!(round_trip(&mut other, b"warm"), b"warm");
    // Let the other connection's worker enter its blocking recv first, so the fault hits the new one.
    std::thread::sleep(Duration::from_millis(100));
    shim::inject("recv", 0, 1, libc::ECONNRESET);
    let mut victim = client(server.local_addr());
    victim.write_all(b"x").ok();
    let closes = recorder.wait_for_closes(1, SOON);
    assert!(
        matches!(closes[0].1, CloseReason::PeerReset),
        "got {:?}",
        closes[0].1
    );
    let mut reply = [0u8; 5];
    other.write_all(b"alive").unwrap();
    other.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b"alive");
}

/// A warm-up round trip, then one round trip each through a spurious `EAGAIN` on `send`, an `EINTR` on
/// `recv` and a spurious `EAGAIN` on `recv`: every one must still echo.
fn round_trips_outlast_spurious_errors(stream: &mut TcpStream) {
    assert_eq!(round_trip(stream, b"warm"), b"warm");
    shim::inject("send", 0, 1, libc::EAGAIN);
    assert_eq!(round_trip(stream, b"again"), b"again");
    shim::inject("recv", 0, 1, libc::EINTR);
    assert_eq!(round_trip(stream, b"intr"), b"intr");
    shim::inject("recv", 0, 1, libc::EAGAIN);
    assert_eq!(round_trip(stream, b"spurious"), b"spurious");
}

fn spurious_eagain_and_eintr_are_retried() {
    let recorder = Recorder::default();
    let server = server(&recorder);
    let mut stream = client(server.local_addr());
    round_trips_outlast_spurious_errors(&mut stream);
    assert!(
        recorder.closes().is_empty(),
        "a retried error closed the connection"
    );
}

fn a_loop_that_cannot_start_is_given_no_connections() {
    let recorder = Recorder::default();
    // The first loop thread to create its epoll fails; the other one starts.
    shim::inject("epoll_create1", 0, 1, libc::EMFILE);
    let server = loop_server(2, &recorder);
    assert!(
        eventually(SOON, || shim::calls("epoll_create1") >= 2),
        "the two loop threads did not both try to create their epoll"
    );
    for index in 0..6 {
        let mut stream = client(server.local_addr());
        stream.write_all(b"served?").unwrap();
        let mut reply = [0u8; 7];
        assert!(
            stream.read_exact(&mut reply).is_ok() && &reply == b"served?",
            "connection {index} was handed to the loop that could not start and refused"
        );
    }
}

fn a_server_whose_only_loop_cannot_start_refuses_as_busy_and_counts_it() {
    let recorder = Recorder::default();
    // The only loop thread fails to create its epoll: every admitted connection is refused by it.
    shim::inject("epoll_create1", 0, 1, libc::EMFILE);
    let server = loop_server(1, &recorder);
    assert!(
        eventually(SOON, || shim::calls("epoll_create1") >= 1),
        "the loop thread did not try to create its epoll"
    );
    let mut stream = common::UnwantedClient::connect(server.local_addr());
    assert!(
        stream.is_closed_by_server(),
        "a connection handed to a loop that could not start should be reset"
    );
    assert!(
        eventually(SOON, || server.stats().refused_by(RefusalCause::Busy) == 1),
        "an admitted connection refused as Busy should count in the refusals: {:?}",
        server.stats()
    );
    let stats = server.stats();
    assert_eq!(stats.refused_after_admission, 1, "{stats:?}");
    assert_eq!(
        stats.closed, 1,
        "the refused connection was admitted, so it closes once: {stats:?}"
    );
    assert!(
        has_event(&recorder, |event| matches!(
            event,
            Event::Refused {
                cause: RefusalCause::Busy,
                ..
            }
        )),
        "a Refused event should name the Busy refusal"
    );
}

/// Handlers on coroutines: a stack that cannot be mapped refuses only its connection; a failing `recv` closes
/// only its connection; spurious `EAGAIN` and `EINTR` are retried without the handler seeing them.
fn handlers_on_coroutines_meet_faults_one_connection_at_a_time() {
    let recorder = Recorder::default();
    let server = ServerBuilder::new()
        .handler_driver(HandlerDriver::Coroutines { loops: 1 })
        .listen("127.0.0.1:0")
        .limits(Limits::new().min_rate(None))
        .events(recorder.clone())
        .handler(|connection: &mut TcpConnection<'_>| {
            let mut buffer = [0_u8; 64];
            loop {
                let count = connection.read(&mut buffer)?;
                if count == 0 {
                    return Ok::<(), NetError>(());
                }
                connection.write_all(&buffer[..count])?;
            }
        })
        .allow_all()
        .build()
        .expect("the coroutine handler server should start");
    // The loop's stack pool is empty, so the first connection maps a stack, and fails to.
    shim::inject("coroutine_stack", 0, 1, libc::ENOMEM);
    let mut refused = common::UnwantedClient::connect(server.local_addr());
    let closes = recorder.wait_for_closes(1, SOON);
    assert_eq!(
        closes.first().map(|close| close.1),
        Some(CloseReason::Limit(LimitKind::HandlerStack)),
        "a connection whose coroutine stack cannot be mapped should close at the handler stack limit, \
         got {closes:?}"
    );
    assert!(
        recorder.events().iter().any(|event| matches!(
            event,
            Event::HandlerStackFailed { errno, .. } if *errno == libc::ENOMEM
        )),
        "the failed stack mapping was not reported with its ENOMEM"
    );
    assert!(
        refused.is_closed_by_server(),
        "the connection without a coroutine stack was served"
    );
    let mut other = client(server.local_addr());
    round_trips_outlast_spurious_errors(&mut other);
    assert_eq!(
        recorder.closes().len(),
        1,
        "a retried error closed a connection: {:?}",
        recorder.closes()
    );
    // Let the loop finish its solo read of the other connection first (a blocking recv right after each
    // echo, timing out within a few ms), so the fault hits the new connection's recv, not that one.
    std::thread::sleep(Duration::from_millis(100));
    shim::inject("recv", 0, 1, libc::ECONNRESET);
    let mut victim = client(server.local_addr());
    victim.write_all(b"x").ok();
    let closes = recorder.wait_for_closes(2, SOON);
    assert_eq!(
        closes.get(1).map(|close| close.1),
        Some(CloseReason::PeerReset),
        "a failing recv should close its connection as reset, got {closes:?}"
    );
    assert_eq!(
        round_trip(&mut other, b"alive"),
        b"alive",
        "the other handler should carry on"
    );
}

#[test]
fn injected_faults_close_or_pause_only_what_they_hit() {
    a_per_connection_accept_error_is_counted_and_the_next_connection_served();
    a_kernel_memory_shortage_pauses_accepting_then_resumes();
    descriptor_pressure_sheds_one_connection_and_then_serves();
    a_broken_listener_stops_accepting_without_spinning();
    a_failing_recv_closes_only_its_connection();
    spurious_eagain_and_eintr_are_retried();
    a_loop_that_cannot_start_is_given_no_connections();
    a_server_whose_only_loop_cannot_start_refuses_as_busy_and_counts_it();
    handlers_on_coroutines_meet_faults_one_connection_at_a_time();
}

/// Set in the child process of the systemd take test.
const SYSTEMD_CHILD: &str = "NET_IO_TEST_FAULTS_SYSTEMD_CHILD";

/// Whether descriptor `fd` of this process is closed, open and close-on-exec, or open and inheritable, from
/// `/proc/self/fdinfo` (its `flags` carry `O_CLOEXEC` exactly when the descriptor is close-on-exec).
fn descriptor_state(fd: i32) -> &'static str {
    let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")) else {
        return "closed";
    };
    let flags = info
        .lines()
        .find_map(|line| line.strip_prefix("flags:"))
        .and_then(|flags| u32::from_str_radix(flags.trim(), 8).ok());
    match flags {
        Some(flags) if flags & libc::O_CLOEXEC as u32 != 0 => "cloexec",
        Some(_) => "inheritable",
        None => "unreadable",
    }
}

/// systemd passes two listeners; both pass the checks, the first is taken, and taking the second fails (an
/// injected `getsockname` error). The adoption fails as a whole: the listener this process took is closed,
/// the one it did not take is left open, close-on-exec, for no child of ours to inherit.
#[test]
fn a_take_that_fails_half_way_closes_only_what_was_taken() {
    use std::os::fd::OwnedFd;
    use std::process::{Command, Stdio};

    use common::child;
    use net_io_blocking::systemd;

    if child::is_child(SYSTEMD_CHILD) {
        shim::reset();
        // getsockname runs once per descriptor in the checks (fds 3 and 4), then once more in each take:
        // the fourth call is fd 4's take, after fd 3 was taken.
        shim::inject("getsockname", 3, 1, libc::EIO);
        let error = systemd::listeners().expect_err("the adoption should have failed");
        println!("RESULT error {error}");
        println!("RESULT fd3 {}", descriptor_state(3));
        println!("RESULT fd4 {}", descriptor_state(4));
        return;
    }
    let first =
        std::net::TcpListener::bind("127.0.0.1:0").expect("bind the first socket to pass on");
    let second =
        std::net::TcpListener::bind("127.0.0.1:0").expect("bind the second socket to pass on");
    // The shell puts stdin on fd 3 and stderr on fd 4, sets LISTEN_PID to its own pid and execs this test
    // binary, the way systemd starts a service after its fork.
    let script = "exec 3<&0 4<&2 0</dev/null 2>&1; export LISTEN_PID=$$; exec \"$0\" \"$@\"";
    let process = Command::new("/bin/sh")
        .arg("-c")
        .arg(script)
        .arg(child::this_binary())
        .args(child::only_test(
            "a_take_that_fails_half_way_closes_only_what_was_taken",
        ))
        .env_remove("LISTEN_PIDFDID")
        .env_remove("LISTEN_FDNAMES")
        .env("LISTEN_FDS", "2")
        .env(SYSTEMD_CHILD, "1")
        .stdin(Stdio::from(OwnedFd::from(first)))
        .stdout(Stdio::piped())
        .stderr(Stdio::from(OwnedFd::from(second)))
        .spawn()
        .expect("could not start the child");
    let results = child::result_lines(process, Duration::from_secs(60));
    assert_eq!(
        results,
        [
            "error inherited fd 4 (named \"unknown\") cannot be adopted: checking it failed: Input/output \
             error (os error 5); pass listening TCP stream sockets only (ListenStream=)",
            "fd3 closed",
            "fd4 cloexec",
        ],
        "a take that failed half-way should close the listener it took and leave the other close-on-exec"
    );
}
