//! Connection caps checked before any read: global, per listener, and per source prefix within a listener.
//!
//! Each cap is a counter raised with a compare-and-swap, so a burst can never overshoot it. The per-source
//! table is split into 16 shards keyed by a randomly keyed SipHash of the source prefix (a /32 for IPv4, a
//! /64 for IPv6), each a mutex-guarded map sized up front so that admission does not allocate. A
//! [`Reservation`] gives its counts back exactly once, when it is dropped.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const SHARDS: usize = 16;

/// Which cap refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CapRefusal {
    Global,
    Listener,
    Source,
}

/// A fixed-size key for a source prefix: 16 address bytes with the host part cleared, plus the family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct SourceKey {
    bytes: [u8; 16],
    v6: bool,
}

#[derive(Debug)]
struct Counter {
    open: AtomicUsize,
    max: usize,
}

#[derive(Debug)]
struct SourceTable {
    shards: Vec<Mutex<HashMap<SourceKey, usize>>>,
    hasher: RandomState,
    max: usize,
}

/// Every cap of one server.
#[derive(Debug)]
pub(crate) struct Caps {
    global: Counter,
    listeners: Vec<Counter>,
    sources: Vec<SourceTable>,
}

/// Counts held by one admitted connection, released when dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    caps: Arc<Caps>,
    listener: usize,
    source: Option<SourceKey>,
}

impl SourceKey {
    /// The /32 of an IPv4 address or the /64 of an IPv6 one; IPv4-mapped IPv6 counts as IPv4.
    pub(crate) fn of(address: IpAddr) -> Self {
        match address.to_canonical() {
            IpAddr::V4(v4) => {
                let mut bytes = [0u8; 16];
                bytes[..4].copy_from_slice(&v4.octets());
                Self { bytes, v6: false }
            }
            IpAddr::V6(v6) => {
                let mut bytes = v6.octets();
                bytes[8..].fill(0);
                Self { bytes, v6: true }
            }
        }
    }
}

impl Counter {
    fn new(max: usize) -> Self {
        Self {
            open: AtomicUsize::new(0),
            max,
        }
    }

    fn try_acquire(&self) -> bool {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.max).then_some(open + 1)
            })
            .is_ok()
    }

    fn release(&self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl SourceTable {
    fn new(max: usize, expected_sources: usize) -> Self {
        let per_shard = expected_sources.div_ceil(SHARDS).max(4);
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::with_capacity(per_shard)))
                .collect(),
            hasher: RandomState::new(),
            max,
        }
    }

    fn shard(&self, key: &SourceKey) -> &Mutex<HashMap<SourceKey, usize>> {
        let index = (self.hasher.hash_one(key) as usize) % SHARDS;
        &self.shards[index]
    }

    fn try_acquire(&self, key: SourceKey) -> bool {
        let mut shard = self
            .shard(&key)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let count = shard.entry(key).or_insert(0);
        if *count >= self.max {
            return false;
        }
        *count += 1;
        true
    }

    fn release(&self, key: SourceKey) {
        let mut shard = self
            .shard(&key)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(count) = shard.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                // Removing keeps the table bounded by the number of open connections.
                shard.remove(&key);
            }
        }
    }
}

impl Caps {
    /// Caps for `listener_caps.len()` listeners, each entry being (per-listener cap, per-source cap).
    pub(crate) fn new(global: usize, listener_caps: &[(usize, usize)]) -> Self {
        Self {
            global: Counter::new(global),
            listeners: listener_caps
                .iter()
                .map(|&(listener, _)| Counter::new(listener))
                .collect(),
            sources: listener_caps
                .iter()
                .map(|&(listener, source)| SourceTable::new(source, listener))
                .collect(),
        }
    }

    /// Connections open across every listener.
    pub(crate) fn open(&self) -> usize {
        self.global.open.load(Ordering::Acquire)
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
        let key = SourceKey::of(source);
        if !self.sources[listener].try_acquire(key) {
            self.listeners[listener].release();
            self.global.release();
            return Err(CapRefusal::Source);
        }
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
        let key = SourceKey::of(real_source);
        if self.source == Some(key) {
            return Ok(());
        }
        let table = &self.caps.sources[self.listener];
        if !table.try_acquire(key) {
            return Err(CapRefusal::Source);
        }
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

    #[test]
    fn each_cap_refuses_at_its_limit_and_a_dropped_reservation_frees_its_counts() {
        let caps = Arc::new(Caps::new(3, &[(2, 1), (3, 3)]));
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
    fn ipv4_mapped_ipv6_and_the_same_ipv6_64_share_a_source_key() {
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let plain: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(SourceKey::of(mapped), SourceKey::of(plain));
        let one: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let two: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(SourceKey::of(one), SourceKey::of(two));
        assert_ne!(SourceKey::of(one), SourceKey::of(other));
    }
}
