//! Test fixture: a rule with N endpoints, their loads and selector state.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::state::SelectorState;
use super::{Candidates, EndpointLoad, Excluded};
use crate::rules::{Endpoint, ServiceArgs};

/// Endpoints `127.0.0.1:9000+i` with the given weights.
#[allow(dead_code, reason = "fields used by some selector tests only")]
pub struct Fixture {
    pub args: ServiceArgs,
    pub eps: Vec<Endpoint>,
    pub weights: Vec<u32>,
    pub loads: Vec<Arc<EndpointLoad>>,
    pub excluded: Excluded,
    pub state: Arc<SelectorState>,
}

/// Service arguments parsed from JSON (the rule model has no `Default`).
pub fn args(extra: serde_json::Value) -> ServiceArgs {
    let mut v = serde_json::json!({"externalIP": "10.0.0.1", "port": 8080, "mode": 4});
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    serde_json::from_value(v).expect("valid service args")
}

/// Endpoint `127.0.0.1:port` with `weight`.
pub fn endpoint(port: u16, weight: u32) -> Endpoint {
    serde_json::from_value(serde_json::json!({
        "endpointIP": "127.0.0.1", "targetPort": port, "weight": weight
    }))
    .expect("valid endpoint")
}

impl Fixture {
    pub fn new(weights: &[u32]) -> Self {
        Self::with_args(args(serde_json::json!({})), weights)
    }

    pub fn with_args(args: ServiceArgs, weights: &[u32]) -> Self {
        let eps: Vec<Endpoint> = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| endpoint(9000 + i as u16, w))
            .collect();
        let state = SelectorState::new(&args, &eps);
        Self {
            args,
            eps,
            weights: weights.to_vec(),
            loads: weights.iter().map(|_| EndpointLoad::new()).collect(),
            excluded: Excluded::default(),
            state,
        }
    }

    pub fn cands(&self) -> Candidates<'_> {
        Candidates {
            weights: &self.weights,
            loads: &self.loads,
            excluded: &self.excluded,
        }
    }

    pub fn set_healthy(&self, ep: usize, up: bool) {
        self.loads[ep].healthy.store(up, Ordering::Relaxed);
    }

    pub fn set_in_flight(&self, ep: usize, n: u64) {
        self.loads[ep].in_flight.store(n, Ordering::Relaxed);
    }
}
