//! [`ConnectionInfo`]: the facts about one connection that gates, sessions and events see.

use std::net::SocketAddr;
use std::time::Instant;

use crate::addr::{PrefixKey, PrefixPolicy, normalize};
use crate::gate::Lane;
use crate::id::{ConnectionId, ListenerId, WorkerId};

/// The facts about one connection, fixed at accept (the real peer and the worker are filled in later).
///
/// Addresses are normalised at construction: an IPv4-mapped IPv6 peer is stored as IPv4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionInfo {
    /// The connection's id, never reused.
    pub id: ConnectionId,
    /// The listener that accepted it.
    pub listener: ListenerId,
    /// The worker serving it; `None` until a worker takes it.
    pub worker: Option<WorkerId>,
    /// Our address on this connection.
    pub local: SocketAddr,
    /// The TCP peer's address (the proxy's address behind a PROXY header).
    pub peer: SocketAddr,
    /// The client's address from a PROXY header sent by a trusted proxy.
    pub real_peer: Option<SocketAddr>,
    /// The importance lane the gate gave the connection (0 until admitted).
    pub lane: Lane,
    /// When the connection was accepted.
    pub accepted_at: Instant,
}

impl ConnectionInfo {
    /// Facts for a freshly accepted connection; the peer and local addresses are normalised.
    pub fn new(
        id: ConnectionId,
        listener: ListenerId,
        local: SocketAddr,
        peer: SocketAddr,
        accepted_at: Instant,
    ) -> ConnectionInfo {
        ConnectionInfo {
            id,
            listener,
            worker: None,
            local: normalize(local),
            peer: normalize(peer),
            real_peer: None,
            lane: Lane::DEFAULT,
            accepted_at,
        }
    }

    /// The client's address: the real peer from a trusted PROXY header if there was one, else the TCP peer.
    pub fn client_addr(&self) -> SocketAddr {
        self.real_peer.unwrap_or(self.peer)
    }

    /// The per-source key of the client under `policy`.
    pub fn client_key(&self, policy: PrefixPolicy) -> PrefixKey {
        policy.key(self.client_addr().ip())
    }

    /// Records the real client address from a trusted PROXY header (normalised).
    pub fn set_real_peer(&mut self, real_peer: SocketAddr) {
        self.real_peer = Some(normalize(real_peer));
    }
}
