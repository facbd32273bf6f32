//! The `--allow-from` gate of a stage: links from addresses outside the list are refused before a byte is read,
//! with an `Error` frame that says why.

use std::sync::OnceLock;

use net_io_blocking::{Admission, ConnectionInfo, Gate, Lane, Refusal, TrustedProxies};

use crate::wire::{ErrorCode, Frame, encode_to_vec};

/// The gate's refusal code (reported in the `Refused` event).
const NOT_ALLOWED: u16 = 403;

/// Admits links only from the listed addresses.
#[derive(Debug)]
pub(crate) struct AllowFrom {
    allowed: TrustedProxies,
}

impl AllowFrom {
    pub(crate) fn new(allowed: TrustedProxies) -> AllowFrom {
        AllowFrom { allowed }
    }
}

/// The refusal's `Error` frame, encoded once (a refusal reply must be static).
fn refusal_frame() -> &'static [u8] {
    static FRAME: OnceLock<Vec<u8>> = OnceLock::new();
    FRAME.get_or_init(|| {
        encode_to_vec(&Frame::Error {
            session: 0,
            code: ErrorCode::Auth,
            message: "this stage takes links only from the addresses given to --allow-from".into(),
        })
    })
}

impl Gate for AllowFrom {
    type Ticket = ();

    fn admit(&self, info: &ConnectionInfo) -> Result<Admission<()>, Refusal> {
        if self.allowed.contains(info.peer.ip()) {
            Ok(Admission {
                ticket: (),
                lane: Lane::DEFAULT,
            })
        } else {
            Err(Refusal::Reply {
                code: NOT_ALLOWED,
                bytes: refusal_frame(),
            })
        }
    }
}
