//! Connection caps checked before any read: a counting [`Cap`] (global, per listener) and [`SourceCaps`] per source prefix.
//!
//! The global and per-listener caps are one atomic counter each, taken with a compare-and-swap so that the
//! count never passes the cap even for a moment. The per-source cap keys connections by [`PrefixKey`] in
//! 16 shards of mutex-guarded maps. The maps hash with std's `RandomState`, a SipHash keyed at random per
//! process, so a peer cannot choose addresses that collide (threat T-22), and they are sized up front so
//! that taking a slot does not allocate in steady state.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::addr::{PrefixKey, PrefixPolicy};

const SHARDS: usize = 16;

/// A counter with a ceiling: at most `max` holders at once.
#[derive(Debug)]
pub struct Cap {
    open: AtomicUsize,
    max: usize,
}

/// Per-source-prefix counters with one ceiling, for one listener.
#[derive(Debug)]
pub struct SourceCaps {
    shards: [Mutex<HashMap<PrefixKey, u32>>; SHARDS],
    hasher: RandomState,
    max: u32,
    policy: PrefixPolicy,
}

impl Cap {
    /// A cap of `max` holders.
    pub fn new(max: usize) -> Cap {
        Cap {
            open: AtomicUsize::new(0),
            max,
        }
    }

    /// Takes a slot; false when the cap is reached.
    pub fn try_acquire(&self) -> bool {
        // Relaxed: the counter guards nothing but itself; the CAS makes the ceiling exact.
        self.open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |open| {
                (open < self.max).then_some(open + 1)
            })
            .is_ok()
    }

    /// Gives a slot back. Extra releases are ignored rather than wrapping the counter.
    pub fn release(&self) {
        let _ = self
            .open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |open| {
                open.checked_sub(1)
            });
    }

    /// Slots held now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// The ceiling.
    pub fn max(&self) -> usize {
        self.max
    }
}

impl SourceCaps {
    /// Caps of `max_per_source` per prefix under `policy`, sized for `expected` concurrent sources.
    pub fn new(max_per_source: usize, policy: PrefixPolicy, expected: usize) -> SourceCaps {
        let per_shard = expected.div_ceil(SHARDS).max(1);
        SourceCaps {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::with_capacity(per_shard))),
            hasher: RandomState::new(),
            max: u32::try_from(max_per_source).unwrap_or(u32::MAX),
            policy,
        }
    }

    /// Takes a slot for the source `address`; returns its key (to release later), or `None` at the cap.
    pub fn try_acquire(&self, address: IpAddr) -> Option<PrefixKey> {
        let key = self.policy.key(address);
        let mut shard = self.shard(&key);
        let count = shard.entry(key).or_insert(0);
        if *count >= self.max {
            if *count == 0 {
                shard.remove(&key);
            }
            return None;
        }
        *count += 1;
        Some(key)
    }

    /// Gives back a slot taken with [`SourceCaps::try_acquire`] (or moves it, after a PROXY header,
    /// by releasing the proxy's key and acquiring the client's).
    pub fn release(&self, key: PrefixKey) {
        let mut shard = self.shard(&key);
        if let Some(count) = shard.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                shard.remove(&key);
            }
        }
    }

    /// Connections open from the prefix of `address`.
    pub fn count(&self, address: IpAddr) -> u32 {
        let key = self.policy.key(address);
        self.shard(&key).get(&key).copied().unwrap_or(0)
    }

    /// The key policy.
    pub fn policy(&self) -> PrefixPolicy {
        self.policy
    }

    fn shard(&self, key: &PrefixKey) -> std::sync::MutexGuard<'_, HashMap<PrefixKey, u32>> {
        let index = (self.hasher.hash_one(key) as usize) % SHARDS;
        self.shards[index]
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn racing_threads_never_pass_the_cap() {
        let cap = Arc::new(Cap::new(10));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let cap = Arc::clone(&cap);
                std::thread::spawn(move || (0..1000).filter(|_| cap.try_acquire()).count())
            })
            .collect();
        let taken: usize = threads
            .into_iter()
            .map(|thread| thread.join().unwrap())
            .sum();
        assert_eq!(taken, 10, "exactly the cap may be taken");
        assert_eq!(cap.open(), 10);
        cap.release();
        assert!(cap.try_acquire(), "a released slot must be free again");
    }

    #[test]
    fn a_source_prefix_is_capped_and_others_are_not() {
        let caps = SourceCaps::new(2, PrefixPolicy::DEFAULT, 64);
        let first: IpAddr = "2001:db8::1".parse().unwrap();
        let same_subnet: IpAddr = "2001:db8::2".parse().unwrap();
        let other: IpAddr = "2001:db8:0:1::1".parse().unwrap();
        let a = caps.try_acquire(first).unwrap();
        let _b = caps.try_acquire(same_subnet).unwrap();
        assert_eq!(
            caps.try_acquire(first),
            None,
            "a third connection from one /64 passed"
        );
        assert!(caps.try_acquire(other).is_some());
        caps.release(a);
        assert_eq!(caps.count(first), 1);
        assert!(caps.try_acquire(first).is_some());
    }
}
