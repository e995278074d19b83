//! [`HealthBoard`]: the live endpoint health the data path publishes and `GET .../all` reads.
//!
//! The fullproxy keeps one [`EndpointLoad`] per endpoint (its `healthy` flag is driven by the
//! probes and the circuit breaker). It publishes each rule's loads here, by service id, when it
//! (re)builds the rule's pool, and withdraws them when the rule goes; the API reports
//! `state: active|inactive` from the flags. Reads are a wait-free `ArcSwap` load.

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::api::EndpointHealth;
use crate::routing::{EndpointLoad, EpIdx};
use crate::rules::StoredRule;

/// Endpoint loads by service id (`StoredRule::id`), in `ep_idx` order.
#[derive(Default)]
pub struct HealthBoard {
    current: ArcSwap<HashMap<u32, Vec<Arc<EndpointLoad>>>>,
    write: Mutex<()>,
}

impl HealthBoard {
    /// An empty board (every endpoint reported active until published).
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Publishes the loads of service `id` (index = `ep_idx`), replacing earlier ones.
    pub fn publish(&self, id: u32, loads: Vec<Arc<EndpointLoad>>) {
        let _w = self.write.lock();
        let mut next = HashMap::clone(&self.current.load());
        next.insert(id, loads);
        self.current.store(Arc::new(next));
    }

    /// Replaces the whole board (the proxy publishes every pool after each reconcile, so a
    /// deleted rule disappears with it).
    pub fn replace_all(&self, loads: HashMap<u32, Vec<Arc<EndpointLoad>>>) {
        let _w = self.write.lock();
        self.current.store(Arc::new(loads));
    }

    /// The current loads by service id (a wait-free load; metrics read it at scrape time).
    pub fn snapshot(&self) -> Arc<HashMap<u32, Vec<Arc<EndpointLoad>>>> {
        self.current.load_full()
    }

    /// Withdraws service `id` (its rule was deleted).
    pub fn withdraw(&self, id: u32) {
        let _w = self.write.lock();
        let mut next = HashMap::clone(&self.current.load());
        if next.remove(&id).is_some() {
            self.current.store(Arc::new(next));
        }
    }
}

impl EndpointHealth for HealthBoard {
    fn healthy(&self, rule: &StoredRule, ep: EpIdx) -> Option<bool> {
        self.current
            .load()
            .get(&rule.id)?
            .get(ep)
            .map(|l| l.is_healthy())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    fn stored(id: u32) -> StoredRule {
        let rule = serde_json::from_value(serde_json::json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80},
            "endpoints": [{"endpointIP": "10.0.1.1"}, {"endpointIP": "10.0.1.2"}]
        }))
        .expect("rule");
        StoredRule { id, rule }
    }

    #[test]
    fn published_flags_are_reported_live_and_withdrawn_rules_are_unknown() {
        let board = HealthBoard::new();
        let loads = vec![EndpointLoad::new(), EndpointLoad::new()];
        board.publish(7, loads.clone());
        assert_eq!(board.healthy(&stored(7), 1), Some(true));
        loads[1].healthy.store(false, Ordering::Relaxed);
        assert_eq!(
            board.healthy(&stored(7), 1),
            Some(false),
            "live, not a copy"
        );
        assert_eq!(board.healthy(&stored(7), 5), None, "unknown index");
        assert_eq!(board.healthy(&stored(8), 0), None, "unknown service");
        board.withdraw(7);
        assert_eq!(board.healthy(&stored(7), 0), None);
    }

    #[test]
    fn list_reports_inactive_from_the_board() {
        let board = HealthBoard::new();
        let loads = vec![EndpointLoad::new(), EndpointLoad::new()];
        loads[0].healthy.store(false, Ordering::Relaxed);
        board.publish(1, loads);
        let rule = crate::api::rules::with_states(&stored(1), board.as_ref());
        let states: Vec<_> = rule.endpoints.iter().map(|e| e.state.clone()).collect();
        assert_eq!(
            states,
            vec![Some("inactive".to_string()), Some("active".to_string())]
        );
    }
}
