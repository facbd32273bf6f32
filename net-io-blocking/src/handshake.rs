//! The connection handshake before the workload runs: a PROXY v1/v2 header from a trusted proxy, read under the
//! handshake deadline. Trust is checked before the first read; bytes after the header are application data.

use std::net::SocketAddr;

use net_io_core::proxy::{ProxyCommand, ProxyMode, ProxyParser, ProxyStatus, V1_MAX};
use net_io_core::{
    CloseReason, ConnectionInfo, Event, Gate, LimitKind, ProxyError, Refusal, RefusalCause,
    ResolvedLimits, TrustedProxies, readmit_or_refuse,
};

use crate::codes::reason_for_code;
use crate::link::{Link, Received};
use crate::shared::Core;

/// Room kept per worker for header bytes and the application bytes that arrive with them.
pub(crate) const PREFIX_CAPACITY: usize = 64 * 1024 + 512;
/// The fixed part of a v2 header before its body.
const V2_FIXED: usize = 16;

/// Reads the PROXY header the listener requires; returns the real client address if the header named one
/// (`LOCAL` health checks and `UNKNOWN` transports keep the TCP peer).
///
/// Bytes that arrived after the header are left in `prefix` for the workload.
pub(crate) fn read_proxy_header(
    link: &mut Link,
    info: &ConnectionInfo,
    mode: ProxyMode,
    trusted: &TrustedProxies,
    limits: &ResolvedLimits,
    prefix: &mut Vec<u8>,
) -> Result<Option<SocketAddr>, CloseReason> {
    if !trusted.contains(info.peer.ip()) {
        return Err(CloseReason::ProxyUntrusted);
    }
    let parser = ProxyParser::new(mode, limits.proxy_header_max);
    let most = (V2_FIXED + limits.proxy_header_max).max(V1_MAX);
    let deadline = crate::clock::deadline_after(link.now(), limits.handshake_timeout);
    prefix.clear();
    let mut chunk = [0u8; 512];
    loop {
        // Read no further than the longest possible header, so application data is not pulled in bulk.
        let want = (most - prefix.len().min(most)).clamp(1, chunk.len());
        let now = link.now();
        match link.receive(&mut chunk[..want], Some(deadline), now) {
            Received::Data(count) => prefix.extend_from_slice(&chunk[..count]),
            Received::Eof => {
                return Err(if prefix.is_empty() {
                    CloseReason::ProxyMissing
                } else {
                    CloseReason::ProxyInvalid
                });
            }
            Received::Deadline | Received::Slow => return Err(CloseReason::HandshakeTimeout),
            Received::Killed(code) => return Err(reason_for_code(code)),
            Received::Failed(error) => return Err(CloseReason::from_io(&error)),
        }
        match parser.parse(prefix) {
            Ok(ProxyStatus::NeedMore) if prefix.len() < most => {}
            Ok(ProxyStatus::NeedMore) => return Err(CloseReason::ProxyInvalid),
            Ok(ProxyStatus::Done { header, consumed }) => {
                prefix.drain(..consumed.min(prefix.len()));
                let real = match header.command {
                    ProxyCommand::Proxy => header.source,
                    ProxyCommand::Local => None,
                };
                return Ok(real);
            }
            Err(ProxyError::NotProxy) => return Err(CloseReason::ProxyMissing),
            Err(_) => return Err(CloseReason::ProxyInvalid),
        }
    }
}

/// Asks the gate again once the header named the real client (`info` already carries it); on a refusal,
/// `reply` gets at most `refusal_bytes_max` bytes of a [`Refusal::Reply`] for one non-blocking attempt, the
/// refusal is counted and reported as one at accept would be (see [`count_refusal`]), and the reason to close
/// with comes back. The ticket stays with the caller either way, for `Gate::closed`.
pub(crate) fn readmit<G: Gate>(
    core: &Core,
    gate: &G,
    ticket: &mut G::Ticket,
    info: &ConnectionInfo,
    refusal_bytes_max: usize,
    reply: impl FnOnce(&[u8]),
) -> Result<(), CloseReason> {
    let Err(refusal) = readmit_or_refuse(gate, ticket, info) else {
        return Ok(());
    };
    if let Refusal::Reply { bytes, .. } = refusal {
        // As for a refusal at accept: one short try only, so the refusal path cannot become an amplifier.
        reply(&bytes[..bytes.len().min(refusal_bytes_max)]);
    }
    count_refusal(core, info, RefusalCause::Gate(refusal.code()));
    Err(refusal.close_reason())
}

/// The reason to close with when the per-source cap refuses the real client the header named (the slot
/// could not move to it), after counting the refusal as one at accept would be (see [`count_refusal`]).
pub(crate) fn source_cap_refused(core: &Core, info: &ConnectionInfo) -> CloseReason {
    count_refusal(core, info, RefusalCause::SourceCap);
    CloseReason::Limit(LimitKind::PerSource)
}

/// Counts a refusal of an admitted connection in `Stats::refused` under `cause` and reports `Event::Refused`
/// naming its client, as the accept thread does for a refusal before any read: a gate or cap that decides on
/// the real client shows in the same figures whether a proxy stands in front or not, and so does a connection
/// no worker or loop could take (`Busy`, `DoorClosed` from `refuse_job`). The connection was admitted
/// and still closes (its ticket comes back, `Closed` follows); the stats keep it out of `open` only once.
pub(crate) fn count_refusal(core: &Core, info: &ConnectionInfo, cause: RefusalCause) {
    core.counters.server().record_refused_after_admission(cause);
    core.emit_coalesced(Event::Refused {
        peer: info.client_addr(),
        listener: info.listener,
        cause,
    });
}
