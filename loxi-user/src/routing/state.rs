//! Per-rule selector state: the round-robin cursor, the smooth-WRR current weights and the
//! endpoint topology (identities and rings), rebuilt when the endpoint set changes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use super::key::endpoint_id;
use super::ring::Ring;
use crate::rules::{Endpoint, ServiceArgs};

/// Endpoint identities and the rings built from them. Immutable; swapped whole.
#[derive(Debug, Default)]
pub struct Topology {
    /// `endpoint_id(ip, port)` per `EpIdx`.
    pub ids: Vec<u64>,
    /// CHWBL ring: `chwbl_replication` points per endpoint.
    pub ring: Ring,
    /// wrr-hash ring: points proportional to weight (see [`weighted_vnodes`]).
    pub weighted_ring: Ring,
}

impl Topology {
    /// Builds identities and both rings for `eps` under `args`.
    pub fn build(args: &ServiceArgs, eps: &[Endpoint]) -> Self {
        let ids: Vec<u64> = eps
            .iter()
            .map(|e| endpoint_id(&e.endpoint_ip, target_port(args, e)))
            .collect();
        let rep = args.chwbl_replication.clamp(1, 1024);
        let ring = Ring::build(&ids, &vec![rep; ids.len()]);
        let weights: Vec<u32> = eps.iter().map(|e| e.weight).collect();
        let weighted_ring = Ring::build(&ids, &weighted_vnodes(&weights, rep));
        Self {
            ids,
            ring,
            weighted_ring,
        }
    }
}

/// The backend port of `e`: `targetPort`, or the service port when it is 0.
pub fn target_port(args: &ServiceArgs, e: &Endpoint) -> u16 {
    if e.target_port == 0 {
        args.port
    } else {
        e.target_port
    }
}

/// Virtual nodes per endpoint for wrr-hash: `replication × n × w_i / Σw`, at least 1, so the
/// ring keeps `replication` points per endpoint on average and shares follow the weights.
pub fn weighted_vnodes(weights: &[u32], replication: u32) -> Vec<u32> {
    let sum: u64 = weights.iter().map(|&w| u64::from(w.max(1))).sum();
    let total = u64::from(replication) * weights.len() as u64;
    weights
        .iter()
        .map(|&w| ((total * u64::from(w.max(1))).div_ceil(sum.max(1))).max(1) as u32)
        .collect()
}

/// Mutable selection state of one rule. Shared by every request of the rule (`Arc`).
#[derive(Debug)]
pub struct SelectorState {
    /// Round-robin cursor (also drives fallback keys).
    pub rr: AtomicUsize,
    /// Smooth-WRR current weights by `EpIdx`.
    pub wrr: Mutex<Vec<i64>>,
    /// Identities and rings (a changed rule gets a [`SelectorState::successor`]).
    pub topology: ArcSwap<Topology>,
}

impl SelectorState {
    /// State for a rule's endpoint list.
    pub fn new(args: &ServiceArgs, eps: &[Endpoint]) -> Arc<Self> {
        Arc::new(Self {
            rr: AtomicUsize::new(0),
            wrr: Mutex::new(vec![0; eps.len()]),
            topology: ArcSwap::from_pointee(Topology::build(args, eps)),
        })
    }

    /// The state of a changed rule: a new topology for its endpoint list and fresh WRR
    /// weights, continuing this state's round-robin cursor. `self` is left untouched (the old
    /// pool keeps serving its in-flight requests with it).
    pub fn successor(&self, args: &ServiceArgs, eps: &[Endpoint]) -> Arc<Self> {
        let next = Self::new(args, eps);
        next.rr
            .store(self.rr.load(Ordering::Relaxed), Ordering::Relaxed);
        next
    }

    /// The next round-robin ticket.
    pub fn next_ticket(&self) -> usize {
        self.rr.fetch_add(1, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_vnodes_follow_weights() {
        assert_eq!(weighted_vnodes(&[4, 2, 1], 7), vec![12, 6, 3]);
        assert_eq!(weighted_vnodes(&[1, 1], 256), vec![256, 256]);
    }
}
