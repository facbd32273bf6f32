//! The handler-facing tests once more, with each handler on a coroutine over event loops
//! ([`HandlerDriver::Coroutines`]), so that one `cargo test` covers both handler drivers: this binary includes
//! those test files as modules, and `common::handler_driver` picks coroutines in a binary named
//! `coroutine_suites`.
//!
//! Files that count process-wide things (allocations, descriptors, system calls, injected faults) have their
//! coroutine cases in `coroutine_handlers.rs` and their own binaries.
//!
//! Since the pick goes by the binary's name, a rename would quietly re-run the default driver; the test below
//! fails then, by looking at where a handler built the included tests' way really runs.
//!
//! [`HandlerDriver::Coroutines`]: net_io_blocking::HandlerDriver::Coroutines

// Each included file declares its own `mod common;`, as it must to build as a test binary of its own.
#![allow(clippy::duplicate_mod)]

#[path = "close_reasons.rs"]
mod close_reasons;
#[path = "edges.rs"]
mod edges;
#[path = "exactly_once.rs"]
mod exactly_once;
#[path = "lifecycle.rs"]
mod lifecycle;
#[path = "proxy.rs"]
mod proxy;
#[path = "timeouts.rs"]
mod timeouts;

mod common;

use net_io_blocking::{HandlerDriver, Limits, ServerBuilder, TcpConnection};

#[test]
fn the_included_handler_tests_really_run_on_coroutines_over_event_loops() {
    let intended = intended_handler_driver();
    let picked = common::handler_driver();
    assert_eq!(
        picked, intended,
        "common::handler_driver() picked {picked:?} in this binary, which exists to re-run the handler tests on \
         {intended:?}: was the binary renamed away from `coroutine_suites`?"
    );
    // What the choice does, seen from inside: a coroutine runs on one of the loop threads, a handler on
    // worker threads runs on a worker (the thread names are the builder's, also counted in event_loop.rs).
    let server = ServerBuilder::new()
        .handler_driver(picked)
        .listen("127.0.0.1:0")
        .workers(1)
        .limits(Limits::new().min_rate(None))
        .handler(|connection: &mut TcpConnection<'_>| {
            let name = std::thread::current()
                .name()
                .unwrap_or("unnamed")
                .to_owned();
            connection.write_all(format!("{name}\n").as_bytes())
        })
        .allow_all()
        .build()
        .expect("the probe server should start");
    let mut stream = common::client(server.local_addr());
    let thread = common::read_line(&mut stream);
    let expected_prefix = match intended {
        HandlerDriver::Coroutines { .. } => "net-io-loop-",
        _ => "net-io-worker-",
    };
    assert!(
        thread.starts_with(expected_prefix),
        "a handler built with {picked:?} ran on the thread {thread:?}, not on a {expected_prefix}N thread, so \
         this binary's tests did not run on the driver it exists for"
    );
}

/// The handler driver the included tests are meant to run on here: coroutines, unless
/// `NET_IO_TEST_HANDLER_DRIVER` forces one driver everywhere (then the check is that the force took effect).
fn intended_handler_driver() -> HandlerDriver {
    match std::env::var("NET_IO_TEST_HANDLER_DRIVER").as_deref() {
        Ok("threads") => HandlerDriver::Threads,
        _ => HandlerDriver::Coroutines { loops: 2 },
    }
}
