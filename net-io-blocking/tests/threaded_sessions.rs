//! The sessions-facing tests once more, on worker threads ([`SessionDriver::Threads`]), so that one
//! `cargo test` covers both session drivers: this binary includes those test files as modules, and
//! `common::session_driver` picks worker threads in a binary named `threaded_sessions`.
//!
//! Files that count process-wide things (allocations, descriptors, system calls, injected faults) or that
//! test only the event loop stay in their own binaries and are not included.
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
#[path = "offload.rs"]
mod offload;
#[path = "proxy.rs"]
mod proxy;
#[path = "timeouts.rs"]
mod timeouts;
