//! Sessions the tests share beside the echo: one that closes gracefully with its input left unread.

use net_io_blocking::{Input, Session, SessionContext, Step};

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
