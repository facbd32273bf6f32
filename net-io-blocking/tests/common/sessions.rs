//! Sessions the tests share beside the echo: one that closes gracefully with its input left unread, and one
//! that parks on request and answers each completion.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use net_io_blocking::{Completer, Input, Session, SessionContext, Step};

/// How much [`CloseWhenFull`] holds before it closes; a client that sends more makes the close linger.
pub const READ_BEFORE_CLOSE: usize = 16 * 1024;

/// Reads until its input holds [`READ_BEFORE_CLOSE`] bytes, then closes gracefully without consuming any,
/// so the close finds input left and lingers on it (give it a read buffer of that size).
#[derive(Debug)]
pub struct CloseWhenFull;

impl Session for CloseWhenFull {
    fn on_data(&mut self, input: &mut Input<'_>, _context: &mut SessionContext<'_>) -> Step {
        if input.len() >= READ_BEFORE_CLOSE {
            return Step::Close;
        }
        Step::Read
    }
}

/// Echoes, except that a line `park` parks the session and hands its completer to the test.
pub struct ParkOrEcho {
    /// Where each parked session's completer goes.
    pub completers: Arc<Mutex<Vec<Completer>>>,
}

impl Session for ParkOrEcho {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        if input.bytes() == b"park\n" {
            input.consume_all();
            let Some(completer) = context.completer() else {
                return Step::Abort;
            };
            self.completers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(completer);
            return Step::Park {
                until: context.now() + Duration::from_secs(60),
            };
        }
        let taken = context.output().push_partial(input.bytes());
        input.consume(taken);
        Step::Write
    }

    fn on_wake(&mut self, _token: u64, value: u64, context: &mut SessionContext<'_>) -> Step {
        let line = format!("woke {value}\n");
        if context.output().push(line.as_bytes()).is_err() {
            return Step::Abort;
        }
        Step::Write
    }
}
