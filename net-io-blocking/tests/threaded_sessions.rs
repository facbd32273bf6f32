//! The sessions-facing tests once more, on worker threads ([`SessionDriver::Threads`]), so that one
//! `cargo test` covers both session drivers: this binary includes those test files as modules, and
//! `common::session_driver` picks worker threads in a binary named `threaded_sessions`.
//!
//! Files that count process-wide things (allocations, descriptors, system calls, injected faults) or that
//! test only the event loop stay in their own binaries and are not included.
//!
//! Since the pick goes by the binary's name, a rename would quietly re-run the default driver; the test below
//! fails then, by looking at where a session built the included tests' way really runs.
//!
//! [`SessionDriver::Threads`]: net_io_blocking::SessionDriver::Threads

// Each included file declares its own `mod common;`, as it must to build as a test binary of its own.
#![allow(clippy::duplicate_mod)]

#[path = "admission.rs"]
mod admission;
#[path = "close_reasons.rs"]
mod close_reasons;
#[path = "edges.rs"]
mod edges;
#[path = "exactly_once.rs"]
mod exactly_once;
#[path = "far_deadlines.rs"]
mod far_deadlines;
#[path = "lifecycle.rs"]
mod lifecycle;
#[path = "listen.rs"]
mod listen;
#[path = "offload.rs"]
mod offload;
#[path = "outbound.rs"]
mod outbound;
#[path = "proxy.rs"]
mod proxy;
#[path = "timeouts.rs"]
mod timeouts;

mod common;

use net_io_blocking::{Input, Limits, Session, SessionContext, SessionDriver, Step};

/// Answers any bytes with the name of the thread its `on_data` runs on, one line.
struct ThreadName;

impl Session for ThreadName {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        input.consume(input.bytes().len());
        let name = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_owned();
        context
            .output()
            .push(format!("{name}\n").as_bytes())
            .expect("a thread name fits in an empty output");
        Step::Write
    }
}

#[test]
fn the_included_session_tests_really_run_on_worker_threads() {
    let intended = intended_session_driver();
    let picked = common::session_driver();
    assert_eq!(
        picked, intended,
        "common::session_driver() picked {picked:?} in this binary, which exists to re-run the session tests on \
         {intended:?}: was the binary renamed away from `threaded_sessions`?"
    );
    // What the choice does, seen from inside, through the builder most included tests start from: a session on
    // worker threads runs on a worker, one on event loops on a loop thread (the thread names are the
    // builder's, also counted in event_loop.rs).
    let server = common::test_builder(1, Limits::new(), &common::Recorder::default())
        .sessions(|_: &net_io_blocking::ConnectionInfo| Some(ThreadName))
        .allow_all()
        .build()
        .expect("the probe server should start");
    let mut stream = common::client(server.local_addr());
    std::io::Write::write_all(&mut stream, b"?").expect("write to the probe server");
    let thread = common::read_line(&mut stream);
    let expected_prefix = match intended {
        SessionDriver::Threads => "net-io-worker-",
        _ => "net-io-loop-",
    };
    assert!(
        thread.starts_with(expected_prefix),
        "a session built with {picked:?} ran on the thread {thread:?}, not on a {expected_prefix}N thread, so \
         this binary's tests did not run on the driver it exists for"
    );
}

/// The session driver the included tests are meant to run on here: worker threads, unless
/// `NET_IO_TEST_SESSION_DRIVER` forces one driver everywhere (then the check is that the force took effect).
fn intended_session_driver() -> SessionDriver {
    match std::env::var("NET_IO_TEST_SESSION_DRIVER").as_deref() {
        Ok("event-loop") => SessionDriver::EventLoop { loops: 2 },
        _ => SessionDriver::Threads,
    }
}
