//! The connection handshake before the workload runs: a PROXY v1/v2 header from a trusted proxy, read under the
//! handshake deadline.

use std::net::SocketAddr;

use net_io_core::{CloseReason, ConnectionInfo, ResolvedLimits, TrustedProxies};

use crate::link::Link;

/// Room kept per worker for header bytes and the application bytes that arrive with them.
pub(crate) const PREFIX_CAPACITY: usize = 64 * 1024 + 512;

/// Whether a listener expects a PROXY header from its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ProxyMode {
    /// No header: the TCP peer is the client.
    #[default]
    Off,
}

/// Reads the PROXY header the listener requires; returns the real client address, if the header named one.
///
/// Bytes that arrived after the header are left in `prefix` for the workload.
pub(crate) fn read_proxy_header(
    _link: &mut Link,
    _info: &ConnectionInfo,
    mode: ProxyMode,
    _trusted: &TrustedProxies,
    _limits: &ResolvedLimits,
    _prefix: &mut Vec<u8>,
) -> Result<Option<SocketAddr>, CloseReason> {
    match mode {
        ProxyMode::Off => Ok(None),
    }
}
