//! The `--allow-from` gate of a stage: a link from an address outside the list is marked at admission, before
//! a byte is read, and its session refuses it in words (an `Error` frame, then a graceful close), since the
//! connecting side writes its hello first and an accept-time reset could destroy the explanation.

use net_io_blocking::{Admission, ConnectionInfo, Gate, Lane, Refusal, TrustedProxies};

/// The lane an address outside `--allow-from` is admitted into, only to be refused by its session.
pub(crate) const REFUSED_LANE: Lane = Lane(u8::MAX);

/// Admits links from the listed addresses into the default lane and every other one into [`REFUSED_LANE`].
#[derive(Debug)]
pub(crate) struct AllowFrom {
    allowed: TrustedProxies,
}

impl AllowFrom {
    pub(crate) fn new(allowed: TrustedProxies) -> AllowFrom {
        AllowFrom { allowed }
    }
}

impl Gate for AllowFrom {
    type Ticket = ();

    fn admit(&self, info: &ConnectionInfo) -> Result<Admission<()>, Refusal> {
        let lane = if self.allowed.contains(info.peer.ip()) {
            Lane::DEFAULT
        } else {
            REFUSED_LANE
        };
        Ok(Admission { ticket: (), lane })
    }
}
