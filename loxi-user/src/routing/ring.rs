//! A consistent-hash ring of virtual nodes, shared by CHWBL (sel 8) and wrr-hash (sel 10).
//!
//! Points are `xxh3(endpoint id, replica)` sorted ascending; a key's owner is the first point at
//! or after the key, wrapping to the start. Rings are built when the endpoint set changes (off
//! the request path) and read lock-free through `arc-swap` by [`super::state::SelectorState`].

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::EpIdx;

/// An immutable ring.
#[derive(Debug, Clone, Default)]
pub struct Ring {
    points: Vec<(u64, EpIdx)>,
}

impl Ring {
    /// Builds a ring with `vnodes[i]` points for the endpoint with identity `ids[i]`.
    pub fn build(ids: &[u64], vnodes: &[u32]) -> Self {
        let mut points = Vec::with_capacity(vnodes.iter().map(|&v| v as usize).sum());
        for (ep, (&id, &n)) in ids.iter().zip(vnodes).enumerate() {
            for r in 0..n {
                points.push((xxh3_64_with_seed(&r.to_le_bytes(), id), ep));
            }
        }
        points.sort_unstable();
        Self { points }
    }

    /// Number of virtual nodes.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// True for a ring without points.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// Endpoints in ring order starting at `key`'s owner, wrapping once round the ring; an
    /// endpoint appears once per virtual node.
    pub fn walk(&self, key: u64) -> impl Iterator<Item = EpIdx> + '_ {
        let start = self.points.partition_point(|&(h, _)| h < key);
        let n = self.points.len();
        (0..n).map(move |i| self.points[(start + i) % n].1)
    }

    /// The owner of `key` (first point at or after it), ignoring health.
    pub fn owner(&self, key: u64) -> Option<EpIdx> {
        self.walk(key).next()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(n: usize) -> Vec<u64> {
        (0..n)
            .map(|i| super::super::key::endpoint_id("127.0.0.1", 9000 + i as u16))
            .collect()
    }

    proptest! {
        #[test]
        fn ring_has_exactly_the_requested_points(n in 1usize..12, v in 1u32..64) {
            let ring = Ring::build(&ids(n), &vec![v; n]);
            prop_assert_eq!(ring.len(), n * v as usize);
        }

        #[test]
        fn walk_visits_every_point_once_and_starts_at_owner(n in 1usize..8, v in 1u32..32, key: u64) {
            let ring = Ring::build(&ids(n), &vec![v; n]);
            let walk: Vec<_> = ring.walk(key).collect();
            prop_assert_eq!(walk.len(), ring.len());
            for ep in 0..n {
                prop_assert_eq!(walk.iter().filter(|&&e| e == ep).count(), v as usize);
            }
            prop_assert_eq!(Some(walk[0]), ring.owner(key));
        }

        #[test]
        fn key_above_every_point_wraps_to_the_first(n in 1usize..8) {
            let ring = Ring::build(&ids(n), &vec![4; n]);
            let last = ring.points[ring.len() - 1].0;
            prop_assume!(last < u64::MAX);
            prop_assert_eq!(ring.owner(last + 1), Some(ring.points[0].1));
            prop_assert_eq!(ring.owner(0), Some(ring.points[0].1));
        }

        #[test]
        fn adding_an_endpoint_only_moves_keys_to_it(n in 2usize..8, keys in proptest::collection::vec(any::<u64>(), 50)) {
            let before = Ring::build(&ids(n), &vec![32; n]);
            let after = Ring::build(&ids(n + 1), &vec![32; n + 1]);
            for k in keys {
                let (a, b) = (before.owner(k), after.owner(k));
                prop_assert!(a == b || b == Some(n), "key moved between old endpoints");
            }
        }
    }
}
