//! The task kinds: compute, sleep, channel, TCP, signal, file watch, file operations and processes.

pub mod channel;
pub mod compute;
pub mod file;
pub mod process;
pub mod signal;
pub mod sleep;
pub mod tcp;
pub mod watch;
