//! Kill codes: the slot codes at and above 0xff00 are the driver's own (drain, shutdown, shed), and the close reason each one stands for.

use net_io_core::CloseReason;

/// Slot codes at or above this value are the driver's own; user kill codes are capped just below.
pub(crate) const RESERVED_CODES: u16 = 0xff00;

/// Kill code: closed by a drain while idle (graceful).
pub(crate) const CODE_DRAINED: u16 = 0xff01;

/// Kill code: still busy at the drain deadline (abortive).
pub(crate) const CODE_DRAIN_DEADLINE: u16 = 0xff02;

/// Kill code: the server shut down.
pub(crate) const CODE_SHUTDOWN: u16 = 0xff03;

/// Kill code: shed by the control line.
pub(crate) const CODE_SHED: u16 = 0xff04;

/// The close reason a slot code stands for.
pub(crate) fn reason_for_code(code: u16) -> CloseReason {
    match code {
        CODE_DRAINED => CloseReason::Drained,
        CODE_DRAIN_DEADLINE => CloseReason::DrainDeadline,
        CODE_SHUTDOWN => CloseReason::Shutdown,
        CODE_SHED => CloseReason::Shed,
        code => CloseReason::Killed(code),
    }
}
