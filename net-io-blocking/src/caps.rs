//! The server's caps checked before any read: one global [`Cap`], one per listener, and per-source caps per
//! listener, held by a [`Reservation`] that gives its counts back exactly once, when it is dropped.
//!
//! The counters themselves are `net-io-core`'s ([`Cap`]: a compare-and-swap counter that never overshoots;
//! [`SourceCaps`]: 16 keyed-SipHash shards sized up front). This module ties them together per connection.

use std::net::IpAddr;
use std::sync::Arc;

use net_io_core::{Cap, PrefixKey, PrefixPolicy, SourceCaps};

/// Which cap refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CapRefusal {
    Global,
    Listener,
    Source,
}

/// One listener's caps: (per-listener cap, per-source cap, source key policy).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ListenerCaps {
    pub(crate) max_per_listener: usize,
    pub(crate) max_per_source: usize,
    pub(crate) policy: PrefixPolicy,
}

/// Every cap of one server.
#[derive(Debug)]
pub(crate) struct Caps {
    global: Cap,
    listeners: Vec<Cap>,
    sources: Vec<SourceCaps>,
}

/// Counts held by one admitted connection, released when dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    caps: Arc<Caps>,
    listener: usize,
    source: Option<PrefixKey>,
}

impl Caps {
    pub(crate) fn new(global: usize, listeners: &[ListenerCaps]) -> Self {
        Self {
            global: Cap::new(global),
            listeners: listeners
                .iter()
                .map(|caps| Cap::new(caps.max_per_listener))
                .collect(),
            sources: listeners
                .iter()
                .map(|caps| {
                    SourceCaps::new(caps.max_per_source, caps.policy, caps.max_per_listener)
                })
                .collect(),
        }
    }

    /// Connections open across every listener.
    pub(crate) fn open(&self) -> usize {
        self.global.open()
    }

    /// Takes one count from each cap for a connection from `source` on `listener`, or names the cap that is full.
    pub(crate) fn reserve(
        self: &Arc<Self>,
        listener: usize,
        source: IpAddr,
    ) -> Result<Reservation, CapRefusal> {
        if !self.global.try_acquire() {
            return Err(CapRefusal::Global);
        }
        if !self.listeners[listener].try_acquire() {
            self.global.release();
            return Err(CapRefusal::Listener);
        }
        let Some(key) = self.sources[listener].try_acquire(source.to_canonical()) else {
            self.listeners[listener].release();
            self.global.release();
            return Err(CapRefusal::Source);
        };
        Ok(Reservation {
            caps: Arc::clone(self),
            listener,
            source: Some(key),
        })
    }
}

impl Reservation {
    /// Moves the per-source count to `real_source` (after a PROXY header named the real client).
    pub(crate) fn move_source(&mut self, real_source: IpAddr) -> Result<(), CapRefusal> {
        let table = &self.caps.sources[self.listener];
        let real_source = real_source.to_canonical();
        if self.source == Some(table.policy().key(real_source)) {
            return Ok(());
        }
        let Some(key) = table.try_acquire(real_source) else {
            return Err(CapRefusal::Source);
        };
        if let Some(old) = self.source.replace(key) {
            table.release(old);
        }
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(key) = self.source.take() {
            self.caps.sources[self.listener].release(key);
        }
        self.caps.listeners[self.listener].release();
        self.caps.global.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener(max_per_listener: usize, max_per_source: usize) -> ListenerCaps {
        ListenerCaps {
            max_per_listener,
            max_per_source,
            policy: PrefixPolicy::default(),
        }
    }

    #[test]
    fn each_cap_refuses_at_its_limit_and_a_dropped_reservation_frees_its_counts() {
        let caps = Arc::new(Caps::new(3, &[listener(2, 1), listener(3, 3)]));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = caps.reserve(0, a).expect("first connection");
        assert_eq!(caps.reserve(0, a).unwrap_err(), CapRefusal::Source);
        let second = caps.reserve(0, b).expect("second source");
        assert_eq!(
            caps.reserve(0, "10.0.0.3".parse().unwrap()).unwrap_err(),
            CapRefusal::Listener
        );
        let third = caps
            .reserve(1, a)
            .expect("per-source caps are per listener");
        assert_eq!(caps.reserve(1, b).unwrap_err(), CapRefusal::Global);
        assert_eq!(caps.open(), 3);
        drop((first, second, third));
        assert_eq!(caps.open(), 0, "every count should be given back");
        caps.reserve(0, a)
            .expect("a freed source slot should be reusable");
    }

    #[test]
    fn an_ipv4_mapped_peer_counts_against_the_same_source_as_plain_ipv4() {
        let caps = Arc::new(Caps::new(4, &[listener(4, 1)]));
        let _held = caps.reserve(0, "10.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(
            caps.reserve(0, "::ffff:10.0.0.1".parse().unwrap())
                .unwrap_err(),
            CapRefusal::Source,
            "the mapped address escaped the per-source cap"
        );
    }

    #[test]
    fn moving_a_reservation_to_the_real_client_respects_the_real_clients_cap() {
        let caps = Arc::new(Caps::new(4, &[listener(4, 1)]));
        let proxy: IpAddr = "10.0.0.1".parse().unwrap();
        let client: IpAddr = "192.0.2.9".parse().unwrap();
        let _other = caps.reserve(0, client).unwrap();
        let mut reservation = caps.reserve(0, proxy).unwrap();
        assert_eq!(reservation.move_source(client), Err(CapRefusal::Source));
        let fresh: IpAddr = "192.0.2.10".parse().unwrap();
        reservation.move_source(fresh).unwrap();
        caps.reserve(0, proxy)
            .expect("the proxy's slot should be free after the move");
    }
}
