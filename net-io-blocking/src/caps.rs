//! The server's caps checked before any read: one global [`Cap`], and per listener a cap and per-source caps
//! ([`ListenerCounts`]), held by a [`Reservation`] that gives its counts back exactly once, when it is dropped.
//!
//! The counters themselves are `net-io-core`'s ([`Cap`]: a compare-and-swap counter that never overshoots;
//! [`SourceCaps`]: 16 keyed-SipHash shards sized up front). This module ties them together per connection.
//! A listener's counts live as long as the last connection it admitted, so a listener removed at run time
//! can still be drained: [`ListenerCounts::members`] names the connections it still has open.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

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

/// The server-wide cap.
#[derive(Debug)]
pub(crate) struct Caps {
    global: Cap,
}

/// One listener's counters and the ids of the connections it has open.
#[derive(Debug)]
pub(crate) struct ListenerCounts {
    cap: Cap,
    sources: SourceCaps,
    /// Ids of the admitted connections not yet closed. Locked once at admission and once at close (the set
    /// keeps its capacity, so a steady server does not allocate here); read only to drain this listener.
    members: Mutex<HashSet<u64>>,
}

/// Counts held by one admitted connection, released when dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    caps: Arc<Caps>,
    listener: Arc<ListenerCounts>,
    source: Option<PrefixKey>,
    /// The connection's id once [`Reservation::enroll`] named it, 0 before.
    id: u64,
}

impl Caps {
    pub(crate) fn new(global: usize) -> Self {
        Self {
            global: Cap::new(global),
        }
    }

    /// Connections open across every listener.
    pub(crate) fn open(&self) -> usize {
        self.global.open()
    }

    /// Takes one count from each cap for a connection from `source` on `listener`, or names the cap that is full.
    pub(crate) fn reserve(
        self: &Arc<Self>,
        listener: &Arc<ListenerCounts>,
        source: IpAddr,
    ) -> Result<Reservation, CapRefusal> {
        if !self.global.try_acquire() {
            return Err(CapRefusal::Global);
        }
        if !listener.cap.try_acquire() {
            self.global.release();
            return Err(CapRefusal::Listener);
        }
        let Some(key) = listener.sources.try_acquire(source.to_canonical()) else {
            listener.cap.release();
            self.global.release();
            return Err(CapRefusal::Source);
        };
        Ok(Reservation {
            caps: Arc::clone(self),
            listener: Arc::clone(listener),
            source: Some(key),
            id: 0,
        })
    }
}

impl ListenerCounts {
    pub(crate) fn new(caps: ListenerCaps) -> Self {
        Self {
            cap: Cap::new(caps.max_per_listener),
            sources: SourceCaps::new(caps.max_per_source, caps.policy, caps.max_per_listener),
            members: Mutex::new(HashSet::new()),
        }
    }

    /// Connections of this listener admitted and not yet closed.
    pub(crate) fn open(&self) -> usize {
        self.cap.open()
    }

    /// The ids of this listener's open connections, sorted (for a binary search per slot while draining).
    pub(crate) fn members(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.lock_members().iter().copied().collect();
        ids.sort_unstable();
        ids
    }

    fn lock_members(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.members
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Reservation {
    /// Records that this reservation belongs to connection `id`, so draining its listener can find it.
    pub(crate) fn enroll(&mut self, id: u64) {
        if self.id == 0 && id != 0 {
            self.id = id;
            self.listener.lock_members().insert(id);
        }
    }

    /// Moves the per-source count to `real_source` (after a PROXY header named the real client).
    pub(crate) fn move_source(&mut self, real_source: IpAddr) -> Result<(), CapRefusal> {
        let table = &self.listener.sources;
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
        if self.id != 0 {
            self.listener.lock_members().remove(&self.id);
        }
        if let Some(key) = self.source.take() {
            self.listener.sources.release(key);
        }
        self.listener.cap.release();
        self.caps.global.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener(max_per_listener: usize, max_per_source: usize) -> Arc<ListenerCounts> {
        Arc::new(ListenerCounts::new(ListenerCaps {
            max_per_listener,
            max_per_source,
            policy: PrefixPolicy::default(),
        }))
    }

    #[test]
    fn each_cap_refuses_at_its_limit_and_a_dropped_reservation_frees_its_counts() {
        let caps = Arc::new(Caps::new(3));
        let (zero, one) = (listener(2, 1), listener(3, 3));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = caps.reserve(&zero, a).expect("first connection");
        assert_eq!(caps.reserve(&zero, a).unwrap_err(), CapRefusal::Source);
        let second = caps.reserve(&zero, b).expect("second source");
        assert_eq!(
            caps.reserve(&zero, "10.0.0.3".parse().unwrap())
                .unwrap_err(),
            CapRefusal::Listener
        );
        let third = caps
            .reserve(&one, a)
            .expect("per-source caps are per listener");
        assert_eq!(caps.reserve(&one, b).unwrap_err(), CapRefusal::Global);
        assert_eq!(caps.open(), 3);
        drop((first, second, third));
        assert_eq!(caps.open(), 0, "every count should be given back");
        caps.reserve(&zero, a)
            .expect("a freed source slot should be reusable");
    }

    #[test]
    fn an_enrolled_connection_is_a_member_of_its_listener_until_its_reservation_drops() {
        let caps = Arc::new(Caps::new(4));
        let (zero, one) = (listener(4, 4), listener(4, 4));
        let address: IpAddr = "10.0.0.1".parse().unwrap();
        let mut first = caps.reserve(&zero, address).unwrap();
        first.enroll(7);
        let mut second = caps.reserve(&one, address).unwrap();
        second.enroll(9);
        assert_eq!(
            zero.members(),
            vec![7],
            "listener 0 should hold only connection 7"
        );
        assert_eq!(
            one.members(),
            vec![9],
            "listener 1 should hold only connection 9"
        );
        drop(first);
        assert!(
            zero.members().is_empty(),
            "a closed connection stayed a member"
        );
        assert_eq!(zero.open(), 0, "the listener's count was not given back");
        assert_eq!(
            caps.open(),
            1,
            "only the other listener's connection should be open"
        );
    }

    #[test]
    fn an_ipv4_mapped_peer_counts_against_the_same_source_as_plain_ipv4() {
        let caps = Arc::new(Caps::new(4));
        let zero = listener(4, 1);
        let _held = caps.reserve(&zero, "10.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(
            caps.reserve(&zero, "::ffff:10.0.0.1".parse().unwrap())
                .unwrap_err(),
            CapRefusal::Source,
            "the mapped address escaped the per-source cap"
        );
    }

    #[test]
    fn moving_a_reservation_to_the_real_client_respects_the_real_clients_cap() {
        let caps = Arc::new(Caps::new(4));
        let zero = listener(4, 1);
        let proxy: IpAddr = "10.0.0.1".parse().unwrap();
        let client: IpAddr = "192.0.2.9".parse().unwrap();
        let _other = caps.reserve(&zero, client).unwrap();
        let mut reservation = caps.reserve(&zero, proxy).unwrap();
        assert_eq!(reservation.move_source(client), Err(CapRefusal::Source));
        let fresh: IpAddr = "192.0.2.10".parse().unwrap();
        reservation.move_source(fresh).unwrap();
        caps.reserve(&zero, proxy)
            .expect("the proxy's slot should be free after the move");
    }
}
