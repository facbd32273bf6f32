//! A gate for the tests: admits everyone, allows or denies writes by count, and keeps what it saw.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use net_io_blocking::{CloseReason, ConnectionInfo, Gate};
use net_io_core::{Admission, Lane, Refusal, Verdict, WriteFacts};

/// The admission of a gate that lets everyone in: no ticket, the default lane.
pub fn admit_on_the_default_lane() -> Result<Admission<()>, Refusal> {
    Ok(Admission {
        ticket: (),
        lane: Lane::DEFAULT,
    })
}

/// Admits every connection on the default lane, allows the first `allowed` write checks and denies every
/// later one with `code`; counts its write checks and records the reason of every close it is told of.
/// Clones share the counts, so a test keeps one clone to look at while the server owns another.
#[derive(Clone, Debug)]
pub struct CountingGate {
    allowed: usize,
    code: u16,
    checks: Arc<AtomicUsize>,
    closed: Arc<Mutex<Vec<CloseReason>>>,
}

impl CountingGate {
    /// A gate that allows every write.
    pub fn allow_all() -> Self {
        Self::deny_after(usize::MAX, 0)
    }

    /// A gate that denies every write with `code`.
    pub fn deny_all(code: u16) -> Self {
        Self::deny_after(0, code)
    }

    /// A gate that allows the first `allowed` write checks and denies the rest with `code`.
    pub fn deny_after(allowed: usize, code: u16) -> Self {
        Self {
            allowed,
            code,
            checks: Arc::default(),
            closed: Arc::default(),
        }
    }

    /// How many writes the gate checked so far.
    pub fn checks(&self) -> usize {
        self.checks.load(Ordering::SeqCst)
    }

    /// The reason of every close the gate was told of, in order.
    pub fn closes(&self) -> Vec<CloseReason> {
        self.closed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

impl Gate for CountingGate {
    type Ticket = ();

    fn admit(&self, _info: &ConnectionInfo) -> Result<Admission<()>, Refusal> {
        admit_on_the_default_lane()
    }

    fn check(&self, _ticket: &(), _write: &WriteFacts) -> Verdict {
        let seen = self.checks.fetch_add(1, Ordering::SeqCst);
        if seen < self.allowed {
            Verdict::Allow
        } else {
            Verdict::Deny(self.code)
        }
    }

    fn closed(&self, _ticket: (), _info: &ConnectionInfo, reason: CloseReason) {
        self.closed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(reason);
    }
}
