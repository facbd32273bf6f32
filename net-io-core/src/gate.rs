//! The [`Gate`]: admission before any byte is read, a check before every write, the ticket back at close.
//!
//! A gate is the application's policy seam (bans, quotas, revocation). The driver calls it through
//! [`admit_or_refuse`] and [`check_or_deny`], which turn a panic into a refusal or a denial: a broken gate
//! fails closed and never lets traffic through (threat T-45).

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::close::CloseReason;
use crate::id::ConnectionId;
use crate::info::ConnectionInfo;

/// The code a refusal or denial carries when the gate panicked.
pub const GATE_PANIC_CODE: u16 = u16::MAX;

/// An opaque importance lane, 0 to 255; the control line can shed lanes at or above a threshold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lane(pub u8);

impl Lane {
    /// Lane 0, the default.
    pub const DEFAULT: Lane = Lane(0);
}

/// A gate's yes to a new connection.
#[derive(Debug)]
pub struct Admission<T> {
    /// The gate's per-connection state, handed back to `check` and `closed`.
    pub ticket: T,
    /// The connection's lane.
    pub lane: Lane,
}

/// A gate's no to a new connection. Nothing is read from a refused connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Reset the connection at once.
    Reset {
        /// The gate's code, reported in the `Refused` event and close reason.
        code: u16,
    },
    /// Send a fixed reply (at most `refusal_bytes_max`, one non-blocking attempt), then reset.
    Reply {
        /// The gate's code.
        code: u16,
        /// The reply, for example `b"HTTP/1.1 503 Service Unavailable\r\n\r\n"`.
        bytes: &'static [u8],
    },
}

/// What a gate sees before a write system call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WriteFacts {
    /// The connection.
    pub id: ConnectionId,
    /// Its lane.
    pub lane: Lane,
    /// Bytes about to be written in this call.
    pub bytes: usize,
    /// True when part of the current response already went out (a denial must then reset).
    pub response_started: bool,
}

impl WriteFacts {
    /// Facts for a write of `bytes` bytes on connection `id`.
    pub fn new(id: ConnectionId, lane: Lane, bytes: usize, response_started: bool) -> WriteFacts {
        WriteFacts {
            id,
            lane,
            bytes,
            response_started,
        }
    }
}

/// The gate's answer to a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Go ahead.
    Allow,
    /// Stop: pending output is wiped and the connection closes with `EgressDenied(code)`.
    Deny(u16),
}

/// Admission and egress policy. One gate serves the whole server; its `Ticket` is per connection.
///
/// Costs: `admit` runs once per accepted connection on the accept thread; `check` once per write call
/// (not again after `EAGAIN` or for the rest of a partial write); `closed` exactly once per admitted
/// connection, with the one close reason.
pub trait Gate: Send + Sync + 'static {
    /// Per-connection state the gate keeps from admission to close.
    type Ticket: Send + 'static;

    /// Admits or refuses a new connection, before any byte is read from it.
    fn admit(&self, info: &ConnectionInfo) -> Result<Admission<Self::Ticket>, Refusal>;

    /// Allows or denies a write of `write.bytes` bytes.
    fn check(&self, ticket: &Self::Ticket, write: &WriteFacts) -> Verdict {
        let _ = (ticket, write);
        Verdict::Allow
    }

    /// Takes the ticket back when the connection closes, with its close reason (for strike counting).
    fn closed(&self, ticket: Self::Ticket, info: &ConnectionInfo, reason: CloseReason) {
        let _ = (ticket, info, reason);
    }
}

/// The explicit "no policy" gate: admits everything into lane 0 and allows every write.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllowAll;

impl Gate for AllowAll {
    type Ticket = ();

    fn admit(&self, _info: &ConnectionInfo) -> Result<Admission<()>, Refusal> {
        Ok(Admission {
            ticket: (),
            lane: Lane::DEFAULT,
        })
    }
}

/// Calls [`Gate::admit`], turning a panic into `Refusal::Reset { code: GATE_PANIC_CODE }`.
pub fn admit_or_refuse<G: Gate + ?Sized>(
    gate: &G,
    info: &ConnectionInfo,
) -> Result<Admission<G::Ticket>, Refusal> {
    catch_unwind(AssertUnwindSafe(|| gate.admit(info))).unwrap_or(Err(Refusal::Reset {
        code: GATE_PANIC_CODE,
    }))
}

/// Calls [`Gate::check`], turning a panic into `Verdict::Deny(GATE_PANIC_CODE)`.
pub fn check_or_deny<G: Gate + ?Sized>(
    gate: &G,
    ticket: &G::Ticket,
    write: &WriteFacts,
) -> Verdict {
    catch_unwind(AssertUnwindSafe(|| gate.check(ticket, write)))
        .unwrap_or(Verdict::Deny(GATE_PANIC_CODE))
}

/// Calls [`Gate::closed`], swallowing a panic so the close still completes.
pub fn close_ticket<G: Gate + ?Sized>(
    gate: &G,
    ticket: G::Ticket,
    info: &ConnectionInfo,
    reason: CloseReason,
) {
    let _ = catch_unwind(AssertUnwindSafe(|| gate.closed(ticket, info, reason)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::ListenerId;
    use std::time::Instant;

    struct Broken;

    impl Gate for Broken {
        type Ticket = ();

        fn admit(&self, _info: &ConnectionInfo) -> Result<Admission<()>, Refusal> {
            panic!("gate bug")
        }

        fn check(&self, _ticket: &(), _write: &WriteFacts) -> Verdict {
            panic!("gate bug")
        }
    }

    fn info() -> ConnectionInfo {
        ConnectionInfo::new(
            ConnectionId::new(1).unwrap(),
            ListenerId(0),
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
            Instant::now(),
        )
    }

    #[test]
    fn a_panicking_gate_refuses_and_denies() {
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let admitted = admit_or_refuse(&Broken, &info());
        let verdict = check_or_deny(
            &Broken,
            &(),
            &WriteFacts::new(ConnectionId::new(1).unwrap(), Lane::DEFAULT, 10, false),
        );
        std::panic::set_hook(hook);
        assert!(
            matches!(
                admitted,
                Err(Refusal::Reset {
                    code: GATE_PANIC_CODE
                })
            ),
            "a panicking admit let the connection in"
        );
        assert_eq!(
            verdict,
            Verdict::Deny(GATE_PANIC_CODE),
            "a panicking check let bytes out"
        );
    }

    #[test]
    fn allow_all_admits_into_lane_zero() {
        let admission = admit_or_refuse(&AllowAll, &info()).unwrap();
        assert_eq!(admission.lane, Lane::DEFAULT);
    }
}
