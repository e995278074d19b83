//! Tier 0: the session pin table of one P/D rule. A conversation (the request's
//! [`pin_key`](crate::request::RequestMeta::pin_key)) is pinned to the (prefill, decode) pair
//! that served it for `pd_session_ttl_sec` (0 → 300 s), refreshed on every use.
//!
//! The table is bounded: at [`PIN_CAPACITY`] entries the least recently used pin is evicted
//! (O(log n): a `BTreeMap` from use stamp to key beside the `HashMap`), and expired pins are
//! dropped when looked up; keys are stored as their 128-bit xxh3 hash, so a long `user` field
//! costs 16 bytes, not its length, and no client can grow the table without bound. Time is tokio's clock, so
//! tests run it with paused time.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use xxhash_rust::xxh3::xxh3_128;

use crate::routing::EpIdx;

/// Most pins one rule keeps (least recently used evicted first).
pub const PIN_CAPACITY: usize = 65_536;

/// A pinned (prefill, decode) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    /// The prefill endpoint.
    pub prefill: EpIdx,
    /// The decode endpoint.
    pub decode: EpIdx,
}

#[derive(Debug)]
struct Entry {
    pin: Pin,
    expires: Instant,
    stamp: u64,
}

#[derive(Debug, Default)]
struct Inner {
    by_key: HashMap<u128, Entry>,
    by_use: BTreeMap<u64, u128>,
    next_stamp: u64,
}

/// The pins of one rule: bounded LRU with a TTL.
#[derive(Debug)]
pub struct PinTable {
    ttl: Duration,
    capacity: usize,
    inner: Mutex<Inner>,
}

impl PinTable {
    /// A table whose pins live `ttl` after their last use, holding at most `capacity`.
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            ttl,
            capacity: capacity.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The live pin of `key` (an expired one is removed and `None` returned). A hit is not a
    /// use: [`PinTable::pin`] refreshes it once the request was served.
    pub fn get(&self, key: &str) -> Option<Pin> {
        let key = xxh3_128(key.as_bytes());
        let mut g = self.inner.lock();
        let (pin, expires, stamp) = {
            let e = g.by_key.get(&key)?;
            (e.pin, e.expires, e.stamp)
        };
        if expires <= Instant::now() {
            g.by_key.remove(&key);
            g.by_use.remove(&stamp);
            return None;
        }
        Some(pin)
    }

    /// Pins `key` to `pin` for the TTL from now (a new pin or a refresh), evicting the least
    /// recently used pin when the table is full.
    pub fn pin(&self, key: &str, pin: Pin) {
        let key = xxh3_128(key.as_bytes());
        let mut g = self.inner.lock();
        let stamp = g.next_stamp;
        g.next_stamp += 1;
        let expires = Instant::now() + self.ttl;
        if let Some(e) = g.by_key.get_mut(&key) {
            let old = e.stamp;
            *e = Entry {
                pin,
                expires,
                stamp,
            };
            g.by_use.remove(&old);
            g.by_use.insert(stamp, key);
            return;
        }
        while g.by_key.len() >= self.capacity {
            let Some((_, oldest)) = g.by_use.pop_first() else {
                break;
            };
            g.by_key.remove(&oldest);
        }
        g.by_key.insert(
            key,
            Entry {
                pin,
                expires,
                stamp,
            },
        );
        g.by_use.insert(stamp, key);
    }

    /// Number of pins held (expired ones not yet looked up included).
    pub fn len(&self) -> usize {
        self.inner.lock().by_key.len()
    }

    /// True when no pin is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Pin = Pin {
        prefill: 0,
        decode: 1,
    };
    const B: Pin = Pin {
        prefill: 2,
        decode: 3,
    };

    #[tokio::test(start_paused = true)]
    async fn pins_expire_after_the_ttl_from_their_last_use() {
        let t = PinTable::new(Duration::from_secs(10), 8);
        t.pin("c1", A);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(t.get("c1"), Some(A));
        t.pin("c1", A);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(t.get("c1"), Some(A), "the refresh restarted the TTL");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(t.get("c1"), None);
        assert!(t.is_empty(), "an expired pin is dropped when looked up");
    }

    #[tokio::test(start_paused = true)]
    async fn the_least_recently_used_pin_is_evicted_at_capacity() {
        let t = PinTable::new(Duration::from_secs(60), 2);
        t.pin("a", A);
        t.pin("b", B);
        t.pin("a", B); // "a" is now the most recent
        t.pin("c", A);
        assert_eq!(t.len(), 2);
        assert_eq!(t.get("b"), None, "b was least recently used");
        assert_eq!(t.get("a"), Some(B));
        assert_eq!(t.get("c"), Some(A));
    }
}
