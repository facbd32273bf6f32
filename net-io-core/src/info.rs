//! [`ConnectionInfo`]: the facts about one connection that gates, sessions and events see.

use std::net::SocketAddr;
use std::time::Instant;

use crate::addr::{PrefixKey, PrefixPolicy, normalize};
use crate::gate::Lane;
use crate::id::{ConnectionId, ListenerId, WorkerId};

/// Which side opened a connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Accepted on one of the server's listeners.
    #[default]
    Accepted,
    /// Opened by the server itself (an outbound connection, `ServerHandle::connect` in net-io-blocking).
    Connected,
}

/// The facts about one connection, fixed at accept (the real peer and the worker are filled in later).
///
/// Addresses are normalised at construction: an IPv4-mapped IPv6 peer is stored as IPv4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionInfo {
    /// The connection's id, never reused.
    pub id: ConnectionId,
    /// The listener that accepted it; [`ListenerId::OUTBOUND`] for a connection the server opened.
    pub listener: ListenerId,
    /// Whether the connection was accepted or opened by the server.
    pub origin: Origin,
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
    /// When the connection was accepted (for an outbound one: when its connect started).
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
            origin: Origin::Accepted,
            worker: None,
            local: normalize(local),
            peer: normalize(peer),
            real_peer: None,
            lane: Lane::DEFAULT,
            accepted_at,
        }
    }

    /// Facts for an outbound connection the server opened to `peer` from `local`: its listener is
    /// [`ListenerId::OUTBOUND`] and its origin [`Origin::Connected`].
    pub fn outbound(
        id: ConnectionId,
        local: SocketAddr,
        peer: SocketAddr,
        started_at: Instant,
    ) -> ConnectionInfo {
        ConnectionInfo {
            origin: Origin::Connected,
            ..ConnectionInfo::new(id, ListenerId::OUTBOUND, local, peer, started_at)
        }
    }

    /// True for a connection the server opened itself.
    pub fn is_outbound(&self) -> bool {
        self.origin == Origin::Connected
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
