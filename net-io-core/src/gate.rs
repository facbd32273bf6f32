//! The [`Gate`]: admission before any byte is read, a check before every write, the ticket back at close.
//!
//! A gate is the application's policy seam (bans, quotas, revocation). The driver calls it through
//! [`admit_or_refuse`], [`readmit_or_refuse`] and [`check_or_deny`], which turn a panic into a refusal or a
//! denial: a broken gate fails closed and never lets traffic through (threat T-45).
//!
//! On a listener that requires a PROXY header, the calls on one connection run in this order:
//!
//! ```text
//! accept ─ caps ─ admit(info: proxy's address) ─ read PROXY header ─ source cap moves to the real client
//!        ─ readmit(&mut ticket, info: real client) ─ ProxyResolved ─ HandshakeDone ─ check … check ─ closed
//! ```
//!
//! `readmit` is called only when the header names a client (`PROXY` command with an address); a `LOCAL`
//! health check or an `UNKNOWN` transport keeps the proxy's address and is not asked again.

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::close::{CloseReason, RefusalCause};
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

impl Refusal {
    /// The gate's code.
    pub const fn code(self) -> u16 {
        match self {
            Refusal::Reset { code } | Refusal::Reply { code, .. } => code,
        }
    }

    /// The close reason of an admitted connection that [`Gate::readmit`] refused:
    /// `Refused(RefusalCause::Gate(code))`, named `refused_gate`, the same cause an `admit` refusal counts under.
    pub const fn close_reason(self) -> CloseReason {
        CloseReason::Refused(RefusalCause::Gate(self.code()))
    }
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
/// (not again after `EAGAIN` or for the rest of a partial write); `readmit` at most once, on the serving
/// thread, when a trusted PROXY header names the real client; `closed` exactly once per admitted connection,
/// with the one close reason and the ticket as `readmit` left it.
pub trait Gate: Send + Sync + 'static {
    /// Per-connection state the gate keeps from admission to close.
    type Ticket: Send + 'static;

    /// Admits or refuses a new connection, before any byte is read from it.
    fn admit(&self, info: &ConnectionInfo) -> Result<Admission<Self::Ticket>, Refusal>;

    /// Asks again once a trusted PROXY header named the real client: `info.real_peer` (and so
    /// [`ConnectionInfo::client_addr`]) now names the real client, `info.peer` is still the proxy, and the
    /// per-source cap already counts the real client.
    ///
    /// Runs once per connection, on the thread serving it, before any application byte is read and before
    /// `ProxyResolved` is reported. The gate may keep the ticket (return `Ok(())`), replace it (assign to
    /// `*ticket`, then `Ok(())`; the value it replaces is dropped here, so hand its accounting over first), or
    /// refuse: the connection then closes with `Refused(RefusalCause::Gate(code))` (`refused_gate`), a
    /// [`Refusal::Reply`] sends its bytes once without blocking first, and `closed` still receives the ticket.
    /// A panic refuses with [`GATE_PANIC_CODE`]. Whatever happens, `closed` gets the current ticket exactly once.
    ///
    /// **The default keeps the ticket and lets the connection go on**, which is how every gate behaved before
    /// this method existed. We chose it over no default (gate authors would be made to think, but every
    /// existing gate would stop compiling) and over re-running `admit` on the real address (that would call
    /// `admit` twice per connection but `closed` once, silently breaking gates that count in `admit`).
    /// **A gate that decides on addresses must override this**, or it only ever sees the proxy's address on
    /// a PROXY listener.
    fn readmit(&self, ticket: &mut Self::Ticket, info: &ConnectionInfo) -> Result<(), Refusal> {
        let _ = (ticket, info);
        Ok(())
    }

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

/// Calls [`Gate::readmit`], turning a panic into `Refusal::Reset { code: GATE_PANIC_CODE }`; the ticket is
/// left as the gate last stored it, so it can still go back through `closed`.
pub fn readmit_or_refuse<G: Gate + ?Sized>(
    gate: &G,
    ticket: &mut G::Ticket,
    info: &ConnectionInfo,
) -> Result<(), Refusal> {
    catch_unwind(AssertUnwindSafe(|| gate.readmit(ticket, info))).unwrap_or(Err(Refusal::Reset {
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

        fn readmit(&self, _ticket: &mut (), _info: &ConnectionInfo) -> Result<(), Refusal> {
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
        let readmitted = readmit_or_refuse(&Broken, &mut (), &info());
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
        assert_eq!(
            readmitted,
            Err(Refusal::Reset {
                code: GATE_PANIC_CODE
            }),
            "a panicking readmit let the real client in"
        );
    }

    #[test]
    fn the_default_readmit_keeps_the_ticket() {
        let mut ticket = ();
        assert_eq!(
            readmit_or_refuse(&AllowAll, &mut ticket, &info()),
            Ok(()),
            "the default readmit refused a connection admit had let in"
        );
    }

    #[test]
    fn a_readmit_refusal_closes_under_the_gate_cause_with_its_code() {
        let refusals = [
            Refusal::Reset { code: 7 },
            Refusal::Reply {
                code: 9,
                bytes: b"no\n",
            },
            Refusal::Reset {
                code: GATE_PANIC_CODE,
            },
        ];
        let named: Vec<String> = refusals
            .iter()
            .map(|refusal| {
                let reason = refusal.close_reason();
                format!("{refusal:?} -> {reason:?} ({})", reason.as_str())
            })
            .collect();
        insta::assert_snapshot!("readmit_refusal_close_reasons", named.join("\n"));
    }

    #[test]
    fn allow_all_admits_into_lane_zero() {
        let admission = admit_or_refuse(&AllowAll, &info()).unwrap();
        assert_eq!(admission.lane, Lane::DEFAULT);
    }
}
