//! A listener's settings: the [`ListenerSpec`] a caller writes, the [`ListenerDefaults`] every listener is
//! checked against, and the [`ListenerRuntime`] its connections keep (limits, PROXY mode, caps).

use std::net::SocketAddr;
use std::sync::Arc;

use net_io_core::proxy::ProxyMode;
use net_io_core::{Limits, ResolvedLimits, TrustedProxies};
use net_io_sys::socket::ConnectionOptions;

use crate::caps::ListenerCounts;

/// The most listeners one server has live at once (at build, and after [`ServerHandle::add_listener`](crate::ServerHandle::add_listener)).
pub const LISTENERS_MAX: usize = 64;
/// One listening address and its own settings.
#[derive(Debug, Clone)]
pub struct ListenerSpec {
    pub(crate) address: SocketAddr,
    pub(crate) limits: Limits,
    pub(crate) proxy: Option<ProxyMode>,
    pub(crate) trusted: TrustedProxies,
    pub(crate) reuse_port: bool,
    pub(crate) receive_buffer: Option<usize>,
    pub(crate) send_buffer: Option<usize>,
    /// The index of an inherited listener in `Settings::adopted`, used instead of binding `address`.
    pub(crate) adopted: Option<usize>,
}

impl ListenerSpec {
    /// A listener on `address` with the server's limits and no PROXY header.
    pub fn new(address: SocketAddr) -> Self {
        Self {
            address,
            limits: Limits::new(),
            proxy: None,
            trusted: TrustedProxies::new(),
            reuse_port: false,
            receive_buffer: None,
            send_buffer: None,
            adopted: None,
        }
    }

    /// Limits for this listener; fields left unset fall back to the server's.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Requires a PROXY header (v1, v2 or either) from a peer in `trusted`, read under the handshake
    /// deadline; other peers close with `ProxyUntrusted` before anything is read.
    pub fn proxy(mut self, mode: ProxyMode, trusted: TrustedProxies) -> Self {
        self.proxy = Some(mode);
        self.trusted = trusted;
        self
    }

    /// Sets `SO_REUSEPORT` so several servers can share the port.
    pub fn reuse_port(mut self, reuse: bool) -> Self {
        self.reuse_port = reuse;
        self
    }

    /// Sets `SO_RCVBUF` on the listener (accepted sockets inherit it).
    pub fn receive_buffer(mut self, bytes: usize) -> Self {
        self.receive_buffer = Some(bytes);
        self
    }

    /// Sets `SO_SNDBUF` on the listener (accepted sockets inherit it); a small one bounds a slow reader.
    pub fn send_buffer(mut self, bytes: usize) -> Self {
        self.send_buffer = Some(bytes);
        self
    }
}

/// What a listener is validated and set up against: the builder's settings, kept by the runtime so that a
/// listener added while the server runs gets the same treatment as one given to the builder.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ListenerDefaults {
    /// The server's limits as configured (unset fields still unset), laid under each listener's.
    pub(crate) base_limits: Limits,
    /// The server's resolved limits (for the global cap).
    pub(crate) global: ResolvedLimits,
    pub(crate) workers: usize,
    pub(crate) connection_options: ConnectionOptions,
}

/// How one listener's connections are admitted and served. The socket itself is owned by its accept
/// thread, so removing the listener closes it at once while its connections keep these settings.
pub(crate) struct ListenerRuntime {
    /// The listener's limits laid over the server's: deadlines, rates, buffers and batch size.
    pub(crate) limits: ResolvedLimits,
    pub(crate) proxy: Option<ProxyMode>,
    pub(crate) trusted: TrustedProxies,
    /// Its cap, per-source caps and open connections.
    pub(crate) counts: Arc<ListenerCounts>,
}
