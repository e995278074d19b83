//! Endpoint health for the fullproxy: a passive circuit breaker fed by every response
//! ([`breaker`]) and active probes from the rule's `probetype` ([`probe`]).
//!
//! Both write one [`HealthCell`] per endpoint; the endpoint is eligible for selection
//! (`EndpointLoad::healthy`) only while its probe is up *and* its breaker is closed. Cells are
//! carried across rule updates for unchanged endpoints, like the load counters.

pub mod board;
pub mod breaker;
pub mod engine;
pub mod metrics;
pub mod probe;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::routing::EndpointLoad;

/// Health inputs of one endpoint.
#[derive(Debug, Default)]
pub struct HealthCell {
    /// Consecutive failures (origin 5xx or connect failures) seen by the breaker.
    pub streak: AtomicU32,
    /// The breaker is open (endpoint held down until the cool-down ends).
    pub breaker_open: AtomicBool,
    /// The active probe has declared the endpoint down.
    pub probe_down: AtomicBool,
    /// Consecutive probe failures.
    pub probe_failures: AtomicU32,
}

impl HealthCell {
    /// A healthy cell.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Is the endpoint up as far as both inputs go?
    pub fn is_up(&self) -> bool {
        !self.breaker_open.load(Ordering::Relaxed) && !self.probe_down.load(Ordering::Relaxed)
    }

    /// Publishes the combined state into the endpoint's load record (what selectors read).
    pub fn publish(&self, load: &EndpointLoad) {
        load.healthy.store(self.is_up(), Ordering::Relaxed);
    }
}
