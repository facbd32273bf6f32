//! The handler-facing tests once more, with each handler on a coroutine over event loops
//! ([`HandlerDriver::Coroutines`]), so that one `cargo test` covers both handler drivers: this binary includes
//! those test files as modules, and `common::handler_driver` picks coroutines in a binary named
//! `coroutine_suites`.
//!
//! Files that count process-wide things (allocations, descriptors, system calls, injected faults) have their
//! coroutine cases in `coroutine_handlers.rs` and their own binaries.
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
